// Device helpers shared by the CUDA kernels (torch-free).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fastopt_core.h"

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

// How a CUDA block of kThreads threads covers one tile of quant_tile(B) elements: Q quantization blocks per
// tile, G threads per quantization block, K elements per thread (K = 4 for every B up to kTileMin: the
// KMAX = 4 instantiations know it at compile time; 8 or 16 above). A thread's K elements of a whole
// quantization block whose tensors are aligned (`quad_aligned`) are K / 4 runs of 4 consecutive ones, each
// one vector load or store per tensor (`slot`, vec = true; a warp still reads one contiguous span); those of
// a partial last block or of an unaligned tensor are strided by G, one element per load (vec = false).
template <int KMAX>
struct QuantLayout {
  int Q, G, K;
  __device__ __forceinline__ explicit QuantLayout(int B) {
    Q = B >= (int)kTileMin ? 1 : (int)kTileMin / B;
    G = kThreads / Q;
    K = KMAX == 4 ? 4 : B / G;
  }
  // Offset in its quantization block of the thread's element k.
  __device__ __forceinline__ int slot(bool vec, int lane, int k) const {
    return vec ? 4 * (lane + (k >> 2) * G) + (k & 3) : lane + k * G;
  }
};

// Four consecutive elements, loaded or stored as one vector (2 x 16 bytes for fp64).
template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};

template <typename T>
__device__ __forceinline__ Quad<T> ld4(const T* p, int o) { return *reinterpret_cast<const Quad<T>*>(p + o); }
template <typename T>
__device__ __forceinline__ void st4(T* p, int o, const Quad<T>& q) { *reinterpret_cast<Quad<T>*>(p + o) = q; }
// Four codes as one 32-bit word (code t in byte t), and back.
__device__ __forceinline__ uint32_t ld4(const uint8_t* p, int o) { return *reinterpret_cast<const uint32_t*>(p + o); }
__device__ __forceinline__ void st4(uint8_t* p, int o, const uint8_t (&c)[4]) {
  *reinterpret_cast<uint32_t*>(p + o) = (uint32_t)c[0] | (uint32_t)c[1] << 8 | (uint32_t)c[2] << 16 |
                                        (uint32_t)c[3] << 24;
}

// Whether every quantization block of tensors at these addresses starts at a vector boundary: T elements in
// runs of 4 (block starts are multiples of B >= 64 elements, so the tensors' own alignment decides), codes in
// 32-bit words.
template <typename T>
__device__ __forceinline__ bool quad_aligned(const void* a, const void* b, const void* codes1, const void* codes2) {
  return (((uintptr_t)a | (uintptr_t)b) % (4 * sizeof(T)) | ((uintptr_t)codes1 | (uintptr_t)codes2) % 4) == 0;
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

// The tensor a persistent block is working on. Its tiles only grow (grid-stride loop), so the binary search in
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
