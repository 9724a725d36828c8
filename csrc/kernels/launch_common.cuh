#pragma once

// What the launches share: the drivers' __global__ entry point, the launch, descriptors -> collective
// arguments (checked before any TMA descriptor is encoded), the one-CTA-per-tile grid, and the launch of
// TileStreamKernel.

#include <algorithm>
#include <atomic>
#include <climits>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "geometry.h"
#include "launch_args.h"
#include "static_switch.h"
#include "store_kernel.cuh"
#include "tile_schedule.cuh"
#include "tile_stream_kernel.cuh"

namespace flash_epilogue {

// An sm_90 kernel compiles to an empty body for sm_80 (FLASH_EPILOGUE_CUDA_ARCHS="80;90a"): it is never
// launched there, and its TMA/stmatrix code cannot be emitted.
template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, Kernel::kMinBlocksPerSm)
    epilogue_device_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
  extern __shared__ __align__(1024) char smem[];
#if defined(__CUDA_ARCH__)
  if constexpr (Kernel::ArchTag::kMinComputeCapability >= 90) {
#if __CUDA_ARCH__ >= 900
    Kernel{}(params, smem);
#endif
  } else {
    Kernel{}(params, smem);
  }
#endif
}

template <OutputDType kDType>
using element_of = std::conditional_t<kDType == OutputDType::kBFloat16, cutlass::bfloat16_t, cutlass::half_t>;

constexpr int kMaxDevices = 64;  // the per-device cache below; a device past it is not cached

// Raise Kernel's dynamic shared-memory limit once per device. Keyed by the kernel class: two kernels with
// the same Params share a function-pointer type, and a cache keyed by it skipped the second's attribute.
template <class Kernel>
cudaError_t set_smem_limit_once(int smem_bytes) {
  static std::atomic<int> configured_bytes[kMaxDevices] = {};  // host threads launch concurrently
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) { return err; }
  if (device < kMaxDevices && configured_bytes[device].load(std::memory_order_relaxed) >= smem_bytes) {
    return cudaSuccess;
  }
  // Always raise it: the default 48 KB limit counts static shared memory too.
  cudaError_t err = cudaFuncSetAttribute(epilogue_device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         smem_bytes);
  if (err == cudaSuccess && device < kMaxDevices) {
    configured_bytes[device].store(smem_bytes, std::memory_order_relaxed);
  }
  return err;
}

// Launch Kernel over `grid` (nothing for an empty grid); a launch error is left for cudaGetLastError.
template <class Kernel>
char const* launch_kernel(dim3 grid, typename Kernel::Params const& params, cudaStream_t stream) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) { return nullptr; }
  int const smem_bytes = Kernel::kSharedStorageSize;
  if constexpr (Kernel::kSharedStorageSize > 0) {  // none asked for: the default limit holds
    if (set_smem_limit_once<Kernel>(smem_bytes) != cudaSuccess) { return nullptr; }  // reported by cudaGetLastError
  }
  epilogue_device_kernel<Kernel><<<grid, Kernel::kNumThreads, smem_bytes, stream>>>(params);
  return nullptr;
}

// The grid of a persistent driver: kMinBlocksPerSm CTAs per SM, fewer when there are fewer tiles.
template <class Kernel>
int persistent_grid(int64_t num_tiles, int num_sms) {
  int64_t const resident = int64_t(Kernel::kMinBlocksPerSm) * std::max(num_sms, 1);
  return static_cast<int>(std::min(num_tiles, resident));
}

// Where the plan asks for a launch this instantiation does not run (driver, tile rows, CTAs per SM), why: the
// instantiations compile what the plan can ask for, and a mismatch is the plan's bug, never the caller's.
inline char const* plan_mismatch(LaunchPlan const& plan, Driver driver, int block_n, int ctas_per_sm) {
  bool const same = plan.driver == driver && plan.tile.block_n == block_n && plan.ctas_per_sm == ctas_per_sm;
  return same ? nullptr : "internal: the plan asks for a launch this build does not compile";
}

