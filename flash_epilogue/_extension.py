"""Loads flash_epilogue._C (the kernels, the op schemas) or records why not (a build for another torch is named from
_build_info.py before it fails to load), and turns the ops' errors into the package's."""
import importlib
import os

import torch

from .errors import FlashEpilogueBuildError, FlashEpilogueInputError, FlashEpilogueTypeError, fail

try:
    from . import _build_info
except ImportError:  # a source checkout that was never built
    _build_info = None


def _load():
    """(_C, None) or (None, the reason it is unavailable)."""
    if os.environ.get("FLASH_EPILOGUE_DISABLE_KERNELS", "0") not in ("", "0"):
        return None, "disabled by FLASH_EPILOGUE_DISABLE_KERNELS"
    if _build_info is None:
        return None, ("flash_epilogue has no built extension (a pure-Python install, FLASH_EPILOGUE_SKIP_CUDA_BUILD=1, "
                      "or a source checkout never built): build it with `pip install --no-build-isolation .` "
                      "(or `-e .`) in the repository")
    built, running = _build_info.TORCH_VERSION, torch.__version__
    if built != running:
        return None, (f"flash_epilogue was built against torch {built} but torch {running} is running; "
                      "rebuild it: `pip install --no-build-isolation --force-reinstall --no-deps .`")
    try:
        return importlib.import_module(f"{__package__}._C"), None
    except ImportError as e:
        return None, f"the extension flash_epilogue._C failed to load: {e}"


_C, UNAVAILABLE_REASON = _load()

# Read once: a constant that torch.compile can trace (calling into _C would break the graph).
_COMPILED_ARCHS: tuple[str, ...] = tuple(_C.compiled_archs()) if _C is not None else ()


def compiled_archs() -> tuple[str, ...]:
    return _COMPILED_ARCHS


def unavailable(op: str) -> FlashEpilogueBuildError:
    reason = UNAVAILABLE_REASON or "the loaded flash_epilogue._C does not define it (a stale build: rebuild it)"
    return FlashEpilogueBuildError(f"flash_epilogue.{op}: the CUDA kernels are not available: {reason}")


def require(op: str):
    """_C, or FlashEpilogueBuildError for `op`."""
    if _C is None:
        raise unavailable(op)
    return _C


def check_tensor_types(op: str, args: tuple, kwargs: dict) -> None:
    """After a call failed: the package's TypeError where the dispatcher refused it before the op's checker saw it (a
    Tensor argument of the schema given another type, or every Tensor argument None: no device to dispatch by)."""
    schema = getattr(torch.ops.flash_epilogue, op).default._schema
    given = dict(zip((a.name for a in schema.arguments), args)) | kwargs
    tensors = [(a.name, given[a.name]) for a in schema.arguments
               if str(a.type) in ("Tensor", "Optional[Tensor]") and a.name in given]
    for name, v in tensors:
        if v is not None and not isinstance(v, torch.Tensor):
            fail(op, name, "a torch.Tensor", type(v).__name__, FlashEpilogueTypeError)
    if not any(isinstance(v, torch.Tensor) for _, v in tensors):
        raise FlashEpilogueTypeError(f"flash_epilogue.{op}: expected torch.Tensor arguments, got None for all of them")


def op_error(op: str, e: Exception) -> Exception:
    """What a wrapper raises (from None) for the error `e` of torch.ops.flash_epilogue.<op>: the C++ checker's
    TypeError / ValueError as the package's, by type."""
    if isinstance(e, TypeError):
        return FlashEpilogueTypeError(str(e))
    if isinstance(e, ValueError):
        return FlashEpilogueInputError(str(e))
    if isinstance(e, AttributeError) and not hasattr(torch.ops.flash_epilogue, op):
        return unavailable(op)
    return e
