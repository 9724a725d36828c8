#pragma once

// Runtime value -> compile-time constant, in the style of FlashAttention's static_switch.h: the
// body is a lambda in which NAME is a constexpr copy of the matched value. Torch-free, so the host
// bindings and the device-side config table share it. Every switch ends in a `default` that
// returns a value of the body's type built from the first case, so the caller must check the value
// beforehand (the argument checker does); the default is reached only for a value outside the table.
//
//   return HEADDIM_SWITCH(head_dim, kHeadDim, [&] { return launch<kHeadDim>(args); });

// The compiled head dims (tile widths). Keep scripts/generate_instantiations.py's HEAD_DIMS equal
// (tests/test_build.py checks it against the table flash_epilogue._C exports).
#define FLASH_EPILOGUE_HEAD_DIMS 64, 96, 128, 192, 256

#define HEADDIM_SWITCH(VALUE, NAME, ...)                         \
  [&] {                                                          \
    switch (VALUE) {                                             \
      case 96: { constexpr static int NAME = 96; return __VA_ARGS__(); }   \
      case 128: { constexpr static int NAME = 128; return __VA_ARGS__(); } \
      case 192: { constexpr static int NAME = 192; return __VA_ARGS__(); } \
      case 256: { constexpr static int NAME = 256; return __VA_ARGS__(); } \
      default: { constexpr static int NAME = 64; return __VA_ARGS__(); }   \
    }                                                            \
  }()

// The code path: 90 (sm_90: TMA collectives) or 80 (sm_80 collectives, also runnable on sm_90).
#define ARCH_SWITCH(VALUE, NAME, ...)                            \
  [&] {                                                          \
    if ((VALUE) == 90) { constexpr static int NAME = 90; return __VA_ARGS__(); } \
    constexpr static int NAME = 80;                              \
    return __VA_ARGS__();                                        \
  }()

// A boolean as a constant (bf16 vs fp16 outputs, batched vs varlen).
#define BOOL_SWITCH(COND, NAME, ...)                             \
  [&] {                                                          \
    if (COND) { constexpr static bool NAME = true; return __VA_ARGS__(); } \
    constexpr static bool NAME = false;                          \
    return __VA_ARGS__();                                        \
  }()
