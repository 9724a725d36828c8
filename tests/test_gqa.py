"""GPU tests of the GQA ops: gqa_accumulate (+ GQAAccumulator.to_dense), gqa_postprocess, gqa_reduce.

Oracles (flash_epilogue/reference.py):
* deterministic gqa_accumulate and gqa_reduce: bitwise equal to the sequential fp32 sum of the
  group in head order (``acc + p_0 + p_1 + ... + p_{g-1}``), computed by the reference;
* non-deterministic gqa_accumulate: within a derived bound of the fp64 sum (see
  :func:`check_accumulate`);
* gqa_postprocess: bitwise ``(dense * fp32(scale)).to(dtype)`` of the accumulator's own values
  (read back with to_dense), and nothing outside the valid rows written: outputs are views
  carved out of canary-filled buffers and each WHOLE buffer is compared bitwise.

Every case runs on both code paths (`arch` 90 and 80). Test data spans several binades but stays
far from fp32 subnormals (the non-deterministic sm_80 path's atomics flush them; the reference would
not), but for test_gqa_subnormals_kept (the deterministic modes and gqa_reduce keep them).
"""
from types import SimpleNamespace

import pytest
import torch

import flash_epilogue as fe
from conftest import (CANARY_BITS, DTYPES, arch_param, assert_bits, bits, block_n, canary, carve, cu_seqlens,
                      cuda_graph, deterministic_algorithms, generator, input_view, int32, rand, same_view)
from flash_epilogue.reference import gqa_accumulate_reference, gqa_reduce_reference, store_reference

pytestmark = pytest.mark.gpu

DEV = "cuda"
HEAD_DIMS = (64, 80, 96, 128, 192, 256)  # 80 is not compiled: it runs on the 96 tile with column predicates
GROUPS = ((2, 1), (2, 2), (1, 3), (2, 4), (1, 6), (1, 8), (1, 16))  # (h_k, g): MHA, GQA ..., MQA (h_k = 1)
DV_PAIRS = ((192, 128), (128, 64), (64, 256), (72, 200), (64, 192))  # on hdim 192: dV, dK of fewer slabs
U32 = 2.0**-24  # unit roundoff of fp32
I32 = torch.int32


def problem(layout, n):
    """(gqa_accumulator kwargs, seq kwargs, seq kwargs with seqused, leading shape) of a small
    problem with row edges around the tile height n: batched (2 sequences, one cut by seqused)
    or varlen (5 sequences of lengths n + 1, 0, 37, 1, 2n - 1, slack rows after the last;
    seqused cuts some, down to 0)."""
    if layout == "batched":
        b, s = 2, 2 * n + 3
        used = int32(s - 4, n + 1)
        return {"batch": b, "seqlen": s}, {}, {"seqused": used}, (b, s)
    lens = [n + 1, 0, 37, 1, 2 * n - 1]
    cu = cu_seqlens(lens)
    used = int32(*(max(0, x - 3 * (i % 2)) for i, x in enumerate(lens)))
    total = sum(lens) + 5
    return ({"cu_seqlens": cu, "total_tokens": total}, {"cu_seqlens": cu}, {"cu_seqlens": cu, "seqused": used},
            (total,))


def scaled(dense, scale):
    """fp32 multiply by the scale rounded to fp32: what the kernels compute."""
    return dense * torch.tensor(scale, dtype=torch.float32, device=dense.device)


