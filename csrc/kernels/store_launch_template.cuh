#pragma once

// Host side of `store`. Which kernel runs a problem was chosen by measurement on the H200 (docs/design.md).

#include <cstdint>

#include <cute/tensor.hpp>

#include "launch_args.h"
#include "launch_common.cuh"
#include "static_switch.h"
#include "store_kernel.cuh"
#include "tile_schedule.cuh"

namespace flash_epilogue {

template <class Element, int kHeadDim, class ArchTag, bool kVarlen, class Config = BwdTileConfig<kHeadDim, ArchTag>>
char const* launch_store_variant(StoreLaunchArgs const& args, cudaStream_t stream) {
  using Kernel = StoreKernel<Config, Element, ArchTag, kVarlen>;
  bool const is_varlen = args.cu_seqlens != nullptr;
  int const num_tiles = static_cast<int>(row_tiles<Config::kBlockN>(args.rows, args.batch, is_varlen));
  if (num_tiles == 0 || args.num_heads == 0 || (!is_varlen && args.batch == 0)) { return nullptr; }
  typename Kernel::Params params{{{{}, static_cast<float const*>(args.dk_accum.ptr), stride_of(args.dk_accum)},
                                  {{}, static_cast<float const*>(args.dv_accum.ptr), stride_of(args.dv_accum)}},
                                 args.num_heads, args.batch};
  return launch_output_tiles<Kernel>(args, 2, args.num_heads, params, stream);
}

// StoreKernel in the instantiation the call's sequence metadata needs.
template <class Element, int kHeadDim, class ArchTag>
char const* launch_store_one_cta_per_tile(StoreLaunchArgs const& args, cudaStream_t stream) {
  return BOOL_SWITCH(!without_sequence_metadata(args), kVarlen,
                     [&] { return launch_store_variant<Element, kHeadDim, ArchTag, kVarlen>(args, stream); });
}

template <class Config, class Element, int kCtasPerSm>
char const* launch_store_streamed(StoreLaunchArgs const& args, cudaStream_t stream) {
  StreamedTensor const tensors[2] = {{args.dk, args.dk_accum}, {args.dv, args.dv_accum}};
  return launch_tile_stream_for<Config, Element, float, /*kReduce=*/false, kCtasPerSm>(
      tensors, 2, args.rows, args.num_heads, 1, args.batch, args.cu_seqlens, args.seqused, stream);
}

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_store(StoreLaunchArgs const& args, cudaStream_t stream) {
  using Element = element_of<kDType>;
  using ArchTag = arch_tag_of<kArch>;
  if constexpr (kArch >= 90 && kHeadDim <= 64) {
    // Small tiles (32 KB of fp32): one CTA per tile, two per SM, beat streaming. With cu_seqlens and sequences of
    // 2048 rows or more on average, (64, 64) tiles are faster still; batched, or with shorter sequences, slower.
    if (args.cu_seqlens != nullptr && args.rows >= int64_t(2048) * args.batch) {
      using VarlenConfig = BwdTileConfigSm90Base<64, 64, 256, /*kSwapAB=*/false, /*kAtomLayoutNdKV=*/1>;
      return launch_store_variant<Element, kHeadDim, ArchTag, /*kVarlen=*/true, VarlenConfig>(args, stream);
    }
    return launch_store_one_cta_per_tile<Element, kHeadDim, ArchTag>(args, stream);
  } else if constexpr (kArch >= 90) {
    using Config = BwdTileConfig<kHeadDim, ArchTag>;
    // Small problems (output tiles of dK and dV, at Config's size) take other kernels.
    bool const is_varlen = args.cu_seqlens != nullptr;
    [[maybe_unused]] int64_t const output_tiles = 2 * row_tiles<Config::kBlockN>(args.rows, args.batch, is_varlen) *
                                                  args.num_heads * (is_varlen ? 1 : args.batch);
    if constexpr (kHeadDim > 128) {
      // Up to two 72-80 KB tiles per SM, the streaming kernel's prologue is not paid back.
      if (output_tiles <= 2 * int64_t(multiprocessor_count())) {
        return launch_store_one_cta_per_tile<Element, kHeadDim, ArchTag>(args, stream);
      }
    }
    if constexpr (kHeadDim == 128) {
      // At most one 128-row tile per SM: (64, 128) tiles, two CTAs per SM, are faster.
      using SmallProblemConfig = BwdTileConfigSm90Base<128, 64, 256, /*kSwapAB=*/false, /*kAtomLayoutNdKV=*/1>;
      if (output_tiles <= multiprocessor_count()) {
        return launch_store_streamed<SmallProblemConfig, Element, /*kCtasPerSm=*/2>(args, stream);
      }
    }
    return launch_store_streamed<Config, Element, /*kCtasPerSm=*/1>(args, stream);
  } else {
    // sm_80 has no TMA: one CTA per tile, and the collective's predicated path.
    return launch_store_variant<Element, kHeadDim, ArchTag, /*kVarlen=*/true>(args, stream);
  }
}

}  // namespace flash_epilogue
