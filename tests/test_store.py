"""GPU tests of `store` (bitwise `accum.to(dtype)` on every valid element, nothing else in the canary buffer
changed), and the checker test_store_zero.py shares. Layout cases run on both code paths (`arch`: sm_90, and the
sm_80 path on the same GPU) with row edges at the path's kBlockN; the sm_90 driver's cases on sm_90 alone."""
import pytest
import torch

import flash_epilogue as fe
from conftest import DTYPES, arch_param, assert_bits, bits, block_n, canary, carve, cu_seqlens, int32, rand, same_view
from flash_epilogue.reference import store_reference, store_zero_reference

pytestmark = pytest.mark.gpu

HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)
DV_PAIRS = [(192, 128), (64, 128), (128, 64), (256, 128), (72, 200), (64, 256), (136, 72)]
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=str)


def accum(shape):
    return rand(shape, binades=20)


def check(dk_buf, dv_buf, dk, dv, arch=90, acc=None, **kw):
    """store (acc: its accumulators, True: fresh ones) or else store_zero on (dk, dv), views into canary buffers;
    each whole buffer must equal bitwise the reference applied to a clone. Returns the expected zeros in dk."""
    expect_k, expect_v = dk_buf.clone(), dv_buf.clone()
    acc = (accum(dk.shape), accum(dv.shape)) if acc is True else acc
    if acc is None:  # unchecked: some cases pass out-of-range indices on purpose
        store_zero_reference(same_view(expect_k, dk), same_view(expect_v, dv), **kw)
        fe.store_zero(dk, dv, check_inputs=False, _arch=arch, **kw)
    else:
        store_reference(*acc, same_view(expect_k, dk), same_view(expect_v, dv), **kw)
        fe.store(*acc, dk, dv, _arch=arch, **kw)
    torch.cuda.synchronize()
    assert_bits(dk_buf, expect_k, "dk")
    assert_bits(dv_buf, expect_v, "dv")
    return int((bits(expect_k) == 0).sum())


def check_carved(shape, dtype, layout="plain", arch=90, shape_v=None, **kw):
    """check() on dk of `shape` and dv of `shape_v` (default `shape`) carved per `layout` (or (dk's, dv's))."""
    lk, lv = (layout, layout) if isinstance(layout, str) else layout
    (dk_buf, dk), (dv_buf, dv) = carve(shape, dtype, lk), carve(shape_v or shape, dtype, lv)
    return check(dk_buf, dv_buf, dk, dv, arch, **kw)


def varlen_meta(n, long=2, tail=37):
    """(batch, cu_seqlens, seqused, total rows): lengths with edges at kBlockN `n` and empty sequences, seqused
    0, 5 or 10 rows shorter, 9 slack rows after the last sequence."""
    lens = [0, 1, n - 1, n, n + 1, long * n + 7, 0, tail]
    cu = cu_seqlens(lens)
    return len(lens), cu, int32(*[max(0, x - (i % 3) * 5) for i, x in enumerate(lens)]), int(cu[-1]) + 9


@arch_param
@dtype_param
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("seq_idx", range(7))
@pytest.mark.parametrize("batch,heads", [(1, 1), (2, 3)])
def test_store_batched(dtype, d, seq_idx, batch, heads, arch):
    n = block_n(d, arch=arch)
    check_carved((batch, (0, 1, n - 1, n, n + 1, 1000, 4096)[seq_idx], heads, d), dtype, arch=arch, acc=True)


