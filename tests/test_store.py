"""GPU tests of `store`: bitwise equal to `accum.to(dtype)` on every valid element, and nothing
else in the surrounding buffer changes (outputs are carved out of canary-filled buffers)."""
import pytest
import torch

import flash_epilogue as fe
from flash_epilogue.reference import store_reference

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)
CANARY_BITS = 0x7FBF  # a NaN payload no conversion produces: an unwritten element stays exactly this


def fresh_accum(shape, device="cuda", generator=None):
    """fp32 values over many binades (rounding of large and tiny magnitudes is exercised too)."""
    x = torch.randn(shape, device=device, generator=generator)
    exponent = torch.randint(-20, 20, shape, device=device, generator=generator).float()
    return x * torch.exp2(exponent)


def canary_buffer(shape, dtype):
    return torch.full(shape, 0, dtype=torch.int16, device="cuda").fill_(CANARY_BITS).view(dtype)


def bits(t):
    return t.view(torch.int16)


def check_store(dk_buf, dv_buf, dk, dv, dk_accum, dv_accum, store_kw=None, **seq):
    """Run the kernel on (dk, dv), views into canary-filled buffers, and compare each buffer
    bitwise with the reference applied to a copy. `store_kw` goes to fe.store only (e.g. _arch)."""
    expect_k, expect_v = dk_buf.clone(), dv_buf.clone()
    # the views of the copies at the same offsets and strides
    ek = expect_k.as_strided(dk.shape, dk.stride(), dk.storage_offset())
    ev = expect_v.as_strided(dv.shape, dv.stride(), dv.storage_offset())
    store_reference(dk_accum, dv_accum, ek, ev, **seq)
    fe.store(dk_accum, dv_accum, dk, dv, **seq, **(store_kw or {}))
    torch.cuda.synchronize()
    assert torch.equal(bits(dk_buf), bits(expect_k)), _first_diff(dk_buf, expect_k)
    assert torch.equal(bits(dv_buf), bits(expect_v)), _first_diff(dv_buf, expect_v)


def _first_diff(got, want):
    idx = (bits(got) != bits(want)).nonzero()
    return f"{idx.shape[0]} elements differ, first at {idx[0].tolist()}: got {got[tuple(idx[0])]}, want {want[tuple(idx[0])]}"


def block_n(d, dv=None):
    return fe.tile_config(d, dv).block_n


def seqlens_for(d):
    n = block_n(d)
    return (0, 1, n - 1, n, n + 1, 1000, 4096)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("seq_idx", range(7))
@pytest.mark.parametrize("batch,heads", [(1, 1), (2, 3)])
def test_store_batched(dtype, d, seq_idx, batch, heads):
    seqlen = seqlens_for(d)[seq_idx]
    shape = (batch, seqlen, heads, d)
    dk_buf, dv_buf = canary_buffer(shape, dtype), canary_buffer(shape, dtype)
    check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum(shape), fresh_accum(shape))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", [0, 80])
def test_store_empty_batch(dtype, arch):
    shape = (0, 128, 4, 128)
    dk = canary_buffer(shape, dtype)
    fe.store(fresh_accum(shape), fresh_accum(shape), dk, canary_buffer(shape, dtype), _arch=arch)
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (64, 128, 192, 256))
def test_store_bhsd_layout(dtype, d):
    # outputs stored (batch, heads, seqlen, d) and passed as (batch, seqlen, heads, d) views
    b, h, s = 2, 4, 777
    dk_buf, dv_buf = canary_buffer((b, h, s, d), dtype), canary_buffer((b, h, s, d), dtype)
    accum_k = fresh_accum((b, h, s, d)).transpose(1, 2)
    accum_v = fresh_accum((b, s, h, d))  # the inputs need not share the outputs' layout
    check_store(dk_buf, dv_buf, dk_buf.transpose(1, 2), dv_buf.transpose(1, 2), accum_k, accum_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (64, 96, 128, 192, 256))
