#pragma once

// Host side of the GQA ops: argument structs -> collective arguments -> checked launches.

#include <cute/tensor.hpp>

#include "gqa_kernels.cuh"
#include "launch_args.h"
#include "store_launch_template.cuh"

namespace flash_epilogue {

namespace detail {

inline ShapeRowsHeadBatch shape_of(TensorDesc const& t, int rows, int heads, int batch_extent) {
  return {rows, t.head_dim, heads, batch_extent};
}

template <class Traits>
AccumReader<Traits> reader_of(AccumDesc const& a) {
  return {a.ptr, a.head_stride, a.batch_stride, a.num_tiles};
}

// Grid over (tiles, heads, batch) as the store driver maps it.
template <int kBlockN>
dim3 tile_grid(int rows, int heads, int batch, bool varlen) {
  int const tiles = varlen ? rows / kBlockN + batch : (rows + kBlockN - 1) / kBlockN;
  return dim3(tiles, heads, varlen ? 1 : batch);
}

template <class Kernel>
char const* launch(dim3 grid, typename Kernel::Params const& params, cudaStream_t stream) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) { return nullptr; }
  auto kernel = epilogue_device_kernel<Kernel>;
  int const smem_bytes = Kernel::kSharedStorageSize;
  if (set_smem_limit_once(kernel, smem_bytes) != cudaSuccess) { return nullptr; }  // reported by cudaGetLastError
  kernel<<<grid, Kernel::kNumThreads, smem_bytes, stream>>>(params);
  return nullptr;
}

}  // namespace detail

template <int kHeadDim, int kArch>
char const* launch_gqa_accumulate(GqaAccumulateLaunchArgs const& args, cudaStream_t stream) {
  using ArchTag = arch_tag_of<kArch>;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  using Kernel = GqaAccumulateKernel<Config, ArchTag>;
  using Collective = typename Kernel::Collective;
  bool const varlen = args.cu_seqlens != nullptr;
  int const batch_extent = varlen ? 1 : args.batch;
  typename Collective::Arguments coll_args{args.dk_accum.ptr, args.dv_accum.ptr, args.dk_accum.head_stride,
                                           args.dk_accum.batch_stride, args.dk_accum.num_tiles, batch_extent,
                                           args.num_heads_q, args.num_heads_kv, args.rows,
                                           args.semaphores, args.cu_seqlens, args.seqused};
  if (char const* why = Collective::can_implement(coll_args)) { return why; }
  dim3 const tiles = detail::tile_grid<Config::kBlockN>(args.rows, args.num_heads_q, args.batch, varlen);
  int64_t const counters = 2 * static_cast<int64_t>(batch_extent) * args.dk_accum.num_tiles * args.num_heads_kv;
  int* const ticket = args.semaphores ? args.semaphores + counters : nullptr;
  typename Kernel::Params params{Collective::to_underlying_arguments(coll_args),
                                 static_cast<float const*>(args.dk_partial.ptr),
                                 detail::shape_of(args.dk_partial, args.rows, args.num_heads_q, batch_extent),
                                 stride_of(args.dk_partial),
                                 static_cast<float const*>(args.dv_partial.ptr),
                                 detail::shape_of(args.dv_partial, args.rows, args.num_heads_q, batch_extent),
                                 stride_of(args.dv_partial),
                                 args.batch, args.num_heads_q, static_cast<int>(tiles.x), static_cast<int>(tiles.z), ticket};
  if (args.semaphores) {
    // Counters and ticket start at zero on this stream, before every launch (graph-capturable).
    if (cudaMemsetAsync(args.semaphores, 0, (counters + 1) * sizeof(int), stream) != cudaSuccess) { return nullptr; }
    // One CTA per work item, in ticket order (see GqaAccumulateKernel).
    dim3 const grid(tiles.x * tiles.y * tiles.z, 1, 1);
    return detail::launch<Kernel>(grid, params, stream);
  }
  return detail::launch<Kernel>(tiles, params, stream);
}

template <int kHeadDim, int kArch>
char const* launch_gqa_accum_to_dense(GqaDenseLaunchArgs const& args, cudaStream_t stream) {
  using ArchTag = arch_tag_of<kArch>;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  using Kernel = GqaDenseKernel<Config, ArchTag>;
  bool const varlen = args.cu_seqlens != nullptr;
  int const batch_extent = varlen ? 1 : args.batch;
  typename Kernel::Params params{detail::reader_of<typename Kernel::Traits>(args.accum),
                                 static_cast<float*>(args.out.ptr),
                                 detail::shape_of(args.out, args.rows, args.num_heads_kv, batch_extent),
                                 stride_of(args.out), args.batch, args.cu_seqlens, args.seqused};
  return detail::launch<Kernel>(detail::tile_grid<Config::kBlockN>(args.rows, args.num_heads_kv, args.batch, varlen),
                                params, stream);
}

