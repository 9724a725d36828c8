#pragma once

// Drivers of the GQA path:
//   GqaAccumulateKernel  per-q-head fp32 partials -> C fragments -> CollectiveEpilogueBwdGQA::store
//   GqaPostprocessKernel accumulator -> C fragments (same TiledMma) * scale -> CollectiveEpilogueBwd
//   GqaDenseKernel       accumulator -> row-major fp32 (debugging and tests)
//   GqaReduceKernel      all partials of a group summed in registers, in head order -> store
// The tile <-> (n_block, batch) mapping is the store driver's (store_kernel.cuh).

#include <cute/tensor.hpp>

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/epilogue_bwd.h"
#include "flash_epilogue/epilogue_bwd_gqa.h"
#include "flash_epilogue/seqlen_info.h"
#include "store_kernel.cuh"

namespace flash_epilogue {

// Everything a GQA driver derives from (head dim config, arch path). The C layout does not depend
// on bf16 vs fp16, so the accumulator side uses the bf16 TiledMma.
template <class Config, class ArchTag>
struct GqaTraits {
  using TiledMmaConfig = BwdTiledMma<Config, cutlass::bfloat16_t, ArchTag>;
  using TiledMma = typename TiledMmaConfig::TiledMma;
  using FragmentTileShape = typename TiledMmaConfig::FragmentTileShape;
  static constexpr int kNumThreads = Config::kNumThreads;
  static constexpr int kFragElems =
      decltype(cute::size(cute::partition_fragment_C(TiledMma{}, FragmentTileShape{})))::value;
  static constexpr int kAccumTileElems = kFragElems * kNumThreads;
  using TileShape_MNK = cute::Shape<cute::_64, cute::Int<Config::kBlockN>, cute::Int<Config::kHeadDim>>;
  using Collective = CollectiveEpilogueBwdGQA<TileShape_MNK, ArchTag, kNumThreads, kAccumTileElems>;
};

using StrideRowsHeadBatch = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;  // (rows, d, head, batch)
using ShapeRowsHeadBatch = cute::Shape<int32_t, int32_t, int32_t, int32_t>;

// The (BLK_N, BLK_D) tile of head `head` at n_block of a sequence starting at `offset`.
template <int kBlockN, int kHeadDim, class T>
CUTLASS_DEVICE auto rows_tile(T* ptr, ShapeRowsHeadBatch const& shape, StrideRowsHeadBatch const& stride, int head,
                              int batch_coord, int offset, int n_block) {
  using namespace cute;
  Tensor m = make_tensor(make_gmem_ptr(ptr), shape, stride)(_, _, head, batch_coord);  // (rows, d)
  return local_tile(domain_offset(make_coord(offset, _0{}), m), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                    make_coord(n_block, _0{}));
}

template <class Config_, class ArchTag_>
struct GqaAccumulateKernel {
  using Config = Config_;
  using ArchTag = ArchTag_;
  using Traits = GqaTraits<Config, ArchTag>;
  using Collective = typename Traits::Collective;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kNumThreads = Config::kNumThreads;

  struct Params {
    typename Collective::Params collective;
    float const* ptr_dK_partial;
    ShapeRowsHeadBatch shape_dK;  // (rows, d, h_q, batch_extent)
    StrideRowsHeadBatch stride_dK;
    float const* ptr_dV_partial;
    ShapeRowsHeadBatch shape_dV;
    StrideRowsHeadBatch stride_dV;
    int batch;
    int num_heads_q;
    int tiles_x;   // grid extent over tiles (per batch z)
    int tiles_z;   // batch extent of the grid
    int* ticket;   // deterministic: work counter (zeroed before launch), else null
  };

