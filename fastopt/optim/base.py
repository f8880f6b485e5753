"""What every fastopt optimizer shares: argument checks, gradient validation, buckets, GradScaler, state_dict.

Subclasses implement `_state_spec(p, group)` (the state a parameter gets: key -> (shape, dtype)) and `_step_group(group,
params, grads, states, scaler)` (one fused step over a bucket of params that share a device and dtype; those that
support sharded params return it as a generator of its collectives, fastopt.distributed.phases, so that `step()` batches
them over the buckets). Everything torch users expect from `torch.optim` comes from `torch.optim.Optimizer`.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import math
import numbers
import operator
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from .. import checkpoint as ckpt
from .. import ops
from ..distributed import phases
from ..distributed.layout import (_ATTR, Layout, eager_under_compile, fsdp1_refusal, fsdp_grads, layout_of, local,
                                  param_meta)

__all__ = ["FastOptimizer", "check", "check_betas", "ScalerArgs", "lr_rule", "host_value"]


# torch.nn.parameter.is_lazy(p) is isinstance(p, this); the isinstance alone in the per-step loops
_LAZY = torch.nn.parameter.UninitializedTensorMixin


def check(cond: bool, name: str, owner: str, value: Any, must: str) -> None:
    """Raise `ValueError("Owner: name=value must ...")` unless `cond`."""
    if not cond:
        raise ValueError(f"{owner}: {name}={value!r} must {must}")


def number_must(v, must: str) -> str:
    """`must`, plus why a tensor is refused where a plain number is taken (torch.optim.AdamW takes tensor betas;
    here only an lr may be a tensor, which the step reads anew each time): without it, `betas[0]=tensor(0.8)
    must be in [0, 1)` would read as if 0.8 were out of range."""
    if isinstance(v, Tensor):
        return f"not be a tensor (only lr may be one, 0-dim on the CPU: pass .item()); it must {must}"
    return must


def check_betas(owner: str, betas, n: int, name: str = "betas") -> tuple:
    if not isinstance(betas, (tuple, list)) or len(betas) != n:
        raise ValueError(f"{owner}: {name}={betas!r} must be a tuple of {n} floats")
    for i, b in enumerate(betas):
        check(is_number(b) and 0.0 <= b < 1.0, f"{name}[{i}]", owner, b, number_must(b, "be in [0, 1)"))
    return tuple(float(b) for b in betas)


def is_number(x) -> bool:
    """A finite real number (int, float, or a numpy scalar such as np.float32), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x) -> bool:
    """An int (or a numpy integer), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def plain(v):
    """A numpy scalar (an np.float32 lr, an np.int64 rank) as the Python number it holds, so that the kernels
    and the state_dict see Python numbers; anything else as it is."""
    # type(), not isinstance: np.float64 subclasses float (and np.complex128 complex), and stays a numpy scalar
    # in the state_dict otherwise, which torch.load(weights_only=True) refuses.
    if isinstance(v, numbers.Number) and type(v) not in (int, float, complex, bool) and hasattr(v, "item"):
        return v.item()
    return v


def host_value(v):
    """A hyperparameter as the step reads it: a 0-dim CPU tensor (an lr a scheduler may change in place) as
    the float it holds now (no host sync: it lives on the host), anything else as it is."""
    return float(v) if isinstance(v, Tensor) else v


def lr_rule(minimum: str = ">= 0", allow_none: bool = False, hint: str = ""):
    """The rule of an lr: a finite number `minimum` (">= 0" or "> 0"), or a 0-dim CPU tensor holding one (as
    torch.optim.AdamW accepts; kept as the tensor, so that a scheduler's in-place change is read at each
    step), or None where `allow_none`. A CUDA tensor is refused: reading it at every step would be a host
    sync."""
    strict = minimum == "> 0"
    must = ("be None or " if allow_none else "be ") + f"a finite number {minimum}" + hint

    def rule(owner: str, name: str, v):
        if v is None and allow_none:
            return v
        x = v
        if isinstance(v, Tensor):
            if v.device.type != "cpu":
                raise ValueError(f"{owner}: {name}={v!r} is a tensor on {v.device}; the step reads the lr on the "
                                 "host, which would wait for the device (a host sync) at every step: pass a number "
                                 "or a 0-dim CPU tensor")
            if v.dim() != 0 or v.dtype == torch.bool or v.is_complex():
                raise ValueError(f"{owner}: {name}={v!r} must {must} (a tensor lr: 0-dim, real, on the CPU)")
            x = float(v)
        check(is_number(x) and (x > 0 if strict else x >= 0), name, owner, v, must)
        return v
    return rule


# Rules of `FastOptimizer._hyper_rules`: (test, what the value must be), or a function (owner, name, value) that
# raises or returns the normalized value.
NONNEG = (lambda v: is_number(v) and v >= 0, "be a finite number >= 0")
POSITIVE = (lambda v: is_number(v) and v > 0, "be a finite number > 0")
FLAG = (lambda v: isinstance(v, bool), "be True or False")
NBITS = (lambda v: is_int(v) and v in (32, 8), "be 32 or 8")
BLOCK_SIZE = (lambda v: is_int(v) and 64 <= v <= 4096 and not v & (v - 1), "be a power of two from 64 to 4096")
MIN_8BIT_SIZE = (lambda v: is_int(v) and v >= 0, "be an int >= 0")


def betas_rule(n: int):
    return lambda owner, name, v: check_betas(owner, v, n, name)


def eps_pair(owner: str, name: str, eps) -> tuple:
    """(eps1, eps2), each a finite number >= 0."""
    if not (isinstance(eps, (tuple, list)) and len(eps) == 2):
        raise ValueError(f"{owner}: {name}={eps!r} must be a pair (eps1, eps2)")
    for k, e in enumerate(eps):
        check(is_number(e) and e >= 0, f"{name}[{k}]", owner, e, number_must(e, "be a finite number >= 0"))
    return tuple(float(e) for e in eps)


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


# The implementation flags torch.optim's optimizers keep in every param group (Adam, AdamW, NAdam, RAdam, SGD,
# Adafactor, ...): a state_dict whose groups hold one is torch.optim's (see FastOptimizer._foreign_parts).
_TORCH_OPTIM_FLAGS = frozenset({"foreach", "maximize", "capturable", "differentiable", "fused"})


def _whole_numel(p: Tensor, lay) -> int:
    """Elements of the whole param of which `p` (with layout `lay`, or None) is this rank's piece."""
    return p.numel() if lay is None else lay.numel


def _other_classes_keys(cls: type, keys: set) -> dict:
    """{key: names of the fastopt optimizer classes that have it} for the `keys` that are hyperparameters of
    other fastopt optimizer classes (their `_hyper_rules`) and not of `cls`: a state_dict with such a key is
    theirs. Other keys (a scheduler's `initial_lr`, another library's own) say nothing."""
    mine = set(cls._hyper_rules)
    found: dict = {}
    todo = list(FastOptimizer.__subclasses__())
    while todo:
        other = todo.pop()
        todo.extend(other.__subclasses__())
        if issubclass(cls, other) or issubclass(other, cls):
            continue
        for k in (set(other._hyper_rules) & keys) - mine:
            found.setdefault(k, set()).add(other._name)
    return found


def _sharded_dims(t: Tensor) -> tuple:
    """The dims of DTensor t's mesh (those of more than one rank) that t is not Replicate along: those over which
    DTensor's unscale reduces found_inf when t is the first gradient (replicas along the others hold the same)."""
    from torch.distributed.tensor import Replicate
    m = t.device_mesh
    return tuple(d for d, pl in enumerate(t.placements) if not isinstance(pl, Replicate) and m.size(d) > 1)


def _found_inf_agreed(params: list) -> bool:
    """Whether GradScaler's found_inf is the same on every rank that holds a piece of `params`: no DTensor among
    them, or all DTensors on one mesh, sharded along the same dims of it (`_sharded_dims`), and so their
    gradients (`_grads_placed_as_params`, read at each step). DTensor's unscale (`found_inf_reduce_handler`, torch
    2.13) reduces found_inf over the dims that shard the FIRST gradient of each device and dtype only: a param
    Replicate along a dim that shards another (TP's replicated params beside its sharded ones), or on another mesh
    (under FSDP2 + TP the params TP leaves whole lie on the dp mesh alone), coming first, an inf in one rank's
    piece of another param is seen by that rank (and those it reduces with) alone."""
    meshes = [p.device_mesh for p in params if ckpt.is_dtensor(p)]
    if not meshes:
        return True
    if len(meshes) < len(params) or any(m != meshes[0] for m in meshes):
        return False
    return len({_sharded_dims(p) for p in params}) == 1


