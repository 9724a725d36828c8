"""Loads flash_epilogue._C or records why not (a build for another torch is named from _build_info.py before it fails
to load), and calls the ops as every wrapper does (call_op): the opt-in content checks (a host sync: never under
torch.compile or CUDA-graph capture), the op, its error as the package's, and FLASH_EPILOGUE_DEBUG's sync."""
import ast
import importlib
import os
from pathlib import Path

import torch

from .errors import FlashEpilogueBuildError, FlashEpilogueInputError, FlashEpilogueTypeError, fail

try:
    from . import _build_info
except ImportError:  # a source checkout that was never built
    _build_info = None

_C, UNAVAILABLE_REASON = None, None
if os.environ.get("FLASH_EPILOGUE_DISABLE_KERNELS", "0") not in ("", "0"):
    UNAVAILABLE_REASON = "disabled by FLASH_EPILOGUE_DISABLE_KERNELS"
elif _build_info is None:
    UNAVAILABLE_REASON = ("flash_epilogue has no built extension (a pure-Python install, "
                          "FLASH_EPILOGUE_SKIP_CUDA_BUILD=1, or a source checkout never built): build it with "
                          "`pip install --no-build-isolation .` (or `-e .`) in the repository")
elif _build_info.TORCH_VERSION != torch.__version__:
    UNAVAILABLE_REASON = (f"flash_epilogue was built against torch {_build_info.TORCH_VERSION} but torch "
                          f"{torch.__version__} is running; "
                          "rebuild it: `pip install --no-build-isolation --force-reinstall --no-deps .`")
else:
    try:
        _C = importlib.import_module(f"{__package__}._C")
    except ImportError as e:
        UNAVAILABLE_REASON = f"the extension flash_epilogue._C failed to load: {e}"

# Read once: a constant that torch.compile can trace (calling into _C would break the graph).
_COMPILED_ARCHS: tuple[str, ...] = tuple(_C.compiled_archs()) if _C is not None else ()


def compiled_archs() -> tuple[str, ...]:
    return _COMPILED_ARCHS


# The code paths the build has kernels of: 90, and 80 where it was built (FLASH_EPILOGUE_SM80_PATH; a build older than
# that knob has both); none without the extension.
_CODE_PATHS: tuple[int, ...] = tuple(_C.build_info().get("code_paths", (90, 80))) if _C is not None else ()


def code_paths() -> tuple[int, ...]:
    return _CODE_PATHS


def sm80_path_callable() -> bool:
    """Whether a workload (the tests, the sanitizer's) may ask for the sm_80 path (the ops' private `_arch=80`): where
    the build has it, or without the kernels, where no call launches and its checks are those of every build."""
    return _C is None or 80 in _CODE_PATHS


def unavailable(op: str) -> FlashEpilogueBuildError:
    reason = UNAVAILABLE_REASON or "the loaded flash_epilogue._C does not define it (a stale build: rebuild it)"
    return FlashEpilogueBuildError(f"flash_epilogue.{op}: the CUDA kernels are not available: {reason}. The ops run "
                                   "on an sm_90 GPU (H100, H200); on any device, flash_epilogue.reference computes "
                                   "each of them in plain PyTorch, with the same bits")


def schemas() -> list[str]:
    """The op schemas, read from their one definition (schema.inc, which the extension's registration includes)."""
    lines = Path(__file__).with_name("schema.inc").read_text().splitlines()
    return ast.literal_eval("[" + "\n".join(line for line in lines if not line.lstrip().startswith("//")) + "]")


def _raising(op: str):
    def kernel(*args, **kwargs):
        raise unavailable(op)
    return kernel


# Without the extension the ops still exist: torch.ops.flash_epilogue.<op> has its schema and raises unavailable(op)
# (before autograd, and while torch.compile traces it). The library object must live as long as the module.
_LIBRARY = None
if _C is None:
    _LIBRARY = torch.library.Library("flash_epilogue", "DEF")
    for _schema in schemas():
        _op = _schema.split("(", 1)[0]
        _LIBRARY.define(_schema)
        _LIBRARY.impl(_op, _raising(_op), "CompositeImplicitAutograd")


def op_error(op: str, e: Exception) -> Exception:
    """The error `e` of torch.ops.flash_epilogue.<op> as a wrapper raises it: the C++ checker's as the package's."""
    if isinstance(e, TypeError):
        return FlashEpilogueTypeError(str(e))
    if isinstance(e, ValueError):
        return FlashEpilogueInputError(str(e))
    if isinstance(e, AttributeError) and not hasattr(torch.ops.flash_epilogue, op):
        return unavailable(op)
    return e


