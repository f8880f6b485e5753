"""Fixtures and the one tolerance table of the test suite.

- `backend`: "torch" (the reference) and "triton" (the real kernels: compiled on CUDA, through Triton's
  interpreter on CPU when TRITON_INTERPRET=1 was set before Python started, as `./run.sh test` does).
- `device`: "cpu", plus "cuda" when a GPU is present.
- markers: `gpu` (skipped without CUDA), `dist` (spawns gloo processes).
"""
from __future__ import annotations


import pytest
import torch

from fastopt import ops

# Relative error allowed against a float64 reference, measured against the size of the total update
# (||p_ref - p_init||), never against |p|. fp64: the math alone. fp32/bf16/fp16: see `assert_tracks`.
TOL = {
    torch.float64: 1e-9,
    torch.float32: 2e-5,
    torch.bfloat16: 0.6,  # round-to-nearest bf16 itself loses ~half of 10 small updates (transformers: 0.49)
    torch.float16: 0.08,
}

ALL_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "dist: spawns several gloo processes")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def _triton_runs_here() -> bool:
    return ops.triton_available() and (torch.cuda.is_available() or ops.interpreting())


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton" and not _triton_runs_here():
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv("FASTOPT_BACKEND", request.param)
    if request.param == "triton":
        from fastopt.kernels import common
        monkeypatch.setattr(common, "POISON", True)
    return request.param


@pytest.fixture(params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def device(request, backend):
    if request.param == "cpu" and backend == "triton" and not ops.interpreting():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    if request.param == "cuda" and ops.interpreting():
        pytest.skip("CUDA runs compiled kernels, not the interpreter")
    return torch.device(request.param)


def rel_update_error(ours, ref, init) -> float:
    """||ours - ref|| / ||ref - init||, norms over all elements of a list of tensors (in float64)."""
    num = sum((a.double() - b.double()).square().sum().item() for a, b in zip(ours, ref)) ** 0.5
    den = sum((b.double() - c.double()).square().sum().item() for b, c in zip(ref, init)) ** 0.5
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


def launches_per_step(monkeypatch, make_opt, shapes=((3, 4), (5,), (2, 2, 3)), repeats=(1, 4)) -> list[int]:
    """Triton launches of one (second) step of `make_opt(params)` over `shapes * r` params, for each r in
    `repeats`: equal counts mean launches do not grow with the number of params. Skips without Triton."""
    pytest.importorskip("triton")
    if not _triton_runs_here():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    import triton
    monkeypatch.setenv("FASTOPT_BACKEND", "triton")
    launches = []
    cls = type(triton.jit(lambda: None))
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