def _grads_placed_as_params(params: list) -> bool:
    """Whether each DTensor gradient of these DTensor params is on its param's mesh, sharded along its dims: a
    gradient can differ (torch 2.13 leaves a Replicate one on an embedding sharded by
    RowwiseParallel(input_layouts=Replicate()), Partial ones on SequenceParallel's norm weights: `_local_grad`),
    and DTensor's unscale reads the first gradient's placements (`_found_inf_agreed`). Gradients change at every
    step: read at each GradScaler.step, over the params that are DTensors only."""
    return all(not ckpt.is_dtensor(g := p.grad) or (
        (g.placements == p.placements or _sharded_dims(g) == _sharded_dims(p)) and g.device_mesh == p.device_mesh)
        for p in params)


class FastOptimizer(torch.optim.Optimizer):
    _name = "FastOptimizer"

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """GradScaler then sets `self.grad_scale` and `self.found_inf` and lets step() unscale and skip on device,
        with no host sync. Not with params sharded as plain tensors (FSDP1, `declare_shard`,
        `setup_distributed`): each rank's found_inf covers its own pieces alone, so ranks would skip different
        steps and their loss scales drift apart; GradScaler then unscales first (FSDP1's ShardedGradScaler sums
        the infs over its ranks there) and steps only when no rank found one, as for torch's optimizers (its host
        sync, outside step()). Nor with DTensor params whose found_inf torch does not agree over their ranks
        (`_found_inf_agreed`). Read at every GradScaler.step: the answer is kept until the params or their known
        layouts change (`_declare_group` forgets it); the DTensor gradients' placements are read each time."""
        key = (len(self.__dict__.get("_layout_cache", ())),) + tuple(
            (id(g["params"]), len(g["params"])) for g in self.param_groups)
        memo = self.__dict__.get("_amp_memo")
        if memo is None or memo[0] != key:
            ps = [p for g in self.param_groups for p in g["params"]]
            plain = any((lay := self._layout(p)) is not None and lay.mesh is None and not lay.outside for p in ps)
            memo = self.__dict__["_amp_memo"] = ((len(self.__dict__["_layout_cache"]),) + key[1:],
                                                 not plain and _found_inf_agreed(ps),
                                                 [p for p in ps if ckpt.is_dtensor(p)])
        return memo[1] and _grads_placed_as_params(memo[2])

    def __init__(self, params, defaults: dict):
        if isinstance(params, (set, frozenset)):  # torch refuses one in a group, and from 2.15 warns here
            raise TypeError(f"{self._name}: params is a {type(params).__name__}: optimizer parameters need to be "
                            "organized in ordered collections, but the ordering of tensors in sets will change "
                            "between runs and between ranks (a state_dict would resume into other params, and ranks "
                            "would pair different params in their collectives). Please use a list instead.")
        self._plans: dict = {}  # (id(group), device, dtype) -> the kernels' cache of that bucket
        self._layout_sigs: dict = {}  # see _check_state_layouts
        super().__init__(params, defaults)
        self.state = ckpt.state_of(self, self.state)

    def __getstate__(self) -> dict:
        """torch's state (defaults, state, param_groups) plus the layouts of the params sharded by hand
        (`declare_shard`, `setup_distributed`), in the order of the params: a deep copy of a param does not keep
        its declaration, and the optimizer's own cache of them is not copied, so a copy would otherwise step its
        pieces as whole tensors. Layouts are shared by `copy.deepcopy` and refuse to pickle (process groups)."""
        state = super().__getstate__()
        state.pop("_colossal", None)  # process groups, and the ids of these params
        state.pop("_unstepped", None)  # the copy's state dicts are new: its zero state is not known to be unstepped
        declared = [None if ckpt.is_dtensor(p) or self._layout(p) is None else
                    (self._layout(p), getattr(p, _ATTR, None) is self._layout(p))
                    for g in self.param_groups for p in g["params"]]
        if any(d is not None for d in declared):
            state["_fastopt_layouts"] = declared
        return state

    def __setstate__(self, state: dict) -> None:
        """After unpickling, deepcopy and load_state_dict: the caches that are not pickled start afresh (the
        kernels' plans of groups that are gone with their scratch buffers, the layout signatures); the declared
        layouts of a copy are given to its params (`__getstate__`)."""
        state = dict(state)
        self.__dict__.pop("_unstepped", None)
        declared = state.pop("_fastopt_layouts", None)
        defaults = state.get("defaults", self.__dict__.get("defaults", {}))
        differentiable = "differentiable" in defaults
        super().__setstate__(state)
        for group in self.param_groups:
            for k, v in self._added_defaults.items():
                group.setdefault(k, v)
        # torch adds defaults["differentiable"]; a group of a state_dict would then "lack" it on the next load.
        if not differentiable:
            self.defaults.pop("differentiable", None)
        self.state = ckpt.state_of(self, self.state)  # torch.optim's load_state_dict hands a plain defaultdict
        self._plans = {}
        self._layout_sigs = {}
        if declared is not None:
            cache = self.__dict__.setdefault("_layout_cache", {})
            for p, d in zip([p for g in self.param_groups for p in g["params"]], declared):
                if d is not None:
                    lay, by_declare_shard = d
                    if by_declare_shard and getattr(p, _ATTR, None) is None:
                        setattr(p, _ATTR, lay)  # declare_shard's declaration, as on the original tensor
                    # `_layout` sees a later declare_shard, as on the original (setup_distributed's: 2-tuples)
                    cache[id(p)] = (p, lay, getattr(p, _ATTR)) if by_declare_shard else (p, lay)

    # ---- subclass interface -------------------------------------------------------------------
    def _state_spec(self, p: Tensor, group: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def _step_group(self, group: dict, params: list[Tensor], grads: list[Tensor],
                    states: list[dict], scaler: ScalerArgs):
        """One fused step over a bucket; subclasses with `_supports_layouts` also take `layouts=` and `sharded=`
        and return the step as a generator (fastopt.distributed.phases) that yields its collectives: buffers
        to sum over the ranks that share the params, when `sharded`. None: done already. Groups with a true
        `bf16_stochastic_round` also get `sr_ids=` (`_param_ids`)."""
        raise NotImplementedError

    # ---- shared machinery ---------------------------------------------------------------------
    @staticmethod
    def state_dtype(p: Tensor) -> torch.dtype:
        """fp64 params keep fp64 state (the math alone, no rounding); all others fp32."""
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def _quantized_keys(self, group: dict) -> dict[str, tuple[str, bool, int]]:
        """8-bit states a param may have in `group`: codes key -> (absmax key, signed map, block size)."""
        return {}

    # The state keys that hold one value per element of the param (shaped like its local piece), declared by
    # each optimizer: for a DTensor param they are DTensors like it, so that DCP reshards them
    # (fastopt/checkpoint.py); every other state is whole, the same on every rank.
    _elementwise_state: tuple[str, ...] = ()

    def _elementwise_keys(self, group: dict) -> frozenset:
        """The element-wise state keys of the params of `group` (`_elementwise_state` unless overridden)."""
        return frozenset(self._elementwise_state)

    def _dtensor_forms(self, p: Tensor, group: dict) -> dict:
        """The states of DTensor param `p` that are DTensors themselves (sharded, so DCP reshards them), each
        as (global shape, placements) on p's mesh: the element-wise keys, like p. Empty for a plain param."""
        if not ckpt.is_dtensor(p):
            return {}
        form = (tuple(p.shape), tuple(p.placements))
        return {k: form for k in self._elementwise_keys(group)}

    # The group keys that `_state_spec` reads: changing one between steps is refused where the state of a
    # param no longer fits (`_check_state_layouts`).
    _layout_keys: tuple[str, ...] = ()

    def _init_state(self, p: Tensor, group: dict) -> dict:
        """Zeros of `_state_spec`; for a DTensor param the element-wise states are DTensors like it
        (fastopt/checkpoint.py: DCP reshards them), whose local tensors `step()` hands to `_step_group`."""
        state = self.state[p]
        if not state:
            state.update(ckpt.zero_state(self._state_spec(p, group), p, self._dtensor_forms(p, group)))
        return state

    def _state_known(self, p: Tensor, group: dict) -> bool:
        """Whether param `p`'s state can be built before its first step (`state_dict()` lists zero state for it);
        GaLore cannot yet for a plain 1-D tensor in a projected group that `setup_distributed` may still declare
        a flat shard of a matrix."""
        return True

    # key -> rule (see NONNEG etc. above): what `_check_hyper` checks. Subclasses declare theirs.
    _hyper_rules: dict = {}
    # Group keys added after a release, with the value the optimizer stepped with before: a state_dict or a
    # pickle whose groups lack one loads with that value (load_state_dict, __setstate__).
    _added_defaults: dict = {}

    def _check_hyper(self, hp: dict, where: str | None = None) -> dict:
        """The constructor's checks (`_hyper_rules`) of the hyperparameters present in `hp`: constructor
        arguments, or (`where`: the group's name `param_groups[i]`, named so in the error) a group's keys, when a
        group is added and again at each step. Returns a normalized copy (betas and eps as tuples of floats).
        Subclasses build their defaults with it. Numpy scalars come back as Python numbers (`plain`)."""
        out = {k: v if k == "params" else plain(v) for k, v in hp.items()}
        for k, rule in self._hyper_rules.items():
            if k in hp:
                name = k if where is None else f"{where}['{k}']"
                if callable(rule):
                    out[k] = rule(self._name, name, out[k])
                else:
                    check(rule[0](out[k]), name, self._name, out[k], number_must(out[k], rule[1]))
        return out

    def add_param_group(self, param_group: dict) -> None:
        """Checks the group's hyperparameters (`_check_hyper`) and that none of its params is already in a
        group or appears twice in it (torch only warns there, and the param would be stepped twice) before
        adding it; torch checks the rest. As in torch, the group is the caller's dict itself (holding the checked
        values and the defaults it lacked), so that a change made through it later (`groups[1]["lr"] = 0`) is
        seen by the step; a group refused (here, by torch or by the declaration) leaves it as it was."""
        before = dict(param_group) if isinstance(param_group, dict) else None
        if before is not None:
            where = f"param_groups[{len(self.param_groups)}]"
            checked = self._prepare_group(dict(param_group), where)
            params = checked.get("params")
            if params is not None and not isinstance(params, (Tensor, set)):  # torch refuses a set itself
                checked["params"] = params = list(params)
                seen = {id(p): f"param_groups[{gi}]['params'][{pi}]"
                        for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])}
                for i, q in enumerate(params):
                    t = q[1] if isinstance(q, tuple) and len(q) == 2 else q  # (name, param)
                    here = f"{where}['params'][{i}]"
                    if id(t) in seen:
                        raise ValueError(f"{self._name}: {here} is the same tensor as {seen[id(t)]}; each param "
                                         "may appear once in an optimizer (it would be stepped twice)")
                    seen[id(t)] = here
            param_group.update(checked)
        try:
            super().add_param_group(param_group)
            spec = self.__dict__.get("_colossal")
            if spec is not None:  # declared like the groups setup_distributed saw, or not added at all
                declared: dict = {}
                try:
                    self._declare_group(len(self.param_groups) - 1, spec, declared)
                except BaseException:
                    self.param_groups.pop()
                    raise
                self.__dict__.setdefault("_layout_cache", {}).update(declared)
        except BaseException:
            if before is not None:
                param_group.clear()
                param_group.update(before)
            raise
        group = self.param_groups[-1]
        if self._quantized_keys(group):  # may keep 8-bit state
            _warm_maps(group)

    def _prepare_group(self, group: dict, where: str) -> dict:
        """The group `add_param_group` adds (from a copy of the caller's dict), its hyperparameters checked; a
        subclass fills in and checks its own keys here."""
        return self._check_hyper(group, where)

    def _check_group(self, gi: int, group: dict) -> None:
        """A subclass's own step-time checks of a group (after `_check_hyper`)."""

    def _check_groups(self) -> None:
        """The groups' hyperparameters again (an lr scheduler or a user may have changed them); also run by
        fastopt.ZeroRedundancyOptimizer before it reduces the gradients, so that a refused step leaves them as
        they were."""
        for gi, group in enumerate(self.param_groups):
            for k, v in group.items():  # a numpy scalar set since: as the Python number it holds
                if k != "params" and plain(v) is not v:
                    group[k] = plain(v)
            self._check_hyper(group, f"param_groups[{gi}]")
            self._check_group(gi, group)

    def _check_grads(self) -> None:
        """Every refusal happens here, before any parameter or state changes: the groups' hyperparameters
        (`_check_groups`), the gradients, then whether each param's state still fits its group's settings and
        its dtype and shape."""
        self._check_groups()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                g = p.grad  # read once: a tensor property, and this loop runs over every param at every step
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{self._name} does not support sparse gradients")
                dt, gdt = p.dtype, g.dtype
                if dt.is_complex or gdt.is_complex:
                    raise RuntimeError(f"{self._name} does not support complex parameters")
                if not dt.is_floating_point:
                    raise RuntimeError(f"{self._name}: parameter of dtype {p.dtype} is not floating point")
                if gdt is not dt and torch.promote_types(dt, gdt) != dt:
                    raise RuntimeError(
                        f"{self._name}: param_groups[{gi}]['params'][{pi}] is {p.dtype} but its grad is "
                        f"{p.grad.dtype} (p.grad_dtype): a param is stepped with a grad of its own dtype, or of one "
                        f"that converts to it exactly (FSDP1's keep_low_precision_grads); rounded to {p.dtype}, "
                        f"this grad would lose {'range and ' if p.dtype == torch.float16 else ''}precision. Keep "
                        f"the param in {torch.promote_types(p.dtype, p.grad.dtype)} or its grads in {p.dtype}")
                if ckpt.is_dtensor(p) != ckpt.is_dtensor(g):
                    kinds = ("a DTensor", "a plain tensor") if ckpt.is_dtensor(p) else ("a plain tensor", "a DTensor")
                    raise RuntimeError(f"{self._name}: param_groups[{gi}]['params'][{pi}] is {kinds[0]} (shape "
                                       f"{tuple(p.shape)}) but its grad is {kinds[1]} (shape {tuple(p.grad.shape)}): "
                                       "a DTensor param needs a DTensor grad on its mesh (as autograd makes it; "
                                       "DTensor.from_local or distribute_tensor), a plain param a plain grad")
        self._check_state_layouts()

    def _check_state_layouts(self) -> None:
        """Refuse a step whose params' existing state no longer fits `_state_spec`: a group key of
        `_layout_keys` changed between steps (Adafactor's beta1 None -> 0.9, nbits, block_size, GaLore's rank
        ...), a param's dtype or shape changed (`model.double()`), or a state tensor was replaced by one of
        another dtype, shape or device (`opt.state[p]["exp_avg"] = torch.zeros_like(p)` on a bf16 param). The
        kernels would read and write the old tensors out of bounds. The full comparison (metadata only, no host
        sync) runs for a group only when its signature (`_layout_sig`) differs from the one last checked. Then
        every param of the optimizer is also checked for appearing twice (put there by hand: `add_param_group`
        refuses it) and every state tensor for being another param's too: either would be stepped twice in one
        launch."""
        sigs, state, empty = self._layout_sigs, self.state, {}
        live, checked = set(), []
        for gi, group in enumerate(self.param_groups):
            params = group["params"]
            live.add(id(group))
            entry = self._layout_sig(group, params, state, empty)
            old = sigs.get(id(group))
            if (old is not None and old[0] is group and old[1] == entry[1] and len(old[2]) == len(entry[2])
                    and all(map(operator.is_, old[2], entry[2]))):
                continue
            self._check_group_state(gi, group, old[1] if old is not None and old[0] is group else None)
            checked.append(group)
        if checked:
            self._check_nothing_shared()
            for group in checked:  # after the checks, which may have converted a step or cleared unstepped state
                sigs[id(group)] = self._layout_sig(group, group["params"], state, empty)
        if len(sigs) > len(live):
            for k in [k for k in sigs if k not in live]:
                del sigs[k]

    def _layout_sig(self, group: dict, params: list, state, empty: dict) -> tuple:
        """(group, signature, each param's number of state entries and the values) for `_check_state_layouts`.
        The signature: the group's `_layout_keys` and its params' dtypes, shapes and devices. The values are
        compared by identity (`operator.is_`: a tensor's == would compare its elements), tensors held by weak
        reference: `weakref.ref(t)` is the same object while t lives, and a dead one is never `is` a new tensor's
        (whose id may be the freed one's), while the state it held is freed when the state drops it
        (`opt.state.clear()`, an offload's `state[k] = v.to("cpu")`), not at the next step."""
        sts = tuple(map(state.get, params, itertools.repeat(empty)))
        vals = tuple(itertools.chain.from_iterable(map(dict.values, sts)))
        try:
            held = tuple(map(weakref.ref, vals))
        except TypeError:  # a number set by hand (a step), None: held itself
            held = tuple(weakref.ref(v) if isinstance(v, Tensor) else v for v in vals)
        try:
            meta = tuple(map(param_meta, params))
        except RuntimeError:  # a lazy module's param has no shape yet
            meta = tuple((p.dtype, None if isinstance(p, _LAZY) else p.shape, p.device) for p in params)
        return group, (tuple(group.get(k) for k in self._layout_keys), meta), tuple(map(len, sts)) + held

    def _check_nothing_shared(self) -> None:
        """No param twice in the optimizer, no state tensor in two params' states (set there by hand)."""
        seen: dict = {}
        held: dict = {}
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                here = f"param_groups[{gi}]['params'][{pi}]"
                first = seen.setdefault(id(p), here)
                if first is not here:
                    raise ValueError(f"{self._name}: {here} is the same tensor as {first}; each param may appear "
                                     "once in an optimizer (it would be stepped twice)")
                for k, v in self.state.get(p, {}).items():
                    if isinstance(v, Tensor):
                        first = held.setdefault(id(v), (here, k))
                        if first != (here, k):
                            raise ValueError(f"{self._name}: the state of {here} holds under {k!r} the tensor that "
                                             f"the state of {first[0]} holds under {first[1]!r}: each param's state "
                                             "is its own (it would be stepped once per param); set a copy")

    def _check_group_state(self, gi: int, group: dict, old_sig) -> None:
        where = f"param_groups[{gi}]"
        for pi, p in enumerate(group["params"]):
            st = self.state.get(p)
            if not st:
                continue
            spec = self._state_spec(p, group)
            dev = local(p).device
            step = st.get("step")
            if not (isinstance(step, Tensor) and not ckpt.is_dtensor(step) and step.dtype is torch.float32
                    and step.dim() == 0 and step.device == dev):
                # a number (transformers' int step) or a one-element tensor of another dtype or device: a copy
                # as load_state_dict makes it
                st["step"] = ckpt.as_step(step, f"{self._name}.state[{where}['params'][{pi}]]", dev)
            # The kernels index row-major memory: a state set by hand as zeros_like(p) of a channels_last or
            # transposed p keeps p's strides (made dense, as load_state_dict makes it)
            for k, v in list(st.items()):
                if k != "step" and isinstance(v, Tensor) and not local(v).is_contiguous():
                    st[k] = v.contiguous()
            here = ckpt.local_state(st, p)
            have = {k: (tuple(v.shape), v.dtype, v.device) for k, v in here.items()
                    if k != "step" and isinstance(v, Tensor)}
            want = {k: (tuple(s), d, dev) for k, (s, d) in spec.items()}
            if have == want:
                continue
            if self.__dict__.get("_unstepped", {}).get(id(p)) is st:
                st.clear()  # zero state state_dict() made before any step: made again for the param as it is now
                continue
            n = self._name
            pw = f"{where}['params'][{pi}]"
            diff = _state_diff(have, want, dev)
            new_opt = ("give these params to a new optimizer (a state_dict saved here loads into it: load_state_dict "
                       "casts and checks the state)")
            if old_sig is not None and pi < len(old_sig[1]) and old_sig[1][pi] != (p.dtype, p.shape, p.device):
                was = old_sig[1][pi]
                raise ValueError(f"{n}: {pw} is now {p.dtype} of shape {tuple(p.shape)} on {p.device}, but its state "
                                 f"was made for {was[0]} of shape {tuple(was[1])} on {was[2]} ({diff}): change the "
                                 f"param back, or {new_opt}")
            if old_sig is not None:
                changed = [(k, v0, group.get(k)) for k, v0 in zip(self._layout_keys, old_sig[0]) if v0 != group.get(k)]
                if changed:
                    keys = ", ".join(f"{where}[{k!r}]={v!r} (was {v0!r})" for k, v0, v in changed)
                    raise ValueError(f"{n}: {keys} changes the layout of the state of {pw} ({diff}); a group's state "
                                     f"layout is fixed once its params have state: set it back, or {new_opt}")
                # the settings and the param as at the last check: state set by hand since
                raise ValueError(f"{n}: the state of {pw} does not fit its param ({p.dtype}, shape {tuple(p.shape)}) "
                                 f"since the last step ({diff}): a state tensor set by hand must have the shape, dtype "
                                 f"and device the optimizer keeps; set it so, or {new_opt}")
            keys = ", ".join(f"{where}[{k!r}]={group.get(k)!r}" for k in self._layout_keys if k in group)
            raise ValueError(f"{n}: the state of {pw} does not fit its param ({p.dtype}, shape {tuple(p.shape)})"
                             f"{' with ' + keys if keys else ''} ({diff}): restore the settings and the param it was "
                             f"made with, or {new_opt}")

    def _plan_cache(self, group: dict, params: list[Tensor], layouts: list | None) -> dict:
        """The kernels' cache (plans, tables, scratch buffers) of one bucket of `group` (its local `params` and
        their `layouts`, as `_step_group` gets them), keyed like the bucket (device, dtype, reduction groups): two
        buckets of one group (e.g. FSDP2+TP matrices and dp-only norms, or TP matrices and replicated norms)
        must not evict each other's plans every step. By the layouts, not the params: a DTensor's local tensor
        has none."""
        return self._plans.setdefault(
            (id(group), params[0].device, params[0].dtype, None if layouts is None else layouts[0].group_key), {})

    @staticmethod
    def _values(group: dict, keys: Iterable[str]) -> dict:
        """The group's hyperparameters `keys` as the kernels take them (a tensor lr read now: `host_value`)."""
        return {k: host_value(group[k]) for k in keys}

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
            # 0-dim like the step counters: FSDP's ShardedGradScaler makes found_inf of shape (1,); 0 or 1: after
            # ShardedGradScaler.unscale_ it is summed over the ranks (4. where all 4 found one), and GradScaler sums
            # it over devices
            fi = (found_inf.to(device=device, non_blocking=True).reshape(()) > 0).to(torch.float32)
        cache[device] = ScalerArgs(inv, fi)
        return cache[device]

    # Subclasses whose `_step_group` takes `layouts=` and `sharded=` are exact on sharded params (DTensor,
    # declared shards, flat ZeRO ranges).
    _supports_layouts = False
    # Steps through fastopt.ops' Triton seam (`ops.use_triton`); AdamW8bit steps in the extension alone
    # (`_extension_seam`). Either is checked before a step changes anything.
    _triton_seam = True
    _extension_seam = False

    def _layout(self, p: Tensor):
        """p's Layout (fastopt.distributed.layout): set by `setup_distributed`, else `layout_of(p)`, which
        refuses an undeclared copy of a declared tensor (`torch.nn.Parameter(t)` of a declared t)."""
        cache = self.__dict__.setdefault("_layout_cache", {})
        key = id(p)
        hit = cache.get(key)
        if hit is not None and len(hit) == 3 and getattr(p, _ATTR, None) is not hit[2]:
            self._redeclared(p)  # declare_shard since the layout was read (setup_distributed's are 2-tuples)
            hit = None
        if hit is None:
            lay = layout_of(p, owner=self._name)
            if lay is None and fsdp1_refusal(p, "") is not None and self._whole_statistics(p):
                # not cached: declare_fsdp may come before the next step
                raise ValueError(fsdp1_refusal(p, f"{self._name}: {self._where(p)}"))
            # p kept alive so that its id is not reused; its declaration, to see a later one
            hit = cache[key] = (p, lay, getattr(p, _ATTR, None))
        return hit[1]

    def _where(self, p: Tensor) -> str:
        return next((f"param_groups[{gi}]['params'][{pi}]" for gi, g in enumerate(self.param_groups)
                     for pi, q in enumerate(g["params"]) if q is p), "a param")

    def _redeclared(self, p: Tensor) -> None:
        """p was declared (declare_shard) since this optimizer read its layout. Before its first step it takes
        the new one (a declaration refused at a step can be corrected); after, its state was made for the old
        one, and its steps taken: refused. Zero state from a state_dict() before any step is made again."""
        if self._drop_unstepped_state(p):
            raise ValueError(f"{self._name}: {self._where(p)} was declared (fastopt.distributed.declare_shard) "
                             "after its first step, whose state and steps were those of another layout: declare "
                             "shards before the first step, or give the params to a new optimizer")
        self.__dict__.pop("_amp_memo", None)
        self._layout_cache.pop(id(p), None)

    def _fsdp_grads(self, lays: dict | None = None) -> dict:
        """`fsdp_grads` of this optimizer's FSDP1 pieces (none: no collective). `lays`, when given, takes every
        param's layout by id, for `_buckets` to read instead of a second `_layout` per param and step."""
        pieces = []
        for g in self.param_groups:
            for p in g["params"]:
                lay = self._layout(p)
                if lays is not None:
                    lays[id(p)] = lay
                if lay is not None and lay.fsdp:
                    pieces.append((p, lay))
        return fsdp_grads(pieces) if pieces else {}

    def _whole_statistics(self, p: Tensor) -> bool:
        """Whether stepping p takes statistics over the whole tensor (norms, factors, projections), so that a
        piece of it cannot be stepped as if it were the whole (`fsdp1_refusal`); False for element-wise steps."""
        return True

    def _check_declarations(self, group: dict, params: list[Tensor], layouts: list) -> None:
        """At the first step that uses a declared layout (`declare_shard`, `setup_distributed`): its pieces must
        cover the global tensor once over its groups (`check_cover`: one all_reduce per group for the whole
        bucket; nothing at later steps). DTensor layouts are right by construction."""
        todo = [(p, lay) for p, lay in zip(params, layouts)
                if lay is not None and not ckpt.is_dtensor(p) and "covered" not in lay._cache]
        if not todo:
            return
        from ..distributed.layout import check_cover
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        pos = {id(p): i for i, p in enumerate(group["params"])}
        names = [f"param_groups[{gi}]['params'][{pos[id(p)]}] (local shape {tuple(p.shape)})" for p, _ in todo]
        check_cover([lay for _, lay in todo], names, local(todo[0][0]).device, self._name)

    def _check_flat_contiguous(self, params: list[Tensor], layouts: list) -> None:
        """A flat range (`declare_shard(..., flat_offset=...)`, FSDP1, `setup_distributed`) is its local tensor's
        elements in memory order, stepped in place through a flat view: a param made non-contiguous since its
        declaration (`.data` replaced) is refused here, before anything changes."""
        for p, lay in zip(params, layouts):
            if lay is not None and lay.is_flat and not local(p).is_contiguous():
                raise ValueError(f"{self._name}: {self._where(p)} is declared a flat range of a tensor of shape "
                                 f"{lay.global_shape}, its elements in memory order, but is not contiguous (shape "
                                 f"{tuple(p.shape)}, strides {p.stride()}): make it contiguous, as when declared")

    def _param_ids(self) -> dict[int, int]:
        """{id(p): p's position among this optimizer's params over all param_groups (its state_dict id)}: the
        same in one process and under every layout (DTensors, declared pieces), so it seeds the stochastic
        rounding (with the step and each element's global offset, fastopt.reference.common.stochastic_round_bf16).
        Under ZeroRedundancyOptimizer, whose cut groups hold this rank's params and pieces only, it is the
        position of the whole param in the optimizer before it was cut (`_zero_ids`, set by the wrapper before
        each step)."""
        flat = [p for g in self.param_groups for p in g["params"]]
        ids = self.__dict__.get("_zero_ids")
        return {id(p): k for p, k in zip(flat, range(len(flat)) if ids is None or len(ids) != len(flat) else ids)}

    def _global_shape(self, p: Tensor) -> tuple[int, ...]:
        """The shape of the whole tensor that p is (a piece of)."""
        lay = self._layout(p)
        return tuple(p.shape) if lay is None else lay.global_shape

    def _buckets(self, params: Iterable[Tensor], fsdp: dict, lays: dict | None = None) -> dict:
        """Params with grads and elements, grouped by (device, dtype, reduction groups): one fused launch
        sequence, and one collective per phase and group, for each. A sharded param whose piece here is empty
        stays in: every rank of its group must put the same params in the same buffers. An FSDP1 piece has a grad
        when some rank of its unit has one (`fsdp`: `fsdp_grads`): FSDP1 leaves the pieces of no elements without
        one. A DTensor on a mesh without this rank (`Layout.outside`) has no group here: skipped, as DTensor's
        ops skip such a rank. `lays`: the layouts `_fsdp_grads` read this step (by id), else read here."""
        out: dict = defaultdict(list)
        for p in params:
            lay = self._layout(p) if lays is None else lays[id(p)]
            if ((not fsdp[id(p)] if lay is not None and lay.fsdp else p.grad is None)
                    or _whole_numel(p, lay) == 0 or (lay is not None and lay.outside)):
                continue
            out[(p.device, p.dtype, None if lay is None else lay.group_key)].append(p)
        return out

    def setup_distributed(self, tp_group=None, dp_group=None, shard_to_working_param=None, padding_map=None,
                          is_zero: bool = False) -> None:
        """ColossalAI's `DistributedOptim.setup_distributed`, so that its users switch without rewriting: declare
        how this optimizer's params are sharded. Call it before the first `step()`.

        Args:
            tp_group: the tensor-parallel group over which a working param is sharded (ColossalAI d_tensors:
                one dim, even shards). Params that are DTensors or declared with
                `fastopt.distributed.declare_shard` carry their own layout; other params are replicated over it.
            dp_group: the ZeRO group (required with is_zero=True: never the whole world by default).
            shard_to_working_param: {id(p): working param}: with ZeRO, p is this rank's flat shard of the
                working param (the tensor used in forward/backward, itself possibly TP-sharded).
            padding_map: {id(p) or id(working param): padding}: elements appended to the flattened working
                param so that it splits evenly over dp_group (default: inferred from the sizes, and checked).
            is_zero: p holds the range [rank * p.numel(), (rank + 1) * p.numel()) of the flattened (padded)
                working param, rank = its rank in dp_group (ColossalAI's low-level ZeRO). False with a dp_group of
                one rank and 1-D masters mapped to working params of another shape, as many elements (LowLevelZeroPlugin
                on one process, whose masters are flattened) is taken as ZeRO over that group.

        Groups added later (`add_param_group`) are declared the same way, from the same (live) dicts.
        """
        n = f"{self._name}.setup_distributed"
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{n}: torch.distributed is not initialized (init_process_group first)")
        if is_zero and dp_group is None:
            raise ValueError(f"{n}: is_zero=True needs dp_group (the ZeRO process group); fastopt never assumes "
                             "the whole world")
        spec = (tp_group, dp_group, {} if shard_to_working_param is None else shard_to_working_param,
                {} if padding_map is None else padding_map, is_zero)
        declared: dict = {}  # every group's, before any is kept: a refused call declares nothing
        for gi in range(len(self.param_groups)):
            self._declare_group(gi, spec, declared)
        self.__dict__.setdefault("_layout_cache", {}).update(declared)
        self.__dict__["_colossal"] = spec  # for add_param_group; not copied (process groups, ids of these params)
        for group in self.param_groups:
            for p in group["params"]:
                self._drop_unstepped_state(p)

    def _drop_unstepped_state(self, p: Tensor) -> bool:
        """Drop p's state if no step has used it (step 0: the zero state a state_dict() makes, with the shapes of
        the layout before a new declaration; the first step makes it again). A host read, at a declaration only.
        Returns whether p has state left (made by its steps)."""
        st = self.state.get(p)
        if st and "step" in st and float(local(st["step"])) == 0:
            del self.state[p]
            return False
        return bool(st)

    def _declare_group(self, gi: int, spec: tuple, cache: dict) -> None:
        """`setup_distributed`'s declaration of the params of param_groups[gi], into `cache` (the caller keeps
        them in `_layout_cache` once every one is made)."""
        from ..distributed.layout import make_layout
        self.__dict__.pop("_amp_memo", None)
        n = f"{self._name}.setup_distributed"
        tp_group, dp_group, mapping, pads, is_zero = spec
        group = self.param_groups[gi]
        for pi, p in enumerate(group["params"]):
            where = f"param_groups[{gi}]['params'][{pi}]"
            working = mapping.get(id(p), p)
            tp_lay = _working_layout(working, tp_group, n, where)
            # LowLevelZeroPlugin on one process passes is_zero=False (its `dp_size > 1 and zero_stage > 0`), yet
            # flattens every master: a 1-D master of all of its working param's elements (no padding over one
            # rank), over a dp group of one, is ZeRO's range of that group
            one = (not is_zero and dp_group is not None and dist.get_world_size(dp_group) == 1 and p.dim() == 1
                   and tuple(local(working).shape) != tuple(local(p).shape)
                   and p.numel() == (tp_lay.count if tp_lay is not None else working.numel()))
            if not is_zero and not one:
                if tuple(local(working).shape) != tuple(local(p).shape):
                    raise ValueError(f"{n}: shard_to_working_param maps {where} of shape {tuple(p.shape)} to a "
                                     f"working param of shape {tuple(working.shape)}; without is_zero=True "
                                     "they must be the same tensor")
                cache[id(p)] = (p, tp_lay)
                continue
            if id(p) not in mapping:
                raise ValueError(f"{n}: is_zero=True but shard_to_working_param has no entry for {where} "
                                 f"(shape {tuple(p.shape)}); map id(shard) to the working param")
            total = tp_lay.count if tp_lay is not None else working.numel()
            world, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
            chunk = p.numel()
            pad = pads.get(id(p), pads.get(id(working)))
            if pad is None:
                pad = chunk * world - total
            if pad < 0 or chunk * world != total + pad:
                raise ValueError(f"{n}: padding_map gives {pad} for {where}, but {world} ranks of dp_group x "
                                 f"{chunk} elements each must equal the working param's {total} elements plus "
                                 "the padding")
            global_shape = tp_lay.global_shape if tp_lay is not None else tuple(working.shape)
            lay = make_layout((chunk,), global_shape, dp_group, flat_offset=min(rank * chunk, total),
                              base=tp_lay, owner=n)
            cache[id(p)] = (p, lay)

    @staticmethod
    def _advance_steps(steps: list[Tensor], scaler: ScalerArgs) -> None:
        """step += 1, or += 0 where GradScaler found an inf: one foreach launch, no host sync."""
        if scaler.found_inf is None:
            torch._foreach_add_(steps, 1.0)
        else:
            # a list of one 0-dim tensor: _foreach_add_(steps, tensor) synchronized on CUDA (torch 2.11, seen in
            # bench/gpu_checks.py's no-host-sync check); the list form reads it on the device
            inc = 1.0 - scaler.found_inf
            torch._foreach_add_(steps, [inc] * len(steps))

    # torch.compile of a training step runs this step eagerly (a graph break): the step is fused kernels already,
    # dynamo cannot trace the Triton launches, and inductor miscompiled the reference's 8-bit dequantization of a
    # partial last block (pytorch/pytorch#195582: NaN and wrong params on CPU). `eager_under_compile`: as
    # torch.compiler.disable, importing torch._dynamo at the first call instead of at `import fastopt`.
    @eager_under_compile
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # under the caller's autocast, as its forward expects
        with _autocast_off():
            self._step_now()
        return loss

    def _step_now(self) -> None:
        """step() after the closure, under no autocast (`_autocast_off`)."""
        self._check_grads()
        self.__dict__.pop("_unstepped", None)
        lays: dict = {}  # every param's layout, read once this step
        fsdp = self._fsdp_grads(lays)
        buckets = []  # every bucket's declarations checked before any param or step counter changes
        for group in self.param_groups:
            for (device, _dtype, group_key), params in self._buckets(group["params"], fsdp, lays).items():
                layouts = None
                if group_key is not None:
                    if not self._supports_layouts:
                        raise NotImplementedError(f"{self._name} does not support sharded parameters yet")
                    layouts = [lays[id(p)] for p in params]
                    self._check_flat_contiguous(params, layouts)
                    self._check_declarations(group, params, layouts)
                if self._triton_seam:
                    ops.use_triton(params[0])  # a FASTOPT_BACKEND that cannot step these params raises here
                elif self._extension_seam and ops.use_extension():
                    ops.load_extension()  # the extension's build error (no compiler, no ninja) raises here
                buckets.append((group, device, group_key, params, layouts))
        scalers: dict = {}
        sharded = []  # the steps of the sharded buckets, run together: one collective per phase and groups
        copied = []  # (p.grad's local tensors the kernels read as a copy, ScalerArgs) under GradScaler's fused path
        # Stochastic rounding is seeded by ids that every layout of these params gives alike.
        ids = self._param_ids() if any(g.get("bf16_stochastic_round") for g in self.param_groups) else None
        for group, device, group_key, params, layouts in buckets:
            # The bucket's GPU current (params may be spread over the GPUs of one process): Triton launches on
            # the current device, and so do events and streams taken without one. The ops' generators enter it
            # again at each resumption, as the sharded ones resume in phases.run.
            with ops.on_device(device):
                grads = [_local_grad(p) for p in params]
                if layouts is not None:  # a flat range is its elements in memory order: a strided grad's, copied
                    grads = [g.contiguous() if lay is not None and lay.is_flat else g
                             for g, lay in zip(grads, layouts)]
                states = [ckpt.local_state(self._init_state(p, group), p) for p in params]
                scaler = self._scaler_args(device, scalers)
                if scaler.inv_scale is not None:
                    copied.append((_copied_grads(params, grads), scaler))
                self._advance_steps([s["step"] for s in states], scaler)
                sr = {"sr_ids": [ids[id(p)] for p in params]} if group.get("bf16_stochastic_round") else {}
                if group_key is None:
                    steps = self._step_group(group, [local(p) for p in params], grads, states, scaler, **sr)
                    if steps is not None:
                        phases.drive(steps, None)
                else:
                    sharded.append((self._step_group(group, [local(p) for p in params], grads, states, scaler,
                                                     layouts=layouts, sharded=True, **sr), group_key,
                                    layouts[0].reduce))
        phases.run(sharded)
        for grads, scaler in copied:  # the kernels left the unscaled gradient in the copies they read
            ops.unscale_grads_(grads, scaler.inv_scale, scaler.found_inf)

    # ---- state_dict -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.optim's state_dict (tensors, plain numbers and dicts of them: loads with
        `torch.load(weights_only=True)`), holding the state tensors themselves as torch's does (no copy on the
        device; a later step changes them, `torch.save` or a deep copy keeps them), zero state for trainable params
        that have none yet (created and kept, as torch's `get_optimizer_state_dict` does with a step at lr=0), and
        DTensor params' state in the form `torch.distributed.checkpoint` reshards (see fastopt/checkpoint.py).
        The hooks of `register_state_dict_pre_hook` run first, those of `register_state_dict_post_hook` on the
        finished dict, as in torch."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        # One form for every param, whatever layout each one has: a param that is plain under TP alone (a
        # norm's weight) may be a DTensor under FSDP, and DCP matches states by name.
        force = self.__dict__.get("_dequantize_8bit", False) or any(
            ckpt.is_dtensor(p) for g in self.param_groups for p in g["params"])
        state, groups = {}, []
        index = 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))  # torch's ids (no duplicates)
            groups.append(packed)
            quantized = self._quantized_keys(group)
            for p in group["params"]:
                if self._zero_state_due(p, group):
                    self._make_zero_state(p, group)
                if self.state.get(p):
                    state[index] = ckpt.export_state(self.state[p], quantized, force)
                index += 1
        sd = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            out = post_hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def _zero_state_due(self, p: Tensor, group: dict) -> bool:
        """Whether `state_dict()` (and the truth test of `self.state`) makes p's zero state now: not for a lazy
        module's param before its dry run (`UninitializedParameter`: no shape yet; its first step makes it)."""
        # An empty piece of a sharded param too (FSDP1's on ranks without its elements, a declared one): the ranks
        # that share a param must all make its zero state or none, or load_state_dict refuses the checkpoint.
        return (not self.state.get(p) and p.requires_grad and not torch.nn.parameter.is_lazy(p)
                and (p.numel() > 0 or math.prod(self._global_shape(p)) > 0) and self._state_known(p, group))

    def _make_zero_state(self, p: Tensor, group: dict) -> None:
        """Zero state for trainable param `p`, which has none, kept (as torch's DCP makes it with a step at lr=0):
        DCP's flattened form rebuilds a param's state from the keys it has. Until a step, it is made again if the
        param changes (`model.double()`; torch's AdamW takes that)."""
        self.__dict__.setdefault("_unstepped", {})[id(p)] = self.state[p]
        self._init_state(p, group)

    def _make_zero_states(self) -> None:
        """`_make_zero_state` for every trainable param without state: what `state_dict()` lists, and what the
        truth test of `self.state` makes (fastopt/checkpoint.py's StateDict: DCP's `_init_optim_state`)."""
        for group in self.param_groups:
            for p in group["params"]:
                if self._zero_state_due(p, group):
                    self._make_zero_state(p, group)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load after checking everything; on any mismatch raise and leave the optimizer as it was (on every
        rank: with DTensor params, the ranks agree on the verdict, so call it on all of them, as DCP does).

        Takes this optimizer's state_dicts from another layout of the same kind: DTensor states (on the params'
        device mesh) are redistributed to the params' placements, plain full-size element-wise states are cut
        to the local piece, dequantized 8-bit states are requantized into the local blocks
        (fastopt/checkpoint.py). State tensors move to their param's
        device, and float states take the dtype this optimizer keeps for the param (`state_dtype`: fp64 for
        fp64 params, fp32 for the others; 8-bit codes stay uint8, `step` fp32), as torch casts them to the
        param's. Across meshes, or between DTensor and plain params, go through torch.distributed.checkpoint
        (`get_/set_optimizer_state_dict`), which reshards; a direct load is refused, naming the key. The hooks of
        `register_load_state_dict_pre_hook` see (and may replace) a shallow copy of
        `state_dict` before anything else; those of `register_load_state_dict_post_hook` run once it is loaded.
        """
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # shallow, as torch: a pre hook may edit it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            if out is not None:
                state_dict = out
        state_dict = self._from_foreign(state_dict)
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if self._added_defaults and isinstance(groups, list):
            state_dict = {**state_dict, "param_groups": [{**self._added_defaults, **g} if isinstance(g, dict) else g
                                                         for g in groups]}
        new_state = self._validate_state_dict(state_dict)
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        for g, sg in zip(self.param_groups, saved_groups):  # torch's update_group
            sg["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                sg["param_names"] = g["param_names"]
        self.__setstate__({"state": new_state, "param_groups": saved_groups})  # new groups: their plans go
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _from_foreign(self, state_dict):
        """A state_dict of another library's optimizer (transformers, came-pytorch, bitsandbytes) in this
        optimizer's form; this optimizer's own (and anything else) as it is."""
        return state_dict

    def _foreign_parts(self, state_dict, is_foreign_group):
        """(state, param_groups) of `state_dict` when it has torch's shape (a dict 'state', a list 'param_groups'
        as long as this optimizer's) and is_foreign_group(g) holds for every group; else None, and _from_foreign
        leaves it to _validate_state_dict, which names what is wrong (a missing 'state' must not load as an empty
        one). The caller converts the entries of `state` that are dicts and passes the others through, for the
        same reason. A group with torch.optim's own flags (`foreach`, `maximize`, ...) is torch.optim's, never
        the other library's, however much else it shares: torch.optim.AdamW's state_dict before its first step
        (no state to tell it apart) has every key bitsandbytes' has, and its `maximize` would be ignored."""
        if not isinstance(state_dict, dict):
            return None
        state, groups = state_dict.get("state"), state_dict.get("param_groups")
        if not (isinstance(state, dict) and isinstance(groups, list) and len(groups) == len(self.param_groups)
                and all(isinstance(g, dict) and not _TORCH_OPTIM_FLAGS & set(g) and is_foreign_group(g)
                        for g in groups)):
            return None
        return state, groups

    def _validate_state_dict(self, state_dict: dict) -> dict:
        """{param: the state to install}, built from `state_dict` without touching the optimizer; raises
        ValueError naming the first mismatch."""
        name = self._name
        where = f"{name}.load_state_dict"
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            got = sorted(state_dict, key=str) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"{where}: expected a dict with keys 'state' and 'param_groups', got {got}")
        saved_state = state_dict["state"]
        if not isinstance(saved_state, dict):
            raise ValueError(f"{where}: 'state' must be a dict (param id -> state), got "
                             f"{type(saved_state).__name__}")
        saved_groups = state_dict["param_groups"]
        if not isinstance(saved_groups, list) or not all(isinstance(g, dict) and "params" in g
                                                         for g in saved_groups):
            raise ValueError(f"{where}: 'param_groups' must be a list of dicts with 'params'")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{where}: state_dict has {len(saved_groups)} param groups, "
                             f"this optimizer has {len(self.param_groups)}")
        id_map = {}
        for gi, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"{where}: param_groups[{gi}] has {len(sg['params'])} params "
                                 f"in the state_dict, {len(g['params'])} here")
            ours = set(self.defaults)
            theirs = set(sg) - {"params", "param_names"}
            if not ours <= theirs:
                raise ValueError(f"{where}: param_groups[{gi}] lacks {sorted(ours - theirs)}: "
                                 f"not {'an' if name[0] in 'AEIOU' else 'a'} {name} state_dict")
            # Keys this group holds too say nothing: torch.optim keeps any key a user puts in a group, and a run
            # must resume from its own state_dict whatever its keys are named.
            others = _other_classes_keys(type(self), theirs - set(g))
            if others:  # Lamb's groups hold every key of GaLoreAdamW's plain groups (correct_bias has a default)
                raise ValueError(f"{where}: param_groups[{gi}] has {', '.join(sorted(others))}: not "
                                 f"{'an' if name[0] in 'AEIOU' else 'a'} {name} state_dict, but one of "
                                 f"{', '.join(sorted({c for cs in others.values() for c in cs}))}")
            merged = {**g, **{k: plain(v) for k, v in sg.items() if k not in ("params", "param_names")}}
            try:  # the saved hyperparameters, checked as a step would, before anything changes
                self._check_hyper(merged, f"param_groups[{gi}]")
                self._check_group(gi, merged)
            except ValueError as e:
                raise ValueError(f"{where}: the state_dict's {str(e).removeprefix(name + ': ')}") from None
            for pid, p in zip(sg["params"], g["params"]):
                id_map[pid] = (p, merged, g)
        # The ranks that share a sharded param agree on the verdict (a non-finite value, or another shape, may be
        # in one rank's piece only): over the groups of the params' meshes and declarations, never the world.
        params = [p for g in self.param_groups for p in g["params"]]
        groups = ckpt.agreement_groups(params, [None if ckpt.is_dtensor(p) else self._layout(p) for p in params])
        new_state, problem = {}, None
        for pid, st in saved_state.items():
            if pid not in id_map:
                problem = f"{where}: state for unknown param id {pid!r}"
                break
            p, group, own = id_map[pid]
            if isinstance(st, dict) and not st:
                continue  # no state (DCP's flattened form gives {} to a trainable param without any): fresh
            if _whole_numel(p, self._layout(p)) == 0:
                # A param of no elements never steps (`_buckets`) and keeps no state here; transformers' and
                # came-pytorch's keep one, whose column factor is a mean over no rows (NaN): dropped, whatever it holds.
                continue
            spec = self._state_spec(p, group)
            quantized = self._quantized_keys(group)
            try:
                out, bad = ckpt.import_state(st, p, spec, quantized, self._dtensor_forms(p, group),
                                             f"{where}: state[{pid!r}]", local(p).device,
                                             **self._codes_cast(p, group, own, spec, quantized))
            except ValueError as e:  # raised below on every rank of the groups, not on this one alone
                problem = str(e)
                break
            problem = problem or bad
            new_state[p] = out
        # ... and on the state each loads for it: all of them fresh, or all from one step.
        marks = _step_marks([new_state.get(p) for p in params]) if groups else []

        def describe(i, mine, theirs, rank):
            pid = next(k for k, v in id_map.items() if v[0] is params[i])
            word = lambda m: ("no state" if m is None else f"the state of step {m:g}"  # noqa: E731
                              if isinstance(m, float) else "a state")
            return (f"{where}: state[{pid!r}] holds {word(mine)} here and {word(theirs)} on rank {rank}, which "
                    "shares this param: the ranks must load the states of one checkpoint")
        apart = ckpt.agree_states(groups, marks, problem is not None, describe)  # on every rank, as agree
        ckpt.agree(problem or apart, groups)
        return new_state

    def _codes_cast(self, p: Tensor, group: dict, own: dict, spec: dict, quantized: dict) -> dict:
        """`import_state`'s `cast_keys` and `cast_note` for param `p`: its states that are 8-bit codes under the
        state_dict's settings (`group`, whose `_layout_keys` replace this optimizer's own, `own`, as torch's
        load_state_dict and DCP's template alike take a state_dict's hyperparameters) but 32-bit in this
        optimizer's own state, under the same key. DCP fills a template of this optimizer with the codes there,
        cast to floating point, and leaves their absmax behind (fastopt/checkpoint.py)."""
        changed = [k for k in self._layout_keys if group.get(k) != own.get(k)]
        if not changed:
            return {}
        own_spec = self._state_spec(p, own)
        keys = frozenset(k for k, (akey, _s, _b) in quantized.items()
                         if akey in spec and k in own_spec and akey not in own_spec)
        if not keys:
            return {}
        fmt = lambda g: ", ".join(f"{k}={g.get(k)!r}" for k in changed)  # noqa: E731
        return dict(cast_keys=keys, cast_note=f"the state_dict's param_groups have {fmt(group)}, this optimizer "
                                              f"{fmt(own)}")


