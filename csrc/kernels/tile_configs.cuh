#pragma once

// The tiles the drivers run, as the tile table (config_table.cu) lists them: FA3's per (head dim, arch path)
// (BwdTileConfig: its C fragment fixes the GQA accumulator's order), and `store`'s 64-row sm_90 tiles, which the
// plan picks for small problems: no mainloop produces them, so no accumulator takes their order.

#include "flash_epilogue/bwd_config.h"

namespace flash_epilogue {

// store's 64-row sm_90 tile: one warpgroup along the rows, two along D.
template <int kHeadDim>
using StoreRows64Config = BwdTileConfigSm90Base<kHeadDim, 64, 256, /*kSwapAB=*/false, /*kAtomLayoutNdKV=*/1>;
constexpr bool has_store_rows64_tile(int head_dim) { return head_dim == 64 || head_dim == 128; }

}  // namespace flash_epilogue
