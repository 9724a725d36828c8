#pragma once

// FlashAttention-3's dK/dV tile configuration per head dim (sm_90, and the sm_80 fallback of 8 warps of
// the 16x8x16 MMA), and the dK/dV TiledMma it implies. No MMA is issued here, but the C-fragment layout
// must be exactly the mainloop's: the shared-memory copies and the GQA accumulator's order derive from it.
// With dKV_swapAB the MMA computes dK^T: its C fragment covers a (kHeadDim, kBlockN) tile.

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm80.hpp>
#include <cutlass/arch/arch.h>

namespace flash_epilogue {

template <int kHeadDim_, class ArchTag_>
struct BwdTileConfig;

// The ArchTag of a code path as the launch functions number it: 90 (sm_90 collectives) or 80.
template <int kArch>
using arch_tag_of = std::conditional_t<kArch >= 90, cutlass::arch::Sm90, cutlass::arch::Sm80>;

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

template <>
struct BwdTileConfig<64, cutlass::arch::Sm90> : BwdTileConfigSm90Base<64, 128, 256, false, 2> {};
template <>
struct BwdTileConfig<96, cutlass::arch::Sm90> : BwdTileConfigSm90Base<96, 128, 256, false, 2> {};
template <>
struct BwdTileConfig<128, cutlass::arch::Sm90> : BwdTileConfigSm90Base<128, 128, 256, false, 2> {};
template <>
struct BwdTileConfig<192, cutlass::arch::Sm90> : BwdTileConfigSm90Base<192, 96, 384, true, 1> {};
template <>
struct BwdTileConfig<256, cutlass::arch::Sm90> : BwdTileConfigSm90Base<256, 80, 256, true, 1> {};

// The dK/dV TiledMma of the sm_90 mainloop: one warpgroup per 64 rows of N (of D when swapAB),
// the GMMA atom's N covering the rest of the tile. Element is the 16-bit input type of the MMA.
template <class Config, class Element>
struct BwdTiledMmaSm90 {
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kAtomN = Config::kAtomLayoutNdKV;
  static constexpr int kAtomK = Config::kAtomLayoutKdKV;
  // (M, N, K) of one warpgroup's atom; K (the query block) only has to be a legal GMMA K.
  using AtomShape =
      std::conditional_t<!Config::kSwapAB,
                         cute::Shape<cute::Int<kBlockN / kAtomN>, cute::Int<kHeadDim / kAtomK>, cute::_64>,
                         cute::Shape<cute::Int<kHeadDim / kAtomK>, cute::Int<kBlockN / kAtomN>, cute::_64>>;
  using AtomLayout =
      std::conditional_t<!Config::kSwapAB, cute::Layout<cute::Shape<cute::Int<kAtomN>, cute::Int<kAtomK>, cute::_1>>,
                         cute::Layout<cute::Shape<cute::Int<kAtomK>, cute::Int<kAtomN>, cute::_1>>>;
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, AtomShape, cute::GMMA::Major::K, cute::GMMA::Major::K>(),
      AtomLayout{}));
  // The (rows, cols) tile the C fragment covers: (kBlockN, kHeadDim), transposed when swapAB.
  using FragmentTileShape = std::conditional_t<!Config::kSwapAB, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>,
                                               cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>>;
};

template <int kHeadDim_, int kBlockN_, bool kSwapAB_, int kAtomLayoutNdKV_>
struct BwdTileConfigSm80Base {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNumThreads = 256;
  static constexpr bool kSwapAB = kSwapAB_;
  static constexpr int kAtomLayoutNdKV = kAtomLayoutNdKV_;  // warps along N
  static constexpr int kNumWarps = kNumThreads / 32;
  static constexpr int kAtomLayoutKdKV = 1;  // only shapes the sm_90 TMA smem atom
  static_assert(kNumWarps % kAtomLayoutNdKV == 0, "AtomLayoutNdKV must divide the warp count");
};

template <>
struct BwdTileConfig<64, cutlass::arch::Sm80> : BwdTileConfigSm80Base<64, 128, false, 4> {};
template <>
struct BwdTileConfig<96, cutlass::arch::Sm80> : BwdTileConfigSm80Base<96, 128, false, 4> {};
template <>
struct BwdTileConfig<128, cutlass::arch::Sm80> : BwdTileConfigSm80Base<128, 128, false, 2> {};
template <>
struct BwdTileConfig<192, cutlass::arch::Sm80> : BwdTileConfigSm80Base<192, 80, true, 2> {};
template <>
struct BwdTileConfig<256, cutlass::arch::Sm80> : BwdTileConfigSm80Base<256, 64, false, 2> {};

// The dK/dV TiledMma of FA3's sm_80 mainloop: the 16x8x16 MMA atom tiled over 8 warps, each warp
// grid dimension covering 16 rows/columns per warp.
template <class Config, class Element>
struct BwdTiledMmaSm80 {
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kAtomN = Config::kAtomLayoutNdKV;
  static constexpr int kAtomOther = Config::kNumWarps / kAtomN;
  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, cute::SM80_16x8x16_F32F16F16F32_TN,
                                     cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  using AtomLayout = std::conditional_t<!Config::kSwapAB,
                                        cute::Layout<cute::Shape<cute::Int<kAtomN>, cute::Int<kAtomOther>, cute::_1>>,
                                        cute::Layout<cute::Shape<cute::Int<kAtomOther>, cute::Int<kAtomN>, cute::_1>>>;
  using TiledMma = decltype(cute::make_tiled_mma(cute::MMA_Atom<MmaAtom>{}, AtomLayout{},
                                                 cute::Tile<cute::Int<16 * cute::size<0>(AtomLayout{})>,
                                                            cute::Int<16 * cute::size<1>(AtomLayout{})>, cute::_16>{}));
  using FragmentTileShape = std::conditional_t<!Config::kSwapAB, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>,
                                               cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>>;
};

// The TiledMma config of an arch: BwdTiledMma<Config, Element, Sm90 or Sm80>.
template <class Config, class Element, class ArchTag>
using BwdTiledMma = std::conditional_t<ArchTag::kMinComputeCapability >= 90, BwdTiledMmaSm90<Config, Element>,
                                       BwdTiledMmaSm80<Config, Element>>;

}  // namespace flash_epilogue
