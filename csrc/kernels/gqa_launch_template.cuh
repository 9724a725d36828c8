#pragma once

// Host side of the GQA ops: the plan's launch (csrc/binding/plan.cpp chooses it) -> collective arguments ->
// checked launches. A launch takes tensors[0, num_tensors): dK's and dV's, or one of them where dV has a tile of its
// own and so a launch of its own.

#include <algorithm>
#include <climits>
#include <type_traits>

#include <cute/tensor.hpp>

#include "geometry.h"
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

// The sm_80 path: each query head's tile added through the collective; plan.ordered: in head order, on the
// SemaphoreWorkspace's counters, CTAs claiming their work from its ticket.
template <int kHeadDim, int kArch>
char const* launch_gqa_accumulate_per_head(GqaAccumulateLaunchArgs const& args, cudaStream_t stream) {
  using ArchTag = arch_tag_of<kArch>;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  using Kernel = GqaAccumulateKernel<Config, ArchTag>;
  using Collective = typename Kernel::Collective;
  if (char const* why = plan_mismatch(args.plan, Driver::kPerQueryHead, Config::kBlockN, Kernel::kMinBlocksPerSm)) {
    return why;
  }
  if (args.num_tensors != 2) { return "internal: the per-query-head adds take dK and dV together"; }
  Geometry const& g = args.geometry;
  SemaphoreWorkspace const workspace = SemaphoreWorkspace::of(g, Config::kBlockN);
  int* const semaphores = args.plan.ordered ? args.semaphores : nullptr;
  if (args.plan.ordered && semaphores == nullptr) { return "internal: the ordered adds need their semaphores"; }
  auto coll_args = [&](AccumDesc const& accum, int* counters) {  // accum as the collective's dK
    return typename Collective::Arguments{accum.ptr,       nullptr,       accum.head_stride, accum.batch_stride,
                                          accum.num_tiles, g.batch_extent(), args.num_heads_q, g.num_heads_kv,
                                          g.rows,          counters,      nullptr,           g.cu_seqlens,
                                          g.seqused,       workspace.counters};
  };
  constexpr int kTileElems = Collective::kAccumTileElems;
  if (args.tensors[0].accum.tile_elems != kTileElems || args.tensors[1].accum.tile_elems != kTileElems) {
    return "the per-query-head adds take accumulators of whole tiles (kAccumTileElems floats each)";
  }
  auto const dk_args = coll_args(args.tensors[0].accum, semaphores ? workspace.dk(semaphores) : nullptr);
  auto const dv_args = coll_args(args.tensors[1].accum, semaphores ? workspace.dv(semaphores) : nullptr);
  if (char const* why = Collective::can_implement(dk_args)) { return why; }
  if (char const* why = Collective::can_implement(dv_args)) { return why; }
  dim3 const tiles = row_tile_grid<Config::kBlockN>(g, args.num_heads_q);
  // Ordered: one CTA per (tile, tensor, q_head) in a 1-D grid; the ticket and decode are int.
  int64_t const work_items = int64_t(tiles.x) * 2 * tiles.y * tiles.z;
  if (semaphores && work_items > INT_MAX) { return "more than 2^31 - 1 tiles x heads x 2 (deterministic mode)"; }
  auto partial = [&](TensorDesc const& t, typename Collective::Arguments const& collective) {
    return typename Kernel::TensorParams{Collective::to_underlying_arguments(collective),
                                         static_cast<float const*>(t.ptr), shape_of(t, g, args.num_heads_q),
                                         stride_of(t)};
  };
  typename Kernel::Params params{};
  params.tensors[0] = partial(args.tensors[0].partial, dk_args);
  params.tensors[1] = partial(args.tensors[1].partial, dv_args);
  params.geometry = g;
  params.num_heads_q = args.num_heads_q;
  params.tiles_x = static_cast<int>(tiles.x);
  params.tiles_z = static_cast<int>(tiles.z);
  params.chunk_units = 1;
  if (semaphores) {
    if (workspace.initialize(semaphores, stream) != cudaSuccess) { return nullptr; }  // for cudaGetLastError
    params.ticket = workspace.ticket(semaphores);
    // A chunk's accumulator tiles take about 12 MB of the H200's 60 MB L2, so they stay there between
    // members' adds beside the streamed partials; smaller and larger chunks were slower (docs/design.md).
    int64_t const units = static_cast<int64_t>(tiles.x) * tiles.z * 2 * g.num_heads_kv;
    int64_t const tile_bytes = static_cast<int64_t>(Kernel::Traits::kAccumTileElems) * sizeof(float);
    params.num_units = static_cast<int>(units);
    int64_t const chunk_units = std::min<int64_t>(units, (int64_t(12) << 20) / tile_bytes);
    params.chunk_units = static_cast<int>(std::max<int64_t>(1, chunk_units));
    return launch_kernel<Kernel>(dim3(static_cast<unsigned>(work_items), 1, 1), params, stream);
  }
  return launch_kernel<Kernel>(dim3(2 * tiles.x, tiles.y, tiles.z), params, stream);  // see the kernel's decode
}

