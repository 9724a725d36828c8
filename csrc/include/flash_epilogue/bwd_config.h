#pragma once

// FlashAttention-3's dK/dV tile configuration per head dim, and the dK/dV TiledMma it implies.
// Only the MMA's C-fragment layout matters to the epilogue (no MMA is issued here), but it must
// be exactly the mainloop's: the epilogue's shared-memory copies and the GQA accumulator's
// element order are derived from it.
//
//   head dim | kBlockN | threads | dKV_swapAB | AtomLayoutNdKV | AtomLayoutKdKV
//   64       | 128     | 256     | no         | 2              | 1
//   96       | 128     | 256     | no         | 2              | 1
//   128      | 128     | 256     | no         | 2              | 1
//   192      | 96      | 384     | yes        | 1              | 3
//   256      | 80      | 256     | yes        | 1              | 2
//
// With dKV_swapAB the MMA computes dK^T: its C fragment covers a (kHeadDim, kBlockN) tile.

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/arch/arch.h>

namespace flash_epilogue {

template <int kHeadDim_, class ArchTag_>
struct BwdTileConfig;

template <int kHeadDim_, int kBlockN_, int kNumThreads_, bool kSwapAB_, int kAtomLayoutNdKV_>
struct BwdTileConfigSm90Base {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNumThreads = kNumThreads_;
  static constexpr bool kSwapAB = kSwapAB_;
  static constexpr int kAtomLayoutNdKV = kAtomLayoutNdKV_;
  static constexpr int kNumWarpGroups = kNumThreads / 128;
  static constexpr int kAtomLayoutKdKV = kNumWarpGroups / kAtomLayoutNdKV;
  static_assert(kNumThreads % 128 == 0, "sm_90 dK/dV MMAs are issued by whole warpgroups");
  static_assert(kNumWarpGroups % kAtomLayoutNdKV == 0, "AtomLayoutNdKV must divide the warpgroup count");
};

template <> struct BwdTileConfig<64, cutlass::arch::Sm90> : BwdTileConfigSm90Base<64, 128, 256, false, 2> {};
template <> struct BwdTileConfig<96, cutlass::arch::Sm90> : BwdTileConfigSm90Base<96, 128, 256, false, 2> {};
template <> struct BwdTileConfig<128, cutlass::arch::Sm90> : BwdTileConfigSm90Base<128, 128, 256, false, 2> {};
template <> struct BwdTileConfig<192, cutlass::arch::Sm90> : BwdTileConfigSm90Base<192, 96, 384, true, 1> {};
template <> struct BwdTileConfig<256, cutlass::arch::Sm90> : BwdTileConfigSm90Base<256, 80, 256, true, 1> {};

// The dK/dV TiledMma of the sm_90 mainloop: one warpgroup per 64 rows of N (of D when swapAB),
// the GMMA atom's N covering the rest of the tile. Element is the 16-bit input type of the MMA.
template <class Config, class Element>
struct BwdTiledMmaSm90 {
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kAtomN = Config::kAtomLayoutNdKV;
  static constexpr int kAtomK = Config::kAtomLayoutKdKV;
  // (M, N, K) of one warpgroup's atom; K (the query block) only has to be a legal GMMA K.
  using AtomShape = std::conditional_t<!Config::kSwapAB,
                                       cute::Shape<cute::Int<kBlockN / kAtomN>, cute::Int<kHeadDim / kAtomK>, cute::_64>,
                                       cute::Shape<cute::Int<kHeadDim / kAtomK>, cute::Int<kBlockN / kAtomN>, cute::_64>>;
  using AtomLayout = std::conditional_t<!Config::kSwapAB,
                                        cute::Layout<cute::Shape<cute::Int<kAtomN>, cute::Int<kAtomK>, cute::_1>>,
                                        cute::Layout<cute::Shape<cute::Int<kAtomK>, cute::Int<kAtomN>, cute::_1>>>;
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, AtomShape, cute::GMMA::Major::K, cute::GMMA::Major::K>(),
      AtomLayout{}));
  // The (rows, cols) tile the C fragment covers: (kBlockN, kHeadDim), transposed when swapAB.
  using FragmentTileShape = std::conditional_t<!Config::kSwapAB,
                                               cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>,
                                               cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>>;
};

}  // namespace flash_epilogue