// fn(std::bool_constant<predicated>): the instantiation predicating rows per sequence (the collectives' Varlen) or
// not, as the plan says. kPredicatedOnly: only the predicated one is compiled (the sm_80 path; tiles the plan picks
// only with sequence metadata).
template <bool kPredicatedOnly, class Fn>
char const* with_predication(bool predicated, Fn&& fn) {
  if (predicated) { return fn(std::true_type{}); }
  if constexpr (kPredicatedOnly) {
    return "internal: the plan asks for an unpredicated launch this build does not compile";
  } else {
    return fn(std::false_type{});
  }
}

// A TensorDesc's (rows, d, heads, batch extent) shape and element strides; heads: the tensor's (the geometry's KV
// heads, or the partials' query heads).
inline cute::Shape<int32_t, int32_t, int32_t, int32_t> shape_of(TensorDesc const& t, Geometry const& g, int heads) {
  return {g.rows, t.head_dim, heads, g.batch_extent()};
}
inline cute::Stride<int64_t, cute::_1, int64_t, int64_t> stride_of(TensorDesc const& t) {
  return {t.row_stride, cute::_1{}, t.head_stride, t.batch_stride};
}

// CollectiveEpilogueBwd's arguments for outputs dk/dv of g's KV heads (dv.ptr may be null: dK only).
template <class Epilogue, class Element>
typename Epilogue::Arguments epilogue_arguments(TensorDesc const& dk, TensorDesc const& dv, Geometry const& g) {
  return {static_cast<Element*>(dk.ptr), shape_of(dk, g, g.num_heads_kv), stride_of(dk),
          static_cast<Element*>(dv.ptr), shape_of(dv, g, g.num_heads_kv), stride_of(dv),
          g.cu_seqlens, g.seqused};
}

// The collective's Params of outputs[0, count), each as its dK (no dV), or the first reason one cannot be
// stored. All are checked before any TMA descriptor is encoded. Callers return before this when there is
// nothing to launch (TMA cannot encode an empty tensor).
template <class Epilogue, class Element>
char const* output_epilogue_params(TensorDesc const* outputs, int count, Geometry const& g,
                                   typename Epilogue::Params* params) {
  for (int i = 0; i < count; ++i) {
    if (char const* why = Epilogue::can_implement(epilogue_arguments<Epilogue, Element>(outputs[i], {}, g))) {
      return why;
    }
  }
  for (int i = 0; i < count; ++i) {
    params[i] = Epilogue::to_underlying_arguments(epilogue_arguments<Epilogue, Element>(outputs[i], {}, g));
  }
  return nullptr;
}

// Grid (row tiles, heads, batch extent) of a one-CTA-per-tile driver (see tile_schedule.cuh).
template <int kBlockN>
dim3 row_tile_grid(Geometry const& g, int heads) {
  return dim3(static_cast<unsigned>(g.row_tiles(kBlockN)), heads, g.batch_extent());
}

// Launch a one-CTA-per-output-tile driver of outputs[0, count) (see locate_output_tile); params.tensors hold the
// rest of each output's parameters.
template <class Kernel>
char const* launch_output_tiles(Geometry const& g, TensorDesc const* outputs, int count,
                                typename Kernel::Params& params, cudaStream_t stream) {
  using Epilogue = typename Kernel::Epilogue;
  typename Epilogue::Params epilogue[2];
  if (char const* why = output_epilogue_params<Epilogue, typename Kernel::Element>(outputs, count, g, epilogue)) {
    return why;
  }
  for (int i = 0; i < count; ++i) { params.tensors[i].epilogue = epilogue[i]; }
  params.geometry = g;
  dim3 grid = row_tile_grid<Kernel::kBlockN>(g, g.num_heads_kv);
  grid.x *= count;  // tiles of dK, then tiles of dV
  return launch_kernel<Kernel>(grid, params, stream);
}

// Whether TMA can load a tensor of these strides (each under 2^40 bytes), or why not.
inline char const* tma_input_strides_fit(TensorDesc const& t, size_t element_bytes) {
  for (int64_t s : {t.row_stride, t.head_stride, t.batch_stride}) {
    if (s * static_cast<int64_t>(element_bytes) >= (int64_t(1) << 40)) {
      return "input strides must be < 2^40 bytes (TMA)";
    }
  }
  return nullptr;
}

// The most tiles one persistent launch walks: the tile index, and tile + gridDim.x, stay ints.
constexpr int64_t kMaxStreamedTiles = INT_MAX - (1 << 16);

