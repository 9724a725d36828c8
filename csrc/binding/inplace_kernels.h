#pragma once

// The mutating ops' place in torch's in-place machinery, as registration.cpp registers it: an ADInplaceOrView and
// an Autograd kernel per op, unboxed (no IValue stack per call) and with the rules torch's generated kernels of
// in-place ops apply. torch's autogradNotImplementedFallback() and its ADInplaceOrView partner
// bump the versions of written *returns* only: these schemas return nothing, so those (boxed) fallbacks would miss
// every written tensor.
//
// ADInplaceOrView: the kernel, then a version bump of every written tensor (a tensor saved for backward and then
// overwritten makes backward raise "modified by an inplace operation"). An inference tensor outside InferenceMode
// gets torch's own error from that bump, raised before the kernel so that nothing is written.
// Autograd: the ops are steps of an attention backward and have no derivative. With grad mode on, a written tensor
// goes through torch's check_inplace (leaves and views that require grad), then any tensor argument that requires
// grad raises a RuntimeError naming the op and the argument (one eager error, where torch's not-implemented
// convention would defer it to backward). A forward-mode tangent raises the same way whatever the grad mode; grad
// mode off (inside a backward without create_graph, under torch.no_grad()) checks nothing else.

#include <cstdint>
#include <optional>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

namespace flash_epilogue {

// Each tensor argument of a call (an optional one if given) as f(argument index, tensor), in schema order.
template <class F, class T>
void visit_arg(F& f, int i, T const& a) {
  if constexpr (std::is_same_v<T, at::Tensor>) { f(i, a); }
  if constexpr (std::is_same_v<T, std::optional<at::Tensor>>) {
    if (a.has_value()) { f(i, *a); }
  }
}
template <class F, class... Args>
void for_each_tensor(F&& f, Args const&... args) {
  int i = 0;
  (visit_arg(f, i++, args), ...);  // left to right
}

// Whether t is a forward-mode AD dual tensor (only a tensor with autograd meta can be one).
inline bool has_tangent(at::Tensor const& t) {
  return t.unsafeGetTensorImpl()->autograd_meta() != nullptr && t._fw_grad(/*level=*/0).defined();
}

// The kernels of one op: kSchema its registered name, kFn its implementation, and kBackwardOfRepeatKv
// (bit i: argument i is a gradient whose derivative repeat_kv owns: gqa_reduce's partials). Argument names and
// Tensor(x!) positions come from the registered schema (registration.cpp); typing the handle checks kFn's signature against
// it.
template <char const* kSchema, auto kFn, uint32_t kBackwardOfRepeatKv = 0>
struct InplaceKernels;

template <char const* kSchema, uint32_t kBackwardOfRepeatKv, class... Args, void (*kFn)(Args...)>
struct InplaceKernels<kSchema, kFn, kBackwardOfRepeatKv> {
  static c10::TypedOperatorHandle<void(Args...)> const& op() {
    static auto const h = c10::Dispatcher::singleton().findSchemaOrThrow(kSchema, "").template typed<void(Args...)>();
    return h;
  }
  static bool writes(int i) {  // argument i is a Tensor(x!)
    c10::AliasInfo const* const alias = op().schema().arguments()[i].alias_info();
    return alias != nullptr && alias->isWrite();
  }
  static char const* name() { return kSchema + sizeof("flash_epilogue::") - 1; }  // the op's own name
  static constexpr auto implementation = kFn;

  static void inplace_or_view(c10::DispatchKeySet ks, Args... args) {
    if (!c10::InferenceMode::is_enabled()) {
      for_each_tensor([](int i, at::Tensor const& t) {
        if (writes(i) && t.is_inference()) { torch::autograd::increment_version(t); }  // raises torch's error
      }, args...);
    }
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op().redispatch(ks & c10::after_ADInplaceOrView_keyset, args...);
    }
    for_each_tensor([](int i, at::Tensor const& t) {
      if (writes(i)) { torch::autograd::increment_version(t); }
    }, args...);
  }

  static void autograd(c10::DispatchKeySet ks, Args... args) {
    bool const grad_mode = at::GradMode::is_enabled();
    if (grad_mode) {  // torch's in-place rules first (its messages), as its generated kernels check
      for_each_tensor([](int i, at::Tensor const& t) {
        if (writes(i) && t.requires_grad()) { torch::autograd::check_inplace(t, /*requires_grad=*/true); }
      }, args...);
    }
    for_each_tensor([grad_mode](int i, at::Tensor const& t) {
      bool const requires_grad = grad_mode && t.requires_grad();
      if (!requires_grad && !has_tangent(t)) { return; }
      TORCH_CHECK(false, "flash_epilogue.", name(), ": ", op().schema().arguments()[i].name(), ": ",
                  requires_grad ? "requires grad" : "has a forward-mode tangent", ", but ", name(),
                  (kBackwardOfRepeatKv >> i & 1u) != 0
                      ? " has no derivative: it is itself the backward of repeat_kv (the group sum of the expanded "
                        "heads' gradient). To differentiate through a KV-head expand use flash_epilogue.repeat_kv, "
                        "whose backward runs this reduce (double backward included); else call it under "
                        "torch.no_grad() or on detached partials"
                      : " has no derivative (a step of an attention backward): call it with grad mode off (inside a "
                        "backward without create_graph, or under torch.no_grad()) or on detached tensors");
    }, args...);
    at::AutoDispatchBelowAutograd guard;
    op().redispatch(ks & c10::after_autograd_keyset, args...);
  }
};

// The kernels of a list of ops, by key.
template <class... Kernels>
struct Register {
  static void implementation(torch::Library& m) { (m.impl(Kernels::name(), TORCH_FN(Kernels::implementation)), ...); }
  static void inplace_or_view(torch::Library& m) { (m.impl(Kernels::name(), TORCH_FN(Kernels::inplace_or_view)), ...); }
  static void autograd(torch::Library& m) { (m.impl(Kernels::name(), TORCH_FN(Kernels::autograd)), ...); }
};

}  // namespace flash_epilogue
