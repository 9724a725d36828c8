#pragma once

// Raw named barriers: CUTLASS's cutlass::arch::NamedBarrier compiles to a trap below sm_90. Barrier 0 is
// __syncthreads(); the default ids start above CUTLASS's reserved 1..7 (ReservedNamedBarriers).

#include <cutlass/cutlass.h>

namespace flash_epilogue {

// Default barrier id of the epilogues (CollectiveEpilogueBwd also takes the next one).
inline constexpr int kDefaultEpilogueBarrierId = 8;
inline constexpr int kMaxNamedBarrierId = 15;  // hardware has 16 (0..15)

// All `num_threads` threads (a multiple of 32) wait until every one of them arrived.
CUTLASS_DEVICE void named_barrier_sync(int num_threads, int barrier_id) {
#if defined(__CUDA_ARCH__)
  asm volatile("bar.sync %0, %1;" : : "r"(barrier_id), "r"(num_threads) : "memory");
#endif
}

// Arrive without waiting: the matching sync completes once `num_threads` threads arrived or synced.
CUTLASS_DEVICE void named_barrier_arrive(int num_threads, int barrier_id) {
#if defined(__CUDA_ARCH__)
  asm volatile("bar.arrive %0, %1;" : : "r"(barrier_id), "r"(num_threads) : "memory");
#endif
}

}  // namespace flash_epilogue
