#pragma once

// CUTLASS's Hopper FMHA (examples/88_hopper_fmha) storing its backward dK/dV through
// flash_epilogue::CollectiveEpilogueBwd instead of its own FmhaBwdEpilogueKV. The adapter has
// FmhaBwdEpilogueKV's template parameters, Arguments, kernel-facing types and call, so the swap is one line of
// the example's device/fmha_device_bwd.hpp (plus this include, with csrc/include on the include path):
//
//   using Epilogue = flash_epilogue::cutlass_fmha::EpilogueBwdKV<Element, ElementAccumulator,
//                                                                 typename Mainloop::TileShapePV>;
//
// scripts/cutlass_fmha_check.py makes that swap in a copy of the example and compares the two builds bitwise.
//
// What the example hands its epilogue: each of its two MMA warpgroups calls it once per tile with its own fp32
// dK/dV C fragments of TiledMmaPV (64 KV rows x D over 128 threads; the kernel numbers the 64-row blocks
// 2 * kv_block + warpgroup) and its own TensorStorage (epilogue[warpgroup] of a union with the mainloop's
// shared memory). dK and dV are (B, H, K, D) tensors with int strides (B, H, K, _1). dS already carries the
// softmax scale, so dK is stored as it comes.
//
// Requirement on the kernel: the warpgroups' epilogues run one after the other. Both warpgroups use named
// barriers BarrierId (128 threads) and BarrierId + 1 (160, the TMA hand-off); concurrent calls would mix the two
// warpgroups' arrivals on one barrier. And epilogue[0] overlays the K/V stages that warpgroup 1's last dQ GEMM
// reads. FmhaKernelTmaWarpSpecialized serialises the calls: the `if constexpr (kIsEpilogueLocked)` in front of
// math_wg_order_barrier.wait() / arrive() ends in a stray `;`, so the ordered barrier around the epilogue is
// unconditional, and warpgroup 0 waits there for warpgroup 1's arrival from inside the mainloop. Where a kernel
// lets the epilogues overlap, this adapter must not be used as it is (the check refuses such a checkout).
//
// Barrier ids: the example itself syncs only __syncthreads (id 0) and mbarriers (pipelines, ordered barrier);
// CUTLASS's epilogue that this replaces used id 1. The default ids 8 and 9 are free.
//
// Bits: fp16 round-to-nearest of the fp32 fragments, as FmhaBwdEpilogueKV (Sm90Compute with
// round_to_nearest); rows >= K and columns >= D are clipped by TMA in both.
//
// GQA (fewer KV heads than query heads; the check's `gqa` build): EpilogueBwdKVGQA adds each query head's
// fragments into fp32 accumulators of its KV head (CollectiveEpilogueBwdGQA, bulk reduce-add), and GqaPostprocess
// converts them to dK/dV after the kernel. Two modes:
//   atomic (Arguments::semaphores null): unordered adds; the sum's rounding depends on the order they land in.
//   deterministic (semaphores: num_semaphores() zeroed int32 counters): CollectiveEpilogueBwdGQA's ordered mode,
//     one counter per (64-row tile, KV head, batch) and accumulator; the group's member g = h % G waits until its
//     tile's counter reaches g, adds, and releases it to g + 1, so the adds land in head order and dK/dV are the
//     same bits on every run.
// Forward progress of the deterministic mode: member g - 1 of a tile is query head h - 1, a CTA of lower blockIdx.z
// and so of lower linear block index. It runs while member g waits if CTAs start in increasing linear block index,
// which is what the hardware does with a non-persistent grid (FA3's deterministic backward relies on the same for
// its non-persistent schedulers), but that is a property of the dispatcher, not something CUDA promises. The
// kernel therefore takes its tiles from TicketTileScheduler: each CTA draws a ticket from a global counter when it
// starts and works on the tile the ticket names in linear block order. A CTA that holds ticket t is running, so
// are the holders of every lower ticket, and every wait is on a lower ticket's tile: the waits end whatever order
// CTAs start in.
//
// Shared memory: one 64 x D fp16 tile per tensor per warpgroup (the example's own TMA epilogue stages 64 x 32
// subtiles). Both warpgroups' storage together is 2 * 2 * 64 * D * 2 bytes, the size of the mainloop's K/V stages
// (smem_k: 4 stages of 64 x D) that it overlays, so the kernel's shared memory does not grow (see TensorStorage).

