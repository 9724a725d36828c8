"""The Python API: thin wrappers over torch.ops.flash_epilogue.*.

Host time. The C++ ops check every argument themselves (the same checks as validation.py, with the
same messages), so on the hot path a wrapper calls the op first and runs the Python validation
only when the op raises: the validation then raises FlashEpilogueInputError naming the bad
argument, or, when it finds nothing wrong, the op's own error is re-raised. The Python validation
runs first, as before, under torch.compile, for anything but a plain CUDA tensor (meta and fake
tensors reach the fake kernels, which do not validate), when content checks are asked for, and
for Python scalars of unusual types (numpy ints, ...; the op's schema would coerce them).

Validation reads tensor metadata only (no host sync). Checks of tensor *contents*
(cu_seqlens monotonic and in range, seqused within its segment) need a host sync and run only
when asked: `check_inputs=True`, or FLASH_EPILOGUE_CHECK_INPUTS=1 in the environment; never while
a CUDA graph is being captured or under torch.compile. The kernels clamp every row range to the
tensor's extent, so bad metadata cannot write outside a tensor even unchecked.

FLASH_EPILOGUE_DEBUG=1 turns the content checks on and synchronizes after every launch, so a
device-side failure is reported by the op that caused it.

Both variables are read once, at import (an environment lookup on every call costs host time);
after changing them in a running process call :func:`refresh_env_flags`.
"""
from __future__ import annotations

import operator
import os
from typing import Optional, Sequence, Union

import torch

from . import _extension  # defines the ops, or their fallbacks
from . import validation
from .gqa import GQAAccumulator

__all__ = ["store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_reduce", "refresh_env_flags"]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


_DEBUG = False  # FLASH_EPILOGUE_DEBUG
_CHECK_INPUTS = False  # FLASH_EPILOGUE_CHECK_INPUTS or FLASH_EPILOGUE_DEBUG: content checks by default


def refresh_env_flags() -> None:
    """Re-read FLASH_EPILOGUE_CHECK_INPUTS and FLASH_EPILOGUE_DEBUG from the environment.

    They are read once, when the package is imported; call this after changing them in a running
    process (``os.environ[...] = "1"``, pytest's ``monkeypatch.setenv``)."""
    global _DEBUG, _CHECK_INPUTS
    _DEBUG = _env_flag("FLASH_EPILOGUE_DEBUG")
    _CHECK_INPUTS = _env_flag("FLASH_EPILOGUE_CHECK_INPUTS") or _DEBUG
    if _extension._C is not None and hasattr(_extension._C, "_set_debug_sync"):
        _extension._C._set_debug_sync(_DEBUG)  # repeat_kv's backward synchronizes in C++


refresh_env_flags()

_NUMBER_TYPES = (int, float)  # scalars the fast path passes to an op as they are (bool is not one)


def _eager_and_not_capturing() -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _want_content_checks(check_inputs: Optional[bool]) -> bool:
    """Content checks (a host sync) when asked: check_inputs=True, FLASH_EPILOGUE_CHECK_INPUTS=1 or
    FLASH_EPILOGUE_DEBUG=1; never under torch.compile or CUDA-graph capture."""
    if check_inputs is None:
        check_inputs = _CHECK_INPUTS
    return bool(check_inputs) and _eager_and_not_capturing()


