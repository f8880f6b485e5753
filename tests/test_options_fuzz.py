"""A randomized differential test of each fastopt optimizer's option space against its external reference, in one
process, float64.

A seed draws an optimizer (Adafactor, CAME, Lamb, GaLoreAdamW 32-bit, GaLoreAdamW 8-bit, AdamW8bit), its constructor
options from the reference's whole argument list, 1-3 param groups (the first takes the constructor's options, the
others override a random subset of them, inheriting the rest), params of random shapes (0-d, 1-D, tall, wide and
square 2-D, 1x1, 1xN, Nx1, 3-D and 4-D where the reference takes them, an empty one, some starting at zero), and 8-15
steps of fresh random gradients of random scale, where a param's gradient is None at some steps (so params reach
different step counts, some none at all). In 3 seeds of 4 the back end is the torch reference; in the fourth, the
Triton kernels through the interpreter (TRITON_INTERPRET=1, small shapes).

References: transformers' Adafactor, came-pytorch's CAME, galore-torch's GaLoreAdamW (32-bit), and, written here
in float64 from the documented math (as tests/test_lamb.py, test_galore.py and test_adamw8bit.py write theirs),
LAMB, GaLore-AdamW with 8-bit moments (galore-torch's projector, the moments through conftest.through_8bit after
every step) and torch's AdamW math with 8-bit moments (conftest.through_8bit). Documented deviations are followed:
fastopt's GaLore weight_decay default (always passed), its defaults for the keys a projected group lacks
(update_proj_gap=200, scale=0.25, proj_type="std", given to galore-torch written out), and the refusals (a rank
above a projected param's smaller dim, an lr given with relative_step, warmup_init without it, betas equal to 1)
are never drawn.

After every step, for every param: ||ours - ref|| <= TOL * (the update's size) with TOL = conftest.TOL[float64] on
both back ends (the kernels' float64 tests use it too) and the update's size the reference's path length (the sum
of its steps' sizes, at least ||ref - init||: a 0-d param clipped to +-lr * clip_threshold can step back to where it
started, keeping its steps' rounding); the same non-finite elements where the reference has any; the step
counts; the states, norm-wise within TOL of the largest norm the reference's state has had (a moment that cancels
to near zero at one step keeps its terms' absolute error), 8-bit codes and GaLore's fp32 bases bit for bit. A
failure is also an exception from fastopt, or one from the reference (reported as such).

Seed streams (each keeps its runs when the others change):
- below 100000: the draws above; Triton one seed in 4, small shapes (at most 15 rows).
- from 100000 (EXTRAS_FROM): also hyperparameters changed between steps (both sides), params and gradients in
  transposed memory, constructor options as numpy scalars, a per-group nbits (Lamb, GaLore 8-bit), groups added
  with add_param_group, our optimizer replaced midway by a new one loaded from its state_dict through
  torch.save / torch.load(weights_only=True), the constructor's lr as a 0-dim float64 tensor.
- from 200000 (MEDIUM_TRITON_FROM): Triton always, with the torch seeds' shapes (up to 29 rows, more than one of the
  interpreted kernels' 16-row blocks).

Not drawn, with the reason: GaLore proj_type "full" at rank = a dim with beta2 = 0 or eps ~ 0 (see draw()); a
beta1 switched between None and a number mid-run (transformers makes exp_avg at the first step only); CAME
with nbits=8 (no reference to hold it to). galore-torch's reverse_std on a wide matrix at rank = its rows raises in
galore-torch itself (its project_back picks the side from the low-rank shape): the reference is its projector with
the side fixed (_fixed_projector).

    python tests/test_options_fuzz.py FIRST_SEED COUNT [OUT.jsonl]   # many seeds, one line per seed
    python tests/test_options_fuzz.py --show SEED                     # the drawn run of a seed
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import time
import traceback

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
import torch
from conftest import TOL as TOLS
from conftest import through_8bit

import fastopt
from fastopt import ops

TOL = TOLS[torch.float64]

EXTRAS_FROM = 100000  # seeds from here on also draw _draw_extras (the seeds below keep the runs they had)
MEDIUM_TRITON_FROM = 200000
OPTS = ["adafactor", "came", "lamb", "galore", "galore8", "adamw8bit"]
FACTORED = ("adafactor", "came")


# ---------------------------------------------------------------------------------------------------- drawing
def _shape(rng: random.Random, kind: str, small: bool) -> list:
    n = (lambda: rng.randint(2, 9)) if small else (lambda: rng.randint(2, 23))
    if kind == "scalar":
        return []
    if kind == "vec":
        return [rng.choice([1, n(), n() * 3])]
    if kind == "tall":
        a, b = sorted([n(), n()])
        return [b + rng.randint(1, 6), a]
    if kind == "wide":
        a, b = sorted([n(), n()])
        return [a, b + rng.randint(1, 6)]
    if kind == "square":
        k = n()
        return [k, k]
    if kind == "1x1":
        return [1, 1]
    if kind == "1xN":
        return [1, n()]
    if kind == "Nx1":
        return [n(), 1]
    if kind == "3d":
        return [rng.randint(1, 3), n(), n()]
    if kind == "4d":
        return [rng.randint(1, 2), rng.randint(1, 3), n(), n()]
    if kind == "empty":
        return rng.choice([[0], [0, 3], [3, 0], [2, 0, 4]])
    raise ValueError(kind)


def _shapes(rng, opt, small, projected=False):
    if projected:  # galore-torch projects 2-D matrices only
        kinds = ["tall", "wide", "square", "1x1", "1xN", "Nx1"]
    else:
        kinds = ["scalar", "vec", "vec", "tall", "wide", "square", "1x1", "1xN", "Nx1", "3d", "4d"]
        if opt in ("adamw8bit", "lamb") and not small:
            kinds += ["big"]
    out = []
    for _ in range(rng.randint(1, 3)):
        k = rng.choice(kinds)
        if k == "big":  # several 8-bit blocks, the last one partial
            out.append([rng.randint(300, 700)] if rng.random() < 0.5 else [rng.randint(10, 30), rng.randint(20, 40)])
        else:
            out.append(_shape(rng, k, small))
    if not projected and rng.random() < 0.15:
        out.append(_shape(rng, "empty", small))
    return out


def _draw_adafactor(rng):
    rel = rng.random() < 0.5
    o = dict(relative_step=rel, lr=None if rel else rng.choice([1e-3, 1e-2, 3e-2, 0.1]),
             eps=(rng.choice([1e-30, 0.0, 1e-3, 0.1]), rng.choice([1e-3, 0.0, 1e-2, 0.5])),
             clip_threshold=rng.choice([1.0, 0.1, 0.5, 3.0, 1e3]),
             decay_rate=rng.choice([-0.8, -0.5, -1.0, -0.3, 0.0]),
             beta1=rng.choice([None, None, 0.0, 0.5, 0.9]),
             weight_decay=rng.choice([0.0, 0.0, 0.01, 0.3]),
             scale_parameter=rng.random() < 0.6,
             warmup_init=rel and rng.random() < 0.4)
    return o


def _draw_came(rng):
    return dict(lr=rng.choice([1e-4, 1e-3, 1e-2, 0.1]),
                eps=(rng.choice([1e-30, 0.0, 1e-3, 0.1]), rng.choice([1e-16, 0.0, 1e-4, 0.5])),
                clip_threshold=rng.choice([1.0, 0.1, 0.5, 3.0, 1e3]),
                betas=tuple(rng.choice([0.0, 0.5, 0.9, 0.999, 0.9999]) for _ in range(3)),
                weight_decay=rng.choice([0.0, 0.0, 0.01, 0.3]))


def _betas2(rng):
    return (rng.choice([0.0, 0.5, 0.9, 0.95]), rng.choice([0.0, 0.5, 0.9, 0.99, 0.999]))


def _draw_lamb(rng, nbits):
    o = dict(lr=rng.choice([1e-3, 1e-2, 0.05, 0.2]), betas=_betas2(rng), eps=rng.choice([1e-6, 0.0, 1e-8, 1e-3, 0.1]),
             weight_decay=rng.choice([0.0, 0.0, 0.01, 0.3]), bias_correction=rng.random() < 0.6,
             max_trust_ratio=rng.choice([None, None, 0.5, 1.0, 2.0, 10.0]))
    if nbits == 8:
        o.update(block_size=rng.choice([64, 128, 256]), min_8bit_size=rng.choice([0, 16, 64, 200, 4096]))
    return o


def _draw_adamw8bit(rng):
    return dict(lr=rng.choice([1e-3, 1e-2, 0.05]), betas=_betas2(rng), eps=rng.choice([1e-8, 0.0, 1e-6, 1e-3, 0.1]),
                weight_decay=rng.choice([0.0, 0.01, 0.3]), block_size=rng.choice([64, 128, 256]),
                min_8bit_size=rng.choice([0, 16, 64, 200, 4096, 10 ** 9]))


def _draw_galore(rng, nbits):
    o = dict(lr=rng.choice([1e-3, 1e-2, 0.05]), betas=_betas2(rng), eps=rng.choice([1e-6, 0.0, 1e-8, 1e-3, 0.1]),
             weight_decay=rng.choice([0.0, 0.0, 0.01, 0.3]), correct_bias=rng.random() < 0.7)
    if nbits == 8:
        o.update(block_size=rng.choice([64, 128, 256]), min_8bit_size=rng.choice([0, 16, 64, 200, 4096]))
    return o


def draw(seed: int) -> dict:
    rng = random.Random(seed)
    opt = OPTS[rng.randrange(len(OPTS))]
    # From MEDIUM_TRITON_FROM on: Triton always, with the torch seeds' shapes (up to 29 rows: more than one of the
    # interpreted kernels' 16-row blocks); below it, one seed in 4, small shapes.
    backend = "triton" if seed % 4 == 3 or seed >= MEDIUM_TRITON_FROM else "torch"
    small = backend == "triton" and seed < MEDIUM_TRITON_FROM
    nbits = 8 if opt in ("galore8", "adamw8bit") else (rng.choice([32, 32, 8]) if opt == "lamb" else 32)
    drawer = dict(adafactor=_draw_adafactor, came=_draw_came, adamw8bit=_draw_adamw8bit,
                  lamb=lambda r: _draw_lamb(r, nbits), galore=lambda r: _draw_galore(r, 32),
                  galore8=lambda r: _draw_galore(r, 8))[opt]
    ctor = drawer(rng)
    groups = []
    for gi in range(rng.randint(1, 3)):
        own = {}
        if gi > 0:
            full = drawer(rng)
            keys = [k for k in full if rng.random() < 0.5]
            own = {k: full[k] for k in keys}
            if opt == "adafactor":  # the group's effective options must be valid ones (README: refusals)
                eff = {**ctor, **own}
                if eff["relative_step"]:
                    if "lr" in own:
                        own["lr"] = None
                else:
                    if eff["lr"] is None:
                        own["lr"] = rng.choice([1e-3, 1e-2, 3e-2])
                    if eff["warmup_init"]:
                        own["warmup_init"] = False
        projected = opt.startswith("galore") and rng.random() < 0.7
        shapes = _shapes(rng, opt, small, projected)
        if projected:
            mind = min(min(s) for s in shapes)
            gal = dict(rank=rng.randint(1, min(mind, 6)), update_proj_gap=rng.randint(1, 4),
                       scale=rng.choice([0.25, 1.0, 0.5, 2.0]),
                       proj_type=rng.choice(["std", "reverse_std", "right", "left", "full"]))
            # keys left to fastopt's documented defaults (update_proj_gap=200, scale=0.25, proj_type="std")
            own["galore"] = gal
            if gal["proj_type"] == "full":
                # At a refresh, full projection at rank = a dim gives the diagonal diag(s) up to the fp32 SVD's
                # rounding: off-diagonal entries ~1e-9 of the norm, which m / (sqrt(v) + eps) with beta2 = 0
                # (v = r^2) or at t = 1, and eps ~ 0, divides by themselves: rounding of 1e-16 amplified past
                # TOL on either side (seed 1043: 8.7e-9, the same on both back ends). Not drawn.
                eff = {**ctor, **own}
                own["betas"] = (eff["betas"][0], max(eff["betas"][1], 0.5))
                own["eps"] = max(eff["eps"], 1e-6)
            own["galore_omit"] = [k for k in ("update_proj_gap", "scale", "proj_type") if rng.random() < 0.15]
        groups.append(dict(own=own, shapes=shapes))
    steps = rng.randint(8, 15) if backend == "torch" else rng.randint(8, 10)
    nparams = sum(len(g["shapes"]) for g in groups)
    none_p = rng.choice([0.0, 0.1, 0.25])
    none = [[rng.random() < none_p for _ in range(nparams)] for _ in range(steps)]
    zero_init = [rng.random() < 0.1 for _ in range(nparams)]
    scales = [rng.choice([1.0, 1.0, 1e-3, 30.0]) for _ in range(nparams)]
    cfg = dict(seed=seed, opt=opt, backend=backend, nbits=nbits, ctor=ctor, groups=groups, steps=steps, none=none,
               zero_init=zero_init, scales=scales)
    if seed >= EXTRAS_FROM:
        cfg.update(_draw_extras(random.Random(seed * 31 + 7), cfg, drawer))
    return cfg


# Keys a group may change between steps, both sides reading it at the next step (galore-torch keeps the first
# step's update_proj_gap and scale: a documented deviation, not drawn; layout keys are refused once there is state).
CHANGEABLE = dict(adafactor=("eps", "clip_threshold", "decay_rate", "weight_decay", "scale_parameter", "beta1", "lr"),
                  came=("lr", "eps", "clip_threshold", "betas", "weight_decay"),
                  lamb=("lr", "betas", "eps", "weight_decay", "bias_correction", "max_trust_ratio"),
                  adamw8bit=("lr", "betas", "eps", "weight_decay"),
                  galore=("lr", "betas", "eps", "weight_decay", "correct_bias"),
                  galore8=("lr", "betas", "eps", "weight_decay", "correct_bias"))


def _draw_extras(rng, cfg, drawer):
    """A separate stream (the base draw stays as it was): hyperparameters changed between steps, params and
    grads in transposed memory, option values as numpy scalars and lists."""
    opt = cfg["opt"]
    changes = []
    for _ in range(rng.choice([0, 0, 1, 2])):
        t = rng.randint(2, cfg["steps"] - 1)
        gi = rng.randrange(len(cfg["groups"]))
        key = rng.choice(CHANGEABLE[opt])
        eff = {**cfg["ctor"], **cfg["groups"][gi]["own"]}
        val = drawer(rng)[key]
        if opt == "adafactor":
            if key == "lr" and eff["relative_step"]:
                continue  # ignored with relative_step (README); not a comparison of anything
            if key == "lr" and val is None:
                val = 0.02
            if key == "beta1" and (eff["beta1"] is None) != (val is None):
                continue  # transformers makes exp_avg at the first step only: switching raises there
        changes.append([t, gi, key, val])
    nparams = sum(len(g["shapes"]) for g in cfg["groups"])
    noncontig = [rng.random() < 0.2 for _ in range(nparams)]
    grad_noncontig = rng.random() < 0.2
    numpy_keys = [k for k in cfg["ctor"] if rng.random() < 0.1]
    # Lamb, GaLore 8-bit: a group of its own nbits (a group key), taking the 8-bit keys from the defaults
    group_nbits = {}
    if opt in ("lamb", "galore8"):
        for gi in range(1, len(cfg["groups"])):
            if rng.random() < 0.4:
                group_nbits[gi] = rng.choice([8, 32])
    add_later = len(cfg["groups"]) > 1 and rng.random() < 0.3
    # our optimizer replaced at this step (before it) by a new one loaded from its state_dict (saved and loaded
    # through torch.save / torch.load(weights_only=True))
    reload_at = rng.randint(1, cfg["steps"] - 1) if rng.random() < 0.25 else None
    tensor_lr = rng.random() < 0.15  # the constructor's lr as a 0-dim float64 CPU tensor (README: lr may be one)
    return dict(changes=changes, noncontig=noncontig, grad_noncontig=grad_noncontig, numpy_keys=numpy_keys,
                group_nbits=group_nbits, add_later=add_later, reload_at=reload_at, tensor_lr=tensor_lr)


def _as_numpy(v):
    import numpy as np
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, float):
        return np.float64(v)
    if isinstance(v, int):
        return np.int64(v)
    if isinstance(v, (tuple, list)):
        return [_as_numpy(x) for x in v]  # a list of numpy scalars for a tuple
    return v


# ---------------------------------------------------------------------------------------------------- references
def _adam_moments(s: dict, g, b1: float, b2: float):
    """The step count after this step and Adam's new m and v of a param's state `s` (made at its first step)."""
    if "step" not in s:
        s.update(step=0, exp_avg=torch.zeros_like(g), exp_avg_sq=torch.zeros_like(g))
    s["step"] += 1
    return s["step"], b1 * s["exp_avg"] + (1 - b1) * g, b2 * s["exp_avg_sq"] + (1 - b2) * g * g


def _stepped(opt):
    """(group, param, its state) of the params a reference steps now: those with a gradient and an element."""
    for gr in opt.param_groups:
        for p in gr["params"]:
            if p.grad is not None and p.numel() > 0:
                yield gr, p, opt.state[p]


class LambRef(torch.optim.Optimizer):
    """LAMB as fastopt/reference/lamb.py's docstring (and tests/test_lamb.py's lamb_reference) states it, float64,
    per param step counts; with nbits=8, m and v of params of >= min_8bit_size elements stored through the 8-bit
    format after every step."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True,
                 max_trust_ratio=None, nbits=32, block_size=256, min_8bit_size=4096):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, max_trust_ratio=max_trust_ratio, nbits=nbits,
                                      block_size=block_size, min_8bit_size=min_8bit_size))

    @torch.no_grad()
    def step(self):
        for gr, p, s in _stepped(self):
            b1, b2 = gr["betas"]
            t, m, v = _adam_moments(s, p.grad, b1, b2)
            a = m / (v.sqrt() + gr["eps"]) + gr["weight_decay"] * p
            pn, an = p.norm().item(), a.norm().item()
            r = pn / an if pn > 0 and an > 0 else 1.0
            if gr["max_trust_ratio"] is not None:
                r = min(r, gr["max_trust_ratio"])
            eta = gr["lr"] * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if gr["bias_correction"] else gr["lr"]
            p.sub_(eta * r * a)
            if gr["nbits"] == 8 and p.numel() >= gr["min_8bit_size"]:
                m, v, s["codes"] = through_8bit(m, v, gr["block_size"])
            s["exp_avg"], s["exp_avg_sq"] = m, v