#include <cassert>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/arch.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>
#include <cutlass/kernel_hardware_info.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "flash_epilogue/epilogue_bwd.h"
#include "flash_epilogue/epilogue_bwd_gqa.h"

namespace flash_epilogue::cutlass_fmha {

// The calling thread's index in its warpgroup, read from %tid.x at the call. The kernel calls its epilogue inside
// its tile loop, after the mainloop: a plain threadIdx.x lets the compiler compute the index (and the shared-memory
// offsets that follow from it) before the loop and keep them live across the whole mainloop, which costs that
// loop register spills (a volatile read cannot be moved out of the call).
CUTLASS_DEVICE int thread_idx_in_warpgroup() {
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return int(tid % cutlass::NumThreadsPerWarpGroup);
}

// (n_block, head, batch) of the kernel's per-warpgroup coordinate (_, 64-row block, (b, h)).
template <class BlkCoord>
CUTLASS_DEVICE cute::tuple<int32_t, int32_t, int32_t> block_coord_of(BlkCoord const& wg_coord) {
  return {int32_t(cute::get<1>(wg_coord)), int32_t(cute::get<2, 1>(wg_coord)), int32_t(cute::get<2, 0>(wg_coord))};
}

// An adapter's collective Params for the problem; throws std::invalid_argument with the adapter's name and its
// can_implement reason rather than encode TMA descriptors the collective cannot run.
template <class Adapter, class ProblemShape>
typename Adapter::Params checked_params(char const* adapter, ProblemShape const& problem_size,
                                        typename Adapter::Arguments const& args) {
  if (char const* why = Adapter::can_implement(problem_size, args)) {
    throw std::invalid_argument(std::string("flash_epilogue::cutlass_fmha::") + adapter + ": " + why);
  }
  return Adapter::Collective::to_underlying_arguments(Adapter::collective_arguments(problem_size, args));
}

// Element: the 16-bit output type; ElementAccumulator: float; TileShape_WG: the mainloop's TileShapePV,
// (64 KV rows of one warpgroup, D, BlockQO).
template <class Element_, class ElementAccumulator, class TileShape_WG, int BarrierId = kDefaultEpilogueBarrierId>
struct EpilogueBwdKV {
  using Element = Element_;
  static constexpr int kBlockN = cute::get<0>(TileShape_WG{});    // KV rows of one warpgroup
  static constexpr int kHeadDim = cute::get<1>(TileShape_WG{});   // the tile's head dim; the problem's may be less
  static constexpr int kNumThreads = cutlass::NumThreadsPerWarpGroup;
  static_assert(std::is_same_v<ElementAccumulator, float>, "the dK/dV fragments are fp32");

  // (BLK_M unused, BLK_N, BLK_D): one warpgroup's tile, stored by its 128 threads, TMA path, not varlen.
  using Collective = CollectiveEpilogueBwd<cute::Shape<cute::tuple_element_t<2, TileShape_WG>, cute::Int<kBlockN>,
                                                       cute::Int<kHeadDim>>,
                                           Element, cutlass::arch::Sm90, kNumThreads, /*Varlen=*/false,
                                           /*dKV_swapAB=*/false, /*AtomLayoutKdKV=*/1, BarrierId>;

  // FmhaBwdEpilogueKV's fields, in its order: strides (batch, head, row, _1).
  struct Arguments {
    Element* ptr_K;
    cute::tuple<int, int, int, cute::_1> dK;
    Element* ptr_V;
    cute::tuple<int, int, int, cute::_1> dV;
  };
  using Params = typename Collective::Params;

