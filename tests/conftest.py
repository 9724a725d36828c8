"""Shared test setup: the GPU marker, and the buffer builders every test file uses.

Canary buffers: 16-bit ones hold CANARY_BITS, a NaN payload no conversion produces (an element the kernel
did not write keeps these bits); fp32 ones NaN (a read outside a view poisons the result). Outputs are views
carved out of such buffers and the WHOLE buffer is compared bitwise with the reference applied to a clone.
"""
import contextlib
import os
import shutil
import subprocess

import pytest
import torch

import flash_epilogue as fe

CANARY_BITS = 0x7FBF
DTYPES = (torch.bfloat16, torch.float16)
# the code paths: sm_90 (the H200's own) and the sm_80 path (`_arch=80`) on the same GPU
arch_param = pytest.mark.parametrize("arch", (90, 80), ids=("sm90", "sm80"))
LAYOUTS = ("plain", "padded", "transposed")


def _why_no_sm90_kernels() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if (cap := torch.cuda.get_device_capability()) != (9, 0):
        return f"needs sm_90, device is sm_{cap[0]}{cap[1]}"
    return "" if fe.kernels_available() else f"kernels not built: {fe.UNAVAILABLE_REASON}"


WHY_NOT = _why_no_sm90_kernels()
HAVE_SM90 = not WHY_NOT


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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAVE_SM90:
            item.add_marker(pytest.mark.skip(reason=WHY_NOT))
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


def bits(t):
    """The raw bits of t (same shape and strides), for bitwise comparisons (NaN payloads included)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def first_diff(got, want) -> str:
    idx = (bits(got) != bits(want)).nonzero()
    if idx.shape[0] == 0:
        return "equal"
    i = tuple(idx[0].tolist())
    return f"{idx.shape[0]} elements differ, first at {list(i)}: got {got[i].item()}, want {want[i].item()}"


def assert_bits(got, want, name=""):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert torch.equal(bits(got), bits(want)), f"{name}: {first_diff(got, want)}"


def generator(seed, device="cuda"):
    return torch.Generator(device=device).manual_seed(seed)


def rand(shape, gen=None, dtype=torch.float32, device="cuda", binades=8):
    """Normal samples times 2^e, e uniform in [-binades, binades]: the order of additions (and the
    rounding of large and tiny magnitudes) matters."""
    device = device if gen is None else gen.device
    x = torch.randn(shape, device=device, generator=gen)
    e = torch.randint(-binades, binades + 1, shape, device=device, generator=gen).float()
    return (x * torch.exp2(e)).to(dtype)


def canary(shape, dtype=torch.bfloat16, device="cuda"):
    """A buffer of the canary bits (16-bit dtypes) or of NaN (fp32)."""
    if dtype == torch.float32:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, CANARY_BITS, dtype=torch.int16, device=device).view(dtype)


def carve(shape, dtype, layout, device="cuda"):
    """(buffer, view): a canary buffer and a `shape` view into it. plain: the view is the buffer;
    padded: extra rows, heads, head-dim columns and batch slack around the view; transposed:
    heads-major storage seen as (b, s, h, d) / (total, h, d)."""
    d = shape[-1]
    if layout == "plain":
        buf = canary(shape, dtype, device)
        return buf, buf
    if len(shape) == 4:
        b, s, h, _ = shape
        if layout == "padded":
            buf = canary((b + 1, s + 3, h + 2, d + 16), dtype, device)
            return buf, buf[1:, 2 : s + 2, 1 : h + 1, 8 : d + 8]
        buf = canary((b, h + 1, s + 2, d + 8), dtype, device)
        return buf, buf[:, 1:, 1 : s + 1, :d].transpose(1, 2)
    t, h, _ = shape
    if layout == "padded":
        buf = canary((t + 5, h + 1, d + 8), dtype, device)
        return buf, buf[3 : t + 3, 1:, 8:]
    buf = canary((h, t + 4, d), dtype, device)
    return buf, buf[:, 2 : t + 2].transpose(0, 1)


def input_view(shape, layout, gen, dtype=torch.float32, binades=8):
    """An input of `shape` laid out per `layout` in a NaN/canary buffer (reads outside the view
    poison the result)."""
    _, view = carve(shape, dtype, layout, gen.device)
    view.copy_(rand(shape, gen, dtype, binades=binades))
    return view


def same_view(clone, view):
    """The view of `clone` (a copy of view's buffer) at view's offset and strides."""
    return clone.as_strided(view.shape, view.stride(), view.storage_offset())


def block_n(d, dv=None, arch=90):
    """kBlockN of the tile that serves head dims (d, dv) on the path `arch` (90, 80; 0 = 90 here)."""
    return fe.tile_config(d, dv, arch=80 if arch == 80 else 90).block_n


def int32(*vals, device="cuda"):
    return torch.tensor(vals, dtype=torch.int32, device=device)


def cu_seqlens(lens, device="cuda"):
    return torch.tensor([0] + list(lens), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


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
