"""The compiled tile configurations, mirrored from csrc/include/flash_epilogue/bwd_config.h.

FlashAttention-3 picks one dK/dV tile shape per head dim; the order of the GQA accumulator
and the rows one CTA owns depend on it, so Python needs the same table (to size grids and
accumulators, and for tests that hit tile edges). A head dim that is not compiled runs on the
next larger compiled one, with column predicates.
"""
from __future__ import annotations

from dataclasses import dataclass

HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TileConfig:
    head_dim: int  # the compiled head dim (tile width)
    block_n: int  # kBlockN: KV rows per tile
    num_threads: int  # epilogue (MMA) threads per CTA
    swap_ab: bool  # dKV_swapAB: the MMA computes dK^T, the fragment is (head_dim, block_n)
    atom_layout_n: int  # AtomLayoutNdKV: warpgroups along N (along D when swap_ab)
    accum_tile_elems: int = 0  # floats per tile in the GQA accumulator (the C fragment, padding included)

    def __post_init__(self):
        if self.accum_tile_elems == 0:
            object.__setattr__(self, "accum_tile_elems", self.block_n * self.head_dim)


# sm_90 configurations (SPEC.md table), the only arch compiled by default.
SM90_CONFIGS = {
    64: TileConfig(64, 128, 256, False, 2),
    96: TileConfig(96, 128, 256, False, 2),
    128: TileConfig(128, 128, 256, False, 2),
    192: TileConfig(192, 96, 384, True, 1),
    256: TileConfig(256, 80, 256, True, 1),
}

# sm_80 configurations (FA3's Ampere fallback): 8 warps of the 16x8x16 MMA; atom_layout_n is the
# number of warps along N (along D's partner axis when swap_ab, see bwd_config.h).
SM80_CONFIGS = {
    64: TileConfig(64, 128, 256, False, 4),
    96: TileConfig(96, 128, 256, False, 4),
    128: TileConfig(128, 128, 256, False, 2),
    # FA3's sm_80 hdim-192 TiledMma covers N in steps of 32: its fragment pads N = 80 to 96
    192: TileConfig(192, 80, 256, True, 2, accum_tile_elems=96 * 192),
    256: TileConfig(256, 64, 256, False, 2),
}

COMPILED_HEAD_DIMS = tuple(sorted(SM90_CONFIGS))


def tile_config(d: int, dv: int | None = None, arch: int = 90) -> TileConfig:
    """The config that serves head dims (d, dv) on `arch` (90, or 80 for the sm_80 path): the
    smallest compiled head dim >= max(d, dv)."""
    width = max(d, d if dv is None else dv)
    configs = SM80_CONFIGS if arch == 80 else SM90_CONFIGS
    for hd in COMPILED_HEAD_DIMS:
        if width <= hd:
            return configs[hd]
    raise ValueError(f"head dim {width} exceeds the largest compiled head dim {COMPILED_HEAD_DIMS[-1]}")


def gqa_accum_shape(batch: int, rows: int, num_heads_kv: int, d: int, dv: int | None = None, *, arch: int = 90,
                    varlen: bool = False) -> tuple[int, int, int, int]:
    """Shape (batch_extent, h_k, num_tiles, tile_elems) of each GQA accumulator (dK's and dV's agree).

    The tile is the C fragment of the config serving max(d, dv) on `arch` (90, or 80 for the sm_80
    path). Batched: one tile row per (batch, ceil(seqlen / kBlockN) tiles), `rows` = seqlen.
    Varlen (`rows` = total tokens, `batch` = cu_seqlens.numel() - 1): batch_extent 1 and
    (total + batch * kBlockN) // kBlockN tiles, enough for every sequence to start at its
    kBlockN-aligned offset_padded = ((cu_seqlens[b] + b * kBlockN) // kBlockN) * kBlockN.
    """
    cfg = tile_config(d, dv, arch)
    n = cfg.block_n
    if varlen:
        return (1, num_heads_kv, (rows + batch * n) // n, cfg.accum_tile_elems)
    return (batch, num_heads_kv, -(-rows // n), cfg.accum_tile_elems)


def gqa_semaphore_numel(accum_shape: tuple[int, ...]) -> int:
    """int32 entries of the deterministic-mode workspace of accumulators of `accum_shape`: one
    counter for dK and one for dV per (tile, KV head), plus one for the kernel's own use (a ticket)."""
    batch_extent, num_heads_kv, num_tiles = accum_shape[0], accum_shape[1], accum_shape[2]
    return 2 * batch_extent * num_tiles * num_heads_kv + 1
