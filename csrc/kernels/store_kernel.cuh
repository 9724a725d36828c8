#pragma once

// What the drivers writing 16-bit outputs share: a traits type per tile configuration, and the body of a
// one-CTA-per-tile driver. StoreKernel is `store`'s (sm_80; sm_90 where the plan picks it): the CTA loads the fp32
// dK or dV of its tile straight into the C fragment, as the mainloop would leave it, and hands it to
// CollectiveEpilogueBwd::store.

#include <cute/tensor.hpp>
#include <cutlass/arch/arch.h>

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/epilogue_bwd.h"
#include "geometry.h"
#include "launch_plan.h"
#include "tile_io.cuh"
#include "tile_schedule.cuh"

namespace flash_epilogue {

// A tile configuration as a driver writing Element outputs takes it: FA3's dK/dV TiledMma (only its C layout is
// used: no MMA is issued), the tile its fragment covers, and the collective that stores it (kVarlen: rows
// predicated per sequence).
template <class Config_, class Element_, class ArchTag_, bool kVarlen_>
struct OutputTileTraits {
  using Config = Config_;
  using Element = Element_;
  using ArchTag = ArchTag_;
  static constexpr bool kVarlen = kVarlen_;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kNumThreads = Config::kNumThreads;
  using TiledMmaConfig = BwdTiledMma<Config, Element, ArchTag>;
  using TiledMma = typename TiledMmaConfig::TiledMma;
  using FragmentTileShape = typename TiledMmaConfig::FragmentTileShape;
  static_assert(cute::size(TiledMma{}) == kNumThreads, "the TiledMma must span exactly the epilogue threads");
  using TileShape_MNK = cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using Epilogue = CollectiveEpilogueBwd<TileShape_MNK, Element, ArchTag, kNumThreads, kVarlen, Config::kSwapAB,
                                         Config::kAtomLayoutKdKV>;
};

// The body of a one-CTA-per-tile driver: this CTA's tile (locate_output_tile), its fragment filled by
// fill(frag, thr_mma, tensor_params, tile) (false: nothing to store), then stored by the collective.
// DriverParams: tensors[2] with .epilogue, and geometry.
template <class Traits, class DriverParams, class Fill>
CUTLASS_DEVICE void store_output_tile(DriverParams const& params, char* smem, Fill&& fill) {
  using namespace cute;
  using Epilogue = typename Traits::Epilogue;
  int const thread_idx = threadIdx.x;
  auto const tile = locate_output_tile<Traits::kBlockN, Epilogue>(params);
  if (tile.valid_rows <= 0) { return; }  // whole CTA: padded varlen tile or empty sequence
  auto const& work = params.tensors[tile.tensor];

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
  Tensor frag = partition_fragment_C(tiled_mma, typename Traits::FragmentTileShape{});
  if (!fill(frag, thr_mma, work, tile)) { return; }
  auto& storage = *reinterpret_cast<typename Epilogue::TensorStorage*>(smem);
  Epilogue{}.store(work.epilogue, frag, frag, storage, tiled_mma, thread_idx,
                   make_tuple(tile.n_block, tile.head, tile.batch));
}

// The launch code reads the traits' Element, ArchTag, kBlockN and kNumThreads through the kernel (its base).
template <class Traits>
struct StoreKernel : Traits {
  using Epilogue = typename Traits::Epilogue;
  static constexpr int kMinBlocksPerSm = kStoreTileCtasPerSm;

  struct TensorParams {
    typename Epilogue::Params epilogue;  // this output as the collective's dK, no dV
    float const* ptr_accum;
    typename Epilogue::StridedKV stride_accum;  // (rows, d, head, batch)
  };

  struct Params {
    TensorParams tensors[2];  // dK, dV
    Geometry geometry;
  };

  static constexpr int kSharedStorageSize = sizeof(typename Epilogue::TensorStorage);

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    auto fill = [](auto& frag, auto const& thr_mma, TensorParams const& work, auto const& tile) {
      auto const& ep = work.epilogue;
      constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
      auto const gtile = rows_tile<kBlockN, kHeadDim>(work.ptr_accum, ep.shape_dK, work.stride_accum, tile.head,
                                                      ep.cu_seqlens ? 0 : tile.batch, tile.seqlen_info.offset,
                                                      tile.n_block);  // (BLK_N, BLK_D)
      load_accum_tile<Traits::Config::kSwapAB, kBlockN, kHeadDim>(frag, thr_mma, gtile, tile.valid_rows,
                                                                  cute::get<1>(ep.shape_dK));
      return true;
    };
    store_output_tile<Traits>(params, smem, fill);
  }
};

}  // namespace flash_epilogue
