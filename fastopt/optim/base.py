"""What every fastopt optimizer shares: argument checks, gradient validation, buckets, GradScaler, state_dict.

Subclasses implement `_state_spec(p, group)` (the state a parameter gets: key -> (shape, dtype)) and
`_step_group(group, params, grads, states, scaler)` (one fused step over a bucket of params that share a
device and dtype). Everything torch users expect from `torch.optim` comes from `torch.optim.Optimizer`.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.layout import layout_of, local

__all__ = ["FastOptimizer", "check", "check_betas", "ScalerArgs"]


def check(cond: bool, name: str, owner: str, value: Any, must: str) -> None:
    """Raise `ValueError("Owner: name=value must ...")` unless `cond`."""
    if not cond:
        raise ValueError(f"{owner}: {name}={value!r} must {must}")


def check_betas(owner: str, betas, n: int, name: str = "betas") -> tuple:
    if not isinstance(betas, (tuple, list)) or len(betas) != n:
        raise ValueError(f"{owner}: {name}={betas!r} must be a tuple of {n} floats")
    for i, b in enumerate(betas):
        check(isinstance(b, (int, float)) and 0.0 <= b < 1.0, f"{name}[{i}]", owner, b, "be in [0, 1)")
    return tuple(float(b) for b in betas)


class ScalerArgs:
    """GradScaler's `grad_scale` / `found_inf`, on one device, as the kernels consume them.

    `inv_scale` multiplies the gradient; `found_inf` (0. or 1.) tells every kernel to leave params and
    state untouched. Both stay on the device: no host sync.
    """

    __slots__ = ("inv_scale", "found_inf")

    def __init__(self, inv_scale: Tensor | None, found_inf: Tensor | None):
        self.inv_scale = inv_scale
        self.found_inf = found_inf

    @property
    def active(self) -> bool:
        return self.inv_scale is not None or self.found_inf is not None


class FastOptimizer(torch.optim.Optimizer):
    # GradScaler sets `self.grad_scale` and `self.found_inf` and lets step() unscale and skip on device.
    _step_supports_amp_scaling = True
    _name = "FastOptimizer"

    # ---- subclass interface -------------------------------------------------------------------
    def _state_spec(self, p: Tensor, group: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def _step_group(self, group: dict, params: list[Tensor], grads: list[Tensor],
                    states: list[dict], scaler: ScalerArgs) -> None:
        raise NotImplementedError

    # ---- shared machinery ---------------------------------------------------------------------
    @staticmethod
    def state_dtype(p: Tensor) -> torch.dtype:
        """fp64 params keep fp64 state (the math alone, no rounding); all others fp32."""
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def _init_state(self, p: Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            for key, (shape, dtype) in self._state_spec(p, group).items():
                state[key] = torch.zeros(shape, dtype=dtype, device=p.device)
        return state

    def _check_grads(self) -> None:
        """Every refusal happens here, before any parameter or state changes."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self._name} does not support sparse gradients")
                if torch.is_complex(p) or torch.is_complex(p.grad):
                    raise RuntimeError(f"{self._name} does not support complex parameters")
                if not p.is_floating_point():
                    raise RuntimeError(f"{self._name}: parameter of dtype {p.dtype} is not floating point")

    def _scaler_args(self, device: torch.device, cache: dict) -> ScalerArgs:
        if device in cache:
            return cache[device]
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        inv = None
        if grad_scale is not None:
            inv = grad_scale.to(device=device, dtype=torch.float32, non_blocking=True).reciprocal()
        fi = None
        if found_inf is not None:
            fi = found_inf.to(device=device, dtype=torch.float32, non_blocking=True)
        cache[device] = ScalerArgs(inv, fi)
        return cache[device]

    # Subclasses whose `_step_group` takes `layouts=` and `reduce=` are exact on sharded params (DTensor).
    _supports_layouts = False

    def _layout(self, p: Tensor):
        cache = self.__dict__.setdefault("_layout_cache", {})
        key = id(p)
        if key not in cache:
            cache[key] = (p, layout_of(p))  # keep p alive so its id is not reused
        return cache[key][1]

    def _buckets(self, params: Iterable[Tensor]) -> dict:
        """Params with grads and elements, grouped by (device, dtype, reduction group): one fused launch
        sequence, and one collective per phase, for each."""
        out: dict = defaultdict(list)
        for p in params:
            if p.grad is None or p.numel() == 0:
                continue
            lay = self._layout(p)
            out[(p.device, p.dtype, None if lay is None else lay.group_key)].append(p)
        return out

    @staticmethod
    def _advance_steps(steps: list[Tensor], scaler: ScalerArgs) -> None:
        """step += 1, or += 0 where GradScaler found an inf: one foreach launch, no host sync."""
        if scaler.found_inf is None:
            torch._foreach_add_(steps, 1.0)
        else:
            torch._foreach_add_(steps, 1.0 - scaler.found_inf)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_grads()
        scalers: dict = {}
        for group in self.param_groups:
            for (device, _dtype, group_key), params in self._buckets(group["params"]).items():
                if group_key is not None and not self._supports_layouts:
                    raise NotImplementedError(f"{self._name} does not support sharded (DTensor) parameters yet")
                grads = [local(p.grad) for p in params]
                states = [self._init_state(p, group) for p in params]
                scaler = self._scaler_args(device, scalers)
                self._advance_steps([s["step"] for s in states], scaler)
                if group_key is None:
                    self._step_group(group, [local(p) for p in params], grads, states, scaler)
                else:
                    layouts = [self._layout(p) for p in params]
                    pg = layouts[0].group
                    self._step_group(group, [local(p) for p in params], grads, states, scaler, layouts=layouts,
                                     reduce=lambda buf: dist.all_reduce(buf, group=pg))
        return loss

    # ---- state_dict -----------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """Load after checking everything; on any mismatch raise and leave the optimizer as it was.

        Unlike `torch.optim.Optimizer`, state tensors keep their saved dtype (fp32 state of a bf16 param
        stays fp32) and move to their param's device.
        """
        self._validate_state_dict(state_dict)
        saved_state = state_dict["state"]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        id_map = dict(zip(ids, params))
        for pid, st in saved_state.items():
            p = id_map[pid]
            self.state[p] = {
                k: (v.detach().to(device=p.device, dtype=torch.float32 if k == "step" else v.dtype, copy=True)
                    if isinstance(v, Tensor) else v)
                for k, v in st.items()
            }

    def _validate_state_dict(self, state_dict: dict) -> None:
        name = self._name
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError(f"{name}.load_state_dict: expected a dict with keys 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{name}.load_state_dict: state_dict has {len(saved_groups)} param groups, "
                             f"this optimizer has {len(self.param_groups)}")
        id_map = {}
        for gi, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"{name}.load_state_dict: param_groups[{gi}] has {len(sg['params'])} params "
                                 f"in the state_dict, {len(g['params'])} here")
            ours = set(self.defaults)
            theirs = set(sg) - {"params", "param_names"}
            if not ours <= theirs:
                raise ValueError(f"{name}.load_state_dict: param_groups[{gi}] lacks {sorted(ours - theirs)}: "
                                 f"not a {name} state_dict")
            for pid, p in zip(sg["params"], g["params"]):
                id_map[pid] = (p, g)
        for pid, st in state_dict["state"].items():
            if pid not in id_map:
                raise ValueError(f"{name}.load_state_dict: state for unknown param id {pid}")
            p, g = id_map[pid]
            spec = self._state_spec(p, {**g, **{k: v for k, v in
                                                 next(sg for sg in saved_groups if pid in sg["params"]).items()
                                                 if k != "params"}})
            expected = set(spec) | {"step"}
            if set(st) != expected:
                raise ValueError(f"{name}.load_state_dict: state of param {pid} has keys {sorted(st)}, "
                                 f"expected {sorted(expected)}")
            for k, (shape, _dtype) in spec.items():
                v = st[k]
                if not isinstance(v, Tensor) or tuple(v.shape) != tuple(shape):
                    got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                    raise ValueError(f"{name}.load_state_dict: state[{pid}][{k!r}] has shape {got}, "
                                     f"expected {tuple(shape)}")
                if v.is_floating_point() and not torch.isfinite(v).all():
                    raise ValueError(f"{name}.load_state_dict: state[{pid}][{k!r}] holds non-finite values")
            step = st["step"]
            if not isinstance(step, Tensor) or step.numel() != 1 or not math.isfinite(float(step)):
                raise ValueError(f"{name}.load_state_dict: state[{pid}]['step'] must be a finite scalar tensor")
