#pragma once

// The torch-free interface between csrc/bindings.cpp (validation, dispatch) and the generated
// instantiations: plain pointers, extents and element strides. No CUTLASS types here, so the
// host compiler that builds the bindings never parses CuTe.

#include <cstdint>

#include <cuda_runtime_api.h>

namespace flash_epilogue {

enum class OutputDType : int { kBFloat16 = 0, kFloat16 = 1 };

// One (rows, d, heads, batch) tensor. Batched: rows = seqlen. Varlen: rows = total tokens and
// batch = 1 (sequences are located through cu_seqlens). Strides are in elements; the head-dim
// stride is 1. Size-1 dims must already carry a legal (16-byte multiple) stride.
struct TensorDesc {
  void* ptr = nullptr;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
  int64_t batch_stride = 0;
  int head_dim = 0;
};

struct StoreLaunchArgs {
  TensorDesc dk_accum, dv_accum;  // fp32 inputs, in dK's / dV's layout
  TensorDesc dk, dv;              // 16-bit outputs
  int rows = 0;                   // seqlen (batched) or total tokens (varlen)
  int num_heads = 0;
  int batch = 0;                  // number of sequences (cu_seqlens.numel() - 1 in varlen)
  int const* cu_seqlens = nullptr;  // device, (batch + 1,) or null
  int const* seqused = nullptr;     // device, (batch,) or null
  bool use_tma = true;              // false: the predicated path (forced by cu_seqlens/seqused)
};

// Returns nullptr on success, else why the arguments cannot run (a launch error is left for
// cudaGetLastError). Instantiated per (dtype, compiled head dim) in csrc/instantiations/.
template <OutputDType kDType, int kHeadDim>
char const* launch_store(StoreLaunchArgs const& args, cudaStream_t stream);

}  // namespace flash_epilogue
