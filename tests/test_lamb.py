"""fastopt.Lamb against a float64 LAMB written here from issue 4's text, both back ends."""
from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import (TOL, Counting, assert_tracks, rel_update_error, step_with_inf_at, group_key,
                      check_bad_key_refused_after_a_step, check_refuses_sparse_and_complex,
                      check_skips_params_without_grad, check_no_host_sync, save_load, feed, adam_8bit_reference,
                      assert_matches_8bit_reference, near_decision_points, run_changed_midway)

import fastopt
from fastopt import ops
from fastopt.reference.quant import quantize_blockwise
from sr_checks import (assert_sr_beats_nearest, check_noise_varies, check_sr_deterministic,
                       sr_problem)

# A single element to N-D in one optimizer; several params span more than one program of the kernels.
SHAPES = [(), (1,), (7,), (300,), (3, 5), (17, 19), (2, 3, 4, 5)]
ZERO_PARAM = 4   # starts at zero: ||p|| = 0 at step 1, so its trust ratio must be 1
ZERO_GRAD = 1    # gradient always zero: with weight_decay=0, ||a|| = 0 (ratio 1, no move)
SCALES = [1.0, 1.0, 3.0, 0.05, 0.0, 1.0, 4.0]  # spread the trust ratios so that max_trust_ratio binds for some
OPTIONS = {
    "default": dict(),
    "decay": dict(weight_decay=0.1),
    "no_bias_correction": dict(bias_correction=False),
    "clamped": dict(max_trust_ratio=1.5, weight_decay=0.01),
    "beta1_zero": dict(betas=(0.0, 0.99)),
    "all": dict(lr=0.02, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.05, bias_correction=False, max_trust_ratio=0.9),
}
LR = 0.05
STEPS = 40       # float64 comparisons: long enough for bias correction to fade and errors to accumulate
# Low-precision params: the run length TOL's bf16/fp16 entries were measured on. GradScaler: the skipped step
# is what is tested (its 8-bit variant runs two 8-bit runs through the interpreter).
STEPS_SHORT = 10
SMALL_8BIT = dict(block_size=64, min_8bit_size=16)  # nbits=8 on test-sized params: several blocks, partial last


def make_problem(shapes=SHAPES, scales=None, steps=STEPS, seed=0, zero_grad=None):
    g = torch.Generator().manual_seed(seed)
    scales = scales or [1.0] * len(shapes)
    init = [torch.randn(s, generator=g, dtype=torch.float64) * c for s, c in zip(shapes, scales)]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) * (1 + 0.3 * t) for s in shapes] for t in range(steps)]
    if zero_grad is not None:
        for step_grads in grads:
            step_grads[zero_grad].zero_()
    return init, grads


def lamb_reference(init, grads, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True,
                   max_trust_ratio=None, lrs=None, store=torch.float64, change=None):
    """LAMB as issue 4 states it, in float64, one parameter at a time. `store`: round p to this dtype after
    every step (the precision floor of a param kept in `store`). `change`: (k, name, value), the argument `name`
    is `value` from step k + 1 on. Returns (params, exp_avg, exp_avg_sq, ratios)."""
    ps = [x.to(store).double() for x in init]
    ms = [torch.zeros_like(x) for x in ps]
    vs = [torch.zeros_like(x) for x in ps]
    ratios = []
    for t, step_grads in enumerate(grads, start=1):
        if change is not None and t == change[0] + 1:
            h = dict(betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                     max_trust_ratio=max_trust_ratio)
            h[change[1]] = change[2]
            betas, eps, weight_decay, bias_correction, max_trust_ratio = h.values()
        beta1, beta2 = betas
        step_lr = lrs[t - 1] if lrs is not None else lr
        eta = step_lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t) if bias_correction else step_lr
        ratios.append([])
        for i, g in enumerate(step_grads):
            g = g.to(store).double()
            ms[i] = beta1 * ms[i] + (1 - beta1) * g
            vs[i] = beta2 * vs[i] + (1 - beta2) * g * g
            a = ms[i] / (vs[i].sqrt() + eps) + weight_decay * ps[i]
            p_norm, a_norm = ps[i].norm().item(), a.norm().item()
            ratio = p_norm / a_norm if p_norm > 0 and a_norm > 0 else 1.0
            if max_trust_ratio is not None:
                ratio = min(ratio, max_trust_ratio)
            ratios[-1].append(ratio)
            ps[i] = (ps[i] - eta * ratio * a).to(store).double()
    return ps, ms, vs, ratios


def run(init, grads, dtype, device="cpu", lrs=None, **kw):
    params = [p.to(device=device, dtype=dtype, copy=True).requires_grad_() for p in init]
    opt = fastopt.Lamb(params, **kw)
    sched = None
    if lrs is not None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lrs[min(t, len(lrs) - 1)] / kw["lr"])
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.to(device=device, dtype=dtype)
        opt.step()
        if sched is not None:
            sched.step()
    return params, opt


