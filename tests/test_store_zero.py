"""GPU tests of `store_zero`: zeros exactly where the reference writes them (the valid rows of the selected
sequences and heads, within [row_start, row_end)) and nothing else in the canary buffers, on both code paths."""
import pytest
import torch

import flash_epilogue as fe
from conftest import CANARY_BITS, LAYOUTS, arch_param, assert_bits, bits, block_n, canary, cuda_graph, int32
from flash_epilogue.reference import store_zero_reference
from test_store import DV_PAIRS, HEAD_DIMS, check_carved, dtype_param, varlen_meta

pytestmark = pytest.mark.gpu

FORMS = ("none", "list", "tensor", "int")
INT32_MAX = 2**31 - 1  # row_start/row_end are int32s (larger values are rejected)


def row_ranges(n):
    """[row_start, row_end) pairs with edges at kBlockN - 1, kBlockN, kBlockN + 1 (and beyond)."""
    return [(0, None), (0, n - 1), (0, n), (0, n + 1), (n - 1, None), (n, None), (n + 1, None), (n - 1, n + 1),
            (n + 1, 2 * n - 1), (1, 2 * n + 1), (n, n), (2 * n + 3, None), (3, INT32_MAX), (5 * n, None)]


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
def test_store_zero_rows_and_selections(dtype, d, arch, varlen):
    n = block_n(d, d, arch)
    gen = torch.Generator().manual_seed(d * (11 if varlen else 7) + arch + (dtype == torch.float16))
    if varlen:
        batch, cu, used, total = varlen_meta(n)
        shape, seqs = (total, 2, d), ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used})
        ranges = [(0, None), (n - 1, n + 1), (n, None), (n + 1, 2 * n), (1, n - 1), (3, 3), (0, INT32_MAX)]
    else:
        batch, s = 3, 2 * n + 3
        shape, seqs, ranges = (batch, s, 3, d), ({}, {"seqused": int32(s, n + 1, 0)}), row_ranges(n)
    zeroed = 0
    for i, (r0, r1) in enumerate(ranges):
        for seq in seqs:
            zeroed += check_carved(shape, dtype, LAYOUTS[(i + len(seq)) % 3], arch,
                                   batch_idx=selection(batch, gen, FORMS[i % 4]),
                                   head_idx=selection(shape[-2], gen, FORMS[(i + 1 + len(seq)) % 4]),
                                   row_start=r0, row_end=r1, **seq)
    assert zeroed > 0  # the cases are not vacuous


@dtype_param
@pytest.mark.parametrize("d,dv_dim", DV_PAIRS)
@arch_param
def test_store_zero_dv_differs_from_d(dtype, d, dv_dim, arch):
    n = block_n(d, dv_dim, arch)
    gen = torch.Generator().manual_seed(d + dv_dim + arch)
    b, s, h = 2, 2 * n + 1, 3
    for i, (r0, r1) in enumerate([(0, None), (n - 1, n + 1), (n, 2 * n), (n + 1, None)]):
        check_carved((b, s, h, d), dtype, LAYOUTS[i % 3], arch, (b, s, h, dv_dim), seqused=int32(s, n),
                     batch_idx=selection(b, gen, FORMS[i % 4]), head_idx=selection(h, gen, "tensor"), row_start=r0,
                     row_end=r1)
    batch, cu, used, total = varlen_meta(n)
    for layout, seq in zip(("padded", "transposed"), ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used})):
        check_carved((total, h, d), dtype, layout, arch, (total, h, dv_dim), batch_idx=selection(batch, gen, "list"),
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
        fe.store_zero(dk, dv, batch_idx=[0, 3], check_inputs=True, _arch=arch)
    torch.cuda.synchronize()
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
        fe.store_zero(canary(shape, dtype), canary(shape, dtype), _arch=arch)
    cu = torch.zeros(3, dtype=torch.int32, device="cuda")
    fe.store_zero(canary((0, h, d), dtype), canary((0, h, d), dtype), cu_seqlens=cu, _arch=arch)
    # varlen whose sequences are all empty, with slack rows: nothing written
    assert check_carved((12, h, d), dtype, ("plain", "padded"), arch, cu_seqlens=cu) == 0
    # the default call zeroes every valid element, as zero_() would
    shape = (2, 300, 3, 96)
    dk, dv = canary(shape, dtype), canary(shape[:-1] + (32,), dtype)
    fe.store_zero(dk, dv, _arch=arch)
    torch.cuda.synchronize()
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
