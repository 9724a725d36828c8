// repeat_kv: the KV-head expand, its group-sum backward (gqa_reduce where the kernels take the gradient), their
// autograd, in C++ so that a backward through it runs no Python (docs/design.md: host time). The package keeps the
// public wrapper and the fake kernels.

#include "repeat_kv.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/strides.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "checks.h"
#include "device.h"
#include "format.h"
#include "ops.h"
#include "plan.h"

namespace flash_epilogue {

namespace {

std::atomic<bool> debug_sync_on{false};

// repeat_kv's (x = t), with a layout repeat_kv_backward's (grad = t); returns dim as 1 or 2.
int64_t check_repeat_kv(TensorArg t, int64_t n_rep, int64_t dim, std::optional<c10::IntArrayRef> layout = {}) {
  Checker const c(layout ? "repeat_kv_backward" : "repeat_kv");
  char const* const heads = layout ? "heads" : "kv_heads";
  if (t.dim() != 4) {
    c.fail(layout ? "grad: rank" : "x: rank",
           std::string("4 dims: (batch, ") + heads + ", seqlen, head_dim) for dim=1, (batch, seqlen, " + heads +
               ", head_dim) for dim=2",
           rank_got(t));
  }
  if (n_rep < 1) { c.fail("n_rep", "a positive int", num(n_rep)); }
  if (dim != 1 && dim != 2 && dim != -3 && dim != -2) {
    c.fail("dim", "1 (or -3) or 2 (or -2): the KV-head dim of a 4-D tensor", num(dim));
  }
  dim = dim < 0 ? dim + 4 : dim;
  if (!layout && t.size(dim) > std::numeric_limits<int64_t>::max() / n_rep) {
    c.fail("n_rep", "a positive int with x.shape[dim] * n_rep < 2^63", num(n_rep));
  }
  if (layout && t.size(dim) % n_rep != 0) {
    c.fail("grad: heads", "a multiple of n_rep = " + num(n_rep) + " in dim " + num(dim),
           num(t.size(dim)) + " (shape " + num(t.sizes()) + ")");
  }
  std::array<int64_t, 3> const dims = {0, 1, 2};
  if (layout && (layout->size() != 3 || !std::is_permutation(layout->begin(), layout->end(), dims.begin()))) {
    c.fail("layout", "a permutation of [0, 1, 2]", seq(*layout, -1, true));
  }
  return dim;
}

// For repeat_kv's backward: whether gqa_reduce takes `partial` (batch, seqlen, heads, d) as dk_partial (dtype, head
// dim, grid limits, a GPU with kernels, not empty) and whether it reads it in place (strides, alignment).
bool gqa_reduce_takes(TensorArg partial) {
  at::ScalarType const dtype = partial.scalar_type();
  if (!partial.is_cuda() || (dtype != at::kBFloat16 && dtype != at::kHalf)) { return false; }
  return head_dim_supported(partial.size(3)) && head_dim_built(partial.size(3)) && partial.numel() > 0 &&
         within_grid_limits(partial.size(1), partial.size(2), partial.size(0)) &&
         has_kernels(device_capability(partial.get_device()));
}

bool gqa_reduce_reads_in_place(TensorArg partial) {
  int64_t const multiple = 16 / partial.element_size();
  if (partial.size(3) > 1 && partial.stride(3) != 1) { return false; }
  for (int64_t i = 0; i < 3; ++i) {
    if (partial.size(i) > 1 && (partial.stride(i) < 0 || partial.stride(i) % multiple != 0)) { return false; }
  }
  return address(partial) % 16 == 0;
}

at::Tensor kernel_view(TensorArg t, int64_t dim) { return dim == 1 ? t.transpose(1, 2) : t; }  // (b, s, h, d)

// flash_epilogue.reference.group_sum_reference into `out`, the same ATen calls in the same order (the same bits):
// per KV head 0 + g_0 + ... + g_{n-1} in fp32 (or the gradient's wider dtype), then one rounding to out's dtype.
at::Tensor group_sum_reference(TensorArg grad, int64_t n_rep, int64_t dim, TensorArg out) {
  if (out.numel() == 0) { return out; }  // nothing to sum (and no n_rep-long loop over empty heads)
  at::ScalarType const acc_dtype = c10::promoteTypes(grad.scalar_type(), at::kFloat);
  at::Tensor acc = out.scalar_type() == acc_dtype ? out : at::empty(out.sizes(), grad.options().dtype(acc_dtype));
  acc.zero_();
  at::Tensor const grouped = grad.unflatten(dim, {out.size(dim), n_rep});
  for (int64_t j = 0; j < n_rep; ++j) { acc.add_(grouped.select(dim + 1, j)); }  // exact upcast, then an fp32 add
  if (!acc.is_same(out)) { out.copy_(acc); }                                     // round to nearest even, once
  return out;
}

// The order of x's first three dims in memory, outermost first (ties keep the logical order); symbolic strides
// (torch.compile, dynamic shapes) compare through guards.
std::array<int64_t, 3> layout_of(TensorArg x) {
  c10::SymIntArrayRef const strides = x.sym_strides();
  std::array<int64_t, 3> order = {0, 1, 2};
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  return order;
}

// The op through the dispatcher (traced by torch.compile, differentiated again under create_graph): repeat_kv, or
// with a layout repeat_kv_backward.
at::Tensor call(TensorArg t, int64_t n_rep, int64_t dim, std::optional<c10::IntArrayRef> layout) {
  auto const schema = [](char const* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); };
  static auto const forward = schema("flash_epilogue::repeat_kv").typed<at::Tensor(TensorArg, int64_t, int64_t)>();
  static auto const backward = schema("flash_epilogue::repeat_kv_backward")
                                   .typed<at::Tensor(TensorArg, int64_t, int64_t, c10::IntArrayRef)>();
  return layout ? backward.call(t, n_rep, dim, *layout) : forward.call(t, n_rep, dim);
}

// The autograd of both ops as torch's generated kernels have it: a graph node of our own (torch.func's grad and vjp
// take those, where they refuse a C++ torch::autograd::Function) and the forward-mode tangent set on the output
// (torch.autograd.forward_ad, torch.func.jvp). Each op is linear and the other's adjoint, so each derivative is a call
// of the other op (or of the op itself, for the tangent), through the dispatcher: differentiable again.
using torch::autograd::Node;
using torch::autograd::variable_list;

// A new node in torch's node handle: std::shared_ptr<Node> with its iterative deleter in older torch, intrusive_ptr in
// newer (deleteNode, found by argument-dependent lookup, exists only in the former).
template <class T>
auto new_node() {
  if constexpr (std::is_same_v<decltype(torch::autograd::Edge::function), std::shared_ptr<Node>>) {
    return std::shared_ptr<T>(new T(), [](T* n) { deleteNode(n); });
  } else {
    return c10::make_intrusive<T>();
  }
}

// The node of repeat_kv (layout: x's, its gradient's) or of repeat_kv_backward (no layout): the other op.
struct RepeatKvNode : Node {
  int64_t n_rep = 0, dim = 0;
  std::optional<std::array<int64_t, 3>> layout;
  std::string name() const override { return layout ? "RepeatKvBackward" : "RepeatKvBackwardBackward"; }
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined() || !should_compute_output(0)) { return {at::Tensor()}; }
    return {call(grads[0], n_rep, dim, layout ? std::optional<c10::IntArrayRef>(*layout) : std::nullopt)};
  }
};

}  // namespace