def check_accumulate(d, dv, arch, h_k, g, layout, deterministic, seed, chunks=3):
    """gqa_accumulate called `chunks` times into one accumulator (different partials each call;
    the middle call limited by seqused), then to_dense against the reference.

    Deterministic: bitwise equal to the sequential fp32 reference. Otherwise each element is an
    fp32 sum of T = chunks * g terms (the initial 0 adds nothing) in an order the kernel does not
    fix; any order of T - 1 rounded adds is within (T - 1) * u * sum|p_i| of the exact sum to
    first order (u = 2^-24; the second-order term is below u^2 T^2 sum|p| and T <= 48 here), so
    |got - fp64 sum| <= T * u * sum|p| (fp64 sums of |p| as the scale) holds with margin.
    """
    n = block_n(d, dv, arch)
    alloc, seq, seq_used, lead = problem(layout, n)
    gen = generator(seed)
    acc = fe.gqa_accumulator(h_k, d, dv, deterministic=deterministic, device=DEV, arch=arch, **alloc)
    # the same tiles; each holds the slabs of its own head dim (fewer for the narrower on hdim 192's sm_90 tile)
    assert acc.dk_accum.shape[:3] == acc.dv_accum.shape[:3] and acc.dk_accum.is_contiguous()
    cfg = acc.config
    elems = [-(-w // cfg.slab_cols) * cfg.slab_elems if cfg.slab_cols else cfg.accum_tile_elems for w in (d, dv)]
    assert [acc.dk_accum.shape[3], acc.dv_accum.shape[3]] == elems
    ref = [torch.zeros(lead + (h_k, w), device=DEV) for w in (d, dv)]
    ref64 = [torch.zeros(lead + (h_k, w), dtype=torch.float64, device=DEV) for w in (d, dv)]
    mag = [torch.zeros(lead + (h_k, w), dtype=torch.float64, device=DEV) for w in (d, dv)]
    for c in range(chunks):
        kw = seq_used if c == 1 else seq
        pk, pv = rand(lead + (h_k * g, d), gen), rand(lead + (h_k * g, dv), gen)
        fe.gqa_accumulate(pk, pv, acc, deterministic=deterministic, **kw)
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k, **kw)
        gqa_accumulate_reference(pk, pv, *ref64, num_heads_kv=h_k, sequential=False, **kw)
        gqa_accumulate_reference(pk.abs(), pv.abs(), *mag, num_heads_kv=h_k, sequential=False, **kw)
    dense = acc.to_dense(**seq)
    torch.cuda.synchronize()
    for name, got, want, want64, m in zip(("dk", "dv"), dense, ref, ref64, mag):
        assert got.shape == want.shape and got.dtype == torch.float32
        if deterministic:
            assert_bits(got, want, name)
        else:
            bound = chunks * g * U32 * m
            err = (got.double() - want64).abs()
            bad = err > bound
            assert not bad.any(), (f"{name}: {int(bad.sum())} elements off, worst excess "
                                   f"{(err - bound).max().item():.3e}")
    return SimpleNamespace(acc=acc, dense=dense, ref=ref, seq=seq, seq_used=seq_used, lead=lead, n=n)


def check_postprocess(case, dtype, layouts, scales, seq, h_k, d, dv):
    """gqa_postprocess into canary-carved views: each whole buffer bitwise equal to the reference
    (scaled accumulator values, rounded, on the valid rows of `seq`; canary elsewhere)."""
    (dk_buf, dk), (dv_buf, dv_out) = carve(case.lead + (h_k, d), dtype, layouts[0]), \
        carve(case.lead + (h_k, dv), dtype, layouts[1])
    expect_k, expect_v = dk_buf.clone(), dv_buf.clone()
    store_reference(scaled(case.dense[0], scales[0]), scaled(case.dense[1], scales[1]), same_view(expect_k, dk),
                    same_view(expect_v, dv_out), **seq)
    fe.gqa_postprocess(case.acc, dk, dv_out, scale_dk=scales[0], scale_dv=scales[1], **seq)
    torch.cuda.synchronize()
    assert_bits(dk_buf, expect_k, "dk")
    assert_bits(dv_buf, expect_v, "dv")


# ---------------------------------------------------------------------------------------------
# gqa_accumulate


@arch_param
@pytest.mark.parametrize("h_k,g", GROUPS, ids=[f"hk{k}-g{g}" for k, g in GROUPS])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gqa_accumulate(d, h_k, g, arch):
    # every group size on every head dim and path; the layout alternates so that each head dim
    # sees both; both modes on the same problem
    layout = ("batched", "varlen")[(HEAD_DIMS.index(d) + GROUPS.index((h_k, g))) % 2]
    for deterministic in (False, True):
        check_accumulate(d, d, arch, h_k, g, layout, deterministic, seed=d * 100 + h_k * 17 + g + arch)


@arch_param
@pytest.mark.parametrize("layout", ("batched", "varlen"))
def test_gqa_to_dense_with_seqused(layout, arch):
    # to_dense reads the valid rows of the seqlens it is given: rows past seqused come back 0
    case = check_accumulate(128, 64, arch, 2, 3, layout, True, seed=5)
    got = case.acc.to_dense(**case.seq_used)
    want = [torch.zeros_like(r) for r in case.ref]
    store_reference(case.ref[0], case.ref[1], want[0], want[1], **case.seq_used)
    torch.cuda.synchronize()
    for x, w in zip(got, want):
        assert_bits(x, w)


@arch_param
@pytest.mark.parametrize("d,dv", DV_PAIRS)
def test_gqa_dv_differs_from_d(d, dv, arch):
    for i, layout in enumerate(("batched", "varlen")):
        case = check_accumulate(d, dv, arch, 2, 2, layout, deterministic=i == 0, seed=d + dv + i)
        check_postprocess(case, torch.bfloat16, ("padded", "transposed"), (0.5, 1.0 / 3.0), case.seq_used, 2, d, dv)


@arch_param
@pytest.mark.parametrize("d", (64, 192, 256))
@pytest.mark.parametrize("layout", ("batched", "varlen"))
def test_gqa_deterministic_is_repeatable(layout, d, arch):
    # 50 runs (reset, two chunks) give the same accumulator bits, equal to the sequential reference
    h_k, g = 2, 4
    n = block_n(d, d, arch)
    alloc, seq, seq_used, lead = problem(layout, n)
    gen = generator(d + arch)
    chunks = [(rand(lead + (h_k * g, d), gen), rand(lead + (h_k * g, d), gen), kw) for kw in (seq, seq_used)]
    acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, arch=arch, **alloc)
    first = None
    for _ in range(50):
        acc.reset()
        for pk, pv, kw in chunks:
            fe.gqa_accumulate(pk, pv, acc, deterministic=True, **kw)
        if first is None:
            first = (acc.dk_accum.clone(), acc.dv_accum.clone())
        else:
            assert torch.equal(bits(acc.dk_accum), bits(first[0]))
            assert torch.equal(bits(acc.dv_accum), bits(first[1]))
    ref = [torch.zeros(lead + (h_k, d), device=DEV) for _ in range(2)]
    for pk, pv, kw in chunks:
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k, **kw)
    for got, want in zip(acc.to_dense(**seq), ref):
        assert_bits(got, want)


