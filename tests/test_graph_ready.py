"""What a CUDA graph of `step()` needs from the host side, checked without a GPU (the capture itself runs in
bench/gpu_checks.py on the lent GPU): once warmed up, a step whose gradients have not moved copies nothing
from the host (every table a kernel reads stays where the capture saw it), and a step whose gradients did move
rebuilds the tables and stays exact."""
from __future__ import annotations

import pytest
import torch
from conftest import check_no_host_sync

import fastopt
from fastopt import ops

interpreted = pytest.mark.skipif(not (ops.triton_available() and ops.interpreting()),
                                 reason="the Triton path on CPU needs TRITON_INTERPRET=1")

OPTS = {
    "adafactor": lambda ps: fastopt.Adafactor(ps, lr=1e-2, relative_step=False, beta1=0.9),
    "came": lambda ps: fastopt.CAME(ps, lr=1e-2),
    "came8": lambda ps: fastopt.CAME(ps, lr=1e-2, nbits=8),
    "lamb": lambda ps: fastopt.Lamb(ps, lr=1e-2),
    "lamb8": lambda ps: fastopt.Lamb(ps, lr=1e-2, nbits=8, min_8bit_size=1),
    "galore": lambda ps: fastopt.GaLoreAdamW([{"params": ps[:1], "rank": 2, "update_proj_gap": 100},
                                              {"params": ps[1:]}], lr=1e-2),
    # the compiled extension's tables: two 8-bit params and one with fp64 state, one launch each kind
    "adamw8bit": lambda ps: fastopt.AdamW8bit(ps, lr=1e-2, min_8bit_size=8, block_size=64),
}
SHAPES = [(6, 5), (7,), (2, 3, 4)]


def _host_copies(monkeypatch) -> list:
    """Every host-to-device table copy of the kernels (kernels.common.to_device, wherever it was imported, and
    the extension's tables: ops.build_ext_table)."""
    import importlib
    calls = []
    orig_ext = ops.build_ext_table
    monkeypatch.setattr(ops, "build_ext_table", lambda op, *a: calls.append(op) or orig_ext(op, *a))
    for mod in ("common", "adafactor", "came", "lamb", "factored", "galore"):
        m = importlib.import_module(f"fastopt.kernels.{mod}")
        if hasattr(m, "to_device"):
            orig = m.to_device
            monkeypatch.setattr(m, "to_device", lambda *a, orig=orig, **k: calls.append(a[0]) or orig(*a, **k))
    return calls


def _run(make, backend, monkeypatch, copies=None):
    monkeypatch.setenv("FASTOPT_BACKEND", backend)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in SHAPES]
    opt = make(params)
    static = [torch.zeros_like(p) for p in params]
    keep = []
    for t in range(6):
        if t == 4:  # the gradients move (zero_grad(set_to_none=True) and a new backward)
            keep.append(static)  # the old tensors stay alive: the new ones get other addresses
            static = [torch.zeros_like(p) for p in params]
        for p, g in zip(params, static):
            g.copy_(torch.randn(g.shape, generator=gen, dtype=g.dtype))
            p.grad = g
        if copies is not None:
            copies.clear()
        opt.step()
        if copies is not None and t in (2, 3):
            assert copies == [], f"step {t} with unmoved gradients copied tables from the host: {copies}"
        if copies is not None and t == 4:
            assert copies, "the gradients moved but no pointer table was rebuilt"
    return [p.detach() for p in params]


@interpreted
@pytest.mark.parametrize("name", list(OPTS))
def test_unmoved_gradients_copy_nothing_and_moved_ones_stay_exact(name, monkeypatch):
    ref = _run(OPTS[name], "torch", monkeypatch)
    ours = _run(OPTS[name], "triton", monkeypatch, copies=_host_copies(monkeypatch))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OPTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_step_does_not_sync_with_the_host(name, dtype):
    """Steps on CUDA (aligned and odd sizes): after the first step (GaLore's SVD at t = 1 reads the host),
    step() makes no synchronizing call. fp32 and fp16 params step through a GradScaler (grad_scale / found_inf
    on the device); bf16 ones without (bf16 needs no loss scaling, and torch 2.11's GradScaler cannot check bf16
    gradients on CUDA: _amp_foreach_non_finite_check_and_unscale_cuda is not implemented for BFloat16)."""
    shapes = [(64, 48), (7, 5), (2, 3, 16), (96,), (5,), ()]
    params = [(torch.randn(s, device="cuda") * 0.1).to(dtype).requires_grad_() for s in shapes]
    check_no_host_sync(OPTS[name](params), params, steps=4, first_checked=1, scaler=dtype != torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adafactor", "adamw8bit"])
def test_zero_grad_scaler_step_does_not_sync_with_the_host(name):
    """The ZeRO wrapper on one rank (no process group) through fastopt.ZeroGradScaler: the scaler's inf check,
    the wrapper's step and the wrapped optimizer's step make no synchronizing call after the first step."""
    shapes = [(64, 48), (7, 5), (2, 3, 16), (96,), (5,), ()]
    params = [(torch.randn(s, device="cuda") * 0.1).requires_grad_() for s in shapes]
    opt = fastopt.ZeroRedundancyOptimizer(OPTS[name](params))
    check_no_host_sync(opt, params, steps=4, first_checked=1, scaler=fastopt.ZeroGradScaler)


@pytest.mark.parametrize("name, plan", [("adafactor", "AdafactorPlan"), ("lamb", "LambPlan"), ("came", "CAMEPlan")])
def test_two_buckets_of_one_group_keep_their_plans(name, plan, monkeypatch):
    """One param group holding a plain param and a declared shard (two buckets of the same device and dtype, as
    FSDP2+TP matrices and dp-only norms are): each bucket's plan is built once, not rebuilt every step because
    the other bucket evicted it (the Triton kernels, under the interpreter)."""
    if not (ops.triton_available() and (torch.cuda.is_available() or ops.interpreting())):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    import importlib
    from fastopt.distributed import declare_shard
    from fastopt.distributed.layout import Layout
    monkeypatch.setenv("FASTOPT_BACKEND", "triton")
    monkeypatch.setattr(Layout, "reduce", lambda self, buf: None)  # one "rank" holding the whole param
    cls = getattr(importlib.import_module(f"fastopt.kernels.{name}"), plan)
    built = []
    init = cls.__init__
    monkeypatch.setattr(cls, "__init__", lambda self, *a, **k: built.append(1) or init(self, *a, **k))
    make = {"adafactor": lambda ps: fastopt.Adafactor(ps, lr=1e-2, relative_step=False),
            "lamb": lambda ps: fastopt.Lamb(ps, lr=1e-2), "came": lambda ps: fastopt.CAME(ps, lr=1e-2)}[name]
    dev = "cuda" if torch.cuda.is_available() and not ops.interpreting() else "cpu"  # compiled kernels or interpreted
    for mixed in (False, True):
        a, b = torch.randn(6, 5, device=dev), torch.randn(6, 5, device=dev)
        if mixed:
            b = declare_shard(b, (6, 5), "group", flat_offset=0)
        opt = make([a, b])
        built.clear()
        for _ in range(4):
            a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
            opt.step()
        assert len(built) == (2 if mixed else 1), (mixed, len(built))
