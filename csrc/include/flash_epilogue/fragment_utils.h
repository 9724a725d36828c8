#pragma once

// Packed fragment conversion and a tiled copy with separate row and column predicates.

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace flash_epilogue {

// Convert a fragment into `dst` (same size), round to nearest even, through one NumericArrayConverter so
// pairs use the packed cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32.
template <class EngineIn, class LayoutIn, class EngineOut, class LayoutOut>
CUTLASS_DEVICE void convert_fragment(cute::Tensor<EngineIn, LayoutIn> const& src,
                                     cute::Tensor<EngineOut, LayoutOut>& dst) {
  using From = typename EngineIn::value_type;
  using To = typename EngineOut::value_type;
  constexpr int kNumel = decltype(cute::size(src))::value;
  static_assert(kNumel == decltype(cute::size(dst))::value, "source and destination fragments differ in size");
  static_assert(kNumel % 2 == 0, "fragment conversion works on pairs: the fragment size must be even");
  cutlass::NumericArrayConverter<To, From, kNumel> converter;
  *reinterpret_cast<cutlass::Array<To, kNumel>*>(dst.data()) =
      converter(*reinterpret_cast<cutlass::Array<From, kNumel> const*>(src.data()));
}

// Tiled copy of a (CPY, CPY_M, CPY_K) partition: only rows in [min_rows, max_rows) (all with kCheckRows
// false) and column blocks whose predicate is set. `identity`: the same partition of an identity tensor.
template <bool kCheckRows = true, class TiledCopy, class SrcTensor, class DstTensor, class IdentityTensor,
          class ColPredTensor>
CUTLASS_DEVICE void copy_predicated(TiledCopy const& tiled_copy, SrcTensor const& src, DstTensor&& dst,
                                    IdentityTensor const& identity, ColPredTensor const& col_pred, int max_rows,
                                    int min_rows = 0) {
  using namespace cute;
  CUTE_STATIC_ASSERT_V(rank(src) == Int<3>{});
  CUTE_STATIC_ASSERT_V(rank(dst) == Int<3>{});
  CUTE_STATIC_ASSERT_V(size<1>(src) == size<1>(dst));
  CUTE_STATIC_ASSERT_V(size<2>(src) == size<2>(dst));
  CUTE_STATIC_ASSERT_V(size<2>(src) == size(col_pred));
#pragma unroll
  for (int m = 0; m < size<1>(src); ++m) {
    int const row = get<0>(identity(_0{}, m, _0{}));
    if (!kCheckRows || (row >= min_rows && row < max_rows)) {
#pragma unroll
      for (int k = 0; k < size<2>(src); ++k) {
        if (col_pred(k)) { cute::copy(tiled_copy, src(_, m, k), dst(_, m, k)); }
      }
    }
  }
}

}  // namespace flash_epilogue