def test_store_strided_views(dtype, d):
    # dk/dv carved out of wider buffers: padded rows, extra heads, padded head dim, and a
    # batch stride with slack; everything outside the view must keep its canary
    b, s, h = 3, 300, 2
    dk_buf = canary_buffer((b + 1, s + 5, h + 2, d + 16), dtype)
    dv_buf = canary_buffer((b, s, 2 * h, d + 8), dtype)
    dk = dk_buf[1:, 2 : s + 2, 1 : h + 1, :d]
    dv = dv_buf[:, :, ::2, :d]
    accum_buf = fresh_accum((b, s, h, d + 4))
    check_store(dk_buf, dv_buf, dk, dv, accum_buf[..., :d], fresh_accum((b, s, h, d)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", [0, 80])
def test_store_size_one_dims_with_odd_strides(dtype, arch):
    # batch 1 and heads 1 with strides no one could use: normalized, not rejected
    s, d = 200, 128
    base = canary_buffer((s * d + 64,), dtype)
    dk = base.as_strided((1, s, 1, d), (3, d, 5, 1))
    dv_buf = canary_buffer((1, s, 1, d), dtype)
    dv = dv_buf.as_strided((1, s, 1, d), (7, d, 1, 1))
    accum = fresh_accum((1, s, 1, d)).as_strided((1, s, 1, d), (1, d, 3, 1))
    check_store(base, dv_buf, dk, dv, accum, fresh_accum((1, s, 1, d)), store_kw={"_arch": arch})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128), (128, 64), (256, 128), (72, 200)])
def test_store_dv_differs_from_d(dtype, d, dv):
    b, s, h = 2, 333, 3
    dk_buf, dv_buf = canary_buffer((b, s, h, d), dtype), canary_buffer((b, s, h, dv), dtype)
    check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum((b, s, h, d)), fresh_accum((b, s, h, dv)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (64, 128, 192, 256))
def test_store_varlen_and_seqused(dtype, d):
    n = block_n(d)
    lens = [0, 1, n - 1, n, n + 1, 3 * n + 7, 0, 500]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    total, h = int(cu[-1]) + 9, 2  # slack rows after the last sequence stay untouched
    used = torch.tensor([max(0, x - (i % 3) * 5) for i, x in enumerate(lens)], dtype=torch.int32).cuda()
    for seq in ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used}):
        dk_buf, dv_buf = canary_buffer((total, h, d), dtype), canary_buffer((total, h, d), dtype)
        check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum((total, h, d)), fresh_accum((total, h, d)), **seq)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_seqused_batched(dtype):
    b, s, h, d = 4, 400, 2, 128
    used = torch.tensor([0, 1, 129, 400], dtype=torch.int32, device="cuda")
    dk_buf, dv_buf = canary_buffer((b, s, h, d), dtype), canary_buffer((b, s, h, d), dtype)
    check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum((b, s, h, d)), fresh_accum((b, s, h, d)), seqused=used)