def _autocast_off() -> contextlib.ExitStack:
    """Autocast turned off where the caller has it on: a step called inside `torch.autocast` (a training loop
    that keeps `opt.step()` in its autocast block) would otherwise run the torch reference's matmuls (GaLore's
    projections) in bf16/fp16, off the step outside it (torch.optim's steps have no autocast-eligible op)."""
    stack = contextlib.ExitStack()
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _step_marks(states: list) -> list:
    """What the ranks that share a param must agree on in the state they load for it, per state: None (fresh),
    else its step as a float (True where it has no value here: on the meta device). The step tensors are read
    with one host copy per device, not one per param."""
    marks: list = [None if st is None else True for st in states]
    by_device: dict = defaultdict(list)
    for i, st in enumerate(states):
        step = None if st is None else st.get("step")
        if isinstance(step, Tensor):
            step = local(step)
            if not step.is_meta:
                by_device[step.device].append((i, step))
        elif isinstance(step, numbers.Real):
            marks[i] = float(step)
    for found in by_device.values():
        values = torch.stack([s.reshape(()).to(torch.float64) for _, s in found]).tolist()
        for (i, _), v in zip(found, values):
            marks[i] = v
    return marks


def _warm_maps(group: dict) -> None:
    """The 8-bit maps (fastopt.reference.quant.dynamic_map) on the CUDA devices of a group that may keep 8-bit
    state, made when the group is added: the first step then copies nothing from the host (a copy from pageable
    memory synchronizes, which `torch.cuda.set_sync_debug_mode("error")` refuses)."""
    from ..reference.quant import dynamic_map
    for dev in {local(p).device for p in group["params"] if isinstance(p, Tensor) and local(p).is_cuda}:
        dynamic_map(True, dev)
        dynamic_map(False, dev)


