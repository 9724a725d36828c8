"""CPU tests of the package surface: the tile table (as _C, fe.tile_config and the instantiation generator see it),
the GQA accumulator's geometry, the fake kernels, `python -m flash_epilogue`, the environment switches, and the docs'
performance table against the results file it cites."""
import inspect
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_epilogue as fe

ROOT = Path(__file__).resolve().parent.parent
F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32
C = fe._extension._C  # the extension module (None without it)
needs_C = pytest.mark.skipif(C is None, reason=f"no extension: {fe.UNAVAILABLE_REASON}")
OP_NAMES = ("store", "store_zero", "gqa_accumulate", "gqa_postprocess", "gqa_accum_to_dense", "gqa_reduce",
            "repeat_kv", "repeat_kv_backward")


@needs_C
def test_tile_table_is_the_extension_s():
    rows = [r for r in C.tile_configs() if r["fa3"]]  # FA3's tiles; the others are store's (test_plan.py)
    assert [(r["head_dim"], r["arch"]) for r in rows] == [(hd, a) for hd in fe.COMPILED_HEAD_DIMS for a in (90, 80)]
    for r in rows:
        cfg = fe.tile_config(r["head_dim"], arch=r["arch"])
        assert isinstance(cfg, fe.TileConfig)
        got = {k: getattr(cfg, k) for k in ("head_dim", "block_n", "num_threads", "swap_ab", "atom_layout_n",
                                           "accum_tile_elems", "slab_cols", "slab_elems")}
        assert got == {k: r[k] for k in got}, r
    # an uncompiled head dim runs on the next compiled tile
    assert fe.tile_config(80).head_dim == 96 and fe.tile_config(72, 136).head_dim == 192
    # the instantiation generator's head dims: every tile head dim of the C++ switch; a build of them all has a tile
    # config of each
    head_dims = tuple(runpy.run_path(str(ROOT / "scripts/generate_instantiations.py"))["HEAD_DIMS"])
    build = C.build_info()
    assert head_dims == tuple(build["tile_head_dims"])
    if build["compiled_head_dims"] == build["tile_head_dims"]:
        assert head_dims == tuple(sorted({r["head_dim"] for r in rows}))


