"""fastopt.GaLoreAdamW against galore-torch's GaLoreAdamW in float64, every projection type, both back ends."""
from __future__ import annotations

import io
import math
import pickle
import re

import pytest
import torch
from conftest import (TOL, Counting, assert_tracks, rel_update_error, step_with_inf_at,
                      check_refuses_sparse_and_complex, check_skips_params_without_grad, through_8bit,
                      check_no_host_sync, snapshot, assert_unchanged, save_load, run_changed_midway, on_torch_backend)

import fastopt
from fastopt import ops

galore_torch = pytest.importorskip("galore_torch")
from galore_torch.galore_projector import GaLoreProjector  # noqa: E402

PROJ_TYPES = ["std", "reverse_std", "left", "right", "full"]
# Projected: a tall and a wide matrix (std projects opposite sides of them) and a batch of two matrices, which
# galore-torch does not take: its oracle is galore-torch on each matrix of the batch as a separate param.
# Plain AdamW group: a matrix and a vector. Dims are not multiples of the kernels' tiles (16 interpreted).
MATS = [(20, 12), (12, 20), (2, 12, 18)]
PLAIN = [(5, 6), (7,)]
RANK = 4
GAP = 3    # 9 steps: the bases are refreshed at steps 1, 4 and 7
STEPS = 9
LR = 0.02
WD = 0.1
GROUP = dict(rank=RANK, update_proj_gap=GAP, scale=0.25)
SMALL_8BIT = dict(block_size=64, min_8bit_size=32)  # projected moments of 48-80 elements: 1-2 blocks, partial


def make_problem(shapes, steps=STEPS, seed=0):
    """Fresh full-rank random gradients every step, of growing size."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) * (1 + 0.2 * t) for s in shapes]
             for t in range(steps)]
    return init, grads


def split_batches(xs):
    """galore-torch's view of our params: every matrix of a batch a param of its own."""
    out = []
    for x in xs:
        out += list(x.reshape(-1, *x.shape[-2:]).unbind(0)) if x.dim() > 2 else [x]
    return out


def galore_torch_run(init, grads, proj_type, n_mats, dtype=torch.float64, skip=(), device="cpu", **kw):
    """galore-torch's GaLoreAdamW on `init` (its first n_mats projected, the rest plain), in `dtype`, on `device`
    (ours's: the same fp32 SVDs, cuSOLVER's on CUDA, whose last bits and signs differ from LAPACK's), skipping
    the steps in `skip`. Returns (params on the CPU, optimizer, params list in its order)."""
    params = [x.to(device=device, dtype=dtype).clone().requires_grad_() for x in init]
    groups = [{"params": params[:n_mats], "proj_type": proj_type, **GROUP}, {"params": params[n_mats:]}]
    opt = galore_torch.GaLoreAdamW(groups, lr=kw.get("lr", LR), weight_decay=kw.get("weight_decay", WD),
                                   eps=kw.get("eps", 1e-6), betas=kw.get("betas", (0.9, 0.999)),
                                   correct_bias=kw.get("correct_bias", True), no_deprecation_warning=True)
    for t, step_grads in enumerate(grads):
        if t in skip:
            continue
        for p, gr in zip(params, step_grads):
            p.grad = gr.to(device=device, dtype=dtype)
        opt.step()
    return [p.detach().cpu() for p in params], opt, params


def reference(init, grads, proj_type, dtype=torch.float64, skip=(), device="cpu", **kw):
    """galore-torch on our problem (batched params split into matrices). Returns (params in our shapes,
    galore-torch's optimizer, for each of our params the list of galore-torch's params it became)."""
    n_mats = len(MATS)
    flat, opt, plist = galore_torch_run(split_batches(init[:n_mats]) + init[n_mats:],
                                        [split_batches(g[:n_mats]) + g[n_mats:] for g in grads], proj_type,
                                        len(split_batches(init[:n_mats])), dtype, skip, device, **kw)
    out, owners, i = [], [], 0
    for j, x in enumerate(init):
        k = x.shape[0] if j < n_mats and x.dim() > 2 else 1
        out.append(torch.stack(flat[i:i + k]).view(x.shape) if k > 1 else flat[i])
        owners.append(plist[i:i + k])
        i += k
    return out, opt, owners


def make_opt(params, proj_type="std", cls=None, **kw):
    cls = cls or fastopt.GaLoreAdamW
    kw = {"lr": LR, "weight_decay": WD, **kw}
    return cls([{"params": params[:len(MATS)], "proj_type": proj_type, **GROUP}, {"params": params[len(MATS):]}],
               **kw)


def run(init, grads, dtype, device="cpu", proj_type="std", **kw):
    params = [p.to(device=device, dtype=dtype, copy=True).requires_grad_() for p in init]
    opt = make_opt(params, proj_type, **kw)
    step(opt, params, grads)
    return params, opt


def step(opt, params, grads):
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.to(device=p.device, dtype=p.dtype)
        opt.step()


def galore_state(ref_opt, q, key):
    """galore-torch's state `key` of its param q (on the CPU); 'proj_left' / 'proj_right': its projector's basis."""
    st = ref_opt.state[q]
    if key in ("exp_avg", "exp_avg_sq"):
        return st[key].cpu()
    proj = st["projector"]
    if proj.proj_type == "full":
        return proj.ortho_matrix[0 if key == "proj_left" else 1].cpu()
    return proj.ortho_matrix.cpu()


def basis_keys(shape, proj_type):
    from fastopt.reference.galore import projection_side
    side = projection_side(shape, proj_type)
    return ["proj_left", "proj_right"] if side == "full" else ["proj_" + side]


def assert_states_match(opt, params, ref_opt, owners, proj_type, rtol=TOL[torch.float64]):
    """Moments (of the projected shape) and bases, matrix by matrix, against galore-torch's."""
    for i, (p, qs) in enumerate(zip(params, owners)):
        st = opt.state[p]
        projected = i < len(MATS)
        keys = basis_keys(p.shape, proj_type) if projected else []
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", *keys}, (i, sorted(st))
        for key in ["exp_avg", "exp_avg_sq"] + keys:
            shape = galore_state(ref_opt, qs[0], key).shape
            if projected:  # whole: galore-torch's matrices, batched like the param
                assert st[key].shape == (*p.shape[:-2], *shape), (i, key)
            else:
                assert st[key].shape == p.shape, (i, key)
            ours = st[key].cpu().reshape(len(qs), *shape)
            for k, q in enumerate(qs):
                want = galore_state(ref_opt, q, key)
                if key.startswith("proj"):  # the same fp32 SVD of the same gradient
                    assert torch.equal(ours[k], want.to(ours.dtype)), (i, key, k)
                else:
                    err = (ours[k] - want).norm() / want.norm()
                    assert err <= rtol, (i, key, k, err.item())


@pytest.mark.parametrize("proj_type", PROJ_TYPES)
def test_matches_galore_torch(backend, device, proj_type, monkeypatch):
    """Params, moments and bases against galore-torch after 9 steps with refreshes at steps 1, 4, 7; the SVDs
    run on those steps only, and the subspace changes there and only there."""
    init, grads = make_problem(MATS + PLAIN)
    ref, ref_opt, owners = reference(init, grads, proj_type, device=device)
    svd_calls = []
    real_svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **k: svd_calls.append(1) or real_svd(*a, **k))
    params = [p.to(device=device, dtype=torch.float64, copy=True).requires_grad_() for p in init]
    opt = make_opt(params, proj_type)
    seen = []
    n_svd = sum(math.prod(s[:-2]) for s in MATS)  # one per matrix (the batch: one per matrix in it)
    for t, step_grads in enumerate(grads, start=1):
        before = len(svd_calls)
        step(opt, params, [step_grads])
        assert len(svd_calls) - before == (n_svd if (t - 1) % GAP == 0 else 0), f"step {t}"
        seen.append(opt.state[params[0]][basis_keys(MATS[0], proj_type)[0]].clone())
    for t in range(1, STEPS):
        assert torch.equal(seen[t], seen[t - 1]) == (t % GAP != 0), f"step {t + 1}"
    for i, (a, b, c) in enumerate(zip(params, ref, init)):
        assert rel_update_error([a.detach().cpu()], [b], [c]) <= TOL[torch.float64], f"param {i} {tuple(c.shape)}"
    assert_states_match(opt, params, ref_opt, owners, proj_type)
    assert all(float(s["step"]) == STEPS and s["step"].dtype == torch.float32 for s in opt.state.values())


@pytest.mark.parametrize("proj_type", ["std", "reverse_std"])
def test_square_matrices_match_galore_torch(backend, device, proj_type):
    """A square matrix is where std and reverse_std decide on the tie m == n: galore-torch projects it on the right
    with std (m >= n) and on the left with reverse_std. Params and bases against galore-torch after 9 steps with
    refreshes at steps 1, 4, 7 (MATS has no square matrix)."""
    init, grads = make_problem([(16, 16), (13, 13), (7,)])
    ref, ref_opt, plist = galore_torch_run(init, grads, proj_type, 2, device=device)
    params = [p.to(device=device, dtype=torch.float64, copy=True).requires_grad_() for p in init]
    opt = fastopt.GaLoreAdamW([{"params": params[:2], "proj_type": proj_type, **GROUP}, {"params": params[2:]}],
                              lr=LR, weight_decay=WD)
    step(opt, params, grads)
    for i, (a, b, c) in enumerate(zip(params, ref, init)):
        assert rel_update_error([a.detach().cpu()], [b], [c]) <= TOL[torch.float64], f"param {i} {tuple(c.shape)}"
    key = "proj_right" if proj_type == "std" else "proj_left"
    for p, q in zip(params[:2], plist[:2]):
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq", key}, sorted(opt.state[p])
        assert torch.equal(opt.state[p][key].cpu(), galore_state(ref_opt, q, key).to(torch.float64))


def _both(groups, init, grads, device, **kw):
    """fastopt's and galore-torch's GaLoreAdamW over `groups(params)`, stepped with `grads`: each one's params."""
    out = []
    for cls, dev, extra in ((fastopt.GaLoreAdamW, device, {}),
                            (galore_torch.GaLoreAdamW, "cpu", {"no_deprecation_warning": True})):
        ps = [x.to(dev).clone().requires_grad_() for x in init]
        opt = cls(groups(ps), **kw, **extra)
        step(opt, ps, grads)
        out.append([p.detach().cpu() for p in ps])
    return out


@pytest.mark.parametrize("proj_type", ["std", "full"])
def test_rank_equal_to_the_smaller_dim_matches_galore_torch(backend, device, proj_type):
    """rank = min(m, n), the end of the rule "rank at most min(m, n)": taken, and 7 steps (refreshes at 1, 4, 7)
    in float64 are galore-torch's, param by param."""
    init, grads = make_problem([(9, 5), (5, 9), (7,)], steps=7)
    group = dict(GROUP, rank=5, proj_type=proj_type)
    ours, ref = _both(lambda ps: [{"params": ps[:2], **group}, {"params": ps[2:]}], init, grads, device,
                      lr=LR, weight_decay=WD)
    for i, (a, b, x) in enumerate(zip(ours, ref, init)):
        assert_tracks([a], [b], [x], torch.float64, what=f"param {i}")


def test_refresh_at_every_step_and_a_group_scale_match_galore_torch(backend, device):
    """update_proj_gap=1 (the end of the rule "an int >= 1": an SVD at every step) and groups with their own
    scale (other than the default 0.25, each read from its group): 5 steps in float64 are galore-torch's, param
    by param."""
    init, grads = make_problem([(20, 12), (12, 20), (7,)], steps=5)
    ours, ref = _both(lambda ps: [{"params": ps[:1], **GROUP, "update_proj_gap": 1, "scale": 0.7, "proj_type": "std"},
                                  {"params": ps[1:2], **GROUP, "update_proj_gap": 2, "scale": 1.5,
                                   "proj_type": "std"},
                                  {"params": ps[2:]}], init, grads, device, lr=LR, weight_decay=WD)
    for i, (a, b, x) in enumerate(zip(ours, ref, init)):
        assert_tracks([a], [b], [x], torch.float64, what=f"param {i}")


