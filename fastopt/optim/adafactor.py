"""fastopt.Adafactor: transformers' Adafactor, fused (math: fastopt/reference/adafactor.py)."""
from __future__ import annotations

import torch

from .. import ops
from ..distributed.layout import local
from .base import FLAG, NONNEG, POSITIVE, FastOptimizer, check, eps_pair, is_number, lr_rule


class Adafactor(FastOptimizer):
    """Adafactor with the signature and semantics of `transformers.optimization.Adafactor`.

    Factored second moment over the last two dims of every param with ndim >= 2 (leading dims are a batch of
    matrices), full second moment for vectors and single elements; relative step size, parameter-RMS
    scaling, warm-up, RMS clipping of the update, optional `beta1` momentum, decoupled weight decay.

    Args:
        params: iterable of params or param-group dicts.
        lr: external learning rate; must be None when `relative_step=True` (a group's lr is then ignored, as in
            transformers: its `AdafactorSchedule` writes the lr it logs there; see `_get_lr`).
        eps: (eps1, eps2): regularizer added to g^2, and the floor of the param RMS used as scale.
        clip_threshold: d, the RMS above which the update is scaled down.
        decay_rate: c in beta2_t = 1 - t^c (<= 0; 0, as transformers and torch take it: beta2_t = 0, V_t = G^2).
        beta1: momentum coefficient in [0, 1), or None for none (and no `exp_avg` state).
        weight_decay: decoupled decay, applied as p -= weight_decay * alpha_t * p.
        scale_parameter: scale the step by max(eps2, RMS(p)).
        relative_step: step size min(1e-2, 1/sqrt(t)) (or warm-up) instead of `lr`.
        warmup_init: with relative_step, the step size grows as 1e-6 t.
        bf16_stochastic_round: round bf16 params stochastically (unbiased) instead of to nearest.

    State per param (tensors only; loads with `torch.load(weights_only=True)`): `step` (fp32 scalar on the
    param's device), `exp_avg_sq_row` and `exp_avg_sq_col` (factored) or `exp_avg_sq`, and `exp_avg` with
    beta1; fp32, or fp64 for fp64 params. Works with `torch.amp.GradScaler` without host sync.
    """

    _name = "Adafactor"
    _supports_layouts = True
    _elementwise_state = ("exp_avg", "exp_avg_sq")  # the factors are whole
    _layout_keys = ("beta1",)  # None: no exp_avg
    _hyper_rules = dict(
        eps=eps_pair, clip_threshold=POSITIVE,
        decay_rate=(lambda v: is_number(v) and v <= 0, "be a finite number <= 0"),
        beta1=(lambda v: v is None or (is_number(v) and 0 <= v < 1), "be None or in [0, 1)"), weight_decay=NONNEG,
        scale_parameter=FLAG, relative_step=FLAG, warmup_init=FLAG, bf16_stochastic_round=FLAG,
        lr=lr_rule(">= 0", allow_none=True))

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False,
                 bf16_stochastic_round=False):
        defaults = self._check_hyper(dict(
            lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate, beta1=beta1,
            weight_decay=weight_decay, scale_parameter=scale_parameter, relative_step=relative_step,
            warmup_init=warmup_init, bf16_stochastic_round=bf16_stochastic_round))
        super().__init__(params, defaults)

    # ---- validation -----------------------------------------------------------------------------------
    def _check_hyper(self, hp: dict, where: str | None = None) -> dict:
        """The base class's rules, then lr, relative_step and warmup_init together (a group's missing ones
        taken from the defaults)."""
        out = super()._check_hyper(hp, where)
        n = self._name

        def name(k):
            return k if where is None else f"{where}['{k}']"

        if {"lr", "relative_step", "warmup_init"} & set(hp):
            full = hp if where is None else {**self.defaults, **hp}
            lr, relative = full["lr"], full["relative_step"]
            # Refused where the lr is the caller's own: the constructor's, or an added group's (not one it takes
            # from the defaults, as a group that turns relative_step on beside groups with an lr does).
            if lr is not None and relative and (where is None or (self._adding and "lr" in hp)):
                raise ValueError(f"{n}: {name('lr')}={lr!r} cannot be combined with relative_step=True; "
                                 "pass lr=None, or relative_step=False with an lr")
            check(relative or lr is not None, name("lr"), n, lr, "be a finite number >= 0 when relative_step=False")
            check(relative or not full["warmup_init"], name("warmup_init"), n, full["warmup_init"],
                  "be False when relative_step=False (warm-up scales the relative step)")
        return out

    _adding = False

    def add_param_group(self, param_group: dict) -> None:
        """A group given an lr of its own with relative_step=True is refused, like the constructor's lr; one that
        only inherits the defaults' lr is not. Once added, a group's lr is ignored under relative_step (schedulers
        may write it)."""
        self._adding = True
        try:
            super().add_param_group(param_group)
        finally:
            self._adding = False

    @torch.no_grad()
    def _get_lr(self, param_group: dict, param_state: dict) -> float:
        """transformers' `Adafactor._get_lr`, which its `AdafactorSchedule` calls to log the lr (and writes into
        the group, where relative_step ignores it): the relative step size of the param's step (the group's lr
        without relative_step), times max(eps[1], RMS of the param) with scale_parameter. The RMS is of the
        param as it is now, over all its shards (a collective for a sharded param: every rank must call it, as
        every rank steps its scheduler); transformers' is from before the last step, an O(lr) difference."""
        from ..reference.adafactor import step_size
        step = param_state.get("step")
        t = torch.ones((), dtype=torch.float64) if step is None else local(step).detach().double().cpu().clamp(min=1)
        sq, n = torch.zeros((), dtype=torch.float64), 1
        if param_group["scale_parameter"]:
            p = next((q for q in param_group["params"] if self.state.get(q) is param_state),
                     param_group["params"][0])
            lay, x = self._layout(p), local(p).detach()
            if lay is None:
                sq, n = x.double().square().sum(), max(1, x.numel())
            else:
                sq = lay.local_view(x).double().square().sum().reshape(1)
                lay.reduce(sq)
                n = max(1, lay.numel)
        lr = self._values(param_group, ("lr",))["lr"]
        return float(step_size(t, sq.cpu().reshape(()), n, lr=lr, eps2=param_group["eps"][1],
                               relative_step=param_group["relative_step"], warmup_init=param_group["warmup_init"],
                               scale_parameter=param_group["scale_parameter"]))

    def _state_spec(self, p, group):
        """Row and column factors span the whole (global) matrix, identical on every rank that holds a piece
        of a sharded param; the element-wise states are shaped like the local piece."""
        dt = self.state_dtype(p)
        here, shape = tuple(local(p).shape), self._global_shape(p)
        spec = {}
        if len(shape) >= 2:
            spec["exp_avg_sq_row"] = (shape[:-1], dt)
            spec["exp_avg_sq_col"] = (shape[:-2] + shape[-1:], dt)
        else:
            spec["exp_avg_sq"] = (here, dt)
        if group["beta1"] is not None:
            spec["exp_avg"] = (here, dt)
        return spec

    def _step_group(self, group, params, grads, states, scaler, layouts=None, sharded=False, sr_ids=None):
        hyper = self._values(group, ("lr", "eps", "clip_threshold", "decay_rate", "beta1", "weight_decay",
                                     "scale_parameter", "relative_step", "warmup_init", "bf16_stochastic_round"))
        return ops.adafactor_phases(params, grads, states, inv_scale=scaler.inv_scale, found_inf=scaler.found_inf,
                                    cache=self._plan_cache(group, params, layouts),
                                    layouts=layouts, sharded=sharded, sr_ids=sr_ids, **hyper)

    def _from_foreign(self, state_dict):
        """load_state_dict also takes transformers' `Adafactor` state_dicts: the same state keys (`exp_avg_sq_row`,
        `exp_avg_sq_col` or `exp_avg_sq`, `exp_avg` with beta1), their int `step` becomes a tensor, their
        `RMS` (recomputed there every step from the param, unused across steps) is dropped, and their groups
        get this optimizer's `bf16_stochastic_round`."""
        parts = self._foreign_parts(
            state_dict, lambda g: "bf16_stochastic_round" not in g and set(_TRANSFORMERS_KEYS) <= set(g))
        if parts is not None:
            state, groups = parts
            state = {pid: ({k: v for k, v in st.items() if k != "RMS"} if isinstance(st, dict) else st)
                     for pid, st in state.items()}
            state_dict = {"state": state,
                          "param_groups": [{**g, "bf16_stochastic_round": ours["bf16_stochastic_round"]}
                                           for g, ours in zip(groups, self.param_groups)]}
        return state_dict


# Group keys of transformers' Adafactor; a state_dict whose groups hold these and no fastopt-only key is its.
_TRANSFORMERS_KEYS = ("lr", "eps", "clip_threshold", "decay_rate", "beta1", "weight_decay", "scale_parameter",
                      "relative_step", "warmup_init")
