"""Fused multi-tensor Adafactor (the math: fastopt/reference/adafactor.py).

Launches per step, each covering every param of the bucket (their number does not grow with the params):

  factored (ndim >= 2)                      unfactored (vectors, scalars)
  1 _sq_stats_kernel   rows/col partials    -
  2 _col_reduce_kernel col sums             -
    [yield stats: summed over the ranks, one collective]
  3 _factor_kernel     R_t, C_t, factors    -
  4 _usq_kernel        sum U^2, sum X^2     4' _vec_stats_kernel  V_t, sum U^2, sum X^2
  5 _segment_sum_kernel per-param sums of both
    [yield sums: summed over the ranks, one collective]
  6 _apply_kernel      clip, momentum,      6' _vec_apply_kernel
                       decay, write X

The gradient is read three times (statistics, RMS of the update, update): the RMS clip needs the sum of
U^2 over the whole (possibly sharded) matrix before any element of X may be written.

Sharded buckets (`layouts`) run the same launches with the factored kernels MAPPED (kernels/factored.py: local
elements, global statistics through int64 row/column maps built once per layout and cached with the plan), plus
one zero-fill of the statistics buffer before launch 1; RMS and step sizes use global numels. The buffers yielded
to be summed are float64 as in the reference (a float64 copy of them when the kernels accumulate in fp32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common
from .common import (FP_FUSION, INTERPRET, cached_plan, keep_limit, load_ptr, param_of_program, ptr_table, round_to,
                     segment_sum, sr_round, store_grad, unscale_factor)
from .factored import (BucketPlan, col_map, global_numel, in_piece, launch_factors, launch_sq_stats, launch_usq,
                       row_block, row_map, store_param_tile)

BLOCK_V = 256 if INTERPRET else 1024

# Slots of the hyperparameter tensor (the accumulation dtype, filled on the host in float64): compiled Triton
# passes Python floats, and folds float literals, as fp32, which would round fp64 params' beta1 (0.9) by 2.6e-8.
# DECAY and EPS1 come first, at the offsets _factor_kernel reads with BETA_FROM_STEP and HYPER_FROM_PTR.
(H_DECAY, _H_UNUSED, H_EPS1, H_LR, H_EPS2, H_CLIP, H_BETA1, H_OMB1, H_WD, H_WARMUP_LR,
 H_MAX_LR) = (tl.constexpr(k) for k in range(11))


def hyper_values(lr, eps, clip_threshold, decay_rate, beta1, weight_decay) -> tuple:
    b1 = beta1 if beta1 is not None else 0.0
    return (decay_rate, 0.0, eps[0], lr if lr is not None else 0.0, eps[1], clip_threshold, b1, 1.0 - b1,
            weight_decay, 1e-6, 1e-2)


@triton.jit
def _step_scale(step, u_sq, p_sq, numel, hyper_ptr, RELATIVE: tl.constexpr, WARMUP: tl.constexpr,
                SCALE_PARAM: tl.constexpr):
    """(alpha_t, alpha_t / max(1, RMS(U)/d)) for one param."""
    acc_t = step.dtype
    eps2 = tl.load(hyper_ptr + H_EPS2).to(acc_t)
    clip_threshold = tl.load(hyper_ptr + H_CLIP).to(acc_t)
    if RELATIVE:
        if WARMUP:
            rel = tl.minimum(tl.load(hyper_ptr + H_WARMUP_LR).to(acc_t) * step, 1.0 / tl.sqrt(step))
        else:
            rel = tl.minimum(tl.load(hyper_ptr + H_MAX_LR).to(acc_t), 1.0 / tl.sqrt(step))
    else:
        rel = tl.load(hyper_ptr + H_LR).to(acc_t)
    alpha = rel
    if SCALE_PARAM:
        alpha = rel * tl.maximum(tl.sqrt(p_sq / numel), eps2, propagate_nan=tl.PropagateNan.ALL)
    clip = tl.maximum(tl.sqrt(u_sq / numel) / clip_threshold, 1.0, propagate_nan=tl.PropagateNan.ALL)
    return alpha, alpha / clip


@triton.jit
def _load_step(step_ptrs, i, acc_t: tl.constexpr):
    return tl.load(tl.load(step_ptrs + i).to(tl.pointer_type(tl.float32))).to(acc_t)


@triton.jit
def _vec_stats_kernel(g_ptrs, g_ref, p_ptrs, v_ptrs, step_ptrs, vmeta_ptr, prog_param_ptr, part2_ptr, part2_base,
                      inv_scale_ptr, found_inf_ptr, hyper_ptr, HAS_SCALE: tl.constexpr,
                      HAS_INF: tl.constexpr, SCALE_PARAM: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """V_t = b V + (1-b)(G^2 + eps1); partial sums of (G/sqrt(V_t))^2 and X^2."""
    pid = tl.program_id(0)
    j, n, prog_start, _third = param_of_program(vmeta_ptr, prog_param_ptr, ALIGNED)
    acc_t = part2_ptr.dtype.element_ty
    offs = (pid - prog_start).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    keep = offs < keep_limit(n, found_inf_ptr, HAS_INF)
    step = _load_step(step_ptrs, j, acc_t)
    bt = 1.0 - tl.exp(tl.load(hyper_ptr + H_DECAY).to(acc_t) * tl.log(step))
    eps1 = tl.load(hyper_ptr + H_EPS1).to(acc_t)
    g = tl.load(load_ptr(g_ptrs, j, g_ref, ALIGNED) + offs, mask=m, other=0.0).to(acc_t) * inv
    v_ptr = load_ptr(v_ptrs, j, part2_ptr, ALIGNED)
    v = bt * tl.load(v_ptr + offs, mask=m, other=0.0) + (1.0 - bt) * (g * g + eps1)
    tl.store(v_ptr + offs, v, mask=keep)
    u = tl.where(m, g / tl.sqrt(v), 0.0)
    tl.store(part2_ptr + (part2_base + pid) * 2, tl.sum(u * u, 0))
    p_sq = tl.sum(tl.zeros([BLOCK], dtype=acc_t), 0)
    if SCALE_PARAM:
        p = tl.load(load_ptr(p_ptrs, j, g_ref, ALIGNED) + offs, mask=m, other=0.0).to(acc_t)
        p_sq = tl.sum(p * p, 0)
    tl.store(part2_ptr + (part2_base + pid) * 2 + 1, p_sq)


@triton.jit
def _apply_kernel(g_ptrs, g_ref, p_ptrs, m_ptrs, step_ptrs, meta_ptr, maps_ptr, prog_param_ptr, stats_ptr, sums_ptr,
                  inv_scale_ptr, found_inf_ptr, hyper_ptr, sr_ptr,
                  HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, RELATIVE: tl.constexpr, WARMUP: tl.constexpr,
                  SCALE_PARAM: tl.constexpr, HAS_MOM: tl.constexpr, HAS_WD: tl.constexpr, SR: tl.constexpr,
                  MAPPED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    i, B, R, C, row_off, col_off, _po, b, rb = row_block(meta_ptr, prog_param_ptr, pid, BLOCK_R, ALIGNED)
    acc_t = stats_ptr.dtype.element_ty
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    R_keep = keep_limit(R, found_inf_ptr, HAS_INF)
    step = _load_step(step_ptrs, i, acc_t)
    alpha, scale = _step_scale(step, tl.load(sums_ptr + 2 * i), tl.load(sums_ptr + 2 * i + 1),
                               global_numel(meta_ptr, i).to(acc_t), hyper_ptr, RELATIVE, WARMUP, SCALE_PARAM)
    beta1 = tl.load(hyper_ptr + H_BETA1).to(acc_t)
    omb1 = tl.load(hyper_ptr + H_OMB1).to(acc_t)
    weight_decay = tl.load(hyper_ptr + H_WD).to(acc_t)
    g_ptr = load_ptr(g_ptrs, i, g_ref, ALIGNED)
    p_ptr = load_ptr(p_ptrs, i, g_ref, ALIGNED)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    row_base, rslot = row_map(meta_ptr, maps_ptr, i, b, rows, rmask, R, C, row_off, MAPPED, ALIGNED)
    rfac = tl.load(stats_ptr + rslot, mask=rmask, other=0.0) * scale
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        offs = row_base[:, None] + cols[None, :]
        mask = in_piece(offs, rmask[:, None] & cmask[None, :], meta_ptr, i, MAPPED, ALIGNED)
        keep = in_piece(offs, (rows < R_keep)[:, None] & cmask[None, :], meta_ptr, i, MAPPED, ALIGNED)
        cslot = col_map(meta_ptr, maps_ptr, i, b, cols, cmask, C, col_off, MAPPED)
        cfac = tl.load(stats_ptr + cslot, mask=cmask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_t) * inv
        store_grad(g_ptr, offs, g, keep, HAS_SCALE)  # the last pass that reads it
        u = g * rfac[:, None] * cfac[None, :]
        if HAS_MOM:
            m_ptr = load_ptr(m_ptrs, i, stats_ptr, ALIGNED)
            u = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + omb1 * u
            tl.store(m_ptr + offs, u, mask=keep)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
        if HAS_WD:
            p = p - (weight_decay * alpha) * p - u
        else:
            p = p - u
        store_param_tile(p_ptr, offs, p, keep, meta_ptr, i, rslot, row_off, cslot, col_off, step, sr_ptr, SR, MAPPED)


@triton.jit
def _vec_apply_kernel(g_ptrs, g_ref, p_ptrs, v_ptrs, m_ptrs, step_ptrs, vmeta_ptr, prog_param_ptr, sums_ptr,
                      sums_base, inv_scale_ptr, found_inf_ptr, hyper_ptr, sr_ptr,
                      HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, RELATIVE: tl.constexpr,
                      WARMUP: tl.constexpr, SCALE_PARAM: tl.constexpr, HAS_MOM: tl.constexpr,
                      HAS_WD: tl.constexpr, SR: tl.constexpr, GMAP: tl.constexpr, ALIGNED: tl.constexpr,
                      BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    j, n, prog_start, _third = param_of_program(vmeta_ptr, prog_param_ptr, ALIGNED)
    acc_t = sums_ptr.dtype.element_ty
    offs = (pid - prog_start).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    keep = offs < keep_limit(n, found_inf_ptr, HAS_INF)
    step = _load_step(step_ptrs, j, acc_t)
    k = sums_base + j
    numel = tl.load(vmeta_ptr + j * 3 + 2).to(acc_t)  # global: RMS over the whole (maybe sharded) param
    alpha, scale = _step_scale(step, tl.load(sums_ptr + 2 * k), tl.load(sums_ptr + 2 * k + 1), numel, hyper_ptr,
                               RELATIVE, WARMUP, SCALE_PARAM)
    beta1 = tl.load(hyper_ptr + H_BETA1).to(acc_t)
    omb1 = tl.load(hyper_ptr + H_OMB1).to(acc_t)
    weight_decay = tl.load(hyper_ptr + H_WD).to(acc_t)
    v = tl.load(load_ptr(v_ptrs, j, sums_ptr, ALIGNED) + offs, mask=mask, other=1.0)
    g_ptr = load_ptr(g_ptrs, j, g_ref, ALIGNED)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_t) * inv
    store_grad(g_ptr, offs, g, keep, HAS_SCALE)  # the last pass that reads it
    u = g / tl.sqrt(v) * scale
    if HAS_MOM:
        m_ptr = load_ptr(m_ptrs, j, sums_ptr, ALIGNED)
        u = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + omb1 * u
        tl.store(m_ptr + offs, u, mask=keep)
    p_ptr = load_ptr(p_ptrs, j, g_ref, ALIGNED)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
    if HAS_WD:
        p = p - (weight_decay * alpha) * p - u
    else:
        p = p - u
    if SR:
        out = sr_round(p.to(tl.float32), sr_ptr, k, step, offs, keep, GMAP)
    else:
        out = round_to(p, g_ref.dtype.element_ty)
    tl.store(p_ptr + offs, out, mask=keep)


class AdafactorPlan(BucketPlan):
    """Everything about a bucket that stays fixed between steps: tables and scratch buffers. The partial sums are
    (sum U^2, sum X^2) per program and per param."""

    def __init__(self, params, states, device, acc_dtype, layouts=None):
        super().__init__(params, states, device, acc_dtype, layouts, BLOCK_V, 2)
        st = [states[k] for k in self.order]
        self.m_ptrs = ptr_table([s.get("exp_avg") for s in st], device)
        self.row_ptrs = ptr_table([s.get("exp_avg_sq_row") for s in st[:self.n_fac]], device)
        self.col_ptrs = ptr_table([s.get("exp_avg_sq_col") for s in st[:self.n_fac]], device)
        self.v_ptrs = ptr_table([s.get("exp_avg_sq") for s in st[self.n_fac:]], device)


def adafactor_phases(params, grads, states, *, lr, eps, clip_threshold, decay_rate, beta1, weight_decay,
                     scale_parameter, relative_step, warmup_init, bf16_stochastic_round=False, inv_scale=None,
                     found_inf=None, sharded=False, cache=None, layouts=None, sr_ids=None):
    """One step over a bucket, a generator that yields each buffer to be summed over the ranks that share the
    params when `sharded` (fastopt.distributed.phases). `sr_ids`: the params' ids seeding the stochastic rounding
    (None: their positions in the bucket)."""
    device = params[0].device
    acc_dtype = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    plan = cached_plan(cache, ("adafactor",), params, states, layouts,
                       lambda: AdafactorPlan(params, states, device, acc_dtype, layouts))
    if common.POISON:
        for buf in (plan.stats, plan.part, plan.sums):
            buf.fill_(float("nan"))
    g_ptrs = plan.grad_table([grads[k] for k in plan.order], device)
    g_ref = grads[0]
    al = plan.tensors_aligned and plan.grad_table.aligned
    hyper = plan.hyper(hyper_values(lr, eps, clip_threshold, decay_rate, beta1, weight_decay))
    dummy = plan.sums
    flags = dict(HAS_SCALE=inv_scale is not None, HAS_INF=found_inf is not None)
    inv_arg = inv_scale if inv_scale is not None else dummy
    inf_arg = found_inf if found_inf is not None else dummy
    fp = plan.fplan
    if fp is not None:
        launch_sq_stats(g_ptrs, g_ref, fp, plan.stats, plan.new_parts(), inv_scale, aligned=al)
        if sharded:
            yield from common.sum_fp64(plan.stats)
        launch_factors(fp, plan.stats, plan.row_ptrs, plan.col_ptrs, plan.step_ptrs, found_inf,
                       beta_from_step=True, hyper=hyper)
        launch_usq(g_ptrs, g_ref, plan.p_ptrs, fp, plan.stats, plan.part, inv_scale, width=2,
                   scale_parameter=scale_parameter, aligned=al)
    nf = plan.n_fac
    vec_args = (g_ptrs[nf:], g_ref, plan.p_ptrs[nf:])
    if plan.n_vprogs:
        _vec_stats_kernel[(plan.n_vprogs,)](*vec_args, plan.v_ptrs, plan.step_ptrs[nf:], plan.vmeta, plan.vprog_param,
                                            plan.part, plan.fac_progs, inv_arg, inf_arg, hyper,
                                            SCALE_PARAM=scale_parameter, ALIGNED=al and plan.vec_sizes_aligned,
                                            BLOCK=BLOCK_V, **flags, **FP_FUSION)
    segment_sum(plan.part, plan.seg_start, plan.seg_len, plan.sums, 2)
    if sharded:
        yield from common.sum_fp64(plan.sums)
    sr = bool(bf16_stochastic_round) and params[0].dtype == torch.bfloat16
    sr_arg, gmap = plan.sr(sr_ids) if sr else (dummy, 0)
    consts = dict(RELATIVE=relative_step, WARMUP=warmup_init, SCALE_PARAM=scale_parameter, HAS_MOM=beta1 is not None,
                  HAS_WD=weight_decay != 0, SR=sr, **flags)
    if fp is not None:
        _apply_kernel[(fp.n_progs,)](g_ptrs, g_ref, plan.p_ptrs, plan.m_ptrs, plan.step_ptrs, fp.meta, fp.maps,
                                     fp.prog_param, plan.stats, plan.sums, inv_arg, inf_arg, hyper, sr_arg,
                                     MAPPED=fp.mapped, ALIGNED=al and fp.sizes_aligned, BLOCK_R=fp.block_r,
                                     BLOCK_C=fp.block_c, **consts, **FP_FUSION)
    if plan.n_vprogs:
        _vec_apply_kernel[(plan.n_vprogs,)](*vec_args, plan.v_ptrs, plan.m_ptrs[nf:], plan.step_ptrs[nf:], plan.vmeta,
                                            plan.vprog_param, plan.sums, nf, inv_arg, inf_arg, hyper, sr_arg,
                                            BLOCK=BLOCK_V, ALIGNED=al and plan.vec_sizes_aligned, GMAP=gmap, **consts,
                                            **FP_FUSION)
