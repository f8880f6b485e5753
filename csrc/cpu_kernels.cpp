// CPU kernels: see cpu_kernels.h. Scalar code over whole quantization blocks; the caller parallelizes
// over tiles.
#include "cpu_kernels.h"

#include <string.h>

#include <algorithm>

namespace fastopt {
namespace cpu {

// ---- storage types -------------------------------------------------------------------------------------

float bf16_to_float(uint16_t b) {
  uint32_t bits = (uint32_t)b << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    float f = (float)mant * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  if (exp == 31) bits = sign | 0x7f800000u | (mant << 13);
  else bits = sign | ((exp + 112u) << 23) | (mant << 13);
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                                    // below 2^-14: subnormal or zero
    float a;
    memcpy(&a, &ax, 4);
    // a * 2^24 is exact; round half to even onto the subnormal grid (0x400 is the smallest normal).
    const float scaled = a * 16777216.0f;
    uint32_t m = (uint32_t)scaled;
    const float rem = scaled - (float)m;
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return (uint16_t)(sign | m);
  }
  uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13));
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is correct
  return (uint16_t)(sign | h);
}

namespace {

struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

inline float load(const float* p, int64_t i) { return p[i]; }
inline double load(const double* p, int64_t i) { return p[i]; }
inline float load(const bf16* p, int64_t i) { return bf16_to_float(p[i].bits); }
inline float load(const f16* p, int64_t i) { return f16_to_float(p[i].bits); }

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(double* p, int64_t i, double v) { p[i] = v; }
inline void store(bf16* p, int64_t i, float v) { p[i].bits = float_to_bf16(v); }
inline void store(f16* p, int64_t i, float v) { p[i].bits = float_to_f16(v); }

template <typename T> struct ComputeOf { using type = float; };
template <> struct ComputeOf<double> { using type = double; };

void quantize_run(const SearchTables& t, const float* x, float absmax, uint8_t* codes, int64_t n) {
  for (int64_t i = 0; i < n; ++i) codes[i] = quantize_nearest(t, normalize(x[i], absmax));
}

template <typename F>
void for_each_tile(const int64_t* tile_start, int n_tensors, int64_t tile_begin, int64_t tile_end, F&& f) {
  if (tile_begin >= tile_end) return;
  int i = find_tensor(tile_start, n_tensors, tile_begin);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    while (tile >= tile_start[i + 1]) ++i;
    f(i, tile - tile_start[i]);
  }
}

template <typename T>
void quantize_impl(const QuantEntry* entries, const int64_t* tile_start, int n_tensors, int64_t B,
                   const SearchTables& tables, int64_t tile_begin, int64_t tile_end) {
  const int64_t tile = quant_tile(B);
  for_each_tile(tile_start, n_tensors, tile_begin, tile_end, [&](int i, int64_t local) {
    const QuantEntry& e = entries[i];
    const T* x = static_cast<const T*>(e.x);
    const int64_t end = local * tile + tile < e.n ? local * tile + tile : e.n;
    for (int64_t start = local * tile; start < end; start += B) {
      const int64_t stop = start + B < e.n ? start + B : e.n;
      float xf[kMaxBlock];
      float amax = 0.0f;
      for (int64_t j = start; j < stop; ++j) {
        xf[j - start] = (float)load(x, j);
        amax = fmaxf(amax, fabsf(xf[j - start]));
      }
      e.absmax[start / B] = amax;
      quantize_run(tables, xf, amax, e.codes + start, stop - start);
    }
  });
}