  static constexpr int kSharedStorageSize = sizeof(typename Collective::TensorStorage);

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    int tile_x, q_head, batch_z;
    if (params.ticket) {
      // Deterministic: claim work in (tile, kv_head, group member) order. A CTA holding member g of
      // a tile was handed its ticket after the CTA holding member g-1, which is therefore already
      // running: the collective's wait for g-1 always ends, whatever order blocks are scheduled in.
      __shared__ int claimed;
      if (thread_idx == 0) { claimed = atomicAdd(params.ticket, 1); }
      __syncthreads();
      int const work = claimed;
      int const num_heads_kv = params.collective.num_heads_kv;
      int const group = params.num_heads_q / num_heads_kv;
      int const member = work % group;
      int const kv_head = (work / group) % num_heads_kv;
      int const tile_linear = work / params.num_heads_q;
      q_head = kv_head * group + member;
      tile_x = tile_linear % params.tiles_x;
      batch_z = tile_linear / params.tiles_x;
    } else {
      tile_x = blockIdx.x;
      q_head = blockIdx.y;
      batch_z = blockIdx.z;
    }
    auto const [n_block, bidb] = tile_to_block_and_batch<kBlockN>(tile_x, batch_z, params.batch, params.collective.cu_seqlens);
    int const rows = get<0>(params.shape_dK);
    SeqlenInfo<kBlockN> const seqlen_info{bidb, rows, params.collective.cu_seqlens, params.collective.seqused};
    int const valid_rows = seqlen_info.valid_rows(n_block, rows);
    if (valid_rows <= 0) { return; }  // every member of this tile exits alike: nobody waits on it

    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tdKrdK = partition_fragment_C(tiled_mma, typename Traits::FragmentTileShape{});
    Tensor tdVrdV = partition_fragment_C(tiled_mma, typename Traits::FragmentTileShape{});
    int const batch_coord = params.collective.cu_seqlens ? 0 : bidb;
    load_accum_tile<Config::kSwapAB, kBlockN, kHeadDim>(
        tdVrdV, thr_mma,
        rows_tile<kBlockN, kHeadDim>(params.ptr_dV_partial, params.shape_dV, params.stride_dV, q_head, batch_coord,
                                     seqlen_info.offset, n_block),
        valid_rows, get<1>(params.shape_dV));
    load_accum_tile<Config::kSwapAB, kBlockN, kHeadDim>(
        tdKrdK, thr_mma,
        rows_tile<kBlockN, kHeadDim>(params.ptr_dK_partial, params.shape_dK, params.stride_dK, q_head, batch_coord,
                                     seqlen_info.offset, n_block),
        valid_rows, get<1>(params.shape_dK));
    auto& storage = *reinterpret_cast<typename Collective::TensorStorage*>(smem);
    Collective{}.store(params.collective, tdKrdK, tdVrdV, storage, thread_idx, make_tuple(n_block, q_head, bidb));
  }
};

// Accumulator tiles back into C fragments: (n_block, kv_head, batch) -> fragment of thread_idx.
template <class Traits>
struct AccumReader {
  float const* ptr;
  int64_t head_stride;
  int64_t batch_stride;
  int num_tiles;

  template <class Fragment, class SeqInfo>
  CUTLASS_DEVICE bool read(Fragment& frag, SeqInfo const& info, bool varlen, int n_block, int kv_head, int bidb,
                           int thread_idx) const {
    int const tile = (varlen ? info.offset_padded / Traits::Collective::kBlockN : 0) + n_block;
    if (tile < 0 || tile >= num_tiles) { return false; }
    int64_t const offset = (varlen ? 0 : bidb) * batch_stride + kv_head * head_stride +
                           static_cast<int64_t>(tile) * Traits::kAccumTileElems;
    Traits::Collective::load_fragment(frag, ptr + offset, thread_idx);
    return true;
  }
};

template <class Config_, class Element_, class ArchTag_, bool kVarlen_>
struct GqaPostprocessKernel {
  using Config = Config_;
  using Element = Element_;
  using ArchTag = ArchTag_;
  using Traits = GqaTraits<Config, ArchTag>;
  using Store = StoreKernel<Config, Element, ArchTag, kVarlen_>;  // its TiledMma and CollectiveEpilogueBwd
  using Epilogue = typename Store::Epilogue;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNumThreads = Config::kNumThreads;

