"""fastopt.GaLoreAdamW against galore-torch's GaLoreAdamW (and GaLoreAdamW8bit) on Llama-like shapes.

The projected group holds every attention and MLP matrix of the decoder layers (q, k, v, o, gate, up, down),
as in the GaLore paper; embeddings, LM head and norms are plain AdamW. All rows: lr 1e-3, betas
(0.9, 0.999), eps 1e-6, weight decay 0.01, scale 0.25, proj_type std, at rank 128 and 1024 (divided by
--scale on reduced CPU sizes, and never above a matrix's smaller dim).

Rows:

- `galore-r<rank>`: steps without an SVD (update_proj_gap 10**9: the bases come from the untimed first step).
  The issue's target (H100): fastopt at least 3x galore-torch here.
- `galore8-r<rank>`: the 8-bit variants on steps without an SVD (galore-torch's uses bitsandbytes' CUDA
  kernels: a `skipped` row on CPU).

The untimed first step of every row computes its bases with a stand-in for `torch.linalg.svd` (orthonormal
factors from two QR factorizations, `standin_svd`), in both implementations: the timed steps do the same
work whatever the bases hold, and a full SVD of every matrix (hundreds of them on the 1B set) would take
minutes on a GPU. Steps that do refresh, whose SVD dominates, are bench_galore_refresh.py's, run last.

Bytes (`min_bytes`, the basis of GB/s and % copy) of a step without an SVD: every param reads g and p and
writes p (3 s per element); a projected m x n matrix also reads its fp32 basis (4 r n bytes when m >= n,
else 4 m r) and reads and writes m and v of the projected shape (16 bytes per projected element; 4 plus the
absmax with 8-bit state); plain params read and write full-size m and v (16 per element, or 4 with 8-bit
state above min_8bit_size). Refresh rows use the same count (the SVD's traffic is not counted). fastopt's
kernels move these bytes plus R and N (written once and read once each, fp32, projected-shaped:
`kernel_bytes`); the full-size update is never written. galore-torch writes it (back-projection), reads and
writes it again (times scale), then reads it with p for the update and p twice more for the decay.

State bytes: measured from each optimizer's state; galore-torch keeps its bases in a `GaLoreProjector`
object outside the state tensors, so its rows add `projector.ortho_matrix` to the count.
"""
from __future__ import annotations

import contextlib
import math

import torch

try:
    from . import common
except ImportError:
    import common

import fastopt
from fastopt import ops

STEM = "galore"
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
RANKS = (128, 1024)
PROJECTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NO_REFRESH = 10 ** 9
NEEDS_CUDA_8BIT = "needs CUDA (bitsandbytes' 8-bit kernels)"


