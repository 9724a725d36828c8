#pragma once

// The persistent sm_90 drivers' machinery: a ring of shared-memory stages that one producer thread fills by TMA
// while the consumer warpgroups drain it, and the tile walk both sides share. Used by TileStreamKernel (store,
// gqa_reduce) and GqaAccumulateStreamKernel.

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "flash_epilogue/epilogue_bwd.h"
#include "tile_io.cuh"

namespace flash_epilogue {

// This CTA's tiles of a persistent launch, in order: blockIdx.x, then every gridDim.x-th below num_tiles. The
// producer and the consumers walk the same tiles and skip the same empty ones, so their load counts agree.
template <class Fn>
CUTLASS_DEVICE void for_each_persistent_tile(int num_tiles, Fn&& fn) {
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) { fn(tile); }
}

// Host: a TMA load of (rows, d, head, batch) ElementIn tiles of TileShape into stages laid out as SmemLayout.
template <class SmemLayout, class TileShape, class ElementIn>
auto make_stage_tma_load(ElementIn const* ptr, ShapeRowsHeadBatch const& shape, StrideRowsHeadBatch const& stride) {
  return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, cute::make_tensor(cute::make_gmem_ptr(ptr), shape, stride),
                             SmemLayout{}, TileShape{}, cute::_1{});
}

// The roles and shared memory of a persistent sm_90 driver streaming (BLK_N, BLK_D) tiles (also used by
// GqaAccumulateStreamKernel): the config's consumer warpgroups and one producer warpgroup, one thread of
// which walks the tiles and issues the loads. The producer gives its registers to the consumers
// (setmaxnreg), who hold a whole fp32 tile: without that a 288-thread CTA's 168-register cap spilled.
// Shared memory: kStages swizzled stages, kExtraBytes for the driver, the full and empty mbarriers.
template <class Config, class ElementIn, int kCtasPerSm, int kExtraBytes = 0>
struct StreamRing {
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kNumConsumerThreads = Config::kNumThreads;
  static constexpr int kNumConsumerWarps = kNumConsumerThreads / cutlass::NumThreadsPerWarp;
  static constexpr int kNumThreads = kNumConsumerThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr int kRegistersAtLaunch = (65536 / (kNumThreads * kCtasPerSm)) / 8 * 8;  // per thread, at launch
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = cute::min(
      240, (kRegistersAtLaunch * kNumThreads - kProducerRegisters * cutlass::NumThreadsPerWarpGroup) /
               kNumConsumerThreads / 8 * 8);
  static_assert(kNumConsumerThreads % cutlass::NumThreadsPerWarpGroup == 0, "setmaxnreg works on whole warpgroups");
  static_assert(kConsumerRegisters >= kRegistersAtLaunch, "the consumers must not lose registers to the producer");
  using TileShape = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;

  // Conflict-free in C-fragment order: 8-byte fp32 pairs of 8 rows take two wavefronts, swapAB's walks one.
  using SmemLayoutIn =  // (BLK_N, BLK_D)
      decltype(cute::tile_to_shape(detail::smem_layout_atom_k_major<ElementIn, kHeadDim>(), TileShape{}));
  static constexpr int kStageElems = kBlockN * kHeadDim;
  static constexpr int kStageBytes = kStageElems * static_cast<int>(sizeof(ElementIn));
  static_assert(kStageBytes % 1024 == 0, "stages must keep the 1024-byte alignment of the swizzled layouts");
  // sm_90's opt-in dynamic shared memory per CTA (228 KB per SM, less 1 KB the system reserves per CTA)
  static constexpr int kSmemCapacity = (228 / kCtasPerSm - 1) * 1024;
  static constexpr int kBarrierBytes = 1024;  // the stages' mbarriers, with room to spare
  static constexpr int kStages = cute::min(6, (kSmemCapacity - kBarrierBytes - kExtraBytes) / kStageBytes);
  static_assert(kCtasPerSm == 1 || kCtasPerSm == 2, "one or two CTAs per SM");
  static_assert(kStages >= 2, "the shared memory must hold at least two input stages");
  static constexpr int kExtraOffset = kStages * kStageBytes;
  static constexpr int kBarrierOffset = kExtraOffset + kExtraBytes;
  static constexpr int kSharedStorageSize =  // barriers: full, empty
      kBarrierOffset + 2 * kStages * static_cast<int>(sizeof(uint64_t));
  static_assert(kSharedStorageSize <= kSmemCapacity);

