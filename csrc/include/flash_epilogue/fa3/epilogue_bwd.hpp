#pragma once

// A drop-in for FA3's hopper/epilogue_bwd.hpp (FA3's template parameters, Arguments and store) implemented
// with flash_epilogue's collectives; see docs/collectives.md. Where it differs from FA3's own epilogue:
//   * Deterministic GQA: the next member may add only once this member's bulk reduce-add has completed in
//     global memory (FA3 waits only for the smem read, so the next add may overtake it). store_zero takes
//     its turn. The counters are FA3's (CounterOrder::kSequenceBlock), inside the allocation FA3 makes.
//   * MHA: the store's start and its TMA hand-off use barrier ids 1 and 2 (FA3 syncs id 1 at two thread
//     counts). FA3's backward uses ids 1 (its epilogue), 4-5 (scheduler) and 9-15 (mainloop): 2 is free.
//   * Varlen MHA on sm_90: tiles inside their sequence go out by TMA (FA3: all predicated). Same bits.
//   * Host: to_underlying_arguments throws std::invalid_argument with can_implement's reason instead of
//     launching arguments the collectives cannot run.
//   * cu_seqlens / seqused are ignored when Varlen is false, as in FA3.

#include <stdexcept>
#include <string>
#include <type_traits>

#include <cute/tensor.hpp>

#include "flash_epilogue/epilogue_bwd.h"
#include "flash_epilogue/epilogue_bwd_gqa.h"