// The sm_90 path: GqaAccumulateStreamKernel, deterministic by construction in both modes.
template <int kHeadDim>
char const* launch_gqa_accumulate_streamed(GqaAccumulateLaunchArgs const& args, cudaStream_t stream) {
  using Config = BwdTileConfig<kHeadDim, cutlass::arch::Sm90>;
  using Kernel = GqaAccumulateStreamKernel<Config>;
  if (char const* why = plan_mismatch(args.plan, Driver::kStream, Config::kBlockN, Kernel::kMinBlocksPerSm)) {
    return why;
  }
  Geometry const& g = args.geometry;
  int64_t const num_tiles = g.tiles(Config::kBlockN) * args.num_tensors;
  for (int i = 0; i < args.num_tensors; ++i) {
    if (char const* why = tma_input_strides_fit(args.tensors[i].partial, sizeof(float))) { return why; }
  }
  if (num_tiles == 0) { return nullptr; }
  if (num_tiles > kMaxStreamedTiles) { return "more than 2^31 - 2^16 accumulator tiles"; }
  typename Kernel::Params params{};
  params.num_tensors = args.num_tensors;
  params.group = args.num_heads_q / g.num_heads_kv;
  params.geometry = g;
  params.num_n_tiles = static_cast<int>(g.row_tiles(Config::kBlockN));
  params.num_tiles = static_cast<int>(num_tiles);
  for (int i = 0; i < args.num_tensors; ++i) {
    GqaAccumulateLaunchArgs::Tensor const& in = args.tensors[i];
    typename Kernel::TensorParams& t = params.tensors[i];
    if (char const* why = tiles_of(in.accum, in.partial.head_dim, t.accum)) { return why; }
    t.shape_in = shape_of(in.partial, g, args.num_heads_q);
    t.tma_load_in = Kernel::Ring::make_tma_load(static_cast<float const*>(in.partial.ptr), t.shape_in,
                                                stride_of(in.partial));
  }
  return launch_kernel<Kernel>(dim3(persistent_grid<Kernel>(num_tiles, args.plan.num_sms)), params, stream);
}

template <int kHeadDim, int kArch>
char const* launch_gqa_accumulate(GqaAccumulateLaunchArgs const& args, cudaStream_t stream) {
  if constexpr (kArch < 90) {
    return launch_gqa_accumulate_per_head<kHeadDim, kArch>(args, stream);
  } else {
    return launch_gqa_accumulate_streamed<kHeadDim>(args, stream);
  }
}

