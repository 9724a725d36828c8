"""The compiled tile configurations (csrc/kernels/config_table.cu, as _C exports it: one dK/dV tile per head dim, as FA3
picks it, which fixes the accumulator's order) and the GQA accumulator, a pytree node (tensors the leaves, ints the
context) that goes through torch.library ops, opcheck, torch.compile and export."""
from dataclasses import dataclass, fields

import torch
import torch.utils._pytree as pytree

from . import _extension
from .errors import FlashEpilogueTypeError, as_count, as_int, fail

__all__ = ["COMPILED_HEAD_DIMS", "TileConfig", "tile_config", "GQAAccumulator", "gqa_accumulator"]

_OP = "gqa_accumulator"


@dataclass(frozen=True)
class TileConfig:
    head_dim: int  # the compiled head dim (tile width)
    block_n: int  # kBlockN: KV rows per tile
    num_threads: int  # epilogue (MMA) threads per CTA
    swap_ab: bool  # dKV_swapAB: the MMA computes dK^T, the fragment is (head_dim, block_n)
    atom_layout_n: int  # AtomLayoutNdKV: warpgroups (sm_80: warps) along N (along D when swap_ab)
    accum_tile_elems: int  # floats per tile in the GQA accumulator (the C fragment, padding included)
    slab_cols: int  # where the warpgroups' slabs of a tile split its columns, the columns of each; else 0
    slab_elems: int  # floats per slab (one per warpgroup on sm_90; the whole tile on sm_80)
    arch: int  # the code path: 90 (sm_90 collectives) or 80 (the sm_80 ones)


# {(arch, head_dim): TileConfig} of FA3's tiles (the table's others are store's, for small problems); empty without
# the extension (or with a stale one).
_TABLE = {(c["arch"], c["head_dim"]): TileConfig(**{f.name: c[f.name] for f in fields(TileConfig)})
          for c in getattr(_extension._C, "tile_configs", tuple)() if c.get("fa3", True)}

COMPILED_HEAD_DIMS: tuple[int, ...] = tuple(sorted({hd for _, hd in _TABLE}))
# every tile head dim of a full build (a build may leave some out: FLASH_EPILOGUE_HEAD_DIMS)
_TILE_HEAD_DIMS: tuple[int, ...] = tuple(_extension._C.build_info().get("tile_head_dims", COMPILED_HEAD_DIMS)) \
    if _TABLE else ()


def tile_config(d: int, dv: int | None = None, arch: int = 90) -> TileConfig:
    """The config that serves head dims (d, dv) on `arch` (90, or 80 for the sm_80 path): the smallest tile head dim
    >= max(d, dv), as FA3 picks it; an error naming FLASH_EPILOGUE_HEAD_DIMS where this build left it out."""
    if not _TABLE:
        raise _extension.unavailable("tile_config")
    width, path = max(d, d if dv is None else dv), 80 if arch == 80 else 90
    for hd in _TILE_HEAD_DIMS:
        if width <= hd:
            if (path, hd) not in _TABLE:
                fail("tile_config", "head dim", f"a head dim this build has kernels for: {width} runs on the tile "
                     f"of head dim {hd}, which this build leaves out (FLASH_EPILOGUE_HEAD_DIMS="
                     f"{';'.join(map(str, COMPILED_HEAD_DIMS))}); rebuild with it in FLASH_EPILOGUE_HEAD_DIMS", width)
            return _TABLE[(path, hd)]
    raise ValueError(f"head dim {width} exceeds the largest compiled head dim {_TILE_HEAD_DIMS[-1]}")


