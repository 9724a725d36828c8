"""The GQA accumulator: fp32 dK/dV workspaces that CollectiveEpilogueBwdGQA adds into.

    acc = flash_epilogue.gqa_accumulator(num_heads_kv=2, head_dim=128, batch=4, seqlen=8192,
                                         device="cuda")
    for chunk in chunks:                                  # many calls into one accumulator
        flash_epilogue.gqa_accumulate(dk_partial, dv_partial, acc)
    flash_epilogue.gqa_postprocess(acc, dk, dv, scale_dk=softmax_scale)
    acc.reset()                                           # zero it for the next step

The accumulator is a plain Python object: three tensors (dk_accum, dv_accum and, for deterministic
mode, semaphores) and the ints of the problem it was sized for. The ops take its tensors, so it
goes through torch.library ops, opcheck, torch.compile and export (it is a registered pytree node:
its tensors are the leaves, its ints the context).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.utils._pytree as pytree

from ._config import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, TileConfig, gqa_accum_shape, gqa_semaphore_numel, tile_config
from .validation import _check_seqlens_meta, _check_tensor, _fail, _is_int, resolve_arch

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
        from .ops import _accum_to_dense  # noqa: PLC0415 (ops imports this module)

        return _accum_to_dense(self, cu_seqlens=cu_seqlens, seqused=seqused, check_inputs=check_inputs)

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


def gqa_accumulator(
    num_heads_kv: int,
    head_dim: int,
    head_dim_v: Optional[int] = None,
    *,
    batch: Optional[int] = None,
    seqlen: Optional[int] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    total_tokens: Optional[int] = None,
    deterministic: bool = False,
    device: DeviceArg = None,
    arch: int = 0,
) -> GQAAccumulator:
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
    if not _is_int(num_heads_kv) or num_heads_kv < 1:
        _fail(_OP, "num_heads_kv", "a positive int", num_heads_kv)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    for name, value in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if not _is_int(value) or value <= 0 or value % HEAD_DIM_MULTIPLE or value > MAX_HEAD_DIM:
            _fail(_OP, name, f"a multiple of {HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}]", value)
    if not isinstance(deterministic, bool):
        _fail(_OP, "deterministic", "a bool", type(deterministic).__name__)
    if not _is_int(arch) or arch not in (0, 80, 90):
        _fail(_OP, "arch", "0 (the device's path), 80 or 90", arch)
    varlen = cu_seqlens is not None or total_tokens is not None
    if varlen:
        if seqlen is not None:
            _fail(_OP, "seqlen", "None in the varlen layout (cu_seqlens/total_tokens given)", seqlen)
        if not _is_int(total_tokens) or total_tokens < 0:
            _fail(_OP, "total_tokens", "an int >= 0 (the partials' row count) in the varlen layout", total_tokens)
        if cu_seqlens is not None:
            _check_tensor(_OP, "cu_seqlens", cu_seqlens)
            n = int(_check_seqlens_meta(_OP, cu_seqlens, None, 0))
            if batch is not None and batch != n:
                _fail(_OP, "batch", f"None or {n} (cu_seqlens.numel() - 1)", batch)
            batch = n
        elif not _is_int(batch) or batch < 1:
            _fail(_OP, "batch", "an int >= 1 (the number of sequences) or cu_seqlens", batch)
        rows = int(total_tokens)
    else:
        if not _is_int(batch) or batch < 0:
            _fail(_OP, "batch", "an int >= 0", batch)
        if not _is_int(seqlen) or seqlen < 0:
            _fail(_OP, "seqlen", "an int >= 0 (or cu_seqlens and total_tokens for the varlen layout)", seqlen)
        rows = int(seqlen)
    if device is None:
        device = cu_seqlens.device if cu_seqlens is not None else torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path = resolve_arch(device, arch)
    cfg = tile_config(head_dim, head_dim_v, path)
    shape = gqa_accum_shape(int(batch), rows, int(num_heads_kv), int(head_dim), int(head_dim_v), arch=path,
                            varlen=varlen)
    dk_accum = torch.zeros(shape, dtype=torch.float32, device=device)
    dv_accum = torch.zeros(shape, dtype=torch.float32, device=device)
    semaphores = None
    if deterministic:
        semaphores = torch.zeros(gqa_semaphore_numel(shape), dtype=torch.int32, device=device)
    return GQAAccumulator(dk_accum, dv_accum, semaphores, head_dim=int(head_dim), head_dim_v=int(head_dim_v),
                          block_n=cfg.block_n, tile_elems=cfg.accum_tile_elems, arch=path,
                          num_heads_kv=int(num_heads_kv), batch=int(batch), rows=rows, varlen=varlen)