  using TmaLoad = decltype(make_stage_tma_load<SmemLayoutIn, TileShape>(static_cast<ElementIn const*>(nullptr),
                                                                         ShapeRowsHeadBatch{}, StrideRowsHeadBatch{}));
  static TmaLoad make_tma_load(ElementIn const* ptr, ShapeRowsHeadBatch const& shape,
                               StrideRowsHeadBatch const& stride) {
    return make_stage_tma_load<SmemLayoutIn, TileShape>(ptr, shape, stride);
  }
  using Barrier = cutlass::arch::ClusterTransactionBarrier;

  ElementIn* const stages;
  uint64_t* const full;   // TMA landed in the stage
  uint64_t* const empty;  // every consumer warp is done with it

  CUTLASS_DEVICE explicit StreamRing(char* smem)
      : stages(reinterpret_cast<ElementIn*>(smem)),
        full(reinterpret_cast<uint64_t*>(smem + kBarrierOffset)),
        empty(reinterpret_cast<uint64_t*>(smem + kBarrierOffset) + kStages) {}

  CUTLASS_DEVICE ElementIn* stage_ptr(int stage) const { return stages + stage * kStageElems; }

  // The CTA's roles, once thread 0 has set up the barriers: one thread of the producer warpgroup runs
  // `produce` (the warpgroup's other registers go to the consumers), the consumer warpgroups `consume`.
  template <class Produce, class Consume>
  CUTLASS_DEVICE void run(Produce&& produce, Consume&& consume) const {
    int const warp_idx = __shfl_sync(0xffffffff, threadIdx.x / cutlass::NumThreadsPerWarp, 0);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        Barrier::init(&full[s], 1);
        Barrier::init(&empty[s], kNumConsumerWarps);
      }
      cutlass::arch::fence_barrier_init();
    }
    __syncthreads();  // the only CTA-wide barrier: the roles part here
    if (warp_idx >= kNumConsumerWarps) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
      if (warp_idx == kNumConsumerWarps && cute::elect_one_sync()) { produce(); }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
      consume();
    }
  }

  // Producer: `load_index`'s stage once every consumer warp released it (a fresh barrier passes parity 1).
  CUTLASS_DEVICE int acquire(int load_index) const {
    int const stage = load_index % kStages;
    Barrier::wait(&empty[stage], ((load_index / kStages) & 1) ^ 1);
    return stage;
  }

  // Producer: TMA-load tile n_block of `head` (rows from `offset`) into `stage`. Rows past the tensor and
  // columns past d arrive as zeros; a next sequence's rows are loaded and never used. No L2 hint:
  // EVICT_FIRST was slower than none (docs/design.md).
  CUTLASS_DEVICE void load_tile(TmaLoad const& tma, ShapeRowsHeadBatch const& shape, int head, int batch_coord,
                                int offset, int n_block, int stage) const {
    using namespace cute;
    Tensor g_in = rows_tile<kBlockN, kHeadDim>(tma.get_tma_tensor(shape), head, batch_coord, offset,
                                               n_block);  // (BLK_N, BLK_D)
    Tensor s_in = make_tensor(make_smem_ptr(stage_ptr(stage)), SmemLayoutIn{});  // (BLK_N, BLK_D)
    auto cta_tma = tma.get_slice(_0{});
    Barrier::arrive_and_expect_tx(&full[stage], kStageBytes);  // OOB-filled bytes count too
    copy(tma.with(full[stage]), cta_tma.partition_S(g_in), cta_tma.partition_D(s_in));
  }

  // Producer: one 1-D bulk copy of `bytes` (a multiple of 16, at most a stage) from 16-byte aligned gmem.
  CUTLASS_DEVICE void load_bytes(void const* src, int bytes, int stage) const {
    Barrier::arrive_and_expect_tx(&full[stage], bytes);
    cute::SM90_BULK_COPY_G2S::copy(src, &full[stage], stage_ptr(stage), bytes);
  }

  // Consumers: wait until load `load_index` has landed; its stage.
  CUTLASS_DEVICE int wait(int load_index) const {
    int const stage = load_index % kStages;
    Barrier::wait(&full[stage], (load_index / kStages) & 1);
    return stage;
  }

  // Each consumer warp, once all its lanes are done (and a TMA store's issuer has waited for its read).
  CUTLASS_DEVICE void release(int stage) const {
    __syncwarp();
    if (cute::elect_one_sync()) { Barrier::arrive(&empty[stage]); }
  }
};

}  // namespace flash_epilogue
