"""The Python API: thin wrappers over torch.ops.flash_epilogue.* (the ops of csrc/binding).

The C++ ops check every argument (metadata only, no host sync) with messages
``flash_epilogue.<op>: <arg>: expected <expected>, got <got>``. A wrapper calls its op and raises the op's error
as FlashEpilogueInputError (FlashEpilogueTypeError for a wrong type or dtype). It checks only what the op does not
see: Python scalars (coerced to the schema's int64 and float), the GQAAccumulator, gqa_reduce's
num_heads_kv/out/out_dtype and store_zero's index lists. Under torch.compile a wrapper calls the op directly: an
invalid compiled call fails when it runs, with the op's message. The opt-in content checks of cu_seqlens, seqused
and the selections (a host sync) and FLASH_EPILOGUE_DEBUG: see flash_epilogue._checks.
"""
from __future__ import annotations

import operator
from typing import Optional, Sequence, Union

import torch

from . import _checks, _extension
from ._checks import refresh_env_flags
from .errors import FlashEpilogueTypeError, as_count, as_float, as_index, as_int, fail
from .gqa import GQAAccumulator

__all__ = ["store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_reduce", "refresh_env_flags"]

_ops = torch.ops.flash_epilogue  # looked up once (host time); each op is looked up per call
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def store(dk_accum: torch.Tensor, dv_accum: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
          cu_seqlens: Optional[torch.Tensor] = None, seqused: Optional[torch.Tensor] = None,
          check_inputs: Optional[bool] = None, _arch: int = 0) -> None:
    """Convert fp32 dK/dV accumulators to dk/dv (bf16 or fp16, round to nearest even), in place.

    Layouts: batched (batch, seqlen, heads, d) with any strides whose last dim is contiguous
    (e.g. a (batch, heads, seqlen, d) tensor passed as `.transpose(1, 2)`), or varlen
    (total_tokens, heads, d) with `cu_seqlens` (int32, batch + 1). `seqused` (int32, batch) limits
    each sequence to its first seqused[b] rows. Only valid rows of dk/dv are written; dv may have
    its own head dim. The fp32 inputs have the shapes of dk and dv.
    """
    if torch.compiler.is_compiling():
        return _ops.store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, _arch=_arch)
    if type(_arch) is not int or not _I64_MIN <= _arch <= _I64_MAX:
        _arch = as_int("store", "_arch", _arch)
    if check_inputs or (check_inputs is None and _checks.CHECK_INPUTS):
        _checks.check_contents("store", dk, cu_seqlens, seqused)
    try:
        _ops.store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, _arch=_arch)
    except Exception as e:  # noqa: BLE001 (the op's error, as the package's)
        raise _extension.op_error("store", e) from None
    if _checks.DEBUG:
        _checks.debug_sync("store", dk.device)


IndexArg = Union[None, int, Sequence[int], torch.Tensor]


def _index_tensor(name: str, idx: IndexArg, device) -> Optional[torch.Tensor]:
    """batch_idx/head_idx as the op takes them: None or a tensor (passed on: the op checks it), or an int or a
    sequence of ints as a new int32 tensor on `device` (a host -> device copy)."""
    if idx is None or isinstance(idx, torch.Tensor):
        return idx
    op, what = "store_zero", "None, an int, a sequence of ints or an int32 tensor"
    if isinstance(idx, (bool, str, bytes)):
        fail(op, name, what, type(idx).__name__, FlashEpilogueTypeError)
    try:
        values, names = [operator.index(idx)], [name]
    except TypeError:
        try:
            items = list(idx)
        except TypeError:
            fail(op, name, what, type(idx).__name__, FlashEpilogueTypeError)
        names = [f"{name}[{i}]" for i in range(len(items))]
        values = [as_index(op, n, v) for n, v in zip(names, items)]
    for v, n in zip(values, names):
        if not _I32_MIN <= v <= _I32_MAX:
            fail(op, n, f"an int32 value in [{_I32_MIN}, {_I32_MAX}]", v)
    return torch.tensor(values, dtype=torch.int32, device=device)


