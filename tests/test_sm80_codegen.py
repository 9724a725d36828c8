"""CPU (CI) test: the sm_80 code path compiles to real sm_80 machine code with no breakpoint or trap.

CUTLASS's NamedBarrier and the sm_90-only copy atoms compile to a breakpoint below sm_90; the sm_80
collectives use the project's own bar.sync/bar.arrive and plain copies, so their SASS must hold
none. The sm_90 kernels, built into an sm_80 binary by FLASH_EPILOGUE_CUDA_ARCHS="80;90a", must
compile there too (to empty bodies: they are never launched on sm_80).
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import nvcc

ROOT = Path(__file__).resolve().parent.parent


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia  # the nvidia-cuda-cuobjdump wheel: nvidia/cu13/bin/cuobjdump
    except ImportError:
        return None
    return next((str(c) for base in nvidia.__path__ for c in Path(base).glob("cu*/bin/cuobjdump")), None)


def _compile(src: str, out: Path, gencode: str) -> None:
    from flash_epilogue._cutlass import cutlass_include_dirs

    cmd = [nvcc(), "-std=c++20", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", f"-gencode={gencode}", "-cubin",
           "-I", str(ROOT / "csrc/include"), "-I", str(ROOT / "csrc/kernels"),
           *[f"-I{d}" for d in cutlass_include_dirs()], str(ROOT / src), "-o", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
@pytest.mark.skipif(_cuobjdump() is None,
                    reason="no cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
def test_sm80_path_has_no_breakpoint(tmp_path):
    cubin = tmp_path / "store_sm80.cubin"
    _compile("csrc/instantiations/store_hdim128_sm80.cu", cubin, "arch=compute_80,code=sm_80")
    tool = _cuobjdump()
    env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # it runs nvdisasm
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True, env=env).stdout
    assert "Function" in sass and "BAR.SYNC" in sass, "expected the store kernel and its named barriers"
    for bad in ("BPT", "BRKPT", "TRAP"):
        assert bad not in sass, f"sm_80 store kernel contains {bad}"


@pytest.mark.skipif(nvcc() is None, reason="no nvcc")
def test_sm90_kernels_compile_into_an_sm80_binary(tmp_path):
    _compile("csrc/instantiations/store_zero_hdim64_sm90.cu", tmp_path / "zero_sm90_for_sm80.cubin",
             "arch=compute_80,code=sm_80")