class AdamW8Ref(torch.optim.Optimizer):
    """torch.optim.AdamW's update in float64 (tests/test_adamw8bit.py's _adamw8bit_reference), per param step
    counts, m and v of params of >= min_8bit_size elements stored through the 8-bit format after every step."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, block_size=256,
                 min_8bit_size=4096):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size,
                                      min_8bit_size=min_8bit_size))

    @torch.no_grad()
    def step(self):
        for gr, p, s in _stepped(self):
            b1, b2 = gr["betas"]
            lr = gr["lr"]
            t, m, v = _adam_moments(s, p.grad, b1, b2)
            denom = v.sqrt() / math.sqrt(1 - b2 ** t) + gr["eps"]
            p.copy_(p * (1 - lr * gr["weight_decay"]) - lr / (1 - b1 ** t) * m / denom)
            if p.numel() >= gr["min_8bit_size"]:
                m, v, s["codes"] = through_8bit(m, v, gr["block_size"])
            s["exp_avg"], s["exp_avg_sq"] = m, v


class GaLore8Ref(torch.optim.Optimizer):
    """galore-torch's GaLoreAdamW step (its projector, its refresh rule, its weight decay after the update), float64,
    with m and v of >= min_8bit_size elements (the moments' count: the projected shape) stored through the 8-bit
    format after every step (tests/test_galore.py's galore8_reference, per param and per group)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True,
                 block_size=256, min_8bit_size=4096, nbits=8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      correct_bias=correct_bias, block_size=block_size, min_8bit_size=min_8bit_size,
                                      nbits=nbits))

    @torch.no_grad()
    def step(self):
        GaLoreProjector = _fixed_projector()
        for gr, p, s in _stepped(self):
            b1, b2 = gr["betas"]
            g = p.grad
            if "rank" in gr:
                if "projector" not in s:
                    s["projector"] = GaLoreProjector(gr["rank"], update_proj_gap=gr["update_proj_gap"],
                                                     scale=gr["scale"], proj_type=gr["proj_type"])
                g = s["projector"].project(g, s.get("step", 0))
            t, m, v = _adam_moments(s, g, b1, b2)
            eta = gr["lr"] * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if gr["correct_bias"] else gr["lr"]
            n = m / (v.sqrt() + gr["eps"])
            if "rank" in gr:
                n = s["projector"].project_back(n)
            p.add_(n, alpha=-eta)
            if gr["weight_decay"] > 0:
                p.add_(p, alpha=-gr["lr"] * gr["weight_decay"])
            if gr["nbits"] == 8 and m.numel() >= gr["min_8bit_size"]:
                m, v, s["codes"] = through_8bit(m, v, gr["block_size"])
            s["exp_avg"], s["exp_avg_sq"] = m, v


