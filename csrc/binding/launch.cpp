// The tensors as the kernels take them (launch.h).

#include "launch.h"

#include <algorithm>

namespace flash_epilogue {

// TMA needs a 16-byte multiple also as the stride of a size-1 dim (torch's is arbitrary): the tensor's largest
// extent.
TensorDesc describe(at::Tensor const& t, bool varlen) {
  int64_t span = t.size(-1);
  for (int i = 0; i + 1 < t.dim(); ++i) {
    if (t.size(i) > 1) { span = std::max(span, t.stride(i) * t.size(i)); }
  }
  int const elems_per_16b = 16 / static_cast<int>(t.element_size());
  span = (span + elems_per_16b - 1) / elems_per_16b * elems_per_16b;
  auto const stride_of = [&](int dim) { return t.size(dim) > 1 ? t.stride(dim) : span; };
  return {t.data_ptr(), stride_of(varlen ? 0 : 1), stride_of(varlen ? 1 : 2), varlen ? span : stride_of(0),
          static_cast<int>(t.size(-1))};
}

AccumDesc accum_desc(at::Tensor const& t) {
  return {t.data_ptr<float>(), t.stride(1), t.stride(0), static_cast<int>(t.size(2)), static_cast<int>(t.size(3))};
}

}  // namespace flash_epilogue
