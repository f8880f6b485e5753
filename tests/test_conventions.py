"""torch.optim's conventions, for every fastopt optimizer (Adafactor, CAME 32/8, Lamb 32/8, GaLore-AdamW 32/8 with a
projected group, AdamW8bit) on both back ends:

- loaded state takes the dtype the optimizer keeps for its param (fp64 for fp64 params, fp32 for the others), as
  torch casts it to the param's; a state_dict loads twice, and into a deepcopy;
- a group key the state layout depends on (beta1 None/not None, nbits, block_size, min_8bit_size, GaLore's rank and
  proj_type), or a param's dtype, changed between steps is refused, naming it, before anything changes; a change
  that keeps the layout steps;
- CAME takes lr=0 in its groups (warm-up and cosine schedules), not as its constructor's lr;
- deepcopy and pickle (also of the ZeRO wrapper) give an optimizer that steps like the original;
- the state_dict and load_state_dict hooks run as on torch.optim.AdamW (optimizers and the ZeRO wrapper);
- a 0-dim CPU tensor lr, changed in place between steps, steps like the same float lrs; a CUDA (here: meta)
  tensor lr is refused;
- a param twice in one group, or in two groups, is refused; the group dicts a caller hands in are the param_groups
  (a change made through them takes effect), as in torch; a lazy module's params are taken before their dry run;
- a state_dict that looks like another library's but is malformed is refused as fastopt's own would be;
- the kernels' plans of groups replaced by load_state_dict are dropped; a state tensor replaced by hand is checked
  (another dtype or shape refused), a step count set by hand (a number, another tensor, reset in place) steps as
  a loaded one, a param appended by hand to a group that holds it, or a state tensor set in two params'
  states, is refused; state dropped by hand is freed at once;
- torch.compile of a training step runs step() eagerly (a graph break), bit for bit the eager run.
Float64 params (unless a test is about dtypes) and fresh random gradients at every step.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import os
import pickle
import re
import subprocess
import sys
import types
import warnings

import pytest
import torch
from conftest import (TOL, assert_unchanged, check_no_host_sync, check_unscaled_grads, compiled_step_ops,
                      rel_update_error, save_load, snapshot)

import fastopt

F32, F64 = torch.float32, torch.float64
SHAPES = [(8, 12), (12,), (24, 20)]


def _galore(ps, **kw):
    cls = fastopt.GaLoreAdamW
    rank, proj_type = kw.pop("rank", 2), kw.pop("proj_type", "std")
    return cls([{"params": [ps[0], ps[2]], "rank": rank, "update_proj_gap": 3, "proj_type": proj_type},
                {"params": [ps[1]]}], **kw)


# name -> (factory(params, **overrides), its defaults). 8-bit cases: small blocks and thresholds, so that the
# matrices (96 and 480 elements; GaLore's projected moments 24 and 48) are 8-bit and the vector is not.
CASES = {
    "adafactor": (fastopt.Adafactor, dict(lr=1e-2, relative_step=False, scale_parameter=False, beta1=0.9,
                                          weight_decay=0.1)),
    "came32": (fastopt.CAME, dict(lr=1e-2, weight_decay=0.1)),
    "came8": (fastopt.CAME, dict(lr=1e-2, weight_decay=0.1, nbits=8)),
    "lamb32": (fastopt.Lamb, dict(lr=1e-2, weight_decay=0.1)),
    "lamb8": (fastopt.Lamb, dict(lr=1e-2, weight_decay=0.1, nbits=8, block_size=64, min_8bit_size=64)),
    "galore32": (_galore, dict(lr=1e-2)),
    "galore8": (_galore, dict(lr=1e-2, nbits=8, block_size=64, min_8bit_size=16)),
    "adamw8bit": (fastopt.AdamW8bit, dict(lr=1e-2, block_size=64, min_8bit_size=64)),
}


def make(case, ps, **over):
    fn, kw = CASES[case]
    return fn(ps, **{**kw, **over})


def make_params(device, dtype=F64, seed=0):
    """The same values (fp32-representable) in any dtype."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_() for s in SHAPES]


def grads_at(ps, t, seed=1):
    """Fresh full-rank gradients for step t, the same for any params of the same shapes (in their dtype)."""
    g = torch.Generator().manual_seed(1000 * seed + t)
    return [torch.randn(p.shape, generator=g, dtype=F64).to(device=p.device, dtype=p.dtype) for p in ps]


def set_grads(ps, t, seed=1):
    for p, grad in zip(ps, grads_at(ps, t, seed)):
        p.grad = grad


def run(opt, ps, steps):
    for t in steps:
        set_grads(ps, t)
        opt.step()


def params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def assert_same(opt_a, opt_b):
    """Params and states of two optimizers over params in the same order: bit for bit."""
    for p, q in zip(params_of(opt_a), params_of(opt_b)):
        assert torch.equal(p, q)
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


# ---- 1. loaded state takes its param's state dtype --------------------------------------------------------------
@pytest.mark.parametrize("src, dst", [(F32, F64), (F64, F32)], ids=["fp32_to_fp64", "fp64_to_fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_loaded_state_takes_the_state_dtype_of_its_param(case, src, dst, backend, device, monkeypatch):
    """State saved from `src` params after 3 steps loads into the same params in `dst`: float states become fp64
    for fp64 params and fp32 for the others (8-bit codes stay uint8, absmax and step fp32), holding the saved
    values. The next 6 steps equal, bit for bit, those of a twin given that state cast by hand, keep every dtype
    (the Triton kernels read the state with the param's state dtype), and track an fp64 run from the start at
    least half as closely as a run in fp32 from the start does (those two runs on the torch back end: the math,
    whichever back end is under test)."""
    a = make_params(device, src)
    opt_a = make(case, a)
    run(opt_a, a, range(3))
    sd = opt_a.state_dict()
    b, c = ([p.detach().to(dst).requires_grad_() for p in a] for _ in range(2))
    opt_b, opt_c = make(case, b), make(case, c)
    opt_b.load_state_dict(sd)
    want = F64 if dst == F64 else F32

    def expected(k, v):
        return v.dtype if v.dtype == torch.uint8 else F32 if k == "step" or "absmax" in k else want
    for p, q, r in zip(params_of(opt_a), params_of(opt_b), params_of(opt_c)):
        assert opt_b.state[q].keys() == opt_a.state[p].keys()
        for k, v in opt_a.state[p].items():
            got = opt_b.state[q][k]
            assert got.dtype == expected(k, v), (k, got.dtype)
            assert torch.equal(got, v.to(got.dtype)), k
        opt_c.state[r] = {k: v.to(expected(k, v), copy=True) for k, v in opt_a.state[p].items()}
    run(opt_b, b, range(3, 9))
    run(opt_c, c, range(3, 9))
    assert_same(opt_b, opt_c)
    assert all(v.dtype == expected(k, v) for q in b for k, v in opt_b.state[q].items())
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    truth, low = make_params(device, F64), make_params(device, F32)
    run(make(case, truth), truth, range(9))
    run(make(case, low), low, range(9))
    init = make_params(device, F64)
    err, floor = rel_update_error(b, truth, init), rel_update_error(low, truth, init)
    assert err <= 2 * floor + 1e-6, f"{case}: {err:.3g} of the update from fp64; fp32 throughout: {floor:.3g}"


def test_a_state_dict_loads_twice_and_into_a_deepcopy(backend, device):
    """torch's __setstate__ adds defaults['differentiable']; a state_dict's groups must not "lack" it later."""
    for case in CASES:
        ps = make_params(device)
        opt = make(case, ps)
        run(opt, ps, range(2))
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        opt.load_state_dict(sd)
        copy.deepcopy(opt).load_state_dict(sd)
        assert "differentiable" not in opt.defaults



@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_holds_the_state_tensors_themselves(case, backend, device):
    """state_dict() holds the optimizer's own state tensors, as torch.optim's does, not copies on their device (a
    save of 32-bit Lamb or CAME state held it twice). A state_dict loaded into another optimizer is that one's own
    copy: stepping one leaves the other as it was, and both go on as one run."""
    ps = make_params(device)
    opt = make(case, ps)
    run(opt, ps, range(2))
    sd = opt.state_dict()
    for i, p in enumerate(params_of(opt)):
        assert opt.state[p], i
        for k, v in opt.state[p].items():
            assert sd["state"][i][k].data_ptr() == v.data_ptr(), (i, k)
    twin_ps = [p.detach().clone().requires_grad_() for p in ps]
    twin = make(case, twin_ps)
    twin.load_state_dict(sd)
    before = snapshot(opt)
    run(twin, twin_ps, range(2, 4))
    assert_unchanged(opt, before)
    run(opt, ps, range(2, 4))
    assert_same(opt, twin)

# ---- 2. state layout fixed between steps ------------------------------------------------------------------------
# (case, constructor overrides, key of group 0, new value): each changes the state layout of a param with state.
LAYOUT_CHANGES = [
    ("adafactor", dict(beta1=None), "beta1", 0.9),
    ("adafactor", {}, "beta1", None),
    ("came32", {}, "nbits", 8),
    ("came8", {}, "nbits", 32),
    ("lamb32", dict(min_8bit_size=64), "nbits", 8),
    ("lamb8", {}, "block_size", 128),
    ("lamb8", {}, "min_8bit_size", 100),
    ("galore32", {}, "rank", 3),
    ("galore32", {}, "proj_type", "full"),
    ("galore8", {}, "nbits", 32),
    ("galore8", {}, "min_8bit_size", 32),
    ("adamw8bit", {}, "block_size", 128),
    ("adamw8bit", {}, "min_8bit_size", 100),
]


@pytest.mark.parametrize("case, kw, key, new", LAYOUT_CHANGES,
                         ids=[f"{c}-{k}={v}" for c, _, k, v in LAYOUT_CHANGES])
def test_layout_key_changed_between_steps_is_refused(case, kw, key, new, backend, device):
    """The step after the change raises a ValueError naming param_groups[0][key], its new and old values, and
    changes nothing; set back, the optimizer steps on exactly like a twin that never changed."""
    ps, tw = make_params(device), make_params(device)
    opt, twin = make(case, ps, **kw), make(case, tw, **kw)
    run(opt, ps, range(2))
    run(twin, tw, range(2))
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = new
    set_grads(ps, 2)
    before = snapshot(opt)
    name = type(opt).__name__
    with pytest.raises(ValueError, match=re.escape(f"{name}: param_groups[0]['{key}']={new!r} (was {old!r}) "
                                                   "changes the layout of the state of param_groups[0]['params']")):
        opt.step()
    assert_unchanged(opt, before)
    with pytest.raises(ValueError, match=re.escape(f"param_groups[0]['{key}']={new!r}")):
        opt.step()  # still refused
    opt.param_groups[0][key] = old
    run(opt, ps, range(2, 6))
    run(twin, tw, range(2, 6))
    assert_same(opt, twin)


# (case, key of group 0, new value): changes that keep every param's state layout.
LAYOUT_KEPT = [
    ("adafactor", "beta1", 0.5),
    ("lamb8", "min_8bit_size", 90),
    ("galore32", "update_proj_gap", 2),
    ("adamw8bit", "min_8bit_size", 90),
]


@pytest.mark.parametrize("case, key, new", LAYOUT_KEPT, ids=[f"{c}-{k}={v}" for c, k, v in LAYOUT_KEPT])
def test_change_that_keeps_the_layout_steps(case, key, new, backend, device):
    ps, tw = make_params(device), make_params(device)
    opt, twin = make(case, ps), make(case, tw)
    run(opt, ps, range(2))
    run(twin, tw, range(2))
    opt.param_groups[0][key] = new
    twin.param_groups[0][key] = new
    run(opt, ps, range(2, 6))
    run(twin, tw, range(2, 6))
    assert_same(opt, twin)


def test_galore_scale_and_gap_changed_between_steps_take_effect(backend, device):
    """GaLore's `scale` and `update_proj_gap` are read at every step (galore-torch keeps those of the param's
    first step): after two equal steps, the step with scale 1.0 moves each projected param by 4 times the step
    with the default 0.25 (no weight decay, the same moments), the plain group's param alike; a gap changed from
    3 to 1 refreshes the bases at step 3, which gap 3 keeps."""
    from fastopt.reference.galore import LEFT, RIGHT
    ps, tw = make_params(device), make_params(device)
    opt, twin = make("galore32", ps, weight_decay=0.0), make("galore32", tw, weight_decay=0.0)
    run(opt, ps, range(2))
    run(twin, tw, range(2))
    before = [p.detach().clone() for p in ps]
    bases = [{k: v.clone() for k, v in opt.state[p].items() if k in (LEFT, RIGHT)} for p in ps]
    opt.param_groups[0]["scale"] = 1.0
    opt.param_groups[0]["update_proj_gap"] = 1
    twin.param_groups[0]["update_proj_gap"] = 1
    run(opt, ps, [2])
    run(twin, tw, [2])
    for k, (p, q, b) in enumerate(zip(ps, tw, before)):
        factor = 1.0 if k == 1 else 4.0
        err = rel_update_error([p], [b + factor * (q.detach() - b)], [b])
        assert err < 1e-12, (k, err)
        if k != 1:
            assert bases[k] and all(not torch.equal(opt.state[p][key], v) for key, v in bases[k].items()), k
    for k, p in enumerate(tw):  # the gap alone, in the twin: refreshed too; a gap of 3 would not have
        assert all(not torch.equal(twin.state[p][key], v) for key, v in bases[k].items()), k
    keep_ps = make_params(device)
    keep = make("galore32", keep_ps, weight_decay=0.0)
    run(keep, keep_ps, range(3))
    for p, b in zip(keep_ps, bases):
        assert all(torch.equal(keep.state[p][key], v) for key, v in b.items())


@pytest.mark.parametrize("reloaded", [False, True], ids=["stepped", "loaded"])
@pytest.mark.parametrize("case", list(CASES))
def test_param_dtype_changed_between_steps_is_refused(case, reloaded, backend, device):
    """model.double() after steps (p.data replaced by an fp64 copy) leaves fp32 state the kernels would read as
    fp64: the step raises naming the param and changes nothing. With state that was loaded (no earlier step
    saw the param) the error says the state does not fit the param. A new optimizer takes the state_dict."""
    ps = make_params(device, F32)
    opt = make(case, ps)
    run(opt, ps, range(2))
    if reloaded:
        opt.load_state_dict(opt.state_dict())
    sd = opt.state_dict()
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in ps}
    values = [p.detach().double() for p in ps]
    for p in ps:
        p.data = p.data.double()
    set_grads(ps, 2)
    # the first param with fp32 state (8-bit codes and their absmax fit an fp64 param as well)
    gi, pi, first = next((gi, pi, p) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])
                         if any(v.is_floating_point() and k != "step" and "absmax" not in k
                                for k, v in opt.state[p].items()))
    pos = f"param_groups[{gi}]['params'][{pi}]"
    msg = (f"the state of {pos} does not fit its param (torch.float64" if reloaded else
           f"{pos} is now torch.float64 of shape {tuple(first.shape)}")
    with pytest.raises(ValueError, match=re.escape(msg)):
        opt.step()
    for p, v in zip(ps, values):
        assert torch.equal(p, v)
        assert all(torch.equal(opt.state[p][k], s) for k, s in before[p].items())
    fresh = make(case, ps)
    fresh.load_state_dict(sd)
    fresh.step()
    assert all(v.dtype in (F64, torch.uint8) or k == "step" or "absmax" in k
               for p in ps for k, v in fresh.state[p].items())