def store_zero(dk: torch.Tensor, dv: torch.Tensor, *, cu_seqlens: Optional[torch.Tensor] = None,
               seqused: Optional[torch.Tensor] = None, batch_idx: IndexArg = None, head_idx: IndexArg = None,
               row_start: int = 0, row_end: Optional[int] = None, check_inputs: Optional[bool] = None,
               _arch: int = 0) -> None:
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
    if (batch_idx is not None or head_idx is not None) and isinstance(dk, torch.Tensor):
        batch_idx = _index_tensor("batch_idx", batch_idx, dk.device)
        head_idx = _index_tensor("head_idx", head_idx, dk.device)
    if torch.compiler.is_compiling():
        return _ops.store_zero(dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, batch_idx=batch_idx,
                               head_idx=head_idx, row_start=row_start, row_end=row_end, _arch=_arch)
    if type(row_start) is not int or not _I64_MIN <= row_start <= _I64_MAX:
        row_start = as_int(op, "row_start", row_start)
    if row_end is not None and (type(row_end) is not int or not _I64_MIN <= row_end <= _I64_MAX):
        row_end = as_int(op, "row_end", row_end, "None or an int")
    if type(_arch) is not int or not _I64_MIN <= _arch <= _I64_MAX:
        _arch = as_int(op, "_arch", _arch)
    if check_inputs or (check_inputs is None and _checks.CHECK_INPUTS):
        _checks.check_contents(op, dk, cu_seqlens, seqused, batch_idx, head_idx)
    try:
        _ops.store_zero(dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, batch_idx=batch_idx, head_idx=head_idx,
                        row_start=row_start, row_end=row_end, _arch=_arch)
    except Exception as e:  # noqa: BLE001 (the op's error, as the package's)
        raise _extension.op_error(op, e) from None
    if _checks.DEBUG:
        _checks.debug_sync(op, dk.device)


# --------------------------------------------------------------------------------------------
# GQA: accumulate per-query-head partials into a GQAAccumulator, postprocess it; one-call reduce


def _check_acc(op: str, acc, k, v, cu_seqlens, k_name: str, v_name: str) -> None:
    """`acc` is a GQAAccumulator sized for this call (`k`/`v`: the call's tensors of dK's/dV's head dim): the
    ints that accumulator tensors of one shape can still disagree on."""
    if not isinstance(acc, GQAAccumulator):
        fail(op, "acc", "a flash_epilogue.GQAAccumulator (from flash_epilogue.gqa_accumulator)", type(acc).__name__,
             FlashEpilogueTypeError)
    try:
        shape, varlen = k.shape, cu_seqlens is not None
        want = (varlen, cu_seqlens.numel() - 1 if varlen else shape[0], shape[0 if varlen else 1], shape[-1],
                v.shape[-1])
    except Exception:  # noqa: BLE001 (not tensors, too few dims: the op reports them)
        return
    if (acc.varlen, acc.batch, acc.rows, acc.head_dim, acc.head_dim_v) != want:
        _acc_mismatch(op, acc, k, v, cu_seqlens, k_name, v_name)


def _acc_mismatch(op: str, acc: GQAAccumulator, k, v, cu_seqlens, k_name: str, v_name: str) -> None:
    """_check_acc found a difference: name it, unless the op rejects the call anyway (tensors of the wrong rank,
    a malformed cu_seqlens)."""
    varlen = cu_seqlens is not None
    rank = 3 if varlen else 4
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == rank == v.dim()):
        return
    if varlen and not (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1):
        return
    shape = k.shape
    want = (cu_seqlens.numel() - 1, shape[0]) if varlen else (shape[0], shape[1])
    # The op's own check comes first: where the accumulator's tensors lack the shape the op computes for this
    # call (its KV heads: dk's for postprocess, the accumulator's for accumulate), the op names dk_accum's shape.
    try:
        heads = shape[-2] if op == "gqa_postprocess" else acc.dk_accum.shape[1]
        layout = _extension._C.gqa_accum_layout(heads, shape[-1], v.shape[-1], *want, varlen, acc.arch, k.device)
    except Exception:  # noqa: BLE001 (arguments the op rejects itself)
        return
    if tuple(layout["shape"]) != tuple(acc.dk_accum.shape):
        return
    if acc.varlen != varlen:
        kind = "varlen (cu_seqlens given)" if varlen else "batched (cu_seqlens None)"
        fail(op, "acc.varlen", f"{varlen}: the call's layout is {kind}", acc.varlen)
    whys = ("cu_seqlens.numel() - 1", f"{k_name}.shape[0], the total tokens") if varlen else (
        f"{k_name}.shape[0]", f"{k_name}.shape[1], the seqlen")
    for field, w, why in zip(("batch", "rows", "head_dim", "head_dim_v"), want + (shape[-1], v.shape[-1]),
                             whys + (f"{k_name}.shape[-1]", f"{v_name}.shape[-1]")):
        if getattr(acc, field) != w:
            fail(op, f"acc.{field}", f"{w} ({why})", getattr(acc, field))