def _local_grad(p: Tensor) -> Tensor:
    """p.grad's local tensor, laid out like p's and in p's dtype. A DTensor grad whose placements differ from its
    param's is redistributed to them first, as the DTensor ops of torch's own optimizers do implicitly (FSDP2 does
    it itself): pure tensor parallelism leaves `Partial(sum)` grads on replicated norm weights under
    SequenceParallel, and `Replicate` grads on an embedding sharded by `RowwiseParallel(input_layouts=
    Replicate())`. One collective per such param (none from Replicate to Shard). A grad in a narrower dtype than
    its param (FSDP1's `keep_low_precision_grads`) is stepped as a copy in the param's (exact; `_check_grads`
    refuses a wider one, which torch allows with `p.grad_dtype = None`). An FSDP1 piece stepped without a grad
    here (`fsdp_grads`: it has no elements here): zeros."""
    g = p.grad
    if g is None:
        return torch.zeros_like(local(p))
    if g.dtype != p.dtype:
        g = g.to(p.dtype)
    if ckpt.is_dtensor(g) and ckpt.is_dtensor(p) and (g.placements != p.placements
                                                        or g.device_mesh != p.device_mesh):
        g = g.redistribute(p.device_mesh, p.placements)
    return local(g)


def _copied_grads(params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    """The local tensors of the params' own gradients (the DTensor grad's, under DTensor) that `grads`, what the
    kernels read (`_local_grad`, made contiguous for flat layouts), are not: a grad cast to its param's dtype,
    redistributed to its param's placements, or copied contiguous. The kernels store the unscaled gradient into
    what they read; these get it by a separate op after the step."""
    out = []
    for p, g in zip(params, grads):
        if p.grad is None:
            continue
        own = local(p.grad)
        if own is not g and not (own.dtype == g.dtype and own.data_ptr() == g.data_ptr() and own.shape == g.shape
                                 and own.stride() == g.stride()):
            out.append(own)
    return out


def _state_diff(have: dict, want: dict, dev) -> str:
    """What differs between a param's state and the state it needs (key -> (shape, dtype, device) each)."""
    def fmt(m):
        return f"{m[0]} {m[1]}" + ("" if m[2] == dev else f" on {m[2]}")
    return "; ".join(
        f"{k!r} is {fmt(have[k])}, needs {fmt(want[k])}" if k in have and k in want else
        f"no {k!r} ({fmt(want[k])} needed)" if k in want else f"{k!r} ({fmt(have[k])}) is not needed"
        for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k))


