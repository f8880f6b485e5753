// C++ unit tests of the torch-free core and CPU kernels (no framework, no torch; run by ctest).
// Each check prints what failed; the exit status is the number of failed checks (capped at 100).
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <vector>

#include "cpu_kernels.h"
#include "test_maps.h"

using namespace fastopt;

static int failures = 0;

#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (!(cond)) {                                                \
      ++failures;                                                 \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                               \
      fprintf(stderr, "\n");                                      \
    }                                                             \
  } while (0)

// The specification: lowest index among the nearest (fp32 distance), scanning every code.
static int brute_nearest(const std::vector<float>& map, float x) {
  int best = 0;
  for (int j = 1; j < 256; ++j)
    if (fabsf(x - map[j]) < fabsf(x - map[best])) best = j;
  return best;
}

static void test_block_sizes() {
  for (int64_t b : {64, 128, 256, 512, 1024, 2048, 4096}) CHECK(valid_block_size(b), "%lld", (long long)b);
  for (int64_t b : {0, 1, 32, 63, 65, 100, 255, 8192, -256}) CHECK(!valid_block_size(b), "%lld", (long long)b);
  CHECK(quant_tile(64) == 1024 && quant_tile(1024) == 1024 && quant_tile(4096) == 4096, "quant_tile");
}

// div_fast (the GPU's division by one value, many times) against the IEEE division, bit for bit: every fp32
// significand of x in one binade (the result scales with x's exponent while nothing under- or overflows) for b
// of varied significands (1, all ones, random), quotients near a midpoint between two fp32 values, and random
// x, b over its exact range, the edges included; outside it, within an ulp (Divisor's use); the host's
// Divisor and Normalizer divide.
static uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}

