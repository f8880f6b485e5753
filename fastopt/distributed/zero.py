"""ZeroRedundancyOptimizer: ZeRO stages 1 and 2 around any optimizer instance.

The model stays an ordinary module with the same weights on every rank, and each rank trains on its own data
(DDP-style data parallelism without a model wrapper). The wrapper owns the data-parallel communication:

* Partition. Whole parameters are assigned to ranks, largest first, each to the rank holding the fewest
  elements so far (the greedy balance of `torch.distributed.optim.ZeroRedundancyOptimizer`). A parameter is
  never split: every statistic an optimizer keeps over a whole matrix (Adafactor's and CAME's row and column
  factors, Lamb's trust ratio, GaLore's projection, 8-bit blocks) is then computed by one rank from the whole
  gradient, exactly as in a single process, with no extra communication. The price is balance: a rank holds
  at most `total / world + (largest parameter)` elements of state.
* The wrapped optimizer sees only this rank's parameters: its `param_groups` are cut down in place (each group
  keeps its hyperparameters, possibly with no params on this rank) and state of other ranks' params is
  dropped, so its state exists for this rank's shard only.
* ZeRO-1 (`partition_grad=False`): gradients are averaged over the group by all-reduce of flat buckets (one
  collective per bucket of at most `bucket_size_mb`). With `overlap_communication=False` this happens in
  `step()`, each all-reduce waited on right after it is launched; with `True` each bucket is all-reduced
  asynchronously as soon as backward has produced all its gradients (DDP's scheme), and all are waited on at
  the end of backward. Every rank keeps full averaged gradients.
* ZeRO-2 (`partition_grad=True`): from post-accumulate-grad hooks, each gradient is copied (divided by the
  world size) into a flat bucket of params that share one owner, and freed (`p.grad = None`) at once; a full
  bucket is reduced to its owner (`dist.reduce`), which adds it into a flat accumulator. With
  `overlap_communication=False` the hook that launched a reduction waits for it before backward goes on
  (nothing on the wire while backward computes; gradients are still freed as they are packed); with `True`
  the reductions run while backward goes on. At the end of backward (an autograd callback) all reductions are
  waited on and the owner's params get `.grad` as views of the accumulator; other ranks' params keep
  `.grad = None`.
* `step()` steps this rank's shard with the wrapped optimizer, then every owner broadcasts its updated params
  in flat buckets, so all ranks end the step with identical weights.

Gradient accumulation: run several backward passes, then `step()`. ZeRO-1 reduces once, in `step()` (with
overlap: once per backward, an all-reduce of the running sums, which stays exact because the earlier part is
already identical on every rank). ZeRO-2 reduces every backward's fresh gradient into the owner's accumulator;
before a backward adds to an owner's exposed `.grad`, a tensor hook detaches it, so accumulator + fresh
gradient is never counted twice. Not calling `zero_grad()` between steps accumulates across steps, as in torch.

Like DDP, every rank must run the same sequence: the same backward passes over the same params, and every
`step()`, `clip_grad_norm_()`, consolidated `state_dict()` and `add_param_group()` together. A parameter that
gets no gradient on a rank contributes zeros from that rank. One that gets a gradient on no rank keeps
`.grad = None` and is not stepped, as in one process (torch's optimizers skip it: no state, no weight decay):
every bucket carries one "has a gradient" count per param after its gradients, summed by the same collective,
so this costs no extra communication (the counts are read back to the host only for params without a local
gradient). A gradient zeroed by `zero_grad(set_to_none=False)` still counts, as in torch. Gradients set by
hand instead of by backward are reduced in `step()` (they must be set on every rank).

Hyperparameters live in `param_groups` of the wrapper (every param of each group); assigning a key there
(LR schedulers do) sets it in the wrapped optimizer's group at once, and every `step()` copies all keys across.
Without an initialized process group (or with a group of one rank) the wrapper is a pass-through that
communicates nothing.

Not supported: `torch.amp.GradScaler` (its inf check and step skip are per rank, so ranks could disagree;
the wrapper does not declare `_step_supports_amp_scaling`), optimizers that evaluate the closure several times
per step (LBFGS: the wrapper runs the closure once, then reduces), DTensor params (FSDP / tensor parallelism
shard them already: use the optimizer directly), and params of one group spread over devices whose backward
hooks run in different threads.
"""
from __future__ import annotations

import math
import sys
import weakref
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ZeroRedundancyOptimizer"]

_NAME = "ZeroRedundancyOptimizer"
_NOT_HYPER = ("params", "param_names")


