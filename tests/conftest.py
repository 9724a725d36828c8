"""Shared test setup: the GPU marker and the helpers of more than one test file that are the suite's own (fixtures,
subprocesses, the checks and problems several files share). The general helpers (canary buffers, bitwise comparison,
seeded inputs, problem geometries) are flash_epilogue.testing's: a test file imports every shared helper from conftest
or from flash_epilogue.testing, never from another test file.

Outputs are views carved out of canary buffers (flash_epilogue.testing.carve) and the WHOLE buffer is compared bitwise
with the reference applied to a clone.
"""
import contextlib
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.utils._pytree as pytree

import flash_epilogue as fe
from flash_epilogue.ops import _gqa_reduce, _store, _store_zero
from flash_epilogue.reference import (gqa_accumulate_reference, gqa_reduce_reference, gqa_reduce_sequential_fp32,
                                      group_sum_reference, store_reference, store_zero_reference)
from flash_epilogue.testing import (assert_bits, bits, call_op, canary, carve, generator, input_view, int32, problem,
                                    rand, same, same_view)

TESTS = Path(__file__).resolve().parent
BF16, F16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32
DTYPES = (BF16, F16)
U32 = 2.0**-24  # unit roundoff of fp32
# the code paths: sm_90 (the H200's own) and the sm_80 path (`_arch=80`) on the same GPU
arch_param = pytest.mark.parametrize("arch", (90, 80), ids=("sm90", "sm80"))


def _why_no_sm90_kernels() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if (cap := torch.cuda.get_device_capability()) != (9, 0):
        return f"needs sm_90, device is sm_{cap[0]}{cap[1]}"
    return "" if fe.kernels_available() else f"kernels not built: {fe.UNAVAILABLE_REASON}"


WHY_NOT = _why_no_sm90_kernels()
HAVE_SM90 = not WHY_NOT
# The sm_80 code path's GPU tests skip in a build without it (FLASH_EPILOGUE_SM80_PATH; the GPU check builds it):
# pytest_collection_modifyitems.
SM80_PATH = fe._extension.sm80_path_callable()
NO_SM80_PATH = "this build has no sm_80 code path (FLASH_EPILOGUE_SM80_PATH=1 builds it)"
PATHS = (0, 80) if SM80_PATH else (0,)  # the code paths a GPU workload loops over (0: the GPU's own)


def runs_sm80_path(item) -> bool:
    """A test instance of the sm_80 path: its `arch` is 80, or a parameter names it (an id with "sm80")."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return params.get("arch") == 80 or any(isinstance(v, str) and "sm80" in v for v in params.values())


def nvcc() -> str | None:
    """The nvcc that compiles the header-library tests (PATH, else CUDA_HOME's), or None."""
    cuda_bin = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")
    return shutil.which("nvcc") or shutil.which("nvcc", path=cuda_bin)


def run_checked(cmd, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, **kw), its output captured as text; it must exit 0, else the message is its output's tail."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))[:300]}: exit code {proc.returncode}\n"
                                  f"{proc.stdout[-6000:]}{proc.stderr[-3000:]}")
    return proc


def run_in_child(workload):
    """Run `workload` (a module-level function of a test file that prints OK at its end) in a fresh Python process,
    so that a fault (a sticky CUDA error, a crash) fails only the calling test."""
    module = Path(workload.__code__.co_filename).stem
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import {module}; {module}.{workload.__name__}()"
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], cwd=TESTS.parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")


EXAMPLE = TESTS.parent / "examples" / "custom_kernel"


