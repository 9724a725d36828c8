// Test of flash_epilogue/cutlass_fmha/epilogue_bwd.hpp inside CUTLASS's example 88 (tests/test_cutlass_fmha_check.py
// builds this file against a copy of the example that scripts/cutlass_fmha_check.py patched; no kernel runs, and
// main runs on the CPU). For each of the example's backward tiles:
//   1. the swapped device layer's Epilogue is the adapter;
//   2. the kernel's shared memory is no larger than with the example's own FmhaBwdEpilogueKV;
//   3. the adapter's call, as the kernel makes it, compiles for the device;
//   4. the GQA build's deterministic path (TicketTileScheduler as the kernel constructs it, EpilogueBwdKVGQA's
//      ordered adds with semaphores, their host set-up) compiles, and keeps the kernel's shared memory;
//   5. (main) the adapters' host checks: each case prints `name: reason` (or `ok`), and to_underlying_arguments
//      throws std::invalid_argument with the reason.
// Tiles 64x128x32 and 64x128x128 (CI's compile, under a minute on 2 cores); FE_ALL_TILES adds the other three.

#include <cstdio>
#include <stdexcept>
#include <type_traits>

#include "cute/tensor.hpp"

#include "collective/fmha_fusion.hpp"
#include "device/fmha_device_bwd.hpp"  // patched: names flash_epilogue::cutlass_fmha::EpilogueBwdKV

using namespace cute;

template <class TileShape, class Fusion = cutlass::fmha::collective::DefaultFusion>
struct Swapped {
  using Bwd = cutlass::fmha::device::FmhaBwd<cutlass::half_t, float, TileShape, Fusion>;
  using Mainloop = typename Bwd::Mainloop;
  using Ours = flash_epilogue::cutlass_fmha::EpilogueBwdKV<cutlass::half_t, float, typename Mainloop::TileShapePV>;
  using Theirs = cutlass::fmha::collective::FmhaBwdEpilogueKV<cutlass::half_t, float, typename Mainloop::TileShapePV>;
  using Kernel = typename Bwd::Operation::Kernel;
  using KernelTheirs = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<
      Mainloop, Theirs, cutlass::fmha::kernel::TileSchedulerBwdAdapter<cutlass::fmha::kernel::IndividualTileScheduler>>;

  static_assert(std::is_same_v<typename Bwd::Epilogue, Ours>, "the device layer does not name the adapter");
  static_assert(sizeof(typename Kernel::SharedStorage) <= sizeof(typename KernelTheirs::SharedStorage),
                "the adapter grows the kernel's shared memory");
  static constexpr bool kChecked = true;
};

// The tiles of the smallest and largest head dim, the adapter's two shared-memory atoms (SW64, SW128); with
// FE_ALL_TILES, every backward tile the example instantiates (88_hopper_fmha.cu's run_bwd_32/64/128).
static_assert(Swapped<Shape<_64, _128, _32>>::kChecked && Swapped<Shape<_64, _128, _128>>::kChecked);
#ifdef FE_ALL_TILES
static_assert(Swapped<Shape<_128, _128, _32>>::kChecked);
static_assert(Swapped<Shape<_64, _128, _64>>::kChecked && Swapped<Shape<_128, _128, _64>>::kChecked);
#endif

// Each MMA warpgroup's dK/dV fragments of the mainloop's TiledMmaPV, as the mainloop hands them over (filled with
// 1 and 2), and the TiledMma.
template <class Mainloop>
__device__ auto warpgroup_fragments() {
  typename Mainloop::TiledMmaPV tiled_mma;
  auto thread_mma = tiled_mma.get_slice(threadIdx.x % cutlass::NumThreadsPerWarpGroup);
  auto acc_dk = partition_fragment_C(thread_mma, select<0, 1>(typename Mainloop::TileShapePV{}));
  auto acc_dv = partition_fragment_C(thread_mma, select<0, 1>(typename Mainloop::TileShapePV{}));
  fill(acc_dk, 1.0f);
  fill(acc_dv, 2.0f);
  return make_tuple(tiled_mma, make_tuple(acc_dk, acc_dv));
}

// 3. The adapter's call as the kernel makes it (FmhaKernelTmaWarpSpecialized::operator(): each MMA warpgroup's
// fragments of the mainloop's TiledMmaPV, wg_coord, epilogue[warpgroup]), for the device. The whole kernels
// compile in scripts/cutlass_fmha_check.py --build-only (minutes).
template <class TileShape>
__global__ void call_the_epilogue(typename Swapped<TileShape>::Ours::Params const params, int kv_block, int head,
                                  int batch) {
  using S = Swapped<TileShape>;
  using Mainloop = typename S::Mainloop;
  using Kernel = typename S::Kernel;
  extern __shared__ char smem[];
  auto& storage = *reinterpret_cast<typename Kernel::SharedStorage*>(smem);
  auto [tiled_mma, result] = warpgroup_fragments<Mainloop>();
  int const wg = threadIdx.x / cutlass::NumThreadsPerWarpGroup;
  auto wg_coord = make_coord(_0{}, 2 * kv_block + wg, make_coord(batch, head));  // the scheduler's, per warpgroup
  typename S::Ours::LoadPipeline::Params pipeline_params;
  typename S::Ours::LoadPipeline pipeline(storage.epi_load, pipeline_params);
  typename S::Ours epilogue;
  epilogue(typename Mainloop::TileShapePV{}, wg_coord, result, tiled_mma,
           make_tuple(batch + 1, head + 1, 128, 128, int(get<2>(TileShape{}))), params, pipeline,
           storage.tensors.epilogue[wg]);
}

