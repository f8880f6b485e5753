"""fastopt.Adafactor against transformers' Adafactor (float64), both back ends."""
from __future__ import annotations

import pytest
import torch
from conftest import (TALL_ROWS, TOL, assert_tracks, rel_update_error, step_with_inf_at,
                      launches_per_step, check_bad_group_refused, check_foreign_group_count_refused,
                      check_refuses_sparse_and_complex, check_skips_params_without_grad, feed, save_load,
                      check_lr_scheduler_drives_group_lr, run_changed_midway)
from transformers.optimization import Adafactor as HFAdafactor

import fastopt
from sr_checks import (assert_sr_beats_nearest, check_noise_varies, check_own_state_dict_keeps_sr,
                       check_sr_deterministic, sr_problem)

SHAPES = [(1, 9), (9, 1), (3, 5), (2, 3, 4, 5), (7,), (1,), ()]
OPTIONS = {
    "default": dict(),
    "beta1": dict(beta1=0.9),
    "decay": dict(weight_decay=0.05),
    "warmup": dict(warmup_init=True),
    "no_scale": dict(scale_parameter=False),
    "fixed_lr": dict(lr=3e-2, relative_step=False),
    "all": dict(lr=3e-2, relative_step=False, scale_parameter=False, beta1=0.8, weight_decay=0.1,
                clip_threshold=0.5, decay_rate=-0.6),
    # From zero params the step size stays on its floor eps2 (RMS(p) < eps2 all along), and eps1 is not small
    # next to g^2: both eps act.
    "eps_zero_init": dict(eps=(1e-2, 1e-2)),
    "eps1_zero_init": dict(eps=(0.5, 1e-3), beta1=0.9),
    # The same with the default eps: the step size sits on the default eps2.
    "zero_init": dict(),
    # beta1=0 keeps an `exp_avg` (the last update), as transformers does for any beta1 that is not None.
    "beta1_zero": dict(beta1=0.0),
    # The ends of the rule "(eps1, eps2), each >= 0": g^2 alone in the factors, RMS(p) alone as the scale.
    "eps_zero": dict(eps=(0.0, 0.0), beta1=0.9),
    # decay_rate=0, taken by transformers and torch: beta2_t = 1 - t^0 = 0, the factors of g^2 alone each step.
    "decay_rate_zero": dict(decay_rate=0.0, beta1=0.9),
}
STEPS = 10


def make_problem(shapes=SHAPES, steps=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) * (1 + t) for s in shapes] for t in range(steps)]
    return init, grads


def run(cls, init, grads, dtype, device="cpu", **kw):
    params = [p.detach().clone().to(device=device, dtype=dtype).requires_grad_() for p in init]
    opt = cls(params, **kw)
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.to(device=device, dtype=dtype)
        opt.step()
    return params, opt


def state_tensors(opt, params, key):
    return [opt.state[p][key] for p in params if key in opt.state[p]]


# eps_zero: the interpreted Triton kernels compute 0/0 in lanes they mask off (never stored; what is stored is
# checked).
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("option", list(OPTIONS))
def test_matches_transformers_float64(backend, device, option):
    kw = OPTIONS[option]
    init, grads = make_problem()
    if option.endswith("zero_init"):
        init = [torch.zeros_like(p) for p in init]
    ours, opt = run(fastopt.Adafactor, init, grads, torch.float64, device, **kw)
    ref, ref_opt = run(HFAdafactor, init, grads, torch.float64, **kw)
    assert_tracks([p.cpu() for p in ours], ref, init, torch.float64)
    for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"):
        a, b = state_tensors(opt, ours, key), state_tensors(ref_opt, ref, key)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            torch.testing.assert_close(x.cpu(), y, rtol=TOL[torch.float64], atol=0)
    assert all(float(opt.state[p]["step"]) == STEPS for p in ours)


