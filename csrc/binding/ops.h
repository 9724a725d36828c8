#pragma once

// The mutating ops' implementations, as their schemas (registration.cpp) declare them: every argument checked
// (checks.h), then the plan's launches (plan.h, launch.h). They run for CUDA and CPU tensors alike: CPU tensors get
// every metadata check, then the device check's message.

#include <cstdint>
#include <optional>

#include "checks.h"

namespace flash_epilogue {

void store(TensorArg dk_accum, TensorArg dv_accum, TensorArg dk, TensorArg dv, OptArg cu_seqlens, OptArg seqused,
           int64_t arch);
void store_zero(TensorArg dk, TensorArg dv, OptArg cu_seqlens, OptArg seqused, OptArg batch_idx, OptArg head_idx,
                int64_t row_start, std::optional<int64_t> row_end, int64_t arch);
void gqa_accumulate(TensorArg dk_partial, TensorArg dv_partial, TensorArg dk_accum, TensorArg dv_accum,
                    OptArg semaphores, OptArg cu_seqlens, OptArg seqused, bool deterministic, int64_t arch);
void gqa_postprocess(TensorArg dk_accum, TensorArg dv_accum, TensorArg dk, TensorArg dv, double scale_dk,
                     double scale_dv, OptArg cu_seqlens, OptArg seqused, int64_t arch);
void gqa_accum_to_dense(TensorArg accum, TensorArg out, int64_t head_dim, OptArg cu_seqlens, OptArg seqused,
                        int64_t arch);
void gqa_reduce(TensorArg dk_partial, OptArg dv_partial, TensorArg dk, OptArg dv, OptArg cu_seqlens, OptArg seqused,
                double scale_dk, double scale_dv, int64_t arch);

// The GQA accumulators' layout for _C.gqa_accum_layout, its arguments checked (op gqa_accumulator): batch sequences
// of `rows` rows (varlen: rows total tokens); arch 0: the device's path. The GQA ops check against the same.
AccumLayout gqa_accum_layout(int64_t num_heads_kv, int64_t head_dim, int64_t head_dim_v, int64_t batch, int64_t rows,
                             bool varlen, int64_t arch, at::Device device);

}  // namespace flash_epilogue
