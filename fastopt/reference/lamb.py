"""LAMB in plain torch: the spec, the CPU path and the oracle of the Triton kernels.

You, Li, Reddi et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes" (2020),
Algorithm 2, with the conventions of the LAMB in ColossalAI's distributed-optimizers documentation (bias
correction folded into the step size, eps added to the uncorrected sqrt(v)). For a parameter p with
gradient g at step t:

    m_t = beta1 m_{t-1} + (1 - beta1) g                                  first moment      (Alg. 2)
    v_t = beta2 v_{t-1} + (1 - beta2) g^2                                second moment
    eta = lr sqrt(1 - beta2^t) / (1 - beta1^t)   (lr without bias_correction)
    a   = m_t / (sqrt(v_t) + eps) + weight_decay p                       Adam update + decay
    r   = ||p|| / ||a||, or 1 where either norm is zero                  trust ratio       (Alg. 2, phi = id)
    r   = min(r, max_trust_ratio)                                        when max_trust_ratio is set
    p   = p - eta r a

The norms are over the whole parameter. With 8-bit state (`exp_avg` / `exp_avg_sq` uint8 codes in the
block-wise format of fastopt/reference/quant.py, signed map for m, unsigned for v, one fp32 absmax per block)
m_{t-1}, v_{t-1} are the dequantized states, a uses the exact m_t, v_t, and m_t, v_t are requantized after
the update (as bitsandbytes' 8-bit optimizers do).

The step runs in phases so that a distributed caller can sum the squared norms of every shard with one
collective: the step (a generator) yields the flat buffer [||p_0||^2, ||a_0||^2, ||p_1||^2, ||a_1||^2, ...] (in
the bucket's param order, fp64 for fp64 params, else fp32), which the caller sums in place over the ranks that
share the params (fastopt.distributed.phases) before it goes on.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .common import sr_args, stochastic_round_bf16, store_unscaled
from .quant import dequantize_blockwise, quantize_blockwise


def step_size(step: Tensor, *, lr, betas, bias_correction) -> Tensor:
    """eta in float64 (1 - beta^t loses most of its digits in fp32 when beta is close to 1)."""
    t = step.to(torch.float64)
    if not bias_correction:
        return torch.full_like(t, lr)
    beta1, beta2 = betas
    return lr * (1 - torch.pow(beta2, t)).sqrt() / (1 - torch.pow(beta1, t))


def trust_ratio(p_sq: Tensor, a_sq: Tensor, max_trust_ratio=None) -> Tensor:
    """||p|| / ||a|| from the squared norms, 1 where either is zero, clamped from above when asked."""
    ratio = torch.where((p_sq > 0) & (a_sq > 0), p_sq.sqrt() / a_sq.sqrt(), torch.ones_like(p_sq))
    if max_trust_ratio is not None:
        ratio = ratio.clamp(max=max_trust_ratio)
    return ratio


def is_8bit(state: dict) -> bool:
    return state["exp_avg"].dtype == torch.uint8


def load_moments(state: dict, dtype: torch.dtype, block_size: int) -> tuple[Tensor, Tensor]:
    """(m_{t-1}, v_{t-1}) in `dtype`, dequantized when the state is 8-bit."""
    if not is_8bit(state):
        return state["exp_avg"].to(dtype), state["exp_avg_sq"].to(dtype)
    return (dequantize_blockwise(state["exp_avg"], state["exp_avg_absmax"], block_size, signed=True, dtype=dtype),
            dequantize_blockwise(state["exp_avg_sq"], state["exp_avg_sq_absmax"], block_size, signed=False,
                                 dtype=dtype))


def _commit(dst: Tensor, new: Tensor, found_inf: Tensor | None) -> None:
    """dst <- new, unless GradScaler found an inf this step (then dst is left as it was)."""
    new = new.to(dst.dtype)
    if found_inf is not None:
        new = torch.where(found_inf > 0, dst, new)
    dst.copy_(new)


def store_moments(state: dict, m: Tensor, v: Tensor, block_size: int, found_inf: Tensor | None) -> None:
    """m_t, v_t into the state (requantized when it is 8-bit), unless GradScaler found an inf this step."""
    if is_8bit(state):
        for key, x, signed in (("exp_avg", m, True), ("exp_avg_sq", v, False)):
            codes, absmax = quantize_blockwise(x, block_size, signed=signed)
            _commit(state[key], codes, found_inf)
            _commit(state[key + "_absmax"], absmax, found_inf)
    else:
        _commit(state["exp_avg"], m, found_inf)
        _commit(state["exp_avg_sq"], v, found_inf)


def reduction_sizes(shapes, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
    """The buffer `lamb_phases` yields to be summed for a bucket of params of these shapes and `dtype`: the
    squared norms of p and of the update, two per param."""
    return [(2 * len(shapes), torch.float64 if dtype == torch.float64 else torch.float32)]


def lamb_phases(params: list[Tensor], grads: list[Tensor], states: list[dict], *, lr, betas, eps, weight_decay,
                bias_correction, max_trust_ratio=None, bf16_stochastic_round: bool = False, block_size: int = 256,
                inv_scale: Tensor | None = None, found_inf: Tensor | None = None, sharded: bool = False,
                layouts: list | None = None, sr_ids: list | None = None):
    """One step over a bucket of params (same device and dtype); math in fp64 for fp64 params, else fp32. A
    generator: with `sharded`, it yields the buffer of squared norms to be summed over the ranks that share the
    params (fastopt.distributed.phases).
    `bf16_stochastic_round`: bf16 params are rounded by common.stochastic_round_bf16, its noise a function of
    (step, the param's id in `sr_ids` (None: its index in `params`), the element's offset in the global tensor,
    which `layouts[i]` gives; None: param i is whole) only."""
    beta1, beta2 = betas
    acc = torch.float64 if params[0].dtype == torch.float64 else torch.float32

    # Phase 1: new moments, the update a, and the squared norms of p and a, in one flat buffer.
    moments, updates, sums = [], [], []
    for p, grad, s in zip(params, grads, states):
        g = grad.to(acc) * inv_scale if inv_scale is not None else grad.to(acc)
        if inv_scale is not None:
            store_unscaled(grad, g, found_inf)
        m_old, v_old = load_moments(s, acc, block_size)
        m = beta1 * m_old + (1 - beta1) * g
        v = beta2 * v_old + (1 - beta2) * g * g
        pf = p.to(acc)
        a = m / (v.sqrt() + eps)
        if weight_decay != 0:
            a = a + weight_decay * pf
        moments.append((m, v))
        updates.append(a)
        sums += [(pf * pf).sum(), (a * a).sum()]
    sums = torch.stack(sums)
    if sharded:
        yield sums

    # Phase 2: trust ratios, write.
    bf16_sr = bf16_stochastic_round and params[0].dtype == torch.bfloat16
    sr = sr_args(sr_ids, layouts, params[0].device, len(params)) if bf16_sr else None
    for i, (p, s, (m, v), a) in enumerate(zip(params, states, moments, updates)):
        ratio = trust_ratio(sums[2 * i], sums[2 * i + 1], max_trust_ratio)
        eta = step_size(s["step"], lr=lr, betas=betas, bias_correction=bias_correction)
        p_new = p.to(acc) - (eta * ratio.to(torch.float64)).to(acc) * a
        store_moments(s, m, v, block_size, found_inf)
        if bf16_sr:
            p_new = stochastic_round_bf16(p_new, s["step"], *sr[i])
        _commit(p, p_new, found_inf)
