#pragma once

// Host side of `store_zero`: the window clamped to the tensor, the grid over the selection.

#include <cute/tensor.hpp>

#include "launch_args.h"
#include "launch_common.cuh"
#include "store_zero_kernel.cuh"
#include "tile_schedule.cuh"

namespace flash_epilogue {

template <OutputDType kDType, int kHeadDim, int kArch>
char const* launch_store_zero(StoreZeroLaunchArgs const& args, cudaStream_t stream) {
  using Element = element_of<kDType>;
  using ArchTag = arch_tag_of<kArch>;
  using Config = BwdTileConfig<kHeadDim, ArchTag>;
  using Kernel = StoreZeroKernel<Config, Element, ArchTag>;
  using Epilogue = typename Kernel::Epilogue;
  constexpr int kBlockN = Config::kBlockN;
  bool const is_varlen = args.cu_seqlens != nullptr;
  int const batch_extent = is_varlen ? 1 : args.batch;

  auto const ep_args = epilogue_arguments<Epilogue, Element>(args.dk, args.dv, args.rows, args.num_heads, batch_extent,
                                                             args.cu_seqlens, args.seqused);
  if (char const* why = Epilogue::can_implement(ep_args)) { return why; }

  // No sequence is longer than the tensor's rows: clamp the window to them.
  int const row_end = args.row_end < args.rows ? args.row_end : args.rows;
  if (row_end <= args.row_begin) { return nullptr; }
  int const num_sel_batch = args.batch_idx ? args.num_batch_idx : args.batch;
  int const num_sel_heads = args.head_idx ? args.num_head_idx : args.num_heads;
  bool const padded_tiles = is_varlen && args.batch_idx == nullptr;
  int const first_block = args.row_begin / kBlockN;
  int const num_tiles = padded_tiles ? static_cast<int>(row_tiles<kBlockN>(args.rows, args.batch, /*varlen=*/true))
                                     : (row_end + kBlockN - 1) / kBlockN - first_block;
  if (num_tiles <= 0 || num_sel_heads <= 0 || num_sel_batch <= 0) { return nullptr; }

  typename Kernel::Params params{Epilogue::to_underlying_arguments(ep_args), args.batch, args.num_heads,
                                 args.batch_idx, args.head_idx, args.row_begin, row_end, first_block, padded_tiles};
  dim3 const grid(num_tiles, num_sel_heads, padded_tiles ? 1 : num_sel_batch);
  epilogue_device_kernel<Kernel><<<grid, Kernel::kNumThreads, 0, stream>>>(params);
  return nullptr;
}

}  // namespace flash_epilogue
