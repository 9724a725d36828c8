"""Loads flash_epilogue._C (the CUDA kernels) or records why it is unavailable.

A build made against another torch than the running one fails to load with an undefined
symbol; the versions recorded at build time (_build_info.py) let us say so by name first.
"""
from __future__ import annotations

import os

import torch

_C = None
UNAVAILABLE_REASON: str | None = None

try:
    from . import _build_info
except ImportError:  # a source checkout that was never built
    _build_info = None


def _load():
    global _C, UNAVAILABLE_REASON
    if os.environ.get("FLASH_EPILOGUE_DISABLE_KERNELS", "0") not in ("", "0"):
        UNAVAILABLE_REASON = "disabled by FLASH_EPILOGUE_DISABLE_KERNELS"
        return
    if _build_info is None:
        UNAVAILABLE_REASON = ("flash_epilogue was not built: run `pip install --no-build-isolation .` "
                              "(or `-e .`) in the repository")
        return
    if not _build_info.CUDA_KERNELS:
        UNAVAILABLE_REASON = ("this install was built with FLASH_EPILOGUE_SKIP_CUDA_BUILD=1 (reference only); "
                              "reinstall without it: `pip install --no-build-isolation .`")
        return
    built, running = _build_info.TORCH_VERSION, torch.__version__
    if built != running:
        UNAVAILABLE_REASON = (f"flash_epilogue was built against torch {built} but torch {running} is running; "
                              "rebuild it: `pip install --no-build-isolation --force-reinstall --no-deps .`")
        return
    try:
        from . import _C as ext
    except ImportError as e:
        UNAVAILABLE_REASON = f"the extension flash_epilogue._C failed to load: {e}"
        return
    _C = ext


_load()
if _C is None:
    from ._schemas import define_fallback_ops

    define_fallback_ops(UNAVAILABLE_REASON)


# Read once: a constant that torch.compile can trace (calling into _C would break the graph).
_COMPILED_ARCHS: tuple[str, ...] = tuple(_C.compiled_archs()) if _C is not None else ()


def compiled_archs() -> tuple[str, ...]:
    return _COMPILED_ARCHS if _C is not None else ()
