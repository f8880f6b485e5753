"""Fixtures and the one tolerance table of the test suite.

- `backend`: "torch" (the reference) and "triton" (the real kernels: compiled on CUDA, through Triton's
  interpreter on CPU when TRITON_INTERPRET=1 was set before Python started, as `./run.sh test` does).
- `device`: "cpu", plus "cuda" when a GPU is present.
- `pool`: 4 gloo processes (tests/dist_utils.py's DistPool) shared by every test of a pytest process that asks
  for them (each pytest-xdist worker starts its own).
- markers: `gpu` (skipped without CUDA), `dist` (spawns gloo processes).
"""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest
import torch

from fastopt import ops

import interp_speed

interp_speed.install()  # nested @triton.jit calls skip Triton's redundant re-patch (tests/interp_speed.py)

# Relative error allowed against a float64 reference, measured against the size of the total update
# (||p_ref - p_init||), never against |p|. fp64: the math alone. fp32/bf16/fp16: see `assert_tracks`.
TOL = {
    torch.float64: 1e-9,
    torch.float32: 2e-5,
    torch.bfloat16: 0.6,  # round-to-nearest bf16 itself loses ~half of 10 small updates (transformers: 0.49)
    torch.float16: 0.08,
}

ALL_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

# Rows of a matrix just taller than one block of kernels/factored.py's factor kernel (256 rows interpreted, 1024
# compiled), so that its row factors are formed and normalized over two blocks, the last one partial.
TALL_ROWS = 260 if ops.interpreting() else 1030


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "dist: spawns several gloo processes")
    clash = ops._interpreter_clash_here() if ops.triton_available() else None
    if clash:  # one line here, where every interpreted test would fail with it
        raise pytest.UsageError(clash)


COMPILE_TEST = "test_compile.py::test_every_kernel_compiles_for_sm90_without_spills_and_streams_in_vectors"


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    # The sm_90 compile check (minutes with a cold Triton cache, one core) runs last; its process starts when
    # the tests do (`pytest_runtestloop`), beside the rest of the suite (tests/test_compile.py). Under
    # pytest-xdist it runs first, on the first worker, beside the other: run last, it came in the last tests a
    # worker steals (from the end of the other's queue), and its minutes were the run's tail, on one core.
    compile_test = [it for it in items if it.nodeid.endswith(COMPILE_TEST)]
    if compile_test:
        rest = [it for it in items if it not in compile_test]
        items[:] = compile_test + rest if os.environ.get("PYTEST_XDIST_WORKER") else rest + compile_test


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    # After every filter and reordering (-k, -m, --lf, --ff ...): only if the compile test is still to run,
    # with other tests to overlap, in one process (not a pytest-xdist worker, each of which would compile).
    config = session.config
    if config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER") or not ops.triton_available():
        return
    items = session.items
    if len(items) > 1 and items[-1].nodeid.endswith(COMPILE_TEST):
        import test_compile
        if test_compile.runs_here():
            config._fastopt_compile = test_compile.Compile()


def pytest_unconfigure(config):
    early = getattr(config, "_fastopt_compile", None)
    if early is not None:
        early.close()


DIST_WORLD = 4


@pytest.fixture(scope="session")
def pool():
    """One DistPool of DIST_WORLD gloo ranks for the whole run of this pytest process (each pytest-xdist worker
    starts its own at its first test on the pool): starting 4 processes that import torch and fastopt costs
    seconds each time (about 5 s on the 2-core CI machine), and the pool restarts itself after a failure.
    Functions run on it set FASTOPT_BACKEND themselves where they need another than "torch", and put back what
    they change."""
    from dist_utils import DistPool
    with DistPool(DIST_WORLD, timeout=120.0, env={"FASTOPT_BACKEND": "torch"}) as p:
        yield p


def _triton_runs_here() -> bool:
    return ops.triton_available() and (torch.cuda.is_available() or ops.interpreting())


def triton_device() -> torch.device:
    """Where a test runs Triton kernels: the CPU under TRITON_INTERPRET=1, else CUDA; skips without Triton or
    without either."""
    if not _triton_runs_here():
        pytest.skip("Triton kernels need Triton, and CUDA or TRITON_INTERPRET=1")
    return torch.device("cpu") if ops.interpreting() else torch.device("cuda")


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton" and not _triton_runs_here():
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv("FASTOPT_BACKEND", request.param)
    if request.param == "triton":
        from fastopt.kernels import common
        monkeypatch.setattr(common, "POISON", True)
    return request.param


