// repeat_kv: the KV-head expand and its group-sum backward, with their autograd.
//
// Both ops and their autograd are here so that a torch.autograd.grad through repeat_kv runs no
// Python: as Python custom ops with a Python autograd and the gqa_reduce wrapper the backward's host
// time exceeds its kernel's (benchmarks/NOTES.md). The package keeps the public wrapper (its
// argument errors are FlashEpilogueInputError) and the fake kernels.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <vector>

#include "ops.h"

namespace flash_epilogue {
namespace {

std::atomic<bool> debug_sync_on{false};

// gqa_reduce's (batch, seqlen, heads, d) view of a tensor whose heads are in `dim`.
at::Tensor kernel_view(at::Tensor const& t, int64_t dim) { return dim == 1 ? t.transpose(1, 2) : t; }

// flash_epilogue.reference.group_sum_reference's arithmetic into `out`: for every KV head,
// 0 + g_0 + ... + g_{n-1} in fp32 (fp64 for fp64/complex128, the gradient's dtype if wider still) in
// head order, then one rounding to out's dtype. The same ATen calls in the same order, so the same
// bits.
void group_sum_reference(at::Tensor const& grad, int64_t n_rep, int64_t dim, at::Tensor const& out) {
  at::ScalarType const acc_dtype = c10::promoteTypes(grad.scalar_type(), at::kFloat);
  at::Tensor acc = out.scalar_type() == acc_dtype ? out : at::empty(out.sizes(), grad.options().dtype(acc_dtype));
  acc.zero_();
  at::Tensor const grouped = grad.unflatten(dim, {out.size(dim), n_rep});
  for (int64_t j = 0; j < n_rep; ++j) { acc.add_(grouped.select(dim + 1, j)); }  // exact upcast, then an fp32 add
  if (!acc.is_same(out)) { out.copy_(acc); }                                     // round to nearest even, once
}

// The Python wrappers synchronize after their launches under FLASH_EPILOGUE_DEBUG; repeat_kv's
// backward runs here, off them (in autograd's engine), so it waits for its kernel itself. Never
// under CUDA-graph capture, where a synchronize is an error.
void debug_sync(char const* op, at::Tensor const& t) {
  if (!debug_sync_on.load(std::memory_order_relaxed)) { return; }
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) { return; }
  cudaError_t const err = cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream(t.get_device()).stream());
  TORCH_CHECK(err == cudaSuccess, "flash_epilogue.", op, ": the kernel failed on ", t.device(), ": ",
              cudaGetErrorString(err));
}

// Sum the groups of `grad` into `out` (x's gradient): one gqa_reduce launch where the kernels take
// the gradient, else group_sum_reference. Bitwise the same either way.
void reduce_groups(at::Tensor const& grad, int64_t n_rep, int64_t dim, at::Tensor const& out) {
  at::Tensor partial = kernel_view(grad, dim);
  if (!gqa_reduce_takes(partial)) {
    group_sum_reference(grad, n_rep, dim, out);
    return;
  }
  if (!gqa_reduce_reads_in_place(partial)) {
    // e.g. the stride-0 gradient of a .sum(), or a misaligned start: one copy into a new (aligned,
    // contiguous) tensor, then the kernel; the result does not depend on it
    partial = kernel_view(grad.clone(at::MemoryFormat::Contiguous), dim);
  }
  // straight to the implementation: the dispatcher and the Python wrapper cost host time, and its
  // checks still run (they are what keeps a bad descriptor from being built)
  gqa_reduce(partial, std::nullopt, kernel_view(out, dim), std::nullopt, std::nullopt, std::nullopt, 1.0, 1.0, 0);
  debug_sync("repeat_kv_backward", partial);
}

// The order of x's first three dims in memory, outermost first: x's gradient is allocated in this
// order. Ties (size-1 dims, equal strides) keep the logical order. Symbolic strides (torch.compile,
// dynamic shapes) are compared through guards.
std::vector<int64_t> layout_of(at::Tensor const& x) {
  c10::SymIntArrayRef const strides = x.sym_strides();
  std::vector<int64_t> order = {0, 1, 2};
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  return order;
}

// The ops called through the dispatcher from autograd (traced by torch.compile, differentiated
// again under create_graph).
at::Tensor call_repeat_kv(at::Tensor const& x, int64_t n_rep, int64_t dim) {
  static auto const op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flash_epilogue::repeat_kv", "")
                             .typed<at::Tensor(at::Tensor const&, int64_t, int64_t)>();
  return op.call(x, n_rep, dim);
}

