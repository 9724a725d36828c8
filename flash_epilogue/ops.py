"""The Python API: thin wrappers over torch.ops.flash_epilogue.* that validate first.

Validation reads tensor metadata only (no host sync). Checks of tensor *contents*
(cu_seqlens monotonic and in range, seqused within its segment) need a host sync and run only
when asked: `check_inputs=True`, or FLASH_EPILOGUE_CHECK_INPUTS=1 in the environment; never while
a CUDA graph is being captured or under torch.compile. The kernels clamp every row range to the
tensor's extent, so bad metadata cannot write outside a tensor even unchecked.
"""
from __future__ import annotations

import operator
import os
from typing import Optional, Sequence, Union

import torch

from . import _extension  # noqa: F401 (defines the ops, or their fallbacks)
from . import validation

__all__ = ["store", "store_zero"]


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


IndexArg = Union[None, int, Sequence[int], torch.Tensor]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _index_tensor(op: str, name: str, idx: IndexArg, device) -> Optional[torch.Tensor]:
    """batch_idx/head_idx as the op takes them: None, or an int32 tensor on `device`.

    A tensor is passed through unchanged (validation then checks its dtype, shape and device);
    an int or a sequence of ints becomes a new int32 tensor on `device` (a host -> device copy).
    """
    if idx is None or isinstance(idx, torch.Tensor):
        return idx
    what = "None, an int, a sequence of ints or an int32 tensor"
    if isinstance(idx, bool) or isinstance(idx, (str, bytes)):
        validation._fail(op, name, what, type(idx).__name__)
    try:
        values = [operator.index(idx)]
        names = [name]
    except TypeError:
        try:
            items = list(idx)
        except TypeError:
            validation._fail(op, name, what, type(idx).__name__)
        values, names = [], [f"{name}[{i}]" for i in range(len(items))]
        for v, v_name in zip(items, names):
            if isinstance(v, bool):
                validation._fail(op, v_name, "an int", "bool")
            try:
                values.append(operator.index(v))
            except TypeError:
                validation._fail(op, v_name, "an int", type(v).__name__)
    for v, v_name in zip(values, names):
        if not _INT32_MIN <= v <= _INT32_MAX:
            validation._fail(op, v_name, f"an int32 value in [{_INT32_MIN}, {_INT32_MAX}]", v)
    return torch.tensor(values, dtype=torch.int32, device=device)


def store_zero(
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    seqused: Optional[torch.Tensor] = None,
    batch_idx: IndexArg = None,
    head_idx: IndexArg = None,
    row_start: int = 0,
    row_end: Optional[int] = None,
    check_inputs: Optional[bool] = None,
    _arch: int = 0,
) -> None:
    """Write zeros into the valid rows of dk and dv (bf16 or fp16), in place.

    Layouts as for :func:`store`: batched (batch, seqlen, heads, d) or varlen
    (total_tokens, heads, d) with `cu_seqlens`; `seqused` limits sequence b to its first
    seqused[b] rows; dv may have its own head dim. Zeroed: for each sequence in `batch_idx` and
    each head in `head_idx`, the rows [row_start, row_end) counted from the sequence's start,
    clipped to its valid rows (`row_end=None`: to the end of each sequence). Nothing else is
    written: not rows past seqused, not the rows between sequences, not other heads.

    `batch_idx`/`head_idx`: None (all), an int, a sequence of ints, or an int32 1-D tensor on
    dk's device. Ints and sequences are copied to a new device tensor on every call (a host ->
    device copy, not allowed during CUDA-graph capture); pass a tensor to avoid it. Entries out
    of range (< 0, or >= batch / heads) are skipped, duplicates are harmless, an empty selection
    writes nothing; with `check_inputs` (or FLASH_EPILOGUE_CHECK_INPUTS=1) out-of-range entries
    raise instead, together with the cu_seqlens/seqused content checks.
    """
    op = "store_zero"
    device = dk.device if isinstance(dk, torch.Tensor) else None
    if device is not None:
        batch_idx = _index_tensor(op, "batch_idx", batch_idx, device)
        head_idx = _index_tensor(op, "head_idx", head_idx, device)
    problem = validation.validate_store_zero(dk, dv, cu_seqlens, seqused, batch_idx, head_idx, row_start, row_end)
    if _want_content_checks(check_inputs):
        validation.check_seqlens_contents(
            cu_seqlens, seqused, total=problem.seqlen,
            seqlen_static=None if problem.varlen else problem.seqlen, op=op)
        validation.check_index_contents(op, "batch_idx", batch_idx, problem.batch, limit_why="the batch size")
        validation.check_index_contents(op, "head_idx", head_idx, problem.num_heads,
                                        limit_why="the number of heads")
    torch.ops.flash_epilogue.store_zero(dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, batch_idx=batch_idx,
                                        head_idx=head_idx, row_start=row_start, row_end=row_end, _arch=_arch)


def _register_fake_if_defined(qualname: str):
    """torch.library.register_fake for an op the loaded extension defines.

    An extension built before an op was added (a stale build) lacks it: the op can then be
    neither called nor traced, so there is nothing to register (tests/test_schemas.py reports
    the missing schema). Every other case (a current build, the fallback schemas) registers.
    """
    namespace, name = qualname.split("::")

    def decorate(fn):
        if hasattr(getattr(torch.ops, namespace), name):
            torch.library.register_fake(qualname)(fn)
        return fn

    return decorate


@_register_fake_if_defined("flash_epilogue::store_zero")
def _store_zero_fake(dk, dv, *, cu_seqlens=None, seqused=None, batch_idx=None, head_idx=None, row_start=0,
                     row_end=None, _arch=0) -> None:
    return None
