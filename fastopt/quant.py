"""Public 8-bit block-wise quantization: bitsandbytes' format (dynamic map, fp32 absmax per block).

    codes, absmax = fastopt.quantize_blockwise(x, block_size=256, signed=True)
    y = fastopt.dequantize_blockwise(codes, absmax, block_size=256, signed=True, dtype=torch.float32)

The format and rounding are specified in `fastopt.reference.quant`; the compiled extension (csrc/) runs it on
CPU and CUDA tensors, the plain-torch reference under `FASTOPT_BACKEND=torch`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import ops

__all__ = ["quantize_blockwise", "dequantize_blockwise"]


def quantize_blockwise(x: Tensor, block_size: int = 256, signed: bool = True) -> tuple[Tensor, Tensor]:
    """Quantize a float tensor of any shape, length and float dtype to 8 bits.

    Returns (codes: uint8 of x's shape, absmax: fp32 of ceil(x.numel() / block_size) elements). `signed`
    picks the signed dynamic map (values of both signs) or the unsigned one (non-negative values, finer).
    Raises ValueError for a block_size that is not a power of two in [64, 4096] or a non-float x.
    """
    return ops.quantize_blockwise(x, block_size, signed)


def dequantize_blockwise(codes: Tensor, absmax: Tensor, block_size: int = 256, signed: bool = True,
                         dtype: torch.dtype = torch.float32) -> Tensor:
    """The values that (codes, absmax) stand for, as `dtype`, in codes' shape."""
    return ops.dequantize_blockwise(codes, absmax, block_size, signed, dtype)
