// CUDA kernels: multi-tensor block-wise 8-bit quantize / dequantize (see fastopt_core.h for the format).
#include "cuda_common.cuh"
#include "cuda_kernels.h"

namespace fastopt {
namespace cuda {

// KMAX: the largest K the instantiation handles (4 for B <= 1024, 16 above), so that the per-thread value
// arrays stay in registers. Whole blocks of aligned tensors take vector loads and stores (QuantLayout).
// Quantize is software-pipelined (pipelined_tiles: the search and the group max are long enough to hide a
// tile's loads behind): 56 registers on sm_90, 4 blocks per SM (at 5, ptxas spills 20 bytes a thread).
// Dequantize is not (see it).
template <typename T, int KMAX>
__global__ void __launch_bounds__(kThreads, KMAX == 4 ? 4 : 2)
    quantize_kernel(const int64_t* __restrict__ tile_start, const QuantEntry* __restrict__ entries, int n_tensors,
                    int64_t total_tiles, int B, const float* __restrict__ map, const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  FASTOPT_SHARED(SearchTables, tab);
  FASTOPT_SHARED_ARRAY(float, red, kThreads / 32);
  build_search_tables_block(tab, map);
  const int steps = tab.steps;
  const QuantLayout<KMAX> L(B);
  const int grp = threadIdx.x / L.G, lane = threadIdx.x % L.G;
  struct Stage {
    uint8_t* codes;  // the quantization block's codes
    float* absmax;
    int64_t qb;
    int lim;  // its elements: offsets [0, lim)
    bool vec;
    float vals[KMAX];
  };
  auto load = [&](int64_t tile, const TensorCursor& cur, bool, Stage& st) {
    const QuantEntry e = entries[cur.i];
    st.qb = (tile - cur.lo) * L.Q + grp;
    const int64_t start = st.qb * B;
    st.lim = block_limit(e.n, start, B);
    st.vec = st.lim == B && quad_aligned<T>(e.x, e.x, e.codes, e.codes);
    st.codes = e.codes + start;
    st.absmax = e.absmax;
    load_tile(L, st.vec, lane, st.lim, static_cast<const T*>(e.x) + start, st.vals);
  };
  auto work = [&](const Stage& st) {
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) amax = fmaxf(amax, fabsf(st.vals[k]));
    amax = group_max(amax, L.G, red);
    if (st.lim > 0) {
      if (lane == 0) st.absmax[st.qb] = amax;
      const Normalizer norm(amax);
      store_tile(L, st.vec, lane, st.lim, st.codes,
                 [&](int k) { return quantize_nearest(tab, norm(st.vals[k]), steps); });
    }
  };
  pipelined_tiles<Stage>(tile_start, n_tensors, total_tiles, load, work);
}

// Dequantize has no reduction: a value needs only its block's absmax. So each thread takes 16 elements of one
// tile (8 for B = 2048), as runs of 4 at offsets 4 (lane + j W) (one 32-bit load of codes and one vector store
// each; a warp's loads and stores are contiguous), W threads a tile: for B <= 1024 (tiles of 1024 elements) four
// tiles per block iteration, 64 threads each; above, one tile of B. Every run's codes and absmax are loaded before
// any store, so a thread has 16 bytes of codes in flight (4 when a block spread one 1024 tile over 256 threads).
template <typename T, int KMAX>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const int64_t* __restrict__ tile_start, const QuantEntry* __restrict__ entries,
                      int n_tensors, int64_t total_tiles, int B, const float* __restrict__ map) {
  using C = typename ComputeOf<T>::type;
  constexpr int kSub = KMAX == 4 ? 4 : 1, W = kThreads / kSub, kRuns = 4;
  FASTOPT_SHARED_ARRAY(float, keys, kCodeSize);
  keys[threadIdx.x] = map[threadIdx.x];
  __syncthreads();
  const int tile_elems = (int)quant_tile(B), runs = tile_elems / (4 * W), shift = __ffs(B) - 1;  // B = 2^shift
  const int sub = threadIdx.x / W, lane = threadIdx.x % W;
  TensorCursor cur;
  for (int64_t base = (int64_t)blockIdx.x * kSub; base < total_tiles; base += (int64_t)gridDim.x * kSub) {
    const int64_t tile = base + sub;
    if (tile >= total_tiles) break;  // the loop has no barrier
    cur.seek(tile_start, n_tensors, tile);
    const QuantEntry e = entries[cur.i];
    const int64_t start = (tile - cur.lo) * tile_elems;
    const int lim = e.n - start < tile_elems ? (int)(e.n - start) : tile_elems;  // >= 1: the tile exists
    const uint8_t* codes = e.codes + start;
    const float* absmax = e.absmax + (start >> shift);
    T* out = static_cast<T*>(e.out) + start;
    if (lim == tile_elems && quad_aligned<T>(e.out, e.out, e.codes, e.codes)) {
      uint32_t w[kRuns];
      float scale[kRuns];
#pragma unroll
      for (int j = 0; j < kRuns; ++j) {
        const int o = 4 * (lane + j * W);
        w[j] = j < runs ? *reinterpret_cast<const uint32_t*>(codes + o) : 0u;
        scale[j] = j < runs ? absmax[o >> shift] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kRuns; ++j) {
        if (j < runs) {
          Quad<T> q;
#pragma unroll
          for (int t = 0; t < 4; ++t) st(q.v, t, (C)(keys[(w[j] >> (8 * t)) & 0xFF] * scale[j]));
          st4(out, 4 * (lane + j * W), q);
        }
      }
    } else {  // a partial tile or an unaligned tensor: element by element, four at a time
#pragma unroll 1
      for (int j = 0; j < 4 * runs; j += 4) {
        uint8_t q[4];
        float scale[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int o = lane + (j + t) * W;
          q[t] = o < lim ? codes[o] : 0;
          scale[t] = o < lim ? absmax[o >> shift] : 0.0f;
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int o = lane + (j + t) * W;
          if (o < lim) st(out, o, (C)(keys[q[t]] * scale[t]));
        }
      }
    }
  }
}

