#pragma once

// Runtime value -> compile-time constant, as in FlashAttention's static_switch.h:
//   return HEADDIM_SWITCH(head_dim, kHeadDim, [&] { return launch<kHeadDim>(args); });
// A value outside the table falls to the first case: callers check values beforehand.

// FA3's tile head dims; a build may disable some (FLASH_EPILOGUE_DISABLE_HDIM<d>, from setup.py), and
// FLASH_EPILOGUE_HEAD_DIMS lists those compiled. Keep scripts/generate_instantiations.py's HEAD_DIMS equal.
#define FLASH_EPILOGUE_ALL_HEAD_DIMS 64, 96, 128, 192, 256

#ifdef FLASH_EPILOGUE_DISABLE_HDIM64
#define FE_IF_HDIM64(...)
#else
#define FE_IF_HDIM64(...) __VA_ARGS__
#endif
#ifdef FLASH_EPILOGUE_DISABLE_HDIM96
#define FE_IF_HDIM96(...)
#else
#define FE_IF_HDIM96(...) __VA_ARGS__
#endif
#ifdef FLASH_EPILOGUE_DISABLE_HDIM128
#define FE_IF_HDIM128(...)
#else
#define FE_IF_HDIM128(...) __VA_ARGS__
#endif
#ifdef FLASH_EPILOGUE_DISABLE_HDIM192
#define FE_IF_HDIM192(...)
#else
#define FE_IF_HDIM192(...) __VA_ARGS__
#endif
#ifdef FLASH_EPILOGUE_DISABLE_HDIM256
#define FE_IF_HDIM256(...)
#else
#define FE_IF_HDIM256(...) __VA_ARGS__
#endif

// An initializer list of the compiled head dims (a trailing comma is allowed there).
#define FLASH_EPILOGUE_HEAD_DIMS \
  FE_IF_HDIM64(64, ) FE_IF_HDIM96(96, ) FE_IF_HDIM128(128, ) FE_IF_HDIM192(192, ) FE_IF_HDIM256(256, )

#if defined(FLASH_EPILOGUE_DISABLE_HDIM64) && defined(FLASH_EPILOGUE_DISABLE_HDIM96) && \
    defined(FLASH_EPILOGUE_DISABLE_HDIM128) && defined(FLASH_EPILOGUE_DISABLE_HDIM192) && \
    defined(FLASH_EPILOGUE_DISABLE_HDIM256)
#error "flash_epilogue: every head dim is disabled (FLASH_EPILOGUE_DISABLE_HDIM*)"
#endif
inline constexpr int kFlashEpilogueHeadDims[] = {FLASH_EPILOGUE_HEAD_DIMS};  // the first is HEADDIM_SWITCH's default

#define HEADDIM_SWITCH(VALUE, NAME, ...)                                                  \
  [&] {                                                                                   \
    switch (VALUE) {                                                                      \
      FE_IF_HDIM96(case 96: { constexpr static int NAME = 96; return __VA_ARGS__(); })    \
      FE_IF_HDIM128(case 128: { constexpr static int NAME = 128; return __VA_ARGS__(); }) \
      FE_IF_HDIM192(case 192: { constexpr static int NAME = 192; return __VA_ARGS__(); }) \
      FE_IF_HDIM256(case 256: { constexpr static int NAME = 256; return __VA_ARGS__(); }) \
      default: { constexpr static int NAME = ::kFlashEpilogueHeadDims[0]; return __VA_ARGS__(); } \
    }                                                                                     \
  }()

// NAME = COND ? A : B, a constant of TYPE.
#define FE_CONDITION_SWITCH(COND, TYPE, NAME, A, B, ...)               \
  [&] {                                                                \
    if (COND) { constexpr static TYPE NAME = A; return __VA_ARGS__(); } \
    constexpr static TYPE NAME = B;                                    \
    return __VA_ARGS__();                                              \
  }()

// The code path: 90 (sm_90: TMA collectives) or 80 (sm_80 collectives, also runnable on sm_90). A build may leave the
// sm_80 path out (FLASH_EPILOGUE_NO_SM80_PATH, from setup.py's FLASH_EPILOGUE_SM80_PATH); the checks then refuse it
// before any launch, and ARCH_SWITCH instantiates the sm_90 path alone.
#ifdef FLASH_EPILOGUE_NO_SM80_PATH
inline constexpr bool kFlashEpilogueSm80Path = false;
#define ARCH_SWITCH(VALUE, NAME, ...) \
  [&] {                               \
    constexpr static int NAME = 90;   \
    return __VA_ARGS__();             \
  }()
#else
inline constexpr bool kFlashEpilogueSm80Path = true;
#define ARCH_SWITCH(VALUE, NAME, ...) FE_CONDITION_SWITCH((VALUE) == 90, int, NAME, 90, 80, __VA_ARGS__)
#endif
#define BOOL_SWITCH(COND, NAME, ...) FE_CONDITION_SWITCH(COND, bool, NAME, true, false, __VA_ARGS__)
