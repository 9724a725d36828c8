#pragma once

// What the binding's files share. ops.cpp holds the package's only argument checks (repeat_kv's: check_repeat_kv): a
// bad argument raises ValueError (TypeError for a wrong dtype or a None tensor) before any launch:
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

// The GQA accumulators: dK's and dV's (batch_extent, heads, num_tiles, tile_elems[i]) floats in the order of the
// TiledMma's C fragment of the config serving max(d, dv), each tile of only the slabs covering its own head dim
// (CompiledTileConfig::accum_tile_elems_for); the deterministic mode's semaphores: dK's and dV's counter per (tile,
// KV head), a ticket.
struct AccumLayout {
  int arch = 90, block_n = 0, config_head_dim = 0;  // the code path, its tile rows and head dim
  int64_t batch_extent = 0, heads = 0, num_tiles = 0;
  int64_t tile_elems[2] = {0, 0};  // dK's, dV's
  std::vector<int64_t> shape(int tensor) const { return {batch_extent, heads, num_tiles, tile_elems[tensor]}; }
  int64_t semaphore_numel() const { return 2 * batch_extent * num_tiles * heads + 1; }
};

// _C.gqa_accum_layout, its arguments checked (op gqa_accumulator): batch sequences of `rows` rows (varlen: rows
// total tokens); arch 0: the device's path (80 on an sm_8x GPU, else 90). The GQA ops check against the same.
AccumLayout gqa_accum_layout(int64_t num_heads_kv, int64_t head_dim, int64_t head_dim_v, int64_t batch, int64_t rows,
                             bool varlen, int64_t arch, at::Device device);

// repeat_kv (x = t), with a layout repeat_kv_backward (grad = t); returns dim as 1 or 2.
int64_t check_repeat_kv(TensorArg t, int64_t n_rep, int64_t dim, std::optional<c10::IntArrayRef> layout = {});

// gqa_reduce (ops.cpp), for repeat_kv's backward: whether it takes `partial` (batch, seqlen, heads, d) as dk_partial
// (dtype, head dim, grid limits, a GPU with kernels, not empty) and whether it reads it in place (strides, alignment).
void gqa_reduce(TensorArg dk_partial, OptArg dv_partial, TensorArg dk, OptArg dv, OptArg cu_seqlens, OptArg seqused,
                double scale_dk, double scale_dv, int64_t arch);
bool gqa_reduce_takes(TensorArg partial);
bool gqa_reduce_reads_in_place(TensorArg partial);

void set_debug_sync(bool on);  // FLASH_EPILOGUE_DEBUG: repeat_kv's backward synchronizes after its launch
bool debug_sync_enabled();

}  // namespace flash_epilogue
