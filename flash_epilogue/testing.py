"""Helpers for testing a kernel bitwise against :mod:`flash_epilogue.reference`: canary-filled outputs, a bitwise
comparison that says where the first difference is and how many elements differ, seeded inputs spread over many
binades, and the sequence geometry of batched, varlen and seqused problems.

The method: carve each output out of a canary-filled buffer (:func:`carve`), apply the reference to a clone of the
buffer (:func:`same_view` finds the output in the clone), run the kernel, and compare the WHOLE buffers with
:func:`assert_bits`: a wrong value, a missed element and a write outside the valid rows all show.

Plain PyTorch: importing this module needs neither the CUDA extension nor a GPU. Functions that allocate take a
``device`` ("cuda" by default; any torch device works) and touch it only when called.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

__all__ = ["CANARY_BITS", "LAYOUTS", "bits", "same", "first_diff", "assert_bits", "generator", "rand", "canary",
           "carve", "input_view", "same_view", "int32", "cu_seqlens", "Problem", "problem", "block_n", "call_op"]

CANARY_BITS = 0x7FBF
"""The 16-bit canary: a NaN payload that no conversion to bf16 or fp16 produces, so an element a kernel did not write
keeps exactly these bits."""

LAYOUTS = ("plain", "padded", "transposed")
"""The layouts of :func:`carve`: contiguous, a view with slack around it on every dim, heads-major storage."""

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as a view of the signed integer dtype of its element size (int8/16/32/64): same shape,
    strides and device. Equal bits mean equal elements, NaN payloads and the sign of zero included."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` (on one device) have the same shape, dtype and bits."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def first_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    """How many elements of ``got`` differ bitwise from ``want`` (same shape and element size, one device) and the
    first of them in row-major order: its index, both values and both bit patterns; "equal" where none differs."""
    idx = (bits(got) != bits(want)).nonzero()
    if idx.shape[0] == 0:
        return "equal"
    i = tuple(idx[0].tolist())
    mask = (1 << 8 * got.element_size()) - 1
    return (f"{idx.shape[0]} elements differ, first at {list(i)}: got {got[i].item()} "
            f"(0x{bits(got)[i].item() & mask:x}), want {want[i].item()} (0x{bits(want)[i].item() & mask:x})")


def assert_bits(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    """Raise AssertionError unless ``got`` and ``want`` (one device) have the same shape, dtype and bits; the message
    starts with ``name`` and says how many elements differ and where the first is (:func:`first_diff`)."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}"
    assert torch.equal(bits(got), bits(want)), f"{name}: {first_diff(got, want)}"


def generator(seed: int, device="cuda") -> torch.Generator:
    """A torch.Generator on ``device``, seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)


def rand(shape: Sequence[int], gen: torch.Generator | None = None, dtype=torch.float32, device="cuda",
         binades: int = 8) -> torch.Tensor:
    """A new contiguous tensor of ``shape`` and ``dtype``: normal samples times 2^e, e uniform in [-binades, binades],
    drawn in fp32 and rounded once to ``dtype``. Spread over many binades, sums depend on the order of their additions
    and conversions round large and tiny magnitudes. On ``gen``'s device when ``gen`` is given, else on ``device``."""
    device = device if gen is None else gen.device
    x = torch.randn(shape, device=device, generator=gen)
    e = torch.randint(-binades, binades + 1, shape, device=device, generator=gen).float()
    return (x * torch.exp2(e)).to(dtype)


