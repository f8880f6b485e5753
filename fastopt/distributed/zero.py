"""ZeroRedundancyOptimizer: ZeRO stages 1 and 2 around any optimizer instance.

The model stays an ordinary module with the same weights on every rank, and each rank trains on its own data
(DDP-style data parallelism without a model wrapper). The wrapper owns the data-parallel communication:

* Partition. A trainable parameter is split when it alone exceeds a fair share of the memory, namely when
  all of these hold: numel > ceil(trainable numel of all the wrapper's params / world); numel >= world * 4096;
  it is contiguous; and the wrapped optimizer steps flat pieces exactly. That last condition covers every
  fastopt optimizer (a `FastOptimizer` with `_supports_layouts`) and torch's element-wise optimizers by exact
  type: SGD, Adam, AdamW, Adamax, NAdam, RAdam, Adagrad, RMSprop (checked in torch 2.13's source: their state
  is per element, or scalars that depend only on the step count). Nothing else ever splits: torch's Adafactor,
  LBFGS, subclasses of torch's optimizers. A split param is cut into `world` contiguous ranges of its
  flattened elements, one per rank in rank order. Boundary r is r * numel / world rounded to the nearest
  multiple of 4096, so every range is non-empty and within 4096 elements of an even share. Because of that
  alignment, 8-bit blocks of any block_size <= 4096 cut the pieces exactly where they cut the whole param:
  8-bit states stay bit-compatible
  with one process, and they consolidate by concatenation. All other params are whole. They go largest first
  to the rank with the fewest elements so far, with each rank's ranges counted (the greedy balance of
  `torch.distributed.optim.ZeroRedundancyOptimizer`), and frozen params weigh nothing. A rank then holds at
  most `total / world + 4096 + (largest whole param)` elements of element-wise state. A whole param's matrix
  statistics (Adafactor's and CAME's factors, Lamb's trust ratio, GaLore's projection, 8-bit blocks) are
  computed by its owner from the whole gradient, as in one process. A split param's statistics are computed
  on the pieces: each piece is declared `declare_shard(piece, p.shape, group, flat_offset=a)`, and the
  optimizer sums the partial statistics over the group with its own collectives, in which every rank takes
  part. State that is whole per param (factors, `step`, GaLore's projection) is kept on every rank.
  Ownership and splits are fixed when a param is added; a param frozen then and unfrozen later stays whole.
* The wrapped optimizer sees only this rank's parameters: its `param_groups` are cut down in place (each group
  keeps its hyperparameters, possibly with no params on this rank), each split param replaced at its place by
  this rank's piece (a leaf `Parameter` viewing the param's storage, `p.view(-1)[a:b]`; its state is keyed by
  the piece, and state made before wrapping is cut to it), and state of other ranks' params is dropped, so its
  state exists for this rank's shard only.
* ZeRO-1 (`partition_grad=False`): gradients are averaged over the group by all-reduce of flat buckets (one
  collective per bucket of at most `bucket_size_mb`). With `overlap_communication=False` this happens in
  `step()`, each all-reduce waited on right after it is launched; with `True` each bucket is all-reduced
  asynchronously as soon as backward has produced all its gradients (DDP's scheme; at most 4 in flight, as
  below), and all are waited on at the end of backward. Every rank keeps full averaged gradients.
* ZeRO-2 (`partition_grad=True`): from post-accumulate-grad hooks, each gradient is copied (divided by the
  world size) into a flat bucket of params that share one owner, and freed (`p.grad = None`) at once; a full
  bucket is reduced to its owner (`dist.reduce`), which adds it into a flat accumulator. With
  `overlap_communication=False` the hook that launched a reduction waits for it before backward goes on
  (nothing on the wire while backward computes; gradients are still freed as they are packed); with `True`
  the reductions run while backward goes on (at most 4 buckets in flight: the oldest is waited on when a fifth
  is launched, which bounds the staging memory). At the end of backward (an autograd callback) all reductions
  are waited on and the owner's params get `.grad` as views of the accumulator; other ranks' params keep
  `.grad = None`. A split param has a bucket of its own. It holds `world` blocks of (chunk + 1) elements, where
  chunk is the longest range: block r holds range r of the gradient and, in its last slot, the "has a
  gradient" count. The bucket is reduce-scattered (`reduce_scatter_single`, or `reduce_scatter_tensor` on torch
  releases without it), so each rank receives only its range summed over the ranks, plus the summed count.
  That is added into the rank's accumulator, the piece gets `.grad` as a view of it, and the param keeps
  `.grad = None` on every rank. With ZeRO-1, the piece's `.grad` is its range of the all-reduced gradient.
* `step()` steps this rank's shard with the wrapped optimizer. Then every owner broadcasts its updated params
  in flat buckets, and each split param is all-gathered from its pieces (one `all_gather_single` per split
  param, ranges padded to the longest; in place, into the param, where its ranges are all alike). All ranks end
  the step with identical weights. `clip_grad_norm_` counts each rank's own params and its range of each split
  param, so every element is counted once.

Gradient accumulation: run several backward passes, then `step()`. ZeRO-1 reduces once, in `step()` (with overlap:
once per backward, an all-reduce of the running sums, which stays exact because the earlier part is already
identical on every rank). ZeRO-2 reduces every backward's fresh gradient into the owner's accumulator; before a
backward adds to an owner's exposed `.grad`, a tensor hook detaches it, so accumulator + fresh gradient is never
counted twice (it is given back at the end of that graph task when no accumulation followed: `torch.autograd.grad`
fires the hook too). Not calling `zero_grad()` between steps accumulates across steps, as in torch. Gradients
cleared without the wrapper (`model.zero_grad()`, as transformers' Trainer does, or `p.grad = None`) are cleared
too: at the start of the next round the owner finds its exposed `.grad` gone (or replaced by hand) and drops that
sum, and a split param's sum (its piece is no module param) is reset when any rank found such a cleared gradient (a
vote carried in the split bucket's reduce-scatter; a model of split params alone must use the wrapper's
`zero_grad()`). Zeroed in place (`model.zero_grad(set_to_none=False)`), the owners' sums are zeroed with their
exposed views; a rank that finds all of its exposed gradients written in place since the last round (their
accumulators' version counters moved) and holding zeros only votes, in the same reduce-scatter, for zeroing the
split params' sums too, which happens when every rank holding an exposed owner's gradient so voted (one rank's
gradients zeroed, or all zero and scaled in place, say by clip_grad_norm_ between micro-batches, are not the
model's; checked on the device, only where split params exist). The wrapper's `clip_grad_norm_` marks no gradient
written: its coefficient is 0 when the total norm is not finite, and the gradients so zeroed on every rank,
carried into the next step's backward after a skipped step, must not zero the split params' sums (one process
keeps their NaN = inf * 0 and skips again). The gradients kept for frozen params (below) vote
as exposed ones, and a frozen split param's kept pieces take the votes in one small all-reduce of their own. The
votes are cast when a round starts: gradients cleared or zeroed through the model after the last backward, with
no backward before the step, leave the split params' sums as they were (the wrapper's `zero_grad()` reaches them).
`add_param_group` between backward and `step()` keeps the sums and reductions made so far.

The wrapper is the data-parallel reduction: a model also wrapped in DistributedDataParallel is refused (at the
first `step()` or `clip_grad_norm_()`, on every rank), as its gradients would be reduced twice and DDP's writes
of its averaged gradients race with the wrapper's (measured: ZeRO-2 37% off, ZeRO-1 with overlap 1.7-5.1% off).
Under ZeRO-2, a gradient written after backward handed it to the wrapper (set by hand after a backward pass) is
refused likewise, instead of being counted on top of it. A second wrapper built over the same params while the
first is alive takes them over (`_CLAIMS`): the first one's hooks stop acting on them, and its `step()` and
`clip_grad_norm_()` are refused (on every rank: all build them in the same order). Sparse gradients are refused.

Like DDP, every rank must run the same sequence: the same backward passes over the same params, and every
`step()`, `clip_grad_norm_()`, consolidated `state_dict()` and `add_param_group()` together. A parameter that
gets no gradient on a rank contributes zeros from that rank. One that gets a gradient on no rank keeps
`.grad = None` and is not stepped, as in one process (torch's optimizers skip it: no state, no weight decay):
every bucket carries one "has a gradient" count per param after its gradients, summed by the same collective,
so this costs no extra communication (the counts are read back to the host only for params without a local
gradient). A gradient zeroed by `zero_grad(set_to_none=False)` still counts, as in torch. Gradients set by
hand instead of by backward are reduced in `step()` (they must be set on every rank). A backward that raises
(on every rank alike) leaves its round open, since no end-of-backward callback runs after an error: the
wrapper's `zero_grad()` waits for the reductions it launched and drops it.

Reentrant activation checkpointing (`checkpoint(..., use_reentrant=True)`, as many fine-tuning recipes set;
transformers 5's default is `use_reentrant=False`) runs one nested backward per checkpointed segment inside the
outer one. The round of reductions ends when the outermost backward does: a hook that fires inside a custom
autograd Function's backward has the end-of-backward callback queued on the outer graph task (by a post-hook on
the outermost such Function's node), not on the nested one, which would reduce every bucket once per segment. A
param used inside and outside a segment, or in two segments, gets its gradient accumulated, and its hook fired,
once per backward that reaches it. Its bucket is reduced once more at the end of the round (ZeRO-1: the running
sum, whose reduced part is already the same on every rank; ZeRO-2: the part accumulated since it was packed), so
the result is exact. Like DDP's `static_graph`, this needs such a param to be accumulated more than once on
every rank alike, as the same model code does. For the same reason ZeRO-1 with overlap waits on its all-reduces
at fixed points only (the oldest when a fifth is in flight, and at the end of backward), never because one
happens to be done: whether a bucket's averages were written into the gradients before such a repeat must not
differ between ranks.

Hyperparameters live in `param_groups` of the wrapper (every param of each group); assigning a key there
(LR schedulers do) sets it in the wrapped optimizer's group at once, and every `step()` copies all keys across.
Without an initialized process group (or with a group of one rank) the wrapper is a pass-through that
communicates nothing.

Freezing or unfreezing params after construction (`requires_grad_`) is noticed at the next `step()` or
`clip_grad_norm_()`. There the buckets and hooks are rebuilt for the params that now require a gradient, and
ZeRO-2's accumulated gradients carry over. A newly unfrozen param's gradient, which no hook saw, is then reduced
like a gradient set by hand, so it is averaged and stepped like the others from its first step on. The change
must be made on every rank alike, before the backward passes of that step. A frozen param is not stepped, even
when it still holds a gradient from before it was frozen (torch's optimizers would step it; here only its owner
could, and no longer managed, it would be neither averaged nor broadcast: the replicas would drift apart).
ZeRO-2 keeps the owner's reduced gradient of a param frozen after its backward as its `.grad` (`_kept`; a split
param's pieces on every rank); unfrozen, it is stepped with it. A backward that reaches it once unfrozen adds this
rank's own gradient into it, the other ranks' arriving alone: the owner's tensor hook (registered on its frozen
params too) first scales the kept sum by the world size, so that it is reduced with the others like a gradient
set by hand, to the sum one process has. Frozen again before the step, such a param's `.grad` is each rank's own
(its owner's with the kept sum so scaled), reduced once it is unfrozen and stepped.

State dicts: the shard (default) holds this rank's params' state and its pieces' state; its "zero" entry records
the owners and the splits, and it reloads on the same partition only. The consolidated state is the unwrapped
optimizer's: a split param's element-wise states (for a FastOptimizer: `_elementwise_keys`, and the absmax of
element-wise 8-bit codes; for torch's optimizers: tensors with the piece's numel) are concatenated in rank
order and reshaped; the others (factors, `step`, GaLore's projection and projected moments) are taken from one
piece. Loading a consolidated or unwrapped state cuts them back into the pieces.

Mixed precision with a loss scale: `ZeroGradScaler`, torch.amp.GradScaler's subclass, whose unscale and inf
check (`_amp_unscale`) complete the reductions, unscale every gradient the rank holds and take the max of the
verdict over the group, so that every rank skips the steps one process skips and keeps the same scale; the wrapped
optimizer takes the verdict on the device where it can (fastopt's, torch's fused ones), else the step is skipped
on the host. `torch.amp.GradScaler` itself is refused: its inf check and step skip are per rank, so ranks could
disagree (the wrapper declares `_step_supports_amp_scaling`, so GradScaler calls `step()` on every rank, and
`step()` raises the same RuntimeError on all of them instead of the ranks that found an inf skipping it while
the others wait in its collectives).

Not supported: optimizers that evaluate the closure several times
per step (LBFGS: the wrapper runs the closure once, then reduces), DTensor params (FSDP / tensor parallelism
shard them already: use the optimizer directly), params declared shards by hand (`declare_shard`) when the
wrapped optimizer is a fastopt one (its pieces would be declared over this group alone; torch's element-wise
optimizers step them exactly; ZeRO over tensor parallelism: the optimizer's `setup_distributed`), and params
of one group spread over devices whose backward hooks run in different threads, and
`torch.distributed.algorithms.Join` (uneven inputs: refused by `join_hook`).
"""
from __future__ import annotations

