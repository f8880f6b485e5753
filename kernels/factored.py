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

Layout of the flat statistics buffer for param i: rows at meta.row_off (B*R), cols at meta.col_off (B*C) of
its GLOBAL matrix batch, rows of every param first, then columns.

Sharded params (a `fastopt.distributed.layout.Layout`: dim shards, flat ranges cut mid-row, 3-D with a sharded
batch dim) run the same kernels with MAPPED set. The row-block programs sweep a local "view" matrix (B, R, C)
whose element (b, r, c) is local element (b R + r) C + c - shift when that lies in [0, count) (a flat range
covers whole view rows but the first and last partly); int64 maps send view row b R + r and view column
b C + c to their global row and column in the statistics buffer. Every local row and column goes to exactly
one global slot, so the stores stay deterministic; slots of rows held by other ranks are zeroed first and
`reduce` adds the ranks' pieces. The factor kernel works on the global factors as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import common
from .common import (FP_FUSION, INTERPRET, load16, keep_limit, load_ptr, multiples, program_table, round_to,
                     sr_round_at, tile_shape, to_device, unscale_factor)

# Columns of the int64 meta table, one row per factored param (the jit functions below spell them as numbers).
# B, R, C: the (local view) matrix batch the row-block programs sweep; *_OFF: offsets into the stats and
# partials buffers; *_START: the param's first program in each kernel's program table; GR, GC: the global
# matrix (the factors); GNUMEL: global elements (RMS); SHIFT, COUNT, RMAP, CMAP: see the module docstring
# (unsharded: 0, B R C, and identity maps, which only MAPPED kernels read).
(M_B, M_R, M_C, M_ROW_OFF, M_COL_OFF, M_PART_OFF, M_PROG_START, M_COLPROG_START, M_FACTPROG_START, M_GR, M_GC,
 M_GNUMEL, M_SHIFT, M_COUNT, M_RMAP, M_CMAP) = range(16)
META_WIDTH = 16


@triton.jit
def load_meta(meta_ptr, i, ALIGNED: tl.constexpr = False):
    """B, R, C, row_off, col_off, part_off, prog_start, colprog_start, factprog_start of param i; with ALIGNED,
    C and part_off declared multiples of 16 (FactoredPlan.sizes_aligned)."""
    base = meta_ptr + i * 16
    return (tl.load(base + 0), tl.load(base + 1), load16(base + 2, ALIGNED), tl.load(base + 3), tl.load(base + 4),
            load16(base + 5, ALIGNED), tl.load(base + 6), tl.load(base + 7), tl.load(base + 8))


@triton.jit
def global_numel(meta_ptr, i):
    return tl.load(meta_ptr + i * 16 + 11)


@triton.jit
def row_map(meta_ptr, maps_ptr, i, b, rows, rmask, R, C, row_off, MAPPED: tl.constexpr,
            ALIGNED: tl.constexpr = False):
    """(local element offset of each row's column 0 (int64; negative where a flat range starts mid-row),
    stats index of each row) for rows `rows` of view matrix b of param i."""
    first = (b * R + rows).to(tl.int64) * C
    if MAPPED:
        first = first - load16(meta_ptr + i * 16 + 12, ALIGNED)
        slot = row_off + tl.load(maps_ptr + tl.load(meta_ptr + i * 16 + 14) + b * R + rows, mask=rmask, other=0)
    else:
        slot = row_off + b * R + rows
    return first, slot


@triton.jit
def col_map(meta_ptr, maps_ptr, i, b, cols, cmask, C, col_off, MAPPED: tl.constexpr):
    """Stats index of each column `cols` of view matrix b of param i."""
    if MAPPED:
        return col_off + tl.load(maps_ptr + tl.load(meta_ptr + i * 16 + 15) + b * C + cols, mask=cmask, other=0)
    else:
        return col_off + b * C + cols


@triton.jit
def global_offsets(meta_ptr, i, rslot, row_off, cslot, col_off, offs, MAPPED: tl.constexpr):
    """The offset of each element of a tile in its param's flattened global tensor, for stochastic rounding:
    (global row in the (B R) rows) * GC + global column, read off the rows' and columns' stats slots (MAPPED);
    else the local offsets `offs`, which are the global ones. Modulo 2**32, as the noise takes them: the tile
    adds int32 (wrapping) per-row and per-column terms."""
    if MAPPED:
        gc = tl.load(meta_ptr + i * 16 + 10)
        return ((rslot - row_off) * gc).to(tl.int32)[:, None] + ((cslot - col_off) % gc).to(tl.int32)[None, :]
    else:
        return offs


