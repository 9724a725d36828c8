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
                         bool deterministic, std::optional<at::Tensor> cu_seqlens, int64_t batch) {
  bool const varlen = cu_seqlens.has_value();
  int const head_dim = static_cast<int>(dk_partial.size(-1));
  fe::Geometry geometry;
  geometry.rows = static_cast<int>(dk_partial.size(varlen ? 0 : 1));
  geometry.batch = static_cast<int>(batch);
  geometry.num_heads_kv = static_cast<int>(dk_accum.size(1));
  geometry.varlen = varlen;
  geometry.cu_seqlens = varlen ? cu_seqlens->data_ptr<int>() : nullptr;
  fe::LaunchPlan plan;  // the sm_90 collective's adds by query head, as the sm_80 path's plan runs them
  plan.tile = plan.dv_tile = {head_dim, 128};
  plan.driver = fe::Driver::kPerQueryHead;
  plan.ctas_per_sm = fe::gqa_tile_ctas_per_sm(256, /*staged=*/false);
  plan.ordered = deterministic;
  // the ordered adds' counters and ticket, as the collective's sm_90 deterministic mode takes them
  at::Tensor const semaphores =
      at::zeros({fe::SemaphoreWorkspace::of(geometry, plan.tile.block_n).numel()}, dk_accum.options().dtype(at::kInt));
  fe::GqaAccumulateLaunchArgs const args{
      .geometry = geometry,
      .plan = plan,
      .num_heads_q = static_cast<int>(dk_partial.size(-2)),
      .tensors = {{describe(dk_partial, varlen), accum(dk_accum)}, {describe(dv_partial, varlen), accum(dv_accum)}},
      .semaphores = deterministic ? semaphores.data_ptr<int>() : nullptr};
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream();
  char const* why = nullptr;
  switch (head_dim) {
    case 64: why = fe::launch_gqa_accumulate_per_head<64, 90>(args, stream); break;
    case 128: why = fe::launch_gqa_accumulate_per_head<128, 90>(args, stream); break;
    default: TORCH_CHECK(false, "accumulate_per_head: head dims 64 and 128 only");
  }
  TORCH_CHECK(why == nullptr, "accumulate_per_head: ", why ? why : "");
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "accumulate_per_head: launch failed");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("accumulate_per_head", &accumulate_per_head); }
