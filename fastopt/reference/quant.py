"""8-bit block-wise quantization in plain torch: the spec of csrc/'s kernels, the torch path and the oracle.

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (2022), in bitsandbytes' format:

    absmax_b = max_{i in block b} |x_i|                        one fp32 scale per block of B elements
    code_i   = argmin_j |x_i / absmax_b - map_j|               nearest of 256 sorted map values (sec. 2.2)
    x~_i     = map[code_i] * absmax_b                          dequantization

`map` is the dynamic map of sec. 2.3 (a sign bit for the signed map, then a run of zero bits that sets the
decimal exponent, then a linear fraction), built exactly as bitsandbytes' `create_dynamic_map` builds it, so
codes and states interoperate. Ties (x exactly halfway between two map values, in fp32 arithmetic) go to the
lower index: the upper one is taken only when strictly nearer, as in bitsandbytes' CPU kernel. x is rounded
to fp32 first; a block of zeros has absmax 0 and the codes of 0.0. B is a power of two in [64, 4096]; the last
block of a tensor may be partial.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import Tensor

__all__ = ["create_dynamic_map", "dynamic_map", "check_block_size", "check_float", "num_blocks",
           "quantize_blockwise", "dequantize_blockwise", "nearest_code"]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> Tensor:
    """The dynamic quantization map, value for value bitsandbytes' `functional.create_dynamic_map`."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    data += [0] * (256 - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _map_cpu(signed: bool) -> Tensor:
    return create_dynamic_map(signed=signed)


_device_maps: dict = {}


def on_device(cache: dict, signed: bool, device: torch.device | str, cpu: Callable[[bool], Tensor]) -> Tensor:
    """`cpu(signed)` copied to `device` once and kept in `cache` (one copy per GPU, however the device is named).
    A GPU's copy goes through pinned memory without blocking: a copy from pageable memory synchronizes with the
    host, which a step must not do, and the first step may be the one that asks (a CUDA graph may even capture
    the copy: the pinned source is kept with it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (bool(signed), device)
    t = cache.get(key)
    if t is None:
        host = cpu(bool(signed))
        if device.type == "cuda":
            host = host.pin_memory()
            t = host.to(device, non_blocking=True)
            cache[key, "host"] = host
        else:
            t = host.to(device)
        cache[key] = t
    return t


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> Tensor:
    """The 8-bit map (signed: first moments; unsigned: second moments), cached per device. Do not modify."""
    return on_device(_device_maps, signed, device, _map_cpu)


def check_block_size(block_size, owner: str = "quantize_blockwise") -> int:
    if (isinstance(block_size, bool) or not isinstance(block_size, int) or not 64 <= block_size <= 4096
            or block_size & (block_size - 1)):
        raise ValueError(f"{owner}: block_size={block_size!r} must be a power of two from 64 to 4096")
    return block_size


def check_float(x: Tensor, owner: str = "quantize_blockwise", name: str = "x") -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{owner}: {name} has dtype {x.dtype}; expected a floating-point tensor "
                         "(float32, float64, bfloat16 or float16)")


def num_blocks(n: int, block_size: int) -> int:
    return math.ceil(n / block_size)


def nearest_code(xn: Tensor, code: Tensor) -> Tensor:
    """Index of the nearest value of the sorted map `code` for each fp32 `xn` (ties: the lower index); 0 for a
    NaN, as the extension's and the Triton kernels' search and bitsandbytes' CPU quantizer give it."""
    idx = (torch.searchsorted(code, xn, right=True) - 1).clamp_(0, 255)  # largest j with code[j] <= xn, else 0
    left = code[idx]
    right = code[(idx + 1).clamp(max=255)]
    up = ((xn - right).abs() < (xn - left).abs()) & (idx < 255)
    return torch.where(xn.isnan(), 0, idx + up.long()).to(torch.uint8)


def _blocks(x: Tensor, block_size: int) -> Tensor:
    """x flattened to fp32, zero-padded to whole blocks: (num_blocks, block_size)."""
    flat = x.reshape(-1).to(torch.float32)
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def quantize_blockwise(x: Tensor, block_size: int = 256, signed: bool = True) -> tuple[Tensor, Tensor]:
    """(codes: uint8 of x's shape, absmax: fp32 [ceil(n / block_size)])."""
    check_block_size(block_size)
    check_float(x)
    blocks = _blocks(x, block_size)
    # The largest |x| of the block's numbers: a NaN is passed over (fmaxf in the extension, max in Triton, as in
    # bitsandbytes' CPU quantizer), so it costs its own element only; an inf makes the absmax inf (and the block's
    # values 0 or NaN).
    mag = blocks.abs()
    absmax = torch.where(mag.isnan(), 0.0, mag).amax(dim=1) if blocks.numel() else blocks.new_zeros(0)
    xn = torch.where(absmax[:, None] > 0, blocks / absmax[:, None], torch.zeros_like(blocks))
    codes = nearest_code(xn.reshape(-1), dynamic_map(signed, x.device))[: x.numel()]
    return codes.view(x.shape), absmax


def dequantize_blockwise(codes: Tensor, absmax: Tensor, block_size: int = 256, signed: bool = True,
                         dtype: torch.dtype = torch.float32) -> Tensor:
    """map[codes] * absmax of each element's block, computed in fp32, returned as `dtype` in codes' shape."""
    check_block_size(block_size, "dequantize_blockwise")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dequantize_blockwise: dtype={dtype} must be a floating-point dtype "
                         "(float32, float64, bfloat16 or float16)")
    if codes.dtype != torch.uint8:
        raise ValueError(f"dequantize_blockwise: codes has dtype {codes.dtype}; expected torch.uint8")
    n = codes.numel()
    if absmax.numel() != num_blocks(n, block_size):
        raise ValueError(f"dequantize_blockwise: absmax has {absmax.numel()} elements; {n} codes in blocks of "
                         f"{block_size} need {num_blocks(n, block_size)}")
    if absmax.dtype != torch.float32:  # as quantize_blockwise returns it, and as the extension requires
        raise ValueError(f"dequantize_blockwise: absmax has dtype {absmax.dtype}; expected torch.float32")
    vals = dynamic_map(signed, codes.device)[codes.reshape(-1).long()]
    scale = absmax.repeat_interleave(block_size)[:n]
    return (vals * scale).to(dtype).view(codes.shape)