@pytest.mark.parametrize("case", list(CASES))
def test_param_dtype_changed_after_state_dict_before_any_step(case, backend, device):
    """state_dict() before the first step makes zero state (kept, as torch's DCP does); model.double() after it
    (p.data replaced by an fp64 copy) then steps like an optimizer built on the fp64 params, as torch's AdamW
    takes it. Once a step has run, or the state was loaded, a change is refused (the tests above)."""
    ps = make_params(device, F32)
    opt = make(case, ps)
    sd = opt.state_dict()
    assert len(sd["state"]) == len(ps)
    for p in ps:
        p.data = p.data.double()
    ref_ps = make_params(device, F64)
    ref = make(case, ref_ps)
    run(opt, ps, range(3))
    run(ref, ref_ps, range(3))
    assert_same(opt, ref)
    assert all(v.dtype in (F64, torch.uint8) or k == "step" or "absmax" in k
               for p in ps for k, v in opt.state[p].items())
    # state_dict() before the first step, then a step: the state is the optimizer's own now, and is kept
    ps = make_params(device, F32)
    opt = make(case, ps)
    opt.state_dict()
    run(opt, ps, range(1))
    for p in ps:
        p.data = p.data.double()
    set_grads(ps, 1)
    with pytest.raises(ValueError, match=r"is now torch.float64 of shape"):
        opt.step()


# ---- 3. CAME: lr 0 in groups ------------------------------------------------------------------------------------
def test_came_groups_take_lr_zero_the_constructor_does_not(backend, device, monkeypatch):
    """A warm-up from 0 (LambdaLR t/4) then a cosine to 0 (CosineAnnealingLR, eta_min=0), against the
    plain-torch back end over the same schedule; the steps at lr=0 leave the params as they are (weight decay
    is scaled by lr too) while the state moves on."""
    with pytest.raises(ValueError, match=re.escape("CAME: lr=0.0 must be a finite number > 0 (CAME has no "
                                                   "relative step size")):
        fastopt.CAME(make_params(device), lr=0.0)
    runs = {}
    for which in ("torch", backend):
        monkeypatch.setenv("FASTOPT_BACKEND", which)
        ps = make_params(device)
        opt = fastopt.CAME(ps[:2], lr=1e-2, weight_decay=0.1)
        opt.add_param_group({"params": ps[2:], "lr": 0.0})  # accepted: a group's lr may be 0 (a frozen group)
        warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(t / 4, 1.0))
        init = [p.detach().clone() for p in ps]
        zero_steps = 0
        for t in range(10):
            if t == 5:
                cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=0.0)
            lr0 = opt.param_groups[0]["lr"]
            p0 = [p.detach().clone() for p in ps]
            set_grads(ps, t)
            opt.step()
            if lr0 == 0:
                zero_steps += 1
                assert torch.equal(ps[0], p0[0]) and torch.equal(ps[1], p0[1])
            assert float(opt.state[ps[0]]["step"]) == t + 1
            (warm if t < 5 else cos).step()
        assert zero_steps == 2  # the warm-up's first step and the cosine's last
        assert torch.equal(ps[2], init[2]) and float(opt.state[ps[2]]["step"]) == 10
        assert not torch.equal(ps[0], init[0])
        runs[which] = ([p.detach().clone() for p in ps], init)
    (ref, init), (ours, _) = runs["torch"], runs[backend]
    err = rel_update_error(ours, ref, init)
    assert err <= TOL[F64], f"{backend}: {err:.3g} of the update away from the torch back end"


# ---- 4. deepcopy and pickle ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "zero"])
@pytest.mark.parametrize("case", list(CASES))
def test_deepcopy_and_pickle_step_like_the_original(case, wrapped, backend, device):
    """After 3 steps (GaLore's next refresh is at step 4) a deepcopy and a pickle round trip each step on their
    own params exactly like a twin that was never copied, and so does the original (the copies do not touch
    it). `wrapped`: the single-process ZeRO wrapper around the optimizer."""
    def build(ps):
        opt = make(case, ps)
        return fastopt.ZeroRedundancyOptimizer(opt) if wrapped else opt
    ps, tw = make_params(device), make_params(device)
    opt, twin = build(ps), build(tw)
    run(opt, ps, range(3))
    run(twin, tw, range(3))
    copies = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    run(twin, tw, range(3, 8))
    for c in copies + [opt]:
        cps = params_of(c)
        assert c is opt or not any(q is p for q in cps for p in ps)
        _run_in_order(c, range(3, 8))
        assert_same(c, twin)


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "zero"])
@pytest.mark.parametrize("case", list(CASES))
def test_step_runs_the_closure_with_grad_and_returns_its_loss(case, wrapped, backend, device):
    """step(closure), called under torch.no_grad() as training loops with a closure (L-BFGS style) may: the
    closure runs once per step with grad enabled, step returns the loss it returned, and the gradients its
    backward made are the ones stepped (the params and states equal, bit for bit, a twin's given the same
    gradients directly). `wrapped`: the single-process ZeRO wrapper around the optimizer."""
    def build(ps):
        opt = make(case, ps)
        return fastopt.ZeroRedundancyOptimizer(opt) if wrapped else opt
    ps, tw = make_params(device), make_params(device)
    opt, twin = build(ps), build(tw)
    for t in range(3):
        calls = []

        def closure():
            opt.zero_grad()
            loss = sum((p * g).sum() for p, g in zip(ps, grads_at(ps, t)))  # each p.grad: its g, exactly
            loss.backward()
            calls.append((torch.is_grad_enabled(), loss))
            return loss
        with torch.no_grad():
            got = opt.step(closure)
        assert len(calls) == 1 and calls[0][0] and got is calls[0][1]
        run(twin, tw, [t])
        assert_same(opt, twin)


def _zero_copy_case(rank, world, case, partition_grad):
    """The pool's ranks, each with its own gradients: a deepcopy of the ZeRO wrapper made after 2 steps
    communicates over the same group and steps like a twin never copied, as does the original; pickling it is
    refused (the group belongs to this process); its state_dict hooks run on every rank, the post hooks where a
    dict is returned."""
    def build(ps):
        return fastopt.ZeroRedundancyOptimizer(make(case, ps), partition_grad=partition_grad)

    def steps(opt, ts):
        ps = sorted(params_of(opt), key=lambda p: SHAPES.index(tuple(p.shape)))
        for t in ts:
            set_grads(ps, t, seed=1 + rank)
            opt.step()
    ps, tw = make_params("cpu"), make_params("cpu")
    opt, twin = build(ps), build(tw)
    steps(opt, range(2))
    steps(twin, range(2))
    dup = copy.deepcopy(opt)
    with pytest.raises(TypeError, match="cannot pickle a wrapper over a process group"):
        pickle.dumps(opt)
    steps(twin, range(2, 5))
    for c in (dup, opt):
        steps(c, range(2, 5))
        assert_same(c, twin)
    log = []
    dup.register_state_dict_pre_hook(lambda o: log.append("pre"))
    dup.register_state_dict_post_hook(lambda o, sd: log.append(("post", sorted(sd["state"]))))
    full = dup.state_dict(consolidated=True, to=0)
    return log, full is not None