def test_groups_step_with_their_own_weight_decay(backend, device):
    """A projected group and a plain group with a weight_decay of their own (0.3, 0.0) and a plain group that
    takes the constructor's (0.1): 9 steps (refreshes at 1, 4, 7) in float64 are galore-torch's, param by param."""
    init, grads = make_problem([(20, 12), (12, 20), (5, 6), (7,)])
    ours, ref = _both(lambda ps: [{"params": ps[:2], **GROUP, "proj_type": "std", "weight_decay": 0.3},
                                  {"params": ps[2:3], "weight_decay": 0.0}, {"params": ps[3:]}],
                      init, grads, device, lr=LR, weight_decay=0.1)
    for i, (a, b, x) in enumerate(zip(ours, ref, init)):
        assert_tracks([a], [b], [x], torch.float64, what=f"param {i}")


# Every hyperparameter a projected group may change between steps that galore-torch reads at every step (it
# fixes scale and update_proj_gap in its projector at the first step): its new value.
GALORE_CHANGES = {"betas": (0.5, 0.9), "eps": 1e-3, "weight_decay": 0.3, "correct_bias": False}


@pytest.mark.parametrize("key", list(GALORE_CHANGES))
def test_hyperparameter_changed_between_steps_takes_effect(backend, device, key):
    """A projected group's hyperparameter set between steps (lr fixed) steps from the next step on as in
    galore-torch: 7 steps (refreshes at 1, 4, 7) in float64, the change before the fourth (the kernels keep the
    group's values in a device tensor, which must follow the group)."""
    init, grads = make_problem([(20, 12), (12, 20), (5, 6), (7,)], steps=7)

    def grouped(cls, **extra):
        return lambda ps, **kw: cls([{"params": ps[:2], **GROUP, "proj_type": "std"}, {"params": ps[2:]}],
                                    **kw, **extra)

    kw = dict(lr=LR, weight_decay=WD)
    ours = run_changed_midway(grouped(fastopt.GaLoreAdamW), init, grads, device, kw, key, GALORE_CHANGES[key])
    ref = run_changed_midway(grouped(galore_torch.GaLoreAdamW, no_deprecation_warning=True), init, grads, "cpu", kw,
                             key, GALORE_CHANGES[key])
    for i, (a, b, x) in enumerate(zip(ours, ref, init)):
        assert_tracks([a], [b], [x], torch.float64, what=f"param {i}")


@pytest.mark.parametrize("proj_type", ["std", "full"])
def test_correct_bias_false_matches_galore_torch(backend, device, proj_type):
    """galore-torch's correct_bias=False (step size lr, no bias corrections), in both groups: params and states
    against galore-torch after 9 steps with refreshes, and no_deprecation_warning is taken; the same run with
    bias corrections is far from it (the first step alone is sqrt(1 - 0.999) / (1 - 0.9) = 0.32 of lr)."""
    init, grads = make_problem(MATS + PLAIN, seed=4)
    ref, ref_opt, owners = reference(init, grads, proj_type, device=device, correct_bias=False)
    params, opt = run(init, grads, torch.float64, device, proj_type, correct_bias=False, no_deprecation_warning=True)
    assert all(g["correct_bias"] is False for g in opt.param_groups)
    for i, (a, b, c) in enumerate(zip(params, ref, init)):
        assert rel_update_error([a.detach().cpu()], [b], [c]) <= TOL[torch.float64], f"param {i} {tuple(c.shape)}"
    assert_states_match(opt, params, ref_opt, owners, proj_type)
    corrected, _ = run(init, grads, torch.float64, device, proj_type)
    assert rel_update_error([p.detach().cpu() for p in corrected], ref, init) > 0.1


def test_state_dict_without_correct_bias_loads_as_corrected(backend):
    """A state_dict saved before `correct_bias` was a group key (bias corrections always on) loads with
    correct_bias=True into an optimizer built with False, and the next steps are those of the run it came from,
    bit for bit; a pickled optimizer whose groups lack it steps the same way. A state_dict that holds
    correct_bias=False keeps it, loaded into an optimizer built with True (the default fills a missing key only),
    and steps like an optimizer built with False given it."""
    if backend == "triton" and not ops.interpreting():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")  # bit for bit: CPU only
    init, grads = make_problem(MATS + PLAIN, seed=6)
    params, opt = run(init, grads[:4], torch.float64)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["correct_bias"]
    twin = [p.detach().clone().requires_grad_() for p in params]
    other = make_opt(twin, correct_bias=False)
    other.load_state_dict(sd)
    assert [g["correct_bias"] for g in other.param_groups] == [True, True]
    old = pickle.loads(pickle.dumps(opt))
    for g in old.param_groups:
        del g["correct_bias"]
    old.__setstate__(old.__getstate__())
    old_params = [p for g in old.param_groups for p in g["params"]]
    assert [g["correct_bias"] for g in old.param_groups] == [True, True]
    for ps, o in ((params, opt), (twin, other), (old_params, old)):
        step(o, ps, grads[4:])
    for a, b, c in zip(params, twin, old_params):
        assert torch.equal(a, b) and torch.equal(a, c)
    off = opt.state_dict()
    for g in off["param_groups"]:
        g["correct_bias"] = False
    runs = []
    for built_with in (True, False):
        qs = [p.detach().clone().requires_grad_() for p in params]
        o = make_opt(qs, correct_bias=built_with)
        o.load_state_dict(off)
        assert [g["correct_bias"] for g in o.param_groups] == [False, False]
        step(o, qs, grads[:2])
        runs.append(qs)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# ---- nbits=8 ------------------------------------------------------------------------------------------
MATS_8BIT = [(40, 24), (24, 40)]           # projected moments (40, 4) and (4, 40): 160 elements, 3 blocks of 64
PLAIN_8BIT = [(10, 10), (5, 6), (7,)]      # plain: 100 elements (8-bit), 30 and 7 (fewer than 32: 32-bit)


def galore8_reference(init, grads, proj_type, lr=LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=WD,
                      block_size=64, min_8bit_size=32, device="cpu"):
    """GaLore-AdamW as issue 6 states it, in float64, with galore-torch's projector, and m and v stored in the
    8-bit block-wise format of issue 5 after every step (the update uses the exact m_t, v_t), on `device` (the
    SVDs ours runs there). The first len(MATS_8BIT) params are projected. Returns (params, [(m codes, v codes)
    or None]) on the CPU."""
    beta1, beta2 = betas
    ps = [x.to(device).clone() for x in init]
    projs = [GaLoreProjector(RANK, update_proj_gap=GAP, scale=GROUP["scale"], proj_type=proj_type)
             if i < len(MATS_8BIT) else None for i in range(len(init))]
    ms, vs, codes = [0.0] * len(ps), [0.0] * len(ps), [None] * len(ps)
    for t, step_grads in enumerate(grads, start=1):
        eta = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        for i, g in enumerate(step_grads):
            g = g.to(device)
            r = projs[i].project(g, t - 1) if projs[i] is not None else g
            m = beta1 * ms[i] + (1 - beta1) * r
            v = beta2 * vs[i] + (1 - beta2) * r * r
            n = m / (v.sqrt() + eps)
            ps[i] = ps[i] - eta * (projs[i].project_back(n) if projs[i] is not None else n)
            if weight_decay > 0:
                ps[i] = ps[i] - lr * weight_decay * ps[i]
            if m.numel() >= min_8bit_size:
                m, v, codes[i] = through_8bit(m, v, block_size)
            ms[i], vs[i] = m, v
    return [p.cpu() for p in ps], [c if c is None else tuple(x.cpu() for x in c) for c in codes]


def make_opt8(params, proj_type, **kw):
    return fastopt.GaLoreAdamW8bit([{"params": params[:len(MATS_8BIT)], "proj_type": proj_type, **GROUP},
                                    {"params": params[len(MATS_8BIT):]}], **{"lr": LR, "weight_decay": WD,
                                                                             **SMALL_8BIT, **kw})


@pytest.mark.parametrize("proj_type", ["std", "full"])
def test_8bit_matches_quantized_reference(backend, device, proj_type):
    """fp64 params (fp64 math, the same fp32 quantization): the 8-bit step is the float64 GaLore-AdamW with its
    moments stored in the 8-bit format, to the last code, refreshes included; no decay, other betas and eps."""
    # full: rank x rank moments (16 elements) are 8-bit too, in one partial block
    kw = dict(betas=(0.85, 0.99), eps=1e-4, weight_decay=0.0, min_8bit_size=16 if proj_type == "full" else 32)
    init, grads = make_problem(MATS_8BIT + PLAIN_8BIT)
    ref, ref_codes = galore8_reference(init, grads, proj_type, device=device, **kw)
    params = [p.to(device=device, copy=True).requires_grad_() for p in init]
    opt = make_opt8(params, proj_type, **kw)
    step(opt, params, grads)
    for i, (p, r, x, c) in enumerate(zip(params, ref, init, ref_codes)):
        st = opt.state[p]
        assert rel_update_error([p.detach().cpu()], [r], [x]) <= TOL[torch.float64], f"param {i}"
        if c is None:
            assert st["exp_avg"].dtype == torch.float64 and "exp_avg_absmax" not in st, i
        else:
            assert st["exp_avg_absmax"].shape == (math.ceil(st["exp_avg"].numel() / 64),)
            got = (st["exp_avg"].cpu().view(c[0].shape), st["exp_avg_sq"].cpu().view(c[1].shape))
            assert torch.equal(got[0], c[0]) and torch.equal(got[1], c[1]), f"param {i}"
    kinds = [opt.state[p]["exp_avg"].dtype for p in params]
    assert kinds[:3] == [torch.uint8] * 3 and kinds[-1] == torch.float64


def test_8bit_decision_reads_the_size_of_the_moments(backend, device):
    """min_8bit_size is compared with the moments' elements (the projected shape), not the param's: a (20, 12)
    param at rank 4 (moments of 20 x 4 = 80 elements) with min_8bit_size=128 keeps float64 moments and steps as
    galore-torch's 32-bit GaLoreAdamW (7 steps, refreshes at 1, 4, 7), while a plain (16, 9) param (144 elements)
    gets 8-bit ones."""
    init, grads = make_problem([(20, 12), (16, 9)], steps=7)
    params = [p.to(device=device, copy=True).requires_grad_() for p in init]
    opt = fastopt.GaLoreAdamW8bit([{"params": params[:1], **GROUP, "proj_type": "std"}, {"params": params[1:]}],
                                  lr=LR, weight_decay=WD, min_8bit_size=128, block_size=64)
    step(opt, params, grads)
    st, plain = opt.state[params[0]], opt.state[params[1]]
    assert st["exp_avg"].dtype == torch.float64 and "exp_avg_absmax" not in st, sorted(st)
    assert plain["exp_avg"].dtype == torch.uint8 and plain["exp_avg_absmax"].shape == (3,)
    ref, *_ = galore_torch_run(init[:1], [g[:1] for g in grads], "std", 1, device=device)
    assert_tracks([params[0].detach().cpu()], ref, init[:1], torch.float64)


# Relative update error of 8-bit state against galore-torch's 32-bit GaLoreAdamW in float64 after 9 steps of
# this problem (blocks of 64): measured 0.0057 (std) and 0.0057 (right) on both back ends, with fp32 and fp64
# params alike (32-bit state, fp32 params: 4.2e-6); allowed: 3x that.
TOL_8BIT = 0.017


@pytest.mark.parametrize("proj_type", ["std", "right"])
def test_8bit_tracks_32bit_galore_torch(backend, device, proj_type):
    init, grads = make_problem(MATS_8BIT + PLAIN_8BIT)
    n_mats = len(MATS_8BIT)
    truth, *_ = galore_torch_run(init, grads, proj_type, n_mats, device=device)
    params = [p.to(device=device, dtype=torch.float32, copy=True).requires_grad_() for p in init]
    opt = make_opt8(params, proj_type)
    step(opt, params, grads)
    err = rel_update_error([p.detach().cpu() for p in params], truth, init)
    assert err <= TOL_8BIT, f"8-bit state: relative update error {err:.3g} > {TOL_8BIT}"
    # The 32-bit params of the group track galore-torch as closely as ever.
    assert_tracks([p.detach().cpu() for p in params[3:]], truth[3:], init[3:], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_tracks_galore_torch(backend, device, dtype):
    init, grads = make_problem(MATS + PLAIN)
    truth, *_ = reference(init, grads, "std", device=device)
    ref_lowp, *_ = reference(init, grads, "std", dtype=dtype, device=device)
    ours, opt = run(init, grads, dtype, device)
    assert all(p.dtype == dtype for p in ours)
    assert all(t.dtype == torch.float32 for s in opt.state.values() for t in s.values())
    assert_tracks([p.detach().cpu() for p in ours], truth, [p.to(dtype) for p in init], dtype, ref_lowp=ref_lowp)


# ---- state_dict, GradScaler ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, nbits, proj_type", [(torch.float32, 32, "full"), (torch.bfloat16, 32, "std"),
                                                     (torch.float32, 8, "std")])
