// CUDA unit test (ctest; no torch): the CUDA kernels against the CPU kernels on the same inputs.
// Exits 77 (ctest: skipped) when no CUDA device is present.
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>

#include <algorithm>
#include <random>
#include <vector>

#include "cpu_kernels.h"
#include "cuda_kernels.h"
#include "test_maps.h"

using namespace fastopt;

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

template <typename T>
static T* to_dev(const std::vector<T>& v) {
  T* d = nullptr;
  CUDA_OK(cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)));
  if (!v.empty()) CUDA_OK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
static std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  if (n) CUDA_OK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

template <typename T>
static std::vector<T> shifted(const std::vector<T>& v, int shift) {  // `shift` zeros, then v
  std::vector<T> out(shift, T(0));
  out.insert(out.end(), v.begin(), v.end());
  return out;
}

static std::vector<float> linear_map(bool is_signed) {  // any sorted 256-value map serves the comparison
  std::vector<float> m(256);
  for (int j = 0; j < 256; ++j) m[j] = is_signed ? -1.0f + 2.0f * j / 255.0f : (float)j / 255.0f;
  m[255] = 1.0f;
  return m;
}

// shift: the device tensors start that many elements into their allocations (1: no vector loads or stores).
static void test_quantize(int64_t B, const std::vector<float>& map, int shift) {
  SearchTables t;
  cpu::build_search_tables(map.data(), &t);
  std::vector<int64_t> ns = {3000, 0, 1, 70000};
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::vector<float>> xs;
  std::vector<QuantEntry> host_entries, dev_entries;
  std::vector<std::vector<uint8_t>> codes;
  std::vector<std::vector<float>> absmax;
  std::vector<uint8_t*> d_codes;
  std::vector<float*> d_absmax;
  for (int64_t n : ns) {
    std::vector<float> x(n);
    for (auto& v : x) v = nd(rng);
    xs.push_back(x);
    codes.emplace_back(n, 0);
    absmax.emplace_back(ceil_div(n, B), 0.0f);
  }
  for (size_t i = 0; i < ns.size(); ++i) {
    host_entries.push_back({xs[i].data(), codes[i].data(), absmax[i].data(), nullptr, ns[i]});
    d_codes.push_back(to_dev(shifted(codes[i], shift)) + shift);
    d_absmax.push_back(to_dev(absmax[i]));
    dev_entries.push_back({to_dev(shifted(xs[i], shift)) + shift, d_codes[i], d_absmax[i], nullptr, ns[i]});
  }
  std::vector<int64_t> ts(ns.size() + 1);
  const int64_t total = cpu::fill_tile_start(ns.data(), (int)ns.size(), quant_tile(B), ts.data());
  cpu::quantize_tiles(DType::F32, host_entries.data(), ts.data(), (int)ns.size(), B, t, 0, total);
  int64_t* d_ts = to_dev(ts);
  QuantEntry* d_e = to_dev(dev_entries);
  float* d_map = to_dev(map);
  CUDA_OK(cuda::quantize(DType::F32, d_ts, d_e, (int)ns.size(), total, B, d_map, nullptr, 0));
  CUDA_OK(cudaDeviceSynchronize());
  for (size_t i = 0; i < ns.size(); ++i) {
    CHECK(to_host(d_codes[i], ns[i]) == codes[i], "B=%lld shift %d tensor %zu: codes differ", (long long)B, shift,
          i);
    CHECK(to_host(d_absmax[i], absmax[i].size()) == absmax[i], "B=%lld shift %d tensor %zu: absmax differs",
          (long long)B, shift, i);
  }
}

