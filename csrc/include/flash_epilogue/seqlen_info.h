#pragma once

// Where one batch's rows live, for the batched layout (batch, seqlen, ...) and the packed
// varlen layout (total_tokens, ...), following FlashAttention's conventions:
//   offset        = cu_seqlens[b]                       (0 without cu_seqlens)
//   offset_padded = round_down(cu_seqlens[b] + b * kBlockN, kBlockN)
//                   (the start of batch b in a kBlockN-aligned workspace; batch b's tiles never
//                    reach batch b+1's because each batch adds one tile of slack)
//   seqlen        = seqused[b] if given, else cu_seqlens[b+1] - cu_seqlens[b], else the static
//                   length. The start always comes from cu_seqlens, the length from seqused.
//
// Ranges (the contract): cu_seqlens and seqused entries may be any int32, consistent or not (a
// caller that skips the content checks must not be able to write outside the tensor); batch_idx
// in [0, 65535]; the row extent (seqlen, or total tokens) in [0, 2^31). Sums of these can pass
// 2^31 (cu_seqlens[b] + b * kBlockN for valid inputs once the token count is within batch * kBlockN
// of 2^31; differences of arbitrary entries), so they are formed and clamped in 64-bit:
// offset_padded is 64-bit (it may exceed 2^31 - 1), seqlen is the length clamped to [0, 2^31 - 1]
// (a negative length and a length past the row extent write the same rows as the clamped one),
// and valid_rows returns a count in [0, kBlockN]. A tile index n_block may be any int.

#include <cstdint>

#include <cutlass/cutlass.h>

namespace flash_epilogue {

template <int kBlockN>
struct SeqlenInfo {
  int offset;
  int64_t offset_padded;
  int seqlen;

  CUTLASS_HOST_DEVICE
  SeqlenInfo(int batch_idx, int static_seqlen, int const* cu_seqlens, int const* seqused) {
    offset = cu_seqlens ? cu_seqlens[batch_idx] : 0;
    offset_padded = cu_seqlens ? first_padded_tile(batch_idx, cu_seqlens) * kBlockN : 0;
    int64_t const length = seqused ? seqused[batch_idx]
                           : cu_seqlens ? int64_t(cu_seqlens[batch_idx + 1]) - cu_seqlens[batch_idx]
                                        : static_seqlen;
    seqlen = static_cast<int>(length < 0 ? 0 : (length > INT32_MAX ? INT32_MAX : length));
  }

  // offset_padded / kBlockN: the first tile of batch b in the padded tile space. Always an int:
  // |cu_seqlens[b]| / kBlockN + b < 2^31. Truncates toward zero for negative (bad) entries, as the
  // 32-bit form did; valid_rows makes any tile of such a batch harmless.
  CUTLASS_HOST_DEVICE static int first_padded_tile(int b, int const* cu_seqlens) {
    return static_cast<int>((int64_t(cu_seqlens[b]) + int64_t(b) * kBlockN) / kBlockN);
  }

  // Rows of tile `n_block` that may be written, clamped to [0, kBlockN] and to the tensor's row
  // extent, so inconsistent metadata (offsets past the end, negative lengths or tiles) writes
  // nothing outside the tensor instead of corrupting memory. 64-bit: offset + n_block * kBlockN
  // can pass 2^31. A tile with a nonzero result starts inside [0, row_extent), so its first row
  // offset + n_block * kBlockN and every row it writes are < 2^31 (int again).
  CUTLASS_HOST_DEVICE
  int valid_rows(int n_block, int row_extent) const {
    int64_t const tile_start = int64_t(n_block) * kBlockN;
    int64_t const start = offset + tile_start;
    if (offset < 0 || n_block < 0 || start >= row_extent) { return 0; }
    int64_t rows = seqlen - tile_start;
    rows = rows < row_extent - start ? rows : row_extent - start;
    return static_cast<int>(rows < 0 ? 0 : (rows < kBlockN ? rows : kBlockN));
  }
};

}  // namespace flash_epilogue