static void test_divisor() {
  std::mt19937 rng(99);
  std::vector<float> bs = {1.0f, 1.5f, 0x1.fffffep0f, 0x1.000002p0f, 0x1.800002p0f, 0x1.7ffffep0f, 3.0f, 0.7f, 1e-3f};
  std::uniform_int_distribution<uint32_t> mant(0, (1u << 23) - 1);
  for (int i = 0; i < 7; ++i) bs.push_back(bits_float(0x3F800000u | mant(rng)));
  long bad = 0;
  for (float b : bs) {
    const float r = 1.0f / b;
    for (uint32_t m = 0; m < (1u << 23); ++m) {
      for (uint32_t e : {0x3F800000u, 0x3F000000u}) {  // x in [1, 2) and [0.5, 1): quotients on both sides of b
        const float x = bits_float(e | m);
        if (bits_of(div_fast(x, b, r)) != bits_of(x / b) || bits_of(div_fast(-x, b, r)) != bits_of(-x / b)) ++bad;
      }
    }
  }
  CHECK(bad == 0, "div_fast differs from the division for %ld x over every significand", bad);
  // Near-midpoint quotients: x = b (q + ulp(q) / 2) rounded, and its neighbours.
  std::uniform_real_distribution<float> unit(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-60, 59);
  bad = 0;
  long tried = 0;
  for (int i = 0; i < 200000; ++i) {
    const float b = ldexpf(unit(rng), expo(rng)), q = unit(rng);
    const double mid = ((double)q + (double)(nextafterf(q, 4.0f) - q) / 2.0) * (double)b;
    float x = (float)mid;
    for (int k = 0; k < 3; ++k, x = nextafterf(x, INFINITY)) {
      if (!div_fast_ok(x) || !div_fast_ok(b)) continue;
      ++tried;
      if (bits_of(div_fast(x, b, 1.0f / b)) != bits_of(x / b)) ++bad;
    }
  }
  CHECK(bad == 0 && tried > 500000, "div_fast differs at %ld of %ld near-midpoint quotients", bad, tried);
  // Random x and b over the range, the edges 2^-60 and 2^60 included.
  std::uniform_int_distribution<int> wide(-60, 60);
  bad = 0;
  for (int i = 0; i < 2000000; ++i) {
    float x = ldexpf(unit(rng), wide(rng)), b = ldexpf(unit(rng), wide(rng));
    if (i % 7 == 0) x = i % 2 ? kDivLo : kDivHi;
    if (i % 11 == 0) b = i % 2 ? kDivLo : kDivHi;
    if (!div_fast_ok(x) || !div_fast_ok(b)) continue;
    if (bits_of(div_fast(x, b, 1.0f / b)) != bits_of(x / b)) ++bad;
  }
  CHECK(bad == 0, "div_fast differs from the division for %ld random pairs", bad);
  CHECK(div_fast_ok(kDivLo) && div_fast_ok(-kDivHi) && !div_fast_ok(0.0f) && !div_fast_ok(NAN) &&
            !div_fast_ok(INFINITY) && !div_fast_ok(nextafterf(kDivLo, 0.0f)) && !div_fast_ok(nextafterf(kDivHi, 1e38f)),
        "div_fast_ok's range");
  // Outside the range (Divisor on a GPU): within one unit of the last place of the quotient, or of the
  // subnormal grid, for every x from the smallest subnormal to 2^127 and b of AdamW's sqrt(1 - beta2^t).
  std::uniform_int_distribution<int> any(-149, 127);
  std::uniform_real_distribution<float> bc(1e-3f, 1.0f);
  double worst = 0.0;
  for (int i = 0; i < 2000000; ++i) {
    const float x = ldexpf(unit(rng), any(rng)), b = bc(rng);
    const float got = div_fast(x, b, 1.0f / b), want = x / b;
    if (!std::isfinite(want)) continue;
    const float unit_last = fmaxf(nextafterf(fabsf(want), INFINITY) - fabsf(want), 0x1p-149f);
    worst = std::max(worst, (double)fabsf(got - want) / unit_last);
  }
  CHECK(worst <= 1.0, "div_fast outside its exact range: %g units of the last place off", worst);
  // What a GPU's Divisor sends to div_fast (fast_for): never an Inf or NaN (div_fast(Inf) is NaN, the division
  // Inf: AdamW's m / Inf = 0 became a NaN param), and every value it does send is within an ulp of the division.
  const Divisor<float> bc2(0.0316f);
  for (float x : {INFINITY, -INFINITY, NAN, 3e38f, nextafterf(kDivHi, INFINITY)})
    CHECK(!bc2.fast_for(x), "%g", (double)x);
  for (float x : {kDivHi, 1e-40f, 0.0f, 1e-10f, 7.5f}) {
    CHECK(bc2.fast_for(x), "%g", (double)x);
    const float got = div_fast(x, bc2.b, bc2.r), want = x / bc2.b;
    CHECK(fabsf(got - want) <= fmaxf(nextafterf(fabsf(want), INFINITY) - fabsf(want), 0x1p-149f),
          "div_fast(%g) = %g, division %g", (double)x, (double)got, (double)want);
  }
  CHECK(!Divisor<float>(INFINITY).fast_for(1.0f) && !Divisor<float>(0.0f).fast_for(1.0f), "fast_for's divisor");
  for (float x : {0.0f, -0.0f, 1e-30f, 3e30f, 0.3f, NAN, INFINITY}) {
    CHECK(bits_of(Divisor<float>(0.75f).divide(x)) == bits_of(x / 0.75f), "Divisor(%g)", (double)x);
    CHECK(bits_of(Normalizer(0.75f)(x)) == bits_of(normalize(x, 0.75f)), "Normalizer(%g)", (double)x);
  }
  CHECK(normalize(0.5f, 0.0f) == 0.0f && Normalizer(0.0f)(0.0f) == 0.0f && normalize(-3.0f, 4.0f) == -0.75f,
        "normalize");
}

