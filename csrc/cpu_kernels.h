// CPU kernels of the 8-bit format and the fused AdamW updates (torch-free; see fastopt_core.h).
//
// Every function works on a range of tiles [tile_begin, tile_end) of a multi-tensor call: the caller owns
// the threads (bindings.cpp runs at::parallel_for over tiles; the C++ unit tests call them serially).
// `tile_start` has n_tensors + 1 entries (fill_tile_start); tiles are quant_tile(block_size) elements for
// the 8-bit functions and kTile32 for adamw32_tiles.
#pragma once

#include "fastopt_core.h"

namespace fastopt {
namespace cpu {

// tile_start[i] = sum of ceil(numel[j] / tile) for j < i; returns the total number of tiles.
int64_t fill_tile_start(const int64_t* numels, int n_tensors, int64_t tile, int64_t* tile_start);

void build_search_tables(const float* map, SearchTables* out);

// x (dtype) -> codes, absmax.
void quantize_tiles(DType dtype, const QuantEntry* entries, const int64_t* tile_start, int n_tensors,
                    int64_t block_size, const SearchTables& tables, int64_t tile_begin, int64_t tile_end);

// codes, absmax -> out (dtype).
void dequantize_tiles(DType dtype, const QuantEntry* entries, const int64_t* tile_start, int n_tensors,
                      int64_t block_size, const SearchTables& tables, int64_t tile_begin, int64_t tile_end);

// Fused 8-bit AdamW (params of `dtype`, grads of the same dtype): per element dequantize m (t1, signed map)
// and v (t2, unsigned map), AdamW, write p, then requantize m and v with their new block absmax. `store_grad`
// (GradScaler's fused path): the gradient times inv_scale is written back over the gradient in the same pass.
void adamw8bit_tiles(DType dtype, const AdamWEntry* entries, const int64_t* tile_start, int n_tensors,
                     int64_t block_size, const SearchTables& t1, const SearchTables& t2, const AdamWHyper& h,
                     float inv_scale, bool store_grad, int64_t tile_begin, int64_t tile_end);

// AdamW with full-precision state: fp32 m, v (fp64 for fp64 params).
void adamw32_tiles(DType dtype, const AdamWEntry* entries, const int64_t* tile_start, int n_tensors,
                   const AdamWHyper& h, float inv_scale, bool store_grad, int64_t tile_begin, int64_t tile_end);

// Storage conversions, round to nearest even (exposed for the unit tests).
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);
float f16_to_float(uint16_t h);
uint16_t float_to_f16(float f);

}  // namespace cpu
}  // namespace fastopt
