#pragma once

// Hopper's bulk reduce-add from shared to global memory (no TMA descriptor: any 16-byte aligned range)
// and its bulk-group waits. CUTLASS 4.2 has no such copy op.

#include <cstdint>

#include <cutlass/cutlass.h>

namespace flash_epilogue {

// L2 eviction policies as cache-hint operands (the values CUTLASS uses for TMA::CacheHintSm90).
inline constexpr uint64_t kCacheHintEvictNormal = 0x1000000000000000ull;
inline constexpr uint64_t kCacheHintEvictLast = 0x14F0000000000000ull;

// Below sm_90 these compile to nothing (an sm_80 build never calls them).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FLASH_EPILOGUE_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define FLASH_EPILOGUE_SM90_ASM(...)
#endif

// gmem[0:bytes) += smem[0:bytes) as fp32, asynchronously, in the calling thread's bulk group.
// bytes: a multiple of 16; both addresses 16-byte aligned.
CUTLASS_DEVICE void bulk_reduce_add_f32(float* gmem, float const* smem, uint32_t bytes,
                                        uint64_t cache_hint = kCacheHintEvictLast) {
  FLASH_EPILOGUE_SM90_ASM("cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32"
                          " [%0], [%1], %2, %3;"
                          :
                          : "l"(gmem), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))), "r"(bytes),
                            "l"(cache_hint)
                          : "memory");
}

CUTLASS_DEVICE void bulk_commit_group() { FLASH_EPILOGUE_SM90_ASM("cp.async.bulk.commit_group;" ::: "memory"); }

// Until the calling thread's bulk groups have *read* their shared memory (it may be reused).
CUTLASS_DEVICE void bulk_wait_read() { FLASH_EPILOGUE_SM90_ASM("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Until the calling thread's bulk groups are *complete*: their global writes are performed.
// This, not bulk_wait_read, is what may precede telling another CTA that the data is there.
CUTLASS_DEVICE void bulk_wait_complete() { FLASH_EPILOGUE_SM90_ASM("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Orders this thread's generic-proxy and async-proxy accesses to global memory.
CUTLASS_DEVICE void fence_proxy_async_global() { FLASH_EPILOGUE_SM90_ASM("fence.proxy.async.global;" ::: "memory"); }

#undef FLASH_EPILOGUE_SM90_ASM

}  // namespace flash_epilogue
