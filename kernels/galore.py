"""Fused GaLore-AdamW (the math: fastopt/reference/galore.py).

Work per projected param and step (the SVD of the refresh steps is torch.linalg.svd, outside):

  left / right                                      full (P and Q)
  1 _galore_matmul_kernel  R = P^T G  or  G Q^T     1a T = P^T G        1b R = T Q^T
  2 _galore_adam_kernel    m_t, v_t (stored, fp32 or 8-bit codes), N = m_t / (sqrt(v_t) + eps) written over R
  3 _galore_matmul_kernel  p -= eta scale (P N | N Q) in the epilogue, then the decoupled decay
                                                    3a W = N Q          3b p -= eta scale P W, decay

The products of every param of a bucket go out as one launch per stage (1 or 1a, 1b, 3 or 3a, 3b; the
projection of a sharded piece in several rectangles, or in scattered rows, as its own, which rect.place adds into
R right away; that of a Shard(d) piece, a run of rows or columns, writes its part of R with the others, as
whole params do): each program finds its job (a product of one matrix batch) by bisection in a small int64
table of pointers, sizes and strides, rebuilt per step and copied asynchronously; the strides that are 1 are
declared so (A_K1, ...: the launch groups jobs by them), so the tiles load as from a contiguous matrix. The
Adam kernel does the same over its params (projected ones in one launch, plain ones in another). Launches per
step therefore do not grow with the params.

Building those launches is host work per param (views, pointers, table rows): for TinyLlama's 201 tensors the
H100 run of 8a1c9ed spent 13.7 ms of host time per step against 15 ms of kernels. A step whose params and states
sit where they sat the step before, with gradients of the same shapes, dtypes, contiguity and alignment, and that
builds no buffer of its own, replays the launches it recorded then (`_Record`): this step's scratch address,
hyperparameters and GradScaler tensors go in, and where gradients moved (as they do under
`zero_grad(set_to_none=True)`), copies of the job tables with their new addresses; the key is a few attribute
reads per tensor. On this project's 2-core CPU with the launches stubbed out, the whole step() of that model went
from 7.1 to 1.9 ms of host time, and from 8.7 to 2.4 ms with its gradients in new memory every step. Sharded
buckets replay too: their collectives (the sum of R, the sharded moments' reduce-scatter and all-gather) run
between the recorded launches, their receive buffer inside the scratch buffer; with the model's 201 tensors as
Shard(0) DTensors on one gloo process, 20.6 ms of host time a step became 7.5-7.9 (`bench/profile_sharded.py
--world 1`). Full projections keep their middle products (T, W) in the scratch buffer too; pieces of several
rectangles or of scattered indices (flat ZeRO ranges: buffers of their own, gathered bases) and uneven cuts of
the moments along an inner dim (copied out of the receive buffer) build their launches every step.

So the full-size update is never materialized: the back-projection's output tile goes straight into the
parameter (read once, written once), and only rank-sized buffers (R, N, T, W) go through memory. A param
without a projection takes one `_galore_adam_kernel` launch with the parameter update in it (plain AdamW).
Params with more than two dims are batches of matrices: the batch is the grid's second axis. A sharded
param's piece is one rectangle of its matrices (dim layouts) or a few (a flat ZeRO range: partial first row,
whole rows, partial last row); each takes the same launches on its local elements, with the bases' rows or
columns it needs (a DTensor param's state keeps just those; otherwise gathered by torch, rank-sized), and its
partial R is added into the bucket's flat buffer, which the caller's `reduce` sums over the ranks once per step
(params with whole moments), or which is reduce-scattered onto the rows of the moments each rank keeps, N
all-gathered back after the Adam kernel (DTensor params: fastopt/reference/galore.py's `MomentExchange`).

The matmul kernel is one tiled `tl.dot` loop over K with arbitrary strides (a transposed operand is a stride
swap, nothing is copied), int64 offsets, an fp32 accumulator. The products are compute-bound (2 m n rank
flops per matrix and direction), so they run on tensor cores, at a precision chosen per param dtype
(`FASTOPT_GALORE_DOT`, default `auto`):
- fp32 params: `input_precision="tf32x3"` (each operand split into two tf32 parts, three tensor-core
  products: about fp32's accuracy, where plain tf32 would keep 10 mantissa bits of the bases); plain `tf32`
  where torch itself multiplies fp32 matrices in TF32 (`torch.backends.cuda.matmul.fp32_precision == "tf32"`,
  which `torch.set_float32_matmul_precision("high")` and `allow_tf32 = True` set too), as galore-torch's
  products then are; read at every step;
- bf16/fp16 params: both operands rounded to the param's dtype (the gradient already is), the precision
  galore-torch itself multiplies such params in (its bases and moments are kept in the param's dtype);
- fp64 params multiply-and-sum the tile in fp64 (no fp64 `tl.dot` is assumed).
`FASTOPT_GALORE_DOT=ieee|tf32|tf32x3` forces that fp32 precision for every param dtype (low-precision
operands then stay fp32; `ieee` is plain fp32 arithmetic, exact to the reference's rounding and several
times slower on an H100). The interpreter computes every dot in fp32 (it ignores `input_precision`, and
reads bf16 dot operands as raw bits, so there the rounded operands are multiplied back in fp32: the same
products, exact in fp32), so CPU runs test the bf16/fp16 rounding and not the tf32 ones.

The 8-bit format is fastopt/reference/quant.py's (bitsandbytes' block-wise format, the extension's): each
program of the Adam kernel holds whole quantization blocks of the flat rank-sized moments, dequantizes,
updates, and requantizes them with kernels/lamb.py's block helpers (nearest map value, ties to the lower
index), so its codes match the reference's and the extension's to the last bit.

Hyperparameters travel as a float64 tensor (Triton passes Python floats as fp32); eta is computed per program
in fp64 from the device step counter: no host sync, and a step GradScaler skips (found_inf) stores nothing.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from . import common
from .common import FP_FUSION, INTERPRET, keep_limit, load16, round_to, search_table, store_grad, to_device
from .lamb import _dequantize, _quantize_store

DOT_PRECISIONS = ("auto", "ieee", "tf32", "tf32x3")


def dot_precision() -> tuple[str, bool]:
    """(`input_precision` for fp32 operands, whether bf16/fp16 params multiply in their own dtype)."""
    want = os.environ.get("FASTOPT_GALORE_DOT", "auto").strip().lower() or "auto"
    if want not in DOT_PRECISIONS:
        raise ValueError(f"FASTOPT_GALORE_DOT={want!r}: expected one of {', '.join(DOT_PRECISIONS)}")
    if want != "auto":
        return want, False
    # torch's own setting for fp32 matmuls on CUDA: "tf32", "ieee" or "none" (the default, IEEE); the legacy
    # setters write it as well; reading it raised in no mix of the two APIs tried (torch 2.10, 2.11, 2.13), where
    # reading `allow_tf32` raises after the new API has been used
    return ("tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "tf32x3"), True


# Matmul tiles (BM, BN, BK, num_warps, num_stages) of the projections (R = P^T G, G Q^T and the rank-sized
# products of a full projection) and of the back-projections with the update (p -= eta scale P N, N Q):
# tl.dot needs 16 at least; small under the interpreter so the tests' matrices span several. fp64 multiplies a
# [BM, BK, BN] product in registers: small tiles there. tiles_for(device) picks the table; bench/galore_tiles.py
# times others on a GPU.
TILES = {"project": (16, 16, 16, 4, 1), "back": (16, 16, 16, 4, 1)} if INTERPRET else \
    {"project": (64, 64, 32, 4, 3), "back": (64, 64, 32, 4, 3)}
# Compute capability 9.x (H100/H200: wgmma, 227 KB of shared memory a block), for the launches of matrices whose
# every access is aligned (ALIGNED: sizes, strides and pointers multiples of 16; large models' matrices, each
# launched apart from odd-sized ones) and whose products run on tensor cores: two warpgroups on 128x128 tiles,
# each issuing 64x128 wgmma where TILES issue 64x64 ones from one, and each operand slice read for twice the rows
# or columns. Compiled for sm_90 (tests/compile_check.py, Triton 3.6 and 3.9): at most 230 registers and 96 KB
# of shared memory, no spill (tests/test_compile.py checks the stack frame, where ptxas spills); with them,
# unaligned launches spilled up to 608 bytes and fp32 FMA products (FASTOPT_GALORE_DOT=ieee) 16. Not yet timed
# on a GPU against TILES (the H100's profile had 20.7 of GaLore-r1024 bf16's 24.3 ms in the 64x64 tiles). TILES
# take 48 KB at most (fp32), what every CUDA GPU gives a block; AMD GPUs (a ROCm build reports MI300 as 9.4)
# keep them too.
TILES_SM90 = {"project": (128, 128, 32, 8, 3), "back": (128, 128, 32, 8, 3)}
TILES64 = (16, 16, 16, 4, 1)
_TILES_OF: dict = {}  # device index (None: CPU tensors, compiled for the active driver's target) -> its table


def tiles_for(device: torch.device, large: bool = True) -> dict:
    """The tile table of launches on `device`: TILES_SM90 on compute capability 9.x when `large`, else TILES
    (always under the interpreter). The dict itself, so bench/galore_tiles.py can change it in place."""
    if INTERPRET or not large:
        return TILES
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = device.index if device.type == "cuda" else None
    table = _TILES_OF.get(key)
    if table is None:
        if key is None:  # only tests/compile_check.py launches non-interpreted kernels on CPU tensors
            target = triton.runtime.driver.active.get_current_target()
            major = target.arch // 10 if target.backend == "cuda" else 0
        else:  # a ROCm build reports gfx versions here: MI200 (9, 0), MI300 (9, 4), MI350 (9, 5), 64 KB LDS or so
            major = torch.cuda.get_device_capability(device)[0] if torch.version.hip is None else 0
        table = _TILES_OF[key] = TILES_SM90 if major == 9 else TILES
    return table


NUM_WARPS = 4  # the Adam kernel's
# Adam kernel: [NQ, QB] tiles of the flat moments (QB = the quantization block with 8-bit state).
QB32, NQ32 = (64, 2) if INTERPRET else (256, 8)
TILE8 = 128 if INTERPRET else 2048

# Slots of the float64 hyperparameter tensor.
HYPER = ("lr", "beta1", "beta2", "1-beta1", "1-beta2", "log(beta1)", "log(beta2)", "eps", "lr*weight_decay",
         "scale")


@triton.jit
def _eta(step_ptr, hyper_ptr):
    """lr sqrt(1 - beta2^t) / (1 - beta1^t) in fp64 from the device step counter (lr where the logs are -inf:
    no bias correction, _hyper)."""
    t = tl.load(step_ptr).to(tl.float64)
    return tl.load(hyper_ptr) * tl.sqrt(1.0 - tl.exp(t * tl.load(hyper_ptr + 6))) / \
        (1.0 - tl.exp(t * tl.load(hyper_ptr + 5)))


# Job tables (int64 rows). Each row ends with a bit mask of its pointers that are offsets into the step's scratch
# buffer (its address is a kernel argument, `base`): then a table does not change from step to step while the
# params, states and gradients stay where they are, and is copied from the host only when one of those moved.
MM_WIDTH = 17  # matmul job: a, b, c, step pointers; M, N, K; strides of a, b, c (batch, row, col); relative mask
_MM_WIDTH = tl.constexpr(MM_WIDTH)
ADAM_WIDTH = 9  # Adam job: r, m, v, m absmax, v absmax, out, step pointers; numel; relative mask
_ADAM_WIDTH = tl.constexpr(ADAM_WIDTH)


@triton.jit
def _job(table_ptr, LOG_JOBS: tl.constexpr, WIDTH: tl.constexpr):
    """(job index, its first program, its row of the table) of this program, in a launch of many jobs. table:
    2**LOG_JOBS int64 first programs of the jobs (padded with a huge value), then WIDTH int64 per job."""
    pid = tl.program_id(0)
    j = 0
    for s in tl.static_range(LOG_JOBS):  # the last job whose first program is <= pid
        cand = j + ((1 << (LOG_JOBS - 1)) >> s)
        j = tl.where(tl.load(table_ptr + cand) <= pid, cand, j)
    return j, tl.load(table_ptr + j), table_ptr + (1 << LOG_JOBS) + j * WIDTH


@triton.jit
def _job_ptr(meta, k, rel, base, ref, ALIGNED: tl.constexpr = False):
    """Pointer k of a job's row: absolute, or an offset from `base` where bit k of `rel` is set."""
    p = (tl.load(meta + k) + ((rel >> k) & 1) * base).to(ref.dtype)
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _stride(ptr, UNIT: tl.constexpr, ALIGNED: tl.constexpr):
    """A job's stride: 1 where the launch declared it so (UNIT; the compiler can then vectorize that dimension),
    else loaded (a multiple of 16 with ALIGNED)."""
    if UNIT:
        return 1
    else:
        return load16(ptr, ALIGNED)