// QuantLayout: for every block size, the slots of a quantization block's G threads (K each) cover the block
// exactly once, in runs of 4 (vector layout) and strided by G (element layout), within both instantiations.
template <int KMAX>
static void check_layout(int B) {
  const QuantLayout<KMAX> L(B);
  CHECK(L.Q * B == (int)quant_tile(B) && L.Q * L.G == kThreads && L.G * L.K == B && L.K <= KMAX && L.K % 4 == 0,
        "B=%d: Q=%d G=%d K=%d", B, L.Q, L.G, L.K);
  for (bool vec : {true, false}) {
    std::vector<int> hits(B, 0);
    for (int lane = 0; lane < L.G; ++lane)
      for (int k = 0; k < L.K; ++k) {
        const int o = L.slot(vec, lane, k);
        if (o >= 0 && o < B) ++hits[o];
        if (vec && k % 4) CHECK(o == L.slot(vec, lane, k - k % 4) + k % 4, "B=%d: run of 4 broken", B);
      }
    CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }), "B=%d vec=%d: not a cover", B, vec);
  }
}

static void test_quant_layout() {
  for (int B : {64, 128, 256, 512, 1024}) check_layout<4>(B);
  for (int B : {2048, 4096}) check_layout<16>(B);
}

static void test_search() {
  for (bool is_signed : {true, false}) {
    const std::vector<float> map = dynamic_map(is_signed);
    for (int j = 1; j < 256; ++j) CHECK(map[j - 1] < map[j], "map not strictly increasing at %d", j);
    SearchTables t;
    cpu::build_search_tables(map.data(), &t);
    std::vector<float> xs = {-1.0f, 1.0f, 0.0f, -0.0f, 1e-9f, -1e-9f, 0.5f, -0.5f};
    for (int j = 0; j < 256; ++j) {  // every code, its neighbours in fp32 and the midpoints to the next code
      xs.push_back(map[j]);
      xs.push_back(nextafterf(map[j], -2.0f));
      xs.push_back(nextafterf(map[j], 2.0f));
      if (j < 255) {
        const float mid = map[j] + (map[j + 1] - map[j]) / 2.0f;
        xs.push_back(mid);
        xs.push_back(nextafterf(mid, -2.0f));
        xs.push_back(nextafterf(mid, 2.0f));
      }
    }
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> u(is_signed ? -1.0f : 0.0f, 1.0f);
    for (int k = 0; k < 200000; ++k) xs.push_back(u(rng));
    std::normal_distribution<float> tiny(0.0f, 1e-4f);
    for (int k = 0; k < 20000; ++k) xs.push_back(is_signed ? tiny(rng) : fabsf(tiny(rng)));
    int bad = 0;
    for (float x : xs) {
      const int got = quantize_nearest(t, x), want = brute_nearest(map, x);
      if (got != want && bad++ < 5) CHECK(got == want, "signed=%d x=%.9g got %d want %d", (int)is_signed, x, got, want);
    }
    CHECK(bad == 0, "%d of %zu searches differ from the brute-force nearest code", bad, xs.size());
    for (int j = 0; j < 256; ++j) CHECK(dequantize_code(t, (uint8_t)j) == map[j], "dequantize_code(%d)", j);
  }
}

// The search's contract, written plainly: the largest j >= 1 with map[j] <= x (else 0), then its right
// neighbour when strictly nearer in fp32; NaN gives 0. (Equal to brute_nearest for every finite x.)
static int floor_nearest(const std::vector<float>& map, float x) {
  if (x != x) return 0;
  int f = (int)(std::upper_bound(map.begin() + 1, map.end(), x) - (map.begin() + 1));
  if (f < 255 && fabsf(x - map[f + 1]) < fabsf(x - map[f])) ++f;
  return f;
}

