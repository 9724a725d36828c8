#pragma once

// The dispatch plan: for one call, everything its launches need (code path, the tiles of dK and dV, driver, CTAs
// per SM, predication, ordering) and the GQA accumulators' geometry that follows from it. Every dispatch rule and
// threshold lives in plan.cpp, each a named constant whose comment states the rule; the measurements behind them are
// in docs/design.md. No torch types: _C exports it as flash_epilogue._C.plan.

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "geometry.h"
#include "launch_args.h"
#include "launch_plan.h"

namespace flash_epilogue {

enum class Op : int { kStore, kStoreZero, kGqaAccumulate, kGqaPostprocess, kGqaAccumToDense, kGqaReduce };

// What the plan decides from.
struct Problem {
  Op op = Op::kStore;
  int arch = 90;              // the code path (code_path)
  ProblemShape shape;         // rows, batch, KV heads, varlen
  bool seqused = false;       // seqused given
  int head_dim = 0;           // dK's; gqa_accum_to_dense: the output's
  int head_dim_v = 0;         // dV's (0: no dV); gqa_accum_to_dense: the head dim of the accumulator's tile
  bool deterministic = false; // gqa_accumulate's flag
  int num_sms = 0;            // the device's multiprocessors
};

LaunchPlan plan(Problem const& p);

// The code path of a call: `requested` (80 or 90) if given, else that of a device of compute capability
// `capability` (none: not a CUDA device): 90 on an sm_90 GPU when the build has sm_90a code, else 80.
int code_path(int64_t requested, std::optional<std::pair<int, int>> capability);

// The tile table: FA3's tile serving head dims up to width, its head dim (0 past 256, whether or not this build has
// it), whether this build has it, the entry of a key.
int serving_head_dim(int64_t width);
bool head_dim_built(int64_t d);
CompiledTileConfig const& tile_config(TileKey key, int arch);
TileKey fa3_tile(int64_t width, int arch);

// The GQA accumulators: dK's and dV's (batch_extent, num_heads_kv, num_tiles, tile_elems) floats, each in the order
// of the C fragment of its tile (the plan's: dK's FA3's tile serving max(d, dv), dV's the same or one of its own),
// each tile of only the slabs covering its tensor's head dim (CompiledTileConfig::accum_tile_elems_for); the sm_80
// ordered mode's SemaphoreWorkspace, of dK's tile.
struct AccumLayout {
  struct Tiles {
    int head_dim = 0, block_n = 0;  // the tile's
    int64_t num_tiles = 0, tile_elems = 0;
  };
  int arch = 90;  // the code path
  int64_t batch_extent = 0, num_heads_kv = 0;
  Tiles tiles[2];  // dK's, dV's
  int64_t semaphore_numel = 0;  // 0 where no ordered mode exists (the sm_90 path)
  std::vector<int64_t> shape(int tensor) const {
    return {batch_extent, num_heads_kv, tiles[tensor].num_tiles, tiles[tensor].tile_elems};
  }
};

// The plan's named thresholds, for the tests that probe each rule on both sides.
std::vector<std::pair<char const*, int64_t>> plan_thresholds();

// The accumulators of a GQA problem p (any GQA op: they share the layout) with dK of head dim d and dV of dv.
AccumLayout accum_layout(Problem const& p, int64_t d, int64_t dv);

}  // namespace flash_epilogue
