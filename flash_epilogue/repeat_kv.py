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

Both directions are ``torch.library`` custom ops (``torch.ops.flash_epilogue.repeat_kv`` and
``repeat_kv_backward``) with fake kernels and registered autograd (double backward included),
so they trace under ``torch.compile(fullgraph=True)``, export, and run in CUDA graphs.
"""
import functools
import operator
from typing import List, Optional, Sequence

import torch

from . import _extension
from ._config import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM
from .validation import FlashEpilogueInputError

__all__ = ["repeat_kv", "group_sum_reference"]

_OP = "repeat_kv"
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


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
    strides) keep the logical order."""
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
# the group reduce: kernel or plain PyTorch


def group_sum_reference(grad: torch.Tensor, n_rep: int, dim: int = 1,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The backward's arithmetic in plain PyTorch (any device, dtype and strides): for every KV
    head k, ``acc = 0; acc += g[k*n_rep + j] for j in 0..n_rep-1`` in fp32 (fp64 for fp64 or
    complex128 gradients, in the gradient's dtype if it is wider still), then one rounding to the
    gradient's dtype, written into ``out`` (default: a new contiguous tensor). Bitwise what the
    gqa_reduce kernel computes (and what repeat_kv's backward falls back to)."""
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


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def _kernel_device(device: torch.device) -> bool:
    """Whether gqa_reduce has kernels for this device: an sm_90 GPU with an sm_90a build, or an
    sm_8x GPU with an sm_80 build (the package's own rule, see flash_epilogue.validation)."""
    if device.type != "cuda" or _extension._C is None:
        return False
    archs = _extension.compiled_archs()
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    return ((major, minor) == (9, 0) and "sm_90a" in archs) or (major == 8 and "sm_80" in archs)


# the launchers' grid limits (csrc/bindings.cpp): rows < 2^31, batch and heads < 65536
_MAX_ROWS, _MAX_BATCH_OR_HEADS = 2**31 - 1, 65535


def _kernel_supports(grad: torch.Tensor, dim: int) -> bool:
    """dtype, head dim, grid limits and device the kernel has; a non-empty gradient."""
    d = grad.shape[-1]
    seqlen = grad.shape[3 - dim]  # (b, h, s, d) for dim 1, (b, s, h, d) for dim 2
    return (grad.dtype in KERNEL_DTYPES and d % HEAD_DIM_MULTIPLE == 0 and 0 < d <= MAX_HEAD_DIM
            and grad.numel() > 0 and seqlen <= _MAX_ROWS and grad.shape[0] <= _MAX_BATCH_OR_HEADS
            and grad.shape[dim] <= _MAX_BATCH_OR_HEADS and _kernel_device(grad.device))


def _kernel_layout_ok(t: torch.Tensor) -> bool:
    """gqa_reduce reads `t` (batch, seqlen, heads, d) in place: last dim contiguous, the other
    strides (of dims longer than 1) non-negative multiples of 16 bytes, a 16-byte aligned start."""
    mult = 16 // t.element_size()
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return False
    for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
        if size > 1 and (stride < 0 or stride % mult != 0):
            return False
    return t.data_ptr() % 16 == 0


def _kernel_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gqa_reduce's (batch, seqlen, heads, d) view of a tensor whose heads are in `dim`."""
    return t.transpose(1, 2) if dim == 1 else t


def _reduce(grad: torch.Tensor, n_rep: int, dim: int, out: torch.Tensor) -> str:
    """Sum the groups of `grad` into `out`; returns the path taken ("kernel", "kernel_copy" or
    "reference"; the tests look)."""
    if not _kernel_supports(grad, dim):
        group_sum_reference(grad, n_rep, dim, out=out)
        return "reference"
    path = "kernel"
    if not _kernel_layout_ok(_kernel_view(grad, dim)):
        # e.g. the stride-0 gradient of a .sum(), or a misaligned start: one copy into a new
        # (aligned, contiguous) tensor, then the kernel; the result does not depend on it
        grad = grad.clone(memory_format=torch.contiguous_format)
        path = "kernel_copy"
    num_heads_kv = out.shape[dim]
    from .ops import gqa_reduce  # noqa: PLC0415 (ops is imported by the package before this module)

    gqa_reduce(_kernel_view(grad, dim), num_heads_kv=num_heads_kv, out=_kernel_view(out, dim))
    return path


# ---------------------------------------------------------------------------------------------
# the custom ops


@torch.library.custom_op("flash_epilogue::repeat_kv", mutates_args=())
def _repeat_kv_op(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    """x repeated n_rep times along dim (1 or 2) as a new contiguous tensor."""
    expanded = _expanded_shape(x.shape, n_rep, dim)
    out = x.new_empty(_repeated_shape(x.shape, n_rep, dim))
    out.view(expanded).copy_(x.unsqueeze(dim + 1).expand(expanded))  # one copy, as reshape's
    return out


def _expanded_shape(shape: Sequence[int], n_rep: int, dim: int) -> list[int]:
    out = list(shape)
    out.insert(dim + 1, n_rep)
    return out


@_repeat_kv_op.register_fake
def _repeat_kv_fake(x, n_rep, dim):
    return x.new_empty(_repeated_shape(x.shape, n_rep, dim))


@torch.library.custom_op("flash_epilogue::repeat_kv_backward", mutates_args=())
def _repeat_kv_backward_op(grad: torch.Tensor, n_rep: int, dim: int, layout: List[int]) -> torch.Tensor:
    """The group sum of grad (heads in dim) in fp32 head order, in the memory order `layout`."""
    op = "repeat_kv_backward"
    out = _empty_in_layout(_reduced_shape(grad.shape, n_rep, dim, op), _check_layout(layout, op), grad)
    _reduce(grad, n_rep, dim, out)
    return out


@_repeat_kv_backward_op.register_fake
def _repeat_kv_backward_fake(grad, n_rep, dim, layout):
    op = "repeat_kv_backward"
    return _empty_in_layout(_reduced_shape(grad.shape, n_rep, dim, op), _check_layout(layout, op), grad)


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


_repeat_kv_op.register_autograd(_backward_repeat, setup_context=_setup_repeat)
_repeat_kv_backward_op.register_autograd(_backward_reduce, setup_context=_setup_reduce)
