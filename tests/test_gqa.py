"""GPU tests of the GQA ops (gqa_accumulate, to_dense, gqa_postprocess, gqa_reduce) against flash_epilogue/reference.py
on both paths (`arch` 90 and 80), and the problem builders and checks test_fuzz.py shares. Outputs are views of canary
buffers compared whole. Data spans several binades, clear of fp32 subnormals (the sm_80 atomics flush them) but in
test_gqa_reduce_equals_accumulate_then_postprocess."""
from pathlib import Path
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
GROUP_IDS = [f"hk{k}-g{g}" for k, g in GROUPS]
DV_PAIRS = ((192, 128), (128, 64), (64, 256), (72, 200), (64, 192))  # on hdim 192: dV, dK of fewer slabs
U32 = 2.0**-24  # unit roundoff of fp32


def call(dev, fn, *args, **kwargs):
    """Run the op on a GPU; on the CPU (test_fuzz's CI run) the call passes every check but the last, the device's."""
    if dev == "cuda":
        return fn(*args, **kwargs)
    with pytest.raises(ValueError, match="device: expected a CUDA tensor, got a tensor on cpu"):
        fn(*args, **kwargs)
    return None


def assert_written(dev, *checks):
    """On a GPU: each (name, buffer, expected copy) bitwise equal."""
    if dev == "cuda":
        torch.cuda.synchronize()
        for name, got, want in checks:
            assert_bits(got, want, name)


def problem(dev, batch, seqlen, lens, slack, used):
    """(accumulator geometry, leading shape, seq kwargs, the same with seqused if `used`): batched or varlen."""
    if lens is not None:
        cu, total = cu_seqlens(lens, dev), sum(lens) + slack
        alloc, lead, seq = {"cu_seqlens": cu, "total_tokens": total}, (total,), {"cu_seqlens": cu}
    else:
        alloc, lead, seq = {"batch": batch, "seqlen": seqlen}, (batch, seqlen), {}
    return alloc, lead, seq, seq if used is None else {**seq, "seqused": int32(*used, device=dev)}


def edge_geometry(layout, n):
    """problem() arguments, row edges around the tile height n; seqused cuts some sequences (down to 0)."""
    if layout == "batched":
        return {"batch": 2, "seqlen": 2 * n + 3, "lens": None, "slack": 0, "used": [2 * n - 1, n + 1]}
    lens = [n + 1, 0, 37, 1, 2 * n - 1]
    return {"batch": None, "seqlen": None, "lens": lens, "slack": 5,
            "used": [max(0, x - 3 * (i % 2)) for i, x in enumerate(lens)]}


def scaled(dense, scale):
    """fp32 multiply by the scale rounded to fp32: what the kernels compute."""
    return dense * torch.tensor(scale, dtype=torch.float32, device=dense.device)


