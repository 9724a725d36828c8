// The mutating ops in torch's in-place machinery (issue 19): an ADInplaceOrView and an Autograd kernel per op with
// `Tensor(x!)` arguments, unboxed (no IValue stack per call) and with torch's rules, as its generated kernels of
// in-place ops apply them. torch::autograd::autogradNotImplementedFallback() and its ADInplaceOrView partner only
// bump the versions of written *returns* and check_inplace only (backward errors are deferred to a NotImplemented
// node): these schemas return nothing, so those fallbacks would miss every written tensor, and they are boxed.
//
// ADInplaceOrView: the kernel, then a version bump of every written tensor (a tensor saved for backward and then
// overwritten makes backward raise "modified by an inplace operation", as after torch's copy_). An inference tensor
// outside InferenceMode gets torch's own error from that bump, raised before the kernel so that nothing is written
// (torch's in-place ops write first, then raise).
// Autograd: the ops are steps of an attention backward and have no derivative. With grad mode on, a written tensor
// goes through torch's check_inplace ("a leaf Variable that requires grad is being used in an in-place
// operation.", views of leaves, views made in no_grad mode), then any tensor argument that requires grad raises a
// RuntimeError naming the op and the argument: the write would leave it without a correct grad_fn (torch's
// not-implemented convention would defer the error to backward; one eager error is clearer). A forward-mode tangent
// raises the same way whatever the grad mode. Grad mode off (inside a backward without create_graph, under
// torch.no_grad()): no checks beyond the tangents, straight to the next kernel.

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "binding.h"

namespace flash_epilogue {
namespace {

// Each tensor argument of a call (an optional one if given) as f(argument index, tensor), in schema order.
template <class F>
void visit(F& f, int i, at::Tensor const& t) {
  f(i, t);
}
template <class F>
void visit(F& f, int i, std::optional<at::Tensor> const& t) {
  if (t.has_value()) { f(i, *t); }
}
template <class F, class T>
void visit(F&, int, T const&) {}
template <class F, class... Args>
void for_each_tensor(F&& f, Args const&... args) {
  int i = 0;
  (visit(f, i++, args), ...);  // left to right
}

bool has_tangent(TensorArg t) {  // a forward-mode AD dual tensor (only a tensor with autograd meta can be one)
  return t.unsafeGetTensorImpl()->autograd_meta() != nullptr && t._fw_grad(/*level=*/0).defined();
}

// Spec: the op's name, its argument names (schema order), `written` (bit i: argument i is a Tensor(x!)) and
// `backward_of_repeat_kv` (bit i: argument i is a gradient whose derivative repeat_kv owns: gqa_reduce's partials).
template <class Spec, class Sig>
struct InplaceKernels;

template <class Spec, class... Args>
struct InplaceKernels<Spec, void(Args...)> {
  static bool writes(int i) { return (Spec::written >> i & 1u) != 0; }

  // Looked up once, and checked against the schema: the spec's names and Tensor(x!) positions are module.cpp's.
  static c10::TypedOperatorHandle<void(Args...)> const& op() {
    static auto const handle = [] {
      c10::OperatorHandle const h = c10::Dispatcher::singleton().findSchemaOrThrow(Spec::schema, "");
      std::vector<c10::Argument> const& schema_args = h.schema().arguments();
      TORCH_INTERNAL_ASSERT(schema_args.size() == Spec::args.size(), Spec::schema, ": the spec's argument count");
      for (size_t i = 0; i < schema_args.size(); ++i) {
        bool const written = schema_args[i].alias_info() != nullptr && schema_args[i].alias_info()->isWrite();
        TORCH_INTERNAL_ASSERT(schema_args[i].name() == Spec::args[i] && written == writes(static_cast<int>(i)),
                              Spec::schema, ": the spec disagrees with the schema at argument ", i);
      }
      return h.template typed<void(Args...)>();
    }();
    return handle;
  }

  static void inplace_or_view(c10::DispatchKeySet ks, Args... args) {
    if (!c10::InferenceMode::is_enabled()) {
      for_each_tensor([](int i, TensorArg t) {
        if (writes(i) && t.is_inference()) { torch::autograd::increment_version(t); }  // raises torch's error
      }, args...);
    }
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op().redispatch(ks & c10::after_ADInplaceOrView_keyset, args...);
    }
    for_each_tensor([](int i, TensorArg t) {
      if (writes(i)) { torch::autograd::increment_version(t); }
    }, args...);
  }