@pytest.mark.parametrize("option", ["default", "warmup", "beta1"])
def test_relative_step_after_ten_thousand_steps_matches_transformers(backend, device, option):
    """Past t = 10^4 the relative step is 1/sqrt(t): min(1e-2, 1/sqrt(t)) and min(1e-6 t, 1/sqrt(t)) (warm-up)
    both take that branch, which 10 steps never reach. Three steps, then both optimizers' step counters are set
    to 20000 (as after a long run), then six more steps track transformers' in float64: params (measured from
    where the counters were set) and states."""
    kw = OPTIONS[option]
    init, grads = make_problem(steps=9)
    ours, opt = run(fastopt.Adafactor, init, grads[:3], torch.float64, device, **kw)
    ref, ref_opt = run(HFAdafactor, init, grads[:3], torch.float64, **kw)
    for p, q in zip(ours, ref):
        opt.state[p]["step"].fill_(20000)
        ref_opt.state[q]["step"] = 20000
    mid = [q.detach().clone() for q in ref]
    for step_grads in grads[3:]:
        for p, q, gr in zip(ours, ref, step_grads):
            p.grad, q.grad = gr.to(device), gr.clone()
        opt.step()
        ref_opt.step()
    assert_tracks([p.detach().cpu() for p in ours], [q.detach() for q in ref], mid, torch.float64)
    for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"):
        a, b = state_tensors(opt, ours, key), state_tensors(ref_opt, ref, key)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            torch.testing.assert_close(x.cpu(), y, rtol=TOL[torch.float64], atol=0)
    assert all(float(opt.state[p]["step"]) == 20006 for p in ours)