class _Group(dict):
    """One param group of the wrapper (all its params); `group[key] = value` also sets the wrapped
    optimizer's group of the same index, which holds this rank's params of the group."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        inner = getattr(self, "_inner", None)
        if inner is not None and key not in _NOT_HYPER:
            inner.param_groups[self._index][key] = value

    def __reduce__(self):  # copies and pickles are plain dicts, detached from the optimizer
        return dict, (dict(self),)


class _Bucket:
    """Params of one device and dtype (and, for ZeRO-2 and broadcasts, one owner) packed in one flat buffer.

    A reduction buffer (`staging`, ZeRO-2's `acc`) holds the `numel` gradient elements followed by one count
    per param: 1 where this rank packed a gradient, summed over the ranks by the same collective, so a count of
    0 means that no rank produced a gradient for that param. `seen[k]`: this rank packed one for param k into
    the current accumulator (its count is then known to be > 0 without reading it back)."""

    __slots__ = ("params", "gidx", "offsets", "numel", "size", "owner", "device", "dtype",
                 "staging", "filled", "pending", "acc", "seen", "work")

    def __init__(self, gidx: list[int], params: list[Tensor], owner: int | None):
        self.params = params
        self.gidx = gidx
        self.owner = owner
        self.offsets = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.size = n + len(params)
        self.device = params[0].device
        self.dtype = params[0].dtype
        self.staging: Tensor | None = None
        self.filled = [False] * len(params)
        self.pending = len(params)
        self.acc: Tensor | None = None
        self.seen = [False] * len(params)
        self.work = None

    def slot(self, buf: Tensor, k: int) -> Tensor:
        p = self.params[k]
        return buf[self.offsets[k]:self.offsets[k] + p.numel()]

    def counts(self, buf: Tensor) -> list[bool]:
        """Per param: did any rank contribute a gradient to `buf` (a host sync on an accelerator)."""
        return buf[self.numel:].ne(0).tolist()

    def reset_round(self) -> None:
        self.staging = None
        self.filled = [False] * len(self.params)
        self.pending = len(self.params)
        self.work = None


class _SharedGroup:
    """The wrapper's process group inside its pickled state: the same group in a deepcopy (the copy communicates
    over it, like the original); pickled only when there is none (a single process)."""

    __slots__ = ("pg",)

    def __init__(self, pg):
        self.pg = pg

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        if self.pg is not None:
            raise TypeError(f"{_NAME}: cannot pickle a wrapper over a process group (the group belongs to this "
                            "process); save its state_dict instead")
        return _SharedGroup, (None,)


# What a pickle or a deepcopy of the wrapper carries; the rest (buckets, hooks) is rebuilt, with ZeRO-2's
# accumulators and the gradients exposed as views of them.
_PICKLED = ("defaults", "optim", "partition_grad", "overlap_communication", "bucket_size_mb", "_cap", "rank",
            "world_size", "_ranks", "_params", "_owner", "_loads", "_inv_world", "_synced")


def _chunks(items: list[int], params: list[Tensor], cap_bytes: int) -> list[list[int]]:
    """Consecutive runs of `items` of at most `cap_bytes` each (a larger param gets a bucket of its own)."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in items:
        b = params[i].numel() * params[i].element_size()
        if cur and size + b > cap_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += b
    if cur:
        out.append(cur)
    return out


def _hook_post(ref, gidx):
    def hook(_p):
        z = ref()
        if z is not None:
            z._on_grad(gidx)
    return hook


def _hook_pre(ref, gidx):
    def hook(_grad):
        z = ref()
        if z is not None:
            z._detach_exposed(gidx)
    return hook