def test_state_dict_round_trip_is_bit_identical(backend, device, dtype, nbits, proj_type):
    """Saved after step 5 (between the refreshes at 4 and 7), loaded with weights_only=True into a fresh
    optimizer: the resumed run equals the straight one bit for bit."""
    kw = dict(nbits=nbits, block_size=64, min_8bit_size=32)
    init, grads = make_problem(MATS + PLAIN, steps=10)
    straight, opt_s = run(init, grads, dtype, device, proj_type, **kw)
    first, opt = run(init, grads[:5], dtype, device, proj_type, **kw)
    loaded = save_load(opt.state_dict())
    params = [p.detach().clone().requires_grad_() for p in first]
    opt2 = make_opt(params, proj_type, **kw)
    opt2.load_state_dict(loaded)
    for p in params:
        assert all(t.device == p.device for t in opt2.state[p].values())
    assert (opt2.state[params[0]]["exp_avg"].dtype == torch.uint8) == (nbits == 8)
    step(opt2, params, grads[5:])
    for a, b in zip(params, straight):
        assert torch.equal(a, b)
    for p, q in zip(params, straight):
        assert set(opt2.state[p]) == set(opt_s.state[q])
        for k, v in opt2.state[p].items():
            assert torch.equal(v, opt_s.state[q][k]), k


def test_galore_torch_state_dict_needs_pickle():
    """Why the state is tensors only: galore-torch's holds a GaLoreProjector object, which weights_only refuses."""
    init, grads = make_problem(MATS[:1], steps=1)
    _, ref_opt, _ = galore_torch_run(init, grads, "std", 1)
    buf = io.BytesIO()
    torch.save(ref_opt.state_dict(), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buf, weights_only=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter on the inf step
@pytest.mark.parametrize("nbits, inf_step", [(32, 3), (32, 0), (8, 3)])
def test_grad_scaler_and_skipped_overflow(backend, device, nbits, inf_step):
    """An inf gradient on a refresh step (t = 4) or on the very first step: that step changes nothing (params,
    moments, bases, step counter) and the refresh happens on the next step instead, as if the bad step had
    never been; no refresh is spent on it."""
    kw = dict(nbits=nbits, **SMALL_8BIT)
    init, grads = make_problem(MATS + PLAIN)
    kept = grads[:inf_step] + grads[inf_step + 1:]
    if nbits == 8:
        ref, ref_opt = run(init, kept, torch.float32, device, **kw)
        ref = [p.detach().cpu() for p in ref]
    else:
        ref, ref_opt, owners = reference(init, kept, "std", device=device)
    params = [p.to(device=device, dtype=torch.float32, copy=True).requires_grad_() for p in init]
    opt = make_opt(params, **kw)
    step_with_inf_at(opt, params, grads, inf_step, device)
    assert all(float(s["step"]) == len(grads) - 1 for s in opt.state.values())
    if nbits == 8:  # a power-of-two loss scale divides out exactly: the same run, bit for bit
        for p, q, r in zip(params, ref_opt.param_groups[0]["params"] + ref_opt.param_groups[1]["params"], ref):
            assert torch.equal(p.detach().cpu(), r)
            assert set(opt.state[p]) == set(ref_opt.state[q])
            for k, v in opt.state[p].items():
                assert torch.equal(v, ref_opt.state[q][k]), k
    else:
        assert_tracks([p.detach().cpu() for p in params], ref, init, torch.float32)
        # The bases come from the same fp32 SVDs at the same steps as galore-torch's without the bad step.
        for p, qs in zip(params[:len(MATS)], owners):
            key = basis_keys(p.shape, "std")[0]
            ours = opt.state[p][key].cpu().reshape(len(qs), *galore_state(ref_opt, qs[0], key).shape)
            for k, q in enumerate(qs):
                assert torch.equal(ours[k].double(), galore_state(ref_opt, q, key))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter on the inf step
def test_grad_scaler_verdicts_are_resolved_once_per_step_before_its_buckets(backend, device, monkeypatch):
    """Under GradScaler the host learns whether a step was skipped from a copy of found_inf, which the next
    step reads (after a CUDA event). With two projected groups (two buckets), that read happens once, at the
    start of the next step, for both: a read per bucket would make a step's second bucket wait on the first
    one's copy of the same step, a host sync inside the step. The refresh schedule still skips the bad step: the
    bases are those of the same groups (their own gaps) stepped without it."""
    init, grads = make_problem(MATS + PLAIN)
    inf_step = 3
    kept = grads[:inf_step] + grads[inf_step + 1:]
    params = [p.to(device=device, dtype=torch.float32, copy=True).requires_grad_() for p in init]
    groups = [{"params": params[:1], **GROUP}, {"params": params[1:len(MATS)], **GROUP, "update_proj_gap": 2},
              {"params": params[len(MATS):]}]
    opt = fastopt.GaLoreAdamW(groups, lr=LR, weight_decay=WD)
    resolved, real = [], opt._resolve_pending
    monkeypatch.setattr(opt, "_resolve_pending", lambda: resolved.append(len(opt._pending)) or real())
    step_with_inf_at(opt, params, grads, inf_step, device)
    assert resolved == [0] + [2] * (len(grads) - 1), resolved  # each step: the step before's two buckets
    assert all(float(s["step"]) == len(grads) - 1 for s in opt.state.values())
    # the refreshes: group 0 at its (kept) steps 1, 4, 7 and group 1 at 1, 3, 5, 7, as without the bad step. The
    # same device and dtype: each refresh's SVD then gets the same gradient (the scaler's power-of-two scale and
    # unscale are exact), where a float64 SVD differs from CUDA's float32 one by 1e-4 (near singular values)
    ref_params = [p.to(device=device, dtype=torch.float32, copy=True).requires_grad_() for p in init]
    ref_opt = fastopt.GaLoreAdamW([{"params": ref_params[:1], **GROUP},
                                   {"params": ref_params[1:len(MATS)], **GROUP, "update_proj_gap": 2},
                                   {"params": ref_params[len(MATS):]}], lr=LR, weight_decay=WD)
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    step(ref_opt, ref_params, kept)
    for p, q in zip(params[:len(MATS)], ref_params[:len(MATS)]):
        for k, v in ref_opt.state[q].items():
            if k.startswith("proj"):
                assert torch.allclose(opt.state[p][k], v, rtol=1e-5, atol=1e-6), k


# ---- groups, inputs -------------------------------------------------------------------------------------
def test_get_galore_param_groups():
    torch.manual_seed(0)
    # model[3]: its smaller dim is the rank, projected (only a dim smaller than the rank keeps a weight plain)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 16), torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 8, bias=False), torch.nn.Linear(8, 4))
    groups = fastopt.get_galore_param_groups(model, weight_decay=0.05, rank=8, update_proj_gap=50, scale=0.5,
                                             proj_type="left")
    ids = [[id(p) for p in g["params"]] for g in groups]
    assert ids[0] == [id(model[1].weight), id(model[3].weight)]
    assert {k: v for k, v in groups[0].items() if k != "params"} == dict(rank=8, update_proj_gap=50, scale=0.5,
                                                                       proj_type="left", weight_decay=0.05)
    assert ids[1] == [id(model[0].weight), id(model[4].weight)] and groups[1]["weight_decay"] == 0.05
    assert ids[2] == [id(model[1].bias), id(model[2].weight), id(model[2].bias), id(model[4].bias)]
    assert groups[2]["weight_decay"] == 0.0
    opt = fastopt.GaLoreAdamW(groups, lr=1e-3)
    model(torch.arange(6).view(2, 3)).sum().backward()
    opt.step()
    st = opt.state[model[1].weight]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq", "proj_left"}
    assert st["exp_avg"].numel() == 8 * 16 and st["proj_left"].numel() == 32 * 8  # left: P is m x rank


def test_get_galore_param_groups_tied_weights_and_nothing_projected():
    """An embedding tied to the output Linear is not projected, whichever module comes first (it was projected
    when the Linear came first: GaLore then ran on the embedding); a model with nothing to project warns (GaLoreAdamW
    would step it as plain AdamW without a word)."""
    for head_first in (False, True):
        emb, head = torch.nn.Embedding(40, 16), torch.nn.Linear(16, 40, bias=False)
        head.weight = emb.weight
        mid = torch.nn.Linear(16, 16)
        model = torch.nn.Sequential(*([head, mid, emb] if head_first else [emb, mid, head]))
        groups = fastopt.get_galore_param_groups(model, weight_decay=0.1, rank=4)
        assert [id(p) for p in groups[0]["params"]] == [id(mid.weight)] and "rank" in groups[0], head_first
        assert [id(p) for p in groups[1]["params"]] == [id(emb.weight)], head_first
    with pytest.warns(UserWarning, match="no param is projected .* rank=8"):
        groups = fastopt.get_galore_param_groups(torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3), torch.nn.Linear(4, 2)),
                                                 weight_decay=0.1, rank=8)
    assert not any("rank" in g for g in groups)


def test_galore_torch_8bit_arguments_taken_at_their_defaults():
    """galore-torch's GaLoreAdamW8bit takes bitsandbytes' arguments: every one of them by keyword at its default
    builds the same optimizer as without it; another value is refused, naming it."""
    import inspect
    galore_torch = pytest.importorskip("galore_torch")
    theirs = {k: v.default for k, v in inspect.signature(galore_torch.GaLoreAdamW8bit).parameters.items()
              if k not in ("params", "lr", "betas", "eps", "weight_decay", "min_8bit_size")}
    assert set(theirs) == {"amsgrad", "optim_bits", "args", "percentile_clipping", "block_wise", "is_paged"}
    p = torch.nn.Parameter(torch.randn(6, 5))
    assert fastopt.GaLoreAdamW8bit([p], **theirs).defaults == fastopt.GaLoreAdamW8bit([p]).defaults
    for name, bad in (("percentile_clipping", 5), ("block_wise", False), ("amsgrad", True)):
        with pytest.raises(ValueError, match=re.escape(f"GaLoreAdamW8bit: {name}={bad!r} is not supported")):
            fastopt.GaLoreAdamW8bit([p], **{name: bad})


def test_skips_params_without_grad_and_empty_params(backend, device):
    check_skips_params_without_grad(
        lambda a, b, e: fastopt.GaLoreAdamW([{"params": [a, b], "rank": 2}, {"params": [e]}], lr=LR), device,
        shapes=((6, 5), (5, 4)))


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=-1.0), "lr"),
    (dict(betas=(1.0, 0.999)), "betas[0]"),
    (dict(eps=-1e-6), "eps"),
    (dict(weight_decay=float("nan")), "weight_decay"),
    (dict(nbits=16), "nbits"),
    (dict(nbits=8, block_size=100), "block_size"),
    (dict(nbits=8, min_8bit_size=-1), "min_8bit_size"),
    (dict(group=dict(rank=0)), "param_groups[0]['rank']"),
    (dict(group=dict(rank=2.0)), "param_groups[0]['rank']"),
    (dict(group=dict(rank=True)), "param_groups[0]['rank']"),
    (dict(group=dict(rank=2, update_proj_gap=True)), "param_groups[0]['update_proj_gap']"),
    (dict(group=dict(rank=6)), "param_groups[0]['rank']"),  # larger than min(m, n) = 5
    (dict(group=dict(rank=2, proj_type="diag")), "param_groups[0]['proj_type']"),
    (dict(group=dict(rank=2, update_proj_gap=0)), "param_groups[0]['update_proj_gap']"),
    (dict(group=dict(rank=2, scale=float("inf"))), "param_groups[0]['scale']"),
    (dict(group=dict(rank=2, nbits=4)), "param_groups[0]['nbits']"),
    (dict(group=dict(proj_type="std")), "param_groups[0]['proj_type']"),  # no rank: a plain group
    (dict(group=dict(rank=2, params=[torch.zeros(8, 5), torch.zeros(2, 3, 1)])), "param_groups[0]['rank']"),
])
def test_bad_arguments_name_themselves(kwargs, name):
    group = {"params": [torch.zeros(8, 5, requires_grad=True)], **kwargs.pop("group", {"rank": 2})}
    with pytest.raises(ValueError, match="GaLoreAdamW: " + re.escape(name) + "="):
        fastopt.GaLoreAdamW([group], **kwargs)


