"""fastopt.GaLoreAdamW: AdamW on low-rank projected gradients, fused (math: fastopt/reference/galore.py)."""
from __future__ import annotations

import math
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from .. import checkpoint as ckpt
from .. import ops
from ..distributed.layout import layout_of, local
from ..reference.galore import (LEFT, PROJ_TYPES, basis_shapes, keeps_local_bases, moment_cut, moment_dim,
                                projected_shape, projection_side)
from ..reference.quant import num_blocks
from .adamw8bit import bnb_defaults_only
from .base import (BLOCK_SIZE, FLAG, MIN_8BIT_SIZE, NBITS, NONNEG, FastOptimizer, betas_rule, check, host_value,
                   is_int, is_number, lr_rule)

__all__ = ["GaLoreAdamW", "GaLoreAdamW8bit", "get_galore_param_groups"]

# A group with `rank` may leave these out; galore-torch's documented values.
GROUP_DEFAULTS = dict(update_proj_gap=200, scale=0.25, proj_type="std")


def _version(t: Tensor) -> int | None:
    """t's `_version`; None for an inference tensor (made under torch.inference_mode: it has no version counter,
    and reading one raises), whose host mirror is trusted as it is."""
    return None if t.is_inference() else t._version


def _host_value(t: Tensor) -> int:
    """A counter's or flag's value on the host; 0 on meta, which holds none (a step of meta params computes
    shapes alone)."""
    return 0 if t.is_meta else int(t.item())


