#pragma once

// From a checked call to its launches: the tensors as the kernels take them, and the one dispatch of a plan to the
// instantiation of its (dtype, tile head dim, code path) in csrc/instantiations/, on the call's device and current
// stream.

#include <type_traits>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "device.h"
#include "launch_args.h"
#include "static_switch.h"

namespace flash_epilogue {

// (rows, d, heads, batch extent) view of a batched (batch, seqlen, heads, d) or varlen (total, heads, d) tensor.
TensorDesc describe(at::Tensor const& t, bool varlen);
AccumDesc accum_desc(at::Tensor const& t);  // t: of the checked accumulator shape

// Runs the launch fn(kDType, kHeadDim, kArch) gives (std::integral_constants of the outputs' dtype, ignored on the
// accumulator side, of args.plan's tile head dim and of its code path). One the kernel refuses: RuntimeError.
template <class Args, class Fn>
void launch(char const* op, at::Device device, at::ScalarType dtype, Args const& args, Fn fn) {
  c10::cuda::CUDAGuard const guard(device);
  bind_primary_context(device.index());
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  char const* const why = BOOL_SWITCH(dtype == at::kBFloat16, kBF16, [&] {
    return ARCH_SWITCH(args.plan.arch, kArch, [&] {
      return HEADDIM_SWITCH(args.plan.tile.head_dim, kHeadDim, [&] {
        using DType = std::integral_constant<OutputDType, kBF16 ? OutputDType::kBFloat16 : OutputDType::kFloat16>;
        return fn(DType{}, std::integral_constant<int, kHeadDim>{}, std::integral_constant<int, kArch>{})(args, stream);
      });
    });
  });
  TORCH_CHECK(why == nullptr, "flash_epilogue.", op, ": arguments rejected by the kernel: ", why);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// launch(), or where the plan gives dV a tile of its own: dK's tensors[0] on the plan's tile, then dV's tensors[1] in
// a launch of its own on dV's tile.
template <class Args, class Fn>
void launch_per_tile(char const* op, at::Device device, at::ScalarType dtype, Args args, Fn fn) {
  if (!args.plan.dv_own_launch() || args.num_tensors < 2) { return launch(op, device, dtype, args, fn); }
  Args dv = args;
  dv.tensors[0] = args.tensors[1];
  dv.num_tensors = 1;
  dv.plan.tile = args.plan.dv_tile;
  args.num_tensors = 1;
  args.plan.dv_tile = args.plan.tile;
  launch(op, device, dtype, args, fn);
  launch(op, device, dtype, dv, fn);
}

}  // namespace flash_epilogue
