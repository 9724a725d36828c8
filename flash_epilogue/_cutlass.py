"""Our C++ headers (get_include) and CUTLASS/CuTe's (none vendored): the pinned `nvidia-cutlass` wheel, or the CUTLASS
checkout that FLASH_EPILOGUE_CUTLASS_DIR (or CUTLASS_PATH) names. setup.py loads this file by path."""
import os
from pathlib import Path

CUTLASS_WHEEL = "nvidia-cutlass==4.2.0.0"


def cutlass_include_dirs() -> list[str]:
    override = os.environ.get("FLASH_EPILOGUE_CUTLASS_DIR") or os.environ.get("CUTLASS_PATH")
    if override:
        root = Path(override).expanduser().resolve()
    else:
        try:
            import cutlass_library
        except ImportError as e:
            raise RuntimeError(f"CUTLASS headers not found: `pip install --no-deps {CUTLASS_WHEEL}` "
                               "or set FLASH_EPILOGUE_CUTLASS_DIR to a CUTLASS checkout") from e
        root = Path(cutlass_library.__file__).resolve().parent / "source"
    if not (root / "include" / "cute" / "tensor.hpp").is_file():
        raise RuntimeError(f"no CUTLASS headers (include/cute/tensor.hpp) under {root}")
    return [str(root / "include"), str(root / "tools" / "util" / "include")]


def get_include() -> list[str]:
    """Include dirs for a C++/CUDA extension that uses the collectives: ours, then CUTLASS's."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = os.path.join(os.path.dirname(here), "csrc", "include")  # source checkout / editable install
    if not os.path.isdir(ours):
        ours = os.path.join(here, "include")  # installed: shipped inside the package
    return [ours, *cutlass_include_dirs()]
