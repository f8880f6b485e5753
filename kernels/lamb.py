"""Fused multi-tensor LAMB (the math: fastopt/reference/lamb.py).

Launches per step, each covering every param of the bucket (their number does not grow with the params):

  32-bit state (fp32 / fp64 m, v)              8-bit state (nbits=8: block-wise codes + absmax)
  1 _lamb_stats_kernel   m_t, v_t (stored),    1' _lamb8_stats_kernel   m_t, v_t from the old codes and g
                         partials of p^2, a^2                          (nothing stored), partials of p^2, a^2
  2 _segment_sum_kernel  per-param ||p||^2, ||a||^2 of both kinds (kernels/common.py), in ONE flat buffer
    [yield sums: summed over the ranks, one collective]
  3 _lamb_apply_kernel   r, p -= eta r a, a    3' _lamb8_apply_kernel   m_t, v_t again from the old codes and
                         recomputed from the                           g, r, p -= eta r a, then m_t, v_t
                         stored m_t, v_t, p                            requantized and stored

Every param is treated as a flat vector (LAMB is elementwise but for the two norms), so one program table
serves every shape. 32-bit: recomputing a in pass 3 reads m and v again instead of writing and re-reading a
param-sized scratch buffer. 8-bit: pass 1 stores nothing, so pass 3 can rebuild the exact m_t, v_t (not
their 8-bit images) from the old codes and the gradient: the update and its norm use the same unquantized
a, as bitsandbytes' 8-bit optimizers do, at the price of a second read of g (1 byte codes are cheap to
re-read). Partial sums are written per program and added in a fixed order (no atomics): every step is
deterministic, so a resumed run is bit-identical to an uninterrupted one.

The 8-bit format is fastopt/reference/quant.py's (bitsandbytes' block-wise format): each program holds
whole quantization blocks, takes their absmax, and finds each element's nearest map value with
common.nearest_code (a bucket table and one threshold compare; ties to the lower index, as the reference and
csrc/ do). Map values and thresholds are read from shared memory (common.map_values), one 1 KB copy per table
per program, as csrc/ keeps its tables in shared memory.

Hyperparameters travel as a small float64 tensor, not as kernel scalars: Triton passes Python floats as
fp32, which is too coarse for fp64 params and for 1 - beta2 (0.999 in fp32 is off by 3e-5 of 1 - 0.999).
The bias corrections 1 - beta^t are computed per program in fp64 for the same reason.

No autotuning: the kernels update m, v and p in place through pointer tables, so a tuner's repeated
launches would apply the step several times.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import common
from .common import (FP_FUSION, INTERPRET, GradTable, SRTable, aligned, cached_plan, keep_limit, load_ptr, map_values,
                     multiples, param_of_program, program_table, ptr_table, quantize_rows, round_to, search_table,
                     segment_sum, sr_round, store_grad, to_device, unscale_factor)

# Elements per program. Small under the interpreter so that the tests' small params span several programs.
BLOCK = 128 if INTERPRET else 2048
NUM_WARPS = 4
# 8-bit: elements per program (whole quantization blocks; at least one block).
TILE8 = 512 if INTERPRET else 2048

# Slots of the float64 hyperparameter tensor.
HYPER = ("lr", "beta1", "beta2", "1-beta1", "1-beta2", "log(beta1)", "log(beta2)", "eps", "weight_decay",
         "max_trust_ratio")
# Columns of the int64 meta tables: numel, first program, index of the param in the bucket (its slot in sums).
META_WIDTH = 3


@triton.jit
def _adam_update(m, v, p, eps, weight_decay, HAS_WD: tl.constexpr):
    a = m / (tl.sqrt(v) + eps)
    if HAS_WD:
        a += weight_decay * p
    return a


@triton.jit
def _trust_scale(step, k, hyper_ptr, sums_ptr, BIAS_CORRECTION: tl.constexpr, HAS_MAX: tl.constexpr):
    """eta * r for the param in slot k of the (reduced) sums: eta in fp64, r = ||p|| / ||a|| or 1."""
    acc_t = sums_ptr.dtype.element_ty
    eta = tl.load(hyper_ptr)
    if BIAS_CORRECTION:
        t = step.to(tl.float64)
        eta = eta * tl.sqrt(1.0 - tl.exp(t * tl.load(hyper_ptr + 6))) / (1.0 - tl.exp(t * tl.load(hyper_ptr + 5)))
    p_sq = tl.load(sums_ptr + 2 * k)
    a_sq = tl.load(sums_ptr + 2 * k + 1)
    ratio = tl.where((p_sq > 0) & (a_sq > 0), tl.sqrt(p_sq) / tl.sqrt(tl.where(a_sq > 0, a_sq, 1.0)), 1.0)
    if HAS_MAX:
        ratio = tl.minimum(ratio, tl.load(hyper_ptr + 9).to(acc_t), propagate_nan=tl.PropagateNan.ALL)
    return (eta * ratio.to(tl.float64)).to(acc_t)


@triton.jit
def _store_param(p_ptr, offs, p, keep, step, sr_ptr, k, SR: tl.constexpr, GMAP: tl.constexpr):
    """Store p rounded to the param's dtype; SR: stochastically, with noise from (step, param id, global offset)
    (common.sr_round: row k of the bucket's sr_table, k the param's index in the bucket), as reference/common.py's
    stochastic_round_bf16."""
    if SR:
        out = sr_round(p.to(tl.float32), sr_ptr, k, step, offs, keep, GMAP)
    else:
        out = round_to(p, p_ptr.dtype.element_ty)
    tl.store(p_ptr + offs, out, mask=keep)


@triton.jit
def _u8_ptr(table, j, ALIGNED: tl.constexpr = False):
    p = tl.load(table + j).to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _f32_ptr(table, j):
    return tl.load(table + j).to(tl.pointer_type(tl.float32))


@triton.jit
def _load_step(step_ptrs, j):
    return tl.load(tl.load(step_ptrs + j).to(tl.pointer_type(tl.float32)))


# ---- 32-bit state ---------------------------------------------------------------------------------------
@triton.jit
def _lamb_stats_kernel(g_ptrs, g_ref, p_ptrs, p_ref, m_ptrs, v_ptrs, meta_ptr, prog_param_ptr, hyper_ptr, parts_ptr,
                       inv_scale_ptr, found_inf_ptr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
                       HAS_WD: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """m_t, v_t of this program's elements (stored unless GradScaler found an inf) and partial sums of p^2, a^2.
    HAS_SCALE: the unscaled gradient is stored over the gradient too (`store_grad`)."""
    pid = tl.program_id(0)
    j, n, prog_start, _k = param_of_program(meta_ptr, prog_param_ptr, ALIGNED)
    offs = (pid - prog_start).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    keep = offs < keep_limit(n, found_inf_ptr, HAS_INF)
    acc_t = parts_ptr.dtype.element_ty
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    g_ptr = load_ptr(g_ptrs, j, g_ref, ALIGNED)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_t) * inv
    store_grad(g_ptr, offs, g, keep, HAS_SCALE)
    p = tl.load(load_ptr(p_ptrs, j, p_ref, ALIGNED) + offs, mask=mask, other=0.0).to(acc_t)
    m_ptr = load_ptr(m_ptrs, j, parts_ptr, ALIGNED)
    v_ptr = load_ptr(v_ptrs, j, parts_ptr, ALIGNED)
    m = tl.load(hyper_ptr + 1).to(acc_t) * tl.load(m_ptr + offs, mask=mask, other=0.0) + \
        tl.load(hyper_ptr + 3).to(acc_t) * g
    v = tl.load(hyper_ptr + 2).to(acc_t) * tl.load(v_ptr + offs, mask=mask, other=0.0) + \
        tl.load(hyper_ptr + 4).to(acc_t) * g * g  # (1-b2) g first: g*g overflows fp32 past 1.8e19
    tl.store(m_ptr + offs, m, mask=keep)
    tl.store(v_ptr + offs, v, mask=keep)
    a = _adam_update(m, v, p, tl.load(hyper_ptr + 7).to(acc_t), tl.load(hyper_ptr + 8).to(acc_t), HAS_WD)
    a = tl.where(mask, a, 0.0)
    tl.store(parts_ptr + pid * 2, tl.sum(p * p, 0))
    tl.store(parts_ptr + pid * 2 + 1, tl.sum(a * a, 0))


@triton.jit
def _lamb_apply_kernel(p_ptrs, p_ref, m_ptrs, v_ptrs, step_ptrs, meta_ptr, prog_param_ptr, hyper_ptr, sums_ptr,
                       found_inf_ptr, sr_ptr, HAS_INF: tl.constexpr, HAS_WD: tl.constexpr,
                       BIAS_CORRECTION: tl.constexpr, HAS_MAX: tl.constexpr, SR: tl.constexpr, GMAP: tl.constexpr,
                       ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """p -= eta * r * a, with r = ||p|| / ||a|| from the (reduced) sums and a recomputed from m_t, v_t, p."""
    pid = tl.program_id(0)
    j, n, prog_start, k = param_of_program(meta_ptr, prog_param_ptr, ALIGNED)
    offs = (pid - prog_start).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc_t = sums_ptr.dtype.element_ty
    step = _load_step(step_ptrs, j)
    scale = _trust_scale(step, k, hyper_ptr, sums_ptr, BIAS_CORRECTION, HAS_MAX)
    p_ptr = load_ptr(p_ptrs, j, p_ref, ALIGNED)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
    m = tl.load(load_ptr(m_ptrs, j, sums_ptr, ALIGNED) + offs, mask=mask, other=0.0)
    v = tl.load(load_ptr(v_ptrs, j, sums_ptr, ALIGNED) + offs, mask=mask, other=1.0)
    p = p - scale * _adam_update(m, v, p, tl.load(hyper_ptr + 7).to(acc_t), tl.load(hyper_ptr + 8).to(acc_t), HAS_WD)
    _store_param(p_ptr, offs, p, offs < keep_limit(n, found_inf_ptr, HAS_INF), step, sr_ptr, k, SR, GMAP)


# ---- 8-bit state ----------------------------------------------------------------------------------------
@triton.jit
def _quantize_store(x, codes_ptr, absmax_ptr, offs, blk, keep, bkeep, map_ptr):
    """Quantize an [NQ, QB] tile of whole blocks (zeros past the end) and store codes and block absmax."""
    codes, amax = quantize_rows(x.to(tl.float32), map_ptr)
    tl.store(codes_ptr + offs, codes, mask=keep)
    tl.store(absmax_ptr + blk, amax, mask=bkeep)


@triton.jit
def _dequantize(codes_ptr, absmax_ptr, offs, mask, blk, bmask, map_ptr):
    codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    amax = tl.load(absmax_ptr + blk, mask=bmask, other=0.0)
    return map_values(codes, map_ptr) * amax[:, None]


@triton.jit
def _moments8(j, g_ptrs, g_ref, m_ptrs, v_ptrs, ma_ptrs, va_ptrs, offs, mask, blk, bmask, hyper_ptr, inv,
              map_s_ptr, map_u_ptr, acc_t: tl.constexpr, ALIGNED: tl.constexpr = False):
    """m_t, v_t (acc_t, zero past the end) from the stored 8-bit m_{t-1}, v_{t-1} and the gradient; and the
    gradient times `inv` with its pointer (`store_grad`)."""
    g_ptr = load_ptr(g_ptrs, j, g_ref, ALIGNED)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_t) * inv
    m_old = _dequantize(_u8_ptr(m_ptrs, j, ALIGNED), _f32_ptr(ma_ptrs, j), offs, mask, blk, bmask, map_s_ptr).to(acc_t)
    v_old = _dequantize(_u8_ptr(v_ptrs, j, ALIGNED), _f32_ptr(va_ptrs, j), offs, mask, blk, bmask, map_u_ptr).to(acc_t)
    m = tl.load(hyper_ptr + 1).to(acc_t) * m_old + tl.load(hyper_ptr + 3).to(acc_t) * g
    v = tl.load(hyper_ptr + 2).to(acc_t) * v_old + tl.load(hyper_ptr + 4).to(acc_t) * g * g
    return tl.where(mask, m, 0.0), tl.where(mask, v, 0.0), g, g_ptr


@triton.jit
def _tile8(meta_ptr, prog_param_ptr, QB: tl.constexpr, NQ: tl.constexpr, ALIGNED: tl.constexpr = False):
    """This program's param and its [NQ, QB] tile: element offsets (int64), block indices, masks."""
    pid = tl.program_id(0)
    j, n, prog_start, k = param_of_program(meta_ptr, prog_param_ptr, ALIGNED)
    blk = (pid - prog_start).to(tl.int64) * NQ + tl.arange(0, NQ)
    offs = blk[:, None] * QB + tl.arange(0, QB)[None, :]
    return j, k, n, blk, offs


