// The CUDA emulator's bfloat16 (see cuda_runtime.h): storage and round-to-nearest-even conversions.
#pragma once
#include "cuda_runtime.h"

struct __nv_bfloat16 {
  uint16_t x;
};

inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((uint32_t)b.x << 16); }

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x0040u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return {(uint16_t)(u >> 16)};
}