def states(opt, params, key):
    return [opt.state[p][key].cpu() for p in params]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_matches_float64_reference(backend, device, option):
    kw = {"lr": LR, **OPTIONS[option]}
    init, grads = make_problem(scales=SCALES, zero_grad=ZERO_GRAD)
    ours, opt = run(init, grads, torch.float64, device, **kw)
    ref, m_ref, v_ref, ratios = lamb_reference(init, grads, **kw)
    ours = [p.detach().cpu() for p in ours]
    assert_tracks(ours, ref, init, torch.float64)
    for i, (a, b, c) in enumerate(zip(ours, ref, init)):
        if torch.equal(b, c):  # zero gradient, no decay: the update is 0 and so must ours be
            assert torch.equal(a, c), f"param {i} moved"
        else:
            assert rel_update_error([a], [b], [c]) <= TOL[torch.float64], f"param {i}"
    for key, want in (("exp_avg", m_ref), ("exp_avg_sq", v_ref)):
        for x, y in zip(states(opt, opt.param_groups[0]["params"], key), want):
            torch.testing.assert_close(x, y, rtol=TOL[torch.float64], atol=0)
    assert all(float(s["step"]) == STEPS and s["step"].dtype == torch.float32 for s in opt.state.values())
    assert all(t.dtype == torch.float64 for s in opt.state.values() for k, t in s.items() if k != "step")
    # The problem exercises what it claims to: ratio 1 for the zero param, and a clamp that binds for some
    # params but not all.
    assert ratios[0][ZERO_PARAM] == min(1.0, kw.get("max_trust_ratio") or 1.0)
    if "max_trust_ratio" in kw:
        flat = [r for step in ratios for r in step]
        assert sum(r == kw["max_trust_ratio"] for r in flat) > 0 and min(flat) < kw["max_trust_ratio"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_tracks_reference(backend, device, dtype):
    kw = dict(lr=LR, weight_decay=0.01, max_trust_ratio=2.0)
    init, grads = make_problem(shapes=[(16, 24), (3, 8, 8), (24,), ()], scales=[1.0, 3.0, 0.1, 1.0],
                               steps=STEPS_SHORT)
    truth, *_ = lamb_reference(init, grads, **kw)
    ref_lowp, *_ = lamb_reference(init, grads, store=dtype, **kw)
    ours, opt = run(init, grads, dtype, device, **kw)
    assert all(p.dtype == dtype for p in ours)
    assert all(t.dtype == torch.float32 for s in opt.state.values() for t in s.values())
    assert_tracks([p.detach().cpu() for p in ours], truth, [p.to(dtype) for p in init], dtype, ref_lowp=ref_lowp)


def test_bf16_stochastic_rounding_tracks_float64(backend, device):
    """Updates far below half a bf16 ulp: round-to-nearest never moves p, stochastic rounding tracks the float64
    run in mean and element by element."""
    kw = dict(lr=2e-4, bias_correction=False)
    init, grads = sr_problem([(16, 64), (1000,)], 12)
    truth, *_ = lamb_reference(init, grads, **kw)
    nearest, _ = run(init, grads, torch.bfloat16, device, **kw)
    sr, _ = run(init, grads, torch.bfloat16, device, bf16_stochastic_round=True, **kw)
    assert_sr_beats_nearest(sr, nearest, truth, init, len(grads), rel=0.15)  # 6 standard deviations of the mean


@pytest.mark.parametrize("nbits", [32, 8])
def test_bf16_stochastic_rounding_noise_varies(backend, device, nbits):
    params = [torch.ones(s, dtype=torch.bfloat16, device=device, requires_grad=True)
              for s in [(32, 64), (32, 64), (2048,), (2048,)]]
    # update = lr * |p| per element here (a uniform a, trust ratio ||p|| / ||a||): 0.4 ulp below 1
    opt = fastopt.Lamb(params, lr=0.4 * 2.0 ** -8, bias_correction=False, bf16_stochastic_round=True, nbits=nbits,
                       **SMALL_8BIT)
    check_noise_varies(opt, params)


@pytest.mark.parametrize("nbits", [32, 8])
def test_bf16_stochastic_rounding_is_deterministic(backend, device, nbits):
    init, grads = make_problem(shapes=[(7,), (9, 40), (), (300,)], steps=4)
    check_sr_deterministic(lambda ps: fastopt.Lamb(ps, lr=LR, weight_decay=0.01, bf16_stochastic_round=True,
                                                   nbits=nbits, **SMALL_8BIT), init, grads, device)


def test_nan_in_one_gradient_element_matches_reference(backend, device):
    """A NaN in one element of a gradient (no GradScaler): that element's m, v and param turn NaN and stay so; the
    param's trust ratio (a NaN norm) falls back to 1 as in the float64 LAMB, so every other element steps on
    (with max_trust_ratio too: the clamp keeps the ratio of 1)."""
    kw = dict(lr=LR, weight_decay=0.01, max_trust_ratio=2.0)
    init, grads = make_problem(shapes=[(6, 5), (40,), ()], steps=STEPS_SHORT)
    grads[3][0][2, 1] = float("nan")
    ours, opt = run(init, grads, torch.float64, device, **kw)
    ref, m_ref, v_ref, _ = lamb_reference(init, grads, **kw)
    ours = [p.detach().cpu() for p in ours]
    for k, (x, r) in enumerate(zip(ours, ref)):
        assert torch.equal(x.isnan(), r.isnan()), f"param {k}: NaN pattern"
    assert ref[0].isnan().sum() == 1 and not any(r.isnan().any() for r in ref[1:])
    finite = [~r.isnan() for r in ref]
    assert_tracks([x[f] for x, f in zip(ours, finite)], [r[f] for r, f in zip(ref, finite)],
                  [x[f] for x, f in zip(init, finite)], torch.float64)
    for key, want in (("exp_avg", m_ref), ("exp_avg_sq", v_ref)):
        for x, y in zip(states(opt, opt.param_groups[0]["params"], key), want):
            torch.testing.assert_close(x, y, rtol=TOL[torch.float64], atol=0, equal_nan=True)


@pytest.mark.parametrize("nbits", [32, 8])
def test_huge_gradient_keeps_the_state_finite(backend, device, nbits):
    """fp32 params, a gradient of +-3e19 in one element: g^2 = 9e38 overflows fp32 (max 3.4e38), (1 - beta2) g g
    computed as ((1 - beta2) g) g, as the reference does, does not (9e35). The state stays finite and is the
    float64 LAMB's (8-bit: its codes, to the last one)."""
    kw = dict(lr=LR, weight_decay=0.01)
    init, grads = make_problem(shapes=[(24, 40), (200,), (7,)], steps=STEPS_SHORT)
    grads[2][0][3, 5] = 3e19
    grads[4][1][17] = -3e19
    grads = [[g.float().double() for g in step_grads] for step_grads in grads]  # what the fp32 run sees
    ours, opt = run(init, grads, torch.float32, device, nbits=nbits, **SMALL_8BIT, **kw)
    params = opt.param_groups[0]["params"]
    assert all(t.isfinite().all() for s in opt.state.values() for t in s.values() if t.is_floating_point())
    ours = [p.detach().cpu() for p in ours]
    if nbits == 32:
        ref, m_ref, v_ref, _ = lamb_reference(init, grads, **kw)
        assert v_ref[0].max() > 1e35 and v_ref[1].max() > 1e35
        for x, y in zip(states(opt, params, "exp_avg_sq"), v_ref):
            torch.testing.assert_close(x.double(), y, rtol=TOL[torch.float32], atol=0)
        for x, y in zip(states(opt, params, "exp_avg"), m_ref):
            torch.testing.assert_close(x.double(), y, rtol=TOL[torch.float32], atol=TOL[torch.float32])
    else:
        ref, codes = lamb8_reference(init, grads, block_size=SMALL_8BIT["block_size"],
                                     min_8bit_size=SMALL_8BIT["min_8bit_size"], **kw)
        for k in range(2):
            st = opt.state[params[k]]
            assert torch.equal(st["exp_avg"].cpu(), codes[k][0]) and torch.equal(st["exp_avg_sq"].cpu(), codes[k][1])
            assert st["exp_avg_sq_absmax"].max() > 1e35
    assert_tracks(ours, ref, init, torch.float32)


@pytest.mark.parametrize("dtype, nbits", [(torch.float32, 32), (torch.bfloat16, 32), (torch.float32, 8)])
def test_state_dict_round_trip_is_bit_identical(backend, device, dtype, nbits):
    kw = dict(lr=LR, weight_decay=0.01, max_trust_ratio=2.0, nbits=nbits, **SMALL_8BIT)
    init, grads = make_problem(shapes=[(5, 7), (2, 3, 4), (6,), ()], steps=10)
    straight, _ = run(init, grads, dtype, device, **kw)
    first, opt = run(init, grads[:5], dtype, device, **kw)
    loaded = save_load(opt.state_dict())
    params = [p.detach().clone().requires_grad_() for p in first]
    opt2 = fastopt.Lamb(params, **kw)
    opt2.load_state_dict(loaded)
    for p in params:
        eight = nbits == 8 and p.numel() >= SMALL_8BIT["min_8bit_size"]
        for k, t in opt2.state[p].items():
            assert t.dtype == (torch.uint8 if eight and k in ("exp_avg", "exp_avg_sq") else torch.float32), k
            assert t.device == p.device
    assert (nbits == 8) == (opt2.state[params[0]]["exp_avg"].dtype == torch.uint8)
    feed(opt2, params, grads[5:])
    for a, b in zip(params, straight):
        assert torch.equal(a, b)


@pytest.mark.parametrize("nbits", [32, 8])
def test_grad_scaler_and_skipped_overflow(backend, device, nbits):
    kw = dict(lr=LR, weight_decay=0.01)
    init, grads = make_problem(shapes=[(6, 5), (4,), ()], steps=STEPS_SHORT)
    inf_step = 3
    if nbits == 8:  # the skipped step must leave the 8-bit state as it was: compare with an 8-bit run without it
        ref, _ = run(init, grads[:inf_step] + grads[inf_step + 1:], torch.float32, device, nbits=8, **SMALL_8BIT,
                     **kw)
        ref = [p.detach().cpu() for p in ref]
        kw.update(nbits=8, **SMALL_8BIT)
    else:
        ref, *_ = lamb_reference(init, grads[:inf_step] + grads[inf_step + 1:], **kw)
    params = [p.to(device=device, dtype=torch.float32, copy=True).requires_grad_() for p in init]
    opt = fastopt.Lamb(params, **kw)
    step_with_inf_at(opt, params, grads, inf_step, device)
    assert all(float(s["step"]) == len(grads) - 1 for s in opt.state.values())
    assert_tracks([p.detach().cpu() for p in params], ref, init, torch.float32)


def test_inf_on_the_first_step_changes_nothing(backend, device):
    p = torch.randn(5, 3, device=device, requires_grad=True)
    opt = fastopt.Lamb([p], lr=LR)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12)
    scaler.scale((p * float("inf")).sum()).backward()
    p0 = p.detach().clone()
    scaler.step(opt)
    assert torch.equal(p, p0)
    st = opt.state[p]
    assert float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()


