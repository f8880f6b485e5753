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

A failure: a relative update error > 1e-9 (float64), ranks holding different params, an exception, or a hang.

    python tests/test_zero_fuzz.py FIRST_SEED COUNT [OUT.jsonl]   # many seeds, one line per seed
    python tests/test_zero_fuzz.py --show SEED                     # the drawn sequence of a seed
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

from conftest import TOL
from test_zero import BUCKET_MB, LOCAL_BATCH, Net, Partial, Wide, _poison, _step_skipping_frozen, batch, make_opt

from fastopt import ZeroGradScaler, ZeroRedundancyOptimizer

DT = torch.float64
MODELS = {"Net": Net, "Partial": Partial, "Wide": Wide}
TOGGLE = {"Net": ["emb", "w1", "b1", "w2", "w3"], "Partial": ["w1", "b2", "w3", "odd", "first", "unused"],
          "Wide": ["big", "w", "b", "w3"]}
DROP = {"Net": ["emb", "w1", "b2", "w3"], "Partial": ["w1", "odd", "first", "w3"], "Wide": ["big", "w", "w3", "b"]}
SCALER_ARGS = dict(init_scale=2.0 ** 12, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)


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
    rnd = random.Random(seed)
    kind = rnd.choice(list(MODELS))
    cfg = dict(seed=seed, kind=kind, partition_grad=rnd.random() < 0.6, overlap=rnd.random() < 0.5, steps=[])
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
            for name in rnd.sample(DROP[kind], rnd.randint(1, 2)):
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
                name = rnd.choice(TOGGLE[kind])
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
            if kind == "Wide" and cfg["partition_grad"] and st["zero"].startswith("model"):
                st["zero"] = "opt" + st["zero"][len("model"):]
        cfg["steps"].append(st)
    if seed >= 2000:
        _draw_amp(cfg, world)
    return cfg


def _draw_amp(cfg: dict, world: int) -> None:
    """Seeds from 2000: the wrapped optimizer (torch's AdamW, at times fused), a loss scaler, and where it is on,
    the steps' non-finite gradient elements (step["poison"]: rank, param, place in it (0-1), value)."""
    rnd = random.Random(f"{cfg['seed']}/amp")
    cfg["opt"] = "AdamWFused" if rnd.random() < 0.3 else "AdamW"
    cfg["scaler"] = rnd.random() < 0.7
    names = [n for n, _ in MODELS[cfg["kind"]]().named_parameters()]
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
    new = ZeroRedundancyOptimizer(make_opt(cfg.get("opt", "AdamW"), model), partition_grad=cfg["partition_grad"],
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


def _fuzz(rank, world, cfg, upto=None):
    os.environ["FASTOPT_BACKEND"] = "torch"
    kind = cfg["kind"]
    cls = MODELS[kind]
    n_in = Wide.N_IN if kind == "Wide" else 11
    ref_model = cls()
    model = copy.deepcopy(ref_model)
    names = [n for n, _ in model.named_parameters()]
    init = [p.detach().clone() for p in ref_model.parameters()]
    ref_opt = make_opt(cfg.get("opt", "AdamW"), ref_model)
    opt = ZeroRedundancyOptimizer(make_opt(cfg.get("opt", "AdamW"), model), partition_grad=cfg["partition_grad"],
                                  overlap_communication=cfg["overlap"], bucket_size_mb=BUCKET_MB)
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
            _ref_amp_step(ref_model, ref_opt, ref_scaler)
            ref_scaler.update()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() != ref_scaler.get_scale():
                errs.append(("scale", s, scaler.get_scale(), ref_scaler.get_scale()))
        else:
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
        # conftest's rel_update_error, but with the error itself where the reference has not moved yet (a first
        # step whose gradients were all frozen or cleared), which that one refuses
        ours, ref = list(model.parameters()), list(ref_model.parameters())
        num = sum((a.detach() - b.detach()).square().sum().item() for a, b in zip(ours, ref)) ** 0.5
        den = sum((b.detach() - c).square().sum().item() for b, c in zip(ref, init)) ** 0.5
        errs.append(("step", s, num / den if den > 0 else num))
    per_param = {n: (a.detach() - b.detach()).abs().max().item() for n, a, b in
                 zip(names, model.parameters(), ref_model.parameters())}
    return dict(errs=errs, err=max([e[2] for e in errs if e[0] == "step"] + [0.0]),
                clip_bad=[e for e in errs if e[0] == "clip_norm"], per_param=per_param,
                amp_bad=[e for e in errs if e[0] in ("scale", "skipped")],
                ref_skips=ref_skips,
                params=[p.detach().clone() for p in model.parameters()])


def check(results) -> list[str]:
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
        if res.get("amp_bad"):
            bad.append(f"rank {r}: scales or skipped steps differ (what, step, ours, reference): {res['amp_bad'][:3]}")
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
FIXED_SEEDS = [0, 2, 3, 4, 5, 15, 24, 34, 122, 229, 313, 2018, 2056, 2109, 2120]


@pytest.mark.dist
@pytest.mark.parametrize("seed", FIXED_SEEDS)
def test_zero_fuzz_fixed_seeds(pool, seed):
    bad = check(pool.run(_fuzz, draw(seed)))
    assert not bad, "\n".join([json.dumps(draw(seed))] + bad)


# ---- many seeds from the command line -------------------------------------------------------------------
def main(argv):
    if argv[0] == "--show":
        print(json.dumps(draw(int(argv[1])), indent=1))
        return
    first, count = int(argv[0]), int(argv[1])
    out = open(argv[2], "a") if len(argv) > 2 else sys.stdout
    from dist_utils import DistError, DistPool
    import test_zero_fuzz as me  # the ranks import the function by its module's name, not __main__
    with DistPool(4, timeout=float(os.environ.get("FUZZ_TIMEOUT", 20)), env={"FASTOPT_BACKEND": "torch"}) as pool:
        for seed in range(first, first + count):
            cfg = draw(seed)
            t0 = time.time()
            try:
                bad = check(pool.run(me._fuzz, cfg))
            except DistError as e:
                msg = str(e)
                lines = [ln for ln in msg.splitlines() if ln.strip()]
                bad = ["EXC: " + " | ".join(lines[:1] + [ln for ln in lines if "Error" in ln][:4])]
            rec = dict(seed=seed, ok=not bad, bad=bad, secs=round(time.time() - t0, 1),
                       kind=cfg["kind"], pg=cfg["partition_grad"], ov=cfg["overlap"])
            if "scaler" in cfg:
                rec.update(opt=cfg["opt"], scaler=cfg["scaler"])
            out.write(json.dumps(rec) + "\n")
            out.flush()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
