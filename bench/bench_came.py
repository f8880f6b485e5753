"""fastopt.CAME against came-pytorch's CAME.

Both run came-pytorch's defaults (eps (1e-30, 1e-16), clip_threshold 1.0, betas (0.9, 0.999, 0.9999), no
weight decay) at lr 2e-4; fastopt runs with 32-bit state (`nbits=32`, the default) and with the 8-bit
momentum (`nbits=8`).

Bytes per step for a param of N elements of s bytes (fp32 state: a = 4 bytes; 8 for fp64 params):

- what the algorithm must move (`min_bytes`, the basis of GB/s and % copy): read the gradient, read the
  param, write the param: 3 s N; read and write the momentum: 2 a N; plus the two pairs of factored
  row/column states read and written (negligible) and, for vectors, the full second moment (2 a N).
- what fastopt's kernels move (`kernel_bytes`), from the passes listed in kernels/came.py's docstring: the
  gradient is read three times (G^2 statistics; the sum of U^2 for the RMS clip; update, momentum and
  instability statistics), the momentum read twice and written once (read and written in the instability
  pass, read again by the parameter write), the param read and written once: 5 s N + 3 a N; plus the
  partial column sums that two passes write and _col_reduce_kernel reads back (2 * 2 * a / BLOCK_R bytes
  per element). The extra reads follow from the maths: the RMS clip needs the factors of the whole matrix
  before the momentum can be formed, and the confidence factors need the instability of the whole matrix
  before any element of the param may be written. So with fp32 params the kernels move 32 bytes where
  the minimum is 20 (bf16: 22 and 14), which bounds % copy for this design.
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

STEM = "came"
LR = 2e-4
QBLOCK = 256  # elements per block scale of the 8-bit momentum (fastopt.reference.came.QBLOCK)


def min_bytes(pset, dtype, nbits: int = 32) -> int:
    a = 8 if dtype == torch.float64 else 4
    m = 2 * a if nbits == 32 else 2 * (1 + 4 / QBLOCK)  # momentum read + written: values, or codes + scales
    return common.min_bytes(pset, dtype, reads=2, writes=1, state_elem=m, factored_state=2, vector_state=1,
                            state_dtype=torch.float64 if dtype == torch.float64 else torch.float32)


def kernel_bytes(pset, dtype, nbits: int = 32) -> int | None:
    """Bytes fastopt's Triton kernels move for one step over `pset` (see the module docstring)."""
    try:
        from fastopt.kernels.common import tile_shape
    except ImportError:  # no Triton: no kernels to count
        return None
    s = common.elem_bytes(dtype)
    a = 8 if dtype == torch.float64 else 4
    mats = [shape for _, shape in pset.shapes if len(shape) >= 2]
    block_r = tile_shape(max(sh[-1] for sh in mats), sum(math.prod(sh[:-1]) for sh in mats))[0] if mats else 1
    q = 1 + 4 / QBLOCK  # bytes per element of an 8-bit momentum: the code and a share of its block's scale
    total = 0
    for _, shape in pset.shapes:
        n = math.prod(shape)
        if len(shape) >= 2:
            b, r, c = math.prod(shape[:-2]), shape[-2], shape[-1]
            if nbits == 32:
                total += 5 * s * n + 3 * a * n
            else:  # _apply8_kernel reads the gradient a fourth time to re-form M_t; codes read 2x, written 1x
                total += 6 * s * n + 3 * q * n
            total += 2 * 2 * a * b * math.ceil(r / block_r) * c      # partial column sums, two phases: w, r
            total += a * b * (r + c) * 12                             # 2 states r/w, 2 stats buffers w/r/w/r
        else:
            # _vec_stats: g, v r/w; _vec_apply (or _apply8): g, v, m r/w, p r/w
            total += 4 * s * n + 3 * a * n + (2 * a * n if nbits == 32 else 2 * q * n)
    return total


def _backend(params) -> str:
    return "triton" if ops.use_triton(params[0]) else "torch reference"


def _came_pytorch(params):
    from came_pytorch import CAME
    return CAME(params, lr=LR)


def run(args) -> list[dict]:
    out = []
    for pset in common.param_sets(args):
        for dtype in common.dtypes(args):
            mb = min_bytes(pset, dtype)
            out.append(common.measure(args, STEM, "fastopt.CAME", pset, dtype, lambda ps: fastopt.CAME(ps, lr=LR),
                                      min_bytes=mb, kernel_bytes=kernel_bytes(pset, dtype), ours=True,
                                      backend=_backend,
                                      notes="kernel B/param counted from kernels/came.py's passes: gradient read "
                                            "3x, momentum read 2x and written 1x, param read and written 1x, plus "
                                            "partial column sums"))
            out.append(common.measure(args, STEM, "fastopt.CAME(nbits=8)", pset, dtype,
                                      lambda ps: fastopt.CAME(ps, lr=LR, nbits=8), min_bytes=min_bytes(pset, dtype, 8),
                                      kernel_bytes=kernel_bytes(pset, dtype, 8), ours=True, backend=_backend,
                                      notes="8-bit momentum; min B/param counts its codes and block scales, not "
                                            "fp32 values"))
            out.append(common.measure(args, STEM, "came-pytorch CAME", pset, dtype, _came_pytorch, min_bytes=mb,
                                      backend="eager"))
    return out


if __name__ == "__main__":
    common.main(STEM, run)