namespace flash {

namespace fa3_compat {

// Named barrier ids inside FA3's backward (see above).
inline constexpr int kMhaBarrierId = 1;  // and kMhaBarrierId + 1 for the TMA hand-off
inline constexpr int kGqaBarrierId = 1;

inline void require(char const* why, char const* collective) {
  if (why != nullptr) { throw std::invalid_argument(std::string("flash_epilogue ") + collective + ": " + why); }
}

// FA3's kernels pass their whole SharedStorage to store; the epilogue's part is tensors.epilogue.
template <class Collective>
struct StoreFromSharedStorage : Collective {
  template <class SharedStorage, class FrgTensor, class TiledMma>
  CUTLASS_DEVICE void store(typename Collective::Params const& params, FrgTensor const& tdKrdK,
                            FrgTensor const& tdVrdV, SharedStorage& shared_storage, TiledMma const& tiled_mma,
                            int thread_idx, cute::tuple<int32_t, int32_t, int32_t> const& block_coord) const {
    Collective::store(params, tdKrdK, tdVrdV, shared_storage.tensors.epilogue, tiled_mma, thread_idx, block_coord);
  }
};

}  // namespace fa3_compat

// dK/dV of MHA: fp32 fragments -> Element (bf16/fp16) tiles in global memory.
template <class TileShape_MNK_, class Element_, class ArchTag_, int NumEpilogueThreads_, bool Varlen_, bool dKV_swapAB_,
          int AtomLayoutKdKV = 1>
struct CollectiveEpilogueBwd
    : fa3_compat::StoreFromSharedStorage<flash_epilogue::CollectiveEpilogueBwd<
          TileShape_MNK_, Element_, ArchTag_, NumEpilogueThreads_, Varlen_, dKV_swapAB_, AtomLayoutKdKV,
          fa3_compat::kMhaBarrierId>> {
  using Base = flash_epilogue::CollectiveEpilogueBwd<TileShape_MNK_, Element_, ArchTag_, NumEpilogueThreads_, Varlen_,
                                                     dKV_swapAB_, AtomLayoutKdKV, fa3_compat::kMhaBarrierId>;
  using typename Base::Element;
  using typename Base::Params;
  using typename Base::ShapedKV;   // (seqlen_k or total_k, d, head, batch)
  using typename Base::StridedKV;  // (row, _1, head, batch)

  // FA3's fields, in its order. num_batch, num_heads_q and the semaphores are GQA's; unused here.
  struct Arguments {
    Element* ptr_dK;
    ShapedKV shape_dK;
    StridedKV stride_dK;
    Element* ptr_dV;
    ShapedKV shape_dV;
    StridedKV stride_dV;
    int num_batch;
    int num_heads_q;
    int* dk_semaphore;
    int* dv_semaphore;
    int const* cu_seqlens;
    int const* seqused;
  };

  static typename Base::Arguments collective_arguments(Arguments const& args) {
    return {args.ptr_dK, args.shape_dK, args.stride_dK, args.ptr_dV, args.shape_dV, args.stride_dV,
            Varlen_ ? args.cu_seqlens : nullptr, Varlen_ ? args.seqused : nullptr};
  }

  static char const* can_implement(Arguments const& args) { return Base::can_implement(collective_arguments(args)); }

  static Params to_underlying_arguments(Arguments const& args) {
    fa3_compat::require(can_implement(args), "CollectiveEpilogueBwd");
    return Base::to_underlying_arguments(collective_arguments(args));
  }
};

// dK/dV of GQA into FA3's fp32 accumulators: (seqlen_k_rounded * d_rounded, h_k, batch) floats, strides
// (1, head, batch), kBlockN * kHeadDim tiles in the fragment order FA3's postprocess reads (ours).
template <class TileShape_MNK_, class ElementAccum, class ArchTag_, int NumEpilogueThreads_, bool Varlen_,
          bool Deterministic_>
struct CollectiveEpilogueBwdGQA
    : fa3_compat::StoreFromSharedStorage<flash_epilogue::CollectiveEpilogueBwdGQA<
          TileShape_MNK_, ArchTag_, NumEpilogueThreads_,
          cute::get<1>(TileShape_MNK_{}) * cute::get<2>(TileShape_MNK_{}), fa3_compat::kGqaBarrierId>> {
  using Base = flash_epilogue::CollectiveEpilogueBwdGQA<TileShape_MNK_, ArchTag_, NumEpilogueThreads_,
                                                        cute::get<1>(TileShape_MNK_{}) * cute::get<2>(TileShape_MNK_{}),
                                                        fa3_compat::kGqaBarrierId>;
  static_assert(std::is_same_v<ElementAccum, float>, "the GQA accumulators are fp32");
  using typename Base::Params;
  using Element = ElementAccum;
  static constexpr bool Varlen = Varlen_;
  static constexpr bool Deterministic = Deterministic_;

  using ShapedKV = cute::Shape<int32_t, int32_t, int32_t>;     // (seqlen_k_rounded * d_rounded, head_k, batch)
  using StridedKV = cute::Stride<cute::_1, int64_t, int64_t>;  // batch stride 0 in varlen

  struct Arguments {
    ElementAccum* ptr_dKaccum;
    ShapedKV shape_dKaccum;
    StridedKV stride_dKaccum;
    ElementAccum* ptr_dVaccum;
    ShapedKV shape_dVaccum;
    StridedKV stride_dVaccum;
    int num_batch;
    int num_heads_q;
    int* dk_semaphore;  // Deterministic: FA3's zeroed (ceil(max_seqlen_k / kBlockN), batch, h_k) int32 counters
    int* dv_semaphore;
    int const* cu_seqlens;
    int const* seqused;
  };

  static constexpr int kTileElems = Base::kAccumTileElems;  // kBlockN * kHeadDim: FA3's tile

  static typename Base::Arguments collective_arguments(Arguments const& args) {
    int const num_tiles = cute::get<0>(args.shape_dKaccum) / kTileElems;
    typename Base::Arguments a{args.ptr_dKaccum, args.ptr_dVaccum, cute::get<1>(args.stride_dKaccum),
                               cute::get<2>(args.stride_dKaccum), num_tiles, cute::get<2>(args.shape_dKaccum),
                               args.num_heads_q, cute::get<1>(args.shape_dKaccum), num_tiles * Base::kBlockN,
                               nullptr, nullptr, Varlen_ ? args.cu_seqlens : nullptr, Varlen_ ? args.seqused : nullptr};
    if constexpr (Deterministic_) {
      a.dk_semaphores = args.dk_semaphore;
      a.dv_semaphores = args.dv_semaphore;
      a.counter_order = flash_epilogue::CounterOrder::kSequenceBlock;
      a.num_batch = args.num_batch;
      // FA3 passes no size; every index consistent metadata forms is inside its allocation.
      a.num_semaphores = Base::semaphore_count(a);
    }
    return a;
  }

  static char const* can_implement(Arguments const& args) {
    if (cute::get<0>(args.shape_dKaccum) % kTileElems != 0) {
      return "accumulator length must be whole kBlockN x kHeadDim tiles (seqlen_k_rounded * d_rounded)";
    }
    bool const same_layout = args.shape_dVaccum == args.shape_dKaccum && args.stride_dVaccum == args.stride_dKaccum;
    if (args.ptr_dVaccum != nullptr && !same_layout) {
      return "dVaccum must have dKaccum's shape and strides (FA3 rounds d and dv to one head dim)";
    }
    if (Deterministic_ &&
        (args.dk_semaphore == nullptr || (args.ptr_dVaccum != nullptr && args.dv_semaphore == nullptr))) {
      return "Deterministic needs dk_semaphore and dv_semaphore";
    }
    return Base::can_implement(collective_arguments(args));
  }

  static Params to_underlying_arguments(Arguments const& args) {
    fa3_compat::require(can_implement(args), "CollectiveEpilogueBwdGQA");
    return Base::to_underlying_arguments(collective_arguments(args));
  }
};

}  // namespace flash
