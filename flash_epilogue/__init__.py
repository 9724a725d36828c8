"""flash_epilogue: FlashAttention-3's backward dK/dV epilogue for Hopper (sm_90) as PyTorch ops.

    import flash_epilogue
    flash_epilogue.store(dk_fp32, dv_fp32, dk_bf16, dv_bf16)    # or torch.ops.flash_epilogue.store
    flash_epilogue.store_zero(dk_bf16, dv_bf16, batch_idx=[1])   # zero the valid rows of sequence 1

The C++ collectives are a header library: see `get_include()`.
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import reference
from ._config import COMPILED_HEAD_DIMS, TileConfig, tile_config
from ._extension import UNAVAILABLE_REASON, compiled_archs
from .ops import store, store_zero
from .validation import FlashEpilogueBuildError, FlashEpilogueInputError


def kernels_available() -> bool:
    """True when the CUDA kernels were built and loaded (an sm_90 GPU is still needed to run)."""
    return UNAVAILABLE_REASON is None


def get_include() -> list[str]:
    """Include dirs for a C++/CUDA extension that uses the collectives: ours, then CUTLASS's."""
    import os

    from ._cutlass import cutlass_include_dirs

    here = os.path.dirname(os.path.abspath(__file__))
    ours = os.path.join(os.path.dirname(here), "csrc", "include")  # source checkout / editable install
    if not os.path.isdir(ours):
        ours = os.path.join(here, "include")  # installed: shipped inside the package
    return [ours, *cutlass_include_dirs()]


__all__ = [
    "store",
    "store_zero",
    "reference",
    "tile_config",
    "TileConfig",
    "COMPILED_HEAD_DIMS",
    "compiled_archs",
    "kernels_available",
    "get_include",
    "FlashEpilogueBuildError",
    "FlashEpilogueInputError",
    "__version__",
]
