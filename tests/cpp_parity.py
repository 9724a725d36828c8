"""C++/Python parity of the argument checks: every call of a Python validator also calls the C++ op.

With FLASH_EPILOGUE_TEST_CPP_PARITY=<file> in the environment, tests/conftest.py wraps the six
validators of flash_epilogue.validation (in that module and in the test module's namespace) for
every test. Each call then also runs the op (torch.ops.flash_epilogue.<op>.default, bound at import
so tests that intercept torch.ops.flash_epilogue.* do not see it) with the same arguments and
compares, appending one JSON line per call to <file>:

- Python rejects a value (FlashEpilogueInputError, not about the device): the op must raise the
  same message ("identical"); anything else is a "mismatch" (the test fails at once).
- an argument that is not a tensor where the op takes one: the op's schema must refuse it ("schema").
- a Python scalar of the wrong type (row_start=1.0, scale_dk="1", deterministic=1, ...): the op's
  schema may coerce it, the wrappers send such calls through the Python validation first
  ("scalar", not compared).
- Python accepts (the tests monkeypatch its device hooks to accept CPU tensors): the op must raise
  exactly its device error for the first tensor, "a CUDA tensor" ("valid").
- Python rejects the device: the op must raise a device error ("device"; identical messages when
  the hooks are not patched).
- not expressible with CPU tensors ("skipped"): meta/fake tensors (they reach the fake kernels),
  a build error, or an accumulator layout that depends on a patched capability (sm_8x).

tests/test_cpp_parity.py runs test_validation.py and test_gqa_validation.py this way.
"""
from __future__ import annotations

import inspect
import json
import re

import torch

import flash_epilogue.validation as V

# validator -> (op, the tensor parameters in the op's positional order, the first tensor of the
# device checks, the op's keyword parameters taken from the validator's)
SPECS = {
    "validate_store": ("store", ("dk_accum", "dv_accum", "dk", "dv"), "dk_accum", ("cu_seqlens", "seqused")),
    "validate_store_zero": ("store_zero", ("dk", "dv"), "dk",
                            ("cu_seqlens", "seqused", "batch_idx", "head_idx", "row_start", "row_end")),
    "validate_gqa_accumulate": ("gqa_accumulate", ("dk_partial", "dv_partial", "dk_accum", "dv_accum", "semaphores"),
                                "dk_partial", ("cu_seqlens", "seqused", "deterministic", "_arch")),
    "validate_gqa_postprocess": ("gqa_postprocess", ("dk_accum", "dv_accum", "dk", "dv"), "dk_accum",
                                 ("scale_dk", "scale_dv", "cu_seqlens", "seqused", "_arch")),
    "validate_gqa_accum_to_dense": ("gqa_accum_to_dense", ("accum", "out"), "accum",
                                    ("head_dim", "cu_seqlens", "seqused", "_arch")),
    "validate_gqa_reduce": ("gqa_reduce", ("dk_partial", "dv_partial", "dk", "dv"), "dk_partial",
                            ("cu_seqlens", "seqused", "scale_dk", "scale_dv", "_arch")),
}
TENSOR_KWARGS = ("cu_seqlens", "seqused", "batch_idx", "head_idx")
GEOMETRY_VALIDATORS = ("validate_gqa_accumulate", "validate_gqa_postprocess", "validate_gqa_accum_to_dense")
SCALAR_EXPECTED = ("an int", "a float", "a bool", "None or an int")

# the ops themselves, before any test can monkeypatch torch.ops.flash_epilogue.<name>
OPS = {op: getattr(getattr(torch.ops.flash_epilogue, op), "default", None)
       for op, *_ in SPECS.values() if hasattr(torch.ops.flash_epilogue, op)}
REAL = {name: getattr(V, name) for name in SPECS}


def cpu_checks_available() -> tuple[bool, str]:
    """Whether the loaded ops run their checks on CPU tensors (a current build of bindings.cpp)."""
    if OPS.get("store") is None:
        return False, "the ops are not defined"
    a = torch.zeros(1, 8, 1, 64)
    k = torch.zeros(1, 8, 1, 64, dtype=torch.float16)
    try:
        OPS["store"](a, a.clone(), k, k.clone())
    except ValueError as e:
        if "device: expected a CUDA tensor" in str(e):
            return True, ""
        return False, f"unexpected error {e!r}"
    except Exception as e:  # noqa: BLE001
        return False, f"the ops do not check CPU tensors (a build without the CPU registration?): {str(e).splitlines()[0][:160]}"
    return False, "the op accepted CPU tensors"


