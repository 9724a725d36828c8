#pragma once

// The `store_zero` driver: zeros a row window of chosen (sequence, head) pairs. Grid (tiles, heads, sequences
// selected): the padded tile space when varlen selects every sequence, else the window's tiles.

#include <cute/tensor.hpp>

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/epilogue_bwd.h"
#include "tile_schedule.cuh"

namespace flash_epilogue {

template <class Config_, class Element_, class ArchTag_>
struct StoreZeroKernel {
  using Config = Config_;
  using Element = Element_;
  using ArchTag = ArchTag_;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kNumThreads = Config::kNumThreads;
  static constexpr int kMinBlocksPerSm = 1;
  using TileShape_MNK = cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  // Sm80 on every arch: store_zero is predicated anyway, and no TMA descriptors to encode.
  using Epilogue = CollectiveEpilogueBwd<TileShape_MNK, Element, cutlass::arch::Sm80, kNumThreads, /*Varlen=*/true,
                                         Config::kSwapAB, Config::kAtomLayoutKdKV>;

  struct Params {
    typename Epilogue::Params epilogue;
    int batch;
    int num_heads;
    int const* batch_idx;  // null: blockIdx.z is the sequence
    int const* head_idx;   // null: blockIdx.y is the head
    int row_begin;
    int row_end;
    int first_block;       // tile of row_begin (selection grids start there)
    bool padded_tiles;     // varlen, every sequence: blockIdx.x is a padded tile
  };

  static constexpr int kSharedStorageSize = 0;

  CUTLASS_DEVICE void operator()(Params const& params, char* /*smem*/) const {
    int const bidb_sel = blockIdx.z;
    int const bidh = params.head_idx ? params.head_idx[blockIdx.y] : static_cast<int>(blockIdx.y);
    if (bidh < 0 || bidh >= params.num_heads) { return; }
    int n_block, bidb;
    if (params.padded_tiles) {
      auto const [nb, b] =
          tile_to_block_and_batch<kBlockN>(blockIdx.x, blockIdx.z, params.batch, params.epilogue.cu_seqlens);
      n_block = nb;
      bidb = b;
    } else {
      n_block = params.first_block + static_cast<int>(blockIdx.x);
      bidb = params.batch_idx ? params.batch_idx[bidb_sel] : bidb_sel;
    }
    if (bidb < 0 || bidb >= params.batch) { return; }
    Epilogue{}.store_zero(params.epilogue, threadIdx.x, cute::make_tuple(n_block, bidh, bidb), params.row_begin,
                          params.row_end);
  }
};

}  // namespace flash_epilogue