def check_accumulate(d, dv, arch, h_k, g, deterministic, batch, seqlen, lens, slack, used, chunk_seqused,
                     partial_layouts, seed, dev="cuda"):
    """gqa_accumulate once per entry of chunk_seqused (with seqused where True), then to_dense. Deterministic: bitwise
    the sequential fp32 reference. Otherwise a sum of T = calls * g terms in any order: T - 1 rounded adds are within
    (T - 1) u sum|p| of the exact sum to first order (u = 2^-24; second order < u^2 T^2 sum|p|, T <= 48), so
    |got - fp64 sum| <= T u sum|p| holds with margin. Returns the case (dense None where nothing ran)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    alloc, lead, seq, seq_used = problem(dev, batch, seqlen, lens, slack, used)
    acc = fe.gqa_accumulator(h_k, d, dv, deterministic=deterministic, device=dev, arch=arch, **alloc)
    ref, ref64, mag = ([torch.zeros(lead + (h_k, w), dtype=t, device=dev) for w in (d, dv)]
                       for t in (torch.float32, torch.float64, torch.float64))
    for with_used in chunk_seqused:
        kw = seq_used if with_used else seq
        pk = input_view(lead + (h_k * g, d), partial_layouts[0], gen)
        pv = input_view(lead + (h_k * g, dv), partial_layouts[1], gen)
        call(dev, fe.gqa_accumulate, pk, pv, acc, deterministic=deterministic, **kw)
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k, **kw)
        gqa_accumulate_reference(pk, pv, *ref64, num_heads_kv=h_k, sequential=False, **kw)
        gqa_accumulate_reference(pk.abs(), pv.abs(), *mag, num_heads_kv=h_k, sequential=False, **kw)
    case = SimpleNamespace(acc=acc, dense=acc.to_dense(**seq) if dev == "cuda" else None, lead=lead, seq=seq,
                           seq_used=seq_used, h_k=h_k, d=d, dv=dv, dev=dev)
    if dev != "cuda":
        return case
    torch.cuda.synchronize()
    for name, got, want, want64, m in zip(("dk", "dv"), case.dense, ref, ref64, mag):
        assert got.shape == want.shape and got.dtype == torch.float32
        if deterministic:
            assert_bits(got, want, f"{name}_accum")
        else:
            excess = (got.double() - want64).abs() - len(chunk_seqused) * g * U32 * m
            assert not (excess > 0).any(), f"{name}_accum: {int((excess > 0).sum())} elements past the fp32 " \
                                           f"reassociation bound, worst by {excess.max().item():.3e}"
    return case


def check_postprocess(case, dtype, layouts, scales, seq):
    """gqa_postprocess of the case's accumulator into canary-carved views: each whole buffer bitwise the reference."""
    (buf_k, dk), (buf_v, dv) = (carve(case.lead + (case.h_k, w), dtype, layout, case.dev)
                                for w, layout in zip((case.d, case.dv), layouts))
    expect_k, expect_v = buf_k.clone(), buf_v.clone()
    if case.dense is not None:
        store_reference(scaled(case.dense[0], scales[0]), scaled(case.dense[1], scales[1]), same_view(expect_k, dk),
                        same_view(expect_v, dv), **seq)
    call(case.dev, fe.gqa_postprocess, case.acc, dk, dv, scale_dk=scales[0], scale_dv=scales[1], **seq)
    assert_written(case.dev, ("dk", buf_k, expect_k), ("dv", buf_v, expect_v))


def reduce_into_views(pk, pv, dtype, layouts=("padded", "transposed"), dev="cuda", **kw):
    """gqa_reduce(out=...) into canary-carved views: returned, each whole buffer bitwise the sequential reference."""
    lead, h_k = pk.shape[:-2], kw["num_heads_kv"]
    (buf_k, dk), (buf_v, dv) = (carve(lead + (h_k, p.shape[-1]), dtype, layout, dev)
                                for p, layout in zip((pk, pk if pv is None else pv), layouts))
    expect_k, expect_v = buf_k.clone(), buf_v.clone()
    gqa_reduce_reference(pk, pv, out=(same_view(expect_k, dk), same_view(expect_v, dv)), sequential=True,
                         **{k: v for k, v in kw.items() if k != "_arch"})
    ret = call(dev, fe.gqa_reduce, pk, pv, out=dk if pv is None else (dk, dv), **kw)
    if dev == "cuda":
        assert ret is dk if pv is None else (ret[0] is dk and ret[1] is dv)
    assert_written(dev, ("dk", buf_k, expect_k), ("dv", buf_v, expect_v))