def _debug_sync(op: str, device: torch.device) -> None:
    """FLASH_EPILOGUE_DEBUG=1: wait for the launch and report a device error against this op."""
    if not (_DEBUG and device.type == "cuda" and _eager_and_not_capturing()):
        return
    try:
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 (re-raised with the op's name)
        raise RuntimeError(f"flash_epilogue.{op}: the kernel failed on {device}: {e}") from e


def _op_checks_first(t, check_inputs: Optional[bool]) -> bool:
    """Whether a call may go straight to the op (which checks its arguments; the Python validation
    runs only if it raises): eager, `t` (the op's first tensor) a plain CUDA tensor, so the call
    reaches the C++ kernel, and no content checks asked for (they run before the launch)."""
    if check_inputs is None:
        check_inputs = _CHECK_INPUTS
    return not check_inputs and not torch.compiler.is_compiling() and type(t) is torch.Tensor and t.is_cuda


def _explain(validate, *args, **kwargs) -> None:
    """The op raised: run the Python validation, whose FlashEpilogueInputError names the bad
    argument (raised in place of the op's error). Returns when it finds nothing wrong; the caller
    then re-raises the op's own error."""
    try:
        validate(*args, **kwargs)
    except (validation.FlashEpilogueInputError, validation.FlashEpilogueBuildError) as e:
        raise e from None


def _check_fake_devices(op: str, tensors) -> None:
    """Fake kernels: every tensor on one device. A call mixing meta (or fake) tensors with real ones
    is dispatched to the fake kernel, which must not accept what the op would refuse."""
    ref_name, ref = None, None
    for name, t in tensors:
        if t is None:
            continue
        if ref is None:
            ref_name, ref = name, t
        elif t.device != ref.device:
            validation._fail(op, f"{name}: device", f"{ref.device} (the device of {ref_name})", t.device)


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
    if _op_checks_first(dk, check_inputs):
        try:
            torch.ops.flash_epilogue.store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused,
                                           _arch=_arch)
        except Exception:
            _explain(validation.validate_store, dk_accum, dv_accum, dk, dv, cu_seqlens, seqused)
            raise
    else:
        problem = validation.validate_store(dk_accum, dv_accum, dk, dv, cu_seqlens, seqused)
        if _want_content_checks(check_inputs):
            validation.check_seqlens_contents(
                cu_seqlens, seqused, total=problem.seqlen,
                seqlen_static=None if problem.varlen else problem.seqlen, op="store")
        torch.ops.flash_epilogue.store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused,
                                       _arch=_arch)
    if _DEBUG:
        _debug_sync("store", dk.device)


@torch.library.register_fake("flash_epilogue::store")
def _store_fake(dk_accum, dv_accum, dk, dv, *, cu_seqlens=None, seqused=None, _arch=0) -> None:
    _check_fake_devices("store", (("dk_accum", dk_accum), ("dv_accum", dv_accum), ("dk", dk), ("dv", dv),
                                  ("cu_seqlens", cu_seqlens), ("seqused", seqused)))


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
    if (batch_idx is not None or head_idx is not None) and isinstance(dk, torch.Tensor):
        batch_idx = _index_tensor(op, "batch_idx", batch_idx, dk.device)
        head_idx = _index_tensor(op, "head_idx", head_idx, dk.device)
    if (_op_checks_first(dk, check_inputs) and type(row_start) is int
            and (row_end is None or type(row_end) is int)):
        try:
            torch.ops.flash_epilogue.store_zero(dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, batch_idx=batch_idx,
                                                head_idx=head_idx, row_start=row_start, row_end=row_end, _arch=_arch)
        except Exception:
            _explain(validation.validate_store_zero, dk, dv, cu_seqlens, seqused, batch_idx, head_idx, row_start,
                     row_end)
            raise
    else:
        problem = validation.validate_store_zero(dk, dv, cu_seqlens, seqused, batch_idx, head_idx, row_start,
                                                 row_end)
        if _want_content_checks(check_inputs):
            validation.check_seqlens_contents(
                cu_seqlens, seqused, total=problem.seqlen,
                seqlen_static=None if problem.varlen else problem.seqlen, op=op)
            validation.check_index_contents(op, "batch_idx", batch_idx, problem.batch, limit_why="the batch size")
            validation.check_index_contents(op, "head_idx", head_idx, problem.num_heads,
                                            limit_why="the number of heads")
        torch.ops.flash_epilogue.store_zero(dk, dv, cu_seqlens=cu_seqlens, seqused=seqused, batch_idx=batch_idx,
                                            head_idx=head_idx, row_start=row_start, row_end=row_end, _arch=_arch)
    if _DEBUG:
        _debug_sync(op, dk.device)


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
    _check_fake_devices("store_zero", (("dk", dk), ("dv", dv), ("cu_seqlens", cu_seqlens), ("seqused", seqused),
                                       ("batch_idx", batch_idx), ("head_idx", head_idx)))


# --------------------------------------------------------------------------------------------
# GQA: accumulate per-query-head partials into a GQAAccumulator, postprocess it; one-call reduce