def _hook_mark(ref):
    def hook(_p):
        z = ref()
        if z is not None:
            z._synced = False
    return hook


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2 data parallelism around any optimizer instance (details: this module's docstring).

    Args:
        optimizer: a constructed `torch.optim.Optimizer` over all of the model's params (any fastopt optimizer,
            torch's AdamW or SGD, ...). It is cut down in place to this rank's params: use the wrapper from now on.
        process_group: the data-parallel group (default: the default group; without an initialized process
            group the wrapper runs as a single rank).
        partition_grad: False for ZeRO-1 (optimizer state sharded, gradients all-reduced), True for ZeRO-2
            (gradients reduced to their owner during backward and freed on the other ranks).
        overlap_communication: ZeRO-1: all-reduce gradient buckets asynchronously during backward instead of in
            `step()`. ZeRO-2 (which always reduces from backward's hooks): let the reductions run asynchronously
            while backward goes on, instead of waiting for each one in the hook that launched it.
        bucket_size_mb: upper bound of one flat communication bucket, in MiB.

    Construction is collective: it checks that every rank passes the same params (count, shapes, dtypes and
    values) and raises the same `ValueError` on every rank when they differ.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, process_group=None, partition_grad: bool = False,
                 overlap_communication: bool = False, bucket_size_mb: float = 25):
        if isinstance(optimizer, type):
            raise TypeError(f"{_NAME}: optimizer={optimizer.__name__} is a class; pass an instance, e.g. "
                            f"{_NAME}({optimizer.__name__}(model.parameters(), ...))")
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise TypeError(f"{_NAME}: optimizer is already a {_NAME}; wrap the inner optimizer once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{_NAME}: optimizer={type(optimizer).__name__} must be a torch.optim.Optimizer "
                            f"instance, e.g. fastopt.Adafactor(model.parameters())")
        if not (isinstance(bucket_size_mb, (int, float)) and math.isfinite(bucket_size_mb) and bucket_size_mb > 0):
            raise ValueError(f"{_NAME}: bucket_size_mb={bucket_size_mb!r} must be a finite number > 0")
        self.partition_grad = bool(partition_grad)
        self.overlap_communication = bool(overlap_communication)
        self.bucket_size_mb = bucket_size_mb
        self._cap = max(1, int(bucket_size_mb * 2 ** 20))
        self._pg, self.rank, self.world_size = self._resolve_group(process_group)
        self._ranks = dist.get_process_group_ranks(self._pg) if self._pg is not None else [0]

        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._check_params(params)
        if self.world_size > 1:
            self._check_replicas(params, optimizer, [len(g["params"]) for g in optimizer.param_groups])

        self._params: list[Tensor] = []
        self._gidx: dict[int, int] = {}
        self._owner: list[int] = []
        self._loads = [0] * self.world_size
        self._assign(params)

        self.optim = optimizer
        self._initialized = False
        groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        self.param_groups = [self._wrap_group(g, i) for i, g in enumerate(self.param_groups)]
        self._initialized = True
        for gi in range(len(optimizer.param_groups)):
            self._restrict_inner_group(gi)
        owned = {id(p) for p, r in zip(self._params, self._owner) if r == self.rank}
        for p in [k for k in optimizer.state if isinstance(k, Tensor) and id(k) not in owned]:
            del optimizer.state[p]

        self._inv_world = 1.0 / self.world_size
        self._synced = False
        self._handles: list = []
        self._build()

    # ---- construction helpers --------------------------------------------------------------------
    @staticmethod
    def _resolve_group(process_group):
        if process_group is None:
            if dist.is_available() and dist.is_initialized():
                pg = dist.group.WORLD
                return pg, dist.get_rank(pg), dist.get_world_size(pg)
            return None, 0, 1
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"{_NAME}: process_group given but torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group first")
        if process_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"{_NAME}: this rank (global rank {dist.get_rank()}) is not a member of "
                             "process_group; pass a group that contains every rank sharing these params")
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"{_NAME}: process_group={type(process_group).__name__} must be a "
                            "torch.distributed.ProcessGroup or None")
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError(f"{_NAME}: this rank (global rank {dist.get_rank()}) is not a member of "
                             "process_group; pass a group that contains every rank sharing these params")
        return process_group, rank, dist.get_world_size(process_group)

    def _check_params(self, params: list[Tensor]) -> None:
        dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no param can be a DTensor
        for i, p in enumerate(params):
            if dtensor is not None and isinstance(p, dtensor.DTensor):
                raise ValueError(f"{_NAME}: param {i} is a DTensor (already sharded by FSDP or tensor "
                                 "parallelism); use the optimizer without this wrapper")
        if self._pg is None or self.world_size == 1:
            return
        backend = str(dist.get_backend(self._pg))
        kinds = {p.device.type for p in params}
        if backend == "nccl" and kinds != {"cuda"}:
            raise ValueError(f"{_NAME}: process_group uses nccl but params live on {sorted(kinds)}; nccl moves "
                             "CUDA tensors only: pass a gloo group for CPU params")
        if backend == "gloo" and "cuda" in kinds and self.partition_grad:
            raise ValueError(f"{_NAME}: process_group uses gloo, which cannot reduce CUDA tensors "
                             "(partition_grad=True); pass an nccl group")

    def _check_replicas(self, params: list[Tensor], optimizer, group_sizes: list[int]) -> None:
        """Same params on every rank (count, groups, shapes, dtypes, values), else ValueError on every rank."""
        meta = (type(optimizer).__name__, group_sizes,
                [(tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for p in params])
        metas: list = [None] * self.world_size
        dist.all_gather_object(metas, meta, group=self._pg)
        for r, m in enumerate(metas):
            if m == meta:
                continue
            if m[0] != meta[0] or m[1] != meta[1]:
                raise ValueError(f"{_NAME}: rank {r} wraps {m[0]} with param groups of sizes {m[1]}, rank "
                                 f"{self.rank} wraps {meta[0]} with {meta[1]}: every rank must pass the same "
                                 "optimizer over the same params")
            k = next(k for k, (a, b) in enumerate(zip(m[2], meta[2])) if a != b)
            raise ValueError(f"{_NAME}: param {k} is {m[2][k]} (shape, dtype, requires_grad) on rank {r} and "
                             f"{meta[2][k]} on rank {self.rank}: every rank must pass the same params")
        # Values: rank 0's params, broadcast in flat buckets, must equal every rank's own.
        bad: list[int] = []
        keyed: dict = {}
        for i, p in enumerate(params):
            if p.numel():
                keyed.setdefault((p.device, p.dtype), []).append(i)
        with torch.no_grad():
            for idx in keyed.values():
                for chunk in _chunks(idx, params, self._cap):
                    flat = torch.cat([params[i].detach().reshape(-1) for i in chunk])
                    mine = flat.clone() if self.rank != 0 else flat
                    dist.broadcast(flat, src=self._ranks[0], group=self._pg)
                    off = 0
                    for i in chunk:
                        n = params[i].numel()
                        if not torch.equal(flat[off:off + n], mine[off:off + n]):
                            bad.append(i)
                        off += n
        bads: list = [None] * self.world_size
        dist.all_gather_object(bads, bad, group=self._pg)
        for r, b in enumerate(bads):
            if b:
                raise ValueError(f"{_NAME}: param {b[0]} (shape {tuple(params[b[0]].shape)}) has different values "
                                 f"on rank {r} and rank 0 (params {b} differ): every rank must start from the "
                                 "same weights (seed the initialization, or broadcast from rank 0)")

    def _assign(self, params: list[Tensor]) -> None:
        """Append `params` and give each an owner: largest first, to the rank with the fewest elements."""
        base = len(self._params)
        for k, p in enumerate(params):
            if id(p) in self._gidx:
                raise ValueError(f"{_NAME}: a param appears twice (param {base + k})")
            self._gidx[id(p)] = base + k
            self._params.append(p)
            self._owner.append(-1)
        # A frozen param weighs nothing (it has no state): counting it could leave a rank without trainable ones.
        weight = lambda i: self._params[i].numel() if self._params[i].requires_grad else 0  # noqa: E731
        for i in sorted(range(base, len(self._params)), key=lambda i: (-weight(i), i)):
            r = min(range(self.world_size), key=lambda r: (self._loads[r], r))
            self._owner[i] = r
            self._loads[r] += weight(i)

    def _wrap_group(self, group: dict, index: int) -> _Group:
        g = _Group(group)
        g._inner = self.optim
        g._index = index
        return g

    def _restrict_inner_group(self, gi: int) -> None:
        g = self.optim.param_groups[gi]
        keep = [k for k, p in enumerate(g["params"]) if self._owner[self._gidx[id(p)]] == self.rank]
        if "param_names" in g:
            g["param_names"] = [g["param_names"][k] for k in keep]
        g["params"] = [g["params"][k] for k in keep]

    def _build(self) -> None:
        """Buckets and hooks for the current params (called again by add_param_group)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        P = self._params
        managed = [i for i, p in enumerate(P) if p.requires_grad and p.numel() > 0]
        self._managed = managed
        self._owned = [i for i in managed if self._owner[i] == self.rank]
        self._views: dict[int, Tensor] = {}
        self._next = 0
        self._round = False
        self._inflight: deque = deque()
        by_key: dict = {}
        for i in managed:
            key = (P[i].device, P[i].dtype)
            if self.partition_grad:
                key = (self._owner[i],) + key
            by_key.setdefault(key, []).append(i)
        # Gradient buckets in the order backward fills them (roughly reverse registration order, as DDP).
        red = []
        for key, idx in by_key.items():
            for chunk in _chunks(idx[::-1], P, self._cap):
                red.append(_Bucket(chunk, [P[i] for i in chunk], key[0] if self.partition_grad else None))
        red.sort(key=lambda b: -max(b.gidx))
        self._red = red
        self._slot = {i: (b, k) for b in red for k, i in enumerate(b.gidx)}
        bc: dict = {}
        for i in managed:
            bc.setdefault((self._owner[i], P[i].device, P[i].dtype), []).append(i)
        self._bc = [_Bucket(chunk, [P[i] for i in chunk], key[0])
                    for key, idx in sorted(bc.items(), key=lambda kv: kv[1][0])
                    for chunk in _chunks(idx, P, self._cap)]
        if self.world_size == 1:
            return
        ref = weakref.ref(self)
        hooks_reduce = self.partition_grad or self.overlap_communication
        for i in managed:
            p = P[i]
            if hooks_reduce:
                self._handles.append(p.register_post_accumulate_grad_hook(_hook_post(ref, i)))
            else:
                self._handles.append(p.register_post_accumulate_grad_hook(_hook_mark(ref)))
            if self.partition_grad and self._owner[i] == self.rank:
                self._handles.append(p.register_hook(_hook_pre(ref, i)))

    def __del__(self):
        for h in getattr(self, "_handles", ()):
            h.remove()

    def __getstate__(self) -> dict:
        state = {k: self.__dict__[k] for k in _PICKLED}
        state["param_groups"] = [dict(g) for g in self.param_groups]
        state["_pg"] = _SharedGroup(self._pg)
        state["_accs"] = [(b.acc, list(b.seen)) for b in self._red]  # ZeRO-2: gradients summed so far
        state["_exposed"] = sorted(self._views)
        return state

    def __setstate__(self, state: dict) -> None:
        """A deepcopy or unpickled copy: the wrapped optimizer's copy, over the copied params, with buckets and
        hooks of its own (on the same process group, for a deepcopy)."""
        state = dict(state)
        pg = state.pop("_pg").pg
        accs, exposed = state.pop("_accs"), state.pop("_exposed")
        differentiable = "differentiable" in state["defaults"]
        self.__dict__["_initialized"] = False
        super().__setstate__(state)  # torch's: its hook registries (empty, as in a copy of a torch optimizer)
        if not differentiable:  # torch adds it to the defaults, shared with the wrapped optimizer
            self.defaults.pop("differentiable", None)
        self._pg = pg
        self._gidx = {id(p): i for i, p in enumerate(self._params)}
        self.param_groups = [self._wrap_group(g, i) for i, g in enumerate(self.param_groups)]
        self._initialized = True
        self._handles = []
        self._build()  # the same buckets, in the same order
        for b, (acc, seen) in zip(self._red, accs):
            b.acc, b.seen = acc, seen
        for gidx in exposed:  # the owner's .grad: a view of the accumulator again, not a copy of one
            b, k = self._slot[gidx]
            p = self._params[gidx]
            self._views[gidx] = p.grad = b.slot(b.acc, k).view(p.shape)

    # ---- torch.optim.Optimizer surface -------------------------------------------------------------
    @property
    def state(self):
        """The wrapped optimizer's state: this rank's params only."""
        return self.optim.state

    @state.setter
    def state(self, value):
        # torch.optim.Optimizer.__init__ assigns an empty state: the wrapped optimizer's must survive that.
        if self.__dict__.get("_initialized"):
            self.optim.state = value

    def __repr__(self) -> str:
        stage = 2 if self.partition_grad else 1
        return (f"{_NAME}(stage={stage}, rank={self.rank}, world_size={self.world_size}, "
                f"overlap_communication={self.overlap_communication}, optimizer={self.optim!r})")

    def add_param_group(self, param_group: dict) -> None:
        """Add a group on every rank (collective after construction): its params are partitioned like the rest."""
        if not getattr(self, "_initialized", False):
            super().add_param_group(param_group)
            return
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        self._check_params(params)
        if self.world_size > 1:
            self._check_replicas(params, self.optim, [len(params)])
        self._assign(params)
        super().add_param_group({**param_group, "params": params})
        gi = len(self.param_groups) - 1
        full = self.param_groups[gi]
        self.optim.add_param_group({**full, "params": list(full["params"])})
        self._restrict_inner_group(gi)
        self.param_groups[gi] = self._wrap_group(full, gi)
        self._build()

    def _push_hyper(self) -> None:
        for gw, gi in zip(self.param_groups, self.optim.param_groups):
            for k, v in gw.items():
                if k not in _NOT_HYPER:
                    gi[k] = v

    def _pull_hyper(self) -> None:
        for gw, gi in zip(self.param_groups, self.optim.param_groups):
            for k, v in gi.items():
                if k not in _NOT_HYPER:
                    dict.__setitem__(gw, k, v)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce_grads()
        self._synced = False
        self._push_hyper()
        self.optim.step()
        self._pull_hyper()
        self._broadcast_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every param (and ZeRO-2's accumulators)."""
        self._synced = False
        for b in self._red:
            if set_to_none:
                b.acc = None
                b.seen = [False] * len(b.params)
            elif b.acc is not None:  # the counts stay: a param whose gradient is zeroed, not removed, is stepped
                b.acc[:b.numel].zero_()
        if set_to_none:
            self._views = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    # ---- gradients ---------------------------------------------------------------------------------
    def _detach_exposed(self, gidx: int) -> None:
        """Before backward adds into an owner's exposed gradient (a view of the accumulator), take it away:
        the accumulator keeps the sum so far and this backward's gradient arrives alone."""
        p = self._params[gidx]
        v = self._views.get(gidx)
        if v is not None and p.grad is v:
            p.grad = None

    def _on_grad(self, gidx: int) -> None:
        """Post-accumulate-grad hook: pack the gradient into its bucket; launch the buckets that are full."""
        if not self._round:
            self._round = True
            torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward(weakref.ref(self)))
        b, k = self._slot[gidx]
        if b.work is not None:  # reduced already in this round (a second backward inside this one)
            return
        self._pack(b, k)
        if b.pending == 0:
            while self._next < len(self._red) and self._red[self._next].pending == 0:
                self._launch(self._red[self._next])
                self._next += 1

    @torch.no_grad()
    def _pack(self, b: _Bucket, k: int) -> None:
        p = self._params[b.gidx[k]]
        if b.staging is None:
            b.staging = torch.zeros(b.size, dtype=b.dtype, device=b.device)
        g = p.grad
        if g is not None and not (self.partition_grad and g is self._views.get(b.gidx[k])):
            b.staging[b.offsets[k]:b.offsets[k] + p.numel()].add_(g.reshape(-1), alpha=self._inv_world)
            b.staging[b.numel + k] = 1  # this rank has a gradient for param k
            b.seen[k] = True
            if self.partition_grad:
                p.grad = None
        if not b.filled[k]:
            b.filled[k] = True
            b.pending -= 1

    def _launch(self, b: _Bucket) -> None:
        if b.staging is None:
            b.staging = torch.zeros(b.size, dtype=b.dtype, device=b.device)
        if self.partition_grad:
            b.work = dist.reduce(b.staging, dst=self._ranks[b.owner], group=self._pg, async_op=True)
        else:
            b.work = dist.all_reduce(b.staging, group=self._pg, async_op=True)
        if not self.overlap_communication:  # synchronous: nothing on the wire while backward goes on
            self._complete(b)
            return
        self._inflight.append(b)
        while self._inflight and self._inflight[0].work.is_completed():  # frees staging early
            self._complete(self._inflight.popleft())

    @torch.no_grad()
    def _complete(self, b: _Bucket) -> None:
        b.work.wait()
        if self.partition_grad:
            if b.owner == self.rank:
                if b.acc is None:
                    b.acc = b.staging
                else:
                    b.acc.add_(b.staging)  # the counts add up too: > 0 once any rank had a gradient
        else:
            # A param with a local gradient has a count > 0; read the counts only when some param has none here.
            has = b.counts(b.staging) if any(p.grad is None for p in b.params) else None
            for k, p in enumerate(b.params):
                if p.grad is not None:
                    p.grad.copy_(b.slot(b.staging, k).view(p.shape))
                elif has[k]:
                    p.grad = b.slot(b.staging, k).view(p.shape)
        b.staging = None

    @torch.no_grad()
    def _flush(self) -> None:
        """Finish the round: pack what the hooks did not (hand-set or missing gradients), reduce every bucket
        not reduced yet, wait for all, and expose the owner's accumulated gradients (ZeRO-2)."""
        self._round = True
        for b in self._red[self._next:]:
            for k in range(len(b.params)):
                if not b.filled[k]:
                    self._pack(b, k)
            self._launch(b)
            while len(self._inflight) > 1:  # one bucket on the wire while the next one is packed
                self._complete(self._inflight.popleft())
        while self._inflight:
            self._complete(self._inflight.popleft())
        for b in self._red:
            b.reset_round()
        self._next = 0
        self._round = False
        if self.partition_grad:
            mine = [b for b in self._red if b.owner == self.rank and b.acc is not None]
            # Params that got a gradient on no rank keep `.grad = None`. The counts are read back (one host sync
            # per device) only for buckets with a param of which this rank packed no gradient itself.
            unsure: dict = {}
            for b in mine:
                if not all(b.seen):
                    unsure.setdefault(b.device, []).append(b)
            has_of = {}
            for bs in unsure.values():
                flags = torch.cat([b.acc[b.numel:].ne(0) for b in bs]).tolist()
                for b in bs:
                    has_of[id(b)], flags = flags[:len(b.params)], flags[len(b.params):]
            for b in mine:
                has = has_of.get(id(b), b.seen)
                for k, p in enumerate(b.params):
                    if not has[k]:
                        continue
                    gidx = b.gidx[k]
                    v = self._views.get(gidx)
                    if v is None or p.grad is not v:
                        v = b.slot(b.acc, k).view(p.shape)
                        self._views[gidx] = v
                        p.grad = v
        else:
            self._synced = True

    def _reduce_grads(self) -> None:
        """Make the gradients averaged (ZeRO-1) / owned and averaged (ZeRO-2), whatever produced them."""
        if self.world_size == 1:
            return
        if self._round:
            self._flush()
        if self.partition_grad:
            P, views = self._params, self._views
            if any(P[i].grad is not None and P[i].grad is not views.get(i) for i in self._managed):
                self._flush()
        elif not self._synced:
            self._flush()

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Every owner sends its updated params, one flat broadcast per bucket; one bucket on the wire while the
        next one is packed, so at most two buckets of temporary memory."""
        if self.world_size == 1:
            return
        q: deque = deque()
        for b in self._bc:
            src = self._ranks[b.owner]
            if len(b.params) == 1 and b.params[0].is_contiguous():
                buf = b.params[0].detach()
                unpack = False
            elif b.owner == self.rank:
                buf = torch.cat([p.detach().reshape(-1) for p in b.params])
                unpack = False
            else:
                buf = torch.empty(b.numel, dtype=b.dtype, device=b.device)
                unpack = True
            q.append((b, buf, unpack, dist.broadcast(buf, src=src, group=self._pg, async_op=True)))
            while len(q) > 1:
                self._finish_broadcast(*q.popleft())
        while q:
            self._finish_broadcast(*q.popleft())

    @staticmethod
    def _finish_broadcast(b: _Bucket, buf: Tensor, unpack: bool, work) -> None:
        work.wait()
        if unpack:
            for k, p in enumerate(b.params):
                p.detach().copy_(b.slot(buf, k).view(p.shape))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the averaged gradients of all ranks (one all-reduce of a scalar;
        each rank measures the params it owns). Returns the total norm; call it on every rank."""
        norm_type = float(norm_type)
        self._reduce_grads()
        grads = [self._params[i].grad for i in self._owned if self._params[i].grad is not None]
        dev = self._params[self._managed[0]].device if self._managed else torch.device("cpu")
        # From every managed param, not the grads this rank owns: all ranks must reduce the same dtype (a rank
        # owning no grad would otherwise send 4 bytes where the others send 8).
        acc_dtype = torch.float64 if any(self._params[i].dtype == torch.float64 for i in self._managed) \
            else torch.float32
        by: dict = {}
        for g in grads:
            by.setdefault((g.device, g.dtype), []).append(g)
        norms = [n.to(device=dev, dtype=acc_dtype) for gs in by.values() for n in torch._foreach_norm(gs, norm_type)]
        if math.isinf(norm_type):
            local = torch.stack(norms).max() if norms else torch.zeros((), dtype=acc_dtype, device=dev)
            if self.world_size > 1:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._pg)
            total = local
        else:
            local = (torch.stack(norms).pow(norm_type).sum() if norms
                     else torch.zeros((), dtype=acc_dtype, device=dev))
            if self.world_size > 1:
                dist.all_reduce(local, group=self._pg)
            total = local.pow(1.0 / norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"{_NAME}.clip_grad_norm_: the total norm of order {norm_type} is non-finite; "
                               "pass error_if_nonfinite=False to clip anyway")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        present = [p.grad for p in self._params if p.grad is not None]  # ZeRO-1: every rank scales its copy
        by = {}
        for g in present:
            by.setdefault((g.device, g.dtype), []).append(g)
        for (device, dtype), gs in by.items():
            torch._foreach_mul_(gs, coef.to(device=device, dtype=dtype))
        return total

    # ---- state_dict --------------------------------------------------------------------------------
    def _local_to_global(self) -> list[int]:
        return [self._gidx[id(p)] for g in self.optim.param_groups for p in g["params"]]

    def state_dict(self, consolidated: bool = False, to: int | None = 0) -> dict | None:
        """This rank's shard (default), or with `consolidated=True` the whole state in the unwrapped optimizer's
        format, gathered (a collective: call it on every rank) to rank `to` of the group, or to every rank with
        `to=None`; other ranks get None. The shard, keyed by the global param index, carries a "zero" entry
        (world size, rank, owner of every param) and reloads only on the same partition. The wrapper's
        `register_state_dict_pre_hook` hooks run first, its post hooks on the dict returned (on the ranks that
        get one), as in torch; the wrapped optimizer's own hooks run on its part."""
        if consolidated and to is not None and not (isinstance(to, int) and 0 <= to < self.world_size):
            raise ValueError(f"{_NAME}.consolidate_state_dict: to={to!r} must be a rank in [0, {self.world_size}) "
                             "or None")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = self._consolidated(to) if consolidated else self._shard()
        if sd is not None:
            for post_hook in self._optimizer_state_dict_post_hooks.values():
                out = post_hook(self, sd)
                if out is not None:
                    sd = out
        return sd

    def _shard(self) -> dict:
        self._push_hyper()
        inner = self.optim.state_dict()
        l2g = self._local_to_global()
        groups = []
        for gi, (g, gw) in enumerate(zip(inner["param_groups"], self.param_groups)):
            full = {k: v for k, v in g.items() if k not in _NOT_HYPER}
            full["params"] = [self._gidx[id(p)] for p in gw["params"]]
            if "param_names" in gw:
                full["param_names"] = list(gw["param_names"])
            groups.append(full)
        out = {k: v for k, v in inner.items() if k not in ("state", "param_groups")}
        out["state"] = {l2g[lid]: st for lid, st in inner["state"].items()}
        out["param_groups"] = groups
        out["zero"] = {"world_size": self.world_size, "rank": self.rank, "owners": list(self._owner)}
        return out

    def consolidate_state_dict(self, to: int | None = 0) -> dict | None:
        """The whole optimizer state as the unwrapped optimizer would save it (CPU tensors), on rank `to`
        (None: every rank); None on the other ranks. Collective. `state_dict(consolidated=True, to=to)`."""
        return self.state_dict(consolidated=True, to=to)

    def _consolidated(self, to: int | None) -> dict | None:
        shard = self._shard()
        shard.pop("zero")
        shard["state"] = {gid: {k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in st.items()}
                          for gid, st in shard["state"].items()}
        if self.world_size == 1:
            parts = [shard["state"]]
        elif to is None:
            parts = [None] * self.world_size
            dist.all_gather_object(parts, shard["state"], group=self._pg)
        else:
            parts = [None] * self.world_size if self.rank == to else None
            dist.gather_object(shard["state"], parts, dst=self._ranks[to], group=self._pg)
            if self.rank != to:
                return None
        merged = {}
        for part in parts:
            merged.update(part)
        shard["state"] = dict(sorted(merged.items()))
        return shard

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state_dict (also one saved by the unwrapped optimizer) or this rank's shard. The
        wrapper's `register_load_state_dict_pre_hook` hooks see (and may replace) a shallow copy of it first, its
        post hooks run once it is loaded, as in torch."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre_hook(self, state_dict)
            if out is not None:
                state_dict = out
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(f"{_NAME}.load_state_dict: expected a dict with 'state' and 'param_groups'")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"{_NAME}.load_state_dict: state_dict has {len(saved)} param groups, this optimizer "
                             f"has {len(self.param_groups)}")
        for gi, (sg, g) in enumerate(zip(saved, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"{_NAME}.load_state_dict: param_groups[{gi}] has {len(sg['params'])} params in "
                                 f"the state_dict, {len(g['params'])} here")
        saved_ids = [pid for sg in saved for pid in sg["params"]]
        state = state_dict["state"]
        zero = state_dict.get("zero")
        owned_saved = {saved_ids[i] for i, r in enumerate(self._owner) if r == self.rank}
        if zero is not None:
            if (zero.get("world_size"), zero.get("rank"), list(zero.get("owners", ()))) != \
                    (self.world_size, self.rank, self._owner):
                raise ValueError(f"{_NAME}.load_state_dict: this shard was saved by rank {zero.get('rank')} of "
                                 f"{zero.get('world_size')} with another partition than rank {self.rank} of "
                                 f"{self.world_size} here; save with state_dict(consolidated=True) to change the "
                                 "world size or the params")
            extra = sorted(set(state) - owned_saved)
            if extra:
                raise ValueError(f"{_NAME}.load_state_dict: the shard holds state of params {extra}, which this "
                                 f"rank does not own")
        unknown = sorted(set(state) - set(saved_ids), key=str)
        if unknown:
            raise ValueError(f"{_NAME}.load_state_dict: state for unknown param ids {unknown}")
        inner_groups = []
        inner_state = {}
        lid = 0
        for gi, (sg, ig) in enumerate(zip(saved, self.optim.param_groups)):
            g = {k: v for k, v in sg.items() if k not in _NOT_HYPER}
            g["params"] = []
            names = []
            for p in ig["params"]:
                gidx = self._gidx[id(p)]
                sid = saved_ids[gidx]
                if sid in state:
                    inner_state[lid] = state[sid]
                g["params"].append(lid)
                if "param_names" in sg:
                    pos = [k for k, q in enumerate(self.param_groups[gi]["params"]) if q is p][0]
                    names.append(sg["param_names"][pos])
                lid += 1
            if "param_names" in sg:
                g["param_names"] = names
            inner_groups.append(g)
        inner = {k: v for k, v in state_dict.items() if k not in ("state", "param_groups", "zero")}
        inner["state"] = inner_state
        inner["param_groups"] = inner_groups
        self.optim.load_state_dict(inner)
        self._pull_hyper()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _end_of_backward(ref):
    def callback():
        z = ref()
        if z is not None and z._round:
            z._flush()
    return callback
