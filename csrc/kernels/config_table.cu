// The tile table: every compiled tile (CompiledTileConfig), for host code that must not parse CuTe.

#include <initializer_list>

#include "gqa_kernels.cuh"
#include "launch_args.h"
#include "static_switch.h"
#include "tile_configs.cuh"

namespace flash_epilogue {

namespace {

template <class Config, int kArch>
CompiledTileConfig entry(bool fa3) {
  CompiledTileConfig c{Config::kHeadDim, kArch,  Config::kBlockN, Config::kNumThreads, Config::kSwapAB,
                       Config::kAtomLayoutNdKV, 0, 0, 0, fa3};
  if (fa3) {  // the GQA accumulator's tile
    using Traits = AccumTraits<Config, arch_tag_of<kArch>>;
    c.accum_tile_elems = Traits::kAccumTileElems;
    c.slab_cols = Traits::kSlabCols;
    c.slab_elems = Traits::kSlabElems;
  }
  return c;
}

}  // namespace

std::vector<CompiledTileConfig> const& compiled_tile_configs() {
  static std::vector<CompiledTileConfig> const table = [] {
    std::vector<CompiledTileConfig> configs;
    // An entry's head_dim is its config's: a head dim HEADDIM_SWITCH lacked would show up as 64.
    for (int head_dim : kFlashEpilogueHeadDims) {
      HEADDIM_SWITCH(head_dim, kHeadDim, [&] {
        configs.push_back(entry<BwdTileConfig<kHeadDim, arch_tag_of<90>>, 90>(true));
        configs.push_back(entry<BwdTileConfig<kHeadDim, arch_tag_of<80>>, 80>(true));
        if constexpr (has_store_rows64_tile(kHeadDim)) {
          configs.push_back(entry<StoreRows64Config<kHeadDim>, 90>(false));
        }
      });
    }
    return configs;
  }();
  return table;
}

}  // namespace flash_epilogue