def _fixed_projector():
    """galore-torch's GaLoreProjector with one fix: for proj_type="reverse_std", project_back decides the side by
    the low-rank gradient's shape (`low.shape[0] <= low.shape[1]`), which for a wide matrix (m < n, projected on the
    right: low is m x rank) with rank == m picks the left side and raises (mat1 and mat2 shapes cannot be
    multiplied); this one projects back on the side `project` chose. Where galore-torch does not raise, the two
    agree (same products)."""
    from galore_torch.galore_projector import GaLoreProjector

    class Fixed(GaLoreProjector):
        def project(self, full_rank_grad, iter):
            self._tall = full_rank_grad.shape[0] >= full_rank_grad.shape[1]
            return super().project(full_rank_grad, iter)

        def project_back(self, low_rank_grad):
            if self.proj_type == "reverse_std":
                full = (self.ortho_matrix @ low_rank_grad if self._tall else low_rank_grad @ self.ortho_matrix)
                return full * self.scale
            return super().project_back(low_rank_grad)

    return Fixed


GALORE_DEFAULTS = dict(update_proj_gap=200, scale=0.25, proj_type="std")  # README: a projected group's missing keys


def _build(cfg, params_ours, params_ref):
    """(ours, reference) over the drawn groups."""
    opt = cfg["opt"]
    ctor = dict(cfg["ctor"])
    ours_ctor = {k: _as_numpy(v) if k in cfg.get("numpy_keys", ()) else v for k, v in ctor.items()}
    if cfg.get("tensor_lr") and ctor.get("lr") is not None:
        ours_ctor["lr"] = torch.tensor(float(ctor["lr"]), dtype=torch.float64)
    ours_groups, ref_groups, i = [], [], 0
    for g in cfg["groups"]:
        n = len(g["shapes"])
        own = {k: v for k, v in g["own"].items() if k not in ("galore", "galore_omit")}
        gi = len(ours_groups)
        nb = cfg.get("group_nbits", {})
        if gi in nb or str(gi) in nb:
            own["nbits"] = nb.get(gi, nb.get(str(gi)))
        og = dict(params=params_ours[i:i + n], **own)
        rg = dict(params=params_ref[i:i + n] if params_ref is not None else [], **own)
        if "galore" in g["own"]:
            gal = g["own"]["galore"]
            og.update({k: v for k, v in gal.items() if k not in g["own"]["galore_omit"]})
            rg.update({**gal, **{k: GALORE_DEFAULTS[k] for k in g["own"]["galore_omit"]}})
        ours_groups.append(og)
        ref_groups.append(rg)
        i += n
    if opt == "adafactor":
        from transformers.optimization import Adafactor as HF
        mk_ours, mk_ref = (lambda gs: fastopt.Adafactor(gs, **ours_ctor)), (lambda gs: HF(gs, **ctor))
    elif opt == "came":
        from came_pytorch import CAME
        mk_ours, mk_ref = (lambda gs: fastopt.CAME(gs, **ours_ctor)), (lambda gs: CAME(gs, **ctor))
    elif opt == "lamb":
        extra = dict(nbits=cfg["nbits"])
        mk_ours = lambda gs: fastopt.Lamb(gs, **ours_ctor, **extra)  # noqa: E731
        mk_ref = lambda gs: LambRef(gs, **ctor, **extra)  # noqa: E731
    elif opt == "adamw8bit":
        mk_ours, mk_ref = (lambda gs: fastopt.AdamW8bit(gs, **ours_ctor)), (lambda gs: AdamW8Ref(gs, **ctor))
    elif opt == "galore":
        import galore_torch
        import galore_torch.adamw
        galore_torch.adamw.GaLoreProjector = _fixed_projector()  # see _fixed_projector: a galore-torch bug
        mk_ours = lambda gs: fastopt.GaLoreAdamW(gs, **ours_ctor)  # noqa: E731
        mk_ref = lambda gs: galore_torch.GaLoreAdamW(gs, **ctor, no_deprecation_warning=True)  # noqa: E731
    elif opt == "galore8":
        if cfg["seed"] % 2:
            mk_ours = lambda gs: fastopt.GaLoreAdamW8bit(gs, **ours_ctor)  # noqa: E731
        else:
            mk_ours = lambda gs: fastopt.GaLoreAdamW(gs, nbits=8, **ours_ctor)  # noqa: E731
        mk_ref = lambda gs: GaLore8Ref(gs, **ctor)  # noqa: E731
    else:
        raise ValueError(opt)
    if params_ref is None:
        mk_ref = lambda gs: None  # noqa: E731
    if not cfg.get("add_later"):
        return mk_ours(ours_groups), mk_ref(ref_groups)
    ours, ref = mk_ours(ours_groups[:1]), mk_ref(ref_groups[:1])
    for og, rg in zip(ours_groups[1:], ref_groups[1:]):
        ours.add_param_group(og)
        if ref is not None:
            ref.add_param_group(rg)
    return ours, ref