static float from_bits(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

// Every fp32 bit pattern near a key, a threshold or a bucket edge, and a stride through all 2^32 of them.
static void check_search_everywhere(const std::vector<float>& map, const char* name) {
  SearchTables t;
  cpu::build_search_tables(map.data(), &t);
  std::vector<float> centers = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY};
  for (int j = 0; j < 256; ++j) {
    centers.push_back(map[j]);
    if (j < 255) centers.push_back(t.thresh[j]);
  }
  for (int b = 0; b < kBuckets; ++b) {
    const float edge = from_bits(b == 0 ? 0u : kBucketLo + ((uint32_t)(b - 1) << (23 - kBucketBits)));
    centers.push_back(edge);
    centers.push_back(-edge);
  }
  int64_t bad = 0, n = 0;
  auto check = [&](float x) {
    ++n;
    const int got = quantize_nearest(t, x), want = floor_nearest(map, x);
    if (got != want && bad++ < 5) CHECK(got == want, "%s: x=%.9g (bits %08x) got %d want %d", name, x,
                                        (unsigned)float_bits(x), got, want);
  };
  for (float c : centers) {
    const uint32_t u = float_bits(c);
    for (int d = -40; d <= 40; ++d) {
      const int64_t v = (int64_t)u + d;
      if (v >= 0 && v <= 0xFFFFFFFFll && ((uint32_t)v >> 31) == (u >> 31)) check(from_bits((uint32_t)v));
    }
  }
  for (uint64_t v = 0; v <= 0xFFFFFFFFull; v += 997) check(from_bits((uint32_t)v));
  check(NAN);
  check(-NAN);
  CHECK(bad == 0, "%s: %lld of %lld searches differ from floor_nearest", name, (long long)bad, (long long)n);
  for (int j = 0; j + 1 < 255; ++j)
    CHECK(t.thresh[j] < t.thresh[j + 1] && t.thresh[j] > map[j] && t.thresh[j] <= map[j + 1], "%s thresh[%d]", name, j);
}

static void test_search_tables() {
  for (bool is_signed : {true, false}) {
    const std::vector<float> map = dynamic_map(is_signed);
    check_search_everywhere(map, is_signed ? "signed dynamic map" : "unsigned dynamic map");
    SearchTables t;
    cpu::build_search_tables(map.data(), &t);
    // One threshold compare per value is what makes the GPU search two dependent loads.
    CHECK(t.steps == 1, "signed=%d: %d steps, expected 1", (int)is_signed, t.steps);
  }
  // Any strictly increasing map
  const std::vector<float> crowded = crowded_map();
  SearchTables tc;
  cpu::build_search_tables(crowded.data(), &tc);
  CHECK(tc.steps > 10, "crowded map: %d steps", tc.steps);
  check_search_everywhere(crowded, "crowded map");
  // Keys outside [-1, 1], +-4 to +-2^65.5: the neighbours -4 and 4 lie over 2^31 apart in fp32 order (the
  // bisection's midpoint must not overflow), and every key sits past the last bucket's 1.0.
  std::vector<float> wide(256);
  for (int j = 0; j < 256; ++j) {
    const float e = 2.0f + 0.5f * (float)(j < 128 ? 127 - j : j - 128);
    wide[j] = (j < 128 ? -1.0f : 1.0f) * powf(2.0f, e);
  }
  check_search_everywhere(wide, "wide map");
}

