"""A randomized differential test of fastopt.ZeroRedundancyOptimizer (ZeRO-1/2) against torch's AdamW in one process.

A seed draws a run: a model (Net, Partial, Wide: a split param), partition_grad, overlap, and 8-12 steps, each a
sequence of ordinary training operations applied alike to a single-process reference (torch.optim.AdamW over the
whole batch, in the same micro-batches) and to a ZeRO-wrapped copy on 4 gloo ranks (each rank its share): zero_grad
through the wrapper or the model (set_to_none True/False) or none (accumulation across steps), 1-2 micro-batches
(from seed 1000 on, at times none), params frozen/unfrozen at several points (before backward, between
micro-batches, after backward, around clip_grad_norm_), clip_grad_norm_ (between micro-batches or after backward), a
param unused (detached) on some or all ranks for a step (the reference detaches it for those ranks' rows),
torch.autograd.grad over the params, a deepcopy of (model, opt), a consolidated state_dict loaded back (into the
same wrapper, or into a new wrapper over a new inner optimizer). The reference mirrors the wrapper's documented
choices: a frozen param is not stepped (its gradient is hidden from torch's step), and clip_grad_norm_ measures the
params that require a gradient (and scales every gradient present).

From seed 2000 on (a stream of its own, drawn after the others: the lower seeds' runs stay as they were), the
wrapped optimizer is at times torch's fused AdamW (both sides), and most runs train with a loss scaler:
fastopt.ZeroGradScaler around the wrapper, torch.amp.GradScaler around the reference (init_scale 2**12,
growth_interval 2), every backward of a scaled loss, some steps with a non-finite element put into one param's
gradient from one rank's share (a tensor hook: on that rank alone; in the reference, always), clip_grad_norm_ after
the backward preceded by unscale_ (between micro-batches: on the scaled gradients, no unscale_), and the step
`scaler.step(opt); scaler.update()`; the scales after each step and the steps skipped must be the same. With a
scaler, the reference's frozen params are stepped by torch and put back (param and state), so that torch's
scaler unscales and checks their gradients as in one process; a copy drawn after an unscale_ of its step is not
made (the copy is a new optimizer to the scaler, which would unscale its gradients again); a step whose reference
holds no gradient at all steps without the scaler (GradScaler refuses it: "No inf checks were recorded").

From seed 5000 on (FASTOPT_FROM, a stream of its own: the lower seeds' runs stay as they were), the wrapped
optimizer is one of fastopt's, drawn as test_checkpoint_fuzz draws it (test_layouts_fuzz's random options, 1-2 param
groups): Adafactor (beta1 or none, relative_step, scale_parameter, warmup_init, clip_threshold, weight decay), CAME
(32-bit or nbits=8), Lamb (32-bit or 8-bit), AdamW8bit (32-bit states through min_8bit_size, or 8-bit), GaLoreAdamW
and GaLoreAdamW8bit (update_proj_gap 1-3: refreshes inside the run); 8-bit states in blocks of 64, 128 or 256 with
min_8bit_size=0, so that each piece of a split param holds several blocks. The model is Wide or a Rand model (one
or two params of >= 4 * 4096 elements, more than a fair share: split over the 4 ranks; at times 3-D, at times of a
multiple of 4 * 4096 elements), with the same operations as above and, 7 runs in 10, the loss scaler
(ZeroGradScaler; fastopt's optimizers take the verdict on the device). The reference is the same optimizer with
the same options in one process on the whole batch, float64, on the torch back end; the wrapped one runs on the
torch back end, or (about 1 run in 10 of the optimizers with Triton kernels) on the Triton kernels where they can
run (TRITON_INTERPRET=1 on CPU; else on the torch back end). Besides the params after every step (the same bound,
8-bit states included: their blocks coincide with one process's, README), the consolidated state after the last
step must equal the reference's: keys, step counts, float tensors within 1e-9 relative to their largest element,
8-bit codes bit for bit (a split param frozen before its first step holds no state, as in one process). A run
must split a param.

A failure: a relative update error > 1e-9 (float64), ranks holding different params, an exception, or a hang.

    python tests/test_zero_fuzz.py FIRST_SEED COUNT [OUT.jsonl]   # many seeds, one line per seed
    python tests/test_zero_fuzz.py --show SEED                     # the drawn sequence of a seed
    python tests/test_zero_fuzz.py --one SEED [KEY=JSON ...] [upto=N]   # one seed, cfg keys replaced, N steps
(TRITON_INTERPRET=1 for the runs drawn on the Triton kernels; FUZZ_ONLY=triton|torch runs those alone.)
"""
from __future__ import annotations

