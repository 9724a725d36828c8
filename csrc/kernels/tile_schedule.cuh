#pragma once

// Which tile a CTA works on: row tile -> (n_block, batch) -> SeqlenInfo -> valid rows. Varlen tiles index
// the padded tile space (SeqlenInfo::offset_padded), so grids are sized from shapes alone and each tile
// finds its sequence by binary search; padded tiles past a sequence's end have no valid rows.

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cute/tensor.hpp>

#include "flash_epilogue/seqlen_info.h"
#include "geometry.h"

namespace flash_epilogue {

template <int kBlockN>
CUTLASS_DEVICE cute::tuple<int, int> tile_to_block_and_batch(int tile, int batch_z, int batch,
                                                             int const* cu_seqlens) {
  if (cu_seqlens == nullptr) { return {tile, batch_z}; }
  // Every value here is an int in range (first_padded_tile never wraps). Bad contents make n_block
  // negative or past the sequence: valid_rows gives such tiles no rows.
  auto first_tile = [&](int b) { return SeqlenInfo<kBlockN>::first_padded_tile(b, cu_seqlens); };
  int lo = 0, hi = batch - 1;  // the last b with first_tile(b) <= tile
  while (lo < hi) {
    int const mid = (lo + hi + 1) / 2;
    if (first_tile(mid) <= tile) { lo = mid; } else { hi = mid - 1; }
  }
  return {tile - first_tile(lo), lo};
}

// A row tile located. valid_rows <= 0: nothing to do.
template <int kBlockN>
struct RowTile {
  int n_block;
  int batch;
  SeqlenInfo<kBlockN> seqlen_info;
  int valid_rows;
};

// shape: the tensor's (rows, ...); seq: what holds cu_seqlens and seqused.
template <int kBlockN, class Shape, class Seq>
CUTLASS_DEVICE RowTile<kBlockN> locate_row_tile(int tile, int batch_z, int batch, Shape const& shape,
                                                Seq const& seq) {
  auto const [n_block, b] = tile_to_block_and_batch<kBlockN>(tile, batch_z, batch, seq.cu_seqlens);
  int const rows = cute::get<0>(shape);
  SeqlenInfo<kBlockN> const seqlen_info{b, rows, seq.cu_seqlens, seq.seqused};
  return {n_block, b, seqlen_info, seqlen_info.valid_rows(n_block, rows)};
}

// A CTA handles dK *or* dV of a tile: one fp32 fragment instead of two halves the registers, so two CTAs
// fit on an SM and one loads while the other stores. The collective is called with dV left null.
struct TensorAndHead {
  int tensor;  // 0: dK, 1: dV
  int head;
};

// An index over dK's items then dV's (`per_tensor` each) -> (tensor: 0 dK, 1 dV; index within it).
template <class Index = int>
CUTLASS_DEVICE std::pair<int, Index> split_by_tensor(std::type_identity_t<Index> index,
                                                     std::type_identity_t<Index> per_tensor) {
  int const tensor = index >= per_tensor ? 1 : 0;
  return {tensor, index - tensor * per_tensor};
}

// A row tile of output (tensor, head); output_tile locates it from a driver's Params.
template <int kBlockN>
struct OutputTile : TensorAndHead, RowTile<kBlockN> {};

template <int kBlockN, class Params>
CUTLASS_DEVICE OutputTile<kBlockN> output_tile(Params const& params, TensorAndHead out, int tile, int batch_z) {
  auto const& ep = params.tensors[out.tensor].epilogue;
  return {out, locate_row_tile<kBlockN>(tile, batch_z, params.geometry.batch, ep.shape_dK, ep)};
}

// This CTA's tile in a one-CTA-per-tile grid (count * row tiles, heads, batch extent), blockIdx.x =
// tensor * row tiles + tile: the tensor goes into x because gridDim.y holds at most 65535, and 65535
// heads must launch. Thread 0 prefetches that output's TMA descriptor.
template <int kBlockN, class Epilogue, class Params>
CUTLASS_DEVICE OutputTile<kBlockN> locate_output_tile(Params const& params) {
  auto const& ep = params.tensors[0].epilogue;
  int const tiles = static_cast<int>(params.geometry.row_tiles(kBlockN));
  auto const [tensor, tile] = split_by_tensor(blockIdx.x, tiles);
  TensorAndHead const out{tensor, static_cast<int>(blockIdx.y)};
  if (threadIdx.x == 0) { Epilogue::prefetch_tma_descriptors(params.tensors[out.tensor].epilogue); }
  return output_tile<kBlockN>(params, out, tile, blockIdx.z);
}

}  // namespace flash_epilogue