def many_tiles_heads(d, tiles_per_head, waves=20):
    """Heads for at least `waves` tiles per SM: the sm_90 driver's persistent CTAs then walk many
    tiles each and their ring of input stages wraps several times."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(2, -(-waves * sms // (2 * tiles_per_head)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (64, 96, 128, 192, 256))
def test_store_many_tiles_per_cta(dtype, d):
    n = block_n(d)
    b, s = 2, 8 * n + 5  # a partial last tile per sequence
    h = many_tiles_heads(d, b * 9)
    dk_buf, dv_buf = canary_buffer((b, s + 3, h, d), dtype), canary_buffer((b, s + 3, h, d), dtype)
    dk, dv = dk_buf[:, 1 : s + 1], dv_buf[:, 2 : s + 2]  # rows outside the views stay untouched
    check_store(dk_buf, dv_buf, dk, dv, fresh_accum((b, s, h, d)), fresh_accum((b, s, h, d)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (128, 192, 256))
@pytest.mark.parametrize("extra_heads", (0, 1))
@pytest.mark.parametrize("metadata", ("none", "cu_seqlens", "seqused"))
def test_store_at_the_small_problem_threshold(dtype, d, extra_heads, metadata):
    # sm_90 small problems take other kernels: at hdim 128 up to one tile per SM (dK's and dV's)
    # streams 64-row tiles with two CTAs per SM, at hdim 192/256 up to two take one CTA per tile;
    # one tile more takes the streaming kernel. Both sides of each switch, a partial tile per head,
    # batched, packed as one varlen sequence (the same tile count) and batched with seqused.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s, h = block_n(d) - 3, (sms // 2 if d == 128 else sms) + extra_heads
    lead = (s + 2,) if metadata == "cu_seqlens" else (1, s + 2)
    dk_buf, dv_buf = canary_buffer((*lead, h, d), dtype), canary_buffer((*lead, h, d), dtype)
    rows = slice(1, s + 1)
    dk, dv = (dk_buf[rows], dv_buf[rows]) if metadata == "cu_seqlens" else (dk_buf[:, rows], dv_buf[:, rows])
    seq = {}
    if metadata == "cu_seqlens":
        seq["cu_seqlens"] = torch.tensor([0, s], dtype=torch.int32, device="cuda")
    elif metadata == "seqused":
        seq["seqused"] = torch.tensor([s - 5], dtype=torch.int32, device="cuda")
    check_store(dk_buf, dv_buf, dk, dv, fresh_accum(dk.shape), fresh_accum(dv.shape), **seq)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", (128, 256))
def test_store_varlen_many_tiles_per_cta(dtype, d):
    # random lengths (zeros included) and a seqused that empties some tiles: the CTAs skip those
    # in the same order as their loads
    n = block_n(d)
    gen = torch.Generator().manual_seed(d)
    lens = torch.randint(0, 4 * n, (48,), generator=gen)
    lens[::7] = 0
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32).cuda()
    used = (lens - torch.randint(0, 2 * n, (48,), generator=gen)).clamp(min=0).to(torch.int32).cuda()
    total = int(cu[-1]) + 11
    h = many_tiles_heads(d, int(lens.sum()) // n + 48)
    for seq in ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used}):
        dk_buf, dv_buf = canary_buffer((total, h, d), dtype), canary_buffer((total, h, d), dtype)
        check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum((total, h, d)), fresh_accum((total, h, d)), **seq)


def test_store_matches_plain_to():
    # the spec in one line: bitwise accum.to(dtype)
    acc = fresh_accum((2, 1000, 4, 128))
    out = torch.empty_like(acc, dtype=torch.bfloat16)
    out_v = torch.empty_like(acc, dtype=torch.bfloat16)
    torch.ops.flash_epilogue.store(acc, acc, out, out_v)
    assert torch.equal(bits(out), bits(acc.to(torch.bfloat16)))
    assert torch.equal(bits(out_v), bits(acc.to(torch.bfloat16)))


def test_store_on_side_stream():
    acc = fresh_accum((2, 1000, 4, 128))
    out, out_v = torch.empty_like(acc, dtype=torch.float16), torch.empty_like(acc, dtype=torch.float16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fe.store(acc, acc, out, out_v)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(bits(out), bits(acc.to(torch.float16)))


def test_torch_ops_backstop_rejects_bad_input():
    # callers that skip the Python wrapper still get a clear error, not a bad launch
    acc = fresh_accum((1, 16, 1, 64))
    out = torch.empty_like(acc, dtype=torch.bfloat16)
    # the op's messages are the Python validation's; a wrong dtype is a TypeError, other values ValueError
    with pytest.raises(TypeError, match=r"^flash_epilogue\.store: dk_accum: dtype: expected torch\.float32, "
                                        r"got torch\.float64$"):
        torch.ops.flash_epilogue.store(acc.double(), acc, out, out.clone())
    with pytest.raises(ValueError, match=r"^flash_epilogue\.store: dk: head dim: expected a multiple of 8"):
        a = fresh_accum((1, 16, 1, 12))
        torch.ops.flash_epilogue.store(a, a, a.bfloat16(), a.bfloat16())
    with pytest.raises(ValueError, match=r"^flash_epilogue\.store: dk: stride\(1\)"):
        a = fresh_accum((1, 16, 1, 64))
        o = canary_buffer((1, 16, 1, 68), torch.bfloat16)[..., :64]
        torch.ops.flash_epilogue.store(a, a, o, out)
    # the process is healthy afterwards
    torch.ops.flash_epilogue.store(acc, acc, out, out.clone())
    torch.cuda.synchronize()


@pytest.mark.parametrize("arch", [0, 80])
@pytest.mark.parametrize("cu,used", [
    ([0, 100, 100000], None),        # last entry past the token count
    ([0, 250, 300], [400, 60]),      # seqused longer than its segment and than the tensor
    ([-500, 100, 200], None),        # negative start
    ([0, 300, 100], None),           # decreasing
])
def test_store_bad_metadata_unchecked_stays_inside_the_tensor(cu, used, arch):
    # contents are not checked by default (no host sync); the kernels clamp every row range to the
    # tensor, so whatever lands inside, nothing outside the tensor's memory may change
    total, h, d = 300, 2, 128
    buf_k, buf_v = canary_buffer((total + 64, h, d), torch.bfloat16), canary_buffer((total + 64, h, d), torch.bfloat16)
    dk, dv = buf_k[32 : 32 + total], buf_v[32 : 32 + total]
    before_k, before_v = buf_k.clone(), buf_v.clone()
    seq = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32, device="cuda")}
    if used is not None:
        seq["seqused"] = torch.tensor(used, dtype=torch.int32, device="cuda")
    acc = fresh_accum((total, h, d))
    fe.store(acc, acc, dk, dv, **seq, check_inputs=False, _arch=arch)
    fe.store_zero(dk, dv, **seq, check_inputs=False, _arch=arch)
    torch.cuda.synchronize()
    for buf, before in ((buf_k, before_k), (buf_v, before_v)):
        assert torch.equal(bits(buf[:32]), bits(before[:32]))
        assert torch.equal(bits(buf[32 + total :]), bits(before[32 + total :]))
    with pytest.raises(fe.FlashEpilogueInputError, match="cu_seqlens|seqused"):
        fe.store(acc, acc, dk, dv, **seq, check_inputs=True)


@pytest.mark.parametrize("d", (64, 96, 128, 256))
def test_store_varlen_full_tiles_strided(d):
    # sm_90 stores a varlen tile by TMA when all its rows lie inside the sequence (and seqused),
    # by predicated stores otherwise. Tiles ending exactly at a sequence's end or at seqused, a
    # sequence of full tiles only, and strided views (padding columns and rows around them) whose
    # canaries a box one row or column too long would overwrite.
    n = block_n(d)
    lens = [2 * n, n + 3, 3 * n, 1, 4 * n + 1]
    used = [2 * n, n, 2 * n, 1, 3 * n - 1]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    total, h = int(cu[-1]), 3
    for seq in ({"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": seqused}):
        dk_buf = canary_buffer((total + 5, h, d + 16), torch.bfloat16)
        dv_buf = canary_buffer((total + 5, h + 1, d), torch.bfloat16)
        dk, dv = dk_buf[2 : 2 + total, :, :d], dv_buf[3 : 3 + total, 1:]
        check_store(dk_buf, dv_buf, dk, dv, fresh_accum((total, h, d)), fresh_accum((total, h, d)), **seq)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_varlen_all_sequences_empty(dtype):
    total, h, d = 200, 2, 64
    cu = torch.zeros(5, dtype=torch.int32, device="cuda")
    dk_buf, dv_buf = canary_buffer((total, h, d), dtype), canary_buffer((total, h, d), dtype)
    check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum((total, h, d)), fresh_accum((total, h, d)), cu_seqlens=cu)
    assert torch.equal(bits(dk_buf), bits(canary_buffer((total, h, d), dtype)))


@pytest.mark.parametrize("arch", [0, 80])
@pytest.mark.parametrize("d,dv", [(192, 128), (64, 256), (136, 72)])
def test_store_varlen_dv_differs_from_d(d, dv, arch):
    lens = [0, 1, 95, 96, 97, 300]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    total, h = int(cu[-1]) + 3, 3
    used = torch.tensor([max(0, x - 7) for x in lens], dtype=torch.int32, device="cuda")
    dk_buf, dv_buf = canary_buffer((total, h, d), torch.bfloat16), canary_buffer((total, h, dv), torch.bfloat16)
    check_store(dk_buf, dv_buf, dk_buf, dv_buf, fresh_accum((total, h, d)), fresh_accum((total, h, dv)),
                store_kw={"_arch": arch}, cu_seqlens=cu, seqused=used)