@triton.jit
def store_param_tile(p_ptr, offs, p, keep, meta_ptr, i, rslot, row_off, cslot, col_off, step, sr_ptr,
                     SR: tl.constexpr, MAPPED: tl.constexpr):
    """Store a tile of param i rounded to its dtype; SR: stochastically, with noise from (step, param id, global
    offset) (common.sr_round_at at `global_offsets`), as reference/common.py's stochastic_round_bf16."""
    if SR:
        goffs = global_offsets(meta_ptr, i, rslot, row_off, cslot, col_off, offs, MAPPED)
        out = sr_round_at(p.to(tl.float32), sr_ptr, i, step, goffs)
    else:
        out = round_to(p, p_ptr.dtype.element_ty)
    tl.store(p_ptr + offs, out, mask=keep)


@triton.jit
def in_piece(offs, mask, meta_ptr, i, MAPPED: tl.constexpr, ALIGNED: tl.constexpr = False):
    """`mask` limited to the elements this rank holds (MAPPED: offsets in [0, count))."""
    if MAPPED:
        return mask & (offs >= 0) & (offs < load16(meta_ptr + i * 16 + 13, ALIGNED))
    else:
        return mask


@triton.jit
def row_block(meta_ptr, prog_param_ptr, pid, BLOCK_R: tl.constexpr, ALIGNED: tl.constexpr = False):
    """What program `pid` of a row-block grid works on: param i (its B, R, C and buffer offsets), matrix b of
    its batch, rows [rb * BLOCK_R, (rb + 1) * BLOCK_R). ALIGNED: C and the partials offset are multiples of 16
    (FactoredPlan.sizes_aligned)."""
    i = tl.load(prog_param_ptr + pid)
    B, R, C, row_off, col_off, part_off, prog_start, _cps, _fps = load_meta(meta_ptr, i, ALIGNED)
    nrb = tl.cdiv(R, BLOCK_R)
    local = pid - prog_start
    return i, B, R, C, row_off, col_off, part_off, local // nrb, local % nrb