def canary(shape: Sequence[int], dtype=torch.bfloat16, device="cuda") -> torch.Tensor:
    """A new contiguous tensor of ``shape`` filled with the canary: :data:`CANARY_BITS` for the 16-bit float dtypes
    (bf16, fp16), NaN for wider float dtypes (fp32, fp64: a read of it poisons a sum)."""
    if dtype.itemsize == 2:
        return torch.full(shape, CANARY_BITS, dtype=torch.int16, device=device).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def carve(shape: Sequence[int], dtype, layout: str, device="cuda", fill: str = "canary"):
    """(buffer, view): a new buffer and a view of ``shape`` into it, laid out per ``layout`` (one of :data:`LAYOUTS`);
    ``shape`` is (batch, seqlen, heads, head_dim) or (total_tokens, heads, head_dim).

    - "plain": the view is the whole buffer, contiguous.
    - "padded": slack around the view on every dim (rows, heads, 8 head-dim columns on each side; batch or tokens),
      so rows, heads and the head dim have pitches of their own and the view starts past the buffer's start.
    - "transposed": heads-major storage ((batch, heads, seqlen, d) or (heads, total_tokens, d)) seen as ``shape``,
      with slack rows (and a slack head, batched).

    fill: "canary" (:func:`canary`: compare the whole buffer after a kernel wrote the view) or "empty" (torch.empty:
    uninitialized, for tools that report reads of uninitialized memory such as compute-sanitizer's initcheck)."""
    if fill not in ("canary", "empty"):
        raise ValueError(f"fill: expected 'canary' or 'empty', got {fill!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if len(shape) not in (3, 4):
        raise ValueError(f"shape: expected (batch, seqlen, heads, d) or (total_tokens, heads, d), got {tuple(shape)}")

    def new(s):
        return canary(s, dtype, device) if fill == "canary" else torch.empty(s, dtype=dtype, device=device)

    d = shape[-1]
    if layout == "plain":
        buf = new(shape)
        return buf, buf
    if len(shape) == 4:
        b, s, h, _ = shape
        if layout == "padded":
            buf = new((b + 1, s + 3, h + 2, d + 16))
            return buf, buf[1:, 2 : s + 2, 1 : h + 1, 8 : d + 8]
        buf = new((b, h + 1, s + 2, d + 8))
        return buf, buf[:, 1:, 1 : s + 1, :d].transpose(1, 2)
    t, h, _ = shape
    if layout == "padded":
        buf = new((t + 5, h + 1, d + 8))
        return buf, buf[3 : t + 3, 1:, 8:]
    buf = new((h, t + 4, d))
    return buf, buf[:, 2 : t + 2].transpose(0, 1)


def input_view(shape: Sequence[int], layout: str, gen: torch.Generator, dtype=torch.float32, binades: int = 8,
               fill: str = "canary") -> torch.Tensor:
    """An input: :func:`rand` values (``gen``, ``dtype``, ``binades``) in a view of ``shape`` carved per ``layout``
    (:func:`carve`, on ``gen``'s device) out of a buffer filled per ``fill``: with the canary (NaN for fp32) a read
    outside the view poisons the result; "empty" leaves the rest uninitialized."""
    _, view = carve(shape, dtype, layout, gen.device, fill)
    return view.copy_(rand(shape, gen, dtype, binades=binades))


def same_view(clone: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The view of ``clone`` (a copy of ``view``'s buffer, e.g. ``buffer.clone()``) at ``view``'s storage offset,
    shape and strides: where to apply the reference so that the whole clone can be compared with the buffer."""
    return clone.as_strided(view.shape, view.stride(), view.storage_offset())


def int32(*vals: int, device="cuda") -> torch.Tensor:
    """An int32 tensor of ``vals`` (1-D, on ``device``): seqused, batch_idx, head_idx, cu_seqlens as given."""
    return torch.tensor(vals, dtype=torch.int32, device=device)


def cu_seqlens(lens: Sequence[int], device="cuda") -> torch.Tensor:
    """The int32 cu_seqlens of sequences of lengths ``lens``: (len(lens) + 1,), [0, l0, l0 + l1, ...], on ``device``."""
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


@dataclasses.dataclass(frozen=True)
class Problem:
    """The sequence geometry of one problem, as the ops and the reference functions take it (see :func:`problem`).

    lead: the leading dims of every per-token tensor: (batch, seqlen) batched, (total_tokens,) varlen; a tensor of
        ``heads`` heads of head dim ``d`` has shape ``lead + (heads, d)``.
    seq: the sequence keyword arguments without seqused: {} batched, {"cu_seqlens": int32 (batch + 1,)} varlen.
    seq_used: ``seq`` plus {"seqused": int32 (batch,)} where the problem has seqused (else equal to ``seq``).
    alloc: the geometry keyword arguments of flash_epilogue.gqa_accumulator: {"batch", "seqlen"} batched,
        {"cu_seqlens", "total_tokens"} varlen.
    """

    lead: tuple[int, ...]
    seq: dict
    seq_used: dict
    alloc: dict

    @property
    def varlen(self) -> bool:
        """True for a varlen problem (cu_seqlens)."""
        return "cu_seqlens" in self.seq

    @property
    def batch(self) -> int:
        """The number of sequences."""
        return self.seq["cu_seqlens"].numel() - 1 if self.varlen else self.lead[0]


def problem(batch: int | None = None, seqlen: int | None = None, lens: Sequence[int] | None = None, slack: int = 0,
            seqused: Sequence[int] | torch.Tensor | None = None, device="cuda") -> Problem:
    """The :class:`Problem` of a batched or a varlen layout, with or without seqused; int32 metadata on ``device``.

    Batched: ``batch`` sequences of ``seqlen`` rows (``lens`` None). Varlen: sequences of lengths ``lens`` packed one
    after the other, then ``slack`` rows that belong to no sequence (``batch`` and ``seqlen`` None). ``seqused``: the
    rows of each sequence that count (one entry per sequence; more than its rows are clamped by the ops), or None."""
    if lens is None:
        if batch is None or seqlen is None:
            raise ValueError("problem: give batch and seqlen (batched) or lens (varlen)")
        lead, seq, alloc, count = (batch, seqlen), {}, {"batch": batch, "seqlen": seqlen}, batch
    else:
        if batch is not None or seqlen is not None:
            raise ValueError("problem: lens (varlen) takes neither batch nor seqlen")
        cu, total = cu_seqlens(lens, device), sum(lens) + slack
        lead, seq, alloc, count = (total,), {"cu_seqlens": cu}, {"cu_seqlens": cu, "total_tokens": total}, len(lens)
    if seqused is None:
        return Problem(lead, seq, seq, alloc)
    if (n := seqused.numel() if isinstance(seqused, torch.Tensor) else len(seqused)) != count:
        raise ValueError(f"problem: seqused has {n} entries, expected one per sequence ({count})")
    used = seqused.to(device) if isinstance(seqused, torch.Tensor) else int32(*seqused, device=device)
    return Problem(lead, seq, {**seq, "seqused": used}, alloc)


def block_n(d: int, dv: int | None = None, arch: int = 90) -> int:
    """kBlockN, the rows of one tile, of the tile flash_epilogue runs head dims (d, dv) on, on the path ``arch`` (90,
    or 80 for the sm_80 path; 0 means 90): row counts around its multiples test the row predicates."""
    from flash_epilogue import tile_config  # the table of the build

    return tile_config(d, dv, arch=80 if arch == 80 else 90).block_n


_DEVICE_CHECK = "device: expected a CUDA tensor, got a tensor on cpu"


def call_op(device, op, *args, **kwargs):
    """``op(*args, **kwargs)`` for one of flash_epilogue's ops on tensors on ``device``: on CUDA, the op's result. On
    the CPU, a dry run: the op checks every argument and the device last, so it must raise ValueError with the device
    check's message ("device: expected a CUDA tensor, got a tensor on cpu"); returns None. Any other error propagates;
    a CPU call that raises nothing is an AssertionError."""
    if torch.device(device).type == "cuda":
        return op(*args, **kwargs)
    try:
        op(*args, **kwargs)
    except ValueError as e:
        if _DEVICE_CHECK in str(e):
            return None
        raise
    raise AssertionError(f"{getattr(op, '__name__', op)}: the call passed the device check on {device}")
