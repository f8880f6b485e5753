"""Params of more than 2**31 elements: the fused Triton kernels of fastopt.Lamb and fastopt.Adafactor index them
with int64 offsets (STYLE.md), so the elements past index 2**31 step exactly like the first ones.

One test per optimizer, run at two small shapes on CPU through Triton's interpreter (it checks the test's own
logic: chunked reference, tolerances) and at BIG on a CUDA device, the real case. BIG is a bf16 (2**16 + 1, 2**15)
param, 2**31 + 2**15 elements (4.3 GB): its whole last row lies past index 2**31. Every step (STEPS of them, fresh
random grads) is compared with a float64 reference that never holds a float64 copy of the param: it works in
chunks of `chunk` elements (or rows), regenerating the grads of earlier steps from their seeds where it needs them.

- Lamb (fastopt/reference/lamb.py): m_t, v_t of every element (fp32 state) against float64 moments; the bf16
  params of the first HEAD and the last TAIL elements against a reference that rounds to bf16 after each step,
  as the kernels do, with the trust ratio ||p|| / ||a|| of float64 norms over the whole tensor (its params
  stepped in float64 and stored as bf16, one whole bf16 copy).
- Adafactor (transformers' semantics, fastopt/reference/adafactor.py) with a fixed lr, no parameter scaling, no
  momentum: the row and column factors (fp32 state) against float64 sums of g^2 over every row and column; the
  bf16 params of the first and last elements against the factored update, clipped by the RMS of U over the whole
  tensor, which the grads' layout makes bind (`Problem.grad_chunk`).

bf16 tolerance: the kernels compute in fp32 and round to bf16, the reference in float64; where the two land on
either side of a bf16 rounding point they differ by one bf16 ulp, and stay one ulp apart (the ulp of the largest
value the element held along the way). The checked elements start small (INIT_SCALE) next to the rest of the
param, so that their updates are several of their ulps: at |p| ~ 1 a step of lr = 1e-2 is about one bf16 ulp
and a one-ulp tolerance would prove nothing.
"""
from __future__ import annotations

import math

import pytest
import torch

import fastopt
from fastopt import ops

BIG = (2**16 + 1, 2**15)
STEPS = 3
SEED = 20240531
HEAD, TAIL = 1024, 4096   # checked params: the first HEAD and the last TAIL elements (at most 1/8, 1/4 of them)
INIT_SCALE = 1 / 16       # the checked elements start this much smaller than the others (a power of two: exact)

CASES = [
    pytest.param("cpu", (33, 48), 500, id="cpu-33x48"),
    pytest.param("cpu", (5, 70), 120, id="cpu-5x70"),
    pytest.param("cuda", BIG, 2**25, id="cuda-65537x32768", marks=pytest.mark.gpu),
]

LR = 1e-2
# Lamb
BETAS, EPS, WD = (0.9, 0.999), 1e-6, 0.01
# Adafactor (transformers' defaults for the rest)
EPS1, DECAY, CLIP = 1e-30, -0.8, 1.0
U32 = 2.0 ** -24          # unit roundoff of fp32, the kernels' accumulation type for bf16 params