  // The collective's storage as bytes aligned as CUTLASS's own shared-memory arrays (128). The collective's type
  // asks for its swizzle's alignment (1024 bytes for SW128), which would round the kernel's SharedStorage up by
  // 512 bytes. The swizzle still holds: epilogue[w] starts w * sizeof(TensorStorage) (a multiple of 1024) after a
  // shared-memory base that the mainloop's own swizzled TMA buffers need 1024-aligned (checked in debug builds).
  struct TensorStorage {
    alignas(128) unsigned char bytes[sizeof(typename Collective::TensorStorage)];
  };
  static_assert(sizeof(TensorStorage) % Collective::SmemAlignmentdKV == 0,
                "consecutive warpgroups' storage must keep the swizzle's alignment");

  // The kernel builds an epilogue load pipeline whatever the epilogue is; nothing is loaded here.
  using LoadPipeline = cutlass::PipelineTransactionAsync<1>;
  using PipelineStorage = typename LoadPipeline::SharedStorage;
  static constexpr int TmaTransactionBytes = 0;

  // problem_size: the example's (B, H, Q, K, D).
  template <class ProblemShape>
  static typename Collective::Arguments collective_arguments(ProblemShape const& problem_size, Arguments const& args) {
    auto const shape = typename Collective::ShapedKV{cute::get<3>(problem_size), cute::get<4>(problem_size),
                                                     cute::get<1>(problem_size), cute::get<0>(problem_size)};
    auto const stride = [](cute::tuple<int, int, int, cute::_1> const& s) {  // (b, h, row, 1) -> (row, 1, h, b)
      return typename Collective::StridedKV{cute::get<2>(s), cute::_1{}, cute::get<1>(s), cute::get<0>(s)};
    };
    return {args.ptr_K, shape, stride(args.dK), args.ptr_V, shape, stride(args.dV)};
  }

  // Why the collective cannot store this problem, or nullptr (the kernel's can_implement checks the mainloop only).
  template <class ProblemShape>
  static char const* can_implement(ProblemShape const& problem_size, Arguments const& args) {
    return Collective::can_implement(collective_arguments(problem_size, args));
  }

  // Throws std::invalid_argument with can_implement's reason (checked_params).
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_size, Arguments const& args,
                                        void* /*workspace*/ = nullptr) {
    return checked_params<EpilogueBwdKV>("EpilogueBwdKV", problem_size, args);
  }

  // Called by each MMA warpgroup with wg_coord = (_, 64-row block, (b, h)) and result = (dK, dV) fragments.
  template <class TileShape, class BlkCoord, class ResultTuple, class TiledMma, class ProblemShape>
  CUTLASS_DEVICE void operator()(TileShape const&, BlkCoord const& wg_coord, ResultTuple const& result,
                                 TiledMma const& tiled_mma, ProblemShape const&, Params const& params, LoadPipeline,
                                 TensorStorage& storage) const {
    auto& collective_storage = *reinterpret_cast<typename Collective::TensorStorage*>(storage.bytes);
    assert(cute::cast_smem_ptr_to_uint(storage.bytes) % Collective::SmemAlignmentdKV == 0);
    Collective{}.store(params, cute::get<0>(result), cute::get<1>(result), collective_storage, tiled_mma,
                       thread_idx_in_warpgroup(), block_coord_of(wg_coord));
  }
};

// The GQA accumulators: one 64 x kHeadDim fp32 tile per (64-row block, KV head, batch), in register-fragment order
// (CollectiveEpilogueBwdGQA's), ceil(K / 64) tiles per (KV head, batch); zero them before the kernel.
template <int kBlockN, int kHeadDim>
struct AccumLayout {
  static constexpr int kTileElems = kBlockN * kHeadDim;
  int num_tiles;
  int64_t stride_head;   // floats
  int64_t stride_batch;  // floats
  int64_t elems;         // of each of dK's and dV's accumulators