def test_tall_matrices_match_transformers_float64(backend, device):
    """Matrices taller than one row block of the factored kernels (16 rows under the interpreter, up to 64
    compiled), the last block partial: the column sums add the partials of several row blocks; and one taller
    than the factor kernel's block (256 rows under the interpreter, 1024 compiled): the row factors are formed
    and normalized over several. SHAPES above all fit in one of each."""
    kw = dict(beta1=0.9, weight_decay=0.01)
    init, grads = make_problem(shapes=[(67, 12), (2, 70, 9), (TALL_ROWS, 3), (5,)])
    ours, opt = run(fastopt.Adafactor, init, grads, torch.float64, device, **kw)
    ref, ref_opt = run(HFAdafactor, init, grads, torch.float64, **kw)
    assert_tracks([p.detach().cpu() for p in ours], ref, init, torch.float64)
    for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"):
        a, b = state_tensors(opt, ours, key), state_tensors(ref_opt, ref, key)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            torch.testing.assert_close(x.cpu(), y, rtol=TOL[torch.float64], atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_tracks_reference(backend, device, dtype):
    kw = dict(beta1=0.9, weight_decay=0.01)
    init, grads = make_problem(shapes=[(16, 24), (3, 8, 8), (24,)])
    init = [p.to(dtype).double() for p in init]  # all runs start from the same representable values
    truth, _ = run(HFAdafactor, init, grads, torch.float64, **kw)
    ref_lowp, _ = run(HFAdafactor, init, grads, dtype, **kw)
    ours, opt = run(fastopt.Adafactor, init, grads, dtype, device, **kw)
    assert all(p.dtype == dtype for p in ours)
    assert all(t.dtype == torch.float32 for p in ours for k, t in opt.state[p].items())
    assert_tracks([p.cpu() for p in ours], truth, init, dtype, ref_lowp=ref_lowp)


def test_bf16_stochastic_rounding_tracks_float64(backend, device):
    """Updates far below half a bf16 ulp: round-to-nearest never moves p, stochastic rounding tracks the float64
    run in mean and element by element (factored and vector params)."""
    kw = dict(lr=2e-4, relative_step=False, scale_parameter=False)
    init, grads = sr_problem([(64, 64), (1000,)], 12)
    truth, _ = run(HFAdafactor, init, grads, torch.float64, **kw)
    nearest, _ = run(fastopt.Adafactor, init, grads, torch.bfloat16, device, **kw)
    sr, _ = run(fastopt.Adafactor, init, grads, torch.bfloat16, device, bf16_stochastic_round=True, **kw)
    assert_sr_beats_nearest(sr, nearest, truth, init, len(grads))


def test_bf16_ties_round_to_even_as_transformers(backend, device):
    """bf16 params are stored rounded to nearest, ties to even, as transformers' bf16 run stores them (torch's
    cast). Every update here is exactly half a bf16 ulp, so every element lands on a tie at every step:
    decay_rate=0 makes beta2_t = 0 (V_t = G^2), gradients of magnitude 2^k give U = +-1 exactly (RMS 1: no
    clip), and lr = 2^-8 is half the ulp of params in [1, 2). Both compute the same fp32 values before the
    cast, so the params must agree bit for bit (ties away from zero would drift one way)."""
    g = torch.Generator().manual_seed(5)
    shapes = [(64,), (49,), ()]
    init = [(1.25 + 0.5 * torch.rand(s, generator=g, dtype=torch.float64)).to(torch.bfloat16).double() for s in shapes]
    grads = [[torch.ldexp(torch.randint(0, 2, s, generator=g).double() * 2 - 1,
                          torch.randint(-2, 3, s, generator=g)) for s in shapes] for _ in range(6)]
    kw = dict(lr=2.0 ** -8, relative_step=False, scale_parameter=False, decay_rate=0.0)
    ref, _ = run(HFAdafactor, init, grads, torch.bfloat16, **kw)
    ours, _ = run(fastopt.Adafactor, init, grads, torch.bfloat16, device, **kw)
    for k, (x, y, x0) in enumerate(zip(ours, ref, init)):
        assert not torch.equal(y.detach().double(), x0), k  # the ties were rounded away from the start
        assert torch.equal(x.detach().cpu(), y.detach()), f"param {k}: {int((x.detach().cpu() != y).sum())} differ"


def test_bf16_stochastic_rounding_noise_varies(backend, device):
    params = [torch.ones(s, dtype=torch.bfloat16, device=device, requires_grad=True)
              for s in [(32, 64), (32, 64), (2048,), (2048,)]]
    # A gradient of 1 gives U = 1 (factored and not): the update is lr, 0.4 ulp below 1
    opt = fastopt.Adafactor(params, lr=0.4 * 2.0 ** -8, relative_step=False, scale_parameter=False,
                            bf16_stochastic_round=True)
    check_noise_varies(opt, params)


def test_bf16_stochastic_rounding_is_deterministic(backend, device):
    init, grads = make_problem(shapes=[(300,), (9, 40), (7,), (2, 3, 50), ()], steps=4)  # not the kernels' order
    check_sr_deterministic(lambda ps: fastopt.Adafactor(ps, beta1=0.9, weight_decay=0.01, bf16_stochastic_round=True),
                           init, grads, device)


@pytest.mark.parametrize("where", ["matrix", "vector"])
def test_nan_in_one_gradient_element_matches_transformers(backend, device, where):
    """A NaN in one element of a gradient (no GradScaler) as transformers' Adafactor takes it: the RMS of the
    update is NaN, so its clip is NaN and the whole param turns NaN (and its momentum), its row and column factors
    (or V) only where the NaN entered; the other params step on."""
    kw = dict(beta1=0.9, weight_decay=0.01)
    init, grads = make_problem(shapes=[(6, 5), (2, 3, 4), (40,), ()], steps=6)
    if where == "matrix":
        grads[2][1][1, 2, 0] = float("nan")
    else:
        grads[2][2][17] = float("nan")
    ours, opt = run(fastopt.Adafactor, init, [], torch.float64, device, **kw)
    ref, ref_opt = run(HFAdafactor, init, [], torch.float64, **kw)
    for t, step_grads in enumerate(grads):  # in lockstep: the NaN pattern right after the NaN step too
        for opt_, params in ((opt, ours), (ref_opt, ref)):
            for p, gr in zip(params, step_grads):
                p.grad = gr.to(device=p.device)
            opt_.step()
        for k, (x, r) in enumerate(zip(ours, ref)):
            assert torch.equal(x.detach().cpu().isnan(), r.detach().isnan()), f"step {t + 1}, param {k}: NaN pattern"
    ours, ref = [p.detach().cpu() for p in ours], [p.detach() for p in ref]
    assert [bool(r.isnan().all()) for r in ref] == [False, where == "matrix", where == "vector", False]
    finite = [0, 3]
    assert_tracks([ours[k] for k in finite], [ref[k] for k in finite], [init[k] for k in finite], torch.float64)
    for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"):
        for k, (x, y) in enumerate(zip(state_tensors(opt, opt.param_groups[0]["params"], key),
                                       state_tensors(ref_opt, ref_opt.param_groups[0]["params"], key))):
            if key != "exp_avg":
                assert not y.isnan().all(), key  # the factors (or V) are NaN only where the NaN entered
            torch.testing.assert_close(x.cpu(), y, rtol=TOL[torch.float64], atol=0, equal_nan=True, msg=key)


def test_state_dict_round_trip_is_bit_identical(backend, device):
    kw = dict(beta1=0.9, weight_decay=0.01)
    init, grads = make_problem(shapes=[(5, 7), (2, 3, 4), (6,), ()])
    straight, _ = run(fastopt.Adafactor, init, grads, torch.float32, device, **kw)
    first, opt = run(fastopt.Adafactor, init, grads[:5], torch.float32, device, **kw)
    loaded = save_load(opt.state_dict())
    params = [p.detach().clone().requires_grad_() for p in first]
    opt2 = fastopt.Adafactor(params, **kw)
    opt2.load_state_dict(loaded)
    assert all(t.dtype == torch.float32 and t.device == p.device for p in params for t in opt2.state[p].values())
    feed(opt2, params, grads[5:])
    for a, b in zip(params, straight):
        assert torch.equal(a, b)


def test_grad_scaler_and_skipped_overflow(backend, device):
    init, grads = make_problem(shapes=[(6, 5), (4,)])
    inf_step = 3
    ref, _ = run(fastopt.Adafactor, init, grads[:inf_step] + grads[inf_step + 1:], torch.float32, device, beta1=0.9)
    params = [p.detach().clone().to(device=device, dtype=torch.float32).requires_grad_() for p in init]
    opt = fastopt.Adafactor(params, beta1=0.9)
    step_with_inf_at(opt, params, grads, inf_step, device)
    assert rel_update_error([p.cpu() for p in params], [p.cpu() for p in ref], init) <= TOL[torch.float32]


# Every hyperparameter a group may change between steps (lr: test_lr_scheduler_drives_group_lr): its new value.
ADAFACTOR_CHANGES = {"beta1": 0.5, "eps": (1e-3, 1e-2), "clip_threshold": 0.3, "decay_rate": -0.5,
                     "weight_decay": 0.2, "scale_parameter": False}


@pytest.mark.parametrize("key", list(ADAFACTOR_CHANGES))
def test_hyperparameter_changed_between_steps_takes_effect(backend, device, key):
    """A group's hyperparameter set between steps (lr fixed) steps from the next step on as transformers'
    Adafactor does, which reads the group at every step: 6 steps in float64, the change before the fourth (the
    kernels keep the group's values in a device tensor, which must follow the group)."""
    kw = dict(lr=3e-2, relative_step=False, beta1=0.9, weight_decay=0.05)
    init, grads = make_problem(steps=6)
    ours = run_changed_midway(fastopt.Adafactor, init, grads, device, kw, key, ADAFACTOR_CHANGES[key])
    ref = run_changed_midway(HFAdafactor, init, grads, "cpu", kw, key, ADAFACTOR_CHANGES[key])
    assert_tracks(ours, ref, init, torch.float64)


def test_lr_scheduler_drives_group_lr(backend, device):
    init, grads = make_problem(shapes=[(4, 6), (5,)])
    check_lr_scheduler_drives_group_lr(fastopt.Adafactor, HFAdafactor, dict(lr=5e-2, relative_step=False, beta1=0.9),
                                       init, grads, device)


def test_skips_params_without_grad_and_empty_params(backend, device):
    check_skips_params_without_grad(lambda a, b, e: fastopt.Adafactor([a, b, e]), device)


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=1e-3), "lr"),
    (dict(lr=-1.0, relative_step=False), "lr"),
    (dict(relative_step=False), "lr"),  # lr=None
    (dict(lr=True, relative_step=False), "lr"),
    (dict(lr=float("inf"), relative_step=False), "lr"),
    (dict(eps=(float("inf"), 1e-3)), "eps[0]"),
    (dict(eps=(1e-30, float("nan"))), "eps[1]"),
    (dict(clip_threshold=float("inf")), "clip_threshold"),
    (dict(clip_threshold=True), "clip_threshold"),
    (dict(decay_rate=-float("inf")), "decay_rate"),
    (dict(scale_parameter=1), "scale_parameter"),
    (dict(eps=(-1e-30, 1e-3)), "eps[0]"),
    (dict(eps=(1e-30, -1.0)), "eps[1]"),
    (dict(eps=1e-3), "eps"),
    (dict(clip_threshold=0.0), "clip_threshold"),
    (dict(decay_rate=0.5), "decay_rate"),
    (dict(beta1=1.0), "beta1"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(warmup_init=True, relative_step=False, lr=1e-3), "warmup_init"),
])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        fastopt.Adafactor([torch.zeros(2, 2, requires_grad=True)], **kwargs)


