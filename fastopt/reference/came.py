"""CAME in plain torch: the spec, the CPU path and the oracle of the Triton kernels.

Luo et al., "CAME: Confidence-guided Adaptive Memory Efficient Optimization" (ACL 2023), Algorithm 1, with
the conventions of came-pytorch's `CAME` (no bias correction, decoupled weight decay scaled by lr). For a
parameter X with gradient G (a matrix over the last two dims; leading dims are a batch of matrices;
vectors and scalars are unfactored):

    R_t = b2 R_{t-1} + (1 - b2) mean_cols(G^2 + eps1)                   row factor          (Alg. 1, l. 5)
    C_t = b2 C_{t-1} + (1 - b2) mean_rows(G^2 + eps1)                   column factor       (l. 6)
    U_t = G / sqrt(R_t C_t / mean(R_t))                                 (unfactored: G / sqrt(V_t), l. 7-8)
    U_t = U_t / max(1, RMS(U_t) / d)                                    update clipping     (l. 9)
    M_t = b1 M_{t-1} + (1 - b1) U_t                                     momentum            (l. 10)
    S_t = (U_t - M_t)^2 + eps2                                          instability         (l. 11)
    R'_t = b3 R'_{t-1} + (1 - b3) mean_cols(S_t)                        (l. 12)
    C'_t = b3 C'_{t-1} + (1 - b3) mean_rows(S_t)                        (l. 13)
    X_t = X_{t-1} - lr wd X_{t-1} - lr M_t / sqrt(R'_t C'_t / mean(R'_t))   (unfactored: - lr M_t; l. 14-15)

The step runs in phases so that a distributed caller can sum the partial statistics of every shard with
one collective per phase: the step (a generator) yields a flat buffer, which the caller sums in place over
the ranks that share the params (fastopt.distributed.phases) before it goes on.
CAME has three: the row/column sums of G^2, the sums of U^2 (for the RMS clip), the row/column sums of
(U - M)^2.

`nbits=8` keeps M in the 8-bit block-wise format of `fastopt.reference.quant` (bitsandbytes' signed dynamic
map, blocks of QBLOCK elements of the flattened param): M_{t-1} is dequantized, M_t is computed in full
precision and used as above, then quantized for storage.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import quant
from .adafactor import _commit, factored_sizes, gather_factors, scatter_rows_cols
from .common import sr_args, stochastic_round_bf16, store_unscaled

QBLOCK = 256  # bitsandbytes' block size for 8-bit optimizer states


def reduction_sizes(shapes) -> list[tuple[int, torch.dtype]]:
    """The buffers `came_phases` yields to be summed for a bucket of params of these global shapes, in order
    ((elements, dtype) per phase): G^2 row/column sums, U^2 sums, instability row/column sums."""
    rc = factored_sizes(shapes)
    mid = [(len(shapes), torch.float64)]
    return [(rc, torch.float64)] + mid + [(rc, torch.float64)] if rc else mid


def _row_col_sums(xs: list[Tensor], layouts: list, states: list[dict], keys: tuple[str, str]) -> Tensor | None:
    """One flat fp64 buffer: for every factored x, its (global) row sums then its column sums; a sharded x's
    local sums scattered into zeros of the global size (`states[i][keys[0]]`, `[keys[1]]` give the sizes)."""
    parts = []
    for x, lay, s in zip(xs, layouts, states):
        if lay is None:
            parts += [x.sum(-1).flatten(), x.sum(-2).flatten()]
        else:
            parts += list(scatter_rows_cols(x, lay, s[keys[0]], s[keys[1]]))
    return torch.cat([t.to(torch.float64) for t in parts]) if parts else None


def _factors(stats: Tensor, pos: int, row: Tensor, col: Tensor, beta: float, eps: float, shape, lay=None) -> tuple:
    """EMA of the row/column means of x (+ eps) from their sums at stats[pos:]; the update's multipliers
    rsqrt(R_t / mean(R_t)) (unsqueezed over columns) and rsqrt(C_t) (over rows), or for a sharded param
    (`lay`) those of its local elements; the new R_t, C_t; new pos. `shape` is the global shape."""
    rsum = stats[pos:pos + row.numel()].view_as(row).to(row.dtype)
    pos += row.numel()
    csum = stats[pos:pos + col.numel()].view_as(col).to(col.dtype)
    pos += col.numel()
    r_new = beta * row + (1 - beta) * (rsum / shape[-1] + eps)
    c_new = beta * col + (1 - beta) * (csum / shape[-2] + eps)
    if lay is None:
        r_fac = (r_new / r_new.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
        c_fac = c_new.unsqueeze(-2).rsqrt()
    else:
        r_fac, c_fac = gather_factors((r_new / r_new.mean(dim=-1, keepdim=True)).rsqrt(), c_new.rsqrt(), lay)
    return r_fac, c_fac, r_new, c_new, pos


def came_phases(params: list[Tensor], grads: list[Tensor], states: list[dict], *, lr, eps, clip_threshold, betas,
                weight_decay, bf16_stochastic_round: bool = False, nbits: int = 32, inv_scale: Tensor | None = None,
                found_inf: Tensor | None = None, sharded: bool = False, layouts: list | None = None,
                sr_ids: list | None = None):
    """One step over a bucket of params (one device, one dtype), a generator: with `sharded`, it yields each phase's
    buffer to be summed over the ranks that share the params (fastopt.distributed.phases). `layouts[i]`
    (fastopt.distributed.layout.Layout or None) places param i's local elements in its global tensor (flat layouts:
    `params[i]` holds only the real elements, see `layout.real_elements`); the four factors are global, identical on
    every rank. `bf16_stochastic_round`: bf16 params are rounded by common.stochastic_round_bf16, its noise a function
    of (step, the param's id in `sr_ids` (None: its index in `params`), the element's offset in the global tensor)
    only."""
    eps1, eps2 = eps
    beta1, beta2, beta3 = betas
    layouts = layouts or [None] * len(params)
    shapes = [tuple(p.shape) if lay is None else lay.global_shape for p, lay in zip(params, layouts)]
    factored = [len(shape) >= 2 for shape in shapes]
    acc = [s["exp_avg_sq_row"].dtype if f else s["exp_avg_sq"].dtype for f, s in zip(factored, states)]
    gs = [g.to(a) * inv_scale if inv_scale is not None else g.to(a) for g, a in zip(grads, acc)]
    fac = [i for i, f in enumerate(factored) if f]
    fac_lays, fac_states = [layouts[i] for i in fac], [states[i] for i in fac]

    # Phase 1: sums of G^2 over each row and column of every factored param, in one flat buffer.
    stats = _row_col_sums([gs[i] * gs[i] for i in fac], fac_lays, fac_states, ("exp_avg_sq_row", "exp_avg_sq_col"))
    if stats is not None and sharded:
        yield stats

    # Phase 2: new second-moment factors (or V_t) and the unclipped update's sum of squares.
    updates, new_states, sums = [], [], []
    pos = 0
    for g, s, shape, f, lay in zip(gs, states, shapes, factored, layouts):
        if f:
            r_fac, c_fac, r_new, c_new, pos = _factors(stats, pos, s["exp_avg_sq_row"], s["exp_avg_sq_col"], beta2,
                                                       eps1, shape, lay)
            u = g * r_fac * c_fac
            new_states.append({"exp_avg_sq_row": r_new, "exp_avg_sq_col": c_new})
        else:
            v_new = beta2 * s["exp_avg_sq"] + (1 - beta2) * (g * g + eps1)
            u = g * v_new.rsqrt()
            new_states.append({"exp_avg_sq": v_new})
        updates.append(u)
        sums.append((u * u).sum().to(torch.float64))
    sums = torch.stack(sums)
    if sharded:
        yield sums

    # Phase 3: clip, momentum, and the sums of the instability (U - M)^2 of every factored param.
    moms, res = [], []
    for i, (g, s, shape, f) in enumerate(zip(gs, states, shapes, factored)):
        clip = torch.clamp((sums[i].to(g.dtype) / math.prod(shape)).sqrt() / clip_threshold, min=1.0)
        u = updates[i] / clip
        m_old = _load_momentum(s, g.dtype, nbits)
        m_new = beta1 * m_old + (1 - beta1) * u
        moms.append(m_new)
        if f:
            res.append((u - m_new).square())
    res_stats = _row_col_sums(res, fac_lays, fac_states, ("exp_avg_res_row", "exp_avg_res_col"))
    if res_stats is not None and sharded:
        yield res_stats

    # Phase 4: instability factors, confidence-scaled update, decay, write.
    pos = 0
    bf16_sr = bf16_stochastic_round and params[0].dtype == torch.bfloat16
    sr = sr_args(sr_ids, layouts, params[0].device, len(params)) if bf16_sr else None
    for i, (p, g, s, m_new, ns, shape, f, lay) in enumerate(
            zip(params, gs, states, moms, new_states, shapes, factored, layouts)):
        if f:
            r_fac, c_fac, r_new, c_new, pos = _factors(res_stats, pos, s["exp_avg_res_row"], s["exp_avg_res_col"],
                                                       beta3, eps2, shape, lay)
            ns.update(exp_avg_res_row=r_new, exp_avg_res_col=c_new)
            u = m_new * r_fac * c_fac
        else:
            u = m_new
        pf = p.to(g.dtype)
        p_new = pf - (lr * weight_decay) * pf - lr * u if weight_decay != 0 else pf - lr * u
        for k, v in ns.items():
            _commit(s[k], v, found_inf)
        _store_momentum(s, m_new, nbits, found_inf)
        if bf16_sr:
            p_new = stochastic_round_bf16(p_new, s["step"], *sr[i])
        _commit(p, p_new, found_inf)
        if inv_scale is not None:
            store_unscaled(grads[i], g, found_inf)


def _load_momentum(s: dict, dtype: torch.dtype, nbits: int) -> Tensor:
    if nbits == 32:
        return s["exp_avg"].to(dtype)
    return quant.dequantize_blockwise(s["exp_avg"], s["exp_avg_absmax"], QBLOCK).to(dtype)


def _store_momentum(s: dict, m_new: Tensor, nbits: int, found_inf: Tensor | None) -> None:
    if nbits == 32:
        _commit(s["exp_avg"], m_new, found_inf)
        return
    codes, absmax = quant.quantize_blockwise(m_new.to(torch.float32), QBLOCK)
    _commit(s["exp_avg"], codes, found_inf)
    _commit(s["exp_avg_absmax"], absmax, found_inf)
