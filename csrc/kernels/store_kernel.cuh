#pragma once

// The `store` driver of the sm_80 path, and of sm_90 at head dims <= 64 and on small problems at
// head dims 192/256 (elsewhere sm_90 runs TileStreamKernel, tile_stream_kernel.cuh; launch_store
// chooses): one CTA per (n_block, head, batch) tile loads the fp32 dK or dV of that tile from
// global memory straight into the C fragment of FA3's dK/dV TiledMma (as if the mainloop had just
// computed it) and hands it to CollectiveEpilogueBwd::store. Also the fragment helpers every
// driver shares.

#include <cute/tensor.hpp>
#include <cutlass/arch/arch.h>

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/epilogue_bwd.h"
#include "flash_epilogue/named_barrier.h"
#include "flash_epilogue/seqlen_info.h"

namespace flash_epilogue {

// Which tile this CTA owns. Batched: grid (n_blocks, heads, batch). Varlen: grid
// (total_tokens / kBlockN + batch, heads, 1) over the kBlockN-aligned padded tile space
// (SeqlenInfo::offset_padded): batch b owns padded tiles [offset_padded(b) / kBlockN, ...), so
// the grid is sized from shapes alone (no host read of cu_seqlens) and each CTA finds its batch
// by binary search. Padded tiles past a sequence's end have no valid rows and exit.
template <int kBlockN>
CUTLASS_DEVICE cute::tuple<int, int> tile_to_block_and_batch(int tile, int batch_z, int batch, int const* cu_seqlens) {
  if (cu_seqlens == nullptr) { return {tile, batch_z}; }
  auto first_tile = [&](int b) { return (cu_seqlens[b] + b * kBlockN) / kBlockN; };
  int lo = 0, hi = batch - 1;  // the last b with first_tile(b) <= tile
  while (lo < hi) {
    int const mid = (lo + hi + 1) / 2;
    if (first_tile(mid) <= tile) { lo = mid; } else { hi = mid - 1; }
  }
  return {tile - first_tile(lo), lo};
}

// Visit the C fragment of `thr_mma` over a (BLK_N, BLK_D) tile (global, or a swizzled stage in
// shared memory): fn(i, row, col, pointer) for element i. Without swapAB the fragment's element pairs
// (2i, 2i+1) are adjacent columns of one row (GMMA and SM80 C layouts) and fn gets them together
// (i even, two elements); with swapAB (the MMA holds dK^T) the tile is seen as (BLK_D, BLK_N) and
// pairs run down a column, so fn gets one element at a time.
template <bool kSwapAB, int kBlockN, int kHeadDim, class ThrMma, class GmemTensor, class Fn>
CUTLASS_DEVICE void for_each_fragment_element(ThrMma const& thr_mma, GmemTensor const& gtile, Fn&& fn) {
  using namespace cute;
  if constexpr (!kSwapAB) {
    Tensor tg = thr_mma.partition_C(gtile);                                                      // (MMA, MMA_N, MMA_D)
    Tensor tc = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // -> (n, d)
    static_assert(decltype(size(tg))::value % 2 == 0, "the C fragment holds column pairs");
#pragma unroll
    for (int i = 0; i < size(tg); i += 2) {
      auto const [row, col] = tc(i);
      fn(Int<2>{}, i, row, col, &tg(i));
    }
  } else {
    // (d, n) -> (n, d): also for a swizzled shared-memory tile, whose layout has no plain strides.
    Tensor gtile_t = make_tensor(gtile.data(), composition(gtile.layout(), make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{},
                                                                                       Stride<Int<kBlockN>, _1>{})));
    Tensor tg = thr_mma.partition_C(gtile_t);                                                    // (MMA, MMA_D, MMA_N)
    Tensor tc = thr_mma.partition_C(make_identity_tensor(Shape<Int<kHeadDim>, Int<kBlockN>>{}));  // -> (d, n)
#pragma unroll
    for (int i = 0; i < size(tg); ++i) {
      auto const [col, row] = tc(i);
      fn(Int<1>{}, i, row, col, &tg(i));
    }
  }
}