def _build_ours_only(cfg, params):
    return _build(cfg, params, None)[0]


# ---------------------------------------------------------------------------------------------------- comparing
def _nonfinite_differ(a, b) -> bool:
    """Whether a and b hold NaN, inf and -inf at other elements."""
    pat = lambda y: (y.detach().isnan(), y.detach() == math.inf, y.detach() == -math.inf)  # noqa: E731
    return not all(torch.equal(u, v) for u, v in zip(pat(a), pat(b)))


def _rel(a, b, scale=None):
    """||a - b|| / ||b||, or over `scale` (the largest ||b|| this state has had: a moment that cancels to near 0
    at one step, m = beta1 m + (1 - beta1) u with the two terms nearly opposite, keeps the absolute error of its
    terms), non-finite elements required in the same places."""
    a, b = a.double(), b.double()
    if not torch.isfinite(b).all() or not torch.isfinite(a).all():
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        if not torch.equal(fa, fb) or not torch.equal(a[~fa].isnan(), b[~fb].isnan()):
            return math.inf
        a, b = a[fa], b[fb]
    d = (a - b).norm().item()
    n = b.norm().item() if scale is None else max(scale, b.norm().item())
    return d / n if n > 0 else (0.0 if d == 0 else math.inf)


def _scale(ref, q, key):
    """The largest norm the reference's state `key` of q has had (finite elements), updated with its value now."""
    scales = ref.__dict__.setdefault("_fuzz_scales", {})
    x = ref.state[q][key].double()
    x = x[torch.isfinite(x)]
    scales[(id(q), key)] = max(scales.get((id(q), key), 0.0), x.norm().item())
    return scales[(id(q), key)]


