"""Fused multi-tensor CAME (the math: fastopt/reference/came.py).

Launches per step, each covering every param of the bucket (their number does not grow with the params):

  factored (ndim >= 2)                           unfactored (vectors, scalars)
  1 _sq_stats_kernel   G^2 rows/col partials     -
  2 _col_reduce_kernel col sums                  -
    [yield stats: summed over the ranks, one collective]
  3 _factor_kernel     R_t, C_t, factors (b2)    -
  4 _usq_kernel        partial sums of U^2       4' _vec_stats_kernel  V_t, partial sums of U^2
  5 _segment_sum_kernel per-param sums of U^2
    [yield sums: summed over the ranks, one collective]
  6 _res_stats_kernel  clip, M_t (stored),       6' _vec_apply_kernel  clip, M_t, decay, write X
                       (U-M)^2 rows/col partials
  7 _col_reduce_kernel col sums of (U-M)^2
    [yield res: summed over the ranks, one collective]
  8 _factor_kernel     R'_t, C'_t, factors (b3)
  9 _apply_kernel      decay, write X

The gradient is read three times (statistics, RMS of the update, update and instability) and M twice: the
RMS clip needs the sum of U^2 over the whole (possibly sharded) matrix before M may be formed, and the
confidence factors need the instability of the whole matrix before any element of X may be written.
Kernels 1-3 and 7-8 are the shared factored-statistics kernels of kernels/factored.py; kernel 6 writes the
instability statistics in exactly the layout of _sq_stats_kernel, so 7 and 8 reuse them unchanged.

nbits=8 (M as uint8 codes of bitsandbytes' signed dynamic map plus one fp32 absmax per QBLOCK elements of the
flattened param): 6 reads the codes instead of M and stores nothing; 9 and 6' become _apply8_kernel, flat
programs of whole quantization blocks that form U and M_t again from the gradient and the old codes (one more
read of the gradient, but no full-precision copy of M anywhere), write X and store M_t's codes and scales.
The codes are those of fastopt.reference.quant, bit for bit.

Sharded buckets (`layouts`) run the same launches with the factored kernels MAPPED (kernels/factored.py: local
elements, global statistics through int64 row/column maps built once per layout and cached with the plan), plus a
zero-fill of each row/column statistics buffer before it is written; RMS uses global numels. The buffers yielded to
be summed are float64 as in the reference (a float64 copy of them when the kernels accumulate in fp32). 8-bit
blocks are those of the local piece, as in the reference.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fastopt.reference.came import QBLOCK as QBLOCK_
from . import common
from .common import (FP_FUSION, INTERPRET, cached_plan, divmod_near, keep_limit, load_ptr, map_values, multiples,
                     param_of_program, program_table, ptr_table, quantize_rows, round_to, search_table, segment_sum,
                     sr_round, store_grad, to_device, unscale_factor)
from .factored import (BucketPlan, col_map, global_numel, in_piece, launch_col_reduce, launch_factors,
                       launch_sq_stats, launch_usq, load_meta, row_block, row_map, store_param_tile)

BLOCK_V = 256 if INTERPRET else 1024
QBLOCK = tl.constexpr(QBLOCK_)  # elements per 8-bit quantization block (one fp32 absmax each)
QB_PER_PROG = 1 if INTERPRET else 4
# _apply8_kernel finds the rows and columns of a factored param's elements in int32 when every R and C of the
# bucket's (B, R, C) views is below this (the offsets within a program then stay below 2^31), else in int64.
NARROW_SIDE = 1 << 30
# Hyperparameters live in a small tensor of the accumulation dtype, filled on the host in float64 with the
# 1 - beta terms and lr * weight_decay formed there, as came-pytorch forms them (compiled Triton passes
# Python floats as fp32: fp64 params would lose precision, and 1 - beta from an fp32 beta is off by up to
# 1.7e-4 relative for beta = 0.9999). H_* index it; the two _factor_kernel launches read (beta, 1 - beta, eps)
# at H_BETA2 and H_BETA3.
(H_BETA2, H_OMB2, H_EPS1, H_BETA3, H_OMB3, H_EPS2, H_BETA1, H_OMB1, H_LR, H_LR_WD,
 H_CLIP) = (tl.constexpr(k) for k in range(11))


def hyper_values(lr, eps, clip_threshold, betas, weight_decay) -> tuple:
    """The H_* entries, in float64."""
    (b1, b2, b3), (e1, e2) = (float(b) for b in betas), (float(e) for e in eps)
    return (b2, 1.0 - b2, e1, b3, 1.0 - b3, e2, b1, 1.0 - b1, float(lr), float(lr) * float(weight_decay),
            float(clip_threshold))


@triton.jit
def _load_step(step_ptrs, i, acc_t: tl.constexpr):
    return tl.load(tl.load(step_ptrs + i).to(tl.pointer_type(tl.float32))).to(acc_t)


@triton.jit
def _clip_scale(u_sq, numel, clip_threshold):
    """1 / max(1, RMS(U) / d)."""
    return 1.0 / tl.maximum(tl.sqrt(u_sq / numel) / clip_threshold, 1.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _store_param(p_ptr, offs, p, mask, step, sr_ptr, k, SR: tl.constexpr, GMAP: tl.constexpr):
    """Store p rounded to the param's dtype; SR: stochastically, with noise from (step, param id, global offset)
    (common.sr_round: row k of the bucket's sr_table), as reference/common.py's stochastic_round_bf16."""
    if SR:
        out = sr_round(p.to(tl.float32), sr_ptr, k, step, offs, mask, GMAP)
    else:
        out = round_to(p, p_ptr.dtype.element_ty)
    tl.store(p_ptr + offs, out, mask=mask)


@triton.jit
def _dequant8(code_ptr, absmax_ptr, qmap_ptr, offs, mask):
    """map[code] * absmax of the element's block, in fp32 (fastopt.reference.quant.dequantize_blockwise)."""
    code = tl.load(code_ptr + offs, mask=mask, other=0).to(tl.int32)
    absmax = tl.load(absmax_ptr + offs // QBLOCK, mask=mask, other=0.0)
    return tl.where(mask, map_values(code, qmap_ptr), 0.0) * absmax


@triton.jit
def _quant8(x, mask, qmap_ptr):
    """(codes, absmax) of the rows of a [blocks, QBLOCK] fp32 tile (common.quantize_rows), masked lanes zero."""
    return quantize_rows(tl.where(mask, x, 0.0), qmap_ptr)


@triton.jit
def _res_stats_kernel(g_ptrs, g_ref, m_ptrs, m_ref, absmax_ptrs, qmap_ptr, meta_ptr, maps_ptr, prog_param_ptr,
                      stats_ptr, sums_ptr, res_ptr, parts_ptr, inv_scale_ptr, found_inf_ptr, hyper_ptr,
                      HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, Q8: tl.constexpr, MAPPED: tl.constexpr,
                      ALIGNED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """U = clip(G rfac cfac); M_t = b1 M + (1-b1) U (stored, except with Q8: _apply8_kernel recomputes M_t
    and stores its codes); row sums and column partials of (U - M_t)^2 into `res` / `parts`, laid out as
    _sq_stats_kernel lays out those of G^2."""
    pid = tl.program_id(0)
    i, B, R, C, row_off, col_off, part_off, b, rb = row_block(meta_ptr, prog_param_ptr, pid, BLOCK_R, ALIGNED)
    acc_t = stats_ptr.dtype.element_ty
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    R_keep = keep_limit(R, found_inf_ptr, HAS_INF)
    beta1 = tl.load(hyper_ptr + H_BETA1)
    omb1 = tl.load(hyper_ptr + H_OMB1)
    scale = _clip_scale(tl.load(sums_ptr + i), global_numel(meta_ptr, i).to(acc_t), tl.load(hyper_ptr + H_CLIP))
    g_ptr = load_ptr(g_ptrs, i, g_ref, ALIGNED)
    m_ptr = load_ptr(m_ptrs, i, m_ref, ALIGNED)
    absmax_ptr = load_ptr(absmax_ptrs, i, qmap_ptr)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    row_base, rslot = row_map(meta_ptr, maps_ptr, i, b, rows, rmask, R, C, row_off, MAPPED, ALIGNED)
    rfac = tl.load(stats_ptr + rslot, mask=rmask, other=0.0) * scale
    part_base = part_off + (b * tl.cdiv(R, BLOCK_R) + rb).to(tl.int64) * C
    acc_r = tl.zeros([BLOCK_R], dtype=acc_t)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        offs = row_base[:, None] + cols[None, :]
        mask = in_piece(offs, rmask[:, None] & cmask[None, :], meta_ptr, i, MAPPED, ALIGNED)
        cfac = tl.load(stats_ptr + col_map(meta_ptr, maps_ptr, i, b, cols, cmask, C, col_off, MAPPED), mask=cmask,
                       other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_t) * inv
        u = g * rfac[:, None] * cfac[None, :]
        if Q8:
            m = beta1 * _dequant8(m_ptr, absmax_ptr, qmap_ptr, offs, mask).to(acc_t) + omb1 * u
        else:
            keep = in_piece(offs, (rows < R_keep)[:, None] & cmask[None, :], meta_ptr, i, MAPPED, ALIGNED)
            m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + omb1 * u
            tl.store(m_ptr + offs, m, mask=keep)
            store_grad(g_ptr, offs, g, keep, HAS_SCALE)  # the last pass that reads it (Q8: _apply8_kernel)
        d = u - m
        sq = d * d
        acc_r += tl.sum(sq, 1)
        tl.store(parts_ptr + part_base + cols, tl.sum(sq, 0), mask=cmask)
    tl.store(res_ptr + rslot, acc_r, mask=rmask)


@triton.jit
def _apply_kernel(p_ptrs, p_ref, m_ptrs, step_ptrs, meta_ptr, maps_ptr, prog_param_ptr, res_ptr, found_inf_ptr,
                  hyper_ptr, sr_ptr, HAS_INF: tl.constexpr, HAS_WD: tl.constexpr, SR: tl.constexpr,
                  MAPPED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """X_t = X - lr wd X - lr M_t rsqrt(R'_t / mean R'_t) rsqrt(C'_t)."""
    pid = tl.program_id(0)
    i, B, R, C, row_off, col_off, _po, b, rb = row_block(meta_ptr, prog_param_ptr, pid, BLOCK_R, ALIGNED)
    acc_t = res_ptr.dtype.element_ty
    R_keep = keep_limit(R, found_inf_ptr, HAS_INF)
    lr = tl.load(hyper_ptr + H_LR)
    lr_wd = tl.load(hyper_ptr + H_LR_WD)
    step = _load_step(step_ptrs, i, acc_t)
    p_ptr = load_ptr(p_ptrs, i, p_ref, ALIGNED)
    m_ptr = load_ptr(m_ptrs, i, res_ptr, ALIGNED)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    row_base, rslot = row_map(meta_ptr, maps_ptr, i, b, rows, rmask, R, C, row_off, MAPPED, ALIGNED)
    rfac = tl.load(res_ptr + rslot, mask=rmask, other=0.0) * lr
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        offs = row_base[:, None] + cols[None, :]
        mask = in_piece(offs, rmask[:, None] & cmask[None, :], meta_ptr, i, MAPPED, ALIGNED)
        cslot = col_map(meta_ptr, maps_ptr, i, b, cols, cmask, C, col_off, MAPPED)
        cfac = tl.load(res_ptr + cslot, mask=cmask, other=0.0)
        u = tl.load(m_ptr + offs, mask=mask, other=0.0) * rfac[:, None] * cfac[None, :]
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
        if HAS_WD:
            p = p - lr_wd * p - u
        else:
            p = p - u
        keep = in_piece(offs, (rows < R_keep)[:, None] & cmask[None, :], meta_ptr, i, MAPPED, ALIGNED)
        store_param_tile(p_ptr, offs, p, keep, meta_ptr, i, rslot, row_off, cslot, col_off, step, sr_ptr, SR, MAPPED)


@triton.jit
def _vec_stats_kernel(g_ptrs, g_ref, v_ptrs, vmeta_ptr, prog_param_ptr, part_ptr, part_base, inv_scale_ptr,
                      found_inf_ptr, hyper_ptr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
                      ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """V_t = b2 V + (1-b2)(G^2 + eps1) (stored); partial sums of (G / sqrt(V_t))^2."""
    pid = tl.program_id(0)
    j, n, prog_start, _third = param_of_program(vmeta_ptr, prog_param_ptr, ALIGNED)
    offs = (pid - prog_start).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    keep = offs < keep_limit(n, found_inf_ptr, HAS_INF)
    beta2 = tl.load(hyper_ptr + H_BETA2)
    omb2 = tl.load(hyper_ptr + H_OMB2)
    eps1 = tl.load(hyper_ptr + H_EPS1)
    acc_t = part_ptr.dtype.element_ty
    g = tl.load(load_ptr(g_ptrs, j, g_ref, ALIGNED) + offs, mask=m, other=0.0).to(acc_t) * inv
    v_ptr = load_ptr(v_ptrs, j, part_ptr, ALIGNED)
    v = beta2 * tl.load(v_ptr + offs, mask=m, other=0.0) + omb2 * (g * g + eps1)
    tl.store(v_ptr + offs, v, mask=keep)
    u = tl.where(m, g / tl.sqrt(v), 0.0)
    tl.store(part_ptr + part_base + pid, tl.sum(u * u, 0))


@triton.jit
def _vec_apply_kernel(g_ptrs, g_ref, p_ptrs, p_ref, v_ptrs, m_ptrs, step_ptrs, vmeta_ptr, prog_param_ptr, sums_ptr,
                      sums_base, inv_scale_ptr, found_inf_ptr, hyper_ptr, sr_ptr, HAS_SCALE: tl.constexpr,
                      HAS_INF: tl.constexpr, HAS_WD: tl.constexpr, SR: tl.constexpr, GMAP: tl.constexpr,
                      ALIGNED: tl.constexpr,
                      BLOCK: tl.constexpr):
    """U = clip(G / sqrt(V_t)); M_t = b1 M + (1-b1) U (stored); X_t = X - lr wd X - lr M_t."""
    pid = tl.program_id(0)
    j, n, prog_start, _third = param_of_program(vmeta_ptr, prog_param_ptr, ALIGNED)
    acc_t = sums_ptr.dtype.element_ty
    offs = (pid - prog_start).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    keep = offs < keep_limit(n, found_inf_ptr, HAS_INF)
    beta1 = tl.load(hyper_ptr + H_BETA1)
    omb1 = tl.load(hyper_ptr + H_OMB1)
    lr = tl.load(hyper_ptr + H_LR)
    lr_wd = tl.load(hyper_ptr + H_LR_WD)
    step = _load_step(step_ptrs, j, acc_t)
    scale = _clip_scale(tl.load(sums_ptr + sums_base + j), tl.load(vmeta_ptr + j * 3 + 2).to(acc_t),
                        tl.load(hyper_ptr + H_CLIP))
    v = tl.load(load_ptr(v_ptrs, j, sums_ptr, ALIGNED) + offs, mask=mask, other=1.0)
    g_ptr = load_ptr(g_ptrs, j, g_ref, ALIGNED)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_t) * inv
    store_grad(g_ptr, offs, g, keep, HAS_SCALE)  # the last pass that reads it
    u = g / tl.sqrt(v) * scale
    m_ptr = load_ptr(m_ptrs, j, sums_ptr, ALIGNED)
    u = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + omb1 * u
    tl.store(m_ptr + offs, u, mask=keep)
    p_ptr = load_ptr(p_ptrs, j, p_ref, ALIGNED)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
    if HAS_WD:
        p = p - lr_wd * p - lr * u
    else:
        p = p - lr * u
    _store_param(p_ptr, offs, p, keep, step, sr_ptr, sums_base + j, SR, GMAP)


@triton.jit
def _apply8_kernel(g_ptrs, g_ref, p_ptrs, p_ref, code_ptrs, code_ref, absmax_ptrs, v_ptrs, step_ptrs, qmeta_ptr,
                   prog_param_ptr, meta_ptr, maps_ptr, stats_ptr, res_ptr, sums_ptr, sums_base, qmap_ptr,
                   inv_scale_ptr, found_inf_ptr, hyper_ptr, sr_ptr, FACTORED: tl.constexpr,
                   HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, HAS_WD: tl.constexpr, SR: tl.constexpr,
                   GMAP: tl.constexpr,
                   MAPPED: tl.constexpr, NARROW: tl.constexpr, ALIGNED: tl.constexpr, QB_PER_PROG: tl.constexpr):
    """nbits=8, one program per QB_PER_PROG quantization blocks of a param (flat, any shape): U = clip(G rfac
    cfac) (or clip(G / sqrt(V_t))), M_t = b1 M + (1-b1) U from the dequantized M, X_t = X - lr wd X -
    lr M_t rres cres (or - lr M_t), and M_t's codes and block scales stored. U and M_t are formed exactly as
    _res_stats_kernel formed them, so the instability statistics describe this M_t."""
    pid = tl.program_id(0)
    j, n, prog_start, _third = param_of_program(qmeta_ptr, prog_param_ptr, ALIGNED)
    acc_t = sums_ptr.dtype.element_ty
    blk0 = (pid - prog_start).to(tl.int64) * QB_PER_PROG
    blk = blk0 + tl.arange(0, QB_PER_PROG)
    offs = blk[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    mask = offs < n
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    n_keep = keep_limit(n, found_inf_ptr, HAS_INF)
    beta1 = tl.load(hyper_ptr + H_BETA1)
    omb1 = tl.load(hyper_ptr + H_OMB1)
    lr = tl.load(hyper_ptr + H_LR)
    lr_wd = tl.load(hyper_ptr + H_LR_WD)
    step = _load_step(step_ptrs, j, acc_t)
    scale = _clip_scale(tl.load(sums_ptr + sums_base + j), tl.load(qmeta_ptr + j * 3 + 2).to(acc_t),
                        tl.load(hyper_ptr + H_CLIP))
    g_ptr = load_ptr(g_ptrs, j, g_ref, ALIGNED)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_t) * inv
    store_grad(g_ptr, offs, g, offs < n_keep, HAS_SCALE)  # the last pass that reads it
    if FACTORED:
        B, R, C, row_off, col_off, _po, _ps, _cps, _fps = load_meta(meta_ptr, j)
        # The element at offs (view element vo, MAPPED) is in row vo // C (b * R + r) and column b * C + vo % C of
        # the (B, R, C) view, b = vo // (R C): from the program's first element's row and column (two scalar
        # divisions) and divmod_near of the offsets within the program.
        first = blk0 * QBLOCK + tl.load(meta_ptr + j * 16 + 12) if MAPPED else blk0 * QBLOCK
        row0 = first // C
        b0 = row0 // R
        local = tl.arange(0, QB_PER_PROG)[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]  # offs - blk0 QBLOCK
        if NARROW:  # every R and C of the plan below NARROW_SIDE: int32 offsets within the program
            dr, c = divmod_near((first - row0 * C).to(tl.int32) + local, C.to(tl.int32), 1.0 / C.to(tl.float32))
            db, _r = divmod_near((row0 - b0 * R).to(tl.int32) + dr, R.to(tl.int32), 1.0 / R.to(tl.float32))
        else:
            dr, c = divmod_near((first - row0 * C) + local, C, 1.0 / C.to(tl.float32))
            db, _r = divmod_near((row0 - b0 * R) + dr, R, 1.0 / R.to(tl.float32))
        row = row0 + dr
        col = (b0 + db) * C + c
        if MAPPED:  # view rows and columns -> global row and column slots
            row = tl.load(maps_ptr + tl.load(meta_ptr + j * 16 + 14) + row, mask=mask, other=0)
            col = tl.load(maps_ptr + tl.load(meta_ptr + j * 16 + 15) + col, mask=mask, other=0)
        rfac = tl.load(stats_ptr + row_off + row, mask=mask, other=0.0) * scale
        u = g * rfac * tl.load(stats_ptr + col_off + col, mask=mask, other=0.0)
    else:
        v = tl.load(load_ptr(v_ptrs, j, sums_ptr, ALIGNED) + offs, mask=mask, other=1.0)
        u = g / tl.sqrt(v) * scale
    code_ptr = load_ptr(code_ptrs, j, code_ref, ALIGNED)
    absmax_ptr = load_ptr(absmax_ptrs, j, qmap_ptr)
    m = beta1 * _dequant8(code_ptr, absmax_ptr, qmap_ptr, offs, mask).to(acc_t) + omb1 * u
    if FACTORED:
        upd = m * (tl.load(res_ptr + row_off + row, mask=mask, other=0.0) * lr) * tl.load(
            res_ptr + col_off + col, mask=mask, other=0.0)
    else:
        upd = lr * m
    p_ptr = load_ptr(p_ptrs, j, p_ref, ALIGNED)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
    if HAS_WD:
        p = p - lr_wd * p - upd
    else:
        p = p - upd
    keep = offs < n_keep
    _store_param(p_ptr, offs, p, keep, step, sr_ptr, sums_base + j, SR, GMAP)
    codes, absmax = _quant8(m.to(tl.float32), mask, qmap_ptr)
    tl.store(code_ptr + offs, codes, mask=keep)
    tl.store(absmax_ptr + blk, absmax, mask=blk * QBLOCK < n_keep)


class CAMEPlan(BucketPlan):
    """Everything about a bucket that stays fixed between steps: tables and scratch buffers. The partial sums are
    sum U^2 per program and per param; `res`, the instability statistics, is laid out as `stats`."""

    def __init__(self, params, states, device, acc_dtype, nbits, layouts=None):
        super().__init__(params, states, device, acc_dtype, layouts, BLOCK_V, 1)
        st = [states[k] for k in self.order]
        nf = self.n_fac
        self.m_ptrs = ptr_table([s["exp_avg"] for s in st], device)
        self.sq_row_ptrs = ptr_table([s["exp_avg_sq_row"] for s in st[:nf]], device)
        self.sq_col_ptrs = ptr_table([s["exp_avg_sq_col"] for s in st[:nf]], device)
        self.res_row_ptrs = ptr_table([s["exp_avg_res_row"] for s in st[:nf]], device)
        self.res_col_ptrs = ptr_table([s["exp_avg_res_col"] for s in st[:nf]], device)
        self.v_ptrs = ptr_table([s["exp_avg_sq"] for s in st[nf:]], device)
        self.fac_numel_aligned = multiples(params[k].numel() for k in self.fac)
        self.res = torch.empty_like(self.stats)
        if nbits == 8:
            self.absmax_ptrs = ptr_table([s["exp_avg_absmax"] for s in st], device)
            self.qmap = search_table(True, device)
            per_prog = QBLOCK_ * QB_PER_PROG
            self.qtables = []
            for ks in (self.fac, self.vec):
                progs = [common.cdiv(params[k].numel(), per_prog) for k in ks]
                prog_param, qstarts = program_table(progs, device)
                qmeta = to_device([x for k, q in zip(ks, qstarts)
                                   for x in (params[k].numel(), q, math.prod(self.gshapes[k]))], torch.int64, device)
                self.qtables.append((sum(progs), prog_param, qmeta))

    def scratch(self):
        return (self.stats, self.res, self.part, self.sums)


def came_phases(params, grads, states, *, lr, eps, clip_threshold, betas, weight_decay, bf16_stochastic_round=False,
                nbits=32, inv_scale=None, found_inf=None, sharded=False, cache=None, layouts=None, sr_ids=None):
    """One step over a bucket, a generator that yields each buffer to be summed over the ranks that share the
    params when `sharded` (fastopt.distributed.phases). `sr_ids`: the params' ids seeding the stochastic rounding
    (None: their positions in the bucket)."""
    device = params[0].device
    acc_dtype = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    plan = cached_plan(cache, ("came",), params, states, layouts,
                       lambda: CAMEPlan(params, states, device, acc_dtype, nbits, layouts))
    if common.POISON:
        for buf in plan.scratch():
            buf.fill_(float("nan"))
    hyper = plan.hyper(hyper_values(lr, eps, clip_threshold, betas, weight_decay))
    g_ptrs = plan.grad_table([grads[k] for k in plan.order], device)
    g_ref = grads[0]
    p_ref = params[0]
    al = plan.tensors_aligned and plan.grad_table.aligned
    al_vec = al and plan.vec_sizes_aligned
    flags = dict(HAS_SCALE=inv_scale is not None, HAS_INF=found_inf is not None)
    inv_arg = inv_scale if inv_scale is not None else plan.sums
    inf_arg = found_inf if found_inf is not None else plan.sums
    sr = bf16_stochastic_round and p_ref.dtype == torch.bfloat16
    fp = plan.fplan
    nf = plan.n_fac
    if fp is not None:
        blocks = dict(BLOCK_R=fp.block_r, BLOCK_C=fp.block_c)
        parts = plan.new_parts()
        launch_sq_stats(g_ptrs, g_ref, fp, plan.stats, parts, inv_scale, aligned=al)
        if sharded:
            yield from common.sum_fp64(plan.stats)
        launch_factors(fp, plan.stats, plan.sq_row_ptrs, plan.sq_col_ptrs, plan.step_ptrs, found_inf,
                       beta_from_step=False, hyper=hyper[H_BETA2:])
        launch_usq(g_ptrs, g_ref, g_ptrs, fp, plan.stats, plan.part, inv_scale, width=1, aligned=al)
    if plan.n_vprogs:
        _vec_stats_kernel[(plan.n_vprogs,)](g_ptrs[nf:], g_ref, plan.v_ptrs, plan.vmeta, plan.vprog_param, plan.part,
                                            plan.fac_progs, inv_arg, inf_arg, hyper, ALIGNED=al_vec, BLOCK=BLOCK_V,
                                            **flags, **FP_FUSION)
    segment_sum(plan.part, plan.seg_start, plan.seg_len, plan.sums, 1)
    if sharded:
        yield from common.sum_fp64(plan.sums)
    q8 = nbits == 8
    m_ref = states[plan.order[0]]["exp_avg"]
    absmax_ptrs = plan.absmax_ptrs if q8 else plan.m_ptrs
    qmap = plan.qmap if q8 else plan.sums
    sr_arg, gmap = plan.sr(sr_ids) if sr else (plan.sums, 0)
    consts = dict(HAS_WD=weight_decay != 0, SR=sr, GMAP=gmap, **flags)
    if plan.n_vprogs and not q8:
        _vec_apply_kernel[(plan.n_vprogs,)](g_ptrs[nf:], g_ref, plan.p_ptrs[nf:], p_ref, plan.v_ptrs, plan.m_ptrs[nf:],
                                            plan.step_ptrs[nf:], plan.vmeta, plan.vprog_param, plan.sums, nf, inv_arg,
                                            inf_arg, hyper, sr_arg, ALIGNED=al_vec, BLOCK=BLOCK_V, **consts,
                                            **FP_FUSION)
    if q8 and plan.qtables[1][0]:
        n_progs, prog_param, qmeta = plan.qtables[1]
        _apply8_kernel[(n_progs,)](g_ptrs[nf:], g_ref, plan.p_ptrs[nf:], p_ref, plan.m_ptrs[nf:], m_ref,
                                   absmax_ptrs[nf:], plan.v_ptrs, plan.step_ptrs[nf:], qmeta, prog_param, plan.sums,
                                   qmeta, plan.sums, plan.sums, plan.sums, nf, qmap, inv_arg, inf_arg, hyper,
                                   sr_arg, FACTORED=False, MAPPED=False, NARROW=True, ALIGNED=al_vec,
                                   QB_PER_PROG=QB_PER_PROG, **consts, **FP_FUSION)
    if fp is not None:
        if fp.mapped:  # the slots of rows and columns held by other ranks
            plan.res.zero_()
        _res_stats_kernel[(fp.n_progs,)](g_ptrs, g_ref, plan.m_ptrs, m_ref, absmax_ptrs, qmap, fp.meta, fp.maps,
                                         fp.prog_param, plan.stats, plan.sums, plan.res, parts, inv_arg, inf_arg,
                                         hyper, Q8=q8, MAPPED=fp.mapped, ALIGNED=al and fp.sizes_aligned, **flags,
                                         **blocks, **FP_FUSION)
        launch_col_reduce(fp, plan.res, parts)
        if sharded:
            yield from common.sum_fp64(plan.res)
        launch_factors(fp, plan.res, plan.res_row_ptrs, plan.res_col_ptrs, plan.step_ptrs, found_inf,
                       beta_from_step=False, hyper=hyper[H_BETA3:])
        if q8:
            n_progs, prog_param, qmeta = plan.qtables[0]
            _apply8_kernel[(n_progs,)](g_ptrs, g_ref, plan.p_ptrs, p_ref, plan.m_ptrs, m_ref, absmax_ptrs, plan.v_ptrs,
                                       plan.step_ptrs, qmeta, prog_param, fp.meta, fp.maps, plan.stats, plan.res,
                                       plan.sums, 0, qmap, inv_arg, inf_arg, hyper, sr_arg, FACTORED=True,
                                       MAPPED=fp.mapped, NARROW=fp.max_side < NARROW_SIDE,
                                       ALIGNED=al and plan.fac_numel_aligned,
                                       QB_PER_PROG=QB_PER_PROG, **consts, **FP_FUSION)
        else:
            _apply_kernel[(fp.n_progs,)](plan.p_ptrs, p_ref, plan.m_ptrs, plan.step_ptrs, fp.meta, fp.maps,
                                         fp.prog_param, plan.res, inf_arg, hyper, sr_arg,
                                         HAS_INF=flags["HAS_INF"], HAS_WD=weight_decay != 0, SR=sr,
                                         MAPPED=fp.mapped,
                                         ALIGNED=al and fp.sizes_aligned, **blocks, **FP_FUSION)
