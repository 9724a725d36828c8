"""CPU (CI) test: the sm_80 code path compiles to real sm_80 machine code with no breakpoint or trap.

CUTLASS's NamedBarrier and the sm_90-only copy atoms compile to a breakpoint below sm_90; the sm_80
collectives use the project's own bar.sync/bar.arrive and plain copies, so their SASS must hold
none. The sm_90 kernels, built into an sm_80 binary by FLASH_EPILOGUE_CUDA_ARCHS="80;90a", must
compile there too (to empty bodies: they are never launched on sm_80).
"""
import os
import shutil
from pathlib import Path

import pytest

from conftest import nvcc, run_checked
from flash_epilogue._cutlass import cutlass_include_dirs

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(nvcc() is None, reason="no nvcc")


def _cuobjdump():
    try:
        import nvidia  # the nvidia-cuda-cuobjdump wheel: nvidia/cu13/bin/cuobjdump
        wheel = next((str(c) for base in nvidia.__path__ for c in Path(base).glob("cu*/bin/cuobjdump")), None)
    except ImportError:
        wheel = None
    return shutil.which("cuobjdump") or wheel


@pytest.mark.parametrize("source", ["store_hdim128_sm80.cu", "store_zero_hdim64_sm90.cu"])
def test_compiles_to_sm80_code_with_no_breakpoint(tmp_path, source):
    cubin = tmp_path / "out.cubin"
    includes = [f"-I{d}" for d in (ROOT / "csrc/include", ROOT / "csrc/kernels", *cutlass_include_dirs())]
    run_checked([nvcc(), "-std=c++20", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-cubin", "-o", str(cubin),
                 "-gencode=arch=compute_80,code=sm_80", *includes, str(ROOT / "csrc/instantiations" / source)])
    if source.endswith("_sm90.cu"):
        return  # the sm_90 kernels: compiling (to empty bodies) is the check, they never launch on sm_80
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # it runs nvdisasm
    sass = run_checked([tool, "-sass", str(cubin)], env=env).stdout
    assert "Function" in sass and "BAR.SYNC" in sass, "expected the store kernel and its named barriers"
    for bad in ("BPT", "BRKPT", "TRAP"):
        assert bad not in sass, f"sm_80 store kernel contains {bad}"
