"""GPU tests of the GQA ops (gqa_accumulate, to_dense, gqa_postprocess, gqa_reduce) against flash_epilogue/reference.py
on both paths (`arch` 90 and 80), with conftest's checks (check_accumulate, check_postprocess, check_reduce, which
test_fuzz.py draws cases for). Outputs are views of canary buffers compared whole. Data spans several binades, clear of
fp32 subnormals (the sm_80 atomics flush them) but in test_gqa_reduce_equals_accumulate_then_postprocess."""
from pathlib import Path

import pytest
import torch

import flash_epilogue as fe
from conftest import (DTYPES, U32, arch_param, check_accumulate, check_postprocess, check_reduce, cuda_graph,
                      deterministic_algorithms, scaled)
from flash_epilogue.ops import _gqa_reduce
from flash_epilogue.reference import gqa_accumulate_reference, gqa_reduce_reference, store_reference
from flash_epilogue.testing import CANARY_BITS, assert_bits, bits, block_n, canary, generator, int32, problem, rand

pytestmark = pytest.mark.gpu

DEV = "cuda"
HEAD_DIMS = (64, 80, 96, 128, 192, 256)  # 80 is not compiled: it runs on the 96 tile with column predicates
GROUPS = ((2, 1), (2, 2), (1, 3), (2, 4), (1, 6), (1, 8), (1, 16))  # (h_k, g): MHA, GQA ..., MQA (h_k = 1)
# on hdim 192: dV, dK of fewer slabs; on hdim 256 with dv <= 128: below the own-tile gate (test_gqa_dv_own_tile)
DV_PAIRS = ((192, 128), (128, 64), (64, 256), (72, 200), (64, 192), (256, 128), (240, 72))


def edge_geometry(layout, n, used=True):
    """problem() arguments, row edges around the tile height n; seqused (if `used`) cuts some sequences (down to 0)."""
    if layout == "batched":
        return {"batch": 2, "seqlen": 2 * n + 3, "lens": None, "slack": 0,
                "seqused": [2 * n - 1, n + 1] if used else None}
    lens = [n + 1, 0, 37, 1, 2 * n - 1]
    return {"batch": None, "seqlen": None, "lens": lens, "slack": 5,
            "seqused": [max(0, x - 3 * (i % 2)) for i, x in enumerate(lens)] if used else None}