@contextlib.contextmanager
def on_torch_backend(monkeypatch):
    """FASTOPT_BACKEND=torch for the block, the test's back end after it: an oracle that a comparison with a
    tolerance holds the back end under test to (the plain-torch reference, which the references test in float64)."""
    with monkeypatch.context() as m:
        m.setenv("FASTOPT_BACKEND", "torch")
        yield


@pytest.fixture(params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def device(request, backend):
    if request.param == "cpu" and backend == "triton" and not ops.interpreting():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    if request.param == "cuda" and ops.interpreting():
        pytest.skip("CUDA runs compiled kernels, not the interpreter")
    # cuda:N, as tensors report it (torch.device("cuda") != torch.device("cuda:0"))
    return torch.device("cuda", torch.cuda.current_device()) if request.param == "cuda" else torch.device("cpu")


@pytest.fixture(scope="module")
def built():
    """The C++/CUDA extension: the first test needing it builds (or finds) it; later ones reuse it."""
    from fastopt import ext
    ext.load()
    return ext


@pytest.fixture(params=["torch", "ext"])
def impl(request, monkeypatch):
    """The 8-bit ops through torch (FASTOPT_BACKEND=torch) or the extension (built first)."""
    if request.param == "ext":
        request.getfixturevalue("built")
        monkeypatch.setenv("FASTOPT_BACKEND", "auto")
    else:
        monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    return request.param


def rel_update_error(ours, ref, init) -> float:
    """||ours - ref|| / ||ref - init||, norms over all elements of a list of tensors (in float64)."""
    def f64(t):  # on the CPU: `init` may be there while the runs were on CUDA
        return t.detach().double().cpu()
    num = sum((f64(a) - f64(b)).square().sum().item() for a, b in zip(ours, ref)) ** 0.5
    den = sum((f64(b) - f64(c)).square().sum().item() for b, c in zip(ref, init)) ** 0.5
    assert den > 0, "the reference did not move: the comparison would prove nothing"
    return num / den


def assert_tracks(ours, truth, init, dtype, ref_lowp=None, what="params"):
    """`ours` (run in `dtype`) matches the float64 `truth` within TOL[dtype] of the update's size; where the
    reference itself was run in `dtype` too (`ref_lowp`), ours may not drift more than 2x as far as it does."""
    err = rel_update_error(ours, truth, init)
    assert err <= TOL[dtype], f"{what}: relative update error {err:.3g} > {TOL[dtype]:.3g} ({dtype})"
    if ref_lowp is not None and dtype != torch.float64:
        ref_err = rel_update_error(ref_lowp, truth, init)
        assert err <= 2 * ref_err + 1e-6, f"{what}: error {err:.3g} vs the reference's own {ref_err:.3g} at {dtype}"


def step_with_inf_at(opt, params, grads, inf_step, device, poison=(0, 0, 0)) -> None:
    """Run `grads` (one list per step) through `opt` under `torch.amp.GradScaler`, with an inf written into
    `params[poison[0]].grad` at index `poison[1:]` on step `inf_step`, and check that this step changed
    nothing: params, state keys (a param without state may get its first) and state values, bit for bit. After
    every step, p.grad as torch's fused optimizers leave it (`check_unscaled_grads`)."""
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12)
    for t, step_grads in enumerate(grads):
        loss = sum((p * gr.to(device=device, dtype=torch.float32)).sum() for p, gr in zip(params, step_grads))
        scaler.scale(loss).backward()
        if t == inf_step:
            params[poison[0]].grad[poison[1:]] = float("inf")
            before = ([p.detach().clone() for p in params],
                      [{k: v.clone() for k, v in opt.state[p].items()} for p in params])
        scaled, scale = [p.grad.clone() for p in params], scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        check_unscaled_grads([p.grad for p in params], scaled, scale, t == inf_step)
        if t == inf_step:
            for p, p0, s0 in zip(params, *before):
                assert torch.equal(p, p0)
                assert set(opt.state[p]) == set(s0) or not s0
                for k, v in s0.items():
                    assert torch.equal(opt.state[p][k], v), k
        opt.zero_grad(set_to_none=True)


