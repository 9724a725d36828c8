#pragma once

// The bindings' interface to the kernels: no CUTLASS types, so the host compiler never parses CuTe.

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

namespace flash_epilogue {

enum class OutputDType : int { kBFloat16 = 0, kFloat16 = 1 };

// One (rows, d, heads, batch) tensor; varlen: rows = total tokens, batch = 1. Element strides (head-dim
// stride 1); size-1 dims must already carry a legal (16-byte multiple) stride.
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
};

// Zero the valid rows of selected sequences and heads, inside a row window.
struct StoreZeroLaunchArgs {
  TensorDesc dk, dv;                // 16-bit outputs
  int rows = 0;                     // seqlen (batched) or total tokens (varlen)
  int num_heads = 0;
  int batch = 0;
  int const* cu_seqlens = nullptr;  // device, (batch + 1,) or null
  int const* seqused = nullptr;     // device, (batch,) or null
  int const* batch_idx = nullptr;   // device, (num_batch_idx,): sequences to zero; null = all
  int num_batch_idx = 0;
  int const* head_idx = nullptr;    // device, (num_head_idx,): heads to zero; null = all
  int num_head_idx = 0;
  int row_begin = 0;                // window [row_begin, row_end) counted from each sequence's start
  int row_end = 0;
};

// GQA accumulators: fp32 (batch_extent, h_k, num_tiles, tile_elems), tile_elems from accum_tile_elems_for.
struct AccumDesc {
  float* ptr = nullptr;
  int64_t head_stride = 0;   // floats
  int64_t batch_stride = 0;  // floats
  int num_tiles = 0;
  int tile_elems = 0;        // floats per tile
};

struct GqaAccumulateLaunchArgs {
  TensorDesc dk_partial, dv_partial;  // fp32 (rows, d, h_q, batch); dv_partial.ptr null: dK only (sm_90)
  AccumDesc dk_accum, dv_accum;
  int rows = 0, num_heads_q = 0, num_heads_kv = 0, batch = 0;
  int const* cu_seqlens = nullptr;
  int const* seqused = nullptr;
  int* semaphores = nullptr;  // deterministic: 2 * batch_extent * num_tiles * h_k + 1 ints, zeroed by the launch
};

struct GqaPostprocessLaunchArgs {
  AccumDesc dk_accum, dv_accum;
  TensorDesc dk, dv;  // 16-bit (rows, d, h_k, batch); dv.ptr null: dK only
  int rows = 0, num_heads_kv = 0, batch = 0;
  int const* cu_seqlens = nullptr;
  int const* seqused = nullptr;
  float scale_dk = 1.f, scale_dv = 1.f;
};

struct GqaDenseLaunchArgs {
  AccumDesc accum;
  TensorDesc out;  // fp32 (rows, w, h_k, batch)
  int rows = 0, num_heads_kv = 0, batch = 0;
  int const* cu_seqlens = nullptr;
  int const* seqused = nullptr;
};

struct GqaReduceLaunchArgs {
  TensorDesc dk_partial, dv_partial;  // (rows, d, h_q, batch); dv_partial.ptr null: dK only
  bool partial_fp32 = true;           // else the outputs' 16-bit dtype
  TensorDesc dk, dv;                  // 16-bit (rows, d, h_k, batch); dv.ptr null iff dv_partial.ptr null
  int rows = 0, num_heads_q = 0, num_heads_kv = 0, batch = 0;
  int const* cu_seqlens = nullptr;
  int const* seqused = nullptr;
  float scale_dk = 1.f, scale_dv = 1.f;
};

// Each returns nullptr, else why the arguments cannot run (a launch error is left for cudaGetLastError).
// kArch 90: the sm_90 path; 80: the sm_80 path (Sm80 collectives, also runnable on sm_90).
template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_store(StoreLaunchArgs const& args, cudaStream_t stream);
template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_store_zero(StoreZeroLaunchArgs const& args, cudaStream_t stream);
template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_gqa_postprocess(GqaPostprocessLaunchArgs const& args, cudaStream_t stream);
template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_gqa_reduce(GqaReduceLaunchArgs const& args, cudaStream_t stream);
// The accumulator's order depends on the C layout, not on the 16-bit type.
template <int kHeadDim, int kArch>
char const* launch_gqa_accumulate(GqaAccumulateLaunchArgs const& args, cudaStream_t stream);
template <int kHeadDim, int kArch>
char const* launch_gqa_accum_to_dense(GqaDenseLaunchArgs const& args, cudaStream_t stream);

// The slabs an accumulator tile `width` columns wide holds: those covering its columns, or all (slab_cols 0).
constexpr int accum_slabs(int width, int slab_cols, int num_slabs) {
  return slab_cols ? (width + slab_cols - 1) / slab_cols : num_slabs;
}

// One compiled (head dim, arch path): BwdTileConfig and the GQA accumulator's floats per tile
// (>= block_n * head_dim: the TiledMma may pad) and slabs (GqaTraits).
struct CompiledTileConfig {
  int head_dim, arch, block_n, num_threads; bool swap_ab; int atom_layout_n, accum_tile_elems, slab_cols, slab_elems;
  int accum_tile_elems_for(int width) const {
    return accum_slabs(width, slab_cols, accum_tile_elems / slab_elems) * slab_elems;
  }
};

// every compiled (head dim, arch path): head dims ascending, for each the 90 path then the 80 path
std::vector<CompiledTileConfig> const& compiled_tile_configs();

}  // namespace flash_epilogue