template <int kHeadDim, int kArch>
char const* launch_gqa_accum_to_dense(GqaDenseLaunchArgs const& args, cudaStream_t stream) {
  using ArchTag = arch_tag_of<kArch>;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  using Kernel = GqaDenseKernel<Config, ArchTag>;
  if (char const* why = plan_mismatch(args.plan, Driver::kOneCtaPerTile, Config::kBlockN, Kernel::kMinBlocksPerSm)) {
    return why;
  }
  Geometry const& g = args.geometry;
  typename Kernel::Params params{};
  params.ptr_out = static_cast<float*>(args.out.ptr);
  params.shape_out = shape_of(args.out, g, g.num_heads_kv);
  params.stride_out = stride_of(args.out);
  params.geometry = g;
  if (char const* why = tiles_of(args.accum, args.out.head_dim, params.accum)) { return why; }
  return launch_kernel<Kernel>(row_tile_grid<Config::kBlockN>(g, g.num_heads_kv), params, stream);
}

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_gqa_postprocess(GqaPostprocessLaunchArgs const& args, cudaStream_t stream) {
  using ArchTag = arch_tag_of<kArch>;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  return with_predication<(kArch < 90)>(args.plan.predicated, [&](auto predicated) -> char const* {
    using Output = OutputTileTraits<Config, element_of<kDType>, ArchTag, decltype(predicated)::value>;
    using Kernel = GqaPostprocessKernel<Output>;
    if (char const* why = plan_mismatch(args.plan, Driver::kOneCtaPerTile, Config::kBlockN, Kernel::kMinBlocksPerSm)) {
      return why;
    }
    typename Kernel::Params params{};
    TensorDesc outputs[2];
    for (int i = 0; i < args.num_tensors; ++i) {
      GqaPostprocessLaunchArgs::Tensor const& t = args.tensors[i];
      if (char const* why = tiles_of(t.accum, t.out.head_dim, params.tensors[i].accum)) { return why; }
      params.tensors[i].scale = t.scale;
      outputs[i] = t.out;
    }
    return launch_output_tiles<Kernel>(args.geometry, outputs, args.num_tensors, params, stream);
  });
}

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_gqa_reduce(GqaReduceLaunchArgs const& args, cudaStream_t stream) {
  using Element = element_of<kDType>;
  using ArchTag = arch_tag_of<kArch>;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  Geometry const& g = args.geometry;
  if (g.num_heads_kv <= 0 || args.num_heads_q % g.num_heads_kv != 0) {  // both drivers divide by it
    return "num_heads_q must be a multiple of num_heads_kv";
  }
  int const group = args.num_heads_q / g.num_heads_kv;
  auto with_input = [&](auto input_tag) -> char const* {
    using ElementIn = typename decltype(input_tag)::type;
    if constexpr (kArch >= 90) {
      StreamedTensor tensors[2];
      for (int i = 0; i < args.num_tensors; ++i) {
        tensors[i] = {args.tensors[i].out, args.tensors[i].partial, args.tensors[i].scale};
      }
      return launch_tile_stream_for<Config, Element, ElementIn, /*kReduce=*/true, kStreamCtasPerSm>(
          args.plan, tensors, args.num_tensors, g, group, stream);
    } else {
      return with_predication</*kPredicatedOnly=*/true>(args.plan.predicated, [&](auto predicated) -> char const* {
        using Output = OutputTileTraits<Config, Element, ArchTag, decltype(predicated)::value>;
        using Kernel = GqaReduceKernel<Output, ElementIn>;
        if (char const* why =
                plan_mismatch(args.plan, Driver::kOneCtaPerTile, Config::kBlockN, Kernel::kMinBlocksPerSm)) {
          return why;
        }
        typename Kernel::Params params{};
        TensorDesc outputs[2];
        for (int i = 0; i < args.num_tensors; ++i) {
          GqaReduceLaunchArgs::Tensor const& t = args.tensors[i];
          params.tensors[i] = {{}, static_cast<ElementIn const*>(t.partial.ptr), shape_of(t.partial, g, args.num_heads_q),
                               stride_of(t.partial), t.scale};
          outputs[i] = t.out;
        }
        params.group = group;
        return launch_output_tiles<Kernel>(g, outputs, args.num_tensors, params, stream);
      });
    }
  };
  return args.partial_fp32 ? with_input(std::type_identity<float>{}) : with_input(std::type_identity<Element>{});
}

}  // namespace flash_epilogue
