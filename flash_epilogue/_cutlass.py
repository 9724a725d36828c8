"""Where the CUTLASS/CuTe headers come from. No CUTLASS code is vendored in this repository.

Default: the `nvidia-cutlass` wheel (pinned 4.2.0.0), which ships the headers under
`cutlass_library/source/include`. Override with FLASH_EPILOGUE_CUTLASS_DIR (or CUTLASS_PATH)
pointing at a CUTLASS checkout, whose headers are in include/.
"""
from __future__ import annotations

import os
from pathlib import Path

CUTLASS_WHEEL = "nvidia-cutlass==4.2.0.0"


def cutlass_root() -> Path:
    override = os.environ.get("FLASH_EPILOGUE_CUTLASS_DIR") or os.environ.get("CUTLASS_PATH")
    if override:
        root = Path(override).expanduser().resolve()
    else:
        try:
            import cutlass_library
        except ImportError as e:
            raise RuntimeError(
                f"CUTLASS headers not found: `pip install --no-deps {CUTLASS_WHEEL}` "
                "or set FLASH_EPILOGUE_CUTLASS_DIR to a CUTLASS checkout"
            ) from e
        root = Path(cutlass_library.__file__).resolve().parent / "source"
    if not (root / "include" / "cute" / "tensor.hpp").is_file():
        raise RuntimeError(f"no CUTLASS headers (include/cute/tensor.hpp) under {root}")
    return root


def cutlass_include_dirs() -> list[str]:
    root = cutlass_root()
    return [str(root / "include"), str(root / "tools" / "util" / "include")]
