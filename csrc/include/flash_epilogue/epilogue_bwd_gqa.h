#pragma once

// CollectiveEpilogueBwdGQA: the dK/dV epilogue when several query heads share a KV head. The CTA of
// (n_block, q_head, batch) adds its fp32 C fragments into fp32 accumulators dKaccum/dVaccum of KV head
// q_head / (h_q / h_k); a postprocess with the same TiledMma and thread count reads them (load_fragment).
//
// Accumulator layout: one contiguous tile of kAccumTileElems floats per (tile, kv_head, batch) at
//   batch * stride_batch + kv_head * stride_head + tile * kAccumTileElems (64-bit),
//   tile = n_block (batched) or offset_padded / kBlockN + n_block (varlen, batch extent 1);
// a tile outside [0, num_tiles) is skipped. Inside a tile, register-fragment order (accum_offset):
//   sm_90: one slab per warpgroup; thread t's 16-byte chunk j at j * 512 + 4 * (t % 128) of its slab
//          (a conflict-free float4 smem store, then one bulk copy);
//   sm_80: element i of thread t at i * NumEpilogueThreads + t (coalesced atomics).
// kAccumTileElems may exceed kBlockN * kHeadDim when the TiledMma pads (padding elements are zeros).
//
// Adding (dV, then dK): sm_90 stages the fragment in smem and one thread issues a bulk reduce-add (no TMA
// descriptor, so varlen works); sm_80 uses fp32 atomics, or in deterministic mode ordered plain
// load-add-stores (atomics flush subnormals).
//
// Deterministic mode (dk_semaphores set): a zeroed int32 counter per (tile, kv_head) of each accumulator:
//   kPaddedTile    (batch * num_tiles + tile) * h_k + kv_head: collision-free, sized from the shapes.
//   kSequenceBlock (n_block * num_batch + batch) * h_k + kv_head: FA3's order, which fits the
//                  ceil(max_seqlen_k / kBlockN) * batch * h_k counters its host allocates.
// Member g waits until the counter equals g, adds, waits until its add is *complete* in global memory,
// then increments: adds land in head order. The waits end only if member g-1 runs while member g waits:
// hand out work so member g starts after member g-1 (e.g. an atomic ticket); never rely on lower block
// indices being scheduled first.
//
// Contract: NumEpilogueThreads threads call `store` / `store_zero` together (barrier BarrierId, one
// TensorStorage); the members match CollectiveEpilogueBwd's, so a kernel can pick either.

#include <cute/tensor.hpp>
#include <cutlass/arch/arch.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/fast_math.h>

#include "flash_epilogue/bulk_reduce.h"
#include "flash_epilogue/named_barrier.h"
#include "flash_epilogue/semaphore.h"
#include "flash_epilogue/seqlen_info.h"

namespace flash_epilogue {

enum class CounterOrder { kPaddedTile, kSequenceBlock };

// TileShape_MNK (BLK_M unused); ArchTag Sm90 (bulk reduce-add) or Sm80 (atomics); NumEpilogueThreads
// (whole warpgroups on sm_90); kAccumTileElems = size(fragment) * NumEpilogueThreads; BarrierId in 1..15.
template <class TileShape_MNK_, class ArchTag_, int NumEpilogueThreads_, int kAccumTileElems_,
          int BarrierId_ = kDefaultEpilogueBarrierId>
struct CollectiveEpilogueBwdGQA {
  using TileShape_MNK = TileShape_MNK_;
  using Element = float;  // what it writes: the fp32 accumulators
  using ArchTag = ArchTag_;
  static constexpr int NumEpilogueThreads = NumEpilogueThreads_;
  static constexpr bool Varlen = true;  // cu_seqlens / seqused honoured when given (run time; no TMA descriptor)
  static constexpr int kAccumTileElems = kAccumTileElems_;
  static constexpr int BarrierId = BarrierId_;
  static constexpr int kBlockN = cute::get<1>(TileShape_MNK{});
  static constexpr int kHeadDim = cute::get<2>(TileShape_MNK{});
  static constexpr bool Use_BulkReduce = ArchTag::kMinComputeCapability >= 90;
  static constexpr int kFragElems = kAccumTileElems / NumEpilogueThreads;

  static_assert(ArchTag::kMinComputeCapability >= 80, "CollectiveEpilogueBwdGQA needs sm_80 or newer");
  static_assert(kAccumTileElems % NumEpilogueThreads == 0,
                "kAccumTileElems must be size(fragment) * NumEpilogueThreads");
  static_assert(kAccumTileElems >= kBlockN * kHeadDim,
                "the accumulator tile must hold the whole (kBlockN, kHeadDim) block");
  static_assert(BarrierId > 0 && BarrierId <= kMaxNamedBarrierId, "BarrierId must be in [1, 15]");
  static_assert(!Use_BulkReduce || NumEpilogueThreads % cutlass::NumThreadsPerWarpGroup == 0,
                "the sm_90 path works per warpgroup");
  static_assert(!Use_BulkReduce || kFragElems % 4 == 0, "the sm_90 path moves 16-byte chunks of the fragment");
  static constexpr int kNumWarpGroups = Use_BulkReduce ? NumEpilogueThreads / cutlass::NumThreadsPerWarpGroup : 1;
  static constexpr int kSlabElems = kAccumTileElems / kNumWarpGroups;