def test_vector_in_a_projected_group_refused_before_any_change(backend, device):
    """A plain vector may still become a flat shard of a matrix (setup_distributed, after construction): the
    first step refuses it, naming it, before any param or state changes."""
    a = torch.randn(8, 5, device=device, requires_grad=True)
    v = torch.randn(5, device=device, requires_grad=True)
    opt = fastopt.GaLoreAdamW([{"params": [a, v], "rank": 2}])
    a.grad, v.grad = torch.randn_like(a), torch.randn_like(v)
    a0 = a.detach().clone()
    with pytest.raises(ValueError, match=re.escape("GaLoreAdamW: param_groups[0]['params'][1].shape=(5,) must "
                                                   "have 2 dims")):
        opt.step()
    assert torch.equal(a, a0) and not opt.state[a]


def test_rank_set_on_a_plain_group_later(backend, device):
    """`rank` written into a plain group between steps makes it projected with galore-torch's defaults for the
    keys it lacks, as add_param_group fills them: before its params have state, the next steps are those of a
    group built with `rank`; once they have plain AdamW state, the step refuses the changed group, naming it,
    before any param or state changes (the first group, stepped earlier in the list, too)."""
    init, grads = make_problem([(6, 8), (8, 5)], steps=4)
    runs = []
    for later in (True, False):
        ps = [x.to(device).clone().requires_grad_() for x in init]
        opt = fastopt.GaLoreAdamW([{"params": ps[:1]}, {"params": ps[1:], **({} if later else {"rank": 2})}],
                                  lr=LR, weight_decay=WD)
        if later:
            opt.param_groups[1]["rank"] = 2
        for step_grads in grads:
            for p, g in zip(ps, step_grads):
                p.grad = g.to(device)
            opt.step()
        runs.append((ps, opt))
    (ours, opt), (want, _) = runs
    assert opt.param_groups[1]["proj_type"] == "std" and opt.param_groups[1]["update_proj_gap"] == 200
    for p, q in zip(ours, want):
        assert torch.equal(p, q)
    opt.param_groups[0]["rank"] = 2  # its param has full-size moments now
    before = snapshot(opt)
    with pytest.raises(ValueError, match=re.escape("GaLoreAdamW: param_groups[0]['rank']=2")):
        opt.step()
    assert_unchanged(opt, before)
    # A rank the param cannot take, set on a plain group: refused, and the group is left as the user set it (it
    # took galore-torch's defaults for the other keys first, which stayed once the user took `rank` out, and made
    # the group one that add_param_group refuses: "'update_proj_gap' must come with 'rank'").
    p = torch.randn(6, 4, device=device, requires_grad=True)
    opt = fastopt.GaLoreAdamW([p], lr=LR)
    opt.param_groups[0]["rank"] = 7
    keys = set(opt.param_groups[0])
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match=re.escape("param_groups[0]['rank']=7 must be at most min(m, n) = 4")):
        opt.step()
    assert set(opt.param_groups[0]) == keys and not opt.state[p]


def test_non_finite_gradient_at_a_refresh_is_refused_before_any_change(backend, device):
    """Without GradScaler, a NaN in a projected param's gradient at a step that refreshes its projection cannot
    go through the SVD: step() refuses it, naming the param, before any param, state or step counter changes
    (the plain group listed first included). A run that catches the error and goes on is then the run that
    never saw that batch, bit for bit."""
    init, grads = make_problem([(5,), (6, 8), (8, 5)], steps=6)
    runs = []
    for skip in (2, None):
        ps = [x.to(device).clone().requires_grad_() for x in init]
        opt = fastopt.GaLoreAdamW([{"params": ps[:1]}, {"params": ps[1:], "rank": 2, "update_proj_gap": 2}],
                                  lr=LR, weight_decay=WD)
        for t, step_grads in enumerate(grads):
            if t == skip:  # step 3 would be a refresh (t - 1) % 2 == 0
                for p, g in zip(ps, step_grads):
                    p.grad = g.to(device)
                ps[2].grad[1, 1] = float("nan")
                before = snapshot(opt)
                with pytest.raises(RuntimeError, match=re.escape("param_groups[1]['params'][1] is not finite")):
                    opt.step()
                assert_unchanged(opt, before)
                continue
            if skip is None and t == 2:
                continue
            for p, g in zip(ps, step_grads):
                p.grad = g.to(device)
            opt.step()
        runs.append((ps, opt))
    (ours, opt), (want, opt_b) = runs
    for p, q in zip(ours, want):
        assert torch.equal(p, q)
        assert all(torch.equal(v, opt_b.state[q][k]) for k, v in opt.state[p].items())


def test_colossal_piece_checked_by_its_global_shape():
    """A ColossalAI d_tensor (TP without ZeRO) is a piece whose `dist_layout` gives the global shape, which
    `setup_distributed` declares after construction: the constructor checks the rank against that shape (before:
    against the piece's, refusing rank 2 for a (1, 6) piece of a (4, 6) weight)."""
    spec = type("Spec", (), {"dim_partition_dict": {0: [0]}})()
    piece = torch.zeros(1, 6, requires_grad=True)
    piece.dist_layout = type("DistLayout", (), {"global_shape": (4, 6), "sharding_spec": spec})()
    fastopt.GaLoreAdamW([{"params": [piece], "rank": 2}])
    with pytest.raises(ValueError, match=re.escape("param_groups[0]['rank']=5 must be at most min(m, n) = 4 of its "
                                                   "param 0 of shape (4, 6)")):
        fastopt.GaLoreAdamW([{"params": [piece], "rank": 5}])


def test_8bit_class_is_nbits_8():
    p = torch.zeros(64, 48, requires_grad=True)
    opt = fastopt.GaLoreAdamW8bit([{"params": [p], "rank": 8}], min_8bit_size=0)
    assert opt.defaults["nbits"] == 8
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.uint8 and opt.state[p]["exp_avg"].numel() == 64 * 8
    with pytest.raises(ValueError, match=r"GaLoreAdamW8bit: param_groups\[0\]\['rank'\]=0"):
        fastopt.GaLoreAdamW8bit([{"params": [p], "rank": 0}])


def test_sparse_and_complex_refused_before_any_change(backend, device):
    check_refuses_sparse_and_complex(
        lambda a, other: fastopt.GaLoreAdamW([{"params": [a], "rank": 2}, {"params": [other]}]), device)


@pytest.mark.parametrize("nbits, proj_type", [(32, "std"), (8, "std"), (32, "full")])
def test_replayed_steps_are_bit_identical(backend, device, nbits, proj_type, monkeypatch):
    """A step whose params, gradients and states sit where they sat the step before replays the launches it
    recorded then (kernels/galore.py's _Record) instead of building them again, and gives the same bits as the
    steps that build them: 12 steps with a learning rate that changes every step, GradScaler with an inf step,
    refreshes at steps 1, 6 and 11, a gradient swapped for its transpose in the same memory (same address and
    shape: built again), a state_dict load midway. Full projections replay too (T and W in the scratch buffer)."""
    if backend != "triton":
        pytest.skip("the Triton launches")
    from fastopt.kernels import galore as k
    real_key, real_replay, replays, on = k._replay_key, k._Record.replay, [], [True]
    monkeypatch.setattr(k, "_replay_key", lambda *a: real_key(*a) if on[0] else None)
    monkeypatch.setattr(k._Record, "replay", lambda self, *a: replays.append(1) or real_replay(self, *a))
    shapes = [(20, 20), (12, 20), (2, 12, 18), (5, 6), (7,)]
    init, grads = make_problem(shapes, steps=12)
    runs = []
    for replay in (True, False):
        ps = [x.to(device=device, dtype=torch.float32, copy=True).requires_grad_() for x in init]
        for p in ps:
            p.grad = torch.zeros_like(p)  # kept where it is: each step writes into it
        opt = fastopt.GaLoreAdamW([{"params": ps[:3], "rank": RANK, "update_proj_gap": 5, "proj_type": proj_type},
                                   {"params": ps[3:]}], lr=LR, weight_decay=WD, nbits=nbits, **SMALL_8BIT)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + t))
        runs.append((ps, opt, sched, torch.amp.GradScaler(device.type, init_scale=2.0 ** 12), replay))
    for t, step_grads in enumerate(grads):
        for ps, opt, sched, scaler, replay in runs:
            on[0] = replay
            scaler.scale(torch.zeros((), device=device))  # the scale, made on first use
            for p, gr in zip(ps, step_grads):
                p.grad.copy_(gr * scaler.get_scale())
            if t == 3:
                ps[0].grad[1, 2] = float("inf")
            if t in (7, 8):  # the square gradient's memory read transposed for a step, then as before
                ps[0].grad = ps[0].grad.t()
            if t == 5:
                opt.load_state_dict(pickle.loads(pickle.dumps(opt.state_dict())))
            if t == 6:  # torch lets a user keep anything in the state: not a tensor, not read
                opt.state[ps[3]]["note"] = "a user's"
            scaler.step(opt)
            scaler.update()
            sched.step()
    (ours, opt, *_), (want, opt_b, *_) = runs
    for p, q in zip(ours, want):
        assert torch.equal(p, q)
        assert set(opt.state[p]) == set(opt_b.state[q])
        for key, v in opt.state[p].items():
            assert torch.equal(v, opt_b.state[q][key]) if key != "note" else v == opt_b.state[q][key], key
    # Replayed, in each of the two buckets (projected, plain), the steps after one that recorded: 8 of the
    # projected one (not the first, the load, the transposed step and the one after it), 9 of the plain one (not
    # the first, the load, the note).
    assert len(replays) == 8 + 9, len(replays)


def test_replay_tells_the_bases_apart(backend, device, monkeypatch):
    """The replay key names each state tensor: a square param at full rank switched from a right to a left
    projection, its state rebuilt in the same memory in the same order (as an allocator may hand it back), builds
    the left projection's launches, not a replay of the right one's; the same run as without replays."""
    if backend != "triton":
        pytest.skip("the Triton launches")
    from fastopt.kernels import galore as k
    real_key, on = k._replay_key, [True]
    monkeypatch.setattr(k, "_replay_key", lambda *a: real_key(*a) if on[0] else None)
    init, grads = make_problem([(16, 16)], steps=6)
    runs = []
    for replay in (True, False):
        p = init[0].to(device=device, dtype=torch.float32, copy=True).requires_grad_()
        p.grad = torch.zeros_like(p)
        runs.append((p, fastopt.GaLoreAdamW([{"params": [p], "rank": 16, "proj_type": "right",
                                              "update_proj_gap": 100}], lr=LR), replay))
    for t, (g,) in enumerate(grads):
        for p, opt, replay in runs:
            on[0] = replay
            p.grad.copy_(g)
            if t == 3:  # the basis kept (no SVD before step 100): Q's 16 x 16 now read as P
                old = opt.state[p]
                opt.param_groups[0]["proj_type"] = "left"
                opt.state[p] = {"step": old["step"], "proj_left": old["proj_right"],
                                "exp_avg": old["exp_avg"].zero_(), "exp_avg_sq": old["exp_avg_sq"].zero_()}
            opt.step()
    (p, opt, _), (q, opt_b, _) = runs
    assert torch.equal(p, q)
    for key, v in opt.state[p].items():
        assert torch.equal(v, opt_b.state[q][key]), key


