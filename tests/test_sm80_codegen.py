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

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(nvcc() is None, reason="no nvcc")


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia  # the nvidia-cuda-cuobjdump wheel: nvidia/cu13/bin/cuobjdump
    except ImportError:
        return None
    return next((str(c) for base in nvidia.__path__ for c in Path(base).glob("cu*/bin/cuobjdump")), None)


def compile_for_sm80(src: str, tmp_path: Path) -> Path:
    from flash_epilogue._cutlass import cutlass_include_dirs

    cubin = tmp_path / f"{Path(src).stem}.cubin"
    run_checked([nvcc(), "-std=c++20", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
                 "-gencode=arch=compute_80,code=sm_80", "-cubin", "-I", str(ROOT / "csrc/include"),
                 "-I", str(ROOT / "csrc/kernels"), *[f"-I{d}" for d in cutlass_include_dirs()], str(ROOT / src),
                 "-o", str(cubin)])
    return cubin


@pytest.mark.skipif(not _cuobjdump(), reason="no cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
def test_sm80_path_has_no_breakpoint(tmp_path):
    cubin = compile_for_sm80("csrc/instantiations/store_hdim128_sm80.cu", tmp_path)
    tool = _cuobjdump()
    env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # it runs nvdisasm
    sass = run_checked([tool, "-sass", str(cubin)], env=env).stdout
    assert "Function" in sass and "BAR.SYNC" in sass, "expected the store kernel and its named barriers"
    for bad in ("BPT", "BRKPT", "TRAP"):
        assert bad not in sass, f"sm_80 store kernel contains {bad}"


def test_sm90_kernels_compile_into_an_sm80_binary(tmp_path):
    compile_for_sm80("csrc/instantiations/store_zero_hdim64_sm90.cu", tmp_path)
