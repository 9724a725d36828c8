#pragma once

// Tile I/O between a C fragment of FA3's dK/dV TiledMma and a (BLK_N, BLK_D) tile in global or shared memory.

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/fast_math.h>

#include "flash_epilogue/fragment_utils.h"
#include "flash_epilogue/named_barrier.h"

namespace flash_epilogue {

using ShapeRowsHeadBatch = cute::Shape<int32_t, int32_t, int32_t, int32_t>;    // (rows, d, head, batch)
using StrideRowsHeadBatch = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;

// fn(width, i, row, col, pointer) for each element i of `thr_mma`'s C fragment over a tile (global, or a
// swizzled smem stage). Without swapAB pairs (2i, 2i+1) are adjacent columns of a row and come together
// (width 2); with swapAB the tile is seen as (BLK_D, BLK_N), pairs run down a column: one at a time.
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
    auto const transposed = make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{});
    Tensor gtile_t = make_tensor(gtile.data(), composition(gtile.layout(), transposed));
    Tensor tg = thr_mma.partition_C(gtile_t);                                                    // (MMA, MMA_D, MMA_N)
    Tensor tc = thr_mma.partition_C(make_identity_tensor(Shape<Int<kHeadDim>, Int<kBlockN>>{}));  // -> (d, n)
#pragma unroll
    for (int i = 0; i < size(tg); ++i) {
      auto const [col, row] = tc(i);
      fn(Int<1>{}, i, row, col, &tg(i));
    }
  }
}

// Load a tile (fp32, or 16-bit widened) into `frag` (kAdd: add to it), zeros outside [0, valid_rows) x
// [0, num_cols). kKeepOutside: elements outside are left as they are, not + 0.f (which turns -0.0 into
// +0.0 and quiets a NaN's payload). Pairs are one 8-byte (fp32) or 4-byte (16-bit) access.
template <bool kSwapAB, int kBlockN, int kHeadDim, bool kAdd = false, bool kKeepOutside = false, class Fragment,
          class ThrMma, class GmemTensor>
CUTLASS_DEVICE void load_accum_tile(Fragment& frag, ThrMma const& thr_mma, GmemTensor const& gtile, int valid_rows,
                                    int num_cols) {
  static_assert(kAdd || !kKeepOutside, "kKeepOutside is for adds");
  using In = std::remove_cv_t<typename GmemTensor::value_type>;
  auto put = [&](int i, float v) {
    if constexpr (kAdd) { frag(i) += v; } else { frag(i) = v; }
  };
  auto load = [&](auto width, int i, int row, int col, auto ptr) {
    bool const valid = row < valid_rows && col < num_cols;
    if constexpr (kKeepOutside) {
      if (!valid) { return; }
    }
    if constexpr (decltype(width)::value == 2) {
      cutlass::Array<In, 2> v;
      v.fill(In(0));
      if (valid) { v = *reinterpret_cast<cutlass::Array<In, 2> const*>(ptr); }
      put(i, static_cast<float>(v[0]));
      put(i + 1, static_cast<float>(v[1]));
    } else {
      put(i, valid ? static_cast<float>(*ptr) : 0.f);
    }
  };
  for_each_fragment_element<kSwapAB, kBlockN, kHeadDim>(thr_mma, gtile, load);
}

// The sum of `group` tiles read row-major with 16-byte vectors, staged in shared memory as fp32 and read
// back in C-fragment order: for gqa_reduce's swapAB configs, whose fragment order runs down columns.
// `smem` (kSmemBytes) may alias the collective's storage, whose store starts with a barrier.
template <int kBlockN, int kHeadDim, int kNumThreads, bool kSwapAB, class ElementIn>
struct StagedTileSum {
  static constexpr int kVec = 16 / sizeof(ElementIn);            // elements per 16-byte load
  static_assert(kHeadDim % kVec == 0, "head dim must be a multiple of one 16-byte vector");
  static constexpr int kThreadsPerRow = cutlass::gcd(kHeadDim / kVec, kNumThreads);
  static constexpr int kRowsPerPass = kNumThreads / kThreadsPerRow;
  static constexpr int kColIters = kHeadDim / kVec / kThreadsPerRow;
  static constexpr int kRowIters = (kBlockN + kRowsPerPass - 1) / kRowsPerPass;
  // Running sums per thread: 16 floats for the 384-thread config (80 registers at two CTAs per SM).
  static constexpr int kSumFloats = kNumThreads > 256 ? 16 : 32;
  static constexpr int kChunkRowIters = cute::max(1, kSumFloats / (kColIters * kVec));
  // Row pitch for conflict-free fragment reads: 8 mod 32 words for 8-byte pairs, 4 for swapAB's 4-byte ones.
  static constexpr int kPitch = kHeadDim + (kSwapAB ? 4 : 8);
  static constexpr int kSmemBytes = kBlockN * kPitch * sizeof(float);

  CUTLASS_DEVICE static auto stage_tile(float* smem) {
    using namespace cute;
    return make_tensor(make_smem_ptr(smem),
                       make_layout(Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(Int<kPitch>{}, _1{})));
  }

  // acc(i) in fragment order = scale * sum over g of tile_g, zeros outside the valid rows/cols.
  template <class Fragment, class ThrMma, class TileOf>
  CUTLASS_DEVICE static void run(Fragment& frag, ThrMma const& thr_mma, TileOf&& tile_of, int group, int valid_rows,
                                 int num_cols, float scale, float* smem, int thread_idx, int barrier_id) {
    using namespace cute;
    int const row0 = thread_idx / kThreadsPerRow;
    int const col0 = (thread_idx % kThreadsPerRow) * kVec;
    // A chunk of row passes at a time: its loads for a head overlap, and the sums leave room for two CTAs.
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
    load_accum_tile<kSwapAB, kBlockN, kHeadDim>(frag, thr_mma, stage_tile(smem), kBlockN, kHeadDim);
  }
};

}  // namespace flash_epilogue