def _check_acc(op: str, acc) -> None:
    if not isinstance(acc, GQAAccumulator):
        validation._fail(op, "acc", "a flash_epilogue.GQAAccumulator (from flash_epilogue.gqa_accumulator)",
                         type(acc).__name__)


def _check_acc_matches(op: str, acc: GQAAccumulator, problem: validation.GQAProblem, *, k_name: str,
                       v_name: Optional[str]) -> None:
    """The accumulator was sized for this problem (its tensors' shapes are checked by the
    validator; here the ints that tensors of the same shape can still disagree on)."""
    layout = "varlen (cu_seqlens given)" if problem.varlen else "batched (cu_seqlens None)"
    if acc.varlen != problem.varlen:
        validation._fail(op, "acc.varlen", f"{problem.varlen}: the call's layout is {layout}", acc.varlen)
    batch_why = "cu_seqlens.numel() - 1" if problem.varlen else f"{k_name}.shape[0]"
    if acc.batch != problem.batch:
        validation._fail(op, "acc.batch", f"{problem.batch} ({batch_why})", acc.batch)
    rows_why = f"{k_name}.shape[0], the total tokens" if problem.varlen else f"{k_name}.shape[1], the seqlen"
    if acc.rows != problem.seqlen:
        validation._fail(op, "acc.rows", f"{problem.seqlen} ({rows_why})", acc.rows)
    if acc.head_dim != problem.head_dim:
        validation._fail(op, "acc.head_dim", f"{problem.head_dim} ({k_name}.shape[-1])", acc.head_dim)
    if v_name is not None and acc.head_dim_v != problem.head_dim_v:
        validation._fail(op, "acc.head_dim_v", f"{problem.head_dim_v} ({v_name}.shape[-1])", acc.head_dim_v)


def _acc_fits(acc: GQAAccumulator, k, v, cu_seqlens) -> bool:
    """_check_acc_matches without messages, from shapes alone (the fast path); False also when the
    arguments are too malformed to tell (the Python validation then says what is wrong)."""
    try:
        varlen = cu_seqlens is not None
        shape = k.shape
        batch, rows = (cu_seqlens.numel() - 1, shape[0]) if varlen else (shape[0], shape[1])
        return (acc.varlen == varlen and acc.batch == batch and acc.rows == rows and acc.head_dim == shape[-1]
                and acc.head_dim_v == v.shape[-1])
    except Exception:  # noqa: BLE001
        return False


def _validate_accumulate(op, acc, dk_partial, dv_partial, semaphores, cu_seqlens, seqused, deterministic):
    problem = validation.validate_gqa_accumulate(dk_partial, dv_partial, acc.dk_accum, acc.dv_accum, semaphores,
                                                 cu_seqlens, seqused, deterministic=deterministic, _arch=acc.arch,
                                                 op=op)
    _check_acc_matches(op, acc, problem, k_name="dk_partial", v_name="dv_partial")
    return problem


def _validate_postprocess(op, acc, dk, dv, cu_seqlens, seqused, scale_dk, scale_dv):
    problem = validation.validate_gqa_postprocess(acc.dk_accum, acc.dv_accum, dk, dv, cu_seqlens, seqused,
                                                  scale_dk=scale_dk, scale_dv=scale_dv, _arch=acc.arch, op=op)
    _check_acc_matches(op, acc, problem, k_name="dk", v_name="dv")
    return problem


def _validate_reduce(op, dk_partial, dv_partial, dk, dv, cu_seqlens, seqused, scale_dk, scale_dv, _arch,
                     num_heads_kv):
    problem = validation.validate_gqa_reduce(dk_partial, dv_partial, dk, dv, cu_seqlens, seqused, scale_dk=scale_dk,
                                             scale_dv=scale_dv, _arch=_arch, op=op)
    if problem.num_heads_kv != num_heads_kv:
        validation._fail(op, "num_heads_kv", f"{problem.num_heads_kv} (the heads of out: dk.shape[-2])", num_heads_kv)
    return problem


def _content_checks(check_inputs, op: str, problem, cu_seqlens, seqused) -> None:
    if _want_content_checks(check_inputs):
        validation.check_seqlens_contents(cu_seqlens, seqused, total=problem.seqlen,
                                          seqlen_static=None if problem.varlen else problem.seqlen, op=op)


