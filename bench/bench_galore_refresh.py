"""GaLore's refresh steps: fastopt.GaLoreAdamW against galore-torch's GaLoreAdamW with update_proj_gap 1, so
that every step computes the SVD of every projected matrix (both run torch.linalg.svd in fp32, which
dominates the step). Reported, not targeted (bench/common.py's `targets` leaves `-refresh` rows out).

A step takes seconds on a GPU (an SVD per matrix), so these rows are cut down: one decoder layer of each set
(7 projected matrices), fp32 params only (the SVD runs in fp32 whatever the params' dtype), rank 128 (the
SVD is computed whole, then truncated: the rank barely changes its cost), and exactly `REPS` timed steps
after the first (`common.measure(reps=...)`: wall clock per step; p20 and p80 are the fastest and slowest).
bench/run.py runs this bench last, so that a GPU run cut short by its time limit has every other bench.
Otherwise as bench_galore.py (the same groups, hyperparameters and byte counts).
"""
from __future__ import annotations

import copy

import torch

try:
    from . import bench_galore as galore
    from . import common
except ImportError:
    import bench_galore as galore
    import common

import fastopt

STEM = "galore_refresh"
RANK = 128
LAYERS = 1
REPS = 3


def run(args) -> list[dict]:
    out = []
    small = copy.copy(args)
    small.layers_7b = small.layers_1b = LAYERS
    for pset in common.param_sets(small):
        rank = galore._rank(args, pset, RANK)
        bench = f"galore-{galore.tag(args, RANK)}-refresh"
        mb, kb = galore._bytes(pset, torch.float32, rank)
        note = f"rank {rank}, an SVD of every matrix every step; {LAYERS} decoder layer, {REPS} timed steps"
        out.append(common.measure(
            args, bench, "fastopt.GaLoreAdamW", pset, torch.float32,
            lambda ps, r=rank: fastopt.GaLoreAdamW(galore._groups(pset, ps, r, 1), **galore.HYPER),
            min_bytes=mb, kernel_bytes=kb, ours=True, backend=galore._backend, reps=REPS, notes=note))
        ref = galore._Galore(pset, rank, 1)
        out.append(ref.fix(common.measure(args, bench, "galore-torch GaLoreAdamW", pset, torch.float32, ref.make,
                                          min_bytes=mb, step=ref.step, backend="eager", reps=REPS, notes=note)))
    return out


if __name__ == "__main__":
    common.main(STEM, run)
