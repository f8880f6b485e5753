// CUDA launchers of the 8-bit format and the fused AdamW updates (torch-free; see fastopt_core.h).
//
// Every launcher is one multi-tensor launch on `stream`, whatever the number of tensors: `tile_start`
// (n_tensors + 1 int64) and `entries` are device arrays, `total_tiles` = tile_start[n_tensors] (known on
// the host). A persistent grid walks the tiles; each tile finds its tensor by binary search in tile_start.
// `found_inf` (device fp32 scalar, may be null): when nonzero the kernels return before writing anything.
// `inv_scale` (device fp32 scalar, may be null) multiplies the gradients, which the AdamW kernels then store
// unscaled (as torch's fused optimizers leave p.grad). Nothing here synchronizes.
// Each returns the launch status (cudaGetLastError).
#pragma once

#include <cuda_runtime_api.h>

#include "fastopt_core.h"

namespace fastopt {
namespace cuda {

cudaError_t quantize(DType dtype, const int64_t* tile_start, const QuantEntry* entries, int n_tensors,
                     int64_t total_tiles, int64_t block_size, const float* map, const float* found_inf,
                     cudaStream_t stream);

cudaError_t dequantize(DType dtype, const int64_t* tile_start, const QuantEntry* entries, int n_tensors,
                       int64_t total_tiles, int64_t block_size, const float* map, cudaStream_t stream);

cudaError_t adamw8bit(DType dtype, const int64_t* tile_start, const AdamWEntry* entries, int n_tensors,
                      int64_t total_tiles, int64_t block_size, const float* map1, const float* map2,
                      const AdamWHyper& h, const float* inv_scale, const float* found_inf, cudaStream_t stream);

cudaError_t adamw32(DType dtype, const int64_t* tile_start, const AdamWEntry* entries, int n_tensors,
                    int64_t total_tiles, const AdamWHyper& h, const float* inv_scale, const float* found_inf,
                    cudaStream_t stream);

}  // namespace cuda
}  // namespace fastopt
