// The CUDA emulator's half (see cuda_runtime.h): storage and round-to-nearest-even conversions (GCC's _Float16).
#pragma once
#include <stdint.h>
#include <string.h>

struct __half {
  uint16_t x;
};

inline float __half2float(__half h) {
  _Float16 f;
  memcpy(&f, &h.x, 2);
  return (float)f;
}

inline __half __float2half_rn(float v) {
  const _Float16 f = (_Float16)v;
  __half h;
  memcpy(&h.x, &f, 2);
  return h;
}
