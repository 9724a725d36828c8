"""GPU tests of `store_zero`: the kernel writes zeros exactly where the reference does (the valid
rows of the selected sequences and heads, within [row_start, row_end)) and nothing else. dk/dv
are views carved out of canary-filled buffers and each WHOLE buffer is compared bitwise with the
reference applied to a clone; every case runs on both code paths (`arch`
90 and 80), which must give identical results. Small shapes: well under 2 s of GPU time on an H200.
"""
import pytest
import torch

import flash_epilogue as fe
from conftest import (CANARY_BITS, DTYPES, arch_param, assert_bits, bits, block_n, canary, carve, cuda_graph,
                      int32)
from flash_epilogue.reference import store_zero_reference

pytestmark = pytest.mark.gpu

HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)
DV_PAIRS = [(192, 128), (64, 128), (128, 64), (256, 128), (72, 200)]
FORMS = ("none", "list", "tensor", "int")
INT32_MAX = 2**31 - 1  # row_start/row_end are int32s (larger values are rejected)


def row_ranges(n):
    """[row_start, row_end) pairs with edges at kBlockN - 1, kBlockN, kBlockN + 1 (and beyond)."""
    return [(0, None), (0, n - 1), (0, n), (0, n + 1), (n - 1, None), (n, None), (n + 1, None), (n - 1, n + 1),
            (n + 1, 2 * n - 1), (1, 2 * n + 1), (n, n), (2 * n + 3, None), (3, INT32_MAX), (5 * n, None)]


def selection(n, gen, form):
    """A random non-empty subset of range(n), in random order, as None / a list / an int32 CUDA
    tensor / one int."""
    if form == "none" or n == 0:
        return None
    k = int(torch.randint(1, n + 1, (1,), generator=gen))
    idx = torch.randperm(n, generator=gen)[:k].tolist()
    if form == "list":
        return idx
    if form == "tensor":
        return int32(*idx)
    return idx[0]


def check_zero(dk_buf, dv_buf, dk, dv, arch, check_inputs=False, **kw):
    """store_zero on (dk, dv), views into canary-filled buffers; each whole buffer must equal,
    bit for bit, the reference applied to a clone. Returns the number of zeroed dk elements."""
    expect_k, expect_v = dk_buf.clone(), dv_buf.clone()
    ek = expect_k.as_strided(dk.shape, dk.stride(), dk.storage_offset())
    ev = expect_v.as_strided(dv.shape, dv.stride(), dv.storage_offset())
    store_zero_reference(ek, ev, **kw)
    fe.store_zero(dk, dv, check_inputs=check_inputs, _arch=arch, **kw)
    torch.cuda.synchronize()
    assert_bits(dk_buf, expect_k, "dk")
    assert_bits(dv_buf, expect_v, "dv")
    return int((bits(expect_k) == 0).sum())


def varlen_meta(n):
    lens = [0, 1, n - 1, n, n + 1, 2 * n + 7, 0, 37]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    used = torch.tensor([max(0, x - (i % 3) * 5) for i, x in enumerate(lens)], dtype=torch.int32)
    return len(lens), cu.cuda(), used.cuda(), int(cu[-1]) + 9  # 9 slack rows after the last sequence


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@arch_param
def test_store_zero_batched(dtype, d, arch):
    n = block_n(d, d, arch)
    b, s, h = 3, 2 * n + 3, 3
    gen = torch.Generator().manual_seed(d * 7 + arch + (dtype == torch.float16))
    used = int32(s, n + 1, 0)
    zeroed = 0
    for i, (r0, r1) in enumerate(row_ranges(n)):
        for seq in ({}, {"seqused": used}):
            layout = ("plain", "padded", "transposed")[(i + len(seq)) % 3]
            (dk_buf, dk), (dv_buf, dv) = carve((b, s, h, d), dtype, layout), carve((b, s, h, d), dtype, layout)
            batch_idx = selection(b, gen, FORMS[i % 4])
            head_idx = selection(h, gen, FORMS[(i + 1 + len(seq)) % 4])
            zeroed += check_zero(dk_buf, dv_buf, dk, dv, arch, batch_idx=batch_idx, head_idx=head_idx,
                                 row_start=r0, row_end=r1, **seq)
    assert zeroed > 0  # the cases are not vacuous


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@arch_param
def test_store_zero_varlen(dtype, d, arch):
    n = block_n(d, d, arch)
    batch, cu, used, total = varlen_meta(n)
    h = 2
    gen = torch.Generator().manual_seed(d * 11 + arch + (dtype == torch.float16))
    ranges = [(0, None), (n - 1, n + 1), (n, None), (n + 1, 2 * n), (1, n - 1), (3, 3), (0, INT32_MAX)]
    for i, (r0, r1) in enumerate(ranges):
        for seq in ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used}):
            layout = ("plain", "padded", "transposed")[(i + len(seq)) % 3]
            (dk_buf, dk), (dv_buf, dv) = carve((total, h, d), dtype, layout), carve((total, h, d), dtype, layout)
            check_zero(dk_buf, dv_buf, dk, dv, arch, batch_idx=selection(batch, gen, FORMS[i % 4]),
                       head_idx=selection(h, gen, FORMS[(i + 2) % 4]), row_start=r0, row_end=r1, **seq)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,dv_dim", DV_PAIRS)
