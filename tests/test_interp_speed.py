"""tests/interp_speed.py (installed by conftest under TRITON_INTERPRET=1): kernels whose nested @triton.jit calls
skip Triton's re-patch, with the interpreter's type functions memoized, give the same bits as under Triton's own
interpreter; the re-patch is skipped, and the patch is kept for later launches."""
from __future__ import annotations

import contextlib

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import interp_speed  # noqa: E402
from fastopt import ops  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.interpreting(), reason="only under TRITON_INTERPRET=1")


@triton.jit
def _inner(x, k):
    return tl.where(x > 0, x * k, -x) + 1.5


@triton.jit
def _outer(x, k):
    y = _inner(x, k)
    return _inner(y, k + 1.0) - tl.sqrt(tl.abs(y) + 1.0)


@triton.jit
def _pick_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _kernel(x_ptr, out_ptr, red_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(3):
        acc += _outer(x, i * 0.5)
    tl.store(out_ptr + offs, acc, mask=mask)
    # triton.language's own jit helpers (tl.sum, tl.max: globals of another module) and a jit combine function
    tl.store(red_ptr + 3 * pid, tl.sum(tl.where(mask, acc, 0.0), axis=0))
    tl.store(red_ptr + 3 * pid + 1, tl.max(tl.where(mask, acc, -1e30), axis=0))
    tl.store(red_ptr + 3 * pid + 2, tl.reduce(tl.where(mask, x, -1e30), 0, _pick_max))


@triton.jit
def _shapes_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, W: tl.constexpr):
    """Blocks of several shapes and element types: [BLOCK] fp32, [W] int32 and fp16, [BLOCK, W] by broadcasting,
    reduced along either axis."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
    w = tl.arange(0, W)
    t = x[:, None] * (w[None, :] + 1).to(tl.float16) + tl.where(w[None, :] % 2 == 0, x[:, None], -x[:, None])
    rows = tl.sum(t, axis=1)
    cols = tl.max(t, axis=0)
    tl.store(out_ptr + offs, rows + tl.sum(cols, axis=0), mask=offs < n)
    tl.store(out_ptr + BLOCK + w, cols.to(tl.float16).to(tl.float32) * (w < W - 1))


def _run(x):
    out, red = torch.empty_like(x), torch.empty(3 * triton.cdiv(x.numel(), 32), dtype=torch.float32)
    _kernel[(triton.cdiv(x.numel(), 32),)](x, out, red, x.numel(), BLOCK=32)
    return out, red


@contextlib.contextmanager
def _counting_patches(counts):
    from triton.runtime import interpreter as it
    orig = it._patch_lang

    def counted(fn):
        counts.append(fn.__name__)
        return orig(fn)

    it._patch_lang = counted
    try:
        yield
    finally:
        it._patch_lang = orig


def test_nested_calls_give_the_same_bits_and_skip_the_repatch():
    from triton.runtime import interpreter as it
    assert interp_speed.installed(), "tests/interp_speed.py did not install on this Triton"
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    ours, theirs = [], []
    def memoized():
        sem = it.interpreter_semantic
        return (it._get_np_dtype, it.InterpreterBuilder.get_block_ty, tl.block_type.with_element_ty,
                tl.tensor.__init__, it._patch_lang, sem.broadcast_impl_value, sem.computation_type_impl, sem.cast)

    ours_fns = memoized()
    with _counting_patches(ours):
        fast = _run(x)
    with interp_speed.triton_as_it_is(), _counting_patches(theirs):
        assert all(a is not b for a, b in zip(ours_fns, memoized()))
        slow = _run(x)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    shaped = [torch.zeros(48), torch.zeros(48)]
    _shapes_kernel[(1,)](x, shaped[0], 30, BLOCK=32, W=16)
    with interp_speed.triton_as_it_is():
        _shapes_kernel[(1,)](x, shaped[1], 30, BLOCK=32, W=16)
    assert torch.equal(shaped[0], shaped[1]) and shaped[0].abs().sum() > 0
    # 4 programs, each 3 x (_outer + 2 _inner) user calls and triton.language's helpers: Triton patches at each;
    # here the launch patches once and the first call of triton.language's own helpers once more.
    assert len(theirs) > 4 * 9 and len(ours) <= 2, (len(ours), len(theirs))
    # ... and keeps it: a later launch patches nothing again (Triton's own re-patches every module each launch).
    sweeps = []
    orig_sweep = it._patch_builtin
    it._patch_builtin = lambda *a, **k: sweeps.append(1) or orig_sweep(*a, **k)
    try:
        again = _run(x)
        assert not sweeps, len(sweeps)
        with interp_speed.triton_as_it_is():
            _run(x)
        assert sweeps
    finally:
        it._patch_builtin = orig_sweep
    assert all(torch.equal(a, b) for a, b in zip(again, fast))
    ref = x.clone()
    acc = torch.zeros_like(x)
    for i in range(3):
        y = torch.where(ref > 0, ref * (i * 0.5), -ref) + 1.5
        acc += torch.where(y > 0, y * (i * 0.5 + 1.0), -y) + 1.5 - torch.sqrt(y.abs() + 1.0)
    assert torch.allclose(fast[0], acc, rtol=1e-6, atol=1e-6)


@triton.jit
def _bad(x):
    return x + _missing_name  # noqa: F821


@triton.jit
def _kernel_bad(x_ptr):
    tl.store(x_ptr, _bad(tl.load(x_ptr)))


def test_errors_in_nested_calls_still_raise_the_interpreter_error():
    from triton.runtime.errors import InterpreterError
    with pytest.raises(InterpreterError, match="_missing_name"):
        _kernel_bad[(1,)](torch.zeros(1))