def gqa_accumulate(dk_partial: torch.Tensor, dv_partial: torch.Tensor, acc: GQAAccumulator, *,
                   deterministic: Optional[bool] = None, cu_seqlens: Optional[torch.Tensor] = None,
                   seqused: Optional[torch.Tensor] = None, check_inputs: Optional[bool] = None) -> None:
    """Add per-query-head fp32 dK/dV partials into the GQA accumulator ``acc``, in place.

    ``dk_partial``/``dv_partial``: fp32 (batch, seqlen, h_q, d) / (batch, seqlen, h_q, dv), or
    varlen (total_tokens, h_q, d) with ``cu_seqlens``; last dim contiguous, other strides multiples
    of 16 bytes. h_q must be a multiple of ``acc.num_heads_kv``: query head j belongs to KV head
    j // (h_q / h_k), and each KV head's accumulator receives the sum of its group over the valid
    rows (rows past ``seqused`` add nothing). Callable many times into the same accumulator
    (chunks of tokens, KV blocks, context-parallel steps): each call carries whole groups.

    ``deterministic``: bitwise reproducible, ``acc + p_0 + p_1 + ... + p_{g-1}`` in fp32 in head
    order; needs an accumulator allocated with ``deterministic=True``. Otherwise the group is
    added in any order (fp32 reassociation only). Default (None): deterministic when the
    accumulator was allocated with ``deterministic=True`` or when
    ``torch.are_deterministic_algorithms_enabled()``.
    """
    op = "gqa_accumulate"
    _check_acc(op, acc, dk_partial, dv_partial, cu_seqlens, "dk_partial", "dv_partial")
    if deterministic is None:
        # an accumulator allocated for deterministic mode asks for it; so does torch's global switch
        deterministic = acc.semaphores is not None or torch.are_deterministic_algorithms_enabled()
        why = "torch.are_deterministic_algorithms_enabled() is True"
    elif type(deterministic) is not bool:
        fail(op, "deterministic", "a bool", type(deterministic).__name__, FlashEpilogueTypeError)
    else:
        why = "deterministic=True"
    if deterministic and acc.semaphores is None:
        fail(op, "acc.semaphores", f"an int32 workspace because {why}: allocate the accumulator with "
             "flash_epilogue.gqa_accumulator(..., deterministic=True) (or pass deterministic=False)",
             "None (allocated with deterministic=False)")
    semaphores = acc.semaphores if deterministic else None
    if torch.compiler.is_compiling():
        return _ops.gqa_accumulate(dk_partial, dv_partial, acc.dk_accum, acc.dv_accum, semaphores,
                                   cu_seqlens=cu_seqlens, seqused=seqused, deterministic=deterministic,
                                   _arch=acc.arch)
    if check_inputs or (check_inputs is None and _checks.CHECK_INPUTS):
        _checks.check_contents(op, dk_partial, cu_seqlens, seqused)
    try:
        _ops.gqa_accumulate(dk_partial, dv_partial, acc.dk_accum, acc.dv_accum, semaphores, cu_seqlens=cu_seqlens,
                            seqused=seqused, deterministic=deterministic, _arch=acc.arch)
    except Exception as e:  # noqa: BLE001 (the op's error, as the package's)
        raise _extension.op_error(op, e) from None
    if _checks.DEBUG:
        _checks.debug_sync(op, dk_partial.device)


