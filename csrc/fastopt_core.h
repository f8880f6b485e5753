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
// Search: the nearest code is the number of decision thresholds <= x, where threshold c (between codes c and
// c + 1) is the smallest fp32 value that the rule above sends to code c + 1 (the rule is monotone in x, so
// this is exact, ties included). A table indexed by the sign, binade and top kBucketBits mantissa bits of x
// gives that count at the low end of x's bucket; `steps` compares with the next thresholds finish it (one
// for both dynamic maps). On a GPU that is two dependent shared-memory loads per value instead of the nine of
// a binary search. The tables come from the map alone (build_search_tables, or a CUDA block in its
// prologue), so any strictly increasing map works. CPU and GPU run this same code.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

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

// How a CUDA block of kThreads threads covers one tile of quant_tile(B) elements: Q quantization blocks per
// tile, G threads per quantization block, K elements per thread (K = 4 for every B up to kTileMin: the
// KMAX = 4 instantiations know it at compile time; 8 or 16 above). A thread's K elements of a whole
// quantization block whose tensors are aligned are K / 4 runs of 4 consecutive ones, each one vector load or
// store per tensor (`slot`, vec = true; a warp still reads one contiguous span); those of a partial last block
// or of an unaligned tensor are strided by G, one element per load (vec = false). The C++ test checks that
// both cover every block exactly once.
template <int KMAX>
struct QuantLayout {
  int Q, G, K;
  FO_HD explicit QuantLayout(int B) {
    Q = B >= (int)kTileMin ? 1 : (int)kTileMin / B;
    G = kThreads / Q;
    K = KMAX == 4 ? 4 : B / G;
  }
  // Offset in its quantization block of the thread's element k.
  FO_HD int slot(bool vec, int lane, int k) const {
    return vec ? 4 * (lane + (k >> 2) * G) + (k & 3) : lane + k * G;
  }
};

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

FO_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

FO_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// Buckets of |x| (per sign): [0, 2^-24), then kBucketBits mantissa bits of each binade up to 1.0, then
// [1.0, inf] (and NaN, which the search sends to code 0 on its own).
constexpr int kBucketBits = 7;
constexpr uint32_t kBucketLo = 0x33800000u;  // 2^-24
constexpr uint32_t kBucketHi = 0x3F800000u;  // 1.0
constexpr int kBuckets = 2 + (int)((kBucketHi - kBucketLo) >> (23 - kBucketBits));  // per sign

struct SearchTables {
  float keys[kCodeSize];            // the map: dequantization
  float thresh[kCodeSize];          // thresh[c], c < 255: the smallest x coded c + 1; thresh[255] = NaN
  uint8_t start[2 * kBuckets];      // #{c : thresh[c] <= lowest x of the bucket}; sign-major
  int steps;                        // the most thresholds inside one bucket, at least 1
};

// Index into SearchTables::start of x's bucket.
FO_HD int search_bucket(float x) {
  const uint32_t u = float_bits(x), a = u & 0x7FFFFFFFu;
  const int b = a < kBucketLo ? 0 : a >= kBucketHi ? kBuckets - 1 : 1 + (int)((a - kBucketLo) >> (23 - kBucketBits));
  return (u >> 31) != 0 ? kBuckets + b : b;
}

// The rule between neighbours l < r: code of r when strictly nearer in fp32 (ties to the lower index).
FO_HD bool nearer_right(float x, float l, float r) { return fabsf(x - r) < fabsf(x - l); }

// fp32 values in a total order as integers (-0.0 and +0.0 both 0), and back.
FO_HD int32_t float_order(float x) {
  const uint32_t u = float_bits(x);
  return (u >> 31) != 0 ? -(int32_t)(u & 0x7FFFFFFFu) : (int32_t)u;
}
FO_HD float order_float(int32_t o) { return o >= 0 ? bits_float((uint32_t)o) : -bits_float((uint32_t)(-o)); }

// Step 1 of building the tables, entry t (0..255): keys[t], and thresh[t] by bisection over the fp32 values
// in (map[t], map[t + 1]]. A CUDA block of 256 threads does it with one call per thread.
FO_HD void fill_search_key(SearchTables& s, const float* map, int t) {
  s.keys[t] = map[t];
  if (t + 1 >= kCodeSize) {
    s.thresh[t] = NAN;  // no code above 255: never <= x
    return;
  }
  const float l = map[t], r = map[t + 1];
  int32_t lo = float_order(l) + 1, hi = float_order(r);  // r itself goes right (distance 0)
  while (lo < hi) {
    const int32_t mid = (int32_t)(((int64_t)lo + (int64_t)hi) >> 1);  // hi - lo may not fit in int32
    if (nearer_right(order_float(mid), l, r)) hi = mid; else lo = mid + 1;
  }
  s.thresh[t] = order_float(lo);
}

