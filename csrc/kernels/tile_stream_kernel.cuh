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
// barrier waited for warp 0. Both measured faster: see benchmarks/NOTES.md.
//
// Work order: tile t of the CTA's walk is (tensor and head, n_tile, batch), heads fastest,
// t = blockIdx.x + k * gridDim.x. A tile of `group` members (gqa_reduce: the group's query heads;
// store: 1) takes `group` consecutive loads of the stream; load i uses stage i % kStages.

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
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  // The collective's epilogue threads (whole warpgroups) consume the stages; one more warpgroup
  // produces them (one of its threads issues the TMA loads and walks the tiles, off the consumers'
  // path). The producer gives its registers to the consumers (setmaxnreg), who hold a whole fp32
  // tile in registers: without that, a 288-thread CTA's 168-register cap spilled the varlen path.
  static constexpr int kNumConsumerThreads = Config::kNumThreads;
  static constexpr int kNumConsumerWarps = kNumConsumerThreads / cutlass::NumThreadsPerWarp;
  static constexpr int kNumThreads = kNumConsumerThreads + cutlass::NumThreadsPerWarpGroup;
  static constexpr int kMinBlocksPerSm = kCtasPerSm;
  static constexpr int kRegistersAtLaunch = (65536 / (kNumThreads * kCtasPerSm)) / 8 * 8;  // per thread, at launch
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = cute::min(
      240, (kRegistersAtLaunch * kNumThreads - kProducerRegisters * cutlass::NumThreadsPerWarpGroup) /
               kNumConsumerThreads / 8 * 8);
  static_assert(kNumConsumerThreads % cutlass::NumThreadsPerWarpGroup == 0, "setmaxnreg works on whole warpgroups");
  static_assert(kConsumerRegisters >= kRegistersAtLaunch, "the consumers must not lose registers to the producer");
  using TileShape = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;

  // One stage holds one input tile, swizzled as TMA writes it. Reading it in C-fragment order is
  // then conflict-free: 8-byte fp32 pairs of 8 rows take the minimum two wavefronts, swapAB's
  // column walks (4 rows 2 apart) one.
  using SmemLayoutIn =  // (BLK_N, BLK_D)
      decltype(cute::tile_to_shape(detail::smem_layout_atom_k_major<ElementIn, kHeadDim>(), TileShape{}));
  static constexpr int kStageElems = kBlockN * kHeadDim;
  static constexpr int kStageBytes = kStageElems * static_cast<int>(sizeof(ElementIn));
  static_assert(kStageBytes % 1024 == 0, "stages must keep the 1024-byte alignment of the swizzled layouts");

  // The collective's shared memory. An fp32 stage is as large as the collective's storage (two
  // 16-bit tiles), so the tile's last stage serves as its output buffer once read into registers;
  // 16-bit stages are half that size and the collective gets a region of its own.
  using OutputStorage = typename Epilogue::TensorStorage;
  static constexpr bool kOutputInStage = kStageBytes >= static_cast<int>(sizeof(OutputStorage));
  static constexpr int kOutputBytes = kOutputInStage ? 0 : static_cast<int>(sizeof(OutputStorage));
  // sm_90's opt-in dynamic shared memory per CTA (228 KB per SM, less 1 KB the system reserves per CTA)
  static constexpr int kSmemCapacity = (228 / kCtasPerSm - 1) * 1024;
  static constexpr int kBarrierBytes = 1024;        // the stages' mbarriers, with room to spare
  static constexpr int kStages = cute::min(6, (kSmemCapacity - kBarrierBytes - kOutputBytes) / kStageBytes);
  static_assert(kCtasPerSm == 1 || kCtasPerSm == 2, "one or two CTAs per SM");
  static_assert(kStages >= 2, "the shared memory must hold at least two input stages");
  static constexpr int kOutputOffset = kStages * kStageBytes;
  static constexpr int kBarrierOffset = kOutputOffset + kOutputBytes;
  static constexpr int kSharedStorageSize =  // barriers: full, empty
      kBarrierOffset + 2 * kStages * static_cast<int>(sizeof(uint64_t));
  static_assert(kSharedStorageSize <= kSmemCapacity);

  using TmaLoad = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<ElementIn const*>(nullptr)), ShapeIO{}, StrideIO{}),
      SmemLayoutIn{}, TileShape{}, cute::_1{}));
  using Barrier = cutlass::arch::ClusterTransactionBarrier;

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
  // the same elsewhere (measured: see benchmarks/NOTES.md).
  CUTLASS_DEVICE static TileWork decode(Params const& params, int tile) {
    int const heads_y = params.num_tensors * params.num_heads;
    auto const [tensor, head] = split_by_tensor(tile % heads_y, params.num_heads);
    TensorAndHead const out{tensor, head};
    int const rest = tile / heads_y;
    return output_tile<kBlockN>(params, out, rest % params.num_n_tiles, rest / params.num_n_tiles);
  }

  // Thread 0: TMA-load member `member` of tile `work` into `stage`. Rows past the tensor and
  // columns past d arrive as zeros; rows of the next sequence (varlen) are loaded too and never
  // stored. No L2 eviction hint: EVICT_FIRST, the obvious one for inputs read once, was slower than
  // no hint or EVICT_NORMAL for store and gqa_reduce (measured: see benchmarks/NOTES.md).
  CUTLASS_DEVICE static void issue_load(Params const& params, TileWork const& work, int member, ElementIn* stage,
                                        uint64_t& full_barrier) {
    using namespace cute;
    TensorParams const& t = params.tensors[work.tensor];
    int const batch_coord = t.epilogue.cu_seqlens ? 0 : work.batch;
    Tensor g_in = rows_tile<kBlockN, kHeadDim>(t.tma_load_in.get_tma_tensor(t.shape_in),  // (BLK_N, BLK_D)
                                               work.head * params.group + member, batch_coord, work.seqlen_info.offset,
                                               work.n_block);
    Tensor s_in = make_tensor(make_smem_ptr(stage), SmemLayoutIn{});  // (BLK_N, BLK_D)
    auto cta_tma = t.tma_load_in.get_slice(_0{});
    Barrier::arrive_and_expect_tx(&full_barrier, kStageBytes);  // OOB-filled bytes count too
    copy(t.tma_load_in.with(full_barrier), cta_tma.partition_S(g_in), cta_tma.partition_D(s_in));
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    int const warp_idx = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarp, 0);
    ElementIn* const stages = reinterpret_cast<ElementIn*>(smem);
    uint64_t* const full = reinterpret_cast<uint64_t*>(smem + kBarrierOffset);  // TMA landed in the stage
    uint64_t* const empty = full + kStages;                                     // every consumer warp is done with it
    auto stage_ptr = [&](int s) { return stages + s * kStageElems; };

    if (thread_idx == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        Barrier::init(&full[s], 1);
        Barrier::init(&empty[s], kNumConsumerWarps);
      }
      cutlass::arch::fence_barrier_init();
    }
    __syncthreads();  // the only CTA-wide barrier: the roles part here

    if (warp_idx >= kNumConsumerWarps) {
      // Producer: one thread walks the same tiles as the consumers, skipping the same empty ones, and
      // refills each stage as soon as all consumer warps have released it.
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
      if (warp_idx == kNumConsumerWarps && cute::elect_one_sync()) {
        for (int i = 0; i < params.num_tensors; ++i) {
          prefetch_tma_descriptor(params.tensors[i].tma_load_in.get_tma_descriptor());
        }
        int load_index = 0;  // fill f of stage f % kStages waits for its release number f / kStages - 1
        for (int tile = blockIdx.x; tile < params.num_tiles; tile += gridDim.x) {
          TileWork const work = decode(params, tile);
          if (work.valid_rows <= 0) { continue; }
          for (int member = 0; member < params.group; ++member, ++load_index) {
            int const stage = load_index % kStages;
            Barrier::wait(&empty[stage], ((load_index / kStages) & 1) ^ 1);  // a fresh barrier passes parity 1
            issue_load(params, work, member, stage_ptr(stage), full[stage]);
          }
        }
      }
      return;
    }

    // Consumers: kNumConsumerThreads threads, the collective's epilogue threads.
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    if (thread_idx == 0) {
      for (int i = 0; i < params.num_tensors; ++i) { Epilogue::prefetch_tma_descriptors(params.tensors[i].epilogue); }
    }
    // A warp is done with a stage once all its lanes are (for the output stage: once the TMA store's
    // issuer, in the last warp, has waited for its read).
    auto release = [&](int stage) {
      __syncwarp();
      if (cute::elect_one_sync()) { Barrier::arrive(&empty[stage]); }
    };
    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor acc = partition_fragment_C(tiled_mma, FragmentTileShape{});
    int load_index = 0;  // loads consumed: stage load_index % kStages, phase (load_index / kStages) & 1
    for (int tile = blockIdx.x; tile < params.num_tiles; tile += gridDim.x) {
      TileWork const work = decode(params, tile);
      if (work.valid_rows <= 0) { continue; }  // padded varlen tile or empty sequence: never loaded
      TensorParams const& t = params.tensors[work.tensor];
      if constexpr (kReduce) { clear(acc); }
      int stage = 0;
      for (int member = 0; member < params.group; ++member, ++load_index) {
        stage = load_index % kStages;
        Barrier::wait(&full[stage], (load_index / kStages) & 1);
        Tensor s_in = make_tensor(make_smem_ptr(stage_ptr(stage)), SmemLayoutIn{});  // (BLK_N, BLK_D)
        load_accum_tile<Config::kSwapAB, kBlockN, kHeadDim, kReduce>(acc, thr_mma, s_in, kBlockN, kHeadDim);
        if (!kOutputInStage || member + 1 < params.group) { release(stage); }
      }
      if constexpr (kReduce) {
#pragma unroll
        for (int i = 0; i < size(acc); ++i) { acc(i) *= t.scale; }
      }
      auto& output = *reinterpret_cast<OutputStorage*>(kOutputInStage ? reinterpret_cast<char*>(stage_ptr(stage))
                                                                       : smem + kOutputOffset);
      // The collective starts with a barrier over the consumer threads, so nobody writes the stage
      // before everyone has read it.
      Epilogue{}.store(t.epilogue, acc, acc, output, tiled_mma, thread_idx,
                       make_tuple(work.n_block, work.head, work.batch));
      if constexpr (kOutputInStage) {
        cutlass::arch::fence_view_async_shared();  // this thread's generic-proxy writes, before TMA refills the stage
        release(stage);
      }
    }
  }
};

}  // namespace flash_epilogue