@triton.jit
def _lamb8_stats_kernel(g_ptrs, g_ref, p_ptrs, p_ref, m_ptrs, v_ptrs, ma_ptrs, va_ptrs, meta_ptr, prog_param_ptr,
                        hyper_ptr, parts_ptr, parts_base, inv_scale_ptr, map_s_ptr, map_u_ptr,
                        HAS_SCALE: tl.constexpr, HAS_WD: tl.constexpr, ALIGNED: tl.constexpr, QB: tl.constexpr,
                        NQ: tl.constexpr):
    """Partial sums of p^2 and a^2 over this program's blocks; a from the exact m_t, v_t. Stores no state."""
    j, _k, n, blk, offs = _tile8(meta_ptr, prog_param_ptr, QB, NQ, ALIGNED)
    mask = offs < n
    bmask = blk * QB < n
    acc_t = parts_ptr.dtype.element_ty
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    m, v, _g, _g_ptr = _moments8(j, g_ptrs, g_ref, m_ptrs, v_ptrs, ma_ptrs, va_ptrs, offs, mask, blk, bmask,
                                 hyper_ptr, inv, map_s_ptr, map_u_ptr, acc_t, ALIGNED)
    p = tl.load(load_ptr(p_ptrs, j, p_ref, ALIGNED) + offs, mask=mask, other=0.0).to(acc_t)
    a = tl.where(mask, _adam_update(m, v, p, tl.load(hyper_ptr + 7).to(acc_t), tl.load(hyper_ptr + 8).to(acc_t),
                                    HAS_WD), 0.0)
    slot = parts_base + tl.program_id(0)
    tl.store(parts_ptr + slot * 2, tl.sum(tl.sum(p * p, 1), 0))
    tl.store(parts_ptr + slot * 2 + 1, tl.sum(tl.sum(a * a, 1), 0))