def _compare_state(cfg, opt, ref, p, q, k, t):
    """Differences between our state of param p and the reference's of q: a list of strings."""
    bad = []
    st, rs = opt.state[p], ref.state[q]
    if q.numel() == 0:
        if st:
            bad.append(f"step {t} param {k}: empty param has state {sorted(st)}")
        return bad
    if not rs:
        if st and float(st.get("step", 0)) != 0:
            bad.append(f"step {t} param {k}: reference has no state, ours {sorted(st)}")
        return bad
    if not st:
        return [f"step {t} param {k}: no state (reference has {sorted(rs)})"]
    if float(st["step"]) != float(rs["step"]):
        bad.append(f"step {t} param {k}: step {float(st['step'])} vs reference's {float(rs['step'])}")
    name = cfg["opt"]
    if name in FACTORED:
        keys = [key for key in ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row",
                                "exp_avg_res_col", "exp_avg_sq") if key in rs]
        have = set(st) - {"step"}
        if have != set(keys):
            bad.append(f"step {t} param {k}: state keys {sorted(have)} vs reference's {sorted(keys)}")
        for key in keys:
            if key in st:
                e = _rel(st[key], rs[key], _scale(ref, q, key))
                if not e <= TOL:
                    bad.append(f"step {t} param {k}: state {key} off by {e:.3g}")
        return bad
    keymap = dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq")
    if name == "adamw8bit":
        keymap = dict(exp_avg="state1", exp_avg_sq="state2")
    codes = rs.get("codes")
    for rk, ok in keymap.items():
        x = st[ok]
        if codes is not None:
            want = codes[0] if rk == "exp_avg" else codes[1]
            if x.dtype != torch.uint8:
                bad.append(f"step {t} param {k}: {ok} is {x.dtype}, the reference keeps it 8-bit")
            elif not torch.equal(x.reshape(-1), want.reshape(-1)):
                nd = int((x.reshape(-1).int() - want.reshape(-1).int()).ne(0).sum())
                mx = int((x.reshape(-1).int() - want.reshape(-1).int()).abs().max())
                bad.append(f"step {t} param {k}: {ok} codes: {nd} of {want.numel()} differ (max by {mx})")
        else:
            if x.dtype == torch.uint8:
                bad.append(f"step {t} param {k}: {ok} is 8-bit, the reference keeps it in float64")
            else:
                e = _rel(x.reshape(rs[rk].shape) if x.numel() == rs[rk].numel() else x, rs[rk], _scale(ref, q, rk))
                if not e <= TOL:
                    bad.append(f"step {t} param {k}: state {ok} off by {e:.3g}")
    if name in ("galore", "galore8") and "projector" in rs:
        proj = rs["projector"]
        if proj.ortho_matrix is not None:
            mats = proj.ortho_matrix if isinstance(proj.ortho_matrix, list) else [proj.ortho_matrix]
            ours = [st[key] for key in ("proj_left", "proj_right") if key in st]
            if len(ours) != len(mats):
                bad.append(f"step {t} param {k}: bases {[key for key in st if key.startswith('proj')]} vs "
                           f"{len(mats)} of the reference's")
            else:
                for a, b in zip(ours, mats):
                    if a.shape != b.shape or not torch.equal(a, b.to(a.dtype)):
                        bad.append(f"step {t} param {k}: basis {tuple(a.shape)} vs {tuple(b.shape)} differs "
                                   f"({_rel(a, b) if a.shape == b.shape else 'shape'})")
    return bad