# A param group's own settings, each bad in one way; the default group is relative-step (lr=None).
BAD_GROUPS = [
    (dict(lr=-1.0), "lr"),
    (dict(relative_step=False), "lr"),  # relative_step=False with lr=None
    (dict(lr=True, relative_step=False), "lr"),
    (dict(lr=float("inf"), relative_step=False), "lr"),
    (dict(eps=(-1.0, 1e-3)), "eps[0]"),
    (dict(eps=(1e-30, float("inf"))), "eps[1]"),
    (dict(eps=1e-3), "eps"),
    (dict(clip_threshold=0.0), "clip_threshold"),
    (dict(clip_threshold=float("inf")), "clip_threshold"),
    (dict(decay_rate=0.5), "decay_rate"),
    (dict(beta1=1.5), "beta1"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(warmup_init=True, relative_step=False, lr=1e-2), "warmup_init"),
    (dict(scale_parameter=1), "scale_parameter"),
]


@pytest.mark.parametrize("how", ["constructor", "add_param_group", "mutated"])
@pytest.mark.parametrize("bad, key", BAD_GROUPS)
def test_bad_group_names_itself_and_changes_nothing(bad, key, how):
    check_bad_group_refused(fastopt.Adafactor, dict(beta1=0.9), bad, key, how)