@arch_param
def test_gqa_deterministic_many_ctas(arch):
    # far more CTAs than fit on the GPU at once, 16 query heads waiting on each KV tile in turn:
    # must finish (forward progress may not depend on the scheduling order) and stay exact
    h_k, g, d, s = 1, 16, 64, 16384
    gen = generator(11)
    pk, pv = rand((1, s, h_k * g, d), gen), rand((1, s, h_k * g, d), gen)
    acc = fe.gqa_accumulator(h_k, d, batch=1, seqlen=s, deterministic=True, device=DEV, arch=arch)
    fe.gqa_accumulate(pk, pv, acc, deterministic=True)
    ref = [torch.zeros(1, s, h_k, d, device=DEV) for _ in range(2)]
    gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k)
    for got, want in zip(acc.to_dense(), ref):
        assert_bits(got, want)


@arch_param
def test_gqa_deterministic_follows_torch_setting(arch):
    n = block_n(128, 128, arch)
    alloc, seq, _, lead = problem("varlen", n)
    gen = generator(3)
    pk, pv = rand(lead + (8, 128), gen), rand(lead + (8, 128), gen)
    plain = fe.gqa_accumulator(2, 128, device=DEV, arch=arch, **alloc)
    acc = fe.gqa_accumulator(2, 128, deterministic=True, device=DEV, arch=arch, **alloc)
    with deterministic_algorithms():
        fe.gqa_accumulate(pk, pv, acc, **seq)  # deterministic by default now (`plain` raises: test_bad_inputs)
        # the atomic mode asked for explicitly is torch's alert (test_determinism: with warn_only, a warning)
        with pytest.raises(RuntimeError, match=r"gqa_accumulate\(deterministic=False\) does not have a deterministic"):
            fe.gqa_accumulate(pk, pv, plain, deterministic=False, **seq)
    assert not plain.dk_accum.any() and not plain.dv_accum.any()
    ref = [torch.zeros(lead + (2, 128), device=DEV) for _ in range(2)]
    gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=2, **seq)
    for got, want in zip(acc.to_dense(**seq), ref):
        assert_bits(got, want)
    # an accumulator allocated with deterministic=True is deterministic by default without the switch
    acc.reset()
    fe.gqa_accumulate(pk, pv, acc, **seq)
    for got, want in zip(acc.to_dense(**seq), ref):
        assert_bits(got, want)