  static void autograd(c10::DispatchKeySet ks, Args... args) {
    bool const grad_mode = at::GradMode::is_enabled();
    if (grad_mode) {  // torch's in-place rules first (its messages), as its generated kernels check
      for_each_tensor([](int i, TensorArg t) {
        if (writes(i) && t.requires_grad()) { torch::autograd::check_inplace(t, /*requires_grad=*/true); }
      }, args...);
    }
    for_each_tensor([grad_mode](int i, TensorArg t) {
      bool const requires_grad = grad_mode && t.requires_grad();
      if (!requires_grad && !has_tangent(t)) { return; }
      char const* const what = requires_grad ? "requires grad" : "has a forward-mode tangent";
      TORCH_CHECK((Spec::backward_of_repeat_kv >> i & 1u) == 0, "flash_epilogue.", Spec::name, ": ", Spec::args[i],
                  ": ", what, ", but ", Spec::name,
                  " has no derivative: it is itself the backward of repeat_kv "
                  "(the group sum of the expanded heads' gradient). To differentiate through a KV-head expand use "
                  "flash_epilogue.repeat_kv, whose backward runs this reduce (double backward included); else call "
                  "it under torch.no_grad() or on detached partials");
      TORCH_CHECK(false, "flash_epilogue.", Spec::name, ": ", Spec::args[i], ": ", what, ", but ", Spec::name,
                  " has no derivative (a step of an attention backward): call it with grad mode off (inside a "
                  "backward without create_graph, or under torch.no_grad()) or on detached tensors");
    }, args...);
    at::AutoDispatchBelowAutograd guard;
    op().redispatch(ks & c10::after_autograd_keyset, args...);
  }
};

// The specs, from module.cpp's schemas (argument order, Tensor(x!) positions) and the kernels' C++ signatures.
using OptInt = std::optional<int64_t>;

struct Store {
  static constexpr char const* schema = "flash_epilogue::store";
  static constexpr char const* name = "store";
  static constexpr std::array<char const*, 7> args = {"dk_accum",   "dv_accum", "dk",   "dv",
                                                      "cu_seqlens", "seqused",  "_arch"};
  static constexpr uint32_t written = 0b1100, backward_of_repeat_kv = 0;
  using Sig = void(TensorArg, TensorArg, TensorArg, TensorArg, OptArg, OptArg, int64_t);
};
struct StoreZero {
  static constexpr char const* schema = "flash_epilogue::store_zero";
  static constexpr char const* name = "store_zero";
  static constexpr std::array<char const*, 9> args = {"dk",       "dv",        "cu_seqlens", "seqused", "batch_idx",
                                                      "head_idx", "row_start", "row_end",    "_arch"};
  static constexpr uint32_t written = 0b11, backward_of_repeat_kv = 0;
  using Sig = void(TensorArg, TensorArg, OptArg, OptArg, OptArg, OptArg, int64_t, OptInt, int64_t);
};
struct GqaAccumulate {
  static constexpr char const* schema = "flash_epilogue::gqa_accumulate";
  static constexpr char const* name = "gqa_accumulate";
  static constexpr std::array<char const*, 9> args = {"dk_partial", "dv_partial",    "dk_accum",
                                                      "dv_accum",   "semaphores",    "cu_seqlens",
                                                      "seqused",    "deterministic", "_arch"};
  static constexpr uint32_t written = 0b11100, backward_of_repeat_kv = 0;
  using Sig = void(TensorArg, TensorArg, TensorArg, TensorArg, OptArg, OptArg, OptArg, bool, int64_t);
};
struct GqaPostprocess {
  static constexpr char const* schema = "flash_epilogue::gqa_postprocess";
  static constexpr char const* name = "gqa_postprocess";
  static constexpr std::array<char const*, 9> args = {"dk_accum", "dv_accum",   "dk",      "dv",   "scale_dk",
                                                      "scale_dv", "cu_seqlens", "seqused", "_arch"};
  static constexpr uint32_t written = 0b1100, backward_of_repeat_kv = 0;
  using Sig = void(TensorArg, TensorArg, TensorArg, TensorArg, double, double, OptArg, OptArg, int64_t);
};
struct GqaAccumToDense {
  static constexpr char const* schema = "flash_epilogue::gqa_accum_to_dense";
  static constexpr char const* name = "gqa_accum_to_dense";
  static constexpr std::array<char const*, 6> args = {"accum", "out", "head_dim", "cu_seqlens", "seqused", "_arch"};
  static constexpr uint32_t written = 0b10, backward_of_repeat_kv = 0;
  using Sig = void(TensorArg, TensorArg, int64_t, OptArg, OptArg, int64_t);
};
struct GqaReduce {
  static constexpr char const* schema = "flash_epilogue::gqa_reduce";
  static constexpr char const* name = "gqa_reduce";
  static constexpr std::array<char const*, 9> args = {"dk_partial", "dv_partial", "dk",       "dv",   "cu_seqlens",
                                                      "seqused",    "scale_dk",   "scale_dv", "_arch"};
  static constexpr uint32_t written = 0b1100, backward_of_repeat_kv = 0b11;
  using Sig = void(TensorArg, OptArg, TensorArg, OptArg, OptArg, OptArg, double, double, int64_t);
};

template <class Spec>
using KernelsOf = InplaceKernels<Spec, typename Spec::Sig>;

template <class... Specs>
void register_inplace_or_view(torch::Library& m) {
  (m.impl(Specs::name, TORCH_FN(KernelsOf<Specs>::inplace_or_view)), ...);
}
template <class... Specs>
void register_autograd(torch::Library& m) {
  (m.impl(Specs::name, TORCH_FN(KernelsOf<Specs>::autograd)), ...);
}

TORCH_LIBRARY_IMPL(flash_epilogue, ADInplaceOrView, m) {
  register_inplace_or_view<Store, StoreZero, GqaAccumulate, GqaPostprocess, GqaAccumToDense, GqaReduce>(m);
}
TORCH_LIBRARY_IMPL(flash_epilogue, Autograd, m) {
  register_autograd<Store, StoreZero, GqaAccumulate, GqaPostprocess, GqaAccumToDense, GqaReduce>(m);
}

}  // namespace
}  // namespace flash_epilogue
