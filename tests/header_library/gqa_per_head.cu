// sm_90's per-query-head gqa_accumulate as a torch extension, for tests/test_gqa.py: GqaAccumulateKernel
// adds each query head's tile through CollectiveEpilogueBwdGQA's bulk reduce-adds, the protocol an attention
// kernel calls (FA3's mainloop, through fa3/epilogue_bwd.hpp). The op adds whole groups per CTA on sm_90
// (GqaAccumulateStreamKernel), so this keeps the collective's sm_90 adds under test, against the op.

#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

#include "gqa_launch_template.cuh"

namespace fe = flash_epilogue;

namespace {

// (rows, d, heads, batch) of a contiguous batched (b, s, h, d) or varlen (total, h, d) tensor
fe::TensorDesc describe(at::Tensor const& t, bool varlen) {
  return {t.data_ptr(), t.stride(varlen ? 0 : 1), t.stride(-2), varlen ? 0 : t.stride(0),
          static_cast<int>(t.size(-1))};
}

// accumulators as flash_epilogue.gqa_accumulator makes them: (batch extent, h_k, tiles, tile floats)
fe::AccumDesc accum(at::Tensor const& t) {
  return {t.data_ptr<float>(), t.stride(1), t.stride(0), static_cast<int>(t.size(2)), static_cast<int>(t.size(3))};
}

void accumulate_per_head(at::Tensor dk_partial, at::Tensor dv_partial, at::Tensor dk_accum, at::Tensor dv_accum,
                         std::optional<at::Tensor> semaphores, std::optional<at::Tensor> cu_seqlens, int64_t batch) {
  bool const varlen = cu_seqlens.has_value();
  fe::GqaAccumulateLaunchArgs args;
  args.dk_partial = describe(dk_partial, varlen);
  args.dv_partial = describe(dv_partial, varlen);
  args.dk_accum = accum(dk_accum);
  args.dv_accum = accum(dv_accum);
  args.rows = static_cast<int>(dk_partial.size(varlen ? 0 : 1));
  args.num_heads_q = static_cast<int>(dk_partial.size(-2));
  args.num_heads_kv = static_cast<int>(dk_accum.size(1));
  args.batch = static_cast<int>(batch);
  args.cu_seqlens = varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  args.semaphores = semaphores.has_value() ? semaphores->data_ptr<int>() : nullptr;
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream();
  char const* why = nullptr;
  switch (dk_partial.size(-1)) {
    case 64: why = fe::launch_gqa_accumulate_per_head<64, 90>(args, stream); break;
    case 128: why = fe::launch_gqa_accumulate_per_head<128, 90>(args, stream); break;
    default: TORCH_CHECK(false, "accumulate_per_head: head dims 64 and 128 only");
  }
  TORCH_CHECK(why == nullptr, "accumulate_per_head: ", why ? why : "");
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "accumulate_per_head: launch failed");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("accumulate_per_head", &accumulate_per_head); }