@arch_param
@dtype_param
@pytest.mark.parametrize("d", (64, 96, 128, 192, 256))
def test_store_views(dtype, d, arch):
    # outputs stored (batch, heads, seqlen, d), passed as (batch, seqlen, heads, d) views; inputs in another layout
    b, h, s = 2, 4, 777
    dk_buf, dv_buf = canary((b, h, s, d), dtype), canary((b, h, s, d), dtype)
    acc = accum((b, h, s, d)).transpose(1, 2), accum((b, s, h, d))
    check(dk_buf, dv_buf, dk_buf.transpose(1, 2), dv_buf.transpose(1, 2), arch, acc)
    # dk/dv carved out of wider buffers: padded rows, extra heads, padded head dim, and a batch stride with slack
    b, s, h = 3, 300, 2
    dk_buf, dv_buf = canary((b + 1, s + 5, h + 2, d + 16), dtype), canary((b, s, 2 * h, d + 8), dtype)
    dk, dv = dk_buf[1:, 2 : s + 2, 1 : h + 1, :d], dv_buf[:, :, ::2, :d]
    check(dk_buf, dv_buf, dk, dv, arch, (accum((b, s, h, d + 4))[..., :d], accum((b, s, h, d))))
    # batch 1 and heads 1 with strides no one could use: normalized, not rejected
    s = 200
    base, dv_buf = canary((s * d + 64,), dtype), canary((1, s, 1, d), dtype)
    dk, dv = base.as_strided((1, s, 1, d), (3, d, 5, 1)), dv_buf.as_strided((1, s, 1, d), (7, d, 1, 1))
    acc = accum((1, s, 1, d)).as_strided((1, s, 1, d), (1, d, 3, 1))
    check(base, dv_buf, dk, dv, arch, (acc, accum((1, s, 1, d))))
    # through the op itself, one accumulator for both, into new outputs: bitwise accum.to(dtype)
    acc = accum((2, 1000, 4, d))
    outs = torch.empty_like(acc, dtype=dtype), torch.empty_like(acc, dtype=dtype)
    torch.ops.flash_epilogue.store(acc, acc, *outs, _arch=arch)
    for out in outs:
        assert torch.equal(bits(out), bits(acc.to(dtype)))


@arch_param
@dtype_param
@pytest.mark.parametrize("d,dv", DV_PAIRS)
def test_store_dv_differs_from_d(dtype, d, dv, arch):
    check_carved((2, 333, 3, d), dtype, arch=arch, shape_v=(2, 333, 3, dv), acc=True)
    lens = [0, 1, 95, 96, 97, 300]
    total = sum(lens) + 3
    check_carved((total, 3, d), dtype, arch=arch, shape_v=(total, 3, dv), acc=True, cu_seqlens=cu_seqlens(lens),
                 seqused=int32(*[max(0, x - 7) for x in lens]))


@arch_param
@dtype_param
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_store_seqused_varlen_and_empty(dtype, d, arch):
    n = block_n(d, arch=arch)
    check_carved((4, 400, 2, d), dtype, arch=arch, acc=True, seqused=int32(0, 1, n + 1, 400))
    check_carved((0, 128, 4, d), dtype, arch=arch, acc=True)
    _, cu, used, total = varlen_meta(n, 3, 500 if arch == 90 else 50)
    # the last: every sequence empty, nothing written
    for seq in ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used}, {"cu_seqlens": int32(0, 0, 0, 0, 0)}):
        check_carved((total, 2, d), dtype, arch=arch, acc=True, **seq)


