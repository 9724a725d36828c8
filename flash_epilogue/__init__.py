"""flash_epilogue: FlashAttention-3's backward dK/dV epilogue for Hopper (sm_90) as PyTorch ops.

    import flash_epilogue as fe
    fe.store(dk_fp32, dv_fp32, dk_bf16, dv_bf16)                  # or torch.ops.flash_epilogue.store
    fe.store_zero(dk_bf16, dv_bf16, batch_idx=[1])                 # zero the valid rows of sequence 1
    acc = fe.gqa_accumulator(h_k, d, batch=b, seqlen=s, device="cuda")   # GQA: query-head partials -> KV heads
    fe.gqa_accumulate(dk_partial, dv_partial, acc)                 # as many calls as chunks
    fe.gqa_postprocess(acc, dk_bf16, dv_bf16, scale_dk=scale)
    dk_bf16 = fe.gqa_reduce(dk_partial, num_heads_kv=h_k)          # or all at once
    k = fe.repeat_kv(k, n_rep)   # autograd: (b, h_k, s, d) -> (b, h_k * n_rep, s, d), the group reduce as backward

The C++ collectives are a header library: see `get_include()`. docs/semantics.md documents the semantics.
"""
__version__ = "0.1.0"

from . import reference
from ._config import COMPILED_HEAD_DIMS, TileConfig, tile_config
from ._extension import UNAVAILABLE_REASON, compiled_archs
from .errors import FlashEpilogueBuildError, FlashEpilogueInputError, FlashEpilogueTypeError
from .gqa import GQAAccumulator, gqa_accumulator
from .ops import gqa_accumulate, gqa_postprocess, gqa_reduce, refresh_env_flags, store, store_zero
from .repeat_kv import repeat_kv


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


__all__ = ["store", "store_zero", "GQAAccumulator", "gqa_accumulator", "gqa_accumulate", "gqa_postprocess",
           "gqa_reduce", "refresh_env_flags", "repeat_kv", "reference", "tile_config", "TileConfig",
           "COMPILED_HEAD_DIMS", "compiled_archs", "kernels_available", "get_include", "FlashEpilogueBuildError",
           "FlashEpilogueInputError", "FlashEpilogueTypeError", "UNAVAILABLE_REASON", "__version__"]
