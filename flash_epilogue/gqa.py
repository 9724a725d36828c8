"""The GQA accumulator: fp32 dK/dV workspaces that CollectiveEpilogueBwdGQA adds into (usage: the package's
docstring). A plain Python object: three tensors (dk_accum, dv_accum and, for deterministic mode, semaphores) and
the ints of the problem it was sized for; a registered pytree node (its tensors the leaves, its ints the context),
so it goes through torch.library ops, opcheck, torch.compile and export.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.utils._pytree as pytree

from . import _checks, _extension
from ._config import TileConfig, tile_config
from .errors import FlashEpilogueTypeError, as_count, as_int, fail

__all__ = ["GQAAccumulator", "gqa_accumulator"]

_OP = "gqa_accumulator"


@dataclass(eq=False, repr=False)
class GQAAccumulator:
    """fp32 dK/dV accumulators of one GQA backward problem (and the deterministic-mode semaphores).

    ``dk_accum`` and ``dv_accum``: fp32, contiguous, both of shape (batch_extent, num_heads_kv,
    num_tiles, tile_elems): one tile of ``block_n`` KV rows per (batch, KV head, tile), each tile
    sized for max(head_dim, head_dim_v). Batched: batch_extent = batch, num_tiles =
    ceil(seqlen / block_n). Varlen: batch_extent = 1 and every sequence starts at its
    block_n-aligned padded offset, ((cu_seqlens[b] + b * block_n) // block_n) * block_n rows.

    **The element order inside a tile is opaque**: it is the register-fragment order of the
    dK/dV TiledMma of ``arch`` (90, or 80 for the sm_80 path), not row-major. Only the ops of this
    package read it: pass the object to :func:`flash_epilogue.gqa_accumulate` and
    :func:`flash_epilogue.gqa_postprocess`; :meth:`to_dense` decodes it (for tests/debugging).

    ``semaphores``: an int32 workspace for deterministic mode (None when allocated without it);
    the op zeroes it on the current stream before each use.

    The ints describe the problem the accumulator was sized for; the ops check their inputs
    against them: ``head_dim``/``head_dim_v`` (d and dv), ``block_n`` (kBlockN of the tile),
    ``tile_elems`` (floats per tile), ``arch`` (90 or 80), ``num_heads_kv``, ``batch`` (sequences),
    ``rows`` (seqlen, or the total token count in varlen), ``varlen``.
    """

    dk_accum: torch.Tensor
    dv_accum: torch.Tensor
    semaphores: Optional[torch.Tensor]
    head_dim: int
    head_dim_v: int
    block_n: int
    tile_elems: int
    arch: int
    num_heads_kv: int
    batch: int
    rows: int
    varlen: bool

    @property
    def deterministic(self) -> bool:
        """Whether it can run deterministic mode (it has semaphores)."""
        return self.semaphores is not None

    @property
    def config(self) -> TileConfig:
        """The tile configuration whose fragment order the accumulator uses."""
        return tile_config(self.head_dim, self.head_dim_v, self.arch)

    @property
    def batch_extent(self) -> int:
        return self.dk_accum.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.dk_accum.shape[2]

    @property
    def device(self) -> torch.device:
        return self.dk_accum.device

    def reset(self) -> "GQAAccumulator":
        """Zero both accumulators (on the current stream) for reuse; returns self."""
        self.dk_accum.zero_()
        self.dv_accum.zero_()
        return self

    def dense_shape(self, head_dim: int) -> tuple[int, ...]:
        """(batch, seqlen, num_heads_kv, head_dim), or (total_tokens, num_heads_kv, head_dim) in varlen."""
        if self.varlen:
            return (self.rows, self.num_heads_kv, head_dim)
        return (self.batch, self.rows, self.num_heads_kv, head_dim)

    def to_dense(self, *, cu_seqlens: Optional[torch.Tensor] = None, seqused: Optional[torch.Tensor] = None,
                 check_inputs: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The accumulators as row-major fp32 tensors (dk_dense, dv_dense) of the layout of dk/dv:
        (batch, seqlen, num_heads_kv, head_dim[_v]) or varlen (total_tokens, num_heads_kv, head_dim[_v]).

        Varlen accumulators need the ``cu_seqlens`` they were filled with (where each sequence
        starts). Rows outside the valid rows (past ``seqused``, between and after sequences) are 0.
        A debugging/testing aid through the op ``gqa_accum_to_dense``, not a fast path.
        """
        op = "gqa_accum_to_dense"
        if self.varlen and cu_seqlens is None:
            fail(op, "cu_seqlens", "the int32 cu_seqlens the varlen accumulator was filled with", "None")
        if not self.varlen and cu_seqlens is not None:
            fail(op, "cu_seqlens", "None for an accumulator of the batched layout", "a tensor")
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.numel() - 1 != self.batch:
            fail(op, "acc.batch", f"{cu_seqlens.numel() - 1} (cu_seqlens.numel() - 1)", self.batch)
        head_dim = max(self.head_dim, self.head_dim_v)  # names the tile config
        outs = [torch.zeros(self.dense_shape(d), dtype=torch.float32, device=self.device)
                for d in (self.head_dim, self.head_dim_v)]
        if check_inputs or (check_inputs is None and _checks.CHECK_INPUTS):
            _checks.check_contents(op, outs[0], cu_seqlens, seqused)
        for accum, out in zip((self.dk_accum, self.dv_accum), outs):
            try:
                torch.ops.flash_epilogue.gqa_accum_to_dense(accum, out, head_dim=head_dim, cu_seqlens=cu_seqlens,
                                                            seqused=seqused, _arch=self.arch)
            except Exception as e:  # noqa: BLE001 (the op's error, as the package's)
                raise _extension.op_error(op, e) from None
        return outs[0], outs[1]

    def __repr__(self) -> str:
        sem = "None" if self.semaphores is None else f"int32[{self.semaphores.numel()}]"
        return (f"GQAAccumulator(dk_accum/dv_accum=float32{list(self.dk_accum.shape)}, semaphores={sem}, "
                f"head_dim={self.head_dim}, head_dim_v={self.head_dim_v}, block_n={self.block_n}, "
                f"tile_elems={self.tile_elems}, arch={self.arch}, num_heads_kv={self.num_heads_kv}, "
                f"batch={self.batch}, rows={self.rows}, varlen={self.varlen}, device={self.device})")


_CONFIG_FIELDS = ("head_dim", "head_dim_v", "block_n", "tile_elems", "arch", "num_heads_kv", "batch", "rows",
                  "varlen")
_TENSOR_FIELDS = ("dk_accum", "dv_accum", "semaphores")


def _flatten(acc: GQAAccumulator):
    return [getattr(acc, f) for f in _TENSOR_FIELDS], tuple(getattr(acc, f) for f in _CONFIG_FIELDS)


def _flatten_with_keys(acc: GQAAccumulator):
    children, context = _flatten(acc)
    return [(pytree.GetAttrKey(f), c) for f, c in zip(_TENSOR_FIELDS, children)], context


def _unflatten(children, context) -> GQAAccumulator:
    return GQAAccumulator(*children, *context)


pytree.register_pytree_node(GQAAccumulator, _flatten, _unflatten,
                            serialized_type_name="flash_epilogue.gqa.GQAAccumulator",
                            flatten_with_keys_fn=_flatten_with_keys)


DeviceArg = Union[None, str, int, torch.device]


def gqa_accumulator(num_heads_kv: int, head_dim: int, head_dim_v: Optional[int] = None, *,
                    batch: Optional[int] = None, seqlen: Optional[int] = None,
                    cu_seqlens: Optional[torch.Tensor] = None, total_tokens: Optional[int] = None,
                    deterministic: bool = False, device: DeviceArg = None, arch: int = 0) -> GQAAccumulator:
    """Allocate a zeroed :class:`GQAAccumulator` for dK (head dim ``head_dim``) and dV
    (``head_dim_v``, default ``head_dim``) of ``num_heads_kv`` KV heads.

    Batched layout: give ``batch`` and ``seqlen`` (the KV sequence length of the partials).
    Varlen layout: give ``total_tokens`` (the partials' row count: no host read of cu_seqlens)
    and ``cu_seqlens`` (int32, batch + 1; only its size is used, the batch) or ``batch``.

    ``deterministic=True`` also allocates the semaphores deterministic mode needs (2 int32 per
    (tile, KV head), plus one). ``device``: default cu_seqlens' device, else the current CUDA
    device. ``arch``: 0 = the device's own path (90 on sm_90; 80 on sm_8x), or 80 to use the sm_80
    path's layout on an sm_90 GPU (a testing knob); the accumulator only works with that path.

    The element order is the MMA fragment order (opaque, see :class:`GQAAccumulator`).
    """
    _C = _extension.require(_OP)
    num_heads_kv = as_count(_OP, "num_heads_kv", num_heads_kv, "a positive int", 1)
    head_dim = as_int(_OP, "head_dim", head_dim)
    head_dim_v = head_dim if head_dim_v is None else as_int(_OP, "head_dim_v", head_dim_v)
    if not isinstance(deterministic, bool):
        fail(_OP, "deterministic", "a bool", type(deterministic).__name__, FlashEpilogueTypeError)
    arch = as_int(_OP, "arch", arch)
    varlen = cu_seqlens is not None or total_tokens is not None
    if varlen:
        if seqlen is not None:
            fail(_OP, "seqlen", "None in the varlen layout (cu_seqlens/total_tokens given)", seqlen)
        rows = as_count(_OP, "total_tokens", total_tokens, "an int >= 0 (the partials' row count) in the varlen layout")
        if cu_seqlens is not None:
            n = _sequences(cu_seqlens)
            if batch is not None and batch != n:
                fail(_OP, "batch", f"None or {n} (cu_seqlens.numel() - 1)", batch)
            batch = n
        batch = as_count(_OP, "batch", batch, "an int >= 1 (the number of sequences) or cu_seqlens", 1)
    else:
        batch = as_count(_OP, "batch", batch, "an int >= 0")
        rows = as_count(_OP, "seqlen", seqlen, "an int >= 0 (or cu_seqlens and total_tokens for the varlen layout)")
    if device is None:
        device = cu_seqlens.device if cu_seqlens is not None else torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:  # the one place the accumulator geometry is computed (the ops check against the same function)
        layout = _C.gqa_accum_layout(num_heads_kv, head_dim, head_dim_v, batch, rows, varlen, arch, device)
    except (TypeError, ValueError) as e:
        raise _extension.op_error(_OP, e) from None
    shape = tuple(layout["shape"])
    semaphores = None
    if deterministic:
        semaphores = torch.zeros(layout["semaphore_numel"], dtype=torch.int32, device=device)
    return GQAAccumulator(torch.zeros(shape, dtype=torch.float32, device=device),
                          torch.zeros(shape, dtype=torch.float32, device=device), semaphores, head_dim=head_dim,
                          head_dim_v=head_dim_v, block_n=layout["block_n"], tile_elems=layout["tile_elems"],
                          arch=layout["arch"], num_heads_kv=num_heads_kv, batch=batch, rows=rows, varlen=varlen)


def _sequences(cu_seqlens) -> int:
    """cu_seqlens.numel() - 1 of an int32 (batch + 1,) tensor (only its size is read)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        fail(_OP, "cu_seqlens", "a torch.Tensor", type(cu_seqlens).__name__, FlashEpilogueTypeError)
    if cu_seqlens.dtype != torch.int32:
        fail(_OP, "cu_seqlens: dtype", "torch.int32", cu_seqlens.dtype, FlashEpilogueTypeError)
    if cu_seqlens.dim() != 1:
        fail(_OP, "cu_seqlens: rank", "1 dim (batch + 1,)",
             f"{cu_seqlens.dim()} dims, shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        fail(_OP, "cu_seqlens: numel", "batch + 1 >= 2 (at least one sequence)", cu_seqlens.numel())
    return cu_seqlens.numel() - 1