def many_tiles_heads(tiles_per_head, waves=20):
    """Heads for at least `waves` tiles per SM: the sm_90 driver's persistent CTAs then walk many tiles each and
    their ring of input stages wraps several times."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(2, -(-waves * sms // (2 * tiles_per_head)))


@dtype_param
@pytest.mark.parametrize("d", (64, 96, 128, 192, 256))
def test_store_sm90_tiling(dtype, d):
    n = block_n(d)
    b, s = 2, 8 * n + 5  # a partial last tile per sequence
    h = many_tiles_heads(b * 9)
    dk_buf, dv_buf = canary((b, s + 3, h, d), dtype), canary((b, s + 3, h, d), dtype)
    check(dk_buf, dv_buf, dk_buf[:, 1 : s + 1], dv_buf[:, 2 : s + 2], acc=True)
    # varlen: random lengths (zeros too) and a seqused emptying some tiles: the CTAs skip those in the order of
    # their loads
    gen = torch.Generator().manual_seed(d)
    lens = torch.randint(0, 4 * n, (48,), generator=gen)
    lens[::7] = 0
    cu = cu_seqlens(lens.tolist())
    used = (lens - torch.randint(0, 2 * n, (48,), generator=gen)).clamp(min=0).to(torch.int32).cuda()
    h = many_tiles_heads(int(lens.sum()) // n + 48)
    for seq in ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used}):
        check_carved((int(cu[-1]) + 11, h, d), dtype, acc=True, **seq)
    # a varlen tile goes by TMA when all its rows lie inside the sequence (and seqused), by predicated stores
    # otherwise: tiles ending exactly at a sequence's end or at seqused, a sequence of full tiles only, and strided
    # views whose canaries a box one row or column too long would overwrite
    cu = cu_seqlens([2 * n, n + 3, 3 * n, 1, 4 * n + 1])
    total, h = int(cu[-1]), 3
    for seq in ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": int32(2 * n, n, 2 * n, 1, 3 * n - 1)}):
        dk_buf, dv_buf = canary((total + 5, h, d + 16), dtype), canary((total + 5, h + 1, d), dtype)
        check(dk_buf, dv_buf, dk_buf[2 : 2 + total, :, :d], dv_buf[3 : 3 + total, 1:], acc=True, **seq)


@dtype_param
@pytest.mark.parametrize("d", (128, 192, 256))
@pytest.mark.parametrize("extra_heads", (0, 1))
@pytest.mark.parametrize("metadata", ("none", "cu_seqlens", "seqused"))
def test_store_at_the_small_problem_threshold(dtype, d, extra_heads, metadata):
    # sm_90 small problems take other kernels: at hdim 128 up to one tile per SM (dK's and dV's) streams 64-row tiles
    # with two CTAs per SM, at hdim 192/256 up to two take one CTA per tile; one tile more: the streaming kernel. Both
    # sides of each switch, a partial tile per head: batched, as one varlen sequence (same tiles), with seqused.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s, h = block_n(d) - 3, (sms // 2 if d == 128 else sms) + extra_heads
    lead = (s + 2,) if metadata == "cu_seqlens" else (1, s + 2)
    dk_buf, dv_buf = canary((*lead, h, d), dtype), canary((*lead, h, d), dtype)
    seq = {"none": {}, "cu_seqlens": {"cu_seqlens": int32(0, s)}, "seqused": {"seqused": int32(s - 5)}}[metadata]
    check(dk_buf, dv_buf, dk_buf[..., 1 : s + 1, :, :], dv_buf[..., 1 : s + 1, :, :], acc=True, **seq)


@arch_param
@pytest.mark.parametrize("cu,used", [
    ([0, 100, 100000], None),  # last entry past the token count
    ([0, 250, 300], [400, 60]),  # seqused longer than its segment and than the tensor
    ([-500, 100, 200], None),  # negative start
    ([0, 300, 100], None),  # decreasing
])
def test_store_bad_metadata_unchecked_stays_inside_the_tensor(cu, used, arch):
    # contents are not checked by default (no host sync); the kernels clamp every row range to the tensor, so
    # whatever lands inside, nothing outside the tensor's memory may change
    total, h, d = 300, 2, 128
    buf_k, buf_v = canary((total + 64, h, d)), canary((total + 64, h, d))
    dk, dv = buf_k[32 : 32 + total], buf_v[32 : 32 + total]
    before_k, before_v = buf_k.clone(), buf_v.clone()
    seq = {"cu_seqlens": int32(*cu), **({} if used is None else {"seqused": int32(*used)})}
    acc = accum((total, h, d))
    fe.store(acc, acc, dk, dv, **seq, check_inputs=False, _arch=arch)
    fe.store_zero(dk, dv, **seq, check_inputs=False, _arch=arch)
    torch.cuda.synchronize()
    for buf, before in ((buf_k, before_k), (buf_v, before_v)):
        assert_bits(buf[:32], before[:32])
        assert_bits(buf[32 + total :], before[32 + total :])
    with pytest.raises(fe.FlashEpilogueInputError, match="cu_seqlens|seqused"):
        fe.store(acc, acc, dk, dv, **seq, check_inputs=True)