static void test_quantize_roundtrip() {
  const std::vector<float> map = dynamic_map(true);
  SearchTables t;
  cpu::build_search_tables(map.data(), &t);
  float max_gap = 0.0f;
  for (int j = 1; j < 256; ++j) max_gap = std::max(max_gap, map[j] - map[j - 1]);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t B : {64, 256, 4096}) {
    for (int64_t n : {1, 63, 64, 65, 1000, 4097, 9000}) {
      std::vector<float> x(n), back(n);
      for (auto& v : x) v = nd(rng);
      if (n >= 2 * B) std::fill(x.begin() + B, x.begin() + 2 * B, 0.0f);  // a block of zeros
      std::vector<uint8_t> codes(n, 0xAB);
      std::vector<float> absmax(ceil_div(n, B), NAN);
      QuantEntry e{x.data(), codes.data(), absmax.data(), back.data(), n};
      int64_t ts[2];
      const int64_t total = cpu::fill_tile_start(&n, 1, quant_tile(B), ts);
      cpu::quantize_tiles(DType::F32, &e, ts, 1, B, t, 0, total);
      cpu::dequantize_tiles(DType::F32, &e, ts, 1, B, t, 0, total);
      for (int64_t b = 0; b < ceil_div(n, B); ++b) {
        float amax = 0.0f;
        for (int64_t i = b * B; i < std::min(n, (b + 1) * B); ++i) amax = std::max(amax, fabsf(x[i]));
        CHECK(absmax[b] == amax, "B=%lld n=%lld block %lld absmax %g want %g", (long long)B, (long long)n,
              (long long)b, absmax[b], amax);
      }
      int bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float a = absmax[i / B];
        const int want = brute_nearest(map, a > 0 ? x[i] / a : 0.0f);
        if (codes[i] != want || fabsf(back[i] - x[i]) > 0.5f * max_gap * a * 1.0001f) ++bad;
      }
      CHECK(bad == 0, "B=%lld n=%lld: %d elements wrong", (long long)B, (long long)n, bad);
      if (n >= 2 * B) CHECK(absmax[1] == 0.0f && codes[B] == 127 && back[B] == 0.0f, "zero block: code %d", codes[B]);
    }
  }
}

static void test_multi_tensor() {
  const std::vector<float> map = dynamic_map(false);
  SearchTables t;
  cpu::build_search_tables(map.data(), &t);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(0.0f, 3.0f);
  const int64_t B = 128;
  std::vector<int64_t> ns = {0, 5000, 1, 0, 2049, 128};
  std::vector<std::vector<double>> xs;
  std::vector<std::vector<uint8_t>> codes, codes1;
  std::vector<std::vector<float>> absmax, absmax1;
  std::vector<QuantEntry> entries;
  for (int64_t n : ns) {
    std::vector<double> x(n);
    for (auto& v : x) v = u(rng);
    xs.push_back(x);
    codes.emplace_back(n, 0);
    codes1.emplace_back(n, 0);
    absmax.emplace_back(ceil_div(n, B), -1.0f);
    absmax1.emplace_back(ceil_div(n, B), -1.0f);
  }
  for (size_t i = 0; i < ns.size(); ++i)
    entries.push_back({xs[i].data(), codes[i].data(), absmax[i].data(), nullptr, ns[i]});
  std::vector<int64_t> ts(ns.size() + 1);
  const int64_t total = cpu::fill_tile_start(ns.data(), (int)ns.size(), quant_tile(B), ts.data());
  CHECK(total == 0 + 5 + 1 + 0 + 3 + 1, "total tiles %lld", (long long)total);
  CHECK(find_tensor(ts.data(), (int)ns.size(), 0) == 1 && find_tensor(ts.data(), (int)ns.size(), 5) == 2 &&
            find_tensor(ts.data(), (int)ns.size(), 6) == 4 && find_tensor(ts.data(), (int)ns.size(), 9) == 5,
        "find_tensor skips empty tensors");
  for (int64_t b = 0; b < total; b += 2)  // uneven chunks, as parallel_for would cut them
    cpu::quantize_tiles(DType::F64, entries.data(), ts.data(), (int)ns.size(), B, t, b, std::min(total, b + 2));
  for (size_t i = 0; i < ns.size(); ++i) {  // each tensor alone, fp32-rounded input: the same codes
    std::vector<float> xf(xs[i].begin(), xs[i].end());
    QuantEntry e{xf.data(), codes1[i].data(), absmax1[i].data(), nullptr, ns[i]};
    int64_t ts1[2];
    const int64_t tot1 = cpu::fill_tile_start(&ns[i], 1, quant_tile(B), ts1);
    cpu::quantize_tiles(DType::F32, &e, ts1, 1, B, t, 0, tot1);
    CHECK(codes[i] == codes1[i] && absmax[i] == absmax1[i], "tensor %zu differs from its single-tensor run", i);
  }
}