# Every hyperparameter a group may change between steps (lr: test_lr_scheduler_drives_group_lr): its new value.
LAMB_CHANGES = {"betas": (0.5, 0.9), "eps": 1e-3, "weight_decay": 0.2, "max_trust_ratio": 0.5,
                "bias_correction": False}


@pytest.mark.parametrize("key", list(LAMB_CHANGES))
def test_hyperparameter_changed_between_steps_takes_effect(backend, device, key):
    """A group's hyperparameter set between steps (lr fixed) steps from the next step on as the float64 LAMB
    with that change: 6 steps, the change before the fourth (the kernels keep the group's values in a device
    tensor, which must follow the group)."""
    kw = dict(lr=LR, weight_decay=0.05, max_trust_ratio=2.0)
    init, grads = make_problem(steps=6)
    ours = run_changed_midway(fastopt.Lamb, init, grads, device, kw, key, LAMB_CHANGES[key])
    ref, *_ = lamb_reference(init, grads, **kw, change=(3, key, LAMB_CHANGES[key]))
    assert_tracks(ours, ref, init, torch.float64)


def test_lr_scheduler_drives_group_lr(backend, device):
    kw = dict(lr=LR, weight_decay=0.01)
    lrs = [LR / (1 + t) for t in range(STEPS)]
    init, grads = make_problem(shapes=[(4, 6), (5,)])
    ours, _ = run(init, grads, torch.float64, device, lrs=lrs, **kw)
    ref, *_ = lamb_reference(init, grads, lrs=lrs, **kw)
    assert_tracks([p.detach().cpu() for p in ours], ref, init, torch.float64)