def _arg(message: str) -> tuple[str, str]:
    """(argument, expected) of a validation message."""
    m = re.match(r"^flash_epilogue\.[^:]+: (.*?): expected (.*), got ", message)
    return (m.group(1), m.group(2)) if m else ("", "")


def _is_device_error(arg: str, expected: str) -> bool:
    return arg == "device" or arg.endswith(": device") or (arg == "_arch" and expected.startswith("0 or 80 on"))


class Comparer:
    def __init__(self, path: str, nodeid: str):
        self.path, self.nodeid = path, nodeid

    def record(self, validator: str, outcome: str, detail: str = "") -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"test": self.nodeid, "validator": validator, "outcome": outcome,
                                "detail": detail}) + "\n")

    def wrap(self, name: str):
        real = REAL[name]
        sig = inspect.signature(real)

        def wrapped(*args, **kwargs):
            try:
                result = real(*args, **kwargs)
            except V.FlashEpilogueInputError as e:
                self.compare(name, sig.bind(*args, **kwargs), e)
                raise
            except V.FlashEpilogueBuildError:
                self.record(name, "skipped", "build error")
                raise
            self.compare(name, sig.bind(*args, **kwargs), None)
            return result

        return wrapped

    def compare(self, name: str, bound: inspect.BoundArguments, py_error) -> None:
        bound.apply_defaults()
        a = bound.arguments
        op, positional, first, keywords = SPECS[name]
        if OPS.get(op) is None:
            return self.record(name, "skipped", "op not defined")
        tensors = [a[p] for p in positional] + [a[k] for k in keywords if k in TENSOR_KWARGS]
        py_msg = str(py_error) if py_error is not None else None
        if py_msg is not None:
            py_msg = py_msg.replace(f"flash_epilogue.{a.get('op', op)}: ", f"flash_epilogue.{op}: ", 1)
        arg, expected = _arg(py_msg) if py_msg else ("", "")
        if py_error is not None and expected in SCALAR_EXPECTED:
            return self.record(name, "scalar", py_msg)
        schema = any(t is not None and not isinstance(t, torch.Tensor) for t in tensors)
        if not schema and any(t is not None and (type(t) is not torch.Tensor or t.device.type != "cpu")
                              for t in tensors):
            return self.record(name, "skipped", "meta/fake tensors reach the fake kernels")
        if name in GEOMETRY_VALIDATORS and not schema:
            device = next(t.device for t in tensors if t is not None)
            if V.resolve_arch(device, a["_arch"]) != (a["_arch"] or 90):
                return self.record(name, "skipped", "the accumulator layout follows a patched sm_8x capability")
        try:
            OPS[op](*[a[p] for p in positional], **{k: a[k] for k in keywords})
            cpp_error = None
        except Exception as e:  # noqa: BLE001
            cpp_error = e
        cpp_msg = str(cpp_error) if cpp_error is not None else None
        device_msg = f"flash_epilogue.{op}: {first}: device: expected a CUDA tensor, got a tensor on cpu"
        if schema:
            outcome = "schema" if cpp_error is not None else "mismatch"
        elif py_error is None:
            outcome = "valid" if cpp_msg == device_msg else "mismatch"
        elif _is_device_error(arg, expected):
            ok = isinstance(cpp_error, ValueError) and ": device: " in (cpp_msg or "")
            outcome = ("identical" if cpp_msg == py_msg else "device") if ok else "mismatch"
        else:
            outcome = "identical" if cpp_msg == py_msg else "mismatch"
        self.record(name, outcome, f"python: {py_msg!r} / C++: {cpp_msg!r}")
        assert outcome != "mismatch", (f"{name} and torch.ops.flash_epilogue.{op} disagree:\n  Python: {py_msg!r}\n"
                                       f"  C++:    {type(cpp_error).__name__}: {cpp_msg!r}")
