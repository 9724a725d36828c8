// The example's launcher, torch-free: what example_binding.cpp needs of epilogue_example.cu.
#pragma once

#include <cuda_runtime_api.h>

namespace example {

// dK and dV (seqlen, heads, 128) bf16 from their fp32 accumulators, all contiguous, on `stream`.
// Returns nullptr once launched, or why CollectiveEpilogueBwd cannot run these arguments (or the
// CUDA error of raising the kernel's shared-memory limit).
char const* launch_backward_tail(float const* dk_accum, float const* dv_accum, void* dk, void* dv, int seqlen,
                                 int heads, cudaStream_t stream);

}  // namespace example