namespace detail {

template <class Element, int kHeadDim, class ArchTag, bool kVarlen>
char const* launch_gqa_postprocess_variant(GqaPostprocessLaunchArgs const& args, cudaStream_t stream) {
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  using Kernel = GqaPostprocessKernel<Config, Element, ArchTag, kVarlen>;
  using Epilogue = typename Kernel::Epilogue;
  bool const varlen = args.cu_seqlens != nullptr;
  int const batch_extent = varlen ? 1 : args.batch;
  auto ep_args = epilogue_arguments<Epilogue, Element>(args.dk, args.dv, args.rows, args.num_heads_kv, batch_extent,
                                                       args.cu_seqlens, args.seqused);
  if (char const* why = Epilogue::can_implement(ep_args)) { return why; }
  typename Kernel::Params params{Epilogue::to_underlying_arguments(ep_args),
                                 reader_of<typename Kernel::Traits>(args.dk_accum),
                                 reader_of<typename Kernel::Traits>(args.dv_accum), args.scale_dk, args.scale_dv,
                                 args.batch};
  return launch<Kernel>(tile_grid<Config::kBlockN>(args.rows, args.num_heads_kv, args.batch, varlen), params, stream);
}

template <class Element, class ElementIn, int kHeadDim, class ArchTag, bool kVarlen>
char const* launch_gqa_reduce_variant(GqaReduceLaunchArgs const& args, cudaStream_t stream) {
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  using Kernel = GqaReduceKernel<Config, Element, ElementIn, ArchTag, kVarlen>;
  using Epilogue = typename Kernel::Epilogue;
  bool const varlen = args.cu_seqlens != nullptr;
  int const batch_extent = varlen ? 1 : args.batch;
  if (args.num_heads_kv <= 0 || args.num_heads_q % args.num_heads_kv != 0) {
    return "num_heads_q must be a multiple of num_heads_kv";
  }
  auto ep_args = epilogue_arguments<Epilogue, Element>(args.dk, args.dv, args.rows, args.num_heads_kv, batch_extent,
                                                       args.cu_seqlens, args.seqused);
  if (char const* why = Epilogue::can_implement(ep_args)) { return why; }
  typename Kernel::Params params{Epilogue::to_underlying_arguments(ep_args),
                                 static_cast<ElementIn const*>(args.dk_partial.ptr),
                                 shape_of(args.dk_partial, args.rows, args.num_heads_q, batch_extent),
                                 stride_of(args.dk_partial),
                                 static_cast<ElementIn const*>(args.dv_partial.ptr),
                                 shape_of(args.dv_partial, args.rows, args.num_heads_q, batch_extent),
                                 stride_of(args.dv_partial),
                                 args.num_heads_q / args.num_heads_kv, args.scale_dk, args.scale_dv, args.batch};
  return launch<Kernel>(tile_grid<Config::kBlockN>(args.rows, args.num_heads_kv, args.batch, varlen), params, stream);
}

}  // namespace detail

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_gqa_postprocess(GqaPostprocessLaunchArgs const& args, cudaStream_t stream) {
  using Element = element_of<kDType>;
  using ArchTag = arch_tag_of<kArch>;
  if constexpr (kArch >= 90) {
    if (args.use_tma && args.cu_seqlens == nullptr && args.seqused == nullptr) {
      return detail::launch_gqa_postprocess_variant<Element, kHeadDim, ArchTag, false>(args, stream);
    }
  }
  return detail::launch_gqa_postprocess_variant<Element, kHeadDim, ArchTag, true>(args, stream);
}

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_gqa_reduce(GqaReduceLaunchArgs const& args, cudaStream_t stream) {
  using Element = element_of<kDType>;
  using ArchTag = arch_tag_of<kArch>;
  auto with_input = [&](auto input_tag) -> char const* {
    using ElementIn = typename decltype(input_tag)::type;
    if constexpr (kArch >= 90) {
      if (args.use_tma && args.cu_seqlens == nullptr && args.seqused == nullptr) {
        return detail::launch_gqa_reduce_variant<Element, ElementIn, kHeadDim, ArchTag, false>(args, stream);
      }
    }
    return detail::launch_gqa_reduce_variant<Element, ElementIn, kHeadDim, ArchTag, true>(args, stream);
  };
  return args.partial_fp32 ? with_input(std::type_identity<float>{}) : with_input(std::type_identity<Element>{});
}

}  // namespace flash_epilogue
