"""The compiled tile configurations, as _C exports the C++ table (csrc/kernels/config_table.cu): one dK/dV tile per
head dim, as FA3 picks it (it fixes the GQA accumulator's order); other head dims run on the next larger one."""
from dataclasses import dataclass, fields

from . import _extension
from .errors import fail


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


# {(arch, head_dim): TileConfig}; empty without the extension (or with a stale one).
_TABLE = {(c["arch"], c["head_dim"]): TileConfig(**{f.name: c[f.name] for f in fields(TileConfig)})
          for c in getattr(_extension._C, "tile_configs", tuple)()}

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
