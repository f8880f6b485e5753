"""AdamW with 8-bit block-wise state in plain torch: the spec of csrc/'s fused kernel, the torch path, the oracle.

Loshchilov & Hutter's AdamW (torch.optim.AdamW's form) with Dettmers et al.'s 8-bit block-wise states
(bitsandbytes' AdamW8bit). For a parameter p with gradient g at step t:

    m, v     = deq(state1, absmax1, signed map), deq(state2, absmax2, unsigned map)
    m        = b1 m + (1 - b1) g
    v        = b2 v + (1 - b2) g^2
    p        = p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    state1, absmax1 = quant(m, signed map);  state2, absmax2 = quant(v, unsigned map)

The update uses the new m and v before they are requantized (as bitsandbytes does). Params with fewer than
`min_8bit_size` elements keep full-precision `state1`/`state2` (fp32, fp64 for fp64 params) and skip the
(de)quantization. Math in fp32 (fp64 for fp64 params); quantization always rounds to fp32 first.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import store_unscaled
from .quant import dequantize_blockwise, quantize_blockwise


def is_8bit(state: dict) -> bool:
    return "absmax1" in state


def _log(beta: float) -> float:
    """log(beta) in double; -inf for beta = 0 (then -expm1(t log(beta)) = 1: no bias correction)."""
    return math.log(beta) if beta > 0 else -math.inf


def _commit(dst: Tensor, new: Tensor, found_inf: Tensor | None) -> None:
    """dst <- new, unless GradScaler found an inf this step."""
    if found_inf is not None:
        new = torch.where(found_inf > 0, dst, new.to(dst.dtype))
    dst.copy_(new)


def adamw8bit_step(params: list[Tensor], grads: list[Tensor], states: list[dict], *, lr: float,
                   betas: tuple[float, float], eps: float, weight_decay: float, block_size: int,
                   inv_scale: Tensor | None = None, found_inf: Tensor | None = None) -> None:
    """One step over params of one device and dtype; `states[i]['step']` is already advanced."""
    beta1, beta2 = betas
    for p, grad, s in zip(params, grads, states):
        acc = torch.float64 if p.dtype == torch.float64 else torch.float32
        g = grad.to(acc)
        if inv_scale is not None:
            g = g * inv_scale.to(acc)
            store_unscaled(grad, g, found_inf)
        if is_8bit(s):
            m = dequantize_blockwise(s["state1"], s["absmax1"], block_size, signed=True, dtype=acc)
            v = dequantize_blockwise(s["state2"], s["absmax2"], block_size, signed=False, dtype=acc)
        else:
            m, v = s["state1"].to(acc), s["state2"].to(acc)
        t = s["step"].to(acc)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        # 1 - beta^t as -expm1(t log(beta)), log(beta) in double (the extension's rule, csrc/fastopt_core.h): in
        # fp32, beta ** t rounds beta first, and 1 - beta^t multiplies that rounding by 1 / (1 - beta)
        step_size = lr / -torch.expm1(t * _log(beta1))
        sqrt_bc2 = (-torch.expm1(t * _log(beta2))).sqrt()
        p_new = p.to(acc) * (1 - lr * weight_decay) - step_size * (m / (v.sqrt() / sqrt_bc2 + eps))
        if is_8bit(s):
            for key, x, signed in (("1", m, True), ("2", v, False)):
                codes, absmax = quantize_blockwise(x, block_size, signed=signed)
                _commit(s["state" + key], codes, found_inf)
                _commit(s["absmax" + key], absmax, found_inf)
        else:
            _commit(s["state1"], m, found_inf)
            _commit(s["state2"], v, found_inf)
        _commit(p, p_new, found_inf)
