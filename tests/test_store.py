"""GPU tests of `store` (bitwise `accum.to(dtype)` on every valid element) and `store_zero` (zeros exactly where the
reference writes them: the valid rows of the selected sequences and heads, within [row_start, row_end)); nothing else
in the canary buffers changes. Layout cases run on both code paths (`arch`: sm_90, and the sm_80 path on the same GPU)
with row edges at the path's kBlockN; the sm_90 driver's cases on sm_90 alone."""
from functools import partial

import pytest
import torch

import flash_epilogue as fe
from conftest import DTYPES, arch_param, cuda_graph
from flash_epilogue.ops import _store, _store_zero
from flash_epilogue.reference import store_reference, store_zero_reference
from flash_epilogue.testing import (CANARY_BITS, LAYOUTS, assert_bits, bits, block_n, canary, carve, cu_seqlens, int32,
                                    rand, same_view)

pytestmark = pytest.mark.gpu

HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)
DV_PAIRS = [(192, 128), (64, 128), (128, 64), (256, 128), (72, 200), (64, 256), (136, 72)]
FORMS = ("none", "list", "tensor", "int")
INT32_MAX = 2**31 - 1  # row_start/row_end are int32s (larger values are rejected)
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=str)
accum = partial(rand, binades=20)


def check(dk_buf, dv_buf, dk, dv, arch=90, acc=None, **kw):
    """store (acc: its accumulators, True: fresh ones) or else store_zero on (dk, dv), views into canary buffers;
    each whole buffer must equal bitwise the reference applied to a clone. Returns the expected zeros in dk."""
    expect_k, expect_v = dk_buf.clone(), dv_buf.clone()
    acc = (accum(dk.shape), accum(dv.shape)) if acc is True else acc
    if acc is None:  # unchecked: some cases pass out-of-range indices on purpose
        store_zero_reference(same_view(expect_k, dk), same_view(expect_v, dv), **kw)
        _store_zero(dk, dv, check_inputs=False, _arch=arch, **kw)
    else:
        store_reference(*acc, same_view(expect_k, dk), same_view(expect_v, dv), **kw)
        _store(*acc, dk, dv, _arch=arch, **kw)
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
    assert all(torch.equal(bits(out), bits(acc.to(dtype))) for out in outs)