def _rank(args, pset, rank) -> int:
    mats = [s for name, s in pset.shapes if name.rsplit(".", 1)[-1] in PROJECTED]
    return max(1, min([rank // args.scale] + [min(s) for s in mats]))


def tag(args, rank0) -> str:
    """A row's rank label: `r<rank>`, and `/<scale>` on reduced sizes (where the rank is divided by it)."""
    return f"r{rank0}" + (f"/{args.scale}" if args.scale > 1 else "")


def _groups(pset, params, rank, gap):
    proj, plain = [], []
    for (name, _), p in zip(pset.shapes, params):
        (proj if name.rsplit(".", 1)[-1] in PROJECTED else plain).append(p)
    return [{"params": proj, "rank": rank, "update_proj_gap": gap, "scale": 0.25, "proj_type": "std"},
            {"params": plain}]


def _bytes(pset, dtype, rank, nbits=32, block_size=256, min_8bit=4096) -> tuple[int, int]:
    """(min_bytes, fastopt kernel_bytes) of one step without an SVD, over the whole set: kernel bytes are the
    minimal bytes plus R and N of each projected matrix (`kb` collects only those)."""
    s = common.elem_bytes(dtype)
    mb = kb = 0
    for name, shape in pset.shapes:
        n = math.prod(shape)
        mb += 3 * s * n
        if name.rsplit(".", 1)[-1] in PROJECTED:
            m, k = shape
            r_elems = m * rank if m >= k else rank * k           # std: the smaller side is projected
            basis = 4 * rank * (k if m >= k else m)
            state = (4 + 16 / block_size) * r_elems if nbits == 8 and r_elems >= min_8bit else 16 * r_elems
            mb += basis + state
            kb += 4 * 4 * r_elems                                # R and N: each written once, read once
        else:
            state = (4 + 16 / block_size) * n if nbits == 8 and n >= min_8bit else 16 * n
            mb += state
    return int(mb), int(mb + kb)


def standin_svd(a, full_matrices=False, **_kw):
    """What the untimed first step uses for `torch.linalg.svd`: (U, S, Vh) of the reduced SVD's shapes and
    dtype, U's columns and Vh's rows orthonormal (QR factorizations of the leading columns and rows of `a`),
    S ones. Not the SVD: the bases it gives do not change the work of the steps timed after it."""
    k = min(a.shape[-2:])
    u = torch.linalg.qr(a[..., :, :k])[0]
    vh = torch.linalg.qr(a[..., :k, :].mT)[0].mT
    return u, torch.ones(*a.shape[:-2], k, dtype=a.dtype, device=a.device), vh


@contextlib.contextmanager
def standin_first_step():
    real = torch.linalg.svd
    torch.linalg.svd = standin_svd
    try:
        yield
    finally:
        torch.linalg.svd = real


def _backend(params) -> str:
    return "triton" if ops.use_triton(params[0]) else "torch reference"


class _Galore:
    """galore-torch's optimizer behind `measure()`; remembers its projectors' bytes (outside its state)."""

    def __init__(self, pset, rank, gap, eight=False):
        self.pset, self.rank, self.gap, self.eight = pset, rank, gap, eight
        self.proj_bytes = 0
        self.grads = None

    def make(self, params):
        import galore_torch
        cls = galore_torch.GaLoreAdamW8bit if self.eight else galore_torch.GaLoreAdamW
        kw = {} if self.eight else {"no_deprecation_warning": True}
        return cls(_groups(self.pset, params, self.rank, self.gap), **HYPER, **kw)

    def step(self, opt, params):
        # GaLoreAdamW8bit's step leaves p.grad = the projected gradient (rank x n); stepped again on that, it
        # projects it a second time (matmul shape error on the H100, 2026-11-24). Each timed step gets the
        # full gradients back (a reference per param, no copy), as a training step's backward would give.
        if self.eight:
            if self.grads is None:
                self.grads = [p.grad for p in params]
            for p, g in zip(params, self.grads):
                p.grad = g
        opt.step()
        if not self.proj_bytes:
            for st in opt.state.values():
                mats = st.get("projector").ortho_matrix if "projector" in st else None
                for t in (mats if isinstance(mats, list) else [mats] if mats is not None else []):
                    self.proj_bytes += t.numel() * t.element_size()

    def fix(self, row: dict) -> dict:
        if row["status"] == "ok":
            row["state_bytes"] += self.proj_bytes
            row["state_bytes_per_param"] = row["state_bytes"] / row["n_params"]
            row["notes"] += f"; state bytes include its projectors' bases ({self.proj_bytes / 2**20:.1f} MiB)"
        return row


def run(args) -> list[dict]:
    out = []
    first = standin_first_step
    for pset in common.param_sets(args):
        for dtype in common.dtypes(args):
            for rank0 in RANKS:
                rank = _rank(args, pset, rank0)
                label = tag(args, rank0)
                note = f"rank {rank}, steps without SVD (first step's bases: standin_svd)"
                mb, kb = _bytes(pset, dtype, rank)
                out.append(common.measure(
                    args, f"galore-{label}", "fastopt.GaLoreAdamW", pset, dtype,
                    lambda ps, r=rank: fastopt.GaLoreAdamW(_groups(pset, ps, r, NO_REFRESH), **HYPER),
                    min_bytes=mb, kernel_bytes=kb, ours=True, backend=_backend, first=first,
                    notes=note + "; back-projection fused with the update, full-size update never written"))
                ref = _Galore(pset, rank, NO_REFRESH)
                out.append(ref.fix(common.measure(args, f"galore-{label}", "galore-torch GaLoreAdamW", pset, dtype,
                                                  ref.make, min_bytes=mb, step=ref.step, backend="eager", first=first,
                                                  notes=note)))
                mb8, kb8 = _bytes(pset, dtype, rank, nbits=8)
                out.append(common.measure(
                    args, f"galore8-{label}", "fastopt.GaLoreAdamW8bit", pset, dtype,
                    lambda ps, r=rank: fastopt.GaLoreAdamW8bit(_groups(pset, ps, r, NO_REFRESH), **HYPER),
                    min_bytes=mb8, kernel_bytes=kb8, ours=True, backend=_backend, first=first,
                    notes=note + "; 8-bit m, v (blocks of 256, >= 4096 elements)"))
                if torch.device(args.device).type != "cuda":  # its step asserts CUDA (bitsandbytes' kernels)
                    out.append(common.skipped(args, f"galore8-{label}", "galore-torch GaLoreAdamW8bit", pset, dtype,
                                              NEEDS_CUDA_8BIT, backend="bitsandbytes", notes=note,
                                              min_bytes_per_param=mb8 / pset.n_params))
                else:
                    ref8 = _Galore(pset, rank, NO_REFRESH, eight=True)
                    out.append(ref8.fix(common.measure(args, f"galore8-{label}", "galore-torch GaLoreAdamW8bit",
                                                       pset, dtype, ref8.make, min_bytes=mb8, step=ref8.step,
                                                       backend="bitsandbytes", first=first, notes=note)))
    return out


if __name__ == "__main__":
    common.main(STEM, run)