def test_param_groups_and_buckets(backend, device):
    """Two groups with their own hyperparameters, and fp32 and fp64 params in one group."""
    init, grads = make_problem(shapes=[(4, 6), (5,), (3, 3), (8,)])
    dtypes = [torch.float64, torch.float32, torch.float64, torch.float64]
    params = [p.to(device=device, dtype=d, copy=True).requires_grad_() for p, d in zip(init, dtypes)]
    opt = fastopt.Lamb([{"params": params[:2]}, {"params": params[2:], "lr": 0.01, "max_trust_ratio": 0.5}],
                       lr=LR, weight_decay=0.02)
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.to(device=device, dtype=p.dtype)
        opt.step()
    ref_a, *_ = lamb_reference(init[:2], [g[:2] for g in grads], lr=LR, weight_decay=0.02)
    ref_b, *_ = lamb_reference(init[2:], [g[2:] for g in grads], lr=0.01, weight_decay=0.02, max_trust_ratio=0.5)
    ours = [p.detach().cpu() for p in params]
    assert_tracks([ours[0]], [ref_a[0]], [init[0]], torch.float64)
    assert_tracks([ours[1]], [ref_a[1]], [init[1]], torch.float32)
    assert_tracks(ours[2:], ref_b, init[2:], torch.float64)


class _Captured(Exception):
    pass


def test_reduce_hook_sums_shards_into_whole_param_norms(backend, device):
    """Two simulated ranks each hold a flat slice of every param (one holds nothing of the single element);
    `reduce` sums their norm buffers, as one all-reduce would: the shards together must take the whole
    params' step, whose trust ratios need both halves' norms."""
    kw = dict(lr=LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True, max_trust_ratio=None)
    shapes = [(), (7,), (3, 50), (2, 3, 4)]
    init, grads = make_problem(shapes=shapes, scales=[1.0, 3.0, 0.1, 1.0])
    cuts = [max(0, x.numel() // 2 - 1) if x.dim() else 0 for x in init]  # uneven cuts, rows cut anywhere

    def split(x, i):
        flat = x.reshape(-1)
        return [flat[:cuts[i]].to(device).clone(), flat[cuts[i]:].to(device).clone()]

    shards = [[], []]
    for i, x in enumerate(init):
        for r, s in enumerate(split(x, i)):
            shards[r].append(s)
    st = [[{"step": torch.zeros((), device=device), "exp_avg": torch.zeros_like(s), "exp_avg_sq": torch.zeros_like(s)}
           for s in shards[r]] for r in range(2)]

    def local_sums(r, gs):
        """Rank r's local norm buffer, from the real code path, on copies (the step stops in `reduce`)."""
        got = {}

        def capture(buf):
            got["buf"] = buf.clone()
            raise _Captured

        copies = [s.clone() for s in shards[r]]
        st_copy = [{k: v.clone() for k, v in s.items()} for s in st[r]]
        with pytest.raises(_Captured):
            ops.lamb_step(copies, gs, st_copy, reduce=capture, **kw)
        return got["buf"]

    for step_grads in grads:
        gs = [[], []]
        for i, g in enumerate(step_grads):
            for r, s in enumerate(split(g, i)):
                gs[r].append(s)
        for r in range(2):
            for s in st[r]:
                s["step"] += 1
        total = local_sums(0, gs[0]) + local_sums(1, gs[1])
        assert total.shape == (2 * len(shapes),)
        for r in range(2):
            ops.lamb_step(shards[r], gs[r], st[r], reduce=lambda buf: buf.copy_(total), **kw)
    ours = [torch.cat([shards[0][i].cpu(), shards[1][i].cpu()]).view(x.shape) for i, x in enumerate(init)]
    ref, *_ = lamb_reference(init, grads, **kw)
    assert_tracks(ours, ref, init, torch.float64)


# ---- nbits=8 ------------------------------------------------------------------------------------------
SHAPES_8BIT = [(24, 40), (200,), (5, 7, 9), (7,), ()]  # the last two stay 32-bit (fewer than min_8bit_size)
# Relative update error of 8-bit state against the 32-bit float64 LAMB after STEPS_8BIT steps of this problem
# (blocks of 64): measured 0.0140 on both back ends with fp32 and fp64 params (0.011 after 10 steps; 32-bit
# state, fp32 params: 1.0e-6); allowed: about 2x that.
TOL_8BIT = 0.03
STEPS_8BIT = 30


def lamb8_reference(init, grads, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, max_trust_ratio=None,
                    block_size=64, min_8bit_size=64, bias_correction=True, lrs=None):
    """LAMB as issue 4 states it, in float64, with m and v stored in the 8-bit block-wise format of issue 5
    (quantized after each step from the exact m_t, v_t, which the update uses). `lrs`: each step's lr (a schedule
    set through the group). Returns (params, codes)."""
    beta1, beta2 = betas

    def update(p, m, v, t, step_lr):
        eta = step_lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t) if bias_correction else step_lr
        a = m / (v.sqrt() + eps) + weight_decay * p
        p_norm, a_norm = p.norm().item(), a.norm().item()
        ratio = p_norm / a_norm if p_norm > 0 and a_norm > 0 else 1.0
        if max_trust_ratio is not None:
            ratio = min(ratio, max_trust_ratio)
        return p - eta * ratio * a

    return adam_8bit_reference(init, grads, betas, block_size, min_8bit_size,
                               [lr] * len(grads) if lrs is None else lrs, update)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_8bit_matches_quantized_reference(backend, device, bias_correction):
    """fp64 params (fp64 math, the same fp32 quantization): the 8-bit step is the float64 LAMB with its
    moments stored in the 8-bit format, to the last code. min_8bit_size=200: the (200,) param has exactly that
    many elements, which makes it 8-bit ("fewer elements keep 32-bit state", bitsandbytes' numel < min rule)."""
    kw = dict(lr=LR, weight_decay=0.01, max_trust_ratio=2.0, min_8bit_size=200, bias_correction=bias_correction)
    init, grads = make_problem(shapes=SHAPES_8BIT, scales=[1.0, 3.0, 0.1, 1.0, 1.0], steps=STEPS_8BIT)
    ours, opt = run(init, grads, torch.float64, device, nbits=8, block_size=64, **kw)
    ref, ref_codes = lamb8_reference(init, grads, **kw)
    assert [c is not None for c in ref_codes] == [True] * 3 + [False] * 2
    for i, (p, r, x, c) in enumerate(zip(ours, ref, init, ref_codes)):
        st = opt.state[p]
        assert rel_update_error([p.detach().cpu()], [r], [x]) <= TOL[torch.float64], f"param {i}"
        assert (st["exp_avg"].dtype == torch.uint8) == (c is not None), f"param {i}: {st['exp_avg'].dtype}"
        if c is None:
            assert st["exp_avg"].dtype == torch.float64 and set(st) == {"step", "exp_avg", "exp_avg_sq"}
        else:
            assert st["exp_avg_absmax"].shape == (math.ceil(p.numel() / 64),)
            assert torch.equal(st["exp_avg"].cpu(), c[0]) and torch.equal(st["exp_avg_sq"].cpu(), c[1]), f"param {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_tracks_32bit_reference(backend, device, dtype):
    kw = dict(lr=LR, weight_decay=0.01)
    init, grads = make_problem(shapes=SHAPES_8BIT, scales=[1.0, 3.0, 0.1, 1.0, 1.0], steps=STEPS_8BIT)
    truth, *_ = lamb_reference(init, grads, **kw)
    ours, opt = run(init, grads, dtype, device, nbits=8, block_size=64, min_8bit_size=64, **kw)
    ours = [p.detach().cpu() for p in ours]
    tol = TOL_8BIT if dtype == torch.float32 else TOL[dtype]  # bf16: its own rounding dominates
    err = rel_update_error(ours, truth, [p.to(dtype) for p in init])
    assert err <= tol, f"8-bit state, {dtype}: relative update error {err:.3g} > {tol}"
    # The 32-bit params of the mixed bucket have their own norms: they track the 32-bit LAMB as closely as ever.
    assert_tracks(ours[3:], truth[3:], [p.to(dtype) for p in init[3:]], dtype)
    assert [opt.state[p]["exp_avg"].dtype for p in opt.param_groups[0]["params"]] == [torch.uint8] * 3 + [
        torch.float32] * 2


# Lamb's 8-bit state: (m, its absmax), (v, its absmax).
LAMB_8BIT_KEYS = (("exp_avg", "exp_avg_absmax"), ("exp_avg_sq", "exp_avg_sq_absmax"))

# The defaults fastopt.Lamb documents, written out (with nbits=8 also blocks of 256 and 8-bit state from 4096
# elements on): what `Lamb(params)` must step with.
DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True, max_trust_ratio=None)