# ---------------------------------------------------------------------------------------------
# gqa_postprocess


@arch_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gqa_postprocess(d, dtype, arch):
    h_k, g = 2, 3
    for i, layout in enumerate(("batched", "varlen")):
        case = check_accumulate(d, d, arch, h_k, g, layout, deterministic=False, seed=d * 3 + i, chunks=2)
        # unit scales on every valid row; softmax-like scales (not exact in fp32) with seqused
        check_postprocess(case, dtype, ("plain", "padded"), (1.0, 1.0), case.seq, h_k, d, d)
        check_postprocess(case, dtype, ("transposed", "plain"), (d**-0.5, 0.3), case.seq_used, h_k, d, d)
        # the accumulator is unchanged by postprocess
        for got, want in zip(case.acc.to_dense(**case.seq), case.dense):
            assert torch.equal(bits(got), bits(want))


# ---------------------------------------------------------------------------------------------
# gqa_reduce


def reduce_into_views(pk, pv, h_k, dtype, scales, **kw):
    """gqa_reduce(out=...) into views carved out of canary buffers (padded dk, transposed dv): each whole
    buffer bitwise the sequential reference."""
    lead = pk.shape[:-2]
    (dk_buf, dk), (dv_buf, dv) = carve(lead + (h_k, pk.shape[-1]), dtype, "padded"), \
        carve(lead + (h_k, pk.shape[-1] if pv is None else pv.shape[-1]), dtype, "transposed")
    expect_k, expect_v = dk_buf.clone(), dv_buf.clone()
    seq = {k: v for k, v in kw.items() if k != "_arch"}
    gqa_reduce_reference(pk, pv, num_heads_kv=h_k, out=(same_view(expect_k, dk), same_view(expect_v, dv)),
                         scale_dk=scales[0], scale_dv=scales[1], sequential=True, **seq)
    ret = fe.gqa_reduce(pk, pv, num_heads_kv=h_k, out=dk if pv is None else (dk, dv), scale_dk=scales[0],
                        scale_dv=scales[1], **kw)
    torch.cuda.synchronize()
    assert ret is dk if pv is None else (ret[0] is dk and ret[1] is dv)
    assert_bits(dk_buf, expect_k, "dk")
    assert_bits(dv_buf, expect_v, "dv")


def check_reduce(d, dtype, arch, h_k, g, layout, partial_dtype, storage, with_dv, give_out, scales, seed,
                 use_seqused):
    dv_dim = d if d == 256 else d + 8 * (seed % 2)  # dv != d now and then
    n = block_n(d, dv_dim, arch)
    _, seq, seq_used, lead = problem(layout, n)
    kw = seq_used if use_seqused else seq
    gen = generator(seed)
    layout_p = {"bshd": "plain", "bhsd": "transposed"}[storage]  # heads-major storage seen as (.., rows, h_q, d)
    pk = input_view(lead + (h_k * g, d), layout_p, gen, partial_dtype)
    pv = input_view(lead + (h_k * g, dv_dim), layout_p, gen, partial_dtype) if with_dv else None
    if give_out:
        return reduce_into_views(pk, pv, h_k, dtype, scales, _arch=arch, **kw)
    out_dtype = dtype if partial_dtype == torch.float32 else None
    ret = fe.gqa_reduce(pk, pv, num_heads_kv=h_k, out_dtype=out_dtype, scale_dk=scales[0], scale_dv=scales[1],
                        _arch=arch, **kw)
    outs = list(ret) if with_dv else [ret]
    for out, p in zip(outs, (pk, pv)):
        assert out.dtype == dtype and out.is_contiguous() and out.shape == lead + (h_k, p.shape[-1])
    # rows outside the valid rows are uninitialized: compare the valid rows only
    for out, p, scale in zip(outs, (pk, pv), scales):
        got = out.clone()
        want = got.clone()
        gqa_reduce_reference(p, num_heads_kv=h_k, out=want, scale_dk=scale, sequential=True, **kw)
        assert_bits(got, want)