  struct Params {
    typename Epilogue::Params epilogue;
    AccumReader<Traits> dk_accum;
    AccumReader<Traits> dv_accum;
    float scale_dk;
    float scale_dv;
    int batch;
  };

  static constexpr int kSharedStorageSize = sizeof(typename Epilogue::TensorStorage);

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    auto const& ep = params.epilogue;
    if (thread_idx == 0) { Epilogue::prefetch_tma_descriptors(ep); }
    auto const [n_block, bidb] = tile_to_block_and_batch<kBlockN>(blockIdx.x, blockIdx.z, params.batch, ep.cu_seqlens);
    int const kv_head = blockIdx.y;
    int const rows = get<0>(ep.shape_dK);
    SeqlenInfo<kBlockN> const seqlen_info{bidb, rows, ep.cu_seqlens, ep.seqused};
    if (seqlen_info.valid_rows(n_block, rows) <= 0) { return; }

    typename Store::TiledMma tiled_mma;
    Tensor tdKrdK = partition_fragment_C(tiled_mma, typename Store::TiledMmaConfig::FragmentTileShape{});
    Tensor tdVrdV = partition_fragment_C(tiled_mma, typename Store::TiledMmaConfig::FragmentTileShape{});
    bool const varlen = ep.cu_seqlens != nullptr;
    if (!params.dk_accum.read(tdKrdK, seqlen_info, varlen, n_block, kv_head, bidb, thread_idx) ||
        !params.dv_accum.read(tdVrdV, seqlen_info, varlen, n_block, kv_head, bidb, thread_idx)) {
      return;
    }
#pragma unroll
    for (int i = 0; i < size(tdKrdK); ++i) {
      tdKrdK(i) *= params.scale_dk;
      tdVrdV(i) *= params.scale_dv;
    }
    auto& storage = *reinterpret_cast<typename Epilogue::TensorStorage*>(smem);
    Epilogue{}.store(ep, tdKrdK, tdVrdV, storage, tiled_mma, thread_idx, make_tuple(n_block, kv_head, bidb));
  }
};

template <class Config_, class ArchTag_>
struct GqaDenseKernel {
  using Config = Config_;
  using ArchTag = ArchTag_;
  using Traits = GqaTraits<Config, ArchTag>;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNumThreads = Config::kNumThreads;

  struct Params {
    AccumReader<Traits> accum;
    float* ptr_out;
    ShapeRowsHeadBatch shape_out;  // (rows, w, h_k, batch_extent)
    StrideRowsHeadBatch stride_out;
    int batch;
    int const* cu_seqlens;
    int const* seqused;
  };

  static constexpr int kSharedStorageSize = 0;

  CUTLASS_DEVICE void operator()(Params const& params, char*) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    auto const [n_block, bidb] = tile_to_block_and_batch<kBlockN>(blockIdx.x, blockIdx.z, params.batch, params.cu_seqlens);
    int const kv_head = blockIdx.y;
    int const rows = get<0>(params.shape_out);
    SeqlenInfo<kBlockN> const seqlen_info{bidb, rows, params.cu_seqlens, params.seqused};
    int const valid_rows = seqlen_info.valid_rows(n_block, rows);
    if (valid_rows <= 0) { return; }
    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor frag = partition_fragment_C(tiled_mma, typename Traits::FragmentTileShape{});
    bool const varlen = params.cu_seqlens != nullptr;
    if (!params.accum.read(frag, seqlen_info, varlen, n_block, kv_head, bidb, thread_idx)) { return; }
    store_fragment_tile<Config::kSwapAB, kBlockN, Config::kHeadDim>(
        frag, thr_mma,
        rows_tile<kBlockN, Config::kHeadDim>(params.ptr_out, params.shape_out, params.stride_out, kv_head,
                                             varlen ? 0 : bidb, seqlen_info.offset, n_block),
        valid_rows, get<1>(params.shape_out));
  }
};

