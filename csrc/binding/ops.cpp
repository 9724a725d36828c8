// The ops and their registration: the arguments checked (checks.cpp), then one launch on the tensors' device and its
// current stream through the one (dtype, head dim, arch path) dispatch to the instantiations of csrc/instantiations/.

#include "binding.h"

#include <ATen/Context.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "static_switch.h"

namespace flash_epilogue {
namespace {

// (rows, d, heads, batch) view of a batched (batch, seqlen, heads, d) or varlen (total, heads, d) tensor. TMA needs
// a 16-byte multiple also as the stride of a size-1 dim (torch's is arbitrary): the tensor's largest extent.
TensorDesc describe(TensorArg t, bool varlen) {
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

AccumDesc accum_desc(TensorArg t, AccumLayout const& layout) {  // t: of the checked shape (floats per tile: size(3))
  return {t.data_ptr<float>(), t.stride(1), t.stride(0), static_cast<int>(layout.num_tiles),
          static_cast<int>(t.size(3))};
}

// Of a launch's arguments, those it has of: extents, heads, cu_seqlens/seqused, the outputs dk/dv (dv null: dK only).
template <class Args>
Args args_for(Problem const& p, OptArg cu_seqlens, OptArg seqused, at::Tensor const* dk = nullptr,
              at::Tensor const* dv = nullptr) {
  Args args;
  args.rows = p.rows;
  args.batch = p.batch;
  args.cu_seqlens = p.varlen ? cu_seqlens->const_data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->const_data_ptr<int>() : nullptr;
  auto const has_heads = [](auto& a) -> decltype((void)a.num_heads) {};  // C++17 member tests; else num_heads_kv
  auto const has_heads_q = [](auto& a) -> decltype((void)a.num_heads_q) {};
  auto const has_dk = [](auto& a) -> decltype((void)a.dk) {};
  if constexpr (std::is_invocable_v<decltype(has_heads), Args&>) { args.num_heads = p.heads; }
  if constexpr (!std::is_invocable_v<decltype(has_heads), Args&>) { args.num_heads_kv = p.heads; }
  if constexpr (std::is_invocable_v<decltype(has_heads_q), Args&>) { args.num_heads_q = p.heads_q; }
  if constexpr (std::is_invocable_v<decltype(has_dk), Args&>) {
    args.dk = describe(*dk, p.varlen);
    if (dv != nullptr) { args.dv = describe(*dv, p.varlen); }
  }
  return args;
}

// Once per host thread and device: a thread without a CUDA runtime call has no current context (c10's guard skips
// cudaSetDevice for a matching index), and encoding the TMA descriptors there crashes (docs/design.md).
void bind_primary_context(int device) {
  thread_local uint64_t bound = 0;  // bit d: device d bound
  uint64_t const bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (bound & bit) != 0) { return; }
  C10_CUDA_CHECK(cudaSetDevice(device));
  bound |= bit;
}

// The one dispatch: fn(kDType, kHeadDim, kArch), std::integral_constants of the outputs' dtype (ignored on the
// accumulator side), the compiled head dim and the code path, gives the launch. One the kernel refuses: RuntimeError.
template <class Args, class Fn>
void launch(char const* op, Problem const& p, at::ScalarType dtype, Args const& args, Fn fn) {
  c10::cuda::CUDAGuard const guard(p.device);
  bind_primary_context(p.device.index());
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(p.device.index()).stream();
  char const* const why = BOOL_SWITCH(dtype == at::kBFloat16, kBF16, [&] {
    return ARCH_SWITCH(p.arch, kArch, [&] {
      return HEADDIM_SWITCH(p.head_dim, kHeadDim, [&] {
        using DType = std::integral_constant<OutputDType, kBF16 ? OutputDType::kBFloat16 : OutputDType::kFloat16>;
        return fn(DType{}, std::integral_constant<int, kHeadDim>{}, std::integral_constant<int, kArch>{})(args, stream);
      });
    });
  });
  TORCH_CHECK(why == nullptr, "flash_epilogue.", op, ": arguments rejected by the kernel: ", why);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// CPU tensors get every metadata check, then the device check's message (the CPU tests run the checks).
void register_impls(torch::Library& m) {
  m.impl("store", &store);
  m.impl("store_zero", &store_zero);
  m.impl("gqa_accumulate", &gqa_accumulate);
  m.impl("gqa_postprocess", &gqa_postprocess);
  m.impl("gqa_accum_to_dense", &gqa_accum_to_dense);
  m.impl("gqa_reduce", &gqa_reduce);
}

TORCH_LIBRARY_IMPL(flash_epilogue, CUDA, m) { register_impls(m); }
TORCH_LIBRARY_IMPL(flash_epilogue, CPU, m) { register_impls(m); }

}  // namespace

void store(TensorArg dk_accum, TensorArg dv_accum, TensorArg dk, TensorArg dv, OptArg cu_seqlens, OptArg seqused,
           int64_t arch) {
  Problem const p = check_store(dk_accum, dv_accum, dk, dv, cu_seqlens, seqused, arch);
  if (dk.numel() == 0) { return; }  // batch 0, seqlen 0, heads 0: nothing to launch
  auto args = args_for<StoreLaunchArgs>(p, cu_seqlens, seqused, &dk, &dv);
  args.dk_accum = describe(dk_accum, p.varlen);
  args.dv_accum = describe(dv_accum, p.varlen);
  launch("store", p, dk.scalar_type(), args, [](auto t, auto d, auto a) { return &launch_store<t, d, a>; });
}

void store_zero(TensorArg dk, TensorArg dv, OptArg cu_seqlens, OptArg seqused, OptArg batch_idx, OptArg head_idx,
                int64_t row_start, std::optional<int64_t> row_end, int64_t arch) {
  Problem const p = check_store_zero(dk, dv, cu_seqlens, seqused, batch_idx, head_idx, row_start, row_end, arch);
  int64_t const end = std::min<int64_t>(row_end.value_or(p.rows), p.rows);
  auto const empty = [](OptArg t) { return t.has_value() && t->numel() == 0; };  // an empty selection
  if (dk.numel() == 0 || empty(batch_idx) || empty(head_idx) || row_start >= end) { return; }
  auto args = args_for<StoreZeroLaunchArgs>(p, cu_seqlens, seqused, &dk, &dv);
  args.batch_idx = batch_idx.has_value() ? batch_idx->const_data_ptr<int>() : nullptr;
  args.num_batch_idx = batch_idx.has_value() ? static_cast<int>(batch_idx->numel()) : 0;
  args.head_idx = head_idx.has_value() ? head_idx->const_data_ptr<int>() : nullptr;
  args.num_head_idx = head_idx.has_value() ? static_cast<int>(head_idx->numel()) : 0;
  args.row_begin = static_cast<int>(row_start);
  args.row_end = static_cast<int>(end);
  launch("store_zero", p, dk.scalar_type(), args, [](auto t, auto d, auto a) { return &launch_store_zero<t, d, a>; });
}

void gqa_accumulate(TensorArg dk_partial, TensorArg dv_partial, TensorArg dk_accum, TensorArg dv_accum,
                    OptArg semaphores, OptArg cu_seqlens, OptArg seqused, bool deterministic, int64_t arch) {
  Problem const p = check_gqa_accumulate(dk_partial, dv_partial, dk_accum, dv_accum, semaphores, cu_seqlens, seqused,
                                         deterministic, arch);
  // the atomic adds' order varies from run to run: under torch.use_deterministic_algorithms(True), torch's error
  // (with warn_only=True the Python wrapper warns: a C++ warning of a torch.ops call would only reach stderr)
  at::Context& ctx = at::globalContext();
  if (!deterministic && ctx.deterministicAlgorithms() && !ctx.deterministicAlgorithmsWarnOnly()) {
    ctx.alertNotDeterministic("flash_epilogue.gqa_accumulate(deterministic=False)");
  }
  if (dk_partial.numel() == 0 || dk_accum.numel() == 0) { return; }
  auto args = args_for<GqaAccumulateLaunchArgs>(p, cu_seqlens, seqused);
  args.dk_accum = accum_desc(dk_accum, p.accum);
  args.dv_accum = accum_desc(dv_accum, p.accum);
  args.dk_partial = describe(dk_partial, p.varlen);
  args.dv_partial = describe(dv_partial, p.varlen);
  args.semaphores = deterministic ? semaphores->data_ptr<int>() : nullptr;
  launch("gqa_accumulate", p, at::kFloat, args, [](auto, auto d, auto a) { return &launch_gqa_accumulate<d, a>; });
}

void gqa_postprocess(TensorArg dk_accum, TensorArg dv_accum, TensorArg dk, TensorArg dv, double scale_dk,
                     double scale_dv, OptArg cu_seqlens, OptArg seqused, int64_t arch) {
  Problem const p = check_gqa_postprocess(dk_accum, dv_accum, dk, dv, scale_dk, scale_dv, cu_seqlens, seqused, arch);
  if (dk.numel() == 0) { return; }
  auto args = args_for<GqaPostprocessLaunchArgs>(p, cu_seqlens, seqused, &dk, &dv);
  args.dk_accum = accum_desc(dk_accum, p.accum);
  args.dv_accum = accum_desc(dv_accum, p.accum);
  args.scale_dk = static_cast<float>(scale_dk);
  args.scale_dv = static_cast<float>(scale_dv);
  launch("gqa_postprocess", p, dk.scalar_type(), args,
         [](auto t, auto d, auto a) { return &launch_gqa_postprocess<t, d, a>; });
}

void gqa_accum_to_dense(TensorArg accum, TensorArg out, int64_t head_dim, OptArg cu_seqlens, OptArg seqused,
                        int64_t arch) {
  Problem const p = check_gqa_accum_to_dense(accum, out, head_dim, cu_seqlens, seqused, arch);
  if (out.numel() == 0) { return; }
  auto args = args_for<GqaDenseLaunchArgs>(p, cu_seqlens, seqused);
  args.accum = accum_desc(accum, p.accum);
  args.out = describe(out, p.varlen);
  launch("gqa_accum_to_dense", p, at::kFloat, args,
         [](auto, auto d, auto a) { return launch_gqa_accum_to_dense<d, a>; });
}

void gqa_reduce(TensorArg dk_partial, OptArg dv_partial, TensorArg dk, OptArg dv, OptArg cu_seqlens, OptArg seqused,
                double scale_dk, double scale_dv, int64_t arch) {
  Problem const p = check_gqa_reduce(dk_partial, dv_partial, dk, dv, cu_seqlens, seqused, scale_dk, scale_dv, arch);
  if (dk.numel() == 0) { return; }
  auto args = args_for<GqaReduceLaunchArgs>(p, cu_seqlens, seqused, &dk, dv.has_value() ? &*dv : nullptr);
  args.dk_partial = describe(dk_partial, p.varlen);
  if (dv_partial.has_value()) { args.dv_partial = describe(*dv_partial, p.varlen); }
  args.partial_fp32 = dk_partial.scalar_type() == at::kFloat;
  args.scale_dk = static_cast<float>(scale_dk);
  args.scale_dv = static_cast<float>(scale_dv);
  launch("gqa_reduce", p, dk.scalar_type(), args, [](auto t, auto d, auto a) { return &launch_gqa_reduce<t, d, a>; });
}

}  // namespace flash_epilogue
