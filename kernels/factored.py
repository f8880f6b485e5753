"""Factored second-moment statistics shared by Adafactor and CAME.

Every factored param is a batch of matrices (B, R, C) (the last two dims; leading dims flattened into B).
Three multi-tensor kernels, each one launch for all factored params of a bucket:

- `_sq_stats_kernel`: one program per (param, b, block of BLOCK_R rows) sweeps the rows' columns once and
  writes the rows' sums of x^2 (x = the gradient, or CAME's instability) and its partial column sums.
  Writing partials instead of atomically adding them keeps every step deterministic, so a resumed run is
  bit-identical to an uninterrupted one.
- `_col_reduce_kernel`: adds the partial column sums of a (param, b) into its column sums.
- `_factor_kernel`: one program per (param, b) turns the (all-reduced) sums into the new row and column
  factors R_t, C_t (exponential moving averages of the means of x^2 + eps), stores them as state, and
  overwrites the sums with what the update multiplies by: rsqrt(R_t / mean(R_t)) and rsqrt(C_t).

Layout of the flat statistics buffer for param i: rows at meta.row_off (B*R), cols at meta.col_off (B*C).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import INTERPRET, keep_limit, load_ptr, program_table, tile_shape, to_device

# Columns of the int64 meta table, one row per factored param.
# B, R, C: the matrix batch; *_OFF: offsets into the stats and partials buffers; *_START: the param's first
# program in each kernel's program table.
M_B, M_R, M_C, M_ROW_OFF, M_COL_OFF, M_PART_OFF, M_PROG_START, M_COLPROG_START, M_FACTPROG_START = range(9)
META_WIDTH = 9


@triton.jit
def load_meta(meta_ptr, i):
    base = meta_ptr + i * 9
    return (tl.load(base + 0), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3), tl.load(base + 4),
            tl.load(base + 5), tl.load(base + 6), tl.load(base + 7), tl.load(base + 8))


@triton.jit
def row_block(meta_ptr, prog_param_ptr, pid, BLOCK_R: tl.constexpr):
    """What program `pid` of a row-block grid works on: param i (its B, R, C and buffer offsets), matrix b of
    its batch, rows [rb * BLOCK_R, (rb + 1) * BLOCK_R)."""
    i = tl.load(prog_param_ptr + pid)
    B, R, C, row_off, col_off, part_off, prog_start, _cps, _fps = load_meta(meta_ptr, i)
    nrb = tl.cdiv(R, BLOCK_R)
    local = pid - prog_start
    return i, B, R, C, row_off, col_off, part_off, local // nrb, local % nrb


@triton.jit
def _sq_stats_kernel(x_ptrs, x_ref, meta_ptr, prog_param_ptr, stats_ptr, parts_ptr, inv_scale_ptr,
                     HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    i, B, R, C, row_off, col_off, part_off, b, rb = row_block(meta_ptr, prog_param_ptr, pid, BLOCK_R)
    x_ptr = load_ptr(x_ptrs, i, x_ref)
    acc_t = stats_ptr.dtype.element_ty
    inv = 1.0
    if HAS_SCALE:
        inv = tl.load(inv_scale_ptr)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    row_base = (b * R + rows).to(tl.int64) * C
    part_base = part_off + (b * tl.cdiv(R, BLOCK_R) + rb).to(tl.int64) * C
    acc_r = tl.zeros([BLOCK_R], dtype=acc_t)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        x = tl.load(x_ptr + row_base[:, None] + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        x = x.to(acc_t) * inv
        sq = x * x
        acc_r += tl.sum(sq, 1)
        tl.store(parts_ptr + part_base + cols, tl.sum(sq, 0), mask=cmask)
    tl.store(stats_ptr + row_off + b * R + rows, acc_r, mask=rmask)


@triton.jit
def _col_reduce_kernel(meta_ptr, prog_param_ptr, stats_ptr, parts_ptr, BLOCK_R: tl.constexpr,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.load(prog_param_ptr + pid)
    B, R, C, row_off, col_off, part_off, _ps, colprog_start, _fps = load_meta(meta_ptr, i)
    nrb = tl.cdiv(R, BLOCK_R)
    ncb = tl.cdiv(C, BLOCK)
    local = pid - colprog_start
    b = local // ncb
    cols = (local % ncb) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < C
    acc = tl.zeros([BLOCK], dtype=stats_ptr.dtype.element_ty)
    for rb in range(0, nrb):
        acc += tl.load(parts_ptr + part_off + (b * nrb + rb).to(tl.int64) * C + cols, mask=cmask, other=0.0)
    tl.store(stats_ptr + col_off + b * C + cols, acc, mask=cmask)


@triton.jit
def _factor_kernel(meta_ptr, prog_param_ptr, stats_ptr, row_ptrs, col_ptrs, step_ptrs, found_inf_ptr, beta, decay_rate, eps,
                   hyper_ptr, BETA_FROM_STEP: tl.constexpr, HAS_INF: tl.constexpr, HYPER_FROM_PTR: tl.constexpr,
                   BLOCK: tl.constexpr):
    """R_t = b R + (1-b)(rowsum/C + eps), C_t likewise; stats <- rsqrt(R_t/mean R_t), rsqrt(C_t).

    b is `beta`, or 1 - step^decay_rate with BETA_FROM_STEP (Adafactor's schedule, eq. 7). With
    HYPER_FROM_PTR, (b, 1 - b, eps) are read from hyper_ptr[0:3] instead, a tensor of the stats dtype
    filled on the host in float64: compiled Triton passes Python floats as fp32, and 1 - b formed from an
    fp32 b = 0.9999 is off by 1.7e-4 relative.
    """
    pid = tl.program_id(0)
    i = tl.load(prog_param_ptr + pid)
    B, R, C, row_off, col_off, _po, _ps, _cps, factprog_start = load_meta(meta_ptr, i)
    b = pid - factprog_start
    acc_t = stats_ptr.dtype.element_ty
    R_keep = keep_limit(R, found_inf_ptr, HAS_INF)
    C_keep = keep_limit(C, found_inf_ptr, HAS_INF)
    bt = beta
    if BETA_FROM_STEP:
        step = tl.load(tl.load(step_ptrs + i).to(tl.pointer_type(tl.float32))).to(acc_t)
        bt = 1.0 - tl.exp(decay_rate * tl.log(step))
    omb = 1.0 - bt
    if HYPER_FROM_PTR:
        bt = tl.load(hyper_ptr).to(acc_t)
        omb = tl.load(hyper_ptr + 1).to(acc_t)
        eps = tl.load(hyper_ptr + 2).to(acc_t)
    row_state = load_ptr(row_ptrs, i, stats_ptr) + b * R
    col_state = load_ptr(col_ptrs, i, stats_ptr) + b * C
    rstats = stats_ptr + row_off + b * R
    cstats = stats_ptr + col_off + b * C
    total = tl.zeros([BLOCK], dtype=acc_t)
    for r0 in range(0, R, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        m = r < R
        new = bt * tl.load(row_state + r, mask=m, other=0.0) + omb * (
            tl.load(rstats + r, mask=m, other=0.0) / C + eps)
        new = tl.where(m, new, 0.0)
        tl.store(row_state + r, new, mask=r < R_keep)
        tl.store(rstats + r, new, mask=m)
        total += new
    mean = tl.sum(total, 0) / R
    for r0 in range(0, R, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        m = r < R
        v = tl.load(rstats + r, mask=m, other=1.0)
        tl.store(rstats + r, 1.0 / tl.sqrt(v / mean), mask=m)
    for c0 in range(0, C, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < C
        new = bt * tl.load(col_state + c, mask=m, other=0.0) + omb * (
            tl.load(cstats + c, mask=m, other=0.0) / R + eps)
        tl.store(col_state + c, new, mask=c < C_keep)
        tl.store(cstats + c, 1.0 / tl.sqrt(new), mask=m)


@triton.jit
def _usq_kernel(g_ptrs, g_ref, p_ptrs, meta_ptr, prog_param_ptr, stats_ptr, part_ptr, inv_scale_ptr,
                HAS_SCALE: tl.constexpr, WIDTH: tl.constexpr, SCALE_PARAM: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """part[pid * WIDTH] = sum over the program's rows of U^2, U = G rsqrt(R_t / mean R_t) rsqrt(C_t) (the
    factors `_factor_kernel` left in stats); with WIDTH 2 also part[pid * 2 + 1] = the rows' sum of X^2
    (zero unless SCALE_PARAM)."""
    pid = tl.program_id(0)
    i, B, R, C, row_off, col_off, _po, b, rb = row_block(meta_ptr, prog_param_ptr, pid, BLOCK_R)
    acc_t = stats_ptr.dtype.element_ty
    g_ptr = load_ptr(g_ptrs, i, g_ref)
    p_ptr = load_ptr(p_ptrs, i, g_ref)
    inv = 1.0
    if HAS_SCALE:
        inv = tl.load(inv_scale_ptr)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    rfac = tl.load(stats_ptr + row_off + b * R + rows, mask=rmask, other=0.0)
    row_base = (b * R + rows).to(tl.int64) * C
    u_acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=acc_t)
    p_acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=acc_t)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        mask = rmask[:, None] & cmask[None, :]
        offs = row_base[:, None] + cols[None, :]
        cfac = tl.load(stats_ptr + col_off + b * C + cols, mask=cmask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_t) * inv
        u = g * rfac[:, None] * cfac[None, :]
        u_acc += u * u
        if SCALE_PARAM:
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
            p_acc += p * p
    tl.store(part_ptr + pid * WIDTH, tl.sum(tl.sum(u_acc, 1), 0))
    if WIDTH == 2:
        tl.store(part_ptr + pid * 2 + 1, tl.sum(tl.sum(p_acc, 1), 0))


def launch_sq_stats(x_ptrs, x_ref, plan, stats, parts, inv_scale):
    _sq_stats_kernel[(plan.n_progs,)](x_ptrs, x_ref, plan.meta, plan.prog_param, stats, parts,
                                      inv_scale if inv_scale is not None else stats,
                                      HAS_SCALE=inv_scale is not None, BLOCK_R=plan.block_r, BLOCK_C=plan.block_c)
    _col_reduce_kernel[(plan.n_colprogs,)](plan.meta, plan.colprog_param, stats, parts, BLOCK_R=plan.block_r,
                                           BLOCK=plan.block_col)


def launch_usq(g_ptrs, g_ref, p_ptrs, plan, stats, part, inv_scale, *, width: int, scale_parameter: bool = False):
    _usq_kernel[(plan.n_progs,)](g_ptrs, g_ref, p_ptrs, plan.meta, plan.prog_param, stats, part,
                                 inv_scale if inv_scale is not None else stats, HAS_SCALE=inv_scale is not None,
                                 WIDTH=width, SCALE_PARAM=scale_parameter, BLOCK_R=plan.block_r,
                                 BLOCK_C=plan.block_c)


def launch_factors(plan, stats, row_ptrs, col_ptrs, step_ptrs, found_inf, *, beta=0.0, decay_rate=0.0, eps=0.0,
                   beta_from_step: bool, hyper=None):
    """`hyper`: optional tensor of stats' dtype holding (beta, 1 - beta, eps), used instead of the floats."""
    _factor_kernel[(plan.n_factprogs,)](plan.meta, plan.factprog_param, stats, row_ptrs, col_ptrs, step_ptrs,
                                             found_inf if found_inf is not None else stats, beta, decay_rate, eps,
                                             hyper if hyper is not None else stats,
                                             BETA_FROM_STEP=beta_from_step, HAS_INF=found_inf is not None,
                                             HYPER_FROM_PTR=hyper is not None, BLOCK=plan.block_vec)


