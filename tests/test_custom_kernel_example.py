"""examples/custom_kernel: a user's own extension that includes the collective. CI compiles it
(CPU); on an sm_90 GPU it is built with torch's JIT loader and must give `.to(bf16)` bitwise."""
import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch

import flash_epilogue
from conftest import HAVE_SM90, nvcc

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_kernel"
# examples/custom_kernel/build.py, loaded by path: a pip package named `build` would shadow an import by name
_spec = importlib.util.spec_from_file_location("custom_kernel_build", EXAMPLE / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
@pytest.mark.skipif(torch.version.cuda is None, reason="the binding needs a CUDA build of torch (its c10/cuda headers)")
@pytest.mark.skipif(HAVE_SM90, reason="test_example_runs builds and runs it here")
def test_example_compiles(tmp_path):
    # both sources at once, as the JIT loader's ninja does: the kernel with nvcc and no torch
    # include path (the .cu must not need torch), the binding as host-only C++
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    assert set(build.SOURCES) == {"epilogue_example.cu", "example_binding.cpp"}
    kernel = [nvcc(), *build.NVCC_FLAGS, "-c", str(EXAMPLE / "epilogue_example.cu"), "-o", str(tmp_path / "kernel.o"),
              *[f"-I{d}" for d in flash_epilogue.get_include()]]
    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    # nvcc as the host compiler's driver: it adds CUDA's own include directory (cuda_runtime.h),
    # wherever CUDA_HOME points or not
    binding = [nvcc(), "-x", "c++", "-std=c++20", "-DTORCH_EXTENSION_NAME=example", "-DTORCH_API_INCLUDE_EXTENSION_H",
               "-c", str(EXAMPLE / "example_binding.cpp"), "-o", str(tmp_path / "binding.o"),
               *[f"-I{d}" for d in includes]]
    running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for cmd in (kernel, binding)]
    for name, proc in zip(("epilogue_example.cu", "example_binding.cpp"), running):
        _, err = proc.communicate()
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"


@pytest.mark.gpu
def test_example_runs():
    ext = build.load()
    acc_k = torch.randn(1000, 3, 128, device="cuda")
    acc_v = torch.randn_like(acc_k)
    dk, dv = torch.empty_like(acc_k, dtype=torch.bfloat16), torch.empty_like(acc_k, dtype=torch.bfloat16)
    ext.run(acc_k, acc_v, dk, dv)
    torch.cuda.synchronize()
    assert torch.equal(dk.view(torch.int16), acc_k.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(dv.view(torch.int16), acc_v.to(torch.bfloat16).view(torch.int16))
