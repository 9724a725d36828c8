#pragma once

// What module.cpp and ops.cpp share. ops.cpp holds the package's only argument checks: a bad argument raises
// ValueError (TypeError for a wrong dtype or a None tensor) before any launch:
// `flash_epilogue.<op>: <arg>: expected <expected>, got <got>`.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <string>
#include <vector>

#include "launch_args.h"

namespace flash_epilogue {

using TensorArg = at::Tensor const&;  // the ops' argument types
using OptArg = std::optional<at::Tensor> const&;
std::vector<std::string> const& compiled_archs();  // "sm_90a", or "sm_80" and "sm_90a"

// The GQA accumulators: dK's and dV's (batch_extent, heads, num_tiles, tile_elems) floats, each in the order of the
// TiledMma's C fragment of its tile's config: dK's that serving max(d, dv), dV's the same or one of its own
// (dv_tile_head_dim), each tile of only the slabs covering its tensor's head dim
// (CompiledTileConfig::accum_tile_elems_for); the deterministic mode's semaphores: dK's and dV's counter per (tile,
// KV head), a ticket (the sm_80 path, where both tensors share the tile).
struct AccumLayout {
  struct Tiles {
    int head_dim = 0, block_n = 0;  // the config's head dim and tile rows
    int64_t num_tiles = 0, tile_elems = 0;
  };
  int arch = 90;  // the code path
  int64_t batch_extent = 0, heads = 0;
  Tiles tiles[2];  // dK's, dV's
  std::vector<int64_t> shape(int tensor) const {
    return {batch_extent, heads, tiles[tensor].num_tiles, tiles[tensor].tile_elems};
  }
  int64_t semaphore_numel() const { return 2 * batch_extent * tiles[0].num_tiles * heads + 1; }
};

// _C.gqa_accum_layout, its arguments checked (op gqa_accumulator): batch sequences of `rows` rows (varlen: rows
// total tokens); arch 0: the device's path (80 on an sm_8x GPU, else 90). The GQA ops check against the same.
AccumLayout gqa_accum_layout(int64_t num_heads_kv, int64_t head_dim, int64_t head_dim_v, int64_t batch, int64_t rows,
                             bool varlen, int64_t arch, at::Device device);

void set_debug_sync(bool on);  // FLASH_EPILOGUE_DEBUG: repeat_kv's backward synchronizes after its launch
bool debug_sync_enabled();

}  // namespace flash_epilogue