// One copy, as an expand + reshape makes.
at::Tensor repeat_kv(TensorArg x, int64_t n_rep, int64_t dim) {
  dim = check_repeat_kv(x, n_rep, dim);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end()), expanded = shape;
  shape[dim] *= n_rep;
  expanded.insert(expanded.begin() + dim + 1, n_rep);
  at::Tensor out = at::empty(shape, x.options());
  out.view(expanded).copy_(x.unsqueeze(dim + 1).expand(expanded));
  return out;
}

// The group sum of grad (heads in dim) into a tensor dense in the order `layout` (x's, outermost first; the last dim
// contiguous), the same bits either way: gqa_reduce where the kernels take grad (from a contiguous copy where they
// cannot read it in place: a .sum()'s stride 0, a misaligned start), else the reference.
at::Tensor repeat_kv_backward(TensorArg grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  dim = check_repeat_kv(grad, n_rep, dim, layout);
  std::array<int64_t, 4> shape = {grad.size(0), grad.size(1), grad.size(2), grad.size(3)};
  shape[dim] /= n_rep;
  // the strides at::empty gives the permuted shape (a size-0 dim counts as 1), permuted back
  std::array<int64_t, 4> const order = {layout[0], layout[1], layout[2], 3};
  c10::DimVector const dense = c10::contiguous_strides({shape[order[0]], shape[order[1]], shape[order[2]], shape[3]});
  std::array<int64_t, 4> strides;
  for (int i = 0; i < 4; ++i) { strides[order[i]] = dense[i]; }
  at::Tensor out = at::empty_strided(shape, strides, grad.options());
  at::Tensor partial = kernel_view(grad, dim);
  if (!gqa_reduce_takes(partial)) { return group_sum_reference(grad, n_rep, dim, out); }
  if (!gqa_reduce_reads_in_place(partial)) { partial = kernel_view(grad.clone(at::MemoryFormat::Contiguous), dim); }
  // the implementation itself (no dispatcher, no Python wrapper), its checks included
  gqa_reduce(partial, std::nullopt, kernel_view(out, dim), std::nullopt, std::nullopt, std::nullopt, 1.0, 1.0, 0);
  // FLASH_EPILOGUE_DEBUG: the backward (off the Python wrappers) waits for its kernel, except under graph capture
  if (debug_sync_on.load(std::memory_order_relaxed) &&
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    cudaError_t const err = cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream(partial.get_device()).stream());
    TORCH_CHECK(err == cudaSuccess, "flash_epilogue.repeat_kv_backward: the kernel failed on ", partial.device(), ": ",
                cudaGetErrorString(err));
  }
  return out;
}

