"""repeat_kv: the KV-head expand of GQA attention, with the deterministic group reduce as backward.

    import flash_epilogue as fe
    k = fe.repeat_kv(k, n_rep)            # (b, h_k, s, d) -> (b, h_k * n_rep, s, d), as transformers'
    v = fe.repeat_kv(v, n_rep)            # Llama repeat_kv / k.repeat_interleave(n_rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v)
    k = fe.repeat_kv(k, n_rep, dim=2)     # (b, s, h_k, d) layout (FlashAttention's)

Forward: the same values, shape and strides as transformers' ``x[:, :, None].expand(...).reshape(...)``
(a new contiguous tensor). Backward: each KV head's gradient is the fp32 sum of its n_rep query
heads' gradients in head order (``0 + g_0 + g_1 + ... + g_{n-1}``), rounded once to x's dtype:
bitwise reproducible, through :func:`flash_epilogue.gqa_reduce` when the kernels support the
gradient (a CUDA bf16/fp16 tensor on a GPU the package has kernels for, head dim a multiple of
8 up to 256), else through the same arithmetic in plain PyTorch (see :func:`group_sum_reference`).

Both directions are ops of the C++ extension (``torch.ops.flash_epilogue.repeat_kv`` and
``repeat_kv_backward``, csrc/bindings.cpp) with their autograd in C++ (double backward included),
so a backward through them runs no Python; the fake kernels are here. They trace under
``torch.compile(fullgraph=True)``, export, and run in CUDA graphs. Without the extension (not
built, or built before these ops) this module defines the same ops in Python, whose backward is
the plain-PyTorch sum.
"""
import collections.abc
import contextlib
import operator
from typing import Optional, Sequence

import torch

from . import _extension, _schemas
from .validation import FlashEpilogueInputError

__all__ = ["repeat_kv", "group_sum_reference"]

_OP = "repeat_kv"


def _fail(arg: str, expected, got):
    raise FlashEpilogueInputError(f"flash_epilogue.{_OP}: {arg}: expected {expected}, got {got}")


def _int_arg(name: str, value, expected: str) -> int:
    """`value` as an int (anything with __index__, but not a bool), else a clear error."""
    if isinstance(value, bool):
        _fail(name, expected, "bool")
    try:
        return operator.index(value)
    except TypeError:
        _fail(name, expected, type(value).__name__)


def _check_args(x, n_rep, dim) -> int:
    """Validate the arguments of repeat_kv; returns dim normalized to 1 or 2."""
    if not isinstance(x, torch.Tensor):
        _fail("x", "a torch.Tensor", type(x).__name__)
    if x.dim() != 4:
        _fail("x: rank", "4 dims: (batch, kv_heads, seqlen, head_dim) for dim=1, "
              "(batch, seqlen, kv_heads, head_dim) for dim=2", f"{x.dim()} dims, shape {tuple(x.shape)}")
    n = _int_arg("n_rep", n_rep, "a positive int")
    if n < 1:
        _fail("n_rep", "a positive int", n)
    dim_expected = "1 (or -3) or 2 (or -2): the KV-head dim of a 4-D tensor"
    dim = _int_arg("dim", dim, dim_expected)
    if dim not in (1, 2, -3, -2):
        _fail("dim", dim_expected, dim)
    return dim % 4


def repeat_kv(x: torch.Tensor, n_rep: int, dim: int = 1) -> torch.Tensor:
    """Repeat each KV head ``n_rep`` times along ``dim``: ``x.repeat_interleave(n_rep, dim=dim)``.

    ``x``: (batch, kv_heads, seqlen, head_dim) with ``dim=1`` (transformers' layout; a drop-in for
    its Llama ``repeat_kv(hidden_states, n_rep)``), or (batch, seqlen, kv_heads, head_dim) with
    ``dim=2``. Output head ``j`` is KV head ``j // n_rep``.

    ``n_rep == 1`` returns ``x`` itself (as transformers does). Otherwise a new contiguous tensor
    with the original's values, shape and strides (transformers' ``expand(...).reshape(...)``
    copies too, except with a single KV head, where its reshape returns a stride-0 view of x: here
    that case is a contiguous copy as well, so the result can always be written in place).

    Backward: the gradient of KV head k is ``0 + g_{k*n} + ... + g_{k*n+n-1}`` summed in fp32
    (fp64 for fp64 tensors) in head order and rounded once to x's dtype, so it is bitwise
    reproducible and independent of the gradient's strides. On a supported GPU (bf16/fp16, head
    dim a multiple of 8 up to 256) it is one :func:`flash_epilogue.gqa_reduce` launch that reads
    the gradient in place in its own strides and writes x's gradient in x's memory layout (e.g.
    a (b, s, h_k, d) projection output seen as (b, h_k, s, d) gets a gradient laid out the same).
    """
    dim = _check_args(x, n_rep, dim)
    if int(n_rep) == 1:
        return x
    return torch.ops.flash_epilogue.repeat_kv(x, int(n_rep), dim)


# ---------------------------------------------------------------------------------------------
# shapes and layouts