@pytest.mark.dist
@pytest.mark.parametrize("partition_grad", [False, True], ids=["zero1", "zero2"])
@pytest.mark.parametrize("case", ["adafactor", "lamb8", "galore32"])
def test_deepcopy_of_the_zero_wrapper_on_several_ranks(pool, case, partition_grad):
    out = pool.run(_zero_copy_case, case, partition_grad)
    assert out == [(["pre", ("post", [0, 1, 2])], True)] + [(["pre"], False)] * (len(out) - 1)


def _run_in_order(opt, steps):
    """Gradients by the params' positions in `SHAPES` (GaLore's groups hold them in another order)."""
    ps = sorted(params_of(opt), key=lambda p: SHAPES.index(tuple(p.shape)))
    run(opt, ps, steps)


# ---- 5. state_dict hooks -----------------------------------------------------------------------------------------
def _hook_log(opt, fresh) -> list:
    """Register one of each state_dict hook on `opt` and the load hooks on `fresh`, save `opt` and load into
    `fresh`; what each hook saw, in the order they ran."""
    log = []
    opt.register_state_dict_pre_hook(lambda o: log.append(("sd_pre", sum(1 for s in o.state.values() if s))))

    def sd_post(o, sd):
        tensors = all(isinstance(v, torch.Tensor) for st in sd["state"].values() for v in st.values())
        log.append(("sd_post", sorted(sd["state"]), tensors))
        sd["edited"] = True  # in place, kept
    opt.register_state_dict_post_hook(sd_post)
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "replaced": True})  # a new dict, returned
    sd = opt.state_dict()
    log.append(("saved", sd.get("edited"), sd.get("replaced")))

    def load_pre(o, sd_):
        log.append(("load_pre", sorted(sd_["state"])))
        del sd_["edited"], sd_["replaced"]  # a shallow copy: the caller's dict keeps them
        sd_["state"] = {k: {**st, "step": torch.tensor(100.0)} for k, st in sd_["state"].items()}
    fresh.register_load_state_dict_pre_hook(load_pre)
    fresh.register_load_state_dict_pre_hook(lambda o, sd_: {**sd_})  # a new dict, returned and loaded
    fresh.register_load_state_dict_post_hook(
        lambda o: log.append(("load_post", sorted(float(s["step"]) for s in o.state.values() if s))))
    fresh.load_state_dict(sd)
    log.append(("caller's dict", sd.get("edited"), sd.get("replaced")))
    return log


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "zero"])
@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_hooks_run_as_on_torch_adamw(case, wrapped, backend, device):
    """Pre hooks before, post hooks after, on the dicts that are saved and loaded: the same log as
    torch.optim.AdamW's (and the wrapper's hooks on the wrapper's dicts)."""
    def ours(ps):
        opt = make(case, ps)
        return fastopt.ZeroRedundancyOptimizer(opt) if wrapped else opt

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-2)
    logs = {}
    for name, build in (("torch", adamw), ("ours", ours)):
        ps = make_params(device)
        opt = build(ps)
        _run_in_order(opt, range(2))
        logs[name] = _hook_log(opt, build(make_params(device)))
    assert logs["ours"] == logs["torch"]
    assert logs["torch"][-2] == ("load_post", [100.0] * len(SHAPES))


# ---- 6. tensor lr -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_tensor_lr_changed_in_place_steps_like_floats(case, backend, device):
    """lr=torch.tensor(...) (0-dim, CPU, as torch.optim.AdamW takes it), changed in place before each step as a
    scheduler does: the same params and states, bit for bit, as a twin whose groups get the same floats."""
    lr = torch.tensor(1e-2, dtype=F64)
    ps, tw = make_params(device), make_params(device)
    opt, twin = make(case, ps, lr=lr), make(case, tw, lr=1e-2)
    assert all(g["lr"] is lr for g in opt.param_groups)
    for t in range(6):
        lr.fill_(1e-2 * (t + 1) / 6)
        for g in twin.param_groups:
            g["lr"] = float(lr)
        set_grads(ps, t)
        set_grads(tw, t)
        opt.step()
        twin.step()
    assert_same(opt, twin)
    again = make(case, make_params(device), lr=1e-2)
    again.load_state_dict(save_load(opt.state_dict()))
    assert float(again.param_groups[0]["lr"]) == float(lr)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_tensor_lr_and_state_checks_need_no_host_sync(case):
    """A CPU tensor lr of CUDA params is read on the host, and the pre-step checks (state layouts included)
    read metadata only: GradScaler steps 2 and 3 (no GaLore refresh) never synchronize."""
    ps = make_params("cuda", F32)
    opt = make(case, ps, lr=torch.tensor(1e-2, dtype=F64))
    check_no_host_sync(opt, ps, steps=3, first_checked=1)


@pytest.mark.parametrize("case", list(CASES))
def test_lr_tensor_off_the_host_is_refused(case):
    """A tensor lr that is not on the CPU (CUDA; here a meta tensor) would need a host sync at every step: refused
    in the constructor, in add_param_group and when set between steps, naming why; so are other bad tensors."""
    name = CASES[case][0].__name__ if isinstance(CASES[case][0], type) else "GaLoreAdamW"
    off = torch.tensor(1e-2, device="meta")
    with pytest.raises(ValueError, match=re.escape(f"{name}: lr=") + ".*host sync"):
        make(case, make_params("cpu"), lr=off)
    for bad in (torch.tensor([1e-2]), torch.tensor(-1e-2), torch.tensor(float("nan"))):
        with pytest.raises(ValueError, match=re.escape(f"{name}: lr=")):
            make(case, make_params("cpu"), lr=bad)
    ps = make_params("cpu")
    opt = make(case, ps)
    run(opt, ps, range(1))
    n = len(opt.param_groups)
    with pytest.raises(ValueError, match=re.escape(f"{name}: param_groups[{n}]['lr']=") + ".*host sync"):
        opt.add_param_group({"params": [torch.zeros(3, dtype=F64, requires_grad=True)], "lr": off})
    assert len(opt.param_groups) == n
    before = snapshot(opt)
    opt.param_groups[0]["lr"] = off
    set_grads(ps, 1)
    with pytest.raises(ValueError, match=re.escape(f"{name}: param_groups[0]['lr']=") + ".*host sync"):
        opt.step()
    assert_unchanged(opt, before)


# Every case's keys that must be numbers, with a value in range: (key, the value as a 0-dim tensor).
_TENSOR_KEYS = {"adafactor": [("eps", (torch.tensor(1e-30), 1e-3)), ("weight_decay", torch.tensor(0.1))],
                "came32": [("betas", (torch.tensor(0.9), 0.999, 0.9999)), ("eps", (torch.tensor(1e-30), 1e-16))],
                "lamb32": [("betas", (torch.tensor(0.9), 0.999)), ("weight_decay", torch.tensor(0.1))],
                "galore32": [("betas", (0.9, torch.tensor(0.999))), ("eps", torch.tensor(1e-6))],
                "adamw8bit": [("betas", (torch.tensor(0.9), 0.999)), ("weight_decay", torch.tensor(0.01))]}


@pytest.mark.parametrize("case", list(_TENSOR_KEYS))
def test_a_tensor_where_only_numbers_are_taken_is_refused_saying_so(case):
    """torch.optim.AdamW takes tensor betas; here only lr may be a tensor (the step reads it anew each time). A
    tensor beta, eps or weight_decay, in range, is refused saying that it is a tensor: `betas[0]=tensor(0.9000)
    must be in [0, 1)` read as if 0.9 were out of range. In the constructor and when set between steps."""
    name = CASES[case][0].__name__ if isinstance(CASES[case][0], type) else "GaLoreAdamW"
    for key, value in _TENSOR_KEYS[case]:
        with pytest.raises(ValueError, match=re.escape(f"{name}: {key}") + r".*must not be a tensor \(only lr"):
            make(case, make_params("cpu"), **{key: value})
    ps = make_params("cpu")
    opt = make(case, ps)
    run(opt, ps, range(1))
    key, value = _TENSOR_KEYS[case][0]
    before = snapshot(opt)
    opt.param_groups[0][key] = value
    set_grads(ps, 1)
    with pytest.raises(ValueError, match=re.escape(f"{name}: param_groups[0]['{key}']") + ".*must not be a tensor"):
        opt.step()
    assert_unchanged(opt, before)