def _working_layout(working: Tensor, tp_group, owner: str, where: str) -> Layout | None:
    """The tensor-parallel layout of a working param: its DTensor placements or `declare_shard` declaration,
    or, for a ColossalAI d_tensor (a `dist_layout` with a global shape and a sharding spec), its shard along
    one dim over `tp_group` (torch.chunk's rule, which is ColossalAI's even split when the dim divides);
    None when it is whole here."""
    from ..distributed.layout import make_layout
    lay = layout_of(working)
    if lay is not None:
        return lay
    spec = getattr(working, "dist_layout", None)
    if spec is None:
        return None
    parts = {d: axes for d, axes in spec.sharding_spec.dim_partition_dict.items() if axes}
    if not parts:
        return None
    if len(parts) > 1:
        raise NotImplementedError(f"{owner}: the working param of {where} is sharded along dims {sorted(parts)}; "
                                  "one sharded dim is supported (declare others with "
                                  "fastopt.distributed.declare_shard)")
    if tp_group is None:
        raise ValueError(f"{owner}: tp_group=None, but the working param of {where} is sharded along dim "
                         f"{next(iter(parts))}; pass tp_group")
    (d,) = parts
    # ColossalAI splits evenly; torch.chunk's rule is the same there and also covers uneven shards.
    return make_layout(tuple(working.shape), tuple(spec.global_shape), tp_group, dim=d % working.dim(), owner=owner)
