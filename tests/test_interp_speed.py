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


@triton.jit
def _scalars_kernel(x_ptr, i_ptr, f_ptr, g_ptr, k, j, n, BLOCK: tl.constexpr, C: tl.constexpr):
    """Blocks of fp32, bf16, fp16, fp64, int32, int64, uint8 and bool with Python numbers and constexprs on either
    side (fp32-representable, fp64-only, integers past int32 and uint32), scalar kernel arguments (k: a float, j: an
    int), integer wrap-around, division and modulo, pointer arithmetic with blocks and Python ints."""
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    i = tl.load(i_ptr + offs, mask=m, other=1)
    xb, xh, xd = x.to(tl.bfloat16), x.to(tl.float16), x.to(tl.float64)
    il, iu, ib = i.to(tl.int64), i.to(tl.uint8), i > 0
    fs = (x * 0.5 + 1e-30, 2.0 - x, 1.0 / (x + 3.0), x * k, k - x, x / k, xb * 0.1 - 3, 1.5 * xb + k,
          xh * 1.5 + 1, 2 - xh, xd * 0.1 + 1e-320, 1e300 * xd, xd - k, x + True, x * C, C / (xd + 5.0),
          tl.maximum(x, 0.0), tl.minimum(xb, -0.0), x % 2.0, x + i, xb * i, xh + iu, xd * il, x - 3)
    gs = (i * 3 + 7, i * 1000003, 7 - i, i // 3, i % 5, -9 // (i + 100), il * 2**40, il + 2**31, i + -2**31,
          il + 2**40, iu + 200, iu * 3, 250 - iu, ib + 1, ib & True, i * j, j - il, iu + j, i * C, C - i,
          tl.minimum(i, 3), i << 2, i >> 1, i.to(tl.uint32) + 4294967295)
    for r in tl.static_range(len(fs)):
        tl.store(f_ptr + r * BLOCK + offs, fs[r].to(tl.float64))
    for r in tl.static_range(len(gs)):
        tl.store((g_ptr + 1) + r * BLOCK + offs - 1, gs[r].to(tl.int64))
    tl.store(g_ptr + len(gs) * BLOCK + 0 * j, j + 1)


@triton.jit
def _refused_kernel(i_ptr, CASE: tl.constexpr):
    i = tl.load(i_ptr + tl.arange(0, 4))
    if CASE == 0:
        i = i + 2**31  # an int32 block: 2**31 is uint32, no wider kind, so int32, out of its range
    elif CASE == 1:
        i = i.to(tl.uint8) + -1
    else:
        i = 1.5 + i.to(tl.pointer_type(tl.int32))  # a float offset
    tl.store(i_ptr + tl.arange(0, 4), i.to(tl.int32))


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
    # Triton 3.6-3.8's binary operations have another shape: all but their fast paths install there
    assert interp_speed.ops_installed() or tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9)
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    ours, theirs = [], []
    def memoized():
        sem = it.interpreter_semantic
        return (it._get_np_dtype, it.InterpreterBuilder.get_block_ty, tl.block_type.with_element_ty,
                tl.tensor.__init__, it._patch_lang, sem.broadcast_impl_value, sem.computation_type_impl, sem.cast,
                sem.binary_op_type_checking_impl, sem.binary_op_sanitize_overflow_impl, it._patch_attr,
                tl.core._unwrap_if_constexpr, it._convert_float)

    ours_fns = memoized()
    with _counting_patches(ours):
        fast = _run(x)
    with interp_speed.triton_as_it_is(), _counting_patches(theirs):
        differ = [a is not b for a, b in zip(ours_fns, memoized())]
        ops_differ = differ[8:12]  # the binary operations' four, Triton's own either way where not installed
        assert all(differ[:8] + differ[12:]) and ops_differ == [interp_speed.ops_installed()] * 4, differ
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


def test_binary_operations_with_python_numbers_give_the_same_bits():
    """The fast paths of binary operations (a block and a Python number or a scalar, blocks of one shape and a
    pointer, the skipped overflow check) and the kept builtin wrappers, against Triton's own, bit for bit."""
    if not interp_speed.ops_installed():  # checked by the test above: Triton 3.6-3.8 only
        pytest.skip(f"Triton {triton.__version__}: the binary operations' fast paths are not installed (and its "
                    "interpreter runs them as it is)")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, generator=g) * 4
    x[:6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40])
    i = torch.randint(-2**31, 2**31, (50,), generator=g, dtype=torch.int32)
    i[:4] = torch.tensor([0, -1, 2**31 - 1, -2**31], dtype=torch.int32)
    outs = []
    for mode in (contextlib.nullcontext, interp_speed.triton_as_it_is):
        for k, j in ((0.75, 3), (float("nan"), -5), (-0.0, 2**31 - 1), (1e-320, 0), (float("inf"), 2**40)):
            f, gi = torch.zeros(24 * 64, dtype=torch.float64), torch.zeros(24 * 64 + 1, dtype=torch.int64)
            with mode():
                _scalars_kernel[(1,)](x, i, f, gi, k, j, 50, BLOCK=64, C=3)
            outs.append((f.view(torch.int64), gi))
    fast, slow = outs[:5], outs[5:]
    for (f1, g1), (f2, g2) in zip(fast, slow):
        assert torch.equal(f1, f2) and torch.equal(g1, g2)
    assert fast[0][0].ne(0).sum() > 20 * 50 and fast[0][1].ne(0).sum() > 20 * 50