def _device(kind: str, need_bytes: int, monkeypatch) -> torch.device:
    """The device of a case, with the real kernels selected (FASTOPT_BACKEND=triton) and scratch buffers poisoned
    with NaN; skips where the kernels cannot run: CPU needs TRITON_INTERPRET=1, CUDA the compiled kernels and
    `need_bytes` of free memory."""
    if not ops.triton_available():
        pytest.skip("needs Triton")
    if kind == "cpu" and not ops.interpreting():
        pytest.skip("the CPU variant runs the kernels through Triton's interpreter: set TRITON_INTERPRET=1")
    if kind == "cuda":
        if ops.interpreting():
            pytest.skip("the big case needs the compiled kernels, not the interpreter")
        free, _total = torch.cuda.mem_get_info()
        if free < need_bytes:
            pytest.skip(f"needs {need_bytes / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    monkeypatch.setenv("FASTOPT_BACKEND", "triton")
    from fastopt.kernels import common
    monkeypatch.setattr(common, "POISON", True)
    return torch.device(kind)


class Problem:
    """A bf16 param of `shape`, its grads and the checked slices; all values drawn chunk by chunk from seeds,
    so that any chunk of any step's grad can be drawn again without keeping it."""

    def __init__(self, shape, chunk: int, device):
        self.shape, self.device = shape, device
        self.rows, self.cols = shape
        self.n = math.prod(shape)
        self.chunks = [(lo, min(lo + chunk, self.n)) for lo in range(0, self.n, chunk)]
        self.slices = {"head": slice(0, min(HEAD, self.n // 8)), "tail": slice(self.n - min(TAIL, self.n // 4), self.n)}

    def _randn(self, what: int, step: int, k: int) -> torch.Tensor:
        lo, hi = self.chunks[k]
        gen = torch.Generator(device=self.device).manual_seed(SEED + 1_000_003 * (what * (STEPS + 1) + step) + k)
        return torch.randn(hi - lo, generator=gen, dtype=torch.float32, device=self.device)

    def param(self) -> torch.nn.Parameter:
        p = torch.empty(self.n, dtype=torch.bfloat16, device=self.device)
        for k, (lo, hi) in enumerate(self.chunks):
            p[lo:hi] = self._randn(0, 0, k)
        for sl in self.slices.values():
            p[sl] *= INIT_SCALE
        return torch.nn.Parameter(p.view(self.shape))

    def grad_chunk(self, step: int, k: int) -> torch.Tensor:
        """Chunk k of the step's grad (bf16): standard normal, times 8 in the top-left quadrant of the matrix. The
        quadrant makes the factored second moment of Adafactor miss the true one (g^2 is not of rank one), so the
        update's RMS is about 2 and the RMS clip binds; Lamb's Adam-normalized update does not care."""
        lo, hi = self.chunks[k]
        idx = torch.arange(lo, hi, device=self.device)
        big = (idx // self.cols < self.rows // 2) & (idx % self.cols < self.cols // 2)
        return (self._randn(1, step, k) * torch.where(big, 8.0, 1.0)).to(torch.bfloat16)

    def fill_grad(self, p: torch.nn.Parameter, step: int) -> None:
        if p.grad is None:
            p.grad = torch.empty_like(p)
        flat = p.grad.view(-1)
        for k, (lo, hi) in enumerate(self.chunks):
            flat[lo:hi] = self.grad_chunk(step, k)

    def check_slices(self, p, ref: dict, tol: dict, what: str) -> None:
        """The checked elements of `p` against their bf16 reference `ref` (name -> tensor): within `tol`, the
        largest bf16 ulp each element has held, updated here (see the module docstring)."""
        for name, sl in self.slices.items():
            ours, want = p.detach().view(-1)[sl].double(), ref[name].double()
            tol[name] = torch.maximum(tol[name], _bf16_ulp(torch.maximum(ours.abs(), want.abs())))
            _assert_within(ours, want, tol[name], f"{what}, params", sl.start)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (float64, x >= 0): 2^(e - 8) for x = f 2^e, f in [0.5, 1)."""
    _f, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), e - 8)


def _to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16 rounding to nearest even (through fp32: exact but for ties of a rounded tie, ~2^-29)."""
    return x.to(torch.float32).to(torch.bfloat16)


def _assert_within(ours: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str, first: int) -> None:
    """|ours - want| <= bound element-wise (float64); the message names the first bad element's flat index."""
    err = (ours.double() - want).abs()
    bad = ~(err <= bound)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements off, first at flat index {first + i}: "
                             f"{ours[i].item()!r} vs {want[i].item()!r} (allowed {bound.reshape(-1)[i].item():.3g}; "
                             f"worst excess {(err - bound).max().item():.3g})")


def _assert_moved(ref: dict, init: dict, tol: dict) -> None:
    """The checked elements moved by far more than they may be off: otherwise the comparison would prove nothing."""
    for name in ref:
        moved = (ref[name].double() - init[name].double()).abs().mean().item()
        allowed = tol[name].mean().item()
        assert moved > 8 * allowed, f"{name}: the reference moved {moved:.3g} on average, tolerance {allowed:.3g}"


# ---- Lamb ------------------------------------------------------------------------------------------------
def _lamb_moments(pb: Problem, t: int, k: int):
    """float64 m_t, v_t of chunk k from the grads of steps 1..t, and the m_t recursion run on |g| (the size of
    the terms m_t sums, which bounds the fp32 rounding of the state)."""
    b1, b2 = BETAS
    m = v = m_abs = 0.0
    for s in range(1, t + 1):
        g = pb.grad_chunk(s, k).double()
        m = b1 * m + (1 - b1) * g
        m_abs = b1 * m_abs + (1 - b1) * g.abs()
        v = b2 * v + (1 - b2) * g * g
    return m, v, m_abs


@pytest.mark.parametrize("kind, shape, chunk", CASES)
def test_lamb_indexes_past_2_31(kind, shape, chunk, monkeypatch):
    """LAMB (bias correction, weight decay) on one bf16 param; the reference follows fastopt/reference/lamb.py:
    a = m_t / (sqrt(v_t) + eps) + wd p, r = ||p|| / ||a|| (whole tensor), p -= lr sqrt(1 - b2^t) / (1 - b1^t) r a."""
    n = math.prod(shape)
    # param, grad, reference param (bf16), m and v (fp32); about 8 float64 chunk temporaries
    dev = _device(kind, n * 14 + chunk * 8 * 10 + 2**30, monkeypatch)
    pb = Problem(shape, chunk, dev)
    p = pb.param()
    ref = p.detach().clone().view(-1)  # the reference's whole param, stepped in float64 chunks, stored as bf16
    init = {name: ref[sl].clone() for name, sl in pb.slices.items()}
    tol = {name: torch.zeros(sl.stop - sl.start, dtype=torch.float64, device=dev) for name, sl in pb.slices.items()}
    opt = fastopt.Lamb([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for t in range(1, STEPS + 1):
        pb.fill_grad(p, t)
        opt.step()
        st = opt.state[p]
        assert float(st["step"]) == t and st["exp_avg"].dtype == torch.float32
        p_sq = torch.zeros((), dtype=torch.float64, device=dev)
        a_sq = torch.zeros((), dtype=torch.float64, device=dev)
        for k, (lo, hi) in enumerate(pb.chunks):
            m, v, _ = _lamb_moments(pb, t, k)
            x = ref[lo:hi].double()
            p_sq += x.square().sum()
            a_sq += (m / (v.sqrt() + EPS) + WD * x).square().sum()
        ratio = (p_sq.sqrt() / a_sq.sqrt()).item()  # both norms are positive here
        eta = LR * math.sqrt(1 - BETAS[1] ** t) / (1 - BETAS[0] ** t)
        for k, (lo, hi) in enumerate(pb.chunks):
            m, v, m_abs = _lamb_moments(pb, t, k)
            # fp32 state: a few roundings per step of terms no larger than m_abs (resp. v)
            _assert_within(st["exp_avg"].view(-1)[lo:hi], m, 1e-6 * m_abs, f"Lamb step {t}, exp_avg", lo)
            _assert_within(st["exp_avg_sq"].view(-1)[lo:hi], v, 1e-6 * v, f"Lamb step {t}, exp_avg_sq", lo)
            x = ref[lo:hi].double()
            ref[lo:hi] = _to_bf16(x - eta * ratio * (m / (v.sqrt() + EPS) + WD * x))
        pb.check_slices(p, {name: ref[sl] for name, sl in pb.slices.items()}, tol, f"Lamb step {t}")
    _assert_moved({name: ref[sl] for name, sl in pb.slices.items()}, init, tol)


# ---- Adafactor -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, shape, chunk", CASES)
def test_adafactor_indexes_past_2_31(kind, shape, chunk, monkeypatch):
    """Adafactor with lr fixed, no parameter scaling, no momentum, no decay; the reference follows
    fastopt/reference/adafactor.py: R_t, C_t from the row and column means of g^2 over the whole matrix,
    U = g rsqrt(R_t / mean(R_t)) rsqrt(C_t), p -= lr U / max(1, RMS(U) / d) with RMS over every element."""
    n = math.prod(shape)
    rows, cols = shape
    rows_per_chunk = max(1, chunk // cols)
    # param, grad (bf16), the kernels' fp32 column partials (4 / BLOCK_R bytes per element: n / 16 bytes with
    # BIG's 64-row blocks); float64 row chunks
    dev = _device(kind, n * 4 + n // 4 + rows_per_chunk * cols * 8 * 4 + 2**30, monkeypatch)
    pb = Problem(shape, chunk, dev)
    p = pb.param()
    ref = {name: p.detach().view(-1)[sl].clone() for name, sl in pb.slices.items()}
    init = {name: x.clone() for name, x in ref.items()}
    tol = {name: torch.zeros_like(x, dtype=torch.float64) for name, x in ref.items()}
    row_state = torch.zeros(rows, dtype=torch.float64, device=dev)
    col_state = torch.zeros(cols, dtype=torch.float64, device=dev)
    blocks = [(r0, min(r0 + rows_per_chunk, rows)) for r0 in range(0, rows, rows_per_chunk)]
    opt = fastopt.Adafactor([p], lr=LR, relative_step=False, scale_parameter=False, beta1=None)
    for t in range(1, STEPS + 1):
        pb.fill_grad(p, t)
        opt.step()
        g = p.grad.view(rows, cols)
        row_sum = torch.empty(rows, dtype=torch.float64, device=dev)
        col_sum = torch.zeros(cols, dtype=torch.float64, device=dev)
        for r0, r1 in blocks:
            sq = g[r0:r1].double().square()
            row_sum[r0:r1] = sq.sum(1)
            col_sum += sq.sum(0)
        beta2t = 1.0 - t ** DECAY
        row_state = beta2t * row_state + (1 - beta2t) * (row_sum / cols + EPS1)
        col_state = beta2t * col_state + (1 - beta2t) * (col_sum / rows + EPS1)
        st = opt.state[p]
        assert float(st["step"]) == t and set(st) == {"step", "exp_avg_sq_row", "exp_avg_sq_col"}
        # fp32 state: sums of `cols` (resp. `rows`) positive terms in any order, then a few roundings
        _assert_within(st["exp_avg_sq_row"], row_state, (cols + 8) * U32 * row_state, f"Adafactor step {t}, rows", 0)
        _assert_within(st["exp_avg_sq_col"], col_state, (rows + 8) * U32 * col_state, f"Adafactor step {t}, cols", 0)
        r_fac = (row_state / row_state.mean()).rsqrt()
        c_fac = col_state.rsqrt()
        u_sq = sum((g[r0:r1].double() * r_fac[r0:r1, None] * c_fac).square().sum() for r0, r1 in blocks)
        clip = max(1.0, math.sqrt(u_sq.item() / n) / CLIP)
        assert clip > 1.2, f"step {t}: RMS(U) = {clip:.3g}, the clip does not bind (the grads' layout should see to it)"
        for name, sl in pb.slices.items():
            idx = torch.arange(sl.start, sl.stop, device=dev)
            u = g.view(-1)[sl].double() * r_fac[idx // cols] * c_fac[idx % cols]
            ref[name] = _to_bf16(ref[name].double() - (LR / clip) * u)
        pb.check_slices(p, ref, tol, f"Adafactor step {t}")
    _assert_moved(ref, init, tol)