@triton.jit
def _galore_matmul_kernel(table_ptr, base, a_ref, b_ref, c_ref, step_ref, acc_ref, op_ref, hyper_ptr, inv_scale_ptr,
                          found_inf_ptr, UPDATE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
                          HAS_WD: tl.constexpr, FP64: tl.constexpr, LOWP: tl.constexpr, UPCAST: tl.constexpr,
                          PRECISION: tl.constexpr, LOG_JOBS: tl.constexpr, A_K1: tl.constexpr, A_M1: tl.constexpr,
                          B_N1: tl.constexpr, B_K1: tl.constexpr, C_N1: tl.constexpr, ALIGNED: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C = A @ B for one [BM, BN] tile of one matrix of one job's batch; one launch covers many jobs.

    table: see _job; MM_WIDTH int64 per job.
    A_K1 / A_M1 / B_N1 / B_K1 / C_N1: every job of the launch has that stride 1 (A's k or m, B's n or k, C's n).
    UPDATE=False: C is stored (times inv_scale when HAS_SCALE). UPDATE=True: C is the parameter, and the tile
    becomes p - eta * scale * (A @ B), then p - lr * weight_decay * p (HAS_WD), stored unless found_inf.
    LOWP: both operands rounded to op_ref's dtype (bf16/fp16) before the product; else fp32 at PRECISION."""
    acc_t = acc_ref.dtype.element_ty
    op_t = op_ref.dtype.element_ty if LOWP else acc_t
    pid = tl.program_id(0)
    j, first, meta = _job(table_ptr, LOG_JOBS, _MM_WIDTH)
    rel = tl.load(meta + _MM_WIDTH - 1)
    a_ptr = _job_ptr(meta, 0, rel, base, a_ref, ALIGNED)
    b_ptr = _job_ptr(meta, 1, rel, base, b_ref, ALIGNED)
    c_ptr = _job_ptr(meta, 2, rel, base, c_ref, ALIGNED)
    M = load16(meta + 4, ALIGNED)
    N = load16(meta + 5, ALIGNED)
    K = load16(meta + 6, ALIGNED)
    sab = load16(meta + 7, ALIGNED)
    sam = _stride(meta + 8, A_M1, ALIGNED)
    sak = _stride(meta + 9, A_K1, ALIGNED)
    sbb = load16(meta + 10, ALIGNED)
    sbk = _stride(meta + 11, B_K1, ALIGNED)
    sbn = _stride(meta + 12, B_N1, ALIGNED)
    scb = load16(meta + 13, ALIGNED)
    scm = load16(meta + 14, ALIGNED)
    scn = _stride(meta + 15, C_N1, ALIGNED)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_matrix = tiles_m * tiles_n
    local = pid - first
    bid = local // per_matrix
    t = local % per_matrix
    # Consecutive programs (which run at the same time) share a slice of the larger operand, read from DRAM
    # once for them: B's columns (M < N: A is the smaller, e.g. P^T of a projection onto the left) or A's rows.
    m_fast = M < N
    rm = tl.where(m_fast, t % tiles_m, t // tiles_n) * BM + tl.arange(0, BM)
    rn = tl.where(m_fast, t // tiles_m, t % tiles_n) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK).to(tl.int64)
    a_base = a_ptr + bid * sab
    b_base = b_ptr + bid * sbb
    acc = tl.zeros([BM, BN], dtype=acc_t)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_base + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(b_base + kk[:, None] * sbk + rn[None, :] * sbn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                    other=0.0)
        if LOWP and UPCAST:  # the interpreter's dot reads bf16 as raw bits (and its cast truncates): the same
            a = round_to(a.to(acc_t), op_t).to(acc_t)  # rounded operands, multiplied in fp32, exactly
            b = round_to(b.to(acc_t), op_t).to(acc_t)
        else:
            a = a.to(op_t)
            b = b.to(op_t)
        if FP64:
            acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c_offs = c_ptr + bid * scb + rm[:, None] * scm + rn[None, :] * scn
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if UPDATE:
        step_ptr = _job_ptr(meta, 3, rel, base, step_ref)
        coef = (_eta(step_ptr, hyper_ptr) * tl.load(hyper_ptr + 9)).to(acc_t)
        p = tl.load(c_offs, mask=mask, other=0.0).to(acc_t)
        p = p - coef * acc
        if HAS_WD:
            p = p - tl.load(hyper_ptr + 8).to(acc_t) * p
        keep = mask & (rm[:, None] < keep_limit(M, found_inf_ptr, HAS_INF))
        tl.store(c_offs, round_to(p, c_ptr.dtype.element_ty), mask=keep)
    else:
        if HAS_SCALE:
            acc = acc * tl.load(inv_scale_ptr).to(acc_t)
        tl.store(c_offs, acc, mask=mask)


@triton.jit
def _galore_adam_kernel(table_ptr, base, r_ref, m_ref, ma_ref, out_ref, step_ref, acc_ref, hyper_ptr, inv_scale_ptr,
                        found_inf_ptr, map_s_ptr, map_u_ptr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
                        HAS_WD: tl.constexpr, EIGHT: tl.constexpr, APPLY: tl.constexpr, LOG_JOBS: tl.constexpr,
                        QB: tl.constexpr, NQ: tl.constexpr):
    """Adam on the flat (projected) gradient r: m_t, v_t stored (fp32/fp64, or requantized 8-bit codes with
    EIGHT), then N = m_t / (sqrt(v_t) + eps) written to out (projected params), or, with APPLY (params
    without a projection), the parameter update p -= eta N, p -= lr weight_decay p, with p at out.
    One launch covers many params: table as _galore_matmul_kernel's, ADAM_WIDTH int64 per job."""
    acc_t = acc_ref.dtype.element_ty
    j, first, meta = _job(table_ptr, LOG_JOBS, _ADAM_WIDTH)
    rel = tl.load(meta + _ADAM_WIDTH - 1)
    r_ptr = _job_ptr(meta, 0, rel, base, r_ref)
    m_ptr = _job_ptr(meta, 1, rel, base, m_ref)
    v_ptr = _job_ptr(meta, 2, rel, base, m_ref)
    ma_ptr = _job_ptr(meta, 3, rel, base, ma_ref)
    va_ptr = _job_ptr(meta, 4, rel, base, ma_ref)
    out_ptr = _job_ptr(meta, 5, rel, base, out_ref)
    step_ptr = _job_ptr(meta, 6, rel, base, step_ref)
    n = tl.load(meta + 7)
    blk = (tl.program_id(0) - first) * NQ + tl.arange(0, NQ)
    offs = blk[:, None] * QB + tl.arange(0, QB)[None, :]
    mask = offs < n
    limit = keep_limit(n, found_inf_ptr, HAS_INF)
    keep = offs < limit
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(acc_t)
    if HAS_SCALE:
        r = r * tl.load(inv_scale_ptr).to(acc_t)
    if EIGHT:
        bmask = blk * QB < n
        m_old = _dequantize(m_ptr, ma_ptr, offs, mask, blk, bmask, map_s_ptr).to(acc_t)
        v_old = _dequantize(v_ptr, va_ptr, offs, mask, blk, bmask, map_u_ptr).to(acc_t)
    else:
        m_old = tl.load(m_ptr + offs, mask=mask, other=0.0).to(acc_t)
        v_old = tl.load(v_ptr + offs, mask=mask, other=0.0).to(acc_t)
    m = tl.load(hyper_ptr + 1).to(acc_t) * m_old + tl.load(hyper_ptr + 3).to(acc_t) * r
    v = tl.load(hyper_ptr + 2).to(acc_t) * v_old + tl.load(hyper_ptr + 4).to(acc_t) * (r * r)
    m = tl.where(mask, m, 0.0)
    v = tl.where(mask, v, 0.0)
    nrm = m / (tl.sqrt(v) + tl.load(hyper_ptr + 7).to(acc_t))
    if APPLY:  # r is the gradient (params without a projection): stored unscaled under GradScaler (`store_grad`)
        store_grad(r_ptr, offs, r, keep, HAS_SCALE)
        p = tl.load(out_ptr + offs, mask=mask, other=0.0).to(acc_t)
        p = p - _eta(step_ptr, hyper_ptr).to(acc_t) * nrm
        if HAS_WD:
            p = p - tl.load(hyper_ptr + 8).to(acc_t) * p
        tl.store(out_ptr + offs, round_to(p, out_ptr.dtype.element_ty), mask=keep)
    else:
        tl.store(out_ptr + offs, nrm, mask=mask)
    if EIGHT:
        bkeep = blk * QB < limit
        _quantize_store(m, m_ptr, ma_ptr, offs, blk, keep, bkeep, map_s_ptr)
        _quantize_store(v, v_ptr, va_ptr, offs, blk, keep, bkeep, map_u_ptr)
    else:
        tl.store(m_ptr + offs, m, mask=keep)
        tl.store(v_ptr + offs, v, mask=keep)


# ---- host side ------------------------------------------------------------------------------------------
LEFT, RIGHT = "proj_left", "proj_right"


def _hyper(cache, lr, betas, eps, weight_decay, scale, device, correct_bias=True) -> torch.Tensor:
    """The float64 hyperparameter tensor (see HYPER), rebuilt only when a value changed (e.g. lr). Without
    `correct_bias` both logs are -inf: _eta's beta^t = exp(t * -inf) = 0 for t >= 1, and the step size is lr."""
    key = ("hyper", device, lr, betas, eps, weight_decay, scale, correct_bias)
    if cache is None or cache.get("hyper_key") != key:
        b1, b2 = betas
        values = [lr, b1, b2, 1.0 - b1, 1.0 - b2, math.log(b1) if b1 > 0 and correct_bias else -math.inf,
                  math.log(b2) if b2 > 0 and correct_bias else -math.inf, eps, lr * weight_decay, scale]
        t = to_device([float(x) for x in values], torch.float64, device)
        if cache is None:
            return t
        cache["hyper_key"], cache["hyper"] = key, t
    return cache["hyper"]


class _Record:
    """A step's launches, kept to replay the next steps without the host work that built them (galore_phases).

    A replay is valid while the step would build the same launches: the same tensors at the same addresses
    (params, states: `key`; gradients of the same shapes, dtypes, contiguity and alignment, wherever they are
    now), the same layouts, the same kinds of launch, and nothing else in the job tables but offsets into the
    scratch buffer; so the recording step collects the tables' absolute pointers (`absolute`), and its record is
    kept only when each of them is the address of a param, state or gradient of the step (not, e.g., a
    contiguous copy of a strided gradient or a buffer of its own). Each launch keeps its arguments with the
    step's own values left as slots (the scratch buffer's address, the hyperparameters, GradScaler's tensors),
    which `replay` fills with the current step's, and where its table holds gradients' addresses, those
    entries: gradients that `zero_grad(set_to_none=True)` let go come back wherever the allocator puts them, and
    a table that names them is copied again with their new addresses (the tables of the last few sets of
    addresses are kept). The record keeps the bucket's plan too: a replay of sharded params runs its
    collectives between the launches where the recording step ran them."""

    KEPT = 2  # sets of moved gradients' addresses whose tables are kept (two alternate under some allocators)

    def __init__(self, key: tuple, grads: tuple, addresses: frozenset):
        self.key, self.grads, self.addresses = key, grads, addresses
        # the gradients' own addresses (see `of`), but for empty ones' (no table has them; 0, say, is a table's
        # entry for no tensor)
        self.grad_index = {ptr: i for i, (ptr, entry) in enumerate(zip(grads, key[1::2])) if _nonempty(entry[4])}
        self.launches: list = []
        self.absolute: set = set()
        self.size = 0
        # The step between its launches: the ranges of the scratch buffer zeroed before them, the bucket's
        # BucketPlan (its collectives: the sum of R, the sharded moments' exchange) and where they fall among
        # the launches (after the projections, after Adam).
        self.zeros: list = []
        self.plan = None
        self.sharded = False
        self.cuts: list[int] = []
        self.moved: dict = {}  # gradients' addresses -> each launch's table for them (None: the recorded one)

    @classmethod
    def of(cls, key: tuple, grads: tuple) -> "_Record | None":
        """A recorder for a step of `key` whose gradients sit at `grads`, or None where the tables could not tell
        a gradient's entries from others' (grad_entries finds them by address): one tensor for two params, or a
        gradient in a param's or a state's memory."""
        others = _addresses(key)
        real = [ptr for ptr, entry in zip(grads, key[1::2]) if _nonempty(entry[4])]  # as `_addresses`
        if len(set(real)) < len(real) or not others.isdisjoint(real):
            return None
        return cls(key, grads, others | frozenset(real))

    def complete(self) -> bool:
        return self.absolute <= self.addresses

    def grad_entries(self, head: int, rows: list[list[int]], pointers: int) -> list[tuple[int, int]]:
        """(position in the job table, gradient) of each gradient's address in a table of `rows` after `head`
        entries; a row's first `pointers` entries are pointers, its last the mask of those into the scratch."""
        width, out = len(rows[0]), []
        for r, row in enumerate(rows):
            for k in range(pointers):
                i = self.grad_index.get(row[k]) if not row[-1] >> k & 1 else None
                if i is not None:
                    out.append((head + r * width + k, i))
        return out

    def _tables(self, grads: tuple, device) -> list:
        tables = self.moved.pop(grads, None)  # re-inserted: the dict's order is the order of last use
        if tables is None:
            tables = []
            for *_, (values, entries) in self.launches:
                if any(grads[i] != self.grads[i] for _, i in entries):
                    values = list(values)
                    for pos, i in entries:
                        values[pos] = grads[i]
                    tables.append(_Tables._copy(values, device))
                else:
                    tables.append(None)
            while len(self.moved) >= self.KEPT:
                self.moved.pop(next(iter(self.moved)))
        self.moved[grads] = tables
        return tables

    def replay(self, buf: torch.Tensor, hyper, inv_scale, found_inf, grads: tuple):
        """The recorded step over the scratch buffer `buf`: a generator that yields its collectives, as
        galore_phases does."""
        values = {"base": buf.data_ptr(), "hyper": hyper, "inv_scale": inv_scale, "found_inf": found_inf}
        tables = self._tables(grads, buf.device) if grads != self.grads else [None] * len(self.launches)
        for lo, hi in self.zeros:
            buf[lo:hi].zero_()
        bounds = [0, *self.cuts, len(self.launches)]
        for seg, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            if seg == 1:
                yield from self.plan.reduce(buf, self.sharded)
            elif seg == 2:
                yield from self.plan.gather()
            for (kernel, grid, args, kw, slots, _), table in zip(self.launches[lo:hi], tables[lo:hi]):
                args = list(args)
                for pos, what in slots:
                    args[pos] = values[what]
                if table is not None:
                    args[0] = table
                globals()[kernel][grid](*args, **kw, **FP_FUSION)


def _replay_key(params, grads, states, layouts, sharded, cache, flags) -> tuple | None:
    """(key, the gradients' addresses) of a step's launches (see _Record), or None without a cache. The
    params' layouts (objects kept per param by the optimizer: compared by identity) decide the pieces' products
    and the collectives between the launches."""
    if cache is None:
        return None
    key, at = [(*flags, sharded, tuple(layouts))], []
    Tensor = torch.Tensor
    for p, g, s in zip(params, grads, states):
        at.append(g.data_ptr())
        key.append((p.data_ptr(), p.shape, p.is_contiguous(), at[-1] % common.ALIGN_BYTES, g.shape, g.dtype,
                    g.is_contiguous()))
        # By name: which tensors a param has (proj_left or proj_right, ...) decides its launches. A value a user
        # put in the state that is no tensor is not read here.
        key.append(tuple((name, t.data_ptr(), t.shape, t.dtype, t.is_contiguous()) if isinstance(t, Tensor)
                         else (name,) for name, t in s.items()))
    return tuple(key), tuple(at)


def _nonempty(shape) -> bool:
    return 0 not in shape


def _addresses(key: tuple) -> frozenset:
    """The addresses of the params and states a key names, but for empty ones: no job table has those, and an
    empty view's own address (one past its storage's end, say) may be where a buffer of another step starts."""
    out = set()
    for entry in key[1::2]:
        if _nonempty(entry[1]):
            out.add(entry[0])
    for entry in key[2::2]:
        out.update(t[1] for t in entry if len(t) > 1 and _nonempty(t[2]))
    return frozenset(out)


_DTYPE_REFS: dict = {}


def _ref(x: torch.Tensor) -> torch.Tensor:
    """What a kernel's `*_ref` argument gets for a job tensor x: the kernels read only its dtype (the pointers
    come from the job table), so a one-element tensor of x's dtype and device, made once, which a recorded
    launch keeps without keeping the step's gradients or scratch buffer alive."""
    t = _DTYPE_REFS.get((x.dtype, x.device))
    if t is None:
        t = _DTYPE_REFS[(x.dtype, x.device)] = torch.empty(1, dtype=x.dtype, device=x.device)
    return t


def _scratch(shape, dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if common.POISON:
        out.fill_(float("nan"))
    return out


class _Launch:
    """Arguments every launch of one step shares."""

    def __init__(self, step, hyper, inv_scale, found_inf, weight_decay, fp64, dummy, op_dummy, precision,
                 scratch=None, tables=None, record=None):
        self.scratch = scratch  # the step's scratch buffer: pointers into it go into job tables as offsets
        self.record = record  # a _Record of the step's launches (for a replay of the step), or None
        self.tables = tables if tables is not None else _Tables(None)
        self.step, self.hyper = step, hyper
        self.inv_scale, self.found_inf = inv_scale, found_inf
        self.has_wd = weight_decay > 0
        self.fp64 = fp64
        self.dummy = dummy
        self.op_dummy = op_dummy  # a tensor of the operand dtype when products run in bf16/fp16, else None
        self.precision = precision

    def matmul(self, a, b, c, *, update=False, scale_input=False, group=None):
        """c = a @ b (batched, any strides), or the parameter update into c (update=True): launched now, or
        added to `group` (a dict) for one launch per kind of job at flush()."""
        nb, m, k = a.shape
        n = b.shape[2]
        if nb * m * n == 0:  # an empty local piece: nothing to compute (a K of 0 still stores zeros)
            return
        units = (a.stride(2) == 1, a.stride(2) != 1 and a.stride(1) == 1, b.stride(2) == 1,
                 b.stride(2) != 1 and b.stride(1) == 1, c.stride(2) == 1)
        a_k1, a_m1, b_n1, b_k1, c_n1 = units
        # ALIGNED: M, N, K and every stride the kernel loads a multiple of 16 elements, every pointer 16-byte
        # aligned. A kind of its own, so that an odd-sized matrix does not take the vector accesses (and on an
        # H100 TILES_SM90) from the others of its bucket.
        loaded = [m, n, k, a.stride(0), b.stride(0), c.stride(0), c.stride(1)]
        loaded += [st for st, unit in ((a.stride(1), a_m1), (a.stride(2), a_k1), (b.stride(1), b_k1),
                                       (b.stride(2), b_n1), (c.stride(2), c_n1)) if not unit]
        al = common.aligned((a, b, c)) and common.multiples(loaded)
        kind = ("matmul", update, scale_input and self.inv_scale is not None, a.dtype, b.dtype, c.dtype, units, al)
        self._add(kind, (a, b, c, self.step), group)

    def adam(self, r, state, out, *, apply, block_size, scale_input, group=None):
        """Adam over the flat r into out (N, or the parameter with `apply`): now, or at flush() of `group`."""
        if r.numel() == 0:
            return
        eight = state["exp_avg"].dtype == torch.uint8
        kind = ("adam", apply, eight, scale_input and self.inv_scale is not None, block_size, r.dtype,
                state["exp_avg"].dtype, out.dtype)
        absmax = (state["exp_avg_absmax"], state["exp_avg_sq_absmax"]) if eight else (None, None)
        self._add(kind, (r, state["exp_avg"], state["exp_avg_sq"], *absmax, out, self.step), group)

    def _add(self, kind, job, group) -> None:
        if group is None:
            self._launch(kind, [job])
        else:
            group.setdefault(kind, (self, []))[1].append(job)

    def _pointers(self, tensors) -> tuple[list[int], int]:
        """Data pointers (0 for None) for a job's row, those into the scratch buffer as offsets, and their mask.
        With a recorder, the absolute ones are also collected in it (see _Record)."""
        vals, rel = [], 0
        home = self.scratch.untyped_storage().data_ptr() if self.scratch is not None and self.scratch.numel() \
            else None
        for k, t in enumerate(tensors):
            if t is None:
                vals.append(0)
            elif home is not None and t.untyped_storage().data_ptr() == home:
                vals.append(t.data_ptr() - self.scratch.data_ptr())
                rel |= 1 << k
            else:
                vals.append(t.data_ptr())
                if self.record is not None:
                    self.record.absolute.add(vals[-1])
        return vals, rel

    def _base(self) -> int:
        return self.scratch.data_ptr() if self.scratch is not None else 0

    def _go(self, kernel: str, grid, args: list, kw: dict, values: list[int], rows: list[list[int]],
            pointers: int) -> None:
        """Launch the module's `kernel` (by name: a replay launches what the module holds then; its job table,
        of `values`, first), and with a recorder keep the launch with the step's own values (scratch address,
        hyperparameters, GradScaler's tensors) marked as slots that `_Record.replay` fills in, and where the
        table has gradients' addresses (the first `pointers` entries of each of `rows`)."""
        globals()[kernel][grid](*args, **kw, **FP_FUSION)
        if self.record is not None:
            slots = [(1, "base")]
            for pos, a in enumerate(args):
                for what, t in (("hyper", self.hyper), ("inv_scale", self.inv_scale), ("found_inf", self.found_inf)):
                    if t is not None and a is t:
                        slots.append((pos, what))
            kept = list(args)
            for pos, _ in slots:
                kept[pos] = None
            grads = self.record.grad_entries(len(values) - len(rows) * len(rows[0]), rows, pointers)
            self.record.launches.append((kernel, grid, kept, kw, tuple(slots), (values, grads)))

    @staticmethod
    def flush(group: dict) -> None:
        """Launch the jobs `matmul` / `adam` collected in `group`, one grid per kind."""
        for kind, (run, jobs) in group.items():
            run._launch(kind, jobs)
        group.clear()

    def _launch(self, kind, jobs) -> None:
        if kind[0] == "adam":
            self._launch_adam(kind, jobs)
            return
        update, has_scale, _, _, _, (a_k1, a_m1, b_n1, b_k1, c_n1), al = kind[1:]
        rows = []
        for a, b, c, step in jobs:
            ptrs, rel = self._pointers((a, b, c, step if update else None))
            rows.append([*ptrs, a.shape[1], b.shape[2], a.shape[2], *a.stride(), *b.stride(), *c.stride(), rel])
        # TILES_SM90 spill where the loads go element by element or the fp32 product runs in FMAs (ieee)
        large = al and (self.op_dummy is not None or self.precision != "ieee")
        bm, bn, bk, warps, stages = TILES64 if self.fp64 else \
            tiles_for(jobs[0][2].device, large)["back" if update else "project"]
        programs = [a.shape[0] * common.cdiv(a.shape[1], bm) * common.cdiv(b.shape[2], bn) for a, b, _, _ in jobs]
        table, total, log_jobs, values = self.tables.get(programs, rows, jobs[0][2].device)
        a0, b0, c0, step0 = jobs[0]
        self._go("_galore_matmul_kernel", (total,), [
            table, self._base(), _ref(a0), _ref(b0), _ref(c0), _ref(step0) if update else self.dummy, self.dummy,
            self.op_dummy if self.op_dummy is not None else self.dummy, self.hyper,
            self.inv_scale if self.inv_scale is not None else self.dummy,
            self.found_inf if self.found_inf is not None else self.dummy], dict(
            UPDATE=update, HAS_SCALE=has_scale, HAS_INF=self.found_inf is not None, HAS_WD=self.has_wd,
            FP64=self.fp64, LOWP=self.op_dummy is not None, UPCAST=INTERPRET, PRECISION=self.precision,
            LOG_JOBS=log_jobs, A_K1=a_k1, A_M1=a_m1, B_N1=b_n1, B_K1=b_k1, C_N1=c_n1, ALIGNED=al,
            BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages), values, rows, 4)

    def _launch_adam(self, kind, jobs) -> None:
        apply, eight, has_scale, block_size = kind[1:5]
        qb, nq = (block_size, max(1, TILE8 // block_size)) if eight else (QB32, NQ32)
        rows = []
        for job in jobs:
            ptrs, rel = self._pointers(job)
            rows.append([*ptrs, job[0].numel(), rel])
        programs = [common.cdiv(job[0].numel(), qb * nq) for job in jobs]
        r0, m0, _, ma0, _, out0, step0 = jobs[0]
        table, total, log_jobs, values = self.tables.get(programs, rows, r0.device)
        maps = (search_table(True, r0.device), search_table(False, r0.device)) if eight else (self.dummy,) * 2
        self._go("_galore_adam_kernel", (total,), [
            table, self._base(), _ref(r0), _ref(m0), _ref(ma0) if eight else self.dummy, _ref(out0), _ref(step0),
            self.dummy, self.hyper, self.inv_scale if self.inv_scale is not None else self.dummy,
            self.found_inf if self.found_inf is not None else self.dummy, *maps], dict(
            HAS_SCALE=has_scale, HAS_INF=self.found_inf is not None, HAS_WD=self.has_wd, EIGHT=eight, APPLY=apply,
            LOG_JOBS=log_jobs, QB=qb, NQ=nq, num_warps=NUM_WARPS), values, rows, len(jobs[0]))


class _Tables:
    """The job tables of a bucket's launches by content, kept from one step to the next in the optimizer's cache
    (those a step did not use are dropped): a table whose params, states and gradients did not move is not
    copied again. One that must be copied goes from pinned memory, asynchronously; one copied while a CUDA graph
    is being captured keeps its host side for the life of the process (the graph copies from it on every
    replay), which the offsets into the scratch buffer make rare: a capture sees the tables of the eager steps."""

    _captured: list = []

    def __init__(self, cache):
        prev = cache.get("job_tables", {}) if cache is not None else {}
        self.prev, self.now = prev, {}
        if cache is not None:
            cache["job_tables"] = self.now

    def get(self, programs: list[int], rows: list[list[int]], device) -> tuple[torch.Tensor, int, int, list[int]]:
        """(table, programs in all, LOG_JOBS, the table's values) of a launch of many jobs (see _job): the first
        program of each job, padded to a power of two with a value no program reaches, then each job's row."""
        log_jobs = (len(rows) - 1).bit_length()
        firsts, total = [], 0
        for n in programs:
            firsts.append(total)
            total += n
        firsts += [1 << 62] * ((1 << log_jobs) - len(rows))
        values = firsts + [x for row in rows for x in row]
        key = (device, tuple(values))
        table = self.now.get(key)
        if table is None:
            table = self.prev.get(key)
            if table is None:
                table = self._copy(values, device)
            self.now[key] = table
        return table, total, log_jobs, values

    @classmethod
    def _copy(cls, values: list[int], device) -> torch.Tensor:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            host = torch.tensor(values, dtype=torch.int64).pin_memory()
            cls._captured.append(host)
            return host.to(device, non_blocking=True)
        return to_device(values, torch.int64, device)


def galore_phases(params, grads, states, *, lr, betas, eps, weight_decay, scale=1.0, block_size=256,
                  correct_bias=True, inv_scale=None, found_inf=None, cache=None, layouts=None, sharded=False):
    """One step over a bucket (same device and dtype) whose bases are already refreshed; `step` advanced; a
    generator that yields its collectives when `sharded` (fastopt.distributed.phases).
    Sharded params as in the reference: each rank's partial R (the sum over the rectangles of the matrices it
    holds: one for a dim layout, a few for a flat range) goes into one flat buffer for the bucket; the part of
    the params with whole moments is summed over the ranks, that of the params with sharded moments
    (DTensors) reduce-scattered onto the rows kept here, N all-gathered after Adam (`MomentExchange`); the
    back-projection writes each rectangle of the local piece. The bases' rows or columns (unless the state keeps
    just those: DTensor params) and N's block of a rectangle are gathered with torch (rank-sized); the kernels
    see local tensors only."""
    from fastopt.reference.galore import BucketPlan, local_bases, local_rects
    device = params[0].device
    acc = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    hyper = _hyper(cache, float(lr), tuple(float(b) for b in betas), float(eps), float(weight_decay),
                   float(scale), device, bool(correct_bias))
    precision, lowp = dot_precision()
    layouts = layouts if layouts is not None else [None] * len(params)
    keyed = _replay_key(params, grads, states, layouts, sharded, cache,
                        (device, params[0].dtype, precision, lowp, weight_decay > 0, block_size, inv_scale is None,
                         found_inf is None))
    record = None
    if keyed is not None:
        key, at = keyed
        rec = cache.get("replay")
        if rec is not None and rec.key == key:
            yield from rec.replay(_scratch(rec.size, acc, device), hyper, inv_scale, found_inf, at)
            return
        record = _Record.of(key, at)
        if record is None:
            cache.pop("replay", None)
    dummy = torch.empty(1, dtype=acc, device=device)
    op_dummy = torch.empty(1, dtype=params[0].dtype, device=device) \
        if lowp and params[0].dtype in (torch.bfloat16, torch.float16) else None
    works = [p if p.is_contiguous() else p.contiguous() for p in params]
    plan = BucketPlan(params, states, layouts)  # whole moments first: summed as a prefix of the buffer
    shapes, proj = plan.shapes, plan.proj
    rects, bases, gs = {}, {}, {}
    # The middle products of a full projection, T = P^T G (phase 1) and W = N Q (phase 3), both (B, a, n) for a
    # piece of one rectangle, go into the scratch buffer after the plan's part, a param's T and W at the same
    # offset (its T is read before its W is written), so that such buckets replay too.
    mids, size = {}, plan.scratch_size
    for i in proj:
        rects[i] = local_rects(layouts[i], shapes[i], tuple(params[i].shape), device)
        gs[i] = grads[i] if grads[i].is_contiguous() else grads[i].contiguous()
        # Each rectangle's rows of P and columns of Q, for both phases: the state's own (no copy) where it keeps
        # the local piece's (DTensor params), else gathered once.
        bases[i] = [tuple(b.contiguous() if b is not None else None
                          for b in local_bases(states[i], shapes[i], rect)) for rect in rects[i]]
        if len(rects[i]) == 1 and None not in bases[i][0]:
            nb, _, n = rects[i][0].view(gs[i]).shape
            mids[i] = (size, (nb, bases[i][0][0].shape[2], n))
            size += math.prod(mids[i][1])
    buf = _scratch(size, acc, device)
    rs = plan.views(buf)

    def middle(i, shape):
        """T or W of a full projection: in the scratch buffer, or (a piece of several rectangles) its own."""
        if i not in mids:
            return _scratch(shape, acc, device)
        at, want = mids[i]
        assert tuple(shape) == want, (shape, want)
        return buf[at:at + math.prod(want)].view(want)

    firsts, seconds = {}, {}  # jobs launched together (_Launch.matmul's and adam's `group`)
    tables = _Tables(cache)
    launch = lambda step: _Launch(step, hyper, inv_scale, found_inf, weight_decay,  # noqa: E731
                                  acc == torch.float64, dummy, op_dummy, precision, scratch=buf, tables=tables,
                                  record=record)
    # Phase 1: every projected param's (partial) R into one flat buffer.
    zeros = []  # ranges of buf zeroed before the grouped products write a part of them
    # Ranges zeroed right away (R of a param whose products rect.place adds in): a step that replays had no such
    # products (they write buffers of their own, which no record keeps) but may have had empty pieces, whose R
    # is zeros here.
    cleared = []
    for i in proj:
        run = launch(states[i]["step"])
        start, off = plan.starts[i], plan.starts[i] + rs[i].numel()
        g = gs[i]
        # Where the param's product goes: the whole R (a whole param), the view of R at a single rectangle's
        # rows or columns (a Shard(d) piece: the rest of R is zeros here, summed over the ranks), or, for
        # several rectangles or scattered indices, a buffer of its own that rect.place adds into R.
        into = None
        if len(rects[i]) == 1:
            left, right = bases[i][0]
            into = rects[i][0].target(rs[i], rows=left is None, cols=right is None)
        if into is None:  # now: rect.place adds into it below (a replay zeroes it with the others, see `cleared`)
            rs[i].zero_()
            cleared.append((start, off))
        elif into.numel() < rs[i].numel():  # zeroed with its neighbours in the buffer, in one op
            if zeros and zeros[-1][1] == start:
                zeros[-1] = (zeros[-1][0], off)
            else:
                zeros.append((start, off))
        for rect, (left, right) in zip(rects[i], bases[i]):
            g3 = rect.view(g)
            nb, m, n = g3.shape
            a = left.shape[2] if left is not None else m
            b = right.shape[1] if right is not None else n
            part = into if into is not None else _scratch((nb, a, b), acc, device)
            # Products into R join the bucket's launches (first products, then second ones); those into a buffer
            # of their own go now, since rect.place reads them.
            first, second = (firsts, seconds) if into is not None else (None, None)
            if left is not None and right is not None:
                t = middle(i, (nb, a, n))
                run.matmul(left.transpose(1, 2), g3, t, scale_input=True, group=first)
                run.matmul(t, right.transpose(1, 2), part, group=second)
            elif left is not None:
                run.matmul(left.transpose(1, 2), g3, part, scale_input=True, group=first)
            else:
                run.matmul(g3, right.transpose(1, 2), part, scale_input=True, group=first)
            if into is None:
                rect.place(rs[i], part, rows=left is None, cols=right is None)
    for lo, hi in zeros:
        buf[lo:hi].zero_()
    _Launch.flush(firsts)
    _Launch.flush(seconds)
    if record is not None:
        record.cuts.append(len(record.launches))
    mine = yield from plan.reduce(buf, sharded)
    # Phase 2: Adam (N over R, in place: over the rows kept here for sharded moments); plain AdamW, with the
    # update, for the params without a projection.
    for i, (p, g, s, work) in enumerate(zip(params, grads, states, works)):
        run = launch(s["step"])
        if i not in rs:
            run.adam(g.contiguous(), s, work, apply=True, block_size=block_size, scale_input=True, group=firsts)
        else:
            r = mine.get(i, rs[i])
            run.adam(r, s, r, apply=False, block_size=block_size, scale_input=False, group=firsts)
    _Launch.flush(firsts)
    for i, (p, work) in enumerate(zip(params, works)):
        if i not in rs and work is not p:
            p.copy_(work)
    if record is not None:
        record.cuts.append(len(record.launches))
    yield from plan.gather()
    # Phase 3: the back-projection fused with the update of each rectangle.
    for i in proj:
        s, p, work, r = states[i], params[i], works[i], rs[i]
        run = launch(s["step"])
        for rect, (left, right) in zip(rects[i], bases[i]):
            nloc = rect.pick(r, rows=left is None, cols=right is None)  # a view where it can be: any strides
            p3 = rect.view(work)
            if left is not None and right is not None:
                w = middle(i, (nloc.shape[0], nloc.shape[1], right.shape[2]))
                run.matmul(nloc, right, w, group=firsts)
                run.matmul(left, w, p3, update=True, group=seconds)
            elif left is not None:
                run.matmul(left, nloc, p3, update=True, group=seconds)
            else:
                run.matmul(nloc, right, p3, update=True, group=seconds)
    _Launch.flush(firsts)
    _Launch.flush(seconds)
    for i in proj:
        if works[i] is not params[i]:
            params[i].copy_(works[i])
    if record is not None:
        record.size, record.zeros, record.plan, record.sharded = size, zeros + cleared, plan, sharded
        if record.complete():
            cache["replay"] = record
        else:
            cache.pop("replay", None)
