"""Pure-PyTorch reference semantics of the ops (any device and strides; metadata read on the host), the tests' oracle:
what the kernels must produce, element for element, in the valid rows (:func:`sequence_bounds`) only."""
from typing import Iterable

import torch

__all__ = ["sequence_bounds", "store_reference", "store_zero_reference", "gqa_reduce_reference",
           "gqa_reduce_sequential_fp32", "gqa_accumulate_reference", "group_sum_reference"]


def _ints(t) -> list[int]:  # of an integer tensor (any shape) or a sequence
    return [int(v) for v in (t.detach().reshape(-1).tolist() if isinstance(t, torch.Tensor) else t)]


def sequence_bounds(batch: int, seqlen_or_total: int, cu_seqlens=None, seqused=None) -> list[tuple[int, int]]:
    """(start, length) of each sequence's valid rows: start = cu_seqlens[b] (0 without), length = seqused[b], else the
    segment's length, else the seqlen; clamped as the kernels do: 0 <= start <= start + length <= seqlen_or_total."""
    extent = max(int(seqlen_or_total), 0)
    cu, su = (None if t is None else _ints(t) for t in (cu_seqlens, seqused))
    if cu is not None and len(cu) < batch + 1:
        raise ValueError(f"cu_seqlens has {len(cu)} entries, need batch + 1 = {batch + 1}")
    if su is not None and len(su) < batch:
        raise ValueError(f"seqused has {len(su)} entries, need batch = {batch}")
    starts = [min(max(0 if cu is None else cu[b], 0), extent) for b in range(batch)]
    lengths = [su[b] if su is not None else extent if cu is None else cu[b + 1] - cu[b] for b in range(batch)]
    return [(start, min(max(length, 0), extent - start)) for start, length in zip(starts, lengths)]


def _valid_rows(t: torch.Tensor, cu_seqlens, seqused, dv: torch.Tensor | None = None) -> list[tuple]:
    """Per sequence, the index that views its valid rows (all heads, all columns) in a tensor of t's layout (and of
    ``dv``'s, which must match t's but for the last dim)."""
    if dv is not None and t.shape[:-1] != dv.shape[:-1]:
        raise ValueError(f"dk {tuple(t.shape)} and dv {tuple(dv.shape)} differ before the last dim")
    varlen = cu_seqlens is not None
    if t.dim() != (3 if varlen else 4):
        want = "(total_tokens, heads, headdim) with cu_seqlens" if varlen else "(batch, seqlen, heads, headdim)"
        raise ValueError(f"expected {want}, got shape {tuple(t.shape)}")
    batch, extent = (len(_ints(cu_seqlens)) - 1, t.shape[0]) if varlen else (t.shape[0], t.shape[1])
    return [(slice(start, start + length),) if varlen else (b, slice(start, start + length))
            for b, (start, length) in enumerate(sequence_bounds(batch, extent, cu_seqlens, seqused))]


def store_reference(dk_accum: torch.Tensor, dv_accum: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
                    cu_seqlens=None, seqused=None) -> None:
    """In place: the valid rows of dk/dv get ``accum.to(dk.dtype)``; everything else untouched."""
    if dk_accum.shape != dk.shape or dv_accum.shape != dv.shape:
        raise ValueError(f"accumulator shapes {tuple(dk_accum.shape)}/{tuple(dv_accum.shape)} "
                         f"differ from dk/dv {tuple(dk.shape)}/{tuple(dv.shape)}")
    for rows in _valid_rows(dk, cu_seqlens, seqused, dv):
        dk[rows].copy_(dk_accum[rows].to(dk.dtype))
        dv[rows].copy_(dv_accum[rows].to(dv.dtype))


def _as_index_list(idx, n: int) -> list[int]:
    """The selected indices in [0, n), in order; others (negative ones too: no wrap-around) skipped."""
    return [i for i in _ints([idx] if isinstance(idx, int) else idx) if 0 <= i < n]


def store_zero_reference(dk: torch.Tensor, dv: torch.Tensor, *, cu_seqlens=None, seqused=None,
                         batch_idx: Iterable[int] | None = None, head_idx: Iterable[int] | None = None,
                         row_start: int = 0, row_end: int | None = None) -> None:
    """In place: what :func:`flash_epilogue.store_zero` zeroes (``batch_idx``/``head_idx`` may also be integer tensors
    of any device; entries outside [0, batch) / [0, heads) skipped, duplicates change nothing); nothing else."""
    valid = _valid_rows(dk, cu_seqlens, seqused, dv)
    heads = [slice(None)] if head_idx is None else _as_index_list(head_idx, dk.shape[-2])
    for b in range(len(valid)) if batch_idx is None else _as_index_list(batch_idx, len(valid)):
        window = slice(max(int(row_start), 0), None if row_end is None else max(int(row_end), 0))
        for t in (dk, dv):
            for h in heads:
                t[valid[b]][window][:, h].zero_()