def gqa_postprocess(acc: GQAAccumulator, dk: torch.Tensor, dv: torch.Tensor, *, scale_dk: float = 1.0,
                    scale_dv: float = 1.0, cu_seqlens: Optional[torch.Tensor] = None,
                    seqused: Optional[torch.Tensor] = None, check_inputs: Optional[bool] = None) -> None:
    """Write the accumulator to dk/dv (bf16 or fp16), in place: ``(accum * scale).to(dtype)``
    (fp32 multiply by the scale rounded to fp32, then round to nearest even).

    dk/dv: (batch, seqlen, h_k, d) / (..., dv), or varlen (total_tokens, h_k, d) with
    ``cu_seqlens``; layouts and strides as for :func:`store`. Only the valid rows are written
    (rows past ``seqused``, padding between sequences and everything else stay untouched). The
    accumulator is not changed: call ``acc.reset()`` before reusing it.
    """
    op = "gqa_postprocess"
    _check_acc(op, acc, dk, dv, cu_seqlens, "dk", "dv")
    if torch.compiler.is_compiling():
        return _ops.gqa_postprocess(acc.dk_accum, acc.dv_accum, dk, dv, scale_dk=scale_dk, scale_dv=scale_dv,
                                    cu_seqlens=cu_seqlens, seqused=seqused, _arch=acc.arch)
    if type(scale_dk) is not float:
        scale_dk = as_float(op, "scale_dk", scale_dk)
    if type(scale_dv) is not float:
        scale_dv = as_float(op, "scale_dv", scale_dv)
    if check_inputs or (check_inputs is None and _checks.CHECK_INPUTS):
        _checks.check_contents(op, dk, cu_seqlens, seqused)
    try:
        _ops.gqa_postprocess(acc.dk_accum, acc.dv_accum, dk, dv, scale_dk=scale_dk, scale_dv=scale_dv,
                             cu_seqlens=cu_seqlens, seqused=seqused, _arch=acc.arch)
    except Exception as e:  # noqa: BLE001 (the op's error, as the package's)
        raise _extension.op_error(op, e) from None
    if _checks.DEBUG:
        _checks.debug_sync(op, dk.device)


def _new_output(name: str, partial, num_heads_kv: int, varlen: bool, out_dtype):
    """gqa_reduce's output for `partial` (None: None): (batch, seqlen, h_k, d) or varlen (total, h_k, d) of
    `out_dtype` (default: the partial's dtype if 16-bit, else bfloat16). For a partial the op rejects (not a
    tensor, the wrong rank) a placeholder that lets the op report it."""
    if not isinstance(partial, torch.Tensor):
        return None if partial is None else torch.empty(0)
    dtype = out_dtype
    if dtype is None:
        dtype = partial.dtype if partial.dtype in _HALF_DTYPES else torch.bfloat16
    if partial.dim() != (3 if varlen else 4):
        return partial.new_empty(0, dtype=dtype)
    h_q = partial.shape[-2]
    if h_q < 1 or h_q % num_heads_kv != 0:
        fail("gqa_reduce", "num_heads_kv", f"a divisor of the {h_q} query heads ({name}.shape[-2])", num_heads_kv)
    return partial.new_empty(tuple(partial.shape[:-2]) + (num_heads_kv, partial.shape[-1]), dtype=dtype)


def _reduce_outputs(dk_partial, dv_partial, num_heads_kv: int, varlen: bool, out, out_dtype):
    """(dk, dv) for gqa_reduce: `out` unpacked, or new tensors."""
    op = "gqa_reduce"
    if out_dtype is not None and out_dtype not in _HALF_DTYPES:
        fail(op, "out_dtype", "None, torch.float16 or torch.bfloat16", out_dtype)
    if out is None:
        return (_new_output("dk_partial", dk_partial, num_heads_kv, varlen, out_dtype),
                _new_output("dv_partial", dv_partial, num_heads_kv, varlen, out_dtype))
    if isinstance(out, torch.Tensor):
        if dv_partial is not None:
            fail(op, "out", "a (dk, dv) pair because dv_partial is given", "a torch.Tensor")
        dk, dv = out, None
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        dk, dv = out
    else:
        length = f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""
        fail(op, "out", "None, a tensor (dk) or a (dk, dv) pair", f"a {type(out).__name__}{length}")
    if isinstance(dk, torch.Tensor):
        if out_dtype is not None and dk.dtype != out_dtype:
            fail(op, "out_dtype", f"None or {dk.dtype} (the dtype of out)", out_dtype)
        if dk.dim() == (3 if varlen else 4) and dk.shape[-2] != num_heads_kv:
            fail(op, "num_heads_kv", f"{dk.shape[-2]} (the heads of out: dk.shape[-2])", num_heads_kv)
    return dk, dv


