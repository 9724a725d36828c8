#pragma once

// Where one batch's rows live, for the batched layout (batch, seqlen, ...) and the packed
// varlen layout (total_tokens, ...), following FlashAttention's conventions:
//   offset        = cu_seqlens[b]                       (0 without cu_seqlens)
//   offset_padded = round_down(cu_seqlens[b] + b * kBlockN, kBlockN)
//                   (the start of batch b in a kBlockN-aligned workspace; batch b's tiles never
//                    reach batch b+1's because each batch adds one tile of slack), formed as
//                   (cu_seqlens[b] / kBlockN + b) * kBlockN (the same for cu_seqlens[b] >= 0)
//   seqlen        = seqused[b] if given, else cu_seqlens[b+1] - cu_seqlens[b], else the static
//                   length. The start always comes from cu_seqlens, the length from seqused.
//
// Ranges (the contract): cu_seqlens and seqused entries may be any int32, consistent or not (a
// caller that skips the content checks must not be able to write outside the tensor); batch_idx
// in [0, batch), batch < 65536; the row extent (seqlen, or total tokens) in [0, 2^31). Sums can pass
// 2^31 (cu_seqlens[b] + b * kBlockN for valid inputs once the token count is within batch * kBlockN
// of 2^31; differences of arbitrary entries), so none is formed where it can wrap: offset_padded
// is 64-bit (it may exceed 2^31 - 1; first_padded_tile is its tile, an int), seqlen is the length
// formed in 64-bit and clamped to [0, 2^31 - 1] (a negative length and a length past the row extent
// write the same rows as the clamped one), and valid_rows returns a count in [0, kBlockN] without
// forming offset + n_block * kBlockN past the row extent. A tile index n_block may be any int.

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
    offset_padded = cu_seqlens ? int64_t(first_padded_tile(batch_idx, cu_seqlens)) * kBlockN : 0;
    int64_t const length = seqused ? seqused[batch_idx]
                           : cu_seqlens ? int64_t(cu_seqlens[batch_idx + 1]) - cu_seqlens[batch_idx]
                                        : static_seqlen;
    seqlen = static_cast<int>(length < 0 ? 0 : (length > INT32_MAX ? INT32_MAX : length));
  }

  // offset_padded / kBlockN, the first tile of batch b in the padded tile space: cu_seqlens[b] /
  // kBlockN + b, which equals (cu_seqlens[b] + b * kBlockN) / kBlockN for cu_seqlens[b] >= 0 and,
  // unlike that sum, never wraps (|cu_seqlens[b]| / kBlockN + b < 2^31). For negative (bad) entries
  // it is some int: valid_rows gives every tile of such a batch no rows.
  CUTLASS_HOST_DEVICE static int first_padded_tile(int b, int const* cu_seqlens) {
    return cu_seqlens[b] / kBlockN + b;
  }

  // Rows of tile `n_block` that may be written, clamped to [0, kBlockN] and to the tensor's row
  // extent, so inconsistent metadata (offsets past the end, negative lengths or tiles) writes
  // nothing outside the tensor instead of corrupting memory. offset + n_block * kBlockN can pass
  // 2^31, so it is formed only once the tile is known to start inside [0, row_extent) (n_block <=
  // (row_extent - 1 - offset) / kBlockN): every value below is then an int in range (32-bit, once
  // per tile), and every row the tile writes is < 2^31.
  CUTLASS_HOST_DEVICE
  int valid_rows(int n_block, int row_extent) const {
    if (offset < 0 || n_block < 0 || offset >= row_extent || n_block > (row_extent - 1 - offset) / kBlockN) {
      return 0;
    }
    int const tile_start = n_block * kBlockN;  // <= row_extent - 1 - offset
    int const start = offset + tile_start;     // < row_extent
    int rows = seqlen - tile_start;            // seqlen in [0, 2^31 - 1], tile_start in [0, 2^31)
    rows = rows < row_extent - start ? rows : row_extent - start;
    return rows < 0 ? 0 : (rows < kBlockN ? rows : kBlockN);
  }
};

}  // namespace flash_epilogue