@pytest.mark.parametrize("how", ["constructor", "add_param_group"])
def test_group_lr_with_relative_step_is_refused_when_added(how):
    """Like the constructor's lr; set later (a scheduler's), it is ignored, as in transformers."""
    check_bad_group_refused(fastopt.Adafactor, dict(beta1=0.9), dict(lr=1e-2), "lr", how)


@pytest.mark.parametrize("how", ["constructor", "add_param_group"])
def test_group_turning_relative_step_on_inherits_the_lr_without_refusal(backend, device, how):
    """A group that turns relative_step on beside groups with a fixed lr takes the defaults' lr without being
    refused (it is not the group's own) and ignores it: its param steps as transformers' relative-step
    Adafactor steps it, over several steps."""
    init, grads = make_problem(shapes=[(4, 6), (3, 5)], steps=6)
    ours = [p.detach().clone().to(device).requires_grad_() for p in init]
    theirs = [p.detach().clone().requires_grad_() for p in init]
    fixed, rel = dict(params=[ours[0]]), dict(params=[ours[1]], relative_step=True)
    if how == "constructor":
        opt = fastopt.Adafactor([fixed, rel], lr=1e-2, relative_step=False)
    else:
        opt = fastopt.Adafactor([fixed], lr=1e-2, relative_step=False)
        opt.add_param_group(rel)
    ref = HFAdafactor([dict(params=[theirs[0]], lr=1e-2, relative_step=False),
                       dict(params=[theirs[1]], lr=None, relative_step=True)], lr=1e-2, relative_step=False)
    for step_grads in grads:
        for a, b, gr in zip(ours, theirs, step_grads):
            a.grad, b.grad = gr.to(device), gr.clone()
        opt.step()
        ref.step()
    assert_tracks([p.detach().cpu() for p in ours], [p.detach() for p in theirs], init, torch.float64)


