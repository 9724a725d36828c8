#pragma once

// Where batch b's rows live, batched (batch, seqlen, ...) or packed varlen (total_tokens, ...), as in
// FlashAttention:
//   offset        = cu_seqlens[b] (0 without cu_seqlens)
//   offset_padded = round_down(cu_seqlens[b] + b * kBlockN, kBlockN): batch b's start in a kBlockN-aligned
//                   workspace (one tile of slack per batch keeps batches apart)
//   seqlen        = seqused[b], else cu_seqlens[b+1] - cu_seqlens[b], else the static length.
//
// Ranges: cu_seqlens / seqused entries any int32, consistent or not (nothing may be written outside the
// tensor); batch_idx in [0, batch), batch < 65536; the row extent in [0, 2^31); n_block any int. Sums can
// pass 2^31 (cu_seqlens[b] + b * kBlockN near the int32 limit; differences of bad entries), so none is
// formed where it can wrap: offset_padded is 64-bit, seqlen is formed in 64-bit and clamped to
// [0, 2^31 - 1], and valid_rows never forms offset + n_block * kBlockN past the row extent.

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

  // offset_padded / kBlockN: equals (cu_seqlens[b] + b * kBlockN) / kBlockN for cu_seqlens[b] >= 0 and,
  // unlike that sum, never wraps. For negative (bad) entries valid_rows gives the batch no rows.
  CUTLASS_HOST_DEVICE static int first_padded_tile(int b, int const* cu_seqlens) { return cu_seqlens[b] / kBlockN + b; }

  // Rows of tile n_block that may be written, in [0, kBlockN] and inside the row extent (bad metadata
  // writes nothing outside the tensor). offset + n_block * kBlockN is formed only once the tile is known
  // to start inside [0, row_extent): every value below is then an int in range.
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
