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
# on hdim 192: dV, dK of fewer slabs; on hdim 256 with dv <= 128: below the own-tile gate (test_gqa_dv_own_tile)
DV_PAIRS = ((192, 128), (128, 64), (64, 256), (72, 200), (64, 192), (256, 128), (240, 72))
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


def edge_geometry(layout, n, used=True):
    """problem() arguments, row edges around the tile height n; seqused (if `used`) cuts some sequences (down to 0)."""
    if layout == "batched":
        return {"batch": 2, "seqlen": 2 * n + 3, "lens": None, "slack": 0, "used": [2 * n - 1, n + 1] if used else None}
    lens = [n + 1, 0, 37, 1, 2 * n - 1]
    return {"batch": None, "seqlen": None, "lens": lens, "slack": 5,
            "used": [max(0, x - 3 * (i % 2)) for i, x in enumerate(lens)] if used else None}


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
        pk, pv = (input_view(lead + (h_k * g, w), layout, gen) for w, layout in zip((d, dv), partial_layouts))
        call(dev, fe.gqa_accumulate, pk, pv, acc, deterministic=deterministic, **kw)
        for out, p, sequential in ((ref, (pk, pv), True), (ref64, (pk, pv), False), (mag, (pk.abs(), pv.abs()), False)):
            gqa_accumulate_reference(*p, *out, num_heads_kv=h_k, sequential=sequential, **kw)
    case = SimpleNamespace(acc=acc, dense=acc.to_dense(**seq) if dev == "cuda" else None, lead=lead, seq=seq,
                           seq_used=seq_used, h_k=h_k, d=d, dv=dv, dev=dev)
    for name, got, want, want64, m in zip(("dk", "dv"), case.dense or (), ref, ref64, mag):
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


def check_reduce(d, dv, with_dv, arch, h_k, g, partial_dtype, out_dtype, batch, seqlen, lens, slack, used,
                 partial_layouts, give_out, out_layouts, scales, seed, dev="cuda"):
    """gqa_reduce into canary-carved views (give_out: returned, each whole buffer bitwise the sequential reference),
    else into new contiguous outputs whose valid rows (the rest is uninitialized) are bitwise the reference."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    _, lead, _, seq = problem(dev, batch, seqlen, lens, slack, used)
    pk, pv = (input_view(lead + (h_k * g, w), lay, gen, partial_dtype) for w, lay in zip((d, dv), partial_layouts))
    pv = pv if with_dv else None
    kw = {"num_heads_kv": h_k, "scale_dk": scales[0], "scale_dv": scales[1], **seq}
    if not give_out:
        ret = call(dev, fe.gqa_reduce, pk, pv, out_dtype=out_dtype if partial_dtype == torch.float32 else None,
                   _arch=arch, **kw)
        if dev == "cuda":
            for name, out, p, scale in zip(("dk", "dv"), list(ret) if with_dv else [ret], (pk, pv), scales):
                assert out.dtype == out_dtype and out.is_contiguous() and out.shape == lead + (h_k, p.shape[-1])
                want = out.clone()
                gqa_reduce_reference(p, num_heads_kv=h_k, out=want, scale_dk=scale, sequential=True, **seq)
                assert_bits(out, want, name)
        return
    (buf_k, dk), (buf_v, dv_out) = (carve(lead + (h_k, w), out_dtype, layout, dev)
                                    for w, layout in zip((d, dv if with_dv else d), out_layouts))
    expect_k, expect_v = buf_k.clone(), buf_v.clone()
    gqa_reduce_reference(pk, pv, out=(same_view(expect_k, dk), same_view(expect_v, dv_out)), sequential=True, **kw)
    ret = call(dev, fe.gqa_reduce, pk, pv, out=(dk, dv_out) if with_dv else dk, _arch=arch, **kw)
    if dev == "cuda":
        assert (ret[0] is dk and ret[1] is dv_out) if with_dv else ret is dk
    assert_written(dev, ("dk", buf_k, expect_k), ("dv", buf_v, expect_v))


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
    own = acc.arch == 90 and acc.config.head_dim == 256 and dv <= 128 and \
        acc.num_tiles * h_k * acc.batch_extent >= 512
    assert acc.config_v == (fe.tile_config(dv) if own else acc.config)
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
    # from 512 hdim-256 tiles x KV heads x batch on, a dV of <= 128 columns beside dK of head dim 256 runs on its own
    # tile on sm_90 (80 rows for dK's tiles, 128 for dV's): accumulate in both modes, postprocess and reduce with row
    # edges of both tiles and seqused, bitwise the reference
    d, h_k, g = 256, 8, 2
    if layout == "batched":
        geometry = {"batch": 2, "seqlen": 80 * 64 + 3, "lens": None, "slack": 0, "used": [80 * 64 - 126, 2 * 128 + 5]}
    else:
        lens = [128 * 20 + 1, 0, 80 * 17 - 1, 37, 1, 128 * 15]
        geometry = {"batch": None, "seqlen": None, "lens": lens, "slack": 5, "used": [x - 3 * (x > 40) for x in lens]}
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
    # off; under the switch the atomic mode asked for explicitly is its alert (test_determinism: with warn_only, a
    # warning; the atomic accumulator's default raises: test_bad_inputs). 50 runs (reset, two chunks) give the same
    # accumulator bits, equal to the sequential reference
    h_k, g = 2, 4
    alloc, lead, seq, seq_used = problem(DEV, **edge_geometry(layout, block_n(d, d, arch)))
    gen = generator(d + arch)
    chunks = [(rand(lead + (h_k * g, d), gen), rand(lead + (h_k * g, d), gen), kw) for kw in (seq, seq_used)]
    acc = fe.gqa_accumulator(h_k, d, deterministic=True, device=DEV, arch=arch, **alloc)
    plain = fe.gqa_accumulator(h_k, d, device=DEV, arch=arch, **alloc)
    with deterministic_algorithms():
        fe.gqa_accumulate(*chunks[0][:2], acc, **seq)
        with pytest.raises(RuntimeError, match=r"gqa_accumulate\(deterministic=False\) does not have a deterministic"):
            fe.gqa_accumulate(*chunks[0][:2], plain, deterministic=False, **seq)
    assert not plain.dk_accum.any() and not plain.dv_accum.any()
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
        for a, b in zip(one, two):
            assert_bits(a, b)
        for t in (*assert_dense_is_reference(acc, [(pk, pv, kw)], h_k, kw), *two):
            assert (t.float() != 0).float().mean() > 0.5


@arch_param
def test_gqa_empty_and_huge_problems(arch):
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
        fe.gqa_reduce(pk, num_heads_kv=h_k, out=rk, seqused=used, _arch=arch)

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
        ours, theirs, mag = (getattr(acc, name) for acc in accs)
        if deterministic:
            assert torch.equal(bits(ours), bits(theirs)), name
        else:
            assert ((ours - theirs).abs() <= 2 * group * U32 * mag).all(), name