  // No empty base: see CollectiveEpilogueBwd::TensorStorage.
  struct TensorStorageBulk {
    cute::array_aligned<float, kAccumTileElems, 128> smem_dkv;
  };
  struct TensorStorageAtomic {};
  using TensorStorage = std::conditional_t<Use_BulkReduce, TensorStorageBulk, TensorStorageAtomic>;

  struct Arguments {
    float* ptr_dKaccum;
    float* ptr_dVaccum;    // may be null: dK only
    int64_t stride_head;   // floats between KV heads of one batch
    int64_t stride_batch;  // floats between batches (unused in varlen)
    int num_tiles;         // tiles per (kv_head, batch): ceil(seqlen / kBlockN), or padded total / kBlockN
    int batch_extent;      // batch (batched) or 1 (varlen)
    int num_heads_q;
    int num_heads_kv;
    int static_seqlen;             // batched layout's seqlen (SeqlenInfo); the token count in varlen
    int* dk_semaphores = nullptr;  // deterministic: semaphore_count(*this) zeroed counters for dKaccum
    int* dv_semaphores = nullptr;  // and as many for dVaccum (needed when ptr_dVaccum is given)
    int const* cu_seqlens = nullptr;
    int const* seqused = nullptr;
    int64_t num_semaphores = 0;  // the counters each buffer holds (can_implement refuses fewer than needed)
    CounterOrder counter_order = CounterOrder::kPaddedTile;
    int num_batch = 1;  // the batch size (kSequenceBlock only; in varlen batch_extent is 1)
  };

  // Counters per accumulator in deterministic mode: batches * num_tiles * h_k, batches being batch_extent
  // (kPaddedTile) or num_batch (kSequenceBlock).
  static int64_t semaphore_count(Arguments const& args) {
    int const batches = args.counter_order == CounterOrder::kPaddedTile ? args.batch_extent : args.num_batch;
    return static_cast<int64_t>(batches) * args.num_tiles * args.num_heads_kv;
  }

  struct Params {
    float* ptr_dKaccum;
    float* ptr_dVaccum;
    int64_t stride_head;
    int64_t stride_batch;
    int num_tiles;
    int num_heads_kv;
    int static_seqlen;
    cutlass::FastDivmod qhead_per_khead_divmod;
    int* dk_semaphores;
    int* dv_semaphores;
    int const* cu_seqlens;
    int const* seqused;
    CounterOrder counter_order;
    int num_batch;
  };

  static char const* can_implement(Arguments const& args) {
    if (args.num_heads_kv <= 0 || args.num_heads_q % args.num_heads_kv != 0) {
      return "num_heads_q must be a multiple of num_heads_kv";
    }
    if (reinterpret_cast<uintptr_t>(args.ptr_dKaccum) % 16 || reinterpret_cast<uintptr_t>(args.ptr_dVaccum) % 16) {
      return "accumulators must be 16-byte aligned";
    }
    if (args.stride_head % 4 || args.stride_batch % 4) { return "accumulator strides must be multiples of 16 bytes"; }
    if (args.dk_semaphores != nullptr) {
      if (args.ptr_dVaccum != nullptr && args.dv_semaphores == nullptr) {
        return "deterministic mode with ptr_dVaccum needs dv_semaphores";
      }
      if (args.counter_order == CounterOrder::kSequenceBlock && args.num_batch <= 0) {
        return "the kSequenceBlock counter order needs num_batch >= 1";
      }
      if (args.num_semaphores < semaphore_count(args)) {
        return "a semaphore buffer holds fewer counters than semaphore_count(args)";
      }
    }
    return nullptr;
  }

  static Params to_underlying_arguments(Arguments const& args) {
    return {args.ptr_dKaccum, args.ptr_dVaccum, args.stride_head, args.stride_batch, args.num_tiles,
            args.num_heads_kv, args.static_seqlen, cutlass::FastDivmod(args.num_heads_q / args.num_heads_kv),
            args.dk_semaphores, args.dk_semaphores ? args.dv_semaphores : nullptr, args.cu_seqlens, args.seqused,
            args.counter_order, args.num_batch};
  }

