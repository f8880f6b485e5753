"""Checks of bf16 stochastic rounding shared by tests/test_adafactor.py, test_came.py and test_lamb.py."""
from __future__ import annotations

import torch

from fastopt.reference.common import stochastic_round_bf16


def bf16_ulp(x):
    """The spacing of bf16 values around each element of x (8 significant bits)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x)[1] - 8)


def assert_sr_tracks(sr, truth, steps):
    """Stochastic rounding against the float64 truth, element by element. Each step rounds x to one of its two
    bf16 neighbours, the upper with probability f (x's distance from the lower, in ulps): an error of mean 0
    and variance f (1 - f) ulp^2 <= ulp^2 / 4, drawn afresh each step (the noise changes with the step). Where
    the update does not depend on p (bf16-exact grads, params inside one binade), T steps add T such errors:
    E[err^2] <= T ulp^2 / 4 per element, and the mean of err^2 / ulp^2 over a few thousand elements stays
    within a few percent of its expectation. Noise frozen across steps rounds the same elements up each time:
    their errors add up (~T f ulp instead of ~sqrt(T f) ulp) and break the bound."""
    for k, (s, t) in enumerate(zip(sr, truth)):
        s = s.detach().cpu().double()
        rms = ((s - t) / bf16_ulp(t)).square().mean().sqrt().item()
        assert rms <= (steps / 4) ** 0.5, f"param {k}: RMS error {rms:.3f} ulp after {steps} steps"


def assert_sr_beats_nearest(sr, nearest, truth, init, steps, rel=0.1):
    """Updates far below half a bf16 ulp: round-to-nearest never moves a param, stochastic rounding tracks the
    float64 run in mean (within `rel` of the mean move) and element by element (`assert_sr_tracks`)."""
    for k, (s, n, t, x) in enumerate(zip(sr, nearest, truth, init)):
        moved = (1 - t).mean().item()
        assert moved > 0
        assert torch.equal(n.detach().cpu().double(), x)
        sr_moved = (1 - s.detach().cpu().double()).mean().item()
        assert abs(sr_moved - moved) < rel * moved, (k, sr_moved, moved)
    assert_sr_tracks(sr, truth, steps)


def sr_problem(shapes, steps, seed=3):
    """Params at 1, gradients in [0.5, 1.5) exactly representable in bf16 (the truth sees what bf16 sees)."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.ones(s, dtype=torch.float64) for s in shapes]
    grads = [[(torch.rand(s, generator=g, dtype=torch.float64) + 0.5).to(torch.bfloat16).double() for s in shapes]
             for _ in range(steps)]
    return init, grads


def rounding_patterns(opt, params, steps):
    """Step `opt` `steps` times from params reset to 1 with a gradient of 1 everywhere: every element of a param
    rounds the same value, so which of its two bf16 neighbours each one got shows the noise alone. Returns, per
    step and param, the mask of elements that got the upper one."""
    out = []
    for _ in range(steps):
        with torch.no_grad():
            for p in params:
                p.fill_(1.0)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        masks = []
        for p in params:
            vals = torch.unique(p.detach())
            assert vals.numel() == 2, vals  # both neighbours drawn: the value sits strictly between them
            masks.append(p.detach() == vals[1])
        out.append(masks)
    return out


def assert_differ(a, b, what):
    """Neither mask contains the other: the noise changed (noise frozen while the rounded value moves would
    give nested masks)."""
    assert (a & ~b).any() and (~a & b).any(), what


def check_noise_varies(opt, params, steps=4):
    """Stochastic rounding draws new noise for each step, each param and each element (same-shaped params of
    the bucket round the same values)."""
    pats = rounding_patterns(opt, params, steps)
    for k in range(len(params)):
        for s in range(steps):
            for t in range(s + 1, steps):
                assert_differ(pats[s][k], pats[t][k], f"param {k}: steps {s + 1} and {t + 1} round alike")
    for s in range(steps):
        for k in range(len(params)):
            for j in range(k + 1, len(params)):
                if params[k].shape == params[j].shape:
                    assert_differ(pats[s][k], pats[s][j], f"step {s + 1}: params {k} and {j} round alike")


def rng_states(device):
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])


def sr_steps_under_seed(make_opt, init, grads, device, seed):
    """bf16 params stepped with stochastic rounding after torch.manual_seed(seed) (as ranks seeded differently
    would be). At each step: step() leaves torch's global generators as they were, and each param is
    fastopt.reference's stochastic_round_bf16 (noise from the step, the param's position in the optimizer, here
    its index in `init`, and the element's offset) of the fp32 value it rounds, read off a twin optimizer over
    fp32 copies of the params (the same math up to the store). Returns the params."""
    params = [x.to(device=device, dtype=torch.bfloat16).requires_grad_() for x in init]
    twins = [torch.zeros_like(p, dtype=torch.float32).requires_grad_() for p in params]
    opt, twin_opt = make_opt(params), make_opt(twins)
    torch.manual_seed(seed)
    rounded_apart = False
    for step_grads in grads:
        with torch.no_grad():
            for p, q, gr in zip(params, twins, step_grads):
                q.copy_(p)
                p.grad = gr.to(device=device, dtype=torch.bfloat16)
                q.grad = p.grad.float()
        before = rng_states(device)
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, rng_states(device))), "step() moved the global RNG"
        twin_opt.step()
        for k, (p, q) in enumerate(zip(params, twins)):
            want = stochastic_round_bf16(q.detach(), opt.state[p]["step"], k)
            assert torch.equal(p.detach(), want), f"param {k}: {int((p != want).sum())} elements rounded otherwise"
            rounded_apart = rounded_apart or not torch.equal(want, q.detach().to(torch.bfloat16))
    assert rounded_apart  # stochastic rounding did something round-to-nearest would not
    return [p.detach().cpu() for p in params]


def check_sr_deterministic(make_opt, init, grads, device):
    """The noise is the reference's, and the result does not depend on the global seed: replicas of a param on
    ranks seeded differently stay equal."""
    a = sr_steps_under_seed(make_opt, init, grads, device, 0)
    b = sr_steps_under_seed(make_opt, init, grads, device, 1)
    for k, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"param {k} depends on the global seed"


def check_own_state_dict_keeps_sr(cls, run, kw: dict, device) -> None:
    """`cls` with bf16_stochastic_round=True, 4 of 8 steps, its state_dict (through torch.save) loaded into `cls`
    made without it: the setting comes back, and the loaded run's bf16 params equal the uninterrupted run's bit for
    bit, all moved. `run(cls, init, grads, dtype, device, **kw)` -> (params, optimizer)."""
    from conftest import feed, save_load
    init, grads = sr_problem([(32, 64), (1000,)], 8)
    straight, _ = run(cls, init, grads, torch.bfloat16, device, bf16_stochastic_round=True, **kw)
    first, opt = run(cls, init, grads[:4], torch.bfloat16, device, bf16_stochastic_round=True, **kw)
    params = [p.detach().clone().requires_grad_() for p in first]
    opt2 = cls(params, **kw)
    opt2.load_state_dict(save_load(opt.state_dict()))
    assert opt2.param_groups[0]["bf16_stochastic_round"] is True
    feed(opt2, params, grads[4:])
    for a, b, p0 in zip(params, straight, first):
        assert not torch.equal(b, p0)
        assert torch.equal(a, b)