template <class Config_, class Element_, class ElementIn_, class ArchTag_, bool kVarlen_>
struct GqaReduceKernel {
  using Config = Config_;
  using Element = Element_;
  using ElementIn = ElementIn_;  // float, or Element
  using ArchTag = ArchTag_;
  using Store = StoreKernel<Config, Element, ArchTag, kVarlen_>;
  using Epilogue = typename Store::Epilogue;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kNumThreads = Config::kNumThreads;

  struct Params {
    typename Epilogue::Params epilogue;  // outputs: (rows, d, h_k, batch)
    ElementIn const* ptr_dK_partial;
    ShapeRowsHeadBatch shape_dK_partial;  // (rows, d, h_q, batch)
    StrideRowsHeadBatch stride_dK_partial;
    ElementIn const* ptr_dV_partial;      // null: dK only
    ShapeRowsHeadBatch shape_dV_partial;
    StrideRowsHeadBatch stride_dV_partial;
    int group;
    float scale_dk;
    float scale_dv;
    int batch;
  };

  static constexpr int kSharedStorageSize = sizeof(typename Epilogue::TensorStorage);

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    auto const& ep = params.epilogue;
    if (thread_idx == 0) { Epilogue::prefetch_tma_descriptors(ep); }
    auto const [n_block, bidb] = tile_to_block_and_batch<kBlockN>(blockIdx.x, blockIdx.z, params.batch, ep.cu_seqlens);
    int const kv_head = blockIdx.y;
    int const rows = get<0>(ep.shape_dK);
    SeqlenInfo<kBlockN> const seqlen_info{bidb, rows, ep.cu_seqlens, ep.seqused};
    int const valid_rows = seqlen_info.valid_rows(n_block, rows);
    if (valid_rows <= 0) { return; }

    typename Store::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    using FragShape = typename Store::TiledMmaConfig::FragmentTileShape;
    Tensor tdKrdK = partition_fragment_C(tiled_mma, FragShape{});
    Tensor tdVrdV = partition_fragment_C(tiled_mma, FragShape{});
    Tensor partial = partition_fragment_C(tiled_mma, FragShape{});
    int const batch_coord = ep.cu_seqlens ? 0 : bidb;
    bool const has_dv = params.ptr_dV_partial != nullptr;
    // 0 + p_0 + p_1 + ... in head order: the same bits whatever the launch order.
    auto sum_group = [&](auto& acc, ElementIn const* ptr, ShapeRowsHeadBatch const& shape,
                         StrideRowsHeadBatch const& stride, float scale) {
      clear(acc);
      for (int g = 0; g < params.group; ++g) {
        load_accum_tile<Config::kSwapAB, kBlockN, kHeadDim>(
            partial, thr_mma,
            rows_tile<kBlockN, kHeadDim>(ptr, shape, stride, kv_head * params.group + g, batch_coord,
                                         seqlen_info.offset, n_block),
            valid_rows, get<1>(shape));
#pragma unroll
        for (int i = 0; i < size(acc); ++i) { acc(i) += partial(i); }
      }
#pragma unroll
      for (int i = 0; i < size(acc); ++i) { acc(i) *= scale; }
    };
    sum_group(tdKrdK, params.ptr_dK_partial, params.shape_dK_partial, params.stride_dK_partial, params.scale_dk);
    if (has_dv) {
      sum_group(tdVrdV, params.ptr_dV_partial, params.shape_dV_partial, params.stride_dV_partial, params.scale_dv);
    }
    auto& storage = *reinterpret_cast<typename Epilogue::TensorStorage*>(smem);
    Epilogue{}.store(ep, tdKrdK, tdVrdV, storage, tiled_mma, thread_idx, make_tuple(n_block, kv_head, bidb));
  }
};

}  // namespace flash_epilogue
