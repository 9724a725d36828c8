#pragma once

// Host side of `store`: builds the collective's arguments from a StoreLaunchArgs, checks them all
// with can_implement before any TMA descriptor is encoded, and launches the driver kernel:
// TileStreamKernel on the sm_90 path (StoreKernel<Sm90> at head dims <= 64), StoreKernel on the
// sm_80 path. Also the launcher of TileStreamKernel that gqa_reduce shares.

#include <algorithm>
#include <atomic>
#include <climits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "launch_args.h"
#include "store_kernel.cuh"
#include "tile_stream_kernel.cuh"

namespace flash_epilogue {

template <OutputDType kDType>
using element_of = std::conditional_t<kDType == OutputDType::kBFloat16, cutlass::bfloat16_t, cutlass::half_t>;

// Raise Kernel's dynamic shared-memory limit once per device (the attribute is per device).
// Keyed by the kernel class, not by the kernel's function-pointer type: two kernels with the same
// Params (a driver derived from another) have the same pointer type, and a cache shared between
// them skipped the second kernel's attribute, whose launch then failed with "invalid argument".
template <class Kernel>
cudaError_t set_smem_limit_once(int smem_bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> configured_bytes[kMaxDevices] = {};  // host threads launch concurrently
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) { return err; }
  if (device < kMaxDevices && configured_bytes[device].load(std::memory_order_relaxed) >= smem_bytes) {
    return cudaSuccess;
  }
  // Always raise it: the default 48 KB limit counts the kernel's static shared memory too, so a
  // 48 KB dynamic request plus a few static bytes fails to launch ("invalid argument").
  cudaError_t err = cudaFuncSetAttribute(epilogue_device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         smem_bytes);
  if (err == cudaSuccess && device < kMaxDevices) { configured_bytes[device].store(smem_bytes, std::memory_order_relaxed); }
  return err;
}

// Launch Kernel over `grid` with its shared storage (nothing for an empty grid). Returns nullptr:
// a launch error is left for the caller's cudaGetLastError.
template <class Kernel>
char const* launch_kernel(dim3 grid, typename Kernel::Params const& params, cudaStream_t stream) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) { return nullptr; }
  int const smem_bytes = Kernel::kSharedStorageSize;
  if (set_smem_limit_once<Kernel>(smem_bytes) != cudaSuccess) { return nullptr; }  // reported by cudaGetLastError
  epilogue_device_kernel<Kernel><<<grid, Kernel::kNumThreads, smem_bytes, stream>>>(params);
  return nullptr;
}

template <int kArch>
using arch_tag_of = std::conditional_t<kArch >= 90, cutlass::arch::Sm90, cutlass::arch::Sm80>;

// (rows, d, heads, batch) element strides of a TensorDesc, as every driver's Params holds them.
inline cute::Stride<int64_t, cute::_1, int64_t, int64_t> stride_of(TensorDesc const& t) {
  return {t.row_stride, cute::_1{}, t.head_stride, t.batch_stride};
}

// Whether a launch takes the kernels' batched instantiation (the collective's Varlen = false: TMA
// stores only, no sequence metadata). With cu_seqlens / seqused the Varlen one stores the tiles
// inside their sequence by TMA and the rest through predicated stores (sm_90).
template <class LaunchArgs>
bool without_sequence_metadata(LaunchArgs const& args) {
  return args.cu_seqlens == nullptr && args.seqused == nullptr;
}

// CollectiveEpilogueBwd's arguments for outputs dk/dv (dv.ptr may be null: dK only).
template <class Epilogue, class Element>
typename Epilogue::Arguments epilogue_arguments(TensorDesc const& dk, TensorDesc const& dv, int rows, int heads,
                                                int batch_extent, int const* cu_seqlens, int const* seqused) {
  auto shape = [&](TensorDesc const& t) { return typename Epilogue::ShapedKV{rows, t.head_dim, heads, batch_extent}; };
  return {static_cast<Element*>(dk.ptr), shape(dk), stride_of(dk), static_cast<Element*>(dv.ptr), shape(dv),
          stride_of(dv), cu_seqlens, seqused};
}

