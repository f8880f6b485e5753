"""Pieces of the reference math that several optimizers share."""
from __future__ import annotations

import torch
from torch import Tensor


def stochastic_round_bf16(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round fp32 `x` to bf16 up or down with probability proportional to the distance (unbiased).

    Adds uniform random bits below bf16's 16-bit mantissa cut, then truncates: E[round(x)] = x.
    """
    bits = x.to(torch.float32).view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=generator)
    out = ((bits + noise) & -65536).view(torch.float32)
    out = torch.where(torch.isfinite(x), out, x.to(torch.float32))
    return out.to(torch.bfloat16)
