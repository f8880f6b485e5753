"""fastopt.Lamb against eager PyTorch LAMBs.

- "eager LAMB (per-param loop)": the LAMB step as ColossalAI's and pytorch-optimizer's `Lamb` write it: one
  parameter at a time, a handful of elementwise kernels each, two norms, and a Python `if` on the norms
  (`if weight_norm == 0 or adam_norm == 0`), i.e. a host sync per parameter. The issue's target compares
  against this one.
- "foreach LAMB (torch._foreach_*)": the same maths with torch's multi-tensor foreach ops and the trust
  ratios as device tensors (no host sync): the strongest eager baseline we know how to write.

All three run the same maths (issue 4: bias correction in the step size, weight_decay 0.01, no clamp).
Both eager baselines keep m and v in the param's dtype (`torch.zeros_like(p)`, as those libraries do);
fastopt keeps them in fp32.

Bytes per step for a param of N elements of s bytes, with fp32 m and v (a = 4 bytes):

- what the algorithm must move (`min_bytes`, the basis of GB/s and % copy): read g and p, write p (3 s N),
  read and write m and v (4 a N).
- what fastopt's kernels move (`kernel_bytes`), from the passes in kernels/lamb.py's docstring: pass 1 reads
  g, p, m, v and writes m, v; pass 3 reads m, v, p again and writes p: 4 s N + 6 a N, plus the per-program
  partial sums (2 values written and read per BLOCK elements). The second read of m, v and p follows from
  the maths: no element of p may be written before ||a|| over the whole parameter (all its shards) is
  known, so a kernel that cannot keep the whole parameter on chip reads it twice. Storing a instead
  (write a, read a) moves the same bytes as re-reading m and v. With fp32 params that caps % copy at
  (3*4 + 4*4) / (4*4 + 6*4) = 70% of what the kernels actually achieve (`kernel_gbps`).
- nbits=8 (m and v as 1-byte codes plus one fp32 absmax per block of B, for params of min_8bit_size elements
  or more; smaller ones keep fp32 m and v and take the 32-bit kernels): the algorithm moves 3 s N + 4 N
  (+ 16 N / B for the absmax); fastopt's 8-bit kernels read g and p in both passes (pass 1 stores nothing,
  so that pass 3 can rebuild the exact m_t, v_t) and the codes twice: 5 s N + 6 N (+ 24 N / B), plus the
  partial sums.
  Update these counts when the kernels change.
"""
from __future__ import annotations

import math

import torch

try:
    from . import common
except ImportError:
    import common

import fastopt
from fastopt import ops

STEM = "lamb"
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)


def _state_bytes(dtype) -> int:
    return 8 if dtype == torch.float64 else 4


def min_bytes(pset, dtype) -> int:
    return common.min_bytes(pset, dtype, reads=2, writes=1, state_elem=4.0 * _state_bytes(dtype))


def min_bytes8(pset, dtype, block_size=256, min_8bit_size=4096) -> int:
    """nbits=8: codes and block absmax for params of min_8bit_size elements or more; the smaller ones keep
    full-precision m and v, as fastopt.Lamb(nbits=8) does (the 1b set's norm weights)."""
    s, total = common.elem_bytes(dtype), 0
    for _, shape in pset.shapes:
        n = math.prod(shape)
        state = 4 * n + 16 * math.ceil(n / block_size) if n >= min_8bit_size else 4 * _state_bytes(dtype) * n
        total += 3 * s * n + state
    return int(total)


def kernel_bytes(pset, dtype, nbits=32, block_size=256, min_8bit_size=4096) -> int | None:
    """Bytes fastopt's Triton kernels move for one step over `pset` (see the module docstring); with nbits=8,
    params under min_8bit_size take the 32-bit kernels."""
    try:
        from fastopt.kernels.lamb import BLOCK, TILE8
    except ImportError:  # no Triton: no kernels to count
        return None
    s, a = common.elem_bytes(dtype), _state_bytes(dtype)
    total = 0
    for _, shape in pset.shapes:
        n = math.prod(shape)
        if nbits == 8 and n >= min_8bit_size:
            progs = math.ceil(n / max(TILE8, block_size))
            total += (5 * s + 6) * n + 24 * math.ceil(n / block_size) + 2 * 2 * a * progs
        else:
            total += (4 * s + 6 * a) * n + 2 * 2 * a * math.ceil(n / BLOCK)
    return int(total)