@triton.jit
def _lamb8_apply_kernel(g_ptrs, g_ref, p_ptrs, p_ref, m_ptrs, v_ptrs, ma_ptrs, va_ptrs, step_ptrs, meta_ptr,
                        prog_param_ptr, hyper_ptr, sums_ptr, inv_scale_ptr, found_inf_ptr, map_s_ptr, map_u_ptr,
                        sr_ptr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, HAS_WD: tl.constexpr,
                        BIAS_CORRECTION: tl.constexpr, HAS_MAX: tl.constexpr, SR: tl.constexpr, GMAP: tl.constexpr,
                        ALIGNED: tl.constexpr, QB: tl.constexpr, NQ: tl.constexpr):
    """m_t, v_t again, p -= eta * r * a, then m_t, v_t requantized (new block absmax) and stored. HAS_SCALE: the
    unscaled gradient is stored over the gradient too, here, the last pass that reads it (`store_grad`)."""
    j, k, n, blk, offs = _tile8(meta_ptr, prog_param_ptr, QB, NQ, ALIGNED)
    mask = offs < n
    bmask = blk * QB < n
    limit = keep_limit(n, found_inf_ptr, HAS_INF)
    keep = offs < limit
    bkeep = blk * QB < limit
    acc_t = sums_ptr.dtype.element_ty
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    m, v, g, g_ptr = _moments8(j, g_ptrs, g_ref, m_ptrs, v_ptrs, ma_ptrs, va_ptrs, offs, mask, blk, bmask,
                               hyper_ptr, inv, map_s_ptr, map_u_ptr, acc_t, ALIGNED)
    store_grad(g_ptr, offs, g, keep, HAS_SCALE)
    step = _load_step(step_ptrs, j)
    scale = _trust_scale(step, k, hyper_ptr, sums_ptr, BIAS_CORRECTION, HAS_MAX)
    p_ptr = load_ptr(p_ptrs, j, p_ref, ALIGNED)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
    p = p - scale * _adam_update(m, v, p, tl.load(hyper_ptr + 7).to(acc_t), tl.load(hyper_ptr + 8).to(acc_t), HAS_WD)
    _store_param(p_ptr, offs, p, keep, step, sr_ptr, k, SR, GMAP)
    _quantize_store(m, _u8_ptr(m_ptrs, j, ALIGNED), _f32_ptr(ma_ptrs, j), offs, blk, keep, bkeep, map_s_ptr)
    _quantize_store(v, _u8_ptr(v_ptrs, j, ALIGNED), _f32_ptr(va_ptrs, j), offs, blk, keep, bkeep, map_u_ptr)


