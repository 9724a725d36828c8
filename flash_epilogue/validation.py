"""Input validation of the flash_epilogue ops, over tensor metadata only.

Everything here reads dtype, device, shape, strides, storage offset and (for tensors that
own real memory) data_ptr; nothing reads tensor contents, so validation never syncs with
the device and works on meta/fake tensors. The one exception is
:func:`check_seqlens_contents` and :func:`check_index_contents`, which copy cu_seqlens/seqused
or batch_idx/head_idx to the host and run only when the caller asks for it.

Every rejected input raises :class:`FlashEpilogueInputError` with the message
``"flash_epilogue.<op>: <arg>: expected <expected>, got <actual>"``.

csrc/bindings.cpp makes the same checks in the same order with the same messages (the wrappers
call the op first and run this validation only when the op raises): change both together;
tests/test_cpp_parity.py compares them over the validation test suites.

The device checks come last and go through three module-level functions
(:func:`_is_cuda_device`, :func:`_device_capability`, :func:`_compiled_archs`) that tests
monkeypatch to reach them with CPU tensors.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NoReturn, Optional, Sequence

import torch

from ._config import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, TileConfig, gqa_accum_shape, gqa_semaphore_numel, tile_config

__all__ = [
    "FlashEpilogueInputError",
    "FlashEpilogueBuildError",
    "StoreProblem",
    "GQAProblem",
    "validate_store",
    "validate_store_zero",
    "validate_gqa_accumulate",
    "validate_gqa_postprocess",
    "validate_gqa_accum_to_dense",
    "validate_gqa_reduce",
    "resolve_arch",
    "check_seqlens_contents",
    "check_index_contents",
    "normalized_strides",
]

ALIGN_BYTES = 16  # TMA / 16-byte vector stores: strides and start addresses
SUPPORTED_CAPABILITIES = ((9, 0),)
HALF_DTYPES = (torch.float16, torch.bfloat16)
ACCUM_DTYPES = (torch.float32,)
SEQLEN_DTYPES = (torch.int32,)

_BATCHED_DIMS = "(batch, seqlen, heads, headdim)"
_VARLEN_DIMS = "(total_tokens, heads, headdim)"


class FlashEpilogueInputError(ValueError):
    """An op argument is not acceptable (dtype, shape, layout, device, contents)."""


class FlashEpilogueBuildError(RuntimeError):
    """The package was installed without the CUDA kernels an op needs."""


@dataclass(frozen=True)
class StoreProblem:
    batch: int  # number of sequences (cu_seqlens.numel() - 1 in varlen)
    seqlen: int  # static seqlen, or the total token count in varlen
    num_heads: int
    head_dim: int  # d (dk's last dim)
    head_dim_v: int  # dv (dv's last dim)
    dtype: torch.dtype  # dk/dv dtype
    varlen: bool
    has_seqused: bool
    config: TileConfig
    device: torch.device


@dataclass(frozen=True)
class GQAProblem:
    batch: int  # number of sequences (cu_seqlens.numel() - 1 in varlen)
    seqlen: int  # static seqlen, or the total token count in varlen
    num_heads_kv: int  # h_k
    num_heads_q: Optional[int]  # h_q (None for the ops that see only KV heads: postprocess, accum_to_dense)
    head_dim: int  # d (accum_to_dense: the width of out)
    head_dim_v: int  # dv (accum_to_dense: the width of out)
    dtype: torch.dtype  # the outputs' dtype (float32 for accumulate and accum_to_dense)
    varlen: bool
    has_seqused: bool
    arch: int  # the code path the accumulator layout belongs to: 90, or 80 (0 resolved for the device)
    config: TileConfig
    accum_shape: Optional[tuple[int, int, int, int]]  # (batch_extent, h_k, num_tiles, tile_elems); None for reduce
    device: torch.device

    @property
    def group(self) -> Optional[int]:
        """Query heads per KV head (None when the op sees no query heads)."""
        return None if self.num_heads_q is None else self.num_heads_q // max(self.num_heads_kv, 1)


# --------------------------------------------------------------------------------------------
# Device hooks (monkeypatched by the CPU tests)


def _is_cuda_device(device: torch.device) -> bool:
    return device.type == "cuda"


def _device_capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def _compiled_archs() -> tuple[str, ...]:
    from ._extension import compiled_archs  # noqa: PLC0415 (lazy: loading may define fallback ops)

    return compiled_archs()


# --------------------------------------------------------------------------------------------
# Shared helpers (reused by every op's validator)


def _fail(op: str, arg: str, expected, got) -> NoReturn:
    raise FlashEpilogueInputError(f"flash_epilogue.{op}: {arg}: expected {expected}, got {got}")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d) for d in dtypes)


def _check_tensor(op: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, name, "a torch.Tensor", type(t).__name__)


def _check_dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        _fail(op, f"{name}: dtype", _dtype_names(allowed), t.dtype)


def _check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        _fail(op, f"{name}: dtype", f"{ref.dtype} (the dtype of {ref_name})", t.dtype)


def _check_rank(op: str, name: str, t: torch.Tensor, varlen: bool) -> None:
    rank, dims = (3, _VARLEN_DIMS) if varlen else (4, _BATCHED_DIMS)
    if t.dim() != rank:
        why = "cu_seqlens is given" if varlen else "cu_seqlens is None"
        _fail(op, f"{name}: rank", f"{rank} dims {dims} because {why}", f"{t.dim()} dims, shape {_shape(t)}")


def _check_same_shape(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.shape != ref.shape:
        _fail(op, f"{name}: shape", f"{_shape(ref)} (the shape of {ref_name})", _shape(t))


def _check_same_leading_shape(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """t and ref agree on every dim but the last (dv may have its own head dim)."""
    if t.shape[:-1] != ref.shape[:-1]:
        _fail(op, f"{name}: shape", f"{_shape(ref)[:-1] + ('*',)} ({ref_name}'s shape but the last dim)",
              _shape(t))


def _check_head_dim(op: str, name: str, d: int) -> None:
    if d <= 0 or d % HEAD_DIM_MULTIPLE != 0 or d > MAX_HEAD_DIM:
        _fail(op, f"{name}: head dim", f"a multiple of {HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}]", d)


def _check_last_stride(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.stride(-1) != 1:
        _fail(op, f"{name}: stride(-1)", "1 (last dim contiguous)", f"{t.stride(-1)} (strides {t.stride()})")


def _stride_multiple(element_size: int) -> int:
    return max(ALIGN_BYTES // element_size, 1)


def _check_stride_values(op: str, name: str, shape: Sequence[int], strides: Sequence[int],
                         element_size: int) -> None:
    """Every stride but the last: non-negative multiple of 16 bytes; dims of size <= 1 ignored."""
    multiple = _stride_multiple(element_size)
    for i in range(len(shape) - 1):
        if shape[i] <= 1:
            continue
        s = strides[i]
        if s < 0 or s % multiple != 0:
            _fail(op, f"{name}: stride({i})",
                  f"a non-negative multiple of {multiple} elements ({ALIGN_BYTES} bytes)",
                  f"{s} (shape {tuple(shape)}, strides {tuple(strides)})")


def _check_strides(op: str, name: str, t: torch.Tensor) -> None:
    if t.numel() == 0:  # no memory is touched: the kernels return early
        return
    _check_stride_values(op, name, _shape(t), t.stride(), t.element_size())


def normalized_strides(t: torch.Tensor) -> tuple[int, ...]:
    """t's strides with those of size-1 dims replaced by a valid TMA stride (the 16-byte
    rounded extent of the inner dims); ``t.as_strided(t.shape, normalized_strides(t))``
    addresses the same elements as t."""
    multiple = _stride_multiple(t.element_size())
    out = list(t.stride())
    for i in range(t.dim() - 1):
        if t.shape[i] == 1:
            inner = 1 + sum((n - 1) * s for n, s in zip(t.shape[i + 1:], t.stride()[i + 1:]) if n > 1)
            out[i] = -(-inner // multiple) * multiple
    return tuple(out)


def _has_real_data(t: torch.Tensor) -> bool:
    """True when data_ptr() is a real address (not meta, not a fake tensor under compile)."""
    if t.device.type == "meta":
        return False
    if type(t) is torch.Tensor:  # fast path: a plain tensor is never fake (FakeTensor is a subclass)
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        return True
    return not is_fake(t)


def _check_alignment(op: str, name: str, t: torch.Tensor) -> None:
    # Traced by torch.compile there is no address to look at (data_ptr breaks the graph): the C++
    # op makes this check when the compiled code runs.
    if t.numel() == 0 or torch.compiler.is_compiling():
        return
    if _has_real_data(t):
        ptr = t.data_ptr()
        if ptr % ALIGN_BYTES != 0:
            _fail(op, f"{name}: data_ptr", f"a {ALIGN_BYTES}-byte aligned address",
                  f"{ptr:#x} (address % {ALIGN_BYTES} = {ptr % ALIGN_BYTES})")
    else:
        offset = t.storage_offset() * t.element_size()
        if offset % ALIGN_BYTES != 0:
            _fail(op, f"{name}: storage_offset", f"a multiple of {ALIGN_BYTES} bytes",
                  f"{t.storage_offset()} elements = {offset} bytes")


def _byte_range(t: torch.Tensor) -> tuple[object, int, int]:
    """(memory key, first byte, end byte) spanned by t; two tensors may overlap only when
    their keys are equal. Real tensors use absolute addresses (catches aliasing across
    storage objects); meta/fake tensors use their storage identity and offset."""
    size = t.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    if _has_real_data(t):
        key: object = ("address", t.device)
        start = t.data_ptr()
    else:
        key = ("storage", t.device, t.untyped_storage()._cdata)
        start = t.storage_offset() * size
    return key, start, start + extent * size


def _elements_coincide(t: torch.Tensor, other: torch.Tensor, delta_bytes: int) -> bool:
    """Whether some element of `t` and one of `other` (which starts `delta_bytes` after t) share
    memory. Exact for equal element sizes (a bounded search over the strides, so packed layouts
    such as dk = kv[:, :, 0], dv = kv[:, :, 1] are told apart); conservative (True) otherwise."""
    size = t.element_size()
    if other.element_size() != size or delta_bytes % size != 0:
        return True
    # sum over dims of x_d * stride_d == delta, x_d in [0, n-1] for t and [-(n-1), 0] for other
    terms: dict[int, list[int]] = {}
    for sign, tensor in ((1, t), (-1, other)):
        for n, stride in zip(tensor.shape, tensor.stride()):
            if n > 1 and stride != 0:
                lo_hi = terms.setdefault(abs(stride), [0, 0])
                reach = (n - 1) * (1 if (sign > 0) == (stride > 0) else -1)
                lo_hi[0 if reach < 0 else 1] += reach
    items = sorted(((s, lo, hi) for s, (lo, hi) in terms.items()), reverse=True)
    suffix_lo, suffix_hi = [0] * (len(items) + 1), [0] * (len(items) + 1)
    for k in range(len(items) - 1, -1, -1):
        s, lo, hi = items[k]
        suffix_lo[k], suffix_hi[k] = suffix_lo[k + 1] + lo * s, suffix_hi[k + 1] + hi * s
    budget = [100_000]

    def reachable(k: int, rem: int) -> bool:
        if k == len(items):
            return rem == 0
        budget[0] -= 1
        if budget[0] < 0:
            return True  # too many candidates to rule out: assume they coincide
        s, lo, hi = items[k]
        first = max(lo, -((suffix_hi[k + 1] - rem) // s))  # ceil((rem - suffix_hi) / s)
        last = min(hi, (rem - suffix_lo[k + 1]) // s)
        return any(reachable(k + 1, rem - x * s) for x in range(first, last + 1))

    return reachable(0, delta_bytes // size)


def _check_no_overlap(op: str, name: str, t: torch.Tensor, other_name: str, other: torch.Tensor,
                      ranges: Optional[dict] = None) -> None:
    """`t` shares no element with `other`. `ranges` (id -> _byte_range) avoids recomputing them."""
    if t.numel() == 0 or other.numel() == 0 or torch.compiler.is_compiling():
        return
    key_a, a0, a1 = ranges[id(t)] if ranges else _byte_range(t)
    key_b, b0, b1 = ranges[id(other)] if ranges else _byte_range(other)
    if key_a == key_b and a0 < b1 and b0 < a1 and _elements_coincide(t, other, b0 - a0):
        _fail(op, f"{name}: memory", f"no overlap with {other_name}",
              f"bytes [{a0:#x}, {a1:#x}) overlapping {other_name}'s [{b0:#x}, {b1:#x})")


def _check_index_tensor(op: str, name: str, t, numel: Optional[int], numel_why: str = "") -> None:
    """An int32, 1-D, contiguous tensor of ``numel`` elements (any number when None)."""
    _check_tensor(op, name, t)
    _check_dtype(op, name, t, SEQLEN_DTYPES)
    if t.dim() != 1:
        _fail(op, f"{name}: rank", "1 dim", f"{t.dim()} dims, shape {_shape(t)}")
    if t.numel() > 1 and t.stride(0) != 1:
        _fail(op, f"{name}: stride(0)", "1 (contiguous)", t.stride(0))
    if numel is not None and t.numel() != numel:
        _fail(op, f"{name}: numel", f"{numel} ({numel_why})", t.numel())


def _is_int(v) -> bool:
    """A Python int (or a symbolic one under torch.compile), not a bool."""
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def _check_seqlens_meta(op: str, cu_seqlens, seqused, batch_dim: int, batch_name: str = "dk") -> int:
    """Metadata checks of cu_seqlens/seqused; returns the batch size.

    ``batch_dim`` is ``batch_name``.shape[0] in the batched layout; ignored in varlen (cu_seqlens
    given), where the batch is cu_seqlens.numel() - 1 (at least 1).
    """
    if cu_seqlens is not None:
        _check_tensor(op, "cu_seqlens", cu_seqlens)
        _check_dtype(op, "cu_seqlens", cu_seqlens, SEQLEN_DTYPES)
        if cu_seqlens.dim() != 1:
            _fail(op, "cu_seqlens: rank", "1 dim (batch + 1,)", f"{cu_seqlens.dim()} dims, shape {_shape(cu_seqlens)}")
        if cu_seqlens.numel() > 1 and cu_seqlens.stride(0) != 1:
            _fail(op, "cu_seqlens: stride(0)", "1 (contiguous)", cu_seqlens.stride(0))
        if cu_seqlens.numel() < 2:
            _fail(op, "cu_seqlens: numel", "batch + 1 >= 2 (at least one sequence)", cu_seqlens.numel())
        batch = cu_seqlens.numel() - 1
        why = "batch = cu_seqlens.numel() - 1"
    else:
        batch = batch_dim
        why = f"batch = {batch_name}.shape[0]"
    if seqused is not None:
        _check_index_tensor(op, "seqused", seqused, batch, why)
    return batch


def _check_devices(op: str, tensors: Sequence[tuple[str, Optional[torch.Tensor]]]) -> torch.device:
    """All given tensors on one CUDA device with a supported capability, and kernels built.

    ``tensors`` is a sequence of (name, tensor or None); the first non-None is the reference.
    Returns the common device.
    """
    present = [(n, t) for n, t in tensors if t is not None]
    for name, t in present:
        if not _is_cuda_device(t.device):
            _fail(op, f"{name}: device", "a CUDA tensor", f"a tensor on {t.device}")
    ref_name, ref = present[0]
    for name, t in present[1:]:
        if t.device != ref.device:
            _fail(op, f"{name}: device", f"{ref.device} (the device of {ref_name})", t.device)
    device = ref.device
    archs = _compiled_archs()
    if not archs:
        raise FlashEpilogueBuildError(
            f"flash_epilogue.{op}: the package was installed without its CUDA kernels "
            "(FLASH_EPILOGUE_SKIP_CUDA_BUILD was set, or the extension flash_epilogue._C failed to "
            "import); reinstall on a machine with the CUDA toolkit: "
            "`pip install --no-build-isolation .` (with FLASH_EPILOGUE_SKIP_CUDA_BUILD unset)")
    major, minor = _device_capability(device)
    hopper = (major, minor) in SUPPORTED_CAPABILITIES and "sm_90a" in archs
    ampere = major == 8 and "sm_80" in archs  # an "80;90a" build: the sm_80 path runs on sm_8x
    if not (hopper or ampere):
        _fail(op, "device", f"a GPU of compute capability sm_90 (compiled for {', '.join(archs)})",
              f"{device} with compute capability sm_{major}{minor}")
    return device


# --------------------------------------------------------------------------------------------
# Op validators


def _output_problem(dk, dv, batch, varlen: bool, has_seqused: bool, device) -> StoreProblem:
    """The StoreProblem of validated outputs dk/dv (store and store_zero)."""
    d, dv_dim = int(dk.shape[-1]), int(dv.shape[-1])
    return StoreProblem(batch=int(batch), seqlen=int(dk.shape[0] if varlen else dk.shape[1]),
                        num_heads=int(dk.shape[-2]), head_dim=d, head_dim_v=dv_dim, dtype=dk.dtype, varlen=varlen,
                        has_seqused=has_seqused, config=tile_config(d, dv_dim), device=device)


def validate_store(dk_accum, dv_accum, dk, dv, cu_seqlens=None, seqused=None, *, op: str = "store") -> StoreProblem:
    """Validate the arguments of ``store`` (metadata only, no sync); returns the problem."""
    outputs = (("dk", dk), ("dv", dv))
    inputs = (("dk_accum", dk_accum), ("dv_accum", dv_accum))
    four = inputs + outputs
    varlen = cu_seqlens is not None

    for name, t in four:  # a
        _check_tensor(op, name, t)
    for name, t in inputs:  # b
        _check_dtype(op, name, t, ACCUM_DTYPES)
    _check_dtype(op, "dk", dk, HALF_DTYPES)
    _check_same_dtype(op, "dv", dv, "dk", dk)
    for name, t in four:  # c
        _check_rank(op, name, t, varlen)
    _check_same_shape(op, "dk_accum", dk_accum, "dk", dk)  # d
    _check_same_shape(op, "dv_accum", dv_accum, "dv", dv)
    _check_same_leading_shape(op, "dv", dv, "dk", dk)
    d, dv_dim = dk.shape[-1], dv.shape[-1]  # e
    _check_head_dim(op, "dk", d)
    _check_head_dim(op, "dv", dv_dim)
    for name, t in four:  # f
        _check_last_stride(op, name, t)
    for name, t in four:  # g
        _check_strides(op, name, t)
    for name, t in four:  # h
        _check_alignment(op, name, t)
    _check_no_overlaps(op, outputs, inputs)  # i
    batch = _check_seqlens_meta(op, cu_seqlens, seqused, dk.shape[0])  # j
    if cu_seqlens is not None or seqused is not None:
        _check_no_overlaps(op, outputs, (("cu_seqlens", cu_seqlens), ("seqused", seqused)))
    device = _check_devices(op, four + (("cu_seqlens", cu_seqlens), ("seqused", seqused)))  # k

    return _output_problem(dk, dv, batch, varlen, seqused is not None, device)


def validate_store_zero(dk, dv, cu_seqlens=None, seqused=None, batch_idx=None, head_idx=None, row_start=0,
                        row_end=None, *, op: str = "store_zero") -> StoreProblem:
    """Validate the arguments of ``store_zero`` (metadata only, no sync); returns the problem.

    ``batch_idx``/``head_idx``: None (all) or int32 1-D contiguous tensors of any length (0 too);
    their values are checked only by :func:`check_index_contents` (out-of-range entries are
    skipped by the kernel). ``row_start >= 0``; ``row_end`` None (to each sequence's end) or
    ``>= row_start``.
    """
    outputs = (("dk", dk), ("dv", dv))
    varlen = cu_seqlens is not None

    for name, t in outputs:  # a
        _check_tensor(op, name, t)
    _check_dtype(op, "dk", dk, HALF_DTYPES)  # b
    _check_same_dtype(op, "dv", dv, "dk", dk)
    for name, t in outputs:  # c
        _check_rank(op, name, t, varlen)
    _check_same_leading_shape(op, "dv", dv, "dk", dk)  # d
    d, dv_dim = dk.shape[-1], dv.shape[-1]  # e
    _check_head_dim(op, "dk", d)
    _check_head_dim(op, "dv", dv_dim)
    for name, t in outputs:  # f
        _check_last_stride(op, name, t)
    for name, t in outputs:  # g
        _check_strides(op, name, t)
    for name, t in outputs:  # h
        _check_alignment(op, name, t)
    _check_no_overlap(op, "dv", dv, "dk", dk)  # i
    batch = _check_seqlens_meta(op, cu_seqlens, seqused, dk.shape[0])  # j
    selections = (("batch_idx", batch_idx), ("head_idx", head_idx))
    for name, t in selections:
        if t is not None:
            _check_index_tensor(op, name, t, None)
    _check_no_overlaps(op, outputs, (("cu_seqlens", cu_seqlens), ("seqused", seqused)) + selections)
    if not _is_int(row_start):  # k
        _fail(op, "row_start", "an int", type(row_start).__name__)
    if row_start < 0:
        _fail(op, "row_start", ">= 0", row_start)
    if row_end is not None:
        if not _is_int(row_end):
            _fail(op, "row_end", "None or an int", type(row_end).__name__)
        if row_end < row_start:
            _fail(op, "row_end", f"None or >= row_start = {row_start}", row_end)
    device = _check_devices(op, outputs + (("cu_seqlens", cu_seqlens), ("seqused", seqused)) + selections)  # l

    return _output_problem(dk, dv, batch, varlen, seqused is not None, device)


def check_seqlens_contents(cu_seqlens, seqused, *, total: int, seqlen_static: Optional[int] = None,
                           op: str) -> None:
    """Content checks of cu_seqlens/seqused (host sync: call only when the user asks).

    cu_seqlens: first >= 0, non-decreasing, last <= ``total`` (the tensors' token count).
    seqused: each >= 0 and <= its segment length (varlen) or ``seqlen_static`` (batched;
    ``total`` when seqlen_static is None). Run the metadata checks first.
    """
    cu = None
    if cu_seqlens is not None:
        cu = [int(v) for v in cu_seqlens.tolist()]
        if cu and cu[0] < 0:
            _fail(op, "cu_seqlens[0]", ">= 0", cu[0])
        for i in range(1, len(cu)):
            if cu[i] < cu[i - 1]:
                _fail(op, f"cu_seqlens[{i}]", f">= cu_seqlens[{i - 1}] = {cu[i - 1]} (non-decreasing)", cu[i])
        if cu and cu[-1] > total:
            _fail(op, f"cu_seqlens[{len(cu) - 1}]", f"<= {total} (the tensors' token count)", cu[-1])
    if seqused is not None:
        su = [int(v) for v in seqused.tolist()]
        for b, n in enumerate(su):
            if n < 0:
                _fail(op, f"seqused[{b}]", ">= 0", n)
            if cu is not None:
                limit = cu[b + 1] - cu[b]
                why = f"the length of segment {b}, cu_seqlens[{b + 1}] - cu_seqlens[{b}]"
            else:
                limit = total if seqlen_static is None else seqlen_static
                why = "the static seqlen"
            if n > limit:
                _fail(op, f"seqused[{b}]", f"<= {limit} ({why})", n)


def check_index_contents(op: str, name: str, t, limit: int, *, limit_why: Optional[str] = None) -> None:
    """Content check of a selection tensor (batch_idx, head_idx): every value in [0, ``limit``).

    Host sync: call only when the user asks. Unchecked, the kernel skips out-of-range entries.
    ``t`` None (select all) passes. ``limit_why`` (e.g. "the batch size") is added to the message.
    """
    if t is None:
        return
    expected = f"a value in [0, {limit})" + (f" ({limit_why})" if limit_why else "")
    for i, v in enumerate(int(v) for v in t.reshape(-1).tolist()):
        if not 0 <= v < limit:
            _fail(op, f"{name}[{i}]", expected, v)


# --------------------------------------------------------------------------------------------
# GQA: accumulate, postprocess, accum_to_dense, reduce

GQA_ARCHS = (0, 80, 90)  # `_arch`: 0 = the device's own path
_ACCUM_DIMS = "(batch_extent, heads_kv, num_tiles, tile_elems)"


def _check_arch_value(op: str, arch) -> None:
    if not _is_int(arch) or int(arch) not in GQA_ARCHS:
        _fail(op, "_arch", "0 (the device's path), 80 or 90", arch)


def resolve_arch(device: Optional[torch.device], requested: int = 0) -> int:
    """The code path (90 or 80) an op runs for `requested` (0, 80 or 90) on `device`.

    0 picks the device's own path: 80 on an sm_8x GPU, 90 otherwise (sm_90; also for devices that
    are not CUDA devices, which the device checks reject later).
    """
    if requested:
        return int(requested)
    if device is not None and _is_cuda_device(device):
        try:
            major, _ = _device_capability(device)
        except Exception:  # noqa: BLE001 (a device we cannot query: the device checks say why)
            return 90
        return 80 if major == 8 else 90
    return 90


def _check_arch_device(op: str, device: torch.device, requested: int) -> None:
    """`_arch` = 90 needs an sm_90 GPU (the sm_80 path runs on both)."""
    if int(requested) == 90 and _is_cuda_device(device):
        major, minor = _device_capability(device)
        if (major, minor) not in SUPPORTED_CAPABILITIES:
            _fail(op, "_arch", f"0 or 80 on {device} (compute capability sm_{major}{minor})", requested)


def _check_scale(op: str, name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (numbers.Real, torch.SymInt, torch.SymFloat)):
        _fail(op, name, "a float", type(v).__name__)


def _check_accum_rank(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() != 4:
        _fail(op, f"{name}: rank", f"4 dims {_ACCUM_DIMS}", f"{t.dim()} dims, shape {_shape(t)}")


def _check_group(op: str, q_name: str, h_q: int, kv_name: str, h_k: int, kv_src: str) -> None:
    """h_k >= 1 and h_q a positive multiple of h_k (query head j belongs to KV head j // (h_q / h_k))."""
    if h_k < 1:
        _fail(op, f"{kv_name}: heads", f">= 1 ({kv_src}, the number of KV heads)", h_k)
    if h_q < 1 or h_q % h_k != 0:
        _fail(op, f"{q_name}: heads",
              f"a positive multiple of the {h_k} KV heads ({kv_src}): every KV head serves h_q / h_k query heads",
              f"{h_q} query heads ({q_name}.shape[-2])")


def _accum_why(batch: int, rows: int, h_k: int, d: int, dv: int, arch: int, varlen: bool) -> str:
    what = (f"{batch} sequences of {rows} total tokens" if varlen else f"batch {batch}, seqlen {rows}")
    return (f"the accumulator of {what}, {h_k} KV heads, head dims ({d}, {dv}) on the sm_{arch} path: "
            "allocate it with flash_epilogue.gqa_accumulator")


def _check_accum_shape(op: str, name: str, t: torch.Tensor, expected: tuple, why: str) -> None:
    if _shape(t) != tuple(expected):
        _fail(op, f"{name}: shape", f"{tuple(expected)} ({why})", _shape(t))


def _check_accum_geometry(op: str, accums, device, _arch: int, batch: int, rows: int, h_k: int, d: int, dv: int,
                          varlen: bool) -> tuple[int, tuple]:
    """The arch path and the accumulator shape of this problem; every accumulator must have it."""
    arch = resolve_arch(device, _arch)
    expected = gqa_accum_shape(batch, rows, h_k, d, dv, arch=arch, varlen=varlen)
    why = _accum_why(batch, rows, h_k, d, dv, arch, varlen)
    for name, t in accums:
        _check_accum_shape(op, name, t, expected, why)
    return arch, expected


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _check_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.numel() > 0 and not t.is_contiguous():
        _fail(op, f"{name}: strides", f"{_contiguous_strides(_shape(t))} (contiguous)", t.stride())


def _check_reduced_shape(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """t is ref with another number of heads (dim -2): (..., h_k, d) against (..., h_q, d)."""
    if t.shape[:-2] != ref.shape[:-2] or t.shape[-1] != ref.shape[-1]:
        _fail(op, f"{name}: shape", f"{_shape(ref)[:-2] + ('*',) + _shape(ref)[-1:]} ({ref_name}'s shape but the heads dim)",
              _shape(t))


def _check_no_overlaps(op: str, written: Sequence[tuple[str, Optional[torch.Tensor]]],
                       read: Sequence[tuple[str, Optional[torch.Tensor]]]) -> None:
    """No written tensor shares an element with another written one or with a read one."""
    if torch.compiler.is_compiling():  # as in _check_alignment: the C++ op checks at run time
        return
    written = [(n, t) for n, t in written if t is not None]
    read = [(n, t) for n, t in read if t is not None]
    ranges = {id(t): _byte_range(t) for _, t in written + read if t.numel()}
    for i, (name, t) in enumerate(written):
        for other_name, other in written[:i]:
            _check_no_overlap(op, name, t, other_name, other, ranges)
    for name, t in written:
        for other_name, other in read:
            _check_no_overlap(op, name, t, other_name, other, ranges)


def validate_gqa_accumulate(dk_partial, dv_partial, dk_accum, dv_accum, semaphores=None, cu_seqlens=None,
                            seqused=None, *, deterministic: bool = False, _arch: int = 0,
                            op: str = "gqa_accumulate") -> GQAProblem:
    """Validate the arguments of ``gqa_accumulate`` (metadata only, no sync); returns the problem.

    Partials: fp32 (batch, seqlen, h_q, d) / varlen (total, h_q, d), dv_partial with its own head
    dim; h_k = dk_accum.shape[1] divides h_q. Accumulators: fp32, contiguous, both of the shape
    :func:`gqa_accum_shape` gives. Semaphores (required when ``deterministic``): int32, 1-D,
    contiguous, :func:`gqa_semaphore_numel` entries.
    """
    partials = (("dk_partial", dk_partial), ("dv_partial", dv_partial))
    accums = (("dk_accum", dk_accum), ("dv_accum", dv_accum))
    four = partials + accums
    varlen = cu_seqlens is not None

    for name, t in four:  # a
        _check_tensor(op, name, t)
    if semaphores is not None:
        _check_tensor(op, "semaphores", semaphores)
    if not isinstance(deterministic, bool):
        _fail(op, "deterministic", "a bool", type(deterministic).__name__)
    _check_arch_value(op, _arch)
    for name, t in four:  # b
        _check_dtype(op, name, t, ACCUM_DTYPES)
    for name, t in partials:  # c
        _check_rank(op, name, t, varlen)
    for name, t in accums:
        _check_accum_rank(op, name, t)
    _check_same_leading_shape(op, "dv_partial", dv_partial, "dk_partial", dk_partial)  # d
    d, dv_dim = int(dk_partial.shape[-1]), int(dv_partial.shape[-1])
    _check_head_dim(op, "dk_partial", d)
    _check_head_dim(op, "dv_partial", dv_dim)
    h_q, h_k = int(dk_partial.shape[-2]), int(dk_accum.shape[1])
    _check_group(op, "dk_partial", h_q, "dk_accum", h_k, "dk_accum.shape[1]")
    batch = int(_check_seqlens_meta(op, cu_seqlens, seqused, dk_partial.shape[0], "dk_partial"))  # j
    rows = int(dk_partial.shape[0] if varlen else dk_partial.shape[1])
    arch, expected = _check_accum_geometry(op, accums, dk_partial.device, _arch, batch, rows, h_k, d, dv_dim, varlen)
    for name, t in partials:  # f, g
        _check_last_stride(op, name, t)
    for name, t in partials:
        _check_strides(op, name, t)
    for name, t in accums:
        _check_contiguous(op, name, t)
    for name, t in four:  # h
        _check_alignment(op, name, t)
    numel = gqa_semaphore_numel(expected)
    if semaphores is None and deterministic:
        _fail(op, "semaphores", f"an int32 tensor of >= {numel} entries because deterministic=True "
              "(allocate the accumulator with flash_epilogue.gqa_accumulator(..., deterministic=True))", "None")
    if semaphores is not None:
        _check_index_tensor(op, "semaphores", semaphores, None)
        if semaphores.numel() < numel:
            _fail(op, "semaphores: numel",
                  f">= {numel} (2 * batch_extent * num_tiles * heads_kv + 1 for accumulators of shape {expected})",
                  semaphores.numel())
    seqlens = (("cu_seqlens", cu_seqlens), ("seqused", seqused))
    _check_no_overlaps(op, accums + (("semaphores", semaphores),), partials + seqlens)  # i
    device = _check_devices(op, four + (("semaphores", semaphores),) + seqlens)  # k
    _check_arch_device(op, device, _arch)

    return GQAProblem(batch=batch, seqlen=rows, num_heads_kv=h_k, num_heads_q=h_q, head_dim=d, head_dim_v=dv_dim,
                      dtype=torch.float32, varlen=varlen, has_seqused=seqused is not None, arch=arch,
                      config=tile_config(d, dv_dim, arch), accum_shape=expected, device=device)


def validate_gqa_postprocess(dk_accum, dv_accum, dk, dv, cu_seqlens=None, seqused=None, *, scale_dk=1.0,
                             scale_dv=1.0, _arch: int = 0, op: str = "gqa_postprocess") -> GQAProblem:
    """Validate the arguments of ``gqa_postprocess`` (metadata only, no sync); returns the problem.

    dk/dv as the outputs of ``store`` (bf16/fp16, (batch, seqlen, h_k, d) / varlen (total, h_k, d),
    dv with its own head dim); the accumulators as for ``gqa_accumulate``, for dk/dv's problem.
    """
    accums = (("dk_accum", dk_accum), ("dv_accum", dv_accum))
    outputs = (("dk", dk), ("dv", dv))
    four = accums + outputs
    varlen = cu_seqlens is not None

    for name, t in four:  # a
        _check_tensor(op, name, t)
    _check_scale(op, "scale_dk", scale_dk)
    _check_scale(op, "scale_dv", scale_dv)
    _check_arch_value(op, _arch)
    for name, t in accums:  # b
        _check_dtype(op, name, t, ACCUM_DTYPES)
    _check_dtype(op, "dk", dk, HALF_DTYPES)
    _check_same_dtype(op, "dv", dv, "dk", dk)
    for name, t in accums:  # c
        _check_accum_rank(op, name, t)
    for name, t in outputs:
        _check_rank(op, name, t, varlen)
    _check_same_leading_shape(op, "dv", dv, "dk", dk)  # d
    d, dv_dim = int(dk.shape[-1]), int(dv.shape[-1])
    _check_head_dim(op, "dk", d)
    _check_head_dim(op, "dv", dv_dim)
    h_k = int(dk.shape[-2])
    batch = int(_check_seqlens_meta(op, cu_seqlens, seqused, dk.shape[0], "dk"))  # j
    rows = int(dk.shape[0] if varlen else dk.shape[1])
    arch, expected = _check_accum_geometry(op, accums, dk.device, _arch, batch, rows, h_k, d, dv_dim, varlen)
    for name, t in outputs:  # f, g
        _check_last_stride(op, name, t)
    for name, t in outputs:
        _check_strides(op, name, t)
    for name, t in accums:
        _check_contiguous(op, name, t)
    for name, t in four:  # h
        _check_alignment(op, name, t)
    seqlens = (("cu_seqlens", cu_seqlens), ("seqused", seqused))
    _check_no_overlaps(op, outputs, accums + seqlens)  # i
    device = _check_devices(op, four + seqlens)  # k
    _check_arch_device(op, device, _arch)

    return GQAProblem(batch=batch, seqlen=rows, num_heads_kv=h_k, num_heads_q=None, head_dim=d, head_dim_v=dv_dim,
                      dtype=dk.dtype, varlen=varlen, has_seqused=seqused is not None, arch=arch,
                      config=tile_config(d, dv_dim, arch), accum_shape=expected, device=device)


def validate_gqa_accum_to_dense(accum, out, cu_seqlens=None, seqused=None, *, head_dim: int, _arch: int = 0,
                                op: str = "gqa_accum_to_dense") -> GQAProblem:
    """Validate the arguments of ``gqa_accum_to_dense`` (metadata only, no sync); returns the problem.

    ``head_dim``: max(d, dv) of the accumulator (it names the tile config); out: fp32
    (batch, seqlen, h_k, w) / varlen (total, h_k, w) with w <= head_dim.
    """
    both = (("accum", accum), ("out", out))
    varlen = cu_seqlens is not None

    for name, t in both:  # a
        _check_tensor(op, name, t)
    if not _is_int(head_dim):
        _fail(op, "head_dim", "an int", type(head_dim).__name__)
    _check_arch_value(op, _arch)
    for name, t in both:  # b
        _check_dtype(op, name, t, ACCUM_DTYPES)
    _check_accum_rank(op, "accum", accum)  # c
    _check_rank(op, "out", out, varlen)
    _check_head_dim(op, "head_dim", int(head_dim))  # d
    w = int(out.shape[-1])
    _check_head_dim(op, "out", w)
    if w > head_dim:
        _fail(op, "out: head dim", f"<= head_dim = {head_dim}", w)
    h_k = int(out.shape[-2])
    batch = int(_check_seqlens_meta(op, cu_seqlens, seqused, out.shape[0], "out"))  # j
    rows = int(out.shape[0] if varlen else out.shape[1])
    arch, expected = _check_accum_geometry(op, (("accum", accum),), out.device, _arch, batch, rows, h_k,
                                           int(head_dim), int(head_dim), varlen)
    _check_last_stride(op, "out", out)  # f, g
    _check_strides(op, "out", out)
    _check_contiguous(op, "accum", accum)
    for name, t in both:  # h
        _check_alignment(op, name, t)
    seqlens = (("cu_seqlens", cu_seqlens), ("seqused", seqused))
    _check_no_overlaps(op, (("out", out),), (("accum", accum),) + seqlens)  # i
    device = _check_devices(op, both + seqlens)  # k
    _check_arch_device(op, device, _arch)

    return GQAProblem(batch=batch, seqlen=rows, num_heads_kv=h_k, num_heads_q=None, head_dim=w, head_dim_v=w,
                      dtype=torch.float32, varlen=varlen, has_seqused=seqused is not None, arch=arch,
                      config=tile_config(int(head_dim), None, arch), accum_shape=expected, device=device)


def validate_gqa_reduce(dk_partial, dv_partial, dk, dv, cu_seqlens=None, seqused=None, *, scale_dk=1.0,
                        scale_dv=1.0, _arch: int = 0, op: str = "gqa_reduce") -> GQAProblem:
    """Validate the arguments of ``gqa_reduce`` (metadata only, no sync); returns the problem.

    Partials: fp32 or dk's 16-bit dtype (both the same), (batch, seqlen, h_q, d) / varlen
    (total, h_q, d), any strides like the inputs of ``store``; dk/dv: bf16/fp16 with the partials'
    shape but h_k = dk.shape[-2] heads, h_k dividing h_q; dv (and dv_partial) None together.
    """
    varlen = cu_seqlens is not None
    _check_tensor(op, "dk_partial", dk_partial)  # a
    _check_tensor(op, "dk", dk)
    if dv_partial is None:
        if dv is not None:
            _fail(op, "dv", "None because dv_partial is None", type(dv).__name__)
    else:
        _check_tensor(op, "dv_partial", dv_partial)
        if not isinstance(dv, torch.Tensor):
            _fail(op, "dv", "a torch.Tensor because dv_partial is given", type(dv).__name__)
    partials = tuple((n, t) for n, t in (("dk_partial", dk_partial), ("dv_partial", dv_partial)) if t is not None)
    outputs = tuple((n, t) for n, t in (("dk", dk), ("dv", dv)) if t is not None)
    _check_scale(op, "scale_dk", scale_dk)
    _check_scale(op, "scale_dv", scale_dv)
    _check_arch_value(op, _arch)
    _check_dtype(op, "dk", dk, HALF_DTYPES)  # b
    if dv is not None:
        _check_same_dtype(op, "dv", dv, "dk", dk)
    if dk_partial.dtype not in (torch.float32, dk.dtype):
        _fail(op, "dk_partial: dtype", f"torch.float32 or {dk.dtype} (the dtype of dk)", dk_partial.dtype)
    if dv_partial is not None:
        _check_same_dtype(op, "dv_partial", dv_partial, "dk_partial", dk_partial)
    for name, t in partials + outputs:  # c
        _check_rank(op, name, t, varlen)
    if dv_partial is not None:  # d
        _check_same_leading_shape(op, "dv_partial", dv_partial, "dk_partial", dk_partial)
    _check_reduced_shape(op, "dk", dk, "dk_partial", dk_partial)
    if dv is not None:
        _check_reduced_shape(op, "dv", dv, "dv_partial", dv_partial)
        _check_same_leading_shape(op, "dv", dv, "dk", dk)  # the same KV heads
    d = int(dk.shape[-1])
    dv_dim = int(dv.shape[-1]) if dv is not None else d
    _check_head_dim(op, "dk", d)
    if dv is not None:
        _check_head_dim(op, "dv", dv_dim)
    h_q, h_k = int(dk_partial.shape[-2]), int(dk.shape[-2])
    _check_group(op, "dk_partial", h_q, "dk", h_k, "dk.shape[-2]")
    for name, t in partials + outputs:  # f, g, h
        _check_last_stride(op, name, t)
    for name, t in partials + outputs:
        _check_strides(op, name, t)
    for name, t in partials + outputs:
        _check_alignment(op, name, t)
    _check_no_overlaps(op, outputs, partials)  # i
    batch = int(_check_seqlens_meta(op, cu_seqlens, seqused, dk_partial.shape[0], "dk_partial"))  # j
    seqlens = (("cu_seqlens", cu_seqlens), ("seqused", seqused))
    for out_name, out in outputs:
        for in_name, inp in seqlens:
            if inp is not None:
                _check_no_overlap(op, out_name, out, in_name, inp)
    device = _check_devices(op, partials + outputs + seqlens)  # k
    _check_arch_device(op, device, _arch)
    arch = resolve_arch(device, _arch)

    return GQAProblem(batch=batch, seqlen=int(dk.shape[0] if varlen else dk.shape[1]), num_heads_kv=h_k,
                      num_heads_q=h_q, head_dim=d, head_dim_v=dv_dim, dtype=dk.dtype, varlen=varlen,
                      has_seqused=seqused is not None, arch=arch, config=tile_config(d, dv_dim, arch),
                      accum_shape=None, device=device)
