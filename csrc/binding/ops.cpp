// The op implementations: the arguments checked (checks.cpp), then one launch on the tensors'
// device and its current stream, through the one (dtype, head dim, arch path) dispatch to the
// instantiations of csrc/instantiations/.

#include "ops.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <type_traits>

#include "static_switch.h"

namespace flash_epilogue {
namespace {

// (rows, d, heads, batch) view of a batched (batch, seqlen, heads, d) or varlen (total, heads, d)
// tensor. A size-1 dim's stride is meaningless to torch but not to TMA (it must be a 16-byte
// multiple): give it the tensor's largest extent, which always is one.
TensorDesc describe(at::Tensor const& t, bool varlen) {
  TensorDesc desc;
  desc.ptr = t.data_ptr();
  desc.head_dim = static_cast<int>(t.size(-1));
  int const row_dim = varlen ? 0 : 1, head_dim = varlen ? 1 : 2;
  int64_t span = t.size(-1);
  for (int i = 0; i + 1 < t.dim(); ++i) {
    if (t.size(i) > 1) { span = std::max(span, t.stride(i) * t.size(i)); }
  }
  int const elems_per_16b = 16 / static_cast<int>(t.element_size());
  span = (span + elems_per_16b - 1) / elems_per_16b * elems_per_16b;
  auto stride_of = [&](int dim) { return t.size(dim) > 1 ? t.stride(dim) : span; };
  desc.row_stride = stride_of(row_dim);
  desc.head_stride = stride_of(head_dim);
  desc.batch_stride = varlen ? span : stride_of(0);
  return desc;
}

AccumDesc accum_desc(at::Tensor const& t, AccumLayout const& layout) {
  return {t.data_ptr<float>(), t.stride(1), t.stride(0), static_cast<int>(layout.num_tiles)};
}

// The fields every launch has: extents and the device pointers of cu_seqlens/seqused.
template <class Args>
Args args_for(Problem const& p, OptTensor const& cu_seqlens, OptTensor const& seqused) {
  Args args;
  args.rows = p.rows;
  args.batch = p.batch;
  args.cu_seqlens = p.varlen ? cu_seqlens->const_data_ptr<int>() : nullptr;
  args.seqused = seqused.has_value() ? seqused->const_data_ptr<int>() : nullptr;
  return args;
}

// ... and the outputs dk/dv (dv null: dK only), for every launch but the accumulator side's.
template <class Args>
Args args_for(Problem const& p, OptTensor const& cu_seqlens, OptTensor const& seqused, at::Tensor const& dk,
              at::Tensor const* dv) {
  Args args = args_for<Args>(p, cu_seqlens, seqused);
  args.dk = describe(dk, p.varlen);
  if (dv != nullptr) { args.dv = describe(*dv, p.varlen); }
  return args;
}

// The device, stream and CUDA context a launch runs with. Ops may be called from any host thread
// (the autograd engine's device threads, a user's Python threads). A thread that has made no CUDA
// runtime call has no current context, and c10's guard skips cudaSetDevice when the device index
// already matches (device 0 reads as current there), so the driver call that encodes the TMA
// descriptors (cuTensorMapEncodeTiled, made before the first runtime launch could bind a context)
// fails in such a thread, and CUTLASS's error path crashes the process (benchmarks/NOTES.md).
// cudaSetDevice binds the device's primary context: once per thread and device.
void bind_primary_context(int device) {
  thread_local uint64_t bound = 0;  // bit d: this thread has bound device d's primary context
  uint64_t const bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (bound & bit) != 0) { return; }
  C10_CUDA_CHECK(cudaSetDevice(device));
  bound |= bit;
}

struct LaunchScope {
  c10::cuda::CUDAGuard guard;
  cudaStream_t stream;
  explicit LaunchScope(at::Device device) : guard(device) {
    bind_primary_context(device.index());
    stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  }
};

// The one dispatch: fn(kDType, kHeadDim, kArch, stream), the first three std::integral_constants,
// for the outputs' dtype (the accumulator-side launches ignore it), the problem's compiled head dim
// and its code path. A launch the kernel refuses raises RuntimeError.
template <class Fn>
void launch(char const* op, Problem const& p, at::ScalarType dtype, Fn fn) {
  LaunchScope const scope(p.device);
  char const* const why = BOOL_SWITCH(dtype == at::kBFloat16, kBF16, [&] {
    return ARCH_SWITCH(p.arch, kArch, [&] {
      return HEADDIM_SWITCH(p.head_dim, kHeadDim, [&] {
        using DType = std::integral_constant<OutputDType, kBF16 ? OutputDType::kBFloat16 : OutputDType::kFloat16>;
        return fn(DType{}, std::integral_constant<int, kHeadDim>{}, std::integral_constant<int, kArch>{}, scope.stream);
      });
    });
  });
  TORCH_CHECK(why == nullptr, "flash_epilogue.", op, ": arguments rejected by the kernel: ", why);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void store(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk, at::Tensor const& dv,
           OptTensor const& cu_seqlens, OptTensor const& seqused, int64_t arch) {
  Problem const p = check_store(dk_accum, dv_accum, dk, dv, cu_seqlens, seqused, arch);
  if (dk.numel() == 0) { return; }  // batch 0, seqlen 0, heads 0: nothing to launch
  auto args = args_for<StoreLaunchArgs>(p, cu_seqlens, seqused, dk, &dv);
  args.dk_accum = describe(dk_accum, p.varlen);
  args.dv_accum = describe(dv_accum, p.varlen);
  args.num_heads = p.heads;
  launch("store", p, dk.scalar_type(),
         [&](auto t, auto hd, auto a, cudaStream_t s) { return launch_store<t, hd, a>(args, s); });
}

void store_zero(at::Tensor const& dk, at::Tensor const& dv, OptTensor const& cu_seqlens, OptTensor const& seqused,
                OptTensor const& batch_idx, OptTensor const& head_idx, int64_t row_start,
                std::optional<int64_t> row_end, int64_t arch) {
  Problem const p = check_store_zero(dk, dv, cu_seqlens, seqused, batch_idx, head_idx, row_start, row_end, arch);
  int64_t const end = std::min<int64_t>(row_end.value_or(p.rows), p.rows);
  bool const empty_selection =
      (batch_idx.has_value() && batch_idx->numel() == 0) || (head_idx.has_value() && head_idx->numel() == 0);
  if (dk.numel() == 0 || empty_selection || row_start >= end) { return; }
  auto args = args_for<StoreZeroLaunchArgs>(p, cu_seqlens, seqused, dk, &dv);
  args.num_heads = p.heads;
  args.batch_idx = batch_idx.has_value() ? batch_idx->const_data_ptr<int>() : nullptr;
  args.num_batch_idx = batch_idx.has_value() ? static_cast<int>(batch_idx->numel()) : 0;
  args.head_idx = head_idx.has_value() ? head_idx->const_data_ptr<int>() : nullptr;
  args.num_head_idx = head_idx.has_value() ? static_cast<int>(head_idx->numel()) : 0;
  args.row_begin = static_cast<int>(row_start);
  args.row_end = static_cast<int>(end);
  launch("store_zero", p, dk.scalar_type(),
         [&](auto t, auto hd, auto a, cudaStream_t s) { return launch_store_zero<t, hd, a>(args, s); });
}

void gqa_accumulate(at::Tensor const& dk_partial, at::Tensor const& dv_partial, at::Tensor const& dk_accum,
                    at::Tensor const& dv_accum, OptTensor const& semaphores, OptTensor const& cu_seqlens,
                    OptTensor const& seqused, bool deterministic, int64_t arch) {
  Problem const p = check_gqa_accumulate(dk_partial, dv_partial, dk_accum, dv_accum, semaphores, cu_seqlens, seqused,
                                         deterministic, arch);
  if (dk_partial.numel() == 0 || dk_accum.numel() == 0) { return; }
  auto args = args_for<GqaAccumulateLaunchArgs>(p, cu_seqlens, seqused);
  args.dk_accum = accum_desc(dk_accum, p.accum);
  args.dv_accum = accum_desc(dv_accum, p.accum);
  args.dk_partial = describe(dk_partial, p.varlen);
  args.dv_partial = describe(dv_partial, p.varlen);
  args.num_heads_q = p.heads_q;
  args.num_heads_kv = p.heads;
  args.semaphores = deterministic ? semaphores->data_ptr<int>() : nullptr;
  launch("gqa_accumulate", p, at::kFloat,
         [&](auto, auto hd, auto a, cudaStream_t s) { return launch_gqa_accumulate<hd, a>(args, s); });
}

void gqa_postprocess(at::Tensor const& dk_accum, at::Tensor const& dv_accum, at::Tensor const& dk, at::Tensor const& dv,
                     double scale_dk, double scale_dv, OptTensor const& cu_seqlens, OptTensor const& seqused,
                     int64_t arch) {
  Problem const p = check_gqa_postprocess(dk_accum, dv_accum, dk, dv, scale_dk, scale_dv, cu_seqlens, seqused, arch);
  if (dk.numel() == 0) { return; }
  auto args = args_for<GqaPostprocessLaunchArgs>(p, cu_seqlens, seqused, dk, &dv);
  args.dk_accum = accum_desc(dk_accum, p.accum);
  args.dv_accum = accum_desc(dv_accum, p.accum);
  args.num_heads_kv = p.heads;
  args.scale_dk = static_cast<float>(scale_dk);
  args.scale_dv = static_cast<float>(scale_dv);
  launch("gqa_postprocess", p, dk.scalar_type(),
         [&](auto t, auto hd, auto a, cudaStream_t s) { return launch_gqa_postprocess<t, hd, a>(args, s); });
}

void gqa_accum_to_dense(at::Tensor const& accum, at::Tensor const& out, int64_t head_dim, OptTensor const& cu_seqlens,
                        OptTensor const& seqused, int64_t arch) {
  Problem const p = check_gqa_accum_to_dense(accum, out, head_dim, cu_seqlens, seqused, arch);
  if (out.numel() == 0) { return; }
  auto args = args_for<GqaDenseLaunchArgs>(p, cu_seqlens, seqused);
  args.accum = accum_desc(accum, p.accum);
  args.out = describe(out, p.varlen);
  args.num_heads_kv = p.heads;
  launch("gqa_accum_to_dense", p, at::kFloat,
         [&](auto, auto hd, auto a, cudaStream_t s) { return launch_gqa_accum_to_dense<hd, a>(args, s); });
}

void gqa_reduce(at::Tensor const& dk_partial, OptTensor const& dv_partial, at::Tensor const& dk, OptTensor const& dv,
                OptTensor const& cu_seqlens, OptTensor const& seqused, double scale_dk, double scale_dv, int64_t arch) {
  Problem const p = check_gqa_reduce(dk_partial, dv_partial, dk, dv, cu_seqlens, seqused, scale_dk, scale_dv, arch);
  if (dk.numel() == 0) { return; }
  auto args = args_for<GqaReduceLaunchArgs>(p, cu_seqlens, seqused, dk, dv.has_value() ? &*dv : nullptr);
  args.dk_partial = describe(dk_partial, p.varlen);
  if (dv_partial.has_value()) { args.dv_partial = describe(*dv_partial, p.varlen); }
  args.partial_fp32 = dk_partial.scalar_type() == at::kFloat;
  args.num_heads_q = p.heads_q;
  args.num_heads_kv = p.heads;
  args.scale_dk = static_cast<float>(scale_dk);
  args.scale_dv = static_cast<float>(scale_dv);
  launch("gqa_reduce", p, dk.scalar_type(),
         [&](auto t, auto hd, auto a, cudaStream_t s) { return launch_gqa_reduce<t, hd, a>(args, s); });
}

}  // namespace flash_epilogue