import contextlib
import inspect
import math
import sys
import weakref
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .. import checkpoint as ckpt
from .layout import collective, eager_under_compile, layout_of, param_meta

__all__ = ["ZeroRedundancyOptimizer", "ZeroGradScaler"]

_NAME = "ZeroRedundancyOptimizer"
# param -> weakref of the newest wrapper built over it: an older wrapper still alive over the same params (a
# notebook cell run twice, a scheduler holding it) leaves them alone, and refuses to step.
_CLAIMS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_NOT_HYPER = ("params", "param_names")
# A split param's ranges start at multiples of this many elements: every 8-bit block size (a power of two up to
# 4096) then cuts the pieces into the blocks of the whole param.
_ALIGN = 4096
# With overlap_communication, at most this many buckets on the wire during backward: each holds a bucket-sized
# staging buffer until it is waited on, and some backends never report completion before a wait (gloo's
# reduce_scatter_tensor), so the oldest is waited on when one more is launched (on CUDA a wait only orders streams).
_MAX_INFLIGHT = 4
# torch's optimizers whose math is element-wise (checked in torch 2.13's source: no norm, sum or mean over a
# param; scalars such as `step` and NAdam's `mu_product` depend on the step count alone), by exact type.
_ELEMENTWISE_TORCH = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop")


def _split_bounds(n: int, world: int) -> tuple[int, ...]:
    """Range boundaries of a param of n >= world * _ALIGN elements: r * n / world rounded to the nearest
    multiple of _ALIGN. Strictly increasing (consecutive targets are >= _ALIGN apart) and below n, so no range
    is empty; each range is within _ALIGN elements of n / world."""
    inner = [(2 * r * n + world * _ALIGN) // (2 * world * _ALIGN) * _ALIGN for r in range(1, world)]
    return tuple([0] + inner + [n])


def _sparse_message(i: int, p: Tensor, g: Tensor) -> str:
    return (f"{_NAME}: param #{i} {tuple(p.shape)} (the wrapper's order) has a {g.layout} gradient "
            "(nn.Embedding(sparse=True)?); the wrapper averages dense gradients: make it dense (sparse=False)")


def _can_split(optimizer) -> bool:
    """Whether `optimizer` steps a flat piece of a param exactly as the whole: a FastOptimizer that takes
    layouts (its whole-tensor statistics are summed over the group of the pieces), or one of torch's
    element-wise optimizers by exact type (a subclass may change the math)."""
    from ..optim.base import FastOptimizer
    if isinstance(optimizer, FastOptimizer):
        return bool(optimizer._supports_layouts)
    return any(type(optimizer) is getattr(torch.optim, n, None) for n in _ELEMENTWISE_TORCH)


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
    the current accumulator (its count is then known to be > 0 without reading it back).

    A split bucket (ZeRO-2, one split param, `bounds` its ranges): `staging` holds world blocks of (chunk + 4)
    elements, chunk the longest range; block r holds range r of the gradient, a count, two votes, set where
    the rank found since the last round (`_begin_round`) the owners' gradients cleared (1: `model.zero_grad()`)
    or zeroed in place (1: `model.zero_grad(set_to_none=False)`), and 1 where the rank holds an owner's exposed
    gradient (its zeroed vote counts). It is reduce-scattered into `recv` (chunk + 4 elements: this rank's range,
    padded, and the count, the votes and the voters summed over the ranks); `acc` (chunk + 1) is reset when any
    rank voted cleared, its sum (not its count: a zeroed gradient still counts) when every voter voted zeroed,
    and `recv`'s first chunk + 1 are added into it; `numel` is chunk, so `acc[numel:]` is the count as above.
    `version`: `acc`'s version counter when the round that last added into it ended (or when `_rebuild` filled
    it)."""

    __slots__ = ("params", "gidx", "offsets", "numel", "size", "owner", "device", "dtype",
                 "staging", "filled", "pending", "acc", "seen", "work", "bounds", "recv", "again", "version",
                 "packed")

    def __init__(self, gidx: list[int], params: list[Tensor], owner: int | None, bounds: tuple | None = None):
        self.params = params
        self.gidx = gidx
        self.owner = owner
        self.bounds = bounds
        self.recv = None
        self.offsets = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.size = n + len(params)
        if bounds is not None:
            chunk = max(b - a for a, b in zip(bounds, bounds[1:]))
            self.numel = chunk
            self.size = (len(bounds) - 1) * (chunk + 4)
        self.device = params[0].device
        self.dtype = params[0].dtype
        self.staging: Tensor | None = None
        self.filled = [False] * len(params)
        self.pending = len(params)
        self.acc: Tensor | None = None
        self.seen = [False] * len(params)
        self.work = None
        self.again = False  # a param's hook fired again in this round: the bucket is reduced a second time
        self.version = None
        self.packed = False  # a split param's: this rank packed a gradient in the current round

    def slot(self, buf: Tensor, k: int) -> Tensor:
        p = self.params[k]
        return buf[self.offsets[k]:self.offsets[k] + p.numel()]

    def counts(self, buf: Tensor) -> list[bool]:
        """Per param: did any rank contribute a gradient to `buf` (a host sync on an accelerator)."""
        return buf[self.numel:].ne(0).tolist()

    def reset_round(self) -> None:
        self.staging = None
        self.recv = None
        self.filled = [False] * len(self.params)
        self.pending = len(self.params)
        self.work = None
        self.again = False


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
            "world_size", "_ranks", "_params", "_owner", "_loads", "_inv_world", "_synced", "_split", "_pieces")


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


def _same(a, b) -> bool:
    """Whether two hyperparameter values are the same: tensors by identity (no host read), others by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # values without a truth value for ==
        return a is b


def _hook_post(ref, gidx):
    def hook(_p):
        z = ref()
        if z is not None and gidx not in z._lost:
            z._on_grad(gidx)
    return hook


def _hook_pre(ref, gidx):
    # A pickled param leaves its hooks behind, as it should: the copy belongs to no wrapper, and an unpickled
    # wrapper registers its own. Marked so, torch's pickling of a plain-tensor param does not warn about it.
    @torch.utils.hooks.unserializable_hook
    def hook(_grad):
        z = ref()
        if z is not None and gidx not in z._lost:
            z._detach_exposed(gidx)
    return hook


@contextlib.contextmanager
def _hookable(p: Tensor):
    """Let a hook be registered on a frozen param: torch refuses one on a tensor that does not require a gradient,
    but keeps one registered on it before, which fires again once it is unfrozen. Yields False for a param that
    torch refuses to mark as requiring a gradient (an integer one, an inference tensor outside inference mode): it
    can never be unfrozen, and needs no hook."""
    frozen = not p.requires_grad
    if frozen:
        try:
            p.requires_grad_(True)
        except RuntimeError:  # refused: torch's own error, nothing set
            yield False
            return
    try:
        yield True
    finally:
        if frozen:
            p.requires_grad_(False)