def check_unscaled_grads(grads, scaled, scale: float, skipped: bool, what: str = "") -> None:
    """The gradients after `scaler.step` on GradScaler's fused path, as torch's fused optimizers leave them: the
    `scaled` ones (before the step) times 1/scale in their own dtype, bit for bit (the scale is a power of 2), on a
    step taken; as they were on one skipped."""
    for k, (g, s) in enumerate(zip(grads, scaled)):
        want = s if skipped else s * (1.0 / scale)
        assert torch.equal(g, want), (f"{what}grad {k} after a {'skipped' if skipped else 'taken'} step: "
                                      f"{(g.double() - want.double()).abs().max().item():.3g} off (scale {scale})")


def through_8bit(m, v, block_size: int) -> tuple:
    """m_t and v_t as 8-bit state keeps them (fastopt.reference.quant's block-wise format, signed map for m,
    unsigned for v): (m, v) dequantized in float64, and (m codes, v codes)."""
    from fastopt.reference.quant import dequantize_blockwise, quantize_blockwise
    qm, am = quantize_blockwise(m, block_size, signed=True)
    qv, av = quantize_blockwise(v, block_size, signed=False)
    return (dequantize_blockwise(qm, am, block_size, signed=True, dtype=torch.float64),
            dequantize_blockwise(qv, av, block_size, signed=False, dtype=torch.float64), (qm, qv))


def near_decision_points(signed: bool, block: int = 256) -> torch.Tensor:
    """Blocks of `block` fp32 values, each opened by its absmax (1, 3 or 0.7), the rest on and one or two ulps
    beside the midpoints between adjacent values of the signed or unsigned 8-bit map times that absmax: where
    the nearest code changes and the last bit of x / absmax decides (random data almost never lands there)."""
    from fastopt.reference.quant import dynamic_map
    keys = dynamic_map(signed).double()
    rows = []
    for amax in (1.0, 3.0, 0.7):
        mids = ((keys[:-1] + keys[1:]) / 2 * amax).float()
        vals, up, down = [mids], mids, mids
        for _ in range(2):
            up = torch.nextafter(up, torch.tensor(float("inf")))
            down = torch.nextafter(down, torch.tensor(float("-inf")))
            vals += [up, down]
        x = torch.cat(vals)
        x = x[x.abs() <= amax]  # (the unsigned map's midpoints are positive, and so are their neighbours)
        for lo in range(0, x.numel(), block - 1):
            row = torch.zeros(block, dtype=torch.float32)
            row[0] = amax
            row[1:1 + x[lo:lo + block - 1].numel()] = x[lo:lo + block - 1]
            rows.append(row)
    return torch.cat(rows)


def adam_8bit_reference(init, grads, betas, block_size: int, min_8bit_size: int, lrs, update) -> tuple:
    """Adam's moments in float64, one param at a time, those of params of at least `min_8bit_size` elements kept
    between steps in the 8-bit block-wise format (`through_8bit`: quantized from the exact m_t, v_t the update
    used, as bitsandbytes does); `update(p, m, v, t, lr)` is the param after step t (from 1) at that step's lr,
    `lrs[t - 1]`. Returns (params, [(m codes, v codes) or None])."""
    beta1, beta2 = betas
    ps = [x.clone() for x in init]
    ms = [torch.zeros_like(x) for x in ps]
    vs = [torch.zeros_like(x) for x in ps]
    codes = [None] * len(ps)
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            m = beta1 * ms[i] + (1 - beta1) * g
            v = beta2 * vs[i] + (1 - beta2) * g * g
            ps[i] = update(ps[i], m, v, t, lrs[t - 1])
            if ps[i].numel() >= min_8bit_size:
                m, v, codes[i] = through_8bit(m, v, block_size)
            ms[i], vs[i] = m, v
    return ps, codes