  // Where fragment element i of thread t lives in its accumulator tile.
  CUTLASS_HOST_DEVICE static int accum_offset(int thread_idx, int i) {
    if constexpr (Use_BulkReduce) {
      int const warpgroup = thread_idx / cutlass::NumThreadsPerWarpGroup;
      int const lane = thread_idx % cutlass::NumThreadsPerWarpGroup;
      return warpgroup * kSlabElems + (i / 4) * (4 * cutlass::NumThreadsPerWarpGroup) + 4 * lane + i % 4;
    } else {
      return i * NumEpilogueThreads + thread_idx;
    }
  }

  // The postprocess side: this thread's fragment from an accumulator tile.
  template <class Fragment>
  CUTLASS_DEVICE static void load_fragment(Fragment& frag, float const* tile, int thread_idx) {
    static_assert(decltype(cute::size(frag))::value == kFragElems, "fragment of another TiledMma or thread count");
    if constexpr (Use_BulkReduce) {
#pragma unroll
      for (int i = 0; i < kFragElems; i += 4) {
        float4 const v = *reinterpret_cast<float4 const*>(tile + accum_offset(thread_idx, i));
        frag(i) = v.x;
        frag(i + 1) = v.y;
        frag(i + 2) = v.z;
        frag(i + 3) = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kFragElems; ++i) { frag(i) = tile[accum_offset(thread_idx, i)]; }
    }
  }

  // The inverse, for a driver that owns the whole tile (no other CTA touches it meanwhile).
  template <class Fragment>
  CUTLASS_DEVICE static void store_fragment(Fragment const& frag, float* tile, int thread_idx) {
    static_assert(decltype(cute::size(frag))::value == kFragElems, "fragment of another TiledMma or thread count");
    if constexpr (Use_BulkReduce) {
#pragma unroll
      for (int i = 0; i < kFragElems; i += 4) {
        *reinterpret_cast<float4*>(tile + accum_offset(thread_idx, i)) =
            make_float4(frag(i), frag(i + 1), frag(i + 2), frag(i + 3));
      }
    } else {
#pragma unroll
      for (int i = 0; i < kFragElems; ++i) { tile[accum_offset(thread_idx, i)] = frag(i); }
    }
  }

  // The accumulator tile of (n_block, kv_head, batch) and its counter; not valid if bad metadata puts it outside.
  struct TileLocation {
    int64_t offset;
    int64_t semaphore;
    bool valid;
  };
  CUTLASS_DEVICE static TileLocation locate(Params const& params, int n_block, int kv_head, int bidb) {
    SeqlenInfo<kBlockN> const info{bidb, params.static_seqlen, params.cu_seqlens, params.seqused};
    // 64-bit: offset_padded / kBlockN + n_block passes 2^31 for bad n_block or cu_seqlens.
    int64_t const tile = (params.cu_seqlens ? info.offset_padded / kBlockN : 0) + n_block;
    int const batch_coord = params.cu_seqlens ? 0 : bidb;
    int64_t const offset = batch_coord * params.stride_batch + kv_head * params.stride_head + tile * kAccumTileElems;
    bool const padded_order = params.counter_order == CounterOrder::kPaddedTile;
    int64_t const semaphore =
        padded_order ? (static_cast<int64_t>(batch_coord) * params.num_tiles + tile) * params.num_heads_kv + kv_head
                     : (static_cast<int64_t>(n_block) * params.num_batch + bidb) * params.num_heads_kv + kv_head;
    bool const counter_in_range = padded_order || (n_block >= 0 && n_block < params.num_tiles);
    return {offset, semaphore, tile >= 0 && tile < params.num_tiles && counter_in_range};
  }

  // Kept so that one kernel can call either collective.
  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const&) {}

  // block_coord = (n_block, q_head, batch). Adds dV then dK; with ptr_dVaccum null only dK (tdVrdV ignored).
  // tiled_mma is unused (the order is accum_offset's): the call is CollectiveEpilogueBwd::store's.
  template <class FrgTensor, class TiledMma>
  CUTLASS_DEVICE void store(Params const& params, FrgTensor const& tdKrdK, FrgTensor const& tdVrdV,
                            TensorStorage& storage, TiledMma const& /*tiled_mma*/, int thread_idx,
                            cute::tuple<int32_t, int32_t, int32_t> const& block_coord) const {
    static_assert(decltype(cute::size(tdKrdK))::value == kFragElems, "fragment of another TiledMma or thread count");
    auto [n_block, q_head, bidb] = block_coord;
    int group_idx;
    int const kv_head = params.qhead_per_khead_divmod.divmod(group_idx, q_head);
    TileLocation const loc = locate(params, n_block, kv_head, bidb);
    if (!loc.valid) { return; }  // whole CTA
    int* const sem_dk = params.dk_semaphores ? params.dk_semaphores + loc.semaphore : nullptr;
    int* const sem_dv = params.dv_semaphores ? params.dv_semaphores + loc.semaphore : nullptr;
    if (params.ptr_dVaccum) {
      add_tile(tdVrdV, params.ptr_dVaccum + loc.offset, sem_dv, group_idx, storage, thread_idx);
    }
    add_tile(tdKrdK, params.ptr_dKaccum + loc.offset, sem_dk, group_idx, storage, thread_idx);
  }