// The collective's Params for outputs[0, count), each as the collective's dK (no dV), into
// params[i]; or the reason the first output that cannot be stored gives. Every output is checked
// before any is encoded: to_underlying_arguments encodes a TMA descriptor, and make_tma_copy
// asserts on one the driver would reject. Callers return before this when there is nothing to
// launch (TMA cannot encode an empty tensor).
template <class Epilogue, class Element>
char const* output_epilogue_params(TensorDesc const* outputs, int count, int rows, int heads, int batch_extent,
                                   int const* cu_seqlens, int const* seqused, typename Epilogue::Params* params) {
  auto arguments = [&](TensorDesc const& out) {
    return epilogue_arguments<Epilogue, Element>(out, TensorDesc{}, rows, heads, batch_extent, cu_seqlens, seqused);
  };
  for (int i = 0; i < count; ++i) {
    if (char const* why = Epilogue::can_implement(arguments(outputs[i]))) { return why; }
  }
  for (int i = 0; i < count; ++i) { params[i] = Epilogue::to_underlying_arguments(arguments(outputs[i])); }
  return nullptr;
}

// Row tiles per head: batched, of `rows`; varlen, of the kBlockN-aligned padded tile space that
// tile_to_block_and_batch walks (sized from the shapes alone, no host read of cu_seqlens).
template <int kBlockN>
int64_t row_tiles(int64_t rows, int batch, bool varlen) {
  return varlen ? rows / kBlockN + batch : (rows + kBlockN - 1) / kBlockN;
}

template <class Element, int kHeadDim, class ArchTag, bool kVarlen>
char const* launch_store_variant(StoreLaunchArgs const& args, cudaStream_t stream) {
  using namespace cute;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  using Kernel = StoreKernel<Config, Element, ArchTag, kVarlen>;
  using Epilogue = typename Kernel::Epilogue;
  bool const is_varlen = args.cu_seqlens != nullptr;
  int const batch_extent = is_varlen ? 1 : args.batch;

  int const num_tiles = static_cast<int>(row_tiles<Config::kBlockN>(args.rows, args.batch, is_varlen));
  if (num_tiles == 0 || args.num_heads == 0 || batch_extent == 0) { return nullptr; }
  // One collective per output (the driver splits dK and dV over CTAs).
  TensorDesc const outputs[2] = {args.dk, args.dv};
  typename Epilogue::Params epilogue[2];
  if (char const* why = output_epilogue_params<Epilogue, Element>(outputs, 2, args.rows, args.num_heads, batch_extent,
                                                                  args.cu_seqlens, args.seqused, epilogue)) {
    return why;
  }
  typename Kernel::Params params{{{epilogue[0], static_cast<float const*>(args.dk_accum.ptr), stride_of(args.dk_accum)},
                                  {epilogue[1], static_cast<float const*>(args.dv_accum.ptr), stride_of(args.dv_accum)}},
                                 args.num_heads, args.batch};
  return launch_kernel<Kernel>(dim3(num_tiles, 2 * args.num_heads, batch_extent), params, stream);
}

// The current device's multiprocessor count, cached per device (0 if it cannot be read).
inline int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static int counts[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) { return 0; }
  if (device < kMaxDevices && counts[device] > 0) { return counts[device]; }
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) { return 0; }
  if (device < kMaxDevices) { counts[device] = count; }
  return count;
}

// One output of a TileStreamKernel launch: a 16-bit (rows, d, heads, batch) tensor, its input
// (rows, d, heads * group, batch) and the scale of the sum (kReduce kernels only).
struct StreamedTensor {
  TensorDesc out;
  TensorDesc in;
  float scale = 1.f;
};

