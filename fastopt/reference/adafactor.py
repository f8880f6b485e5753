"""Adafactor in plain torch: the spec, the CPU path and the oracle of the Triton kernels.

Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost" (2018), with the
conventions of transformers' `Adafactor`. For a parameter X with gradient G at step t (a matrix over the
last two dims; leading dims are a batch of matrices; vectors and scalars are unfactored):

    rho_t   = min(1e-6 t if warmup_init else 1e-2, 1/sqrt(t))           relative step      (Alg. 4)
    alpha_t = max(eps2, RMS(X_{t-1})) * rho_t   if scale_parameter      step size          (Alg. 4)
    beta2_t = 1 - t^decay_rate                                          (decay_rate = -0.8, eq. 7)
    R_t = beta2_t R_{t-1} + (1 - beta2_t) mean_cols(G^2 + eps1)         row factor         (Alg. 4)
    C_t = beta2_t C_{t-1} + (1 - beta2_t) mean_rows(G^2 + eps1)         column factor
    U_t = G / sqrt(R_t C_t / mean(R_t))                                 (unfactored: G / sqrt(V_t))
    U_t = U_t / max(1, RMS(U_t) / d)                                    update clipping    (sec. 5)
    U_t = alpha_t U_t;   M_t = beta1 M_{t-1} + (1 - beta1) U_t; U_t = M_t   if beta1 is set
    X_t = X_{t-1} - weight_decay alpha_t X_{t-1} - U_t

The step runs in phases so that a distributed caller can sum the partial statistics of every shard with
one collective per phase: the step (a generator) yields a flat buffer, which the caller sums in place over
the ranks that share the params (fastopt.distributed.phases) before it goes on.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import sr_args, stochastic_round_bf16, store_unscaled


def is_factored(p: Tensor) -> bool:
    return p.dim() >= 2


def step_size(step: Tensor, p_sq_sum: Tensor, numel: int, *, lr, eps2, relative_step, warmup_init,
              scale_parameter) -> Tensor:
    """alpha_t: relative or fixed step, times max(eps2, RMS(X)) when scale_parameter."""
    if relative_step:
        min_step = 1e-6 * step if warmup_init else torch.full_like(step, 1e-2)
        rel = torch.minimum(min_step, step.rsqrt())
    else:
        rel = torch.full_like(step, lr)
    if scale_parameter:
        return rel * torch.clamp((p_sq_sum / numel).sqrt(), min=eps2)
    return rel


def _commit(dst: Tensor, new: Tensor, found_inf: Tensor | None) -> None:
    """dst <- new, unless GradScaler found an inf this step (then dst is left as it was)."""
    if found_inf is not None:
        new = torch.where(found_inf > 0, dst, new.to(dst.dtype))
    dst.copy_(new)


def scatter_rows_cols(sq: Tensor, lay, row: Tensor, col: Tensor) -> tuple[Tensor, Tensor]:
    """Row and column sums (fp64) of the local elements `sq` of a sharded factored param, scattered into
    zeros shaped like the global row factor `row` (..., R) and column factor `col` (..., C): summed over
    the ranks that hold its pieces, they are the global sums. The elements may be any piece of the matrix
    (whole rows or columns, strided blocks, a flat range cut mid-row)."""
    ridx, cidx = lay.factor_index(sq.device)
    sq = sq.to(torch.float64).reshape(-1)
    rows = torch.zeros(row.numel(), dtype=torch.float64, device=sq.device).index_add_(0, ridx.reshape(-1), sq)
    cols = torch.zeros(col.numel(), dtype=torch.float64, device=sq.device).index_add_(0, cidx.reshape(-1), sq)
    return rows, cols


def gather_factors(r_fac: Tensor, c_fac: Tensor, lay) -> tuple[Tensor, Tensor]:
    """The row and column multipliers of every local element of a sharded param, shaped like its local piece,
    from the global (..., R) and (..., C) factors."""
    ridx, cidx = lay.factor_index(r_fac.device)
    return r_fac.reshape(-1)[ridx], c_fac.reshape(-1)[cidx]


def factored_sizes(shapes) -> int:
    """Elements of the row and column statistics of every factored shape: sum of prod(shape[:-1]) +
    prod(shape[:-2]) * shape[-1], O(rows + columns) per matrix."""
    return sum(math.prod(s[:-1]) + math.prod(s[:-2]) * s[-1] for s in shapes if len(s) >= 2)


def reduction_sizes(shapes) -> list[tuple[int, torch.dtype]]:
    """The buffers `adafactor_phases` yields to be summed for a bucket of params of these global shapes, in order
    ((elements, dtype) per phase): the benchmark counts collectives and bytes from this, a test checks it."""
    out = []
    if any(len(s) >= 2 for s in shapes):
        out.append((factored_sizes(shapes), torch.float64))
    return out + [(2 * len(shapes), torch.float64)]


def adafactor_phases(params: list[Tensor], grads: list[Tensor], states: list[dict], *, lr, eps, clip_threshold,
                     decay_rate, beta1, weight_decay, scale_parameter, relative_step, warmup_init,
                     bf16_stochastic_round: bool = False, inv_scale: Tensor | None = None,
                     found_inf: Tensor | None = None, sharded: bool = False, layouts: list | None = None,
                     sr_ids: list | None = None):
    """One step over a bucket of local tensors, a generator: with `sharded`, it yields each phase's buffer to be summed
    over the ranks that share the params (fastopt.distributed.phases). `layouts[i]` (fastopt.distributed.layout.Layout
    or None) places param i's local elements in its global tensor (flat layouts: `params[i]` holds only the real
    elements, see `layout.real_elements`); the row and column factors are global. `bf16_stochastic_round`: bf16 params
    are rounded by common.stochastic_round_bf16, its noise a function of (step, the param's id in `sr_ids` (None:
    its index in `params`), the element's offset in the global tensor) only."""
    eps1, eps2 = eps
    layouts = layouts or [None] * len(params)
    shapes = [tuple(p.shape) if lay is None else lay.global_shape for p, lay in zip(params, layouts)]
    acc = [s["exp_avg_sq_row"].dtype if len(shape) >= 2 else s["exp_avg_sq"].dtype
           for shape, s in zip(shapes, states)]
    gs = [g.to(a) * inv_scale if inv_scale is not None else g.to(a) for g, a in zip(grads, acc)]

    # Phase 1: sums of G^2 over each (global) row and column of every factored param, in one flat buffer.
    parts = []
    for g, s, shape, lay in zip(gs, states, shapes, layouts):
        if len(shape) >= 2:
            if lay is None:
                sq = (g * g).to(torch.float64)
                rows, cols = sq.sum(-1), sq.sum(-2)
            else:
                rows, cols = scatter_rows_cols(g * g, lay, s["exp_avg_sq_row"], s["exp_avg_sq_col"])
            parts += [rows.flatten(), cols.flatten()]
    stats = torch.cat(parts) if parts else None
    if stats is not None and sharded:
        yield stats

    # Phase 2: new factors (or second moments), the unclipped update's and the param's sums of squares.
    updates, new_states, sums = [], [], []
    pos = 0
    for p, g, s, shape, lay in zip(params, gs, states, shapes, layouts):
        beta2t = 1.0 - s["step"].to(g.dtype).pow(decay_rate)
        if len(shape) >= 2:
            rows, cols = s["exp_avg_sq_row"], s["exp_avg_sq_col"]
            rsum = stats[pos:pos + rows.numel()].view_as(rows).to(g.dtype)
            pos += rows.numel()
            csum = stats[pos:pos + cols.numel()].view_as(cols).to(g.dtype)
            pos += cols.numel()
            r_new = beta2t * rows + (1 - beta2t) * (rsum / shape[-1] + eps1)
            c_new = beta2t * cols + (1 - beta2t) * (csum / shape[-2] + eps1)
            r_fac = (r_new / r_new.mean(dim=-1, keepdim=True)).rsqrt()
            c_fac = c_new.rsqrt()
            if lay is None:
                u = g * r_fac.unsqueeze(-1) * c_fac.unsqueeze(-2)
            else:
                r_loc, c_loc = gather_factors(r_fac, c_fac, lay)
                u = g * r_loc * c_loc
            new_states.append({"exp_avg_sq_row": r_new, "exp_avg_sq_col": c_new})
        else:
            v_new = beta2t * s["exp_avg_sq"] + (1 - beta2t) * (g * g + eps1)
            u = g * v_new.rsqrt()
            new_states.append({"exp_avg_sq": v_new})
        updates.append(u)
        pf = p.to(g.dtype)
        sums += [(u * u).sum().to(torch.float64), (pf * pf).sum().to(torch.float64)]
    sums = torch.stack(sums)
    if sharded:
        yield sums

    # Phase 3: clip, scale, momentum, decay, write.
    bf16_sr = bf16_stochastic_round and params[0].dtype == torch.bfloat16
    sr = sr_args(sr_ids, layouts, params[0].device, len(params)) if bf16_sr else None
    for i, (p, g, s, u, shape) in enumerate(zip(params, gs, states, updates, shapes)):
        numel = math.prod(shape)
        u_sq, p_sq = sums[2 * i].to(g.dtype), sums[2 * i + 1].to(g.dtype)
        alpha = step_size(s["step"].to(g.dtype), p_sq, numel, lr=lr, eps2=eps2, relative_step=relative_step,
                          warmup_init=warmup_init, scale_parameter=scale_parameter)
        clip = torch.clamp((u_sq / numel).sqrt() / clip_threshold, min=1.0)
        u = u * (alpha / clip)
        if beta1 is not None:
            m_new = beta1 * s["exp_avg"] + (1 - beta1) * u
            new_states[i]["exp_avg"] = m_new
            u = m_new
        pf = p.to(g.dtype)
        p_new = pf - (weight_decay * alpha) * pf - u if weight_decay != 0 else pf - u
        for k, v in new_states[i].items():
            _commit(s[k], v, found_inf)
        if bf16_sr:
            p_new = stochastic_round_bf16(p_new, s["step"], *sr[i])
        _commit(p, p_new, found_inf)
        if inv_scale is not None:
            store_unscaled(grads[i], g, found_inf)
