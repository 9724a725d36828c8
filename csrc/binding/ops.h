#pragma once

// The ops' implementations (ops.cpp, repeat_kv.cpp), registered by module.cpp. Each checks its
// arguments (checks.h) before anything reaches a kernel.

#include <ATen/core/Tensor.h>

#include <optional>

#include "checks.h"

namespace flash_epilogue {

void store(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk, at::Tensor const& dv,
           OptTensor const& cu_seqlens, OptTensor const& seqused, int64_t arch);
void store_zero(at::Tensor const& dk, at::Tensor const& dv, OptTensor const& cu_seqlens, OptTensor const& seqused,
                OptTensor const& batch_idx, OptTensor const& head_idx, int64_t row_start,
                std::optional<int64_t> row_end, int64_t arch);
void gqa_accumulate(at::Tensor const& dk_partial, at::Tensor const& dv_partial, at::Tensor const& dk_accum,
                    at::Tensor const& dv_accum, OptTensor const& semaphores, OptTensor const& cu_seqlens,
                    OptTensor const& seqused, bool deterministic, int64_t arch);
void gqa_postprocess(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk, at::Tensor const& dv,
                     double scale_dk, double scale_dv, OptTensor const& cu_seqlens, OptTensor const& seqused,
                     int64_t arch);
void gqa_accum_to_dense(at::Tensor const& accum, at::Tensor const& out, int64_t head_dim, OptTensor const& cu_seqlens,
                        OptTensor const& seqused, int64_t arch);
void gqa_reduce(at::Tensor const& dk_partial, OptTensor const& dv_partial, at::Tensor const& dk, OptTensor const& dv,
                OptTensor const& cu_seqlens, OptTensor const& seqused, double scale_dk, double scale_dv, int64_t arch);

// repeat_kv and repeat_kv_backward: the kernels (every backend) and the autograd wrappers.
at::Tensor repeat_kv(at::Tensor const& x, int64_t n_rep, int64_t dim);
at::Tensor repeat_kv_backward(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout);
at::Tensor repeat_kv_autograd(at::Tensor const& x, int64_t n_rep, int64_t dim);
at::Tensor repeat_kv_backward_autograd(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout);

// FLASH_EPILOGUE_DEBUG for the C++ paths (repeat_kv's backward): synchronize after the launch.
void set_debug_sync(bool on);
bool debug_sync_enabled();

}  // namespace flash_epilogue
