"""CPU tests of the pure-PyTorch reference semantics (flash_epilogue/reference.py)."""
import pytest
import torch

from conftest import CANARY_BITS, bits, canary
from flash_epilogue.reference import (
    gqa_accumulate_reference,
    gqa_reduce_reference,
    gqa_reduce_sequential_fp32,
    sequence_bounds,
    store_reference,
    store_zero_reference,
)


def _canary(shape, dtype, heads_major=False):
    """A canary buffer on the CPU; heads_major: (b, h, s, d) storage seen as (b, s, h, d)."""
    if heads_major:
        return canary((shape[0], shape[2], shape[1], shape[3]), dtype, "cpu").transpose(1, 2)
    return canary(shape, dtype, "cpu")


def i32(*vals):
    return torch.tensor(vals, dtype=torch.int32)


def is_canary(t):
    return bool((bits(t) == CANARY_BITS).all())


def written(t):
    return bool((bits(t) != CANARY_BITS).all())


def _valid_mask(shape, bounds, varlen):
    """Boolean mask over the rows dim(s): True on valid rows (broadcast over heads and d)."""
    if varlen:
        m = torch.zeros(shape[0], dtype=torch.bool)
        for start, length in bounds:
            m[start:start + length] = True
        return m[:, None, None]
    m = torch.zeros(shape[0], shape[1], dtype=torch.bool)
    for b, (start, length) in enumerate(bounds):
        m[b, start:start + length] = True
    return m[:, :, None, None]


def _check_store(dk_accum, dv_accum, dk, dv, cu_seqlens=None, seqused=None):
    varlen = cu_seqlens is not None
    dk0, dv0 = dk.clone(), dv.clone()
    store_reference(dk_accum, dv_accum, dk, dv, cu_seqlens=cu_seqlens, seqused=seqused)
    batch = cu_seqlens.numel() - 1 if varlen else dk.shape[0]
    bounds = sequence_bounds(batch, dk.shape[0] if varlen else dk.shape[1], cu_seqlens, seqused)
    for acc, out, before in ((dk_accum, dk, dk0), (dv_accum, dv, dv0)):
        mask = _valid_mask(out.shape, bounds, varlen).expand(out.shape)
        expect = torch.where(mask, acc.to(out.dtype), before)
        assert torch.equal(bits(out), bits(expect))
        # untouched elements still hold the canary, bit for bit
        assert is_canary(out[~mask])
    return bounds


# ---------------------------------------------------------------------------------------------
# sequence_bounds


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


# ---------------------------------------------------------------------------------------------
# store


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_batched(dtype):
    torch.manual_seed(0)
    dk_accum, dv_accum = torch.randn(2, 9, 3, 64), torch.randn(2, 9, 3, 64)
    dk, dv = _canary((2, 9, 3, 64), dtype), _canary((2, 9, 3, 64), dtype)
    _check_store(dk_accum, dv_accum, dk, dv)
    assert torch.equal(dk, dk_accum.to(dtype)) and torch.equal(dv, dv_accum.to(dtype))


def test_store_rounds_to_nearest_even():
    # 1 + 2^-11 is halfway between two fp16 values: ties to even -> 1.0; 1 + 3*2^-11 -> 1 + 2^-9
    acc = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11)], dtype=torch.float32).reshape(1, 3, 1, 1)
    acc = acc.expand(1, 3, 1, 8).contiguous()
    dk = _canary((1, 3, 1, 8), torch.float16)
    dv = _canary((1, 3, 1, 8), torch.float16)
    store_reference(acc, acc, dk, dv)
    assert dk[0, :, 0, 0].tolist() == [1.0, 1 + 2**-9, -1.0]


def test_store_strided_transposed_storage():
    """(batch, heads, seqlen, d) storage passed as (batch, seqlen, heads, d)."""
    torch.manual_seed(1)
    shape = (2, 11, 4, 64)
    dk = _canary(shape, torch.bfloat16, heads_major=True)
    dv = _canary(shape, torch.bfloat16, heads_major=True)
    assert not dk.is_contiguous() and dk.stride(-1) == 1
    dk_accum = torch.randn(2, 4, 11, 64).transpose(1, 2)
    dv_accum = torch.randn(shape)
    _check_store(dk_accum, dv_accum, dk, dv, seqused=torch.tensor([7, 11], dtype=torch.int32))


