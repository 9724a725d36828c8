#pragma once

// The sm_90 driver of `store` and `gqa_reduce`: persistent CTAs, one per SM (two for small `store`
// problems, kCtasPerSm), each walking its share of the tiles. A producer warp streams the inputs of
// the next tiles into a ring of shared-memory stages through TMA loads; the consumer warps (the
// collective's epilogue threads) read each tile out of its stage into the C fragment (as the
// mainloop would leave it), and CollectiveEpilogueBwd converts and stores it. Full/empty
// mbarriers per stage hand the stages back and forth.
//
// Why not one CTA per tile with loads straight into registers (StoreKernel, GqaReduceKernel: the
// sm_80 path)? There an SM alternates between loading and storing, and gqa_reduce's swapAB configs
// read their partials down fragment columns. Here up to kStages - 1 tiles' loads stay in flight
// whatever the consumers do, and every config reads its stage conflict-free. Why a producer warp
// rather than consumer thread 0 issuing the loads? The issue work (tile decode,
// arrive_and_expect_tx, TMA instructions) then sat on every tile's critical path: each CTA-wide
// barrier waited for warp 0. Both measured faster: see docs/design.md.
//
// Work order: tile t of the CTA's walk is (tensor and head, n_tile, batch), heads fastest,
// t = blockIdx.x + k * gridDim.x. A tile of `group` members (gqa_reduce: the group's query heads;
// store: 1) takes `group` consecutive loads of the stream; load i uses stage i % kStages.
//
// StreamRing (below) is the part the sm_90 gqa_accumulate driver shares (gqa_kernels.cuh): the
// roles, the stages and their barriers.

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/epilogue_bwd.h"
#include "store_kernel.cuh"
#include "tile_io.cuh"
#include "tile_schedule.cuh"

namespace flash_epilogue {

// Host: a TMA load of (rows, d, head, batch) ElementIn tiles of TileShape into stages laid out as
// SmemLayout. StreamRing::TmaLoad is its type.
template <class SmemLayout, class TileShape, class ElementIn>
auto make_stage_tma_load(ElementIn const* ptr, ShapeRowsHeadBatch const& shape, StrideRowsHeadBatch const& stride) {
  return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, cute::make_tensor(cute::make_gmem_ptr(ptr), shape, stride),
                             SmemLayout{}, TileShape{}, cute::_1{});
}

// The roles and the shared memory of a persistent sm_90 driver that streams (BLK_N, BLK_D) ElementIn
// tiles through TMA-loaded stages.
//   Roles: the config's kNumThreads consumer threads (whole warpgroups, the collective's epilogue
//   threads) and one producer warpgroup, one thread of which issues the loads and walks the tiles,
//   off the consumers' path. The producer gives its registers to the consumers (setmaxnreg), who
//   hold a whole fp32 tile in registers: without that, a 288-thread CTA's 168-register cap spilled
//   the varlen store.
//   Shared memory: kStages stages of one tile each, swizzled as TMA writes it; kExtraBytes for the
//   driver; the stages' full and empty mbarriers. Load i of the CTA's stream uses stage i % kStages.
// Device side, a CTA's view of its ring: acquire / load_tile (producer), wait / release (consumers).
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

  // Reading a stage in C-fragment order is conflict-free: 8-byte fp32 pairs of 8 rows take the
  // minimum two wavefronts, swapAB's column walks (4 rows 2 apart) one.
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
  // Host: the load descriptor of one input, (rows, d, head, batch) at `ptr`.
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

  // Thread 0, before the CTA-wide barrier that parts the roles.
  CUTLASS_DEVICE void init() const {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full[s], 1);
      Barrier::init(&empty[s], kNumConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }

  // Producer: load `load_index`'s stage, once every consumer warp has released its previous fill
  // (fill f waits for release number f / kStages - 1; a fresh barrier passes parity 1).
  CUTLASS_DEVICE int acquire(int load_index) const {
    int const stage = load_index % kStages;
    Barrier::wait(&empty[stage], ((load_index / kStages) & 1) ^ 1);
    return stage;
  }

  // Producer: TMA-load the (BLK_N, BLK_D) tile n_block of head `head` (rows from `offset`) into
  // `stage`. Rows past the tensor and columns past d arrive as zeros; rows of the next sequence
  // (varlen) are loaded too and never used. No L2 eviction hint: EVICT_FIRST, the obvious one for
  // inputs read once, was slower than no hint or EVICT_NORMAL for store and gqa_reduce (measured:
  // see docs/design.md).
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

  // Producer: one 1-D bulk copy of `bytes` (a multiple of 16, at most a stage's) from 16-byte aligned
  // global memory to the start of the stage.
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

  // Each consumer warp: done with `stage` once all its lanes are (a stage a TMA store or bulk copy
  // reads: once its issuing thread, in one of the warps, has waited for that read).
  CUTLASS_DEVICE void release(int stage) const {
    __syncwarp();
    if (cute::elect_one_sync()) { Barrier::arrive(&empty[stage]); }
  }
};

