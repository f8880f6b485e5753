// CUDA kernels: fused multi-tensor AdamW with 8-bit block-wise state, and with full-precision state.
//
// 8-bit, per element in one pass: dequantize m (signed map) and v (unsigned map) with the block's old absmax,
// AdamW in fp32 (fp64 for fp64 params), write p; then the block's new absmax (a group max over the threads of
// the block) and requantize m and v. The update uses the unquantized new m and v, as bitsandbytes does.
// The tiles are software-pipelined (pipelined_tiles): the next tile's p, g, codes and old absmax wait in
// registers while the current one computes, which takes 79 registers (sm_90, fp32/bf16/fp16 params) and so 3
// blocks of 256 threads per SM for B <= 1024; at 4 blocks (64 registers) ptxas spilled 86 bytes a thread. B above
// 1024 (16 values a thread) takes 235 registers, one block per SM.
#include "cuda_common.cuh"
#include "cuda_kernels.h"

namespace fastopt {
namespace cuda {

template <typename T, int KMAX>
__global__ void __launch_bounds__(kThreads, KMAX == 4 ? 3 : 1)
    adamw8bit_kernel(const int64_t* __restrict__ tile_start, const AdamWEntry* __restrict__ entries, int n_tensors,
                     int64_t total_tiles, int B, const float* __restrict__ map1, const float* __restrict__ map2,
                     AdamWHyper h, const float* __restrict__ inv_scale, const float* __restrict__ found_inf) {
  using C = typename ComputeOf<T>::type;
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  FASTOPT_SHARED(SearchTables, tab1);
  FASTOPT_SHARED(SearchTables, tab2);
  FASTOPT_SHARED_ARRAY(float, red, 2 * kThreads / 32);
  build_search_tables_block(tab1, map1);
  build_search_tables_block(tab2, map2);
  const int steps1 = tab1.steps, steps2 = tab2.steps;
  const C inv = inv_scale != nullptr ? (C)*inv_scale : (C)1;
  const QuantLayout<KMAX> L(B);
  const int grp = threadIdx.x / L.G, lane = threadIdx.x % L.G;
  struct Stage {
    int i;  // the tensor
    int64_t qb;
    int lim;  // offsets [0, lim) from the quantization block's start: 32-bit index arithmetic
    bool vec, moved;
    float old1, old2;  // the block's absmax before the step
    C pv[KMAX], gv[KMAX];
    Codes<KMAX> q1, q2;
  };
  // Only what the next tile's math needs waits in registers; work reloads the tensor's entry (an L1 hit).
  auto load = [&](int64_t tile, const TensorCursor& cur, bool moved, Stage& st) {
    const AdamWEntry e = entries[cur.i];
    st.i = cur.i;
    st.qb = (tile - cur.lo) * L.Q + grp;
    const int64_t start = st.qb * B;
    st.lim = block_limit(e.n, start, B);
    st.vec = st.lim == B && quad_aligned<T>(e.p, e.g, e.s1, e.s2);  // see QuantLayout
    st.moved = moved;
    st.old1 = st.lim > 0 ? e.a1[st.qb] : 0.0f;
    st.old2 = st.lim > 0 ? e.a2[st.qb] : 0.0f;
    load_tile(L, st.vec, lane, st.lim, static_cast<const T*>(e.p) + start, st.pv);
    load_tile(L, st.vec, lane, st.lim, static_cast<const T*>(e.g) + start, st.gv);
    load_codes(L, st.vec, lane, st.lim, static_cast<const uint8_t*>(e.s1) + start, st.q1);
    load_codes(L, st.vec, lane, st.lim, static_cast<const uint8_t*>(e.s2) + start, st.q2);
  };
  AdamWScalars<C> s{};
  auto work = [&](const Stage& st) {
    const AdamWEntry e = entries[st.i];
    if (st.moved) s = adamw_scalars<C>(h, *e.step);
    const int64_t start = st.qb * B;
    T* p = static_cast<T*>(e.p) + start;
    uint8_t* c1 = static_cast<uint8_t*>(e.s1) + start;
    uint8_t* c2 = static_cast<uint8_t*>(e.s2) + start;
    C pv[KMAX];
    float mq[KMAX], vq[KMAX];
    float new1 = 0.0f, new2 = 0.0f;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      mq[k] = 0.0f;
      vq[k] = 0.0f;
      pv[k] = st.pv[k];
      if (k < L.K && (st.vec || L.slot(false, lane, k) < st.lim)) {
        C m = (C)(dequantize_code(tab1, st.q1[k]) * st.old1);
        C v = (C)(dequantize_code(tab2, st.q2[k]) * st.old2);
        pv[k] = adamw_element<C>(st.pv[k], st.gv[k] * inv, m, v, s);
        mq[k] = (float)m;
        vq[k] = (float)v;
      }
      new1 = fmaxf(new1, fabsf(mq[k]));
      new2 = fmaxf(new2, fabsf(vq[k]));
    }
    store_tile(L, st.vec, lane, st.lim, p, [&](int k) { return pv[k]; });
    if (inv_scale != nullptr)  // GradScaler's fused path: the unscaled gradient stored over it, as torch's fused steps
      store_tile(L, st.vec, lane, st.lim, const_cast<T*>(static_cast<const T*>(e.g)) + start,
                 [&](int k) { return st.gv[k] * inv; });
    // Every thread of the group has read the old absmax (its value feeds new1/new2) before lane 0 writes.
    float amax[2] = {new1, new2};
    group_max_n<2>(amax, L.G, red);
    if (st.lim > 0) {
      if (lane == 0) {
        e.a1[st.qb] = amax[0];
        e.a2[st.qb] = amax[1];
      }
      const Normalizer norm1(amax[0]), norm2(amax[1]);
      store_tile(L, st.vec, lane, st.lim, c1, [&](int k) { return quantize_nearest(tab1, norm1(mq[k]), steps1); });
      store_tile(L, st.vec, lane, st.lim, c2, [&](int k) { return quantize_nearest(tab2, norm2(vq[k]), steps2); });
    }
  };
  pipelined_tiles<Stage>(tile_start, n_tensors, total_tiles, load, work);
}

// Full-precision state: tiles of kTile32 elements, kTile32 / kThreads per thread.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    adamw32_kernel(const int64_t* __restrict__ tile_start, const AdamWEntry* __restrict__ entries, int n_tensors,
                   int64_t total_tiles, AdamWHyper h, const float* __restrict__ inv_scale,
                   const float* __restrict__ found_inf) {
  using C = typename ComputeOf<T>::type;
  constexpr int K = (int)(kTile32 / kThreads);
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const C inv = inv_scale != nullptr ? (C)*inv_scale : (C)1;
  TensorCursor cur;
  AdamWScalars<C> s{};
  for (int64_t tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const bool moved = cur.seek(tile_start, n_tensors, tile);
    const AdamWEntry e = entries[cur.i];
    if (moved) s = adamw_scalars<C>(h, *e.step);
    T* p = static_cast<T*>(e.p);
    T* g = static_cast<T*>(const_cast<void*>(e.g));
    C* m = static_cast<C*>(e.s1);
    C* v = static_cast<C*>(e.s2);
    const int64_t base = (tile - cur.lo) * kTile32 + threadIdx.x;
    C pv[K], gv[K], mv[K], vv[K];  // loads first, as in adamw8bit_kernel
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t j = base + (int64_t)k * kThreads;
      const bool in = j < e.n;
      pv[k] = in ? (C)ld(p, j) : (C)0;
      gv[k] = in ? (C)ld(g, j) : (C)0;
      mv[k] = in ? m[j] : (C)0;
      vv[k] = in ? v[j] : (C)0;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t j = base + (int64_t)k * kThreads;
      if (j < e.n) {
        const C gk = gv[k] * inv;
        if (inv_scale != nullptr) st(g, j, gk);  // GradScaler's fused path: the unscaled gradient stored over it
        st(p, j, adamw_element<C>(pv[k], gk, mv[k], vv[k], s));
        m[j] = mv[k];
        v[j] = vv[k];
      }
    }
  }
}

