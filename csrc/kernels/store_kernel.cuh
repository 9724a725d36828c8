#pragma once

// The one-CTA-per-tile `store` driver (sm_80; sm_90 where launch_store chooses it): the CTA loads the
// fp32 dK or dV of its tile straight into the C fragment, as the mainloop would leave it, and hands it to
// CollectiveEpilogueBwd::store. store_output_tile is also the body of the GQA one-tile-per-CTA drivers.

#include <cute/tensor.hpp>
#include <cutlass/arch/arch.h>

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/epilogue_bwd.h"
#include "tile_io.cuh"
#include "tile_schedule.cuh"

namespace flash_epilogue {

template <class Config, class Element_, class ArchTag_, bool kVarlen>  // kVarlen: cu_seqlens and/or seqused given
struct StoreKernel {
  using Element = Element_;
  using ArchTag = ArchTag_;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kNumThreads = Config::kNumThreads;
  static constexpr int kMinBlocksPerSm = 2;
  using TiledMmaConfig = BwdTiledMma<Config, Element, ArchTag>;
  using TiledMma = typename TiledMmaConfig::TiledMma;
  static_assert(cute::size(TiledMma{}) == kNumThreads, "the TiledMma must span exactly the epilogue threads");
  using TileShape_MNK = cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using Epilogue = CollectiveEpilogueBwd<TileShape_MNK, Element, ArchTag, kNumThreads, kVarlen, Config::kSwapAB,
                                         Config::kAtomLayoutKdKV>;

  struct TensorParams {
    typename Epilogue::Params epilogue;  // this output as the collective's dK, no dV
    float const* ptr_accum;
    typename Epilogue::StridedKV stride_accum;  // (rows, d, head, batch)
  };

  struct Params {
    TensorParams tensors[2];  // dK, dV
    int num_heads;
    int batch;
  };

  static constexpr int kSharedStorageSize = sizeof(typename Epilogue::TensorStorage);

  // This CTA's tile, its fragment filled by fill(frag, thr_mma, work, tile) (false: nothing to store),
  // then stored by the collective. DriverParams: tensors[2] with .epilogue, batch.
  template <class DriverParams, class Fill>
  CUTLASS_DEVICE static void store_output_tile(DriverParams const& params, char* smem, Fill&& fill) {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    auto const tile = locate_output_tile<kBlockN, Epilogue>(params);
    if (tile.valid_rows <= 0) { return; }  // whole CTA: padded varlen tile or empty sequence
    auto const& work = params.tensors[tile.tensor];

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor frag = partition_fragment_C(tiled_mma, typename TiledMmaConfig::FragmentTileShape{});
    if (!fill(frag, thr_mma, work, tile)) { return; }
    auto& storage = *reinterpret_cast<typename Epilogue::TensorStorage*>(smem);
    Epilogue{}.store(work.epilogue, frag, frag, storage, tiled_mma, thread_idx,
                     make_tuple(tile.n_block, tile.head, tile.batch));
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    auto fill = [](auto& frag, auto const& thr_mma, TensorParams const& work, auto const& tile) {
      auto const& ep = work.epilogue;
      auto const gtile = rows_tile<kBlockN, kHeadDim>(work.ptr_accum, ep.shape_dK, work.stride_accum, tile.head,
                                                      ep.cu_seqlens ? 0 : tile.batch, tile.seqlen_info.offset,
                                                      tile.n_block);  // (BLK_N, BLK_D)
      load_accum_tile<Config::kSwapAB, kBlockN, kHeadDim>(frag, thr_mma, gtile, tile.valid_rows,
                                                          cute::get<1>(ep.shape_dK));
      return true;
    };
    store_output_tile(params, smem, fill);
  }
};

}  // namespace flash_epilogue