@pytest.mark.parametrize("forced", ["auto", "torch", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_meta_params_step_as_torch_adamw_steps_them(case, forced, monkeypatch):
    """Shape-only dry runs on the meta device (torch.optim.AdamW steps them): the torch reference steps them, state
    on meta; FASTOPT_BACKEND=triton refuses them, pointing to auto/torch (not to
    TRITON_INTERPRET, which does not help). AdamW8bit's extension has meta kernels and steps them either way."""
    monkeypatch.setenv("FASTOPT_BACKEND", forced)
    ps = [torch.empty(s, device="meta", dtype=F64, requires_grad=True) for s in SHAPES]
    opt = make(case, ps)
    for p in ps:
        p.grad = torch.empty_like(p)
    if forced == "triton" and case != "adamw8bit":
        with pytest.raises(RuntimeError, match="not on meta tensors: use FASTOPT_BACKEND=auto or torch"):
            opt.step()
        return
    opt.step()
    opt.step()
    devices = {v.device.type for st in opt.state.values() for v in st.values()}
    assert devices == {"meta"} and len(opt.state) == len(ps)
    assert sorted(opt.state_dict()["state"]) == list(range(len(ps)))


@pytest.mark.parametrize("case", list(CASES))
def test_a_state_dict_loads_onto_meta_params_as_torch_adamw_loads_it(case, monkeypatch):
    """A CPU state_dict loaded into an optimizer over meta params (a shape-only dry run of a resume): the state
    is on meta, with the keys and dtypes of the CPU optimizer's, and the next step runs (torch.optim.AdamW does
    both). Before, the checks of the saved values ran on the meta copies and raised from `Tensor.item()`, and
    GaLore read its step counters with it."""
    monkeypatch.setenv("FASTOPT_BACKEND", "auto")
    ps = make_params("cpu")
    opt = make(case, ps)
    run(opt, ps, range(2))
    ms = [torch.empty(s, device="meta", dtype=F64, requires_grad=True) for s in SHAPES]
    on_meta = make(case, ms)
    on_meta.load_state_dict(opt.state_dict())
    for p, m in zip(ps, ms):
        assert {k: v.dtype for k, v in on_meta.state[m].items()} == {k: v.dtype for k, v in opt.state[p].items()}
        assert {v.device.type for v in on_meta.state[m].values()} == {"meta"}
        m.grad = torch.empty_like(m)
    on_meta.step()


# ---- 7. duplicate params ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_duplicate_params_are_refused(case):
    """Twice in one group (torch only warns; the param would be stepped twice) or in two groups, given to the
    constructor or to add_param_group: a ValueError naming both places; nothing is added."""
    cls, kw = CASES[case]
    kw = {k: v for k, v in kw.items() if k not in ("rank", "proj_type")}
    cls = fastopt.GaLoreAdamW if cls is _galore else cls
    name = cls.__name__
    a, b, c = make_params("cpu")

    def refused(where, first):
        return pytest.raises(ValueError, match=re.escape(f"{name}: {where} is the same tensor as {first}"))
    with refused("param_groups[0]['params'][2]", "param_groups[0]['params'][0]"):
        cls([a, b, a], **kw)
    with refused("param_groups[0]['params'][1]", "param_groups[0]['params'][0]"):
        cls([("w", a), ("v", a)], **kw)
    with refused("param_groups[1]['params'][1]", "param_groups[0]['params'][1]"):
        cls([{"params": [a, b]}, {"params": [c, b]}], **kw)
    opt = cls([a], **kw)
    with refused("param_groups[1]['params'][1]", "param_groups[0]['params'][0]"):
        opt.add_param_group({"params": [b, a]})
    with refused("param_groups[1]['params'][1]", "param_groups[1]['params'][0]"):
        opt.add_param_group({"params": (p for p in [c, c])})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("case", list(CASES))
def test_a_set_of_params_is_refused(case):
    """A set's order changes between runs and between ranks: refused as torch refuses one in a group (torch 2.15
    only warns about one given as `params` itself, and torch 2.10-2.14 take it silently), on every version."""
    cls, kw = CASES[case]
    kw = {k: v for k, v in kw.items() if k not in ("rank", "proj_type")}
    cls = fastopt.GaLoreAdamW if cls is _galore else cls
    a, b, c = make_params("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before torch's FutureWarning
        for kind in (set, frozenset):
            with pytest.raises(TypeError, match=rf"^{cls.__name__}: params is a {kind.__name__}: optimizer "
                               "parameters need to be organized in ordered collections"):
                cls(kind([a, b]), **kw)
    with pytest.raises(TypeError, match="ordered collections"):
        cls([{"params": [a]}, {"params": {b, c}}], **kw)
    opt = cls([a], **kw)
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group({"params": {b, c}})
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == [a]


# ---- 8. plans of replaced groups -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["adafactor", "came32", "lamb8", "galore32"])
def test_plans_of_replaced_groups_are_dropped(case, backend, device):
    """Each load_state_dict replaces the groups: the kernels' plans (and scratch buffers) of the old ones go, and
    the optimizer steps on exactly like a twin that never reloaded."""
    ps, tw = make_params(device), make_params(device)
    opt, twin = make(case, ps), make(case, tw)
    for t in range(4):
        run(opt, ps, [t])
        run(twin, tw, [t])
        opt.load_state_dict(opt.state_dict())
    run(opt, ps, [4])
    run(twin, tw, [4])
    live = {id(g) for g in opt.param_groups}
    assert opt._plans and {k[0] for k in opt._plans} <= live
    assert len(opt._plans) == len(twin._plans)
    assert_same(opt, twin)


@pytest.mark.parametrize("case", list(CASES))
def test_state_dropped_between_steps_is_rebuilt(case, backend, device):
    """A param's state deleted between steps (`del opt.state[p]`, as code that resets some layers' moments does)
    starts afresh at the next step, as a new optimizer stepped from the params of that moment does, bit for bit;
    the old state, which a state_dict taken before still holds, is written no more. The kernels' cached plans
    (kernels/common.py's `cached_plan`) are keyed by the state tensors' addresses too: keyed by the params alone,
    a plan went on writing through the old state's pointers (freed ones, where nothing held them)."""
    ps = make_params(device)
    opt = make(case, ps)
    run(opt, ps, range(3))
    tw = [p.detach().clone().requires_grad_() for p in ps]
    twin = make(case, tw)
    kept = opt.state_dict()  # holds the state tensors themselves: they stay allocated
    old = {i: {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)} for i, st in kept["state"].items()}
    for p in ps:
        del opt.state[p]
    run(opt, ps, range(3, 6))
    run(twin, tw, range(3, 6))
    for i, st in kept["state"].items():
        assert all(torch.equal(st[k], v) for k, v in old[i].items()), f"param {i}: its dropped state changed"
    assert_same(opt, twin)


def _first_state_key(opt, ps):
    """(param, key) of the first state tensor but the step: a moment, a factor, 8-bit codes or a projection."""
    return next((p, k) for p in ps for k, v in opt.state[p].items() if k != "step" and isinstance(v, torch.Tensor))


def _strided_copy(v):
    """v's values in a tensor of v's shape whose last dim has stride 2 (as zeros_like of a transposed or
    channels_last param is not row-major either)."""
    out = torch.zeros((*v.shape, 2), dtype=v.dtype, device=v.device)[..., 0]
    return out.copy_(v)


@pytest.mark.parametrize("what", ["dtype", "shape", "same", "strided"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_state_tensor_replaced_by_hand_is_checked(case, what, backend, device):
    """A state tensor replaced between steps (`opt.state[p]["exp_avg"] = torch.zeros_like(p)`, as torch users reset
    a moment) is checked as a changed param is: of another dtype or shape it is refused, naming the param and
    what it needs, and nothing changes (unchecked, the kernels read and wrote it as the old one: NaN, a segfault
    or heap corruption under the interpreter, an out-of-bounds access on a GPU); of the same dtype and shape it is
    stepped with, as a twin that loads the state_dict holding it steps, strided too (made contiguous, as the
    load makes it: the kernels read it as row-major, 1.6e-2 to 0.86 off the twin under the interpreter)."""
    ps = make_params(device)
    opt = make(case, ps)
    run(opt, ps, range(2))
    p, key = _first_state_key(opt, ps)
    v = opt.state[p][key]
    new = {"dtype": lambda: torch.zeros(v.shape, dtype=F32 if v.dtype != F32 else F64, device=device),
           "shape": lambda: torch.zeros(v.numel() + 1, dtype=v.dtype, device=device),
           "same": lambda: torch.zeros_like(v), "strided": lambda: _strided_copy(v + 1)}[what]()
    opt.state[p][key] = new
    set_grads(ps, 2)
    if what in ("dtype", "shape"):
        before = snapshot(opt)
        gi, pi = next((gi, g["params"].index(p)) for gi, g in enumerate(opt.param_groups) if p in g["params"])
        with pytest.raises(ValueError, match=re.escape(f"the state of param_groups[{gi}]['params'][{pi}] does not "
                                                       f"fit its param ({p.dtype}, shape {tuple(p.shape)}) since the "
                                                       "last step")):
            opt.step()
        assert_unchanged(opt, before)
        return
    tw = [q.detach().clone().requires_grad_() for q in ps]
    twin = make(case, tw)
    twin.load_state_dict(opt.state_dict())
    run(opt, ps, range(2, 5))
    run(twin, tw, range(2, 5))
    assert_same(opt, twin)


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_count_set_by_hand_steps_as_a_loaded_one(case, backend, device):
    """`state["step"]` set by hand between steps, as code written for transformers', came-pytorch's or
    galore-torch's int steps does: a Python number, a CPU or int64 tensor, or a counter reset in place
    (`.zero_()`; GaLore's refresh schedule, mirrored on the host, reads it again) steps as the same count loaded
    from a state_dict does, bit for bit; the count becomes an fp32 0-dim tensor on the param's device. A count
    that is no number, or negative, is refused naming it, before anything changes."""
    ps = make_params(device)
    opt = make(case, ps)
    run(opt, ps, range(3))
    forms = [lambda t: 1, lambda t: torch.tensor(1, dtype=torch.int64), lambda t: t.zero_().add_(1)]
    for i, q in enumerate(ps):
        opt.state[q]["step"] = forms[i % len(forms)](opt.state[q]["step"])
    sd = opt.state_dict()
    for st in sd["state"].values():
        st["step"] = torch.tensor(1.0)
    tw = [q.detach().clone().requires_grad_() for q in ps]
    twin = make(case, tw)
    twin.load_state_dict(sd)
    run(opt, ps, range(3, 8))  # GaLore (update_proj_gap 3): refreshes at counts 4 and 7, as after a count of 1
    run(twin, tw, range(3, 8))
    assert_same(opt, twin)
    for q in ps:
        step = opt.state[q]["step"]
        assert step.dtype == F32 and step.dim() == 0 and step.device == q.device and float(step) == 6
    for bad, message in (("x", "must be a scalar tensor or number, got str"), (-1, "=-1.0 must be a finite number")):
        opt.state[ps[0]]["step"] = bad
        before = {q: (q.detach().clone(), {k: v for k, v in opt.state[q].items()}) for q in ps}
        with pytest.raises(ValueError, match=re.escape(message)):
            opt.step()
        for q, (q0, s0) in before.items():
            assert torch.equal(q, q0) and all(opt.state[q][k] is v for k, v in s0.items())


@pytest.mark.parametrize("case", list(CASES))
def test_a_param_appended_to_a_group_twice_by_hand_is_refused(case, backend, device):
    """A param appended by hand to a group that holds it already (`opt.param_groups[0]["params"].append(p)`):
    refused at the next step as the constructor refuses it, naming both places, before anything changes (it
    would be stepped twice in one launch: neither torch's two updates nor the same on both back ends). A param
    appended by hand that is new to the optimizer steps, as in torch."""
    ps = make_params(device)
    opt = make(case, ps)
    run(opt, ps, range(2))
    group = opt.param_groups[-1]
    group["params"].append(group["params"][0])
    set_grads(ps, 2)
    before = snapshot(opt)
    n = len(group["params"]) - 1
    gi = len(opt.param_groups) - 1
    with pytest.raises(ValueError, match=re.escape(f"param_groups[{gi}]['params'][{n}] is the same tensor as "
                                                   f"param_groups[{gi}]['params'][0]")):
        opt.step()
    assert_unchanged(opt, before)
    group["params"].pop()
    extra = torch.randn(6, dtype=F64, device=device, requires_grad=True)
    group["params"].append(extra)
    extra.grad = torch.randn_like(extra)
    opt.step()
    assert float(opt.state[extra]["step"]) == 1


@pytest.mark.parametrize("case", list(CASES))
def test_a_state_tensor_shared_by_hand_is_refused(case, backend, device):
    """One tensor set by hand in two params' states (`opt.state[q]["step"] = opt.state[p]["step"]`, a reset of
    the counts to one tensor) would be stepped once per param in one launch (two params: 8 after 4 steps): refused,
    naming both, before anything changes; a copy steps."""
    ps = make_params(device)
    opt = make(case, ps)
    run(opt, ps, range(2))
    a, b = ps[0], ps[2]
    opt.state[b]["step"] = opt.state[a]["step"]
    set_grads(ps, 2)
    before = snapshot(opt)
    where = {id(p): f"param_groups[{gi}]['params'][{pi}]" for gi, g in enumerate(opt.param_groups)
             for pi, p in enumerate(g["params"])}
    with pytest.raises(ValueError, match=re.escape(f"the state of {where[id(b)]} holds under 'step' the tensor that "
                                                   f"the state of {where[id(a)]} holds under 'step'")):
        opt.step()
    assert_unchanged(opt, before)
    opt.state[b]["step"] = opt.state[a]["step"].clone()
    opt.step()
    assert float(opt.state[a]["step"]) == float(opt.state[b]["step"]) == 3


@pytest.mark.parametrize("case", list(CASES))
def test_state_dropped_by_hand_is_freed_at_once(case, backend, device):
    """State the optimizer no longer holds (`opt.state.clear()`, an offload's `state[k] = v.to("cpu")`) is freed
    then, not kept alive until the next step by the step's record of the state it checked (weak references)."""
    import gc
    import weakref
    ps = make_params(device)
    opt = make(case, ps)
    run(opt, ps, range(2))
    refs = [weakref.ref(v) for st in opt.state.values() for v in st.values()]
    opt.state.clear()
    gc.collect()
    assert not [r for r in refs if r() is not None]


# ---- 9. what a torch user may hand in: numpy scalars, named params, state_dicts with bad or extra keys -------------
def _name(case):
    return "GaLoreAdamW" if CASES[case][0] is _galore else CASES[case][0].__name__


@pytest.mark.parametrize("case", list(CASES))
def test_numpy_scalars_step_like_python_numbers(case, backend, device):
    """np.float32 / np.float64 / np.int64 hyperparameters (torch.optim takes them), in the constructor and set in
    a group between steps, step bit for bit like the Python numbers they hold, and the groups hold those numbers
    (np.float64 subclasses float: it stayed a numpy scalar, which torch.load(weights_only=True) refused in the
    state_dict); the pairs and triples (betas, eps) given as lists of numpy scalars are held as tuples of Python
    floats."""
    np = pytest.importorskip("numpy")
    lr = np.float32(1e-2)
    ps, tw = make_params(device), make_params(device)
    tuples = {k: v for k, v in make(case, make_params(device)).defaults.items() if isinstance(v, tuple)}
    assert tuples  # betas or eps
    opt = make(case, ps, lr=lr, weight_decay=np.float64(0.25),
               **{k: [np.float32(x) for x in v] for k, v in tuples.items()})
    twin = make(case, tw, lr=float(lr), weight_decay=0.25,
                **{k: tuple(float(np.float32(x)) for x in v) for k, v in tuples.items()})
    assert type(opt.param_groups[0]["lr"]) is float and opt.param_groups[0]["lr"] == float(lr)
    assert type(opt.param_groups[0]["weight_decay"]) is float
    for g, h in zip(opt.param_groups, twin.param_groups):
        for k in tuples:
            assert type(g[k]) is tuple and all(type(x) is float for x in g[k]) and g[k] == h[k], (k, g[k])
    for t in range(4):
        if t == 2:
            for g, h in zip(opt.param_groups, twin.param_groups):
                g["lr"], h["lr"] = np.float32(3e-3), float(np.float32(3e-3))
                if "rank" in g:
                    g["update_proj_gap"], g["scale"] = np.int64(1), np.float64(0.5)
                    h["update_proj_gap"], h["scale"] = 1, 0.5
        run(opt, ps, [t])
        run(twin, tw, [t])
    assert_same(opt, twin)
    assert all(type(g[k]) is float for g in opt.param_groups for k in ("lr", "weight_decay"))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # numpy scalars are refused there
    assert [g["weight_decay"] for g in loaded["param_groups"]] == [0.25] * len(opt.param_groups)


def _callers_groups(case, ps):
    """Param groups as a caller builds them: dicts the caller keeps (GaLore's first one projected)."""
    extra = dict(rank=2, update_proj_gap=3, proj_type="std") if CASES[case][0] is _galore else {}
    return [{"params": [ps[0], ps[2]], **extra}, {"params": [ps[1]]}]


@pytest.mark.parametrize("added", [False, True], ids=["constructor", "add_param_group"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_callers_group_dicts_are_the_groups(case, added, backend, device):
    """torch.optim keeps the dicts handed to the constructor or to add_param_group as its param_groups (so do
    transformers', came-pytorch's, galore-torch's and bitsandbytes' optimizers), and so does every fastopt
    optimizer: an lr and a weight decay set through the caller's own dict after 2 steps take effect, 6 steps
    bit for bit like a twin's set through its param_groups (the groups were copies: the change was ignored)."""
    fn, kw = CASES[case]
    cls = fastopt.GaLoreAdamW if fn is _galore else fn
    ps = make_params(device)
    groups = _callers_groups(case, ps)
    torch_opt = torch.optim.AdamW(groups[:1] if added else groups, lr=1e-2)
    if added:
        torch_opt.add_param_group(groups[1])
    assert all(g is h for g, h in zip(torch_opt.param_groups, groups))
    opts = []
    for via_caller in (True, False):
        ps = make_params(device)
        groups = _callers_groups(case, ps)
        opt = cls(groups[:1] if added else groups, **kw)
        if added:
            opt.add_param_group(groups[1])
        assert all(g is h for g, h in zip(opt.param_groups, groups))
        for t in range(6):
            if t == 2:
                target = groups[1] if via_caller else opt.param_groups[1]
                target["lr"], target["weight_decay"] = 3e-3, 0.2
            run(opt, ps, [t])
        opts.append(opt)
    assert opts[0].param_groups[1]["lr"] == 3e-3
    assert_same(*opts)
    # A group torch refuses after fastopt's checks passed (non-leaf tensors): the caller's dict as it was.
    group = _callers_groups(case, [p * 2 for p in make_params(device)])[0]
    given = dict(group)
    with pytest.raises(ValueError, match="non-leaf Tensor"):
        opts[0].add_param_group(group)
    assert group.keys() == given.keys() and all(group[k] is given[k] for k in given)  # same objects
    assert len(opts[0].param_groups) == 2


@pytest.mark.parametrize("case", list(CASES))
def test_lazy_module_params_before_their_dry_run(case, backend, device):
    """An optimizer built on a lazy module's params before its dry run (torch.nn.LazyLinear: UninitializedParameter,
    no shape yet; GaLore with plain groups, whose projected ones check shapes when built), as torch.optim.AdamW takes
    them: state_dict() lists no state for them, as AdamW's, and the truth test of `state` and a step without
    gradients pass (they raised); after the dry run, 4 steps with fresh random gradients are bit for bit those of a
    twin built after it."""
    fn, kw = CASES[case]
    build = functools.partial(fastopt.GaLoreAdamW if fn is _galore else fn, **kw)

    def lazy_model():
        return torch.nn.Sequential(torch.nn.LazyLinear(8, device=device, dtype=F64),
                                   torch.nn.LazyLinear(20, device=device, dtype=F64))
    model = lazy_model()
    opt = build(model.parameters())
    assert torch.optim.AdamW(lazy_model().parameters()).state_dict()["state"] == {}
    assert opt.state_dict()["state"] == {} and opt.state
    opt.step()
    model(torch.zeros(3, 12, device=device, dtype=F64))  # the dry run: (8, 12), (8,), (20, 8), (20,)
    twin = copy.deepcopy(model)
    twin_opt = build(twin.parameters())
    run(opt, list(model.parameters()), range(4))
    run(twin_opt, list(twin.parameters()), range(4))
    assert_same(opt, twin_opt)


GALORE_BAD_KEYS = [("scale", float("nan")), ("scale", "0.25"), ("update_proj_gap", 0), ("update_proj_gap", 2.5),
                   ("rank", "2"), ("rank", 0), ("proj_type", "bogus"), ("proj_type", None)]


@pytest.mark.parametrize("key, bad", GALORE_BAD_KEYS, ids=[f"{k}={v}" for k, v in GALORE_BAD_KEYS])
def test_galore_keys_set_between_steps_are_refused(key, bad, backend, device):
    """A projected group's own keys set to a bad value after a step: the next step raises the ValueError that the
    constructor raises for it, naming the key, before anything changes (a NaN scale used to turn the weights into
    NaN; a bad gap or rank failed deep inside the step)."""
    ps = make_params(device)
    opt = make("galore32", ps)
    run(opt, ps, range(2))
    before = snapshot(opt)
    opt.param_groups[0][key] = bad
    set_grads(ps, 2)
    with pytest.raises(ValueError, match=re.escape(f"GaLoreAdamW: param_groups[0]['{key}']=")):
        opt.step()
    assert_unchanged(opt, before)
    with pytest.raises(ValueError, match=re.escape(f"GaLoreAdamW: param_groups[0]['{key}']=")):
        fastopt.GaLoreAdamW([{"params": [make_params(device)[0]], "rank": 2, key: bad}])


BAD_SAVED = {"adafactor": ("decay_rate", 0.5), "came32": ("betas", (0.9, 0.999)), "came8": ("lr", -1.0),
             "lamb32": ("eps", float("nan")), "lamb8": ("block_size", 100), "galore32": ("scale", float("nan")),
             "galore8": ("update_proj_gap", 0), "adamw8bit": ("betas", (1.0, 0.999))}


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_with_a_bad_hyperparameter_is_refused_unchanged(case, backend, device):
    """A state_dict whose group holds a bad hyperparameter is refused by load_state_dict with the step's
    ValueError naming it; the optimizer keeps its groups and state (before, the groups were replaced and only the
    next step refused, or stepped: a saved NaN scale gave NaN weights). Extra top-level keys (a post hook's
    "version") load, as torch's do."""
    ps = make_params(device)
    opt = make(case, ps)
    run(opt, ps, range(2))
    good = opt.state_dict()
    key, bad = BAD_SAVED[case]
    sd = copy.deepcopy(good)
    sd["param_groups"][0][key] = bad
    before, groups = snapshot(opt), copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                                   for g in opt.param_groups])
    with pytest.raises(ValueError, match=re.escape(f"{_name(case)}.load_state_dict: the state_dict's "
                                                   f"param_groups[0]['{key}']")):
        opt.load_state_dict(sd)
    assert_unchanged(opt, before)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    tw = make_params(device)
    twin = make(case, tw)
    run(twin, tw, range(2))
    twin.load_state_dict({**copy.deepcopy(good), "version": 3})
    run(opt, ps, [2])
    run(twin, tw, [2])
    assert_same(opt, twin)


# Every fastopt optimizer class over one group of the test params (GaLore's also with projected groups).
CLASS_CASES = {"adafactor": "adafactor", "came": "came32", "lamb": "lamb32", "galore": "galore32",
               "galore_plain": None, "adamw8bit": "adamw8bit"}
CROSS = [(a, b) for a in CLASS_CASES for b in CLASS_CASES
         if a != b and {a, b} != {"galore", "galore_plain"}]


def _class_case(name, ps):
    return fastopt.GaLoreAdamW(ps, lr=1e-2) if name == "galore_plain" else make(CLASS_CASES[name], ps)


@pytest.mark.parametrize("src, dst", CROSS, ids=[f"{a}-into-{b}" for a, b in CROSS])
def test_a_state_dict_of_another_optimizer_class_is_refused_unchanged(src, dst):
    """A stepped state_dict of one fastopt optimizer class, loaded into another: a ValueError names what tells it
    apart, and the loading optimizer keeps its groups and state. Before, Lamb's loaded into a GaLoreAdamW of
    plain groups (its groups hold every key of those, correct_bias having a default): Lamb's bias_correction
    and max_trust_ratio were kept unread, and the run went on as AdamW's."""
    sp, dp = make_params("cpu"), make_params("cpu")
    saved, opt = _class_case(src, sp), _class_case(dst, dp)
    run(saved, sp, range(2))
    run(opt, dp, range(2))
    before, groups = snapshot(opt), copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                                   for g in opt.param_groups])
    with pytest.raises(ValueError, match=re.escape(f"{type(opt).__name__}.load_state_dict: ")):
        opt.load_state_dict(saved.state_dict())
    assert_unchanged(opt, before)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


@pytest.mark.parametrize("case", list(CASES))
def test_a_key_named_like_another_class_hyperparameter_resumes_from_its_own_state_dict(case, backend, device):
    """Every group holds a key of the user's own (torch.optim keeps any), named like a hyperparameter of another
    fastopt class (Adafactor's `beta1`; GaLore's `scale` for Adafactor): the state_dict saved after 3 steps, through
    torch.save, loads into a fresh optimizer of the same groups, and its next 4 steps are bit for bit the
    uninterrupted run's; the loaded groups keep the key. Before, the optimizer refused its own state_dict as
    another class's (the key named it), so such a run could not resume from its checkpoints."""
    extra = {"scale": 2.0} if case == "adafactor" else {"beta1": 0.5}
    ps, qs = make_params(device), make_params(device)
    opt = make(case, ps)
    for g in opt.param_groups:
        g.update(extra)
    run(opt, ps, range(3))
    saved = save_load(opt.state_dict())
    with torch.no_grad():
        for p, q in zip(ps, qs):
            q.copy_(p)
    fresh = make(case, qs)
    for g in fresh.param_groups:
        g.update(extra)
    fresh.load_state_dict(saved)
    assert all(g[k] == v for g in fresh.param_groups for k, v in extra.items())
    run(opt, ps, range(3, 7))
    run(fresh, qs, range(3, 7))
    assert_same(opt, fresh)


@pytest.mark.parametrize("case", list(CASES))
def test_an_empty_state_in_a_state_dict_loads_as_no_state(case):
    """A state_dict entry of {} for a param (what DCP's flattened form gives a trainable param without state;
    torch.optim loads it as no state) loads: that param has no state, the others theirs, and 3 more steps are
    bit for bit those of an optimizer given the same state_dict without that entry."""
    ps = make_params("cpu")
    opt = make(case, ps)
    run(opt, ps, range(2))
    sd = opt.state_dict()
    with_empty = {"state": {**sd["state"], 1: {}}, "param_groups": sd["param_groups"]}
    without = {"state": {k: v for k, v in sd["state"].items() if k != 1}, "param_groups": sd["param_groups"]}
    twins = []
    for loaded in (with_empty, without):
        qs = [p.detach().clone().requires_grad_() for p in ps]
        o = make(case, qs)
        o.load_state_dict(loaded)
        flat = params_of(o)
        assert not o.state.get(flat[1]) and o.state.get(flat[0]) and o.state.get(flat[2])
        run(o, qs, range(2, 5))
        twins.append(o)
    assert_same(*twins)


# The group keys only fastopt has: without them a group reads as another library's (transformers' Adafactor,
# came-pytorch's CAME, bitsandbytes' AdamW8bit), which load_state_dict converts.
FASTOPT_ONLY = {"adafactor": ("bf16_stochastic_round",), "came32": ("bf16_stochastic_round", "nbits"),
                "adamw8bit": ("block_size", "min_8bit_size")}


@pytest.mark.parametrize("form, message", [
    ("no state", "expected a dict with keys 'state' and 'param_groups', got ['param_groups']"),
    ("state list", "'state' must be a dict (param id -> state), got list"),
    ("state entry int", "state[0] is a int, expected a dict of tensors")])
@pytest.mark.parametrize("case", list(FASTOPT_ONLY))
def test_foreign_state_dict_of_a_bad_shape_is_refused_unchanged(case, form, message, backend, device):
    """A state_dict whose groups look like another library's but whose 'state' is missing, not a dict, or holds a
    non-dict entry is refused with the ValueError fastopt's own would get, and nothing changes (before, a missing
    'state' loaded as an empty one, wiping the step counts, and the others raised AttributeError)."""
    ps = make_params(device)
    opt = make(case, ps)
    run(opt, ps, range(2))
    sd = opt.state_dict()
    groups = [{k: v for k, v in g.items() if k not in FASTOPT_ONLY[case]} for g in sd["param_groups"]]
    bad = {"no state": {"param_groups": groups}, "state list": {"state": [], "param_groups": groups},
           "state entry int": {"state": {**sd["state"], 0: 5}, "param_groups": groups}}[form]
    before = snapshot(opt)
    with pytest.raises(ValueError, match=re.escape(f"{_name(case)}.load_state_dict: {message}")):
        opt.load_state_dict(bad)
    assert_unchanged(opt, before)
    opt.load_state_dict({"state": sd["state"], "param_groups": groups})  # the well-formed foreign form loads
    twin_ps = make_params(device)
    twin = make(case, twin_ps)
    run(twin, twin_ps, range(2))
    run(opt, ps, [2])
    run(twin, twin_ps, [2])
    assert_same(opt, twin)


def test_galore_state_dict_projecting_a_vector_here_is_refused_clearly():
    """A GaLore state_dict whose projected group falls on a vector of this optimizer (grouped otherwise): a
    ValueError naming the param, not an IndexError from inside the state's shapes."""
    w1, b1, w2, b2 = [torch.randn(*s, dtype=F64, requires_grad=True) for s in [(16, 16), (16,), (8, 16), (8,)]]
    a = fastopt.GaLoreAdamW([{"params": [w1, w2], "rank": 4}, {"params": [b1, b2]}])
    set_grads([w1, b1, w2, b2], 0)
    a.step()
    b = fastopt.GaLoreAdamW([{"params": [w1, b1]}, {"params": [w2, b2]}])
    with pytest.raises(ValueError, match=re.escape("param_groups[0]['params'][1].shape=(16,) must have 2 dims")):
        b.load_state_dict(a.state_dict())
    assert len(b.state) == 0


def test_galore_groups_refused_as_torch_refuses_them():
    """add_param_group with what torch.optim refuses (not a dict, no 'params', params in a set) raises torch's
    error, for projected groups too, and adds nothing (a list used to become a group with a tensor key and no
    params: the tensor was never trained)."""
    w = torch.randn(8, 8, dtype=F64, requires_grad=True)
    opt, ref = fastopt.GaLoreAdamW([w]), torch.optim.AdamW([torch.randn(8, 8, requires_grad=True)])
    extra = torch.zeros(8, 4, dtype=F64, requires_grad=True)
    for group, err in (([extra], TypeError), ({"lr": 0.1}, KeyError), ({"lr": 0.1, "rank": 2}, KeyError),
                       ({"params": {extra}, "rank": 2}, TypeError)):
        with pytest.raises(err) as theirs:
            ref.add_param_group(group)
        with pytest.raises(err, match=re.escape(str(theirs.value).strip("'"))):
            opt.add_param_group(group)
        assert len(opt.param_groups) == 1


def test_galore_takes_named_params_in_projected_groups(backend, device):
    """(name, param) pairs in a projected group (torch.optim takes them, and so did GaLore's other groups): the
    group keeps the names, as torch's does, and steps bit for bit like the same params unnamed; a state_dict
    without names (the unnamed twin's) loads, and the groups keep their names, as torch's update_group keeps
    them."""
    named = [(f"w{i}", p) for i, p in enumerate(make_params(device))]
    ps = make_params(device)
    opt = fastopt.GaLoreAdamW([{"params": [named[0], named[2]], "rank": 2, "update_proj_gap": 3},
                               {"params": [named[1]]}], lr=1e-2)
    twin = _galore(ps, lr=1e-2)
    assert opt.param_groups[0]["param_names"] == ["w0", "w2"]
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["w0", "w2"]
    mine = [p for _, p in named]
    for t in range(4):
        run(opt, mine, [t])
        run(twin, ps, [t])
    assert_same(opt, twin)
    sd = twin.state_dict()
    assert not any("param_names" in g for g in sd["param_groups"])
    opt.load_state_dict(sd)
    assert [g.get("param_names") for g in opt.param_groups] == [["w0", "w2"], ["w1"]]
    assert opt.state_dict()["param_groups"][1]["param_names"] == ["w1"]
    run(opt, mine, [4])
    run(twin, ps, [4])
    assert_same(opt, twin)


def test_galore_skips_empty_params_in_projected_groups(backend, device):
    """A 0-element matrix in a projected group is skipped like any 0-element param (it used to be refused:
    rank must be at most min(m, n) = 0)."""
    ps = make_params(device)
    empty = torch.zeros(0, 5, dtype=F64, device=device, requires_grad=True)
    opt = fastopt.GaLoreAdamW([{"params": [ps[0], empty], "rank": 2}], lr=1e-2)
    for t in range(2):
        set_grads([ps[0], empty], t)
        opt.step()
    assert empty not in opt.state and opt.state[ps[0]]["step"].item() == 2


# ---- torch.compile ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_training_step_runs_the_step_eagerly(case, backend, device):
    """A compiled function that sets the grads and calls opt.step(): dynamo captures the function's own ops and
    none of the step's (it traced into the Triton launches and failed; inductor miscompiled the 8-bit reference's
    partial last block, pytorch/pytorch#195582, giving NaN params), and four steps equal the eager run bit for bit."""
    import operator
    ps, twin = make_params(device), make_params(device)
    opt, ref = make(case, ps), make(case, twin)
    traced = compiled_step_ops(opt, ref, ps, twin, lambda t: [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(t), dtype=F64).to(device) for p in ps])
    assert_same(opt, ref)
    assert traced == {operator.mul}, traced


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_inside_autocast_is_the_step_outside_it(case, backend, device):
    """opt.step() called inside the training loop's `torch.autocast(dtype=torch.bfloat16)` block: bit for bit the
    step outside it (torch.optim's steps have no autocast-eligible op; GaLore's projections on the torch back end
    ran in bf16 there, 1.5e-5 of the params off after 6 steps, and its Triton kernels did not). A closure still
    runs under the caller's autocast, as its forward expects."""
    ps, tw = make_params(device, F32), make_params(device, F32)
    opt, twin = make(case, ps), make(case, tw)
    x = torch.ones(2, 2, device=device)
    for t in range(4):
        set_grads(ps, t)
        set_grads(tw, t)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = opt.step(lambda: (x @ x).sum())
        assert loss.dtype == torch.bfloat16
        twin.step()
    assert_same(opt, twin)


def test_import_leaves_dynamo_to_the_first_step():
    """`import fastopt` does not import torch._dynamo (2.5 s on a small CPU machine, for a process that only
    loads a checkpoint or the extension); an optimizer's first step does, as torch.optim's first step does, and
    only then is step() made eager under torch.compile (the test above). In a fresh process."""
    script = ("import sys, torch, fastopt; print('torch._dynamo' in sys.modules)\n"
              "p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)\n"
              "fastopt.Lamb([p]).step(); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, FASTOPT_BACKEND="torch"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True"], out.stdout



@pytest.mark.parametrize("case", list(CASES))
def test_found_inf_of_shape_one_as_fsdp_sharded_grad_scaler_makes_it(case):
    """FSDP's ShardedGradScaler hands step() a found_inf of shape (1,), not 0-dim: with 0 it steps exactly as a
    0-dim found_inf does (6 steps, params and state bit for bit); with 1, and with 4 (its unscale_ sums the infs
    over the ranks; GradScaler sums them over devices), nothing changes, step counters included (they went back
    by found_inf - 1)."""
    a, b = make_params("cpu"), make_params("cpu")
    oa, ob = make(case, a), make(case, b)
    for t in range(6):
        set_grads(a, t)
        set_grads(b, t)
        for o, fi in ((oa, torch.zeros(())), (ob, torch.zeros(1))):
            o.grad_scale, o.found_inf = torch.ones(()), fi
            o.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for k, v in oa.state[p].items():
            assert torch.equal(ob.state[q][k], v), k
    before = ([p.detach().clone() for p in b], [{k: v.clone() for k, v in ob.state[p].items()} for p in b])
    for found in (1.0, 4.0):
        set_grads(b, 6)
        ob.found_inf = torch.full((1,), found)
        ob.step()
        for p, p0, s0 in zip(b, *before):
            assert torch.equal(p, p0)
            for k, v in s0.items():
                assert torch.equal(ob.state[p][k], v), (found, k)


def _bf16_grads(low, twin, t):
    """Step t's grads, rounded to bf16: in fp32 on `twin`, as bf16 grads of the fp32 params `low` (through
    `.data`, as FSDP1's MixedPrecision(keep_low_precision_grads=True) makes them)."""
    set_grads(twin, t)
    for p, q in zip(low, twin):
        q.grad = q.grad.to(torch.bfloat16).to(F32)
        p.grad = q.grad.clone()
        p.grad.data = q.grad.to(torch.bfloat16)


@pytest.mark.parametrize("case", list(CASES))
def test_grads_in_another_dtype_step_as_their_copy_in_the_param_dtype(case, backend, device):
    """fp32 params whose grads are bf16 (FSDP1's MixedPrecision(keep_low_precision_grads=True) makes them, through
    `.data`): bit for bit the steps of the same grads made fp32, over 4 steps, params and states (the Triton
    Adafactor read the params through the grads' type: NaN; AdamW8bit's extension refused them)."""
    low, twin = make_params(device, F32), make_params(device, F32)
    opt, ref = make(case, low), make(case, twin)
    for t in range(4):
        _bf16_grads(low, twin, t)
        assert all(p.grad.dtype == torch.bfloat16 for p in low)
        opt.step()
        ref.step()
    assert_same(opt, ref)


GRAD_KINDS = [("plain", F32), ("plain", torch.bfloat16), ("plain", torch.float16), ("plain", F64),
              ("strided", F32), ("bf16_grads", F32)]


@pytest.mark.parametrize("kind, dtype", GRAD_KINDS, ids=[f"{k}-{str(d)[6:]}" for k, d in GRAD_KINDS])
@pytest.mark.parametrize("case", list(CASES))
def test_grad_scaler_leaves_grads_unscaled_as_torch(case, kind, dtype, backend, device):
    """Under torch.amp.GradScaler (its fused path: grad_scale and found_inf handed to step()), p.grad after each
    of 4 steps is as torch's fused AdamW leaves it (pinned here too): the scaled gradient times 1/scale in its own
    dtype, bit for bit, on the steps taken; unchanged on the skipped one (an inf at step 2). The kernels store it
    as they read it; `strided` (transposed params and grads: the kernels read contiguous copies) and `bf16_grads`
    (bf16 grads of fp32 params, read as fp32 copies) take the separate op on p.grad."""
    ps = make_params(device, dtype)
    twin = [p.detach().float().requires_grad_() for p in ps]
    if kind == "strided":
        ps = [p.detach().t().contiguous().t().requires_grad_() if p.dim() == 2 else p for p in ps]
    opts = [make(case, ps), torch.optim.AdamW(twin, lr=1e-3, fused=True)]
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12)
    for t in range(4):
        scale = float(scaler.scale(torch.ones((), device=device)))  # (the scaler's first call makes its scale)
        for p, q, g in zip(ps, twin, grads_at(ps, t)):
            p.grad = (g.t().contiguous().t() if kind == "strided" and g.dim() == 2 else g) * scale
            if kind == "bf16_grads":
                p.grad.data = p.grad.to(torch.bfloat16)
            q.grad = g.float() * scale
            if t == 2:
                p.grad[(0,) * p.dim()] = q.grad[(0,) * p.dim()] = float("inf")
        for o, qs in zip(opts, (ps, twin)):
            grads = [q.grad for q in qs]
            scaled = [g.clone() for g in grads]
            scaler.step(o)
            assert all(q.grad is g for q, g in zip(qs, grads))  # in place
            check_unscaled_grads(grads, scaled, scale, t == 2, f"{type(o).__name__} step {t}: ")
        scaler.update()


