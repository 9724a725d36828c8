"""Loads flash_epilogue._C (the CUDA kernels and the op schemas) or records why it is unavailable, and turns
the ops' errors into the package's.

A build made against another torch than the running one fails to load with an undefined symbol; the versions
recorded at build time (_build_info.py) let us say so by name first. Without _C no op is defined: the wrappers
raise FlashEpilogueBuildError naming UNAVAILABLE_REASON.
"""
from __future__ import annotations

import importlib
import os
import re

import torch

from .errors import FlashEpilogueBuildError, FlashEpilogueInputError, FlashEpilogueTypeError

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
        ext = importlib.import_module(f"{__package__}._C")
    except ImportError as e:
        UNAVAILABLE_REASON = f"the extension flash_epilogue._C failed to load: {e}"
        return
    _C = ext


_load()

# Read once: a constant that torch.compile can trace (calling into _C would break the graph).
_COMPILED_ARCHS: tuple[str, ...] = tuple(_C.compiled_archs()) if _C is not None else ()


def compiled_archs() -> tuple[str, ...]:
    return _COMPILED_ARCHS if _C is not None else ()


def unavailable(op: str) -> FlashEpilogueBuildError:
    reason = UNAVAILABLE_REASON or "the loaded flash_epilogue._C does not define it (a stale build: rebuild it)"
    return FlashEpilogueBuildError(f"flash_epilogue.{op}: the CUDA kernels are not available: {reason}")


def require(op: str):
    """_C, or FlashEpilogueBuildError for `op`."""
    if _C is None:
        raise unavailable(op)
    return _C


# The dispatcher's error for an argument of the wrong type (a list for a Tensor); other types are coerced
# by the wrappers before the call.
_SCHEMA_TYPE = re.compile(r"Expected a value of type '(?:Optional\[)?Tensor\]?' for argument '(\w+)' "
                          r"but instead found type '(\w+)'")


def op_error(op: str, e: Exception) -> Exception:
    """What a wrapper raises (from None) for the error `e` of torch.ops.flash_epilogue.<op>."""
    if isinstance(e, TypeError):
        return FlashEpilogueTypeError(str(e))
    if isinstance(e, ValueError):
        return FlashEpilogueInputError(str(e))
    if isinstance(e, AttributeError) and not hasattr(torch.ops.flash_epilogue, op):
        return unavailable(op)
    match = _SCHEMA_TYPE.search(str(e)) if type(e) is RuntimeError else None
    if match:
        return FlashEpilogueTypeError(f"flash_epilogue.{op}: {match[1]}: expected a torch.Tensor, got {match[2]}")
    return e
