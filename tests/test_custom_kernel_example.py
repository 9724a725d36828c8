"""examples/custom_kernel: a user's own extension that includes the collective. CI compiles it
(CPU); on an sm_90 GPU it is built with torch's JIT loader and must give `.to(bf16)` bitwise."""
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import include_paths

import flash_epilogue as fe
from conftest import EXAMPLE, HAVE_SM90, example_build, nvcc, run_checked
from flash_epilogue.testing import same

build = example_build()  # examples/custom_kernel/build.py


@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
@pytest.mark.skipif(torch.version.cuda is None, reason="the binding needs a CUDA build of torch (its c10/cuda headers)")
@pytest.mark.skipif(HAVE_SM90, reason="test_example_runs builds and runs it here")
def test_example_compiles(tmp_path):
    # the binding as host-only C++, as the JIT loader's ninja builds it; the kernel (nvcc, no torch include path:
    # the .cu must not need torch) test_install compiles against the installed headers, copies of the checkout's
    assert set(build.SOURCES) == {"epilogue_example.cu", "example_binding.cpp"}
    # nvcc drives the host compiler: it adds CUDA's own include directory (cuda_runtime.h) wherever CUDA_HOME points
    run_checked([nvcc(), "-x", "c++", "-std=c++20", "-DTORCH_EXTENSION_NAME=example", "-DTORCH_API_INCLUDE_EXTENSION_H",
                 "-c", str(EXAMPLE / "example_binding.cpp"), "-o", str(tmp_path / "binding.o"),
                 *[f"-I{d}" for d in (*include_paths(), sysconfig.get_paths()["include"])]])


@pytest.mark.skipif(nvcc() is None or shutil.which("cmake") is None, reason="needs nvcc and cmake")
def test_example_kernel_builds_with_cmake(tmp_path):
    # the README's CMake line, from another directory, with this Python's flash_epilogue: no warning
    build_dir = tmp_path / "build"
    # the package this test imports, installed or not (a checkout built in place is importable from its root only)
    path = os.pathsep.join([str(Path(fe.__file__).parent.parent), os.environ.get("PYTHONPATH", "")])
    configure = run_checked(["cmake", "-S", str(EXAMPLE), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                             f"-DPython3_EXECUTABLE={sys.executable}", f"-DCMAKE_CUDA_COMPILER={nvcc()}"],
                            cwd=tmp_path, timeout=600, env=dict(os.environ, PYTHONPATH=path))
    built = run_checked(["cmake", "--build", str(build_dir)], cwd=tmp_path, timeout=900)
    assert (build_dir / "libepilogue_example.a").is_file()
    assert "warning" not in (configure.stderr + built.stdout + built.stderr).lower(), built.stdout[-3000:]


@pytest.mark.gpu
def test_example_runs():
    ext = build.load()
    acc_k = torch.randn(1000, 3, 128, device="cuda")
    acc_v = torch.randn_like(acc_k)
    dk, dv = torch.empty_like(acc_k, dtype=torch.bfloat16), torch.empty_like(acc_k, dtype=torch.bfloat16)
    ext.run(acc_k, acc_v, dk, dv)
    torch.cuda.synchronize()
    assert same(dk, acc_k.to(torch.bfloat16)) and same(dv, acc_v.to(torch.bfloat16))