  // problem_size: the example's (B, H, Q, K, D); num_heads_kv divides H.
  template <class ProblemShape>
  static AccumLayout of(ProblemShape const& problem_size, int num_heads_kv) {
    int const num_tiles = (cute::get<3>(problem_size) + kBlockN - 1) / kBlockN;
    int64_t const stride_head = int64_t(num_tiles) * kTileElems;
    int64_t const stride_batch = stride_head * num_heads_kv;
    return {num_tiles, stride_head, stride_batch, stride_batch * cute::get<0>(problem_size)};
  }
};

// EpilogueBwdKV's interface for GQA: each query head's dK/dV added into its KV head's fp32 accumulators.
template <class Element_, class ElementAccumulator, class TileShape_WG, int BarrierId = kDefaultEpilogueBarrierId>
struct EpilogueBwdKVGQA {
  using Element = float;
  static constexpr int kBlockN = cute::get<0>(TileShape_WG{});
  static constexpr int kHeadDim = cute::get<1>(TileShape_WG{});
  static constexpr int kNumThreads = cutlass::NumThreadsPerWarpGroup;
  using Layout = AccumLayout<kBlockN, kHeadDim>;
  static_assert(std::is_same_v<ElementAccumulator, float>, "the dK/dV fragments are fp32");

  using Collective = CollectiveEpilogueBwdGQA<cute::Shape<cute::tuple_element_t<2, TileShape_WG>, cute::Int<kBlockN>,
                                                          cute::Int<kHeadDim>>,
                                              cutlass::arch::Sm90, kNumThreads, Layout::kTileElems, BarrierId>;

  struct Arguments {
    float* ptr_dK_accum;  // AccumLayout::of(problem_size, num_heads_kv).elems floats each, zeroed
    float* ptr_dV_accum;
    int num_heads_kv;
    int* semaphores = nullptr;  // deterministic: num_semaphores(problem_size, num_heads_kv) zeroed int32; null: atomic
  };
  using Params = typename Collective::Params;
  using TensorStorage = typename Collective::TensorStorage;  // 64 x kHeadDim floats: EpilogueBwdKV's size
  using LoadPipeline = cutlass::PipelineTransactionAsync<1>;
  using PipelineStorage = typename LoadPipeline::SharedStorage;
  static constexpr int TmaTransactionBytes = 0;

  // The semaphores are the collective's counters in its kPaddedTile order: dK's, then as many for dV.
  template <class ProblemShape>
  static typename Collective::Arguments collective_arguments(ProblemShape const& problem_size, Arguments const& args) {
    Layout const layout = Layout::of(problem_size, args.num_heads_kv > 0 ? args.num_heads_kv : 1);
    typename Collective::Arguments out{args.ptr_dK_accum, args.ptr_dV_accum, layout.stride_head,
                                       layout.stride_batch, layout.num_tiles, cute::get<0>(problem_size),
                                       cute::get<1>(problem_size), args.num_heads_kv, cute::get<3>(problem_size)};
    if (args.semaphores != nullptr) {
      int64_t const count = Collective::semaphore_count(out);
      out.dk_semaphores = args.semaphores;
      out.dv_semaphores = args.semaphores + count;
      out.num_semaphores = count;
    }
    return out;
  }

  // The int32 counters the deterministic mode needs (both accumulators'); zero them before each launch.
  template <class ProblemShape>
  static int64_t num_semaphores(ProblemShape const& problem_size, int num_heads_kv) {
    Arguments const shape_only{nullptr, nullptr, num_heads_kv};
    return 2 * Collective::semaphore_count(collective_arguments(problem_size, shape_only));
  }

  template <class ProblemShape>
  static char const* can_implement(ProblemShape const& problem_size, Arguments const& args) {
    if (args.ptr_dK_accum == nullptr || args.ptr_dV_accum == nullptr) { return "dK and dV accumulators are needed"; }
    return Collective::can_implement(collective_arguments(problem_size, args));
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_size, Arguments const& args,
                                        void* /*workspace*/ = nullptr) {
    return checked_params<EpilogueBwdKVGQA>("EpilogueBwdKVGQA", problem_size, args);
  }

