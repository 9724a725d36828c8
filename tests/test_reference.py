"""CPU tests of the pure-PyTorch reference semantics (flash_epilogue/reference.py)."""
from functools import partial

import pytest
import torch

from flash_epilogue.reference import (gqa_accumulate_reference, gqa_reduce_reference, gqa_reduce_sequential_fp32,
                                      sequence_bounds, store_reference, store_zero_reference)
from flash_epilogue.testing import CANARY_BITS, bits, canary, int32, same

F16, BF16 = torch.float16, torch.bfloat16
i32 = partial(int32, device="cpu")


def _canary(shape, dtype, heads_major=False):
    """A canary buffer on the CPU; heads_major: (.., h, rows, d) storage seen as (.., rows, h, d)."""
    if heads_major:
        return canary(shape[:-3] + (shape[-2], shape[-3], shape[-1]), dtype, "cpu").transpose(-3, -2)
    return canary(shape, dtype, "cpu")


def is_canary(t):
    return bool((bits(t) == CANARY_BITS).all())


def test_sequence_bounds():
    assert sequence_bounds(3, 17) == [(0, 17)] * 3
    assert sequence_bounds(3, 12, i32(0, 5, 5, 12)) == [(0, 5), (5, 0), (5, 7)]
    # seqused overrides the length, not the start
    assert sequence_bounds(3, 12, i32(0, 5, 9, 12), i32(3, 0, 2)) == [(0, 3), (5, 0), (9, 2)]
    assert sequence_bounds(2, 10, None, [4, 10]) == [(0, 4), (0, 10)]
    # clamped: start past the end, negative length, length past the end, negative start, negative seqused
    cu = i32(-3, 4, 2, 20, 30)
    assert sequence_bounds(4, 10, cu) == [(0, 7), (4, 0), (2, 8), (10, 0)]
    assert sequence_bounds(2, 6, None, i32(-1, 99)) == [(0, 0), (0, 6)]
    for start, length in sequence_bounds(4, 10, cu, [100, 100, -5, 1]):
        assert 0 <= start and 0 <= length and start + length <= 10


# ---- store
@pytest.mark.parametrize("shape_k,shape_v,dtype,seed,seq,bounds", [
    ((2, 9, 3, 64), (2, 9, 3, 64), F16, 0, {}, [(0, 9)] * 2),
    ((2, 9, 3, 64), (2, 9, 3, 64), BF16, 0, {}, [(0, 9)] * 2),
    *[((2, 7, 2, d), (2, 7, 2, dv), BF16, 5, {"seqused": i32(5, 7)}, [(0, 5), (0, 7)])
      for d, dv in ((192, 128), (64, 128), (256, 8))],
    ((3, 8, 2, 64), (3, 8, 2, 64), F16, 4, {"seqused": i32(0, 3, 8)}, [(0, 0), (0, 3), (0, 8)]),
    # varlen: 3 trailing rows belong to no sequence; seqused shorter than its segment
    ((23, 2, 128), (23, 2, 128), F16, 2, {"cu_seqlens": i32(0, 5, 5, 17, 20)}, [(0, 5), (5, 0), (5, 12), (17, 3)]),
    ((16, 3, 64), (16, 3, 64), BF16, 3, {"cu_seqlens": i32(0, 6, 16), "seqused": i32(2, 10)}, [(0, 2), (6, 10)]),
    # bad metadata is clamped: only rows inside the tensor can be written
    ((10, 1, 8), (10, 1, 8), F16, 0, {"cu_seqlens": i32(2, 1, 40)}, [(2, 0), (1, 9)]),
    # nothing to write: empty sequences, an empty tensor
    ((4, 2, 64), (4, 2, 64), F16, 0, {"cu_seqlens": i32(0, 0, 0)}, [(0, 0), (0, 0)]),
    ((0, 2, 64), (0, 2, 64), F16, 0, {"cu_seqlens": i32(0, 0)}, [(0, 0)]),
], ids=["fp16", "bf16", "d192-dv128", "d64-dv128", "d256-dv8", "seqused", "varlen", "varlen-seqused", "bad-metadata",
        "all-empty", "no-rows"])