def _hook_mark(ref, gidx):
    def hook(_p):
        z = ref()
        if z is not None and gidx not in z._lost:
            z._synced = False
    return hook


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2 data parallelism around any optimizer instance (details: this module's docstring).

    Args:
        optimizer: a constructed `torch.optim.Optimizer` over all of the model's params (any fastopt optimizer,
            torch's AdamW or SGD, ...). It is cut down in place to this rank's params: use the wrapper from now on.
        process_group: the data-parallel group (default: the default group; without an initialized process
            group the wrapper runs as a single rank; built so, it refuses to step once a default group of
            several ranks exists: build it after `init_process_group`).
        partition_grad: False for ZeRO-1 (optimizer state sharded, gradients all-reduced), True for ZeRO-2
            (gradients reduced to their owner during backward and freed on the other ranks).
        overlap_communication: ZeRO-1: all-reduce gradient buckets asynchronously during backward instead of in
            `step()`. ZeRO-2 (which always reduces from backward's hooks): let the reductions run asynchronously
            while backward goes on, instead of waiting for each one in the hook that launched it.
        bucket_size_mb: upper bound of one flat communication bucket, in MiB.
        optimizer_class, **defaults: torch's form, `ZeroRedundancyOptimizer(params, optimizer_class=AdamW,
            lr=...)`: `optimizer` is then the params, and the optimizer is `optimizer_class(params, **defaults)`.
        parameters_as_bucket_view: accepted for torch's signature (a memory layout there; it changes no result).
        overlap_with_ddp: torch's DDP-hook mode; only False (this wrapper reduces the gradients itself:
            `overlap_communication`).

    Construction is collective: it checks that every rank passes the same params (count, shapes, dtypes and
    values) and the same hyperparameters (all but tensor values; `add_param_group` checks its group too), and
    raises the same `ValueError` on every rank when they differ.

    Partition. A trainable param p is split when all of these hold: p.numel() > ceil(T / world), where T is the
    trainable numel of all the wrapper's params; p.numel() >= world * 4096; p is contiguous; and the optimizer
    is a fastopt optimizer or torch's SGD, Adam, AdamW, Adamax, NAdam, RAdam, Adagrad or RMSprop (exact type;
    anything else never splits). Rank r then steps elements [b_r, b_{r+1}) of p.view(-1), where b_r is
    r * numel / world rounded to the nearest multiple of 4096. That range is never empty and is within 4096
    elements of an even share. Every other param is owned whole by one rank (greedy balance, largest first).
    `self._split` maps the index of each split param to its boundaries. `self._owner[i]` is the owner of
    whole param i, or -1 for a split param.
    """

    # GradScaler then sets `grad_scale` / `found_inf` and calls step() on every rank, which takes them from
    # ZeroGradScaler (whose inf check is every rank's) and refuses them alike otherwise (without it, GradScaler
    # would skip step() on the ranks that found an inf: the others would hang).
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, process_group=None, partition_grad: bool = False,
                 overlap_communication: bool = False, bucket_size_mb: float = 25, *, optimizer_class=None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults):
        if isinstance(process_group, type):
            raise TypeError(f"{_NAME}: process_group={process_group.__name__} is a class; torch's form takes it by "
                            f"keyword: {_NAME}(params, optimizer_class={process_group.__name__}, **hyperparameters)")
        if overlap_with_ddp:
            raise ValueError(f"{_NAME}: overlap_with_ddp=True (torch's DDP communication hook) is not supported: "
                             "this wrapper reduces the gradients itself (no DDP), overlapped with backward by "
                             "overlap_communication=True")
        if optimizer_class is not None:
            # torch's form: the params and the class with its hyperparameters. parameters_as_bucket_view, a
            # memory layout of torch's, changes no result: the communication here is bucketed either way.
            if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
                raise TypeError(f"{_NAME}: optimizer_class={optimizer_class!r} must be a torch.optim.Optimizer "
                                "subclass")
            if isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"{_NAME}: pass either an optimizer instance or params with optimizer_class, "
                                "not both")
            optimizer = optimizer_class(optimizer, **defaults)
        elif defaults:
            raise TypeError(f"{_NAME}: unexpected keyword arguments {sorted(defaults)}: hyperparameters go to the "
                            f"optimizer, {_NAME}(fastopt.Adafactor(params, ...)), or with torch's form to "
                            f"{_NAME}(params, optimizer_class=..., **hyperparameters)")
        if isinstance(optimizer, type):
            raise TypeError(f"{_NAME}: optimizer={optimizer.__name__} is a class; pass an instance, e.g. "
                            f"{_NAME}({optimizer.__name__}(model.parameters(), ...)), or torch's form "
                            f"{_NAME}(model.parameters(), optimizer_class={optimizer.__name__}, ...)")
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
        self._check_params(params, optimizer)
        if self.world_size > 1:
            self._check_replicas(params, optimizer, [len(g["params"]) for g in optimizer.param_groups],
                                 optimizer.param_groups)

        self._params: list[Tensor] = []
        self._gidx: dict[int, int] = {}
        self._owner: list[int] = []
        self._loads = [0] * self.world_size
        self._split: dict[int, tuple[int, ...]] = {}  # param index -> range boundaries (world + 1)
        self._pieces: dict[int, Tensor] = {}  # param index -> this rank's piece of a split param
        self._piece_gidx: dict[int, int] = {}  # id(piece) -> param index
        self._assign(params, self.world_size > 1 and _can_split(optimizer))

        self.optim = optimizer
        self._initialized = False
        groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        self.param_groups = [self._wrap_group(g, i) for i, g in enumerate(self.param_groups)]
        self._initialized = True
        for gi in range(len(optimizer.param_groups)):
            self._restrict_inner_group(gi)
        owned = {id(p) for p, r in zip(self._params, self._owner) if r == self.rank}
        owned |= set(self._piece_gidx)
        for p in [k for k in optimizer.state if isinstance(k, Tensor) and id(k) not in owned]:
            del optimizer.state[p]

        self._inv_world = 1.0 / self.world_size
        self._synced = False
        self._handles: list = []
        self._lost: set = set()  # params a newer wrapper took over (`_claim`)
        self._kept: dict[int, Tensor] = {}  # ZeRO-2: frozen params' reduced gradients, kept by a rebuild
        self._kept_ver: dict[int, int] = {}  # ... their version counters when kept or at the last round's end
        self._unkept: dict = {}  # ... taken by a backward that reached them since (`_detach_exposed`)
        self._build()
        self._claim(self._params)

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

    def _check_params(self, params: list[Tensor], optimizer) -> None:
        from ..optim.base import FastOptimizer
        dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no param can be a DTensor
        fast = isinstance(optimizer, FastOptimizer)  # element-wise torch optimizers step any piece exactly
        for i, p in enumerate(params):
            if dtensor is not None and isinstance(p, dtensor.DTensor):
                raise ValueError(f"{_NAME}: param {i} is a DTensor (already sharded by FSDP or tensor "
                                 "parallelism); use the optimizer without this wrapper")
            if fast and layout_of(p, owner=_NAME) is not None:  # its pieces would be declared over this group
                raise ValueError(f"{_NAME}: param {i} is declared a shard of a larger tensor "
                                 f"(fastopt.distributed.declare_shard); wrapping {type(optimizer).__name__}, the "
                                 "wrapper partitions whole params: use the optimizer without it, or its "
                                 "setup_distributed for ZeRO over tensor parallelism")
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

    def _check_replicas(self, params: list[Tensor], optimizer, group_sizes: list[int], groups: list[dict],
                        first: int = 0) -> None:
        """Same params on every rank (count, groups, shapes, dtypes, values) and the same hyperparameters in
        `groups` (all but tensor values; `first`: the index of groups[0]), else ValueError on every rank."""
        meta = (type(optimizer).__name__, group_sizes,
                [(tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for p in params],
                [sorted((k, repr(v)) for k, v in g.items() if k not in _NOT_HYPER and not isinstance(v, Tensor))
                 for g in groups])
        metas: list = [None] * self.world_size
        dist.all_gather_object(metas, meta, group=self._pg)
        for r, m in enumerate(metas):
            if m == meta:
                continue
            if m[:3] == meta[:3]:
                gi, (k, v), (_, mine) = next((gi, a, b) for gi, (x, y) in enumerate(zip(m[3], meta[3]))
                                             for a, b in zip(x, y) if a != b)
                raise ValueError(f"{_NAME}: param_groups[{first + gi}][{k!r}] is {v} on rank {r} and {mine} on rank "
                                 f"{self.rank}: every rank must step with the same hyperparameters")
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

    def _assign(self, params: list[Tensor], splittable: bool = False) -> None:
        """Append `params`; split those that would unbalance memory (`splittable`: the wrapped optimizer steps
        flat pieces exactly; the rule is in the class docstring), give each other one an owner: largest first,
        to the rank with the fewest elements (split params' ranges counted)."""
        split = self.__dict__.setdefault("_split", {})
        base = len(self._params)
        first: dict[int, int] = {}
        for k, p in enumerate(params):  # before anything changes
            j = self._gidx.get(id(p), first.get(id(p)))
            if j is not None:
                where = f"param {j}" if id(p) in self._gidx else f"its params[{j}]"
                raise ValueError(f"{_NAME}: a param appears twice: the group's params[{k}] is {where} already")
            first[id(p)] = k
        for k, p in enumerate(params):
            self._gidx[id(p)] = base + k
            self._params.append(p)
            self._owner.append(-1)
        meta = self.__dict__.setdefault("_meta", [])
        if len(meta) == base:  # each param's dtype, shape and device as given (_check_param_storage)
            meta.extend(map(param_meta, params))
        # A frozen param weighs nothing (it has no state): counting it could leave a rank without trainable ones.
        weight = lambda i: self._params[i].numel() if self._params[i].requires_grad else 0  # noqa: E731
        world = self.world_size
        fair = -(-sum(weight(i) for i in range(len(self._params))) // world)
        rest = []
        for i in range(base, len(self._params)):
            p = self._params[i]
            if splittable and weight(i) > fair and weight(i) >= world * _ALIGN and p.is_contiguous():
                split[i] = _split_bounds(p.numel(), world)
                for r in range(world):
                    self._loads[r] += split[i][r + 1] - split[i][r]
            else:
                rest.append(i)
        for i in sorted(rest, key=lambda i: (-weight(i), i)):
            r = min(range(world), key=lambda r: (self._loads[r], r))
            self._owner[i] = r
            self._loads[r] += weight(i)

    def _wrap_group(self, group: dict, index: int) -> _Group:
        g = _Group(group)
        g._inner = self.optim
        g._index = index
        return g

    def _restrict_inner_group(self, gi: int) -> None:
        """The wrapped optimizer's group `gi` cut to this rank's params, each split param replaced (in place)
        by this rank's piece; state it already holds for a split param is cut to the piece."""
        g = self.optim.param_groups[gi]
        keep = [k for k, p in enumerate(g["params"]) if self._owner[self._gidx[id(p)]] == self.rank
                or self._gidx[id(p)] in self._split]
        if "param_names" in g:
            g["param_names"] = [g["param_names"][k] for k in keep]
        params = []
        for k in keep:
            p = g["params"][k]
            i = self._gidx[id(p)]
            if i in self._split:
                piece = self._make_piece(i)
                st = self.optim.state.get(p)
                if st:  # state made before wrapping (torch's Adagrad makes it in its constructor)
                    self.optim.state[piece] = self._cut_state(i, st, g)
                p = piece
            params.append(p)
        g["params"] = params

    def _range(self, i: int) -> tuple[int, int]:
        bounds = self._split[i]
        return bounds[self.rank], bounds[self.rank + 1]

    def _make_piece(self, i: int) -> Tensor:
        """This rank's piece of split param i: a leaf viewing the param's storage (the step writes into the
        param), declared a flat shard over the process group for a FastOptimizer."""
        p = self._params[i]
        a, b = self._range(i)
        piece = torch.nn.Parameter(p.detach().view(-1)[a:b], requires_grad=p.requires_grad)
        self._declare(piece, i)
        self._pieces[i] = piece
        self._piece_gidx[id(piece)] = i
        return piece

    def _declare(self, piece: Tensor, i: int) -> None:
        from ..optim.base import FastOptimizer
        if isinstance(self.optim, FastOptimizer):
            from .layout import declare_shard
            declare_shard(piece, tuple(self._params[i].shape), self._pg, flat_offset=self._range(i)[0])

    # ---- a split param's state: cut from the whole one, merged from the pieces -------------------------
    def _state_kinds(self, group: dict):
        """(element-wise keys, {absmax key: block size} of element-wise 8-bit codes) of a FastOptimizer's
        group; None for torch's element-wise optimizers (a state with the piece's numel is element-wise)."""
        from ..optim.base import FastOptimizer
        if not isinstance(self.optim, FastOptimizer):
            return None
        elem = set(self.optim._elementwise_keys(group))
        absmax = {akey: block for key, (akey, _signed, block) in self.optim._quantized_keys(group).items()
                  if key in elem}
        return elem, absmax

    def _cut_state(self, i: int, st: dict, group: dict, where: str = "state") -> dict:
        """The state of this rank's piece of split param i, from the whole param's state `st` (copies: the
        whole state is not kept alive). Element-wise states (and the absmax of element-wise 8-bit codes,
        whose blocks the 4096-aligned ranges cut exactly) are cut; the others are the same on every piece."""
        p = self._params[i]
        a, b = self._range(i)
        kinds = self._state_kinds(group)
        out = {}
        for k, v in st.items():
            if isinstance(v, dict) and kinds is not None and k in kinds[0] and \
                    isinstance(v.get(ckpt.DEQUANTIZED), Tensor):  # 8-bit state, dequantized: element-wise values
                vals = v[ckpt.DEQUANTIZED]
                if vals.numel() != p.numel():
                    raise ValueError(f"{_NAME}.load_state_dict: {where}[{k!r}].{ckpt.DEQUANTIZED} has shape "
                                     f"{tuple(vals.shape)}, expected {tuple(p.shape)} (the whole param, which is "
                                     "split over the ranks)")
                out[k] = {**v, ckpt.DEQUANTIZED: vals.reshape(-1)[a:b].clone()}
                continue
            if not isinstance(v, Tensor):
                out[k] = v
                continue
            if kinds is None:
                elem, block = v.dim() > 0 and v.numel() == p.numel(), None
            else:
                elem, block = k in kinds[0], kinds[1].get(k)
            if block is not None:
                nb = -(-p.numel() // block)
                if v.numel() != nb:
                    raise ValueError(f"{_NAME}.load_state_dict: {where}[{k!r}] has {v.numel()} blocks, expected "
                                     f"{nb} (blocks of {block} of the whole param of shape {tuple(p.shape)})")
                out[k] = v.reshape(-1)[a // block:-(-b // block)].clone()
            elif elem:
                if v.numel() != p.numel():
                    raise ValueError(f"{_NAME}.load_state_dict: {where}[{k!r}] has shape {tuple(v.shape)}, expected "
                                     f"{tuple(p.shape)} (the whole param, which is split over the ranks)")
                out[k] = v.reshape(-1)[a:b].clone()
            else:
                out[k] = v
        return out

    def _merge_states(self, i: int, states: list[dict], group: dict) -> dict:
        """The whole param's state from its pieces' states, in rank order: element-wise states (and their
        absmax) concatenated, the others (the same on every piece) taken once."""
        p = self._params[i]
        bounds = self._split[i]
        kinds = self._state_kinds(group)
        out = {}
        for k, v in states[0].items():
            if isinstance(v, dict) and kinds is not None and k in kinds[0]:  # 8-bit state, dequantized
                out[k] = {ckpt.DEQUANTIZED: torch.cat([s[k][ckpt.DEQUANTIZED].reshape(-1) for s in states])
                          .view(p.shape)}
                continue
            if not isinstance(v, Tensor):
                out[k] = v
                continue
            if kinds is None:
                elem, block = v.dim() > 0 and v.numel() == bounds[1] - bounds[0], None
            else:
                elem, block = k in kinds[0], kinds[1].get(k)
            if block is not None:
                out[k] = torch.cat([s[k].reshape(-1) for s in states])
            elif elem:
                out[k] = torch.cat([s[k].reshape(-1) for s in states]).view(p.shape)
            else:
                out[k] = v
        return out

    def _build(self, requires: list[bool] | None = None) -> None:
        """Buckets and hooks for the current params (called again by add_param_group); `requires`: the
        requires_grad pattern to build for, the params' own by default (a copy's: its original's at its last
        build, so that its buckets are the original's and a freeze since is noticed at its next step)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        P = self._params
        self._requires = list(requires) if requires is not None else [p.requires_grad for p in P]
        managed = [i for i, r in enumerate(self._requires) if r and P[i].numel() > 0]
        self._managed = managed
        self._owned = [i for i in managed if self._owner[i] == self.rank]
        self._gathered = [i for i in managed if i in self._split]  # split params: all-gathered after the step
        self._group_of = {self._gidx[id(p)]: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self._views: dict[int, Tensor] = {}
        self._consumed: set = set()  # ZeRO-2: params whose gradient a hook took since the last step
        self._stashed: dict[int, Tensor] = {}  # ZeRO-2: owners' views a tensor hook took away (`_detach_exposed`)
        self._give_back_queued = False  # a callback gives them back at the end of the graph task (`_give_back`)
        self._cleared = False  # ZeRO-2: this round found an owner's gradient cleared (`_begin_round`)
        self._zeroed: Any = False  # ZeRO-2: ... or every exposed one zeroed in place (a device bool)
        self._eligible: Any = False  # ZeRO-2: this rank holds an exposed owner's gradient (its zeroed vote counts)
        self._carried = None  # ZeRO-2: (cleared, zeroed, eligible) votes a rebuild took over (`_rebuild`)
        self._ddp_checked = False  # looked for a DDP module over these params (at the next step)
        self._next = 0
        self._round = False
        self._late: set = set()  # ZeRO-1: params accumulated again after their bucket was launched (`_again`)
        self._inflight: deque = deque()
        by_key: dict = {}
        red = []
        for i in managed:
            if self.partition_grad and i in self._split:  # reduce-scattered: a bucket of its own
                red.append(_Bucket([i], [P[i]], self.rank, self._split[i]))
                continue
            key = (P[i].device, P[i].dtype)
            if self.partition_grad:
                key = (self._owner[i],) + key
            by_key.setdefault(key, []).append(i)
        # Gradient buckets in the order backward fills them (roughly reverse registration order, as DDP).
        for key, idx in by_key.items():
            for chunk in _chunks(idx[::-1], P, self._cap):
                red.append(_Bucket(chunk, [P[i] for i in chunk], key[0] if self.partition_grad else None))
        red.sort(key=lambda b: -max(b.gidx))
        self._red = red
        self._slot = {i: (b, k) for b in red for k, i in enumerate(b.gidx)}
        bc: dict = {}
        for i in managed:
            if i not in self._split:
                bc.setdefault((self._owner[i], P[i].device, P[i].dtype), []).append(i)
        self._bc = [_Bucket(chunk, [P[i] for i in chunk], key[0])
                    for key, idx in sorted(bc.items(), key=lambda kv: kv[1][0])
                    for chunk in _chunks(idx, P, self._cap)]
        if self.world_size == 1:
            return
        ref = weakref.ref(self)
        hooks_reduce = self.partition_grad or self.overlap_communication
        for i, p in enumerate(P):
            # Frozen since the build copied (a copy's: built for its original's pattern), hooked alike: unfrozen
            # before a backward, its gradients take the way the original's do. The owner's tensor hook goes on its
            # frozen whole params too: it finds a kept gradient reached by a backward (`_detach_exposed`).
            pre = self.partition_grad and self._owner[i] == self.rank and i not in self._split and p.numel() > 0
            if i not in self._slot and not pre:
                continue
            with _hookable(p) as hookable:
                if not hookable:
                    continue
                if i in self._slot:
                    hook = _hook_post if hooks_reduce else _hook_mark
                    self._handles.append(p.register_post_accumulate_grad_hook(hook(ref, i)))
                if pre:
                    self._handles.append(p.register_hook(_hook_pre(ref, i)))

    def __del__(self):
        for h in getattr(self, "_handles", ()):
            h.remove()

    def __getstate__(self) -> dict:
        state = {k: self.__dict__[k] for k in _PICKLED}
        state["param_groups"] = [dict(g) for g in self.param_groups]
        state["_pg"] = _SharedGroup(self._pg)
        state["_accs"] = [(b.acc, list(b.seen)) for b in self._red]  # ZeRO-2: gradients summed so far
        state["_requires"] = list(self._requires)  # what the buckets were built for (params frozen since too)
        # Whether each accumulator was written in place since its round ended (`_zeroed_vote`): a copied tensor's
        # version counter starts afresh, so the copy is told, not the counter.
        state["_moved"] = [None if b.version is None or b.acc is None else b.acc._version != b.version
                           for b in self._red]
        cleared = set(self._cleared_views()) if self.partition_grad else set()
        state["_exposed"] = sorted(set(self._views) - cleared)
        state["_dropped"] = sorted(cleared)  # cleared by hand since exposed: the copy drops their sums
        state["_carried"] = self._pending_votes()
        state["_kept"] = {i: v for i, v in self._kept.items() if self._holder(i).grad is v}
        state["_kept_moved"] = {i: v._version != self._kept_ver.get(i) for i, v in state["_kept"].items()}
        return state

    def __setstate__(self, state: dict) -> None:
        """A deepcopy or unpickled copy: the wrapped optimizer's copy, over the copied params, with buckets and
        hooks of its own (on the same process group, for a deepcopy)."""
        state = dict(state)
        pg = state.pop("_pg").pg
        accs, exposed, dropped = state.pop("_accs"), state.pop("_exposed"), state.pop("_dropped", [])
        carried = state.pop("_carried", None)
        state_requires = state.pop("_requires", None)
        moved_since = state.pop("_moved", None)
        self._kept = state.pop("_kept", {})
        moved = state.pop("_kept_moved", {})
        self._kept_ver = {i: -1 if moved.get(i, True) else v._version for i, v in self._kept.items()}
        self._unkept = {}
        differentiable = "differentiable" in state["defaults"]
        self.__dict__["_initialized"] = False
        super().__setstate__(state)  # torch's: its hook registries (empty, as in a copy of a torch optimizer)
        if not differentiable:  # torch adds it to the defaults, shared with the wrapped optimizer
            self.defaults.pop("differentiable", None)
        self._pg = pg
        self._gidx = {id(p): i for i, p in enumerate(self._params)}
        self._piece_gidx = {id(q): i for i, q in self._pieces.items()}
        # A copied piece has storage of its own (Parameter's deepcopy clones): view the copied param again. Its
        # declaration came along with the wrapped optimizer's copy (FastOptimizer.__getstate__).
        for i, q in self._pieces.items():
            a, b = self._range(i)
            q.data = self._params[i].detach().view(-1)[a:b]
        self.param_groups = [self._wrap_group(g, i) for i, g in enumerate(self.param_groups)]
        self._initialized = True
        self._handles = []
        self._lost = set()
        # The same buckets, in the same order: built for the requires_grad pattern of the original's buckets, not
        # the params' now (a param frozen or unfrozen since is noticed at the copy's next step, as at the
        # original's: built for the new pattern, the accumulators and views below landed in other buckets).
        self._build(state_requires)
        for b, (acc, seen), moved in zip(self._red, accs, moved_since or [None] * len(accs)):
            b.acc, b.seen = acc, seen
            if moved is not None:  # as the original's: unwritten since the round (its counter), or written (-1)
                b.version = -1 if moved else acc._version
        for gidx in dropped:
            self._drop_sum(gidx)
        for gidx in exposed:  # the owner's .grad: a view of the accumulator again, not a copy of one
            self._expose(gidx)
        for gidx, v in self._kept.items():  # a frozen param's kept gradient (a Parameter's copy has none)
            self._holder(gidx).grad = v
        self._carried = carried
        self._claim(self._params)

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

    @property
    def process_group(self):
        """The data-parallel group (None without an initialized process group), as torch's wrapper names it."""
        return self._pg

    def join_hook(self, **kwargs):
        """torch.distributed.algorithms.Join (uneven inputs) is not supported: refused when a Join is built."""
        raise NotImplementedError(
            f"{_NAME} does not support torch.distributed.algorithms.Join: its gradient reductions run from "
            "backward's hooks and in step(), and a joined rank would have to stand in for each of them; give "
            "every rank the same number of batches (e.g. DistributedSampler(drop_last=True))")

    def add_param_group(self, param_group: dict) -> None:
        """Add a group on every rank (collective after construction): its params are partitioned like the rest."""
        if not getattr(self, "_initialized", False):
            super().add_param_group(param_group)
            return
        params = param_group["params"]
        if isinstance(params, set):  # torch refuses it too: a set's order may differ between ranks
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                            "tensors in sets will change between runs. Please use a list instead.")
        params = [params] if isinstance(params, Tensor) else list(params)
        self._check_params(params, self.optim)
        if self.world_size > 1:
            self._check_replicas(params, self.optim, [len(params)], [param_group], len(self.param_groups))
        # What _assign and the two add_param_group change, put back if either refuses the group (the wrapped
        # optimizer checks its hyperparameters there; torch's, that every param is a leaf): nothing stays changed,
        # and the group can be added again once corrected. Each rank refuses the same group the same way.
        base, loads, groups = len(self._params), list(self._loads), len(self.param_groups)
        split = dict(self._split)
        try:
            self._assign(params, self.world_size > 1 and _can_split(self.optim))
            super().add_param_group({**param_group, "params": params})
            gi = len(self.param_groups) - 1
            full = self.param_groups[gi]
            self.optim.add_param_group({**full, "params": list(full["params"])})
        except BaseException:
            for p in self._params[base:]:
                self._gidx.pop(id(p), None)
            del self._params[base:], self._owner[base:], self.param_groups[groups:]
            self._loads[:] = loads
            self._split.clear()
            self._split.update(split)
            raise
        self.__dict__.pop("_held", None)  # a consolidated state_dict held for state_dict() is stale from now on
        self._restrict_inner_group(gi)
        self.param_groups[gi] = self._wrap_group(full, gi)
        self._rebuild()  # carries ZeRO-2's sums and views over, and redoes ZeRO-1's reduction
        self._claim(params)

    def _push_hyper(self) -> None:
        """The wrapper's hyperparameters into the wrapped optimizer's groups; one set there directly since the
        last step (an LR scheduler built on the wrapped optimizer: the wrapper's groups would overwrite it) is
        refused, naming it."""
        seen = self.__dict__.get("_hyper_seen", [])
        for gi_, (gw, gi, last) in enumerate(zip(self.param_groups, self.optim.param_groups, seen)):
            for k, v in gi.items():
                if k in _NOT_HYPER or k not in last or _same(v, last[k]) or _same(v, gw.get(k)):
                    continue
                raise ValueError(f"{_NAME}: the wrapped optimizer's param_groups[{gi_}][{k!r}] was set to {v!r} "
                                 f"since the last step, and the wrapper's param_groups[{gi_}][{k!r}] is "
                                 f"{gw.get(k)!r}: the wrapper's groups drive the wrapped optimizer (their values are "
                                 "copied into it at every step), so build LR schedulers on the wrapper, and set "
                                 "hyperparameters in its param_groups")
        for gw, gi in zip(self.param_groups, self.optim.param_groups):
            for k, v in gw.items():
                if k not in _NOT_HYPER:
                    gi[k] = v

    def _pull_hyper(self) -> None:
        for gw, gi in zip(self.param_groups, self.optim.param_groups):
            for k, v in gi.items():
                if k not in _NOT_HYPER:
                    dict.__setitem__(gw, k, v)
        self._hyper_seen = [{k: v for k, v in gi.items() if k not in _NOT_HYPER} for gi in self.optim.param_groups]

    @eager_under_compile  # eager under torch.compile, like the wrapped optimizer's step (collectives, hooks)
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs):
        """The optimizer step on this rank's params and pieces, then the params' broadcast (collective).
        `closure` runs once, before the reductions; `kwargs` go to the wrapped optimizer's step, as in torch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        amp = self._take_amp()
        try:
            stepped = self._step_shard(amp, kwargs)
        except BaseException:
            if amp is not None:  # GradScaler deletes them after a step that returns
                self.__dict__.pop("grad_scale", None)
                self.__dict__.pop("found_inf", None)
            raise
        self.__dict__.pop("_held", None)  # a consolidated state_dict held for state_dict() is stale from now on
        self._pull_hyper()
        if stepped:  # a step ZeroGradScaler skipped on the host skipped it on every rank: no param changed
            self._broadcast_params()
            self._gather_split()
        return loss

    def _step_shard(self, amp: tuple | None, kwargs: dict) -> bool:
        """step()'s reductions and the wrapped optimizer's step of this rank's shard (`_step_inner`)."""
        from ..optim.base import FastOptimizer
        self._push_hyper()
        if isinstance(self.optim, FastOptimizer):  # a refused step leaves the gradients as they were
            self.optim._check_groups()
        self._reduce_grads()
        self._synced = False
        if not self.partition_grad:  # ZeRO-2 exposed the pieces' gradients already
            for i, piece in self._pieces.items():
                g = self._params[i].grad
                a, b = self._range(i)
                piece.grad = None if g is None else g.detach().reshape(-1)[a:b]
        if amp is not None and amp[0] is not None:
            amp = self._unscale_here(amp)
        # A frozen param is not stepped, even with a gradient left from before it was frozen: it is neither
        # averaged nor broadcast any more, so its owner alone would move it (torch's optimizers step any param
        # with a gradient). Its gradient is hidden from the wrapped optimizer for the step.
        hidden = [(p, p.grad) for g in self.optim.param_groups for p in g["params"]
                  if p.grad is not None and self._frozen(p)]
        for p, _g in hidden:
            p.grad = None
        # A FastOptimizer seeds its stochastic rounding with each param's position before the groups were cut.
        self.optim.__dict__["_zero_ids"] = self._local_to_global()
        try:
            return self._step_inner(amp, kwargs)
        finally:
            for p, g in hidden:
                p.grad = g

    # ---- torch.amp: ZeroGradScaler ------------------------------------------------------------------
    def _take_amp(self) -> tuple | None:
        """GradScaler's `grad_scale` and `found_inf`, set on the wrapper by its step() (on every rank alike):
        (grad_scale, found_inf), or None without a scaler. Refused on every rank unless this round's inf check
        was ZeroGradScaler's (`_amp_unscale`): another scaler's found_inf covers the gradients this rank holds
        alone, so ranks would skip different steps (or wait for each other) and their loss scales drift apart."""
        grad_scale = self.__dict__.get("grad_scale")
        found_inf = self.__dict__.get("found_inf")
        agreed = self.__dict__.pop("_amp_agreed", False)
        if grad_scale is None and found_inf is None:
            return None
        if not agreed or not isinstance(found_inf, Tensor):
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise RuntimeError(f"{_NAME}: GradScaler's step found no ZeroGradScaler inf check of these gradients. "
                               "Use fastopt.ZeroGradScaler (torch.amp.GradScaler's arguments), whose check covers "
                               "all ranks (a torch.amp.GradScaler's covers one rank's gradients, so ranks would "
                               "skip different steps), and call its unscale_ after the last backward (its update() "
                               "after a step that raised); or train in bfloat16, which needs no scaler")
        return grad_scale, found_inf

    def _unscale_here(self, amp: tuple) -> tuple:
        """GradScaler.step with no unscale_ before it: every gradient this rank holds is unscaled here, in place,
        as in one process (frozen params' too), and the wrapped optimizer gets no grad_scale. GradScaler unscales
        them before it steps or skips an optimizer without `_step_supports_amp_scaling` (and refuses fp16 ones
        there); a fused one (torch's `fused=True`, fastopt's) unscales the gradients it steps in place, and leaves
        them scaled at a step it skips: the same here, where it would unscale only this rank's shard's (ZeRO-1:
        other params' gradients, and a split param's other ranges, stayed scaled and differed between ranks:
        accumulated across steps, the sums were wrong). For fastopt's optimizers this is one pass over the
        gradients more than in one process, where their kernels store the unscaled gradients as they read them."""
        on_device = self._amp_on_device()
        if not on_device:
            self._refuse_fp16()
        grad_scale, found_inf = amp
        inv = grad_scale.double().reciprocal().float()
        if on_device:  # 1 where the step is skipped
            skip = (found_inf.to(inv.device).reshape(()) > 0).float()
            inv = inv * (1 - skip) + skip
        self._unscale(self._present_grads(), inv, torch.zeros((), device=inv.device))
        return None, found_inf

    def _amp_on_device(self) -> bool:
        """Whether the wrapped optimizer takes GradScaler's verdict on the device (fastopt's, torch's fused ones).
        Not one of GradScaler's older protocol, whose step takes the scaler itself (`grad_scaler=`: its own check
        would be this rank's; given none, it stepped on the scaled gradients and past infs): the host's skip."""
        from ..optim.base import FastOptimizer
        if isinstance(self.optim, FastOptimizer):
            return True
        if not getattr(self.optim, "_step_supports_amp_scaling", False):
            return False
        return "grad_scaler" not in inspect.signature(self.optim.step).parameters

    def _step_inner(self, amp: tuple | None, kwargs: dict) -> bool:
        """The wrapped optimizer's step, with ZeroGradScaler's verdict (`amp`, every rank's) applied as GradScaler
        applies it in one process (the gradients unscaled by `_unscale_here`, or by unscale_ before): its found_inf
        given to an optimizer that skips on the device, else the step skipped on the host when any rank found an inf
        (the host sync of GradScaler's own skip). False when skipped."""
        if amp is None:
            self.optim.step(**kwargs)
            return True
        grad_scale, found_inf = amp
        if self._amp_on_device():
            # A FastOptimizer declines GradScaler's on-device path for declared shards (its found_inf would be
            # its rank's alone); this one is every rank's.
            self.optim.grad_scale, self.optim.found_inf = grad_scale, found_inf
            try:
                self.optim.step(**kwargs)
            finally:
                del self.optim.grad_scale, self.optim.found_inf
            return True
        if found_inf.item():
            return False
        self.optim.step(**kwargs)
        return True

    def _amp_unscale(self, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool) -> dict:
        """ZeroGradScaler's `_unscale_grads_` (its unscale_ and the inf check of its step): the gradients reduced,
        then every one this rank holds (`_present_grads`) multiplied by `inv_scale` and checked, and the verdict
        made every rank's (an all-reduce of the max of one flag). Returns {device: found_inf}, as GradScaler's."""
        self._reduce_grads()
        if not allow_fp16:
            self._refuse_fp16()
        dev = self._comm_device()
        found = self._unscale(self._present_grads(), inv_scale, found_inf.to(dev, copy=True))
        if self.world_size > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self._pg)  # 0 or 1, as torch's fused steps read it
        self.__dict__["_amp_agreed"] = True
        return {found_inf.device: found.to(found_inf.device)}

    def _refuse_fp16(self) -> None:
        """GradScaler's refusal to unscale fp16 gradients, where it unscales for the optimizer; decided from the
        params (the same on every rank), not from the gradients this rank holds (ZeRO-2: its own params')."""
        if any(p.requires_grad and p.dtype == torch.float16 for p in self._params):
            raise ValueError("Attempting to unscale FP16 gradients.")

    @staticmethod
    def _unscale(grads: list[Tensor], inv_scale: Tensor, found: Tensor) -> Tensor:
        """grads *= inv_scale in place, per device and dtype (GradScaler's kernel); `found` (0-dim fp32) is set
        to 1 where one of them is not finite. Returns `found`."""
        for (device, _dtype), gs in _by_device_dtype(grads).items():
            here = found if device == found.device else torch.zeros((), device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(gs, here, inv_scale.to(device))
            if here is not found:
                torch.maximum(found, here.to(found.device), out=found)
        return found

    def _present_grads(self) -> list[Tensor]:
        """Every gradient this rank holds, each once: its params' (ZeRO-1: all of them, averaged alike on every
        rank; ZeRO-2: its own) and, under ZeRO-2, its pieces' (a ZeRO-1 piece's is a view of its param's)."""
        present = [p.grad for p in self._params if p.grad is not None]
        if self.partition_grad:
            present += [q.grad for q in self._pieces.values() if q.grad is not None]
        return present

    def _comm_device(self) -> torch.device:
        """Where the wrapper's small collectives (norms, flags) run: its first managed param's device."""
        return self._params[self._managed[0]].device if self._managed else torch.device("cpu")

    def _frozen(self, p: Tensor) -> bool:
        """Whether a param of the wrapped optimizer (a whole param, or a piece of a split one) is frozen now."""
        i = self._piece_gidx.get(id(p))
        return not (self._params[i] if i is not None else p).requires_grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every param (and ZeRO-2's accumulators)."""
        self._drop_round()  # a backward that raised (no end-of-backward callback runs after an error)
        self._give_back_stashed()  # ... before its round began: its `_give_back` callback did not run either
        self._synced = False
        self.__dict__.pop("_amp_agreed", None)  # a ZeroGradScaler.unscale_ with no step after it
        self._carried = None  # every sum is cleared here, the split params' too: nothing left to vote on
        for piece in self._pieces.values():
            if set_to_none:
                piece.grad = None
            elif piece.grad is not None and not self.partition_grad:
                piece.grad = None  # ZeRO-1: a view of the param's gradient, zeroed below; set again by step()
        for b in self._red:
            if set_to_none:
                b.acc = None
                b.seen = [False] * len(b.params)
            elif b.acc is not None:  # the counts stay: a param whose gradient is zeroed, not removed, is stepped
                b.acc[:b.numel].zero_()
        self._consumed = set()  # what the hooks took is cleared with the rest: a gradient set next replaces it
        if set_to_none:
            self._views = {}
            self._stashed = {}
            self._unkept = {}
            self._kept = {}
            self._kept_ver = {}
        else:
            for gidx, v in self._kept.items():  # a split param's piece is not in the groups zeroed below
                v.zero_()
                self._kept_ver[gidx] = v._version
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
        the accumulator keeps the sum so far and this backward's gradient arrives alone. A kept gradient (a param
        frozen with it, unfrozen since) is scaled instead."""
        p = self._params[gidx]
        v = self._views.get(gidx)
        if v is not None and p.grad is v:
            p.grad = None
            self._stashed[gidx] = v  # given back if no accumulation follows (torch.autograd.grad fires this too)
        else:
            # A param unfrozen since its reduced gradient was kept (`_rebuild`), reached by this backward, which adds
            # this rank's own gradient into it while the other ranks' arrive alone: scaled by the world size, the
            # kept sum (zeroed or scaled since, as one process's gradient would be) is reduced with theirs like a
            # gradient set by hand, to the sum one process has.
            v = self._kept.get(gidx)
            if v is None or p.grad is not v:
                return
            version = self._kept_ver.pop(gidx)
            del self._kept[gidx]
            scaled = p.grad = v.mul(self.world_size)
            self._unkept[gidx] = (v, version, scaled, scaled._version)  # kept again if no accumulation follows
        if not self._give_back_queued:  # at the end of this graph task (the accumulation follows at once)
            self._give_back_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(_give_back(weakref.ref(self)))

    def _drop_round(self) -> None:
        """Drop an open round of reductions: one of a backward that raised, or of a step refused before its
        reductions (the next backward starts a round of its own, rather than adding to buckets marked filled)."""
        if not self._round:
            return
        while self._inflight:  # every rank launched these (the same hooks fired before the same error)
            self._complete(self._inflight.popleft())
        for b in self._red:
            b.reset_round()
        self._next = 0
        self._round = False
        self._cleared = self._zeroed = self._eligible = False
        self._late = set()
        self._give_back_queued = False
        self._give_back_stashed()

    def _check_dense(self) -> None:
        """Refuse a sparse gradient before the step's reductions (every rank alike: a property of the model),
        dropping the backward's open round: the user makes it dense and runs backward again."""
        for i, p in enumerate(self._params):
            g = p.grad
            if g is not None and g.layout != torch.strided:
                self._drop_round()
                raise RuntimeError(_sparse_message(i, p, g))

    def _check_param_storage(self) -> None:
        """Before the step's reductions, every rank alike (the params are replicated, so is a change to them):
        refuse a param whose dtype, shape or device changed since it was given to the wrapper (`model.double()`,
        `p.data = ...` of another shape): its buckets, its piece and its state were made for what it was (the
        owner's optimizer alone would refuse it, leaving the other ranks waiting). A split param whose storage
        was replaced (`p.data = new` of the same dtype and shape) gets its piece pointed at the new storage: the
        piece went on viewing the old one, so the step's result never reached the param (each rank's own range
        kept the new values unstepped, and the ranks' replicas differed)."""
        P = self._params
        meta = self.__dict__.get("_meta") or []
        if len(meta) != len(P):  # recorded by _assign; else when first seen here
            meta = self._meta = meta[:len(P)] + [param_meta(p) for p in P[len(meta):]]
        now = list(map(param_meta, P))
        if now != meta:
            i, (dt, shape, dev) = next((i, m) for i, (m, w) in enumerate(zip(now, meta)) if m != w)
            raise ValueError(f"{_NAME}: param {i} is now {dt} of shape {tuple(shape)} on {dev}, but was {meta[i][0]} "
                             f"of shape {tuple(meta[i][1])} on {meta[i][2]} when it was given to the wrapper "
                             "(p.data replaced, or the model converted): its gradient buckets, its state and any "
                             "piece of it were made for that. Change it back, or wrap a new optimizer over the "
                             "params as they are now (a consolidated state_dict loads into it)")
        for i, piece in self._pieces.items():
            p, (a, b) = P[i], self._range(i)
            if not p.is_contiguous():
                raise ValueError(f"{_NAME}: split param {i} (shape {tuple(p.shape)}) is no longer contiguous "
                                 "(p.data replaced): its pieces are ranges of its memory; make it contiguous")
            if piece.data_ptr() != p.data_ptr() + a * p.element_size():
                piece.data = p.detach().view(-1)[a:b]

    def _give_back_stashed(self) -> None:
        """Expose again the owners' views that a tensor hook took away and no accumulation followed (a
        `torch.autograd.grad` over the params): `model.zero_grad()` and the next round see them as before. Called
        outside a backward too (zero_grad, step): a graph task that raised ran no callback, so none is queued now."""
        self._give_back_queued = False
        for gidx, v in self._stashed.items():
            if self._params[gidx].grad is None and self._views.get(gidx) is v:
                self._params[gidx].grad = v
        self._stashed = {}
        for gidx, (v, version, scaled, scaled_version) in self._unkept.items():
            if self._params[gidx].grad is scaled and scaled._version == scaled_version:
                self._params[gidx].grad = v
                self._kept[gidx] = v
                self._kept_ver[gidx] = version
        self._unkept = {}

    def _begin_round(self) -> None:
        """A round of reductions starts (the first hook of a backward, or a step's flush). ZeRO-2: an owner's
        exposed gradient that is no longer the view of its accumulator was cleared (`model.zero_grad()`,
        `p.grad = None`) or replaced by hand since: its sum so far is dropped, as torch drops a cleared
        gradient, and this rank votes, in every split bucket it packs, for resetting the split params' sums
        too (their pieces are not module params: no `model.zero_grad()` reaches them). Where every bucket with
        an owner's exposed gradient was written in place since (its version counter moved) and holds zeros only,
        they were zeroed in place (`model.zero_grad(set_to_none=False)`): the rank votes for zeroing the split
        sums (the counts stay: a zeroed gradient still counts). Checked on the device, without a host sync, and
        only where split params exist."""
        self._round = True
        if not self.partition_grad:
            return
        for b in self._red:
            b.packed = False
        dropped, gone = self._cleared_views(), self._cleared_kept()
        self._cleared, self._zeroed, self._eligible = self._pending_votes(bool(dropped or gone))
        self._carried = None  # cast now
        for gidx in dropped:
            self._drop_sum(gidx)
            del self._views[gidx]
            self._stashed.pop(gidx, None)
        for gidx in gone:  # cleared with the rest (its vote is cast): no longer kept
            del self._kept[gidx], self._kept_ver[gidx]
        if any(gidx in self._split for gidx in self._kept):
            self._vote_kept()

    @torch.no_grad()
    def _vote_kept(self) -> None:
        """ZeRO-2: a frozen split param's kept pieces (`_kept`, on every rank alike) take the votes just cast as
        its sum would in its bucket (`_complete`): no bucket carries them while it is frozen, so they are summed
        here, in one small all-reduce and a host read, only while such a piece is kept. Cleared, the pieces have
        no gradient (as the param has none in one process); zeroed by every eligible rank, they hold zeros."""
        kept = [gidx for gidx in self._kept if gidx in self._split]
        dev = self._kept[kept[0]].device
        votes = torch.zeros(3, dtype=torch.float32, device=dev)
        votes[0] = float(self._cleared)
        votes[1] = self._zeroed
        votes[2] = self._eligible
        dist.all_reduce(votes, group=self._pg)
        cleared, zeroed, eligible = votes.tolist()
        for gidx in kept:
            v = self._kept[gidx]
            if cleared:
                del self._kept[gidx], self._kept_ver[gidx]
                if self._pieces[gidx].grad is v:
                    self._pieces[gidx].grad = None
            elif zeroed and zeroed == eligible:
                v.zero_()
                self._kept_ver[gidx] = v._version

    def _drop_sum(self, gidx: int) -> None:
        """ZeRO-2: an owner's accumulated gradient of a param (not split) is dropped, as torch drops a cleared one."""
        b, k = self._slot[gidx]
        if b.acc is not None:
            b.slot(b.acc, k).zero_()
            b.acc[b.numel + k] = 0
        b.seen[k] = False

    def _pending_votes(self, cleared: bool | None = None) -> tuple | None:
        """ZeRO-2: the (cleared, zeroed, eligible) votes of what happened to the owners' gradients since the last
        round (`model.zero_grad()`; `cleared`: whether `_cleared_views()` found any, when known), with those a
        rebuild or a copy carried over (`_carried`: their new buckets cannot tell). `_begin_round` casts them;
        `_rebuild` and a copy carry them to the next round."""
        if not self.partition_grad:
            return None
        zeroed, eligible = self._zeroed_vote()
        if cleared is None:
            cleared = bool(self._cleared_views() or self._cleared_kept())
        votes = (cleared, zeroed, eligible)
        if self._carried is not None:  # from a rebuild or copy since the last round
            c, z, e = self._carried
            votes = (votes[0] or c, z if zeroed is False else zeroed | z, max(eligible, e))
        return votes

    def _cleared_views(self) -> list[int]:
        """ZeRO-2: the owners' params whose exposed gradient is no longer the view of its accumulator (cleared
        or replaced since; a view the tensor hook took away still counts as exposed)."""
        return [gidx for gidx, v in self._views.items() if gidx not in self._split
                and self._params[gidx].grad is not v and self._stashed.get(gidx) is not v]

    def _cleared_kept(self) -> list[int]:
        """ZeRO-2: the frozen whole params whose kept gradient is no longer their `.grad` (cleared or replaced
        since, as `_cleared_views`; one a backward took, `_unkept`, is not)."""
        return [gidx for gidx, v in self._kept.items() if gidx not in self._split and self._params[gidx].grad is not v]

    def _zeroed_vote(self) -> tuple[Any, float]:
        """ZeRO-2 with split params reduced (or a frozen one's pieces kept): this rank's (zeroed, eligible) votes
        (`_begin_round`). The frozen whole params' kept gradients count as the exposed ones do."""
        dev = next((b.device for b in self._red if b.bounds is not None), None) if self._split else None
        if dev is None:
            dev = next((v.device for gidx, v in self._kept.items() if gidx in self._split), None)
        if dev is None:  # no split param requires a gradient now, nor holds a kept one: nothing to vote on
            return False, 0.0
        exposed = {}  # buckets with an owner's gradient still exposed (or taken by the tensor hook)
        for gidx, v in self._views.items():
            if gidx not in self._split and (self._params[gidx].grad is v or self._stashed.get(gidx) is v):
                b = self._slot[gidx][0]
                exposed[id(b)] = b
        kept = [(v, self._kept_ver[gidx]) for gidx, v in self._kept.items()
                if gidx not in self._split and self._params[gidx].grad is v]
        zeroed: Any = False
        if (exposed or kept) and all(b.version is not None and b.acc._version != b.version
                                     for b in exposed.values()) and all(v._version != ver for v, ver in kept):
            nonzero = [b.acc[:b.numel].ne(0).any().to(dev) for b in exposed.values()]
            nonzero += [v.ne(0).any().to(dev) for v, _ in kept]
            zeroed = torch.stack(nonzero).any().logical_not()
        return zeroed, float(bool(exposed or kept))  # the zeroed vote must be unanimous among the eligible ranks

    def _on_grad(self, gidx: int) -> None:
        """Post-accumulate-grad hook: pack the gradient into its bucket; launch the buckets that are full."""
        if not self._round:
            self._begin_round()
            _at_end_of_backward(weakref.ref(self))
        self._stashed.pop(gidx, None)  # backward added into it: the gradient is this backward's now
        b, k = self._slot[gidx]
        if b.filled[k]:
            self._again(b, k)
            return
        self._pack(b, k)
        if self.partition_grad:
            self._consumed.add(gidx)
        if b.pending == 0:
            while self._next < len(self._red) and self._red[self._next].pending == 0:
                self._launch(self._red[self._next])
                self._next += 1

    @torch.no_grad()
    def _again(self, b: _Bucket, k: int) -> None:
        """A param's hook fires a second time in one backward: reentrant checkpointing (`use_reentrant=True`) runs a
        backward of its own inside the outer one, so a param used inside and outside a checkpointed segment, or in two
        segments, accumulates once per backward that reaches it. Before its bucket is launched the slot is packed again
        (ZeRO-1: the running sum, over the slot; ZeRO-2: the new part, added). Either way the bucket is reduced a second
        time at the end of the round (`_flush`): after a launch the new part is not in the reduction. ZeRO-1 keeps the
        param's running sum (`_late`: `_complete` does not overwrite it) or has the average plus the new part (which of
        the two depends on when the bucket was completed: at fixed points only, alike on every rank, `_launch`); either
        averages to the exact sum, a mix of them would not. ZeRO-2 has freed the packed part, so the second reduction
        adds only the new part. The second reduction depends only on which params accumulate twice, which the model
        fixes, so every rank makes it (module docstring)."""
        b.again = True
        if b.work is None:
            if not self.partition_grad:
                b.slot(b.staging, k).zero_()
            self._pack(b, k)
        elif not self.partition_grad:
            self._late.add(b.gidx[k])

    @torch.no_grad()
    def _pack(self, b: _Bucket, k: int) -> None:
        p = self._params[b.gidx[k]]
        if b.staging is None:
            b.staging = torch.zeros(b.size, dtype=b.dtype, device=b.device)
        g = p.grad
        if g is not None and g.layout != torch.strided:  # the same on every rank: a property of the model
            raise RuntimeError(_sparse_message(b.gidx[k], p, g))
        if b.bounds is not None:
            votes = b.staging.view(len(b.bounds) - 1, b.numel + 4)
            votes[:, b.numel + 1] = float(self._cleared)
            votes[:, b.numel + 2] = self._zeroed
            votes[:, b.numel + 3] = self._eligible
        if g is not None and b.bounds is not None:  # block r: range r of the gradient, then its count
            flat, blocks = g.reshape(-1), b.staging.view(len(b.bounds) - 1, b.numel + 4)
            for r, (lo, hi) in enumerate(zip(b.bounds, b.bounds[1:])):
                blocks[r, :hi - lo].add_(flat[lo:hi], alpha=self._inv_world)
            blocks[:, b.numel] = 1
            b.seen[k] = True
            b.packed = True
            p.grad = None
        elif g is not None and not (self.partition_grad and g is self._views.get(b.gidx[k])):
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
        if b.bounds is not None:
            b.recv = torch.empty(b.numel + 4, dtype=b.dtype, device=b.device)
            b.work = collective("reduce_scatter_single", "reduce_scatter_tensor")(
                b.recv, b.staging, group=self._pg, async_op=True)
        elif self.partition_grad:
            b.work = dist.reduce(b.staging, dst=self._ranks[b.owner], group=self._pg, async_op=True)
        else:
            b.work = dist.all_reduce(b.staging, group=self._pg, async_op=True)
        if not self.overlap_communication:  # synchronous: nothing on the wire while backward goes on
            self._complete(b)
            return
        self._inflight.append(b)
        # ZeRO-1 completes a bucket at fixed points only (not when its work happens to be done): `_complete` writes
        # the averages into the gradients, and a param accumulated again (`_again`) must find that done, or not,
        # on every rank alike (a rank with the average plus the new part and one with its own running sum would
        # average to neither).
        while self._inflight and (len(self._inflight) > _MAX_INFLIGHT
                                  or self.partition_grad and self._inflight[0].work.is_completed()):
            self._complete(self._inflight.popleft())  # frees its staging buffer

    @torch.no_grad()
    def _complete(self, b: _Bucket) -> None:
        b.work.wait()
        if b.bounds is not None:  # the votes (recv's last three elements) reset the sum so far, on the device
            got, cleared, zeroed, eligible = b.recv[:-3], b.recv[-3:-2], b.recv[-2:-1], b.recv[-1:]
            if b.acc is None:
                b.acc = got
            else:
                b.acc.masked_fill_(cleared != 0, 0)
                # zeroed by every rank that holds an exposed owner's gradient, not one rank's subset of them
                b.acc[:b.numel].masked_fill_((zeroed != 0) & (zeroed == eligible), 0)
                b.acc.add_(got)
            b.recv = None
        elif self.partition_grad:
            if b.owner == self.rank:
                if b.acc is None:
                    b.acc = b.staging
                else:
                    b.acc.add_(b.staging)  # the counts add up too: > 0 once any rank had a gradient
        else:
            # A param with a local gradient has a count > 0; read the counts only when some param has none here.
            has = b.counts(b.staging) if any(p.grad is None for p in b.params) else None
            for k, p in enumerate(b.params):
                if b.gidx[k] in self._late:  # accumulated again since it was packed: reduced again (`_again`)
                    continue
                if p.grad is not None:
                    p.grad.copy_(b.slot(b.staging, k).view(p.shape))
                elif has[k]:
                    p.grad = b.slot(b.staging, k).view(p.shape)
        b.staging = None

    def _reduce_rest(self, buckets: list) -> None:
        """Pack what the hooks did not into `buckets`, reduce each, and wait for every reduction in flight."""
        for b in buckets:
            for k in range(len(b.params)):
                if not b.filled[k]:
                    self._pack(b, k)
            self._launch(b)
            while len(self._inflight) > 1:  # one bucket on the wire while the next one is packed
                self._complete(self._inflight.popleft())
        while self._inflight:
            self._complete(self._inflight.popleft())

    @torch.no_grad()
    def _flush(self) -> None:
        """Finish the round: pack what the hooks did not (hand-set or missing gradients), reduce every bucket
        not reduced yet, wait for all, and expose the owner's accumulated gradients (ZeRO-2)."""
        if not self._round:
            self._begin_round()
        self._reduce_rest(self._red[self._next:])
        again = [b for b in self._red if b.again]
        if again:  # params accumulated twice in this backward (`_again`): their buckets are reduced again
            self._late = set()
            self._cleared = self._zeroed = self._eligible = False  # the first reduction carried this round's votes
            for b in again:
                b.reset_round()
            self._reduce_rest(again)
        for b in self._red:
            b.reset_round()
        self._next = 0
        self._round = False
        self._cleared = self._zeroed = self._eligible = False
        if self.partition_grad:
            mine = [b for b in self._red if b.owner == self.rank and b.acc is not None]
            for b in mine:
                b.version = b.acc._version
            for gidx, v in self._kept.items():  # the votes on them are cast: in-place writes from now on are news
                self._kept_ver[gidx] = v._version
            # Params that got a gradient on no rank keep `.grad = None`. The counts are read back (one host sync
            # per device) only for buckets with a param of which this rank packed no gradient itself.
            unsure: dict = {}
            for b in mine:
                # A split param's sum may have been reset by the ranks' votes (`_complete`) in a round in which
                # this rank packed none of it: its count says whether any gradient is left.
                if not all(b.seen) or (b.bounds is not None and not b.packed):
                    unsure.setdefault(b.device, []).append(b)
            has_of = {}
            for bs in unsure.values():
                flags = torch.cat([b.acc[b.numel:].ne(0) for b in bs]).tolist()
                for b in bs:
                    has_of[id(b)], flags = flags[:len(b.params)], flags[len(b.params):]
            for b in mine:
                has = has_of.get(id(b), b.seen)
                for k, gidx in enumerate(b.gidx):
                    if has[k] and (gidx not in self._views or self._holder(gidx).grad is not self._views[gidx]):
                        self._expose(gidx)
                    elif not has[k] and b.bounds is not None and gidx in self._views:
                        # Reset by a cleared vote (model.zero_grad()) and given no gradient since, on any rank: the
                        # piece has none, as the param has none in one process (exposed, it was stepped with zeros).
                        if self._pieces[gidx].grad is self._views[gidx]:
                            self._pieces[gidx].grad = None
                        del self._views[gidx]
                        b.seen[k] = False
        else:
            self._synced = True

    def _holder(self, gidx: int) -> Tensor:
        """What holds a param's gradient for the wrapped optimizer: the param, or this rank's piece of a split one."""
        return self._pieces[gidx] if gidx in self._split else self._params[gidx]

    def _expose(self, gidx: int) -> None:
        """ZeRO-2: the gradient of a param this rank owns (of its piece, for a split param): a view of its
        bucket's accumulator."""
        b, k = self._slot[gidx]
        if b.bounds is None:
            p = self._params[gidx]
            v = p.grad = b.slot(b.acc, k).view(p.shape)
        else:
            a, c = self._range(gidx)
            v = self._pieces[gidx].grad = b.acc[:c - a]
        self._views[gidx] = v

    def _reduce_grads(self) -> None:
        """Make the gradients averaged (ZeRO-1) / owned and averaged (ZeRO-2), whatever produced them."""
        self._check_newest()
        if self.world_size == 1:
            self._check_no_late_world()
            return
        if not self._ddp_checked:
            self._check_no_ddp()
        self._check_dense()
        self._check_param_storage()
        self._give_back_stashed()
        if self._round:
            self._flush()
        if self.partition_grad:
            self._check_foreign()
        unfrozen = False
        if any(p.requires_grad != r for p, r in zip(self._params, self._requires)):
            unfrozen = any(p.requires_grad and not r for p, r in zip(self._params, self._requires))
            self._rebuild()
        if self.partition_grad:
            P, views = self._params, self._views
            # A param unfrozen since the last build may hold a gradient that no hook saw on some ranks only (a
            # backward that used it on some of them): every rank reduces then, as every rank rebuilt.
            if unfrozen or any(P[i].grad is not None and P[i].grad is not views.get(i) for i in self._managed):
                self._flush()
        elif not self._synced:
            self._flush()

    def _claim(self, params: list[Tensor]) -> None:
        """Take `params` over from an older wrapper still alive: marked in its `_lost` (its hooks skip them, its
        step() is refused), so that hooks and steps test a set instead of looking params up."""
        ref = weakref.ref(self)
        for p in params:
            old = _CLAIMS.get(p)
            z = old() if old is not None else None
            if z is not None and z is not self:
                z._lost.add(z._gidx[id(p)])
            _CLAIMS[p] = ref

    def _check_newest(self) -> None:
        if self._lost:
            i = min(self._lost)
            raise RuntimeError(f"{_NAME}: param #{i} {tuple(self._params[i].shape)} (the wrapper's order) is managed "
                               f"by a newer {_NAME} built over the same params since this one; step that one "
                               "(this one's hooks no longer act on them)")

    def _check_no_late_world(self) -> None:
        """A wrapper built without a process group (torch.distributed not yet initialized: an optimizer made
        before `init_process_group`, or before Trainer/accelerate set it up) runs as a single rank. Refuse to
        step it once a default group of several ranks exists: it would average nothing, and each rank's params
        would drift apart silently (torch's wrapper refuses to be built without the group). Every rank alike."""
        if self._pg is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                f"{_NAME} was built before torch.distributed was initialized, so it runs as a single rank, but "
                f"the default process group now has {dist.get_world_size()} ranks: it would average no gradient "
                "and the ranks' params would drift apart. Build it after init_process_group (with Trainer or "
                "accelerate: after TrainingArguments / Accelerator, which initialize it), or pass a "
                "process_group of one rank to step each rank on its own on purpose.")

    def _check_no_ddp(self) -> None:
        """Refuse params that a DistributedDataParallel module reduces too (looked for once, at the first step or
        clip_grad_norm_, among the live objects: every rank alike, as DDP is built on every rank)."""
        import gc
        mine = {id(p): i for i, p in enumerate(self._params)}
        ddp_type = torch.nn.parallel.DistributedDataParallel
        for o in gc.get_objects():
            module = o.__dict__.get("_modules", {}).get("module") if issubclass(type(o), ddp_type) else None
            if module is None:  # not a DDP, or one whose construction failed
                continue
            both = sorted({mine[id(p)] for p in module.parameters() if id(p) in mine})
            if both:
                raise RuntimeError(
                    f"{_NAME}: params #{both[0]} {tuple(self._params[both[0]].shape)} (the wrapper's order) and "
                    f"{len(both) - 1} more are also reduced by a DistributedDataParallel module. This wrapper does "
                    "the data-parallel gradient reduction itself: under DDP every gradient would be reduced twice, "
                    "and with partition_grad=True or overlap_communication=True DDP's writes of its averaged "
                    "gradients race with the wrapper's, which gives wrong gradients. Give the wrapper the bare "
                    "module's parameters (no DDP; each rank still runs backward on its own batch).")
        self._ddp_checked = True  # a refusal stands until the DDP module is gone

    def _check_foreign(self) -> None:
        """ZeRO-2: refuse gradients assigned after a backward hook handed them to the wrapper (which freed them)
        and before this step: counting both would be wrong. Assigned on every rank (as they must be), they are
        refused on every rank: an owner's gradient is then no longer the view of its accumulator either."""
        P, views = self._params, self._views
        late = sorted(i for i in self._consumed if P[i].grad is not None and P[i].grad is not views.get(i))
        if late:  # `_consumed` stays: refused again until zero_grad() (a retry would drop the backward's sum)
            shown = ", ".join(f"#{i} {tuple(P[i].shape)}" for i in late[:4]) + (" ..." if len(late) > 4 else "")
            raise RuntimeError(
                f"{_NAME}(partition_grad=True): params {shown} (the wrapper's order) got a gradient after backward "
                "had handed theirs to the wrapper, which reduces and frees them as backward runs. A gradient set by "
                "hand replaces a backward pass (call the wrapper's zero_grad() first); it cannot follow one.")
        self._consumed = set()

    @torch.no_grad()
    def _rebuild(self) -> None:
        """A param was frozen or unfrozen since the buckets were built: build them and the hooks again for the
        params that require a gradient now (every rank alike, as they must all run the same backward). ZeRO-2's
        accumulated gradients move into the new accumulators; a newly unfrozen param's gradient, which no hook
        saw, is reduced now like a gradient set by hand. ZeRO-2: the owner's reduced gradient of a param frozen
        now stays its `.grad` (not stepped while frozen, `_kept`); unfrozen again while it is still the param's
        `.grad` (a backward since took it, `_detach_exposed`), it is carried back (the other ranks have none:
        reduced as one set by hand, by its owner alone, the ranks would hang). Owners and splits stay as they
        were."""
        carry = {}
        votes = self._pending_votes()
        if self.partition_grad:
            P = self._params
            for gidx, v in list(self._kept.items()):
                if P[gidx].requires_grad:
                    del self._kept[gidx], self._kept_ver[gidx]
                    # Still the param's gradient: a reduced sum (zeroed or scaled since, as one process's would be).
                    # A backward that reached it since it was unfrozen took it (`_detach_exposed`): no longer kept.
                    if self._holder(gidx).grad is v:
                        carry[gidx] = v
            for gidx, v in self._views.items():
                if not P[gidx].requires_grad and self._holder(gidx).grad is v:
                    self._kept[gidx] = v
                    self._kept_ver[gidx] = v._version
            for b in self._red:
                if b.acc is None:
                    continue
                has = b.counts(b.acc) if not all(b.seen) else b.seen
                for k, gidx in enumerate(b.gidx):
                    v = self._views.get(gidx)
                    if b.bounds is None and v is not None and self._params[gidx].grad is not v \
                            and self._stashed.get(gidx) is not v:
                        continue  # cleared since it was exposed (model.zero_grad()): nothing to carry
                    if has[k] and self._params[gidx].requires_grad:
                        carry[gidx] = v
                        if carry[gidx] is None:  # summed, not exposed (zero_grad(set_to_none=False) zeroed it)
                            a, c = self._range(gidx) if b.bounds is not None else (0, self._params[gidx].numel())
                            carry[gidx] = b.slot(b.acc, k) if b.bounds is None else b.acc[:c - a]
        self._build()
        self._carried = votes
        self._synced = False  # ZeRO-1: reduce again (averaged gradients, the same on every rank, stay as they are)
        for gidx, v in carry.items():
            b, k = self._slot[gidx]
            if b.acc is None:
                b.acc = torch.zeros(b.size if b.bounds is None else b.numel + 1, dtype=b.dtype, device=b.device)
            dst = b.acc[:v.numel()] if b.bounds is not None else b.slot(b.acc, k)
            dst.copy_(v.reshape(-1))
            b.acc[b.numel + (k if b.bounds is None else 0)] = 1
            b.seen[k] = True
            self._expose(gidx)
        for b in self._red:  # the round that filled them has ended: in-place writes from now on are news
            if b.acc is not None:
                b.version = b.acc._version

    @torch.no_grad()
    def _gather_split(self) -> None:
        """Every rank sends its updated piece of each split param and receives the others': one all-gather
        per split param (ranges padded to the longest), one on the wire while the next is packed. Where the
        ranges are all alike (numel a multiple of world * 4096, as most matrices are) the all-gather runs in
        place, into the param itself (its piece here is the slice of it at this rank's offset, which NCCL and
        gloo take as in-place): no buffer of the param's size."""
        q: deque = deque()
        for i in self._gathered:
            p, bounds = self._params[i], self._split[i]
            chunk = max(b - a for a, b in zip(bounds, bounds[1:]))
            piece = self._pieces[i].detach()
            if (chunk * self.world_size == p.numel() and p.is_contiguous()  # every range `chunk` long, and
                    and piece.data_ptr() == p.data_ptr() + self.rank * chunk * p.element_size()):  # p's slice
                out = p.detach().view(-1)
                work = collective("all_gather_single", "all_gather_into_tensor")(out, piece, group=self._pg,
                                                                                 async_op=True)
                q.append((p, None, chunk, out, work))
                while len(q) > 1:
                    self._finish_gather(*q.popleft())
                continue
            if piece.numel() == chunk:
                send = piece
            else:
                send = torch.zeros(chunk, dtype=p.dtype, device=p.device)
                send[:piece.numel()] = piece
            out = torch.empty(chunk * self.world_size, dtype=p.dtype, device=p.device)
            work = collective("all_gather_single", "all_gather_into_tensor")(out, send, group=self._pg,
                                                                             async_op=True)
            q.append((p, bounds, chunk, out, work))
            while len(q) > 1:
                self._finish_gather(*q.popleft())
        while q:
            self._finish_gather(*q.popleft())

    def _finish_gather(self, p, bounds, chunk, out, work) -> None:
        work.wait()
        if bounds is None:  # gathered in place
            return
        flat = p.detach().view(-1)
        for r, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if r != self.rank:
                flat[a:b].copy_(out[r * chunk:r * chunk + b - a])

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
        grads += [g for g in map(self._piece_grad, self._gathered) if g is not None]  # each range counted once
        dev = self._comm_device()
        # From every managed param, not the grads this rank owns: all ranks must reduce the same dtype (a rank
        # owning no grad would otherwise send 4 bytes where the others send 8).
        acc_dtype = torch.float64 if any(self._params[i].dtype == torch.float64 for i in self._managed) \
            else torch.float32
        norms = [n.to(device=dev, dtype=acc_dtype) for gs in _by_device_dtype(grads).values()
                 for n in torch._foreach_norm(gs, norm_type)]
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
        # ZeRO-2: scaling here is no zeroing through the model (`_zeroed_vote`). A coefficient of 0 (a non-finite
        # norm) leaves every owner's gradient zero: the accumulators not written in place since their round
        # ended stay unmoved, or the next round would zero the split params' sums (their inf * 0 = NaN, which one
        # process keeps, lost: the wrapper would step where torch's GradScaler skips). The wrapper's other
        # in-place scaling, the loss scale's (`_unscale`), moves no version counter (GradScaler's kernel,
        # torch._amp_foreach_non_finite_check_and_unscale_, torch 2.13).
        still = [b for b in self._red if b.version is not None and b.acc is not None
                 and b.acc._version == b.version] if self.partition_grad else []
        kept_still = [gidx for gidx, v in self._kept.items()
                      if v._version == self._kept_ver.get(gidx)] if self.partition_grad else []
        for (device, dtype), gs in _by_device_dtype(self._present_grads()).items():  # ZeRO-1: every rank its copy
            torch._foreach_mul_(gs, coef.to(device=device, dtype=dtype))
        for b in still:
            b.version = b.acc._version
        for gidx in kept_still:
            self._kept_ver[gidx] = self._kept[gidx]._version
        return total

    def _piece_grad(self, i: int) -> Tensor | None:
        """This rank's range of split param i's averaged gradient."""
        if self.partition_grad:
            return self._pieces[i].grad
        g = self._params[i].grad
        a, b = self._range(i)
        return None if g is None else g.reshape(-1)[a:b]

    # ---- state_dict --------------------------------------------------------------------------------
    def _local_to_global(self) -> list[int]:
        return [self._gidx[id(p)] if id(p) in self._gidx else self._piece_gidx[id(p)]
                for g in self.optim.param_groups for p in g["params"]]

    def state_dict(self, consolidated: bool = False, to: int | None = 0) -> dict | None:
        """This rank's shard (default), or with `consolidated=True` the whole state in the unwrapped optimizer's
        format, gathered (a collective: call it on every rank) to rank `to` of the group, or to every rank with
        `to=None`; other ranks get None. The shard, keyed by the global param index, carries a "zero" entry
        (world size, rank, owner of every param) and reloads only on the same partition. The wrapper's
        `register_state_dict_pre_hook` hooks run first, its post hooks on the dict returned (on the ranks that
        get one), as in torch; the wrapped optimizer's own hooks run on its part. torch's idiom works too: after
        `consolidate_state_dict(to=r)`, a plain `state_dict()` on rank r returns that consolidated dict until a
        step, `load_state_dict` or `add_param_group` changes the state (then this rank's shard again)."""
        held = self.__dict__.get("_held")
        if held is not None and not consolidated:  # new dicts, as every state_dict() call gives
            return {**held, "state": {i: dict(st) for i, st in held["state"].items()},
                    "param_groups": [{**g, "params": list(g["params"])} for g in held["param_groups"]]}
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

    def _drop_foreign_state(self) -> None:
        """Entries of the wrapped optimizer's state (a defaultdict) for params this rank does not step, which reading
        `opt.state[p]` makes (logging code on one rank, say): empty ones are dropped, as torch's state_dict would
        fail on a key outside its groups; one holding values set by hand is refused, naming the param (its state
        lives on the rank that steps it)."""
        held = {id(p) for g in self.optim.param_groups for p in g["params"]}
        for k in [k for k in self.optim.state if id(k) not in held]:
            if self.optim.state[k]:
                i = self._gidx.get(id(k))
                what = f"param #{i} {tuple(k.shape)} (the wrapper's order)" if i is not None else \
                    f"a tensor {tuple(k.shape)} that is none of its params"
                where = ("is split: each rank keeps its own piece's state" if i in self._split else
                         f"is stepped by rank {self._owner[i]}") if i is not None else "is not stepped"
                raise ValueError(f"{_NAME}: rank {self.rank}'s opt.state holds {sorted(map(str, self.optim.state[k]))} "
                                 f"for {what}, which {where}; change state through load_state_dict of a "
                                 "consolidated state_dict instead")
            del self.optim.state[k]

    def _shard(self) -> dict:
        self._push_hyper()
        self._drop_foreign_state()
        # A piece keeps the requires_grad its param had when it was made: a split param frozen since, and never
        # stepped, would get the zero state that the wrapped optimizer's state_dict() makes for trainable params
        # (one process makes none for it, nor does a frozen whole param here).
        for i, piece in self._pieces.items():
            if piece.requires_grad != self._params[i].requires_grad:
                piece.requires_grad_(self._params[i].requires_grad)
        # fastopt.checkpoint.dequantized_8bit(wrapper) reaches the wrapped optimizer's 8-bit states (a fastopt one's)
        from ..optim.base import FastOptimizer
        deq = self.__dict__.get("_dequantize_8bit") and isinstance(self.optim, FastOptimizer)
        with ckpt.dequantized_8bit(self.optim) if deq else contextlib.nullcontext():
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
        out["zero"] = {"world_size": self.world_size, "rank": self.rank, "owners": list(self._owner),
                       "split": {i: list(b) for i, b in sorted(self._split.items())}}
        return out

    def consolidate_state_dict(self, to: int | None = 0) -> dict | None:
        """The whole optimizer state as the unwrapped optimizer would save it (CPU tensors), on rank `to`
        (None: every rank); None on the other ranks. Collective. `state_dict(consolidated=True, to=to)`, which a
        plain `state_dict()` on those ranks returns as well (torch's ZeroRedundancyOptimizer idiom: consolidate
        on every rank, then save `state_dict()` on rank `to`) until a step, `load_state_dict` or
        `add_param_group`."""
        sd = self.state_dict(consolidated=True, to=to)
        self._held = sd
        return sd

    def _consolidated(self, to: int | None) -> dict | None:
        try:
            shard = self._shard()
        except ValueError as e:  # refused on this rank (`_drop_foreign_state`): the others get the error, not a hang
            if self.world_size == 1:
                raise
            shard, refused = None, e
        else:
            refused = None
            shard.pop("zero")
            shard["state"] = {gid: {k: _cpu(v) for k, v in st.items()} for gid, st in shard["state"].items()}
        part = shard["state"] if refused is None else str(refused)
        if self.world_size == 1:
            parts = [part]
        elif to is None:
            parts = [None] * self.world_size
            dist.all_gather_object(parts, part, group=self._pg)
        else:
            parts = [None] * self.world_size if self.rank == to else None
            dist.gather_object(part, parts, dst=self._ranks[to], group=self._pg)
        if refused is not None:
            raise refused
        if parts is None:
            return None
        for part in parts:
            if isinstance(part, str):
                raise ValueError(part)
        merged = {}
        for part in parts:
            merged.update({gid: st for gid, st in part.items() if gid not in self._split})
        for i in self._split:
            pieces = [part[i] for part in parts if i in part]
            if pieces:  # every rank has its piece's state, or none has (a gradient is seen by all or none)
                group = self.optim.param_groups[self._group_of[i]]
                merged[i] = self._merge_states(i, pieces, group)
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
        owned_saved = {saved_ids[i] for i, r in enumerate(self._owner) if r == self.rank or i in self._split}
        if zero is not None:
            split = {int(i): list(b) for i, b in zero.get("split", {}).items()}
            if (zero.get("world_size"), zero.get("rank"), list(zero.get("owners", ())), split) != \
                    (self.world_size, self.rank, self._owner, {i: list(b) for i, b in self._split.items()}):
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
                gidx = self._gidx[id(p)] if id(p) in self._gidx else self._piece_gidx[id(p)]
                sid = saved_ids[gidx]
                if sid in state and gidx in self._split and zero is None:  # the whole param's: cut this piece
                    inner_state[lid] = self._cut_state(gidx, state[sid], {**ig, **g}, f"state[{sid!r}]")
                elif sid in state:
                    inner_state[lid] = state[sid]
                g["params"].append(lid)
                if "param_names" in sg:
                    whole = self._params[gidx]
                    pos = [k for k, q in enumerate(self.param_groups[gi]["params"]) if q is whole][0]
                    names.append(sg["param_names"][pos])
                lid += 1
            if "param_names" in sg:
                g["param_names"] = names
            inner_groups.append(g)
        inner = {k: v for k, v in state_dict.items() if k not in ("state", "param_groups", "zero")}
        inner["state"] = inner_state
        inner["param_groups"] = inner_groups
        self.optim.load_state_dict(inner)
        self.__dict__.pop("_held", None)  # loaded: a held consolidated state_dict is stale (a refusal keeps it)
        self._pull_hyper()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


class ZeroGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` for `ZeroRedundancyOptimizer`: the same arguments, methods and state_dict, used the
    same way (`scale(loss).backward()`, optionally `unscale_(opt)` and `opt.clip_grad_norm_(...)`, `step(opt)`,
    `update()`), on every rank. With the wrapper, its unscale and inf check (in `unscale_`, or in `step` when
    `unscale_` was not called) first complete the gradients' reductions, then unscale and check every gradient
    the rank holds (its own params' and pieces' under ZeRO-2, all of them under ZeRO-1) and take the max of the
    verdict over the wrapper's group (one all-reduce of a flag): every rank skips the same steps and keeps the
    same scale, those of one process on the whole batch. A wrapped optimizer that unscales and skips on the device
    (fastopt's, torch's `fused=True` ones) gets the verdict there, with no host sync; others are skipped on the
    host, as GradScaler skips them. Other optimizers are served as by `torch.amp.GradScaler`.

    A plain `torch.amp.GradScaler` (or FSDP's `ShardedGradScaler`) is refused by the wrapper's step, on every rank:
    its check covers the gradients of one rank."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer._amp_unscale(inv_scale, found_inf, allow_fp16)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


def _by_device_dtype(tensors) -> dict:
    """{(device, dtype): [tensors]}, in first-seen order: the groups one foreach kernel takes."""
    by: dict = {}
    for t in tensors:
        by.setdefault((t.device, t.dtype), []).append(t)
    return by


def _cpu(v):
    """A state value on the CPU: tensors detached and moved, dicts of them (8-bit states dequantized) alike."""
    if isinstance(v, Tensor):
        return v.detach().cpu()
    return {k: _cpu(x) for k, x in v.items()} if isinstance(v, dict) else v


def _give_back(ref):
    def callback():
        z = ref()
        if z is not None:
            z._give_back_queued = False
            z._give_back_stashed()
    return callback


def _end_of_backward(ref):
    def callback():
        z = ref()
        if z is not None and z._round:
            z._flush()
    return callback


_BACKWARD_OF_A_FUNCTION = torch.autograd.function.BackwardCFunction.apply.__code__


def _at_end_of_backward(ref) -> None:
    """Have the wrapper's round flushed when the backward pass running now ends: an autograd callback queued on
    its graph task. A hook that fires inside a backward started by a custom autograd Function's backward
    (reentrant checkpointing runs one per checkpointed segment) is in a nested graph task, which ends while
    the outer backward still has gradients to produce: the callback goes to the outermost one instead, queued
    by a post-hook on the outermost Function's node, which runs in the outer graph task once that Function's
    backward returns. Found on this thread's Python stack (autograd runs a nested backward on the thread
    that runs the Function's backward)."""
    f, outer = sys._getframe(1), None
    while f is not None:
        if f.f_code is _BACKWARD_OF_A_FUNCTION:
            outer = f
        f = f.f_back
    node = outer.f_locals.get("self") if outer is not None else None
    queue = torch.autograd.Variable._execution_engine.queue_callback
    if node is None:
        queue(_end_of_backward(ref))
        return
    handle = None

    def post_hook(_grad_inputs, _grad_outputs):
        handle.remove()
        queue(_end_of_backward(ref))
    handle = node.register_hook(post_hook)