  // wg_coord = (_, 64-row block, (b, query head)); the collective finds the KV head. Deterministic: waits for the
  // group's previous query head to have added this tile (the kernel must take its tiles from TicketTileScheduler).
  template <class TileShape, class BlkCoord, class ResultTuple, class TiledMma, class ProblemShape>
  CUTLASS_DEVICE void operator()(TileShape const&, BlkCoord const& wg_coord, ResultTuple const& result,
                                 TiledMma const& tiled_mma, ProblemShape const&, Params const& params, LoadPipeline,
                                 TensorStorage& storage) const {
    Collective{}.store(params, cute::get<0>(result), cute::get<1>(result), storage, tiled_mma,
                       thread_idx_in_warpgroup(), block_coord_of(wg_coord));
  }
};

// The GQA accumulators -> 16-bit dK/dV (B, H_kv, K, D): one CTA of 128 threads per (64-row block, KV head, batch)
// reads its tile's fragments (TiledMma: the mainloop's TiledMmaPV, as in the kernel) and stores them with
// CollectiveEpilogueBwd, as EpilogueBwdKV would.
template <class Element, class TileShape_WG, class TiledMma, int BarrierId = kDefaultEpilogueBarrierId>
struct GqaPostprocess {
  using Accumulate = EpilogueBwdKVGQA<Element, float, TileShape_WG, BarrierId>;
  using Mha = EpilogueBwdKV<Element, float, TileShape_WG, BarrierId>;
  using Store = typename Mha::Collective;
  using Layout = typename Accumulate::Layout;
  static constexpr int kNumThreads = cutlass::NumThreadsPerWarpGroup;

  struct Params {
    typename Store::Params store;
    float const* dk_accum;
    float const* dv_accum;
    Layout layout;
    dim3 grid;
  };

  // problem_size: (B, H, Q, K, D); dK/dV strides (batch, head, row, _1) over num_heads_kv heads.
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_size, int num_heads_kv, float const* dk_accum,
                                        float const* dv_accum, Element* ptr_dK,
                                        cute::tuple<int, int, int, cute::_1> const& stride_dK, Element* ptr_dV,
                                        cute::tuple<int, int, int, cute::_1> const& stride_dV) {
    auto const kv_problem = cute::make_tuple(cute::get<0>(problem_size), num_heads_kv, cute::get<2>(problem_size),
                                             cute::get<3>(problem_size), cute::get<4>(problem_size));
    typename Mha::Arguments const args{ptr_dK, stride_dK, ptr_dV, stride_dV};
    Layout const layout = Layout::of(problem_size, num_heads_kv);
    return {Mha::to_underlying_arguments(kv_problem, args), dk_accum, dv_accum, layout,
            dim3(layout.num_tiles, num_heads_kv, cute::get<0>(problem_size))};
  }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
    using namespace cute;
    int const thread_idx = threadIdx.x;
    int const n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(thread_idx);
    Tensor frag_dk = partition_fragment_C(thread_mma, select<0, 1>(TileShape_WG{}));
    Tensor frag_dv = partition_fragment_C(thread_mma, select<0, 1>(TileShape_WG{}));
    int64_t const offset = batch * params.layout.stride_batch + kv_head * params.layout.stride_head +
                           int64_t(n_block) * Layout::kTileElems;
    Accumulate::Collective::load_fragment(frag_dk, params.dk_accum + offset, thread_idx);
    Accumulate::Collective::load_fragment(frag_dv, params.dv_accum + offset, thread_idx);
    auto& storage = *reinterpret_cast<typename Store::TensorStorage*>(smem);
    Store{}.store(params.store, frag_dk, frag_dv, storage, tiled_mma, thread_idx,
                  cute::make_tuple(int32_t(n_block), int32_t(kv_head), int32_t(batch)));
  }

  static cudaError_t run(Params const& params, cudaStream_t stream = nullptr);
};