void* kernels[] = {reinterpret_cast<void*>(&call_the_epilogue<Shape<_64, _128, _32>>),
#ifdef FE_ALL_TILES
                   reinterpret_cast<void*>(&call_the_epilogue<Shape<_64, _128, _64>>),
                   reinterpret_cast<void*>(&call_the_epilogue<Shape<_128, _128, _64>>),
                   reinterpret_cast<void*>(&call_the_epilogue<Shape<_128, _128, _32>>),
#endif
                   reinterpret_cast<void*>(&call_the_epilogue<Shape<_64, _128, _128>>)};

// 4. The GQA build's kernel parts (scripts/cutlass_fmha_check.py's `gqa` copy names them in its device layer): the
// ticket scheduler, constructed by every thread first thing as FmhaKernelTmaWarpSpecialized does, and the GQA
// epilogue's call on the tile the scheduler hands out, in deterministic mode when the params carry semaphores.
using TicketScheduler =
    cutlass::fmha::kernel::TileSchedulerBwdAdapter<flash_epilogue::cutlass_fmha::TicketTileScheduler>;

template <class TileShape>
struct Gqa {
  using Mainloop = typename Swapped<TileShape>::Mainloop;
  using Epilogue =
      flash_epilogue::cutlass_fmha::EpilogueBwdKVGQA<cutlass::half_t, float, typename Mainloop::TileShapePV>;
  using Kernel = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<Mainloop, Epilogue, TicketScheduler>;
  static_assert(sizeof(typename Kernel::SharedStorage) <=
                    sizeof(typename Swapped<TileShape>::KernelTheirs::SharedStorage),
                "the GQA epilogue grows the kernel's shared memory");

  // The device layer's set-up of the deterministic mode: semaphores after both accumulators, the ticket after them.
  static typename Kernel::Params params(cute::tuple<int, int, int, int, int> problem, int h_kv, float* workspace) {
    auto const elems = Epilogue::Layout::of(problem, h_kv).elems;
    int* const semaphores = reinterpret_cast<int*>(workspace + 2 * elems);
    typename Epilogue::Arguments const args{workspace, workspace + elems, h_kv, semaphores};
    typename Kernel::Params params;
    params.epilogue = Epilogue::to_underlying_arguments(problem, args);
    params.tile_scheduler = TicketScheduler::to_underlying_arguments(problem, cutlass::KernelHardwareInfo{},
                                                                     typename Mainloop::ClusterShape{}, TileShape{});
    params.tile_scheduler.ticket = semaphores + Epilogue::num_semaphores(problem, h_kv);
    return params;
  }
};

template <class TileShape>
__global__ void call_the_gqa_epilogue(typename Gqa<TileShape>::Kernel::Params const params) {
  using G = Gqa<TileShape>;
  using Mainloop = typename G::Mainloop;
  extern __shared__ char smem[];
  TicketScheduler scheduler{params.tile_scheduler};
  auto& storage = *reinterpret_cast<typename G::Kernel::SharedStorage*>(smem);
  auto [tiled_mma, result] = warpgroup_fragments<Mainloop>();
  int const wg = threadIdx.x / cutlass::NumThreadsPerWarpGroup;
  auto wg_coord = scheduler.get_block_coord();
  get<1>(wg_coord) = 2 * get<1>(wg_coord) + wg;  // as the kernel does
  typename G::Epilogue::LoadPipeline::Params pipeline_params;
  typename G::Epilogue::LoadPipeline pipeline(storage.epi_load, pipeline_params);
  typename G::Epilogue epilogue;
  epilogue(typename Mainloop::TileShapePV{}, wg_coord, result, tiled_mma, params.problem_size,
           params.epilogue, pipeline, storage.tensors.epilogue[wg]);
}

void* gqa_kernels[] = {reinterpret_cast<void*>(&call_the_gqa_epilogue<Shape<_64, _128, _128>>)};
auto* gqa_host = &Gqa<Shape<_64, _128, _128>>::params;

// 5. The host checks, on arguments no kernel is launched with (can_implement reads pointers for their alignment only).
template <class Adapter, class Problem>
void refusal(char const* name, Problem const& problem, typename Adapter::Arguments const& args) {
  char const* why = Adapter::can_implement(problem, args);
  std::printf("%s: %s\n", name, why ? why : "ok");
  if (why == nullptr) { return; }
  try {
    Adapter::to_underlying_arguments(problem, args);
    std::printf("%s: not thrown\n", name);
  } catch (std::invalid_argument const& e) {
    std::printf("%s: thrown: %s\n", name, e.what());
  }
}

int main() {
  using Mha = Swapped<Shape<_64, _128, _128>>::Ours;
  using GqaEpilogue = Gqa<Shape<_64, _128, _128>>::Epilogue;
  alignas(16) static cutlass::half_t out[16];
  alignas(16) static float accum[16];
  auto const problem = [](int d) { return make_tuple(2, 4, 128, 128, d); };  // (B, H, Q, K, D)
  auto const mha = [&](cutlass::half_t* ptr, int d) {
    cute::tuple<int, int, int, _1> const stride{4 * 128 * d, 128 * d, d, _1{}};
    return Mha::Arguments{ptr, stride, ptr, stride};
  };
  refusal<Mha>("mha", problem(128), mha(out, 128));
  refusal<Mha>("mha head dim 100", problem(100), mha(out, 100));
  refusal<Mha>("mha misaligned", problem(128), mha(out + 1, 128));
  refusal<GqaEpilogue>("gqa", problem(128), {accum, accum, 2});
  refusal<GqaEpilogue>("gqa no accumulators", problem(128), {nullptr, nullptr, 2});
  refusal<GqaEpilogue>("gqa 3 kv heads of 4", problem(128), {accum, accum, 3});
  return 0;
}