def _group_view(partial: torch.Tensor, num_heads_kv: int) -> torch.Tensor:
    """(..., h_q, d) -> (..., h_k, group, d): q head j = kv head j // group, index j % group."""
    h_q = partial.shape[-2]
    if num_heads_kv <= 0 or h_q % num_heads_kv != 0:
        raise ValueError(f"num_heads_kv={num_heads_kv} must divide the {h_q} query heads of partial")
    return partial.unflatten(-2, (num_heads_kv, h_q // num_heads_kv))


def gqa_reduce_reference(dk_partial: torch.Tensor, dv_partial: torch.Tensor | None = None, *, num_heads_kv: int,
                         cu_seqlens=None, seqused=None, out=None, out_dtype: torch.dtype | None = None,
                         scale_dk: float = 1.0, scale_dv: float = 1.0, sequential: bool = False):
    """:func:`flash_epilogue.gqa_reduce` from its arguments (out_dtype may be fp32 here, new outputs are zero-filled):
    each group summed in fp64, times the scale, rounded to the output dtype; ``sequential=True``: the kernel's
    arithmetic bit for bit instead, :func:`gqa_reduce_sequential_fp32` rounded to nearest even."""
    outs, results = tuple(out) if isinstance(out, (tuple, list)) else (out, None), []
    for partial, out, scale in ((dk_partial, outs[0], scale_dk), (dv_partial, outs[1], scale_dv)):
        if partial is None:
            continue
        if out is not None and out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype}, out_dtype is {out_dtype}")
        dtype = out.dtype if out is not None else out_dtype if out_dtype is not None else \
            partial.dtype if partial.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        reduced = (gqa_reduce_sequential_fp32(partial, num_heads_kv, scale) if sequential else
                   _group_view(partial, num_heads_kv).to(torch.float64).sum(dim=-2) * float(scale)).to(dtype)
        if out is None:
            out = torch.zeros(reduced.shape, dtype=dtype, device=partial.device)
        elif out.shape != reduced.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(reduced.shape)}")
        for rows in _valid_rows(partial, cu_seqlens, seqused):
            out[rows].copy_(reduced[rows])
        results.append(out)
    return results[0] if dv_partial is None else tuple(results)


def _sequential_sum(grouped: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """(..., g, d) -> (..., d): ``acc = acc + p_0; acc = acc + p_1; ...`` in order, from ``acc``, by default +0.0 (the
    kernel's memset accumulator, which turns a -0.0 sum into +0.0) in fp32 (the input's dtype if wider)."""
    if acc is None:
        acc = torch.zeros(grouped.shape[:-2] + grouped.shape[-1:], dtype=torch.promote_types(grouped.dtype,
                          torch.float32), device=grouped.device)
    for g in range(grouped.shape[-2]):
        acc = acc + grouped[..., g, :]  # the exact upcast, then the add
    return acc


def gqa_reduce_sequential_fp32(partial: torch.Tensor, num_heads_kv: int, scale: float = 1.0) -> torch.Tensor:
    """The deterministic kernel's arithmetic, exactly: each group summed in order (:func:`_sequential_sum`), times
    ``scale`` rounded to fp32; every row, ``(..., h_k, d)``."""
    return _sequential_sum(_group_view(partial, num_heads_kv)) * torch.tensor(float(scale), dtype=torch.float32,
                                                                               device=partial.device)


def group_sum_reference(grad: torch.Tensor, n_rep: int, dim: int = 1) -> torch.Tensor:
    """repeat_kv's backward: each group of ``n_rep`` heads of ``grad`` (heads in ``dim``, 1 or 2 of a 4-D tensor)
    summed as :func:`gqa_reduce_sequential_fp32` does, rounded once to grad's dtype; a new contiguous tensor."""
    dim = dim % 4
    heads = grad.shape[dim]
    if heads % n_rep != 0:
        raise ValueError(f"group_sum_reference: the {heads} heads of grad (dim {dim}) are not a multiple of {n_rep}")
    acc = _sequential_sum(grad.movedim(dim, -2).unflatten(-2, (heads // n_rep, n_rep)))
    return acc.to(grad.dtype).movedim(-2, dim).contiguous()


def gqa_accumulate_reference(dk_partial: torch.Tensor, dv_partial: torch.Tensor | None,
                             dk_dense: torch.Tensor, dv_dense: torch.Tensor | None, *, num_heads_kv: int,
                             cu_seqlens=None, seqused=None, sequential: bool = True) -> None:
    """In place: :func:`flash_epilogue.gqa_accumulate` into dense accumulators (as ``GQAAccumulator.to_dense`` returns;
    None with a None partial skipped). ``sequential=True`` (fp32 only): deterministic mode's bits, ``((dense + p_0) +
    p_1) + ... + p_{g-1}`` in fp32; ``False``: the group's fp64 sum added (with fp64 dense: an exact-enough oracle)."""
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
        for rows in _valid_rows(partial, cu_seqlens, seqused):
            src, dst = grouped[rows], dense[rows]  # (rows, h_k, g, d), (rows, h_k, d)
            dst.copy_(_sequential_sum(src.to(torch.float32), dst) if sequential else
                      (dst.to(torch.float64) + src.to(torch.float64).sum(dim=-2)).to(dense.dtype))