@pytest.mark.parametrize("nbits", [None, 8])
def test_defaults_are_the_documented_ones(backend, device, nbits):
    """No argument but the params (nbits=None), or nbits=8 alone: DEFAULTS, 32-bit state, and with nbits=8 blocks
    of 256 and 8-bit state from min_8bit_size=4096 elements on. fp64 params, 10 steps: 4096 elements (8-bit with
    nbits=8, else fp64 state), 4095 (fp64 state), a param whose trust ratio exceeds 10 at every step (no clamp by
    default), a single element; the float64 LAMB to TOL[float64], the 8-bit states to the last code."""
    shapes = [(64, 64), (4095,), (7,), ()]
    init, grads = make_problem(shapes=shapes, scales=[1.0, 1.0, 200.0, 1.0], steps=STEPS_SHORT)
    params = [p.to(device=device, copy=True).requires_grad_() for p in init]
    opt = fastopt.Lamb(params) if nbits is None else fastopt.Lamb(params, nbits=8)
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.to(device)
        opt.step()
    ref, _, _, ratios = lamb_reference(init, grads, **DEFAULTS)
    assert min(step[2] for step in ratios) > 10
    codes = [None] * len(shapes)
    if nbits == 8:
        ref, codes = lamb8_reference(init, grads, block_size=256, min_8bit_size=4096, **DEFAULTS)
        assert [c is not None for c in codes] == [True, False, False, False]
    assert_matches_8bit_reference(opt, params, ref, codes, init, 256, LAMB_8BIT_KEYS)


