#pragma once

// `store_zero`: zeros a row window of chosen (sequence, head) pairs. Grid (tiles, heads, sequences selected):
// the padded tile space when varlen selects every sequence, else the window's tiles.

#include <cute/tensor.hpp>

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/epilogue_bwd.h"
#include "geometry.h"
#include "launch_args.h"
#include "launch_common.cuh"
#include "tile_schedule.cuh"

namespace flash_epilogue {

template <class Config, class Element_, class ArchTag_>
struct StoreZeroKernel {
  using Element = Element_;
  using ArchTag = ArchTag_;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNumThreads = Config::kNumThreads;
  static constexpr int kMinBlocksPerSm = kStoreZeroCtasPerSm;
  static constexpr int kSharedStorageSize = 0;
  using TileShape_MNK = cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<Config::kHeadDim>>;
  // Sm80 on every arch: store_zero is predicated anyway, and no TMA descriptors to encode.
  using Epilogue = CollectiveEpilogueBwd<TileShape_MNK, Element, cutlass::arch::Sm80, kNumThreads, /*Varlen=*/true,
                                         Config::kSwapAB, Config::kAtomLayoutKdKV>;

  struct Params {
    typename Epilogue::Params epilogue;
    Geometry geometry;
    int const* batch_idx;  // null: blockIdx.z is the sequence
    int const* head_idx;   // null: blockIdx.y is the head
    int row_start;
    int row_end;
    int first_block;    // tile of row_start (selection grids start there)
    bool padded_tiles;  // varlen, every sequence: blockIdx.x is a padded tile
  };

  CUTLASS_DEVICE void operator()(Params const& params, char* /*smem*/) const {
    Geometry const& g = params.geometry;
    int const bidb_sel = blockIdx.z;
    int const bidh = params.head_idx ? params.head_idx[blockIdx.y] : static_cast<int>(blockIdx.y);
    if (bidh < 0 || bidh >= g.num_heads_kv) { return; }
    int n_block, bidb;
    if (params.padded_tiles) {
      auto const [nb, b] = tile_to_block_and_batch<kBlockN>(blockIdx.x, blockIdx.z, g.batch, g.cu_seqlens);
      n_block = nb;
      bidb = b;
    } else {
      n_block = params.first_block + static_cast<int>(blockIdx.x);
      bidb = params.batch_idx ? params.batch_idx[bidb_sel] : bidb_sel;
    }
    if (bidb < 0 || bidb >= g.batch) { return; }
    Epilogue{}.store_zero(params.epilogue, threadIdx.x, cute::make_tuple(n_block, bidh, bidb), params.row_start,
                          params.row_end);
  }
};

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_store_zero(StoreZeroLaunchArgs const& args, cudaStream_t stream) {
  using Element = element_of<kDType>;
  using Config = BwdTileConfig<kHeadDim, arch_tag_of<kArch>>;
  using Kernel = StoreZeroKernel<Config, Element, arch_tag_of<kArch>>;
  using Epilogue = typename Kernel::Epilogue;
  constexpr int kBlockN = Config::kBlockN;
  if (char const* why = plan_mismatch(args.plan, Driver::kOneCtaPerTile, kBlockN, Kernel::kMinBlocksPerSm)) {
    return why;
  }
  Geometry const& g = args.geometry;
  auto const ep_args = epilogue_arguments<Epilogue, Element>(args.dk, args.dv, g);
  if (char const* why = Epilogue::can_implement(ep_args)) { return why; }

  if (args.row_end <= args.row_start) { return nullptr; }
  int const num_sel_batch = args.batch_idx ? args.num_batch_idx : g.batch;
  int const num_sel_heads = args.head_idx ? args.num_head_idx : g.num_heads_kv;
  bool const padded_tiles = g.varlen && args.batch_idx == nullptr;
  int const first_block = args.row_start / kBlockN;
  int const num_tiles = padded_tiles ? static_cast<int>(g.row_tiles(kBlockN))
                                     : (args.row_end + kBlockN - 1) / kBlockN - first_block;
  if (num_tiles <= 0 || num_sel_heads <= 0 || num_sel_batch <= 0) { return nullptr; }

  typename Kernel::Params const params{Epilogue::to_underlying_arguments(ep_args), g, args.batch_idx, args.head_idx,
                                       args.row_start, args.row_end, first_block, padded_tiles};
  dim3 const grid(num_tiles, num_sel_heads, padded_tiles ? 1 : num_sel_batch);
  return launch_kernel<Kernel>(grid, params, stream);
}

}  // namespace flash_epilogue