class GaLoreAdamW(FastOptimizer):
    """GaLore-AdamW (Zhao et al., 2024) with the semantics of galore-torch's `GaLoreAdamW`.

    Param groups with a `rank` key (and optionally `update_proj_gap` (200), `scale` (0.25), `proj_type`
    (`std`, `reverse_std`, `left`, `right`, `full`; default `std`)) are projected: each matrix's gradient is
    projected onto the top-`rank` singular vectors of a gradient (the SVD runs at the first step and every
    `update_proj_gap` steps after it, on the steps t with (t - 1) % update_proj_gap == 0), Adam runs on the
    projected gradient, and its output is projected back, times `scale`. A param with more than two dims is a
    batch of matrices over its last two dims, each with its own projection. Groups without `rank` are plain
    AdamW. Transformers-style AdamW throughout: eps added to the uncorrected sqrt(v), step size
    lr sqrt(1 - beta2^t) / (1 - beta1^t) (lr with correct_bias=False), decoupled weight decay
    p -= lr weight_decay p after the update.
    Group keys are read at every step, as torch's optimizers read theirs: an `update_proj_gap` or `scale`
    changed between steps (by hand or by a scheduler) takes effect at the next step, where galore-torch keeps
    the values its projector was built with at the param's first step.

    Sharded params (DTensor Shard / _StridedShard placements: tensor parallelism, FSDP2, both on a 2-D mesh;
    `fastopt.distributed.declare_shard`; flat ZeRO ranges, also through `setup_distributed`) give the
    single-process result: on refresh steps each param's whole gradient is assembled on one rank of its group,
    which computes its SVD, and the new bases are shared (`refresh_bases`); on every step each rank projects
    its piece and the projected gradients of a bucket are summed over the ranks, after which each rank
    back-projects onto its own piece. For DTensor params the projected moments are sharded too: the sum is a
    reduce-scatter that leaves each rank the slice of the projected gradient whose moments it keeps (1/world of
    them), Adam runs on it, and one all-gather gives every rank the whole normalized update N for its
    back-projection (the same bytes as one all-reduce; one reduce-scatter and one all-gather per step for the
    bucket). Declared shards and flat ZeRO ranges keep whole moments on every rank (one all-reduce per step).
    A DTensor param's bases are cut like its piece (P's rows, Q's columns: all that its back-projection reads);
    other params keep them whole on every rank.
    With nbits=8 a DTensor param's moments are quantized in blocks of this rank's slice, not of the whole
    moments: the result then agrees with one process to the quantization error, as AdamW8bit's does.

    The defaults are those of the distributed-optimizers documentation (eps=1e-6, weight_decay=0.01), for both
    classes. galore-torch's `GaLoreAdamW` has weight_decay=0.0: pass it to reproduce its runs. Its
    `GaLoreAdamW8bit` steps with bitsandbytes' 8-bit Adam instead (eps=1e-8, added to sqrt(v / (1 - beta2^t)) as
    in torch.optim.AdamW; an unprojected param's weight decay before its update), which no argument here
    reproduces: fastopt's `GaLoreAdamW8bit` is its `GaLoreAdamW` with 8-bit moments.

    Args:
        params: iterable of params or param-group dicts (see `get_galore_param_groups`), or of (name, param)
            pairs as torch.optim takes them.
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to sqrt(v) (>= 0).
        weight_decay: decoupled decay (>= 0), applied after the update.
        nbits: 32 (fp32 moments; fp64 for fp64 params) or 8 (both moments, of the projected shape, in the
            8-bit block-wise format of `fastopt.quantize_blockwise`: signed map for m, unsigned for v).
        min_8bit_size: with nbits=8, moments with fewer elements stay 32-bit.
        block_size: elements per quantization block with nbits=8 (a power of two from 64 to 4096).
        correct_bias: fold Adam's bias corrections into the step size (galore-torch's argument; a group key).
            A state_dict saved before the key existed loads with True, the only behaviour then.
        no_deprecation_warning: accepted for galore-torch's signature and ignored (this class warns of
            nothing).

    State per param (tensors only; loads with `torch.load(weights_only=True)`): `step` (fp32 scalar on the
    param's device), `exp_avg`, `exp_avg_sq` (fp32, fp64 for fp64 params, or uint8 codes plus
    `exp_avg_absmax`, `exp_avg_sq_absmax`, fp32, one per block; the param's shape without a projection), and
    for projected params the bases `proj_left` (..., m, rank) and/or `proj_right` (..., rank, n), in the
    moments' float dtype: for a DTensor param DTensors with its placements along the dims they share with it
    (replicated along the rank-sized one), so each rank keeps the rows of P and the columns of Q of its own
    piece; otherwise whole, the same on every rank. A projected param's `exp_avg` and `exp_avg_sq` have the
    projected shape (..., rank, n), (..., m, rank) or (..., rank, rank): for a DTensor param they are DTensors
    of that shape on its mesh, cut along one dim over the ranks that shard the param (`Shard(d)` on those mesh
    dims, uneven like the params' shards; d the first dim with at least as many entries as those ranks, else
    the largest), so DCP reshards them; otherwise whole, the same on every rank.
    Works with `torch.amp.GradScaler` without host sync on the steps without an SVD: a
    step with an inf gradient changes nothing, step counter and bases included. The refresh schedule is
    decided on the host from a mirror of the step counter; a skipped step is known there from GradScaler's
    found_inf of the previous steps, copied asynchronously (on CUDA: to pinned memory, waited for by event
    one step later).
    """

    _name = "GaLoreAdamW"
    # Sharded params (DTensor Shard(0) / Shard(1), FSDP2, 2-D meshes, declared shards, flat ZeRO ranges): the
    # whole gradient is assembled for the SVD on refresh steps only, and the projected gradient is summed over
    # the ranks that share a param (DTensors: reduce-scattered onto sharded moments, N all-gathered; others:
    # all-reduced), one collective per phase per step for the bucket.
    _supports_layouts = True
    _elementwise_state = ("exp_avg", "exp_avg_sq")  # groups without `rank` only: see _elementwise_keys
    # `rank` and `proj_type` give the bases' and moments' shapes (a group without `rank`: None).
    _layout_keys = ("nbits", "min_8bit_size", "block_size", "rank", "proj_type")
    # A projected group's own keys too (checked where present: when a group is added, before each step, in a
    # state_dict before it loads).
    _hyper_rules = dict(lr=lr_rule(">= 0"), betas=betas_rule(2), eps=NONNEG, weight_decay=NONNEG, nbits=NBITS,
                        min_8bit_size=MIN_8BIT_SIZE, block_size=BLOCK_SIZE, correct_bias=FLAG,
                        rank=(lambda v: is_int(v) and v >= 1, "be an int >= 1"),
                        update_proj_gap=(lambda v: is_int(v) and v >= 1, "be an int >= 1"),
                        scale=(is_number, "be a finite number"),
                        proj_type=(lambda v: isinstance(v, str) and v in PROJ_TYPES,
                                   "be one of " + ", ".join(PROJ_TYPES)))

    # Group keys that a state_dict saved by an earlier fastopt may lack, and the value it then stepped with.
    _added_defaults = dict(correct_bias=True)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, nbits=32,
                 min_8bit_size=4096, block_size=256, correct_bias=True, no_deprecation_warning=False):
        defaults = self._check_hyper(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, nbits=nbits,
                                          min_8bit_size=min_8bit_size, block_size=block_size,
                                          correct_bias=correct_bias))
        # id(state["step"]) -> [a weak reference to that tensor, its value as the host knows it, the tensor's
        # _version then] (`_mirror`): a counter changed in place by anything but this optimizer's one add per step
        # (`state["step"].zero_()`) is read again
        self._host_steps: dict = {}
        self._pending: list = []     # (found_inf copy, CUDA event or None, host-step entries it may undo)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict) -> None:
        """After unpickling, deepcopy and load_state_dict: the host's mirror of the step counters, read once
        here from the (copied or loaded) state, so that step() never needs a read."""
        super().__setstate__(state)
        self._host_steps = {}
        for s in self.state.values():
            if isinstance(s.get("step"), Tensor):
                self._mirror(s["step"], _host_value(s["step"]), _version(s["step"]))
        self._pending = []

    # ---- validation -----------------------------------------------------------------------------------
    def _prepare_group(self, group: dict, where: str) -> dict:
        """Validates a group before it is added: a projected group's keys (the defaults it lacks filled in), and
        each of its params' shape. What torch refuses itself (no 'params', params in a set) goes to torch's checks
        as it is."""
        ps = group.get("params")
        if ps is None or isinstance(ps, set):
            return super()._prepare_group(group, where)
        group["params"] = [ps] if isinstance(ps, Tensor) else list(ps)
        if "rank" in group:
            for k, v in GROUP_DEFAULTS.items():
                group.setdefault(k, v)
            group = self._check_hyper(group, where)  # `rank` first: the shapes below are checked against it
            self._check_projected(group, where, at_step=False)
            return group
        for k in GROUP_DEFAULTS:
            check(k not in group, f"{where}['{k}']", self._name, group.get(k),
                  "come with 'rank' (a group without 'rank' is plain AdamW)")
        return super()._prepare_group(group, where)

    def _check_projected(self, group: dict, where: str, at_step: bool = True) -> None:
        """Each param of a projected group is a matrix (or a batch of them) with both dims >= rank, by its
        global shape. Before the first step a plain 1-D tensor passes: `setup_distributed` may still declare
        it a flat shard of a matrix (ColossalAI's ZeRO), and a ColossalAI d_tensor's piece is checked by the
        global shape of its `dist_layout`; `step()` checks again before changing anything. Before it, the
        layouts are read without caching them (`_layout`): a declaration may still come."""
        n, rank = self._name, group["rank"]
        for pi, p in enumerate(group["params"]):
            p = p[1] if isinstance(p, tuple) else p  # (name, param), before torch unpacks named params
            lay = self._layout(p) if at_step else layout_of(p, owner=n)
            shape = tuple(p.shape) if lay is None else lay.global_shape
            if not at_step and lay is None:  # a ColossalAI d_tensor: setup_distributed will declare it
                spec = getattr(p, "dist_layout", None)
                if getattr(spec, "global_shape", None) is not None:
                    shape = tuple(spec.global_shape)
            if (not at_step and len(shape) < 2 and lay is None) or math.prod(shape) == 0:
                continue  # 0-element params are never stepped
            if len(shape) >= 2 and rank <= min(shape[-2:]):
                continue  # the messages below are formatted only for a refusal: this runs at every step
            check(len(shape) >= 2, f"{where}['params'][{pi}].shape", n, shape,
                  "have 2 dims (more: a batch of matrices over the last two) to be projected; put vectors "
                  "in a group without 'rank'")
            check(rank <= min(shape[-2:]), f"{where}['rank']", n, rank,
                  f"be at most min(m, n) = {min(shape[-2:])} of its param {pi} of shape {shape}")

    def _check_group(self, gi: int, group: dict) -> None:
        """A group given `rank` since it was added (a plain group made projected) takes the projected keys it
        lacks from GROUP_DEFAULTS, as add_param_group gives them, and is checked like one added so."""
        if "rank" in group:
            missing = {k: v for k, v in GROUP_DEFAULTS.items() if k not in group}
            merged = {**group, **missing}  # checked before the group takes them: a refused step leaves it as it was
            if missing:
                self._check_hyper(merged, f"param_groups[{gi}]")
            self._check_projected(merged, f"param_groups[{gi}]")
            group.update(missing)

    def _check_grads(self) -> None:
        """The base class's checks, then (`_check_refresh_grads`) the gradients the SVDs of this step will read.
        First, once per step, the earlier steps' GradScaler verdicts (`_resolve_pending`): resolved per bucket,
        a step's second projected bucket would wait on the event of its first one's found_inf copy, a host sync
        inside the step."""
        self._resolve_pending()
        super()._check_grads()
        self._check_refresh_grads()

    def _check_refresh_grads(self) -> None:
        """Without GradScaler, a non-finite gradient of a param whose projection this step refreshes is refused
        before any param, state or step counter changes (one host sync, on refresh steps only): its SVD could not
        be computed. (GradScaler skips such a step instead.) Params sharded over ranks are left to the refresh,
        where every rank of the param's groups learns of a failed SVD and raises (after this step's other
        buckets ran): a rank's own piece cannot tell the others without a collective."""
        if getattr(self, "found_inf", None) is not None:
            return
        due, states, mirror = [], self.state, self._host_steps
        for gi, group in enumerate(self.param_groups):
            if "rank" not in group:
                continue
            gap = group["update_proj_gap"]
            for pi, p in enumerate(group["params"]):  # every step: the cheap tests first
                g = p.grad
                if g is None:
                    continue
                s = states.get(p)
                step = s.get("step") if s else None
                if step is not None:
                    e = mirror.get(id(step))  # (before this step's add)
                    known = e is not None and e[0]() is step and e[2] == _version(step)
                    if (e[1] if known else int(step.item())) % gap:
                        continue
                # (no step yet: its first step is a refresh)
                if not (g.is_meta or p.numel() == 0 or self._layout(p) is not None):
                    due.append((gi, pi, local(g)))
        if not due:
            return
        finite = torch.stack([ckpt.all_finite(g).to(due[0][2].device) for *_, g in due])
        if bool(finite.all()):
            return
        gi, pi, _ = due[int((~finite).nonzero()[0])]
        raise RuntimeError(f"{self._name}: the gradient of param_groups[{gi}]['params'][{pi}] is not finite at a "
                           "step that refreshes its projection (the SVD of its gradient); nothing was changed. "
                           "Skip the batch, or let torch.amp.GradScaler skip such steps")

    def _whole_statistics(self, p):
        """The projected groups' params (a group without 'rank' is element-wise AdamW)."""
        return any(q is p for g in self.param_groups if "rank" in g for q in g["params"])

    # ---- state ------------------------------------------------------------------------------------------
    def _state_known(self, p, group):
        # An undeclared 1-D piece in a projected group: its matrix's shape comes with setup_distributed (read
        # without caching the layout, as `_check_projected` does before the first step: a declaration may come).
        if "rank" not in group:
            return True
        lay = layout_of(p, owner=self._name)
        return len(p.shape if lay is None else lay.global_shape) >= 2

    def _state_spec(self, p, group):
        """Projected params: bases and moments of the projected shape, for a DTensor param this rank's part of them
        (`_dtensor_forms`: the bases of its piece, a slice of the moments), whole otherwise. Others: element-wise,
        shaped like the local piece."""
        shape = self._global_shape(p)
        dt = self.state_dtype(p)
        spec = {}
        mshape, whole = tuple(local(p).shape), shape
        if "rank" in group:
            side = projection_side(shape, group["proj_type"])
            mshape = whole = projected_shape(shape, group["rank"], side)
            # Bases of a param sharded along dims: cut like its local piece (`keeps_local_bases`); others: whole.
            cut_like = tuple(local(p).shape) if keeps_local_bases(self._layout(p)) else shape
            spec = {k: (s, dt) for k, s in basis_shapes(cut_like, group["rank"], side).items()}
            cut = moment_cut(self._layout(p), whole) if ckpt.is_dtensor(p) else None
            if cut is not None:
                d, _start, count = cut
                mshape = tuple(whole[:d]) + (count,) + tuple(whole[d + 1:])
        # The 8-bit decision looks at the whole moments (or param): the same on every rank and in every layout.
        if group["nbits"] == 8 and math.prod(whole) >= group["min_8bit_size"]:
            blocks = (num_blocks(math.prod(mshape), group["block_size"]),)
            spec.update({"exp_avg": (mshape, torch.uint8), "exp_avg_absmax": (blocks, torch.float32),
                         "exp_avg_sq": (mshape, torch.uint8), "exp_avg_sq_absmax": (blocks, torch.float32)})
        else:
            spec.update({"exp_avg": (mshape, dt), "exp_avg_sq": (mshape, dt)})
        return spec

    def _quantized_keys(self, group):
        bs = group["block_size"]
        return {"exp_avg": ("exp_avg_absmax", True, bs), "exp_avg_sq": ("exp_avg_sq_absmax", False, bs)}

    def _elementwise_keys(self, group):
        # A projected param's moments and bases are not shaped like the param (`_dtensor_forms`).
        return frozenset() if "rank" in group else super()._elementwise_keys(group)

    def _dtensor_forms(self, p, group):
        """A projected DTensor param's moments: DTensors of the projected shape on its mesh, cut along one dim
        (`moment_cut`) over the mesh dims that shard the param (replicated over the others; all replicated for a
        replicated param). Its bases: DTensors with the param's placements, except that the mesh dims that shard
        the param along the dim a basis replaces by `rank` (n for P, m for Q) replicate it."""
        if "rank" not in group or not ckpt.is_dtensor(p):
            return super()._dtensor_forms(p, group)
        from torch.distributed.tensor.placement_types import Replicate
        shape = self._global_shape(p)
        side = projection_side(shape, group["proj_type"])
        whole = projected_shape(shape, group["rank"], side)
        lay = self._layout(p)
        if lay is None:
            placements = (Replicate(),) * p.device_mesh.ndim
        elif lay.mesh is None:  # a layout declared for it (`setup_distributed`): plain states
            return {}
        else:
            placements = lay.shard_placements(moment_dim(whole, dist.get_world_size(lay.group)))
        forms = {k: (whole, placements) for k in ("exp_avg", "exp_avg_sq")}
        nd = len(shape)
        for key, bshape in basis_shapes(shape, group["rank"], side).items():
            rank_dim = nd - 1 if key == LEFT else nd - 2
            forms[key] = (bshape, tuple(Replicate() if getattr(pl, "dim", None) == rank_dim else pl
                                        for pl in p.placements))
        return forms

    def _init_state(self, p, group):
        fresh = not self.state[p]
        state = super()._init_state(p, group)
        if fresh:
            self._mirror(state["step"], 0, _version(state["step"]))
        return state

    # ---- the refresh schedule, on the host --------------------------------------------------------------
    def _resolve_pending(self) -> None:
        """Undo the host's +1 for the earlier steps that GradScaler skipped (their found_inf is known by now)."""
        for buf, event, entries in self._pending:
            if event is not None:
                event.synchronize()
            if float(buf) != 0:
                for e in entries:
                    e[1] -= 1
        self._pending.clear()

    def _mirror(self, step: Tensor, value: int, version: int | None) -> list:
        """A new `_host_steps` entry for counter `step`, dropped when the tensor is freed: the mirror keeps no
        state alive that the optimizer no longer holds (`opt.state.clear()`)."""
        key, mirror = id(step), self._host_steps

        def drop(ref, key=key, mirror=mirror):
            e = mirror.get(key)
            if e is not None and e[0] is ref:
                del mirror[key]
        e = mirror[key] = [weakref.ref(step, drop), value, version]
        return e

    def _host_step(self, state: dict, found_inf: Tensor | None) -> list:
        step = state["step"]
        e, v = self._host_steps.get(id(step)), _version(step)
        if e is None or e[0]() is not step or (v is not None and e[2] != v - 1):
            # State set or changed from outside (not created, loaded nor stepped here): read it once. The device
            # counter already counts this step (its add is the one _version step expected) unless found_inf is set.
            before = _host_value(step) - (1 if found_inf is None else 1 - _host_value(found_inf))
            e = self._mirror(step, before, None)
        e[2] = v
        return e

    def _refresh_flags(self, states: list[dict], gap: int, found_inf: Tensor | None) -> list[bool]:
        entries = [self._host_step(s, found_inf) for s in states]
        for e in entries:
            e[1] += 1  # provisional: undone by _resolve_pending if GradScaler skips this step
        if found_inf is not None:
            if found_inf.device.type == "cuda":
                buf = torch.empty((), dtype=found_inf.dtype, pin_memory=True)
                buf.copy_(found_inf, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(found_inf.device))  # the stream of the copy
            else:
                buf, event = found_inf.clone(), None
            self._pending.append((buf, event, entries))
        return [(e[1] - 1) % gap == 0 for e in entries]

    # ---- the step -----------------------------------------------------------------------------------------
    def _step_group(self, group, params, grads, states, scaler, layouts=None, sharded=False):
        hyper = dict(lr=host_value(group["lr"]), betas=group["betas"], eps=group["eps"],
                     weight_decay=group["weight_decay"], block_size=group["block_size"],
                     correct_bias=group["correct_bias"])
        if "rank" in group:
            refresh = self._refresh_flags(states, group["update_proj_gap"], scaler.found_inf)
            if any(refresh):
                ops.galore_refresh(grads, states, refresh, rank=group["rank"], inv_scale=scaler.inv_scale,
                                   found_inf=scaler.found_inf, layouts=layouts)
            hyper["scale"] = group["scale"]
        return ops.galore_phases(params, grads, states, inv_scale=scaler.inv_scale, found_inf=scaler.found_inf,
                                 cache=self._plan_cache(group, params, layouts),
                                 layouts=layouts, sharded=sharded, **hyper)


