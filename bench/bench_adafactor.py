"""fastopt.Adafactor against transformers' Adafactor and torch.optim.Adafactor(foreach=True).

All three run with their defaults (fastopt's are transformers': relative step, parameter scaling, update
clipping at 1.0, no momentum); torch.optim.Adafactor is torch's own variant of the same factored algorithm
(lr 1e-2, its own step-size rule), timed for speed only.

Bytes per step, default configuration (no momentum), for a param of N elements of s bytes:

- what the algorithm must move (`min_bytes`, the basis of GB/s and % copy): read the gradient, read the
  param, write the param: 3 s N; plus the factored row/column state read and written (negligible) and,
  for vectors, the full second moment read and written (8 N, fp32; vectors are a tiny share).
- what fastopt's kernels move (`kernel_bytes`), from the passes listed in kernels/adafactor.py's docstring:
  the gradient is read three times (row/column statistics; the sum of U^2 for the RMS clip; the update),
  the param twice (its sum of squares for `scale_parameter`; the update) and written once: 6 s N; plus the
  partial column sums that `_sq_stats_kernel` writes and `_col_reduce_kernel` reads back (fp32, one row of
  C per block of BLOCK_R rows: 2 * 4 / BLOCK_R bytes per element). The three gradient reads follow from
  the maths: the RMS of the update needs the factors of the whole matrix before any element of it may
  be written, so a kernel that does not keep the gradient on chip cannot reach the minimal bytes.
  Update this count when the kernels change.
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

STEM = "adafactor"


def min_bytes(pset, dtype) -> int:
    return common.min_bytes(pset, dtype, reads=2, writes=1, factored_state=1, vector_state=1)


def kernel_bytes(pset, dtype, *, scale_parameter: bool = True, beta1: bool = False) -> int | None:
    """Bytes fastopt's Triton kernels move for one step over `pset` (see the module docstring)."""
    try:
        from fastopt.kernels.common import tile_shape
    except ImportError:  # no Triton: no kernels to count
        return None
    s = common.elem_bytes(dtype)
    a = 8 if dtype == torch.float64 else 4
    mats = [shape for _, shape in pset.shapes if len(shape) >= 2]
    block_r = tile_shape(max(sh[-1] for sh in mats), sum(math.prod(sh[:-1]) for sh in mats))[0] if mats else 1
    total = 0
    for _, shape in pset.shapes:
        n = math.prod(shape)
        mom = 2 * a * n if beta1 else 0
        if len(shape) >= 2:
            b, r, c = math.prod(shape[:-2]), shape[-2], shape[-1]
            total += (3 + (2 if scale_parameter else 1) + 1) * s * n + mom
            total += 2 * a * b * math.ceil(r / block_r) * c          # partial column sums: written, read
            total += a * b * (r + c) * 6                              # state r/w, stats w/r/w/r (small)
        else:
            # _vec_stats: g, v r/w, p (scale); _vec_apply: v, g, p r/w
            total += (2 + (2 if scale_parameter else 1) + 1) * s * n + 3 * a * n + mom
    return total


def _backend(params) -> str:
    return "triton" if ops.use_triton(params[0]) else "torch reference"


def _transformers(params):
    from transformers.optimization import Adafactor
    return Adafactor(params)


def _torch_foreach(params):
    if not hasattr(torch.optim, "Adafactor"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.optim.Adafactor (added in 2.5)")
    return torch.optim.Adafactor(params, foreach=True)


def run(args) -> list[dict]:
    out = []
    for pset in common.param_sets(args):
        for dtype in common.dtypes(args):
            mb = min_bytes(pset, dtype)
            kb = kernel_bytes(pset, dtype)
            out.append(common.measure(args, STEM, "fastopt.Adafactor", pset, dtype, lambda ps: fastopt.Adafactor(ps),
                                      min_bytes=mb, kernel_bytes=kb, ours=True, backend=_backend,
                                      notes="kernel B/param counted from kernels/adafactor.py's passes: gradient "
                                            "read 3x, param read 2x and written 1x, plus partial column sums"))
            out.append(common.measure(args, STEM, "transformers Adafactor", pset, dtype, _transformers,
                                      min_bytes=mb, backend="eager"))
            out.append(common.measure(args, STEM, "torch.optim.Adafactor(foreach)", pset, dtype, _torch_foreach,
                                      min_bytes=mb, backend="foreach",
                                      notes="torch's own Adafactor variant (lr 1e-2, its step-size rule); speed only"))
    return out


if __name__ == "__main__":
    common.main(STEM, run)