// The keys alone: all that dequantization reads.
FO_HD void fill_search_keys_only(SearchTables& s, const float* map) {
  for (int t = 0; t < kCodeSize; ++t) s.keys[t] = map[t];
}

// #{c < 255 : thresh[c] <= v}, thresholds sorted.
FO_HD int count_thresholds(const SearchTables& s, float v) {
  int c = 0;
  for (int step = 128; step > 0; step >>= 1) c += s.thresh[c + step - 1] <= v ? step : 0;
  return c;
}

// Step 2, after every fill_search_key: start[j] (0 <= j < 2 * kBuckets); returns how many thresholds fall
// inside bucket j, which `steps` must cover.
FO_HD int fill_search_start(SearchTables& s, int j) {
  const int b = j % kBuckets;
  const bool neg = j >= kBuckets;
  const uint32_t lo = b == 0 ? 0u : kBucketLo + ((uint32_t)(b - 1) << (23 - kBucketBits));
  const uint32_t hi = b == kBuckets - 1 ? 0x7F800000u : kBucketLo + ((uint32_t)b << (23 - kBucketBits)) - 1;
  const float low = neg ? -bits_float(hi) : bits_float(lo), high = neg ? -bits_float(lo) : bits_float(hi);
  const int first = count_thresholds(s, low);
  s.start[j] = (uint8_t)first;
  return count_thresholds(s, high) - first;
}

// Nearest code of x (x / absmax of its block, in [-1, 1]; any fp32 value works). NaN gives code 0. `steps`:
// s.steps, which a CUDA kernel reads once into a register. The first compare is unconditional (steps >= 1) and
// the loop is kept rolled: for the dynamic maps (steps == 1) the search is then one table load, one threshold
// compare and a branch that is never taken, where a loop over a count read from shared memory per call cost
// about 20 instructions (unrolled by 4, with its remainder).
FO_HD uint8_t quantize_nearest(const SearchTables& s, float x, int steps) {
  int c = s.start[search_bucket(x)];
  c += s.thresh[c] <= x ? 1 : 0;
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int i = 1; i < steps; ++i) c += s.thresh[c] <= x ? 1 : 0;
  return x == x ? (uint8_t)c : (uint8_t)0;
}
FO_HD uint8_t quantize_nearest(const SearchTables& s, float x) { return quantize_nearest(s, x, s.steps); }

FO_HD float dequantize_code(const SearchTables& s, uint8_t c) { return s.keys[c]; }

// ---- many values divided by one -------------------------------------------------------------------------
// x / b, the IEEE quotient bit for bit, from r = 1 / b (correctly rounded) in three operations: q0 = x r, then
// Markstein's correction q0 + (x - q0 b) r, each rounded once (an fma). Exact where x and b both lie in
// [2^-60, 2^60] in magnitude: the quotient is then a normal number and the remainder x - q0 b exactly
// representable. A CUDA kernel dividing many values by one b (a quantization block's absmax, AdamW's
// sqrt(1 - beta2^t)) takes r once and skips the division's own reciprocal and range check (FCHK and its slow
// path) per value. The C++ test compares it with the division over every fp32 significand of x for a set of
// b, at the range's edges, and on near-midpoint quotients.
constexpr float kDivLo = 0x1p-60f, kDivHi = 0x1p60f;

FO_HD bool div_fast_ok(float v) { return fabsf(v) >= kDivLo && fabsf(v) <= kDivHi; }

FO_HD float div_fast(float x, float b, float r) {
#if defined(__CUDA_ARCH__)
  const float q0 = __fmul_rn(x, r);
  return __fmaf_rn(__fmaf_rn(-q0, b, x), r, q0);
#else
  const float q0 = x * r;
  return fmaf(fmaf(-q0, b, x), r, q0);
#endif
}

// Division by one b, many times (AdamW's sqrt(v) / sqrt(1 - beta2^t)): on a GPU, div_fast while b is in its
// range (checked once) and |x| <= kDivHi (`fast_for`: one compare; an Inf or NaN x divides, since div_fast would
// give NaN for x = Inf, where the division gives Inf and the update m / Inf = 0): the IEEE quotient for x in
// range, within one unit of the last place (of the subnormal grid, for tiny quotients) below it, where the GPU's
// contracted multiply-adds elsewhere in the update already differ from the host's by as much. The host divides
// (the same quotients, without a software fma where the CPU has none). fp64: the division.
template <typename C>
struct Divisor {
  C b = (C)1;
  Divisor() = default;
  FO_HD explicit Divisor(C d) : b(d) {}
  FO_HD C divide(C x) const { return x / b; }
};