def test_store_padded_rows_untouched():
    """A padded row pitch (d=64 in rows of 80): the padding columns keep the canary."""
    base_k = canary((2, 5, 3, 80), torch.float16, "cpu")
    base_v = canary((2, 5, 3, 80), torch.float16, "cpu")
    dk, dv = base_k[..., :64], base_v[..., :48]
    store_reference(torch.randn(2, 5, 3, 64), torch.randn(2, 5, 3, 48), dk, dv)
    assert is_canary(base_k[..., 64:]) and is_canary(base_v[..., 48:])
    assert written(base_k[..., :64])


def test_store_varlen():
    torch.manual_seed(2)
    cu = torch.tensor([0, 5, 5, 17, 20], dtype=torch.int32)
    total = 23  # 3 trailing rows belong to no sequence
    dk_accum, dv_accum = torch.randn(total, 2, 128), torch.randn(total, 2, 128)
    dk, dv = _canary((total, 2, 128), torch.float16), _canary((total, 2, 128), torch.float16)
    bounds = _check_store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu)
    assert bounds == [(0, 5), (5, 0), (5, 12), (17, 3)]
    assert is_canary(dk[20:])


def test_store_varlen_seqused_shorter_than_segment():
    torch.manual_seed(3)
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    su = torch.tensor([2, 10], dtype=torch.int32)
    dk_accum, dv_accum = torch.randn(16, 3, 64), torch.randn(16, 3, 64)
    dk, dv = _canary((16, 3, 64), torch.bfloat16), _canary((16, 3, 64), torch.bfloat16)
    _check_store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu, seqused=su)
    assert is_canary(dk[2:6]) and written(dk[6:16])


def test_store_seqused_without_cu_seqlens():
    torch.manual_seed(4)
    su = torch.tensor([0, 3, 8], dtype=torch.int32)
    dk_accum, dv_accum = torch.randn(3, 8, 2, 64), torch.randn(3, 8, 2, 64)
    dk, dv = _canary((3, 8, 2, 64), torch.float16), _canary((3, 8, 2, 64), torch.float16)
    _check_store(dk_accum, dv_accum, dk, dv, seqused=su)
    assert is_canary(dk[0]) and is_canary(dk[1, 3:]) and written(dk[2])


def test_store_zero_length_everything():
    dk_accum, dv_accum = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    dk, dv = _canary((4, 2, 64), torch.float16), _canary((4, 2, 64), torch.float16)
    store_reference(dk_accum, dv_accum, dk, dv, cu_seqlens=torch.tensor([0, 0, 0], dtype=torch.int32))
    assert is_canary(dk) and is_canary(dv)
    # an empty tensor is fine too
    e = torch.empty(0, 2, 64)
    store_reference(e, e, e.half(), e.half(), cu_seqlens=torch.tensor([0, 0], dtype=torch.int32))


@pytest.mark.parametrize("d,dv_dim", [(192, 128), (64, 128), (256, 8)])
def test_store_dv_differs_from_d(d, dv_dim):
    torch.manual_seed(5)
    dk_accum, dv_accum = torch.randn(2, 7, 2, d), torch.randn(2, 7, 2, dv_dim)
    dk, dv = _canary((2, 7, 2, d), torch.bfloat16), _canary((2, 7, 2, dv_dim), torch.bfloat16)
    _check_store(dk_accum, dv_accum, dk, dv, seqused=torch.tensor([5, 7], dtype=torch.int32))


def test_store_bad_metadata_never_writes_outside():
    """Bad metadata is clamped: only rows inside the tensor can be written."""
    cu = torch.tensor([2, 1, 40], dtype=torch.int32)
    dk_accum, dv_accum = torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    dk, dv = _canary((10, 1, 8), torch.float16), _canary((10, 1, 8), torch.float16)
    _check_store(dk_accum, dv_accum, dk, dv, cu_seqlens=cu)
    assert is_canary(dk[:1]) and written(dk[1:])


# ---------------------------------------------------------------------------------------------
# store_zero


def _zero_expected(dk, bounds, varlen, batches, heads, r0, r1):
    expect = dk.clone()
    for b in batches:
        start, length = bounds[b]
        lo, hi = min(max(r0, 0), length), length if r1 is None else min(max(r1, 0), length)
        for h in heads:
            if hi > lo:
                if varlen:
                    expect[start + lo:start + hi, h] = 0
                else:
                    expect[b, start + lo:start + hi, h] = 0
    return expect