# eps=0: the interpreted Triton kernels compute 0/0 in lanes they mask off (never stored; what is stored is checked).
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_values_at_the_ends_of_the_rules_are_taken(backend, device):
    """The ends of the argument rules, given to the constructor: lr=0 (a warm-up from 0: the group's lr is raised
    after 3 steps, as a scheduler would), eps=0, nbits=8 with block_size=4096 and min_8bit_size=0 (every param
    8-bit, the single element too). The steps at lr=0 leave the params as they are; over 20 steps (fp64 params)
    the run is the float64 LAMB with 8-bit moments, to the last code."""
    shapes = [(2, 4100), (7,), ()]  # 3 blocks of 4096, the last one partial; one partial block; one element
    init, grads = make_problem(shapes=shapes, scales=[1.0, 3.0, 1.0], steps=20)
    lrs = [0.0] * 3 + [LR] * 17
    kw = dict(eps=0.0, weight_decay=0.01, max_trust_ratio=2.0)
    params = [p.to(device=device, copy=True).requires_grad_() for p in init]
    opt = fastopt.Lamb(params, lr=0.0, nbits=8, block_size=4096, min_8bit_size=0, **kw)
    for t, step_grads in enumerate(grads):
        opt.param_groups[0]["lr"] = lrs[t]
        for p, gr in zip(params, step_grads):
            p.grad = gr.to(device)
        opt.step()
        if t == 2:
            assert all(torch.equal(p.detach().cpu(), x) for p, x in zip(params, init))
    ref, codes = lamb8_reference(init, grads, lr=None, lrs=lrs, block_size=4096, min_8bit_size=0, **kw)
    assert all(c is not None for c in codes)
    assert_matches_8bit_reference(opt, params, ref, codes, init, 4096, LAMB_8BIT_KEYS)


# eps=0: the interpreted Triton kernels compute 0/0 in lanes they mask off (never stored; what is stored is checked).
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_eps_zero_and_a_param_of_many_programs_with_32bit_state(backend, device):
    """32-bit state, eps=0 (a value the rules take): the last program of each param is partly masked, and there
    m = v = 0, so a lane not masked out of ||a|| would put 0/0 into it (ratio 1, a wrong step). The (90, 100)
    param spans 71 programs of the kernels under the interpreter, more per-program partials than one block of
    the segment sum that adds them into its norms. 10 steps against the float64 LAMB."""
    kw = dict(lr=LR, eps=0.0, weight_decay=0.01)
    init, grads = make_problem(shapes=[(7,), (300,), (3, 5), (90, 100)], scales=[1.0, 3.0, 0.5, 1.0], steps=10)
    ours, _ = run(init, grads, torch.float64, device, **kw)
    ref, *_ = lamb_reference(init, grads, **kw)
    for i, (a, b, c) in enumerate(zip(ours, ref, init)):
        assert rel_update_error([a.detach().cpu()], [b], [c]) <= TOL[torch.float64], f"param {i}"


def test_8bit_codes_on_the_decision_points_and_of_nan(backend, device):
    """beta1=0: m_t is the gradient itself, so each step quantizes a chosen m. Blocks of 256 whose absmax is 1, 3
    or 0.7 and whose other values sit on and one or two ulps beside the map's decision points (x / absmax, an
    IEEE division: ties go to the lower code), and a block with a NaN (passed over by the absmax, code 0),
    shifted by one block at each of 3 steps: after every step, each code of exp_avg is
    fastopt.reference.quant.quantize_blockwise's of that step's m, and so is every absmax."""
    block = 256
    x = near_decision_points(True, block)
    nan_block = x[:block].clone()
    nan_block[5] = math.nan
    g = torch.cat([x, nan_block]).double()
    p = torch.ones(g.numel(), dtype=torch.float64, device=device, requires_grad=True)
    opt = fastopt.Lamb([p], lr=1e-3, betas=(0.0, 0.999), nbits=8, block_size=block, min_8bit_size=0)
    for t in range(3):
        gt = torch.roll(g, t * block)
        p.grad = gt.to(device)
        opt.step()
        want, want_amax = quantize_blockwise(gt, block, signed=True)
        st = opt.state[p]
        got = st["exp_avg"].cpu()
        assert got.dtype == torch.uint8
        bad = (got != want).nonzero().flatten().tolist()
        assert not bad, f"step {t + 1}: {len(bad)} codes differ, first at {bad[:5]}: x={gt[bad[:5]].tolist()}"
        assert torch.equal(st["exp_avg_absmax"].cpu(), want_amax), f"step {t + 1}"
        assert int(got[gt.isnan()].item()) == 0


# eps=0: as above.
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_bf16_store_rounds_ties_to_even(backend, device):
    """bf16 params of 1.0 and updates of exactly 2**-9 either way: beta1 = beta2 = 0 and eps=0 make
    a = m / sqrt(v) = sign(g) and ||p|| = ||a|| (trust ratio 1), without bias correction. Down, 1 - 2**-9 is half
    a bf16 ulp below 1 (a tie), and round-to-nearest-even keeps 1.0 (0x3F80, even) where rounding ties down gives
    1 - 2**-8; up, 1 + 2**-9 is a quarter ulp, 1.0 too. 10 steps of fresh random gradients: p stays 1.0."""
    p = torch.ones(300, dtype=torch.bfloat16, device=device, requires_grad=True)
    opt = fastopt.Lamb([p], lr=2.0 ** -9, betas=(0.0, 0.0), eps=0.0, bias_correction=False)
    want = (torch.ones(300) - 2.0 ** -9).to(torch.bfloat16)
    assert torch.equal(want, torch.ones(300, dtype=torch.bfloat16))  # torch's own rounding: the tie goes to 1.0
    gen = torch.Generator().manual_seed(5)
    for t in range(10):
        g = torch.randn(300, generator=gen).to(torch.bfloat16)
        assert bool((g != 0).all()) and bool((g < 0).any()) and bool((g > 0).any())
        p.grad = g.to(device)
        opt.step()
        assert torch.equal(p.detach().cpu(), want), f"step {t + 1}"