static void test_conversions() {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {  // every fp16 value round-trips
    const float f = cpu::f16_to_float((uint16_t)h);
    if (isnan(f)) continue;
    if (cpu::float_to_f16(f) != h) ++bad;
  }
  CHECK(bad == 0, "%d fp16 values do not round-trip", bad);
  for (uint32_t h = 0; h < 0x7bff; ++h) {  // halfway between neighbours rounds to even; just off it, to nearest
    const float a = cpu::f16_to_float((uint16_t)h), b = cpu::f16_to_float((uint16_t)(h + 1));
    const float mid = a + (b - a) / 2.0f;
    const uint16_t even = (h & 1u) ? (uint16_t)(h + 1) : (uint16_t)h;
    if (cpu::float_to_f16(mid) != even || cpu::float_to_f16(nextafterf(mid, 0.0f)) != h ||
        cpu::float_to_f16(nextafterf(mid, 1e9f)) != h + 1)
      ++bad;
  }
  CHECK(bad == 0, "%d fp16 rounding errors", bad);
  CHECK(cpu::float_to_f16(65520.0f) == 0x7c00 && cpu::float_to_f16(65519.0f) == 0x7bff, "fp16 overflow");
  CHECK(cpu::float_to_f16(-INFINITY) == 0xfc00 && isnan(cpu::f16_to_float(cpu::float_to_f16(NAN))), "fp16 inf/nan");
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = cpu::bf16_to_float((uint16_t)b);
    if (!isnan(f) && cpu::float_to_bf16(f) != b) ++bad;
  }
  CHECK(bad == 0, "%d bf16 values do not round-trip", bad);
  CHECK(cpu::float_to_bf16(1.0f + 1.0f / 256.0f) == 0x3f80 && cpu::float_to_bf16(1.0f + 3.0f / 256.0f) == 0x3f82,
        "bf16 ties to even");
}

// The fused 8-bit step against a plain restatement of it (dequantize, AdamW in double, quantize), 12 steps.
static void test_adamw8bit() {
  const std::vector<float> m1 = dynamic_map(true), m2 = dynamic_map(false);
  SearchTables t1, t2;
  cpu::build_search_tables(m1.data(), &t1);
  cpu::build_search_tables(m2.data(), &t2);
  const int64_t B = 64, n = 1000;
  const AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1};
  std::mt19937 rng(11);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> p(n), pr(n), g(n);
  for (int64_t i = 0; i < n; ++i) p[i] = pr[i] = nd(rng);
  std::vector<uint8_t> c1(n, 0), c2(n, 0), r1(n, 0), r2(n, 0);
  std::vector<float> a1(ceil_div(n, B), 0.0f), a2(ceil_div(n, B), 0.0f), q1 = a1, q2 = a2;
  float step = 0.0f;
  AdamWEntry e{p.data(), g.data(), c1.data(), c2.data(), a1.data(), a2.data(), &step, n};
  int64_t ts[2];
  const int64_t total = cpu::fill_tile_start(&n, 1, quant_tile(B), ts);
  double moved = 0.0, diff = 0.0;
  for (int it = 0; it < 12; ++it) {
    for (auto& v : g) v = nd(rng);
    step += 1.0f;
    cpu::adamw8bit_tiles(DType::F64, &e, ts, 1, B, t1, t2, h, 0.5f, false, 0, total);
    const double bc1 = 1.0 - pow(0.9, step), bc2 = 1.0 - pow(0.999, step);
    for (int64_t b = 0; b < ceil_div(n, B); ++b) {
      const int64_t lo = b * B, hi = std::min(n, lo + B);
      std::vector<float> mf, vf;
      float n1 = 0.0f, n2 = 0.0f;
      for (int64_t i = lo; i < hi; ++i) {
        double m = (double)(m1[r1[i]] * q1[b]), v = (double)(m2[r2[i]] * q2[b]);
        const double gi = g[i] * 0.5;
        m = 0.9 * m + (1.0 - 0.9) * gi;
        v = 0.999 * v + (1.0 - 0.999) * gi * gi;
        pr[i] = pr[i] * (1.0 - 1e-2 * 0.1) - 1e-2 / bc1 * (m / (sqrt(v) / sqrt(bc2) + 1e-8));
        mf.push_back((float)m);
        vf.push_back((float)v);
        n1 = std::max(n1, fabsf((float)m));
        n2 = std::max(n2, (float)v);
      }
      q1[b] = n1;
      q2[b] = n2;
      for (int64_t i = lo; i < hi; ++i) {
        r1[i] = (uint8_t)brute_nearest(m1, n1 > 0 ? mf[i - lo] / n1 : 0.0f);
        r2[i] = (uint8_t)brute_nearest(m2, n2 > 0 ? vf[i - lo] / n2 : 0.0f);
      }
    }
  }
  int code_diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, fabs(p[i] - pr[i]));
    code_diff += (c1[i] != r1[i]) + (c2[i] != r2[i]);
  }
  for (int64_t i = 0; i < n; ++i) moved = std::max(moved, fabs(pr[i]));
  CHECK(code_diff == 0, "%d codes differ from the restatement", code_diff);
  CHECK(diff <= 1e-12 * moved, "params differ by %g", diff);
  CHECK(a1 == q1 && a2 == q2, "absmax differs from the restatement");
}