@pytest.mark.parametrize("batch_idx,head_idx,r0,r1", [
    (None, None, 0, None), ([1], None, 0, None), ([0, 2], [1], 0, None), (None, [0, 2], 2, 5), (2, 1, 3, None),
    (None, None, 4, 100), (None, None, 5, 3), (None, None, -2, 1),
])
def test_store_zero_batched(batch_idx, head_idx, r0, r1):
    torch.manual_seed(6)
    su = torch.tensor([6, 0, 4], dtype=torch.int32)
    dk = torch.randn(3, 6, 3, 64).bfloat16()
    dv = torch.randn(3, 6, 3, 32).bfloat16()
    bounds = sequence_bounds(3, 6, None, su)
    batches = [0, 1, 2] if batch_idx is None else ([batch_idx] if isinstance(batch_idx, int) else batch_idx)
    heads = [0, 1, 2] if head_idx is None else ([head_idx] if isinstance(head_idx, int) else head_idx)
    ek = _zero_expected(dk, bounds, False, batches, heads, r0, r1)
    ev = _zero_expected(dv, bounds, False, batches, heads, r0, r1)
    store_zero_reference(dk, dv, seqused=su, batch_idx=batch_idx, head_idx=head_idx, row_start=r0, row_end=r1)
    assert torch.equal(bits(dk), bits(ek)) and torch.equal(bits(dv), bits(ev))


def test_store_zero_varlen_and_strided():
    torch.manual_seed(7)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    su = torch.tensor([3, 0, 5], dtype=torch.int32)
    total = 13
    dk = torch.randn(2, total, 64).half().transpose(0, 1)  # (total, heads, d) over (heads, total, d)
    dv = torch.randn(total, 2, 64).half()
    bounds = sequence_bounds(3, total, cu, su)
    assert bounds == [(0, 3), (4, 0), (4, 5)]
    ek = _zero_expected(dk, bounds, True, [0, 1, 2], [0, 1], 1, None)
    ev = _zero_expected(dv, bounds, True, [0, 1, 2], [0, 1], 1, None)
    store_zero_reference(dk, dv, cu_seqlens=cu, seqused=su, row_start=1)
    assert torch.equal(bits(dk), bits(ek)) and torch.equal(bits(dv), bits(ev))
    # rows outside the valid ranges (seqused tail, padding tokens) untouched
    zero_rows = [1, 2, 5, 6, 7, 8]
    assert (dk[zero_rows] == 0).all()
    keep = [r for r in range(total) if r not in zero_rows]
    assert (dk[keep] != 0).all()


def test_store_zero_out_of_range_indices_skipped():
    # as the kernel does: entries outside [0, n) are skipped (negative ones are not wrapped
    # around), duplicates are harmless, an empty selection writes nothing
    torch.manual_seed(8)
    dk = torch.randn(3, 4, 2, 16).half()
    dv = torch.randn(3, 4, 2, 8).half()
    bounds = sequence_bounds(3, 4)
    for batch_idx, head_idx, batches, heads in [
        ([3, -1, 1, 1, 100], None, [1], [0, 1]),
        (torch.tensor([-3, 2, 2], dtype=torch.int32), [1, 2, -2, 1], [2], [1]),
        (-1, 0, [], [0]),
        ([], None, [], [0, 1]),
        (None, torch.empty(0, dtype=torch.int32), [0, 1, 2], []),
        ([0, 2], [5], [0, 2], []),
    ]:
        k, v = dk.clone(), dv.clone()
        ek = _zero_expected(k, bounds, False, batches, heads, 1, 3)
        ev = _zero_expected(v, bounds, False, batches, heads, 1, 3)
        store_zero_reference(k, v, batch_idx=batch_idx, head_idx=head_idx, row_start=1, row_end=3)
        assert torch.equal(bits(k), bits(ek)) and torch.equal(bits(v), bits(ev))
    # nothing selected: bitwise unchanged
    k = dk.clone()
    store_zero_reference(k, dv.clone(), batch_idx=[-1, 3])
    assert torch.equal(bits(k), bits(dk))