@pytest.mark.parametrize("heads_major", [False, True], ids=["rows-major", "heads-major"])
def test_store(shape_k, shape_v, dtype, seed, seq, bounds, heads_major):
    # random accumulators into canary outputs (heads_major: they and dk_accum in (.., heads, rows, d) storage):
    # acc.to(dtype) on the rows of `bounds`, sequence_bounds' valid rows, and the canary bits on the others
    torch.manual_seed(seed)
    accs = torch.randn(shape_k), torch.randn(shape_v)
    if heads_major:
        accs = accs[0].transpose(-3, -2).contiguous().transpose(-3, -2), accs[1]
    outs = [_canary(s, dtype, heads_major) for s in (shape_k, shape_v)]
    store_reference(*accs, *outs, **seq)
    varlen = "cu_seqlens" in seq
    assert sequence_bounds(len(bounds), shape_k[0 if varlen else 1], **seq) == bounds
    for acc, out in zip(accs, outs):
        mask = torch.zeros(out.shape[:1 if varlen else 2], dtype=torch.bool)
        for b, (start, length) in enumerate(bounds):
            mask[(slice(start, start + length),) if varlen else (b, slice(start, start + length))] = True
        want = torch.where(mask[..., None, None], acc.to(dtype), canary(out.shape, dtype, "cpu"))
        assert torch.equal(bits(out), bits(want))


def test_store_rounds_to_nearest_even():
    # 1 + 2^-11 is halfway between two fp16 values: ties to even -> 1.0; 1 + 3*2^-11 -> 1 + 2^-9
    acc = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11)]).reshape(1, 3, 1, 1).expand(1, 3, 1, 8).contiguous()
    dk, dv = _canary((1, 3, 1, 8), F16), _canary((1, 3, 1, 8), F16)
    store_reference(acc, acc, dk, dv)
    assert dk[0, :, 0, 0].tolist() == [1.0, 1 + 2**-9, -1.0]


def test_store_padded_rows_untouched():
    # a padded row pitch (d=64 in rows of 80): the padding columns keep the canary
    base_k, base_v = canary((2, 5, 3, 80), F16, "cpu"), canary((2, 5, 3, 80), F16, "cpu")
    store_reference(torch.randn(2, 5, 3, 64), torch.randn(2, 5, 3, 48), base_k[..., :64], base_v[..., :48])
    assert is_canary(base_k[..., 64:]) and is_canary(base_v[..., 48:])
    assert (bits(base_k[..., :64]) != CANARY_BITS).all()  # written


# ---- store_zero
def _check_zero(dk, dv, bounds, varlen, batches, heads, r0, r1, **kw):
    """store_zero_reference(dk, dv, **kw) zeroes rows [r0, r1) (clamped to each sequence) of the selected sequences
    and heads, bitwise nothing else."""
    expect = []
    for t in (dk, dv):
        e = t.clone()
        for b in batches:
            start, length = bounds[b]
            lo, hi = min(max(r0, 0), length), length if r1 is None else min(max(r1, 0), length)
            for h in heads:
                if hi > lo:
                    e[(slice(start + lo, start + hi), h) if varlen else (b, slice(start + lo, start + hi), h)] = 0
        expect.append(e)
    store_zero_reference(dk, dv, row_start=r0, row_end=r1, **kw)
    assert same(dk, expect[0]) and same(dv, expect[1])


@pytest.mark.parametrize("batch_idx,head_idx,r0,r1", [
    (None, None, 0, None), ([1], None, 0, None), ([0, 2], [1], 0, None), (None, [0, 2], 2, 5), (2, 1, 3, None),
    (None, None, 4, 100), (None, None, 5, 3), (None, None, -2, 1),
])
def test_store_zero_batched(batch_idx, head_idx, r0, r1):
    torch.manual_seed(6)
    su = i32(6, 0, 4)
    dk, dv = torch.randn(3, 6, 3, 64).bfloat16(), torch.randn(3, 6, 3, 32).bfloat16()
    batches, heads = ([0, 1, 2] if v is None else [v] if isinstance(v, int) else v for v in (batch_idx, head_idx))
    _check_zero(dk, dv, sequence_bounds(3, 6, None, su), False, batches, heads, r0, r1, seqused=su,
                batch_idx=batch_idx, head_idx=head_idx)


