#pragma once

// Host side of `store`: the plan's launch (csrc/binding/plan.cpp chooses it; docs/design.md has the measurements).
// The instantiations of a (head dim, path) are the launches its plan can ask for.

#include <cute/tensor.hpp>

#include "launch_args.h"
#include "launch_common.cuh"
#include "store_kernel.cuh"
#include "tile_configs.cuh"

namespace flash_epilogue {

// One CTA per tile of Config on the kArch path (kPredicatedOnly: see with_predication).
template <class Config, class Element, int kArch, bool kPredicatedOnly>
char const* launch_store_tiles(StoreLaunchArgs const& args, cudaStream_t stream) {
  if (char const* why = plan_mismatch(args.plan, Driver::kOneCtaPerTile, Config::kBlockN, kStoreTileCtasPerSm)) {
    return why;
  }
  return with_predication<kPredicatedOnly>(args.plan.predicated, [&](auto predicated) -> char const* {
    using Kernel = StoreKernel<OutputTileTraits<Config, Element, arch_tag_of<kArch>, decltype(predicated)::value>>;
    Geometry const& g = args.geometry;
    if (g.tiles(Kernel::kBlockN) == 0) { return nullptr; }
    typename Kernel::Params params{};
    TensorDesc outputs[2];
    for (int i = 0; i < 2; ++i) {
      StoreLaunchArgs::Tensor const& t = args.tensors[i];
      params.tensors[i].ptr_accum = static_cast<float const*>(t.accum.ptr);
      params.tensors[i].stride_accum = stride_of(t.accum);
      outputs[i] = t.out;
    }
    return launch_output_tiles<Kernel>(g, outputs, 2, params, stream);
  });
}

// TileStreamKernel over Config's tiles, kCtasPerSm to an SM (sm_90).
template <class Config, class Element, int kCtasPerSm>
char const* launch_store_stream(StoreLaunchArgs const& args, cudaStream_t stream) {
  StreamedTensor const tensors[2] = {{args.tensors[0].out, args.tensors[0].accum},
                                     {args.tensors[1].out, args.tensors[1].accum}};
  return launch_tile_stream_for<Config, Element, float, /*kReduce=*/false, kCtasPerSm>(args.plan, tensors, 2,
                                                                                       args.geometry, 1, stream);
}

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_store(StoreLaunchArgs const& args, cudaStream_t stream) {
  using Element = element_of<kDType>;
  using Fa3 = BwdTileConfig<kHeadDim, arch_tag_of<kArch>>;
  [[maybe_unused]] bool const fa3_tile = args.plan.tile.block_n == Fa3::kBlockN;
  if constexpr (kArch < 90) {
    return launch_store_tiles<Fa3, Element, kArch, /*kPredicatedOnly=*/true>(args, stream);
  } else if constexpr (kHeadDim == 64) {  // one CTA per tile; the 64-row tile with cu_seqlens only
    return fa3_tile ? launch_store_tiles<Fa3, Element, kArch, false>(args, stream)
                    : launch_store_tiles<StoreRows64Config<kHeadDim>, Element, kArch, true>(args, stream);
  } else if constexpr (kHeadDim == 128) {  // streamed; small problems on the 64-row tile, one CTA each or streamed
    if (fa3_tile) { return launch_store_stream<Fa3, Element, kStreamCtasPerSm>(args, stream); }
    return args.plan.driver == Driver::kOneCtaPerTile
               ? launch_store_tiles<StoreRows64Config<kHeadDim>, Element, kArch, false>(args, stream)
               : launch_store_stream<StoreRows64Config<kHeadDim>, Element, kStreamSmallTileCtasPerSm>(args, stream);
  } else if constexpr (kHeadDim > 128) {  // streamed, or one CTA per tile for small problems
    return args.plan.driver == Driver::kOneCtaPerTile ? launch_store_tiles<Fa3, Element, kArch, false>(args, stream)
                                                      : launch_store_stream<Fa3, Element, kStreamCtasPerSm>(args, stream);
  } else {
    return launch_store_stream<Fa3, Element, kStreamCtasPerSm>(args, stream);
  }
}

}  // namespace flash_epilogue