@dtype_param
@pytest.mark.parametrize("d", (64, 96, 128, 192, 256))
def test_store_sm90_tiling(dtype, d):
    # heads for 20 tiles (dK's and dV's) per SM at least: the persistent CTAs walk many tiles each and their ring of
    # input stages wraps several times
    n, sms = block_n(d), torch.cuda.get_device_properties(0).multi_processor_count
    b, s = 2, 8 * n + 5  # a partial last tile per sequence: 9 tiles each
    h = max(2, -(-20 * sms // (2 * b * 9)))
    dk_buf, dv_buf = canary((b, s + 3, h, d), dtype), canary((b, s + 3, h, d), dtype)
    check(dk_buf, dv_buf, dk_buf[:, 1 : s + 1], dv_buf[:, 2 : s + 2], acc=True)
    # varlen: random lengths (zeros too) and a seqused emptying some tiles: the CTAs skip those in the order of
    # their loads
    gen = torch.Generator().manual_seed(d)
    lens = torch.randint(0, 4 * n, (48,), generator=gen)
    lens[::7] = 0
    cu = cu_seqlens(lens.tolist())
    used = (lens - torch.randint(0, 2 * n, (48,), generator=gen)).clamp(min=0).to(torch.int32).cuda()
    h = max(2, -(-20 * sms // (2 * (int(lens.sum()) // n + 48))))
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
    # small problems take other kernels: at hdim 128 up to one tile per SM (dK's and dV's) streams 64-row tiles with
    # two CTAs per SM, at hdim 192/256 up to two take one CTA per tile; one tile more: the streaming kernel. Both sides
    # of each switch, a partial tile per head: batched, as one varlen sequence (same tiles), with seqused.
    s = n - 3
    for extra_heads in (0, 1) if d >= 128 else ():
        h = (sms // 2 if d == 128 else sms) + extra_heads
        for lead, seq in (((1, s + 2), {}), ((s + 2,), {"cu_seqlens": int32(0, s)}),
                          ((1, s + 2), {"seqused": int32(s - 5)})):
            dk_buf, dv_buf = canary((*lead, h, d), dtype), canary((*lead, h, d), dtype)
            check(dk_buf, dv_buf, dk_buf[..., 1 : s + 1, :, :], dv_buf[..., 1 : s + 1, :, :], acc=True, **seq)
    # hdim 64 varlen: (64, 64) tiles from 2048 token rows per sequence on average, 128-row tiles below (4093 rows)
    for lens in ([2040, 2048], [2048, 2115], [1, 6147]) if d == 64 else ():
        cu, used = cu_seqlens(lens), int32(*[max(0, x - 67) for x in lens])
        for seq in ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used}):
            check_carved((sum(lens) + 5, 3, d), dtype, acc=True, **seq)


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
    _store(acc, acc, dk, dv, **seq, check_inputs=False, _arch=arch)
    _store_zero(dk, dv, **seq, check_inputs=False, _arch=arch)
    for buf, before in ((buf_k, before_k), (buf_v, before_v)):
        assert_bits(buf[:32], before[:32])
        assert_bits(buf[32 + total :], before[32 + total :])
    with pytest.raises(fe.FlashEpilogueInputError, match="cu_seqlens|seqused"):
        fe.store(acc, acc, dk, dv, **seq, check_inputs=True)


def selection(n, gen, form):
    """A random non-empty subset of range(n), in random order, as None / a list / an int32 CUDA tensor / one int."""
    if form == "none" or n == 0:
        return None
    k = int(torch.randint(1, n + 1, (1,), generator=gen))
    idx = torch.randperm(n, generator=gen)[:k].tolist()
    return idx if form == "list" else int32(*idx) if form == "tensor" else idx[0]


@dtype_param
@pytest.mark.parametrize("d", HEAD_DIMS)
@arch_param
@pytest.mark.parametrize("varlen", (False, True), ids=("batched", "varlen"))
def test_store_and_store_zero_seqused_varlen_rows_and_selections(dtype, d, arch, varlen):
    n = block_n(d, d, arch)
    gen = torch.Generator().manual_seed(d * (11 if varlen else 7) + arch + (dtype == torch.float16))
    if varlen:  # store: the last case has every sequence empty, nothing written
        _, cu, used, total = varlen_meta(n, 3, 500 if arch == 90 else 50)
        for seq in ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used}, {"cu_seqlens": int32(0, 0, 0, 0, 0)}):
            check_carved((total, 2, d), dtype, arch=arch, acc=True, **seq)
        batch, cu, used, total = varlen_meta(n)
        shape, seqs = (total, 2, d), ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used})
        ranges = [(0, None), (n - 1, n + 1), (n, None), (n + 1, 2 * n), (1, n - 1), (3, 3), (0, INT32_MAX)]
    else:  # store: seqlens at the tile edges, seqused, no batch
        for s in (0, 1, n - 1, n, n + 1, 1000, 4096):
            for batch, heads in ((1, 1), (2, 3)):
                check_carved((batch, s, heads, d), dtype, arch=arch, acc=True)
        check_carved((4, 400, 2, d), dtype, arch=arch, acc=True, seqused=int32(0, 1, n + 1, 400))
        check_carved((0, 128, 4, d), dtype, arch=arch, acc=True)
        batch, s = 3, 2 * n + 3
        shape, seqs = (batch, s, 3, d), ({}, {"seqused": int32(s, n + 1, 0)})
        ranges = [(0, None), (0, n - 1), (0, n), (0, n + 1), (n - 1, None), (n, None), (n + 1, None), (n - 1, n + 1),
                  (n + 1, 2 * n - 1), (1, 2 * n + 1), (n, n), (2 * n + 3, None), (3, INT32_MAX), (5 * n, None)]
    zeroed = 0
    for i, (r0, r1) in enumerate(ranges):
        for seq in seqs:
            zeroed += check_carved(shape, dtype, LAYOUTS[(i + len(seq)) % 3], arch,
                                   batch_idx=selection(batch, gen, FORMS[i % 4]),
                                   head_idx=selection(shape[-2], gen, FORMS[(i + 1 + len(seq)) % 4]),
                                   row_start=r0, row_end=r1, **seq)
    assert zeroed > 0  # the cases are not vacuous


