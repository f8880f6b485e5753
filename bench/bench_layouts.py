"""Communication of one step under TP 8 x FSDP 8 for the Llama-7B shapes (computed), and the single-process
cost of the layout machinery (timed).

Communication (computed, not timed: no cluster needed). Under FSDP2 on top of TP on an 8 x 8 mesh, every
projection matrix, the embedding and the LM head are sharded over both mesh dims (`Shard`/`_StridedShard` on
"dp", `Shard` on "tp"), so their statistics are summed over the 64 ranks of the world; the norm weights are
sharded by FSDP alone, over the 8 ranks of their dp group. fastopt buckets params by reduction group and
hands each bucket's `reduce` one flat buffer per phase; the buffers' sizes come from the reference's own
`reduction_sizes` (the same buffers `*_step` builds; tests/test_layouts.py checks that they agree). Per row:
collectives per step, buffer bytes per step (what each rank contributes), the bytes a ring all-reduce sends
per rank (2 (n - 1) / n of the buffer), and the two naive alternatives: one collective per param and phase,
and gathering each whole gradient matrix (what an exact factored statistic costs without row/column sums).

Overhead (timed): one single-process `step()` of each optimizer on the usual parameter sets, against the
time the layout machinery alone takes per step (`_buckets`, which looks up every param's layout and groups
the params); the issue's bound is 5% of the step on a GPU.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

try:
    from . import common
except ImportError:
    import common

import fastopt
from fastopt.reference import adafactor as ref_adafactor
from fastopt.reference import came as ref_came
from fastopt.reference import lamb as ref_lamb

STEM = "layouts"
TP, DP = 8, 8
OPTIMIZERS = ("Adafactor", "CAME", "Lamb", "AdamW8bit")


def reduction_sizes(opt: str, shapes, dtype) -> list[tuple[int, torch.dtype]]:
    """The buffers one bucket of params of these (global) shapes reduces per step, in phase order."""
    if opt == "Adafactor":
        return ref_adafactor.reduction_sizes(shapes)
    if opt == "CAME":
        return ref_came.reduction_sizes(shapes)
    if opt == "Lamb":
        return ref_lamb.reduction_sizes(shapes, dtype)
    return []  # AdamW8bit: element-wise, no statistics to share


def buckets_tp_fsdp(shapes) -> dict[str, tuple[int, list]]:
    """Reduction group -> (ranks in it, global shapes of its params) under FSDP2 + TP on a DP x TP mesh."""
    world = [s for _, s in shapes if len(s) >= 2]
    dp = [s for _, s in shapes if len(s) < 2]
    return {"world": (TP * DP, world), "dp": (DP, dp)}


def _size(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"


def comm(opt: str, shapes, dtype=torch.float32) -> dict:
    out = dict(mesh=f"TP {TP} x FSDP {DP}", collectives=0, buffer_bytes=0, ring_bytes_per_rank=0.0,
               per_param_collectives=0, gather_matrix_bytes=0, groups={})
    g_bytes = common.elem_bytes(dtype)
    for name, (ranks, group_shapes) in buckets_tp_fsdp(shapes).items():
        if not group_shapes:
            continue
        sizes = reduction_sizes(opt, group_shapes, dtype)
        nbytes = sum(n * torch.empty((), dtype=dt).element_size() for n, dt in sizes)
        out["groups"][name] = dict(ranks=ranks, params=len(group_shapes), collectives=len(sizes),
                                   buffer_elements=[n for n, _ in sizes], buffer_bytes=nbytes)
        out["collectives"] += len(sizes)
        out["buffer_bytes"] += nbytes
        out["ring_bytes_per_rank"] += 2 * (ranks - 1) / ranks * nbytes
        out["per_param_collectives"] += len(group_shapes) * len(sizes)
        if opt in ("Adafactor", "CAME"):  # all-gathering each matrix's gradient to every rank of its group
            out["gather_matrix_bytes"] += sum(math.prod(s) for s in group_shapes if len(s) >= 2) * g_bytes
    return out


def _machinery_ms(opt, reps: int = 50) -> float:
    """Median wall time of the per-step layout machinery: `_buckets` over every param group (host only)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            opt._buckets(group["params"])
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _factory(name):
    if name == "Adafactor":
        return lambda ps: fastopt.Adafactor(ps)
    if name == "CAME":
        return lambda ps: fastopt.CAME(ps, lr=2e-4)
    if name == "Lamb":
        return lambda ps: fastopt.Lamb(ps, lr=1e-3)
    return lambda ps: fastopt.AdamW8bit(ps, lr=1e-3)


def run(args) -> list[dict]:
    rows = []
    full = common.ParamSet("7b", f"llama-7b (32/32 layers), TP {TP} x FSDP {DP}",
                           tuple(common.model_shapes(common.LLAMA_7B, common.LLAMA_7B.layers)))
    for name in OPTIMIZERS:
        c = comm(name, full.shapes)
        # status "computed" says how the row was made; the reason says only what came out.
        summary = (f"{c['collectives']} collectives/step ({c['per_param_collectives']} if one per "
                   f"param and phase), {_size(c['buffer_bytes'])} reduced/step, "
                   f"{_size(c['ring_bytes_per_rank'])} sent per rank (ring)")
        if c["gather_matrix_bytes"]:
            summary += f"; gathering the gradient matrices instead: {_size(c['gather_matrix_bytes'])}"
        print(f"  layouts    7b  {name:10s} {summary}", flush=True)
        rows.append(common._result(args, STEM, f"fastopt.{name} communication", full, torch.float32, ours=True,
                                   status="computed", reason=summary, comm=c))
    for pset in common.param_sets(args):
        for dtype in common.dtypes(args)[:1]:
            for name in OPTIMIZERS:
                made = {}

                def make(ps, _name=name):
                    made["opt"] = _factory(_name)(ps)
                    return made["opt"]

                r = common.measure(args, STEM, f"fastopt.{name} step", pset, dtype, make, ours=True,
                                   min_bytes=common.min_bytes(pset, dtype))
                rows.append(r)
                if r["status"] != "ok" or "opt" not in made:
                    continue
                ms = _machinery_ms(made["opt"])
                frac = ms / r["ms_median"]
                why = (f"layout machinery {ms:.4f} ms of the {r['ms_median']:.3f} ms timed step "
                       f"({100 * frac:.2f}%; bound 5% on a GPU)")
                print(f"  layouts    {pset.key:3s} {name:10s} {why}", flush=True)
                rows.append(common._result(args, STEM, f"fastopt.{name} layout machinery", pset, dtype, ours=True,
                                           status="computed", reason=why, machinery_ms=ms, overhead_frac=frac))
    return rows


if __name__ == "__main__":
    common.main(STEM, run)