static void test_adamw8bit(int64_t B, const std::vector<float>& m1, const std::vector<float>& m2, int shift) {
  SearchTables t1, t2;
  cpu::build_search_tables(m1.data(), &t1);
  cpu::build_search_tables(m2.data(), &t2);
  const int64_t n = 50000, nb = ceil_div(n, B);
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> p(n), g(n), a1(nb, 0.0f), a2(nb, 0.0f);
  std::vector<uint8_t> c1(n, 127), c2(n, 0);
  for (auto& v : p) v = nd(rng);
  float step = 1.0f, inv = 0.25f;
  float *d_p = to_dev(shifted(p, shift)) + shift, *d_g, *d_a1 = to_dev(a1), *d_a2 = to_dev(a2);
  float* d_step = to_dev(std::vector<float>{1.0f});
  uint8_t *d_c1 = to_dev(shifted(c1, shift)) + shift, *d_c2 = to_dev(shifted(c2, shift)) + shift;
  float* d_inv = to_dev(std::vector<float>{inv});
  const AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01};
  int64_t ts[2];
  const int64_t total = cpu::fill_tile_start(&n, 1, quant_tile(B), ts);
  for (auto& v : g) v = nd(rng);
  d_g = to_dev(shifted(g, shift)) + shift;
  AdamWEntry he{p.data(), g.data(), c1.data(), c2.data(), a1.data(), a2.data(), &step, n};
  AdamWEntry de{d_p, d_g, d_c1, d_c2, d_a1, d_a2, d_step, n};
  cpu::adamw8bit_tiles(DType::F32, &he, ts, 1, B, t1, t2, h, inv, 0, total);
  int64_t* d_ts = to_dev(std::vector<int64_t>{ts[0], ts[1]});
  AdamWEntry* d_e = to_dev(std::vector<AdamWEntry>{de});
  float *d_m1 = to_dev(m1), *d_m2 = to_dev(m2);
  CUDA_OK(cuda::adamw8bit(DType::F32, d_ts, d_e, 1, total, B, d_m1, d_m2, h, d_inv, nullptr, 0));
  CUDA_OK(cudaDeviceSynchronize());
  // The GPU may contract a*b+c into one fma: values agree to a few ulp, codes to a neighbour at near-ties.
  const std::vector<float> gp = to_host(d_p, n);
  const std::vector<uint8_t> g1 = to_host(d_c1, n), g2 = to_host(d_c2, n);
  double dp = 0.0;
  int far = 0, near = 0;
  for (int64_t i = 0; i < n; ++i) {
    dp = std::max(dp, (double)fabsf(gp[i] - p[i]) / (fabsf(p[i]) + 1e-30));
    const int d1 = abs((int)g1[i] - (int)c1[i]), d2 = abs((int)g2[i] - (int)c2[i]);
    far += d1 > 1 || d2 > 1;
    near += d1 == 1 || d2 == 1;
  }
  CHECK(dp < 1e-5, "B=%lld shift %d: params differ by %g (relative)", (long long)B, shift, dp);
  CHECK(far == 0 && near <= n / 1000, "B=%lld shift %d: %d codes off by more than one, %d by one", (long long)B,
        shift, far, near);
  // found_inf: nothing changes.
  float* d_fi = to_dev(std::vector<float>{1.0f});
  const std::vector<float> before = to_host(d_p, n);
  CUDA_OK(cuda::adamw8bit(DType::F32, d_ts, d_e, 1, total, B, d_m1, d_m2, h, d_inv, d_fi, 0));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(to_host(d_p, n) == before && to_host(d_c1, n) == g1, "B=%lld shift %d: found_inf step wrote", (long long)B,
        shift);
}

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  for (int64_t B : {64, 256, 1024, 2048, 4096}) {
    for (int shift : {0, 1}) {  // whole blocks in vectors, and (shifted) element by element
      // the maps' search tables are built on the host for the CPU kernels and by every CUDA block for its own
      for (const auto& map : {linear_map(true), dynamic_map(true), crowded_map()}) test_quantize(B, map, shift);
      test_adamw8bit(B, linear_map(true), linear_map(false), shift);
      test_adamw8bit(B, dynamic_map(true), dynamic_map(false), shift);
    }
  }
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  else printf("all CUDA tests passed\n");
  return failures > 100 ? 100 : failures;
}
