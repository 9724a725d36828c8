"""Build and load the example with torch's JIT extension loader: `load()` returns the extension, whose
`run(dk_accum, dv_accum, dk, dv)` writes dk/dv. As a script, from any directory (`python <path>/build.py`), it builds
the example and checks it once on an sm_90 GPU against `.to(torch.bfloat16)`, bit for bit."""
from __future__ import annotations

import os

import flash_epilogue

HERE = os.path.dirname(os.path.abspath(__file__))
# The kernel (nvcc, no torch headers) and the binding (the host compiler, torch): ninja builds them
# side by side, and nvcc never parses torch's headers.
SOURCES = ("epilogue_example.cu", "example_binding.cpp")
# C++17 is the least the collectives need; without --expt-relaxed-constexpr CuTe's constexpr calls warn.
NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]


def load(verbose: bool = False):
    from flash_epilogue._toolkit import cuda_home

    cuda_home()  # the toolkit into CUDA_HOME before torch's cpp_extension guesses it from nvcc's directory
    from torch.utils.cpp_extension import load as load_extension

    return load_extension(name="flash_epilogue_custom_kernel_example",
                          sources=[os.path.join(HERE, f) for f in SOURCES],
                          extra_include_paths=flash_epilogue.get_include(),
                          extra_cuda_cflags=NVCC_FLAGS, verbose=verbose)


if __name__ == "__main__":
    import torch

    ext = load()
    acc_k = torch.randn(1000, 4, 128, device="cuda")
    acc_v = torch.randn_like(acc_k)
    dk, dv = torch.empty_like(acc_k, dtype=torch.bfloat16), torch.empty_like(acc_k, dtype=torch.bfloat16)
    ext.run(acc_k, acc_v, dk, dv)
    assert torch.equal(dk, acc_k.to(torch.bfloat16)) and torch.equal(dv, acc_v.to(torch.bfloat16))
    print("the example's kernel wrote dk and dv bitwise equal to .to(torch.bfloat16)")