def gqa_accumulate(
    dk_partial: torch.Tensor,
    dv_partial: torch.Tensor,
    acc: GQAAccumulator,
    *,
    deterministic: Optional[bool] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    seqused: Optional[torch.Tensor] = None,
    check_inputs: Optional[bool] = None,
) -> None:
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
    _check_acc(op, acc)
    if deterministic is None:
        # an accumulator allocated for deterministic mode asks for it; so does torch's global switch
        deterministic = acc.semaphores is not None or torch.are_deterministic_algorithms_enabled()
        why = "torch.are_deterministic_algorithms_enabled() is True"
    else:
        why = "deterministic=True"
    if deterministic is True and acc.semaphores is None:
        validation._fail(op, "acc.semaphores",
                         f"an int32 workspace because {why}: allocate the accumulator with "
                         "flash_epilogue.gqa_accumulator(..., deterministic=True) (or pass deterministic=False)",
                         "None (allocated with deterministic=False)")
    semaphores = acc.semaphores if deterministic is True else None
    if (_op_checks_first(dk_partial, check_inputs) and type(deterministic) is bool
            and _acc_fits(acc, dk_partial, dv_partial, cu_seqlens)):
        try:
            torch.ops.flash_epilogue.gqa_accumulate(dk_partial, dv_partial, acc.dk_accum, acc.dv_accum, semaphores,
                                                    cu_seqlens=cu_seqlens, seqused=seqused,
                                                    deterministic=deterministic, _arch=acc.arch)
        except Exception:
            _explain(_validate_accumulate, op, acc, dk_partial, dv_partial, semaphores, cu_seqlens, seqused,
                     deterministic)
            raise
    else:
        problem = _validate_accumulate(op, acc, dk_partial, dv_partial, semaphores, cu_seqlens, seqused, deterministic)
        _content_checks(check_inputs, op, problem, cu_seqlens, seqused)
        torch.ops.flash_epilogue.gqa_accumulate(dk_partial, dv_partial, acc.dk_accum, acc.dv_accum, semaphores,
                                                cu_seqlens=cu_seqlens, seqused=seqused, deterministic=deterministic,
                                                _arch=acc.arch)
    if _DEBUG:
        _debug_sync(op, dk_partial.device)


def gqa_postprocess(
    acc: GQAAccumulator,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    scale_dk: float = 1.0,
    scale_dv: float = 1.0,
    cu_seqlens: Optional[torch.Tensor] = None,
    seqused: Optional[torch.Tensor] = None,
    check_inputs: Optional[bool] = None,
) -> None:
    """Write the accumulator to dk/dv (bf16 or fp16), in place: ``(accum * scale).to(dtype)``
    (fp32 multiply by the scale rounded to fp32, then round to nearest even).

    dk/dv: (batch, seqlen, h_k, d) / (..., dv), or varlen (total_tokens, h_k, d) with
    ``cu_seqlens``; layouts and strides as for :func:`store`. Only the valid rows are written
    (rows past ``seqused``, padding between sequences and everything else stay untouched). The
    accumulator is not changed: call ``acc.reset()`` before reusing it.
    """
    op = "gqa_postprocess"
    _check_acc(op, acc)
    if (_op_checks_first(dk, check_inputs) and type(scale_dk) in _NUMBER_TYPES and type(scale_dv) in _NUMBER_TYPES
            and _acc_fits(acc, dk, dv, cu_seqlens)):
        try:
            torch.ops.flash_epilogue.gqa_postprocess(acc.dk_accum, acc.dv_accum, dk, dv, scale_dk=float(scale_dk),
                                                     scale_dv=float(scale_dv), cu_seqlens=cu_seqlens, seqused=seqused,
                                                     _arch=acc.arch)
        except Exception:
            _explain(_validate_postprocess, op, acc, dk, dv, cu_seqlens, seqused, scale_dk, scale_dv)
            raise
    else:
        problem = _validate_postprocess(op, acc, dk, dv, cu_seqlens, seqused, scale_dk, scale_dv)
        _content_checks(check_inputs, op, problem, cu_seqlens, seqused)
        torch.ops.flash_epilogue.gqa_postprocess(acc.dk_accum, acc.dv_accum, dk, dv, scale_dk=float(scale_dk),
                                                 scale_dv=float(scale_dv), cu_seqlens=cu_seqlens, seqused=seqused,
                                                 _arch=acc.arch)
    if _DEBUG:
        _debug_sync(op, dk.device)