  CUTLASS_DEVICE void store_tail() const {}

  // A member with nothing to add leaves the accumulators as they are, but in deterministic mode still
  // takes its turn, so the members after it do not wait forever.
  CUTLASS_DEVICE void store_zero(Params const& params, int thread_idx,
                                 cute::tuple<int32_t, int32_t, int32_t> const& block_coord) const {
    if (params.dk_semaphores == nullptr) { return; }
    auto [n_block, q_head, bidb] = block_coord;
    int group_idx;
    int const kv_head = params.qhead_per_khead_divmod.divmod(group_idx, q_head);
    TileLocation const loc = locate(params, n_block, kv_head, bidb);
    if (!loc.valid || thread_idx != 0) { return; }
    auto take_turn = [group_idx](int* semaphore) {
      semaphore_wait_eq(semaphore, group_idx);
      semaphore_release_inc(semaphore);
    };
    if (params.ptr_dVaccum) { take_turn(params.dv_semaphores + loc.semaphore); }  // in store's order: dV, dK
    take_turn(params.dk_semaphores + loc.semaphore);
  }

 private:
  template <class FrgTensor>
  CUTLASS_DEVICE static void add_tile(FrgTensor const& frag, float* gmem_tile, int* semaphore, int group_idx,
                                      TensorStorage& storage, int thread_idx) {
    if constexpr (Use_BulkReduce) {
      float* smem = storage.smem_dkv.data();
      // The previous add's bulk copy has read the buffer (its issuer waited before this barrier).
      named_barrier_sync(NumEpilogueThreads, BarrierId);
      store_fragment(frag, smem, thread_idx);
      cutlass::arch::fence_view_async_shared();  // generic-proxy smem writes -> visible to the bulk copy
      named_barrier_sync(NumEpilogueThreads, BarrierId);
      if (thread_idx == 0) {
        if (semaphore) {
          semaphore_wait_eq(semaphore, group_idx);
          fence_proxy_async_global();  // the previous member's adds happen before ours
        }
        bulk_reduce_add_f32(gmem_tile, smem, kAccumTileElems * sizeof(float));
        bulk_commit_group();
        if (semaphore) {
          bulk_wait_complete();  // our adds are performed in global memory, not just read from smem
          fence_proxy_async_global();
          semaphore_release_inc(semaphore);
        } else {
          bulk_wait_read();
        }
      }
    } else if (semaphore) {
      // Deterministic: members take turns, so a plain load-add-store has no race. Not atomics: fp32
      // atomics (RED.F32.FTZ) flush subnormals, and the sum would no longer match gqa_reduce's bits.
      // ld/st.relaxed.gpu: never a stale L1 line, and (asm volatile, memory clobber) not moved across
      // the wait, barriers or fence. A chunk's loads overlap; chunks of 16 keep the registers few.
      if (thread_idx == 0) { semaphore_wait_eq(semaphore, group_idx); }
      named_barrier_sync(NumEpilogueThreads, BarrierId);  // the previous member's adds are visible (acquire + barrier)
      constexpr int kChunk = kFragElems < 16 ? kFragElems : 16;
#pragma unroll
      for (int i0 = 0; i0 < kFragElems; i0 += kChunk) {
        float sum[kChunk];
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
          if (i0 + i < kFragElems) { sum[i] = load_relaxed_gpu(gmem_tile + accum_offset(thread_idx, i0 + i)); }
        }
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
          if (i0 + i < kFragElems) {
            store_relaxed_gpu(gmem_tile + accum_offset(thread_idx, i0 + i), sum[i] + frag(i0 + i));
          }
        }
      }
      __threadfence();
      named_barrier_sync(NumEpilogueThreads, BarrierId);  // every thread's stores are performed
      if (thread_idx == 0) { semaphore_release_inc(semaphore); }
    } else {
      // Unordered: fp32 atomics (RED.F32.FTZ: subnormal sums flush to zero).
#pragma unroll
      for (int i = 0; i < kFragElems; ++i) { atomicAdd(gmem_tile + accum_offset(thread_idx, i), frag(i)); }
    }
  }

  CUTLASS_DEVICE static float load_relaxed_gpu(float const* ptr) {
    float value = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(value) : "l"(ptr) : "memory");
#endif
    return value;
  }
  CUTLASS_DEVICE static void store_relaxed_gpu(float* ptr, float value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("st.relaxed.gpu.global.f32 [%0], %1;" : : "l"(ptr), "f"(value) : "memory");
#endif
  }
};

}  // namespace flash_epilogue