import copy
import json
import os
import random
import sys
import time

import pytest
import torch
from torch.func import functional_call

import test_checkpoint_fuzz as cf
from conftest import TOL
from test_zero import (BUCKET_MB, LOCAL_BATCH, Net, Partial, Wide, _param_maker, _poison, _state_err,
                       _step_skipping_frozen, batch, make_opt)

import fastopt
from fastopt import ZeroGradScaler, ZeroRedundancyOptimizer

DT = torch.float64
MODELS = {"Net": Net, "Partial": Partial, "Wide": Wide}
TOGGLE = {"Net": ["emb", "w1", "b1", "w2", "w3"], "Partial": ["w1", "b2", "w3", "odd", "first", "unused"],
          "Wide": ["big", "w", "b", "w3"]}
DROP = {"Net": ["emb", "w1", "b2", "w3"], "Partial": ["w1", "odd", "first", "w3"], "Wide": ["big", "w", "w3", "b"]}
SCALER_ARGS = dict(init_scale=2.0 ** 12, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
# From this seed on, the wrapped optimizer is one of fastopt's (a stream of its own: the module docstring)
FASTOPT_FROM = 5000
# test_checkpoint_fuzz's variants: Adafactor, CAME (32/8-bit), Lamb (32/8-bit), AdamW8bit (32-bit states through
# min_8bit_size, or 8-bit), GaLoreAdamW, GaLoreAdamW8bit
FASTOPTS = cf.OPTS
EIGHT = cf.EIGHT
TRITON_OPTS = cf.TRITON_OPTS


class Rand(torch.nn.Module):
    """A random model of the fastopt stream: `big` (n_in x h, or 2 x n_in/2 x h applied per half of the input) and
    at times `big2` (H x h2), each >= 4 * 4096 elements and more than a fair share (split over 4 ranks; at times a
    multiple of 4 * 4096: gathered in place), then w (k x H'), b (k), w3 (k x 3), gain (3), as Wide."""

    def __init__(self, m: dict, seed=0):
        super().__init__()
        self.m = dict(m)
        P = _param_maker(seed)
        n_in, h, k = m["n_in"], m["h"], m["k"]
        self.big = P(2, n_in // 2, h, scale=0.1) if m["three"] else P(n_in, h, scale=0.1)
        hid = 2 * h if m["three"] else h
        if m["h2"]:
            self.big2 = P(hid, m["h2"], scale=0.1)
            hid = m["h2"]
        self.w = P(k, hid, scale=0.2)
        self.b = P(k, scale=0.1)
        self.w3 = P(k, 3)
        self.gain = P(3, scale=1.0)

    def forward(self, x):
        if self.m["three"]:
            h = torch.einsum("bgi,gih->bgh", x.reshape(x.shape[0], 2, -1), self.big).reshape(x.shape[0], -1)
        else:
            h = x @ self.big
        h = torch.tanh(h)
        if self.m["h2"]:
            h = torch.tanh(h @ self.big2)
        return ((h @ self.w.T + self.b) @ self.w3) * self.gain


def _build(cfg):
    """A fresh model of the run (the same weights every time)."""
    return Rand(cfg["model"]) if cfg["kind"] == "Rand" else MODELS[cfg["kind"]]()


def _n_in(cfg):
    return {"Wide": Wide.N_IN, "Rand": (cfg.get("model") or {}).get("n_in")}.get(cfg["kind"], 11)


def _make(cfg, model):
    """The run's optimizer over `model`: torch's (AdamW, AdamWFused: test_zero's factories) or fastopt's drawn one."""
    o = cfg.get("opt", "AdamW")
    if isinstance(o, dict):
        return cf.make_opt(o, dict(model.named_parameters()))
    return make_opt(o, model)


# ---- the forward, with params detached ("unused") per call ---------------------------------------------------
def _out(model, kind, x, drop):
    """The model's own forward with the params named in `drop` detached; Partial adds its `odd` and `first`."""
    params = {n: getattr(model, n).detach() for n in drop}
    out = functional_call(model, params, (x,))
    if kind == "Partial":
        P = lambda n: params.get(n, getattr(model, n))  # noqa: E731
        out = out * P("odd") + torch.tanh(x[:, :3] * P("first"))
    return out


def _loss(model, kind, x, y, drop):
    return ((_out(model, kind, x, drop) - y) ** 2).mean()


# ---- drawing a run ------------------------------------------------------------------------------------------
def draw(seed: int, world: int = 4) -> dict:
    if seed >= FASTOPT_FROM:
        return _draw_fastopt(seed, world)
    rnd = random.Random(seed)
    kind = rnd.choice(list(MODELS))
    cfg = dict(seed=seed, kind=kind, partition_grad=rnd.random() < 0.6, overlap=rnd.random() < 0.5, steps=[])
    _draw_steps(rnd, cfg, TOGGLE[kind], DROP[kind], world)
    if seed >= 2000:
        _draw_amp(cfg, world)
    return cfg


def _draw_steps(rnd, cfg: dict, toggle: list, drop: list, world: int) -> None:
    """cfg["steps"]: 8-12 steps of ordinary operations (the module docstring); `toggle`, `drop`: the params that
    may be frozen/unfrozen, and unused."""
    seed, kind = cfg["seed"], cfg["kind"]
    n = rnd.randint(8, 12)
    frozen: set = set()
    for s in range(n):
        st = {}
        st["zero"] = rnd.choice(["opt_none", "opt_zeros", "model_none", "model_zeros", "skip"])
        if st["zero"] in ("opt_none", "model_none") and rnd.random() < 0.12:
            st["newwrap"] = True
        st["accum"] = rnd.choice([1, 2])
        if rnd.random() < 0.35:
            st["drop"] = []
            for name in rnd.sample(drop, rnd.randint(1, 2)):
                c = rnd.random()
                ranks = list(range(world)) if c < 0.3 else sorted(rnd.sample(range(world), rnd.randint(1, world - 1)))
                st["drop"].append((name, ranks))
        points = ["pre", "post"] + (["mid"] if st["accum"] == 2 else [])
        st["clip"] = None
        if rnd.random() < 0.4:
            st["clip"] = (rnd.choice(["post", "post", "mid"] if st["accum"] == 2 else ["post"]),
                          rnd.choice([0.05, 1e3]))
            if st["clip"][0] == "post":
                points += ["preclip", "postclip"]
        toggles = []
        if rnd.random() < 0.45:
            for _ in range(rnd.randint(1, 2)):
                name = rnd.choice(toggle)
                toggles.append((rnd.choice(points), name))
        st["toggles"] = toggles
        for _, name in toggles:
            frozen ^= {name}
        if rnd.random() < 0.15:
            st["agrad"] = rnd.choice(["post", "after_step"] + (["mid"] if st["accum"] == 2 else []))
        if rnd.random() < 0.12:
            st["copy"] = rnd.choice(["post"] + (["mid"] if st["accum"] == 2 else [])
                                    + (["postclip"] if st["clip"] and st["clip"][0] == "post" else []))
            # A copy drops a gradient that no hook saw (torch's Parameter.__deepcopy__ copies no .grad): a param
            # unfrozen in this step loses its own, not mirrored here; no toggles in a step with a copy.
            for _, name in st["toggles"]:
                frozen ^= {name}
            st["toggles"] = []
        if rnd.random() < 0.1:
            st["sd"] = "inplace"
        # From seed 1000 on, a step may run no backward (a stream of its own: the lower seeds' runs stay as they
        # were). Then a split param's gradient cleared or zeroed through the model is not seen (module docstring):
        # through the wrapper instead.
        extra = random.Random(f"{seed}/{s}")
        if seed >= 1000 and st["accum"] == 1 and extra.random() < 0.15:
            st["accum"] = 0
            if kind in ("Wide", "Rand") and cfg["partition_grad"] and st["zero"].startswith("model"):
                st["zero"] = "opt" + st["zero"][len("model"):]
        cfg["steps"].append(st)


def _draw_rand_model(rnd) -> dict:
    aligned = rnd.random() < 0.25  # numel a multiple of 4 * 4096: the pieces are gathered in place
    n_in = rnd.choice([64, 128]) if aligned else rnd.choice([64, 96, 128, 136])
    h = 16384 * rnd.choice([1, 2]) // n_in if aligned else -(-16384 // n_in) + rnd.randint(1, 150)
    m = dict(n_in=n_in, h=h, three=rnd.random() < 0.25, k=rnd.choice([4, 5, 7]), h2=None)
    if rnd.random() < 0.4:
        hid = 2 * h if m["three"] else h
        m["h2"] = -(-16384 // hid) + rnd.randint(0, 60)
    return m


def _draw_fastopt(seed: int, world: int) -> dict:
    """Seeds from FASTOPT_FROM: the wrapped optimizer one of fastopt's, with test_checkpoint_fuzz's random options
    (test_layouts_fuzz's, 8-bit ones with small blocks, GaLore's update_proj_gap 1-3), on Wide or a Rand model."""
    rnd = random.Random(seed)
    kind = rnd.choice(["Wide", "Rand"])
    cfg = dict(seed=seed, kind=kind, partition_grad=rnd.random() < 0.6, overlap=rnd.random() < 0.5, steps=[])
    if kind == "Rand":
        cfg["model"] = _draw_rand_model(rnd)
    shapes = {n: tuple(p.shape) for n, p in _build(cfg).named_parameters()}
    names = list(shapes)
    toggle = TOGGLE.get(kind) or names[:-1]  # Rand: all but gain
    drop = DROP.get(kind) or names[:-1]
    _draw_steps(rnd, cfg, toggle, drop, world)
    name = rnd.choice(FASTOPTS)
    o = cf.draw_variant(rnd, name, shapes, (64, 128, 256))
    cfg["opt"] = o
    _draw_amp(cfg, world, names)
    cfg["opt"] = o  # _draw_amp's draw of torch's AdamW is not used here
    triton = random.Random(f"{seed}/triton")
    cfg["backend"] = "triton" if name in TRITON_OPTS and triton.random() < 0.1 else "torch"
    return cfg


def _draw_amp(cfg: dict, world: int, names=None) -> None:
    """Seeds from 2000: the wrapped optimizer (torch's AdamW, at times fused), a loss scaler, and where it is on,
    the steps' non-finite gradient elements (step["poison"]: rank, param, place in it (0-1), value)."""
    rnd = random.Random(f"{cfg['seed']}/amp")
    cfg["opt"] = "AdamWFused" if rnd.random() < 0.3 else "AdamW"
    cfg["scaler"] = rnd.random() < 0.7
    names = names or [n for n, _ in MODELS[cfg["kind"]]().named_parameters()]
    for st in cfg["steps"]:
        if not cfg["scaler"]:
            continue
        if st.get("copy") and st["clip"] is not None and (st["clip"][0] == "post" or st["copy"] in ("post", "postclip")
                                                          or st["clip"][0] == st["copy"]):
            st["copy"] = None  # made after this step's unscale_: see the module docstring
        if rnd.random() < 0.3:
            r = rnd.randrange(world)
            dropped = {n for n, rs in (st.get("drop") or ()) if r in rs}
            name = rnd.choice([n for n in names if n not in dropped])
            st["poison"] = (r, name, rnd.random(), rnd.choice(["inf", "-inf", "nan"]))


# ---- one run on every rank ------------------------------------------------------------------------------
def _ref_clip(model, max_norm):
    """The wrapper's clip_grad_norm_: the norm over the gradients of params that require one, every gradient
    present scaled."""
    gs = [p.grad for p in model.parameters() if p.grad is not None and p.requires_grad]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs])) if gs \
        else torch.zeros((), dtype=DT)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)
    return total