// kReduce: the tile is 0 + p_0 + ... + p_{group-1} in head order, times the tensor's scale
// (gqa_reduce; the same bits as GqaReduceKernel). Otherwise the single input tile as it is (store:
// an exact cast, -0.0 stays -0.0). kCtasPerSm: CTAs sharing an SM, each with that share of its
// shared memory and registers (2: small problems, see launch_store).
template <class Config_, class Element_, class ElementIn_, bool kVarlen_, bool kReduce_, int kCtasPerSm = 1>
struct TileStreamKernel {
  using Config = Config_;
  using Element = Element_;
  using ElementIn = ElementIn_;  // float, or the 16-bit output type (gqa_reduce's 16-bit partials)
  using ArchTag = cutlass::arch::Sm90;
  static constexpr bool kVarlen = kVarlen_;
  static constexpr bool kReduce = kReduce_;
  using Store = StoreKernel<Config, Element, ArchTag, kVarlen>;  // the TiledMma and the collective
  using Epilogue = typename Store::Epilogue;
  using TiledMma = typename Store::TiledMma;
  using FragmentTileShape = typename Store::TiledMmaConfig::FragmentTileShape;
  using ShapeIO = typename Epilogue::ShapedKV;    // (rows, d, head, batch)
  using StrideIO = typename Epilogue::StridedKV;
  static_assert(std::is_same_v<ShapeIO, ShapeRowsHeadBatch> && std::is_same_v<StrideIO, StrideRowsHeadBatch>);
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;

  // The collective's shared memory. An fp32 stage is as large as the collective's storage (two
  // 16-bit tiles), so the tile's last stage serves as its output buffer once read into registers;
  // 16-bit stages are half that size and the collective gets a region of its own.
  using OutputStorage = typename Epilogue::TensorStorage;
  static constexpr bool kOutputInStage =
      kBlockN * kHeadDim * static_cast<int>(sizeof(ElementIn)) >= static_cast<int>(sizeof(OutputStorage));
  using Ring = StreamRing<Config, ElementIn, kCtasPerSm, kOutputInStage ? 0 : static_cast<int>(sizeof(OutputStorage))>;
  static constexpr int kNumThreads = Ring::kNumThreads;
  static constexpr int kMinBlocksPerSm = kCtasPerSm;
  static constexpr int kSharedStorageSize = Ring::kSharedStorageSize;
  using SmemLayoutIn = typename Ring::SmemLayoutIn;
  using TmaLoad = typename Ring::TmaLoad;

  struct TensorParams {
    typename Epilogue::Params epilogue;  // this output (rows, d, heads, batch) as the collective's dK, no dV
    TmaLoad tma_load_in;                 // its input (rows, d, heads * group, batch)
    ShapeIO shape_in;
    float scale;                         // kReduce only
  };

  struct Params {
    TensorParams tensors[2];  // dK, dV
    int num_tensors;          // 1: dK only
    int num_heads;            // of the outputs
    int group;                // input heads per output head (store: 1)
    int batch;                // sequences
    int num_n_tiles;          // tiles along the rows (varlen: of the kBlockN-aligned padded space)
    int num_tiles;            // num_n_tiles * num_tensors * num_heads * batch extent
  };

  using TileWork = OutputTile<kBlockN>;