template <>
struct Divisor<float> {
  float b = 1.0f, r = 1.0f;
  bool fast = true;  // b in div_fast's range
  Divisor() = default;
  FO_HD explicit Divisor(float d) : b(d), r(1.0f / d), fast(div_fast_ok(d)) {}
  FO_HD bool fast_for(float x) const { return fast && fabsf(x) <= kDivHi; }
  FO_HD float divide(float x) const {
#if defined(__CUDA_ARCH__)
    if (fast_for(x)) return div_fast(x, b, r);
#endif
    return x / b;
  }
};

// x / absmax as the search expects it: fp32 IEEE division (bitsandbytes' CPU rule), 0 for a block of zeros.
// Values of other dtypes (fp64 states included) are rounded to fp32 first.
FO_HD float normalize(float x, float absmax) { return absmax > 0.0f ? x / absmax : 0.0f; }

// normalize(x, absmax) for the values x of the block whose absmax it is (|x| <= absmax, or NaN), bit for bit
// (the codes must be the host's): on a GPU, div_fast where absmax > 0 is in its range (checked once) and
// |x| >= kDivLo (then |x| <= absmax keeps x in range too; a NaN fails the check and divides).
struct Normalizer {
  Divisor<float> d;
  bool fast;
  FO_HD explicit Normalizer(float absmax) : d(absmax), fast(d.fast && absmax > 0.0f) {}
  FO_HD float operator()(float x) const {
#if defined(__CUDA_ARCH__)
    if (fast && fabsf(x) >= kDivLo) return div_fast(x, d.b, d.r);
#endif
    return normalize(x, d.b);
  }
};

// ---- AdamW ---------------------------------------------------------------------------------------------

FO_HD float fo_expm1(float a) { return expm1f(a); }
FO_HD double fo_expm1(double a) { return expm1(a); }
FO_HD float fo_sqrt(float a) { return sqrtf(a); }
FO_HD double fo_sqrt(double a) { return sqrt(a); }
FO_HD float fo_abs(float a) { return fabsf(a); }
FO_HD double fo_abs(double a) { return fabs(a); }

// log(beta1), log(beta2) are taken here, on the host, in double (log(0) = -inf: a bias correction of 1), and
// kept rounded to fp32 as well: the kernels for fp32 math read those (a double read and converted on the device
// cost the fp16 AdamW8bit kernel its last registers: 16 bytes of spills at 3 blocks per SM).
struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay, log_beta1, log_beta2;
  float log_beta1_f, log_beta2_f;
  AdamWHyper(double lr_, double beta1_, double beta2_, double eps_, double weight_decay_)
      : lr(lr_), beta1(beta1_), beta2(beta2_), eps(eps_), weight_decay(weight_decay_), log_beta1(log(beta1_)),
        log_beta2(log(beta2_)), log_beta1_f((float)log_beta1), log_beta2_f((float)log_beta2) {}
  FO_HD float log_beta(int k, float) const { return k == 1 ? log_beta1_f : log_beta2_f; }
  FO_HD double log_beta(int k, double) const { return k == 1 ? log_beta1 : log_beta2; }
};

// Per-step scalars of torch's AdamW for step t (the step count after this step's increment):
//   p <- p (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
//   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
template <typename C>
struct AdamWScalars {
  C beta1, beta2, one_minus_beta1, one_minus_beta2, decay, step_size, eps;
  Divisor<C> sqrt_bc2;  // sqrt(1 - b2^t), divided by
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
  // 1 - b^t as -expm1(t log b), log b from the double hyperparameter (as fastopt.reference.adamw8bit): 1 - (C)b^t
  // rounds b first, and 1 - b^t multiplies that rounding by 1 / (1 - b) (fp32, b2 = 0.9999: 8e-5 of the update;
  // 0.99999: 7e-4; torch's AdamW, in double: 1e-7).
  s.step_size = (C)h.lr / -fo_expm1(t * h.log_beta(1, C()));
  s.sqrt_bc2 = Divisor<C>(fo_sqrt(-fo_expm1(t * h.log_beta(2, C()))));
  s.eps = (C)h.eps;
  return s;
}

// One element: m and v in, updated in place; returns the new parameter value.
template <typename C>
FO_HD C adamw_element(C p, C g, C& m, C& v, const AdamWScalars<C>& s) {
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
  const C denom = s.sqrt_bc2.divide(fo_sqrt(v)) + s.eps;
  return p * s.decay - s.step_size * (m / denom);
}

}  // namespace fastopt