def refresh_env_flags() -> None:
    """Re-read FLASH_EPILOGUE_CHECK_INPUTS and FLASH_EPILOGUE_DEBUG (read once, at import) after changing them."""
    global DEBUG, CHECK_INPUTS  # FLASH_EPILOGUE_DEBUG; content checks by default (FLASH_EPILOGUE_CHECK_INPUTS or DEBUG)
    DEBUG = os.environ.get("FLASH_EPILOGUE_DEBUG", "0") not in ("", "0")
    CHECK_INPUTS = os.environ.get("FLASH_EPILOGUE_CHECK_INPUTS", "0") not in ("", "0") or DEBUG
    if _C is not None:
        _C._set_debug_sync(DEBUG)  # repeat_kv's backward synchronizes in C++


refresh_env_flags()


def _eager() -> bool:
    """Neither traced by torch.compile nor capturing a CUDA graph (no host sync allowed then)."""
    return not (torch.compiler.is_compiling() or torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_contents(op: str, t, cu_seqlens=None, seqused=None, batch_idx=None, head_idx=None, **_) -> None:
    """cu_seqlens non-decreasing in [0, tokens], seqused[b] in [0, length of b], selections in range (`t`: dk's)."""

    def values(t) -> list | None:  # None where the op rejects it anyway (not int32 1-D)
        return t.tolist() if isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1 else None

    varlen = cu_seqlens is not None
    if not (_eager() and isinstance(t, torch.Tensor) and t.dim() == (3 if varlen else 4)):
        return
    rows = t.shape[0] if varlen else t.shape[1]
    cu = values(cu_seqlens) if varlen else []
    if cu is None or (varlen and len(cu) < 2):
        return
    for i, c in enumerate(cu):
        if c < (cu[i - 1] if i else 0):
            fail(op, f"cu_seqlens[{i}]", f">= cu_seqlens[{i - 1}] = {cu[i - 1]} (non-decreasing)" if i else ">= 0", c)
    if cu and cu[-1] > rows:
        fail(op, f"cu_seqlens[{len(cu) - 1}]", f"<= {rows} (the tensors' token count)", cu[-1])
    for b, n in enumerate(values(seqused) or ()):
        if n < 0:
            fail(op, f"seqused[{b}]", ">= 0", n)
        if varlen and b + 1 >= len(cu):
            break  # more entries than sequences: the op reports seqused's numel
        limit = cu[b + 1] - cu[b] if varlen else rows
        if n > limit:
            why = f"the length of segment {b}, cu_seqlens[{b + 1}] - cu_seqlens[{b}]" if varlen else "the static seqlen"
            fail(op, f"seqused[{b}]", f"<= {limit} ({why})", n)
    batch = len(cu) - 1 if varlen else t.shape[0]
    for name, sel, limit, why in (("batch_idx", batch_idx, batch, "the batch size"),
                                  ("head_idx", head_idx, t.shape[-2], "the number of heads")):
        for i, v in enumerate(values(sel) or ()):
            if not 0 <= v < limit:
                fail(op, f"{name}[{i}]", f"a value in [0, {limit}) ({why})", v)


def call_op(op: str, check_inputs: bool | None, t: torch.Tensor, *args, **kwargs) -> None:
    """torch.ops.flash_epilogue.<op>(*args, **kwargs) as every wrapper calls it (`t`: its tensor of the dk layout,
    whose device it synchronizes). Under torch.compile the op alone (it checks when it runs)."""
    if _C is None:
        raise unavailable(op)
    fn = getattr(torch.ops.flash_epilogue, op)
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    if check_inputs or (check_inputs is None and CHECK_INPUTS):
        check_contents(op, t, **kwargs)
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (the op's error, as the package's)
        # first the dispatcher's refusals, before the op's checker saw the call, named from the arguments: a Tensor
        # argument of the schema given another type, or every Tensor argument None (no device to dispatch by)
        schema = fn.default._schema
        given = dict(zip((a.name for a in schema.arguments), args)) | kwargs
        tensors = [(a.name, given[a.name]) for a in schema.arguments
                   if str(a.type) in ("Tensor", "Optional[Tensor]") and a.name in given]
        for name, v in tensors:
            if v is not None and not isinstance(v, torch.Tensor):
                fail(op, name, "a torch.Tensor", type(v).__name__, FlashEpilogueTypeError)
        if not any(isinstance(v, torch.Tensor) for _, v in tensors):
            raise FlashEpilogueTypeError(f"flash_epilogue.{op}: expected torch.Tensor arguments, got None for all of "
                                         "them")
        raise op_error(op, e) from None
    if DEBUG and t.device.type == "cuda" and _eager():  # a device error, reported against this op
        try:
            torch.cuda.synchronize(t.device)
        except Exception as e:  # noqa: BLE001 (re-raised with the op's name)
            raise RuntimeError(f"flash_epilogue.{op}: the kernel failed on {t.device}: {e}") from e
