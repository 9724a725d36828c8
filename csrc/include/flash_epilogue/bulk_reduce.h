#pragma once

// The project's own wrappers for Hopper's bulk reduce-add from shared to global memory
// (cp.reduce.async.bulk ... .add.f32, no TMA descriptor: works on any 16-byte aligned range, so
// also for varlen) and the bulk-group waits around it. CUTLASS 4.2 has no such copy op.

#include <cstdint>

#include <cutlass/cutlass.h>

namespace flash_epilogue {

// L2 eviction policies as cache-hint operands (the values CUTLASS uses for TMA::CacheHintSm90).
inline constexpr uint64_t kCacheHintEvictNormal = 0x1000000000000000ull;
inline constexpr uint64_t kCacheHintEvictLast = 0x14F0000000000000ull;

// gmem[0:bytes) += smem[0:bytes) as fp32, asynchronously, in the calling thread's bulk group.
// bytes: a multiple of 16; both addresses 16-byte aligned.
CUTLASS_DEVICE void bulk_reduce_add_f32(float* gmem, float const* smem, uint32_t bytes,
                                        uint64_t cache_hint = kCacheHintEvictLast) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t const smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, %3;"
               :
               : "l"(gmem), "r"(smem_addr), "r"(bytes), "l"(cache_hint)
               : "memory");
#endif
}

CUTLASS_DEVICE void bulk_commit_group() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// Until the calling thread's bulk groups have *read* their shared memory (it may be reused).
CUTLASS_DEVICE void bulk_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}

// Until the calling thread's bulk groups are *complete*: their global writes are performed.
// This, not bulk_wait_read, is what may precede telling another CTA that the data is there.
CUTLASS_DEVICE void bulk_wait_complete() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

// Orders this thread's generic-proxy and async-proxy accesses to global memory.
CUTLASS_DEVICE void fence_proxy_async_global() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
}

}  // namespace flash_epilogue