at::Tensor call_repeat_kv_backward(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  static auto const op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flash_epilogue::repeat_kv_backward", "")
                             .typed<at::Tensor(at::Tensor const&, int64_t, int64_t, c10::IntArrayRef)>();
  return op.call(grad, n_rep, dim, layout);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// repeat_kv's backward is repeat_kv_backward into x's layout.
struct RepeatKvFunction : torch::autograd::Function<RepeatKvFunction> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor const& x, int64_t n_rep, int64_t dim) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      out = call_repeat_kv(x, n_rep, dim);  // checks x's rank before layout_of reads three strides
    }
    ctx->saved_data["n_rep"] = n_rep;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["layout"] = layout_of(x);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    int64_t const n_rep = ctx->saved_data["n_rep"].toInt(), dim = ctx->saved_data["dim"].toInt();
    std::vector<int64_t> const layout = ctx->saved_data["layout"].toIntVector();
    return {call_repeat_kv_backward(grads[0], n_rep, dim, layout), at::Tensor(), at::Tensor()};
  }
};

// The reduce is linear: its adjoint repeats each KV head's gradient n_rep times (double backward).
struct RepeatKvBackwardFunction : torch::autograd::Function<RepeatKvBackwardFunction> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor const& grad, int64_t n_rep, int64_t dim,
                            c10::IntArrayRef layout) {
    ctx->saved_data["n_rep"] = n_rep;
    ctx->saved_data["dim"] = dim;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_repeat_kv_backward(grad, n_rep, dim, layout);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {call_repeat_kv(grads[0], ctx->saved_data["n_rep"].toInt(), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// Without a gradient to record (a first-order backward runs with grad mode off, also no_grad
// forwards) the op runs without an autograd node, as generated autograd kernels do: no node to
// allocate and fill on the backward's path.
bool records_grad(at::Tensor const& t) { return at::GradMode::is_enabled() && t.requires_grad(); }

}  // namespace

void set_debug_sync(bool on) { debug_sync_on.store(on); }
bool debug_sync_enabled() { return debug_sync_on.load(); }

// x repeated n_rep times along dim as a new contiguous tensor (one copy, as an expand + reshape
// makes).
at::Tensor repeat_kv(at::Tensor const& x, int64_t n_rep, int64_t dim) {
  dim = check_repeat_kv(x, n_rep, dim);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end()), expanded = shape;
  shape[dim] *= n_rep;
  expanded.insert(expanded.begin() + dim + 1, n_rep);
  at::Tensor out = at::empty(shape, x.options());
  out.view(expanded).copy_(x.unsqueeze(dim + 1).expand(expanded));
  return out;
}

// The group sum of grad (heads in dim), allocated with its first three dims in memory in the order
// `layout` (outermost first; x's layout, see layout_of), dense, the last dim contiguous.
at::Tensor repeat_kv_backward(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  dim = check_repeat_kv_backward(grad, n_rep, dim, layout);
  std::array<int64_t, 4> shape = {grad.size(0), grad.size(1), grad.size(2), grad.size(3)};
  shape[dim] /= n_rep;
  // the strides at::empty gives the permuted shape (a size-0 dim counts as 1), permuted back
  std::array<int64_t, 4> const order = {layout[0], layout[1], layout[2], 3};
  std::array<int64_t, 4> strides;
  int64_t stride = 1;
  for (int i = 3; i >= 0; --i) {
    strides[order[i]] = stride;
    stride *= std::max<int64_t>(shape[order[i]], 1);
  }
  at::Tensor out = at::empty_strided(shape, strides, grad.options());
  reduce_groups(grad, n_rep, dim, out);
  return out;
}

at::Tensor repeat_kv_autograd(at::Tensor const& x, int64_t n_rep, int64_t dim) {
  if (!records_grad(x)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_repeat_kv(x, n_rep, dim);
  }
  return RepeatKvFunction::apply(x, n_rep, dim);
}

at::Tensor repeat_kv_backward_autograd(at::Tensor const& grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  if (!records_grad(grad)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_repeat_kv_backward(grad, n_rep, dim, layout);
  }
  return RepeatKvBackwardFunction::apply(grad, n_rep, dim, layout);
}

}  // namespace flash_epilogue