@pytest.mark.parametrize("case", list(CASES))
def test_a_grad_in_a_wider_dtype_than_its_param_is_refused_unchanged(case, backend, device):
    """fp32 grads of bf16 or fp16 params, and bf16 grads of fp16 ones (torch allows any grad dtype with
    `p.grad_dtype = None`), would lose precision rounded to the param's dtype, and an fp16 param's range (a grad
    past 65504 became inf, the param NaN): refused after 2 good steps, naming the param and both dtypes, before any
    param or state changes. (A narrower grad steps as its copy in the param's dtype: the test above.)"""
    for dtype, wider, lost in ((torch.bfloat16, F32, "precision."), (torch.float16, F32, "range and precision."),
                               (torch.float16, torch.bfloat16, "range and precision.")):
        ps = make_params(device, dtype)
        opt = make(case, ps)
        run(opt, ps, range(2))
        before = snapshot(opt)
        set_grads(ps, 2)
        last = params_of(opt)[-1]
        last.grad_dtype = None
        last.grad = last.grad.to(wider)
        gi, pi = len(opt.param_groups) - 1, len(opt.param_groups[-1]["params"]) - 1
        with pytest.raises(RuntimeError, match=re.escape(
                f"param_groups[{gi}]['params'][{pi}] is {dtype} but its grad is {wider}") + ".*" + re.escape(lost)):
            opt.step()
        assert_unchanged(opt, before)


