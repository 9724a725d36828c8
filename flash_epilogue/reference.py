"""Pure-PyTorch reference semantics of the epilogue ops (CPU or GPU, any strides).

These functions define what the CUDA kernels must produce, element for element:

* Layouts follow FlashAttention: batched ``(batch, seqlen, heads, headdim)`` or varlen
  ``(total_tokens, heads, headdim)`` with ``cu_seqlens`` int32 ``(batch + 1,)``; an optional
  ``seqused`` int32 ``(batch,)`` gives the valid length of each sequence.
* For batch ``b`` the valid rows are ``[start, start + length)`` with ``start = cu_seqlens[b]``
  (0 without cu_seqlens) and ``length = seqused[b]`` if given, else
  ``cu_seqlens[b+1] - cu_seqlens[b]``, else the static seqlen; both clamped to the tensor's
  extent (see :func:`sequence_bounds`). Nothing outside the valid rows is ever written.

The sequence metadata is read on the host (``.tolist()``), so these functions sync; they are
test oracles, not fast paths.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

__all__ = [
    "sequence_bounds",
    "store_reference",
    "store_zero_reference",
    "gqa_reduce_reference",
    "gqa_reduce_sequential_fp32",
    "gqa_accumulate_reference",
    "group_sum_reference",
]


def _to_list(t) -> Optional[list]:
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return [int(v) for v in t.detach().reshape(-1).tolist()]
    return [int(v) for v in t]


def sequence_bounds(batch: int, seqlen_or_total: int, cu_seqlens=None, seqused=None) -> list[tuple[int, int]]:
    """(start, length) of the valid rows of each batch, clamped to the tensor's extent.

    ``seqlen_or_total`` is the static seqlen (batched layout) or the total token count
    (varlen, when ``cu_seqlens`` is given). Start and length are never negative and
    ``start + length <= seqlen_or_total`` always holds, so bad metadata can never address
    rows outside the tensor (the kernels clamp the same way).
    """
    extent = max(int(seqlen_or_total), 0)
    cu = _to_list(cu_seqlens)
    su = _to_list(seqused)
    if cu is not None and len(cu) < batch + 1:
        raise ValueError(f"cu_seqlens has {len(cu)} entries, need batch + 1 = {batch + 1}")
    if su is not None and len(su) < batch:
        raise ValueError(f"seqused has {len(su)} entries, need batch = {batch}")
    bounds = []
    for b in range(batch):
        start = 0 if cu is None else cu[b]
        if su is not None:
            length = su[b]
        elif cu is not None:
            length = cu[b + 1] - cu[b]
        else:
            length = extent
        start = min(max(start, 0), extent)
        length = min(max(length, 0), extent - start)
        bounds.append((start, length))
    return bounds


def _layout(t: torch.Tensor, cu_seqlens) -> tuple[int, int, bool]:
    """(batch, seqlen_or_total, varlen) of a dk-like tensor."""
    if cu_seqlens is None:
        if t.dim() != 4:
            raise ValueError(f"expected (batch, seqlen, heads, headdim), got shape {tuple(t.shape)}")
        return t.shape[0], t.shape[1], False
    if t.dim() != 3:
        raise ValueError(f"expected (total_tokens, heads, headdim) with cu_seqlens, got shape {tuple(t.shape)}")
    return len(_to_list(cu_seqlens)) - 1, t.shape[0], True


def _rows(t: torch.Tensor, varlen: bool, b: int, r0: int, r1: int) -> torch.Tensor:
    """View of rows [r0, r1) of batch b (all heads, all columns)."""
    return t[r0:r1] if varlen else t[b, r0:r1]


def store_reference(dk_accum: torch.Tensor, dv_accum: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
                    cu_seqlens=None, seqused=None) -> None:
    """In place: the valid rows of dk/dv get ``accum.to(dk.dtype)``; everything else untouched."""
    if dk_accum.shape != dk.shape or dv_accum.shape != dv.shape:
        raise ValueError(f"accumulator shapes {tuple(dk_accum.shape)}/{tuple(dv_accum.shape)} "
                         f"differ from dk/dv {tuple(dk.shape)}/{tuple(dv.shape)}")
    if dk.shape[:-1] != dv.shape[:-1]:
        raise ValueError(f"dk {tuple(dk.shape)} and dv {tuple(dv.shape)} differ before the last dim")
    batch, extent, varlen = _layout(dk, cu_seqlens)
    for b, (start, length) in enumerate(sequence_bounds(batch, extent, cu_seqlens, seqused)):
        if length == 0:
            continue
        for src, dst in ((dk_accum, dk), (dv_accum, dv)):
            _rows(dst, varlen, b, start, start + length).copy_(
                _rows(src, varlen, b, start, start + length).to(dst.dtype))


def _as_index_list(idx, n: int) -> list[int]:
    """The selected indices in [0, n), in order; entries outside [0, n) (negative ones too: no
    Python-style wrap-around) are skipped, as the kernel skips them. None selects all."""
    if idx is None:
        return list(range(n))
    if isinstance(idx, int):
        idx = [idx]
    elif isinstance(idx, torch.Tensor):
        idx = idx.reshape(-1).tolist()
    return [int(i) for i in idx if 0 <= int(i) < n]


def store_zero_reference(dk: torch.Tensor, dv: torch.Tensor, *, cu_seqlens=None, seqused=None,
                         batch_idx: Optional[Iterable[int]] = None, head_idx: Optional[Iterable[int]] = None,
                         row_start: int = 0, row_end: Optional[int] = None) -> None:
    """In place: zero rows [row_start, row_end) (relative to each sequence start, clamped to
    the valid rows; ``row_end`` None = to the end) of the selected batches and heads of dk and
    dv. ``None`` selects all; an int, a sequence of ints or an integer tensor selects those:
    entries outside [0, batch) / [0, heads) are skipped, duplicates change nothing. Everything
    else untouched."""
    if dk.shape[:-1] != dv.shape[:-1]:
        raise ValueError(f"dk {tuple(dk.shape)} and dv {tuple(dv.shape)} differ before the last dim")
    batch, extent, varlen = _layout(dk, cu_seqlens)
    bounds = sequence_bounds(batch, extent, cu_seqlens, seqused)
    heads = None if head_idx is None else _as_index_list(head_idx, dk.shape[-2])
    for b in _as_index_list(batch_idx, batch):
        start, length = bounds[b]
        lo = min(max(int(row_start), 0), length)
        hi = length if row_end is None else min(max(int(row_end), 0), length)
        if hi <= lo:
            continue
        for t in (dk, dv):
            rows = _rows(t, varlen, b, start + lo, start + hi)
            if heads is None:
                rows.zero_()
            else:
                for h in heads:
                    rows[:, h].zero_()


def _group_view(partial: torch.Tensor, num_heads_kv: int) -> torch.Tensor:
    """(..., h_q, d) -> (..., h_k, group, d): q head j = kv head j // group, index j % group."""
    h_q = partial.shape[-2]
    if num_heads_kv <= 0 or h_q % num_heads_kv != 0:
        raise ValueError(f"num_heads_kv={num_heads_kv} must divide the {h_q} query heads of partial")
    return partial.unflatten(-2, (num_heads_kv, h_q // num_heads_kv))


def gqa_reduce_reference(partial: torch.Tensor, num_heads_kv: int, *, out_dtype: Optional[torch.dtype] = None,
                         cu_seqlens=None, seqused=None, scale: float = 1.0,
                         out: Optional[torch.Tensor] = None, sequential: bool = False) -> torch.Tensor:
    """Sum each group of query heads in fp64, multiply by ``scale``, cast to ``out_dtype``.

    ``partial`` is ``(batch, seqlen, h_q, d)`` or varlen ``(total, h_q, d)``. Only the valid
    rows are written: into ``out`` when given (everything else untouched; ``out_dtype``
    defaults to ``out.dtype``), else into a new zero-filled ``(..., h_k, d)`` tensor.

    ``sequential=True``: the kernel's arithmetic instead, bit for bit: the fp32 sum of
    :func:`gqa_reduce_sequential_fp32` (0 + p_0 + ... + p_{g-1}, times the scale rounded to fp32),
    then rounded to ``out_dtype`` (nearest even).
    """
    if out_dtype is None:
        if out is None:
            raise ValueError("gqa_reduce_reference: give out_dtype or out")
        out_dtype = out.dtype
    if sequential:
        reduced = gqa_reduce_sequential_fp32(partial, num_heads_kv, scale).to(out_dtype)
    else:
        grouped = _group_view(partial, num_heads_kv)
        reduced = (grouped.to(torch.float64).sum(dim=-2) * float(scale)).to(out_dtype)
    if out is None:
        out = torch.zeros(reduced.shape, dtype=out_dtype, device=partial.device)
    else:
        if out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype}, out_dtype is {out_dtype}")
        if out.shape != reduced.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(reduced.shape)}")
    batch, extent, varlen = _layout(partial, cu_seqlens)
    for b, (start, length) in enumerate(sequence_bounds(batch, extent, cu_seqlens, seqused)):
        if length:
            _rows(out, varlen, b, start, start + length).copy_(_rows(reduced, varlen, b, start, start + length))
    return out