def _accum_to_dense(acc: GQAAccumulator, *, cu_seqlens=None, seqused=None,
                    check_inputs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """GQAAccumulator.to_dense: decode both accumulators through gqa_accum_to_dense into new
    zero-filled fp32 tensors (rows outside the valid rows stay 0)."""
    op = "gqa_accum_to_dense"
    _check_acc(op, acc)
    if acc.varlen and cu_seqlens is None:
        validation._fail(op, "cu_seqlens", "the int32 cu_seqlens the varlen accumulator was filled with", "None")
    if not acc.varlen and cu_seqlens is not None:
        validation._fail(op, "cu_seqlens", "None for an accumulator of the batched layout", "a tensor")
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.numel() - 1 != acc.batch:
        validation._fail(op, "acc.batch", f"{cu_seqlens.numel() - 1} (cu_seqlens.numel() - 1)", acc.batch)
    head_dim = max(acc.head_dim, acc.head_dim_v)  # names the tile config
    outs = []
    for accum, d in ((acc.dk_accum, acc.head_dim), (acc.dv_accum, acc.head_dim_v)):
        out = torch.zeros(acc.dense_shape(d), dtype=torch.float32, device=accum.device)
        problem = validation.validate_gqa_accum_to_dense(accum, out, cu_seqlens, seqused, head_dim=head_dim,
                                                         _arch=acc.arch, op=op)
        if not outs:
            _content_checks(check_inputs, op, problem, cu_seqlens, seqused)
        torch.ops.flash_epilogue.gqa_accum_to_dense(accum, out, head_dim=head_dim, cu_seqlens=cu_seqlens,
                                                    seqused=seqused, _arch=acc.arch)
        outs.append(out)
    return outs[0], outs[1]


def _reduce_outputs(op: str, dk_partial, dv_partial, num_heads_kv, varlen: bool, out, out_dtype):
    """(dk, dv) for gqa_reduce: `out` unpacked, or new tensors (batch, seqlen, h_k, d) / varlen
    (total, h_k, d) of `out_dtype` (default: the partials' dtype if 16-bit, else bfloat16)."""
    if not validation._is_int(num_heads_kv) or num_heads_kv < 1:
        validation._fail(op, "num_heads_kv", "a positive int", num_heads_kv)
    if out_dtype is not None and out_dtype not in validation.HALF_DTYPES:
        validation._fail(op, "out_dtype", "None, torch.float16 or torch.bfloat16", out_dtype)
    if out is not None:
        if isinstance(out, torch.Tensor):
            if dv_partial is not None:
                validation._fail(op, "out", "a (dk, dv) pair because dv_partial is given", "a torch.Tensor")
            dk, dv = out, None
        elif isinstance(out, (tuple, list)) and len(out) == 2:
            dk, dv = out
        else:
            validation._fail(op, "out", "None, a tensor (dk) or a (dk, dv) pair",
                             f"a {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list))
                                                          else ""))
        if out_dtype is not None and isinstance(dk, torch.Tensor) and dk.dtype != out_dtype:
            validation._fail(op, "out_dtype", f"None or {dk.dtype} (the dtype of out)", out_dtype)
        return dk, dv
    outputs = []
    for name, partial in (("dk_partial", dk_partial), ("dv_partial", dv_partial)):
        if partial is None:
            outputs.append(None)
            continue
        validation._check_tensor(op, name, partial)
        validation._check_rank(op, name, partial, varlen)
        h_q = partial.shape[-2]
        if h_q < 1 or h_q % num_heads_kv != 0:
            validation._fail(op, "num_heads_kv", f"a divisor of the {h_q} query heads ({name}.shape[-2])",
                             num_heads_kv)
        dtype = out_dtype
        if dtype is None:
            dtype = partial.dtype if partial.dtype in validation.HALF_DTYPES else torch.bfloat16
        shape = tuple(partial.shape[:-2]) + (num_heads_kv, partial.shape[-1])
        outputs.append(torch.empty(shape, dtype=dtype, device=partial.device))
    return outputs[0], outputs[1]