@pytest.mark.parametrize("case", ["adafactor", "came32", "lamb32", "adamw8bit"])
def test_fused_ops_take_grads_in_another_dtype_as_the_param_dtype(case, backend, device, monkeypatch):
    """fastopt.ops' fused steps handed bf16 grads of fp32 params as they are (the optimizers cast such grads
    first; here that cast is taken out, as for a direct call of the op): bit for bit the same steps with the
    grads made fp32 (the Triton Adafactor read the params through the grads' element type: NaN)."""
    from fastopt.optim import base
    monkeypatch.setattr(base, "_local_grad", lambda p: p.grad)
    low, twin = make_params(device, F32), make_params(device, F32)
    opt, ref = make(case, low), make(case, twin)
    for t in range(4):
        _bf16_grads(low, twin, t)
        opt.step()
        ref.step()
    assert_same(opt, ref)


@pytest.mark.skipif(not fastopt.ops.triton_available(), reason="needs Triton")
@pytest.mark.parametrize("case", ["adafactor", "came8", "lamb32", "galore32"])
def test_a_back_end_that_cannot_step_is_named_before_anything_changes(case, monkeypatch):
    """The Triton seam's refusals come before any param, state or step counter changes: FASTOPT_BACKEND unknown,
    `triton` on CPU tensors without the interpreter, and an interpreter that cannot run the kernels: Triton before
    3.7 beside NumPy 2.4 (it takes int() of one-element arrays; torch 2.11 pins Triton 3.6), which failed inside
    each kernel with "only 0-dimensional arrays can be converted to Python scalars". Two steps on the torch
    reference first, so that there is state to keep; the same step runs after."""
    import numpy
    import triton
    clash = fastopt.ops.interpreter_clash
    assert clash("3.6.0", "2.4.6") and clash("3.5.1", "2.4.0") and clash("3.6.0+git1a2b", "2.5.0rc1")
    assert clash("3.7.0", "2.4.6") is None and clash("3.6.0", "2.3.5") is None and clash("3.10.0", "2.4.0") is None
    ps = make_params("cpu")
    opt = make(case, ps)
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    for t in range(2):
        set_grads(ps, t)
        opt.step()
    set_grads(ps, 2)
    before = snapshot(opt)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    refusals = [("cuda", "0", ValueError, "FASTOPT_BACKEND='cuda' must be one of auto, torch, triton"),
                ("triton", "0", RuntimeError, "FASTOPT_BACKEND=triton cannot run on cpu tensors without Triton's "
                                              "interpreter: set TRITON_INTERPRET=1"),
                ("triton", "1", RuntimeError, "Triton 3.6.0's interpreter (TRITON_INTERPRET=1) cannot run fastopt's "
                                              "kernels with NumPy 2.4.6: install numpy<2.4 or triton>=3.7")]
    for name, interpret, error, says in refusals:
        monkeypatch.setenv("FASTOPT_BACKEND", name)
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        with pytest.raises(error, match=re.escape(says)):
            opt.step()
        assert_unchanged(opt, before)
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    opt.step()
    assert not torch.equal(ps[0], before[ps[0]][0])


