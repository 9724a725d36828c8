#pragma once

// Global-memory counters that order CTAs: wait for a value (acquire); publish writes and increment (release).

#include <cutlass/cutlass.h>

namespace flash_epilogue {

CUTLASS_DEVICE int load_acquire_gpu(int const* ptr) {
  int value = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
#endif
  return value;
}

// Spin (one thread) until *ptr == value.
CUTLASS_DEVICE void semaphore_wait_eq(int const* ptr, int value) {
  while (load_acquire_gpu(ptr) != value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __nanosleep(32);
#endif
  }
}

// Publish everything this thread wrote (and, through the caller's barrier, the CTA's), then +1.
CUTLASS_DEVICE void semaphore_release_inc(int* ptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" : : "l"(ptr) : "memory");
#endif
}

}  // namespace flash_epilogue
