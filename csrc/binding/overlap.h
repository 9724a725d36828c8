#pragma once

// Whether two strided tensors share an element: the solver behind the ops' overlap checks.

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace flash_epilogue {

// Whether an element of `t` and one of `other` (starting delta_bytes after t) share memory: exact for equal element
// sizes (a bounded search over the strides tells packed dk = kv[:, :, 0], dv = kv[:, :, 1] apart), else true; true
// also where the search would take too long to rule it out.
bool elements_coincide(at::Tensor const& t, at::Tensor const& other, int64_t delta_bytes);

}  // namespace flash_epilogue