namespace {

template <typename T, int KMAX>
cudaError_t launch_quantize(const int64_t* tile_start, const QuantEntry* entries, int n, int64_t total, int B,
                            const float* map, const float* found_inf, cudaStream_t stream) {
  auto kernel = quantize_kernel<T, KMAX>;
  FASTOPT_LAUNCH(kernel, persistent_grid(kernel, total), kThreads, stream, tile_start, entries, n, total, B, map,
                 found_inf);
  return cudaGetLastError();
}

template <typename T, int KMAX>
cudaError_t launch_dequantize(const int64_t* tile_start, const QuantEntry* entries, int n, int64_t total, int B,
                              const float* map, cudaStream_t stream) {
  auto kernel = dequantize_kernel<T, KMAX>;
  const int64_t per_block = KMAX == 4 ? 4 : 1;  // tiles per block iteration
  FASTOPT_LAUNCH(kernel, persistent_grid(kernel, ceil_div(total, per_block)), kThreads, stream, tile_start, entries,
                 n, total, B, map);
  return cudaGetLastError();
}

template <int KMAX>
cudaError_t quantize_k(DType dtype, const int64_t* ts, const QuantEntry* e, int n, int64_t total, int B,
                       const float* map, const float* fi, cudaStream_t s) {
  switch (dtype) {
    case DType::F32: return launch_quantize<float, KMAX>(ts, e, n, total, B, map, fi, s);
    case DType::F64: return launch_quantize<double, KMAX>(ts, e, n, total, B, map, fi, s);
    case DType::BF16: return launch_quantize<__nv_bfloat16, KMAX>(ts, e, n, total, B, map, fi, s);
    case DType::F16: return launch_quantize<__half, KMAX>(ts, e, n, total, B, map, fi, s);
  }
  return cudaErrorInvalidValue;
}

template <int KMAX>
cudaError_t dequantize_k(DType dtype, const int64_t* ts, const QuantEntry* e, int n, int64_t total, int B,
                         const float* map, cudaStream_t s) {
  switch (dtype) {
    case DType::F32: return launch_dequantize<float, KMAX>(ts, e, n, total, B, map, s);
    case DType::F64: return launch_dequantize<double, KMAX>(ts, e, n, total, B, map, s);
    case DType::BF16: return launch_dequantize<__nv_bfloat16, KMAX>(ts, e, n, total, B, map, s);
    case DType::F16: return launch_dequantize<__half, KMAX>(ts, e, n, total, B, map, s);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t quantize(DType dtype, const int64_t* tile_start, const QuantEntry* entries, int n_tensors,
                     int64_t total_tiles, int64_t block_size, const float* map, const float* found_inf,
                     cudaStream_t stream) {
  if (!valid_block_size(block_size)) return cudaErrorInvalidValue;
  if (total_tiles == 0) return cudaSuccess;
  const int B = (int)block_size;
  if (B <= kTileMin)
    return quantize_k<4>(dtype, tile_start, entries, n_tensors, total_tiles, B, map, found_inf, stream);
  return quantize_k<16>(dtype, tile_start, entries, n_tensors, total_tiles, B, map, found_inf, stream);
}

cudaError_t dequantize(DType dtype, const int64_t* tile_start, const QuantEntry* entries, int n_tensors,
                       int64_t total_tiles, int64_t block_size, const float* map, cudaStream_t stream) {
  if (!valid_block_size(block_size)) return cudaErrorInvalidValue;
  if (total_tiles == 0) return cudaSuccess;
  const int B = (int)block_size;
  if (B <= kTileMin) return dequantize_k<4>(dtype, tile_start, entries, n_tensors, total_tiles, B, map, stream);
  return dequantize_k<16>(dtype, tile_start, entries, n_tensors, total_tiles, B, map, stream);
}

}  // namespace cuda
}  // namespace fastopt