template <class Kernel>
char const* launch_tile_stream(StreamedTensor const* tensors, int num_tensors, int rows, int num_heads, int group,
                               int batch, int const* cu_seqlens, int const* seqused, cudaStream_t stream) {
  using namespace cute;
  using Epilogue = typename Kernel::Epilogue;
  using ElementIn = typename Kernel::ElementIn;
  constexpr int kBlockN = Kernel::kBlockN;
  bool const varlen = cu_seqlens != nullptr;
  int const batch_extent = varlen ? 1 : batch;
  int64_t const n_tiles = row_tiles<kBlockN>(rows, batch, varlen);
  int64_t const num_tiles = n_tiles * num_tensors * num_heads * batch_extent;

  for (int i = 0; i < num_tensors; ++i) {
    for (int64_t s : {tensors[i].in.row_stride, tensors[i].in.head_stride, tensors[i].in.batch_stride}) {
      if (s * static_cast<int64_t>(sizeof(ElementIn)) >= (int64_t(1) << 40)) { return "input strides must be < 2^40 bytes (TMA)"; }
    }
  }
  if (num_tiles == 0) { return nullptr; }
  if (num_tiles > INT_MAX) { return "more than 2^31 - 1 tiles"; }
  TensorDesc const outputs[2] = {tensors[0].out, num_tensors > 1 ? tensors[1].out : TensorDesc{}};
  typename Epilogue::Params epilogue[2];
  if (char const* why = output_epilogue_params<Epilogue, typename Kernel::Element>(
          outputs, num_tensors, rows, num_heads, batch_extent, cu_seqlens, seqused, epilogue)) {
    return why;
  }
  typename Kernel::Params params{};
  for (int i = 0; i < num_tensors; ++i) {
    StreamedTensor const& t = tensors[i];
    typename Epilogue::ShapedKV const shape_in{rows, t.in.head_dim, num_heads * group, batch_extent};
    auto const m_in = make_tensor(make_gmem_ptr(static_cast<ElementIn const*>(t.in.ptr)), shape_in, stride_of(t.in));
    params.tensors[i] = {epilogue[i], make_tma_copy(SM90_TMA_LOAD{}, m_in, typename Kernel::SmemLayoutIn{}, typename Kernel::TileShape{}, _1{}),
                         shape_in, t.scale};
  }
  params.num_tensors = num_tensors;
  params.num_heads = num_heads;
  params.group = group;
  params.batch = batch;
  params.num_n_tiles = static_cast<int>(n_tiles);
  params.num_tiles = static_cast<int>(num_tiles);
  // Persistent CTAs, kMinBlocksPerSm per SM (each holds that share of the SM's shared memory).
  int64_t const resident = int64_t(Kernel::kMinBlocksPerSm) * std::max(multiprocessor_count(), 1);
  int const grid = static_cast<int>(std::min<int64_t>(num_tiles, resident));
  return launch_kernel<Kernel>(dim3(grid), params, stream);
}

// StoreKernel (one CTA per tile) in the instantiation the call's sequence metadata needs.
template <class Element, int kHeadDim, class ArchTag>
char const* launch_store_one_cta_per_tile(StoreLaunchArgs const& args, cudaStream_t stream) {
  return without_sequence_metadata(args) ? launch_store_variant<Element, kHeadDim, ArchTag, /*kVarlen=*/false>(args, stream)
                                         : launch_store_variant<Element, kHeadDim, ArchTag, /*kVarlen=*/true>(args, stream);
}

// launch_tile_stream of the TileStreamKernel instantiation the call's sequence metadata needs
// (kVarlen when cu_seqlens or seqused is given).
template <class Config, class Element, class ElementIn, bool kReduce, int kCtasPerSm = 1>
char const* launch_tile_stream_for(StreamedTensor const* tensors, int num_tensors, int rows, int num_heads, int group,
                                   int batch, int const* cu_seqlens, int const* seqused, cudaStream_t stream) {
  auto launch = [&](auto varlen) {
    using Kernel = TileStreamKernel<Config, Element, ElementIn, decltype(varlen)::value, kReduce, kCtasPerSm>;
    return launch_tile_stream<Kernel>(tensors, num_tensors, rows, num_heads, group, batch, cu_seqlens, seqused, stream);
  };
  return cu_seqlens == nullptr && seqused == nullptr ? launch(std::false_type{}) : launch(std::true_type{});
}