class GaLoreAdamW8bit(GaLoreAdamW):
    """`GaLoreAdamW` with nbits=8: both moments in the 8-bit block-wise format (no bitsandbytes needed)."""

    _name = "GaLoreAdamW8bit"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, min_8bit_size=4096,
                 block_size=256, correct_bias=True, *, amsgrad=False, optim_bits=32, args=None,
                 percentile_clipping=100, block_wise=True, is_paged=False):
        # galore-torch's GaLoreAdamW8bit takes bitsandbytes' arguments: accepted at their defaults
        bnb_defaults_only(self._name, amsgrad=amsgrad, optim_bits=optim_bits, args=args,
                          percentile_clipping=percentile_clipping, block_wise=block_wise, is_paged=is_paged)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, nbits=8,
                         min_8bit_size=min_8bit_size, block_size=block_size, correct_bias=correct_bias)


def _is_norm(module: torch.nn.Module) -> bool:
    norms = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase, torch.nn.RMSNorm)
    return isinstance(module, norms) or "norm" in type(module).__name__.lower()


def get_galore_param_groups(model: torch.nn.Module, weight_decay: float, rank: int = 256, update_proj_gap: int = 200,
                            scale: float = 0.25, proj_type: str = "std") -> list[dict]:
    """Param groups for `GaLoreAdamW`: the 2-D weights of `nn.Linear` layers projected (with `rank`, ...),
    other params of two or more dims plain AdamW with `weight_decay`, and biases, norms' params and every
    other vector or scalar plain AdamW without decay. A Linear weight with a dim smaller than `rank` stays
    plain (its projection would keep no fewer numbers). Params without requires_grad are left out; a param
    shared by several modules appears once, and one that is also another module's than a Linear's weight (an
    embedding tied to the output layer) is not projected, whichever module comes first. Empty groups are dropped;
    a UserWarning says when no param is projected (GaLoreAdamW then steps as plain AdamW). Shapes are the whole
    params' (`layout_of`: an FSDP1 piece is 1-D, a shard declared by hand smaller), so that every rank makes the
    same groups."""
    check(is_int(rank) and rank >= 1, "rank", "get_galore_param_groups", rank, "be an int >= 1")
    projected, decayed, plain = [], [], []
    seen: set = set()
    not_linear = {id(p) for m in model.modules() for n, p in m.named_parameters(recurse=False)
                  if not (isinstance(m, torch.nn.Linear) and n == "weight")}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            lay = layout_of(p, owner="get_galore_param_groups")
            shape = tuple(p.shape) if lay is None else lay.global_shape
            if (isinstance(module, torch.nn.Linear) and name == "weight" and min(shape) >= rank
                    and id(p) not in not_linear):
                projected.append(p)
            elif len(shape) >= 2 and not _is_norm(module):
                decayed.append(p)
            else:
                plain.append(p)
    groups = [{"params": projected, "rank": rank, "update_proj_gap": update_proj_gap, "scale": scale,
               "proj_type": proj_type, "weight_decay": weight_decay},
              {"params": decayed, "weight_decay": weight_decay},
              {"params": plain, "weight_decay": 0.0}]
    if not projected and (decayed or plain):
        warnings.warn(f"get_galore_param_groups: no param is projected (no trainable nn.Linear weight with both "
                      f"dims >= rank={rank}): GaLoreAdamW will step every param as plain AdamW", stacklevel=2)
    return [g for g in groups if g["params"]]