// One output of a TileStreamKernel launch, its input (rows, d, num_heads_kv * group, batch) and scale (kReduce).
struct StreamedTensor {
  TensorDesc out;
  TensorDesc in;
  float scale = 1.f;
};

template <class Kernel>
char const* launch_tile_stream(StreamedTensor const* tensors, int num_tensors, Geometry const& g, int group,
                               int num_sms, cudaStream_t stream) {
  using Epilogue = typename Kernel::Epilogue;
  using ElementIn = typename Kernel::ElementIn;
  int64_t const n_tiles = g.row_tiles(Kernel::kBlockN);
  int64_t const num_tiles = g.tiles(Kernel::kBlockN) * num_tensors;

  for (int i = 0; i < num_tensors; ++i) {
    if (char const* why = tma_input_strides_fit(tensors[i].in, sizeof(ElementIn))) { return why; }
  }
  if (num_tiles == 0) { return nullptr; }
  if (num_tiles > kMaxStreamedTiles) {
    // More tiles run as launches over ranges of heads, each tensor offset to its first head: same bits.
    int64_t const per_head = n_tiles * num_tensors * g.batch_extent();
    if (per_head > kMaxStreamedTiles) { return "more than 2^31 - 2^16 tiles per head"; }
    int const chunk = static_cast<int>(kMaxStreamedTiles / per_head);
    for (int h0 = 0; h0 < g.num_heads_kv; h0 += chunk) {
      StreamedTensor part[2];
      for (int i = 0; i < num_tensors; ++i) {
        part[i] = tensors[i];
        part[i].out.ptr = static_cast<typename Kernel::Element*>(tensors[i].out.ptr) + h0 * tensors[i].out.head_stride;
        part[i].in.ptr = static_cast<ElementIn*>(tensors[i].in.ptr) + int64_t(h0) * group * tensors[i].in.head_stride;
      }
      Geometry heads = g;
      heads.num_heads_kv = std::min(chunk, g.num_heads_kv - h0);
      if (char const* why = launch_tile_stream<Kernel>(part, num_tensors, heads, group, num_sms, stream)) {
        return why;
      }
    }
    return nullptr;
  }
  TensorDesc const outputs[2] = {tensors[0].out, num_tensors > 1 ? tensors[1].out : TensorDesc{}};
  typename Epilogue::Params epilogue[2];
  if (char const* why =
          output_epilogue_params<Epilogue, typename Kernel::Element>(outputs, num_tensors, g, epilogue)) {
    return why;
  }
  typename Kernel::Params params{};
  for (int i = 0; i < num_tensors; ++i) {
    StreamedTensor const& t = tensors[i];
    typename Epilogue::ShapedKV const shape_in = shape_of(t.in, g, g.num_heads_kv * group);
    params.tensors[i] = {epilogue[i],
                         Kernel::Ring::make_tma_load(static_cast<ElementIn const*>(t.in.ptr), shape_in,
                                                     stride_of(t.in)),
                         shape_in, t.scale};
  }
  params.num_tensors = num_tensors;
  params.group = group;
  params.geometry = g;
  params.num_n_tiles = static_cast<int>(n_tiles);
  params.num_tiles = static_cast<int>(num_tiles);
  return launch_kernel<Kernel>(dim3(persistent_grid<Kernel>(num_tiles, num_sms)), params, stream);
}

// launch_tile_stream of the plan's instantiation: Config's tile, rows predicated or not, kCtasPerSm.
template <class Config, class Element, class ElementIn, bool kReduce, int kCtasPerSm>
char const* launch_tile_stream_for(LaunchPlan const& plan, StreamedTensor const* tensors, int num_tensors,
                                   Geometry const& g, int group, cudaStream_t stream) {
  if (char const* why = plan_mismatch(plan, Driver::kStream, Config::kBlockN, kCtasPerSm)) { return why; }
  return with_predication</*kPredicatedOnly=*/false>(plan.predicated, [&](auto predicated) {
    using Traits = OutputTileTraits<Config, Element, cutlass::arch::Sm90, decltype(predicated)::value>;
    using Kernel = TileStreamKernel<Traits, ElementIn, kReduce, kCtasPerSm>;
    return launch_tile_stream<Kernel>(tensors, num_tensors, g, group, plan.num_sms, stream);
  });
}

}  // namespace flash_epilogue