def test_adafactor_schedule_logs_the_lr_and_steps_like_transformers(backend, device):
    """transformers' AdafactorSchedule (what its Trainer logs with relative-step Adafactor) writes the lr it
    reads from `_get_lr` into the groups, which relative_step ignores: params track transformers', and each
    logged lr is transformers' up to the change of the param's RMS in one step (at most the relative step size:
    the update's RMS is clipped to 1 and scaled by RMS(p) times that size)."""
    from transformers.optimization import AdafactorSchedule
    init, grads = make_problem(shapes=[(4, 6), (5,)], steps=12)
    results, logged = [], []
    for cls, dev in ((fastopt.Adafactor, device), (HFAdafactor, "cpu")):
        params = [p.detach().clone().to(dev).requires_grad_() for p in init]
        opt = cls(params, warmup_init=True)
        sched = AdafactorSchedule(opt)
        lrs = []
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.to(dev)
            opt.step()
            sched.step()
            lrs.append(float(sched.get_last_lr()[0]))
        results.append([p.detach().cpu() for p in params])
        logged.append(lrs)
    assert_tracks(results[0], results[1], init, torch.float64)
    ours, theirs = logged
    for t, (a, b) in enumerate(zip(ours, theirs), start=1):
        rel_step = 1e-6 * t
        assert b > 0 and abs(a - b) <= rel_step * b, (t, a, b)
    assert ours[-1] > 5 * ours[0]  # the warm-up shows


@pytest.mark.parametrize("option", ["default", "warmup", "no_scale", "fixed_lr", "all", "zero_init"])
def test_get_lr_is_transformers_get_lr_for_each_param(backend, device, option):
    """`_get_lr` (what AdafactorSchedule logs) of each param's own state is transformers' `_get_lr` of the same
    group at that param's step with that param's RMS (as it is now): params of different RMS in one group, before
    the first step (without state, then with the zero state state_dict() makes, step 0: either way the step size
    the first step takes, t = 1) and after each of 10 steps; zero params: the RMS is below eps2, the floor."""
    kw = OPTIONS[option]
    init, grads = make_problem(shapes=[(4, 6), (3, 5), (7,), ()])
    init = [p * s for p, s in zip(init, (0.25, 1.0, 3.0, 8.0))]
    if option.endswith("zero_init"):
        init = [torch.zeros_like(p) for p in init]
    params = [p.clone().to(device).requires_grad_() for p in init]
    opt = fastopt.Adafactor(params, **kw)
    group = opt.param_groups[0]

    def check(t):
        for k, p in enumerate(params):
            theirs = HFAdafactor._get_lr(group, {"step": t, "RMS": HFAdafactor._rms(p.detach().cpu())})
            assert opt._get_lr(group, opt.state[p]) == pytest.approx(float(theirs), rel=1e-12, abs=0), (t, k)

    check(1)  # no state yet
    opt.state_dict()
    assert all(float(opt.state[p]["step"]) == 0 for p in params)
    check(1)
    for t, step_grads in enumerate(grads, start=1):
        for p, gr in zip(params, step_grads):
            p.grad = gr.to(device)
        opt.step()
        check(t)


def test_state_dicts_interchange_with_transformers(backend, device):
    """transformers' state_dict (int step, an `RMS` entry) loads here midway, each group keeping its own
    fastopt-only `bf16_stochastic_round`, and the run goes on as transformers' own (the relative step size reads
    the loaded step counter); and ours loads there."""
    kw = dict(beta1=0.9, weight_decay=0.01)
    init, grads = make_problem(shapes=[(4, 6), (2, 3, 5), (5,), ()])

    def start(cls, params, flags=None):
        groups = [{"params": params[:2]}, {"params": params[2:]}]
        if flags is not None:
            for g, flag in zip(groups, flags):
                g["bf16_stochastic_round"] = flag
        return cls(groups, **kw)

    def feed(opt, params, grads):
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.to(p.device)
            opt.step()

    truth = [p.clone().requires_grad_() for p in init]
    feed(start(HFAdafactor, truth), truth, grads)
    ref = [p.clone().requires_grad_() for p in init]
    ref_opt = start(HFAdafactor, ref)
    feed(ref_opt, ref, grads[:4])
    params = [p.detach().clone().to(device).requires_grad_() for p in ref]
    ours = start(fastopt.Adafactor, params, flags=(True, False))
    ours.load_state_dict(save_load(ref_opt.state_dict()))
    assert [g["bf16_stochastic_round"] for g in ours.param_groups] == [True, False]
    assert all(float(ours.state[p]["step"]) == 4 and "RMS" not in ours.state[p] for p in params)
    feed(ours, params, grads[4:])
    assert all(float(ours.state[p]["step"]) == len(grads) for p in params)
    assert_tracks([p.detach().cpu() for p in params], [p.detach() for p in truth], init, torch.float64)

    mine = [p.clone().to(device).requires_grad_() for p in init]
    our_opt = start(fastopt.Adafactor, mine)
    feed(our_opt, mine, grads[:4])
    sd = save_load(our_opt.state_dict())
    for st in sd["state"].values():
        for k, v in st.items():
            st[k] = v.cpu()
    params = [p.detach().cpu().clone().requires_grad_() for p in mine]
    theirs = start(HFAdafactor, params)
    theirs.load_state_dict(sd)
    feed(theirs, params, grads[4:])
    assert_tracks([p.detach() for p in params], [p.detach() for p in truth], init, torch.float64)


