"""The Python API: thin wrappers over torch.ops.flash_epilogue.* that validate first.

Validation reads tensor metadata only (no host sync). Checks of tensor *contents*
(cu_seqlens monotonic and in range, seqused within its segment) need a host sync and run only
when asked: `check_inputs=True`, or FLASH_EPILOGUE_CHECK_INPUTS=1 in the environment; never while
a CUDA graph is being captured or under torch.compile. The kernels clamp every row range to the
tensor's extent, so bad metadata cannot write outside a tensor even unchecked.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import _extension  # noqa: F401 (defines the ops, or their fallbacks)
from . import validation

__all__ = ["store"]


def _want_content_checks(check_inputs: Optional[bool]) -> bool:
    if check_inputs is None:
        check_inputs = os.environ.get("FLASH_EPILOGUE_CHECK_INPUTS", "0") not in ("", "0")
    if not check_inputs:
        return False
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def store(
    dk_accum: torch.Tensor,
    dv_accum: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    seqused: Optional[torch.Tensor] = None,
    check_inputs: Optional[bool] = None,
    _arch: int = 0,
) -> None:
    """Convert fp32 dK/dV accumulators to dk/dv (bf16 or fp16, round to nearest even), in place.

    Layouts: batched (batch, seqlen, heads, d) with any strides whose last dim is contiguous
    (e.g. a (batch, heads, seqlen, d) tensor passed as `.transpose(1, 2)`), or varlen
    (total_tokens, heads, d) with `cu_seqlens` (int32, batch + 1). `seqused` (int32, batch) limits
    each sequence to its first seqused[b] rows. Only valid rows of dk/dv are written; dv may have
    its own head dim. The fp32 inputs have the shapes of dk and dv.
    """
    problem = validation.validate_store(dk_accum, dv_accum, dk, dv, cu_seqlens, seqused)
    if _want_content_checks(check_inputs):
        validation.check_seqlens_contents(
            cu_seqlens, seqused, total=problem.seqlen,
            seqlen_static=None if problem.varlen else problem.seqlen, op="store")
    torch.ops.flash_epilogue.store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, _arch=_arch)


@torch.library.register_fake("flash_epilogue::store")
def _store_fake(dk_accum, dv_accum, dk, dv, *, cu_seqlens=None, seqused=None, _arch=0) -> None:
    return None