@pytest.mark.parametrize("nbits", [32, 8])
def test_replay_follows_moved_gradients(backend, device, nbits, monkeypatch):
    """Gradients that come back at other addresses each step (as under zero_grad(set_to_none=True)) still replay:
    the job tables naming them are copied again with their new addresses, the same bits as the steps that build
    everything. Two sets of buffers that alternate copy tables only the first time each set is seen; fresh
    gradients, one moved alone, and one of another alignment (not replayed) take their turns. The buffers a step
    leaves hold other values, so a table left pointing at them would be caught."""
    if backend != "triton":
        pytest.skip("the Triton launches")
    from fastopt.kernels import galore as k
    real_key, real_replay, real_copy, on = k._replay_key, k._Record.replay, k._Tables._copy, [True]
    replays, copies = [], []
    monkeypatch.setattr(k, "_replay_key", lambda *a: real_key(*a) if on[0] else None)
    monkeypatch.setattr(k._Record, "replay", lambda self, *a: replays.append(1) or real_replay(self, *a))
    monkeypatch.setattr(k._Tables, "_copy", classmethod(lambda cls, *a: copies.append(1) or real_copy.__func__(
        cls, *a)))
    shapes = [(20, 20), (12, 20), (2, 12, 18), (5, 6), (7,)]
    init, grads = make_problem(shapes, steps=11)
    # Where each step's gradients go: "A"/"B" two sets of buffers, "new" fresh ones, "one" the first gradient
    # alone in a fresh buffer, "odd" the first at an address 4 bytes past a 16-byte boundary.
    where = ["A", "B", "A", "B", "A", "new", "one", "odd", "A", "B", "A"]
    runs = []
    for replay in (True, False):
        ps = [x.to(device=device, dtype=torch.float32, copy=True).requires_grad_() for x in init]
        pools = {name: [torch.empty_like(p) for p in ps] for name in "AB"}
        opt = fastopt.GaLoreAdamW([{"params": ps[:3], "rank": RANK, "update_proj_gap": 4, "proj_type": "std"},
                                   {"params": ps[3:]}], lr=LR, weight_decay=WD, nbits=nbits, **SMALL_8BIT)
        runs.append((ps, pools, opt, replay))
    for t, (step_grads, at) in enumerate(zip(grads, where)):
        for ps, pools, opt, replay in runs:
            on[0] = replay
            for i, (p, gr) in enumerate(zip(ps, step_grads)):
                if at in pools:
                    p.grad = pools[at][i]
                elif at == "new" or i == 0:
                    p.grad = torch.empty_like(p) if at != "odd" else torch.empty(p.numel() + 1, device=device)[
                        1:].view_as(p)
                p.grad.copy_(gr)
            for pool in pools.values():  # what a stale pointer would read
                if not any(q.grad is b for q, b in zip(ps, pool)):
                    for b in pool:
                        b.fill_(float(t + 1))
            n_copies = len(copies)
            opt.step()
            if replay and t in (2, 3, 4, 10):  # the recorded set, or the other one seen before: no table copied
                assert len(copies) == n_copies, t
    (ours, _, opt, _), (want, _, opt_b, _) = runs
    for p, q in zip(ours, want):
        assert torch.equal(p, q)
        for key, v in opt.state[p].items():
            assert torch.equal(v, opt_b.state[q][key]), key
    # Replayed in both buckets (projected, plain): every step after the first but the one of another alignment
    # (the projected bucket's first gradient) and the step after it (whose key is new again).
    assert len(replays) == 2 * 10 - 2, len(replays)


@pytest.mark.parametrize("tie", ["grads", "param"])
def test_replay_records_only_gradients_of_their_own(backend, device, tie, monkeypatch):
    """A record finds the gradients in its tables by address, so a step whose gradient is another's (one tensor
    for two params) or a param's memory records nothing: the steps after it, each gradient its own again, give
    the bits of steps that build everything (a record there took one param's slots for the other's)."""
    if backend != "triton":
        pytest.skip("the Triton launches")
    from fastopt.kernels import galore as k
    real_key, on = k._replay_key, [True]
    monkeypatch.setattr(k, "_replay_key", lambda *a: real_key(*a) if on[0] else None)
    init, grads = make_problem([(20, 20), (20, 20), (5, 6), (5, 6)], steps=4)
    runs = []
    for replay in (True, False):
        ps = [x.to(device=device, dtype=torch.float32, copy=True).requires_grad_() for x in init]
        opt = fastopt.GaLoreAdamW([{"params": ps[:2], "rank": RANK, "update_proj_gap": 100}, {"params": ps[2:]}],
                                  lr=LR, weight_decay=WD)
        runs.append((ps, opt, replay))
    for t, step_grads in enumerate(grads):
        for ps, opt, replay in runs:
            on[0] = replay
            for p, gr in zip(ps, step_grads):
                p.grad = gr.to(device=device, dtype=torch.float32, copy=True)
            if t == 0:  # the first step records, and the next ones, each gradient its own, would replay it
                for a, b in ((0, 1), (2, 3)):
                    ps[b].grad = ps[a].grad if tie == "grads" else ps[a].detach()
            opt.step()
    (ours, opt, _), (want, opt_b, _) = runs
    for p, q in zip(ours, want):
        assert torch.equal(p, q)
        for key, v in opt.state[p].items():
            assert torch.equal(v, opt_b.state[q][key]), key


@pytest.mark.parametrize("proj_type, matmuls", [("left", 2), ("right", 2), ("full", 4)])
@pytest.mark.parametrize("matrices", [1, 3])
def test_launches_and_no_full_size_buffer(backend, device, proj_type, matmuls, matrices, monkeypatch):
    """Per step and bucket, however many matrices: one projection launch, one Adam launch for the projected
    params and one for the plain ones, one back-projection launch with the update fused in (full: two products
    each way). The scratch buffers are rank-sized: the full-size update is never materialized."""
    if backend != "triton":
        pytest.skip("counts Triton launches")
    from fastopt.kernels import galore as k
    launches, scratch = [], []
    monkeypatch.setattr(k, "_galore_matmul_kernel", Counting("matmul", k._galore_matmul_kernel, launches))
    monkeypatch.setattr(k, "_galore_adam_kernel", Counting("adam", k._galore_adam_kernel, launches))
    real_scratch = k._scratch
    monkeypatch.setattr(k, "_scratch", lambda shape, *a: scratch.append(
        math.prod(shape) if isinstance(shape, tuple) else shape) or real_scratch(shape, *a))
    ws = [torch.randn(40 - 3 * i, 24 + i, device=device, requires_grad=True) for i in range(matrices)]
    b = torch.randn(24, device=device, requires_grad=True)
    opt = fastopt.GaLoreAdamW([{"params": ws, "rank": 4, "proj_type": proj_type}, {"params": [b]}], lr=LR)
    for t in range(2):
        for p in ws + [b]:
            p.grad = torch.randn_like(p)
        launches.clear()
        opt.step()
        assert sorted(launches) == sorted(["matmul"] * matmuls + ["adam"] * 2), (t, launches)
    assert scratch and max(scratch) < sum(w.numel() for w in ws) // 4, scratch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["auto", "ieee"])
@pytest.mark.parametrize("mkn", [(61, 53, 29), (29, 53, 61)])  # tiles in the order of A's rows / of B's columns
def test_dot_operands_rounded_to_the_param_dtype(backend, device, dtype, mode, mkn, monkeypatch):
    """The projection kernel's products: by default (`auto`) a bf16/fp16 bucket multiplies operands rounded to
    its dtype (galore-torch's own precision for such params); fp32 runs fp32 (tf32x3 on a GPU, which the
    interpreter cannot show); FASTOPT_GALORE_DOT=ieee keeps fp32 operands for every dtype. A bad value is a
    ValueError naming the variable."""
    if backend != "triton":
        pytest.skip("the Triton matmul kernel")
    from fastopt.kernels import galore as k
    monkeypatch.setenv("FASTOPT_GALORE_DOT", mode)
    precision, lowp = k.dot_precision()
    gen = torch.Generator().manual_seed(3)
    m, k_, n = mkn
    a = torch.randn(2, m, k_, generator=gen, dtype=torch.float64).to(device)
    b = torch.randn(2, k_, n, generator=gen, dtype=torch.float64).to(device)
    c = torch.empty(2, m, n, device=device)
    dummy = torch.empty(1, device=device)
    op = torch.empty(1, dtype=dtype, device=device) if lowp and dtype != torch.float32 else None
    k._Launch(None, None, None, None, 0.0, False, dummy, op, precision).matmul(a.float(), b.float(), c)
    rounded = dtype if op is not None else torch.float32
    want = a.to(rounded).double() @ b.to(rounded).double()
    # fp32 accumulation of exact products: within a few fp32 ulps of the float64 sum of the rounded operands
    err = ((c.double() - want).abs() / (a.to(rounded).double().abs() @ b.to(rounded).double().abs())).max()
    assert err <= 53 * 2.0 ** -24, err.item()
    if op is not None:  # and the rounding shows: fp32 operands would be far off it
        far = ((a.float().double() @ b.float().double()) - want).abs().max()
        assert far > 100 * (c.double() - want).abs().max()
    monkeypatch.setenv("FASTOPT_GALORE_DOT", "tf16")
    with pytest.raises(ValueError, match="FASTOPT_GALORE_DOT"):
        k.dot_precision()


# Aligned matrices (every size, stride and the rank a multiple of 16) spanning three and four 128-row or -column
# tiles, the last partial, and the back-projections' K (the rank) a multiple of 16 but not of 32: where
# kernels/galore.py takes TILES_SM90.
ALIGNED_MATS = [(272, 160), (160, 400)]
ALIGNED_RANK = 144


def _aligned_run(dtype, device, steps=4, shapes=ALIGNED_MATS, rank=ALIGNED_RANK, unaligned=()):
    """`shapes` projected at `rank`; `unaligned` (shapes) in a group of their own at RANK, in the same steps."""
    init, grads = make_problem(list(shapes) + list(unaligned), steps=steps)
    params = [p.to(device=device, dtype=dtype, copy=True).requires_grad_() for p in init]
    groups = [{"params": params[:len(shapes)], "rank": rank, "update_proj_gap": 2, "scale": 0.25}]
    groups += [{"params": params[len(shapes):], "rank": RANK, "update_proj_gap": 2, "scale": 0.25}] if unaligned else []
    opt = fastopt.GaLoreAdamW(groups, lr=LR, weight_decay=WD)
    step(opt, params, grads)
    return [p.detach().cpu() for p in params], init


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tiles_track_the_reference(backend, device, dtype, monkeypatch):
    """The matmul kernel with TILES_SM90 (128x128x32; under the interpreter, tiles_for chooses as on an H100) on
    ALIGNED_MATS, beside unaligned MATS (TILES) in the same steps, 4 steps with a refresh at 1 and 3: within the
    dtype's tolerance of the float64 reference, and no further from it than the reference run in the dtype. On an
    H100/H200 the aligned launches took TILES_SM90 and the others TILES; on other GPUs every launch TILES."""
    if backend != "triton":
        pytest.skip("the Triton matmul kernel")
    from fastopt.kernels import galore as k
    monkeypatch.delenv("FASTOPT_GALORE_DOT", raising=False)  # ieee would keep TILES
    if ops.interpreting():  # as on an H100: the launches choose (and size their grids) as there
        monkeypatch.setattr(k, "tiles_for", lambda dev, large=True: k.TILES_SM90 if large else k.TILES)
    log = []
    monkeypatch.setattr(k, "_galore_matmul_kernel", _Logged(k._galore_matmul_kernel, log, "BM"))
    mixed = dict(unaligned=MATS[:2])  # the same steps launch TILES too
    ours, init = _aligned_run(dtype, device, **mixed)
    with on_torch_backend(monkeypatch):
        truth, _ = _aligned_run(torch.float64, device, **mixed)
        ref_lowp, _ = _aligned_run(dtype, device, **mixed)
    assert_tracks(ours, truth, [p.to(dtype) for p in init], dtype, ref_lowp=ref_lowp)
    big = ops.interpreting() or torch.cuda.get_device_capability(device)[0] == 9
    assert set(log) == ({k.TILES_SM90["project"][0]} if big else set()) | {k.TILES["project"][0]}, log


