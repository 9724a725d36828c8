#pragma once

// Drivers of the GQA path:
//   GqaAccumulateKernel        per-q-head fp32 partials -> CollectiveEpilogueBwdGQA::store (sm_80)
//   GqaAccumulateStreamKernel  accumulator tile + a group's partials, streamed, summed in head order (sm_90)
//   GqaPostprocessKernel       accumulator -> C fragments * scale -> CollectiveEpilogueBwd
//   GqaDenseKernel             accumulator -> row-major fp32 (debugging and tests)
//   GqaReduceKernel            a group's partials summed in head order -> store (sm_80; sm_90: TileStreamKernel)

#include <cute/tensor.hpp>

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/epilogue_bwd.h"
#include "flash_epilogue/epilogue_bwd_gqa.h"
#include "geometry.h"
#include "launch_plan.h"
#include "store_kernel.cuh"
#include "stream_ring.cuh"
#include "tile_io.cuh"
#include "tile_schedule.cuh"

namespace flash_epilogue {

// The GQA accumulator's tile of a (config, arch path): FA3's TiledMma and C fragment, whose order the tile's floats
// take, the collective adding into it, and its slabs. The C layout does not depend on bf16 vs fp16.
template <class Config, class ArchTag>
struct AccumTraits {
  using TiledMmaConfig = BwdTiledMma<Config, cutlass::bfloat16_t, ArchTag>;
  using TiledMma = typename TiledMmaConfig::TiledMma;
  using FragmentTileShape = typename TiledMmaConfig::FragmentTileShape;
  static constexpr int kNumThreads = Config::kNumThreads;
  static constexpr int kFragElems =
      decltype(cute::size(cute::partition_fragment_C(TiledMma{}, FragmentTileShape{})))::value;
  static constexpr int kAccumTileElems = kFragElems * kNumThreads;
  using TileShape_MNK = cute::Shape<cute::_64, cute::Int<Config::kBlockN>, cute::Int<Config::kHeadDim>>;
  using Collective = CollectiveEpilogueBwdGQA<TileShape_MNK, ArchTag, kNumThreads, kAccumTileElems>;
  // A tile is one slab of kSlabElems floats per warpgroup (sm_80: one slab), thread t's in slab_of(t).
  // Where each warpgroup holds one 64-column GMMA atom of D (hdim 192), slab w holds columns
  // [64 w, 64 w + 64) and a narrower accumulator keeps only the slabs covering its width: kSlabCols = 64.
  // Else 0: every slab spans all columns (hdim 256's warpgroups take 64-column blocks 128 apart).
  static constexpr int kNumSlabs = Collective::kNumWarpGroups;
  static constexpr int kSlabElems = Collective::kSlabElems;
  static constexpr int kSlabCols =
      ArchTag::kMinComputeCapability >= 90 && Config::kSwapAB && Config::kAtomLayoutNdKV == 1 &&
              Config::kHeadDim == 64 * kNumSlabs
          ? 64
          : 0;
  CUTLASS_HOST_DEVICE static int slab_of(int thread_idx) {
    return kNumSlabs > 1 ? thread_idx / cutlass::NumThreadsPerWarpGroup : 0;
  }
  static constexpr int kCtasPerSm = gqa_tile_ctas_per_sm(kNumThreads, /*staged=*/false);
};

template <class Config, class ArchTag_>
struct GqaAccumulateKernel {
  using ArchTag = ArchTag_;
  using Traits = AccumTraits<Config, ArchTag>;
  using Collective = typename Traits::Collective;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kNumThreads = Config::kNumThreads;
  static constexpr int kMinBlocksPerSm = Traits::kCtasPerSm;

  struct TensorParams {
    typename Collective::Params collective;  // this tensor's accumulator as the collective's dK, no dV
    float const* ptr_partial;
    ShapeRowsHeadBatch shape;  // (rows, d, h_q, batch_extent)
    StrideRowsHeadBatch stride;
  };

  struct Params {
    TensorParams tensors[2];  // dK, dV (split over CTAs: see the decode below, or the ticket)
    Geometry geometry;
    int num_heads_q;
    int tiles_x;   // grid extent over tiles (per batch z)
    int tiles_z;   // batch extent of the grid
    int* ticket;   // deterministic: work counter (zeroed before launch), else null
    int num_units;    // deterministic: tiles_x * tiles_z * 2 * h_k
    int chunk_units;  // deterministic: units per ticket chunk
  };