@arch_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gqa_reduce(d, dtype, arch):
    cases = [  # partial dtype, layout, partial storage, dv_partial given, out given, seqused
        (torch.float32, "batched", "bshd", True, True, False),
        (dtype, "batched", "bhsd", False, True, True),
        (torch.float32, "varlen", "bhsd", False, False, True),
        (dtype, "varlen", "bshd", True, True, True),
        (dtype, "batched", "bshd", True, False, False),
    ]
    for i, (pdt, layout, storage, with_dv, give_out, used) in enumerate(cases):
        h_k, g = GROUPS[(HEAD_DIMS.index(d) + 2 * i) % len(GROUPS)]
        scales = (1.0, 1.0) if i % 2 == 0 else (d**-0.5, 3.0)
        check_reduce(d, dtype, arch, h_k, g, layout, pdt, storage, with_dv, give_out, scales,
                     seed=d * 7 + i + arch, use_seqused=used)


@arch_param
@pytest.mark.parametrize("h_k,g", GROUPS, ids=[f"hk{k}-g{g}" for k, g in GROUPS])
def test_gqa_reduce_groups(h_k, g, arch):
    check_reduce(128, torch.bfloat16, arch, h_k, g, "batched", torch.float32, "bshd", True, True, (0.125, 1.0),
                 seed=g, use_seqused=True)
    check_reduce(128, torch.float16, arch, h_k, g, "varlen", torch.float16, "bhsd", True, True, (1.0, 0.5),
                 seed=g + 1, use_seqused=False)


@pytest.mark.parametrize("layout", ("batched", "varlen"))
@pytest.mark.parametrize("partial_dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("d", (128, 192, 256))
def test_gqa_reduce_many_tiles_per_cta(d, partial_dtype, layout):
    # far more tiles than SMs (the sm_90 driver's persistent CTAs walk many each, the stage ring
    # wraps every few tiles), seqused emptying some tiles, dK and dV both
    h_k, g = 4, 4
    n = block_n(d)
    gen = generator(d)
    if layout == "batched":
        b, s = 3, 12 * n + 7
        lead, kw = (b, s), {"seqused": int32(s, 5 * n, 0)}
    else:
        lens = torch.randint(0, 5 * n, (40,), generator=torch.Generator().manual_seed(d))
        lens[::5] = 0
        cu = cu_seqlens(lens.tolist())
        used = (lens - n).clamp(min=0).to(I32).to(DEV)
        lead, kw = (int(cu[-1]) + 3,), {"cu_seqlens": cu, "seqused": used}
    pk, pv = rand(lead + (h_k * g, d), gen, partial_dtype), rand(lead + (h_k * g, d), gen, partial_dtype)
    reduce_into_views(pk, pv, h_k, torch.bfloat16, (0.3, 1.0), **kw)


@arch_param
@pytest.mark.parametrize("d", (64, 192))
def test_gqa_reduce_equals_accumulate_then_postprocess(d, arch):
    # the one-call path and the two-step path compute the same fp32 sum in the same order
    h_k, g = 2, 4
    n = block_n(d, d, arch)
    alloc, seq, seq_used, lead = problem("varlen", n)
    gen = generator(d)
    pk, pv = rand(lead + (h_k * g, d), gen), rand(lead + (h_k * g, d), gen)
    acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, arch=arch, **alloc)
    fe.gqa_accumulate(pk, pv, acc, deterministic=True, **seq_used)
    two = [canary(lead + (h_k, d), torch.bfloat16) for _ in range(2)]
    one = [canary(lead + (h_k, d), torch.bfloat16) for _ in range(2)]
    fe.gqa_postprocess(acc, *two, scale_dk=0.1, scale_dv=0.7, **seq_used)
    fe.gqa_reduce(pk, pv, num_heads_kv=h_k, out=tuple(one), scale_dk=0.1, scale_dv=0.7, _arch=arch, **seq_used)
    torch.cuda.synchronize()
    for a, b in zip(one, two):
        assert_bits(a, b)