class EagerLamb(torch.optim.Optimizer):
    """LAMB one parameter at a time, the way ColossalAI's and pytorch-optimizer's `Lamb.step` do it."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = group["lr"]
                if group["bias_correction"]:
                    step_size *= math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
                weight_norm = p.pow(2).sum().sqrt()
                adam_step = exp_avg / exp_avg_sq.sqrt().add(group["eps"])
                if group["weight_decay"] != 0:
                    adam_step.add_(p, alpha=group["weight_decay"])
                adam_norm = adam_step.pow(2).sum().sqrt()
                if weight_norm == 0 or adam_norm == 0:
                    trust_ratio = 1
                else:
                    trust_ratio = weight_norm / adam_norm
                p.add_(adam_step, alpha=-step_size * trust_ratio)


class ForeachLamb(torch.optim.Optimizer):
    """The same LAMB with torch._foreach_* ops over all params and the trust ratios kept on the device."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            gs = [p.grad for p in ps]
            for p in ps:
                if not self.state[p]:
                    self.state[p].update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            ms = [self.state[p]["exp_avg"] for p in ps]
            vs = [self.state[p]["exp_avg_sq"] for p in ps]
            step = self.state[ps[0]]["step"] + 1
            for p in ps:
                self.state[p]["step"] = step
            torch._foreach_lerp_(ms, gs, 1 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_add_(denom, group["eps"])
            upd = torch._foreach_div(ms, denom)
            if group["weight_decay"] != 0:
                torch._foreach_add_(upd, ps, alpha=group["weight_decay"])
            p_norm = torch.stack(torch._foreach_norm(ps))
            a_norm = torch.stack(torch._foreach_norm(upd))
            ratio = torch.where((p_norm > 0) & (a_norm > 0), p_norm / a_norm, torch.ones_like(p_norm))
            step_size = group["lr"]
            if group["bias_correction"]:
                step_size *= math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
            torch._foreach_mul_(upd, list((ratio * -step_size).to(ps[0].dtype).unbind()))
            torch._foreach_add_(ps, upd)


def _backend(params) -> str:
    return "triton" if ops.use_triton(params[0]) else "torch reference"


def run(args) -> list[dict]:
    out = []
    for pset in common.param_sets(args):
        for dtype in common.dtypes(args):
            mb = min_bytes(pset, dtype)
            kb = kernel_bytes(pset, dtype)
            out.append(common.measure(args, STEM, "fastopt.Lamb", pset, dtype, lambda ps: fastopt.Lamb(ps, **HYPER),
                                      min_bytes=mb, kernel_bytes=kb, ours=True, backend=_backend,
                                      notes="kernel B/param counted from kernels/lamb.py's passes: g read 1x, "
                                            "p read 2x and written 1x, m and v read 2x and written 1x"))
            out.append(common.measure(args, STEM, "fastopt.Lamb(nbits=8)", pset, dtype,
                                      lambda ps: fastopt.Lamb(ps, nbits=8, **HYPER), min_bytes=min_bytes8(pset, dtype),
                                      kernel_bytes=kernel_bytes(pset, dtype, nbits=8), ours=True, backend=_backend,
                                      notes="8-bit m, v (blocks of 256; params under 4096 elements keep fp32); "
                                            "GB/s over the 8-bit minimal bytes"))
            out.append(common.measure(args, STEM, "eager LAMB (per-param loop)", pset, dtype,
                                      lambda ps: EagerLamb(ps, **HYPER), min_bytes=mb, backend="eager",
                                      notes="ColossalAI / pytorch-optimizer style; m, v in the param dtype"))
            out.append(common.measure(args, STEM, "foreach LAMB (torch._foreach_*)", pset, dtype,
                                      lambda ps: ForeachLamb(ps, **HYPER), min_bytes=mb, backend="foreach",
                                      notes="no host sync; m, v in the param dtype"))
    return out


if __name__ == "__main__":
    common.main(STEM, run)