def test_large_tiles_only_for_aligned_tensor_core_launches(backend, device, monkeypatch):
    """tiles_for: TILES_SM90 on compute capability 9.x for launches whose every access is aligned and whose
    product runs on tensor cores; TILES for unaligned launches (MATS; an odd-sized matrix launches apart from the
    aligned ones of its group), fp32 FMA products (FASTOPT_GALORE_DOT=ieee), other GPUs (a ROCm build's too), and
    under the interpreter."""
    if backend != "triton":
        pytest.skip("the Triton matmul kernel")
    from fastopt.kernels import galore as k
    monkeypatch.delenv("FASTOPT_GALORE_DOT", raising=False)
    asked = []
    real = k.tiles_for
    monkeypatch.setattr(k, "tiles_for", lambda dev, large=True: asked.append(large) or real(dev, large))
    small = dict(steps=2, shapes=[(48, 32), (32, 64)], rank=16)  # as aligned, fewer interpreted programs
    _aligned_run(torch.float32, device, **small)
    assert asked and all(asked), asked
    launches = len(asked)
    asked.clear()
    init, grads = make_problem(MATS + PLAIN, steps=2)
    run(init, grads, torch.float32, device)
    assert asked and not any(asked), asked
    asked.clear()
    # an odd-sized matrix in the same group (projected on the side (48, 32) is) launches apart: the aligned ones
    # keep their launches
    _aligned_run(torch.float32, device, **{**small, "shapes": [*small["shapes"], (40, 24)]})
    assert asked.count(True) == launches and False in asked, asked
    asked.clear()
    monkeypatch.setenv("FASTOPT_GALORE_DOT", "ieee")
    _aligned_run(torch.float32, device, **small)
    assert asked and not any(asked), asked
    # the choice per device, as on a machine with such a GPU
    monkeypatch.setattr(k, "INTERPRET", False)
    for cap, want in (((9, 0), k.TILES_SM90), ((8, 0), k.TILES), ((10, 0), k.TILES)):
        monkeypatch.setattr(k, "_TILES_OF", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, cap=cap: cap)
        assert real(torch.device("cuda", 0)) is want and real(torch.device("cuda", 0), False) is k.TILES, cap
    # a ROCm build's MI300 reports (9, 4): TILES there
    with monkeypatch.context() as m:
        m.setattr(torch.version, "hip", "6.4.0")
        m.setattr(k, "_TILES_OF", {})
        m.setattr(torch.cuda, "get_device_capability", lambda d: (9, 4))
        assert real(torch.device("cuda", 0)) is k.TILES
    # each device its own: an H100 beside another GPU, asked in either order
    caps = {0: (8, 0), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: caps[d.index])
    for order in ((0, 1), (1, 0)):
        monkeypatch.setattr(k, "_TILES_OF", {})
        for i in order:
            assert real(torch.device("cuda", i)) is (k.TILES_SM90 if i == 1 else k.TILES), (order, i)


class _Logged:
    """Stands in for a kernel and logs one keyword argument of each launch, replayed ones too (a replay calls
    the launcher its recording step took from the module)."""

    def __init__(self, fn, log: list, key: str):
        self.fn, self.log, self.key = fn, log, key

    def __getitem__(self, grid):
        launcher = self.fn[grid]

        def launch(*args, **kwargs):
            self.log.append(kwargs[self.key])
            return launcher(*args, **kwargs)
        return launch


@pytest.fixture
def cuda_matmul():
    """torch.backends.cuda.matmul, its fp32_precision set back after the test (monkeypatch cannot: the attribute
    lives behind the module's __getattr__, so monkeypatch would delete it)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        yield matmul
    finally:
        torch.set_float32_matmul_precision("highest")  # a test may have used the legacy setter
        matmul.fp32_precision = before


def test_fp32_products_follow_torchs_tf32_setting(backend, device, cuda_matmul, monkeypatch):
    """By default (`auto`) the products of fp32 params run in tf32x3, and in plain TF32 while torch's fp32
    matmuls do (torch.backends.cuda.matmul.fp32_precision, also set by torch.set_float32_matmul_precision):
    read at every step, so a replayed step follows a change too. FASTOPT_GALORE_DOT overrides it."""
    if backend != "triton":
        pytest.skip("the Triton matmul kernel")
    from fastopt.kernels import galore as k
    matmul = cuda_matmul
    monkeypatch.delenv("FASTOPT_GALORE_DOT", raising=False)
    matmul.fp32_precision = "none"
    log = []
    monkeypatch.setattr(k, "_galore_matmul_kernel", _Logged(k._galore_matmul_kernel, log, "PRECISION"))
    ps = [torch.randn(12, 10, device=device, requires_grad=True), torch.randn(10, device=device, requires_grad=True)]
    opt = fastopt.GaLoreAdamW([{"params": ps[:1], "rank": 3, "update_proj_gap": 100}, {"params": ps[1:]}], lr=LR)

    def precisions_of_two_steps():  # the second step replays the first's launches unless the setting changed
        seen = []
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn_like(p)
            log.clear()
            opt.step()
            assert len(log) == 2, log  # projection and back-projection
            seen.append(set(log))
        return seen

    assert precisions_of_two_steps() == [{"tf32x3"}] * 2
    matmul.fp32_precision = "tf32"
    assert precisions_of_two_steps() == [{"tf32"}] * 2
    matmul.fp32_precision = "ieee"
    assert precisions_of_two_steps() == [{"tf32x3"}] * 2
    assert k.dot_precision() == ("tf32x3", True)
    torch.set_float32_matmul_precision("high")  # the legacy setter writes the same setting
    assert k.dot_precision() == ("tf32", True)
    for forced in ("tf32x3", "ieee"):
        monkeypatch.setenv("FASTOPT_GALORE_DOT", forced)
        assert k.dot_precision() == (forced, False)
        assert precisions_of_two_steps() == [{forced}] * 2


@pytest.mark.gpu
def test_tf32_setting_shows_in_the_fp32_products(cuda_matmul, monkeypatch):
    """On the GPU: with torch's fp32 matmuls in TF32, the projection products of fp32 operands carry TF32's
    error (10 mantissa bits kept of each operand), far above tf32x3's, and within it."""
    from fastopt.kernels import galore as k
    monkeypatch.delenv("FASTOPT_GALORE_DOT", raising=False)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(2, 61, 53, generator=gen, dtype=torch.float64)
    b = torch.randn(2, 53, 29, generator=gen, dtype=torch.float64)
    want, size = a.float().double() @ b.float().double(), a.float().double().abs() @ b.float().double().abs()
    dummy = torch.empty(1, device="cuda")
    errs = {}
    for setting in ("none", "tf32"):
        cuda_matmul.fp32_precision = setting
        precision, _ = k.dot_precision()
        c = torch.empty(2, 61, 29, device="cuda")
        k._Launch(None, None, None, None, 0.0, False, dummy, None, precision).matmul(a.float().cuda(), b.float().cuda(), c)
        errs[precision] = ((c.double().cpu() - want).abs() / size).max().item()
    assert set(errs) == {"tf32x3", "tf32"}
    assert errs["tf32x3"] <= 53 * 2.0 ** -24, errs
    assert 2.0 ** -16 <= errs["tf32"] <= 2.0 ** -8, errs


@pytest.mark.gpu
def test_step_does_not_sync_with_the_host():
    """Steps without an SVD (the refresh is at step 1 only here) run without a host sync, under GradScaler."""
    params = [torch.randn(s, device="cuda", requires_grad=True) for s in [(96, 64), (64,)]]
    opt = fastopt.GaLoreAdamW([{"params": params[:1], "rank": 8, "update_proj_gap": 100},
                               {"params": params[1:]}], lr=1e-3)
    check_no_host_sync(opt, params, steps=4, first_checked=1)


# ---- sharded params (issue 7) ----------------------------------------------------------------------------
# (global shape, mesh shape, placements): uneven row shards, column shards, a batch sharded over its batch
# dim (two ranks hold nothing of it), rows x columns on a 2 x 2 mesh (FSDP2 + TP), FSDP2 over TP's rows
# (_StridedShard), a replicated matrix, and a sharded vector in the plain group.
DIST_CASES = [
    ((18, 10), (4,), [("S", 0)]),
    ((10, 14), (4,), [("S", 1)]),
    ((2, 9, 12), (4,), [("S", 0)]),
    ((12, 10), (2, 2), [("S", 0), ("S", 1)]),
    ((16, 9), (2, 2), [("SS", 0, 2), ("S", 0)]),
    ((8, 6), (4,), [("R",)]),
    ((9,), (4,), [("S", 0)]),
]
DIST_PROJ = 6  # the first six are projected
DIST_STEPS = 8


def _dtensor_galore(rank, world, init, grads, backends, proj_types):
    """Child of the dist test: every DIST_CASES param as a DTensor, stepped by fastopt.GaLoreAdamW on each
    back end and projection type; returns the whole params, the states and the collectives of each step."""
    import os

    import torch.distributed as dist
    from dist_utils import placement
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from fastopt.reference import galore as ref_galore

    meshes = {(4,): init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
              (2, 2): init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}
    plc = [(meshes[m], [placement(s) for s in pls]) for _, m, pls in DIST_CASES]
    out = {}
    for backend, proj_type in [(b, t) for b in backends for t in proj_types]:
        os.environ["FASTOPT_BACKEND"] = backend
        params = [torch.nn.Parameter(distribute_tensor(x.clone(), m, pl, src_data_rank=None))
                  for x, (m, pl) in zip(init, plc)]
        opt = fastopt.GaLoreAdamW([{"params": params[:DIST_PROJ], "proj_type": proj_type, **GROUP},
                                   {"params": params[DIST_PROJ:]}], lr=LR, weight_decay=WD)
        calls, svds = [], []
        names = [c for c in ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter_single",
                             "all_gather_into_tensor", "all_gather_single", "all_gather", "broadcast",
                             "all_to_all_single")
                 if hasattr(dist, c)]
        real = {c: getattr(dist, c) for c in names}
        for c in names:
            setattr(dist, c, lambda *a, _c=c, **k: calls.append(_c.replace("_tensor", "").replace("_into", "")
                                                                  .replace("_single", "")) or real[_c](*a, **k))
        svd, share = ref_galore.orthogonal_bases, ref_galore.SHARE_ELEMENTS
        ref_galore.orthogonal_bases = lambda *a, **k: svds.append(1) or svd(*a, **k)
        ref_galore.SHARE_ELEMENTS = 1  # one all-reduce per shared basis: the bounded buffers are exercised
        per_step, svd_steps = [], []
        try:
            for step_grads in grads:
                for p, g, (m, pl) in zip(params, step_grads, plc):
                    p.grad = distribute_tensor(g.clone(), m, pl, src_data_rank=None)
                calls.clear()
                svds.clear()
                opt.step()
                per_step.append(sorted(calls))
                svd_steps.append(len(svds))
        finally:
            for c in names:
                setattr(dist, c, real[c])
            ref_galore.orthogonal_bases, ref_galore.SHARE_ELEMENTS = svd, share
        full = [p.detach().full_tensor() for p in params]
        states = [{k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in opt.state[p].items()}
                  for p in params[:DIST_PROJ]]
        cuts = [tuple(opt.state[p]["exp_avg"].to_local().shape) for p in params[:DIST_PROJ]]
        kept = [(tuple(p.to_local().shape), {k: tuple(v.to_local().shape) for k, v in opt.state[p].items()
                                             if k.startswith("proj")}) for p in params[:DIST_PROJ]]
        out[backend, proj_type] = (full, states, per_step, cuts, svd_steps, kept)
    return out