@arch_param
def test_store_zero_dv_differs_from_d(dtype, d, dv_dim, arch):
    n = block_n(d, dv_dim, arch)
    gen = torch.Generator().manual_seed(d + dv_dim + arch)
    b, s, h = 2, 2 * n + 1, 3
    for i, (r0, r1) in enumerate([(0, None), (n - 1, n + 1), (n, 2 * n), (n + 1, None)]):
        layout = ("plain", "padded", "transposed")[i % 3]
        (dk_buf, dk), (dv_buf, dv) = carve((b, s, h, d), dtype, layout), carve((b, s, h, dv_dim), dtype, layout)
        check_zero(dk_buf, dv_buf, dk, dv, arch, seqused=int32(s, n),
                   batch_idx=selection(b, gen, FORMS[i % 4]), head_idx=selection(h, gen, "tensor"),
                   row_start=r0, row_end=r1)
    batch, cu, used, total = varlen_meta(n)
    for i, seq in enumerate(({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used})):
        layout = ("padded", "transposed")[i]
        (dk_buf, dk), (dv_buf, dv) = carve((total, h, d), dtype, layout), carve((total, h, dv_dim), dtype, layout)
        check_zero(dk_buf, dv_buf, dk, dv, arch, batch_idx=selection(batch, gen, "list"),
                   head_idx=selection(h, gen, "list"), row_start=n - 1, **seq)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@arch_param
def test_store_zero_out_of_range_and_duplicate_indices(dtype, arch):
    # out-of-range entries (negative ones too: no wrap-around) are skipped, duplicates harmless
    d, h = 128, 3
    n = block_n(d, d, arch)
    b, s = 3, n + 5
    used = int32(s, 1, n + 1)
    bad_b = [3, -1, 1, 1, 2**31 - 1, -2**31, 2]
    bad_h = [0, 0, 3, -1, 2, -2**31]
    for form in ("list", "tensor"):
        conv = (lambda x: x) if form == "list" else (lambda x: int32(*x))
        (dk_buf, dk), (dv_buf, dv) = carve((b, s, h, d), dtype, "padded"), carve((b, s, h, 64), dtype, "padded")
        assert check_zero(dk_buf, dv_buf, dk, dv, arch, seqused=used, batch_idx=conv(bad_b),
                          head_idx=conv(bad_h), row_start=n - 1) > 0
        # nothing in range: nothing written
        (dk_buf, dk), (dv_buf, dv) = carve((b, s, h, d), dtype, "plain"), carve((b, s, h, d), dtype, "plain")
        assert check_zero(dk_buf, dv_buf, dk, dv, arch, batch_idx=conv([3, -1, 100]), head_idx=conv([0])) == 0
        assert check_zero(dk_buf, dv_buf, dk, dv, arch, batch_idx=conv([0, 1]), head_idx=conv([-1, 3])) == 0
    # varlen: the batch is cu_seqlens.numel() - 1, not the token count
    batch, cu, seq_used, total = varlen_meta(n)
    (dk_buf, dk), (dv_buf, dv) = carve((total, h, d), dtype, "transposed"), carve((total, h, d), dtype, "plain")
    check_zero(dk_buf, dv_buf, dk, dv, arch, cu_seqlens=cu, seqused=seq_used,
               batch_idx=[batch, batch + 1, total - 1, 5, 4, 5, -1], head_idx=[2, 7, 2])
    # asked to check contents, the wrapper refuses them instead (host sync), before any write
    (dk_buf, dk), (dv_buf, dv) = carve((b, s, h, d), dtype, "plain"), carve((b, s, h, d), dtype, "plain")
    with pytest.raises(fe.FlashEpilogueInputError, match=r"batch_idx\[1\]: expected a value in \[0, 3\)"):
        fe.store_zero(dk, dv, batch_idx=[0, 3], check_inputs=True, _arch=arch)
    torch.cuda.synchronize()
    assert (bits(dk_buf) == CANARY_BITS).all() and (bits(dv_buf) == CANARY_BITS).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@arch_param