// store's dK and dV streamed by TileStreamKernel.
template <class Config, class Element, int kCtasPerSm>
char const* launch_store_streamed(StoreLaunchArgs const& args, cudaStream_t stream) {
  StreamedTensor const tensors[2] = {{args.dk, args.dk_accum}, {args.dv, args.dv_accum}};
  return launch_tile_stream_for<Config, Element, float, /*kReduce=*/false, kCtasPerSm>(
      tensors, 2, args.rows, args.num_heads, 1, args.batch, args.cu_seqlens, args.seqused, stream);
}

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_store(StoreLaunchArgs const& args, cudaStream_t stream) {
  using Element = element_of<kDType>;
  using ArchTag = arch_tag_of<kArch>;
  if constexpr (kArch >= 90 && kHeadDim <= 64) {
    // Small tiles (32 KB of fp32): one CTA per tile, two per SM, measured faster on the H200 than
    // streaming them (8x4096x4x64: 34.1 vs 36.2 us, varlen 37.0 vs 39.1;
    // benchmarks/results/store_hd64_c1d2807.json).
    return launch_store_one_cta_per_tile<Element, kHeadDim, ArchTag>(args, stream);
  } else if constexpr (kArch >= 90) {
    using Config = BwdTileConfig<kHeadDim, ArchTag>;
    // Output tiles of dK and dV together, at Config's tile size: small problems take other kernels.
    bool const is_varlen = args.cu_seqlens != nullptr;
    [[maybe_unused]] int64_t const output_tiles =
        2 * row_tiles<Config::kBlockN>(args.rows, args.batch, is_varlen) * args.num_heads * (is_varlen ? 1 : args.batch);
    if constexpr (kHeadDim > 128) {
      // Up to two tiles per SM at hdim 192/256 (72-80 KB tiles, two or three stages), the streaming
      // kernel's prologue is not paid back: one CTA per tile was 4-11% faster on the H200 for 112-206
      // tiles (hdim 128: 5-10% slower at 64-4096; benchmarks/results/small_store_7b744b7.json). With
      // cu_seqlens / seqused the streaming kernel was slower still: 6.2 -> 7.7 us (512 tokens x 8 heads,
      // hdim 256), 9.7 -> 11.9 (8192 x 1), 5.5 -> 6.8 (512 x 8, hdim 192) (results/varlen_small_5640e70.json).
      if (output_tiles <= 2 * int64_t(multiprocessor_count())) {
        return launch_store_one_cta_per_tile<Element, kHeadDim, ArchTag>(args, stream);
      }
    }
    if constexpr (kHeadDim == 128) {
      // At most one 128-row tile per SM (dK's and dV's): (64, 128) tiles, two CTAs per SM of 3
      // stages each. On the H200 (results/store_block64_7116d02.json) 11% faster at 128 tiles
      // (1, 8192, 1, 128), 6% at 64 (1, 512, 8, 128); 2% slower at 512 and on the large shapes,
      // where one CTA per SM and 128-row tiles stay. With cu_seqlens / seqused, 4-9% faster in CUDA
      // graphs: 5.66 -> 5.19 us (512 tokens x 8 heads), 7.18 -> 6.91 (8192 x 1), 5.71 -> 5.27 (three
      // sequences, 2000 tokens x 2 heads) (results/varlen_small_5640e70.json).
      using SmallProblemConfig = BwdTileConfigSm90Base<128, 64, 256, /*kSwapAB=*/false, /*kAtomLayoutNdKV=*/1>;
      if (output_tiles <= multiprocessor_count()) {
        return launch_store_streamed<SmallProblemConfig, Element, /*kCtasPerSm=*/2>(args, stream);
      }
    }
    return launch_store_streamed<Config, Element, /*kCtasPerSm=*/1>(args, stream);
  } else {
    // sm_80 has no TMA: one CTA per tile, and the collective's predicated path.
    return launch_store_variant<Element, kHeadDim, ArchTag, /*kVarlen=*/true>(args, stream);
  }
}

}  // namespace flash_epilogue