// Load one (BLK_N, BLK_D) tile (fp32, or 16-bit widened to fp32) into the C fragment `frag`
// (kAdd: add it to `frag`), as zeros outside [0, valid_rows) x [0, num_cols). Pairs are read as one
// 8-byte (fp32) or 4-byte (16-bit) access.
template <bool kSwapAB, int kBlockN, int kHeadDim, bool kAdd = false, class Fragment, class ThrMma, class GmemTensor>
CUTLASS_DEVICE void load_accum_tile(Fragment& frag, ThrMma const& thr_mma, GmemTensor const& gtile, int valid_rows,
                                    int num_cols) {
  using In = std::remove_cv_t<typename GmemTensor::value_type>;
  auto put = [&](int i, float v) {
    if constexpr (kAdd) { frag(i) += v; } else { frag(i) = v; }
  };
  for_each_fragment_element<kSwapAB, kBlockN, kHeadDim>(thr_mma, gtile, [&](auto width, int i, int row, int col, auto ptr) {
    bool const valid = row < valid_rows && col < num_cols;
    if constexpr (decltype(width)::value == 2) {
      cutlass::Array<In, 2> v;
      v.fill(In(0));
      if (valid) { v = *reinterpret_cast<cutlass::Array<In, 2> const*>(ptr); }
      put(i, static_cast<float>(v[0]));
      put(i + 1, static_cast<float>(v[1]));
    } else {
      put(i, valid ? static_cast<float>(*ptr) : 0.f);
    }
  });
}

// The sum of `group` (BLK_N, BLK_D) tiles (group 1: one tile), read row-major with 16-byte
// vectors, staged in shared memory as fp32 and read back in C-fragment order. gqa_reduce uses it
// where reading straight in fragment order is slow: 16-bit partials (the fragment reads 2- or
// 4-byte pieces) and the swapAB configs (the fragment runs down columns, 4-byte pieces). Store and
// gqa_accumulate read their fp32 tiles straight in fragment order: staged they ran 10-35% slower
// on the H200 (a7fdc6b, benchmarks/NOTES.md). `smem` needs kSmemBytes and may alias the collective's storage: the
// collectives start with a barrier before writing theirs.
template <int kBlockN, int kHeadDim, int kNumThreads, bool kSwapAB, class ElementIn>
struct StagedTileSum {
  static constexpr int kVec = 16 / sizeof(ElementIn);            // elements per 16-byte load
  static_assert(kHeadDim % kVec == 0, "head dim must be a multiple of one 16-byte vector");
  static constexpr int kThreadsPerRow = cutlass::gcd(kHeadDim / kVec, kNumThreads);
  static constexpr int kRowsPerPass = kNumThreads / kThreadsPerRow;
  static constexpr int kColIters = kHeadDim / kVec / kThreadsPerRow;
  static constexpr int kRowIters = (kBlockN + kRowsPerPass - 1) / kRowsPerPass;
  // Running sums per thread: 32 floats, 16 for the 384-thread config (two CTAs per SM leave it
  // 80 registers).
  static constexpr int kSumFloats = kNumThreads > 256 ? 16 : 32;
  static constexpr int kChunkRowIters = cute::max(1, kSumFloats / (kColIters * kVec));
  // Row pitch in floats. Fragment-order reads are then conflict-free: 8-byte pairs of 8 rows per
  // half-warp want a pitch of 8 mod 32 words, swapAB's 4-byte reads (rows 2 apart) 4 mod 32.
  static constexpr int kPitch = kHeadDim + (kSwapAB ? 4 : 8);
  static constexpr int kSmemBytes = kBlockN * kPitch * sizeof(float);