@dataclass(eq=False, repr=False)
class GQAAccumulator:
    """One GQA problem's fp32 ``dk_accum``/``dv_accum`` (batch_extent, num_heads_kv, num_tiles, tile_elems): opaque
    tiles of KV rows in MMA fragment order (varlen: batch_extent 1, each sequence tile-aligned; see :meth:`to_dense`),
    the sm_80 path's deterministic-mode int32 ``semaphores`` (None on the sm_90 path, deterministic in both modes,
    and where allocated with deterministic=False), the ints of the problem it was sized for. dK's tiles are those of
    :attr:`config` (``block_n`` rows), dV's those of :attr:`config_v`: the same, or where the dispatch plan gives dV
    a tile of its own (on sm_90, head_dim 256 beside a head_dim_v of at most 128 in large problems), that tile."""

    dk_accum: torch.Tensor
    dv_accum: torch.Tensor
    semaphores: torch.Tensor | None
    head_dim: int
    head_dim_v: int
    block_n: int
    arch: int
    num_heads_kv: int
    batch: int
    rows: int  # seqlen, or the total token count in varlen
    varlen: bool
    tile_head_dim_v: int  # the head dim of dV's tile (config_v)
    deterministic: bool  # allocated for deterministic mode: gqa_accumulate's default

    @property
    def config(self) -> TileConfig:
        """The tile configuration whose fragment order dK's accumulator uses (that serving max(d, dv))."""
        return tile_config(self.head_dim, self.head_dim_v, self.arch)

    @property
    def config_v(self) -> TileConfig:
        """The tile configuration whose fragment order dV's accumulator uses."""
        return tile_config(self.tile_head_dim_v, arch=self.arch)

    @property
    def batch_extent(self) -> int:
        return self.dk_accum.shape[0]

    @property
    def num_tiles(self) -> int:
        """dK's tiles per KV head (dV's: ``dv_accum.shape[2]``)."""
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
        return (*(() if self.varlen else (self.batch,)), self.rows, self.num_heads_kv, head_dim)

    def to_dense(self, *, cu_seqlens: torch.Tensor | None = None, seqused: torch.Tensor | None = None,
                 check_inputs: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(dk_dense, dv_dense): the accumulators as row-major fp32 tensors of :meth:`dense_shape`, 0 outside the
        valid rows; varlen needs the ``cu_seqlens`` it was filled with. A testing aid (op gqa_accum_to_dense)."""
        op = "gqa_accum_to_dense"
        if self.varlen and cu_seqlens is None:
            fail(op, "cu_seqlens", "the int32 cu_seqlens the varlen accumulator was filled with", "None")
        if not self.varlen and cu_seqlens is not None:
            fail(op, "cu_seqlens", "None for an accumulator of the batched layout", "a tensor")
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.numel() - 1 != self.batch:
            fail(op, "acc.batch", f"{cu_seqlens.numel() - 1} (cu_seqlens.numel() - 1)", self.batch)
        outs = [torch.zeros(self.dense_shape(d), dtype=torch.float32, device=self.device)
                for d in (self.head_dim, self.head_dim_v)]
        tiles = (self.config.head_dim, self.tile_head_dim_v)  # head_dim names each accumulator's tile
        for i, (accum, out, tile) in enumerate(zip((self.dk_accum, self.dv_accum), outs, tiles)):
            _extension.call_op(op, check_inputs if i == 0 else False, out, accum, out, cu_seqlens=cu_seqlens,
                               seqused=seqused, head_dim=tile, _arch=self.arch)
        return outs[0], outs[1]

    def __repr__(self) -> str:
        sem = "None" if self.semaphores is None else f"int32[{self.semaphores.numel()}]"
        ints = ", ".join(f"{f}={getattr(self, f)}" for f in _CONTEXT)
        return (f"GQAAccumulator(dk_accum=float32{list(self.dk_accum.shape)}, "
                f"dv_accum=float32{list(self.dv_accum.shape)}, semaphores={sem}, {ints}, device={self.device})")


_LEAVES = ("dk_accum", "dv_accum", "semaphores")
_CONTEXT = tuple(f.name for f in fields(GQAAccumulator) if f.name not in _LEAVES)


def _flatten(acc: GQAAccumulator):
    return [getattr(acc, f) for f in _LEAVES], tuple(getattr(acc, f) for f in _CONTEXT)


pytree.register_pytree_node(
    GQAAccumulator, _flatten, lambda leaves, context: GQAAccumulator(*leaves, *context),
    flatten_with_keys_fn=lambda acc: ([(pytree.GetAttrKey(f), getattr(acc, f)) for f in _LEAVES], _flatten(acc)[1]),
    serialized_type_name="flash_epilogue.gqa.GQAAccumulator")


def gqa_accumulator(num_heads_kv: int, head_dim: int, head_dim_v: int | None = None, *,
                    batch: int | None = None, seqlen: int | None = None, cu_seqlens: torch.Tensor | None = None,
                    total_tokens: int | None = None, deterministic: bool | None = None,
                    device: str | int | torch.device | None = None, arch: int = 0) -> GQAAccumulator:
    """A zeroed :class:`GQAAccumulator` for dK (``head_dim``) and dV (``head_dim_v``) of ``num_heads_kv`` KV heads:
    batched (``batch``, ``seqlen``) or varlen (``total_tokens`` and ``cu_seqlens``, only its size read, or ``batch``);
    ``deterministic`` (default: torch.are_deterministic_algorithms_enabled()) becomes gqa_accumulate's default, and on
    the sm_80 path allocates its semaphores; ``device`` (default: cu_seqlens's, else the current CUDA device);
    ``arch`` 80 selects the sm_80 layout (tests). The accumulators are opaque tiles in the order of FA3's dK/dV MMA
    fragment: only the GQA ops read them (:meth:`GQAAccumulator.to_dense` for a dense view)."""
    if _extension._C is None:
        raise _extension.unavailable(_OP)
    num_heads_kv = as_count(_OP, "num_heads_kv", num_heads_kv, "a positive int", 1)
    head_dim = as_int(_OP, "head_dim", head_dim)
    head_dim_v = head_dim if head_dim_v is None else as_int(_OP, "head_dim_v", head_dim_v)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        fail(_OP, "deterministic", "None or a bool", type(deterministic).__name__, FlashEpilogueTypeError)
    arch = as_int(_OP, "arch", arch)
    varlen = cu_seqlens is not None or total_tokens is not None
    if varlen:
        if seqlen is not None:
            fail(_OP, "seqlen", "None in the varlen layout (cu_seqlens/total_tokens given)", seqlen)
        rows = as_count(_OP, "total_tokens", total_tokens, "an int >= 0 (the partials' row count) in the varlen layout")
        if cu_seqlens is not None:  # only its size is read
            if not isinstance(cu_seqlens, torch.Tensor):
                fail(_OP, "cu_seqlens", "a torch.Tensor", type(cu_seqlens).__name__, FlashEpilogueTypeError)
            if cu_seqlens.dtype != torch.int32:
                fail(_OP, "cu_seqlens: dtype", "torch.int32", cu_seqlens.dtype, FlashEpilogueTypeError)
            if cu_seqlens.dim() != 1:
                fail(_OP, "cu_seqlens: rank", "1 dim (batch + 1,)",
                     f"{cu_seqlens.dim()} dims, shape {tuple(cu_seqlens.shape)}")
            n = cu_seqlens.numel() - 1
            if n < 1:
                fail(_OP, "cu_seqlens: numel", "batch + 1 >= 2 (at least one sequence)", cu_seqlens.numel())
            if batch is not None and batch != n:
                fail(_OP, "batch", f"None or {n} (cu_seqlens.numel() - 1)", batch)
            batch = n
        batch = as_count(_OP, "batch", batch, "an int >= 1 (the number of sequences) or cu_seqlens", 1)
    else:
        batch = as_count(_OP, "batch", batch, "an int >= 0")
        rows = as_count(_OP, "seqlen", seqlen, "an int >= 0 (or cu_seqlens and total_tokens for the varlen layout)")
    device = torch.device(device if device is not None else "cuda" if cu_seqlens is None else cu_seqlens.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:  # the one place the accumulator geometry is computed (the ops check against the same function)
        layout = _extension._C.gqa_accum_layout(num_heads_kv, head_dim, head_dim_v, batch, rows, varlen, arch, device)
    except (TypeError, ValueError) as e:
        raise _extension.op_error(_OP, e) from None
    accums = [torch.zeros(tuple(shape), dtype=torch.float32, device=device) for shape in layout["shapes"]]
    # only the sm_80 path orders its adds on semaphores; the sm_90 path is deterministic by construction
    semaphores = torch.zeros(layout["semaphore_numel"], dtype=torch.int32, device=device) \
        if deterministic and layout["semaphore_numel"] else None
    return GQAAccumulator(*accums, semaphores, head_dim, head_dim_v, layout["block_n"], layout["arch"], num_heads_kv,
                          batch, rows, varlen, layout["tile_head_dims"][1], deterministic)
