#pragma once

// The sm_90 driver of `store` and `gqa_reduce`: persistent CTAs walk tiles t = blockIdx.x + k * gridDim.x
// ((tensor and head, n_tile, batch), heads fastest). A producer warp TMA-loads the next tiles' inputs (a
// tile of `group` members: `group` consecutive loads) into a ring of smem stages; the consumers read each
// into the C fragment and CollectiveEpilogueBwd stores it. Unlike one CTA per tile loading into registers,
// loads stay in flight whatever the consumers do, off their critical path, and reads are conflict-free.

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "geometry.h"
#include "store_kernel.cuh"
#include "stream_ring.cuh"
#include "tile_io.cuh"
#include "tile_schedule.cuh"

namespace flash_epilogue {

// kReduce: the tile is (0 + p_0 + ... + p_{group-1}) * scale in head order (GqaReduceKernel's bits);
// else the single input tile as it is (store: -0.0 stays -0.0). kCtasPerSm: CTAs sharing an SM.
// Traits: OutputTileTraits of an sm_90 config.
template <class Traits, class ElementIn_, bool kReduce_, int kCtasPerSm>
struct TileStreamKernel {
  using Config = typename Traits::Config;
  using Element = typename Traits::Element;
  using ElementIn = ElementIn_;  // float, or the 16-bit output type (gqa_reduce's 16-bit partials)
  using ArchTag = typename Traits::ArchTag;
  static_assert(ArchTag::kMinComputeCapability >= 90, "TMA loads: the sm_90 path");
  static constexpr bool kReduce = kReduce_;
  using Epilogue = typename Traits::Epilogue;
  using TiledMma = typename Traits::TiledMma;
  using FragmentTileShape = typename Traits::FragmentTileShape;
  using ShapeIO = typename Epilogue::ShapedKV;    // (rows, d, head, batch)
  using StrideIO = typename Epilogue::StridedKV;
  static_assert(std::is_same_v<ShapeIO, ShapeRowsHeadBatch> && std::is_same_v<StrideIO, StrideRowsHeadBatch>);
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;

  // An fp32 stage holds the collective's storage (two 16-bit tiles), so the tile's last stage serves as
  // its output buffer; 16-bit stages are half that size and the collective gets a region of its own.
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
    int group;                // input heads per output (KV) head (store: 1)
    Geometry geometry;        // of the outputs
    int num_n_tiles;          // geometry.row_tiles(kBlockN)
    int num_tiles;            // num_n_tiles * num_tensors * num_heads_kv * batch extent
  };

  using TileWork = OutputTile<kBlockN>;

  // Heads fastest: concurrent CTAs read neighbouring rows of a (rows, heads, d) layout (docs/design.md).
  CUTLASS_DEVICE static TileWork decode(Params const& params, int tile) {
    int const heads_y = params.num_tensors * params.geometry.num_heads_kv;
    auto const [tensor, head] = split_by_tensor(tile % heads_y, params.geometry.num_heads_kv);
    TensorAndHead const out{tensor, head};
    int const rest = tile / heads_y;
    return output_tile<kBlockN>(params, out, rest % params.num_n_tiles, rest / params.num_n_tiles);
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    Ring const ring(smem);
    ring.run([&] { produce(params, ring); }, [&] { consume(params, ring, smem); });
  }

  // Walks the consumers' tiles, skipping the same empty ones.
  CUTLASS_DEVICE void produce(Params const& params, Ring const& ring) const {
    using namespace cute;
    for (int i = 0; i < params.num_tensors; ++i) {
      prefetch_tma_descriptor(params.tensors[i].tma_load_in.get_tma_descriptor());
    }
    int load_index = 0;
    for_each_persistent_tile(params.num_tiles, [&](int tile) {
      TileWork const work = decode(params, tile);
      if (work.valid_rows <= 0) { return; }
      for (int member = 0; member < params.group; ++member, ++load_index) {
        int const stage = ring.acquire(load_index);
        TensorParams const& t = params.tensors[work.tensor];
        ring.load_tile(t.tma_load_in, t.shape_in, work.head * params.group + member,
                       t.epilogue.cu_seqlens ? 0 : work.batch, work.seqlen_info.offset, work.n_block, stage);
      }
    });
  }

  // Consumers: the collective's epilogue threads.
  CUTLASS_DEVICE void consume(Params const& params, Ring const& ring, char* smem) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    if (thread_idx == 0) {
      for (int i = 0; i < params.num_tensors; ++i) { Epilogue::prefetch_tma_descriptors(params.tensors[i].epilogue); }
    }
    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor acc = partition_fragment_C(tiled_mma, FragmentTileShape{});
    int load_index = 0;  // loads consumed
    for_each_persistent_tile(params.num_tiles, [&](int tile) {
      TileWork const work = decode(params, tile);
      if (work.valid_rows <= 0) { return; }  // padded varlen tile or empty sequence: never loaded
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
      // The collective starts with a barrier, so nobody writes the stage before everyone has read it.
      Epilogue{}.store(t.epilogue, acc, acc, output, tiled_mma, thread_idx,
                       make_tuple(work.n_block, work.head, work.batch));
      if constexpr (kOutputInStage) {
        cutlass::arch::fence_view_async_shared();  // this thread's generic-proxy writes, before TMA refills the stage
        ring.release(stage);
      }
    });
  }
};

}  // namespace flash_epilogue