def test_store_zero_varlen_index_range_is_the_batch():
    # in varlen the batch is cu_seqlens.numel() - 1, not dk.shape[0]
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    dk = torch.ones(6, 1, 8).bfloat16()
    dv = torch.ones(6, 1, 8).bfloat16()
    store_zero_reference(dk, dv, cu_seqlens=cu, batch_idx=[2, 1])
    assert dk[:, 0, 0].tolist() == [1, 1, 0, 0, 0, 1]
    assert torch.equal(dk, dv)


# ---------------------------------------------------------------------------------------------
# GQA reduce


def _grouped_fp64(partial, h_k, scale):
    h_q = partial.shape[-2]
    g = h_q // h_k
    out = torch.zeros(partial.shape[:-2] + (h_k, partial.shape[-1]), dtype=torch.float64)
    for j in range(h_q):
        out[..., j // g, :] += partial[..., j, :].double()
    return out * scale


@pytest.mark.parametrize("h_q,h_k", [(4, 4), (4, 2), (6, 2), (8, 2), (16, 2), (3, 1), (8, 1)])
def test_gqa_reduce_groups(h_q, h_k):
    torch.manual_seed(h_q * 10 + h_k)
    partial = torch.randn(2, 9, h_q, 64)
    scale = 0.125
    ref = gqa_reduce_reference(partial, num_heads_kv=h_k, out_dtype=torch.float32, scale_dk=scale)
    assert ref.shape == (2, 9, h_k, 64)
    expect64 = _grouped_fp64(partial, h_k, scale)
    assert torch.equal(ref, expect64.float())
    bf = gqa_reduce_reference(partial, num_heads_kv=h_k, out_dtype=torch.bfloat16, scale_dk=scale)
    assert torch.equal(bf, expect64.to(torch.bfloat16))

    seq = gqa_reduce_sequential_fp32(partial, h_k, scale)
    assert seq.dtype == torch.float32 and seq.shape == ref.shape
    # only rounding differs: each of the g-1 adds and the multiply rounds once (<= eps/2 relative)
    g = h_q // h_k
    abs_sum = _grouped_fp64(partial.abs(), h_k, abs(scale))
    bound = g * 2.0**-24 * abs_sum + 1e-30
    assert ((seq.double() - expect64).abs() <= bound).all()
    if g == 1:
        assert torch.equal(seq, (partial * scale).float())
    # deterministic: bitwise identical on repeat
    assert torch.equal(bits(seq), bits(gqa_reduce_sequential_fp32(partial.clone(), h_k, scale)))


def test_gqa_sequential_order_is_left_to_right():
    # fp32: (1e8 + 1) + (-1e8) = 0 (the 1 is lost), (1e8 - 1e8) + 1 = 1: order matters
    p = torch.tensor([1e8, 1.0, -1e8], dtype=torch.float32).reshape(1, 1, 3, 1).expand(1, 1, 3, 8).contiguous()
    assert gqa_reduce_sequential_fp32(p, 1)[0, 0, 0, 0].item() == 0.0
    p2 = p[:, :, [0, 2, 1]]
    assert gqa_reduce_sequential_fp32(p2, 1)[0, 0, 0, 0].item() == 1.0
    # the fp64 reference gets the exact sum
    assert gqa_reduce_reference(p, num_heads_kv=1, out_dtype=torch.float32)[0, 0, 0, 0].item() == 1.0
    # the explicit left fold equals the reference
    manual = (p[:, :, 0] + p[:, :, 1]) + p[:, :, 2]
    assert torch.equal(gqa_reduce_sequential_fp32(p, 1)[:, :, 0], manual)


def test_gqa_sequential_zero_accumulator_sign():
    p = torch.full((1, 2, 8), -0.0)
    out = gqa_reduce_sequential_fp32(p, 1)
    assert not torch.signbit(out).any()  # 0 + (-0) + (-0) = +0, as on a zeroed accumulator


def test_gqa_head_mapping():
    # q head j -> kv head j // group: give each q head a distinct power of two
    h_q, h_k = 6, 2
    partial = torch.zeros(1, 1, h_q, 8)
    for j in range(h_q):
        partial[0, 0, j] = 2.0**j
    out = gqa_reduce_reference(partial, num_heads_kv=h_k, out_dtype=torch.float32)
    assert out[0, 0, :, 0].tolist() == [1 + 2 + 4, 8 + 16 + 32]
    assert torch.equal(gqa_reduce_sequential_fp32(partial, h_k), out)


def test_gqa_reduce_masked_rows_and_out():
    torch.manual_seed(8)
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    su = torch.tensor([2, 0, 6], dtype=torch.int32)
    total = 12
    partial = torch.randn(total, 8, 64)
    new = gqa_reduce_reference(partial, num_heads_kv=2, out_dtype=torch.float16, cu_seqlens=cu, seqused=su,
                               scale_dk=2.0)
    full = _grouped_fp64(partial, 2, 2.0).half()
    valid = [0, 1, 3, 4, 5, 6, 7, 8]
    invalid = [r for r in range(total) if r not in valid]
    assert torch.equal(new[valid], full[valid])
    assert (new[invalid] == 0).all()

    out = _canary((total, 2, 64), torch.float16)
    ret = gqa_reduce_reference(partial, num_heads_kv=2, out_dtype=torch.float16, cu_seqlens=cu, seqused=su,
                               scale_dk=2.0, out=out)
    assert ret is out
    assert torch.equal(out[valid], full[valid]) and is_canary(out[invalid])

    # batched with seqused, out dtype inferred from out, strided out
    partial_b = torch.randn(2, 5, 4, 32)
    out_b = _canary((2, 5, 1, 32), torch.bfloat16, heads_major=True)
    gqa_reduce_reference(partial_b, num_heads_kv=1, seqused=torch.tensor([5, 1], dtype=torch.int32), out=out_b)
    full_b = _grouped_fp64(partial_b, 1, 1.0).bfloat16()
    assert torch.equal(out_b[0], full_b[0]) and torch.equal(out_b[1, :1], full_b[1, :1])
    assert is_canary(out_b[1, 1:])


def test_accumulate_reference_orders_and_rows():
    # sequential: ((acc + p0) + p1) + p2 in fp32, head order; fp64 mode: exact
    p = torch.tensor([1e8, 1.0, -1e8], dtype=torch.float32).reshape(1, 1, 3, 1).expand(1, 1, 3, 8).contiguous()
    dk = torch.zeros(1, 1, 1, 8)
    gqa_accumulate_reference(p, None, dk, None, num_heads_kv=1)
    assert dk[0, 0, 0, 0].item() == 0.0
    dk64 = torch.zeros(1, 1, 1, 8, dtype=torch.float64)
    gqa_accumulate_reference(p, None, dk64, None, num_heads_kv=1, sequential=False)
    assert dk64[0, 0, 0, 0].item() == 1.0
    # accumulates across calls, only over valid rows
    pk = torch.randn(2, 5, 4, 8)
    acc = torch.zeros(2, 5, 2, 8)
    used = i32(5, 2)
    gqa_accumulate_reference(pk, pk, acc, acc.clone(), num_heads_kv=2, seqused=used)
    gqa_accumulate_reference(pk, pk, acc, acc.clone(), num_heads_kv=2, seqused=used)
    one = (torch.zeros(2, 5, 2, 8) + pk[:, :, 0::2]) + pk[:, :, 1::2]
    assert torch.equal(acc[0], (one[0] + pk[0, :, 0::2]) + pk[0, :, 1::2])
    assert (acc[1, 2:] == 0).all()
    # varlen
    pv = torch.randn(10, 6, 8)
    dense = torch.zeros(10, 3, 8)
    gqa_accumulate_reference(pv, None, dense, None, num_heads_kv=3, cu_seqlens=i32(0, 4, 9))
    assert torch.equal(dense[:9], (torch.zeros(9, 3, 8) + pv[:9, 0::2]) + pv[:9, 1::2])
    assert (dense[9] == 0).all()


def test_reduce_reference_sequential():
    torch.manual_seed(0)
    p = torch.randn(2, 7, 8, 16) * 100
    seq = gqa_reduce_reference(p, num_heads_kv=2, out_dtype=torch.bfloat16, scale_dk=0.3, sequential=True)
    g = p.unflatten(2, (2, 4))  # q head j -> kv head j // 4
    acc = torch.zeros(2, 7, 2, 16)
    for j in range(4):
        acc = acc + g[:, :, :, j]
    assert torch.equal(seq, (acc * torch.tensor(0.3, dtype=torch.float32)).to(torch.bfloat16))