def gqa_reduce(dk_partial: torch.Tensor, dv_partial: Optional[torch.Tensor] = None, *, num_heads_kv: int,
               cu_seqlens: Optional[torch.Tensor] = None, seqused: Optional[torch.Tensor] = None,
               out: Union[None, torch.Tensor, tuple] = None, out_dtype: Optional[torch.dtype] = None,
               scale_dk: float = 1.0, scale_dv: float = 1.0, check_inputs: Optional[bool] = None, _arch: int = 0):
    """Sum each group of query-head partials into dK (and dV) in one call: deterministic.

    ``dk_partial`` (and ``dv_partial``, optional): fp32, bf16 or fp16 (batch, seqlen, h_q, d) or
    varlen (total_tokens, h_q, d) with ``cu_seqlens``; any strides with the last dim contiguous
    and the others multiples of 16 bytes (a (batch, h_q, seqlen, d) tensor is passed as
    ``.transpose(1, 2)``). For every KV head k < ``num_heads_kv`` the output is
    ``(0 + p_{k*g} + p_{k*g+1} + ... + p_{k*g+g-1}) * scale`` summed in fp32 in head order, then
    rounded to the output dtype (g = h_q / num_heads_kv).

    ``out``: None (new tensors (batch, seqlen, num_heads_kv, d) of ``out_dtype``, default the
    partials' dtype if 16-bit, else bfloat16; rows outside the valid rows are left uninitialized),
    dk, or a (dk, dv) pair (bf16/fp16, any strides as for :func:`store`). Only the valid rows are
    written. Returns dk, or (dk, dv) when dv_partial is given.
    """
    op = "gqa_reduce"
    if type(num_heads_kv) is not int or num_heads_kv < 1:
        num_heads_kv = as_count(op, "num_heads_kv", num_heads_kv, "a positive int", 1)
    dk, dv = _reduce_outputs(dk_partial, dv_partial, num_heads_kv, cu_seqlens is not None, out, out_dtype)
    if torch.compiler.is_compiling():
        _ops.gqa_reduce(dk_partial, dv_partial, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, scale_dk=scale_dk,
                        scale_dv=scale_dv, _arch=_arch)
        return dk if dv_partial is None else (dk, dv)
    if type(scale_dk) is not float:
        scale_dk = as_float(op, "scale_dk", scale_dk)
    if type(scale_dv) is not float:
        scale_dv = as_float(op, "scale_dv", scale_dv)
    if type(_arch) is not int or not _I64_MIN <= _arch <= _I64_MAX:
        _arch = as_int(op, "_arch", _arch)
    if check_inputs or (check_inputs is None and _checks.CHECK_INPUTS):
        _checks.check_contents(op, dk_partial, cu_seqlens, seqused)
    try:
        _ops.gqa_reduce(dk_partial, dv_partial, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, scale_dk=scale_dk,
                        scale_dv=scale_dv, _arch=_arch)
    except Exception as e:  # noqa: BLE001 (the op's error, as the package's)
        raise _extension.op_error(op, e) from None
    if _checks.DEBUG:
        _checks.debug_sync(op, dk.device)
    return dk if dv_partial is None else (dk, dv)


def _no_outputs(*args, **kwargs) -> None:
    """The fake kernel of the ops that only write their arguments: no output to describe, no checks (the op
    checks when the compiled code runs)."""


if _extension._C is not None:
    for _name in ("store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_accum_to_dense", "gqa_reduce"):
        torch.library.register_fake(f"flash_epilogue::{_name}")(_no_outputs)
