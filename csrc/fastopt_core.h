// The torch-free core of fastopt's 8-bit block-wise format and fused 8-bit AdamW, shared by the C++ CPU
// kernels (cpu_kernels.cpp), the CUDA kernels (*.cu) and the C++ unit tests. No torch header here.
//
// Format (bitsandbytes' block-wise 8-bit format, so states interoperate):
//   x (any float dtype, any length n) is cut into blocks of B elements (B a power of two in [64, 4096];
//   the last block may be partial); absmax[b] = max |x| over block b (fp32); code[i] = argmin_j
//   |x_i / absmax[b] - map[j]| over the 256 sorted values `map` of a dynamic map (bitsandbytes'
//   create_dynamic_map, signed for first moments, unsigned for second moments). Ties go to the lower index
//   (bitsandbytes' CPU rule: the right neighbour only when strictly nearer). A block of zeros has absmax 0
//   and codes of 0.0. Dequantization: x_i = map[code_i] * absmax[b].
//
// Search: the nearest code is found with a branch-free descent of an Eytzinger (BFS-ordered) tree of the
// 255 keys map[1..255] (SearchTables::tree), which keeps shared-memory bank conflicts low on GPUs, then one
// compare of the two neighbours stored side by side (SearchTables::pairs). CPU and GPU run this same code.
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define FO_HD __host__ __device__ __forceinline__
#else
#define FO_HD inline
#endif

namespace fastopt {

constexpr int kCodeSize = 256;
constexpr int64_t kMinBlock = 64;
constexpr int64_t kMaxBlock = 4096;
// Elements per tile of the multi-tensor schedulers: a tile holds whole quantization blocks (max(B, 1024)
// elements) for the 8-bit kernels, and kTile32 elements for the fp32-state AdamW kernel.
constexpr int64_t kTileMin = 1024;
constexpr int64_t kTile32 = 1024;
constexpr int kThreads = 256;  // CUDA threads per block; the table builders assume exactly 256

enum class DType : int32_t { F32 = 0, F64 = 1, BF16 = 2, F16 = 3 };

FO_HD bool valid_block_size(int64_t b) { return b >= kMinBlock && b <= kMaxBlock && (b & (b - 1)) == 0; }
FO_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
FO_HD int64_t quant_tile(int64_t block_size) { return block_size > kTileMin ? block_size : kTileMin; }

// One tensor of a multi-tensor quantize/dequantize call. Quantize reads `x` (dtype of the call) and writes
// `codes`, `absmax`; dequantize reads `codes`, `absmax` and writes `out`. All fields are 8 bytes so that a
// host array of entries is copied to the device as is.
struct QuantEntry {
  const void* x;
  uint8_t* codes;
  float* absmax;
  void* out;
  int64_t n;
};

// One parameter of a fused AdamW call. 8-bit: s1/s2 are uint8 codes (signed / unsigned map), a1/a2 their
// fp32 block absmax. fp32 state: s1/s2 are float (double for fp64 params), a1/a2 unused. `step` points to the
// param's fp32 step count, already advanced for this step (read on the device: no host sync).
struct AdamWEntry {
  void* p;
  const void* g;
  void* s1;
  void* s2;
  float* a1;
  float* a2;
  const float* step;
  int64_t n;
};

static_assert(sizeof(QuantEntry) == 5 * 8, "QuantEntry must be five 8-byte fields");
static_assert(sizeof(AdamWEntry) == 8 * 8, "AdamWEntry must be eight 8-byte fields");

// Index i of the tensor that owns `tile`: the largest i with tile_start[i] <= tile (tensors with no tiles
// share their start with the next one, so they are skipped).
FO_HD int find_tensor(const int64_t* tile_start, int n_tensors, int64_t tile) {
  int lo = 0, hi = n_tensors - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// ---- nearest-code search -------------------------------------------------------------------------------

// In-order position (0..254) of Eytzinger node k (1..255) of the perfect binary tree of depth 8.
FO_HD int eytzinger_rank(int k) {
  int level = 0;
  while ((k >> (level + 1)) != 0) ++level;
  return ((2 * (k - (1 << level)) + 1) << (7 - level)) - 1;
}

struct SearchTables {
  float tree[kCodeSize];       // tree[k], k = 1..255: key map[1 + rank(k)]; tree[0] unused
  float pairs[2 * kCodeSize];  // pairs[2i] = map[i], pairs[2i + 1] = map[i + 1] (+inf for i = 255)
};

// Entry t (0..255) of the tables; a CUDA block of 256 threads fills them with one call per thread.
FO_HD void fill_search_entry(SearchTables& s, const float* map, int t) {
  s.tree[t] = t == 0 ? 0.0f : map[1 + eytzinger_rank(t)];
  s.pairs[2 * t] = map[t];
  s.pairs[2 * t + 1] = t + 1 < kCodeSize ? map[t + 1] : INFINITY;
}

// Nearest code of x (x / absmax of its block, in [-1, 1]). NaN gives code 0.
FO_HD uint8_t quantize_nearest(const SearchTables& s, float x) {
  int k = 1;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int level = 0; level < 8; ++level) k = 2 * k + (s.tree[k] <= x ? 1 : 0);
  int idx = k - kCodeSize;  // number of keys map[1..255] <= x: the largest j >= 1 with map[j] <= x, else 0
  float left = s.pairs[2 * idx], right = s.pairs[2 * idx + 1];
  idx += fabsf(x - right) < fabsf(x - left) ? 1 : 0;
  return (uint8_t)idx;
}

FO_HD float dequantize_code(const SearchTables& s, uint8_t c) { return s.pairs[2 * (int)c]; }

// x / absmax as the search expects it: fp32 IEEE division (bitsandbytes' CPU rule), 0 for a block of zeros.
// Values of other dtypes (fp64 states included) are rounded to fp32 first.
FO_HD float normalize(float x, float absmax) { return absmax > 0.0f ? x / absmax : 0.0f; }

// ---- AdamW ---------------------------------------------------------------------------------------------

FO_HD float fo_pow(float a, float b) { return powf(a, b); }
FO_HD double fo_pow(double a, double b) { return pow(a, b); }
FO_HD float fo_sqrt(float a) { return sqrtf(a); }
FO_HD double fo_sqrt(double a) { return sqrt(a); }
FO_HD float fo_abs(float a) { return fabsf(a); }
FO_HD double fo_abs(double a) { return fabs(a); }

struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay;
};