@pytest.mark.skipif(not fastopt.ops.triton_available(), reason="needs Triton")
def test_without_the_interpreter_no_numpy_clash_is_named(monkeypatch):
    """Triton before 3.7 beside NumPy 2.4 only troubles the interpreter: without TRITON_INTERPRET (unset, "0" or
    empty: a GPU machine running compiled kernels, e.g. torch 2.11's Triton 3.6 with NumPy 2.4) there is no clash,
    so that conftest runs the suite and compile_check (which replaces ops.interpreting, with no interpreter) has
    FASTOPT_BACKEND=triton take CPU tensors. A version it cannot read counts as the oldest (0, 0)."""
    import numpy
    import triton
    from fastopt import ops
    assert ops.major_minor("2.10.0+cu128") == (2, 10) and ops.major_minor("3.10") == (3, 10)
    assert ops.major_minor("main") == (0, 0) and ops.interpreter_clash("main", "2.4.0")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ops._interpreter_clash_here() is None
    for interpret in ("0", ""):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        assert ops._interpreter_clash_here() is None, interpret
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "install numpy<2.4 or triton>=3.7" in ops._interpreter_clash_here()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("FASTOPT_BACKEND", "triton")
    monkeypatch.setattr(ops, "interpreting", lambda: True)  # as compile_check does
    assert ops.use_triton(torch.empty(1)) is True