  // acc(i) in fragment order = scale * sum over g of tile_g, zeros outside the valid rows/cols.
  template <class Fragment, class ThrMma, class TileOf>
  CUTLASS_DEVICE static void run(Fragment& frag, ThrMma const& thr_mma, TileOf&& tile_of, int group, int valid_rows,
                                 int num_cols, float scale, float* smem, int thread_idx, int barrier_id) {
    using namespace cute;
    int const row0 = thread_idx / kThreadsPerRow;
    int const col0 = (thread_idx % kThreadsPerRow) * kVec;
    // A chunk of row passes at a time: its loads for one head are in flight together, and the
    // running sums (kSumFloats) leave registers for two CTAs per SM without spilling.
#pragma unroll
    for (int r0 = 0; r0 < kRowIters; r0 += kChunkRowIters) {
      float sum[kChunkRowIters][kColIters][kVec];
#pragma unroll
      for (int r = 0; r < kChunkRowIters; ++r)
#pragma unroll
        for (int c = 0; c < kColIters; ++c)
#pragma unroll
          for (int v = 0; v < kVec; ++v) { sum[r][c][v] = 0.f; }
      for (int g = 0; g < group; ++g) {
        auto const gtile = tile_of(g);  // (BLK_N, BLK_D)
#pragma unroll
        for (int r = 0; r < kChunkRowIters; ++r) {
          int const row = row0 + (r0 + r) * kRowsPerPass;
#pragma unroll
          for (int c = 0; c < kColIters; ++c) {
            int const col = col0 + c * kThreadsPerRow * kVec;
            if (r0 + r < kRowIters && row < valid_rows && col < num_cols) {  // num_cols: a multiple of 8 >= kVec
              auto const v = *reinterpret_cast<cutlass::Array<ElementIn, kVec> const*>(&gtile(row, col));
#pragma unroll
              for (int k = 0; k < kVec; ++k) { sum[r][c][k] += static_cast<float>(v[k]); }
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kChunkRowIters; ++r) {
        int const row = row0 + (r0 + r) * kRowsPerPass;
        if (r0 + r < kRowIters && (kBlockN % kRowsPerPass == 0 || row < kBlockN)) {
#pragma unroll
          for (int c = 0; c < kColIters; ++c) {
            int const col = col0 + c * kThreadsPerRow * kVec;
#pragma unroll
            for (int k = 0; k < kVec; k += 4) {
              *reinterpret_cast<float4*>(smem + row * kPitch + col + k) = make_float4(
                  sum[r][c][k] * scale, sum[r][c][k + 1] * scale, sum[r][c][k + 2] * scale, sum[r][c][k + 3] * scale);
            }
          }
        }
      }
    }
    named_barrier_sync(kNumThreads, barrier_id);
    Tensor stile = make_tensor(make_smem_ptr(smem), make_layout(Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                                               make_stride(Int<kPitch>{}, _1{})));  // (BLK_N, BLK_D)
    load_accum_tile<kSwapAB, kBlockN, kHeadDim>(frag, thr_mma, stile, kBlockN, kHeadDim);
    // The collective's store starts with a barrier: nobody overwrites the staging before all read it.
  }
};

// The inverse for fp32 outputs: write the fragment's elements inside [0, valid_rows) x [0, num_cols).
template <bool kSwapAB, int kBlockN, int kHeadDim, class Fragment, class ThrMma, class GmemTensor>
CUTLASS_DEVICE void store_fragment_tile(Fragment const& frag, ThrMma const& thr_mma, GmemTensor const& gtile,
                                        int valid_rows, int num_cols) {
  for_each_fragment_element<kSwapAB, kBlockN, kHeadDim>(thr_mma, gtile, [&](auto width, int i, int row, int col, auto ptr) {
    if (row < valid_rows && col < num_cols) {
      if constexpr (decltype(width)::value == 2) {
        *reinterpret_cast<float2*>(ptr) = make_float2(frag(i), frag(i + 1));
      } else {
        *ptr = frag(i);
      }
    }
  });
}

// Drivers split the work by output tensor: a CTA handles dK *or* dV of one (n_block, head, batch)
// tile, grid.y running over heads of dK, then heads of dV. Holding one fp32 fragment instead of two
// halves the registers, so two CTAs fit on an SM and one streams its loads while the other stores
// (with both fragments a CTA needs ~150 registers at hdim 128: one CTA per SM, loads and stores
// never overlap). The collective is called with its optional dV left null.
struct TensorAndHead {
  int tensor;  // 0: dK, 1: dV
  int head;
};
CUTLASS_DEVICE TensorAndHead split_tensor_and_head(int grid_y, int num_heads) {
  int const tensor = grid_y >= num_heads ? 1 : 0;
  return {tensor, grid_y - tensor * num_heads};
}

// This CTA's tile in a one-CTA-per-tile driver over dK and dV (grid (n tiles, heads of dK then of
// dV, batch), see tile_to_block_and_batch): which output and head, the tile, its sequence and how
// many of its rows may be written (<= 0: none, the CTA has nothing to do). Thread 0 also prefetches
// that output's TMA descriptor. Params: the driver's, with tensors[2].epilogue and batch.
template <int kBlockN>
struct OutputTile {
  int tensor;
  int head;
  int n_block;
  int batch;
  SeqlenInfo<kBlockN> seqlen_info;
  int valid_rows;
};

template <int kBlockN, class Epilogue, class Params>
CUTLASS_DEVICE OutputTile<kBlockN> locate_output_tile(Params const& params, int num_heads) {
  auto const [tensor, head] = split_tensor_and_head(blockIdx.y, num_heads);
  auto const& ep = params.tensors[tensor].epilogue;
  if (threadIdx.x == 0) { Epilogue::prefetch_tma_descriptors(ep); }
  auto const [n_block, batch] = tile_to_block_and_batch<kBlockN>(blockIdx.x, blockIdx.z, params.batch, ep.cu_seqlens);
  int const rows = cute::get<0>(ep.shape_dK);
  SeqlenInfo<kBlockN> const seqlen_info{batch, rows, ep.cu_seqlens, ep.seqused};
  return {tensor, head, n_block, batch, seqlen_info, seqlen_info.valid_rows(n_block, rows)};
}

template <class Config_, class Element_, class ArchTag_, bool kVarlen_>
struct StoreKernel {
  using Config = Config_;
  using Element = Element_;
  using ArchTag = ArchTag_;
  static constexpr bool kVarlen = kVarlen_;  // cu_seqlens and/or seqused (the collective's Varlen)
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kNumThreads = Config::kNumThreads;
  static constexpr int kMinBlocksPerSm = 2;
  static constexpr bool kSwapAB = Config::kSwapAB;
  using TiledMmaConfig = BwdTiledMma<Config, Element, ArchTag>;
  using TiledMma = typename TiledMmaConfig::TiledMma;
  static_assert(cute::size(TiledMma{}) == kNumThreads, "the TiledMma must span exactly the epilogue threads");
  using TileShape_MNK = cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using Epilogue = CollectiveEpilogueBwd<TileShape_MNK, Element, ArchTag, kNumThreads, kVarlen, kSwapAB,
                                         Config::kAtomLayoutKdKV>;
  using ShapeAccum = typename Epilogue::ShapedKV;  // (rows, d, head, batch)
  using StrideAccum = typename Epilogue::StridedKV;

  struct TensorParams {
    typename Epilogue::Params epilogue;  // this output as the collective's dK, no dV
    float const* ptr_accum;
    StrideAccum stride_accum;
  };

  struct Params {
    TensorParams tensors[2];  // dK, dV
    int num_heads;
    int batch;
  };

  static constexpr int kSharedStorageSize = sizeof(typename Epilogue::TensorStorage);

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    auto const [tensor, bidh, n_block, bidb, seqlen_info, valid_rows] = locate_output_tile<kBlockN, Epilogue>(params, params.num_heads);
    if (valid_rows <= 0) { return; }  // whole CTA: padded varlen tile or empty sequence
    TensorParams const& work = params.tensors[tensor];
    auto const& ep = work.epilogue;

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor frag = partition_fragment_C(tiled_mma, typename TiledMmaConfig::FragmentTileShape{});
    Tensor m = make_tensor(make_gmem_ptr(work.ptr_accum), ep.shape_dK, work.stride_accum)(_, _, bidh, ep.cu_seqlens ? 0 : bidb);  // (rows, d)
    Tensor gtile = local_tile(domain_offset(make_coord(seqlen_info.offset, _0{}), m), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                              make_coord(n_block, _0{}));  // (BLK_N, BLK_D)
    load_accum_tile<kSwapAB, kBlockN, kHeadDim>(frag, thr_mma, gtile, valid_rows, get<1>(ep.shape_dK));

    auto& storage = *reinterpret_cast<typename Epilogue::TensorStorage*>(smem);
    Epilogue{}.store(ep, frag, frag, storage, tiled_mma, thread_idx, make_tuple(n_block, bidh, bidb));
  }
};

// One entry point for every driver (store, store_zero). An sm_90 kernel built into an sm_80 binary
// (FLASH_EPILOGUE_CUDA_ARCHS="80;90a") compiles to an empty body there: it is never launched on
// such a device, and its TMA/stmatrix code cannot be emitted for sm_80.
template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, Kernel::kMinBlocksPerSm) epilogue_device_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
  extern __shared__ __align__(1024) char smem[];
#if defined(__CUDA_ARCH__)
  if constexpr (Kernel::ArchTag::kMinComputeCapability >= 90) {
#if __CUDA_ARCH__ >= 900
    Kernel{}(params, smem);
#endif
  } else {
    Kernel{}(params, smem);
  }
#endif
}

}  // namespace flash_epilogue
