#pragma once

// Raw named barriers. CUTLASS's cutlass::arch::NamedBarrier compiles to a trap below sm_90,
// so anything that may be built for real sm_80 uses these instead.
//
// Barrier 0 is __syncthreads(). Ids handed to the collectives are template parameters so a
// kernel that embeds them can keep its own ids apart; the defaults below start above the ids
// CUTLASS reserves for its own epilogues (cutlass::arch::ReservedNamedBarriers, 1..7).

#include <cutlass/cutlass.h>

namespace flash_epilogue {

// Default barrier id of the dK/dV epilogues (CollectiveEpilogueBwd also takes the next one). A kernel
// that already uses these ids passes another.
inline constexpr int kDefaultEpilogueBarrierId = 8;
inline constexpr int kMaxNamedBarrierId = 15;  // hardware has 16 (0..15)

// All `num_threads` threads (a multiple of 32) wait until every one of them arrived.
CUTLASS_DEVICE void named_barrier_sync(int num_threads, int barrier_id) {
#if defined(__CUDA_ARCH__)
  asm volatile("bar.sync %0, %1;" : : "r"(barrier_id), "r"(num_threads) : "memory");
#endif
}

// Signal arrival without waiting: the matching named_barrier_sync (by other warps) completes once
// `num_threads` threads arrived or synced.
CUTLASS_DEVICE void named_barrier_arrive(int num_threads, int barrier_id) {
#if defined(__CUDA_ARCH__)
  asm volatile("bar.arrive %0, %1;" : : "r"(barrier_id), "r"(num_threads) : "memory");
#endif
}

}  // namespace flash_epilogue
