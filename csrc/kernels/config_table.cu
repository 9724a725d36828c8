// Host-side facts about the compiled configurations that csrc/bindings.cpp needs without
// parsing CuTe: the GQA accumulator's tile size per (head dim, arch path).

#include "gqa_kernels.cuh"
#include "launch_args.h"
#include "static_switch.h"

namespace flash_epilogue {

namespace {

template <int kHeadDim, int kArch>
using TraitsOf = GqaTraits<BwdTileConfig<kHeadDim, std::conditional_t<kArch >= 90, cutlass::arch::Sm90, cutlass::arch::Sm80>>,
                           std::conditional_t<kArch >= 90, cutlass::arch::Sm90, cutlass::arch::Sm80>>;

template <int kArch, class Fn>
int by_head_dim(int head_dim, Fn fn) {
  switch (head_dim) {
    case 64: return fn(std::integral_constant<int, 64>{});
    case 96: return fn(std::integral_constant<int, 96>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    case 192: return fn(std::integral_constant<int, 192>{});
    case 256: return fn(std::integral_constant<int, 256>{});
    default: return 0;
  }
}

}  // namespace

int gqa_accum_tile_elems(int head_dim, int arch) {
  auto elems = [&](auto arch_c) {
    return by_head_dim<decltype(arch_c)::value>(head_dim, [](auto hd) {
      return TraitsOf<decltype(hd)::value, decltype(arch_c)::value>::kAccumTileElems;
    });
  };
  return arch == 90 ? elems(std::integral_constant<int, 90>{}) : elems(std::integral_constant<int, 80>{});
}

int gqa_block_n(int head_dim, int arch) {
  auto rows = [&](auto arch_c) {
    return by_head_dim<decltype(arch_c)::value>(head_dim, [](auto hd) {
      return BwdTileConfig<decltype(hd)::value, std::conditional_t<decltype(arch_c)::value >= 90, cutlass::arch::Sm90,
                                                                   cutlass::arch::Sm80>>::kBlockN;
    });
  };
  return arch == 90 ? rows(std::integral_constant<int, 90>{}) : rows(std::integral_constant<int, 80>{});
}

// Temporary (the kernels' table replaces this file): the table from the functions above and bwd_config.h.
template <int kHeadDim, int kArch>
CompiledTileConfig compiled_tile_config() {
  using Config = BwdTileConfig<kHeadDim, std::conditional_t<kArch >= 90, cutlass::arch::Sm90, cutlass::arch::Sm80>>;
  return {kHeadDim, kArch, gqa_block_n(kHeadDim, kArch), Config::kNumThreads, Config::kSwapAB, Config::kAtomLayoutNdKV,
          gqa_accum_tile_elems(kHeadDim, kArch)};
}

std::vector<CompiledTileConfig> const& compiled_tile_configs() {
  static std::vector<CompiledTileConfig> const table = [] {
    std::vector<CompiledTileConfig> out;
    for (int head_dim : {FLASH_EPILOGUE_HEAD_DIMS}) {
      HEADDIM_SWITCH(head_dim, kHeadDim, [&] {
        out.push_back(compiled_tile_config<kHeadDim, 90>());
        out.push_back(compiled_tile_config<kHeadDim, 80>());
      });
    }
    return out;
  }();
  return table;
}

}  // namespace flash_epilogue
