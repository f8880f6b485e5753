"""fastopt.CAME: came-pytorch's CAME, fused (math: fastopt/reference/came.py)."""
from __future__ import annotations

import math

import torch

from .. import ops
from ..distributed.layout import local
from ..reference import quant
from ..reference.came import QBLOCK
from .base import FLAG, NBITS, NONNEG, POSITIVE, FastOptimizer, betas_rule, eps_pair, lr_rule

# Group keys of came-pytorch's CAME; a state_dict whose groups hold only these comes from came-pytorch.
_CAME_PYTORCH_KEYS = ("lr", "eps", "clip_threshold", "betas", "weight_decay")


class CAME(FastOptimizer):
    """CAME with the signature and semantics of came-pytorch's `CAME`.

    Factored second moment of g^2 + eps1 over the last two dims of every param with ndim >= 2 (leading dims
    are a batch of matrices), RMS clipping of the update, momentum on the clipped update, the factored
    instability (u - m)^2 + eps2 that scales the momentum into the update (confidence); vectors and single
    elements keep a full second moment and step by the momentum alone. No bias correction; decoupled weight
    decay scaled by lr.

    Args:
        params: iterable of params or param-group dicts.
        lr: learning rate (required, > 0).
        eps: (eps1, eps2): regularizers added to g^2 and to the instability.
        clip_threshold: d, the RMS above which the update is scaled down.
        betas: (b1, b2, b3): momentum, second moment and instability decay rates, each in [0, 1).
        weight_decay: decoupled decay, applied as p -= lr * weight_decay * p.
        bf16_stochastic_round: round bf16 params stochastically (unbiased) instead of to nearest.
        nbits: 32, or 8 to keep the momentum `exp_avg` in 8-bit block-wise form (`exp_avg` holds the codes,
            `exp_avg_absmax` the per-block scales).

    State per param (tensors only; loads with `torch.load(weights_only=True)`): `step` (fp32 scalar on the
    param's device), `exp_avg`, and `exp_avg_sq_row`, `exp_avg_sq_col`, `exp_avg_res_row`, `exp_avg_res_col`
    (factored) or `exp_avg_sq`: came-pytorch's names, so its state_dicts load here. fp32, or fp64 for fp64
    params. Works with `torch.amp.GradScaler` without host sync.
    """

    _name = "CAME"
    _supports_layouts = True
    _elementwise_state = ("exp_avg", "exp_avg_sq")  # the four factors are whole
    _layout_keys = ("nbits",)
    # A group's lr may be 0 (a warm-up schedule starts there, CosineAnnealingLR may end there); the
    # constructor's must be > 0, as came-pytorch checks it (`_check_hyper`).
    _hyper_rules = dict(
        lr=lr_rule(">= 0"), eps=eps_pair, betas=betas_rule(3), clip_threshold=POSITIVE, weight_decay=NONNEG,
        bf16_stochastic_round=FLAG, nbits=NBITS)
    _constructor_lr = staticmethod(lr_rule("> 0", hint=" (CAME has no relative step size: pass lr)"))

    def __init__(self, params, lr=None, eps=(1e-30, 1e-16), clip_threshold=1.0, betas=(0.9, 0.999, 0.9999),
                 weight_decay=0.0, bf16_stochastic_round=False, nbits=32):
        defaults = self._check_hyper(dict(lr=lr, eps=eps, clip_threshold=clip_threshold, betas=betas,
                                          weight_decay=weight_decay, bf16_stochastic_round=bf16_stochastic_round,
                                          nbits=nbits))
        super().__init__(params, defaults)

    # came-pytorch's answers to fairseq's optimizer interface: fp16 params step as they are (fp32 states); one
    # flattened param would lose the matrix shapes the factored moments need.
    @property
    def supports_memory_efficient_fp16(self) -> bool:
        return True

    @property
    def supports_flat_params(self) -> bool:
        return False

    def _check_hyper(self, hp: dict, where: str | None = None) -> dict:
        """The base class's rules; the constructor's lr must also be > 0."""
        if where is None and "lr" in hp:
            self._constructor_lr(self._name, "lr", hp["lr"])
        return super()._check_hyper(hp, where)

    def _state_spec(self, p, group):
        """The four factors span the whole (global) matrix, identical on every rank that holds a piece of a
        sharded param; the momentum and the unfactored second moment are shaped like the local piece (8-bit:
        blocks of the local piece)."""
        dt = self.state_dtype(p)
        here, shape = tuple(local(p).shape), self._global_shape(p)
        spec = {}
        if group["nbits"] == 8:
            spec["exp_avg"] = (here, torch.uint8)
            spec["exp_avg_absmax"] = ((quant.num_blocks(math.prod(here), QBLOCK),), torch.float32)
        else:
            spec["exp_avg"] = (here, dt)
        if len(shape) >= 2:
            rows, cols = shape[:-1], shape[:-2] + shape[-1:]
            spec.update(exp_avg_sq_row=(rows, dt), exp_avg_sq_col=(cols, dt), exp_avg_res_row=(rows, dt),
                        exp_avg_res_col=(cols, dt))
        else:
            spec["exp_avg_sq"] = (here, dt)
        return spec

    def _step_group(self, group, params, grads, states, scaler, layouts=None, sharded=False, sr_ids=None):
        hyper = self._values(group, ("lr", "eps", "clip_threshold", "betas", "weight_decay",
                                     "bf16_stochastic_round", "nbits"))
        return ops.came_phases(params, grads, states, inv_scale=scaler.inv_scale, found_inf=scaler.found_inf,
                               cache=self._plan_cache(group, params, layouts),
                               layouts=layouts, sharded=sharded, sr_ids=sr_ids, **hyper)

    def _quantized_keys(self, group):
        return {"exp_avg": ("exp_avg_absmax", True, QBLOCK)}

    def _from_foreign(self, state_dict):
        """load_state_dict also takes came-pytorch's state_dicts: their int `step` becomes a tensor, their `RMS`
        (recomputed there every step, unused by the math) is dropped, and the groups get this optimizer's
        fastopt-only options."""
        parts = self._foreign_parts(state_dict, lambda g: set(_CAME_PYTORCH_KEYS) <= set(g) and "nbits" not in g)
        if parts is not None:
            state, groups = parts
            extra = ("bf16_stochastic_round", "nbits")
            groups = [{**g, **{k: ours[k] for k in extra}} for g, ours in zip(groups, self.param_groups)]
            state = {pid: ({k: (torch.tensor(float(v)) if k == "step" and not isinstance(v, torch.Tensor) else v)
                            for k, v in st.items() if k != "RMS"} if isinstance(st, dict) else st)
                     for pid, st in state.items()}
            state_dict = {"state": state, "param_groups": groups}
        return state_dict