@arch_param
@dtype_param
@pytest.mark.parametrize("d,dv", DV_PAIRS)
def test_store_and_store_zero_dv_differs_from_d(dtype, d, dv, arch):
    check_carved((2, 333, 3, d), dtype, arch=arch, shape_v=(2, 333, 3, dv), acc=True)
    lens = [0, 1, 95, 96, 97, 300]
    total = sum(lens) + 3
    check_carved((total, 3, d), dtype, arch=arch, shape_v=(total, 3, dv), acc=True, cu_seqlens=cu_seqlens(lens),
                 seqused=int32(*[max(0, x - 7) for x in lens]))
    n = block_n(d, dv, arch)
    gen = torch.Generator().manual_seed(d + dv + arch)
    b, s, h = 2, 2 * n + 1, 3
    for i, (r0, r1) in enumerate([(0, None), (n - 1, n + 1), (n, 2 * n), (n + 1, None)]):
        check_carved((b, s, h, d), dtype, LAYOUTS[i % 3], arch, (b, s, h, dv), seqused=int32(s, n),
                     batch_idx=selection(b, gen, FORMS[i % 4]), head_idx=selection(h, gen, "tensor"), row_start=r0,
                     row_end=r1)
    batch, cu, used, total = varlen_meta(n)
    for layout, seq in zip(("padded", "transposed"), ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used})):
        check_carved((total, h, d), dtype, layout, arch, (total, h, dv), batch_idx=selection(batch, gen, "list"),
                     head_idx=selection(h, gen, "list"), row_start=n - 1, **seq)


