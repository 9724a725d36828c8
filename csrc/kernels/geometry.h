#pragma once

// The rows and heads of a call, as the binding, the launches and the kernels share them: batched (`batch`
// sequences of `rows` rows) or varlen (cu_seqlens: `batch` sequences in `rows` total tokens), seqused optionally
// shortening each sequence. No CUTLASS or torch types: the host compiler includes it too.

#include <cstdint>

#if defined(__CUDACC__)
#define FLASH_EPILOGUE_HOST_DEVICE __host__ __device__
#else
#define FLASH_EPILOGUE_HOST_DEVICE
#endif

namespace flash_epilogue {

// Row tiles of block_n rows per (head, batch extent). Batched: ceil(rows / block_n) per sequence. Varlen: the padded
// tile space, rows / block_n + batch tiles, in which sequence b starts at tile (cu_seqlens[b] + b * block_n) /
// block_n (SeqlenInfo::first_padded_tile), so every sequence starts a tile and grids are sized from shapes alone.
FLASH_EPILOGUE_HOST_DEVICE constexpr int64_t row_tiles(int64_t rows, int64_t batch, bool varlen, int64_t block_n) {
  return varlen ? rows / block_n + batch : (rows + block_n - 1) / block_n;
}

// The shape of a call's rows and KV heads, which is all the plan decides from.
struct ProblemShape {
  int rows = 0;          // seqlen (batched) or total tokens (varlen): < 2^31
  int batch = 0;         // sequences: the tensors' dim 0, or cu_seqlens.numel() - 1: < 2^16
  int num_heads_kv = 0;  // KV heads: of dK/dV, of the GQA accumulators: < 2^16
  bool varlen = false;   // cu_seqlens given

  // The batch dim of the tensors and grids: 1 in varlen, where sequences are rows of one.
  FLASH_EPILOGUE_HOST_DEVICE int batch_extent() const { return varlen ? 1 : batch; }
  FLASH_EPILOGUE_HOST_DEVICE int64_t row_tiles(int block_n) const {
    return flash_epilogue::row_tiles(rows, batch, varlen, block_n);
  }
  // Tiles of one tensor: row tiles x KV heads x batch extent.
  FLASH_EPILOGUE_HOST_DEVICE int64_t tiles(int block_n) const {
    return row_tiles(block_n) * num_heads_kv * batch_extent();
  }
};

// The shape and the sequence metadata, as the launches and kernels take them.
struct Geometry : ProblemShape {
  int const* cu_seqlens = nullptr;  // device, (batch + 1,), given iff varlen
  int const* seqused = nullptr;     // device, (batch,) or null
};

}  // namespace flash_epilogue
