"""The CUDA toolkit a build uses, found as torch users expect. setup.py loads this file by path (the package needs the
build to import); the example's JIT build imports it. No torch: it must run before torch's cpp_extension reads
CUDA_HOME."""
import os
import shutil
from pathlib import Path


def _is_toolkit(home: Path) -> bool:
    return (home / "bin" / "nvcc").is_file() and (home / "include" / "cuda_runtime_api.h").is_file()


def cuda_home() -> Path:
    """CUDA_HOME, else the toolkit of the nvcc on PATH where its headers are (a wrapper script's directory has none),
    else /usr/local/cuda; set into CUDA_HOME for torch's cpp_extension. RuntimeError naming CUDA_HOME if none."""
    if os.environ.get("CUDA_HOME"):
        home = Path(os.environ["CUDA_HOME"])
        if not _is_toolkit(home):
            raise RuntimeError(f"CUDA_HOME={home}: no CUDA toolkit there (bin/nvcc and include/cuda_runtime_api.h): "
                               "point CUDA_HOME at one, or set FLASH_EPILOGUE_SKIP_CUDA_BUILD=1 for the pure-Python "
                               "install")
        return home
    nvcc = shutil.which("nvcc")
    for home in ([Path(os.path.realpath(nvcc)).parent.parent] if nvcc else []) + [Path("/usr/local/cuda")]:
        if _is_toolkit(home):
            os.environ["CUDA_HOME"] = str(home)
            return home
    raise RuntimeError("flash_epilogue: no CUDA toolkit found (none in CUDA_HOME, beside the nvcc on PATH or in "
                       "/usr/local/cuda): set CUDA_HOME to one, or FLASH_EPILOGUE_SKIP_CUDA_BUILD=1 for the "
                       "pure-Python install")