namespace {

template <typename T, int KMAX>
cudaError_t launch8(const int64_t* ts, const AdamWEntry* e, int n, int64_t total, int B, const float* m1,
                    const float* m2, const AdamWHyper& h, const float* inv, const float* fi, cudaStream_t stream) {
  auto kernel = adamw8bit_kernel<T, KMAX>;
  FASTOPT_LAUNCH(kernel, persistent_grid(kernel, total), kThreads, stream, ts, e, n, total, B, m1, m2, h, inv, fi);
  return cudaGetLastError();
}

template <int KMAX>
cudaError_t adamw8bit_k(DType dtype, const int64_t* ts, const AdamWEntry* e, int n, int64_t total, int B,
                        const float* m1, const float* m2, const AdamWHyper& h, const float* inv, const float* fi,
                        cudaStream_t s) {
  switch (dtype) {
    case DType::F32: return launch8<float, KMAX>(ts, e, n, total, B, m1, m2, h, inv, fi, s);
    case DType::F64: return launch8<double, KMAX>(ts, e, n, total, B, m1, m2, h, inv, fi, s);
    case DType::BF16: return launch8<__nv_bfloat16, KMAX>(ts, e, n, total, B, m1, m2, h, inv, fi, s);
    case DType::F16: return launch8<__half, KMAX>(ts, e, n, total, B, m1, m2, h, inv, fi, s);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch32(const int64_t* ts, const AdamWEntry* e, int n, int64_t total, const AdamWHyper& h,
                     const float* inv, const float* fi, cudaStream_t stream) {
  auto kernel = adamw32_kernel<T>;
  FASTOPT_LAUNCH(kernel, persistent_grid(kernel, total), kThreads, stream, ts, e, n, total, h, inv, fi);
  return cudaGetLastError();
}

}  // namespace

cudaError_t adamw8bit(DType dtype, const int64_t* tile_start, const AdamWEntry* entries, int n_tensors,
                      int64_t total_tiles, int64_t block_size, const float* map1, const float* map2,
                      const AdamWHyper& h, const float* inv_scale, const float* found_inf, cudaStream_t stream) {
  if (!valid_block_size(block_size)) return cudaErrorInvalidValue;
  if (total_tiles == 0) return cudaSuccess;
  const int B = (int)block_size;
  if (B <= kTileMin)
    return adamw8bit_k<4>(dtype, tile_start, entries, n_tensors, total_tiles, B, map1, map2, h, inv_scale, found_inf,
                          stream);
  return adamw8bit_k<16>(dtype, tile_start, entries, n_tensors, total_tiles, B, map1, map2, h, inv_scale, found_inf,
                         stream);
}

cudaError_t adamw32(DType dtype, const int64_t* tile_start, const AdamWEntry* entries, int n_tensors,
                    int64_t total_tiles, const AdamWHyper& h, const float* inv_scale, const float* found_inf,
                    cudaStream_t stream) {
  if (total_tiles == 0) return cudaSuccess;
  const int64_t* ts = tile_start;
  const AdamWEntry* e = entries;
  switch (dtype) {
    case DType::F32: return launch32<float>(ts, e, n_tensors, total_tiles, h, inv_scale, found_inf, stream);
    case DType::F64: return launch32<double>(ts, e, n_tensors, total_tiles, h, inv_scale, found_inf, stream);
    case DType::BF16: return launch32<__nv_bfloat16>(ts, e, n_tensors, total_tiles, h, inv_scale, found_inf, stream);
    case DType::F16: return launch32<__half>(ts, e, n_tensors, total_tiles, h, inv_scale, found_inf, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace fastopt
