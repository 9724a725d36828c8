// The op schemas (their one definition is flash_epilogue/schema.inc) and the kernels registered for them, by
// dispatch key.

#include <torch/library.h>

#include "inplace_kernels.h"
#include "ops.h"
#include "repeat_kv.h"

TORCH_LIBRARY(flash_epilogue, m) {
  for (char const* schema : {
#include "../../flash_epilogue/schema.inc"
       }) {
    m.def(schema);
  }
}

namespace {

using namespace flash_epilogue;

constexpr char kStore[] = "flash_epilogue::store";
constexpr char kStoreZero[] = "flash_epilogue::store_zero";
constexpr char kGqaAccumulate[] = "flash_epilogue::gqa_accumulate";
constexpr char kGqaPostprocess[] = "flash_epilogue::gqa_postprocess";
constexpr char kGqaAccumToDense[] = "flash_epilogue::gqa_accum_to_dense";
constexpr char kGqaReduce[] = "flash_epilogue::gqa_reduce";

// Every op with Tensor(x!) arguments.
using MutatingOps = Register<InplaceKernels<kStore, &store>, InplaceKernels<kStoreZero, &store_zero>,
                             InplaceKernels<kGqaAccumulate, &gqa_accumulate>,
                             InplaceKernels<kGqaPostprocess, &gqa_postprocess>,
                             InplaceKernels<kGqaAccumToDense, &gqa_accum_to_dense>,
                             InplaceKernels<kGqaReduce, &gqa_reduce, /*dk_partial, dv_partial*/ 0b11>>;

}  // namespace

// CPU tensors get every metadata check, then the device check's message (the CPU tests run the checks). repeat_kv:
// one kernel for every backend (the Python fake kernels serve Meta and FakeTensor), autograd in C++.
TORCH_LIBRARY_IMPL(flash_epilogue, CUDA, m) { MutatingOps::implementation(m); }
TORCH_LIBRARY_IMPL(flash_epilogue, CPU, m) { MutatingOps::implementation(m); }
TORCH_LIBRARY_IMPL(flash_epilogue, ADInplaceOrView, m) { MutatingOps::inplace_or_view(m); }
TORCH_LIBRARY_IMPL(flash_epilogue, CompositeExplicitAutograd, m) {
  m.impl("repeat_kv", &repeat_kv);
  m.impl("repeat_kv_backward", &repeat_kv_backward);
}
TORCH_LIBRARY_IMPL(flash_epilogue, Autograd, m) {
  MutatingOps::autograd(m);
  m.impl("repeat_kv", &repeat_kv_autograd);
  m.impl("repeat_kv_backward", &repeat_kv_backward_autograd);
}