  static constexpr int kSharedStorageSize = sizeof(typename Collective::TensorStorage);

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    int tile_x, q_head, batch_z, tensor;
    if (params.ticket) {
      // Deterministic: work from a ticket. A unit is (tile, tensor, kv_head). Tickets run over chunks of
      // chunk_units units, member-major inside a chunk, so member g's ticket comes chunk_units after
      // member g-1's: the CTA it waits on is already running (the wait always ends), was started about
      // a wave earlier (the wait is short), and a chunk's accumulator tiles stay in L2 between adds.
      __shared__ int claimed;
      if (thread_idx == 0) { claimed = atomicAdd(params.ticket, 1); }
      __syncthreads();
      int const work = claimed;
      int const num_heads_kv = params.geometry.num_heads_kv;
      int const group = params.num_heads_q / num_heads_kv;
      int const chunk = work / (params.chunk_units * group);
      int const chunk_begin = chunk * params.chunk_units;
      int const units_in_chunk = min(params.chunk_units, params.num_units - chunk_begin);
      int const rest = work - chunk_begin * group;
      int const member = rest / units_in_chunk;
      int const unit = chunk_begin + rest % units_in_chunk;
      int const kv_head = unit % num_heads_kv;
      tensor = (unit / num_heads_kv) % 2;
      int const tile_linear = unit / (2 * num_heads_kv);
      q_head = kv_head * group + member;
      tile_x = tile_linear % params.tiles_x;
      batch_z = tile_linear / params.tiles_x;
    } else {
      // Grid (2 * tiles_x, h_q, tiles_z), (x, y) read as the linear index y * gridDim.x + x of the
      // order (tensor, q_head, tile): all of dK, then all of dV, so the accumulator tiles touched
      // between two members' adds fit L2 (docs/design.md). 64-bit: 2 * tiles_x * h_q may pass 2^31.
      auto const [t, rest] = split_by_tensor<int64_t>(int64_t(blockIdx.y) * gridDim.x + blockIdx.x,
                                                      int64_t(params.tiles_x) * params.num_heads_q);
      tensor = t;
      q_head = static_cast<int>(rest / params.tiles_x);
      tile_x = static_cast<int>(rest - int64_t(q_head) * params.tiles_x);
      batch_z = blockIdx.z;
    }
    TensorParams const& work = params.tensors[tensor];
    auto const& coll = work.collective;
    auto const [n_block, bidb, seqlen_info, valid_rows] =
        locate_row_tile<kBlockN>(tile_x, batch_z, params.geometry.batch, work.shape, coll);
    if (valid_rows <= 0) { return; }  // every member of this tile exits alike: nobody waits on it

    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor frag = partition_fragment_C(tiled_mma, typename Traits::FragmentTileShape{});
    auto const gtile = rows_tile<kBlockN, kHeadDim>(work.ptr_partial, work.shape, work.stride, q_head,
                                                    coll.cu_seqlens ? 0 : bidb, seqlen_info.offset, n_block);
    load_accum_tile<Config::kSwapAB, kBlockN, kHeadDim>(frag, thr_mma, gtile, valid_rows, get<1>(work.shape));
    auto& storage = *reinterpret_cast<typename Collective::TensorStorage*>(smem);
    Collective{}.store(coll, frag, frag, storage, tiled_mma, thread_idx, make_tuple(n_block, q_head, bidb));
  }
};

// The accumulator tiles of one tensor. A tile holds its first num_slabs slabs (AccumTraits): a thread of a
// later slab has only columns past the tensor's width, read as zeros and never written.
template <class Traits>
struct AccumTiles {
  float* ptr;
  int64_t head_stride;
  int64_t batch_stride;
  int num_tiles;
  int tile_elems;  // num_slabs * Traits::kSlabElems
  int num_slabs;

  CUTLASS_DEVICE bool holds(int thread_idx) const { return Traits::slab_of(thread_idx) < num_slabs; }

  // Row tile `rt`'s first float, or -1 for a tile outside [0, num_tiles) (inconsistent sequence metadata).
  template <class RowTileT>
  CUTLASS_DEVICE int64_t tile_offset(RowTileT const& rt, bool varlen, int kv_head) const {
    int64_t const tile = (varlen ? rt.seqlen_info.offset_padded / Traits::Collective::kBlockN : 0) + rt.n_block;
    if (tile < 0 || tile >= num_tiles) { return -1; }
    return (varlen ? 0 : rt.batch) * batch_stride + kv_head * head_stride + tile * tile_elems;
  }