def test_dequantized_state_dict_round_trip_is_bit_identical(backend, device):
    """8-bit state in blocks of 128 (several per param, the last one partial), saved in its dequantized form
    (fastopt.checkpoint.dequantized_8bit, what DTensor params save): the values are the moments the codes hold,
    dequantized in blocks of 128; loaded (weights_only) into a fresh Lamb, the state dequantizes to them bit for
    bit and the next 5 steps equal the uninterrupted run's, bit for bit."""
    from fastopt.checkpoint import DEQUANTIZED, dequantized_8bit
    kw = dict(lr=LR, weight_decay=0.01, nbits=8, block_size=128, min_8bit_size=16)
    init, grads = make_problem(shapes=[(5, 70), (200,), (7,)], steps=10)
    straight, _ = run(init, grads, torch.float32, device, **kw)
    first, opt = run(init, grads[:5], torch.float32, device, **kw)
    with dequantized_8bit(opt):
        sd = opt.state_dict()
    for i, p in enumerate(first[:2]):
        st = opt.state[p]
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            want = fastopt.dequantize_blockwise(st[key], st[key + "_absmax"], 128, signed=signed)
            assert set(sd["state"][i][key]) == {DEQUANTIZED} and key + "_absmax" not in sd["state"][i]
            assert torch.equal(sd["state"][i][key][DEQUANTIZED], want), (i, key)
    params = [p.detach().clone().requires_grad_() for p in first]
    opt2 = fastopt.Lamb(params, **kw)
    opt2.load_state_dict(save_load(sd))
    for i, p in enumerate(params[:2]):
        st = opt2.state[p]
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            back = fastopt.dequantize_blockwise(st[key], st[key + "_absmax"], 128, signed=signed)
            assert st[key].dtype == torch.uint8 and torch.equal(back, sd["state"][i][key][DEQUANTIZED]), (i, key)
    feed(opt2, params, grads[5:])
    for a, b in zip(params, straight):
        assert torch.equal(a, b)


def test_flat_ranges_with_padding_take_their_whole_tensors_layout_and_step(backend, device, monkeypatch):
    """Flat ranges declared by hand (fastopt.distributed.declare_shard, one process, `Layout.reduce` patched out:
    each holds its whole tensor), each with 3 padding elements past its end (NaN gradients there, which would
    poison the norms if read). nbits=8, min_8bit_size=320, blocks of 64: the whole tensors' sizes decide the state,
    not the local pieces': (16, 20) is 8-bit, its padding in a 6th block of its own; (317,) keeps 32-bit state
    though its piece has 320 elements. Over 10 steps (fp64) the real elements are the float64 LAMB with 8-bit
    moments, codes to the last one; the padding stays as it was."""
    from fastopt.distributed import declare_shard
    from fastopt.distributed.layout import Layout
    monkeypatch.setattr(Layout, "reduce", lambda self, buf: None)
    kw = dict(lr=LR, weight_decay=0.01, max_trust_ratio=2.0)
    shapes = [(16, 20), (317,)]
    init, grads = make_problem(shapes=shapes, scales=[1.0, 3.0], steps=STEPS_SHORT)
    params = [declare_shard(torch.cat([x.reshape(-1), x.new_full((3,), 7.0)]).to(device).requires_grad_(), s,
                            "group", flat_offset=0) for x, s in zip(init, shapes)]
    opt = fastopt.Lamb(params, nbits=8, block_size=64, min_8bit_size=320, **kw)
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = torch.cat([gr.reshape(-1), gr.new_full((3,), float("nan"))]).to(device)
        opt.step()
    ref, codes = lamb8_reference(init, grads, block_size=64, min_8bit_size=320, **kw)
    assert [c is not None for c in codes] == [True, False]
    for i, (p, r, x, c) in enumerate(zip(params, ref, init, codes)):
        st = opt.state[p]
        assert torch.equal(p[-3:].detach().cpu(), x.new_full((3,), 7.0)), f"param {i}: padding"
        assert rel_update_error([p[:-3].detach().cpu().view_as(x)], [r], [x]) <= TOL[torch.float64], f"param {i}"
        if c is None:
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["exp_avg"].dtype == torch.float64, f"param {i}"
        else:
            assert st["exp_avg_absmax"].shape == (6,)
            for k, want in (("exp_avg", c[0]), ("exp_avg_sq", c[1])):
                assert torch.equal(st[k][:-3].cpu().view_as(want), want), (i, k)


def _dtensor_lamb(rank, world_size, init, grads, kw):
    """Child of the dist test: the params as DTensors sharded several ways, stepped by fastopt.Lamb."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    placements = [[Shard(0)], [Shard(1)], [Shard(0)], [Replicate()], None]  # uneven rows; columns; vector
    params = [torch.nn.Parameter(x.clone() if pl is None else distribute_tensor(x.clone(), mesh, pl))
              for x, pl in zip(init, placements)]
    opt = fastopt.Lamb(params, **kw)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for step_grads in grads:
            for p, g, pl in zip(params, step_grads, placements):
                p.grad = g.clone() if pl is None else distribute_tensor(g.clone(), mesh, pl)
            opt.step()
    finally:
        dist.all_reduce = real
    full = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]
    return full, len(calls)


@pytest.mark.dist
def test_dtensor_shards_match_single_process():
    """Tensor-parallel shards (uneven rows, columns, a sharded vector) next to replicated and plain params:
    the trust ratios use the whole params' norms, with one all-reduce per step for the sharded bucket."""
    from dist_utils import run as dist_run
    kw = dict(lr=LR, weight_decay=0.01, max_trust_ratio=2.0)
    init, grads = make_problem(shapes=[(7, 5), (4, 6), (9,), (3, 2), (5,)], scales=[1.0, 3.0, 0.1, 1.0, 1.0])
    ref, *_ = lamb_reference(init, grads, **kw)
    results = dist_run(_dtensor_lamb, 2, init, grads, kw, env={"FASTOPT_BACKEND": "torch"})
    for full, n_calls in results:
        assert_tracks(full, ref, init, torch.float64)
        assert n_calls == STEPS


