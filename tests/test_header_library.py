"""The header library as a kernel embeds it, checked at compile time (CPU: runs wherever nvcc is, CI included):
tests/header_library/kernel_interface.cu static_asserts that each collective's TensorStorage adds nothing to an
aligned_struct-derived SharedStorage (CUTLASS's and FA3's layouts) and instantiates one kernel that switches
between the MHA and GQA collectives through the same members; fa3_interface.cu uses the FlashAttention-3
compatibility header as FA3's launch code and kernel do (scripts/fa3_check.py runs it inside FA3)."""
from pathlib import Path

import pytest

import flash_epilogue
from conftest import nvcc, run_checked

SOURCES = Path(__file__).resolve().parent / "header_library"


@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
@pytest.mark.parametrize("source", ["kernel_interface.cu", "fa3_interface.cu"])
def test_collectives_embed_in_a_kernel(tmp_path, source):
    run_checked([nvcc(), "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-c", str(SOURCES / source),
                 "-o", str(tmp_path / "out.o"), *[f"-I{d}" for d in flash_epilogue.get_include()]])