def test_store_zero_empty_selections(dtype, arch):
    # every one of these writes nothing: the buffers keep their canary bit for bit
    d, b, s, h = 64, 2, 40, 2
    shape = (b, s, h, d)
    empty = int32()
    zeros = torch.zeros(b, dtype=torch.int32, device="cuda")
    cases = [{"batch_idx": []}, {"batch_idx": empty}, {"head_idx": []}, {"head_idx": empty, "batch_idx": [0, 1]},
             {"row_start": 7, "row_end": 7}, {"row_start": s}, {"row_start": INT32_MAX},
             {"row_start": s + 1, "row_end": INT32_MAX}, {"seqused": zeros}, {"seqused": int32(3, 5), "row_start": 5}]
    for kw in cases:
        (dk_buf, dk), (dv_buf, dv) = carve(shape, dtype, "padded"), carve(shape, dtype, "padded")
        assert check_zero(dk_buf, dv_buf, dk, dv, arch, **kw) == 0, kw
    # zero-extent tensors: no batch, no heads, no tokens
    for shape in ((0, s, h, d), (b, s, 0, d), (b, 0, h, d)):
        dk, dv = canary(shape, dtype), canary(shape, dtype)
        fe.store_zero(dk, dv, _arch=arch)
    cu = torch.zeros(3, dtype=torch.int32, device="cuda")
    dk, dv = canary((0, h, d), dtype), canary((0, h, d), dtype)
    fe.store_zero(dk, dv, cu_seqlens=cu, _arch=arch)
    # varlen whose sequences are all empty, with slack rows: nothing written
    (dk_buf, dk), (dv_buf, dv) = carve((12, h, d), dtype, "plain"), carve((12, h, d), dtype, "padded")
    assert check_zero(dk_buf, dv_buf, dk, dv, arch, cu_seqlens=cu) == 0
    torch.cuda.synchronize()


@arch_param
def test_store_zero_whole_tensor_and_int_selections(arch):
    # the default call zeroes every valid element, as zero_() would
    shape = (2, 300, 3, 96)
    dk, dv = canary(shape, torch.bfloat16), canary(shape[:-1] + (32,), torch.bfloat16)
    fe.store_zero(dk, dv, _arch=arch)
    torch.cuda.synchronize()
    assert (bits(dk) == 0).all() and (bits(dv) == 0).all()
    # an int, a tuple and a range select like the equivalent tensors
    for batch_idx, head_idx in ((1, 2), ((0,), range(1, 3)), (range(2), (2, 0))):
        (dk_buf, dk), (dv_buf, dv) = carve(shape, torch.float16, "transposed"), carve(shape, torch.float16, "plain")
        assert check_zero(dk_buf, dv_buf, dk, dv, arch, batch_idx=batch_idx, head_idx=head_idx, row_start=1) > 0


@arch_param
def test_store_zero_cuda_graph(arch):
    # no host sync: the call captures into a CUDA graph (tensor selections), and a replay reads
    # the selections' current contents
    shape = (3, 200, 2, 128)
    dk_buf, dv_buf = canary(shape, torch.bfloat16), canary(shape, torch.bfloat16)
    batch_idx = int32(1)
    head_idx = int32(0, 1)
    used = int32(200, 150, 7)
    kw = {"seqused": used, "batch_idx": batch_idx, "head_idx": head_idx, "row_start": 5, "row_end": 170}
    # check_inputs=True: the content checks run in the warm-up and are skipped while capturing
    graph, _ = cuda_graph(lambda: fe.store_zero(dk_buf, dv_buf, check_inputs=True, _arch=arch, **kw))
    # the captured selection, then new contents of the same index tensors (an out-of-range head too)
    for batches, heads in (([1], [0, 1]), ([2], [1, -1]), ([0], [1, 1])):
        batch_idx.copy_(torch.tensor(batches, dtype=torch.int32))
        head_idx.copy_(torch.tensor(heads, dtype=torch.int32))
        bits(dk_buf).fill_(CANARY_BITS)
        bits(dv_buf).fill_(CANARY_BITS)
        expect_k, expect_v = dk_buf.clone(), dv_buf.clone()
        store_zero_reference(expect_k, expect_v, **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert (bits(expect_k) == 0).any()
        assert_bits(dk_buf, expect_k, "dk")
        assert_bits(dv_buf, expect_v, "dv")
