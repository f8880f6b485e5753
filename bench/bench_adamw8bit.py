"""fastopt.AdamW8bit against bitsandbytes' AdamW8bit and torch's fused 32-bit AdamW; 8-bit quantize/dequantize.

Optimizer rows (all with lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2):

- fastopt.AdamW8bit: the compiled extension's fused step (csrc/adamw_cuda.cu; C++ kernels on CPU).
- bitsandbytes AdamW8bit (where it imports): its block-wise 8-bit step.
- torch.optim.AdamW(fused=True) and (foreach=True): 32-bit state, the speed and memory baseline.

Bytes per element of a param of s bytes (the minimum each algorithm must move; GB/s and % copy use the
algorithm's own count, so a 32-bit row and an 8-bit row are each measured against their own traffic):
read g and p, write p: 3 s. 8-bit state (tensors >= min_8bit_size = 4096): m and v codes read and written
(4 bytes) and the fp32 absmax of both read and written (16 / 256 bytes at block 256); fastopt's small
tensors keep fp32 m and v: 16 bytes. torch's AdamW keeps m and v in the param dtype: 4 s bytes. fastopt's kernels move
exactly these bytes (one pass per element), so `kernel B/param` equals `min B/param` for its rows.

Quantization rows ("quantize" / "dequantize" bench names in the table) time one multi-tensor call over every
param of the set: fp32/bf16 in, uint8 codes + fp32 absmax out (s + 1 + 4 / 256 bytes per element), and back;
bitsandbytes' functional quantize_blockwise / dequantize_blockwise, one call per tensor, next to them. The
target (issue 5): at least 80% of the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import math

import torch

try:
    from . import common
except ImportError:
    import common

import fastopt
from fastopt import ops

STEM = "adamw8bit"
BLOCK = 256
MIN_8BIT = 4096


def min_bytes_8bit(pset, dtype) -> int:
    s = common.elem_bytes(dtype)
    total = 0
    for _, shape in pset.shapes:
        n = math.prod(shape)
        state = (4 + 16 * math.ceil(n / BLOCK) / n) if n >= MIN_8BIT else 16
        total += (3 * s + state) * n
    return int(total)


def min_bytes_32bit(pset, dtype) -> int:
    """torch's AdamW keeps m and v in the param dtype: both read and written, 4 s bytes per element."""
    return common.min_bytes(pset, dtype, reads=2, writes=1, state_elem=4.0 * common.elem_bytes(dtype))


def quant_bytes(pset, dtype) -> int:
    s = common.elem_bytes(dtype)
    return int(sum((s + 1) * math.prod(sh) + 4 * math.ceil(math.prod(sh) / BLOCK) for _, sh in pset.shapes))


def _backend(params) -> str:
    if not ops.use_extension():
        return "torch reference"
    return "extension (CUDA)" if params[0].is_cuda else "extension (C++ CPU)"


def _bnb(params):
    import bitsandbytes as bnb
    return bnb.optim.AdamW8bit(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def _torch(kind):
    def make(params):
        return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **{kind: True})
    return make


class _Quant:
    """Holds the buffers of a quantize/dequantize row (`measure()` times `step(holder, params)`)."""

    def __init__(self, params, dtype):
        self.state = {}
        self.codes = [torch.empty(p.shape, dtype=torch.uint8, device=p.device) for p in params]
        self.absmax = [torch.empty(math.ceil(p.numel() / BLOCK), dtype=torch.float32, device=p.device) for p in params]
        self.out = [torch.empty_like(p, dtype=dtype) for p in params]
        self.state[0] = {"codes": self.codes, "absmax": self.absmax}


def _q_step(holder, params):
    ops.quantize_blockwise_([p.detach() for p in params], holder.codes, holder.absmax, block_size=BLOCK)


def _dq_step(holder, params):
    ops.dequantize_blockwise_(holder.codes, holder.absmax, holder.out, block_size=BLOCK)


def _bnb_q_step(holder, params):
    import bitsandbytes.functional as F
    for p in params:
        F.quantize_blockwise(p.detach(), blocksize=BLOCK)


def _bnb_dq_step(holder, params):
    import bitsandbytes.functional as F
    for c, a in zip(holder.codes, holder.absmax):  # (its out= variant has no CPU kernel)
        F.dequantize_blockwise(c, absmax=a, blocksize=BLOCK)


def _bnb_available(params):
    import bitsandbytes  # noqa: F401  (ImportError becomes a 'skipped' row)


def run(args) -> list[dict]:
    out = []
    for pset in common.param_sets(args):
        for dtype in common.dtypes(args):
            mb8, mb32 = min_bytes_8bit(pset, dtype), min_bytes_32bit(pset, dtype)
            out.append(common.measure(
                args, STEM, "fastopt.AdamW8bit", pset, dtype, lambda ps: fastopt.AdamW8bit(ps), min_bytes=mb8,
                kernel_bytes=mb8, ours=True, backend=_backend,
                notes="one fused pass per element (8-bit state for tensors >= 4096 elements, fp32 below)"))
            out.append(common.measure(args, STEM, "bitsandbytes AdamW8bit", pset, dtype, _bnb, min_bytes=mb8,
                                      backend="bitsandbytes"))
            out.append(common.measure(args, STEM, "torch.optim.AdamW(fused)", pset, dtype, _torch("fused"),
                                      min_bytes=mb32, backend="fused",
                                      notes="m, v in the param dtype: min B/param counts them"))
            out.append(common.measure(args, STEM, "torch.optim.AdamW(foreach)", pset, dtype, _torch("foreach"),
                                      min_bytes=mb32, backend="foreach"))
            qb = quant_bytes(pset, dtype)

            def holder(ps, dtype=dtype):
                return _Quant(ps, dtype)

            def bnb_holder(ps, dtype=dtype):
                _bnb_available(ps)
                h = _Quant(ps, dtype)
                _q_step(h, ps)  # bitsandbytes dequantizes our codes: same format
                return h

            def prepared(ps, dtype=dtype):
                h = _Quant(ps, dtype)
                _q_step(h, ps)
                return h

            out.append(common.measure(args, "quantize", "fastopt quantize_blockwise_", pset, dtype, holder,
                                      min_bytes=qb, kernel_bytes=qb, ours=True, step=_q_step, backend=_backend,
                                      notes="one multi-tensor launch over every param"))
            out.append(common.measure(args, "quantize", "bitsandbytes quantize_blockwise", pset, dtype, bnb_holder,
                                      min_bytes=qb, step=_bnb_q_step, backend="bitsandbytes",
                                      notes="one call per tensor"))
            out.append(common.measure(args, "dequantize", "fastopt dequantize_blockwise_", pset, dtype, prepared,
                                      min_bytes=qb, kernel_bytes=qb, ours=True, step=_dq_step, backend=_backend,
                                      notes="one multi-tensor launch over every param"))
            out.append(common.measure(args, "dequantize", "bitsandbytes dequantize_blockwise", pset, dtype,
                                      bnb_holder, min_bytes=qb, step=_bnb_dq_step, backend="bitsandbytes",
                                      notes="one call per tensor"))
    return out


if __name__ == "__main__":
    common.main(STEM, run)
