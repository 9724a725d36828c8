// The example's Python binding: the only file of the example that includes torch (as
// csrc/binding/ is for flash_epilogue), so nvcc never compiles torch's headers.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "epilogue_example.h"

namespace example {

void run(torch::Tensor const& dk_accum, torch::Tensor const& dv_accum, torch::Tensor& dk, torch::Tensor& dv) {
  TORCH_CHECK(dk_accum.is_cuda() && dk_accum.is_contiguous() && dk_accum.scalar_type() == torch::kFloat &&
                  dk_accum.dim() == 3 && dk_accum.size(2) == 128,
              "dk_accum: expected a contiguous CUDA fp32 (seqlen, heads, 128) tensor");
  TORCH_CHECK(dv_accum.sizes() == dk_accum.sizes() && dv_accum.is_contiguous(), "dv_accum: expected dk_accum's shape");
  TORCH_CHECK(dk.sizes() == dk_accum.sizes() && dv.sizes() == dk_accum.sizes() && dk.is_contiguous() &&
                  dv.is_contiguous() && dk.scalar_type() == torch::kBFloat16 && dv.scalar_type() == torch::kBFloat16,
              "dk, dv: expected contiguous bf16 tensors of dk_accum's shape");
  c10::cuda::CUDAGuard const guard(dk.device());
  char const* why = launch_backward_tail(dk_accum.data_ptr<float>(), dv_accum.data_ptr<float>(), dk.data_ptr(),
                                         dv.data_ptr(), static_cast<int>(dk.size(0)), static_cast<int>(dk.size(1)),
                                         c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(why == nullptr, "CollectiveEpilogueBwd cannot run these arguments: ", why);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace example

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &example::run, "fp32 dK/dV (seqlen, heads, 128) -> bf16, in place"); }
