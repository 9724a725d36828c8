// A kernel of your own that ends an attention backward with flash_epilogue's collective.
//
// Your mainloop leaves the fp32 dK and dV of one KV tile in registers as C fragments of its dK/dV
// TiledMma; CollectiveEpilogueBwd converts them to bf16 and writes them out. Here the "mainloop"
// only loads the fp32 values from global memory into those fragments, so the example stays small;
// everything from `Epilogue{}.store(...)` on is what your kernel would do.
//
// Layout: (seqlen, heads, 128) contiguous, one sequence. This file is torch-free (nvcc compiles it
// without torch's headers); example_binding.cpp checks the tensors and calls
// launch_backward_tail. Build: see README.md beside this file.

#include "epilogue_example.h"

#include "flash_epilogue/bwd_config.h"
#include "flash_epilogue/epilogue_bwd.h"

namespace example {

using namespace cute;
namespace fe = flash_epilogue;

constexpr int kHeadDim = 128;
using Element = cutlass::bfloat16_t;
using Config = fe::BwdTileConfig<kHeadDim, cutlass::arch::Sm90>;  // FA3's hdim-128 tile: 128 x 128, 256 threads
using TiledMma = typename fe::BwdTiledMmaSm90<Config, Element>::TiledMma;
using TileShape = Shape<_64, Int<Config::kBlockN>, Int<kHeadDim>>;
// Varlen = true: the launch may pass cu_seqlens / seqused (here it passes neither). Tiles inside
// their sequence go out by TMA, the rest through predicated stores. Barrier ids 9 and 10 stay clear
// of the ids this kernel's own code might use.
using Epilogue = fe::CollectiveEpilogueBwd<TileShape, Element, cutlass::arch::Sm90, Config::kNumThreads,
                                           /*Varlen=*/true, Config::kSwapAB, Config::kAtomLayoutKdKV, /*BarrierId=*/9>;

__global__ void __launch_bounds__(Config::kNumThreads, 1)
    my_backward_tail(CUTE_GRID_CONSTANT typename Epilogue::Params const params, float const* dk_accum,
                     float const* dv_accum, int seqlen, int heads) {
  extern __shared__ __align__(1024) char smem[];  // TMA's 128-byte swizzle repeats every 1024 bytes
  int const n_block = blockIdx.x, head = blockIdx.y, thread_idx = threadIdx.x;

  // --- stand-in for the mainloop: fp32 (BLK_N, D) tiles into the C fragments of the dK/dV MMA
  TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
  Tensor tdKrdK = partition_fragment_C(tiled_mma, Shape<Int<Config::kBlockN>, Int<kHeadDim>>{});
  Tensor tdVrdV = partition_fragment_C(tiled_mma, Shape<Int<Config::kBlockN>, Int<kHeadDim>>{});
  auto layout = make_layout(make_shape(seqlen, Int<kHeadDim>{}), make_stride(int64_t(heads) * kHeadDim, _1{}));
  auto tile = [&](float const* base) {
    return local_tile(make_tensor(make_gmem_ptr(base + int64_t(head) * kHeadDim), layout),
                      Shape<Int<Config::kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  };
  Tensor tdKgdK = thr_mma.partition_C(tile(dk_accum));
  Tensor tdVgdV = thr_mma.partition_C(tile(dv_accum));
  Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<Config::kBlockN>, Int<kHeadDim>>{}));
  for (int i = 0; i < size(tdKrdK); ++i) {
    bool const valid = n_block * Config::kBlockN + get<0>(coords(i)) < seqlen;
    tdKrdK(i) = valid ? tdKgdK(i) : 0.f;
    tdVrdV(i) = valid ? tdVgdV(i) : 0.f;
  }

  // --- the epilogue, as in your kernel
  auto& storage = *reinterpret_cast<typename Epilogue::TensorStorage*>(smem);
  Epilogue{}.store(params, tdKrdK, tdVrdV, storage, tiled_mma, thread_idx, make_tuple(n_block, head, 0));
}

char const* launch_backward_tail(float const* dk_accum, float const* dv_accum, void* dk, void* dv, int seqlen,
                                 int heads, cudaStream_t stream) {
  if (seqlen == 0 || heads == 0) { return nullptr; }
  // (seqlen, d, heads, batch = 1) for the collective
  typename Epilogue::ShapedKV const shape{seqlen, kHeadDim, heads, 1};
  typename Epilogue::StridedKV const stride{int64_t(heads) * kHeadDim, _1{}, kHeadDim, int64_t(seqlen) * heads * kHeadDim};
  typename Epilogue::Arguments const args{static_cast<Element*>(dk), shape, stride, static_cast<Element*>(dv), shape,
                                          stride, /*cu_seqlens=*/nullptr, /*seqused=*/nullptr};
  if (char const* why = Epilogue::can_implement(args)) { return why; }
  auto const params = Epilogue::to_underlying_arguments(args);

  int const smem_bytes = sizeof(typename Epilogue::TensorStorage);
  if (cudaError_t err = cudaFuncSetAttribute(my_backward_tail, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
      err != cudaSuccess) {
    return cudaGetErrorString(err);
  }
  dim3 const grid((seqlen + Config::kBlockN - 1) / Config::kBlockN, heads);
  my_backward_tail<<<grid, Config::kNumThreads, smem_bytes, stream>>>(params, dk_accum, dv_accum, seqlen, heads);
  return nullptr;  // a launch error is left for the caller's cudaGetLastError
}

}  // namespace example