def assert_matches_8bit_reference(opt, params, ref, codes, init, block_size: int, keys) -> None:
    """fp64 params against `adam_8bit_reference`'s (params, codes): within TOL[float64] of the update's size,
    param by param; the 8-bit states to the last code, with one absmax per block of `block_size`; the others in
    fp64. `keys`: ((m key, its absmax key), (v key, its absmax key)) of the optimizer's state."""
    (mk, ma), (vk, va) = keys
    for i, (p, r, x, c) in enumerate(zip(params, ref, init, codes)):
        st = {k: v.cpu() for k, v in opt.state[p].items()}
        assert rel_update_error([p.detach().cpu()], [r], [x]) <= TOL[torch.float64], f"param {i}"
        if c is None:
            assert set(st) == {"step", mk, vk} and st[mk].dtype == torch.float64, f"param {i}"
        else:
            assert st[ma].shape == st[va].shape == (-(-p.numel() // block_size),), f"param {i}"
            assert torch.equal(st[mk], c[0]) and torch.equal(st[vk], c[1]), f"param {i}"


def feed(opt, params, grads) -> None:
    """One step of `opt` per entry of `grads`, each param's gradient that entry's, in the param's device and dtype."""
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.to(device=p.device, dtype=p.dtype)
        opt.step()


def run_changed_midway(cls, init, grads, device, kw: dict, key: str, value, at: int = 3) -> list:
    """`cls(params, **kw)` on float64 copies of `init` on `device`, stepped with `grads`, its group's `key` set to
    `value` before step `at` (0-based), as a user or a scheduler sets it: the params after the last step (CPU)."""
    params = [p.detach().clone().to(device=device, dtype=torch.float64).requires_grad_() for p in init]
    opt = cls(params, **kw)
    feed(opt, params, grads[:at])
    opt.param_groups[0][key] = value
    feed(opt, params, grads[at:])
    return [p.detach().cpu() for p in params]


def check_skips_params_without_grad(make_opt, device, shapes=((3, 4), (5,))) -> None:
    """`make_opt(a, b, e)` over fp64 params of `shapes` and an empty one: a step with a gradient for `a` and
    the empty `e` only moves `a` and counts its step; `b` (no gradient) and `e` get no state."""
    a = torch.randn(shapes[0], dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(shapes[1], dtype=torch.float64, device=device, requires_grad=True)
    e = torch.empty(0, 3, dtype=torch.float64, device=device, requires_grad=True)
    opt = make_opt(a, b, e)
    a.grad = torch.randn_like(a)
    e.grad = torch.empty_like(e)
    a0, b0 = a.detach().clone(), b.detach().clone()
    opt.step()
    assert torch.equal(b, b0) and not opt.state[b] and not opt.state[e]
    assert float(opt.state[a]["step"]) == 1 and not torch.equal(a, a0)


def check_refuses_sparse_and_complex(make_opt, device) -> None:
    """`make_opt(a, other)`: a sparse gradient of `other`, or a complex `other`, is refused on the first step,
    naming the reason, before `a` or any state changes."""
    a = torch.randn(4, 3, device=device, requires_grad=True)
    emb = torch.randn(6, 3, device=device, requires_grad=True)
    opt = make_opt(a, emb)
    a.grad = torch.randn_like(a)
    emb.grad = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 3), (6, 3)).to(device)
    a0 = a.detach().clone()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert torch.equal(a, a0) and not opt.state[a]
    z = torch.randn(3, 3, dtype=torch.complex64, device=device, requires_grad=True)
    opt = make_opt(a, z)
    a.grad = torch.randn_like(a)
    z.grad = torch.randn_like(z)
    with pytest.raises(RuntimeError, match="complex parameters"):
        opt.step()
    assert torch.equal(a, a0) and not opt.state[a]
    # A real param whose grad is complex (set through `.data`, which torch's dtype check does not see): its
    # imaginary part would be dropped by the cast to the param's dtype.
    r = torch.randn(3, 3, device=device, requires_grad=True)
    opt = make_opt(a, r)
    a.grad, r.grad = torch.randn_like(a), torch.randn_like(r)
    r.grad.data = torch.randn(3, 3, dtype=torch.complex64, device=device)
    with pytest.raises(RuntimeError, match="complex parameters"):
        opt.step()
    assert torch.equal(a, a0) and not opt.state[a]
    # An integer param (torch.optim takes it as a leaf; its grad set by hand): no float step can update it.
    i = torch.zeros(3, 3, dtype=torch.int64, device=device)
    opt = make_opt(a, i)
    a.grad, i.grad = torch.randn_like(a), torch.ones_like(i)
    with pytest.raises(RuntimeError, match=r"parameter of dtype torch.int64 is not floating point"):
        opt.step()
    assert torch.equal(a, a0) and not opt.state[a]


def group_key(name: str, gi: int) -> str:
    """How a group's key is named in the error: betas[0] -> param_groups[gi]['betas'][0]."""
    key, bracket, rest = name.partition("[")
    return f"param_groups[{gi}]['{key}']" + bracket + rest


def snapshot(opt) -> dict:
    """Each param in `opt`'s groups -> (a copy of it, copies of its state), for `assert_unchanged`."""
    return {p: (p.detach().clone(), {k: v.clone() for k, v in opt.state.get(p, {}).items()})
            for g in opt.param_groups for p in g["params"]}


def assert_unchanged(opt, before: dict) -> None:
    """The params of `before` (a `snapshot(opt)`) bit for bit, and their state: the same keys, dtypes, values."""
    for p, (p0, s0) in before.items():
        st = opt.state.get(p, {})
        assert torch.equal(p, p0) and st.keys() == s0.keys(), (sorted(st), sorted(s0))
        for k, v in s0.items():
            assert st[k].dtype == v.dtype and torch.equal(st[k], v), k


def check_lr_scheduler_drives_group_lr(ours_cls, ref_cls, kw: dict, init, grads, device) -> None:
    """A LambdaLR schedule (lr / (1 + t)) set through the group drives `ours_cls` (on `device`) as it drives the
    reference `ref_cls` (on the CPU), both in float64 from `init`, over every step of `grads`."""
    results = []
    for cls, dev in ((ours_cls, device), (ref_cls, "cpu")):
        params = [p.detach().clone().to(device=dev, dtype=torch.float64).requires_grad_() for p in init]
        opt = cls(params, **kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.to(dev)
            opt.step()
            sched.step()
        results.append([p.detach().cpu() for p in params])
    assert_tracks(results[0], results[1], init, torch.float64)


def compiled_step_ops(opt, ref, params, twin, grads_at, steps: int = 4) -> set:
    """`steps` training steps, each a function that sets the grads (grads_at(t), doubled) and calls step(): on
    (opt, params) through torch.compile, on (ref, twin) eagerly. Returns what dynamo captured (the targets of the
    graphs' function calls), which the caller compares with the function's own ops."""
    torch._dynamo.reset()
    traced = []

    def capture(gm, example_inputs):
        traced.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def train(o, ps, grads):
        for p, g in zip(ps, grads):
            p.grad = g * 2.0
        o.step()

    compiled = torch.compile(train, backend=capture)
    for t in range(steps):
        grads = grads_at(t)
        compiled(opt, params, grads)
        train(ref, twin, [g.clone() for g in grads])
    assert traced, "dynamo captured nothing"
    return set(traced)


def save_load(state_dict):
    """`state_dict` through torch.save and torch.load(weights_only=True), as a checkpoint on disk makes it."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def check_foreign_group_count_refused(ref_cls, ours_cls, **kw) -> None:
    """Another library's state_dict of two groups (the second without state: its param had no grad), saved and
    loaded with weights_only, into an optimizer of one group: refused, naming the counts, before anything
    changes (not cut to the first group)."""
    a, b = torch.randn(4, 5, requires_grad=True), torch.randn(6, requires_grad=True)
    theirs = ref_cls([{"params": [a]}, {"params": [b]}], **kw)
    a.grad = torch.randn_like(a)
    theirs.step()
    mine = a.detach().clone().requires_grad_()
    ours = ours_cls([mine], **kw)
    mine.grad = torch.randn_like(mine)
    ours.step()
    before = snapshot(ours)
    with pytest.raises(ValueError, match="state_dict has 2 param groups, this optimizer has 1"):
        ours.load_state_dict(save_load(theirs.state_dict()))
    assert_unchanged(ours, before)


def check_bad_group_refused(cls, defaults: dict, bad: dict, key: str, how: str) -> None:
    """Group 1's `bad` setting, given to the constructor `cls(groups, **defaults)`, to add_param_group, or set
    between steps (`how`: "constructor", "add_param_group", "mutated"), raises a ValueError naming
    `param_groups[1]['key']` before anything changes: no group added (the dict given left as it was), no param or
    state of group 0 or 1 moved (group 0 is not stepped either)."""
    match = re.escape(f"{cls.__name__}: {group_key(key, 1)}=")
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)
    if how == "constructor":
        with pytest.raises(ValueError, match=match):
            cls([{"params": [a]}, {"params": [b], **bad}], **defaults)
        return
    opt = cls([{"params": [a]}] + ([{"params": [b]}] if how == "mutated" else []), **defaults)
    for _ in range(2):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        opt.step()
    before = snapshot(opt)
    group = {"params": [b], **bad}
    given = dict(group)
    with pytest.raises(ValueError, match=match):
        if how == "add_param_group":
            opt.add_param_group(group)  # the caller's dict is left as it was (it becomes the group if added)
        else:
            opt.param_groups[1].update(bad)
            opt.step()
    assert len(opt.param_groups) == (1 if how == "add_param_group" else 2)
    assert group.keys() == given.keys() and all(group[k] is given[k] for k in given)  # the same objects
    assert how == "mutated" or b not in opt.state
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in before]
    assert_unchanged(opt, before)


def check_bad_key_refused_after_a_step(opt, kw: dict, name: str, new_param) -> None:
    """`opt`, one group of params, takes one step; then `kw` is refused with a ValueError naming `name` as group
    1's key in add_param_group (a group of `new_param`), and as group 0's key when set on it between steps (as a
    user or a scheduler might). After each refusal `opt` is as it was: no group added, group 0's settings, the
    params and their state (keys, dtypes, values) unchanged."""
    prefix = type(opt).__name__
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.step()
    before = snapshot(opt)
    group = dict(opt.param_groups[0])

    def unchanged():
        assert len(opt.param_groups) == 1 and opt.param_groups[0] == group
        assert {id(p) for p in opt.state} == {id(p) for p in before}
        assert_unchanged(opt, before)

    with pytest.raises(ValueError, match=re.escape(f"{prefix}: {group_key(name, 1)}=")):
        opt.add_param_group({"params": [new_param], **kw})
    unchanged()
    opt.param_groups[0].update(kw)
    with pytest.raises(ValueError, match=re.escape(f"{prefix}: {group_key(name, 0)}=")):
        opt.step()
    opt.param_groups[0].update({k: group[k] for k in kw})
    unchanged()


def check_no_host_sync(opt, params, steps: int, first_checked: int = 0, scaler: bool | type = True) -> None:
    """`steps` steps of `opt` over CUDA `params` (loss: sum of p^2), through a GradScaler (`scaler`: True, or the
    GradScaler class to use) or plain;
    from step `first_checked` on, step() must not synchronize with the host
    (`torch.cuda.set_sync_debug_mode("error")` raises if it does). The loss is summed in fp32 and the scaler
    starts at 2^10: no step overflows (GradScaler's default 2^16 made fp16's first step inf, and GaLore, whose
    skipped first step moves its SVD to the next, checked)."""
    cls = scaler if isinstance(scaler, type) else torch.amp.GradScaler
    amp = cls("cuda", init_scale=2.0 ** 10) if scaler else None
    for t in range(steps):
        loss = sum((p.float() * p.float()).sum() for p in params)
        (amp.scale(loss) if amp else loss).backward()
        torch.cuda.synchronize()
        if t >= first_checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            amp.step(opt) if amp else opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if amp:
            amp.update()
        opt.zero_grad(set_to_none=True)


class Counting:
    """Stands in for a Triton kernel (`fn[grid](...)`) or a launching function (`fn(...)`) and appends `name`
    to `log` at each launch: monkeypatch it over the module attribute the host code calls."""

    def __init__(self, name: str, fn, log: list):
        self.name, self.fn, self.log = name, fn, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.fn[grid]

    def __call__(self, *args, **kwargs):
        self.log.append(self.name)
        return self.fn(*args, **kwargs)


def _launch_probe():
    """A def, not a lambda: compiled Triton (3.6) reads the source of what it wraps and finds no def in a lambda."""


def launches_per_step(monkeypatch, make_opt, shapes=((3, 4), (5,), (2, 2, 3)), repeats=(1, 4)) -> list[int]:
    """Triton launches of one (second) step of `make_opt(params)` over `shapes * r` params, for each r in
    `repeats`: equal counts mean launches do not grow with the number of params. Skips without Triton."""
    pytest.importorskip("triton")
    if not _triton_runs_here():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    import triton
    monkeypatch.setenv("FASTOPT_BACKEND", "triton")
    launches = []
    cls = type(triton.jit(_launch_probe))  # JITFunction, or InterpretedFunction under TRITON_INTERPRET=1
    orig = cls.__getitem__
    monkeypatch.setattr(cls, "__getitem__", lambda self, grid: launches.append(self) or orig(self, grid))
    dev = "cuda" if torch.cuda.is_available() and not ops.interpreting() else "cpu"
    counts = []
    for r in repeats:
        params = [torch.randn(s, device=dev, requires_grad=True) for s in list(shapes) * r]
        opt = make_opt(params)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        launches.clear()
        opt.step()
        counts.append(len(launches))
    return counts