template <typename T>
void dequantize_impl(const QuantEntry* entries, const int64_t* tile_start, int n_tensors, int64_t B,
                     const SearchTables& tables, int64_t tile_begin, int64_t tile_end) {
  const int64_t tile = quant_tile(B);
  for_each_tile(tile_start, n_tensors, tile_begin, tile_end, [&](int i, int64_t local) {
    const QuantEntry& e = entries[i];
    T* out = static_cast<T*>(e.out);
    const int64_t end = local * tile + tile < e.n ? local * tile + tile : e.n;
    for (int64_t start = local * tile; start < end; start += B) {
      const int64_t stop = start + B < e.n ? start + B : e.n;
      const float scale = e.absmax[start / B];
      for (int64_t j = start; j < stop; ++j)
        store(out, j, (typename ComputeOf<T>::type)(dequantize_code(tables, e.codes[j]) * scale));
    }
  });
}

// STORE (GradScaler's fused path, a scale given): the unscaled gradient, in the gradient's dtype, is written back
// over the gradient as the pass reads it (torch's fused optimizers leave p.grad so). Without a scale, no store.
template <typename T, bool STORE>
void adamw8bit_impl(const AdamWEntry* entries, const int64_t* tile_start, int n_tensors, int64_t B,
                    const SearchTables& t1, const SearchTables& t2, const AdamWHyper& h, float inv_scale,
                    int64_t tile_begin, int64_t tile_end) {
  using C = typename ComputeOf<T>::type;
  const int64_t tile = quant_tile(B);
  float mq[kMaxBlock], vq[kMaxBlock];
  int last = -1;
  AdamWScalars<C> s{};
  for_each_tile(tile_start, n_tensors, tile_begin, tile_end, [&](int i, int64_t local) {
    const AdamWEntry& e = entries[i];
    if (i != last) {
      s = adamw_scalars<C>(h, *e.step);
      last = i;
    }
    T* p = static_cast<T*>(e.p);
    T* g = static_cast<T*>(const_cast<void*>(e.g));
    uint8_t* c1 = static_cast<uint8_t*>(e.s1);
    uint8_t* c2 = static_cast<uint8_t*>(e.s2);
    const int64_t end = local * tile + tile < e.n ? local * tile + tile : e.n;
    for (int64_t start = local * tile; start < end; start += B) {
      const int64_t stop = start + B < e.n ? start + B : e.n;
      const int64_t b = start / B;
      const float am1 = e.a1[b], am2 = e.a2[b];
      float new1 = 0.0f, new2 = 0.0f;
      for (int64_t j = start; j < stop; ++j) {
        C m = (C)(dequantize_code(t1, c1[j]) * am1);
        C v = (C)(dequantize_code(t2, c2[j]) * am2);
        const C gj = (C)load(g, j) * (C)inv_scale;
        if (STORE) store(g, j, gj);
        store(p, j, adamw_element<C>((C)load(p, j), gj, m, v, s));
        const float mf = (float)m, vf = (float)v;
        mq[j - start] = mf;
        vq[j - start] = vf;
        new1 = fmaxf(new1, fabsf(mf));
        new2 = fmaxf(new2, fabsf(vf));
      }
      e.a1[b] = new1;
      e.a2[b] = new2;
      quantize_run(t1, mq, new1, c1 + start, stop - start);
      quantize_run(t2, vq, new2, c2 + start, stop - start);
    }
  });
}

template <typename T, bool STORE>
void adamw32_impl(const AdamWEntry* entries, const int64_t* tile_start, int n_tensors, const AdamWHyper& h,
                  float inv_scale, int64_t tile_begin, int64_t tile_end) {
  using C = typename ComputeOf<T>::type;
  int last = -1;
  AdamWScalars<C> s{};
  for_each_tile(tile_start, n_tensors, tile_begin, tile_end, [&](int i, int64_t local) {
    const AdamWEntry& e = entries[i];
    if (i != last) {
      s = adamw_scalars<C>(h, *e.step);
      last = i;
    }
    T* p = static_cast<T*>(e.p);
    T* g = static_cast<T*>(const_cast<void*>(e.g));
    C* m = static_cast<C*>(e.s1);
    C* v = static_cast<C*>(e.s2);
    const int64_t end = local * kTile32 + kTile32 < e.n ? local * kTile32 + kTile32 : e.n;
    for (int64_t j = local * kTile32; j < end; ++j) {
      C mj = m[j], vj = v[j];
      const C gj = (C)load(g, j) * (C)inv_scale;
      if (STORE) store(g, j, gj);
      store(p, j, adamw_element<C>((C)load(p, j), gj, mj, vj, s));
      m[j] = mj;
      v[j] = vj;
    }
  });
}

}  // namespace

