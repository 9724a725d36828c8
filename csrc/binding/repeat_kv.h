#pragma once

// repeat_kv and repeat_kv_backward: their implementations (CompositeExplicitAutograd) and Autograd kernels, as
// registration.cpp registers them.

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace flash_epilogue {

// x repeated n_rep times along dim (1 or 2, or -3 or -2), a new contiguous tensor.
at::Tensor repeat_kv(at::Tensor const& x, int64_t n_rep, int64_t dim);
// The group sum of grad (heads in dim) into a tensor dense in the order `layout` (x's, outermost first).
at::Tensor repeat_kv_backward(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout);
at::Tensor repeat_kv_autograd(at::Tensor const& x, int64_t n_rep, int64_t dim);
at::Tensor repeat_kv_backward_autograd(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout);

void set_debug_sync(bool on);  // FLASH_EPILOGUE_DEBUG: repeat_kv's backward synchronizes after its launch
bool debug_sync_enabled();

}  // namespace flash_epilogue
