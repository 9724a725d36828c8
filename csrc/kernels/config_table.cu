// The table of compiled (head dim, arch path) tile configurations, for host code that must not parse CuTe.

#include <initializer_list>

#include "gqa_kernels.cuh"
#include "launch_args.h"
#include "static_switch.h"

namespace flash_epilogue {

std::vector<CompiledTileConfig> const& compiled_tile_configs() {
  static std::vector<CompiledTileConfig> const table = [] {
    std::vector<CompiledTileConfig> configs;
    // An entry's head_dim is its config's: a head dim HEADDIM_SWITCH lacked would show up as 64.
    for (int head_dim : kFlashEpilogueHeadDims) {
      for (int arch : {90, 80}) {
        configs.push_back(HEADDIM_SWITCH(head_dim, kHeadDim, [&] {
          return ARCH_SWITCH(arch, kArch, [&] {
            using Config = BwdTileConfig<kHeadDim, arch_tag_of<kArch>>;
            using Traits = GqaTraits<Config, arch_tag_of<kArch>>;
            return CompiledTileConfig{Config::kHeadDim,        kArch,           Config::kBlockN,
                                      Config::kNumThreads,     Config::kSwapAB, Config::kAtomLayoutNdKV,
                                      Traits::kAccumTileElems, Traits::kSlabCols, Traits::kSlabElems};
          });
        }));
      }
    }
    return configs;
  }();
  return table;
}

}  // namespace flash_epilogue