def test_store_zero_varlen_and_strided():
    torch.manual_seed(7)
    cu, su, total = i32(0, 4, 4, 11), i32(3, 0, 5), 13
    dk = torch.randn(2, total, 64).half().transpose(0, 1)  # (total, heads, d) over (heads, total, d)
    dv = torch.randn(total, 2, 64).half()
    bounds = sequence_bounds(3, total, cu, su)
    assert bounds == [(0, 3), (4, 0), (4, 5)]
    # rows 1, 2, 5 to 8 zeroed; the others (seqused tails, padding tokens) untouched
    _check_zero(dk, dv, bounds, True, [0, 1, 2], [0, 1], 1, None, cu_seqlens=cu, seqused=su)
    # the batch is cu_seqlens.numel() - 1 (2 here), not dk.shape[0]: batch index 2 is out of range
    cu = i32(0, 2, 5)
    _check_zero(torch.ones(6, 1, 8).bfloat16(), torch.ones(6, 1, 8).bfloat16(), sequence_bounds(2, 6, cu), True, [1],
                [0], 0, None, cu_seqlens=cu, batch_idx=[2, 1])


def test_store_zero_out_of_range_indices_skipped():
    # as the kernel does: entries outside [0, n) are skipped (negative ones are not wrapped
    # around), duplicates are harmless, an empty selection writes nothing
    torch.manual_seed(8)
    dk, dv = torch.randn(3, 4, 2, 16).half(), torch.randn(3, 4, 2, 8).half()
    for batch_idx, head_idx, batches, heads in [
        ([3, -1, 1, 1, 100], None, [1], [0, 1]), (torch.tensor([-3, 2, 2], dtype=torch.int32), [1, 2, -2, 1], [2], [1]),
        (-1, 0, [], [0]), ([], None, [], [0, 1]), (None, torch.empty(0, dtype=torch.int32), [0, 1, 2], []),
        ([0, 2], [5], [0, 2], []),
    ]:
        _check_zero(dk.clone(), dv.clone(), sequence_bounds(3, 4), False, batches, heads, 1, 3, batch_idx=batch_idx,
                    head_idx=head_idx)
    # nothing selected: bitwise unchanged
    k = dk.clone()
    store_zero_reference(k, dv.clone(), batch_idx=[-1, 3])
    assert torch.equal(bits(k), bits(dk))