namespace {

// The Autograd kernels (layout given: repeat_kv_backward's): the op below autograd, then the output's grad_fn where
// the input's gradient is recorded (grad mode on and it requires grad), then its tangent where the input has one
// (whatever the grad mode).
at::Tensor differentiable(TensorArg t, int64_t n_rep, int64_t dim, std::optional<c10::IntArrayRef> layout) {
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = call(t, n_rep, dim, layout);  // checks t's rank before layout_of reads three strides
  }
  if (torch::autograd::compute_requires_grad(t)) {
    auto node = new_node<RepeatKvNode>();
    node->n_rep = n_rep;
    node->dim = dim;
    if (!layout) { node->layout = layout_of(t); }
    node->set_next_edges(torch::autograd::collect_next_edges(t));
    torch::autograd::set_history(out, node);
  }
  if (torch::autograd::isFwGradDefined(t)) {
    out._set_fw_grad(call(t._fw_grad(/*level=*/0), n_rep, dim, layout), /*level=*/0, /*is_inplace_op=*/false);
  }
  return out;
}

}  // namespace

at::Tensor repeat_kv_autograd(TensorArg x, int64_t n_rep, int64_t dim) { return differentiable(x, n_rep, dim, {}); }

at::Tensor repeat_kv_backward_autograd(TensorArg grad, int64_t n_rep, int64_t dim, c10::IntArrayRef layout) {
  return differentiable(grad, n_rep, dim, layout);
}

void set_debug_sync(bool on) { debug_sync_on.store(on); }

bool debug_sync_enabled() { return debug_sync_on.load(); }

}  // namespace flash_epilogue