def _new_wrapper(model, opt, cfg):
    full = opt.state_dict(consolidated=True, to=None)
    new = ZeroRedundancyOptimizer(_make(cfg, model), partition_grad=cfg["partition_grad"],
                                  overlap_communication=cfg["overlap"], bucket_size_mb=BUCKET_MB)
    new.load_state_dict(copy.deepcopy(full))
    return new


def _plan(model, cfg) -> dict:
    """The steps' non-finite elements as test_zero's `_poison` takes them: step -> (rank, (param,), index, value)."""
    params = dict(model.named_parameters())
    plan = {}
    for s, st in enumerate(cfg["steps"]):
        if st.get("poison"):
            r, name, where, v = st["poison"]
            n = params[name].numel()
            plan[s] = (r, (name,), min(int(where * n), n - 1), float(v))
    return plan


def _ref_amp_step(model, opt, scaler):
    """scaler.step(opt) in one process, with the fuzzer's frozen params not stepped: torch steps them (its scaler
    unscales and checks their gradients, a fused step unscales them in place), then they and their state are put
    back."""
    saved = []
    for p in model.parameters():
        if not p.requires_grad and p.grad is not None:
            st = opt.state.get(p)
            saved.append((p, p.detach().clone(), None if not st else
                          {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}))
    scaler.step(opt)
    with torch.no_grad():
        for p, data, st in saved:
            p.copy_(data)
            if st is None:
                opt.state.pop(p, None)
            else:
                opt.state[p] = st