def check_reduce(d, dv, with_dv, arch, h_k, g, partial_dtype, out_dtype, batch, seqlen, lens, slack, used,
                 partial_layouts, give_out, out_layouts, scales, seed, dev="cuda"):
    """gqa_reduce into views (give_out), else into new contiguous outputs whose valid rows (the rest is uninitialized)
    are bitwise the sequential reference."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    _, lead, _, seq = problem(dev, batch, seqlen, lens, slack, used)
    pk = input_view(lead + (h_k * g, d), partial_layouts[0], gen, partial_dtype)
    pv = input_view(lead + (h_k * g, dv), partial_layouts[1], gen, partial_dtype) if with_dv else None
    kw = {"num_heads_kv": h_k, "scale_dk": scales[0], "scale_dv": scales[1], "_arch": arch, **seq}
    if give_out:
        return reduce_into_views(pk, pv, out_dtype, out_layouts, dev, **kw)
    ret = call(dev, fe.gqa_reduce, pk, pv, out_dtype=out_dtype if partial_dtype == torch.float32 else None, **kw)
    if dev != "cuda":
        return
    torch.cuda.synchronize()
    for name, out, p, scale in zip(("dk", "dv"), list(ret) if with_dv else [ret], (pk, pv), scales):
        assert out.dtype == out_dtype and out.is_contiguous() and out.shape == lead + (h_k, p.shape[-1])
        want = out.clone()
        gqa_reduce_reference(p, num_heads_kv=h_k, out=want, scale_dk=scale, sequential=True, **seq)
        assert_bits(out, want, name)


def accumulate_case(d, dv, arch, h_k, g, layout, deterministic, seed):
    """check_accumulate on edge_geometry, the middle call with seqused; dk and dv accumulators share the tiles, each
    holding the slabs of its own head dim (fewer for the narrower on hdim 192's sm_90 tile)."""
    geo = edge_geometry(layout, block_n(d, dv, arch))
    case = check_accumulate(d, dv, arch, h_k, g, deterministic, chunk_seqused=[False, True, False],
                            partial_layouts=("plain", "plain"), seed=seed, **geo)
    acc, cfg = case.acc, case.acc.config
    assert acc.dk_accum.shape[:3] == acc.dv_accum.shape[:3] and acc.dk_accum.is_contiguous()
    elems = [-(-w // cfg.slab_cols) * cfg.slab_elems if cfg.slab_cols else cfg.accum_tile_elems for w in (d, dv)]
    assert [acc.dk_accum.shape[3], acc.dv_accum.shape[3]] == elems
    return case


def reduce_case(d, out_dtype, arch, h_k, g, layout, partial_dtype, storage, with_dv, give_out, scales, seed,
                use_seqused):
    """check_reduce on edge_geometry, dv != d now and then, bshd or bhsd partials, padded dk and transposed dv."""
    dv = d if d == 256 else d + 8 * (seed % 2)
    geo = edge_geometry(layout, block_n(d, dv, arch))
    geo["used"] = geo["used"] if use_seqused else None
    storage = {"bshd": "plain", "bhsd": "transposed"}[storage]  # heads-major storage seen as (.., rows, h_q, d)
    check_reduce(d, dv, with_dv, arch, h_k, g, partial_dtype, out_dtype, partial_layouts=(storage, storage),
                 give_out=give_out, out_layouts=("padded", "transposed"), scales=scales, seed=seed, **geo)


def assert_dense_is_reference(acc, calls, h_k, seq):
    """acc.to_dense(**seq) bitwise the sequential reference of the gqa_accumulate calls [(pk, pv, seq kwargs)]."""
    ref = [torch.zeros(p.shape[:-2] + (h_k, p.shape[-1]), device=p.device) for p in calls[0][:2]]
    for pk, pv, kw in calls:
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k, **kw)
    for got, want in zip(acc.to_dense(**seq), ref):
        assert_bits(got, want)


def check_to_dense(case):
    """A postprocess left the accumulator as it was; to_dense reads the valid rows of the seqlens it is given: rows
    past seqused come back 0."""
    for got, want in zip(case.acc.to_dense(**case.seq), case.dense):
        assert_bits(got, want)
    want = [torch.zeros_like(x) for x in case.dense]
    store_reference(*case.dense, *want, **case.seq_used)
    for got, w in zip(case.acc.to_dense(**case.seq_used), want):
        assert_bits(got, w)


@arch_param
@pytest.mark.parametrize("h_k,g", GROUPS, ids=GROUP_IDS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gqa_every_group(d, h_k, g, arch):
    # every group size on every head dim and path: accumulate in both modes, each postprocessed (the layout and the
    # output dtype alternate: each head dim sees every pair of them; unit scales on every valid row, softmax-like
    # scales, not exact in fp32, with seqused), and reduce
    i = GROUPS.index((h_k, g))
    layout, dtype = ("batched", "varlen")[(HEAD_DIMS.index(d) + i) % 2], DTYPES[i // 2 % 2]
    for deterministic in (False, True):
        case = accumulate_case(d, d, arch, h_k, g, layout, deterministic, seed=d * 100 + h_k * 17 + g + arch)
        check_postprocess(case, dtype, ("plain", "padded"), (1.0, 1.0), case.seq)
        check_postprocess(case, dtype, ("transposed", "plain"), (d**-0.5, 0.3), case.seq_used)
        check_to_dense(case)
    reduce_case(d, torch.bfloat16, arch, h_k, g, "batched", torch.float32, "bshd", True, True, (0.125, 1.0), seed=g,
                use_seqused=True)
    reduce_case(d, torch.float16, arch, h_k, g, "varlen", torch.float16, "bhsd", True, True, (1.0, 0.5), seed=g + 1,
                use_seqused=False)


@arch_param
@pytest.mark.parametrize("d,dv", DV_PAIRS)
def test_gqa_dv_differs_from_d(d, dv, arch):
    for i, layout in enumerate(("batched", "varlen")):
        case = accumulate_case(d, dv, arch, 2, 2, layout, deterministic=i == 0, seed=d + dv + i)
        check_postprocess(case, torch.bfloat16, ("padded", "transposed"), (0.5, 1.0 / 3.0), case.seq_used)
        check_to_dense(case)


@arch_param
@pytest.mark.parametrize("d", (64, 192, 256))
@pytest.mark.parametrize("layout", ("batched", "varlen"))
def test_gqa_deterministic_is_repeatable(layout, d, arch):
    # 50 runs (reset, two chunks) give the same accumulator bits, equal to the sequential reference
    h_k, g = 2, 4
    alloc, lead, seq, seq_used = problem(DEV, **edge_geometry(layout, block_n(d, d, arch)))
    gen = generator(d + arch)
    chunks = [(rand(lead + (h_k * g, d), gen), rand(lead + (h_k * g, d), gen), kw) for kw in (seq, seq_used)]
    acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, arch=arch, **alloc)

    def run():
        acc.reset()
        for pk, pv, kw in chunks:
            fe.gqa_accumulate(pk, pv, acc, deterministic=True, **kw)
        return bits(acc.dk_accum).clone(), bits(acc.dv_accum).clone()

    first = run()
    for _ in range(49):
        for got, want in zip(run(), first):
            assert torch.equal(got, want)
    assert_dense_is_reference(acc, chunks, h_k, seq)


@arch_param
def test_gqa_deterministic_mode(arch):
    alloc, lead, seq, _ = problem(DEV, **edge_geometry("varlen", block_n(128, 128, arch)))
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
    assert_dense_is_reference(acc, [(pk, pv, seq)], 2, seq)
    # an accumulator allocated with deterministic=True is deterministic by default without the switch
    acc.reset()
    fe.gqa_accumulate(pk, pv, acc, **seq)
    assert_dense_is_reference(acc, [(pk, pv, seq)], 2, seq)
    # far more CTAs than fit on the GPU at once, 16 query heads waiting on each KV tile in turn: must finish
    # (forward progress may not depend on the scheduling order) and stay exact
    s = 16384
    pk, pv = rand((1, s, 16, 64), gen), rand((1, s, 16, 64), gen)
    acc = fe.gqa_accumulator(1, 64, batch=1, seqlen=s, deterministic=True, device=DEV, arch=arch)
    fe.gqa_accumulate(pk, pv, acc, deterministic=True)
    assert_dense_is_reference(acc, [(pk, pv, {})], 1, {})


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
        reduce_case(d, dtype, arch, h_k, g, layout, pdt, storage, with_dv, give_out, scales, seed=d * 7 + i + arch,
                    use_seqused=used)


@pytest.mark.parametrize("layout", ("batched", "varlen"))
@pytest.mark.parametrize("partial_dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("d", (128, 192, 256))
def test_gqa_reduce_many_tiles_per_cta(d, partial_dtype, layout):
    # far more tiles than SMs (sm_90's persistent CTAs walk many, the stage ring wraps), seqused emptying some
    h_k, g = 4, 4
    n = block_n(d)
    gen = generator(d)
    if layout == "batched":
        geo = (3, 12 * n + 7, None, 0, [12 * n + 7, 5 * n, 0])
    else:
        lens = torch.randint(0, 5 * n, (40,), generator=torch.Generator().manual_seed(d))
        lens[::5] = 0
        geo = (None, None, lens.tolist(), 3, (lens - n).clamp(min=0).tolist())
    _, lead, _, kw = problem(DEV, *geo)
    pk, pv = rand(lead + (h_k * g, d), gen, partial_dtype), rand(lead + (h_k * g, d), gen, partial_dtype)
    reduce_into_views(pk, pv, torch.bfloat16, num_heads_kv=h_k, scale_dk=0.3, scale_dv=1.0, **kw)


@arch_param
@pytest.mark.parametrize("d,layout", [(64, "batched"), (64, "varlen"), (192, "varlen")])
def test_gqa_reduce_equals_accumulate_then_postprocess(d, layout, arch):
    # gqa_reduce is bitwise deterministic gqa_accumulate + gqa_postprocess (the same fp32 sum in the same order), on
    # ordinary partials and on ~1e-40 ones: fp32 subnormals (bf16 has the same exponent range) whose sums are kept
    # (the sm_80 path's fp32 atomics flushed them to zero, so it adds under its semaphore with plain loads and stores)
    h_k, g = 2, 4
    alloc, lead, seq, seq_used = problem(DEV, **edge_geometry(layout, block_n(d, d, arch)))
    gen = generator(d)
    for size, binades, kw, scales in ((1.0, 8, seq_used, {"scale_dk": 0.1, "scale_dv": 0.7}), (1e-40, 3, seq, {})):
        pk, pv = (rand(lead + (h_k * g, d), gen, binades=binades) * size for _ in range(2))
        assert bool((pk.abs() < torch.finfo(torch.float32).tiny).all()) == (size < 1) and (pk != 0).float().mean() > 0.9
        acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, arch=arch, **alloc)
        fe.gqa_accumulate(pk, pv, acc, deterministic=True, **kw)
        two, one = ([canary(lead + (h_k, d), torch.bfloat16) for _ in range(2)] for _ in range(2))
        fe.gqa_postprocess(acc, *two, **scales, **kw)
        fe.gqa_reduce(pk, pv, num_heads_kv=h_k, out=tuple(one), _arch=arch, **scales, **kw)
        torch.cuda.synchronize()
        for a, b in zip(one, two):
            assert_bits(a, b)
        for got, p in zip(acc.to_dense(**kw), (pk, pv)):
            want = torch.zeros_like(got)
            gqa_accumulate_reference(p, None, want, None, num_heads_kv=h_k, **kw)
            assert_bits(got, want, "accumulator")
            assert (got != 0).float().mean() > 0.5
        for out in two:
            assert (out.float() != 0).float().mean() > 0.5


@arch_param
def test_gqa_empty_problems(arch):
    # no sequences, no rows, all-empty varlen: nothing to do, nothing written
    gen = generator(1)
    for geo in ((0, 50, None, 0), (2, 0, None, 0), (None, None, [0, 0, 0], 7)):
        alloc, lead, seq, _ = problem(DEV, *geo, None)
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
    # no host sync: reset + deterministic accumulate (semaphores zeroed in the graph) + postprocess + reduce capture
    # into one CUDA graph; replays read the partials' current contents
    h_k, g, d, b, s = 2, 4, 128, 2, 300
    gen = generator(9)
    pk, pv = rand((b, s, h_k * g, d), gen), rand((b, s, h_k * g, d), gen)
    used = int32(s, 129)
    acc = fe.gqa_accumulator(h_k, d, batch=b, seqlen=s, deterministic=True, device=DEV, arch=arch)
    dk, dv, rk = (torch.zeros(b, s, h_k, d, dtype=t, device=DEV) for t in (torch.bfloat16,) * 2 + (torch.float16,))

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

    ops = torch.ops.flash_epilogue
    gen = generator(2)
    h_k, g, d = 2, 2, 64
    for geo in ((2, 150, None, 0, None), (None, None, [100, 0, 130], 10, [90, 0, 130])):
        alloc, lead, _, seq = problem(DEV, *geo)
        acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, **alloc)
        pk, pv = rand(lead + (h_k * g, d), gen), rand(lead + (h_k * g, d), gen)
        opcheck(ops.gqa_accumulate.default, (pk, pv, acc.dk_accum, acc.dv_accum, acc.semaphores),
                {"deterministic": True, **seq})
        opcheck(ops.gqa_accumulate.default, (pk, pv, acc.dk_accum, acc.dv_accum), seq)
        dk, dv = (torch.zeros(lead + (h_k, d), dtype=torch.bfloat16, device=DEV) for _ in range(2))
        opcheck(ops.gqa_postprocess.default, (acc.dk_accum, acc.dv_accum, dk, dv), {"scale_dk": 0.5, **seq})
        out = torch.zeros(lead + (h_k, d), device=DEV)
        opcheck(ops.gqa_accum_to_dense.default, (acc.dk_accum, out), {"head_dim": d, **seq})
        opcheck(ops.gqa_reduce.default, (pk, pv, dk, dv), seq)
        opcheck(ops.gqa_reduce.default, (pk.bfloat16(), None, dk, None), seq)


def test_gqa_export_with_accumulator_input():
    # the accumulator is a pytree: a module taking one exports, the program mutates the accumulator it is given
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


# ---- the collective's per-query-head adds (tests/header_library/gqa_per_head.cu: CollectiveEpilogueBwdGQA through
# GqaAccumulateKernel, what an attention kernel calls; JIT-built, about a minute) against the op, which adds whole
# groups per CTA on sm_90: deterministic bitwise, the unordered adds within fp32 reassociation


@pytest.fixture(scope="module")
def per_head(tmp_path_factory):
    from torch.utils.cpp_extension import load

    root = Path(__file__).resolve().parent.parent
    return load(name="fe_gqa_per_head", sources=[str(root / "tests" / "header_library" / "gqa_per_head.cu")],
                extra_include_paths=[str(root / "csrc" / "kernels"), *fe.get_include()],
                extra_cuda_cflags=["-std=c++20", "-O3", "--expt-relaxed-constexpr",
                                   "-gencode=arch=compute_90a,code=sm_90a"],
                extra_cflags=["-std=c++20"], build_directory=str(tmp_path_factory.mktemp("gqa_per_head")))


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_per_head_adds_match_the_op(per_head, d, varlen, deterministic):
    hk, group, batch = 2, 4, 3
    alloc, lead, seq, _ = problem(DEV, batch, 600, [300, 1, 517] if varlen else None, 0, None)
    cu = seq.get("cu_seqlens")
    gen = generator(d + 2 * varlen + deterministic)
    pk, pv = rand(lead + (hk * group, d), gen), rand(lead + (hk * group, d), gen)
    accs = [fe.gqa_accumulator(hk, d, deterministic=deterministic, device=DEV, **alloc) for _ in range(3)]
    # the same non-zero start: the adds go onto earlier calls' sums; the third gets |start| + sum |partials|: two
    # orders of the group + 1 additions differ by at most 2 * group * 2^-24 of it
    start = torch.randn(accs[0].dk_accum.shape, generator=gen, device=DEV)
    for acc, init in zip(accs, (start, start, start.abs())):
        acc.dk_accum.copy_(init)
        acc.dv_accum.copy_(init)
    fe.gqa_accumulate(pk, pv, accs[0], cu_seqlens=cu)
    fe.gqa_accumulate(pk.abs(), pv.abs(), accs[2], cu_seqlens=cu)
    per_head.accumulate_per_head(pk, pv, accs[1].dk_accum, accs[1].dv_accum,
                                 accs[1].semaphores if deterministic else None, cu, batch)
    torch.cuda.synchronize()
    for name in ("dk_accum", "dv_accum"):
        ours, theirs = getattr(accs[0], name), getattr(accs[1], name)
        if deterministic:
            assert torch.equal(bits(ours), bits(theirs)), name
        else:
            bound = 2 * group * U32 * getattr(accs[2], name)
            assert ((ours - theirs).abs() <= bound).all(), name