// The full-precision step against torch.optim.AdamW's formula in double, with a found_inf-free inv_scale.
static void test_adamw32() {
  const int64_t n = 3000;
  const AdamWHyper h{3e-3, 0.8, 0.99, 1e-6, 0.05};
  std::mt19937 rng(5);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> p(n), pr(n), g(n), m(n, 0.0), v(n, 0.0), mr(n, 0.0), vr(n, 0.0);
  for (int64_t i = 0; i < n; ++i) p[i] = pr[i] = nd(rng);
  float step = 0.0f;
  AdamWEntry e{p.data(), g.data(), m.data(), v.data(), nullptr, nullptr, &step, n};
  int64_t ts[2];
  const int64_t total = cpu::fill_tile_start(&n, 1, kTile32, ts);
  double err = 0.0;
  for (int it = 0; it < 10; ++it) {
    for (auto& x : g) x = nd(rng);
    step += 1.0f;
    cpu::adamw32_tiles(DType::F64, &e, ts, 1, h, 1.0f, false, 0, total);
    for (int64_t i = 0; i < n; ++i) {
      pr[i] *= 1.0 - 3e-3 * 0.05;
      mr[i] = 0.8 * mr[i] + 0.2 * g[i];
      vr[i] = 0.99 * vr[i] + (1.0 - 0.99) * g[i] * g[i];
      pr[i] -= 3e-3 / (1.0 - pow(0.8, step)) * mr[i] / (sqrt(vr[i]) / sqrt(1.0 - pow(0.99, step)) + 1e-6);
    }
  }
  for (int64_t i = 0; i < n; ++i) err = std::max(err, fabs(p[i] - pr[i]) + fabs(m[i] - mr[i]) + fabs(v[i] - vr[i]));
  CHECK(err < 1e-13, "adamw32 differs from the formula by %g", err);
}

int main() {
  test_block_sizes();
  test_divisor();
  test_quant_layout();
  test_search();
  test_search_tables();
  test_quantize_roundtrip();
  test_multi_tensor();
  test_conversions();
  test_adamw8bit();
  test_adamw32();
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  else printf("all core tests passed\n");
  return failures > 100 ? 100 : failures;
}
