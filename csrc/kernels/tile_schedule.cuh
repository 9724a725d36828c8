#pragma once

// Which tile a CTA works on, and the prologue every driver runs on it: row tile -> (n_block,
// batch) -> SeqlenInfo -> valid rows (locate_row_tile, the one definition).
//
// Row tiles: batched, tile `tile` of sequence `batch_z`. Varlen: tile `tile` of the kBlockN-aligned
// padded tile space (SeqlenInfo::offset_padded): sequence b owns padded tiles [offset_padded(b) /
// kBlockN, ...), so grids are sized from shapes alone (no host read of cu_seqlens) and each tile
// finds its sequence by binary search. Padded tiles past a sequence's end have no valid rows.

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "flash_epilogue/seqlen_info.h"

namespace flash_epilogue {

template <int kBlockN>
CUTLASS_DEVICE cute::tuple<int, int> tile_to_block_and_batch(int tile, int batch_z, int batch,
                                                             int const* cu_seqlens) {
  if (cu_seqlens == nullptr) { return {tile, batch_z}; }
  // first_padded_tile never forms cu_seqlens[b] + b * kBlockN (which passes 2^31 near the int32
  // limit, for valid inputs too); it and tile - first_tile for a tile of the grid (tile < 2^31 /
  // kBlockN + batch) are ints in range. Bad contents make n_block negative or past the sequence:
  // SeqlenInfo::valid_rows gives such tiles no rows.
  auto first_tile = [&](int b) { return SeqlenInfo<kBlockN>::first_padded_tile(b, cu_seqlens); };
  int lo = 0, hi = batch - 1;  // the last b with first_tile(b) <= tile
  while (lo < hi) {
    int const mid = (lo + hi + 1) / 2;
    if (first_tile(mid) <= tile) { lo = mid; } else { hi = mid - 1; }
  }
  return {tile - first_tile(lo), lo};
}

// Row tiles per head (grid sizes; locate_output_tile splits its grid by it): batched, of `rows`;
// varlen, of the padded tile space. Below 2^31 / 64 + 65536 for rows < 2^31.
template <int kBlockN>
CUTLASS_HOST_DEVICE int64_t row_tiles(int64_t rows, int batch, bool varlen) {
  return varlen ? rows / kBlockN + batch : (rows + kBlockN - 1) / kBlockN;
}

// A row tile located: its n_block and sequence, where the sequence lies and how many of the tile's
// rows may be written. valid_rows <= 0: nothing to do (the driver returns, or skips the tile).
template <int kBlockN>
struct RowTile {
  int n_block;
  int batch;
  SeqlenInfo<kBlockN> seqlen_info;
  int valid_rows;
};

// The drivers' prologue. shape: the tensor's (rows, ...), rows its row extent (seqlen, or total
// tokens in varlen); seq: what holds cu_seqlens and seqused (a collective's or driver's Params).
template <int kBlockN, class Shape, class Seq>
CUTLASS_DEVICE RowTile<kBlockN> locate_row_tile(int tile, int batch_z, int batch, Shape const& shape,
                                                Seq const& seq) {
  auto const [n_block, b] = tile_to_block_and_batch<kBlockN>(tile, batch_z, batch, seq.cu_seqlens);
  int const rows = cute::get<0>(shape);
  SeqlenInfo<kBlockN> const seqlen_info{b, rows, seq.cu_seqlens, seq.seqused};
  return {n_block, b, seqlen_info, seqlen_info.valid_rows(n_block, rows)};
}

// Drivers split the work by output tensor: a CTA handles dK *or* dV of one (n_block, head, batch)
// tile (one-CTA-per-tile grids: see locate_output_tile). Holding one fp32 fragment instead of two
// halves the registers, so two CTAs fit on an SM and one streams its loads while the other stores
// (with both fragments a CTA needs ~150 registers at hdim 128: one CTA per SM, loads and stores
// never overlap). The collective is called with its optional dV left null.
struct TensorAndHead {
  int tensor;  // 0: dK, 1: dV
  int head;
};

// An index over dK's items then dV's (`per_tensor` each) -> (tensor, index within its tensor), in int, or
// in int64_t (split_by_tensor<int64_t>) where 2 * per_tensor may pass 2^31.
template <class Index>
struct TensorSplit {
  int tensor;  // 0: dK, 1: dV
  Index index;
};
template <class Index = int>
CUTLASS_DEVICE TensorSplit<Index> split_by_tensor(std::type_identity_t<Index> index,
                                                  std::type_identity_t<Index> per_tensor) {
  int const tensor = index >= per_tensor ? 1 : 0;
  return {tensor, index - tensor * per_tensor};
}

// A row tile of one output (tensor, head) of a driver over dK and dV; output_tile locates tile
// `tile` (sequence batch_z) of output `out` from a driver's Params (tensors[2].epilogue, batch).
template <int kBlockN>
struct OutputTile : TensorAndHead, RowTile<kBlockN> {};

template <int kBlockN, class Params>
CUTLASS_DEVICE OutputTile<kBlockN> output_tile(Params const& params, TensorAndHead out, int tile, int batch_z) {
  auto const& ep = params.tensors[out.tensor].epilogue;
  return {out, locate_row_tile<kBlockN>(tile, batch_z, params.batch, ep.shape_dK, ep)};
}

// The grid of a one-CTA-per-tile driver over `count` outputs (dK, dV) of `heads` heads:
// (count * row tiles, heads, batch extent), blockIdx.x = tensor * row tiles + tile. The output
// tensor goes into x, not y: gridDim.y and z hold at most 65535, and heads up to 65535 must launch
// (2 * heads in y did not); x holds 2^31 - 1, far above 2 * row_tiles. Tiles stay fastest, heads and
// batch keep their dims (a tensor's tiles of one head still run together); only dK's and dV's tiles
// of a head are neighbours. No order between the outputs is relied on: each CTA reads and writes its
// own tile. This CTA's tile; thread 0 also prefetches that output's TMA descriptor.
// Params: tensors[2].epilogue (tensors[0] always set), batch.
template <int kBlockN, class Epilogue, class Params>
CUTLASS_DEVICE OutputTile<kBlockN> locate_output_tile(Params const& params) {
  auto const& ep = params.tensors[0].epilogue;
  bool const varlen = ep.cu_seqlens != nullptr;
  int const tiles = static_cast<int>(row_tiles<kBlockN>(cute::get<0>(ep.shape_dK), params.batch, varlen));
  auto const [tensor, tile] = split_by_tensor(blockIdx.x, tiles);
  TensorAndHead const out{tensor, static_cast<int>(blockIdx.y)};
  if (threadIdx.x == 0) { Epilogue::prefetch_tma_descriptors(params.tensors[out.tensor].epilogue); }
  return output_tile<kBlockN>(params, out, tile, blockIdx.z);
}

}  // namespace flash_epilogue
