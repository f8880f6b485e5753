"""fastopt.Lamb: LAMB with a per-tensor trust ratio, fused (math: fastopt/reference/lamb.py)."""
from __future__ import annotations

import math

import torch

from .. import ops
from ..distributed.layout import local
from ..reference.quant import num_blocks
from .base import BLOCK_SIZE, FLAG, MIN_8BIT_SIZE, NBITS, NONNEG, FastOptimizer, betas_rule, is_number, lr_rule


class Lamb(FastOptimizer):
    """LAMB (You et al., 2020) with the signature and semantics of the LAMB in ColossalAI's
    distributed-optimizers documentation, plus an optional clamp of the trust ratio.

    Per parameter p with gradient g at step t: m and v as in Adam; the update
    a = m / (sqrt(v) + eps) + weight_decay * p; the trust ratio r = ||p|| / ||a|| (1 where either norm is
    zero), clamped to at most `max_trust_ratio` when given; p -= eta * r * a with
    eta = lr * sqrt(1 - beta2^t) / (1 - beta1^t) (bias_correction) or lr. The norms are over the whole
    parameter; the fused step computes them without a host sync. A NaN norm (a NaN gradient element without
    GradScaler) also gives r = 1: that element turns NaN and the others take a step of eta * a, unscaled.

    Args:
        params: iterable of params or param-group dicts.
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to sqrt(v) (>= 0).
        weight_decay: L2 term added to the update before the trust ratio (>= 0).
        bias_correction: fold Adam's bias corrections into the step size.
        max_trust_ratio: upper bound of the trust ratio (> 0), or None for none. It also bounds the ratio 1
            used where a norm is zero.
        bf16_stochastic_round: round bf16 params stochastically (unbiased) instead of to nearest.
        nbits: 32 (fp32 m and v; fp64 for fp64 params) or 8 (m and v in the 8-bit block-wise format of
            `fastopt.quantize_blockwise`: signed map for m, unsigned for v). The trust ratio is the real one:
            the norms of p and of the update computed from the exact m_t, v_t before they are requantized.
        block_size: elements per quantization block with nbits=8 (a power of two from 64 to 4096).
        min_8bit_size: with nbits=8, params with fewer elements keep 32-bit state.

    State per param (tensors only; loads with `torch.load(weights_only=True)`): `step` (fp32 scalar on the
    param's device), `exp_avg`, `exp_avg_sq` (fp32, or fp64 for fp64 params; with 8-bit state uint8 codes
    of the param's shape plus `exp_avg_absmax`, `exp_avg_sq_absmax`, fp32, one per block). Works with
    `torch.amp.GradScaler` without host sync: a step with an inf gradient changes nothing.
    """

    _name = "Lamb"
    # The norms are sums over elements: on a sharded param the local partial sums are summed over the ranks
    # that hold its pieces (the base class's `reduce`), whatever the layout (flat shards: padding cut off).
    _supports_layouts = True
    _elementwise_state = ("exp_avg", "exp_avg_sq")
    _layout_keys = ("nbits", "block_size", "min_8bit_size")
    _hyper_rules = dict(
        lr=lr_rule(">= 0"), betas=betas_rule(2), eps=NONNEG, weight_decay=NONNEG, bias_correction=FLAG,
        bf16_stochastic_round=FLAG, nbits=NBITS, block_size=BLOCK_SIZE, min_8bit_size=MIN_8BIT_SIZE,
        max_trust_ratio=(lambda v: v is None or (is_number(v) and v > 0), "be None or a finite number > 0"))

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True,
                 max_trust_ratio=None, bf16_stochastic_round=False, nbits=32, block_size=256, min_8bit_size=4096):
        defaults = self._check_hyper(dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            max_trust_ratio=max_trust_ratio, bf16_stochastic_round=bf16_stochastic_round, nbits=nbits,
            block_size=block_size, min_8bit_size=min_8bit_size))
        super().__init__(params, defaults)

    def _state_spec(self, p, group):
        """Shaped like the local piece of a sharded param; 8-bit when the whole param is large enough."""
        shape = tuple(local(p).shape)
        if group["nbits"] == 8 and math.prod(self._global_shape(p)) >= group["min_8bit_size"]:
            blocks = (num_blocks(math.prod(shape), group["block_size"]),)
            return {"exp_avg": (shape, torch.uint8), "exp_avg_absmax": (blocks, torch.float32),
                    "exp_avg_sq": (shape, torch.uint8), "exp_avg_sq_absmax": (blocks, torch.float32)}
        dt = self.state_dtype(p)
        return {"exp_avg": (shape, dt), "exp_avg_sq": (shape, dt)}

    def _quantized_keys(self, group):
        bs = group["block_size"]
        return {"exp_avg": ("exp_avg_absmax", True, bs), "exp_avg_sq": ("exp_avg_sq_absmax", False, bs)}

    def _step_group(self, group, params, grads, states, scaler, layouts=None, sharded=False, sr_ids=None):
        hyper = self._values(group, ("lr", "betas", "eps", "weight_decay", "bias_correction", "max_trust_ratio",
                                     "bf16_stochastic_round", "block_size"))
        return ops.lamb_phases(params, grads, states, inv_scale=scaler.inv_scale, found_inf=scaler.found_inf,
                               cache=self._plan_cache(group, params, layouts),
                               layouts=layouts, sharded=sharded, sr_ids=sr_ids, **hyper)