def _reloaded(cfg, opt, params):
    """A new optimizer of ours over the same params, built as the first was, loaded with opt's state_dict."""
    import io
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    new = _build_ours_only(cfg, params)
    new.load_state_dict(sd)
    return new


def _transposed(x):
    """x's values in memory with its last two dims swapped (a non-contiguous tensor, as a transposed weight)."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def run(cfg: dict, stop_at_first: bool = True) -> tuple[list, float]:
    """The drawn run; (failures, largest relative update error seen)."""
    os.environ["FASTOPT_BACKEND"] = cfg["backend"]
    from fastopt.kernels import common
    common.POISON = cfg["backend"] == "triton"
    g = torch.Generator().manual_seed(cfg["seed"] * 7919 + 1)
    shapes = [s for gr in cfg["groups"] for s in gr["shapes"]]
    init = [torch.zeros(s, dtype=torch.float64) if z else torch.randn(s, generator=g, dtype=torch.float64)
            for s, z in zip(shapes, cfg["zero_init"])]
    init = [_transposed(x) if nc and x.dim() >= 2 else x for x, nc in zip(init, cfg.get("noncontig", [False] * 99))]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) * c * (1 + 0.3 * t) for s, c in
              zip(shapes, cfg["scales"])] for t in range(cfg["steps"])]
    ours = [x.clone().requires_grad_() for x in init]
    theirs = [x.clone().requires_grad_() for x in init]
    worst = 0.0
    try:
        opt, ref = _build(cfg, ours, theirs)
    except Exception as e:  # noqa: BLE001 - a constructor failure is a finding, reported with its traceback
        return [f"constructor: {type(e).__name__}: {e}"], worst
    bad = []
    path = [0.0] * len(init)
    prev = [x.clone() for x in init]
    for t in range(cfg["steps"]):
        for k, (p, q) in enumerate(zip(ours, theirs)):
            if cfg["none"][t][k]:
                p.grad = q.grad = None
            else:
                gr = grads[t][k]
                if cfg.get("grad_noncontig") and gr.dim() >= 2:
                    gr = _transposed(gr)
                p.grad, q.grad = gr.clone(), gr.clone()
        if cfg.get("reload_at") == t:
            try:
                opt = _reloaded(cfg, opt, ours)
            except Exception as e:  # noqa: BLE001
                tb = traceback.format_exc().strip().splitlines()[-4:]
                return bad + [f"before step {t + 1}: state_dict reload raised {type(e).__name__}: {e} | "
                              + " / ".join(tb)], worst
        for when, gi, key, val in cfg.get("changes", ()):
            if when == t:
                for o in (opt, ref):
                    o.param_groups[gi][key] = tuple(val) if isinstance(val, list) else val
        try:
            ref.step()
        except Exception as e:  # noqa: BLE001
            return bad + [f"step {t + 1}: REFERENCE raised {type(e).__name__}: {e}"], worst
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc().strip().splitlines()[-4:]
            return bad + [f"step {t + 1}: fastopt raised {type(e).__name__}: {e} | " + " / ".join(tb)], worst
        for k, (p, q, x) in enumerate(zip(ours, theirs, init)):
            if x.numel() == 0:
                if p.shape != x.shape:
                    bad.append(f"step {t + 1} param {k}: empty param changed shape")
                continue
            if not torch.isfinite(q).all() or not torch.isfinite(p).all():
                if _nonfinite_differ(p, q):
                    bad.append(f"step {t + 1} param {k} {tuple(x.shape)}: non-finite pattern differs "
                               f"(ours {int((~torch.isfinite(p)).sum())}, reference {int((~torch.isfinite(q)).sum())})")
                continue
            # The update's size: the reference's path length (the sum of its steps' sizes, never below ||ref -
            # init||): a param that steps back and forth (a 0-d param clipped to +-lr * clip_threshold) can land
            # on or next to where it started, and the rounding of its steps stays.
            path[k] += (q.detach() - prev[k]).norm().item()
            prev[k] = q.detach().clone()
            den = path[k]
            num = (p.detach() - q.detach()).norm().item()
            if den == 0:
                if num != 0 or not torch.equal(p.detach(), x):
                    bad.append(f"step {t + 1} param {k} {tuple(x.shape)}: reference did not move, ours moved {num:.3g}")
                continue
            e = num / den if math.isfinite(num) else math.inf
            worst = max(worst, e)
            if not e <= TOL:
                bad.append(f"step {t + 1} param {k} {tuple(x.shape)}: relative update error {e:.3g}")
            bad += _compare_state(cfg, opt, ref, p, q, k, t + 1)
        if bad and stop_at_first:
            break
    return bad, worst


# ---------------------------------------------------------------------------------------------------- pytest
# Base draws whose runs needed the test's own care (a param stepping back to where it started: path length; GaLore
# "full" at rank = a dim with beta2 = 0, eps = 0); one extras seed per optimizer and back end (changed keys, reloads,
# groups added later, per-group nbits, transposed params); and two np.float64 options saved and reloaded through
# torch.load(weights_only=True) (fastopt/optim/base.py: plain() kept np.float64 a numpy scalar before 2026-12-02).
FIXED_SEEDS = [678, 1043, 1051, 2365,
               100053, 100191, 100221, 100344, 100819, 100979, 101183, 101233, 101518, 101971, 102523, 102716,
               100698, 101916]


def seed_env(cfg, monkeypatch) -> None:
    """A fixed seed's test: skipped where its Triton kernels cannot run (no TRITON_INTERPRET=1 on CPU), on its
    back end, with the kernels' POISON put back after it."""
    if cfg["backend"] == "triton" and not (ops.triton_available() and ops.interpreting()):
        pytest.skip("Triton seeds need TRITON_INTERPRET=1")
    monkeypatch.setenv("FASTOPT_BACKEND", cfg["backend"])
    from fastopt.kernels import common
    monkeypatch.setattr(common, "POISON", common.POISON)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("seed", FIXED_SEEDS)