  template <class Fragment, class RowTileT>
  CUTLASS_DEVICE bool read(Fragment& frag, RowTileT const& rt, bool varlen, int kv_head, int thread_idx) const {
    int64_t const offset = tile_offset(rt, varlen, kv_head);
    if (offset < 0) { return false; }
    if (holds(thread_idx)) {
      Traits::Collective::load_fragment(frag, ptr + offset, thread_idx);
    } else {
      cute::clear(frag);
    }
    return true;
  }
};

// The sm_90 gqa_accumulate: persistent CTAs stream each accumulator tile (a 1-D bulk copy), then its
// group's partials (TMA), through a StreamRing, add them in head order in fp32 (elements outside the valid
// rows and columns kept as they are) and bulk-copy the sum back: each tile moves once instead of g times,
// no other CTA touches it, and the bits are those of the ordered per-head adds, without counters.
template <class Config>
struct GqaAccumulateStreamKernel {
  using ArchTag = cutlass::arch::Sm90;
  using Traits = AccumTraits<Config, ArchTag>;
  using Ring = StreamRing<Config, float, kStreamCtasPerSm>;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNumThreads = Ring::kNumThreads;
  static constexpr int kMinBlocksPerSm = kStreamCtasPerSm;
  static constexpr int kSharedStorageSize = Ring::kSharedStorageSize;
  static_assert(Traits::kAccumTileElems * sizeof(float) == Ring::kStageBytes,
                "a whole accumulator tile fills one stage");
  static_assert(Traits::kNumThreads == Ring::kNumConsumerThreads, "the accumulator's fragments are the consumers'");

  struct TensorParams {
    AccumTiles<Traits> accum;
    typename Ring::TmaLoad tma_load_in;  // its partials, (rows, d, h_q, batch extent)
    ShapeRowsHeadBatch shape_in;
  };

  struct Params {
    TensorParams tensors[2];  // dK, dV
    int num_tensors;          // 2, or 1: dK's alone
    int group;                // query heads per KV head
    Geometry geometry;
    int num_n_tiles;          // geometry.row_tiles(kBlockN)
    int num_tiles;            // num_n_tiles * num_tensors * num_heads_kv * batch extent
  };

  // A tile of the walk and its accumulator tile's first float (-1: nothing to do).
  struct TileWork : TensorAndHead, RowTile<kBlockN> {
    int64_t offset;
  };

  CUTLASS_DEVICE static TileWork decode(Params const& params, int tile) {
    Geometry const& g = params.geometry;
    int const heads_y = params.num_tensors * g.num_heads_kv;
    auto const [tensor, head] = split_by_tensor(tile % heads_y, g.num_heads_kv);
    int const rest = tile / heads_y;
    TensorParams const& t = params.tensors[tensor];
    RowTile<kBlockN> const row_tile =
        locate_row_tile<kBlockN>(rest % params.num_n_tiles, rest / params.num_n_tiles, g.batch, t.shape_in, g);
    int64_t const offset = row_tile.valid_rows > 0 ? t.accum.tile_offset(row_tile, g.varlen, head) : -1;
    return {{tensor, head}, row_tile, offset};
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    Ring const ring(smem);
    ring.run([&] { produce(params, ring); }, [&] { consume(params, ring); });
  }

  // Per tile, the accumulator tile, then the partials in head order.
  CUTLASS_DEVICE void produce(Params const& params, Ring const& ring) const {
    using namespace cute;
    for (int i = 0; i < params.num_tensors; ++i) {
      prefetch_tma_descriptor(params.tensors[i].tma_load_in.get_tma_descriptor());
    }
    int load_index = 0;
    for_each_persistent_tile(params.num_tiles, [&](int tile) {
      TileWork const work = decode(params, tile);
      if (work.offset < 0) { return; }
      TensorParams const& t = params.tensors[work.tensor];
      ring.load_bytes(t.accum.ptr + work.offset, t.accum.tile_elems * int(sizeof(float)), ring.acquire(load_index++));
      for (int member = 0; member < params.group; ++member) {
        int const stage = ring.acquire(load_index++);
        ring.load_tile(t.tma_load_in, t.shape_in, work.head * params.group + member,
                       params.geometry.varlen ? 0 : work.batch, work.seqlen_info.offset, work.n_block, stage);
      }
    });
  }