def test_generated_text_is_up_to_date():
    # docs/performance.md's table is `bench_ops.py --from-json benchmarks/results/h200.json --readme-table`, so the
    # figures and the results file the docs cite cannot drift apart; csrc/instantiations is the generator's output
    readme_table = runpy.run_path(str(ROOT / "benchmarks/common.py"))["readme_table"]
    table = readme_table(json.loads((ROOT / "benchmarks/results/h200.json").read_text()))
    assert table in (ROOT / "docs/performance.md").read_text(), "regenerate the docs' performance table:\n" + table
    out = subprocess.run([sys.executable, "scripts/generate_instantiations.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_info_and_main_run():
    from flash_epilogue.info import info

    d = info()
    assert d["flash_epilogue"] == fe.__version__
    if fe.kernels_available():
        assert "sm_90a" in d["compiled_archs"] and "sm_90a" in C.compiled_archs() and isinstance(C.build_info(), dict)
        got = {(c["op"], c["dtype"], c["head_dim"], c["path"]) for c in d["compiled_configs"]}
        paths = {90: "sm90", 80: "sm80"}
        assert d["code_paths"] == C.build_info()["code_paths"] and 90 in d["code_paths"]
        assert got == {(op, dt, hd, paths[path]) for op in OP_NAMES[:4] + OP_NAMES[5:6]
                       for dt in ("bfloat16", "float16") for hd in fe.COMPILED_HEAD_DIMS for path in d["code_paths"]}
    for module in ("flash_epilogue.info", "flash_epilogue"):
        out = subprocess.run([sys.executable, "-m", module], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("d,dv,arch,block,elems", [
    (64, 64, 90, 128, (8192,) * 2), (80, 80, 90, 128, (12288,) * 2), (96, 96, 90, 128, (12288,) * 2),
    (128, 128, 90, 128, (16384,) * 2), (192, 192, 90, 96, (18432,) * 2), (256, 256, 90, 80, (20480,) * 2),
    (64, 64, 80, 128, (8192,) * 2), (128, 128, 80, 128, (16384,) * 2), (192, 192, 80, 80, (96 * 192,) * 2),
    (256, 256, 80, 64, (16384,) * 2), (192, 128, 90, 96, (18432, 12288)), (128, 192, 90, 96, (12288, 18432)),
    (192, 64, 90, 96, (18432, 6144)), (136, 72, 90, 96, (18432, 12288)), (256, 128, 90, 80, (20480, 20480)),
    (128, 64, 90, 128, (16384, 16384)), (192, 128, 80, 80, (96 * 192, 96 * 192)), (64, 256, 90, 80, (20480, 20480)),
    (64, 256, 80, 64, (16384, 16384))])
@pytest.mark.ops
def test_accumulator_shape_batched(d, dv, arch, block, elems):
    # hdim 192's sm_90 tile is three warpgroup slabs of 64 columns (6144 floats each): a narrower accumulator keeps
    # the slabs covering its head dim; hdim 256's slabs and the others' span every column, as sm_80's one slab does
    for seqlen in (0, 1, block - 1, block, block + 1, 1000):
        acc = fe.gqa_accumulator(2, d, dv, batch=3, seqlen=seqlen, deterministic=True, device="meta", arch=arch)
        assert (acc.dk_accum.shape, acc.dv_accum.shape) == tuple((3, 2, -(-seqlen // block), e) for e in elems)
        assert (acc.block_n, acc.arch, acc.config_v) == (block, arch, acc.config)
        # the sm_80 path's ordered mode: counters per (tile, KV head, batch) of each tensor, and a ticket; the sm_90
        # path is deterministic without them
        assert acc.deterministic
        if arch == 80:
            assert acc.semaphores.shape == (2 * 3 * acc.num_tiles * 2 + 1,) and acc.semaphores.dtype == I32
        else:
            assert acc.semaphores is None
    assert fe.gqa_accumulator(2, d, dv, batch=0, seqlen=50, device="meta", arch=arch).dk_accum.shape[0] == 0
    cfg, slabs = acc.config, acc.config.num_threads // 128 if arch == 90 else 1
    split = (cfg.head_dim, arch) == (192, 90)
    assert (cfg.slab_cols, cfg.slab_elems) == ((64, 6144) if split else (0, cfg.accum_tile_elems // slabs))


@pytest.mark.ops
@pytest.mark.parametrize("d,dv,own", [(256, 128, 128), (256, 96, 96), (248, 40, 64), (200, 128, 128), (256, 136, 0),
                                      (128, 256, 0), (192, 64, 0)])
def test_accumulator_dv_own_tile(d, dv, own):
    # on sm_90, dV of <= 128 columns beside dK on the hdim-256 tile has an accumulator of its own tile (that of its
    # head dim: 128 rows, all columns) from the plan's gate of hdim-256 tiles (80 rows) x KV heads x batch on; dK's
    # is unchanged
    def accumulator(heads, arch=90, **geometry):
        return fe.gqa_accumulator(heads, d, dv, device="meta", arch=arch, **geometry)

    gate = C.plan_thresholds()["dv_own_tile_min_tiles_accumulator"]
    rows6, rows4 = -(-gate // 6), -(-gate // 4)  # the fewest row tiles reaching it with 6 and 4 heads x batch
    cs = torch.tensor([0, 3000, 3000, 6000], dtype=I32)  # 3 sequences: (total + 3 * 80) // 80 tiles
    below = [dict(heads=2, batch=3, seqlen=80 * (rows6 - 1)), dict(heads=1, batch=1, seqlen=80 * (gate - 1)),
             dict(heads=4, cu_seqlens=cs, total_tokens=80 * rows4 - 241), dict(heads=4, batch=3, seqlen=6801, arch=80)]
    above = [dict(heads=2, batch=3, seqlen=80 * (rows6 - 1) + 1), dict(heads=1, batch=1, seqlen=80 * gate),
             dict(heads=4, cu_seqlens=cs, total_tokens=80 * rows4 - 240)]
    for is_above, geometry in [(False, g) for g in below] + [(True, g) for g in above]:
        acc = accumulator(**geometry)
        cfg, cfg_v = fe.tile_config(d, dv, arch=acc.arch), fe.tile_config(own or dv, arch=acc.arch)
        rows, batch, n = acc.rows, acc.batch, cfg.block_n
        assert acc.dk_accum.shape[2:] == (acc.num_tiles, cfg.accum_tile_elems) and acc.block_n == n
        assert acc.num_tiles == ((rows + batch * n) // n if acc.varlen else -(-rows // n))
        if cfg.head_dim == 256:  # the geometries straddle the gate
            assert (acc.num_tiles * acc.batch_extent * acc.num_heads_kv >= gate) == (is_above or acc.arch == 80)
        if own and is_above:
            assert (acc.config, acc.config_v, acc.tile_head_dim_v) == (cfg, cfg_v, own)
            n = cfg_v.block_n
            tiles = (rows + batch * n) // n if acc.varlen else -(-rows // n)
            assert acc.dv_accum.shape == (acc.batch_extent, acc.num_heads_kv, tiles, n * own)
        else:
            assert acc.config_v == acc.config and acc.dv_accum.shape[2] == acc.num_tiles


@pytest.mark.ops
@pytest.mark.parametrize("arch", (90, 80))
@pytest.mark.parametrize("d", (64, 192, 256))
def test_accumulator_varlen_holds_every_padded_sequence(d, arch):
    # (total + batch * kBlockN) // kBlockN tiles hold every sequence at its kBlockN-aligned offset_padded,
    # whatever the lengths (sized from shapes alone: no max_seqlen)
    cfg = fe.tile_config(d, arch=arch)
    n = cfg.block_n
    gen = torch.Generator().manual_seed(d + arch)
    for trial in range(200):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        lens = torch.randint(0, 3 * n, (batch,), generator=gen)
        lens[torch.rand(batch, generator=gen) < 0.2] = 0
        cu_list = [0] + torch.cumsum(lens, 0).tolist()
        total = cu_list[-1] + int(torch.randint(0, 5, (1,), generator=gen))
        shape = fe.gqa_accumulator(3, d, batch=batch, total_tokens=total, device="meta", arch=arch).dk_accum.shape
        assert shape[:2] == (1, 3) and shape[3] == cfg.accum_tile_elems and shape[2] == (total + batch * n) // n
        end = 0
        for b in range(batch):
            padded = ((cu_list[b] + b * n) // n) * n
            assert padded >= end  # sequences never share a tile
            end = padded + -(-int(lens[b]) // n) * n
        assert end <= shape[2] * n


@pytest.mark.ops
def test_accumulator_allocation():
    acc = fe.gqa_accumulator(2, 128, batch=3, seqlen=300, device="meta")
    assert isinstance(acc, fe.GQAAccumulator) and acc.dk_accum.shape == acc.dv_accum.shape == (3, 2, 3, 16384)
    assert acc.dk_accum.dtype == F32 and acc.dk_accum.is_contiguous() and acc.dv_accum.is_contiguous()
    assert acc.semaphores is None and not acc.deterministic
    assert (acc.head_dim, acc.head_dim_v, acc.block_n, acc.arch) == (128, 128, 128, 90)
    assert (acc.num_heads_kv, acc.batch, acc.rows, acc.varlen, acc.batch_extent, acc.num_tiles) == \
        (2, 3, 300, False, 3, 3)
    assert acc.config == fe.tile_config(128) and acc.device.type == "meta" and acc.dense_shape(128) == (3, 300, 2, 128)
    assert "GQAAccumulator(dk_accum=float32[3, 2, 3, 16384], dv_accum=float32[3, 2, 3, 16384], semaphores=None" \
        in repr(acc)
    # dv's own head dim: one tile serves max(d, dv); an uncompiled one: the next tile (test_accumulator_shape_batched)
    acc = fe.gqa_accumulator(4, 192, 128, batch=2, seqlen=200, deterministic=True, device="cpu")
    assert acc.dv_accum.shape == (2, 4, 3, 12288) and "semaphores=None" in repr(acc) and acc.deterministic
    acc = fe.gqa_accumulator(4, 192, 128, batch=2, seqlen=200, deterministic=True, device="cpu", arch=80)
    assert acc.dv_accum.shape == (2, 4, 3, 96 * 192) and "semaphores=int32[49]" in repr(acc)
    assert acc.deterministic and all((t == 0).all() for t in (acc.semaphores, acc.dk_accum, acc.dv_accum))
    assert fe.gqa_accumulator(torch.tensor(3), 64, batch=1, seqlen=8, device="meta").dk_accum.shape[1] == 3
    acc = fe.gqa_accumulator(1, 80, batch=1, seqlen=5, device="meta")
    assert acc.config.head_dim == 96 and acc.dk_accum.shape[3] == 128 * 96 and acc.head_dim == 80
    # varlen: cu_seqlens (its device by default) or batch
    cs = torch.tensor([0, 100, 100, 700], dtype=I32)
    acc = fe.gqa_accumulator(2, 64, cu_seqlens=cs, total_tokens=710, deterministic=True, arch=80)
    assert acc.device == cs.device and acc.varlen and acc.batch == 3 and acc.rows == 710
    assert acc.dk_accum.shape == (1, 2, (710 + 3 * 128) // 128, 8192) and acc.dense_shape(64) == (710, 2, 64)
    assert acc.semaphores.numel() == 2 * acc.num_tiles * 2 + 1
    assert fe.gqa_accumulator(2, 64, batch=3, total_tokens=710, device="meta").dk_accum.shape == acc.dk_accum.shape
    # the extension's layouts
    for args in ((2, 128, 128, 3, 300, False, 0), (2, 192, 128, 2, 200, False, 80), (3, 64, 64, 4, 710, True, 90),
                 (2, 256, 96, 3, 6800, False, 90), (2, 256, 96, 3, 6801, False, 90), (2, 256, 96, 3, 6801, False, 80)):
        layout = C.gqa_accum_layout(*args, torch.device("cpu"))
        h_k, d, dv, batch, rows, varlen, arch = args
        acc = fe.gqa_accumulator(h_k, d, dv, batch=batch, **({"total_tokens": rows} if varlen else {"seqlen": rows}),
                                 deterministic=True, device="cpu", arch=arch)
        assert tuple(map(tuple, layout["shapes"])) == (tuple(acc.dk_accum.shape), tuple(acc.dv_accum.shape))
        assert layout["semaphore_numel"] == (0 if acc.semaphores is None else acc.semaphores.numel())
        assert (acc.semaphores is None) == (acc.arch == 90)
        assert (layout["arch"], layout["block_n"]) == (acc.arch, acc.block_n)
        assert layout["tile_head_dims"] == (acc.config.head_dim, acc.config_v.head_dim)


@pytest.mark.ops
def test_accumulator_reset_and_pytree():
    acc = fe.gqa_accumulator(1, 64, batch=1, seqlen=10, deterministic=True, device="cpu", arch=80)
    acc.dk_accum.fill_(3.0)
    acc.dv_accum.fill_(-1.0)
    assert acc.reset() is acc and (acc.dk_accum == 0).all() and (acc.dv_accum == 0).all()
    leaves, spec = pytree.tree_flatten(acc)
    assert len(leaves) == 3 and leaves[0] is acc.dk_accum and leaves[2] is acc.semaphores
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, fe.GQAAccumulator) and back.dk_accum is acc.dk_accum and back.rows == 10
    leaves, spec = pytree.tree_flatten(fe.gqa_accumulator(1, 64, batch=1, seqlen=10, device="cpu"))
    assert leaves[2] is None and pytree.tree_unflatten(leaves, spec).semaphores is None


@needs_C
@pytest.mark.parametrize("varlen", [False, True])
def test_fake_kernels(varlen):
    from torch._library.simple_registry import singleton

    for name in OP_NAMES:  # every op has one
        assert singleton.find(f"flash_epilogue::{name}").fake_impl.kernel is not None, name
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with FakeTensorMode():
        cs = torch.tensor([0, 40, 100], dtype=I32, device=device)
        lead = (100,) if varlen else (2, 50)
        seq = {"cu_seqlens": cs} if varlen else {}
        ops = torch.ops.flash_epilogue
        acc32 = torch.empty(lead + (4, 128), device=device)
        dk, dv = (torch.empty(lead + (2, w), dtype=BF16, device=device) for w in (128, 64))
        idx = torch.tensor([1], dtype=I32, device=device)
        assert ops.store(acc32, acc32, dk.new_empty(lead + (4, 128)), dk.new_empty(lead + (4, 128)), **seq) is None
        assert ops.store_zero(dk, dv, batch_idx=idx, head_idx=idx, row_start=3, row_end=9, **seq) is None
        alloc = {"cu_seqlens": cs, "total_tokens": 100} if varlen else {"batch": 2, "seqlen": 50}
        acc = fe.gqa_accumulator(2, 128, 64, deterministic=True, device=device, **alloc)
        pk, pv = torch.empty(lead + (8, 128), device=device), torch.empty(lead + (8, 64), device=device)
        assert ops.gqa_accumulate(pk, pv, acc.dk_accum, acc.dv_accum, acc.semaphores, deterministic=True,
                                  **seq) is None
        assert ops.gqa_postprocess(acc.dk_accum, acc.dv_accum, dk, dv, scale_dk=0.5, **seq) is None
        assert ops.gqa_accum_to_dense(acc.dk_accum, torch.empty(lead + (2, 128), device=device), head_dim=128,
                                      **seq) is None
        assert ops.gqa_reduce(pk, None, dk, None, **seq) is None
        # the wrappers, through the fakes: their outputs have the right metadata
        fe.gqa_accumulate(pk, pv, acc, deterministic=True, **seq)
        fe.gqa_postprocess(acc, dk, dv, **seq)
        k, v = acc.to_dense(**seq)
        assert k.shape == lead + (2, 128) and v.shape == lead + (2, 64) and k.dtype == F32
        rk, rv = fe.gqa_reduce(pk, pv, num_heads_kv=4, **seq)
        assert rk.shape == lead + (4, 128) and rv.shape == lead + (4, 64) and rk.dtype == BF16
        r16 = fe.gqa_reduce(pk.half(), num_heads_kv=2, **seq)
        assert r16.dtype == torch.float16 and r16.shape == lead + (2, 128) and r16.is_contiguous()
        # heads-major partials seen as (.., rows, h_q, d): a contiguous (.., rows, h_k, d) output
        rt = fe.gqa_reduce(torch.empty((8,) + lead + (128,), device=device).movedim(0, -2), num_heads_kv=2, **seq)
        assert rt.shape == lead + (2, 128) and rt.is_contiguous()
        assert fe.gqa_reduce(pk, num_heads_kv=8, out_dtype=torch.float16, **seq).dtype == torch.float16
        y = ops.repeat_kv(torch.empty(2, 2, 5, 8, device=device), 3, 1)
        assert y.shape == (2, 6, 5, 8) and y.is_contiguous()


@needs_C
def test_debug_switch_reaches_the_extension(monkeypatch):
    monkeypatch.setenv("FLASH_EPILOGUE_DEBUG", "1")
    assert not C._debug_sync()  # read at import (host time), until refreshed
    fe.refresh_env_flags()
    assert C._debug_sync()  # repeat_kv's C++ backward synchronizes after its kernel
    monkeypatch.setenv("FLASH_EPILOGUE_DEBUG", "0")
    fe.refresh_env_flags()
    assert not C._debug_sync()


def test_public_signatures_have_no_private_arguments():
    """The code-path switch `_arch` is the tests' (ops._store, _store_zero, _gqa_reduce): no public function has it."""
    public = [getattr(m, n) for m in (fe, fe.reference, fe.testing) for n in m.__all__]
    public = [f for f in public if inspect.isfunction(f)]
    assert {f.__name__ for f in public} >= {"store", "store_zero", "gqa_reduce", "gqa_accumulate", "repeat_kv"}
    for f in public:
        private = [p for p in inspect.signature(f).parameters if p.startswith("_")]
        assert not private, f"{f.__module__}.{f.__name__} shows {private}"
    with pytest.raises(TypeError, match="_arch"):
        fe.store(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), _arch=80)
