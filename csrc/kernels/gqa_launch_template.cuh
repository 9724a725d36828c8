#pragma once

// Host side of the GQA ops: argument structs -> collective arguments -> checked launches.

#include <algorithm>
#include <climits>

#include <cute/tensor.hpp>

#include "gqa_kernels.cuh"
#include "launch_args.h"
#include "launch_common.cuh"
#include "tile_schedule.cuh"

namespace flash_epilogue {

// The kernels' view of an accumulator `width` columns wide, or why its floats per tile do not match.
template <class Traits>
char const* tiles_of(AccumDesc const& a, int width, AccumTiles<Traits>& tiles) {
  int const slabs = accum_slabs(width, Traits::kSlabCols, Traits::kNumSlabs);
  if (slabs < 1 || slabs > Traits::kNumSlabs || a.tile_elems != slabs * Traits::kSlabElems) {
    return "internal: an accumulator's floats per tile do not match its head dim";
  }
  tiles = {a.ptr, a.head_stride, a.batch_stride, a.num_tiles, a.tile_elems, slabs};
  return nullptr;
}

// The sm_80 path: each query head's tile added through the collective.
template <int kHeadDim, int kArch>
char const* launch_gqa_accumulate_per_head(GqaAccumulateLaunchArgs const& args, cudaStream_t stream) {
  using ArchTag = arch_tag_of<kArch>;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  using Kernel = GqaAccumulateKernel<Config, ArchTag>;
  using Collective = typename Kernel::Collective;
  bool const varlen = args.cu_seqlens != nullptr;
  int const batch_extent = varlen ? 1 : args.batch;
  // One collective per accumulator. The semaphore buffer: dK's counters, dV's, then the ticket.
  auto coll_args = [&](AccumDesc const& accum, int* semaphores, int64_t num_semaphores) {  // accum as dK
    return typename Collective::Arguments{accum.ptr, nullptr, accum.head_stride, accum.batch_stride, accum.num_tiles,
                                          batch_extent, args.num_heads_q, args.num_heads_kv, args.rows, semaphores,
                                          nullptr, args.cu_seqlens, args.seqused, num_semaphores};
  };
  constexpr int kTileElems = Collective::kAccumTileElems;
  if (args.dv_partial.ptr == nullptr) { return "internal: the per-query-head adds take dK and dV together"; }
  if (args.dk_accum.tile_elems != kTileElems || args.dv_accum.tile_elems != kTileElems) {
    return "the per-query-head adds take accumulators of whole tiles (kAccumTileElems floats each)";
  }
  int64_t const counters = Collective::semaphore_count(coll_args(args.dk_accum, nullptr, 0));
  auto const dk_args = coll_args(args.dk_accum, args.semaphores, counters);
  auto const dv_args = coll_args(args.dv_accum, args.semaphores ? args.semaphores + counters : nullptr, counters);
  if (char const* why = Collective::can_implement(dk_args)) { return why; }
  if (char const* why = Collective::can_implement(dv_args)) { return why; }
  dim3 const tiles = row_tile_grid<Config::kBlockN>(args.rows, args.num_heads_q, args.batch, varlen);
  // Deterministic: one CTA per (tile, tensor, q_head) in a 1-D grid; the ticket and decode are int.
  int64_t const work_items = int64_t(tiles.x) * 2 * tiles.y * tiles.z;
  if (args.semaphores && work_items > INT_MAX) { return "more than 2^31 - 1 tiles x heads x 2 (deterministic mode)"; }
  int* const ticket = args.semaphores ? args.semaphores + 2 * counters : nullptr;
  auto partial = [&](TensorDesc const& t, typename Collective::Arguments const& collective) {
    return typename Kernel::TensorParams{Collective::to_underlying_arguments(collective),
                                         static_cast<float const*>(t.ptr),
                                         shape_of(t, args.rows, args.num_heads_q, batch_extent), stride_of(t)};
  };
  typename Kernel::Params params{{partial(args.dk_partial, dk_args), partial(args.dv_partial, dv_args)},
                                 args.batch, args.num_heads_q, args.num_heads_kv,
                                 static_cast<int>(tiles.x), static_cast<int>(tiles.z), ticket, 0, 1};
  if (args.semaphores) {
    // Zeroed on this stream before every launch (graph-capturable).
    if (cudaMemsetAsync(args.semaphores, 0, (2 * counters + 1) * sizeof(int), stream) != cudaSuccess) {
      return nullptr;
    }
    // A chunk's accumulator tiles take about 12 MB of the H200's 60 MB L2, so they stay there between
    // members' adds beside the streamed partials; smaller and larger chunks were slower (docs/design.md).
    int64_t const units = static_cast<int64_t>(tiles.x) * tiles.z * 2 * args.num_heads_kv;
    int64_t const tile_bytes = static_cast<int64_t>(Kernel::Traits::kAccumTileElems) * sizeof(float);
    params.num_units = static_cast<int>(units);
    int64_t const chunk_units = std::min<int64_t>(units, (int64_t(12) << 20) / tile_bytes);
    params.chunk_units = static_cast<int>(std::max<int64_t>(1, chunk_units));
    return launch_kernel<Kernel>(dim3(static_cast<unsigned>(work_items), 1, 1), params, stream);
  }
  return launch_kernel<Kernel>(dim3(2 * tiles.x, tiles.y, tiles.z), params, stream);  // see the kernel's decode
}

template <int kHeadDim, int kArch>
char const* launch_gqa_accumulate(GqaAccumulateLaunchArgs const& args, cudaStream_t stream) {
  if constexpr (kArch < 90) {
    return launch_gqa_accumulate_per_head<kHeadDim, kArch>(args, stream);
  } else {
    // The sm_90 path, both modes: deterministic by construction, so the semaphores are not used.
    using Config = BwdTileConfig<kHeadDim, cutlass::arch::Sm90>;
    using Kernel = GqaAccumulateStreamKernel<Config>;
    bool const varlen = args.cu_seqlens != nullptr;
    int const batch_extent = varlen ? 1 : args.batch;
    int const num_tensors = args.dv_partial.ptr ? 2 : 1;  // dK's alone where dV has a tile of its own
    int64_t const n_tiles = row_tiles<Config::kBlockN>(args.rows, args.batch, varlen);
    int64_t const num_tiles = n_tiles * num_tensors * args.num_heads_kv * batch_extent;
    TensorDesc const* partials[2] = {&args.dk_partial, &args.dv_partial};
    for (int i = 0; i < num_tensors; ++i) {
      if (char const* why = tma_input_strides_fit(*partials[i], sizeof(float))) { return why; }
    }
    if (num_tiles == 0) { return nullptr; }
    if (num_tiles > kMaxStreamedTiles) { return "more than 2^31 - 2^16 accumulator tiles"; }
    typename Kernel::Params params{{}, num_tensors, args.num_heads_kv, args.num_heads_q / args.num_heads_kv,
                                   args.batch, static_cast<int>(n_tiles), static_cast<int>(num_tiles),
                                   args.cu_seqlens, args.seqused};
    AccumDesc const* accums[2] = {&args.dk_accum, &args.dv_accum};
    for (int i = 0; i < num_tensors; ++i) {
      typename Kernel::TensorParams& t = params.tensors[i];
      if (char const* why = tiles_of(*accums[i], partials[i]->head_dim, t.accum)) { return why; }
      t.shape_in = shape_of(*partials[i], args.rows, args.num_heads_q, batch_extent);
      t.tma_load_in =
          Kernel::Ring::make_tma_load(static_cast<float const*>(partials[i]->ptr), t.shape_in, stride_of(*partials[i]));
    }
    return launch_kernel<Kernel>(dim3(persistent_grid<Kernel>(num_tiles)), params, stream);
  }
}

template <int kHeadDim, int kArch>
char const* launch_gqa_accum_to_dense(GqaDenseLaunchArgs const& args, cudaStream_t stream) {
  using ArchTag = arch_tag_of<kArch>;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  using Kernel = GqaDenseKernel<Config, ArchTag>;
  bool const varlen = args.cu_seqlens != nullptr;
  typename Kernel::Params params{{}, static_cast<float*>(args.out.ptr),
                                 shape_of(args.out, args.rows, args.num_heads_kv, varlen ? 1 : args.batch),
                                 stride_of(args.out), args.batch, args.cu_seqlens, args.seqused};
  if (char const* why = tiles_of(args.accum, args.out.head_dim, params.accum)) { return why; }
  return launch_kernel<Kernel>(row_tile_grid<Config::kBlockN>(args.rows, args.num_heads_kv, args.batch, varlen),
                                params, stream);
}

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_gqa_postprocess(GqaPostprocessLaunchArgs const& args, cudaStream_t stream) {
  using ArchTag = arch_tag_of<kArch>;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  auto launch = [&](auto varlen) {
    using Kernel = GqaPostprocessKernel<Config, element_of<kDType>, ArchTag, decltype(varlen)::value>;
    typename Kernel::Params params{{{{}, {}, args.scale_dk}, {{}, {}, args.scale_dv}}, args.num_heads_kv, args.batch};
    if (char const* why = tiles_of(args.dk_accum, args.dk.head_dim, params.tensors[0].accum)) { return why; }
    int const count = args.dv.ptr ? 2 : 1;  // dK's alone where dV has a tile of its own
    if (count == 2) {
      if (char const* why = tiles_of(args.dv_accum, args.dv.head_dim, params.tensors[1].accum)) { return why; }
    }
    return launch_output_tiles<Kernel>(args, count, args.num_heads_kv, params, stream);
  };
  if constexpr (kArch >= 90) {
    if (without_sequence_metadata(args)) { return launch(std::false_type{}); }
  }
  return launch(std::true_type{});
}

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_gqa_reduce(GqaReduceLaunchArgs const& args, cudaStream_t stream) {
  using Element = element_of<kDType>;
  using ArchTag = arch_tag_of<kArch>;
  if (args.num_heads_kv <= 0 || args.num_heads_q % args.num_heads_kv != 0) {  // both drivers divide by it
    return "num_heads_q must be a multiple of num_heads_kv";
  }
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  int const group = args.num_heads_q / args.num_heads_kv;
  bool const has_dv = args.dv_partial.ptr != nullptr;
  auto with_input = [&](auto input_tag) -> char const* {
    using ElementIn = typename decltype(input_tag)::type;
    if constexpr (kArch >= 90) {
      StreamedTensor const tensors[2] = {{args.dk, args.dk_partial, args.scale_dk},
                                         {args.dv, args.dv_partial, args.scale_dv}};
      return launch_tile_stream_for<Config, Element, ElementIn, /*kReduce=*/true>(
          tensors, has_dv ? 2 : 1, args.rows, args.num_heads_kv, group, args.batch, args.cu_seqlens, args.seqused,
          stream);
    } else {
      using Kernel = GqaReduceKernel<Config, Element, ElementIn, ArchTag, /*kVarlen=*/true>;
      int const batch_extent = args.cu_seqlens != nullptr ? 1 : args.batch;
      auto tensor_params = [&](TensorDesc const& partial, float scale) {
        return typename Kernel::TensorParams{{}, static_cast<ElementIn const*>(partial.ptr),
                                             shape_of(partial, args.rows, args.num_heads_q, batch_extent),
                                             stride_of(partial), scale};
      };
      typename Kernel::Params params{{tensor_params(args.dk_partial, args.scale_dk)}, group, args.num_heads_kv,
                                     args.batch};
      if (has_dv) { params.tensors[1] = tensor_params(args.dv_partial, args.scale_dv); }
      return launch_output_tiles<Kernel>(args, has_dv ? 2 : 1, args.num_heads_kv, params, stream);
    }
  };
  return args.partial_fp32 ? with_input(std::type_identity<float>{}) : with_input(std::type_identity<Element>{});
}

}  // namespace flash_epilogue