  CUTLASS_DEVICE void consume(Params const& params, Ring const& ring) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor frag = partition_fragment_C(tiled_mma, typename Traits::FragmentTileShape{});
    int load_index = 0;  // loads consumed
    for_each_persistent_tile(params.num_tiles, [&](int tile) {
      TileWork const work = decode(params, tile);
      if (work.offset < 0) { return; }
      TensorParams const& t = params.tensors[work.tensor];
      // A warpgroup whose slab the tile lacks only keeps the ring's turns.
      bool const holds = t.accum.holds(thread_idx);
      int stage = ring.wait(load_index++);
      if (holds) { Traits::Collective::load_fragment(frag, ring.stage_ptr(stage), thread_idx); }
      ring.release(stage);
      for (int member = 0; member < params.group; ++member) {
        stage = ring.wait(load_index++);
        if (holds) {
          Tensor s_in = make_tensor(make_smem_ptr(ring.stage_ptr(stage)), typename Ring::SmemLayoutIn{});
          load_accum_tile<Config::kSwapAB, kBlockN, Config::kHeadDim, /*kAdd=*/true, /*kKeepOutside=*/true>(
              frag, thr_mma, s_in, work.valid_rows, get<1>(t.shape_in));
        }
        if (member + 1 < params.group) { ring.release(stage); }
      }
      // The sum over the last partial's stage once every consumer has read it; then fence for the bulk copy.
      named_barrier_sync(Ring::kNumConsumerThreads, kDefaultEpilogueBarrierId);
      if (holds) { Traits::Collective::store_fragment(frag, ring.stage_ptr(stage), thread_idx); }
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(Ring::kNumConsumerThreads, kDefaultEpilogueBarrierId);
      if (thread_idx == 0) {
        SM90_BULK_COPY_S2G::copy(ring.stage_ptr(stage), t.accum.ptr + work.offset,
                                 t.accum.tile_elems * int(sizeof(float)));
        tma_store_arrive();
        tma_store_wait<0>();  // the copy has read the stage (its warp releases it after this)
      }
      ring.release(stage);
    });
  }
};

// Output: OutputTileTraits of the accumulator's config.
template <class Output>
struct GqaPostprocessKernel {
  using Element = typename Output::Element;
  using ArchTag = typename Output::ArchTag;
  using Traits = AccumTraits<typename Output::Config, ArchTag>;
  using Epilogue = typename Output::Epilogue;
  static constexpr int kBlockN = Output::kBlockN;
  static constexpr int kNumThreads = Output::kNumThreads;
  static constexpr int kMinBlocksPerSm = Traits::kCtasPerSm;

  struct TensorParams {
    typename Epilogue::Params epilogue;  // this output as the collective's dK, no dV
    AccumTiles<Traits> accum;
    float scale;
  };

  struct Params {
    TensorParams tensors[2];  // dK, dV (split over CTAs: see locate_output_tile); dV unused without dv
    Geometry geometry;
  };

  static constexpr int kSharedStorageSize = sizeof(typename Epilogue::TensorStorage);

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    auto fill = [](auto& frag, auto const& /*thr_mma*/, TensorParams const& work, auto const& tile) {
      if (!work.accum.read(frag, tile, work.epilogue.cu_seqlens != nullptr, tile.head, threadIdx.x)) { return false; }
#pragma unroll
      for (int i = 0; i < cute::size(frag); ++i) { frag(i) *= work.scale; }
      return true;
    };
    store_output_tile<Output>(params, smem, fill);
  }
};

template <class Config, class ArchTag_>
struct GqaDenseKernel {
  using ArchTag = ArchTag_;
  using Traits = AccumTraits<Config, ArchTag>;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNumThreads = Config::kNumThreads;
  static constexpr int kMinBlocksPerSm = Traits::kCtasPerSm;

  struct Params {
    AccumTiles<Traits> accum;
    float* ptr_out;
    ShapeRowsHeadBatch shape_out;  // (rows, w, h_k, batch_extent)
    StrideRowsHeadBatch stride_out;
    Geometry geometry;
  };

  static constexpr int kSharedStorageSize = 0;

