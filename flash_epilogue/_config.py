"""The compiled tile configurations, as the C++ table (csrc/kernels/config_table.cu) exports them.

FlashAttention-3 picks one dK/dV tile shape per head dim; the order of the GQA accumulator and the rows one
CTA owns depend on it (tests that hit tile edges read it here). A head dim that is not compiled runs on the
next larger compiled one, with column predicates.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import _extension


@dataclass(frozen=True)
class TileConfig:
    head_dim: int  # the compiled head dim (tile width)
    block_n: int  # kBlockN: KV rows per tile
    num_threads: int  # epilogue (MMA) threads per CTA
    swap_ab: bool  # dKV_swapAB: the MMA computes dK^T, the fragment is (head_dim, block_n)
    atom_layout_n: int  # AtomLayoutNdKV: warpgroups (sm_80: warps) along N (along D when swap_ab)
    accum_tile_elems: int  # floats per tile in the GQA accumulator (the C fragment, padding included)
    arch: int  # the code path: 90 (sm_90 collectives) or 80 (the sm_80 ones)


# {(arch, head_dim): TileConfig}, read once from _C; empty without the extension (or with a stale one).
_TABLE = {(c["arch"], c["head_dim"]): TileConfig(**{k: c[k] for k in TileConfig.__dataclass_fields__})
          for c in getattr(_extension._C, "tile_configs", tuple)()}

COMPILED_HEAD_DIMS: tuple[int, ...] = tuple(sorted({hd for _, hd in _TABLE}))


def tile_config(d: int, dv: int | None = None, arch: int = 90) -> TileConfig:
    """The config that serves head dims (d, dv) on `arch` (90, or 80 for the sm_80 path): the smallest
    compiled head dim >= max(d, dv)."""
    if not _TABLE:
        raise _extension.unavailable("tile_config")
    width = max(d, d if dv is None else dv)
    path = 80 if arch == 80 else 90
    for hd in COMPILED_HEAD_DIMS:
        if width <= hd:
            return _TABLE[(path, hd)]
    raise ValueError(f"head dim {width} exceeds the largest compiled head dim {COMPILED_HEAD_DIMS[-1]}")
