#pragma once

// Where one batch's rows live, for the batched layout (batch, seqlen, ...) and the packed
// varlen layout (total_tokens, ...), following FlashAttention's conventions:
//   offset        = cu_seqlens[b]                       (0 without cu_seqlens)
//   offset_padded = round_down(cu_seqlens[b] + b * kBlockN, kBlockN)
//                   (the start of batch b in a kBlockN-aligned workspace; batch b's tiles never
//                    reach batch b+1's because each batch adds one tile of slack)
//   seqlen        = seqused[b] if given, else cu_seqlens[b+1] - cu_seqlens[b], else the static
//                   length. The start always comes from cu_seqlens, the length from seqused.

#include <cutlass/cutlass.h>

namespace flash_epilogue {

template <int kBlockN>
struct SeqlenInfo {
  int offset;
  int offset_padded;
  int seqlen;

  CUTLASS_HOST_DEVICE
  SeqlenInfo(int batch_idx, int static_seqlen, int const* cu_seqlens, int const* seqused) {
    offset = cu_seqlens ? cu_seqlens[batch_idx] : 0;
    offset_padded = cu_seqlens ? (cu_seqlens[batch_idx] + batch_idx * kBlockN) / kBlockN * kBlockN : 0;
    seqlen = seqused ? seqused[batch_idx]
                     : (cu_seqlens ? cu_seqlens[batch_idx + 1] - cu_seqlens[batch_idx] : static_seqlen);
  }

  // Rows of tile `n_block` that may be written, clamped to [0, kBlockN] and to the tensor's row
  // extent, so inconsistent metadata (offsets past the end, negative lengths) writes nothing
  // outside the tensor instead of corrupting memory.
  CUTLASS_HOST_DEVICE
  int valid_rows(int n_block, int row_extent) const {
    int const start = offset + n_block * kBlockN;
    if (offset < 0 || start >= row_extent) { return 0; }
    int rows = seqlen - n_block * kBlockN;
    rows = rows < row_extent - start ? rows : row_extent - start;
    return rows < 0 ? 0 : (rows < kBlockN ? rows : kBlockN);
  }
};

}  // namespace flash_epilogue