# ---- GQA reduce and accumulate
def _grouped_fp64(partial, h_k, scale):
    g = partial.shape[-2] // h_k
    out = torch.zeros(partial.shape[:-2] + (h_k, partial.shape[-1]), dtype=torch.float64)
    for j in range(partial.shape[-2]):
        out[..., j // g, :] += partial[..., j, :].double()
    return out * scale


@pytest.mark.parametrize("h_q,h_k", [(4, 4), (4, 2), (6, 2), (8, 2), (16, 2), (3, 1), (8, 1)])
def test_gqa_reduce_groups(h_q, h_k):
    torch.manual_seed(h_q * 10 + h_k)
    partial, scale, g = torch.randn(2, 9, h_q, 64), 0.125, h_q // h_k
    ref = gqa_reduce_reference(partial, num_heads_kv=h_k, out_dtype=torch.float32, scale_dk=scale)
    expect64 = _grouped_fp64(partial, h_k, scale)  # (2, 9, h_k, 64)
    assert torch.equal(ref, expect64.float())
    bf = gqa_reduce_reference(partial, num_heads_kv=h_k, out_dtype=BF16, scale_dk=scale)
    assert torch.equal(bf, expect64.to(BF16))
    seq = gqa_reduce_sequential_fp32(partial, h_k, scale)
    assert seq.dtype == torch.float32 and seq.shape == ref.shape
    # only rounding differs: each of the g-1 adds and the multiply rounds once (<= eps/2 relative)
    bound = g * 2.0**-24 * _grouped_fp64(partial.abs(), h_k, abs(scale)) + 1e-30
    assert ((seq.double() - expect64).abs() <= bound).all()
    if g == 1:
        assert torch.equal(seq, (partial * scale).float())
    # deterministic: bitwise identical on repeat
    assert torch.equal(bits(seq), bits(gqa_reduce_sequential_fp32(partial.clone(), h_k, scale)))


def _cancelling():
    """fp32 partials 1e8, 1, -1e8 (3 heads, 8 columns): (1e8 + 1) - 1e8 = 0 (the 1 is lost), exactly 1."""
    return torch.tensor([1e8, 1.0, -1e8]).reshape(1, 1, 3, 1).expand(1, 1, 3, 8).contiguous()


def test_gqa_sequential_order_is_left_to_right_from_zero():
    p = _cancelling()
    assert gqa_reduce_sequential_fp32(p, 1)[0, 0, 0, 0].item() == 0.0
    assert gqa_reduce_sequential_fp32(p[:, :, [0, 2, 1]], 1)[0, 0, 0, 0].item() == 1.0  # (1e8 - 1e8) + 1
    # the fp64 reference gets the exact sum
    assert gqa_reduce_reference(p, num_heads_kv=1, out_dtype=torch.float32)[0, 0, 0, 0].item() == 1.0
    # the explicit left fold equals the reference
    assert torch.equal(gqa_reduce_sequential_fp32(p, 1)[:, :, 0], (p[:, :, 0] + p[:, :, 1]) + p[:, :, 2])
    out = gqa_reduce_sequential_fp32(torch.full((1, 2, 8), -0.0), 1)
    assert not torch.signbit(out).any()  # 0 + (-0) + (-0) = +0, as on a zeroed accumulator
    # the reference's sequential=True: each group's left fold from zero (q head j -> kv head j // 4), times fp32(scale)
    p = torch.randn(2, 7, 8, 16, generator=torch.Generator().manual_seed(0)) * 100
    fold = sum(p.unflatten(2, (2, 4)).unbind(3), torch.zeros(2, 7, 2, 16))
    seq = gqa_reduce_reference(p, num_heads_kv=2, out_dtype=BF16, scale_dk=0.3, sequential=True)
    assert torch.equal(seq, (fold * torch.tensor(0.3, dtype=torch.float32)).to(BF16))


def test_gqa_reduce_masked_rows_and_out():
    torch.manual_seed(8)
    total, partial = 12, torch.randn(12, 8, 64)
    seq = {"cu_seqlens": i32(0, 3, 3, 10), "seqused": i32(2, 0, 6)}
    new = gqa_reduce_reference(partial, num_heads_kv=2, out_dtype=F16, scale_dk=2.0, **seq)
    full = _grouped_fp64(partial, 2, 2.0).half()
    valid = [0, 1, 3, 4, 5, 6, 7, 8]
    invalid = [r for r in range(total) if r not in valid]
    assert torch.equal(new[valid], full[valid])
    assert (new[invalid] == 0).all()
    out = _canary((total, 2, 64), F16)
    assert gqa_reduce_reference(partial, num_heads_kv=2, out_dtype=F16, scale_dk=2.0, out=out, **seq) is out
    assert torch.equal(out[valid], full[valid]) and is_canary(out[invalid])
    # batched with seqused, out dtype inferred from out, strided out
    partial_b = torch.randn(2, 5, 4, 32)
    out_b = _canary((2, 5, 1, 32), BF16, heads_major=True)
    gqa_reduce_reference(partial_b, num_heads_kv=1, seqused=i32(5, 1), out=out_b)
    full_b = _grouped_fp64(partial_b, 1, 1.0).bfloat16()
    assert torch.equal(out_b[0], full_b[0]) and torch.equal(out_b[1, :1], full_b[1, :1])
    assert is_canary(out_b[1, 1:])


def test_accumulate_reference_orders_and_rows():
    # sequential: ((acc + p0) + p1) + p2 in fp32, head order; fp64 mode: exact
    p = _cancelling()
    dk, dk64 = torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8, dtype=torch.float64)
    gqa_accumulate_reference(p, None, dk, None, num_heads_kv=1)
    gqa_accumulate_reference(p, None, dk64, None, num_heads_kv=1, sequential=False)
    assert dk[0, 0, 0, 0].item() == 0.0 and dk64[0, 0, 0, 0].item() == 1.0
    # accumulates across calls, only over valid rows
    pk, acc = torch.randn(2, 5, 4, 8), torch.zeros(2, 5, 2, 8)
    for _ in range(2):
        gqa_accumulate_reference(pk, pk, acc, acc.clone(), num_heads_kv=2, seqused=i32(5, 2))
    one = (torch.zeros(2, 5, 2, 8) + pk[:, :, 0::2]) + pk[:, :, 1::2]
    assert torch.equal(acc[0], (one[0] + pk[0, :, 0::2]) + pk[0, :, 1::2])
    assert (acc[1, 2:] == 0).all()
    # varlen
    pv, dense = torch.randn(10, 6, 8), torch.zeros(10, 3, 8)
    gqa_accumulate_reference(pv, None, dense, None, num_heads_kv=3, cu_seqlens=i32(0, 4, 9))
    assert torch.equal(dense[:9], (torch.zeros(9, 3, 8) + pv[:9, 0::2]) + pv[:9, 1::2])
    assert (dense[9] == 0).all()