def accumulate_case(d, dv, arch, h_k, g, layout, deterministic, seed, posts, geometry=None):
    """check_accumulate on edge_geometry, the middle call with seqused, then check_postprocess of each (dtype, layouts,
    scales, with seqused) of posts. Each accumulator has the tiles of its config (dV's its own at (256, <= 128) on
    sm_90), each holding the slabs of its own head dim (fewer for the narrower on hdim 192's sm_90 tile). The
    postprocesses left the accumulator as it was; to_dense reads the valid rows of the seqlens it is given: rows past
    seqused come back 0. geometry: problem()'s arguments, else edge_geometry's."""
    geometry = geometry or edge_geometry(layout, block_n(d, dv, arch))
    case = check_accumulate(d, dv, arch, h_k, g, deterministic, **geometry, chunk_seqused=[False, True, False],
                            partial_layouts=("plain", "plain"), seed=seed)
    acc = case.acc
    # dV's tile is the plan's (its own at (256, <= 128) on sm_90 in large problems)
    plan = fe._extension._C.plan("gqa_accumulate", acc.arch, acc.rows, acc.batch, h_k, acc.varlen, False, d, dv,
                                 deterministic, 132)
    assert acc.config_v == (fe.tile_config(dv) if plan["dv_own_launch"] else acc.config)
    for t, w, cfg in ((acc.dk_accum, d, acc.config), (acc.dv_accum, dv, acc.config_v)):
        n = cfg.block_n
        tiles = (acc.rows + acc.batch * n) // n if acc.varlen else -(-acc.rows // n)
        elems = -(-w // cfg.slab_cols) * cfg.slab_elems if cfg.slab_cols else cfg.accum_tile_elems
        assert t.shape == (acc.batch_extent, h_k, tiles, elems) and t.is_contiguous()
    for dtype, layouts, scales, with_used in posts:
        check_postprocess(case, dtype, layouts, scales, case.seq_used if with_used else case.seq)
    cut = [torch.zeros_like(x) for x in case.dense]
    store_reference(*case.dense, *cut, **case.seq_used)
    for seq, want in ((case.seq, case.dense), (case.seq_used, cut)):
        for got, w in zip(acc.to_dense(**seq), want):
            assert_bits(got, w)
    return acc


def assert_dense_is_reference(acc, calls, h_k, seq):
    """acc.to_dense(**seq) bitwise the sequential reference of the gqa_accumulate calls [(pk, pv, seq kwargs)];
    returns the dense tensors."""
    ref = [torch.zeros(p.shape[:-2] + (h_k, p.shape[-1]), device=p.device) for p in calls[0][:2]]
    for pk, pv, kw in calls:
        gqa_accumulate_reference(pk, pv, *ref, num_heads_kv=h_k, **kw)
    dense = acc.to_dense(**seq)
    for got, want in zip(dense, ref):
        assert_bits(got, want)
    return dense


@arch_param
@pytest.mark.parametrize("h_k,g", GROUPS, ids=[f"hk{k}-g{g}" for k, g in GROUPS])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gqa_every_group(d, h_k, g, arch):
    # every group size on every head dim and path: accumulate in both modes, each postprocessed (the layout and the
    # output dtype alternate: each head dim sees every pair of them; unit scales on every valid row, softmax-like
    # scales, not exact in fp32, with seqused); test_gqa_reduce reduces on every group
    i = GROUPS.index((h_k, g))
    layout, dtype = ("batched", "varlen")[(HEAD_DIMS.index(d) + i) % 2], DTYPES[i // 2 % 2]
    posts = [(dtype, ("plain", "padded"), (1.0, 1.0), False), (dtype, ("transposed", "plain"), (d**-0.5, 0.3), True)]
    for deterministic in (False, True):
        accumulate_case(d, d, arch, h_k, g, layout, deterministic, seed=d * 100 + h_k * 17 + g + arch, posts=posts)


@arch_param
@pytest.mark.parametrize("d,dv", DV_PAIRS)
def test_gqa_dv_differs_from_d(d, dv, arch):
    for i, layout in enumerate(("batched", "varlen")):
        accumulate_case(d, dv, arch, 2, 2, layout, deterministic=i == 0, seed=d + dv + i,
                        posts=[(torch.bfloat16, ("padded", "transposed"), (0.5, 1.0 / 3.0), True)])


@pytest.mark.parametrize("dv", (128, 72))
@pytest.mark.parametrize("layout", ("batched", "varlen"))
def test_gqa_dv_own_tile(layout, dv):
    # from the plan's gates of hdim-256 tiles x KV heads x batch on, a dV of <= 128 columns beside dK of head dim 256
    # runs on its own tile on sm_90 (80 rows for dK's tiles, 128 for dV's): accumulate in both modes, postprocess and
    # reduce with row edges of both tiles and seqused, bitwise the reference
    d, h_k, g = 256, 16, 2
    if layout == "batched":
        geometry = {"batch": 2, "seqlen": 80 * 64 + 3, "lens": None, "slack": 0,
                    "seqused": [80 * 64 - 126, 2 * 128 + 5]}
        rows, batch = 80 * 64 + 3, 2
    else:
        lens = [128 * 20 + 1, 0, 80 * 17 - 1, 37, 1, 128 * 15]
        geometry = {"batch": None, "seqlen": None, "lens": lens, "slack": 5,
                    "seqused": [x - 3 * (x > 40) for x in lens]}
        rows, batch = sum(lens) + 5, len(lens)
    for op in ("gqa_accumulate", "gqa_reduce"):  # past both gates
        assert fe._extension._C.plan(op, 90, rows, batch, h_k, layout == "varlen", False, d, dv, False, 132)[
            "dv_own_launch"]
    for i, deterministic in enumerate((True, False)):
        acc = accumulate_case(d, dv, 0, h_k, g, layout, deterministic, seed=dv + i, geometry=geometry,
                              posts=[(DTYPES[i], ("padded", "transposed"), (0.5, 1.0 / 3.0), i == 0)])
        assert acc.config_v == fe.tile_config(dv)  # not the hdim-256 tile
    for i, pdt in enumerate((torch.float32, torch.bfloat16)):
        check_reduce(d, dv, True, 0, h_k, g, pdt, torch.bfloat16, **geometry, partial_layouts=("plain", "transposed"),
                     give_out=i == 0, out_layouts=("padded", "transposed"), scales=(0.125, 1.0), seed=dv + i)


@arch_param
@pytest.mark.parametrize("d", (64, 128, 192, 256))
@pytest.mark.parametrize("layout", ("batched", "varlen"))
def test_gqa_deterministic(layout, d, arch):
    # an accumulator allocated with deterministic=True adds in the sequential order by default, torch's switch on or
    # off; under the switch the sm_80 path's atomic mode asked for explicitly is its alert, while the sm_90 path,
    # deterministic in both modes, runs it (test_determinism: with warn_only, a warning). 50 runs (reset, two chunks)
    # give the same accumulator bits, equal to the sequential reference
    h_k, g = 2, 4
    p = problem(**edge_geometry(layout, block_n(d, d, arch)), device=DEV)
    seq = p.seq
    gen = generator(d + arch)
    chunks = [(rand(p.lead + (h_k * g, d), gen), rand(p.lead + (h_k * g, d), gen), kw) for kw in (seq, p.seq_used)]
    acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, arch=arch, **p.alloc)
    plain = fe.gqa_accumulator(h_k, d, device=DEV, arch=arch, **p.alloc)
    with deterministic_algorithms():
        fe.gqa_accumulate(*chunks[0][:2], acc, **seq)
        if acc.arch == 80:
            with pytest.raises(RuntimeError,
                               match=r"gqa_accumulate\(deterministic=False\) on the sm_80 path does not have a "):
                fe.gqa_accumulate(*chunks[0][:2], plain, deterministic=False, **seq)
            assert not plain.dk_accum.any() and not plain.dv_accum.any()
        else:
            fe.gqa_accumulate(*chunks[0][:2], plain, deterministic=False, **seq)
            assert_dense_is_reference(plain, chunks[:1], h_k, seq)
    assert_dense_is_reference(acc, chunks[:1], h_k, seq)

    def run(deterministic):
        acc.reset()
        for pk, pv, kw in chunks:
            fe.gqa_accumulate(pk, pv, acc, deterministic=deterministic, **kw)
        return torch.cat((bits(acc.dk_accum).flatten(), bits(acc.dv_accum).flatten()))

    first = run(None)
    for _ in range(49):
        assert torch.equal(run(True), first)
    assert_dense_is_reference(acc, chunks, h_k, seq)


@arch_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gqa_reduce(d, dtype, arch):
    # five cases, each on a group of its own, then every group: bf16 out of fp32 batched partials with seqused, fp16
    # out of fp16 heads-major varlen ones. dv != d now and then; partials bshd ("plain") or bhsd ("transposed": seen
    # as (.., rows, h_q, d)); outputs padded dk and transposed dv where given
    cases = [  # partial dtype, layout, partial storage, dv_partial given, out given, seqused
        (torch.float32, "batched", "plain", True, True, False),
        (dtype, "batched", "transposed", False, True, True),
        (torch.float32, "varlen", "transposed", False, False, True),
        (dtype, "varlen", "plain", True, True, True),
        (dtype, "batched", "plain", True, False, False),
    ]
    runs = [(GROUPS[(HEAD_DIMS.index(d) + 2 * i) % len(GROUPS)], case, (1.0, 1.0) if i % 2 == 0 else (d**-0.5, 3.0),
             d * 7 + i + arch) for i, case in enumerate(cases)]
    case, scales, seed = {torch.bfloat16: ((torch.float32, "batched", "plain", True, True, True), (0.125, 1.0), 0),
                          torch.float16: ((dtype, "varlen", "transposed", True, True, False), (1.0, 0.5), 1)}[dtype]
    runs += [((h_k, g), case, scales, g + seed) for h_k, g in GROUPS]
    for (h_k, g), (pdt, layout, storage, with_dv, give_out, used), scales, seed in runs:
        dv = (d, 128 if d == 256 else d + 8)[seed % 2]  # (256, 128): below the own-tile gate here
        check_reduce(d, dv, with_dv, arch, h_k, g, pdt, dtype, **edge_geometry(layout, block_n(d, dv, arch), used),
                     partial_layouts=(storage, storage), give_out=give_out, out_layouts=("padded", "transposed"),
                     scales=scales, seed=seed)


@pytest.mark.parametrize("layout", ("batched", "varlen"))
@pytest.mark.parametrize("partial_dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("d", (128, 192, 256))
def test_gqa_reduce_many_tiles_per_cta(d, partial_dtype, layout):
    # far more tiles than SMs (sm_90's persistent CTAs walk many, the stage ring wraps), seqused emptying some
    n = block_n(d)
    if layout == "batched":
        geo = (3, 12 * n + 7, None, 0, [12 * n + 7, 5 * n, 0])
    else:
        lens = torch.randint(0, 5 * n, (40,), generator=torch.Generator().manual_seed(d))
        lens[::5] = 0
        geo = (None, None, lens.tolist(), 3, (lens - n).clamp(min=0).tolist())
    check_reduce(d, d, True, 0, 4, 4, partial_dtype, torch.bfloat16, *geo, partial_layouts=("plain", "plain"),
                 give_out=True, out_layouts=("padded", "transposed"), scales=(0.3, 1.0), seed=d)


@arch_param
@pytest.mark.parametrize("d,layout", [(64, "batched"), (64, "varlen"), (192, "varlen")])
def test_gqa_reduce_equals_accumulate_then_postprocess(d, layout, arch):
    # gqa_reduce is bitwise deterministic gqa_accumulate + gqa_postprocess (the same fp32 sum in the same order), on
    # ordinary partials and on ~1e-40 ones: fp32 subnormals (bf16 has the same exponent range) whose sums are kept
    # (the sm_80 path's fp32 atomics flushed them to zero, so it adds under its semaphore with plain loads and stores)
    h_k, g = 2, 4
    p = problem(**edge_geometry(layout, block_n(d, d, arch)), device=DEV)
    gen = generator(d)
    for size, binades, kw, scales in ((1.0, 8, p.seq_used, {"scale_dk": 0.1, "scale_dv": 0.7}), (1e-40, 3, p.seq, {})):
        pk, pv = (rand(p.lead + (h_k * g, d), gen, binades=binades) * size for _ in range(2))
        assert bool((pk.abs() < torch.finfo(torch.float32).tiny).all()) == (size < 1) and (pk != 0).float().mean() > 0.9
        acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, arch=arch, **p.alloc)
        fe.gqa_accumulate(pk, pv, acc, deterministic=True, **kw)
        two, one = ([canary(p.lead + (h_k, d), torch.bfloat16) for _ in range(2)] for _ in range(2))
        fe.gqa_postprocess(acc, *two, **scales, **kw)
        _gqa_reduce(pk, pv, num_heads_kv=h_k, out=tuple(one), _arch=arch, **scales, **kw)
        for a, b in zip(one, two):
            assert_bits(a, b)
        for t in (*assert_dense_is_reference(acc, [(pk, pv, kw)], h_k, kw), *two):
            assert (t.float() != 0).float().mean() > 0.5


@arch_param
def test_gqa_empty_and_huge_problems(arch):
    # no sequences, no rows, all-empty varlen: nothing to do, nothing written
    gen = generator(1)
    for geo in ((0, 50, None, 0), (2, 0, None, 0), (None, None, [0, 0, 0], 7)):
        p = problem(*geo, device=DEV)
        lead, seq = p.lead, p.seq
        acc = fe.gqa_accumulator(1, 64, deterministic=True, device=DEV, arch=arch, **p.alloc)
        pk, pv = rand(lead + (2, 64), gen), rand(lead + (2, 64), gen)
        fe.gqa_accumulate(pk, pv, acc, deterministic=True, **seq)
        fe.gqa_accumulate(pk, pv, acc, deterministic=False, **seq)
        dk, dv = canary(lead + (1, 64), torch.float16), canary(lead + (1, 64), torch.float16)
        fe.gqa_postprocess(acc, dk, dv, **seq)
        _gqa_reduce(pk, pv, num_heads_kv=1, out=(dk, dv), _arch=arch, **seq)
        assert (bits(dk) == CANARY_BITS).all() and (bits(dv) == CANARY_BITS).all()
        assert all((x == 0).all() for x in (*acc.to_dense(**seq), acc.dk_accum, acc.dv_accum))
    # far more CTAs than fit on the GPU at once, 16 query heads waiting on each KV tile in turn, deterministic: must
    # finish (forward progress may not depend on the scheduling order) and stay exact
    s, gen = 16384, generator(3)
    pk, pv = rand((1, s, 16, 64), gen), rand((1, s, 16, 64), gen)
    acc = fe.gqa_accumulator(1, 64, batch=1, seqlen=s, deterministic=True, device=DEV, arch=arch)
    fe.gqa_accumulate(pk, pv, acc, deterministic=True)
    assert_dense_is_reference(acc, [(pk, pv, {})], 1, {})


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
        _gqa_reduce(pk, num_heads_kv=h_k, out=rk, seqused=used, _arch=arch)

    graph, _ = cuda_graph(step)  # check_inputs=True: content checks are skipped while capturing
    for _ in range(2):
        pk.copy_(rand(pk.shape, gen))
        pv.copy_(rand(pv.shape, gen))
        graph.replay()
        ref = assert_dense_is_reference(acc, [(pk, pv, {"seqused": used}), (pv, pk, {})], h_k, {})
        want = gqa_reduce_reference(pk, num_heads_kv=h_k, out=torch.zeros_like(rk), sequential=True, seqused=used)
        for got, w in zip((dk, dv, rk), (scaled(ref[0], 0.5).bfloat16(), ref[1].bfloat16(), want)):
            assert_bits(got, w)


def test_gqa_opcheck():
    # schemas (mutation annotations), fake kernels and functionalization agree with the kernels
    from torch.library import opcheck

    ops = torch.ops.flash_epilogue
    gen = generator(2)
    h_k, g, d = 2, 2, 64
    for geo in ((2, 150, None, 0, None), (None, None, [100, 0, 130], 10, [90, 0, 130])):
        p = problem(*geo, device=DEV)
        lead, seq = p.lead, p.seq_used
        acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, **p.alloc)
        pk, pv = rand(lead + (h_k * g, d), gen), rand(lead + (h_k * g, d), gen)
        sem = torch.zeros(16, dtype=torch.int32, device=DEV)  # the sm_80 path's workspace: unused on sm_90
        opcheck(ops.gqa_accumulate.default, (pk, pv, acc.dk_accum, acc.dv_accum, sem), {"deterministic": True, **seq})
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

    def inputs():  # pk, pv, acc, dk, dv
        return (pk, pv, fe.gqa_accumulator(h_k, d, batch=b, seqlen=s, deterministic=True, device=DEV),
                *[torch.zeros(b, s, h_k, d, dtype=torch.bfloat16, device=DEV) for _ in range(2)])

    ep = torch.export.export(Step(), inputs(), strict=False)
    exported, eager = inputs(), inputs()
    ep.module()(*exported)
    Step()(*eager)
    assert (exported[2].dk_accum != 0).any()
    for got, want in zip((exported[2].dk_accum, *exported[3:]), (eager[2].dk_accum, *eager[3:])):
        assert_bits(got, want)


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
    p = problem(lens=[300, 1, 517], device=DEV) if varlen else problem(batch, 600, device=DEV)
    cu = p.seq.get("cu_seqlens")
    gen = generator(d + 2 * varlen + deterministic)
    pk, pv = rand(p.lead + (hk * group, d), gen), rand(p.lead + (hk * group, d), gen)
    accs = [fe.gqa_accumulator(hk, d, deterministic=deterministic, device=DEV, **p.alloc) for _ in range(3)]
    # the same non-zero start: the adds go onto earlier calls' sums; the third gets |start| + sum |partials|: two
    # orders of the group + 1 additions differ by at most 2 * group * 2^-24 of it
    start = torch.randn(accs[0].dk_accum.shape, generator=gen, device=DEV)
    for acc, init in zip(accs, (start, start, start.abs())):
        acc.dk_accum.copy_(init)
        acc.dv_accum.copy_(init)
    fe.gqa_accumulate(pk, pv, accs[0], cu_seqlens=cu)
    fe.gqa_accumulate(pk.abs(), pv.abs(), accs[2], cu_seqlens=cu)
    per_head.accumulate_per_head(pk, pv, accs[1].dk_accum, accs[1].dv_accum, deterministic, cu, batch)
    torch.cuda.synchronize()
    for name in ("dk_accum", "dv_accum"):
        ours, theirs, mag = (getattr(acc, name) for acc in accs)
        if deterministic:
            assert torch.equal(bits(ours), bits(theirs)), name
        else:
            assert ((ours - theirs).abs() <= 2 * group * U32 * mag).all(), name