@pytest.mark.dist
def test_dtensor_shards_match_single_process(pool):
    """4 gloo ranks: every layout gives galore-torch's single-process result; the bases are the same SVD of
    the whole gradient (bit for bit), each rank keeping the rows of P and the columns of Q of its own piece, and
    the moments of a sharded param are cut along one dim over its ranks (each entry on exactly one rank of its
    group; a replicated param's are whole). Collectives:
    one reduce-scatter of the projected gradients and one all-gather of N per sharded bucket per step; on
    refresh steps also two small all-gathers (where each rank's pieces lie) and one all_to_all for the bucket
    (each sharded projected param's whole gradient onto the rank that computes its SVD: the k-th param's on
    rank k % 4), one all-reduce of the failure flags and the all-reduces of the bucket's new bases (one per
    basis here, with the buffer bound set to 1 element); none for the sharded vector of the plain group. The
    replicated param's SVD runs on every rank."""
    from fastopt import ops
    backends = ["torch"] + (["triton"] if ops.triton_available() and ops.interpreting() else [])
    shapes = [c[0] for c in DIST_CASES]
    init, grads = make_problem(shapes, steps=DIST_STEPS, seed=1)
    n_split = [s[0] if len(s) > 2 else 1 for s in shapes[:DIST_PROJ]]
    ref_init = split_batches(init[:DIST_PROJ]) + init[DIST_PROJ:]
    ref_grads = [split_batches(g[:DIST_PROJ]) + g[DIST_PROJ:] for g in grads]
    proj_types = ["std", "full"]
    results = pool.run(_dtensor_galore, init, grads, backends, proj_types)
    sharded = [i for i, c in enumerate(DIST_CASES[:DIST_PROJ]) if c[2][0][0] != "R"]
    buckets = 1  # the 1-D mesh over all 4 ranks and the 2 x 2 mesh sharded on both dims: the world group
    for backend, proj_type in [(b, t) for b in backends for t in proj_types]:
        ref_flat, ref_opt, plist = galore_torch_run(ref_init, ref_grads, proj_type, sum(n_split))
        for r, res in enumerate(results):
            full, states, per_step, _cuts, svd_steps, kept = res[backend, proj_type]
            assert full[0].shape == init[0].shape
            for piece, bases in kept:  # the bases of the local piece's rows (P) and columns (Q) alone
                want = {"proj_left": piece[:-1] + (GROUP["rank"],),
                        "proj_right": piece[:-2] + (GROUP["rank"], piece[-1])}
                assert bases and all(shape == want[k] for k, shape in bases.items()), (r, piece, bases)
            for t, (calls, svds) in enumerate(zip(per_step, svd_steps), start=1):
                refresh = (t - 1) % GAP == 0
                bases = len(sharded) * (2 if proj_type == "full" else 1)  # SHARE_ELEMENTS = 1: one each
                want = ["all_gather", "reduce_scatter"] * buckets + \
                    (["all_gather"] * 2 + ["all_to_all"] + ["all_reduce"] * (bases + 1) if refresh else [])  # + flags
                assert calls == sorted(want), (backend, r, t, calls)
                mine = sum(1 for k in range(len(sharded)) if k % 4 == r) + (DIST_PROJ - len(sharded))
                assert svds == (mine if refresh else 0), (backend, r, t, svds)
            k = 0
            for i, x in enumerate(init):
                mats = n_split[i] if i < DIST_PROJ else 1
                want = torch.stack(ref_flat[k:k + mats]).view(x.shape) if mats > 1 else ref_flat[k]
                err = rel_update_error([full[i]], [want], [x])
                assert err <= TOL[torch.float64], (backend, r, i, err)
                if i < DIST_PROJ:
                    for key, v in states[i].items():
                        if key == "step":
                            continue
                        ours = v.reshape(mats, *galore_state(ref_opt, plist[k], key).shape)
                        for j in range(mats):
                            w = galore_state(ref_opt, plist[k + j], key)
                            if key.startswith("proj"):
                                assert torch.equal(ours[j], w), (backend, r, i, key)
                            else:
                                assert ((ours[j] - w).norm() / w.norm()).item() <= TOL[torch.float64], (i, key)
                k += mats
            for a, b in zip(states, results[0][backend, proj_type][1]):
                assert all(torch.equal(a[key], b[key]) for key in a), "ranks hold different states"
        # The moments' local pieces: a sharded param's are cut along one dim (the first with >= 4 entries) over the
        # 4 ranks of its group, adding up to the whole (each rank holds about a quarter); a replicated param's
        # are whole on every rank.
        for i in range(DIST_PROJ):
            whole = tuple(results[0][backend, proj_type][1][i]["exp_avg"].shape)
            local = [res[backend, proj_type][3][i] for res in results]
            if i not in sharded:
                assert all(x == whole for x in local), (i, local, whole)
                continue
            d = next(d for d, n in enumerate(whole) if n >= 4)
            assert all(x[:d] + x[d + 1:] == whole[:d] + whole[d + 1:] for x in local), (i, local, whole)
            assert sum(x[d] for x in local) == whole[d], (i, local, whole)
            assert max(x[d] for x in local) == -(-whole[d] // 4), (i, local, whole)


def _dtensor_replay(rank, world, init, grads, nbits, proj_type):
    """Child: the DIST_CASES params as DTensors on the Triton back end, two optimizers stepped alike, one with
    its launches replayed (kernels/galore.py's _Record) and one building them every step; returns whether the
    params and states are bit-identical and the replays of each run."""
    import os

    from dist_utils import placement
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from fastopt.distributed.layout import local
    from fastopt.kernels import common
    from fastopt.kernels import galore as k
    meshes = {(4,): init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
              (2, 2): init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}
    plc = [(meshes[m], [placement(s) for s in pls]) for _, m, pls in DIST_CASES]
    os.environ["FASTOPT_BACKEND"] = "triton"
    common.POISON = True  # scratch buffers NaN: an element a replay leaves unwritten shows
    real_key, real_replay, on, replays = k._replay_key, k._Record.replay, [True], []
    k._replay_key = lambda *a: real_key(*a) if on[0] else None
    k._Record.replay = lambda self, *a: replays.append(on[0]) or real_replay(self, *a)
    try:
        runs = []
        for replay in (True, False):
            params = [torch.nn.Parameter(distribute_tensor(x.clone(), m, pl, src_data_rank=None))
                      for x, (m, pl) in zip(init, plc)]
            opt = fastopt.GaLoreAdamW([{"params": params[:DIST_PROJ], **GROUP, "proj_type": proj_type},
                                       {"params": params[DIST_PROJ:]}], lr=LR, weight_decay=WD, nbits=nbits,
                                      **SMALL_8BIT)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + t))
            runs.append((params, opt, sched, replay))
        for step_grads in grads:
            for params, opt, sched, replay in runs:
                on[0] = replay
                for p, g, (m, pl) in zip(params, step_grads, plc):  # new memory every step
                    p.grad = distribute_tensor(g.clone(), m, pl, src_data_rank=None)
                opt.step()
                sched.step()
    finally:
        k._replay_key, k._Record.replay = real_key, real_replay
        os.environ["FASTOPT_BACKEND"] = "torch"
        common.POISON = False
    (ours, opt_a, *_), (want, opt_b, *_) = runs
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(ours, want))
    for p, q in zip(ours, want):
        a, b = opt_a.state[p], opt_b.state[q]
        same = same and set(a) == set(b) and all(torch.equal(local(a[key]), local(b[key])) for key in a)
    return same, replays


@pytest.mark.dist
@pytest.mark.parametrize("nbits, proj_type", [(32, "std"), (8, "std"), (32, "full")])
def test_dtensor_replay_is_bit_identical(pool, nbits, proj_type):
    """4 gloo ranks, DTensor params on two meshes (Shard(0) and Shard(1) pieces, _StridedShard, a replicated
    matrix, a sharded vector in the plain group), gradients in new memory every step, a learning rate that
    changes every step, refreshes inside the run, scratch buffers filled with NaN: after the first step each of
    the three buckets (the sharded projected params, with their reduce-scatter and all-gather between the
    launches; the replicated matrix of the same group, whose cache is its own; the sharded vector) replays the
    launches it recorded, also on the ranks whose pieces of the 3-D param and of the vector are empty (their
    part of R: zeros), and params and states are bit-identical to those of steps that build their launches;
    with full projections too (their middle products T and W in the scratch buffer)."""
    from fastopt import ops
    if not (ops.triton_available() and ops.interpreting()):
        pytest.skip("the Triton launches, under the interpreter")
    init, grads = make_problem([c[0] for c in DIST_CASES], steps=DIST_STEPS, seed=2)
    for same, replays in pool.run(_dtensor_replay, init, grads, nbits, proj_type):
        assert same
        assert replays == [True] * (3 * (DIST_STEPS - 1)), (len(replays), replays)  # 3 buckets, after the first step


def _permuted_mesh(rank, world, backend, init, grads):
    """Child: a (16, 6) param as a DTensor Shard(0), Shard(0) on a 2 x 2 mesh whose ranks are not in row-major
    order, and the same param whole in one process (each rank runs both); returns the largest differences of
    the param and of each moment."""
    import os

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    os.environ["FASTOPT_BACKEND"] = backend
    mesh = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]))
    pl = [Shard(0), Shard(0)]
    p = torch.nn.Parameter(distribute_tensor(init.clone(), mesh, pl, src_data_rank=None))
    q = torch.nn.Parameter(init.clone())
    opts = [fastopt.GaLoreAdamW([{"params": [x], **GROUP}], lr=LR, weight_decay=WD) for x in (p, q)]
    try:
        for g in grads:
            p.grad = distribute_tensor(g.clone(), mesh, pl, src_data_rank=None)
            q.grad = g.clone()
            for opt in opts:
                opt.step()
    finally:
        os.environ["FASTOPT_BACKEND"] = "torch"
    out = {"param": (p.detach().full_tensor() - q.detach()).abs().max().item()}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = (opts[0].state[p][key].full_tensor() - opts[1].state[q][key]).abs().max().item()
    return out


@pytest.mark.dist
def test_sharded_moments_follow_the_mesh_rank_order(pool):
    """A mesh whose rank k is not the k-th coordinate in row-major order ([[0, 2], [1, 3]]): rank 1 holds rows
    8-11 of the param and keeps rows 8-11 of its (16, 4) moments, not rows 4-7 (the reduce-scatter's packing
    follows the group's ranks, not their order on the mesh): params and moments as in one process, over 4
    steps with a refresh."""
    from fastopt import ops
    backends = ["torch"] + (["triton"] if ops.triton_available() and ops.interpreting() else [])
    init, grads = make_problem([(16, 6)], steps=4, seed=5)
    for backend in backends:
        for r, diffs in enumerate(pool.run(_permuted_mesh, backend, init[0], [g[0] for g in grads])):
            assert max(diffs.values()) <= 1e-12, (backend, r, diffs)