# ---- host side ------------------------------------------------------------------------------------------
def is_8bit(state: dict) -> bool:
    return state["exp_avg"].dtype == torch.uint8


class _Tables:
    """Program table, meta and pointer tables of one kind of param (32-bit or 8-bit state) of a bucket."""

    def __init__(self, idx, params, states, per_prog, device, keys):
        self.idx = idx
        counts = [common.cdiv(params[k].numel(), per_prog) for k in idx]
        self.counts = counts
        self.prog_param, self.starts = program_table(counts, device)
        self.n_progs = sum(counts)
        self.meta = to_device([x for k, s in zip(idx, self.starts) for x in (params[k].numel(), s, k)], torch.int64,
                              device)
        self.p_ptrs = ptr_table([params[k] for k in idx], device)
        self.step_ptrs = ptr_table([states[k]["step"] for k in idx], device)
        self.state_ptrs = {key: ptr_table([states[k][key] for k in idx], device) for key in keys}
        # ALIGNED launches (kernels/common.py): these tensors aligned and every numel a multiple of 16.
        self.aligned = aligned([params[k] for k in idx]) and aligned([t for k in idx for t in states[k].values()]) \
            and multiples(params[k].numel() for k in idx)


class LambPlan:
    """Everything about a bucket that stays fixed between steps: tables and scratch buffers."""

    def __init__(self, params, states, device, acc_dtype, block_size, layouts=None):
        self.sr = SRTable(layouts or [None] * len(params), [p.numel() for p in params], list(range(len(params))),
                          device)
        idx32 = [k for k, s in enumerate(states) if not is_8bit(s)]
        idx8 = [k for k, s in enumerate(states) if is_8bit(s)]
        self.t32 = _Tables(idx32, params, states, BLOCK, device, ("exp_avg", "exp_avg_sq")) if idx32 else None
        self.block_size = block_size
        self.nq = max(1, TILE8 // block_size)
        self.t8 = (_Tables(idx8, params, states, block_size * self.nq, device,
                           ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")) if idx8 else None)
        n32 = self.t32.n_progs if idx32 else 0
        n8 = self.t8.n_progs if idx8 else 0
        # Per-param segments of the partials, in the bucket's param order: the reduced buffer's layout does
        # not depend on which params have 8-bit state.
        start, length = [0] * len(params), [0] * len(params)
        if idx32:
            for k, s, c in zip(idx32, self.t32.starts, self.t32.counts):
                start[k], length[k] = s, c
        if idx8:
            for k, s, c in zip(idx8, self.t8.starts, self.t8.counts):
                start[k], length[k] = n32 + s, c
        self.n32_progs = n32
        self.seg_start = to_device(start, torch.int64, device)
        self.seg_len = to_device(length, torch.int64, device)
        self.parts = torch.empty(2 * (n32 + n8), dtype=acc_dtype, device=device)
        self.sums = torch.empty(2 * len(params), dtype=acc_dtype, device=device)
        self.hyper_key = None
        self.hyper = None
        self.g32, self.g8 = GradTable(), GradTable()
        if idx8:
            self.map_s = search_table(True, device)
            self.map_u = search_table(False, device)

    def grad_tables(self, grads, device) -> tuple:
        """Gradient pointer tables of both kinds (common.GradTable: rebuilt only when a gradient moved)."""
        return (self.g32([grads[k] for k in self.t32.idx], device) if self.t32 is not None else None,
                self.g8([grads[k] for k in self.t8.idx], device) if self.t8 is not None else None)

    def hyperparameters(self, lr, betas, eps, weight_decay, max_trust_ratio, device) -> torch.Tensor:
        """The float64 hyperparameter tensor (see HYPER), rebuilt only when a value changed (e.g. lr)."""
        key = (lr, betas, eps, weight_decay, max_trust_ratio)
        if key != self.hyper_key:
            b1, b2 = betas
            values = [lr, b1, b2, 1.0 - b1, 1.0 - b2, math.log(b1) if b1 > 0 else -math.inf,
                      math.log(b2) if b2 > 0 else -math.inf, eps, weight_decay,
                      math.inf if max_trust_ratio is None else max_trust_ratio]
            self.hyper = to_device([float(x) for x in values], torch.float64, device)
            self.hyper_key = key
        return self.hyper


def lamb_phases(params, grads, states, *, lr, betas, eps, weight_decay, bias_correction, max_trust_ratio=None,
                bf16_stochastic_round=False, block_size=256, inv_scale=None, found_inf=None, sharded=False, cache=None,
                layouts=None, sr_ids=None):
    """One step over a bucket, a generator that yields the buffer of squared norms to be summed over the ranks
    that share the params when `sharded` (fastopt.distributed.phases). `layouts` and `sr_ids` place the params'
    elements and seed the stochastic rounding (None: whole params, their positions in the bucket)."""
    device = params[0].device
    acc_dtype = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    plan = cached_plan(cache, ("lamb", block_size), params, states, layouts,
                       lambda: LambPlan(params, states, device, acc_dtype, block_size, layouts))
    if common.POISON:
        plan.parts.fill_(float("nan"))
        plan.sums.fill_(float("nan"))
    hyper = plan.hyperparameters(float(lr), tuple(float(b) for b in betas), float(eps), float(weight_decay),
                                 None if max_trust_ratio is None else float(max_trust_ratio), device)
    g32, g8 = plan.grad_tables(grads, device)
    al32 = plan.t32 is not None and plan.t32.aligned and plan.g32.aligned
    al8 = plan.t8 is not None and plan.t8.aligned and plan.g8.aligned
    dummy = plan.sums
    inv_arg = inv_scale if inv_scale is not None else dummy
    inf_arg = found_inf if found_inf is not None else dummy
    flags = dict(HAS_WD=weight_decay != 0)
    sr = bool(bf16_stochastic_round) and params[0].dtype == torch.bfloat16
    sr_arg, gmap = plan.sr(sr_ids) if sr else (dummy, 0)
    apply_flags = dict(BIAS_CORRECTION=bool(bias_correction), HAS_MAX=max_trust_ratio is not None, SR=sr, GMAP=gmap,
                       HAS_INF=found_inf is not None, **flags)
    # A kind with no programs (only empty local pieces of sharded params) launches nothing; its sums are 0.
    t32 = plan.t32 if plan.t32 is not None and plan.t32.n_progs else None
    t8 = plan.t8 if plan.t8 is not None and plan.t8.n_progs else None
    if t32 is not None:
        _lamb_stats_kernel[(t32.n_progs,)](g32, grads[0], t32.p_ptrs, params[0], t32.state_ptrs["exp_avg"],
                                           t32.state_ptrs["exp_avg_sq"], t32.meta, t32.prog_param, hyper, plan.parts,
                                           inv_arg, inf_arg, HAS_SCALE=inv_scale is not None,
                                           HAS_INF=found_inf is not None, ALIGNED=al32, BLOCK=BLOCK,
                                           num_warps=NUM_WARPS, **flags, **FP_FUSION)
    if t8 is not None:
        st = t8.state_ptrs
        q = dict(QB=plan.block_size, NQ=plan.nq, num_warps=NUM_WARPS)
        _lamb8_stats_kernel[(t8.n_progs,)](g8, grads[0], t8.p_ptrs, params[0], st["exp_avg"], st["exp_avg_sq"],
                                           st["exp_avg_absmax"], st["exp_avg_sq_absmax"], t8.meta, t8.prog_param,
                                           hyper, plan.parts, plan.n32_progs, inv_arg, plan.map_s, plan.map_u,
                                           HAS_SCALE=inv_scale is not None, ALIGNED=al8, **flags, **q, **FP_FUSION)
    segment_sum(plan.parts, plan.seg_start, plan.seg_len, plan.sums, 2)
    if sharded:
        yield plan.sums
    if t32 is not None:
        _lamb_apply_kernel[(t32.n_progs,)](t32.p_ptrs, params[0], t32.state_ptrs["exp_avg"],
                                           t32.state_ptrs["exp_avg_sq"], t32.step_ptrs, t32.meta, t32.prog_param,
                                           hyper, plan.sums, inf_arg, sr_arg, ALIGNED=al32, BLOCK=BLOCK,
                                           num_warps=NUM_WARPS, **apply_flags, **FP_FUSION)
    if t8 is not None:
        _lamb8_apply_kernel[(t8.n_progs,)](g8, grads[0], t8.p_ptrs, params[0], st["exp_avg"], st["exp_avg_sq"],
                                           st["exp_avg_absmax"], st["exp_avg_sq_absmax"], t8.step_ptrs, t8.meta,
                                           t8.prog_param, hyper, plan.sums, inv_arg, inf_arg, plan.map_s,
                                           plan.map_u, sr_arg, HAS_SCALE=inv_scale is not None, ALIGNED=al8,
                                           **apply_flags, **q, **FP_FUSION)