def test_foreign_state_dict_of_another_group_count_is_refused():
    check_foreign_group_count_refused(HFAdafactor, fastopt.Adafactor)


def test_own_state_dict_loads_with_its_bf16_stochastic_round(backend, device):
    """A state_dict of ours saved with bf16_stochastic_round=True loads with it into an optimizer made without
    it (torch's load_state_dict takes the saved groups' settings; only transformers's state_dicts, which lack
    it, take this optimizer's): the bf16 run goes on bit for bit as the uninterrupted one. Updates below half
    a bf16 ulp: rounding to nearest would not move the params at all."""
    check_own_state_dict_keeps_sr(fastopt.Adafactor, run, dict(lr=2e-4, relative_step=False, scale_parameter=False),
                                  device)


def test_defaults_are_transformers():
    """Every argument of transformers' Adafactor, in its order, with its default (eps and decay_rate too, which
    only tiny gradients or params near zero would show); the fastopt-only option is off by default."""
    import inspect
    theirs = inspect.signature(HFAdafactor).parameters
    ours = inspect.signature(fastopt.Adafactor).parameters
    assert list(ours)[:len(theirs)] == list(theirs)
    assert {k: ours[k].default for k in theirs} == {k: v.default for k, v in theirs.items()}
    p = torch.zeros(2, 2, requires_grad=True)
    ref = HFAdafactor([p]).defaults
    assert fastopt.Adafactor([p]).defaults == {**ref, "bf16_stochastic_round": False}


def test_sparse_and_complex_refused_before_any_change(backend, device):
    check_refuses_sparse_and_complex(lambda a, other: fastopt.Adafactor([a, other]), device)


def test_bad_state_dict_fails_and_changes_nothing():
    p = torch.randn(4, 5, requires_grad=True)
    opt = fastopt.Adafactor([p], beta1=0.9)
    p.grad = torch.randn_like(p)
    opt.step()
    good = opt.state_dict()
    snapshot = {k: v.clone() for k, v in opt.state[p].items()}
    other = fastopt.Adafactor([torch.randn(5, 4, requires_grad=True)], beta1=0.9)
    other.param_groups[0]["params"][0].grad = torch.randn(5, 4)
    other.step()
    bad_shape = other.state_dict()
    wrong_keys = {"state": {0: {k: v for k, v in good["state"][0].items() if k != "exp_avg_sq_col"}},
                  "param_groups": good["param_groups"]}
    two = {"state": good["state"], "param_groups": [dict(good["param_groups"][0], params=[0, 1])]}
    torch_sd = torch.optim.AdamW([torch.randn(4, 5, requires_grad=True)]).state_dict()
    for sd, msg in ((bad_shape, "shape"), (wrong_keys, "keys"), (two, "params"), (torch_sd, "lacks")):
        with pytest.raises(ValueError, match=msg):
            opt.load_state_dict(sd)
        for k, v in snapshot.items():
            assert torch.equal(opt.state[p][k], v)
        assert opt.param_groups[0]["beta1"] == 0.9


def test_launches_do_not_grow_with_param_count(monkeypatch):
    """Two buckets of 3 and 12 params launch the same number of kernels per step."""
    counts = launches_per_step(monkeypatch, lambda ps: fastopt.Adafactor(ps, beta1=0.9))
    assert counts[0] == counts[1] > 0, counts
