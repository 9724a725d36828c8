#pragma once

// The bindings' interface to the kernels: what a launch takes (the geometry, the plan, the tensors) and the launch
// functions, instantiated per (dtype, tile head dim, code path) in csrc/instantiations/. No CUTLASS types, so the
// host compiler never parses CuTe.

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "geometry.h"
#include "launch_plan.h"

namespace flash_epilogue {

enum class OutputDType : int { kBFloat16 = 0, kFloat16 = 1 };

// One (rows, d, heads, batch extent) tensor (varlen: rows = total tokens, batch extent 1). Element strides (head-dim
// stride 1); size-1 dims must already carry a legal (16-byte multiple) stride.
struct TensorDesc {
  void* ptr = nullptr;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
  int64_t batch_stride = 0;
  int head_dim = 0;
};

// A GQA accumulator: fp32 (batch extent, num_heads_kv, num_tiles, tile_elems), tile_elems from accum_tile_elems_for.
struct AccumDesc {
  float* ptr = nullptr;
  int64_t head_stride = 0;   // floats
  int64_t batch_stride = 0;  // floats
  int num_tiles = 0;
  int tile_elems = 0;  // floats per tile
};

// The sm_80 deterministic mode's int32 workspace: dK's counters, dV's, then the ticket CTAs claim their work from.
// A counter per (row tile of dK's tile, KV head, batch extent) of each accumulator. The launch zeroes it on its
// stream before every launch (graph-capturable), so the caller allocates it once.
struct SemaphoreWorkspace {
  int64_t counters = 0;  // per accumulator
  static SemaphoreWorkspace of(ProblemShape const& s, int block_n) { return {s.tiles(block_n)}; }
  int64_t numel() const { return 2 * counters + 1; }
  int* dk(int* base) const { return base; }
  int* dv(int* base) const { return base + counters; }
  int* ticket(int* base) const { return base + 2 * counters; }
  cudaError_t initialize(int* base, cudaStream_t stream) const {
    return cudaMemsetAsync(base, 0, static_cast<size_t>(numel()) * sizeof(int), stream);
  }
};

// Every launch's arguments carry the geometry and the plan; dK's and dV's tensors are tensors[0] and tensors[1]
// (num_tensors 1: dK's alone, as where dV has a launch of its own: see LaunchPlan).
struct StoreLaunchArgs {
  struct Tensor {
    TensorDesc accum;  // fp32 input, in the output's layout
    TensorDesc out;    // 16-bit output
  };
  Geometry geometry;
  LaunchPlan plan;
  Tensor tensors[2];
};

// Zero the valid rows of selected sequences and heads, inside a row window.
struct StoreZeroLaunchArgs {
  Geometry geometry;
  LaunchPlan plan;
  TensorDesc dk, dv;               // 16-bit outputs
  int const* batch_idx = nullptr;  // device, (num_batch_idx,): sequences to zero; null = all
  int num_batch_idx = 0;
  int const* head_idx = nullptr;  // device, (num_head_idx,): heads to zero; null = all
  int num_head_idx = 0;
  int row_start = 0;  // window [row_start, row_end) counted from each sequence's start, row_end <= rows
  int row_end = 0;
};

struct GqaAccumulateLaunchArgs {
  struct Tensor {
    TensorDesc partial;  // fp32 (rows, d, num_heads_q, batch extent)
    AccumDesc accum;
  };
  Geometry geometry;
  LaunchPlan plan;
  int num_heads_q = 0;
  Tensor tensors[2];
  int num_tensors = 2;
  int* semaphores = nullptr;  // plan.ordered: a SemaphoreWorkspace of dK's tile
};

struct GqaPostprocessLaunchArgs {
  struct Tensor {
    AccumDesc accum;
    TensorDesc out;  // 16-bit (rows, d, num_heads_kv, batch extent)
    float scale = 1.f;
  };
  Geometry geometry;
  LaunchPlan plan;
  Tensor tensors[2];
  int num_tensors = 2;
};

struct GqaDenseLaunchArgs {
  Geometry geometry;
  LaunchPlan plan;
  AccumDesc accum;
  TensorDesc out;  // fp32 (rows, w, num_heads_kv, batch extent)
};

struct GqaReduceLaunchArgs {
  struct Tensor {
    TensorDesc partial;  // (rows, d, num_heads_q, batch extent), fp32 or the outputs' 16-bit dtype
    TensorDesc out;      // 16-bit (rows, d, num_heads_kv, batch extent)
    float scale = 1.f;
  };
  Geometry geometry;
  LaunchPlan plan;
  int num_heads_q = 0;
  bool partial_fp32 = true;  // else the outputs' 16-bit dtype
  Tensor tensors[2];
  int num_tensors = 2;
};

// Each returns nullptr, else why the arguments cannot run (a launch error is left for cudaGetLastError). kHeadDim and
// kArch are the plan's dK tile head dim and code path (90: the sm_90 collectives; 80: the sm_80 ones, also runnable
// on sm_90).
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

// One entry of the tile table: a compiled (head dim, arch path, rows) tile, its BwdTileConfig and the GQA
// accumulator's floats per tile (>= block_n * head_dim: the TiledMma may pad) and slabs (AccumTraits). FA3's tiles
// (fa3 true) fix the GQA accumulator's order; the others are `store`'s, for small problems.
struct CompiledTileConfig {
  int head_dim, arch, block_n, num_threads;
  bool swap_ab;
  int atom_layout_n, accum_tile_elems, slab_cols, slab_elems;
  bool fa3;
  int accum_tile_elems_for(int width) const {
    return accum_slabs(width, slab_cols, accum_tile_elems / slab_elems) * slab_elems;
  }
};

// The tile table: head dims ascending, for each FA3's sm_90 tile, then the sm_80 one, then store's others.
std::vector<CompiledTileConfig> const& compiled_tile_configs();

}  // namespace flash_epilogue