namespace detail {
template <class Postprocess>
__global__ void __launch_bounds__(Postprocess::kNumThreads) gqa_postprocess_kernel(
    CUTLASS_GRID_CONSTANT typename Postprocess::Params const params) {
  extern __shared__ __align__(1024) char smem[];
  Postprocess{}(params, smem);
}
}  // namespace detail

template <class Element, class TileShape_WG, class TiledMma, int BarrierId>
cudaError_t GqaPostprocess<Element, TileShape_WG, TiledMma, BarrierId>::run(Params const& params, cudaStream_t stream) {
  auto kernel = detail::gqa_postprocess_kernel<GqaPostprocess>;
  int const smem = int(sizeof(typename Store::TensorStorage));
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) { return e; }
  kernel<<<params.grid, kNumThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

// The example's IndividualTileScheduler (one tile per CTA, grid (ceil(rows / tile), B, H); the example wraps it in
// TileSchedulerBwdAdapter) with a ticket for the deterministic GQA mode. Where Params::ticket points to a zeroed
// int32, each CTA draws the next ticket when it starts and works on the tile that the ticket's value is the linear
// block index of (x fastest, then batch, then head): tickets follow the order CTAs start in, whatever order the
// hardware dispatches them in. With ticket null the tile is blockIdx's, as IndividualTileScheduler's.
//
// Requirement on the kernel: every thread of the CTA constructs the scheduler, before the kernel touches its dynamic
// shared memory: the ticket is passed to the CTA's threads through the first 4 bytes of it, between two
// __syncthreads. FmhaKernelTmaWarpSpecialized constructs it first thing, before its pipelines' initialisation (the
// check refuses a checkout where it no longer does).
struct TicketTileScheduler {
  struct Params {
    dim3 grid;
    int* ticket = nullptr;  // zeroed before each launch; null: blockIdx
  };

  bool valid_ = true;
  unsigned int m_block_;
  unsigned int bidb_;
  unsigned int bidh_;

  CUTLASS_DEVICE explicit TicketTileScheduler(Params const& params) {
    if (params.ticket == nullptr) {  // uniform over the grid
      m_block_ = blockIdx.x;
      bidb_ = blockIdx.y;
      bidh_ = blockIdx.z;
      return;
    }
    extern __shared__ int fe_ticket_smem[];  // the kernel's dynamic shared memory, not yet in use
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) { fe_ticket_smem[0] = atomicAdd(params.ticket, 1); }
    __syncthreads();
    unsigned int const ticket = static_cast<unsigned int>(fe_ticket_smem[0]);
    __syncthreads();  // every thread has read it before the kernel's own use of the word
    m_block_ = ticket % params.grid.x;
    bidb_ = ticket / params.grid.x % params.grid.y;
    bidh_ = ticket / (params.grid.x * params.grid.y);
  }

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& problem_size, cutlass::KernelHardwareInfo,
                                        ClusterShape const& cluster_shape, TileShape const& tile_shape) {
    int const blocks = cute::ceil_div(int(cute::size<2>(problem_size)), int(cute::size<0>(tile_shape)));
    dim3 const grid(cutlass::round_up(blocks, int(cute::size<0>(cluster_shape))), cute::size<0>(problem_size),
                    cute::size<1>(problem_size));
    return Params{grid};
  }

  static dim3 get_grid_shape(Params const& params) { return params.grid; }

  CUTLASS_DEVICE bool is_valid() { return valid_; }

  CUTLASS_DEVICE auto get_block_coord() {
    return cute::make_coord(m_block_, cute::_0{}, cute::make_coord(bidb_, bidh_));
  }

  CUTLASS_DEVICE TicketTileScheduler& operator++() {
    valid_ = false;
    return *this;
  }
};

}  // namespace flash_epilogue::cutlass_fmha