@arch_param
@pytest.mark.parametrize("layout", ("batched", "varlen"))
def test_gqa_subnormals_kept(layout, arch):
    # partials of magnitude ~1e-40 (fp32 subnormals; bf16 has the same exponent range): deterministic
    # accumulate + postprocess equals gqa_reduce bitwise, the sums kept (the sm_80 path's fp32
    # atomics flushed them to zero, so it adds under its semaphore with plain loads and stores)
    h_k, g, d = 2, 4, 64
    n = block_n(d, d, arch)
    alloc, seq, _, lead = problem(layout, n)
    gen = generator(11)
    pk, pv = (rand(lead + (h_k * g, d), gen, binades=3) * 1e-40 for _ in range(2))
    assert (pk.abs() < torch.finfo(torch.float32).tiny).all() and (pk != 0).float().mean() > 0.9
    acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, arch=arch, **alloc)
    fe.gqa_accumulate(pk, pv, acc, deterministic=True, **seq)
    two = [canary(lead + (h_k, d), torch.bfloat16) for _ in range(2)]
    one = [canary(lead + (h_k, d), torch.bfloat16) for _ in range(2)]
    fe.gqa_postprocess(acc, *two, **seq)
    fe.gqa_reduce(pk, pv, num_heads_kv=h_k, out=tuple(one), _arch=arch, **seq)
    dense = acc.to_dense(**seq)
    torch.cuda.synchronize()
    for got, p in zip(dense, (pk, pv)):
        want = torch.zeros_like(got)
        gqa_accumulate_reference(p, None, want, None, num_heads_kv=h_k, **seq)
        assert_bits(got, want, "accumulator")
        assert (got != 0).float().mean() > 0.5
    for a, b in zip(one, two):
        assert_bits(a, b)
        assert (b.float() != 0).float().mean() > 0.5


# ---------------------------------------------------------------------------------------------
# empty problems, no host sync, op checks


@arch_param
def test_gqa_empty_problems(arch):
    # no sequences, no rows, all-empty varlen: nothing to do, nothing written
    cu0 = torch.zeros(4, dtype=I32, device=DEV)
    gen = generator(1)
    for alloc, lead, seq in (({"batch": 0, "seqlen": 50}, (0, 50), {}),
                             ({"batch": 2, "seqlen": 0}, (2, 0), {}),
                             ({"cu_seqlens": cu0, "total_tokens": 7}, (7,), {"cu_seqlens": cu0})):
        acc = fe.gqa_accumulator(1, 64, deterministic=True, device=DEV, arch=arch, **alloc)
        pk, pv = rand(lead + (2, 64), gen), rand(lead + (2, 64), gen)
        fe.gqa_accumulate(pk, pv, acc, deterministic=True, **seq)
        fe.gqa_accumulate(pk, pv, acc, deterministic=False, **seq)
        dk, dv = canary(lead + (1, 64), torch.float16), canary(lead + (1, 64), torch.float16)
        fe.gqa_postprocess(acc, dk, dv, **seq)
        fe.gqa_reduce(pk, pv, num_heads_kv=1, out=(dk, dv), _arch=arch, **seq)
        dense = acc.to_dense(**seq)
        torch.cuda.synchronize()
        assert (bits(dk) == CANARY_BITS).all() and (bits(dv) == CANARY_BITS).all()
        assert all((x == 0).all() for x in dense)
        assert (acc.dk_accum == 0).all() and (acc.dv_accum == 0).all()