def _check_op_args(op: str, name: str, heads: str, t: torch.Tensor, n_rep: int, dim: int) -> int:
    """The ops' own checks (csrc/bindings.cpp's check_repeat_kv_args, same order and messages): t
    4-D, n_rep >= 1, dim naming the heads dim; returns dim normalized to 1 or 2."""
    if t.dim() != 4:
        raise FlashEpilogueInputError(
            f"flash_epilogue.{op}: {name}: rank: expected 4 dims: (batch, {heads}, seqlen, head_dim) for dim=1, "
            f"(batch, seqlen, {heads}, head_dim) for dim=2, got {t.dim()} dims, shape {tuple(t.shape)}")
    if n_rep < 1:
        raise FlashEpilogueInputError(f"flash_epilogue.{op}: n_rep: expected a positive int, got {n_rep}")
    if dim not in (1, 2, -3, -2):
        raise FlashEpilogueInputError(
            f"flash_epilogue.{op}: dim: expected 1 (or -3) or 2 (or -2): the KV-head dim of a 4-D tensor, got {dim}")
    return dim % 4


def _repeated_shape(shape: Sequence[int], n_rep: int, dim: int) -> list[int]:
    out = list(shape)
    out[dim] = out[dim] * n_rep
    return out


def _reduced_shape(shape: Sequence[int], n_rep: int, dim: int, op: str) -> list[int]:
    heads = shape[dim]
    if heads % n_rep != 0:
        raise FlashEpilogueInputError(
            f"flash_epilogue.{op}: grad: heads: expected a multiple of n_rep = {n_rep} in dim {dim}, got {heads} "
            f"(shape {tuple(shape)})")
    out = list(shape)
    out[dim] = heads // n_rep
    return out


def _layout_of(x: torch.Tensor) -> list[int]:
    """The order of x's first three dims in memory, outermost first (the head dim is placed
    innermost regardless): x's gradient is allocated in this order. Ties (size-1 dims, equal
    strides) keep the logical order. (The C++ autograd's layout_of.)"""
    return sorted(range(3), key=lambda i: -x.stride(i))


def _check_layout(layout: Sequence[int], op: str) -> list[int]:
    layout = [int(i) for i in layout]
    if sorted(layout) != [0, 1, 2]:
        raise FlashEpilogueInputError(f"flash_epilogue.{op}: layout: expected a permutation of [0, 1, 2], got {layout}")
    return layout