def gqa_reduce(
    dk_partial: torch.Tensor,
    dv_partial: Optional[torch.Tensor] = None,
    *,
    num_heads_kv: int,
    cu_seqlens: Optional[torch.Tensor] = None,
    seqused: Optional[torch.Tensor] = None,
    out: Union[None, torch.Tensor, tuple] = None,
    out_dtype: Optional[torch.dtype] = None,
    scale_dk: float = 1.0,
    scale_dv: float = 1.0,
    check_inputs: Optional[bool] = None,
    _arch: int = 0,
):
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
    varlen = cu_seqlens is not None
    dk, dv = _reduce_outputs(op, dk_partial, dv_partial, num_heads_kv, varlen, out, out_dtype)
    if (_op_checks_first(dk_partial, check_inputs) and type(_arch) is int and type(scale_dk) in _NUMBER_TYPES
            and type(scale_dv) in _NUMBER_TYPES and (out is None or _heads_of(dk) == num_heads_kv)):
        try:
            torch.ops.flash_epilogue.gqa_reduce(dk_partial, dv_partial, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused,
                                                scale_dk=float(scale_dk), scale_dv=float(scale_dv), _arch=_arch)
        except Exception:
            _explain(_validate_reduce, op, dk_partial, dv_partial, dk, dv, cu_seqlens, seqused, scale_dk, scale_dv,
                     _arch, num_heads_kv)
            raise
    else:
        problem = _validate_reduce(op, dk_partial, dv_partial, dk, dv, cu_seqlens, seqused, scale_dk, scale_dv, _arch,
                                   num_heads_kv)
        _content_checks(check_inputs, op, problem, cu_seqlens, seqused)
        torch.ops.flash_epilogue.gqa_reduce(dk_partial, dv_partial, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused,
                                            scale_dk=float(scale_dk), scale_dv=float(scale_dv), _arch=_arch)
    if _DEBUG:
        _debug_sync(op, dk.device)
    return dk if dv_partial is None else (dk, dv)


def _heads_of(t) -> Optional[int]:
    """t.shape[-2] of a tensor of rank >= 2, else None."""
    return t.shape[-2] if isinstance(t, torch.Tensor) and t.dim() >= 2 else None


@_register_fake_if_defined("flash_epilogue::gqa_accumulate")
def _gqa_accumulate_fake(dk_partial, dv_partial, dk_accum, dv_accum, semaphores=None, *, cu_seqlens=None,
                         seqused=None, deterministic=False, _arch=0) -> None:
    _check_fake_devices("gqa_accumulate", (("dk_partial", dk_partial), ("dv_partial", dv_partial),
                                           ("dk_accum", dk_accum), ("dv_accum", dv_accum), ("semaphores", semaphores),
                                           ("cu_seqlens", cu_seqlens), ("seqused", seqused)))


@_register_fake_if_defined("flash_epilogue::gqa_postprocess")
def _gqa_postprocess_fake(dk_accum, dv_accum, dk, dv, *, scale_dk=1.0, scale_dv=1.0, cu_seqlens=None, seqused=None,
                          _arch=0) -> None:
    _check_fake_devices("gqa_postprocess", (("dk_accum", dk_accum), ("dv_accum", dv_accum), ("dk", dk), ("dv", dv),
                                            ("cu_seqlens", cu_seqlens), ("seqused", seqused)))


@_register_fake_if_defined("flash_epilogue::gqa_accum_to_dense")
def _gqa_accum_to_dense_fake(accum, out, *, head_dim, cu_seqlens=None, seqused=None, _arch=0) -> None:
    _check_fake_devices("gqa_accum_to_dense", (("accum", accum), ("out", out), ("cu_seqlens", cu_seqlens),
                                               ("seqused", seqused)))


@_register_fake_if_defined("flash_epilogue::gqa_reduce")
def _gqa_reduce_fake(dk_partial, dv_partial, dk, dv, *, cu_seqlens=None, seqused=None, scale_dk=1.0, scale_dv=1.0,
                     _arch=0) -> None:
    _check_fake_devices("gqa_reduce", (("dk_partial", dk_partial), ("dv_partial", dv_partial), ("dk", dk), ("dv", dv),
                                       ("cu_seqlens", cu_seqlens), ("seqused", seqused)))