def test_refused_operands_raise_as_under_triton():
    """Operands Triton refuses (fast paths leave their checks to Triton's code): the same error either way."""
    from triton.runtime.errors import InterpreterError
    for case, match in ((0, "out of range for type int32"), (1, "unsigned tensor and a negative scalar"),
                        (2, "invalid operands of type pointer<int32> and triton.language.float32")):
        raised = []
        for mode in (contextlib.nullcontext, interp_speed.triton_as_it_is):
            with mode(), pytest.raises(InterpreterError, match=match) as e:
                _refused_kernel[(1,)](torch.ones(4, dtype=torch.int32), CASE=case)
            raised.append(str(e.value))
        assert raised[0] == raised[1]


@triton.jit
def _casts_kernel(x_ptr, b_ptr, f_ptr, h_ptr, n, BLOCK: tl.constexpr):
    """fp32 and bf16 blocks (masked loads with `other`) cast to each other, to fp16 and fp64 and to every integer
    width and back, through where/maximum/minimum and reductions; masked stores of fp64 and bf16."""
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=-2.5)
    b = tl.load(b_ptr + offs, mask=m, other=1.0)
    xb, bf = x.to(tl.bfloat16), b.to(tl.float32)
    c = tl.where(x == x, tl.minimum(tl.maximum(x, -100.0), 100.0), 0.0)  # NaN-free, in every integer's range
    cb = c.to(tl.bfloat16)
    fs = (xb.to(tl.float32), bf, xb.to(tl.float32) * bf, x.to(tl.float16).to(tl.float32), b.to(tl.float16),
          b.to(tl.float64), xb.to(tl.float64), (bf * 3.0).to(tl.bfloat16).to(tl.float32), tl.maximum(xb, b),
          tl.where(m, xb, b), cb.to(tl.int8), cb.to(tl.int16), cb.to(tl.int32), cb.to(tl.int64), c.to(tl.int8),
          tl.abs(cb).to(tl.uint8), tl.abs(cb).to(tl.uint16), tl.abs(cb).to(tl.uint32), tl.abs(cb).to(tl.uint64),
          c.to(tl.int32).to(tl.bfloat16), tl.abs(c).to(tl.uint8).to(tl.bfloat16), c.to(tl.int64).to(tl.bfloat16),
          c.to(tl.int16).to(tl.float32).to(tl.bfloat16), cb.to(tl.float16).to(tl.bfloat16))
    for r in tl.static_range(len(fs)):
        tl.store(f_ptr + r * BLOCK + offs, fs[r].to(tl.float64), mask=m)
    s = tl.sum(tl.where(m, cb, 0.0).to(tl.float32), axis=0) + tl.max(tl.where(m, bf, -1e30), axis=0)
    tl.store(f_ptr + len(fs) * BLOCK, s.to(tl.bfloat16).to(tl.float64))
    tl.store(h_ptr + offs, xb, mask=m)
    tl.store(h_ptr + BLOCK + offs, (bf * 3.0 + x).to(tl.bfloat16), mask=m)


def test_bf16_fp32_conversions_give_the_same_bits():
    """The conversion between bf16 and fp32 (its fast path: a 16-bit shift, arrays without nonzero subnormals)
    against Triton's, bit for bit: every bf16 value, every upper half of an fp32 with lower halves of all kinds,
    subnormals among them (Triton's path), non-contiguous views; then kernels casting and reducing both ways."""
    import numpy as np
    from triton.runtime import interpreter as it
    fast = it._convert_float
    with interp_speed.triton_as_it_is():
        slow = it._convert_float
    assert fast is not slow

    def same(a, *args):
        r, t = fast(a, *args), slow(a, *args)
        assert type(r) is type(t) and r.dtype == t.dtype and r.shape == t.shape
        assert r.flags.c_contiguous == t.flags.c_contiguous and np.array_equal(r, t)

    bf = np.arange(2**16, dtype=np.uint16)
    normal = bf[((bf & 0x7FFF) == 0) | ((bf & 0x7FFF) >= 0x80)]  # no nonzero subnormal: the fast path
    for a in (normal, bf, normal[:65280].reshape(255, 256).T, normal[::7], np.array([0x8000, 0x7F80], np.uint16)):
        same(a, tl.bfloat16, tl.float32, None)
    hi = np.arange(2**16, dtype=np.uint32) << np.uint32(16)
    for lo in (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234, 0xBEEF):
        u = hi | np.uint32(lo)
        no_sub = u[((u & 0x7F800000) != 0) | ((u & 0x7FFFFF) == 0)]
        for a in (no_sub, u, no_sub[::3], no_sub[:2**15].reshape(128, 256).T):
            same(a.view(np.float32), tl.float32, tl.bfloat16, None)
    assert not np.array_equal(fast(bf, tl.bfloat16, tl.float32, None), bf.astype(np.uint32) << np.uint32(16))

    g = torch.Generator().manual_seed(2)
    runs = []
    for sub in (False, True):
        x = torch.randn(40, generator=g) * 30
        x[:7] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -1e-30])
        b = (torch.randn(40, generator=g) * 30).to(torch.bfloat16)
        b[:5] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), -3e38]).to(torch.bfloat16)
        if sub:  # subnormals: Triton's conversion
            x[7], b[5] = 1e-40, 1e-40
        outs = []
        for mode in (contextlib.nullcontext, interp_speed.triton_as_it_is):
            f, h = torch.full((24 * 64 + 1,), 7.0, dtype=torch.float64), torch.full((128,), 7.0).to(torch.bfloat16)
            with mode():
                _casts_kernel[(1,)](x, b, f, h, 40, BLOCK=64)
            outs.append((f.view(torch.int64), h.view(torch.int16)))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert outs[0][0][:64].ne(torch.tensor(7.0, dtype=torch.float64).view(torch.int64)).sum() == 40
        runs.append(outs[0])
    assert not torch.equal(runs[0][0], runs[1][0])


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
