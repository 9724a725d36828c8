// Compile-time test of the FlashAttention-3 compatibility header (flash_epilogue/fa3/epilogue_bwd.hpp) as FA3's
// backward uses it, without FA3's sources (tests/test_header_library.py compiles this file; nothing runs): the
// launch code picks the MHA or GQA epilogue with std::conditional_t and fills its Arguments in FA3's field order;
// the kernel holds the epilogue's TensorStorage in FA3's SharedStorage layout and calls prefetch_tma_descriptors,
// store(params, dK, dV, shared_storage, tiled_mma, thread_idx, block_coord), store_zero and store_tail.
// scripts/fa3_check.py runs the header inside FA3 itself.

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/fa3/epilogue_bwd.hpp"

namespace fe = flash_epilogue;
using namespace cute;

template <int kHeadDim, bool GQA, bool Varlen, bool Deterministic>
struct Fa3Backward {
  using ArchTag = cutlass::arch::Sm90;
  using Config = fe::BwdTileConfig<kHeadDim, ArchTag>;
  using Mma = fe::BwdTiledMmaSm90<Config, cutlass::bfloat16_t>;
  using TileShape_MNK = Shape<_64, Int<Config::kBlockN>, Int<kHeadDim>>;
  using CollectiveEpilogue = std::conditional_t<
      !GQA,
      flash::CollectiveEpilogueBwd<TileShape_MNK, cutlass::bfloat16_t, ArchTag, Config::kNumThreads, Varlen,
                                   Config::kSwapAB, Config::kAtomLayoutKdKV>,
      flash::CollectiveEpilogueBwdGQA<TileShape_MNK, float, ArchTag, Config::kNumThreads, Varlen, Deterministic>>;
  static_assert(CollectiveEpilogue::Varlen == Varlen, "FA3's kernel asserts the mainloop's Varlen equals the epilogue's");

  // FA3's layout: the epilogue's storage in a union with the mainloop's, inside an aligned_struct<128>.
  struct SharedStorage {
    struct TensorStorage : cute::aligned_struct<128> {
      union {
        cute::array_aligned<cutlass::bfloat16_t, 64 * 1024, 1024> mainloop;
        typename CollectiveEpilogue::TensorStorage epilogue;
      };
    } tensors;
  };
  static_assert(sizeof(SharedStorage) == sizeof(cutlass::bfloat16_t) * 64 * 1024,
                "the epilogue's TensorStorage grows FA3's SharedStorage");

  // flash_bwd_launch_template.h's argument list.
  static typename CollectiveEpilogue::Params host(void* dk, void* dv, void* dk_accum, void* dv_accum, int b, int h,
                                                  int h_k, int seqlen_k, int d, int* dk_semaphore, int* dv_semaphore,
                                                  int const* cu_seqlens_k, int const* seqused_k) {
    using Element = typename CollectiveEpilogue::Element;
    int const seqlen_k_rounded = (seqlen_k + Config::kBlockN - 1) / Config::kBlockN * Config::kBlockN;
    auto shape = [&] {
      if constexpr (!GQA) {
        return typename CollectiveEpilogue::ShapedKV{seqlen_k, d, h, b};
      } else {
        return typename CollectiveEpilogue::ShapedKV{seqlen_k_rounded * kHeadDim, h_k, b};
      }
    }();
    auto stride = [&] {
      if constexpr (!GQA) {
        return typename CollectiveEpilogue::StridedKV{int64_t(h) * d, _1{}, int64_t(d), int64_t(seqlen_k) * h * d};
      } else {
        return typename CollectiveEpilogue::StridedKV{_1{}, int64_t(seqlen_k_rounded) * kHeadDim,
                                                      int64_t(h_k) * seqlen_k_rounded * kHeadDim};
      }
    }();
    typename CollectiveEpilogue::Arguments args{static_cast<Element*>(!GQA ? dk : dk_accum), shape, stride,
                                                static_cast<Element*>(!GQA ? dv : dv_accum), shape, stride,
                                                b, h, dk_semaphore, dv_semaphore, cu_seqlens_k, seqused_k};
    return CollectiveEpilogue::to_underlying_arguments(args);
  }
};

template <int kHeadDim, bool GQA, bool Varlen, bool Deterministic>
__global__ void fa3_consumer(typename Fa3Backward<kHeadDim, GQA, Varlen, Deterministic>::CollectiveEpilogue::Params const params,
                             bool tile_valid) {
  using B = Fa3Backward<kHeadDim, GQA, Varlen, Deterministic>;
  extern __shared__ char smem[];
  auto& shared_storage = *reinterpret_cast<typename B::SharedStorage*>(smem);
  B::CollectiveEpilogue::prefetch_tma_descriptors(params);
  typename B::CollectiveEpilogue epilogue;
  typename B::Mma::TiledMma tiled_mma_dKV;
  auto tdKrdK = partition_fragment_C(tiled_mma_dKV, typename B::Mma::FragmentTileShape{});
  auto tdVrdV = partition_fragment_C(tiled_mma_dKV, typename B::Mma::FragmentTileShape{});
  cute::tuple<int32_t, int32_t, int32_t> const block_coord = {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
  if (tile_valid) {
    epilogue.store(params, tdKrdK, tdVrdV, shared_storage, tiled_mma_dKV, int(threadIdx.x), block_coord);
  } else {
    epilogue.store_zero(params, int(threadIdx.x), block_coord);
  }
  epilogue.store_tail();
}

#define FE_FA3(D, GQA, VARLEN, DET)                                                                             \
  template struct Fa3Backward<D, GQA, VARLEN, DET>;                                                            \
  template __global__ void fa3_consumer<D, GQA, VARLEN, DET>(                                                  \
      Fa3Backward<D, GQA, VARLEN, DET>::CollectiveEpilogue::Params const, bool);
FE_FA3(128, false, false, false)  // MHA, TMA stores
FE_FA3(128, false, true, false)   // MHA varlen
FE_FA3(128, true, true, true)     // GQA varlen, deterministic: FA3's counter order
FE_FA3(128, true, false, false)   // GQA batched, unordered bulk adds