def _svd_failure(rank, world):
    """Child: three sharded params, a NaN in one rank's piece of the second one's gradient on the first (refresh)
    step, no GradScaler: only that param's SVD rank sees the NaN, and every rank must raise alike."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(12, 8, generator=g), mesh, [Shard(0)],
                                                   src_data_rank=None)) for _ in range(3)]
    opt = fastopt.GaLoreAdamW([{"params": params, "rank": 2}], lr=1e-2)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g)
        if i == 1:
            grad[11, 3] = float("nan")  # rank 3's rows
        p.grad = distribute_tensor(grad, mesh, [Shard(0)], src_data_rank=None)
    with pytest.raises(RuntimeError, match="SVD of a projected gradient failed on rank") as err:
        opt.step()
    dist.barrier()  # every rank is out of the step's collectives
    return str(err.value)


@pytest.mark.dist
def test_failed_svd_raises_on_every_rank(pool):
    """The SVD of a sharded param runs on one rank of its group (the second param's on rank 1); when it fails,
    every rank raises the same error instead of waiting for that rank in the next collective."""
    msgs = pool.run(_svd_failure)
    assert all("rank(s) [1]" in m for m in msgs), msgs
    assert "converge" in msgs[1] or "non-finite" in msgs[1], msgs[1]


DIST_INF_STEP = 3  # t = 4: a refresh step (GAP = 3)


def _dtensor_skipped_refresh(rank, world, backend, init, grads):
    """Child: the DIST_CASES params as DTensors stepped through torch.amp.GradScaler (grads scaled by 2^12), every
    element of every gradient inf at step DIST_INF_STEP; returns the whole params and states after each step."""
    import os

    from dist_utils import placement, scaled_dtensor_step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    meshes = {(4,): init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
              (2, 2): init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}
    plc = [(meshes[m], [placement(s) for s in pls]) for _, m, pls in DIST_CASES]
    os.environ["FASTOPT_BACKEND"] = backend
    history, bad = [], []
    try:
        params = [torch.nn.Parameter(distribute_tensor(x.clone(), m, pl, src_data_rank=None))
                  for x, (m, pl) in zip(init, plc)]
        opt = fastopt.GaLoreAdamW([{"params": params[:DIST_PROJ], **GROUP}, {"params": params[DIST_PROJ:]}],
                                  lr=LR, weight_decay=WD)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        for t, step_grads in enumerate(grads):
            bad += [(t, k) for k in scaled_dtensor_step(scaler, opt, params, step_grads, plc, t == DIST_INF_STEP)]
            # copies: the full_tensor() of a replicated DTensor may be its local tensor, which later steps change
            history.append(([p.detach().full_tensor().clone() for p in params],
                            [{k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                              for k, v in opt.state[p].items()} for p in params]))
    finally:
        os.environ["FASTOPT_BACKEND"] = "torch"
    assert not bad, ("grads not unscaled as torch leaves them (step, param)", bad)
    return history


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter on the inf step
def test_grad_scaler_skipped_refresh_leaves_sharded_bases_unchanged(pool):
    """4 gloo ranks, the DIST_CASES params as DTensors under GradScaler, an all-inf gradient on a refresh step
    (t = 4): that step changes nothing, the bases included (their SVD, of the zeroed gradient, is discarded on
    every rank that shares it), and after every step params and states are those of one process in float64 that
    never saw the bad step (its refresh comes at the next step instead). The bases are checked right after the
    skipped step: the refresh of the next step would write over bases the skipped step changed."""
    from fastopt import ops
    backends = ["torch"] + (["triton"] if ops.triton_available() and ops.interpreting() else [])
    init, grads = make_problem([c[0] for c in DIST_CASES], steps=DIST_STEPS, seed=3)
    ref = [x.clone().requires_grad_() for x in init]
    ref_opt = fastopt.GaLoreAdamW([{"params": ref[:DIST_PROJ], **GROUP}, {"params": ref[DIST_PROJ:]}], lr=LR,
                                  weight_decay=WD)
    want = []  # after each step of ours: the single process after the same good steps
    for t, step_grads in enumerate(grads):
        if t != DIST_INF_STEP:
            step(ref_opt, ref, [step_grads])
        want.append(([p.detach().clone() for p in ref],
                     [{k: v.clone() for k, v in ref_opt.state[p].items()} for p in ref]))
    for backend in backends:
        for r, history in enumerate(pool.run(_dtensor_skipped_refresh, backend, init, grads)):
            for t, ((full, states), (ref_full, ref_states)) in enumerate(zip(history, want)):
                if t == DIST_INF_STEP:  # bit for bit what the step before left
                    before_full, before_states = history[t - 1]
                    assert all(torch.equal(a, b) for a, b in zip(full, before_full)), (backend, r, t)
                    for i, (s, s0) in enumerate(zip(states, before_states)):
                        changed = [k for k in s0 if not torch.equal(s[k], s0[k])]
                        assert not changed, (backend, r, t, i, changed)
                for i, (a, b, x) in enumerate(zip(full, ref_full, init)):
                    err = rel_update_error([a], [b], [x])
                    assert err <= TOL[torch.float64], (backend, r, t, i, err)
                    for k, v in ref_states[i].items():
                        if k.startswith("proj"):  # the same fp32 SVD of the same (unscaled) gradient
                            assert torch.equal(states[i][k], v), (backend, r, t, i, k)
                        elif k != "step":
                            e = ((states[i][k] - v).norm() / v.norm()).item()
                            assert e <= TOL[torch.float64], (backend, r, t, i, k, e)
                        else:
                            assert float(states[i][k]) == float(v), (backend, r, t, i, float(states[i][k]), float(v))


def _assert_as_galore_torch(full, states, init, ref, ref_opt, plist, where) -> None:
    """One rank's whole params and states against galore-torch's single process (`galore_torch_run`): params
    within TOL of the update, bases equal (the same fp32 SVD of the whole gradient), moments within TOL."""
    for i, (a, b, x) in enumerate(zip(full, ref, init)):
        err = rel_update_error([a], [b], [x])
        assert err <= TOL[torch.float64], (*where, i, err)
        for key, v in states[i].items():
            if key == "step":
                continue
            w = galore_state(ref_opt, plist[i], key)
            if key.startswith("proj"):
                assert torch.equal(v, w), (*where, i, key)
            else:
                e = ((v - w).norm() / w.norm()).item()
                assert e <= TOL[torch.float64], (*where, i, key, e)


STRIDED = [(22, 6), (20, 24)]  # a tall (projected on the right) and a wide (on the left) matrix; uneven cuts


def _strided_galore(rank, world, backend, init, grads, proj_type):
    """Child: the STRIDED matrices as DTensors _StridedShard(0, split_factor=2) on a 1-D mesh of the 4 ranks (FSDP2's
    cut of a TP piece, alone: each rank holds two runs of rows, not one); returns the whole params and states."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from dist_utils import whole
    from fastopt.distributed import layout_of
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    pl = [_StridedShard(0, split_factor=2)]
    os.environ["FASTOPT_BACKEND"] = backend
    try:
        params = [torch.nn.Parameter(distribute_tensor(x.clone(), mesh, pl, src_data_rank=None)) for x in init]
        opt = fastopt.GaLoreAdamW([{"params": params, "proj_type": proj_type, **GROUP}], lr=LR, weight_decay=WD)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = distribute_tensor(g.clone(), mesh, pl, src_data_rank=None)
            opt.step()
    finally:
        os.environ["FASTOPT_BACKEND"] = "torch"
    held = [layout_of(p).dim_index(0, "cpu").tolist() for p in params]  # the global rows of each local piece
    return ([whole(p.detach()) for p in params],
            [{k: whole(v).clone() for k, v in opt.state[p].items()} for p in params], held)


@pytest.mark.dist
@pytest.mark.parametrize("proj_type", ["std", "full"])
def test_strided_shard_rows_in_two_runs_match_single_process(pool, proj_type):
    """4 gloo ranks, _StridedShard(0, split_factor=2) alone: every rank's piece is two runs of rows, so its
    rectangle's rows are not a slice (Rect.spans is None) and its part of R, and its rows of P, go through the
    gathered and scattered indices (Rect.pick / Rect.place) instead of views. Params and states against
    galore-torch in one process, in float64, over 8 steps with refreshes at 1, 4 and 7."""
    from fastopt import ops
    backends = ["torch"] + (["triton"] if ops.triton_available() and ops.interpreting() else [])
    init, grads = make_problem(STRIDED, steps=DIST_STEPS, seed=4)
    ref, ref_opt, plist = galore_torch_run(init, grads, proj_type, len(STRIDED))
    for backend in backends:
        for r, (full, states, held) in enumerate(pool.run(_strided_galore, backend, init, grads, proj_type)):
            assert all(rows != list(range(rows[0], rows[0] + len(rows))) for rows in held), (r, held)  # two runs
            _assert_as_galore_torch(full, states, init, ref, ref_opt, plist, (backend, r))


# (global shape, mesh shape, placements): batches of matrices with two leading dims, the second one sharded (alone
# on 4 ranks, and with the first on a 2 x 2 mesh), so that the local matrices' global batch indices
# (`Layout.batch_index`) are neither a range nor the first dim's.
LEADS = [((3, 8, 7, 6), (4,), [("S", 1)]), ((4, 2, 6, 9), (2, 2), [("S", 0), ("S", 1)])]


def _leads_galore(rank, world, init, grads):
    """Child: the LEADS params as DTensors stepped by fastopt.GaLoreAdamW; returns the whole params and states."""
    from dist_utils import placement, whole
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    meshes = {(4,): init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
              (2, 2): init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}
    plc = [(meshes[m], [placement(s) for s in pls]) for _, m, pls in LEADS]
    params = [torch.nn.Parameter(distribute_tensor(x.clone(), m, pl, src_data_rank=None))
              for x, (m, pl) in zip(init, plc)]
    opt = fastopt.GaLoreAdamW([{"params": params, **GROUP}], lr=LR, weight_decay=WD)
    for step_grads in grads:
        for p, g, (m, pl) in zip(params, step_grads, plc):
            p.grad = distribute_tensor(g.clone(), m, pl, src_data_rank=None)
        opt.step()
    return [whole(p.detach()) for p in params], [{k: whole(v).clone() for k, v in opt.state[p].items()} for p in params]


@pytest.mark.dist
def test_two_sharded_leading_dims_match_single_process(pool):
    """4 gloo ranks, batches of matrices (B1, B2, R, C) with B2 sharded (and B1 too, on a 2 x 2 mesh): each local
    matrix takes the bases of its own global matrix. Params and states against fastopt's GaLoreAdamW on the whole
    tensors in one process, in float64, over 9 steps of fresh gradients with refreshes at 1, 4 and 7."""
    init, grads = make_problem([s for s, _, _ in LEADS], seed=8)
    ref = [x.clone() for x in init]
    ref_opt = fastopt.GaLoreAdamW([{"params": ref, **GROUP}], lr=LR, weight_decay=WD)
    step(ref_opt, ref, grads)
    for r, (full, states) in enumerate(pool.run(_leads_galore, init, grads)):
        for i, (a, b, x) in enumerate(zip(full, ref, init)):
            assert rel_update_error([a], [b], [x]) <= TOL[torch.float64], (r, i, rel_update_error([a], [b], [x]))
            for k, v in ref_opt.state[b].items():
                w = states[i][k]
                assert w.shape == v.shape, (r, i, k, w.shape, v.shape)
                assert torch.allclose(w, v, rtol=1e-9, atol=1e-12 * float(v.abs().max())), (r, i, k)


MIXED = [(9, 5), (5, 7), (7, 10), (6, 9)]  # DTensors (even index) and flat ranges declared by hand (odd), interleaved


def _mixed_bucket(rank, world, backend, init, grads):
    """Child: one bucket over the world group of two kinds, listed alternately: DTensors [Shard(0), Shard(1)] on a
    2 x 2 mesh (sharded moments: R reduce-scattered, N all-gathered) and flat ranges declared over the world (whole
    moments: R all-reduced), each flat range cut mid-row, the last one padded; returns the whole params and states."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fastopt.distributed import declare_shard, full_tensor, layout_of
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def piece(x, i):
        if i % 2 == 0:
            return distribute_tensor(x.clone(), mesh, [Shard(0), Shard(1)], src_data_rank=None)
        chunk = -(-x.numel() // world)  # ZeRO's equal ranges, zero padding at the tail
        flat = torch.cat([x.reshape(-1), x.new_zeros(chunk * world - x.numel())])
        return flat[rank * chunk:(rank + 1) * chunk].clone()

    os.environ["FASTOPT_BACKEND"] = backend
    try:
        params = [torch.nn.Parameter(piece(x, i)) if i % 2 == 0 else
                  declare_shard(torch.nn.Parameter(piece(x, i)), x.shape, dist.group.WORLD,
                                flat_offset=rank * piece(x, i).numel()) for i, x in enumerate(init)]
        opt = fastopt.GaLoreAdamW([{"params": params, **GROUP}], lr=LR, weight_decay=WD)
        for step_grads in grads:
            for i, (p, g) in enumerate(zip(params, step_grads)):
                p.grad = piece(g, i)
            opt.step()
    finally:
        os.environ["FASTOPT_BACKEND"] = "torch"
    full = [p.detach().full_tensor() if i % 2 == 0 else full_tensor(p.detach(), layout_of(p)).view(x.shape)
            for i, (p, x) in enumerate(zip(params, init))]
    return full, [{k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in opt.state[p].items()}
                  for p in params]


@pytest.mark.dist
def test_dtensors_and_flat_ranges_in_one_bucket_match_single_process(pool):
    """4 gloo ranks, one bucket whose projected params have sharded moments (DTensors) and whole ones (declared
    flat ranges), the DTensors listed first: the flat ranges' R, a prefix of the bucket's buffer, is all-reduced and
    the DTensors' reduce-scattered (BucketPlan orders them so); params and states against galore-torch in one
    process, in float64, over 8 steps with refreshes at 1, 4 and 7."""
    from fastopt import ops
    backends = ["torch"] + (["triton"] if ops.triton_available() and ops.interpreting() else [])
    init, grads = make_problem(MIXED, steps=DIST_STEPS, seed=6)
    ref, ref_opt, plist = galore_torch_run(init, grads, "std", len(MIXED))
    for backend in backends:
        for r, (full, states) in enumerate(pool.run(_mixed_bucket, backend, init, grads)):
            _assert_as_galore_torch(full, states, init, ref, ref_opt, plist, (backend, r))


@pytest.mark.parametrize("shape,side", [((48, 20), "right"), ((20, 48), "left"), ((3, 20, 48), "left"),
                                        ((20, 48), "full")])
def test_new_bases_hold_only_their_rank_columns(shape, side):
    """A refresh's new bases are copies of the `rank` columns of U (rows of Vh), not views of the whole SVD
    factor: the bucket's bases all wait for their commit together, so a view would keep every refreshed param's
    whole U (or Vh) alive at once, min(m, n) columns each (fp32 bases of fp32 params: the cast copies nothing)."""
    from fastopt.reference.galore import orthogonal_bases
    torch.manual_seed(0)
    g = torch.randn(shape)
    for key, basis in orthogonal_bases(g, 4, side, torch.float32).items():
        assert basis.is_contiguous() and basis.untyped_storage().nbytes() == basis.numel() * 4, (key, basis.shape)
        assert basis.shape[-1 if key == "proj_left" else -2] == 4