  CUTLASS_DEVICE void operator()(Params const& params, char*) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    Geometry const& g = params.geometry;
    auto const tile = locate_row_tile<kBlockN>(blockIdx.x, blockIdx.z, g.batch, params.shape_out, g);
    int const kv_head = blockIdx.y;
    if (tile.valid_rows <= 0) { return; }
    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor frag = partition_fragment_C(tiled_mma, typename Traits::FragmentTileShape{});
    bool const varlen = g.varlen;
    if (!params.accum.read(frag, tile, varlen, kv_head, thread_idx)) { return; }
    auto const gtile = rows_tile<kBlockN, Config::kHeadDim>(params.ptr_out, params.shape_out, params.stride_out,
                                                            kv_head, varlen ? 0 : tile.batch, tile.seqlen_info.offset,
                                                            tile.n_block);
    int const valid_rows = tile.valid_rows;
    int const num_cols = get<1>(params.shape_out);
    // The inverse of load_accum_tile, for fp32 outputs: inside [0, valid_rows) x [0, num_cols).
    auto store = [&](auto width, int i, int row, int col, auto ptr) {
      if (row < valid_rows && col < num_cols) {
        if constexpr (decltype(width)::value == 2) {
          *reinterpret_cast<float2*>(ptr) = make_float2(frag(i), frag(i + 1));
        } else {
          *ptr = frag(i);
        }
      }
    };
    for_each_fragment_element<Config::kSwapAB, kBlockN, Config::kHeadDim>(thr_mma, gtile, store);
  }
};

// Output: OutputTileTraits, the kernel's base (as StoreKernel's); ElementIn: float or Output::Element.
template <class Output, class ElementIn>
struct GqaReduceKernel : Output {
  using Config = typename Output::Config;
  using Epilogue = typename Output::Epilogue;
  static constexpr int kBlockN = Output::kBlockN, kHeadDim = Output::kHeadDim, kNumThreads = Output::kNumThreads;
  // swapAB configs stage through StagedTileSum: in fragment order their loads run down columns. The
  // others read the fragment directly (staging was slower: docs/design.md).
  static constexpr bool kStaged = Config::kSwapAB;
  static constexpr int kMinBlocksPerSm = gqa_tile_ctas_per_sm(kNumThreads, kStaged);
  using Staged = StagedTileSum<kBlockN, kHeadDim, kNumThreads, Config::kSwapAB, ElementIn>;

  struct TensorParams {
    typename Epilogue::Params epilogue;  // this output (rows, d, h_k, batch) as the collective's dK
    ElementIn const* ptr_partial;
    ShapeRowsHeadBatch shape_partial;  // (rows, d, h_q, batch)
    StrideRowsHeadBatch stride_partial;
    float scale;
  };

  struct Params {
    TensorParams tensors[2];  // dK, dV (split over CTAs: see locate_output_tile); dV unused without dv_partial
    int group;
    Geometry geometry;
  };

  // The staging buffer aliases the collective's shared memory (used one after the other).
  static constexpr int kSharedStorageSize = cute::max(static_cast<int>(sizeof(typename Epilogue::TensorStorage)),
                                                      kStaged ? Staged::kSmemBytes : 0);

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    auto fill = [&](auto& acc, auto const& thr_mma, TensorParams const& work, auto const& tile) {
      using namespace cute;
      int const batch_coord = work.epilogue.cu_seqlens ? 0 : tile.batch;
      auto tile_of = [&](int g) {
        return rows_tile<kBlockN, kHeadDim>(work.ptr_partial, work.shape_partial, work.stride_partial,
                                            tile.head * params.group + g, batch_coord, tile.seqlen_info.offset,
                                            tile.n_block);
      };
      int const num_cols = get<1>(work.shape_partial);
      // 0 + p_0 + p_1 + ... in head order: the same bits whichever path reads the partials.
      if constexpr (kStaged) {
        Staged::run(acc, thr_mma, tile_of, params.group, tile.valid_rows, num_cols, work.scale,
                    reinterpret_cast<float*>(smem), threadIdx.x, Epilogue::BarrierId);
      } else {
        clear(acc);
        for (int g = 0; g < params.group; ++g) {
          // Added as it arrives (no second fragment), which keeps two CTAs per SM.
          load_accum_tile<Config::kSwapAB, kBlockN, kHeadDim, /*kAdd=*/true>(acc, thr_mma, tile_of(g),
                                                                             tile.valid_rows, num_cols);
        }
#pragma unroll
        for (int i = 0; i < size(acc); ++i) { acc(i) *= work.scale; }
      }
      return true;
    };
    store_output_tile<Output>(params, smem, fill);
  }
};

}  // namespace flash_epilogue
