"""The package's errors, and the coercions of the Python scalars the wrappers pass to the ops. Messages read
``flash_epilogue.<op>: <arg>: expected <expected>, got <got>``, as the C++ checks' do."""
import numbers
import operator
from typing import NoReturn

__all__ = ["FlashEpilogueInputError", "FlashEpilogueTypeError", "FlashEpilogueBuildError"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the schemas' `int`
_INT64 = "an int64 (the op's integer type)"


class FlashEpilogueInputError(ValueError):
    """An op argument is not acceptable (value, shape, layout, device, contents)."""


class FlashEpilogueTypeError(FlashEpilogueInputError, TypeError):
    """An op argument has the wrong type or dtype (a list for a tensor, a float tensor for int32, None)."""


class FlashEpilogueBuildError(RuntimeError):
    """The CUDA kernels an op needs were not built or could not be loaded."""


def fail(op: str, arg: str, expected, got, cls: type = FlashEpilogueInputError) -> NoReturn:
    raise cls(f"flash_epilogue.{op}: {arg}: expected {expected}, got {got}")


def as_index(op: str, name: str, v, expected: str = "an int") -> int:
    """v as a Python int: anything with __index__ (numpy integers, 0-d integer tensors) but a bool."""
    if type(v) is int:
        return v
    if isinstance(v, bool):
        fail(op, name, expected, "bool", FlashEpilogueTypeError)
    try:
        return operator.index(v)
    except TypeError:
        fail(op, name, expected, type(v).__name__, FlashEpilogueTypeError)


def as_int(op: str, name: str, v, expected: str = "an int") -> int:
    """v as the value of an op's `int` argument (int64)."""
    v = as_index(op, name, v, expected)
    if not INT64_MIN <= v <= INT64_MAX:
        fail(op, name, _INT64, v)
    return v


def as_float(op: str, name: str, v) -> float:
    """v as the value of an op's `float` argument (any real number but a bool; the op checks fp32's range)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        fail(op, name, "a float", type(v).__name__, FlashEpilogueTypeError)
    try:
        return float(v)
    except OverflowError:  # an int beyond the double range
        fail(op, name, "a float in fp32's range (|scale| <= 3.4028234663852886e+38; inf and nan pass)", v)


def as_count(op: str, name: str, v, expected: str, low: int = 0) -> int:
    """v as an int >= low (anything with __index__ but a bool), else `expected`, got v."""
    try:
        n = None if isinstance(v, bool) else operator.index(v)
    except TypeError:
        n = None
    if n is None or n < low:
        fail(op, name, expected, v)
    if n > INT64_MAX:
        fail(op, name, _INT64, n)
    return n