@dtype_param
@arch_param
def test_store_zero_selection_edges(dtype, arch):
    # out-of-range entries (negative ones too: no wrap-around) are skipped, duplicates harmless
    d, h = 128, 3
    n = block_n(d, d, arch)
    b, s = 3, n + 5
    for conv in ((lambda x: x), (lambda x: int32(*x))):  # a list, a tensor
        assert check_carved((b, s, h, d), dtype, "padded", arch, (b, s, h, 64), seqused=int32(s, 1, n + 1),
                            batch_idx=conv([3, -1, 1, 1, INT32_MAX, -2**31, 2]),
                            head_idx=conv([0, 0, 3, -1, 2, -2**31]), row_start=n - 1) > 0
        # nothing in range: nothing written
        assert check_carved((b, s, h, d), dtype, "plain", arch, batch_idx=conv([3, -1, 100]), head_idx=conv([0])) == 0
        assert check_carved((b, s, h, d), dtype, "plain", arch, batch_idx=conv([0, 1]), head_idx=conv([-1, 3])) == 0
    # varlen: the batch is cu_seqlens.numel() - 1, not the token count
    batch, cu, seq_used, total = varlen_meta(n)
    check_carved((total, h, d), dtype, ("transposed", "plain"), arch, cu_seqlens=cu, seqused=seq_used,
                 batch_idx=[batch, batch + 1, total - 1, 5, 4, 5, -1], head_idx=[2, 7, 2])
    # asked to check contents, the wrapper refuses them instead (host sync), before any write
    dk, dv = canary((b, s, h, d), dtype), canary((b, s, h, d), dtype)
    with pytest.raises(fe.FlashEpilogueInputError, match=r"batch_idx\[1\]: expected a value in \[0, 3\)"):
        _store_zero(dk, dv, batch_idx=[0, 3], check_inputs=True, _arch=arch)
    assert (bits(dk) == CANARY_BITS).all() and (bits(dv) == CANARY_BITS).all()
    # every one of these writes nothing: the buffers keep their canary bit for bit
    d, b, s, h = 64, 2, 40, 2
    for kw in ({"batch_idx": []}, {"batch_idx": int32()}, {"head_idx": []}, {"head_idx": int32(), "batch_idx": [0, 1]},
               {"row_start": 7, "row_end": 7}, {"row_start": s}, {"row_start": INT32_MAX},
               {"row_start": s + 1, "row_end": INT32_MAX}, {"seqused": int32(0, 0)},
               {"seqused": int32(3, 5), "row_start": 5}):
        assert check_carved((b, s, h, d), dtype, "padded", arch, **kw) == 0, kw
    # zero-extent tensors: no batch, no heads, no tokens
    for shape in ((0, s, h, d), (b, s, 0, d), (b, 0, h, d)):
        _store_zero(canary(shape, dtype), canary(shape, dtype), _arch=arch)
    cu = torch.zeros(3, dtype=torch.int32, device="cuda")
    _store_zero(canary((0, h, d), dtype), canary((0, h, d), dtype), cu_seqlens=cu, _arch=arch)
    # varlen whose sequences are all empty, with slack rows: nothing written
    assert check_carved((12, h, d), dtype, ("plain", "padded"), arch, cu_seqlens=cu) == 0
    # the default call zeroes every valid element, as zero_() would
    shape = (2, 300, 3, 96)
    dk, dv = canary(shape, dtype), canary(shape[:-1] + (32,), dtype)
    _store_zero(dk, dv, _arch=arch)
    assert (bits(dk) == 0).all() and (bits(dv) == 0).all()
    # an int, a tuple and a range select like the equivalent tensors
    for batch_idx, head_idx in ((1, 2), ((0,), range(1, 3)), (range(2), (2, 0))):
        assert check_carved(shape, dtype, ("transposed", "plain"), arch, batch_idx=batch_idx, head_idx=head_idx,
                            row_start=1) > 0


@arch_param
def test_store_zero_cuda_graph(arch):
    # no host sync: the call captures into a CUDA graph (tensor selections), and a replay reads the selections'
    # current contents
    dk_buf, dv_buf = canary((3, 200, 2, 128), torch.bfloat16), canary((3, 200, 2, 128), torch.bfloat16)
    batch_idx, head_idx = int32(1), int32(0, 1)
    kw = {"seqused": int32(200, 150, 7), "batch_idx": batch_idx, "head_idx": head_idx, "row_start": 5, "row_end": 170}
    # check_inputs=True: the content checks run in the warm-up and are skipped while capturing
    graph, _ = cuda_graph(lambda: _store_zero(dk_buf, dv_buf, check_inputs=True, _arch=arch, **kw))
    # the captured selection, then new contents of the same index tensors (an out-of-range head too)
    for batches, heads in (([1], [0, 1]), ([2], [1, -1]), ([0], [1, 1])):
        batch_idx.copy_(torch.tensor(batches, dtype=torch.int32))
        head_idx.copy_(torch.tensor(heads, dtype=torch.int32))
        bits(dk_buf).fill_(CANARY_BITS)
        bits(dv_buf).fill_(CANARY_BITS)
        expect_k, expect_v = dk_buf.clone(), dv_buf.clone()
        store_zero_reference(expect_k, expect_v, **kw)
        graph.replay()
        assert (bits(expect_k) == 0).any()
        assert_bits(dk_buf, expect_k, "dk")
        assert_bits(dv_buf, expect_v, "dv")
