#pragma once

// The ops' argument checks (checks.cpp), the package's only checker. Each check_<op> takes the op's
// arguments and returns what its launch needs, or raises ValueError (TypeError for a wrong dtype
// or a None tensor): `flash_epilogue.<op>: <arg>: expected <expected>, got <got>`.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <string>
#include <vector>

#include "launch_args.h"

namespace flash_epilogue {

using OptTensor = std::optional<at::Tensor>;

// The archs of the build ("sm_90a", or "sm_80" and "sm_90a").
std::vector<std::string> const& compiled_archs();

// The GQA accumulators' geometry: dK's and dV's (batch_extent, heads, num_tiles, tile_elems) floats
// in the order of the TiledMma's C fragment, and the deterministic mode's semaphores (a counter for
// dK and one for dV per (tile, KV head), plus one for the kernel's own use: a ticket).
struct AccumLayout {
  int arch = 90, block_n = 0;  // the code path and its tile rows
  int64_t batch_extent = 0, heads = 0, num_tiles = 0, tile_elems = 0;

  std::vector<int64_t> shape() const { return {batch_extent, heads, num_tiles, tile_elems}; }
  int64_t semaphore_numel() const { return 2 * batch_extent * num_tiles * heads + 1; }
};

// The accumulators of flash_epilogue.gqa_accumulator (_C.gqa_accum_layout), its arguments checked:
// batch sequences of `rows` rows (varlen: rows total tokens), num_heads_kv KV heads, head dims
// (head_dim, head_dim_v); arch 0 is the device's own path (80 on an sm_8x GPU, else 90). The GQA
// ops check their accumulators against the same geometry.
AccumLayout gqa_accum_layout(int64_t num_heads_kv, int64_t head_dim, int64_t head_dim_v, int64_t batch, int64_t rows,
                             bool varlen, int64_t arch, at::Device device);

// What an op launches for once its arguments passed.
struct Problem {
  at::Device device = at::kCPU;
  int arch = 90;  // the code path: 90 (sm_90, TMA) or 80 (sm_80 collectives)
  bool varlen = false;
  int rows = 0, heads = 0, heads_q = 0, batch = 0;  // heads: of dk/dv (h_k on the GQA side)
  int head_dim = 0;                                 // the compiled config serving the head dims
  AccumLayout accum;                                // the GQA ops' accumulators
};

// 16-bit dk/dv (dv with its own head dim) from fp32 accumulators of their shapes.
Problem check_store(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk, at::Tensor const& dv,
                    OptTensor const& cu_seqlens, OptTensor const& seqused, int64_t arch);
// dk/dv as for store; int32 selections; a row window [row_start, row_end) within int32.
Problem check_store_zero(at::Tensor const& dk, at::Tensor const& dv, OptTensor const& cu_seqlens,
                         OptTensor const& seqused, OptTensor const& batch_idx, OptTensor const& head_idx,
                         int64_t row_start, std::optional<int64_t> row_end, int64_t arch);
// fp32 partials of h_q heads, the accumulators (of h_k dividing h_q) of their problem, semaphores
// when deterministic.
Problem check_gqa_accumulate(at::Tensor const& dk_partial, at::Tensor const& dv_partial, at::Tensor const& dk_accum,
                             at::Tensor const& dv_accum, OptTensor const& semaphores, OptTensor const& cu_seqlens,
                             OptTensor const& seqused, bool deterministic, int64_t arch);
// the accumulators of dk/dv's problem; scales within fp32's range.
Problem check_gqa_postprocess(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk,
                              at::Tensor const& dv, double scale_dk, double scale_dv, OptTensor const& cu_seqlens,
                              OptTensor const& seqused, int64_t arch);
// an accumulator of head dim head_dim; fp32 out of at most head_dim columns.
Problem check_gqa_accum_to_dense(at::Tensor const& accum, at::Tensor const& out, int64_t head_dim,
                                 OptTensor const& cu_seqlens, OptTensor const& seqused, int64_t arch);
// partials (fp32 or dk's dtype) of h_q heads into dk/dv of h_k heads; dv_partial and dv None together.
Problem check_gqa_reduce(at::Tensor const& dk_partial, OptTensor const& dv_partial, at::Tensor const& dk,
                         OptTensor const& dv, OptTensor const& cu_seqlens, OptTensor const& seqused, double scale_dk,
                         double scale_dv, int64_t arch);

// repeat_kv: x 4-D, n_rep >= 1 (x.shape[dim] * n_rep within int64), dim the heads dim (1, 2, -3
// or -2). repeat_kv_backward: the same for grad, whose heads are a multiple of n_rep; layout a
// permutation of [0, 1, 2]. Both return dim as 1 or 2.
int64_t check_repeat_kv(at::Tensor const& x, int64_t n_rep, int64_t dim);
int64_t check_repeat_kv_backward(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout);

// repeat_kv's backward: whether gqa_reduce takes `partial` (batch, seqlen, heads, d) as dk_partial
// (its dtype, head dim, grid limits, a GPU with kernels; not empty), and whether it reads it in
// place (strides and alignment; else from a contiguous copy).
bool gqa_reduce_takes(at::Tensor const& partial);
bool gqa_reduce_reads_in_place(at::Tensor const& partial);

}  // namespace flash_epilogue