class _Torch:
    """The reference's steps on the torch back end, whatever the run's (cfg["backend"])."""

    def __enter__(self):
        self.was = os.environ.get("FASTOPT_BACKEND")
        os.environ["FASTOPT_BACKEND"] = "torch"

    def __exit__(self, *exc):
        if self.was is None:
            os.environ.pop("FASTOPT_BACKEND", None)
        else:
            os.environ["FASTOPT_BACKEND"] = self.was


def _fuzz(rank, world, cfg, upto=None):
    os.environ["FASTOPT_BACKEND"] = cfg.get("backend", "torch")
    kind = cfg["kind"]
    n_in = _n_in(cfg)
    ref_model = _build(cfg)
    model = copy.deepcopy(ref_model)
    names = [n for n, _ in model.named_parameters()]
    init = [p.detach().clone() for p in ref_model.parameters()]
    ref_opt = _make(cfg, ref_model)
    opt = ZeroRedundancyOptimizer(_make(cfg, model), partition_grad=cfg["partition_grad"],
                                  overlap_communication=cfg["overlap"], bucket_size_mb=BUCKET_MB)
    split = sorted(opt._split.values())  # the first wrapper's (a later one's leaves a param frozen then whole)
    amp = cfg.get("scaler", False)
    now = [0]
    if amp:
        ref_scaler = torch.amp.GradScaler("cpu", **SCALER_ARGS)
        scaler = ZeroGradScaler("cpu", **SCALER_ARGS)
        plan = _plan(model, cfg)
        _poison(ref_model, plan, now)
        _poison(model, plan, now, rank)
    scaled = (lambda sc, loss: sc.scale(loss)) if amp else (lambda sc, loss: loss)  # noqa: E731
    ref_sc = sc = None
    if amp:
        ref_sc, sc = ref_scaler, scaler
    errs, ref_skips = [], []  # ref_skips: the steps that left the reference's params as they were (a scaler)
    steps = cfg["steps"] if upto is None else cfg["steps"][:upto]
    for s, st in enumerate(steps):
        now[0] = s
        unscaled = False  # unscale_ called in this step (both sides alike)
        x, y = batch(s, world, n_in=n_in)
        drops = [set(n for n, rs in (st.get("drop") or ()) if r in rs) for r in range(world)]
        accum = st["accum"]
        # zero_grad
        z = st["zero"]
        if z != "skip":
            none = z.endswith("none")
            (ref_opt.zero_grad if z.startswith("opt") else ref_model.zero_grad)(set_to_none=none)
            (opt.zero_grad if z.startswith("opt") else model.zero_grad)(set_to_none=none)
        if st.get("newwrap"):
            opt = _new_wrapper(model, opt, cfg)
            ref_opt.state_dict()  # fastopt's makes zero state for trainable params without one (kept): here too

        def at(point):
            nonlocal model, opt, unscaled
            for pt, name in st["toggles"]:
                if pt == point:
                    for m in (ref_model, model):
                        p = getattr(m, name)
                        p.requires_grad_(not p.requires_grad)
            if st.get("agrad") == point:
                ps = [p for p in model.parameters() if p.requires_grad]
                xs_ = x[rank * LOCAL_BATCH:rank * LOCAL_BATCH + 2]
                ys_ = y[rank * LOCAL_BATCH:rank * LOCAL_BATCH + 2]
                if ps:
                    torch.autograd.grad(scaled(sc, _loss(model, kind, xs_, ys_, set())), ps, allow_unused=True)
            if st["clip"] is not None and st["clip"][0] == point:
                at("preclip")
                # with a scaler: unscale_ first, after the backward and where the reference holds a gradient
                # (GradScaler's step refuses an optimizer whose unscale_ recorded no inf check)
                if amp and point == "post" and any(p.grad is not None for p in ref_model.parameters()):
                    ref_scaler.unscale_(ref_opt)
                    scaler.unscale_(opt)
                    unscaled = True
                ref_n = _ref_clip(ref_model, st["clip"][1])
                n = opt.clip_grad_norm_(st["clip"][1])
                at("postclip")
                if abs(float(n) - float(ref_n)) > 1e-9 * max(1.0, float(ref_n)):
                    errs.append(("clip_norm", s, float(n), float(ref_n)))
            if st.get("copy") == point:
                model, opt = copy.deepcopy((model, opt))
                if amp:  # a param's copy has no hooks (the wrapper registers its own)
                    _poison(model, plan, now, rank)
                if not cfg["partition_grad"]:  # ZeRO-1: the copy's params have no gradients, as in torch
                    for p in ref_model.parameters():
                        p.grad = None

        at("pre")
        for m in range(accum):
            if m:
                at("mid")
            # the reference: every rank's m-th micro-batch, weighted as the ranks weigh theirs
            ref_loss = 0
            for r in range(world):
                xr, yr = x[r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH], y[r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]
                xm, ym = xr.chunk(accum)[m], yr.chunk(accum)[m]
                ref_loss = ref_loss + _loss(ref_model, kind, xm, ym, drops[r]) * (xm.shape[0] / xr.shape[0])
            ref_loss = ref_loss / world
            if ref_loss.requires_grad:
                scaled(ref_sc, ref_loss).backward()
            xr, yr = x[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH], y[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
            xm, ym = xr.chunk(accum)[m], yr.chunk(accum)[m]
            loss = _loss(model, kind, xm, ym, drops[rank]) * (xm.shape[0] / xr.shape[0])
            if loss.requires_grad:
                scaled(sc, loss).backward()
        at("post")
        before = [p.detach().clone() for p in model.parameters()]
        ref_before = [p.detach().clone() for p in ref_model.parameters()]
        if amp and (unscaled or any(p.grad is not None for p in ref_model.parameters())):
            with _Torch():
                _ref_amp_step(ref_model, ref_opt, ref_scaler)
            ref_scaler.update()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() != ref_scaler.get_scale():
                errs.append(("scale", s, scaler.get_scale(), ref_scaler.get_scale()))
        else:
            with _Torch():
                _step_skipping_frozen(ref_model, ref_opt)
            opt.step()
        if amp:
            skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            ref_skipped = all(torch.equal(a, b) for a, b in zip(ref_before, ref_model.parameters()))
            if skipped != ref_skipped:
                errs.append(("skipped", s, skipped, ref_skipped))
            if ref_skipped:
                ref_skips.append(s)
        at("after_step")
        if st.get("sd") == "inplace":
            full = opt.state_dict(consolidated=True, to=None)
            opt.load_state_dict(copy.deepcopy(full))
            ref_opt.state_dict()
        # conftest's rel_update_error, but with the error itself where the reference has not moved yet (a first
        # step whose gradients were all frozen or cleared), which that one refuses
        ours, ref = list(model.parameters()), list(ref_model.parameters())
        num = sum((a.detach() - b.detach()).square().sum().item() for a, b in zip(ours, ref)) ** 0.5
        den = sum((b.detach() - c).square().sum().item() for b, c in zip(ref, init)) ** 0.5
        errs.append(("step", s, num / den if den > 0 else num))
    per_param = {n: (a.detach() - b.detach()).abs().max().item() for n, a, b in
                 zip(names, model.parameters(), ref_model.parameters())}
    state_err = None
    if isinstance(cfg.get("opt"), dict):  # fastopt's: the consolidated state against the reference's
        state_err = _state_err(opt.state_dict(consolidated=True, to=None), ref_opt.state_dict())
    return dict(errs=errs, state_err=state_err, split=split,
                err=max([e[2] for e in errs if e[0] == "step"] + [0.0]),
                clip_bad=[e for e in errs if e[0] == "clip_norm"], per_param=per_param,
                amp_bad=[e for e in errs if e[0] in ("scale", "skipped")],
                ref_skips=ref_skips,
                params=[p.detach().clone() for p in model.parameters()])


def _backend_here(cfg):
    """A run drawn on the Triton kernels runs on the torch back end where they cannot run (no interpreter)."""
    if cfg.get("backend") == "triton" and not (fastopt.ops.triton_available() and fastopt.ops.interpreting()):
        cfg["backend"] = "torch"
    return cfg


def check(results, cfg=None) -> list[str]:
    """Problems found in one run's per-rank results."""
    bad = []
    for r, res in enumerate(results):
        if res["err"] > TOL[DT]:
            first = next(e for e in res["errs"] if e[0] == "step" and e[2] > TOL[DT])
            worst = sorted(res["per_param"].items(), key=lambda kv: -kv[1])[:3]
            bad.append(f"rank {r}: relative update error {res['err']:.3g} (first at step {first[1]}: {first[2]:.3g});"
                       f" params most off: {worst}")
        if res["clip_bad"]:
            bad.append(f"rank {r}: clip norms differ: {res['clip_bad'][:2]}")
        if res.get("state_err") is not None and res["state_err"] > TOL[DT]:
            bad.append(f"rank {r}: consolidated state: relative error {res['state_err']:.3g}")
        if res.get("amp_bad"):
            bad.append(f"rank {r}: scales or skipped steps differ (what, step, ours, reference): {res['amp_bad'][:3]}")
    if cfg is not None and isinstance(cfg.get("opt"), dict) and not results[0]["split"]:
        bad.append("no param was split")  # the point of the fastopt stream
    for r, res in enumerate(results[1:], 1):
        if not all(torch.equal(a, b) for a, b in zip(res["params"], results[0]["params"])):
            bad.append(f"rank {r}: params differ from rank 0's")
    return bad


# Seeds that failed before the fixes they found: 2 (0.0985 off) and 4 (TypeError, then a hang), a copy made after a
# freeze; 24 (0.217 off), a copy's zeroed vote; 3 and 15 (hangs), a kept gradient unfrozen before a backward; 122
# (0.233 off), a split param cleared through the model, then unused; 313 (0.00278 off), a kept gradient unfrozen
# before a backward with no zero_grad between; 229 (0.61 off), a frozen split param's pieces cleared through the
# model; 34 (0.0597 off), a kept gradient zeroed through the model, its owner's vote not counted. 0 and 5 passed
# throughout.
# 2018, 2056, 2109, 2120: with ZeroGradScaler (Wide's split param under ZeRO-2 with overlap and ZeRO-1, fused
# AdamW, Partial; steps skipped for non-finite gradients from one rank)
# 5020, 5110, 5122, 5154: fastopt's optimizers (FASTOPT_FROM): Adafactor in two groups on a Rand model (ZeRO-2, scaler,
# a new wrapper and a copy; its split param frozen before its first step: no state), GaLoreAdamW over two split
# params (ZeRO-1, update_proj_gap 1-3), 8-bit AdamW8bit over two split params, one 3-D (ZeRO-2 with overlap), 8-bit
# CAME on the Triton kernels (ZeRO-2 with overlap, scaler).
FIXED_SEEDS = [0, 2, 3, 4, 5, 15, 24, 34, 122, 229, 313, 2018, 2056, 2109, 2120, 5020, 5110, 5122, 5154]
# Seed 5176 (GaLoreAdamW, Wide, ZeRO-2, scaler), reduced to 2 steps of torch's AdamW: an inf in the split param's
# gradient from one rank, unscale_, clip_grad_norm_ (coefficient 0: the NaN of inf * 0 stays in one process's
# gradient), a skipped step, then a backward with no zero_grad: one process skips again. The wrapper stepped there
# (scale 2048 against 1024 after the second step; seed 5176: 0.318 of the update off): its next round took the
# owners' gradients, all zero from the clip, for a zeroing through the model, and zeroed the split param's sum.
CLIP_BY_ZERO = {"seed": 5176, "kind": "Wide", "partition_grad": True, "overlap": False, "steps": [
    {"zero": "opt_none", "accum": 1, "clip": ["post", 0.05], "toggles": [], "poison": [1, "big", 0.4256975391311536,
                                                                                       "-inf"]},
    {"zero": "skip", "accum": 1, "clip": None, "toggles": []}], "opt": "AdamW", "scaler": True, "backend": "torch"}


@pytest.mark.dist
@pytest.mark.parametrize("seed", FIXED_SEEDS)
def test_zero_fuzz_fixed_seeds(pool, seed):
    cfg = _backend_here(draw(seed))
    bad = check(pool.run(_fuzz, cfg), cfg)
    assert not bad, "\n".join([json.dumps(cfg)] + bad)


@pytest.mark.dist
def test_zero_fuzz_clip_by_zero_is_no_zeroing(pool):
    cfg = copy.deepcopy(CLIP_BY_ZERO)
    bad = check(pool.run(_fuzz, cfg), cfg)
    assert not bad, "\n".join([json.dumps(cfg)] + bad)


# ---- many seeds from the command line -------------------------------------------------------------------
def _run(pool, cfg, me, upto=None):
    from dist_utils import DistError
    try:
        results = pool.run(me._fuzz, cfg, upto)
        return check(results, cfg), results
    except DistError as e:
        if os.environ.get("FUZZ_TB"):
            print(e, file=sys.stderr)
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return ["EXC: " + " | ".join(lines[:1] + [ln for ln in lines if "Error" in ln][:4])], None


def main(argv):
    if argv[0] == "--show":
        print(json.dumps(draw(int(argv[1])), indent=1))
        return
    from dist_utils import DistPool
    import test_zero_fuzz as me  # the ranks import the function by its module's name, not __main__
    with DistPool(4, timeout=float(os.environ.get("FUZZ_TIMEOUT", 20)), env={"FASTOPT_BACKEND": "torch"}) as pool:
        if argv[0] == "--one":  # one seed, keys of its cfg replaced by KEY=JSON (a step count: upto=N)
            cfg, upto = _backend_here(draw(int(argv[1]))), None
            for kv in argv[2:]:
                key, val = kv.split("=", 1)
                if key == "upto":
                    upto = int(val)
                else:
                    cfg[key] = json.loads(val)
            print(json.dumps(cfg))
            t0 = time.time()
            bad, results = _run(pool, cfg, me, upto)
            steps = [float(f"{e[2]:.3g}") for e in (results or [{}])[0].get("errs", [])
                     if e[0] == "step"]
            res = (results or [{}])[0]
            print(json.dumps(dict(ok=not bad, bad=bad, step_errs=steps, state_err=res.get("state_err"),
                                  secs=round(time.time() - t0, 1))))
            return
        first, count = int(argv[0]), int(argv[1])
        out = open(argv[2], "a") if len(argv) > 2 else sys.stdout
        for seed in range(first, first + count):
            cfg = _backend_here(draw(seed))
            if os.environ.get("FUZZ_ONLY") and cfg.get("backend", "torch") != os.environ["FUZZ_ONLY"]:
                continue
            t0 = time.time()
            bad, results = _run(pool, cfg, me)
            rec = dict(seed=seed, ok=not bad, bad=bad, secs=round(time.time() - t0, 1),
                       kind=cfg["kind"], pg=cfg["partition_grad"], ov=cfg["overlap"])
            if "scaler" in cfg:
                rec.update(opt=cfg["opt"] if isinstance(cfg["opt"], str) else cfg["opt"]["variant"],
                           scaler=cfg["scaler"])
            if isinstance(cfg.get("opt"), dict):
                res = results[0] if results else {}
                rec.update(backend=cfg["backend"], err=res.get("err"), state_err=res.get("state_err"),
                           split=res.get("split"))
            out.write(json.dumps(rec) + "\n")
            out.flush()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
