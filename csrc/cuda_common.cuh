// Device helpers shared by the CUDA kernels (torch-free).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fastopt_core.h"

// FASTOPT_LAUNCH: kernel<<<grid, threads, 0, stream>>>(args...). The C++ unit tests' CUDA emulator
// (csrc/tests/emu) defines it first, as a call: g++ does not parse <<<>>>.
// Shared memory is declared with FASTOPT_SHARED (one T) and FASTOPT_SHARED_ARRAY (T name[n]), which the emulator
// defines as statics that it fills with garbage before every block.
#ifndef FASTOPT_LAUNCH
#define FASTOPT_LAUNCH(kernel, grid, threads, stream, ...) kernel<<<grid, threads, 0, stream>>>(__VA_ARGS__)
#define FASTOPT_SHARED(T, name) __shared__ T name
#define FASTOPT_SHARED_ARRAY(T, name, n) __shared__ T name[n]
#endif

namespace fastopt {
namespace cuda {

template <typename T> struct ComputeOf { using type = float; };
template <> struct ComputeOf<double> { using type = double; };

__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ double ld(const double* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float ld(const __half* p, int64_t i) { return __half2float(p[i]); }

__device__ __forceinline__ void st(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(double* p, int64_t i, double v) { p[i] = v; }
__device__ __forceinline__ void st(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ uint8_t ld(const uint8_t* p, int64_t i) { return p[i]; }  // 8-bit codes
__device__ __forceinline__ void st(uint8_t* p, int64_t i, uint8_t v) { p[i] = v; }

// The search tables of `map`, built by the kThreads threads of a block in its prologue: keys and thresholds
// (one entry per thread), then the bucket starts (2 * kBuckets / kThreads per thread) and the block max of
// their spans. Every thread must call it; it ends with __syncthreads.
__device__ __forceinline__ void build_search_tables_block(SearchTables& s, const float* map) {
  if (threadIdx.x == 0) s.steps = 1;
  fill_search_key(s, map, threadIdx.x);
  __syncthreads();
  int span = 1;
  for (int j = threadIdx.x; j < 2 * kBuckets; j += kThreads) span = max(span, fill_search_start(s, j));
  atomicMax(&s.steps, span);
  __syncthreads();
}

// Elements of the quantization block that starts at `start` in a tensor of n: min(n - start, B), 0 past the end.
// Offsets inside a block then take 32-bit arithmetic, from pointers moved to `start` once per tile.
__device__ __forceinline__ int block_limit(int64_t n, int64_t start, int B) {
  return start >= n ? 0 : n - start < B ? (int)(n - start) : B;
}

// Four consecutive elements (codes: one 32-bit word), loaded or stored as one vector (2 x 16 bytes for fp64).
template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};

template <typename T>
__device__ __forceinline__ Quad<T> ld4(const T* p, int o) { return *reinterpret_cast<const Quad<T>*>(p + o); }
template <typename T>
__device__ __forceinline__ void st4(T* p, int o, const Quad<T>& q) { *reinterpret_cast<Quad<T>*>(p + o) = q; }

// Whether every quantization block of tensors at these addresses starts at a vector boundary: T elements in
// runs of 4 (block starts are multiples of B >= 64 elements, so the tensors' own alignment decides), codes in
// 32-bit words.
template <typename T>
__device__ __forceinline__ bool quad_aligned(const void* a, const void* b, const void* codes1, const void* codes2) {
  return (((uintptr_t)a | (uintptr_t)b) % (4 * sizeof(T)) | ((uintptr_t)codes1 | (uintptr_t)codes2) % 4) == 0;
}

// The thread's K elements of the quantization block at p (QuantLayout; `lim` elements in it), as V: vector
// loads when `vec` (a whole block of aligned tensors), else one by one, zero past `lim` and in unused slots.
template <int KMAX, typename T, typename V>
__device__ __forceinline__ void load_tile(const QuantLayout<KMAX>& L, bool vec, int lane, int lim, const T* p,
                                          V (&out)[KMAX]) {
  if (vec) {
#pragma unroll
    for (int j = 0; j < KMAX / 4; ++j) {
      const Quad<T> a = 4 * j < L.K ? ld4(p, L.slot(true, lane, 4 * j)) : Quad<T>{};
#pragma unroll
      for (int t = 0; t < 4; ++t) out[4 * j + t] = (V)ld(a.v, t);
    }
  } else {
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int o = L.slot(false, lane, k);
      out[k] = k < L.K && o < lim ? (V)ld(p, o) : (V)0;
    }
  }
}

// The thread's K codes of a quantization block (load_tile's slots), four to a 32-bit word, so that a tile's codes
// waiting in registers (pipelined_tiles) take K / 4 of them.
template <int KMAX>
struct Codes {
  uint32_t w[KMAX / 4];
  __device__ __forceinline__ uint8_t operator[](int k) const { return (uint8_t)(w[k >> 2] >> (8 * (k & 3))); }
};

// load_tile for codes, into words: one 32-bit load per word when `vec`.
template <int KMAX>
__device__ __forceinline__ void load_codes(const QuantLayout<KMAX>& L, bool vec, int lane, int lim,
                                           const uint8_t* p, Codes<KMAX>& out) {
  if (vec) {
#pragma unroll
    for (int j = 0; j < KMAX / 4; ++j)
      out.w[j] = 4 * j < L.K ? *reinterpret_cast<const uint32_t*>(p + L.slot(true, lane, 4 * j)) : 0u;
  } else {
    uint8_t q[KMAX];
    load_tile(L, false, lane, lim, p, q);
#pragma unroll
    for (int j = 0; j < KMAX / 4; ++j)
      out.w[j] = q[4 * j] | (uint32_t)q[4 * j + 1] << 8 | (uint32_t)q[4 * j + 2] << 16 | (uint32_t)q[4 * j + 3] << 24;
  }
}

// Stores value(k) (rounded to T) into the slots load_tile reads, computing each just before its store.
template <int KMAX, typename T, typename F>
__device__ __forceinline__ void store_tile(const QuantLayout<KMAX>& L, bool vec, int lane, int lim, T* p,
                                           F&& value) {
  if (vec) {
#pragma unroll
    for (int j = 0; j < KMAX / 4; ++j) {
      if (4 * j < L.K) {
        Quad<T> a;
#pragma unroll
        for (int t = 0; t < 4; ++t) st(a.v, t, value(4 * j + t));
        st4(p, L.slot(true, lane, 4 * j), a);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int o = L.slot(false, lane, k);
      if (k < L.K && o < lim) st(p, o, value(k));
    }
  }
}

// Max of each of the N values v[i] over each aligned group of G threads (G a power of two, 16..256): one round
// of barriers for all N (AdamW8bit's two moments). Every thread of the block must call it (it may hold
// __syncthreads). `red` holds N * kThreads / 32 floats.
template <int N>
__device__ __forceinline__ void group_max_n(float (&v)[N], int G, float* red) {
  const int width = G < 32 ? G : 32;
  for (int o = width >> 1; o > 0; o >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = fmaxf(v[i], __shfl_xor_sync(0xffffffffu, v[i], o));
  }
  if (G > 32) {
    constexpr int W = kThreads / 32;
    const int warp = threadIdx.x >> 5, per_group = G >> 5, first = warp & ~(per_group - 1);  // a power of two
    __syncthreads();  // the previous call's readers are done with `red`
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int i = 0; i < N; ++i) red[i * W + warp] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) {
      v[i] = red[i * W + first];
#pragma unroll 1
      for (int w = 1; w < per_group; ++w) v[i] = fmaxf(v[i], red[i * W + first + w]);  // 1 to 7 more warps
    }
  }
}

// group_max_n of one value. `red` holds kThreads / 32 floats.
__device__ __forceinline__ float group_max(float v, int G, float* red) {
  float one[1] = {v};
  group_max_n<1>(one, G, red);
  return one[0];
}

// The tensor a persistent block is loading. Its tiles only grow (grid-stride loop), so the binary search in
// tile_start runs only when a tile leaves the current tensor, and starts from it. (The entry itself is
// reloaded per tile, an L1 hit, rather than held in registers across tiles.)
struct TensorCursor {
  int i = -1;
  int64_t lo = 0, hi = 0;  // the tensor's tiles: [lo, hi)
  // Moves to the tensor of `tile`; true when it changed.
  __device__ __forceinline__ bool seek(const int64_t* tile_start, int n_tensors, int64_t tile) {
    if (i >= 0 && tile < hi) return false;
    const int first = i < 0 ? 0 : i;
    i = first + find_tensor(tile_start + first, n_tensors - first, tile);
    lo = tile_start[i];
    hi = tile_start[i + 1];
    return true;
  }
};

// The grid-stride loop of a persistent block over its tiles, software-pipelined: the loads of the block's next
// tile are issued before the current tile's math, barriers and stores, so that each thread keeps one tile's
// reads in flight while it works instead of waiting out the memory latency once per tile (the kernels are
// latency-bound at 4 blocks per SM otherwise: quantize took as long for bf16 input as for fp32).
//   load(tile, cursor, moved, stage): reads what the tile needs from global memory into `stage` (registers);
//     `moved`: the tile is the first of a new tensor for this block. Its results must not be used inside load:
//     a use would wait for the loads there.
//   work(stage): the tile's math and stores. Called in tile order, so per-tensor values it derives when
//     stage.moved (AdamW's scalars) stay right.
// Every thread of the block runs the same tiles, so barriers inside work are safe.
template <typename Stage, typename Load, typename Work>
__device__ __forceinline__ void pipelined_tiles(const int64_t* tile_start, int n_tensors, int64_t total_tiles,
                                                Load&& load, Work&& work) {
  TensorCursor cur;
  int64_t tile = blockIdx.x;
  if (tile >= total_tiles) return;
  Stage now, ahead;
  load(tile, cur, cur.seek(tile_start, n_tensors, tile), now);
  for (;;) {
    const int64_t next = tile + gridDim.x;
    const bool more = next < total_tiles;
    if (more) load(next, cur, cur.seek(tile_start, n_tensors, next), ahead);
    work(now);
    if (!more) return;
    now = ahead;
    tile = next;
  }
}

// Blocks of a persistent grid: enough to fill every SM at the kernel's occupancy, at most one per tile.
template <typename Kernel>
inline int persistent_grid(Kernel kernel, int64_t total_tiles) {
  int dev = 0, sms = 1, per_sm = 1;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  if (per_sm < 1) per_sm = 1;
  const int64_t g = (int64_t)sms * per_sm;
  return (int)(g < total_tiles ? g : total_tiles);
}

}  // namespace cuda
}  // namespace fastopt