int64_t fill_tile_start(const int64_t* numels, int n_tensors, int64_t tile, int64_t* tile_start) {
  int64_t total = 0;
  for (int i = 0; i < n_tensors; ++i) {
    tile_start[i] = total;
    total += ceil_div(numels[i], tile);
  }
  tile_start[n_tensors] = total;
  return total;
}

void build_search_tables(const float* map, SearchTables* out) {
  for (int t = 0; t < kCodeSize; ++t) fill_search_key(*out, map, t);
  out->steps = 1;
  for (int j = 0; j < 2 * kBuckets; ++j) out->steps = std::max(out->steps, fill_search_start(*out, j));
}

#define FASTOPT_DISPATCH(dtype, F, ...)                  \
  switch (dtype) {                                       \
    case DType::F32: F<float>(__VA_ARGS__); break;       \
    case DType::F64: F<double>(__VA_ARGS__); break;      \
    case DType::BF16: F<bf16>(__VA_ARGS__); break;       \
    case DType::F16: F<f16>(__VA_ARGS__); break;         \
  }
#define FASTOPT_DISPATCH_STORE(dtype, store, F, ...)                                     \
  switch (dtype) {                                                                      \
    case DType::F32: (store ? F<float, true> : F<float, false>)(__VA_ARGS__); break;    \
    case DType::F64: (store ? F<double, true> : F<double, false>)(__VA_ARGS__); break;  \
    case DType::BF16: (store ? F<bf16, true> : F<bf16, false>)(__VA_ARGS__); break;     \
    case DType::F16: (store ? F<f16, true> : F<f16, false>)(__VA_ARGS__); break;        \
  }

void quantize_tiles(DType dtype, const QuantEntry* entries, const int64_t* tile_start, int n_tensors,
                    int64_t block_size, const SearchTables& tables, int64_t tile_begin, int64_t tile_end) {
  FASTOPT_DISPATCH(dtype, quantize_impl, entries, tile_start, n_tensors, block_size, tables, tile_begin, tile_end)
}

void dequantize_tiles(DType dtype, const QuantEntry* entries, const int64_t* tile_start, int n_tensors,
                      int64_t block_size, const SearchTables& tables, int64_t tile_begin, int64_t tile_end) {
  FASTOPT_DISPATCH(dtype, dequantize_impl, entries, tile_start, n_tensors, block_size, tables, tile_begin,
                   tile_end)
}

void adamw8bit_tiles(DType dtype, const AdamWEntry* entries, const int64_t* tile_start, int n_tensors,
                     int64_t block_size, const SearchTables& t1, const SearchTables& t2, const AdamWHyper& h,
                     float inv_scale, bool store_grad, int64_t tile_begin, int64_t tile_end) {
  FASTOPT_DISPATCH_STORE(dtype, store_grad, adamw8bit_impl, entries, tile_start, n_tensors, block_size, t1, t2, h,
                         inv_scale, tile_begin, tile_end)
}

void adamw32_tiles(DType dtype, const AdamWEntry* entries, const int64_t* tile_start, int n_tensors,
                   const AdamWHyper& h, float inv_scale, bool store_grad, int64_t tile_begin, int64_t tile_end) {
  FASTOPT_DISPATCH_STORE(dtype, store_grad, adamw32_impl, entries, tile_start, n_tensors, h, inv_scale, tile_begin,
                         tile_end)
}

#undef FASTOPT_DISPATCH
#undef FASTOPT_DISPATCH_STORE

}  // namespace cpu
}  // namespace fastopt
