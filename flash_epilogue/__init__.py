"""flash_epilogue: FlashAttention-3's backward dK/dV epilogue for Hopper (sm_90) as PyTorch ops: store, store_zero, the
GQA reduce (gqa_reduce, or gqa_accumulator, gqa_accumulate and gqa_postprocess) and repeat_kv (with its autograd).
The ops run on an sm_90 GPU; flash_epilogue.reference computes each on any device, with the same bits, and
flash_epilogue.testing holds the helpers that compare kernels with it bitwise. The C++ collectives are a header
library: see `get_include()`. The repository's docs/ document the semantics, the collectives and the speed."""
__version__ = "0.1.0"

from . import reference
from ._cutlass import get_include
from ._extension import UNAVAILABLE_REASON, compiled_archs
from .errors import FlashEpilogueBuildError, FlashEpilogueInputError, FlashEpilogueTypeError
from .gqa import COMPILED_HEAD_DIMS, GQAAccumulator, TileConfig, gqa_accumulator, tile_config
from .ops import gqa_accumulate, gqa_postprocess, gqa_reduce, refresh_env_flags, repeat_kv, store, store_zero


def kernels_available() -> bool:
    """True when the CUDA kernels were built and loaded (an sm_90 GPU is still needed to run)."""
    return UNAVAILABLE_REASON is None


__all__ = ["store", "store_zero", "GQAAccumulator", "gqa_accumulator", "gqa_accumulate", "gqa_postprocess",
           "gqa_reduce", "refresh_env_flags", "repeat_kv", "reference", "tile_config", "TileConfig",
           "COMPILED_HEAD_DIMS", "compiled_archs", "kernels_available", "get_include", "FlashEpilogueBuildError",
           "FlashEpilogueInputError", "FlashEpilogueTypeError", "UNAVAILABLE_REASON", "__version__"]
