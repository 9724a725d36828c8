"""repeat_kv: the KV-head expand of GQA attention, with the deterministic group reduce as backward.

    k = flash_epilogue.repeat_kv(k, n_rep)          # (b, h_k, s, d) -> (b, h_k * n_rep, s, d), transformers'
    k = flash_epilogue.repeat_kv(k, n_rep, dim=2)   # (b, s, h_k, d), FlashAttention's layout

Both directions are ops of the C++ extension (``torch.ops.flash_epilogue.repeat_kv`` and ``repeat_kv_backward``)
with their autograd in C++ (double backward included): a backward runs no Python. The backward is
:func:`flash_epilogue.gqa_reduce` where the kernels support the gradient, else the same arithmetic in ATen
(its oracle: :func:`flash_epilogue.reference.group_sum_reference`). The fake kernels (output metadata only) are
here: the ops trace under ``torch.compile(fullgraph=True)`` and export, and run in CUDA graphs.
"""
from typing import Sequence

import torch

from . import _extension
from .errors import FlashEpilogueTypeError, as_index, fail

__all__ = ["repeat_kv"]

_OP = "repeat_kv"


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
    _extension.require(_OP)
    if not isinstance(x, torch.Tensor):
        fail(_OP, "x", "a torch.Tensor", type(x).__name__, FlashEpilogueTypeError)
    if x.dim() != 4:
        fail(_OP, "x: rank", "4 dims: (batch, kv_heads, seqlen, head_dim) for dim=1, "
             "(batch, seqlen, kv_heads, head_dim) for dim=2", f"{x.dim()} dims, shape {tuple(x.shape)}")
    n = as_index(_OP, "n_rep", n_rep, "a positive int")
    if n < 1:
        fail(_OP, "n_rep", "a positive int", n)
    dim_expected = "1 (or -3) or 2 (or -2): the KV-head dim of a 4-D tensor"
    dim = as_index(_OP, "dim", dim, dim_expected)
    if dim not in (1, 2, -3, -2):
        fail(_OP, "dim", dim_expected, dim)
    if n == 1:
        return x
    return torch.ops.flash_epilogue.repeat_kv(x, n, dim % 4)


def _with_heads(shape: Sequence[int], dim: int, heads: int) -> list[int]:
    out = list(shape)
    out[dim % 4] = heads
    return out


def _repeat_kv_fake(x, n_rep, dim):
    return x.new_empty(_with_heads(x.shape, dim, x.shape[dim] * n_rep))


def _repeat_kv_backward_fake(grad, n_rep, dim, layout):
    """An uninitialized tensor of the reduced shape whose dims lie in memory in the order layout + [3]
    (outermost first), as the op allocates x's gradient."""
    shape = _with_heads(grad.shape, dim, grad.shape[dim] // n_rep)
    perm = list(layout) + [3]
    return grad.new_empty([shape[i] for i in perm]).permute([perm.index(i) for i in range(4)])


if _extension._C is not None:
    torch.library.register_fake("flash_epilogue::repeat_kv")(_repeat_kv_fake)
    torch.library.register_fake("flash_epilogue::repeat_kv_backward")(_repeat_kv_backward_fake)