// Per-step scalars of torch's AdamW for step t (the step count after this step's increment):
//   p <- p (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
//   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
template <typename C>
struct AdamWScalars {
  C beta1, beta2, one_minus_beta1, one_minus_beta2, decay, step_size, sqrt_bc2, eps;
};

template <typename C>
FO_HD AdamWScalars<C> adamw_scalars(const AdamWHyper& h, float step) {
  AdamWScalars<C> s;
  const C t = (C)step;
  s.beta1 = (C)h.beta1;
  s.beta2 = (C)h.beta2;
  // Host-side constants in double, rounded once (as torch does with Python-float scalars).
  s.one_minus_beta1 = (C)(1.0 - h.beta1);
  s.one_minus_beta2 = (C)(1.0 - h.beta2);
  s.decay = (C)(1.0 - h.lr * h.weight_decay);
  s.step_size = (C)h.lr / ((C)1 - fo_pow(s.beta1, t));
  s.sqrt_bc2 = fo_sqrt((C)1 - fo_pow(s.beta2, t));
  s.eps = (C)h.eps;
  return s;
}

// One element: m and v in, updated in place; returns the new parameter value.
template <typename C>
FO_HD C adamw_element(C p, C g, C& m, C& v, const AdamWScalars<C>& s) {
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
  const C denom = fo_sqrt(v) / s.sqrt_bc2 + s.eps;
  return p * s.decay - s.step_size * (m / denom);
}

}  // namespace fastopt