@arch_param
def test_gqa_cuda_graph(arch):
    # no host sync: reset + deterministic accumulate (semaphores zeroed in the graph) + postprocess
    # + reduce capture into one CUDA graph; replays read the partials' current contents
    h_k, g, d, b, s = 2, 4, 128, 2, 300
    gen = generator(9)
    pk, pv = rand((b, s, h_k * g, d), gen), rand((b, s, h_k * g, d), gen)
    used = int32(s, 129)
    acc = fe.gqa_accumulator(h_k, d, batch=b, seqlen=s, deterministic=True, device=DEV, arch=arch)
    dk, dv = (torch.zeros(b, s, h_k, d, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    rk = torch.zeros(b, s, h_k, d, dtype=torch.float16, device=DEV)

    def step():
        acc.reset()
        fe.gqa_accumulate(pk, pv, acc, deterministic=True, seqused=used, check_inputs=True)
        fe.gqa_accumulate(pv, pk, acc, deterministic=True)
        fe.gqa_postprocess(acc, dk, dv, scale_dk=0.5)
        fe.gqa_reduce(pk, num_heads_kv=h_k, out=rk, seqused=used, _arch=arch)

    graph, _ = cuda_graph(step)  # check_inputs=True: content checks are skipped while capturing
    for trial in range(2):
        pk.copy_(rand(pk.shape, gen))
        pv.copy_(rand(pv.shape, gen))
        graph.replay()
        torch.cuda.synchronize()
        ref = [torch.zeros(b, s, h_k, d, device=DEV) for _ in range(2)]
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k, seqused=used)
        gqa_accumulate_reference(pv, pk, *ref, num_heads_kv=h_k)
        assert_bits(dk, scaled(ref[0], 0.5).bfloat16())
        assert torch.equal(bits(dv), bits(ref[1].bfloat16()))
        want = torch.zeros_like(rk)
        gqa_reduce_reference(pk, num_heads_kv=h_k, out=want, sequential=True, seqused=used)
        assert_bits(rk, want)


def test_gqa_opcheck():
    # schemas (mutation annotations), fake kernels and functionalization agree with the kernels
    from torch.library import opcheck

    gen = generator(2)
    h_k, g, d = 2, 2, 64
    cu = int32(0, 100, 100, 230)
    used = int32(90, 0, 130)
    for alloc, lead, seq in (({"batch": 2, "seqlen": 150}, (2, 150), {}),
                             ({"cu_seqlens": cu, "total_tokens": 240}, (240,), {"cu_seqlens": cu, "seqused": used})):
        acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, **alloc)
        pk, pv = rand(lead + (h_k * g, d), gen), rand(lead + (h_k * g, d), gen)
        opcheck(torch.ops.flash_epilogue.gqa_accumulate.default,
                (pk, pv, acc.dk_accum, acc.dv_accum, acc.semaphores), {"deterministic": True, **seq})
        opcheck(torch.ops.flash_epilogue.gqa_accumulate.default, (pk, pv, acc.dk_accum, acc.dv_accum), seq)
        dk, dv = (torch.zeros(lead + (h_k, d), dtype=torch.bfloat16, device=DEV) for _ in range(2))
        opcheck(torch.ops.flash_epilogue.gqa_postprocess.default, (acc.dk_accum, acc.dv_accum, dk, dv),
                {"scale_dk": 0.5, **seq})
        out = torch.zeros(lead + (h_k, d), device=DEV)
        opcheck(torch.ops.flash_epilogue.gqa_accum_to_dense.default, (acc.dk_accum, out), {"head_dim": d, **seq})
        opcheck(torch.ops.flash_epilogue.gqa_reduce.default, (pk, pv, dk, dv), seq)
        opcheck(torch.ops.flash_epilogue.gqa_reduce.default, (pk.bfloat16(), None, dk, None), seq)


def test_gqa_export_with_accumulator_input():
    # the accumulator is a pytree of tensors: a module taking one exports, and the exported
    # program mutates the accumulator it is given
    class Step(torch.nn.Module):
        def forward(self, pk, pv, acc, dk, dv):
            fe.gqa_accumulate(pk, pv, acc, deterministic=True)
            fe.gqa_postprocess(acc, dk, dv, scale_dk=0.5)

    h_k, g, d, b, s = 2, 2, 64, 1, 200
    gen = generator(4)
    pk, pv = rand((b, s, h_k * g, d), gen), rand((b, s, h_k * g, d), gen)
    make = lambda: fe.gqa_accumulator(h_k, d, batch=b, seqlen=s, deterministic=True, device=DEV)  # noqa: E731
    outs = lambda: [torch.zeros(b, s, h_k, d, dtype=torch.bfloat16, device=DEV) for _ in range(2)]  # noqa: E731
    ep = torch.export.export(Step(), (pk, pv, make(), *outs()), strict=False)
    acc, (dk, dv) = make(), outs()
    ep.module()(pk, pv, acc, dk, dv)
    acc_eager, (dk_e, dv_e) = make(), outs()
    Step()(pk, pv, acc_eager, dk_e, dv_e)
    torch.cuda.synchronize()
    assert (acc.dk_accum != 0).any()
    assert torch.equal(bits(acc.dk_accum), bits(acc_eager.dk_accum))
    assert torch.equal(bits(dk), bits(dk_e)) and torch.equal(bits(dv), bits(dv_e))
