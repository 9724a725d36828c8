"""Installing: a non-editable install ships the collectives' headers (the example kernel compiles against them) and
writes nothing into the source tree; a pure-Python one (FLASH_EPILOGUE_SKIP_CUDA_BUILD=1) imports, names why it has no
kernels and runs repeat_kv; a source distribution holds every source the build reads and nothing of a local build; a
build of one head dim (FLASH_EPILOGUE_HEAD_DIMS=64, a real compile run with the GPU suite) refuses another, naming it.
"""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import EXAMPLE, example_build, nvcc, run_checked

ROOT = Path(__file__).resolve().parent.parent
# an editable install of the checkout in this environment answers for flash_epilogue.* through its own finder
ONLY_SITE = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"


def install_and_run(site: Path, code: str, **env) -> str:
    """A non-editable install into `site` (env: the build's environment variables); then the stdout of `code` in a
    new process that imports the package installed there (not the checkout)."""
    run_checked([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--target",
                 str(site), str(ROOT)], env=dict(os.environ, **env), timeout=1800)
    # the rest of PYTHONPATH may hold the dependencies (the cutlass wheel); the checkout itself is left out
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    return run_checked([sys.executable, "-c", ONLY_SITE + code], cwd=site.parent, timeout=600, env=dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(site), *rest]), FLASH_EPILOGUE_DISABLE_KERNELS="0")).stdout


def source_tree_state() -> str:
    """Every path git sees in the checkout, ignored ones included, but setuptools' own build/ and egg-info."""
    out = run_checked(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT).stdout
    return "\n".join(sorted(line for line in out.splitlines() if not any(
        part in line for part in ("build/", ".egg-info", "__pycache__", ".pytest_cache"))))


def test_pure_python_install_ships_the_headers(tmp_path):
    before = source_tree_state()
    out = install_and_run(tmp_path / "site", """
import os, torch, flash_epilogue as fe
assert fe.__file__.startswith(os.path.abspath("site")), fe.__file__
ours = fe.get_include()[0]
assert ours.startswith(os.path.abspath("site"))
assert os.path.isfile(os.path.join(ours, "flash_epilogue", "epilogue_bwd.h"))
assert all(os.path.isdir(d) for d in fe.get_include())
assert not fe.kernels_available() and "FLASH_EPILOGUE_SKIP_CUDA_BUILD" in fe.UNAVAILABLE_REASON
x = torch.randn(2, 2, 5, 8, requires_grad=True)
y = fe.repeat_kv(x, 3)
assert torch.equal(y, x.repeat_interleave(3, 1))
assert torch.equal(torch.autograd.grad(y, x, y)[0], fe.reference.group_sum_reference(y.detach(), 3))
try:  # the ops exist (the schemas ship with the package) and say why they cannot run
    torch.ops.flash_epilogue.store(x, x, x, x)
except fe.FlashEpilogueBuildError as e:
    print("OPS", e)
print("INCLUDE", *fe.get_include())
""", FLASH_EPILOGUE_SKIP_CUDA_BUILD="1")
    assert "OPS flash_epilogue.store: the CUDA kernels are not available" in out, out
    assert source_tree_state() == before, "the install wrote into the source tree"
    if nvcc():  # the example kernel compiles against the installed headers with the README's flags, warning-free
        built = run_checked([nvcc(), *example_build().NVCC_FLAGS, "-c", str(EXAMPLE / "epilogue_example.cu"), "-o",
                             str(tmp_path / "kernel.o"), *[f"-I{d}" for d in out.split("INCLUDE ", 1)[1].split()]],
                            timeout=600)
        assert not built.stderr.strip() and not built.stdout.strip(), built.stderr[-3000:]


def test_a_source_distribution_holds_what_the_build_reads(tmp_path):
    # from a copy of the checkout's files: setuptools would otherwise reuse a local egg-info's file list
    # (a file deleted but not yet committed is neither copied nor needed)
    files = [f for f in run_checked(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT).stdout.split()
             if (ROOT / f).is_file()]
    tree = tmp_path / "tree"
    for f in files:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tree / f)
    run_checked([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)], cwd=tree, timeout=600,
                env=dict(os.environ, FLASH_EPILOGUE_SKIP_CUDA_BUILD="1"))
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    needed = [f for f in files if f.startswith(("csrc/", "flash_epilogue/", "scripts/generate_instantiations"))]
    assert needed and not set(needed) - names, sorted(set(needed) - names)[:10]
    assert not [n for n in names if n.endswith((".so", ".pyc", "_build_info.py"))]  # nothing of a local build


