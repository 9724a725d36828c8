"""The header library as a kernel embeds it, checked at compile time (CPU: runs wherever nvcc is, CI included):
tests/header_library/kernel_interface.cu static_asserts that each collective's TensorStorage adds nothing to an
aligned_struct-derived SharedStorage (CUTLASS's and FA3's layouts) and instantiates one kernel that switches
between the MHA and GQA collectives through the same members."""
import subprocess
from pathlib import Path

import pytest

import flash_epilogue
from conftest import nvcc

SOURCE = Path(__file__).resolve().parent / "header_library" / "kernel_interface.cu"


@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
def test_collectives_embed_in_a_kernel(tmp_path):
    cmd = [nvcc(), "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-c", str(SOURCE),
           "-o", str(tmp_path / "kernel_interface.o"), *[f"-I{d}" for d in flash_epilogue.get_include()]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