# Per state kind: (shapes repeated to grow the bucket, options, the launches of one step). The 8-bit shapes have
# at least SMALL_8BIT's min_8bit_size elements; "mixed" puts 8-bit and 32-bit state in one bucket.
LAUNCH_CASES = {
    "32bit": ([(3, 4)], {}, ["stats", "segment_sum", "apply"]),
    "8bit": ([(5, 20)], dict(nbits=8, **SMALL_8BIT), ["stats8", "segment_sum", "apply8"]),
    "mixed": ([(5, 20), (3, 4)], dict(nbits=8, **SMALL_8BIT), ["stats", "stats8", "segment_sum", "apply", "apply8"]),
}


@pytest.mark.parametrize("case", list(LAUNCH_CASES))
def test_launches_do_not_grow_with_the_number_of_params(backend, device, monkeypatch, case):
    """Every Lamb kernel counted: one launch of each kind per step, however many params the bucket holds."""
    if backend != "triton":
        pytest.skip("counts Triton launches")
    from fastopt.kernels import lamb as k
    shapes, kw, per_step = LAUNCH_CASES[case]
    launches = []
    for name, attr in (("stats", "_lamb_stats_kernel"), ("apply", "_lamb_apply_kernel"),
                       ("stats8", "_lamb8_stats_kernel"), ("apply8", "_lamb8_apply_kernel"),
                       ("segment_sum", "segment_sum")):
        monkeypatch.setattr(k, attr, Counting(name, getattr(k, attr), launches))
    counts = []
    for n in (1, 6):
        launches.clear()
        init, grads = make_problem(shapes=shapes * n, steps=2)
        _, opt = run(init, grads, torch.float32, device, **kw)
        eight = [opt.state[p]["exp_avg"].dtype == torch.uint8 for p in opt.param_groups[0]["params"]]
        assert eight == [math.prod(s) >= SMALL_8BIT["min_8bit_size"] and "nbits" in kw for s in shapes] * n
        counts.append(list(launches))
    assert counts[0] == counts[1] == per_step * 2


@pytest.mark.gpu
def test_step_does_not_sync_with_the_host():
    params = [torch.randn(s, device="cuda", requires_grad=True) for s in [(64, 32), (32,), ()]]
    opt = fastopt.Lamb(params, lr=LR, max_trust_ratio=2.0)
    check_no_host_sync(opt, params, steps=3)  # the first step, which builds the cached tables, too


def test_skips_params_without_grad_and_empty_params(backend, device):
    check_skips_params_without_grad(lambda a, b, e: fastopt.Lamb([a, b, e], lr=LR), device)


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=-1.0), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(lr=True), "lr"),
    (dict(betas=(1.0, 0.999)), "betas[0]"),
    (dict(betas=(1.5, 0.9)), "betas[0]"), (dict(betas=(0.9, False)), "betas[1]"),
    (dict(betas=(0.9, -0.1)), "betas[1]"),
    (dict(betas=0.9), "betas"),
    (dict(eps=-1e-6), "eps"),
    (dict(eps=-1), "eps"),
    (dict(eps=True), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(weight_decay=-1), "weight_decay"),
    (dict(weight_decay=float("inf")), "weight_decay"),
    (dict(max_trust_ratio=0.0), "max_trust_ratio"),
    (dict(max_trust_ratio=-1), "max_trust_ratio"),
    (dict(max_trust_ratio=float("inf")), "max_trust_ratio"),
    (dict(bias_correction=1), "bias_correction"),
    (dict(bf16_stochastic_round="yes"), "bf16_stochastic_round"),
    (dict(nbits=16), "nbits"),
    (dict(nbits=True), "nbits"),
    (dict(block_size=100), "block_size"),
    (dict(nbits=8, block_size=100), "block_size"),
    (dict(nbits=8, block_size=8192), "block_size"),
    (dict(nbits=8, min_8bit_size=-1), "min_8bit_size"),
])
def test_bad_arguments_name_themselves(kwargs, name, monkeypatch):
    """Refused with a ValueError naming the argument: as a constructor argument; as a group's key, in the
    constructor and in add_param_group; and as a group's key changed between steps. Each refusal leaves the
    optimizer as it was: no group added, no param, state or step counter changed."""
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")  # refused before any kernel runs: the back end is moot
    with pytest.raises(ValueError, match="Lamb: " + re.escape(name) + "="):
        fastopt.Lamb([torch.zeros(2, 2, requires_grad=True)], **kwargs)
    a = torch.randn(8, 12, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="Lamb: " + re.escape(group_key(name, 1)) + "="):
        fastopt.Lamb([{"params": [a]}, {"params": [b], **kwargs}], lr=LR)
    # A working optimizer (8-bit state for a, 32-bit for b).
    opt = fastopt.Lamb([a, b], lr=LR, nbits=8, **SMALL_8BIT)
    check_bad_key_refused_after_a_step(opt, kwargs, name, torch.randn(100, dtype=torch.float64, requires_grad=True))


def test_bad_group_lr_refused_before_any_change(backend, device):
    a = torch.randn(4, 3, device=device, requires_grad=True)
    b = torch.randn(5, device=device, requires_grad=True)
    opt = fastopt.Lamb([{"params": [a]}, {"params": [b]}], lr=LR)
    opt.param_groups[1]["lr"] = -0.5
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    a0 = a.detach().clone()
    with pytest.raises(ValueError, match=r"Lamb: param_groups\[1\]\['lr'\]=-0.5"):
        opt.step()
    assert torch.equal(a, a0) and not opt.state[a]


def test_sparse_and_complex_refused_before_any_change(backend, device):
    check_refuses_sparse_and_complex(lambda a, other: fastopt.Lamb([a, other]), device)