@functools.cache
def example_build():
    """examples/custom_kernel/build.py as a module, loaded by path: a pip package named `build` would shadow an import
    by name."""
    spec = importlib.util.spec_from_file_location("custom_kernel_build", EXAMPLE / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAVE_SM90:
            item.add_marker(pytest.mark.skip(reason=WHY_NOT))
        elif "gpu" in item.keywords and not SM80_PATH and runs_sm80_path(item):
            item.add_marker(pytest.mark.skip(reason=NO_SM80_PATH))
        elif "ops" in item.keywords and not fe.kernels_available():
            item.add_marker(pytest.mark.skip(reason=f"needs the ops of flash_epilogue._C: {fe.UNAVAILABLE_REASON}"))


@pytest.fixture(autouse=True)
def _global_state_follows_the_test():
    """The env flags, read at import, re-read before each test once monkeypatch restored the environment (a test that
    sets them calls fe.refresh_env_flags()); torch's deterministic-algorithms switch restored after each test."""
    fe.refresh_env_flags()
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


def cuda_graph(step, warmup=1):
    """(graph, what step returned while captured): step() captured once into a CUDA graph on a side stream,
    after `warmup` runs on that stream outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph, out


@contextlib.contextmanager
def deterministic_algorithms(warn_only=False):
    """torch.use_deterministic_algorithms(True) inside, the previous setting restored after."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


# ---- the GQA checks of test_gqa.py and test_fuzz.py: a geometry is problem()'s batch, seqlen, lens, slack, seqused;
# on the CPU (test_fuzz's CI run) each op call passes every check but the last, the device's (call_op)


def assert_written(dev, *checks):
    """On a GPU: each (name, buffer, expected copy) bitwise equal."""
    if dev == "cuda":
        torch.cuda.synchronize()
        for name, got, want in checks:
            assert_bits(got, want, name)


def scaled(dense, scale):
    """fp32 multiply by the scale rounded to fp32: what the kernels compute."""
    return dense * torch.tensor(scale, dtype=torch.float32, device=dense.device)


def check_accumulate(d, dv, arch, h_k, g, deterministic, batch, seqlen, lens, slack, seqused, chunk_seqused,
                     partial_layouts, seed, dev="cuda"):
    """gqa_accumulate once per entry of chunk_seqused (with seqused where True), then to_dense. Deterministic: bitwise
    the sequential fp32 reference. Otherwise a sum of T = calls * g terms in any order: T - 1 rounded adds are within
    (T - 1) u sum|p| of the exact sum to first order (u = 2^-24; second order < u^2 T^2 sum|p|, T <= 48), so
    |got - fp64 sum| <= T u sum|p| holds with margin. Returns the case (dense None where nothing ran)."""
    gen = generator(seed, dev)
    p = problem(batch, seqlen, lens, slack, seqused, device=dev)
    acc = fe.gqa_accumulator(h_k, d, dv, deterministic=deterministic, device=dev, arch=arch, **p.alloc)
    ref, ref64, mag = ([torch.zeros(p.lead + (h_k, w), dtype=t, device=dev) for w in (d, dv)]
                       for t in (torch.float32, torch.float64, torch.float64))
    for with_used in chunk_seqused:
        kw = p.seq_used if with_used else p.seq
        pk, pv = (input_view(p.lead + (h_k * g, w), layout, gen) for w, layout in zip((d, dv), partial_layouts))
        call_op(dev, fe.gqa_accumulate, pk, pv, acc, deterministic=deterministic, **kw)
        for out, parts, sequential in ((ref, (pk, pv), True), (ref64, (pk, pv), False),
                                       (mag, (pk.abs(), pv.abs()), False)):
            gqa_accumulate_reference(*parts, *out, num_heads_kv=h_k, sequential=sequential, **kw)
    case = SimpleNamespace(acc=acc, dense=acc.to_dense(**p.seq) if dev == "cuda" else None, lead=p.lead, seq=p.seq,
                           seq_used=p.seq_used, h_k=h_k, d=d, dv=dv, dev=dev)
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
    call_op(case.dev, fe.gqa_postprocess, case.acc, dk, dv, scale_dk=scales[0], scale_dv=scales[1], **seq)
    assert_written(case.dev, ("dk", buf_k, expect_k), ("dv", buf_v, expect_v))


def check_reduce(d, dv, with_dv, arch, h_k, g, partial_dtype, out_dtype, batch, seqlen, lens, slack, seqused,
                 partial_layouts, give_out, out_layouts, scales, seed, dev="cuda"):
    """gqa_reduce into canary-carved views (give_out: returned, each whole buffer bitwise the sequential reference),
    else into new contiguous outputs whose valid rows (the rest is uninitialized) are bitwise the reference."""
    gen = generator(seed, dev)
    p = problem(batch, seqlen, lens, slack, seqused, device=dev)
    pk, pv = (input_view(p.lead + (h_k * g, w), lay, gen, partial_dtype) for w, lay in zip((d, dv), partial_layouts))
    pv = pv if with_dv else None
    kw = {"num_heads_kv": h_k, "scale_dk": scales[0], "scale_dv": scales[1], **p.seq_used}
    if not give_out:
        ret = call_op(dev, _gqa_reduce, pk, pv, out_dtype=out_dtype if partial_dtype == torch.float32 else None,
                      _arch=arch, **kw)
        if dev == "cuda":
            for name, out, part, scale in zip(("dk", "dv"), list(ret) if with_dv else [ret], (pk, pv), scales):
                assert out.dtype == out_dtype and out.is_contiguous() and out.shape == p.lead + (h_k, part.shape[-1])
                want = out.clone()
                gqa_reduce_reference(part, num_heads_kv=h_k, out=want, scale_dk=scale, sequential=True, **p.seq_used)
                assert_bits(out, want, name)
        return
    (buf_k, dk), (buf_v, dv_out) = (carve(p.lead + (h_k, w), out_dtype, layout, dev)
                                    for w, layout in zip((d, dv if with_dv else d), out_layouts))
    expect_k, expect_v = buf_k.clone(), buf_v.clone()
    gqa_reduce_reference(pk, pv, out=(same_view(expect_k, dk), same_view(expect_v, dv_out)), sequential=True, **kw)
    ret = call_op(dev, _gqa_reduce, pk, pv, out=(dk, dv_out) if with_dv else dk, _arch=arch, **kw)
    if dev == "cuda":
        assert (ret[0] is dk and ret[1] is dv_out) if with_dv else ret is dk
    assert_written(dev, ("dk", buf_k, expect_k), ("dv", buf_v, expect_v))


# ---- every op as launches, checked at the end (test_big_concurrent.py, test_determinism.py, test_multi_gpu.py)


def every_op_launches(d, gen, lead=(2, 300), h=4, g=2, arch=0, store_dtype=BF16, deterministic=True):
    """(acc, launches, check): every op at head dim d, h KV heads of g query heads each, on gen's device and path
    `arch` (store_dtype: the outputs of store, store_zero, the one-tensor gqa_reduce). A launch is one op call (all but
    the bf16 gqa_reduce make no CUDA call before the op's own; repeat_kv's backward runs on autograd's device thread),
    accumulating into acc (reset it before a rerun; atomic is exact for g <= 2); check(*where) compares bitwise."""
    dev, (b, s) = gen.device, lead
    ak, av, pk, pv = (rand(lead + (n, d), gen) for n in (h, h, h * g, h * g))
    p16 = pk.to(BF16)
    x, grad = rand((b, h, s, d), gen, BF16).requires_grad_(), rand((b, h * g, s, d), gen, BF16)
    out = [canary(lead + (h, d), dt, dev) for dt in (store_dtype, store_dtype, BF16, BF16, store_dtype, BF16, BF16)]
    sel = {"batch_idx": int32(1, device=dev), "row_start": s // 2}  # a list: a CUDA copy first
    acc = fe.gqa_accumulator(h, d, batch=b, seqlen=s, deterministic=deterministic, device=dev, arch=arch)
    got = {}
    launches = [lambda: _store(ak, av, out[0], out[1], _arch=arch),
                lambda: _store_zero(out[0], out[1], **sel, _arch=arch),
                lambda: _gqa_reduce(pk, pv, num_heads_kv=h, out=(out[2], out[3]), _arch=arch),
                lambda: _gqa_reduce(pk, num_heads_kv=h, out=out[4], _arch=arch),
                lambda: got.update(reduce16=_gqa_reduce(p16, num_heads_kv=h, _arch=arch)),
                lambda: fe.gqa_accumulate(pk, pv, acc),
                lambda: fe.gqa_postprocess(acc, out[5], out[6], scale_dk=0.5),
                lambda: got.update(repeat_kv=torch.autograd.grad(fe.repeat_kv(x, g), x, grad))]

    def check(*where):
        stored = [torch.zeros_like(o) for o in out[:2]]
        store_reference(ak, av, *stored)
        store_zero_reference(*stored, batch_idx=[1], row_start=s // 2)
        dense = [torch.zeros(lead + (h, d), device=dev) for _ in range(2)]
        gqa_accumulate_reference(pk, pv, *dense, num_heads_kv=h)
        reduced = [gqa_reduce_sequential_fp32(p, h).to(o.dtype) for p, o in zip((pk, pv, pk), out[2:5])]
        checks = {"store, store_zero": (out[:2], stored), "gqa_reduce": (out[2:5], reduced),
                  "gqa_reduce bf16": ([got["reduce16"]], [gqa_reduce_sequential_fp32(p16.float(), h).to(BF16)]),
                  "gqa_accumulate": (acc.to_dense(), dense),
                  "gqa_postprocess": (out[5:], [(dense[0] * 0.5).to(BF16), dense[1].to(BF16)]),
                  "repeat_kv backward": (got["repeat_kv"], [group_sum_reference(grad, g)])}
        for what, (outputs, want) in checks.items():
            assert all(same(o, w) for o, w in zip(outputs, want, strict=True)), (what, *where)

    return acc, launches, check


# ---- the ops in PyTorch's machinery (test_ecosystem.py, test_aoti.py, test_devices.py): one small problem for every
# op, on the GPU or on the CPU, where kernels written with flash_epilogue.reference stand in for the CUDA ones (the
# accumulator row-major per tile)

OPS = torch.ops.flash_epilogue


def _accum_dense(accum, block_n, like, cu_seqlens):
    """The stand-in tile layout: a batched accumulator (b, h_k, tiles, elems) seen as (b, rows, h_k, width); varlen:
    (total, h_k, width), packed row r at accumulator row r (rows and width: those of `like`)."""
    b, h, tiles, elems = accum.shape
    view = accum.view(b, h, tiles * block_n, elems // block_n)
    if cu_seqlens is not None:
        return view[0, :, :like.shape[0], :like.shape[-1]].transpose(0, 1)
    return view[:, :, :like.shape[1], :like.shape[-1]].transpose(1, 2)


def _cpu_gqa_accumulate(dk_partial, dv_partial, dk_accum, dv_accum, semaphores=None, *, cu_seqlens=None,
                        seqused=None, deterministic=False, _arch=0):
    block_n = fe.tile_config(dk_partial.shape[-1], dv_partial.shape[-1]).block_n
    for p, a in ((dk_partial, dk_accum), (dv_partial, dv_accum)):
        gqa_accumulate_reference(p, None, _accum_dense(a, block_n, p, cu_seqlens), None, num_heads_kv=a.shape[1],
                                 cu_seqlens=cu_seqlens, seqused=seqused)


def _cpu_gqa_postprocess(dk_accum, dv_accum, dk, dv, *, scale_dk=1.0, scale_dv=1.0, cu_seqlens=None, seqused=None,
                         _arch=0):
    block_n = fe.tile_config(dk.shape[-1], dv.shape[-1]).block_n
    scaled = [_accum_dense(a, block_n, o, cu_seqlens) * torch.tensor(sc, dtype=torch.float32)
              for a, o, sc in ((dk_accum, dk, scale_dk), (dv_accum, dv, scale_dv))]
    store_reference(scaled[0], scaled[1], dk, dv, cu_seqlens=cu_seqlens, seqused=seqused)


def _cpu_gqa_accum_to_dense(accum, out, *, head_dim, cu_seqlens=None, seqused=None, _arch=0):
    dense = _accum_dense(accum, fe.tile_config(head_dim).block_n, out, cu_seqlens)
    store_reference(dense, dense, out, torch.empty_like(out), cu_seqlens=cu_seqlens, seqused=seqused)


def _cpu_gqa_reduce(dk_partial, dv_partial, dk, dv, _arch=0, **kw):
    gqa_reduce_reference(dk_partial, dv_partial, num_heads_kv=dk.shape[-2], out=(dk, dv), sequential=True, **kw)


_CPU_KERNELS = {"store": lambda *a, _arch=0, **kw: store_reference(*a, **kw),
                "store_zero": lambda *a, _arch=0, **kw: store_zero_reference(*a, **kw),
                "gqa_accumulate": _cpu_gqa_accumulate, "gqa_postprocess": _cpu_gqa_postprocess,
                "gqa_accum_to_dense": _cpu_gqa_accum_to_dense, "gqa_reduce": _cpu_gqa_reduce}


@pytest.fixture
def cpu_kernels():
    """The ops get CPU kernels (in place of the registration that checks and refuses the device)."""
    if not fe.kernels_available():
        pytest.skip(f"the ops are not defined: {fe.UNAVAILABLE_REASON}")
    lib = torch.library.Library("flash_epilogue", "IMPL")
    try:
        for name, fn in _CPU_KERNELS.items():
            lib.impl(name, fn, "CPU")
    except RuntimeError as e:  # a build without kernels registers its own CPU stubs
        lib._destroy()
        pytest.skip(f"cannot register CPU stand-ins: {e}")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    lib._destroy()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The device a test runs on; the CPU's ops get the stand-in kernels."""
    if request.param == "cpu":
        request.getfixturevalue("cpu_kernels")
    else:
        torch._dynamo.reset()
    return request.param


def make_problem(device, seed=0):
    """The tensors of a small problem, its batched and varlen accumulators (tile offsets from cu_seqlens): batched and
    varlen store/store_zero and GQA accumulator problems, varlen 16-bit gqa_reduce partials (dv != d), a repeat_kv
    input."""
    gen = generator(seed, device)
    rnd = lambda *shape, dtype=torch.float32: rand(shape, gen, dtype, binades=6)  # noqa: E731
    zeros = lambda *shape, dtype=BF16: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    b, s, hk, g, d, dv = 2, 150, 2, 3, 64, 128
    bat = problem(b, s, seqused=[s, 77 - seed], device=device)
    var = problem(lens=[100, 0, 37, 129], slack=5, seqused=[90, 0, 37, 100], device=device)
    total = var.lead[0]
    t = {
        "ak": rnd(b, s, hk, d), "av": rnd(b, s, hk, dv), "dk": zeros(b, s, hk, d), "dv": zeros(b, s, hk, dv),
        "used": bat.seq_used["seqused"],
        "vak": rnd(total, hk, d), "vav": rnd(total, hk, d),
        "vdk": zeros(total, hk, d, dtype=F16), "vdv": zeros(hk, total, d, dtype=F16).transpose(0, 1),
        "cu": var.seq["cu_seqlens"],
        "vused": var.seq_used["seqused"],
        "bidx": int32(0, 3, device=device), "hidx": int32(1, device=device),
        "pk": rnd(b, s, hk * g, d), "pv": rnd(b, s, hk * g, dv),
        "ok": zeros(b, s, hk, d), "ov": zeros(b, s, hk, dv), "dense": zeros(b, s, hk, d, dtype=torch.float32),
        "rpk": rnd(total, hk * g, d, dtype=BF16), "rpv": rnd(total, hk * g, dv, dtype=BF16),
        "rk": zeros(total, hk, d), "rv": zeros(total, hk, dv),
        "x": rnd(b, hk, s, d, dtype=BF16),
        "vpk": rnd(total, hk * g, d), "vok": zeros(total, hk, d, dtype=F16), "vov": zeros(total, hk, d, dtype=F16),
        # the op's semaphores argument (a workspace of the sm_80 path's ordered mode, which the sm_90 path leaves
        # alone), so that every schema's tensor argument goes through each torch tool
        "sem": torch.zeros(16, dtype=torch.int32, device=device),
    }
    acc = fe.gqa_accumulator(hk, d, dv, deterministic=True, device=device, **bat.alloc)
    return t, acc, fe.gqa_accumulator(hk, d, deterministic=True, **var.alloc)


def clone_problem(*trees):
    """Copies of problems, accumulators, outputs (clone keeps the strides of dense tensors)."""
    return pytree.tree_map_only(torch.Tensor, torch.clone, trees)


def assert_same(got, want, *context):
    """Every tensor of two pytrees (problems, accumulators, outputs) bitwise equal."""
    got, want = pytree.tree_leaves_with_path(got), pytree.tree_leaves(want)
    assert len(got) == len(want)
    for (path, a), b in zip(got, want):
        assert (a is None and b is None) or same(a, b), (pytree.keystr(path), *context)


def problem_args(t, acc):
    """every_op's arguments: the tensors (the semaphores apart: no input is passed twice), the accumulators."""
    return {k: v for k, v in t.items() if k != "sem"}, acc.dk_accum, acc.dv_accum, t["sem"]


class Module(torch.nn.Module):
    """fn as a module (torch.export takes modules)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def stores(api, t):
    """store batched and varlen, store_zero with selections and a row range, through `api` (the ops or fe); returns
    sums of what they wrote."""
    api.store(t["ak"], t["av"], t["dk"], t["dv"], seqused=t["used"])
    api.store(t["vak"], t["vav"], t["vdk"], t["vdv"], cu_seqlens=t["cu"], seqused=t["vused"])
    api.store_zero(t["vdk"], t["vdv"], cu_seqlens=t["cu"], seqused=t["vused"], batch_idx=t["bidx"],
                   head_idx=t["hidx"], row_start=3, row_end=60)
    api.store_zero(t["dk"], t["dv"], seqused=t["used"], batch_idx=t["bidx"], row_start=140)
    return t["dk"].float().sum(), t["vdk"].float().sum()


def every_op(t, dk_accum, dv_accum, semaphores):
    """Every op through torch.ops.flash_epilogue.* (no Python wrapper) on make_problem's tensors."""
    stores(OPS, t)
    dk_accum.zero_()
    dv_accum.zero_()
    OPS.gqa_accumulate(t["pk"], t["pv"], dk_accum, dv_accum, semaphores, deterministic=True)
    OPS.gqa_accumulate(t["pk"] * 0.5, t["pv"], dk_accum, dv_accum, semaphores, seqused=t["used"], deterministic=True)
    OPS.gqa_postprocess(dk_accum, dv_accum, t["ok"], t["ov"], scale_dk=0.125, scale_dv=3.0)
    OPS.gqa_accum_to_dense(dk_accum, t["dense"], head_dim=max(t["ok"].shape[-1], t["ov"].shape[-1]))
    OPS.gqa_reduce(t["rpk"], t["rpv"], t["rk"], t["rv"], cu_seqlens=t["cu"], seqused=t["vused"], scale_dk=0.25)
    y = OPS.repeat_kv(t["x"], 3, 1)
    # exact elementwise results (a reduction's order could differ)
    return t["dense"] * 2, t["ok"].float(), y, OPS.repeat_kv_backward(y * 2, 3, 1, [0, 2, 1])


VARLEN = {"cu_seqlens": "cu", "seqused": "vused"}
# {case: (positional, keyword arguments)}: every mutating op (the case up to "-") on autograd_problem's tensors (keys
# of it) and values, each tensor argument of each schema given at least once
CALLS = {
    "store": (("ak", "av", "dk", "dv"), {"seqused": "used"}),
    "store_zero": (("vdk", "vdv"), VARLEN),
    "gqa_accumulate": (("pk", "pv", "acck", "accv", "sem"), {"deterministic": True}),
    "gqa_accumulate-nondet": (("pk", "pv", "acck", "accv", None), {}),
    "gqa_postprocess": (("acck", "accv", "ok", "ov"), {"scale_dk": 0.125}),
    "gqa_accum_to_dense": (("acck", "dense"), {"head_dim": 128}),
    "gqa_reduce": (("rpk", "rpv", "rk", "rv"), VARLEN),
    "gqa_reduce-dk": (("rpk", None, "rk", None), {"cu_seqlens": "cu"}),
    "store-varlen": (("vak", "vav", "vdk", "vdv"), VARLEN),
    "store_zero-indices": (("vdk", "vdv"), {**VARLEN, "batch_idx": "bidx", "head_idx": "hidx"}),
    "gqa_accumulate-seqused": (("pk", "pv", "acck", "accv", "sem"), {"seqused": "used", "deterministic": True}),
    "gqa_postprocess-seqused": (("acck", "accv", "ok", "ov"), {"seqused": "used"}),
}


def autograd_problem(device):
    """make_problem's tensors, the accumulator's among them as acck/accv/sem."""
    t, acc, _ = make_problem(device)
    return t | {"acck": acc.dk_accum, "accv": acc.dv_accum}


def op_call(case, t):
    """CALLS[case] on t: the op, its arguments by name, and {key of t: argument} of those it writes (as its schema
    marks them) and of its other float tensor arguments."""
    op = getattr(OPS, case.split("-")[0])
    schema = op.default._schema.arguments
    names = dict(zip((a.name for a in schema), CALLS[case][0])) | CALLS[case][1]  # argument: key of t, or its value
    written = {names[a.name]: a.name for a in schema if a.alias_info and a.alias_info.is_write and names.get(a.name)}
    read = {k: a for a, k in names.items() if isinstance(k, str) and k not in written and t[k].is_floating_point()}
    return op, {a: t[k] if isinstance(k, str) else k for a, k in names.items()}, written, read


# ---- the bad-input tests' baseline problem (test_bad_inputs.py, test_bad_inputs_calls.py)

B, S, H_K, H_Q, D, TOTAL = 2, 40, 2, 4, 64, 80  # batched (B, S); varlen: cu_seqlens [0, 30, 80]
DKV, INPUT = ("dk", "dv"), fe.FlashEpilogueInputError


def z(d, *shape, dtype=F32):
    return torch.zeros(shape, dtype=dtype, device=d)


def i32(d, *vals):
    return int32(*vals, device=d)


def accumulator(d, deterministic=True, varlen=False, h_k=H_K, hd=D, **kw):
    layout = {"cu_seqlens": i32(d, 0, 30, TOTAL), "total_tokens": TOTAL} if varlen else {"batch": B, "seqlen": S}
    return fe.gqa_accumulator(h_k, hd, deterministic=deterministic, device=d, **{**layout, **kw})


def dense(d, *names, varlen=False, **more):
    """The baseline's zeros: bf16 dk, dv; fp32 accumulators; fp32 partials of the H_Q query heads; cu_seqlens; more."""
    lead = (TOTAL,) if varlen else (B, S)
    out = {n: z(d, *lead, H_Q if "part" in n else H_K, D, dtype=BF16 if n in DKV else F32) for n in names}
    return out | ({"cu_seqlens": i32(d, 0, 30, TOTAL)} if varlen else {}) | more


def sh(*dims):
    return re.escape(str(tuple(dims)))


def acc_shape(got, want=(2, 2, 1, 8192), h_k=2, d=64, c=64, a=90, of="batch 2, seqlen 40"):
    """The message for an accumulator of shape `got` where `want` (the baseline's by default) is expected."""
    return (rf"shape: expected {sh(*want)} \(the accumulator of {of}, {h_k} KV heads and head dim {d} in the tile of "
            rf"head dim {c} on the sm_{a} path: allocate it with flash_epilogue\.gqa_accumulator\), got {sh(*got)}")


def assert_healthy():
    """A valid store, gqa_reduce and deterministic accumulate + postprocess give bitwise-right results and the
    device synchronizes without a (sticky) error."""
    gen = generator(0)
    acc_k, acc_v, pk, pv = (rand(shape, gen) for shape in [(B, S, H_K, D)] * 2 + [(B, S, H_Q, D)] * 2)
    dk, dv, ok, ov = (torch.full((B, S, H_K, D), float("nan"), dtype=BF16, device="cuda") for _ in range(4))
    fe.store(acc_k, acc_v, dk, dv)
    rk = fe.gqa_reduce(pk, num_heads_kv=H_K, out_dtype=BF16)
    acc = accumulator("cuda")
    fe.gqa_accumulate(pk, pv, acc)
    fe.gqa_postprocess(acc, ok, ov)
    torch.cuda.synchronize()
    dense_k, dense_v = z("cuda", B, S, H_K, D), z("cuda", B, S, H_K, D)
    gqa_accumulate_reference(pk, pv, dense_k, dense_v, num_heads_kv=H_K)
    for got, want in zip((dk, dv, rk, ok, ov), (acc_k, acc_v, gqa_reduce_reference(
            pk, num_heads_kv=H_K, out_dtype=BF16, sequential=True), dense_k, dense_v)):
        assert torch.equal(bits(got), bits(want.to(BF16)))