@pytest.mark.gpu  # a real build: run where the GPU suite runs (a many-core machine)
@pytest.mark.slow
@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
def test_a_build_of_one_head_dim_names_the_knobs(tmp_path):
    install_and_run(tmp_path / "site", """
import re, pytest, torch, flash_epilogue as fe
from flash_epilogue.ops import _store
assert fe.kernels_available(), fe.UNAVAILABLE_REASON
assert fe.COMPILED_HEAD_DIMS == (64,)
assert fe.tile_config(40).head_dim == 64
a, o = torch.zeros(1, 8, 2, 128), torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
for call in (lambda: fe.tile_config(128), lambda: fe.store(a, a, o, o.clone())):
    with pytest.raises(fe.FlashEpilogueInputError, match=re.escape(
            "128 runs on the tile of head dim 128, which this build leaves out (FLASH_EPILOGUE_HEAD_DIMS=64)")):
        call()
x = torch.randn(1, 2, 8, 128, device="cuda" if torch.cuda.is_available() else "cpu", requires_grad=True)
y = fe.repeat_kv(x, 2)  # the backward falls back to plain ATen where no kernel is built
assert torch.equal(torch.autograd.grad(y, x, y)[0], fe.reference.group_sum_reference(y.detach(), 2))
if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
    a = torch.randn(1, 300, 2, 64, device="cuda")
    o = torch.empty(1, 300, 2, 64, dtype=torch.bfloat16, device="cuda")
    fe.store(a, a, o, o.clone())
    assert torch.equal(o, a.bfloat16())
    # the default build leaves the sm_80 path out, and says how to build it
    assert fe._extension._C.build_info()["code_paths"] == [90]
    with pytest.raises(fe.FlashEpilogueInputError, match=re.escape(
            "_arch: expected 0 or 90: this build has no sm_80 code path (FLASH_EPILOGUE_SM80_PATH=1 builds it), "
            "got 80")):
        _store(a, a, o, o.clone(), _arch=80)
""", FLASH_EPILOGUE_HEAD_DIMS="64", FLASH_EPILOGUE_SM80_PATH="",
       CUDA_HOME=os.environ.get("CUDA_HOME", "/usr/local/cuda"))


def setup_py(**env) -> subprocess.CompletedProcess:
    """`python setup.py --version` under env: the knobs are read (and the toolkit found) before anything is built."""
    return subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=300)


ON_OFF = "expected 1, true, yes or on (set), or 0, false, no, off or empty (unset)"
ARCH_LIST = "expected ';'-separated archs of 80, 86, 89, 90a (TORCH_CUDA_ARCH_LIST: 8.0, 8.6, 8.9, 9.0 or 9.0a), got "
NO_TOOLKIT = "CUDA_HOME=/nonexistent: no CUDA toolkit there (bin/nvcc and include/cuda_runtime_api.h): point CUDA_HOME"


@pytest.mark.parametrize("env, message", [
    ({"FLASH_EPILOGUE_SKIP_CUDA_BUILD": "maybe"}, "FLASH_EPILOGUE_SKIP_CUDA_BUILD='maybe': " + ON_OFF),
    ({"FLASH_EPILOGUE_CUDA_ARCHS": "90a;xyz"}, "FLASH_EPILOGUE_CUDA_ARCHS='90a;xyz': " + ARCH_LIST + "xyz"),
    ({"FLASH_EPILOGUE_CUDA_ARCHS": "", "TORCH_CUDA_ARCH_LIST": "9.0;7.5"},
     "TORCH_CUDA_ARCH_LIST='9.0;7.5': " + ARCH_LIST + "75"),
    ({"FLASH_EPILOGUE_CUDA_ARCHS": "80"}, "FLASH_EPILOGUE_CUDA_ARCHS='80': flash_epilogue's kernels need sm_90a"),
    ({"FLASH_EPILOGUE_SM80_PATH": "maybe"}, "FLASH_EPILOGUE_SM80_PATH='maybe': " + ON_OFF + ", or auto"),
    # an sm_8x GPU runs the sm_80 path: it cannot be left out of a build for one
    ({"FLASH_EPILOGUE_SM80_PATH": "off", "FLASH_EPILOGUE_CUDA_ARCHS": "90a;86"},
     "FLASH_EPILOGUE_SM80_PATH='off' beside sm_86 in the archs: those GPUs run the sm_80 path"),
    ({"CUDA_HOME": "/nonexistent"}, NO_TOOLKIT),
    # "false" builds: it goes on to look for the toolkit
    ({"FLASH_EPILOGUE_SKIP_CUDA_BUILD": "false", "CUDA_HOME": "/nonexistent"}, NO_TOOLKIT)])
def test_build_knobs_are_refused_listing_what_is_accepted(env, message):
    out = setup_py(**{"FLASH_EPILOGUE_SKIP_CUDA_BUILD": "", "FLASH_EPILOGUE_CUDA_ARCHS": "",
                      "FLASH_EPILOGUE_SM80_PATH": "", **env})
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("skip", ["1", "true", "YES", "on"])
def test_skip_knob_spellings_skip_the_build(skip):
    out = setup_py(FLASH_EPILOGUE_SKIP_CUDA_BUILD=skip, CUDA_HOME="/nonexistent")  # no toolkit looked for
    assert out.returncode == 0, out.stderr[-2000:]


def test_both_arch_spellings_of_sm90a_agree():
    import torch

    if not torch.version.cuda or not nvcc():
        pytest.skip("needs a CUDA build of torch and nvcc (the build's checks run before --version answers)")
    for env in ({"FLASH_EPILOGUE_CUDA_ARCHS": "90"}, {"FLASH_EPILOGUE_CUDA_ARCHS": "90a;80"},
                {"FLASH_EPILOGUE_CUDA_ARCHS": "", "TORCH_CUDA_ARCH_LIST": "9.0"},
                {"FLASH_EPILOGUE_CUDA_ARCHS": "", "TORCH_CUDA_ARCH_LIST": "9.0a+PTX 8.0"}):
        out = setup_py(FLASH_EPILOGUE_SKIP_CUDA_BUILD="", **env)
        assert out.returncode == 0, (env, out.stderr[-2000:])
