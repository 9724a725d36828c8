// The overlap solver (overlap.h).

#include "overlap.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>
#include <utility>
#include <vector>

namespace flash_epilogue {

namespace {

int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b < 0); }  // Python's a // b (b > 0)

}  // namespace

bool elements_coincide(at::Tensor const& t, at::Tensor const& other, int64_t delta_bytes) {
  int64_t const size = t.element_size();
  if (other.element_size() != size || delta_bytes % size != 0) { return true; }
  // sum over dims of x_d * stride_d == delta, x_d in [0, n-1] for t and [-(n-1), 0] for other
  std::map<int64_t, std::array<int64_t, 2>> terms;  // |stride| -> (lo, hi)
  for (auto const& [x, sign] : {std::pair{&t, 1}, std::pair{&other, -1}}) {
    for (int64_t d = 0; d < x->dim(); ++d) {
      int64_t const n = x->size(d), s = x->stride(d), reach = (n - 1) * ((sign > 0) == (s > 0) ? 1 : -1);
      if (n > 1 && s != 0) { terms[std::abs(s)][reach < 0 ? 0 : 1] += reach; }
    }
  }
  // from the smallest stride: (stride, lo, hi, least and most offset of it and the smaller ones); first a zero sentinel
  std::vector<std::array<int64_t, 5>> items(1);
  int64_t least = 0, most = 0;
  for (auto const& [s, r] : terms) { items.push_back({s, r[0], r[1], least += r[0] * s, most += r[1] * s}); }
  int64_t budget = 100000;
  auto reachable = [&](auto&& self, size_t k, int64_t rem) -> bool {  // largest stride first
    if (k == 0) { return rem == 0; }
    if (--budget < 0) { return true; }  // too many candidates to rule out: assume they coincide
    int64_t const s = items[k][0], lo = items[k][1], hi = items[k][2];
    int64_t const first = std::max(lo, -floor_div(items[k - 1][4] - rem, s));
    int64_t const last = std::min(hi, floor_div(rem - items[k - 1][3], s));
    for (int64_t x = first; x <= last; ++x) {
      if (self(self, k - 1, rem - x * s)) { return true; }
    }
    return false;
  };
  return reachable(reachable, items.size() - 1, delta_bytes / size);
}

}  // namespace flash_epilogue
