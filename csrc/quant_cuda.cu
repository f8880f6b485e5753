// CUDA kernels: multi-tensor block-wise 8-bit quantize / dequantize (see fastopt_core.h for the format).
#include "cuda_common.cuh"
#include "cuda_kernels.h"

namespace fastopt {
namespace cuda {

// KMAX: the largest K the instantiation handles (4 for B <= 1024, 16 above), so that the per-thread value
// arrays stay in registers. Whole blocks of aligned tensors take vector loads and stores (QuantLayout).
// Quantize is software-pipelined (pipelined_tiles: the search and the group max are long enough to hide a
// tile's loads behind): 56 registers on sm_90, 4 blocks per SM (at 5, ptxas spills 20 bytes a thread).
// Dequantize is not: with next to no math per tile, a thread mostly waits on its loads anyway, and holding a
// second tile would cost it full occupancy (32 registers; pipelined, it spilled there).
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

template <typename T, int KMAX>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const int64_t* __restrict__ tile_start, const QuantEntry* __restrict__ entries,
                      int n_tensors, int64_t total_tiles, int B, const float* __restrict__ map) {
  using C = typename ComputeOf<T>::type;
  FASTOPT_SHARED_ARRAY(float, keys, kCodeSize);
  keys[threadIdx.x] = map[threadIdx.x];
  __syncthreads();
  const QuantLayout<KMAX> L(B);
  const int grp = threadIdx.x / L.G, lane = threadIdx.x % L.G;
  TensorCursor cur;
  for (int64_t tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    cur.seek(tile_start, n_tensors, tile);
    const QuantEntry e = entries[cur.i];
    T* out = static_cast<T*>(e.out);
    const int64_t qb = (tile - cur.lo) * L.Q + grp;
    const int64_t start = qb * B;
    const int lim = block_limit(e.n, start, B);
    if (lim == 0) continue;
    const float scale = e.absmax[qb];
    const bool vec = lim == B && quad_aligned<T>(e.out, e.out, e.codes, e.codes);
    uint8_t q[KMAX];  // the tile's codes first: a store to `out` in between would serialize the loads
    load_tile(L, vec, lane, lim, e.codes + start, q);
    store_tile(L, vec, lane, lim, out + start, [&](int k) { return (C)(keys[q[k]] * scale); });
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
  FASTOPT_LAUNCH(kernel, persistent_grid(kernel, total), kThreads, stream, tile_start, entries, n, total, B, map);
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