# ---- several GPUs in one process ----------------------------------------------------------------------------
TRITON_CASES = [c for c in CASES if c != "adamw8bit"]  # AdamW8bit runs in the extension, which guards its device


@pytest.mark.parametrize("case", TRITON_CASES)
def test_every_launch_runs_with_its_bucket_device_current(case, backend, device, monkeypatch):
    """Triton launches a kernel on the current device, whatever device its tensors are on, so each bucket's step
    runs inside `ops.on_device(its device)`, its host work too; a step of several buckets advances them in turns, so
    the ops' generators enter it again at each resumption."""
    if backend != "triton":
        pytest.skip("counts Triton launches")
    from fastopt import ops
    from fastopt.kernels import adafactor
    entered, launches = [], []
    real_on_device = ops.on_device

    @contextlib.contextmanager
    def on_device(dev):
        with real_on_device(dev):
            entered.append(dev)
            try:
                yield
            finally:
                entered.pop()

    kernel_type = type(adafactor._apply_kernel)  # the interpreter's or compiled Triton's
    real_run = kernel_type.run

    def run_kernel(self, *args, **kwargs):
        launches.append(list(entered))
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(ops, "on_device", on_device)
    monkeypatch.setattr(kernel_type, "run", run_kernel)
    ps = make_params(device)
    opt = make(case, ps)
    groups = []  # and each bucket's host work (GaLore's refresh, GradScaler's copies) within it
    real_step_group = opt._step_group
    monkeypatch.setattr(opt, "_step_group", lambda *a, **kw: groups.append(list(entered)) or real_step_group(*a, **kw))
    run(opt, ps, range(3))  # GaLore's later steps replay the first's launches
    # entered twice at a launch: by step() for the bucket, and by the op's generator at its resumption, which is
    # what a sharded bucket relies on (phases.run resumes those after step()'s loop over the buckets)
    assert len(launches) >= 3 * 2 and all(e == [ps[0].device] * 2 for e in launches), launches
    assert len(groups) >= 3 and all(e == [ps[0].device] for e in groups), groups
    assert not entered


def test_resumed_steps_leave_no_device_guard_open(monkeypatch):
    """Two buckets' steps on two GPUs, advanced in turns as fastopt.distributed.phases advances them: each runs
    every resumption with its own device current, and the device current before is current again after each."""
    from fastopt import ops
    current = [0]

    @contextlib.contextmanager
    def on_device(dev):  # as torch.cuda.device: make dev current, then restore the one before
        before, current[0] = current[0], dev.index
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(ops, "on_device", on_device)
    seen = []

    def bucket(name):
        for phase in range(3):
            seen.append((name, phase, current[0]))
            yield phase

    a = ops._resumed_on(bucket("a"), torch.device("cuda", 1))
    b = ops._resumed_on(bucket("b"), torch.device("cuda", 2))
    for _ in range(3):
        assert next(a) == next(b) and current[0] == 0
    assert list(a) == list(b) == [] and current[0] == 0
    assert seen == [(n, k, d) for k in range(3) for n, d in (("a", 1), ("b", 2))]


def test_each_bucket_step_enters_its_own_device(monkeypatch):
    """on_device of a CUDA device is torch.cuda.device of it (which makes it current once entered; only built here,
    so no GPU is needed), nothing for a CPU one; each *_phases op enters it with its params' device, not the
    current one or the CPU's, at every resumption (params that only name a device here)."""
    from fastopt import ops
    guard = ops.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(ops.on_device(torch.device("cpu")), contextlib.nullcontext)
    entered = []

    @contextlib.contextmanager
    def on_device(dev):
        entered.append(dev)
        yield

    monkeypatch.setattr(ops, "on_device", on_device)

    def phases(params, grads, states):
        yield "sums"
        yield "norms"

    on_gpu1 = [types.SimpleNamespace(device=torch.device("cuda", 1))]
    assert list(ops._on_params_device(phases)(on_gpu1, [], [])) == ["sums", "norms"]
    assert entered == [torch.device("cuda", 1)] * 3  # two phases and the resumption that ends it


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("case", list(CASES))
def test_params_on_another_gpu_step_as_on_the_current_one(case):
    """Params on cuda:1 while cuda:0 is current (a model spread over the GPUs of one process) step bit for bit as
    the same params on cuda:0, and cuda:0 stays current."""
    torch.cuda.set_device(0)
    runs = []
    for dev in ("cuda:0", "cuda:1"):
        ps = make_params(dev, F32)
        opt = make(case, ps)
        run(opt, ps, range(4))
        torch.cuda.synchronize(dev)
        assert torch.cuda.current_device() == 0
        runs.append([p.detach().cpu() for p in ps])
    for p, q in zip(*runs):
        assert torch.equal(p, q)


# ---- params at different step counts in one bucket ----------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_a_param_that_sat_steps_out_steps_as_if_it_had_not(case, backend, device):
    """A param without a gradient at the first steps (skipped, its state made later) shares the fused launches
    of its bucket with params steps ahead of it: it takes its own step count (bias corrections, relative steps,
    GaLore's refresh schedule), bit for bit as the same param in a twin whose params all start together and get
    the same gradients at its steps."""
    late, skipped, steps = 2, 3, 8  # the last param: a kernel reading the first param's step would miss it
    ps, tw = make_params(device), make_params(device)
    opt, twin = make(case, ps), make(case, tw)
    for t in range(steps):
        set_grads(ps, t)
        if t < skipped:
            ps[late].grad = None
        opt.step()
    for t in range(skipped, steps):
        set_grads(tw, t)  # the late param's gradients at its own steps; the others' do not matter here
        twin.step()
    assert float(opt.state[ps[late]]["step"]) == steps - skipped
    assert float(opt.state[ps[1]]["step"]) == steps
    assert torch.equal(ps[late], tw[late])
    sa, sb = opt.state[ps[late]], twin.state[tw[late]]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_galore_step_counters_set_from_outside_at_a_skipped_step_keep_the_refresh_schedule():
    """Two GaLore optimizers (update_proj_gap=3) over the same params and gradients, stepped with GradScaler's
    grad_scale / found_inf, the third step skipped (found_inf=1); the second has its step counters replaced by
    copies (state set from outside: the host's mirror of them must read them) just before that skipped step.
    After 8 calls (7 steps taken) both are bit for bit the same: their bases refreshed at the same steps."""
    ps_a, ps_b = make_params("cpu"), make_params("cpu")
    oa, ob = make("galore32", ps_a), make("galore32", ps_b)
    for t in range(8):
        for o, ps in ((oa, ps_a), (ob, ps_b)):
            set_grads(ps, t)
            if t == 2 and o is ob:
                for st in o.state.values():
                    st["step"] = st["step"].clone()
            o.grad_scale, o.found_inf = torch.ones(()), torch.full((), 1.0 if t == 2 else 0.0)
            o.step()
    assert all(float(st["step"]) == 7 for st in ob.state.values())
    assert_same(oa, ob)


@pytest.mark.parametrize("case", list(CASES))
def test_params_of_two_dtypes_in_one_group_step_as_in_groups_of_one_dtype(case, backend, device):
    """One param group of fp32 and fp64 params (a model partly kept in fp64, or fp32 norms beside low-precision
    matrices): each dtype is a bucket of its own, so every param steps as in a group of its dtype alone, over
    several steps of fresh gradients (a bucket keyed without the dtype steps the fp64 params in the fp32 ones'
    launches or arithmetic), and keeps a kernels' cache of its own (one cache of both would be rebuilt for each
    bucket in turn, at every step)."""
    dtypes = [F32, F64, F64]  # the fp32 param first: a bucket of both would take its dtype
    mixed = [p.to(dtype=d).detach().requires_grad_() for p, d in zip(make_params(device, F64), dtypes)]
    init = [p.detach().clone() for p in mixed]
    uniform = {d: make_params(device, d) for d in (F32, F64)}
    opt = make(case, mixed)
    refs = {d: make(case, ps) for d, ps in uniform.items()}
    for t in range(5):
        run(opt, mixed, [t])
        for d, ps in uniform.items():
            run(refs[d], ps, [t])
    for i, (p, d) in enumerate(zip(mixed, dtypes)):
        ref = uniform[d][i]
        assert p.dtype == ref.dtype == d
        err = rel_update_error([p], [ref], [init[i]])
        assert err <= TOL[d], (case, i, d, err)
        assert float(opt.state[p]["step"]) == float(refs[d].state[ref]["step"]) == 5
    buckets = {(id(g), p.dtype) for g in opt.param_groups for p in g["params"]}
    assert len(opt._plans) == len(buckets), (case, len(opt._plans), len(buckets))


@pytest.mark.parametrize("case", ["lamb8", "galore8", "came8", "adamw8bit"])
def test_a_non_finite_gradient_element_costs_the_same_elements_on_every_back_end(case, monkeypatch):
    """Without GradScaler, fp32 params, a NaN in one gradient element and an inf in another at the second of 3
    steps: every back end leaves the same elements non-finite and the others within fp32 rounding of each other,
    and the same 8-bit blocks with a non-finite absmax. The extension's and the Triton kernels' block absmax pass
    over a NaN, which takes code 0 (bitsandbytes' CPU quantizer does the same), and a block of NaN only has absmax
    0; the reference's absmax was the NaN, so on CPU tensors a NaN cost its whole block (Lamb(nbits=8): 64
    elements here, 256 with the default blocks) where the same run on the GPU lost one element. CAME's clip and
    GaLore's projection spread the NaN over the whole param on every back end: their blocks of NaN (the Triton
    absmax was NaN there) tell the back ends apart."""
    from conftest import _triton_runs_here
    if case == "adamw8bit":  # its 8-bit step is the extension's on every back end but torch
        from fastopt import ext
        ext.load()
        backs = ["torch", "auto"]
    else:
        backs = ["torch"] + (["triton"] if _triton_runs_here() and fastopt.ops.interpreting() else [])
    if len(backs) < 2:
        pytest.skip("one back end here")
    out, absmax = {}, {}
    for back in backs:
        monkeypatch.setenv("FASTOPT_BACKEND", back)
        ps = make_params("cpu", F32)
        opt = make(case, ps)
        for t in range(3):
            set_grads(ps, t)
            if t == 1:
                ps[2].grad[0, 3] = float("nan")
                ps[2].grad[10, 5] = float("inf")
            opt.step()
        out[back] = [p.detach().clone() for p in ps]
        absmax[back] = [st[k].isfinite() for p in ps for st in [opt.state[p]] for k in sorted(st) if "absmax" in k]
    ref = out["torch"]
    assert not all(bool(p.isfinite().all()) for p in ref) and absmax["torch"]
    for back in backs[1:]:
        assert len(absmax[back]) == len(absmax["torch"])
        assert all(torch.equal(a, b) for a, b in zip(absmax[back], absmax["torch"])), back
        for p, q in zip(out[back], ref):
            assert torch.equal(p.isfinite(), q.isfinite()), (back, int((~p.isfinite()).sum()),
                                                            int((~q.isfinite()).sum()))
            fin = q.isfinite()
            torch.testing.assert_close(p[fin], q[fin], rtol=1e-5, atol=1e-6)