def gqa_reduce_sequential_fp32(partial: torch.Tensor, num_heads_kv: int, scale: float = 1.0) -> torch.Tensor:
    """The deterministic kernel's arithmetic, exactly: a zeroed fp32 accumulator receives the
    group's partials strictly in order 0..g-1 (``acc = 0 + p0; acc = acc + p1; ...``), then is
    multiplied by ``scale`` in fp32. Every row is computed (no masking); returns fp32
    ``(..., h_k, d)`` (partials wider than fp32, e.g. fp64, are summed in their own dtype).

    Starting from +0.0 (as the memset accumulator does) equals ``acc = p0`` except that a
    -0.0 sum becomes +0.0, which only a bit-level comparison can see.
    """
    dtype = torch.promote_types(partial.dtype, torch.float32)
    grouped = _group_view(partial, num_heads_kv).to(dtype)
    acc = torch.zeros(grouped.shape[:-2] + grouped.shape[-1:], dtype=dtype, device=partial.device)
    for g in range(grouped.shape[-2]):
        acc = acc + grouped[..., g, :]
    return acc * torch.tensor(float(scale), dtype=torch.float32, device=partial.device)


def group_sum_reference(grad: torch.Tensor, n_rep: int, dim: int = 1) -> torch.Tensor:
    """repeat_kv's backward: each group of ``n_rep`` heads of ``grad`` (heads in ``dim``, 1 or 2 of a 4-D
    tensor) summed as :func:`gqa_reduce_sequential_fp32` does (``0 + g_0 + ... + g_{n_rep-1}`` in fp32, fp64
    for fp64), rounded once to grad's dtype; a new contiguous tensor."""
    dim = dim % 4
    heads = grad.shape[dim]
    if heads % n_rep != 0:
        raise ValueError(f"group_sum_reference: the {heads} heads of grad (dim {dim}) are not a multiple of {n_rep}")
    acc = gqa_reduce_sequential_fp32(grad.movedim(dim, -2), heads // n_rep)
    return acc.to(grad.dtype).movedim(-2, dim).contiguous()


def gqa_accumulate_reference(dk_partial: torch.Tensor, dv_partial: Optional[torch.Tensor],
                             dk_dense: torch.Tensor, dv_dense: Optional[torch.Tensor], *, num_heads_kv: int,
                             cu_seqlens=None, seqused=None, sequential: bool = True) -> None:
    """In place: add each group of query-head partials into dense accumulators, valid rows only.

    ``dk_partial``/``dv_partial``: ``(batch, seqlen, h_q, d)`` or varlen ``(total, h_q, d)``;
    ``dk_dense``/``dv_dense``: the same with ``num_heads_kv`` heads, ``(batch, seqlen, h_k, d)`` /
    ``(total, h_k, d)`` (what ``GQAAccumulator.to_dense`` returns). Query head j belongs to KV
    head j // (h_q / h_k). Rows outside the valid rows are not touched. A None partial (with a
    None dense) is skipped.

    ``sequential=True`` (fp32 dense only): what deterministic ``gqa_accumulate`` computes, bit for
    bit: ``dense = ((dense + p_0) + p_1) + ... + p_{g-1}`` in fp32. ``sequential=False``: the group
    sum in fp64 added to the dense values (use fp64 dense tensors for an exact-enough oracle).
    """
    for partial, dense, name in ((dk_partial, dk_dense, "dk"), (dv_partial, dv_dense, "dv")):
        if partial is None and dense is None:
            continue
        if partial is None or dense is None:
            raise ValueError(f"{name}_partial and {name}_dense: give both or neither")
        grouped = _group_view(partial, num_heads_kv)
        want = tuple(grouped.shape[:-2]) + (grouped.shape[-1],)
        if tuple(dense.shape) != want:
            raise ValueError(f"{name}_dense has shape {tuple(dense.shape)}, expected {want}")
        if sequential and dense.dtype != torch.float32:
            raise ValueError(f"sequential=True adds in fp32: {name}_dense must be float32, got {dense.dtype}")
        batch, extent, varlen = _layout(partial, cu_seqlens)
        for b, (start, length) in enumerate(sequence_bounds(batch, extent, cu_seqlens, seqused)):
            if length == 0:
                continue
            src = _rows(grouped, varlen, b, start, start + length)  # (rows, h_k, g, d)
            dst = _rows(dense, varlen, b, start, start + length)
            if sequential:
                acc = dst.clone()
                for g in range(src.shape[-2]):
                    acc = acc + src[..., g, :].to(torch.float32)
            else:
                acc = (dst.to(torch.float64) + src.to(torch.float64).sum(dim=-2)).to(dense.dtype)
            dst.copy_(acc)