@dataclass
class FactoredPlan:
    """Tables for the factored kernels over a list of params viewed as (B, R, C); see kernels/factored.py."""
    n: int
    meta: torch.Tensor
    prog_param: torch.Tensor
    colprog_param: torch.Tensor
    factprog_param: torch.Tensor
    n_progs: int
    n_colprogs: int
    n_factprogs: int
    block_r: int
    block_c: int
    block_col: int
    block_vec: int
    stats_numel: int
    parts_numel: int
    prog_starts: list

    @staticmethod
    def build(shapes: list[tuple[int, int, int]], device: torch.device) -> "FactoredPlan":
        block_r, block_c = tile_shape(max(c for _, _, c in shapes))
        if INTERPRET:
            block_r, block_c = min(block_r, 16), min(block_c, 64)
        block_col = 64 if INTERPRET else 256
        meta, progs, colprogs, factprogs = [], [], [], []
        row_off = part_off = 0
        for b, r, c in shapes:
            progs.append(b * triton.cdiv(r, block_r))
            colprogs.append(b * triton.cdiv(c, block_col))
            factprogs.append(b)
        prog_param, prog_starts = program_table(progs, device)
        colprog_param, colprog_starts = program_table(colprogs, device)
        factprog_param, factprog_starts = program_table(factprogs, device)
        col_total = sum(b * r for b, r, _ in shapes)
        col_off = col_total
        for k, (b, r, c) in enumerate(shapes):
            meta += [b, r, c, row_off, col_off, part_off, prog_starts[k], colprog_starts[k], factprog_starts[k]]
            row_off += b * r
            col_off += b * c
            part_off += b * triton.cdiv(r, block_r) * c
        return FactoredPlan(len(shapes), to_device(meta, torch.int64, device), prog_param, colprog_param,
                            factprog_param, sum(progs), sum(colprogs), sum(factprogs), block_r, block_c, block_col,
                            256 if INTERPRET else 1024, col_off, part_off, prog_starts)
