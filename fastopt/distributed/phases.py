"""The collectives of a step, batched over buckets and param groups.

A fused step over a bucket (params that share a device, a dtype and reduction groups) runs in phases: each
ends with a buffer of partial statistics that the ranks sharing the params must sum before the next phase
(Adafactor's row and column sums, Lamb's norms, GaLore's projected gradient). The step functions
(`ops.*_phases`, over fastopt/reference and fastopt/kernels) are generators that yield these requests and go
on once they are done:

    yield buf                                      buf summed in place over the bucket's groups (`reduce`)
    yield Exchange("reduce_scatter", out, inp, g)  out[c] <- the sum over the ranks of g of their inp[rank, c]
    yield Exchange("all_gather", out, inp, g)      out[k, c] <- rank k's inp[c]

`run(steps)` advances the steps of every bucket of one `step()` together, a round per phase, and issues one
collective per round for the requests of one kind, over the same groups, of one dtype and on one device (their
buffers concatenated): the collectives of a `step()` grow neither with the params nor with the param groups. Every
rank of a group runs the same buckets in the same order (`FastOptimizer._buckets`), hence the same rounds.
`drive(steps, reduce)` runs the step of one bucket alone (`ops.*_step`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import collective

__all__ = ["Exchange", "Steps", "run", "drive"]

Steps = Generator["Tensor | Exchange", None, None]


@dataclass(frozen=True, eq=False)
class Exchange:
    """A reduce-scatter or an all-gather over `group` of W ranks: `inp` (reduce_scatter: W * c elements, rank
    k's part at [k * c, (k + 1) * c)) and `out` (all_gather: W * c elements, likewise), both contiguous."""
    kind: str  # "reduce_scatter" | "all_gather"
    out: Tensor
    inp: Tensor
    group: object


def _issue(kind: str, out: Tensor, inp: Tensor, group) -> None:
    if kind == "reduce_scatter":
        collective("reduce_scatter_single", "reduce_scatter_tensor")(out.view(-1), inp.view(-1), group=group)
    else:
        collective("all_gather_single", "all_gather_into_tensor")(out.view(-1), inp.view(-1), group=group)


def _sum(bufs: list[Tensor], reduce: Callable[[Tensor], None]) -> None:
    """Sum every buffer of `bufs` (one dtype and device) over the groups of `reduce`: one call for all of them."""
    if len(bufs) == 1:
        reduce(bufs[0])
        return
    flat = torch.cat([b.reshape(-1) for b in bufs])
    reduce(flat)
    for b, piece in zip(bufs, flat.split([b.numel() for b in bufs])):
        b.copy_(piece.view_as(b))


def _exchange(reqs: list[Exchange]) -> None:
    """The reduce-scatters (or all-gathers) of `reqs` (one group, dtype and device) as one: each rank's parts of
    every request side by side in one buffer."""
    if len(reqs) == 1:
        r = reqs[0]
        _issue(r.kind, r.out, r.inp, r.group)
        return
    w = dist.get_world_size(reqs[0].group)
    if reqs[0].kind == "reduce_scatter":
        send = torch.cat([r.inp.view(w, -1) for r in reqs], 1)
        recv = send.new_empty(send.shape[1])
        _issue("reduce_scatter", recv, send, reqs[0].group)
        for r, piece in zip(reqs, recv.split([r.out.numel() for r in reqs])):
            r.out.view(-1).copy_(piece)
    else:
        send = torch.cat([r.inp.reshape(-1) for r in reqs])
        recv = send.new_empty(w, send.numel())
        _issue("all_gather", recv, send, reqs[0].group)
        for r, piece in zip(reqs, recv.split([r.inp.numel() for r in reqs], 1)):
            r.out.view(w, -1).copy_(piece)


def _advance(gen: Steps):
    try:
        return next(gen)
    except StopIteration:
        return None


def run(steps: Iterable[tuple[Steps | None, object, Callable[[Tensor], None] | None]]) -> None:
    """Run the steps of several buckets, each given as (generator or None, the key of its groups, `reduce`:
    sums a buffer over them), batching their collectives round by round (see the module docstring)."""
    waiting = []
    for gen, key, reduce in steps:
        req = None if gen is None else _advance(gen)
        if req is not None:
            waiting.append((gen, key, reduce, req))
    while waiting:
        batches: dict = {}
        for _gen, key, reduce, req in waiting:
            if isinstance(req, Exchange):
                batches.setdefault((req.kind, req.group, req.inp.dtype, req.inp.device), ([], None))[0].append(req)
            else:
                if reduce is None:
                    raise RuntimeError("fastopt: a step of unsharded params asked for a sum over ranks")
                batches.setdefault(("sum", key, req.dtype, req.device), ([], reduce))[0].append(req)
        for (kind, *_), (reqs, reduce) in batches.items():
            if kind == "sum":
                _sum(reqs, reduce)
            else:
                _exchange(reqs)
        waiting = [(gen, key, reduce, req) for gen, key, reduce, _r in waiting if (req := _advance(gen)) is not None]


def drive(gen: Steps, reduce: Callable[[Tensor], None] | None) -> None:
    """Run the step of one bucket: each buffer it yields summed by `reduce`."""
    run([(gen, None, reduce)])
