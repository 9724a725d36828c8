#pragma once

// Packed fragment conversion, a tiled copy with separate row and column predicates, and row tiles.

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

// Tile n_block of (head, batch_coord) of a (rows, d, head, batch) tensor, in the sequence starting at row
// `offset`; the tensor given (a TMA tensor) or in global memory at `ptr`.
template <int kBlockN, int kHeadDim, class Tensor4>
CUTLASS_DEVICE auto rows_tile(Tensor4 const& m, int head, int batch_coord, int offset, int n_block) {
  using namespace cute;
  return local_tile(domain_offset(make_coord(offset, _0{}), m(_, _, head, batch_coord)),
                    Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
}
template <int kBlockN, int kHeadDim, class T, class ShapeT, class StrideT>
CUTLASS_DEVICE auto rows_tile(T* ptr, ShapeT const& shape, StrideT const& stride, int head, int batch_coord, int offset,
                              int n_block) {
  using namespace cute;
  return rows_tile<kBlockN, kHeadDim>(make_tensor(make_gmem_ptr(ptr), shape, stride), head, batch_coord, offset,
                                      n_block);
}

}  // namespace flash_epilogue