  // Heads (of dK, then of dV) fastest: the CTAs running at one time read the same rows of every
  // head, neighbours in a (rows, heads, d) layout. Against n_tile fastest: faster at hdim 192/256,
  // the same elsewhere (measured: see docs/design.md).
  CUTLASS_DEVICE static TileWork decode(Params const& params, int tile) {
    int const heads_y = params.num_tensors * params.num_heads;
    auto const [tensor, head] = split_by_tensor(tile % heads_y, params.num_heads);
    TensorAndHead const out{tensor, head};
    int const rest = tile / heads_y;
    return output_tile<kBlockN>(params, out, rest % params.num_n_tiles, rest / params.num_n_tiles);
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    int const warp_idx = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarp, 0);
    Ring const ring(smem);
    if (thread_idx == 0) { ring.init(); }
    __syncthreads();  // the only CTA-wide barrier: the roles part here

    if (warp_idx >= Ring::kNumConsumerWarps) {
      // Producer: one thread walks the same tiles as the consumers, skipping the same empty ones, and
      // refills each stage as soon as all consumer warps have released it.
      cutlass::arch::warpgroup_reg_dealloc<Ring::kProducerRegisters>();
      if (warp_idx == Ring::kNumConsumerWarps && cute::elect_one_sync()) {
        for (int i = 0; i < params.num_tensors; ++i) {
          prefetch_tma_descriptor(params.tensors[i].tma_load_in.get_tma_descriptor());
        }
        int load_index = 0;
        for (int tile = blockIdx.x; tile < params.num_tiles; tile += gridDim.x) {
          TileWork const work = decode(params, tile);
          if (work.valid_rows <= 0) { continue; }
          for (int member = 0; member < params.group; ++member, ++load_index) {
            int const stage = ring.acquire(load_index);
            TensorParams const& t = params.tensors[work.tensor];
            ring.load_tile(t.tma_load_in, t.shape_in, work.head * params.group + member,
                           t.epilogue.cu_seqlens ? 0 : work.batch, work.seqlen_info.offset, work.n_block, stage);
          }
        }
      }
      return;
    }

    // Consumers: the collective's epilogue threads.
    cutlass::arch::warpgroup_reg_alloc<Ring::kConsumerRegisters>();
    if (thread_idx == 0) {
      for (int i = 0; i < params.num_tensors; ++i) { Epilogue::prefetch_tma_descriptors(params.tensors[i].epilogue); }
    }
    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor acc = partition_fragment_C(tiled_mma, FragmentTileShape{});
    int load_index = 0;  // loads consumed
    for (int tile = blockIdx.x; tile < params.num_tiles; tile += gridDim.x) {
      TileWork const work = decode(params, tile);
      if (work.valid_rows <= 0) { continue; }  // padded varlen tile or empty sequence: never loaded
      TensorParams const& t = params.tensors[work.tensor];
      if constexpr (kReduce) { clear(acc); }
      int stage = 0;
      for (int member = 0; member < params.group; ++member, ++load_index) {
        stage = ring.wait(load_index);
        Tensor s_in = make_tensor(make_smem_ptr(ring.stage_ptr(stage)), SmemLayoutIn{});  // (BLK_N, BLK_D)
        load_accum_tile<Config::kSwapAB, kBlockN, kHeadDim, kReduce>(acc, thr_mma, s_in, kBlockN, kHeadDim);
        if (!kOutputInStage || member + 1 < params.group) { ring.release(stage); }
      }
      if constexpr (kReduce) {
#pragma unroll
        for (int i = 0; i < size(acc); ++i) { acc(i) *= t.scale; }
      }
      auto& output = *reinterpret_cast<OutputStorage*>(
          kOutputInStage ? reinterpret_cast<char*>(ring.stage_ptr(stage)) : smem + Ring::kExtraOffset);
      // The collective starts with a barrier over the consumer threads, so nobody writes the stage
      // before everyone has read it; its TMA store's issuer waits for the store's read before its
      // warp releases the stage.
      Epilogue{}.store(t.epilogue, acc, acc, output, tiled_mma, thread_idx,
                       make_tuple(work.n_block, work.head, work.batch));
      if constexpr (kOutputInStage) {
        cutlass::arch::fence_view_async_shared();  // this thread's generic-proxy writes, before TMA refills the stage
        ring.release(stage);
      }
    }
  }
};

}  // namespace flash_epilogue
