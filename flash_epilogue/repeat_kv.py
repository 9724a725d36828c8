"""repeat_kv: the KV-head expand of GQA attention, whose backward is the deterministic group reduce.

Both directions are ops of the C++ extension with their autograd in C++: reverse mode (double backward included) and
forward mode, torch.func's grad, vjp and jvp among them. Their fake kernels (output metadata only) and vmap rules (the
vmapped dim folded into the batch dim: one launch) are here, so that they trace under torch.compile(fullgraph=True)
and export and batch under torch.func.vmap.
"""
import torch

from . import _extension
from .errors import FlashEpilogueTypeError, as_int, fail

__all__ = ["repeat_kv"]

_OP = "repeat_kv"


def repeat_kv(x: torch.Tensor, n_rep: int, dim: int = 1) -> torch.Tensor:
    """``x.repeat_interleave(n_rep, dim=dim)``: output head j is KV head j // n_rep, a new contiguous tensor (``x``
    itself when ``n_rep == 1``). ``x``: (batch, kv_heads, seqlen, head_dim) with ``dim=1`` (a drop-in for
    transformers' Llama ``repeat_kv``), or (batch, seqlen, kv_heads, head_dim) with ``dim=2``. Backward: each group
    of n_rep heads of the gradient summed in fp32 (fp64 for fp64) in head order, rounded once to x's dtype (bitwise
    reproducible); one :func:`flash_epilogue.gqa_reduce` launch where the kernels support it."""
    _extension.require(_OP)
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
    return x if n == 1 else torch.ops.flash_epilogue.repeat_kv(x, n, dim % 4)


if _extension._C is not None:
    @torch.library.register_fake("flash_epilogue::repeat_kv")
    def _repeat_kv_fake(x, n_rep, dim):
        shape = list(x.shape)
        shape[dim % 4] *= n_rep
        return x.new_empty(shape)

    @torch.library.register_fake("flash_epilogue::repeat_kv_backward")
    def _repeat_kv_backward_fake(grad, n_rep, dim, layout):
        """x's gradient as the op allocates it: the reduced shape, its dims in memory in the order layout + [3]."""
        shape = list(grad.shape)
        shape[dim % 4] //= n_rep
        perm = list(layout) + [3]
        return grad.new_empty([shape[i] for i in perm]).permute([perm.index(i) for i in range(4)])

    def _folded(in_dims, x, run):
        """run(x with its vmapped dim folded into its batch dim), unfolded: a vmap rule of a per-head-group op (torch
        calls it only when x is batched, its one tensor)."""
        x = x.movedim(in_dims[0], 0)
        out = run(x.flatten(0, 1))
        return out.unflatten(0, (x.shape[0], x.shape[1])), 0

    @torch.library.register_vmap("flash_epilogue::repeat_kv")
    def _repeat_kv_vmap(info, in_dims, x, n_rep, dim):
        return _folded(in_dims, x, lambda t: torch.ops.flash_epilogue.repeat_kv(t, n_rep, dim))

    @torch.library.register_vmap("flash_epilogue::repeat_kv_backward")
    def _repeat_kv_backward_vmap(info, in_dims, grad, n_rep, dim, layout):
        return _folded(in_dims, grad, lambda t: torch.ops.flash_epilogue.repeat_kv_backward(t, n_rep, dim, layout))