def test_options_fuzz_fixed_seeds(seed, monkeypatch):
    cfg = draw(seed)
    seed_env(cfg, monkeypatch)
    bad, _ = run(cfg)
    assert not bad, "\n".join([json.dumps(cfg)] + bad)


def test_references_written_here_agree_with_torch_and_the_suites():
    """AdamW8Ref with 32-bit state is torch.optim.AdamW; LambRef is tests/test_lamb.py's lamb_reference; GaLore8Ref
    with 32-bit state is galore-torch's GaLoreAdamW (std, 7 steps, refreshes at 1, 4, 7): float64, 10 steps."""
    import galore_torch
    from test_lamb import lamb_reference
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 7), (9,), ()]
    init = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) for s in shapes] for _ in range(10)]

    def go(make, init=init, grads=grads):
        ps = [x.clone().requires_grad_() for x in init]
        opt = make(ps)
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        return [p.detach() for p in ps]

    kw = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1)
    a = go(lambda ps: AdamW8Ref(ps, **kw, min_8bit_size=10 ** 9))
    b = go(lambda ps: torch.optim.AdamW(ps, **kw))
    assert all(_rel(x - x0, y - x0) <= TOL for x, y, x0 in zip(a, b, init))
    kw = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1, bias_correction=True, max_trust_ratio=2.0)
    a = go(lambda ps: LambRef(ps, **kw))
    b = lamb_reference(init, grads, **kw)[0]
    assert all(_rel(x - x0, y - x0) <= TOL for x, y, x0 in zip(a, b, init))
    mats = [(8, 5), (4, 9)]
    init2 = [torch.randn(s, generator=g, dtype=torch.float64) for s in mats]
    grads2 = [[torch.randn(s, generator=g, dtype=torch.float64) for s in mats] for _ in range(7)]
    grp = dict(rank=2, update_proj_gap=3, scale=0.5, proj_type="std")
    kw = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    a = go(lambda ps: GaLore8Ref([dict(params=ps, **grp)], **kw, nbits=32), init2, grads2)
    b = go(lambda ps: galore_torch.GaLoreAdamW([dict(params=ps, **grp)], **kw, no_deprecation_warning=True),
           init2, grads2)
    assert all(_rel(x - x0, y - x0) <= TOL for x, y, x0 in zip(a, b, init2))


# ---------------------------------------------------------------------------------------------------- CLI
def main(argv):
    import warnings
    warnings.filterwarnings("ignore")
    if argv[0] == "--show":
        print(json.dumps(draw(int(argv[1])), indent=1))
        return
    first, count = int(argv[0]), int(argv[1])
    out = open(argv[2], "a") if len(argv) > 2 else None
    fails = 0
    for seed in range(first, first + count):
        cfg = draw(seed)
        t0 = time.time()
        bad, worst = run(cfg)
        dt = time.time() - t0
        fails += bool(bad)
        rec = dict(seed=seed, opt=cfg["opt"], backend=cfg["backend"], ok=not bad, worst=worst, secs=round(dt, 2),
                   bad=bad[:5])
        print(json.dumps(rec), flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()
    print(f"{fails} of {count} seeds failed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