@triton.jit
def _sq_stats_kernel(x_ptrs, x_ref, meta_ptr, maps_ptr, prog_param_ptr, stats_ptr, parts_ptr, inv_scale_ptr,
                     HAS_SCALE: tl.constexpr, MAPPED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    i, B, R, C, row_off, col_off, part_off, b, rb = row_block(meta_ptr, prog_param_ptr, pid, BLOCK_R, ALIGNED)
    x_ptr = load_ptr(x_ptrs, i, x_ref, ALIGNED)
    acc_t = stats_ptr.dtype.element_ty
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    row_base, rslot = row_map(meta_ptr, maps_ptr, i, b, rows, rmask, R, C, row_off, MAPPED, ALIGNED)
    part_base = part_off + (b * tl.cdiv(R, BLOCK_R) + rb).to(tl.int64) * C
    acc_r = tl.zeros([BLOCK_R], dtype=acc_t)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        offs = row_base[:, None] + cols[None, :]
        mask = in_piece(offs, rmask[:, None] & cmask[None, :], meta_ptr, i, MAPPED, ALIGNED)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        x = x.to(acc_t) * inv
        sq = x * x
        acc_r += tl.sum(sq, 1)
        tl.store(parts_ptr + part_base + cols, tl.sum(sq, 0), mask=cmask)
    tl.store(stats_ptr + rslot, acc_r, mask=rmask)


@triton.jit
def _col_reduce_kernel(meta_ptr, maps_ptr, prog_param_ptr, stats_ptr, parts_ptr, MAPPED: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(stats_ptr + col_map(meta_ptr, maps_ptr, i, b, cols, cmask, C, col_off, MAPPED), acc, mask=cmask)


@triton.jit
def _factor_kernel(meta_ptr, prog_param_ptr, stats_ptr, row_ptrs, col_ptrs, step_ptrs, found_inf_ptr, beta, decay_rate, eps,
                   hyper_ptr, BETA_FROM_STEP: tl.constexpr, HAS_INF: tl.constexpr, HYPER_FROM_PTR: tl.constexpr,
                   BLOCK: tl.constexpr):
    """R_t = b R + (1-b)(rowsum/C + eps), C_t likewise; stats <- rsqrt(R_t/mean R_t), rsqrt(C_t).

    b is `beta`, or 1 - step^decay_rate with BETA_FROM_STEP (Adafactor's schedule, eq. 7). With
    HYPER_FROM_PTR, (b, 1 - b, eps) are read from hyper_ptr[0:3] instead (with BETA_FROM_STEP too:
    (decay_rate, unused, eps)), a tensor of the stats dtype
    filled on the host in float64: compiled Triton passes Python floats as fp32, and 1 - b formed from an
    fp32 b = 0.9999 is off by 1.7e-4 relative.
    """
    pid = tl.program_id(0)
    i = tl.load(prog_param_ptr + pid)
    _B, _R, _C, row_off, col_off, _po, _ps, _cps, factprog_start = load_meta(meta_ptr, i)
    R = tl.load(meta_ptr + i * 16 + 9)  # the global matrix: the factors are whole on every rank
    C = tl.load(meta_ptr + i * 16 + 10)
    b = pid - factprog_start
    acc_t = stats_ptr.dtype.element_ty
    R_keep = keep_limit(R, found_inf_ptr, HAS_INF)
    C_keep = keep_limit(C, found_inf_ptr, HAS_INF)
    bt = beta
    if HYPER_FROM_PTR:
        eps = tl.load(hyper_ptr + 2).to(acc_t)
    if BETA_FROM_STEP:
        if HYPER_FROM_PTR:
            decay_rate = tl.load(hyper_ptr).to(acc_t)
        step = tl.load(tl.load(step_ptrs + i).to(tl.pointer_type(tl.float32))).to(acc_t)
        bt = 1.0 - tl.exp(decay_rate * tl.log(step))
    omb = 1.0 - bt
    if HYPER_FROM_PTR and not BETA_FROM_STEP:
        bt = tl.load(hyper_ptr).to(acc_t)
        omb = tl.load(hyper_ptr + 1).to(acc_t)
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
def _usq_kernel(g_ptrs, g_ref, p_ptrs, meta_ptr, maps_ptr, prog_param_ptr, stats_ptr, part_ptr, inv_scale_ptr,
                HAS_SCALE: tl.constexpr, WIDTH: tl.constexpr, SCALE_PARAM: tl.constexpr, MAPPED: tl.constexpr,
                ALIGNED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """part[pid * WIDTH] = sum over the program's rows of U^2, U = G rsqrt(R_t / mean R_t) rsqrt(C_t) (the
    factors `_factor_kernel` left in stats); with WIDTH 2 also part[pid * 2 + 1] = the rows' sum of X^2
    (zero unless SCALE_PARAM)."""
    pid = tl.program_id(0)
    i, B, R, C, row_off, col_off, _po, b, rb = row_block(meta_ptr, prog_param_ptr, pid, BLOCK_R, ALIGNED)
    acc_t = stats_ptr.dtype.element_ty
    g_ptr = load_ptr(g_ptrs, i, g_ref, ALIGNED)
    p_ptr = load_ptr(p_ptrs, i, g_ref, ALIGNED)
    inv = unscale_factor(inv_scale_ptr, HAS_SCALE)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    row_base, rslot = row_map(meta_ptr, maps_ptr, i, b, rows, rmask, R, C, row_off, MAPPED, ALIGNED)
    rfac = tl.load(stats_ptr + rslot, mask=rmask, other=0.0)
    u_acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=acc_t)
    p_acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=acc_t)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        offs = row_base[:, None] + cols[None, :]
        mask = in_piece(offs, rmask[:, None] & cmask[None, :], meta_ptr, i, MAPPED, ALIGNED)
        cfac = tl.load(stats_ptr + col_map(meta_ptr, maps_ptr, i, b, cols, cmask, C, col_off, MAPPED), mask=cmask,
                       other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_t) * inv
        u = g * rfac[:, None] * cfac[None, :]
        u_acc += u * u
        if SCALE_PARAM:
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
            p_acc += p * p
    tl.store(part_ptr + pid * WIDTH, tl.sum(tl.sum(u_acc, 1), 0))
    if WIDTH == 2:
        tl.store(part_ptr + pid * 2 + 1, tl.sum(tl.sum(p_acc, 1), 0))


def launch_sq_stats(x_ptrs, x_ref, plan, stats, parts, inv_scale, *, aligned: bool = False):
    if plan.mapped:  # the slots of rows and columns held by other ranks
        stats.zero_()
    _sq_stats_kernel[(plan.n_progs,)](x_ptrs, x_ref, plan.meta, plan.maps, plan.prog_param, stats, parts,
                                      inv_scale if inv_scale is not None else stats,
                                      HAS_SCALE=inv_scale is not None, MAPPED=plan.mapped,
                                      ALIGNED=aligned and plan.sizes_aligned, BLOCK_R=plan.block_r,
                                      BLOCK_C=plan.block_c, **FP_FUSION)
    launch_col_reduce(plan, stats, parts)


def launch_col_reduce(plan, stats, parts):
    _col_reduce_kernel[(plan.n_colprogs,)](plan.meta, plan.maps, plan.colprog_param, stats, parts, MAPPED=plan.mapped,
                                           BLOCK_R=plan.block_r, BLOCK=plan.block_col, **FP_FUSION)


def launch_usq(g_ptrs, g_ref, p_ptrs, plan, stats, part, inv_scale, *, width: int, scale_parameter: bool = False,
               aligned: bool = False):
    _usq_kernel[(plan.n_progs,)](g_ptrs, g_ref, p_ptrs, plan.meta, plan.maps, plan.prog_param, stats, part,
                                 inv_scale if inv_scale is not None else stats, HAS_SCALE=inv_scale is not None,
                                 WIDTH=width, SCALE_PARAM=scale_parameter, MAPPED=plan.mapped,
                                 ALIGNED=aligned and plan.sizes_aligned, BLOCK_R=plan.block_r, BLOCK_C=plan.block_c,
                                 **FP_FUSION)


def launch_factors(plan, stats, row_ptrs, col_ptrs, step_ptrs, found_inf, *, beta=0.0, decay_rate=0.0, eps=0.0,
                   beta_from_step: bool, hyper=None):
    """`hyper`: optional tensor of stats' dtype holding (beta, 1 - beta, eps), used instead of the floats."""
    _factor_kernel[(plan.n_factprogs,)](plan.meta, plan.factprog_param, stats, row_ptrs, col_ptrs, step_ptrs,
                                             found_inf if found_inf is not None else stats, beta, decay_rate, eps,
                                             hyper if hyper is not None else stats,
                                             BETA_FROM_STEP=beta_from_step, HAS_INF=found_inf is not None,
                                             HYPER_FROM_PTR=hyper is not None, BLOCK=plan.block_vec, **FP_FUSION)


@dataclass
class MatrixView:
    """How the row-block programs see one factored param: view (B, R, C), global (GB, GR, GC), and for a
    sharded param the element shift, the elements held and the row/column maps (see the module docstring)."""
    B: int
    R: int
    C: int
    GB: int
    GR: int
    GC: int
    shift: int = 0
    count: int = -1
    rmap: torch.Tensor | None = None
    cmap: torch.Tensor | None = None

    @property
    def view_shape(self) -> tuple[int, int, int]:
        return self.B, self.R, self.C


def matrix_view(local_shape, lay, device) -> MatrixView:
    """The MatrixView of a factored param with local shape `local_shape` and layout `lay` (None: unsharded;
    flat layouts: the param holds `lay.count` real elements)."""
    if lay is None:
        b, r, c = math.prod(local_shape[:-2]), local_shape[-2], local_shape[-1]
        return MatrixView(b, r, c, b, r, c, 0, b * r * c)
    g = lay.global_shape
    gb, gr, gc = math.prod(g[:-2]), g[-2], g[-1]
    off, n = lay.flat if lay.is_flat else (0, None)
    mat = lay.base if lay.is_flat else lay  # the matrix batch the elements are a range of (None: the global one)
    if mat is None:
        bm, rm, cm = gb, gr, gc
        mr = torch.arange(gb * gr, dtype=torch.int64, device=device)
        mc = torch.arange(gb * gc, dtype=torch.int64, device=device)
    else:
        if mat.is_flat:
            raise NotImplementedError("fastopt: a flat range of a flat range has no factored kernel layout")
        nd = len(g)
        shape = [g[d] if idx is None else len(idx) for d, idx in enumerate(mat.index)]
        bm, rm, cm = math.prod(shape[:-2]), shape[-2], shape[-1]
        bidx = mat.batch_index(device)
        mr = (bidx[:, None] * gr + mat.dim_index(nd - 2, device)[None, :]).reshape(-1)
        mc = (bidx[:, None] * gc + mat.dim_index(nd - 1, device)[None, :]).reshape(-1)
    if n is None:
        n = bm * rm * cm
    if n == 0:
        return MatrixView(0, 0, 0, gb, gr, gc, 0, 0, mr[:0], mc[:0])
    per, last = rm * cm, off + n - 1
    b0, b1 = off // per, last // per
    # One matrix: only the rows the range touches; several: whole matrices (at most two partly held).
    rs, rv = ((off // cm) % rm, (last // cm) % rm - (off // cm) % rm + 1) if b0 == b1 else (0, rm)
    bv = b1 - b0 + 1
    bs = b0 + torch.arange(bv, dtype=torch.int64, device=device)
    rows = (bs[:, None] * rm + rs + torch.arange(rv, dtype=torch.int64, device=device)[None, :]).reshape(-1)
    cols = (bs[:, None] * cm + torch.arange(cm, dtype=torch.int64, device=device)[None, :]).reshape(-1)
    return MatrixView(bv, rv, cm, gb, gr, gc, off - (b0 * rm + rs) * cm, n, mr[rows], mc[cols])


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
    maps: torch.Tensor
    mapped: bool
    sizes_aligned: bool  # every C, shard shift and count a multiple of common.ALIGN_ELEMS (see ALIGNED)
    max_side: int  # the largest R or C of the views

    @staticmethod
    def build(views: list, device: torch.device) -> "FactoredPlan":
        """`views`: a MatrixView per param, or (B, R, C) for an unsharded one. Any view with maps makes every
        kernel of the plan MAPPED (unsharded params get identity maps: O(rows + columns) int64)."""
        views = [v if isinstance(v, MatrixView) else MatrixView(*v, *v) for v in views]
        mapped = any(v.rmap is not None for v in views)
        shapes = [v.view_shape for v in views]
        block_r, block_c = tile_shape(max(max(c for _, _, c in shapes), 1), sum(b * r for b, r, _ in shapes))
        if INTERPRET:
            block_r, block_c = min(block_r, 16), min(block_c, 64)
        block_col = 64 if INTERPRET else 256
        meta, progs, colprogs, factprogs = [], [], [], []
        row_off = part_off = 0
        for (b, r, c), v in zip(shapes, views):
            progs.append(b * common.cdiv(r, block_r))
            colprogs.append(b * common.cdiv(c, block_col))
            factprogs.append(v.GB)  # the factors are global: every rank forms all of them
        prog_param, prog_starts = program_table(progs, device)
        colprog_param, colprog_starts = program_table(colprogs, device)
        factprog_param, factprog_starts = program_table(factprogs, device)
        col_total = sum(v.GB * v.GR for v in views)
        col_off = col_total
        maps, map_off = [], 0
        for k, ((b, r, c), v) in enumerate(zip(shapes, views)):
            rmap_off, cmap_off = map_off, map_off + b * r
            if mapped:
                ar = torch.arange
                maps += [v.rmap if v.rmap is not None else ar(b * r, dtype=torch.int64, device=device),
                         v.cmap if v.cmap is not None else ar(b * c, dtype=torch.int64, device=device)]
                map_off += b * r + b * c
            meta += [b, r, c, row_off, col_off, part_off, prog_starts[k], colprog_starts[k], factprog_starts[k],
                     v.GR, v.GC, v.GB * v.GR * v.GC, v.shift, v.count if v.count >= 0 else b * r * c, rmap_off,
                     cmap_off]
            row_off += v.GB * v.GR
            col_off += v.GB * v.GC
            part_off += b * common.cdiv(r, block_r) * c
        maps = torch.cat(maps).to(torch.int64) if maps else torch.zeros(1, dtype=torch.int64, device=device)
        sizes_aligned = multiples([c for _, _, c in shapes] + [x for v in views for x in (v.shift, max(v.count, 0))])
        return FactoredPlan(len(shapes), to_device(meta, torch.int64, device), prog_param, colprog_param,
                            factprog_param, sum(progs), sum(colprogs), sum(factprogs), block_r, block_c, block_col,
                            256 if INTERPRET else 1024, col_off, part_off, prog_starts, maps, mapped, sizes_aligned,
                            max(max(r, c) for _, r, c in shapes))


class BucketPlan:
    """What Adafactor's and CAME's plans of a bucket share, fixed between steps: the params in kernel order
    (`order`: those factored over their last two dims, ndim >= 2 globally, then the vectors), the factored
    kernels' tables (`fplan`), the pointer tables of params and step counters, the vector kernels' programs
    (`block_v` elements each) and their (elements here, first program, global elements) `vmeta`, the per-param
    segments of the partial sums (`part`, `width` per program: the factored programs, then the vector ones),
    summed into `sums` (`width` per param), and the factor scratch `stats` (`new_parts()` makes the other one
    for each step)."""

    def __init__(self, params, states, device, acc_dtype, layouts, block_v: int, width: int):
        layouts = layouts or [None] * len(params)
        self.gshapes = [tuple(p.shape) if lay is None else lay.global_shape for p, lay in zip(params, layouts)]
        self.fac = [k for k, s in enumerate(self.gshapes) if len(s) >= 2]
        self.vec = [k for k, s in enumerate(self.gshapes) if len(s) < 2]
        self.order = self.fac + self.vec
        self.n_fac = len(self.fac)
        self.sr = common.SRTable([layouts[k] for k in self.order], [params[k].numel() for k in self.order],
                                 self.order, device)
        views = [matrix_view(tuple(params[k].shape), layouts[k], device) for k in self.fac]
        self.fplan = f = FactoredPlan.build(views, device) if self.fac else None
        self.p_ptrs = common.ptr_table([params[k] for k in self.order], device)
        self.grad_table = common.GradTable()
        self.step_ptrs = common.ptr_table([states[k]["step"] for k in self.order], device)
        # ALIGNED launches (common.ALIGN_BYTES): the tensors here and this step's grads aligned, and the sizes
        # the kernels mask with multiples of common.ALIGN_ELEMS (the factored ones: FactoredPlan.sizes_aligned).
        self.tensors_aligned = common.aligned(params) and common.aligned([t for s in states for t in s.values()])
        self.vec_sizes_aligned = multiples(params[k].numel() for k in self.vec)
        vprogs = [common.cdiv(params[k].numel(), block_v) for k in self.vec]
        self.vprog_param, vstarts = program_table(vprogs, device)
        self.vmeta = to_device([x for k, s in zip(self.vec, vstarts)
                                for x in (params[k].numel(), s, math.prod(self.gshapes[k]))], torch.int64, device)
        self.n_vprogs = sum(vprogs)
        self.fac_progs = f.n_progs if f else 0
        starts = (f.prog_starts if f else []) + [self.fac_progs + s for s in vstarts]
        lens = [b * common.cdiv(r, f.block_r) for b, r, _ in (v.view_shape for v in views)] + vprogs
        self.seg_start = to_device(starts, torch.int64, device)
        self.seg_len = to_device(lens, torch.int64, device)
        self.stats = torch.empty(f.stats_numel if f else 0, dtype=acc_dtype, device=device)
        self.part = torch.empty(width * (self.fac_progs + self.n_vprogs), dtype=acc_dtype, device=device)
        self.sums = torch.empty(width * len(params), dtype=acc_dtype, device=device)
        self._hyper_key = self._hyper = None

    def new_parts(self) -> torch.Tensor:
        """The statistics kernels' column partials for one step: 4 / BLOCK_R bytes per element of the factored
        params (1/16 byte at 64-row blocks), so many more than the factors themselves hold that they are made for
        each step and dropped after it (the allocator can give that memory to the forward and backward between
        steps), not kept with the plan. NaN under common.POISON."""
        n = self.fplan.parts_numel if self.fplan else 0
        parts = torch.empty(n, dtype=self.stats.dtype, device=self.stats.device)
        return parts.fill_(float("nan")) if common.POISON else parts

    def hyper(self, values: tuple) -> torch.Tensor:
        """The hyperparameter tensor (floats, in the kernels' H_* order), rebuilt only when a value changed (an
        lr schedule)."""
        if values != self._hyper_key:
            self._hyper = to_device([float(v) for v in values], self.sums.dtype, self.sums.device)
            self._hyper_key = values
        return self._hyper
