// CUDA unit test (ctest; no torch): the CUDA kernels against the CPU kernels on the same inputs, every dtype,
// several tensors per launch (the multi-tensor schedule: empty and one-element tensors, partial last blocks,
// per-tensor AdamW steps), whole blocks in vectors and tensors one element off their alignment.
// Exits 77 (ctest: skipped) when no CUDA device is present. Built against csrc/tests/emu (the CUDA emulator,
// FASTOPT_CUDA_EMULATOR) it runs on the CPU, where the results must equal the CPU kernels' bit for bit; on a GPU,
// contracted multiply-adds leave AdamW's values a few ulp apart and codes a neighbour apart at near-ties.
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <vector>

#include "cpu_kernels.h"
#include "cuda_kernels.h"
#include "test_maps.h"

using namespace fastopt;

#if defined(FASTOPT_CUDA_EMULATOR)
constexpr bool kExact = true;
#else
constexpr bool kExact = false;
#endif

static int failures = 0;
#define CHECK(cond, ...)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      ++failures;                                                                     \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);       \
      fprintf(stderr, __VA_ARGS__);                                                   \
      fprintf(stderr, "\n");                                                          \
    }                                                                                 \
  } while (0)
#define CUDA_OK(expr)                                                                 \
  do {                                                                                \
    cudaError_t err_ = (expr);                                                        \
    if (err_ != cudaSuccess) {                                                        \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

static const char* dtype_name(DType d) {
  return d == DType::F32 ? "fp32" : d == DType::F64 ? "fp64" : d == DType::BF16 ? "bf16" : "fp16";
}
static size_t dtype_size(DType d) { return d == DType::F64 ? 8 : d == DType::F32 ? 4 : 2; }

// A tensor of `dtype` as raw bytes, on the host and at `shift` elements into a device allocation.
struct Buf {
  DType dtype;
  size_t elem;
  int64_t n;
  int shift;
  std::vector<uint8_t> host;
  uint8_t* alloc = nullptr;

  Buf(DType d, size_t e, int64_t count, int sh) : dtype(d), elem(e), n(count), shift(sh), host(count * e, 0) {}
  void* dev() const { return alloc + shift * elem; }
  void upload() {
    if (alloc == nullptr) CUDA_OK(cudaMalloc(&alloc, (n + shift + 1) * elem));
    if (n) CUDA_OK(cudaMemcpy(dev(), host.data(), n * elem, cudaMemcpyHostToDevice));
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> v(n * elem);
    if (n) CUDA_OK(cudaMemcpy(v.data(), dev(), n * elem, cudaMemcpyDeviceToHost));
    return v;
  }
  double value(const std::vector<uint8_t>& bytes, int64_t i) const {  // element i of `bytes`, as double
    const uint8_t* p = bytes.data() + i * elem;
    if (dtype == DType::F64) { double v; memcpy(&v, p, 8); return v; }
    if (dtype == DType::F32) { float v; memcpy(&v, p, 4); return v; }
    uint16_t b;
    memcpy(&b, p, 2);
    return dtype == DType::BF16 ? cpu::bf16_to_float(b) : cpu::f16_to_float(b);
  }
  void set(int64_t i, double v) {
    uint8_t* p = host.data() + i * elem;
    if (dtype == DType::F64) { memcpy(p, &v, 8); return; }
    const float f = (float)v;
    if (dtype == DType::F32) { memcpy(p, &f, 4); return; }
    const uint16_t b = dtype == DType::BF16 ? cpu::float_to_bf16(f) : cpu::float_to_f16(f);
    memcpy(p, &b, 2);
  }
};

static Buf floats(DType d, int64_t n, int shift, std::mt19937& rng, double scale = 1.0) {
  Buf b(d, dtype_size(d), n, shift);
  std::normal_distribution<double> nd(0.0, scale);
  for (int64_t i = 0; i < n; ++i) b.set(i, nd(rng));
  return b;
}
static Buf bytes(int64_t n, int shift, std::mt19937& rng) {
  Buf b(DType::F32, 1, n, shift);
  for (auto& v : b.host) v = (uint8_t)(rng() & 0xFF);
  return b;
}
static Buf absmaxes(int64_t n, std::mt19937& rng) {  // block absmax: positive, some zero
  Buf b(DType::F32, 4, n, 0);
  std::uniform_real_distribution<float> u(0.0f, 2.0f);
  for (int64_t i = 0; i < n; ++i) b.set(i, i % 7 == 3 ? 0.0f : u(rng));
  return b;
}

template <typename T>
static T* to_dev(const std::vector<T>& v) {
  T* d = nullptr;
  CUDA_OK(cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)));
  if (!v.empty()) CUDA_OK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

static std::vector<float> linear_map(bool is_signed) {  // any sorted 256-value map serves the comparison
  std::vector<float> m(256);
  for (int j = 0; j < 256; ++j) m[j] = is_signed ? -1.0f + 2.0f * j / 255.0f : (float)j / 255.0f;
  m[255] = 1.0f;
  return m;
}

// Tensor sizes of one multi-tensor launch: partial blocks, an empty and a one-element tensor, whole tiles.
static std::vector<int64_t> sizes(int64_t B) { return {3000, 0, 1, 2 * quant_tile(B), 21000 + 7}; }

// Quantizes tensors of `dtype` (codes and absmax against the CPU kernel's), then dequantizes the codes into
// tensors of `dtype` (against the CPU kernel's: one product per value, equal on a GPU too).
static void test_quant(int64_t B, const std::vector<float>& map, int shift, DType dtype) {
  SearchTables t;
  cpu::build_search_tables(map.data(), &t);
  const std::vector<int64_t> ns = sizes(B);
  std::mt19937 rng(1);
  std::vector<Buf> xs, codes, am, outs;  // codes, absmax and outs start as garbage: every value must be written
  std::vector<QuantEntry> host_e, dev_e;
  for (int64_t n : ns) {
    xs.push_back(floats(dtype, n, shift, rng));
    codes.push_back(bytes(n, shift, rng));
    am.push_back(absmaxes(ceil_div(n, B), rng));
    outs.push_back(floats(dtype, n, shift, rng));
  }
  for (size_t i = 0; i < ns.size(); ++i) {
    for (Buf* b : {&xs[i], &codes[i], &am[i], &outs[i]}) b->upload();
    host_e.push_back({xs[i].host.data(), codes[i].host.data(), (float*)am[i].host.data(), outs[i].host.data(),
                      ns[i]});
    dev_e.push_back({xs[i].dev(), (uint8_t*)codes[i].dev(), (float*)am[i].dev(), outs[i].dev(), ns[i]});
  }
  std::vector<int64_t> ts(ns.size() + 1);
  const int64_t total = cpu::fill_tile_start(ns.data(), (int)ns.size(), quant_tile(B), ts.data());
  int64_t* d_ts = to_dev(ts);
  QuantEntry* d_e = to_dev(dev_e);
  float* d_map = to_dev(map);
  // found_inf set: nothing is written.
  float* d_fi = to_dev(std::vector<float>{1.0f});
  CUDA_OK(cuda::quantize(dtype, d_ts, d_e, (int)ns.size(), total, B, d_map, d_fi, 0));
  CUDA_OK(cudaDeviceSynchronize());
  for (size_t i = 0; i < ns.size(); ++i)
    CHECK(codes[i].download() == codes[i].host, "quantize B=%lld %s: found_inf launch wrote", (long long)B,
          dtype_name(dtype));
  cpu::quantize_tiles(dtype, host_e.data(), ts.data(), (int)ns.size(), B, t, 0, total);
  cpu::dequantize_tiles(dtype, host_e.data(), ts.data(), (int)ns.size(), B, t, 0, total);
  CUDA_OK(cuda::quantize(dtype, d_ts, d_e, (int)ns.size(), total, B, d_map, nullptr, 0));
  CUDA_OK(cuda::dequantize(dtype, d_ts, d_e, (int)ns.size(), total, B, d_map, 0));
  CUDA_OK(cudaDeviceSynchronize());
  for (size_t i = 0; i < ns.size(); ++i) {
    CHECK(codes[i].download() == codes[i].host, "quantize B=%lld shift %d %s tensor %zu: codes differ",
          (long long)B, shift, dtype_name(dtype), i);
    CHECK(am[i].download() == am[i].host, "quantize B=%lld shift %d %s tensor %zu: absmax differs", (long long)B,
          shift, dtype_name(dtype), i);
    CHECK(outs[i].download() == outs[i].host, "dequantize B=%lld shift %d %s tensor %zu: values differ",
          (long long)B, shift, dtype_name(dtype), i);
  }
}

// Agreement of AdamW's results between a GPU and the host, relative to the tensor's largest value (an element
// can cancel to near zero): a few ulp of the dtype (or of the fp32 compute, for bf16 and fp16 that round it).
static double adamw_rtol(DType d) {
  return d == DType::F64 ? 1e-12 : d == DType::F32 ? 1e-5 : d == DType::BF16 ? 1.0 / 128 : 1.0 / 1024;
}

// Compares the device's values of `b` with its host values (the CPU kernel's): equal under the emulator,
// within adamw_rtol of its largest value on a GPU.
static void check_values(const Buf& b, const char* what, int64_t B, int shift, size_t i) {
  const std::vector<uint8_t> got = b.download();
  if (kExact) {
    CHECK(got == b.host, "%s B=%lld shift %d %s tensor %zu: differs", what, (long long)B, shift,
          dtype_name(b.dtype), i);
    return;
  }
  double worst = 0.0, largest = 0.0;
  for (int64_t j = 0; j < b.n; ++j) {
    const double x = b.value(got, j), y = b.value(b.host, j);
    worst = std::max(worst, fabs(x - y));
    largest = std::max(largest, fabs(y));
  }
  CHECK(worst <= adamw_rtol(b.dtype) * largest, "%s B=%lld shift %d %s tensor %zu: differs by %g of %g", what,
        (long long)B, shift, dtype_name(b.dtype), i, worst, largest);
}

// 8-bit codes: equal under the emulator; on a GPU a neighbour at most, for at most 1 in 1000.
static void check_codes(const Buf& b, const char* what, int64_t B, int shift, DType dtype, size_t i) {
  const std::vector<uint8_t> got = b.download();
  if (kExact) {
    CHECK(got == b.host, "%s B=%lld shift %d %s tensor %zu: codes differ", what, (long long)B, shift,
          dtype_name(dtype), i);
    return;
  }
  int64_t far = 0, near = 0;
  for (int64_t j = 0; j < b.n; ++j) {
    const int d = abs((int)got[j] - (int)b.host[j]);
    far += d > 1;
    near += d == 1;
  }
  CHECK(far == 0 && near <= b.n / 1000,
        "%s B=%lld shift %d %s tensor %zu: %lld codes off by more than one, %lld by one", what, (long long)B,
        shift, dtype_name(dtype), i, (long long)far, (long long)near);
}

// 8-bit AdamW (adamw8bit) or full-precision state (adamw32, when B == 0) over several tensors, each with its own
// step count, from random states.
static void test_adamw(int64_t B, const std::vector<float>& m1, const std::vector<float>& m2, int shift,
                       DType dtype) {
  const bool eight = B > 0;
  SearchTables t1, t2;
  if (eight) {
    cpu::build_search_tables(m1.data(), &t1);
    cpu::build_search_tables(m2.data(), &t2);
  }
  const std::vector<int64_t> ns = sizes(eight ? B : kTile32);
  const DType state = dtype == DType::F64 ? DType::F64 : DType::F32;
  std::mt19937 rng(2);
  std::vector<Buf> p, g, s1, s2, a1, a2;
  std::vector<float> steps;
  for (size_t i = 0; i < ns.size(); ++i) {
    const int64_t n = ns[i], nb = eight ? ceil_div(n, B) : 0;
    p.push_back(floats(dtype, n, shift, rng));
    g.push_back(floats(dtype, n, shift, rng, 4.0));
    if (eight) {
      s1.push_back(bytes(n, shift, rng));
      s2.push_back(bytes(n, shift, rng));
    } else {
      s1.push_back(floats(state, n, shift, rng, 0.1));
      s2.push_back(floats(state, n, shift, rng, 0.1));
      for (int64_t j = 0; j < n; ++j) s2.back().set(j, fabs(s2.back().value(s2.back().host, j)));
    }
    a1.push_back(absmaxes(nb, rng));
    a2.push_back(absmaxes(nb, rng));
    steps.push_back((float)(1 + 3 * i));
  }
  std::vector<AdamWEntry> host_e, dev_e;
  float* d_steps = to_dev(steps);
  for (size_t i = 0; i < ns.size(); ++i) {
    for (Buf* b : {&p[i], &g[i], &s1[i], &s2[i], &a1[i], &a2[i]}) b->upload();
    host_e.push_back({p[i].host.data(), g[i].host.data(), s1[i].host.data(), s2[i].host.data(),
                      (float*)a1[i].host.data(), (float*)a2[i].host.data(), &steps[i], ns[i]});
    dev_e.push_back({p[i].dev(), g[i].dev(), s1[i].dev(), s2[i].dev(), (float*)a1[i].dev(), (float*)a2[i].dev(),
                     d_steps + i, ns[i]});
  }
  const AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01};
  const float inv = 0.25f;
  std::vector<int64_t> ts(ns.size() + 1);
  const int64_t total =
      cpu::fill_tile_start(ns.data(), (int)ns.size(), eight ? quant_tile(B) : kTile32, ts.data());
  int64_t* d_ts = to_dev(ts);
  AdamWEntry* d_e = to_dev(dev_e);
  float *d_m1 = to_dev(m1), *d_m2 = to_dev(m2), *d_inv = to_dev(std::vector<float>{inv});
  float* d_fi = to_dev(std::vector<float>{1.0f});
  const int n = (int)ns.size();
  auto launch = [&](const float* fi) {
    if (eight) CUDA_OK(cuda::adamw8bit(dtype, d_ts, d_e, n, total, B, d_m1, d_m2, h, d_inv, fi, 0));
    else CUDA_OK(cuda::adamw32(dtype, d_ts, d_e, n, total, h, d_inv, fi, 0));
    CUDA_OK(cudaDeviceSynchronize());
  };
  launch(d_fi);  // found_inf set: nothing is written
  for (size_t i = 0; i < ns.size(); ++i)
    CHECK(p[i].download() == p[i].host && s1[i].download() == s1[i].host && a2[i].download() == a2[i].host &&
              g[i].download() == g[i].host,
          "adamw B=%lld %s tensor %zu: found_inf launch wrote", (long long)B, dtype_name(dtype), i);
  // with an inv_scale the kernels store the unscaled gradient over the gradient (GradScaler's fused path)
  if (eight) cpu::adamw8bit_tiles(dtype, host_e.data(), ts.data(), n, B, t1, t2, h, inv, true, 0, total);
  else cpu::adamw32_tiles(dtype, host_e.data(), ts.data(), n, h, inv, true, 0, total);
  launch(nullptr);
  const char* what = eight ? "adamw8bit" : "adamw32";
  for (size_t i = 0; i < ns.size(); ++i) {
    check_values(p[i], what, B, shift, i);
    check_values(g[i], what, B, shift, i);
    if (eight) {
      check_codes(s1[i], what, B, shift, dtype, i);
      check_codes(s2[i], what, B, shift, dtype, i);
      check_values(a1[i], what, B, shift, i);
      check_values(a2[i], what, B, shift, i);
    } else {
      check_values(s1[i], what, B, shift, i);
      check_values(s2[i], what, B, shift, i);
    }
  }
}

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  const DType dtypes[] = {DType::F32, DType::BF16, DType::F16, DType::F64};
  for (int shift : {0, 1}) {  // whole blocks in vectors, and (shifted) element by element
    for (int64_t B : {64, 256, 1024, 2048, 4096}) {
      // the maps' search tables are built on the host for the CPU kernels and by every CUDA block for its own
      for (const auto& map : {linear_map(true), dynamic_map(false), crowded_map()})
        test_quant(B, map, shift, DType::F32);
      for (DType d : dtypes) {
        if (d != DType::F32) test_quant(B, dynamic_map(true), shift, d);
        test_adamw(B, dynamic_map(true), dynamic_map(false), shift, d);
      }
      test_adamw(B, linear_map(true), linear_map(false), shift, DType::F32);
    }
    for (DType d : dtypes) test_adamw(0, {}, {}, shift, d);
  }
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  else printf("all CUDA tests passed\n");
  return failures > 100 ? 100 : failures;
}
