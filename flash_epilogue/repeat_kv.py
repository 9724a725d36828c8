"""repeat_kv: the KV-head expand of GQA attention, whose backward is the deterministic group reduce. Both directions
are ops of the extension with their autograd in C++; here are their fake kernels and vmap rules (the vmapped dim folded
into the batch dim: one launch), and, without the extension, the same arithmetic and modes in plain torch."""
import torch

from . import _extension
from .errors import FlashEpilogueTypeError, as_int, fail
from .reference import group_sum_reference

__all__ = ["repeat_kv"]

_OP = "repeat_kv"


def repeat_kv(x: torch.Tensor, n_rep: int, dim: int = 1) -> torch.Tensor:
    """``x.repeat_interleave(n_rep, dim=dim)`` of x (batch, kv_heads, seqlen, d) with ``dim=1`` (transformers' Llama
    ``repeat_kv``) or (batch, seqlen, kv_heads, d) with ``dim=2``; backward: the deterministic group sum of the
    gradient (docs/semantics.md, "Autograd")."""
    if not isinstance(x, torch.Tensor):
        fail(_OP, "x", "a torch.Tensor", type(x).__name__, FlashEpilogueTypeError)
    if x.dim() != 4:
        fail(_OP, "x: rank", "4 dims: (batch, kv_heads, seqlen, head_dim) for dim=1, "
             "(batch, seqlen, kv_heads, head_dim) for dim=2", f"{x.dim()} dims, shape {tuple(x.shape)}")
    n = as_int(_OP, "n_rep", n_rep, "a positive int")
    if n < 1:
        fail(_OP, "n_rep", "a positive int", n)
    dim_expected = "1 (or -3) or 2 (or -2): the KV-head dim of a 4-D tensor"
    dim = as_int(_OP, "dim", dim, dim_expected)
    if dim not in (1, 2, -3, -2):
        fail(_OP, "dim", dim_expected, dim)
    if n == 1:
        return x
    if _extension._C is None:
        return (_RepeatKvCompiled if torch.compiler.is_compiling() else _RepeatKv).apply(x, n, dim % 4)
    return torch.ops.flash_epilogue.repeat_kv(x, n, dim % 4)


def _expanded(x, n_rep: int, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape.insert(dim + 1, n_rep)
    return x.unsqueeze(dim + 1).expand(shape).flatten(dim, dim + 1).contiguous()


def _layout_of(x) -> list[int]:
    """The order of x's first three dims in memory, outermost first (ties keep the logical order); an insertion sort
    by comparisons, which torch.compile traces on symbolic strides too."""
    order = [0]
    for i in (1, 2):
        j = len(order)
        while j > 0 and x.stride(order[j - 1]) < x.stride(i):
            j -= 1
        order.insert(j, i)
    return order


def _gradient_like(grad, n_rep: int, dim: int, layout) -> torch.Tensor:
    """An empty gradient of x: grad's shape with the heads in dim divided by n_rep, its dims dense in the order
    layout + [3] (what the op allocates)."""
    shape = list(grad.shape)
    shape[dim % 4] //= n_rep
    perm = [int(i) for i in layout] + [3]
    return grad.new_empty([shape[i] for i in perm]).permute([perm.index(i) for i in range(4)])


def _group_sum(grad, n_rep: int, dim: int, layout) -> torch.Tensor:  # the kernels' bits, in x's layout
    return _gradient_like(grad, n_rep, dim, layout).copy_(group_sum_reference(grad, n_rep, dim))


class _RepeatKvCompiled(torch.autograd.Function):
    """Without the extension, under torch.compile (dynamo traces neither a Function's jvp nor a Function applied in a
    backward): the repeat, its backward the group sum. Eager: _RepeatKv, the pair of Functions with their jvps."""

    generate_vmap_rule = True
    forward = staticmethod(_expanded)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # the layout as a string: one pytree leaf for torch.func's generated vmap rule (a list would be three)
        ctx.n_rep, ctx.dim, ctx.layout = inputs[1], inputs[2], "".join(map(str, _layout_of(inputs[0])))

    @staticmethod
    def backward(ctx, grad):
        return _group_sum(grad, ctx.n_rep, ctx.dim, ctx.layout), None, None


class _RepeatKv(_RepeatKvCompiled):
    @staticmethod
    def backward(ctx, grad):
        return _GroupSum.apply(grad, ctx.n_rep, ctx.dim, ctx.layout), None, None

    @staticmethod
    def jvp(ctx, x_t, *_):
        return _expanded(x_t, ctx.n_rep, ctx.dim)


class _GroupSum(torch.autograd.Function):
    generate_vmap_rule = True
    forward = staticmethod(_group_sum)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.n_rep, ctx.dim, ctx.layout = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        return _RepeatKv.apply(grad, ctx.n_rep, ctx.dim), None, None, None

    @staticmethod
    def jvp(ctx, g_t, *_):
        return _group_sum(g_t, ctx.n_rep, ctx.dim, ctx.layout)


if _extension._C is not None:
    @torch.library.register_fake("flash_epilogue::repeat_kv")
    def _repeat_kv_fake(x, n_rep, dim):
        shape = list(x.shape)
        shape[dim % 4] *= n_rep
        return x.new_empty(shape)

    torch.library.register_fake("flash_epilogue::repeat_kv_backward")(_gradient_like)

    def _folded(op):
        """The vmap rule of a per-head-group op: its vmapped dim folded into the batch dim (torch calls it only when
        x, the op's one tensor, is batched)."""

        def rule(info, in_dims, x, *rest):
            x = x.movedim(in_dims[0], 0)
            return op(x.flatten(0, 1), *rest).unflatten(0, (x.shape[0], x.shape[1])), 0

        return rule

    for _name in ("repeat_kv", "repeat_kv_backward"):
        torch.library.register_vmap(f"flash_epilogue::{_name}")(_folded(getattr(torch.ops.flash_epilogue, _name)))