def _empty_in_layout(shape: Sequence[int], layout: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor of logical `shape` whose dims lie in memory in the order
    layout + [3] (outermost first): dense, the last dim contiguous."""
    perm = list(layout) + [3]
    buf = like.new_empty([shape[i] for i in perm])
    inverse = [perm.index(i) for i in range(4)]
    return buf.permute(inverse)


# ---------------------------------------------------------------------------------------------
# the group reduce in plain PyTorch


def group_sum_reference(grad: torch.Tensor, n_rep: int, dim: int = 1,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The backward's arithmetic in plain PyTorch (any device, dtype and strides): for every KV
    head k, ``acc = 0; acc += g[k*n_rep + j] for j in 0..n_rep-1`` in fp32 (fp64 for fp64 or
    complex128 gradients, in the gradient's dtype if it is wider still), then one rounding to the
    gradient's dtype, written into ``out`` (default: a new contiguous tensor). Bitwise what the
    gqa_reduce kernel computes, and what repeat_kv's backward falls back to (the C++ op makes the
    same ATen calls: csrc/bindings.cpp, group_sum_reference)."""
    dim = dim % 4
    shape = _reduced_shape(grad.shape, n_rep, dim, "repeat_kv_backward")
    if out is None:
        out = grad.new_empty(shape)
    acc_dtype = torch.promote_types(grad.dtype, torch.float32)
    acc = out if out.dtype == acc_dtype else torch.empty(shape, dtype=acc_dtype, device=grad.device)
    acc.zero_()
    grouped = grad.unflatten(dim, (shape[dim], n_rep))
    for j in range(n_rep):
        acc.add_(grouped.select(dim + 1, j))  # exact upcast of the 16-bit value, then an fp32 add
    if acc is not out:
        out.copy_(acc)  # round to nearest even, once
    return out


# ---------------------------------------------------------------------------------------------
# the ops: C++ (csrc/bindings.cpp), else defined here

# Whether the loaded extension defines the ops (a build older than them does not).
_CPP = _extension._C is not None and hasattr(torch.ops.flash_epilogue, "repeat_kv")


def _kernel_device(device: torch.device) -> bool:
    """Whether the backward can run gqa_reduce for tensors on `device`: an sm_90 GPU with an sm_90a
    build, or an sm_8x GPU with an sm_80 build (the C++ op decides; never without it)."""
    return _CPP and _extension._C is not None and _extension._C._repeat_kv_kernel_device(device)


def _kernel_supports(grad: torch.Tensor, dim: int) -> bool:
    """Whether the backward runs gqa_reduce on `grad` (heads in dim 1 or 2): dtype, head dim, grid
    limits and device the kernel has, a non-empty gradient (the C++ op's own decision)."""
    return _CPP and _extension._C._repeat_kv_kernel_supports(grad, dim)


_python_paths: Optional[list] = None  # the Python ops' record while _recording_paths is active


def _note_path(path: str) -> None:
    if _python_paths is not None:
        _python_paths.append(path)


class _RecordedPaths(collections.abc.Sequence):
    """The backward paths recorded so far ("kernel", "kernel_copy", "reference"), in call order:
    a live view (the C++ op keeps its own record)."""

    def _paths(self) -> list:
        return list(_extension._C._repeat_kv_paths()) if _CPP else list(_python_paths or ())

    def __getitem__(self, i):
        return self._paths()[i]

    def __len__(self) -> int:
        return len(self._paths())

    def __iter__(self):  # one read of the record, not one per element
        return iter(self._paths())

    def __eq__(self, other) -> bool:
        return self._paths() == list(other) if isinstance(other, collections.abc.Sequence) else NotImplemented

    def clear(self) -> None:
        if _CPP:
            _extension._C._repeat_kv_record_paths(True)
        elif _python_paths is not None:
            _python_paths.clear()

    def __repr__(self) -> str:
        return repr(self._paths())


@contextlib.contextmanager
def _recording_paths():
    """Record which way each backward reduce goes while inside (tests and benchmarks look); yields
    the record (_RecordedPaths)."""
    global _python_paths
    if _CPP:
        _extension._C._repeat_kv_record_paths(True)
    else:
        _python_paths = []
    try:
        yield _RecordedPaths()
    finally:
        if _CPP:
            _extension._C._repeat_kv_record_paths(False)
        else:
            _python_paths = None


def _repeat_kv_python(x, n_rep, dim):
    """x repeated n_rep times along dim as a new contiguous tensor (the C++ op's repeat_kv_impl)."""
    dim = _check_op_args("repeat_kv", "x", "kv_heads", x, n_rep, dim)
    expanded = list(x.shape)
    expanded.insert(dim + 1, n_rep)
    out = x.new_empty(_repeated_shape(x.shape, n_rep, dim))
    out.view(expanded).copy_(x.unsqueeze(dim + 1).expand(expanded))  # one copy, as reshape's
    return out


def _backward_output(grad, n_rep, dim, layout) -> torch.Tensor:
    """repeat_kv_backward's checks, then its uninitialized output in the memory order `layout`."""
    op = "repeat_kv_backward"
    dim = _check_op_args(op, "grad", "heads", grad, n_rep, dim)
    return _empty_in_layout(_reduced_shape(grad.shape, n_rep, dim, op), _check_layout(layout, op), grad)


def _repeat_kv_backward_python(grad, n_rep, dim, layout):
    """The group sum of grad in the memory order `layout`, in plain PyTorch (no kernels here)."""
    out = _backward_output(grad, n_rep, dim, layout)
    group_sum_reference(grad, n_rep, dim, out=out)
    _note_path("reference")
    return out


def _setup_repeat(ctx, inputs, output):
    x, n_rep, dim = inputs
    ctx.n_rep, ctx.dim, ctx.layout = n_rep, dim, _layout_of(x)


def _backward_repeat(ctx, grad):
    return torch.ops.flash_epilogue.repeat_kv_backward(grad, ctx.n_rep, ctx.dim, ctx.layout), None, None


def _setup_reduce(ctx, inputs, output):
    _, n_rep, dim, _ = inputs
    ctx.n_rep, ctx.dim = n_rep, dim


def _backward_reduce(ctx, grad):
    # the reduce is linear: its adjoint repeats each KV head's gradient n_rep times
    return torch.ops.flash_epilogue.repeat_kv(grad, ctx.n_rep, ctx.dim), None, None, None


def _define_python_ops() -> torch.library.Library:
    """The ops without the extension: the schemas the C++ extension defines, plain-PyTorch kernels
    for every backend, and their autograd in Python."""
    lib = torch.library.Library(_schemas.LIBRARY, "FRAGMENT")
    for name, kernel in (("repeat_kv", _repeat_kv_python), ("repeat_kv_backward", _repeat_kv_backward_python)):
        lib.define(_schemas.SCHEMAS[name])
        lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_autograd("flash_epilogue::repeat_kv", _backward_repeat, setup_context=_setup_repeat,
                                    lib=lib)
    torch.library.register_autograd("flash_epilogue::repeat_kv_backward", _backward_reduce,
                                    setup_context=_setup_reduce, lib=lib)
    return lib


_python_library = None if _CPP else _define_python_ops()


@torch.library.register_fake("flash_epilogue::repeat_kv")
def _repeat_kv_fake(x, n_rep, dim):
    dim = _check_op_args("repeat_kv", "x", "kv_heads", x, n_rep, dim)
    return x.new_empty(_repeated_shape(x.shape, n_rep, dim))


@torch.library.register_fake("flash_epilogue::repeat_kv_backward")
def _repeat_kv_backward_fake(grad, n_rep, dim, layout):
    return _backward_output(grad, n_rep, dim, layout)
