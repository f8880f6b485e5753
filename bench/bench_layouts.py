"""Communication of one step under TP 8 x FSDP 8 for the Llama-7B shapes (computed), and the single-process
cost of the layout machinery (timed).

Communication (computed, not timed: no cluster needed). Under FSDP2 on top of TP on an 8 x 8 mesh, every
projection matrix, the embedding and the LM head are sharded over both mesh dims (`Shard`/`_StridedShard` on
"dp", `Shard` on "tp"), so their statistics are summed over the 64 ranks of the world; the norm weights are
sharded by FSDP alone, over the 8 ranks of their dp group. fastopt buckets params by reduction group and
hands each bucket's `reduce` one flat buffer per phase; the buffers' sizes come from the reference's own
`reduction_sizes` (the same buffers `*_step` builds; tests/test_layouts.py checks that they agree). Per row:
collectives per step, buffer bytes per step (what each rank contributes), the bytes a ring all-reduce sends
per rank (2 (n - 1) / n of the buffer), and the two naive alternatives: one collective per param and phase,
and gathering each whole gradient matrix (what an exact factored statistic costs without row/column sums).

GaLore-AdamW (computed, one row per rank of bench/bench_galore.py): the params of `get_galore_param_groups`,
every nn.Linear weight projected (`proj_type` "std"; the LM head too, the embedding and the norms stay plain
AdamW, element-wise, without communication). Per step, the projected params (one bucket over the world) write
their partial projected gradients R into one flat fp32 buffer, reduce-scattered along one dim of R (`moment_cut`:
dim 0 for these shapes; each param's slice cut over the 64 ranks as DTensor cuts it, padded to the longest
share) and all-gathered back as N: two collectives, the bytes of one all-reduce of the buffer
(`MomentExchange`). Every `update_proj_gap` steps each projected gradient is assembled whole on one rank (the
bucket's SVDs spread over the ranks; one all_to_all sends each owner the pieces of its gradients,
`gather_to_owners`: reported against a reduce of each whole gradient), and all-reduces share the new bases
(`refresh_bases`), reported per refresh step and spread over the gap. State per rank (the largest rank's):
the bases of the local piece's rows (P) and columns (Q) (`keeps_local_bases`; torch's Llama TP plan: o_proj and
down_proj cut along dim 1 by TP, the others along dim 0, FSDP along dim 0), this rank's slice of the moments,
the plain params' moments of the local piece; against whole bases, whole bases and moments, and AdamW's two
moments of the local pieces.

Overhead (timed): one single-process `step()` of each optimizer on the usual parameter sets, against the
time the layout machinery alone takes per step (`_buckets`, which looks up every param's layout and groups
the params); the issue's bound is 5% of the step on a GPU.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

try:
    from . import common
except ImportError:
    import common

import fastopt
from fastopt.reference import adafactor as ref_adafactor
from fastopt.reference import came as ref_came
from fastopt.reference import lamb as ref_lamb
from fastopt.reference.galore import basis_shapes, moment_dim, projected_shape, projection_side, share_chunks

STEM = "layouts"
TP, DP = 8, 8
OPTIMIZERS = ("Adafactor", "CAME", "Lamb", "AdamW8bit")
GALORE_RANKS = (128, 1024)  # bench/bench_galore.py's RANKS
GALORE_GAP = 200  # get_galore_param_groups' update_proj_gap: the steps between two refreshes of the bases


def reduction_sizes(opt: str, shapes, dtype) -> list[tuple[int, torch.dtype]]:
    """The buffers one bucket of params of these (global) shapes reduces per step, in phase order."""
    if opt == "Adafactor":
        return ref_adafactor.reduction_sizes(shapes)
    if opt == "CAME":
        return ref_came.reduction_sizes(shapes)
    if opt == "Lamb":
        return ref_lamb.reduction_sizes(shapes, dtype)
    return []  # AdamW8bit: element-wise, no statistics to share


def buckets_tp_fsdp(shapes) -> dict[str, tuple[int, list]]:
    """Reduction group -> (ranks in it, global shapes of its params) under FSDP2 + TP on a DP x TP mesh."""
    world = [s for _, s in shapes if len(s) >= 2]
    dp = [s for _, s in shapes if len(s) < 2]
    return {"world": (TP * DP, world), "dp": (DP, dp)}


def shares(n: int, widths) -> list[int]:
    """Sizes of the pieces of a dim of `n` cut with `Shard` over mesh dims of these `widths`, torch.chunk's
    rule per mesh dim nested in mesh-dim order (`Layout.shard_ranges`' sizes), in rank order."""
    out = [n]
    for w in widths:
        full = [-(-size // w) for size in out]
        out = [min((k + 1) * f, size) - min(k * f, size) for f, size in zip(full, out) for k in range(w)]
    return out


def _pieces(shape) -> list[int]:
    """Elements of a param's local piece on each rank (rank = dp * TP + tp) under FSDP2 + TP: matrices cut
    along dim 0 over both mesh dims (TP may cut dim 1 instead: the counts differ only where a dim does not
    split evenly, which no Llama-7B dim does), vectors over dp only, replicated over tp."""
    rest = math.prod(shape[1:])
    if len(shape) >= 2:
        return [c * rest for c in shares(shape[0], (DP, TP))]
    return [c * rest for c in shares(shape[0], (DP,)) for _ in range(TP)]


def tp_dim(name: str) -> int:
    """The dim tensor parallelism cuts in torch's Llama plan: `RowwiseParallel` (dim 1) for o_proj and down_proj,
    `ColwiseParallel` (dim 0) for the other projections and the LM head (the embedding's rowwise plan cuts its
    dim 0 too)."""
    return 1 if name.endswith(("o_proj", "down_proj")) else 0


def _basis_pieces(name: str, shape, rank: int, side: str) -> list[int]:
    """Elements of a projected param's bases that each rank keeps (`keeps_local_bases`): P (m x rank) at the
    rows of its piece, Q (rank x n) at the columns. FSDP cuts dim 0 over dp; TP cuts `tp_dim`."""
    m, n = shape
    out = [0] * (TP * DP)
    for k in range(TP * DP):
        dp, tp = divmod(k, TP)
        if side in ("left", "full"):
            out[k] += rank * (shares(m, (DP, TP))[k] if tp_dim(name) == 0 else shares(m, (DP,))[dp])
        if side in ("right", "full"):
            out[k] += rank * (shares(n, (TP,))[tp] if tp_dim(name) == 1 else n)
    return out


def galore_comm(shapes, rank: int, dtype=torch.float32, gap: int = GALORE_GAP) -> dict:
    """GaLore-AdamW's communication per step and per refresh, and its state per rank, for the named global
    `shapes` under FSDP2 + TP (see the module docstring). Projected: what `get_galore_param_groups` projects
    (every 2-D weight but the embedding's, both dims >= rank)."""
    world = TP * DP
    acc = 8 if dtype == torch.float64 else 4  # R, N, bases and moments: fp64 for fp64 params, else fp32
    g_bytes = common.elem_bytes(dtype)
    projected = [len(s) == 2 and name != "embed_tokens" and min(s) >= rank for name, s in shapes]
    proj = [s for (_, s), p in zip(shapes, projected) if p]
    padded = real = 0
    state = {k: [0] * world for k in ("galore", "whole_bases", "whole_moments", "adamw")}
    sent, received = [0] * world, [0] * world  # refresh: gradient pieces sent to / received by the SVD's owner
    j = 0  # the projected params' order in the bucket: the j-th one's SVD runs on rank j % world
    for (name, s), p in zip(shapes, projected):
        pieces = _pieces(s)
        for k in range(world):
            state["adamw"][k] += 2 * acc * pieces[k]
        if not p:  # plain AdamW: the moments of the local piece, in every variant
            for key in ("galore", "whole_bases", "whole_moments"):
                for k in range(world):
                    state[key][k] += 2 * acc * pieces[k]
            continue
        side = projection_side(s, "std")
        whole = projected_shape(s, rank, side)
        cut = moment_dim(whole, world)  # the dim of R (and of the moments) cut over the ranks
        rest = math.prod(whole) // whole[cut]
        rows = shares(whole[cut], (DP, TP))  # each rank's share of that dim
        padded += world * max(rows) * rest
        real += math.prod(whole)
        bases = sum(math.prod(b) for b in basis_shapes(s, rank, side).values())
        kept = _basis_pieces(name, s, rank, side)
        for k in range(world):
            state["galore"][k] += acc * (kept[k] + 2 * rows[k] * rest)
            state["whole_bases"][k] += acc * (bases + 2 * rows[k] * rest)
            state["whole_moments"][k] += acc * (bases + 2 * math.prod(whole))
            if k == j % world:
                received[k] += g_bytes * (math.prod(s) - pieces[k])
            else:
                sent[k] += g_bytes * pieces[k]
        j += 1
    nbytes = padded * acc
    # Refresh: two small all-gathers (where each rank's pieces lie), one all_to_all that sends each whole
    # gradient's pieces (its dtype) to the rank that computes its SVD, one all-reduce of a flag per rank (an SVD
    # that failed), then the new bases (fp32) all-reduced in buffers of at most SHARE_ELEMENTS.
    grads = sum(math.prod(s) for s in proj) * g_bytes
    sizes = [math.prod(b) for s in proj for b in basis_shapes(s, rank, projection_side(s, "std")).values()]
    bases_all = acc * sum(sizes)
    share_collectives = len(share_chunks(sizes))
    ring = 2 * (world - 1) / world
    refresh_sent = max(sent) + ring * bases_all
    return dict(mesh=f"TP {TP} x FSDP {DP}", collectives=2 if proj else 0, buffer_bytes=nbytes,
                ring_bytes_per_rank=ring * nbytes, per_param_collectives=2 * len(proj), gather_matrix_bytes=0,
                groups={"world": dict(ranks=world, params=len(proj), collectives=2 if proj else 0,
                                      buffer_elements=[padded], buffer_bytes=nbytes,
                                      padding_elements=padded - real)},
                rank=rank, projected=len(proj), plain=len(shapes) - len(proj), refresh_every=gap,
                refresh_collectives=(3 + share_collectives + 1) if proj else 0,
                refresh_share_collectives=share_collectives, refresh_bytes=grads + bases_all,
                refresh_grad_sent_bytes_per_rank=max(sent), refresh_grad_received_bytes_per_rank=max(received),
                refresh_grad_reduce_bytes_per_rank=(world - 1) / world * grads,
                refresh_sent_bytes_per_rank=refresh_sent, refresh_sent_bytes_per_rank_per_step=refresh_sent / gap,
                refresh_svds_per_rank=-(-len(proj) // world),
                state_bytes_per_rank=max(state["galore"]),
                state_bytes_per_rank_whole_bases=max(state["whole_bases"]),
                state_bytes_per_rank_whole_moments=max(state["whole_moments"]),
                adamw_state_bytes_per_rank=max(state["adamw"]))


def _size(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"


def comm(opt: str, shapes, dtype=torch.float32) -> dict:
    out = dict(mesh=f"TP {TP} x FSDP {DP}", collectives=0, buffer_bytes=0, ring_bytes_per_rank=0.0,
               per_param_collectives=0, gather_matrix_bytes=0, groups={})
    g_bytes = common.elem_bytes(dtype)
    for name, (ranks, group_shapes) in buckets_tp_fsdp(shapes).items():
        if not group_shapes:
            continue
        sizes = reduction_sizes(opt, group_shapes, dtype)
        nbytes = sum(n * torch.empty((), dtype=dt).element_size() for n, dt in sizes)
        out["groups"][name] = dict(ranks=ranks, params=len(group_shapes), collectives=len(sizes),
                                   buffer_elements=[n for n, _ in sizes], buffer_bytes=nbytes)
        out["collectives"] += len(sizes)
        out["buffer_bytes"] += nbytes
        out["ring_bytes_per_rank"] += 2 * (ranks - 1) / ranks * nbytes
        out["per_param_collectives"] += len(group_shapes) * len(sizes)
        if opt in ("Adafactor", "CAME"):  # all-gathering each matrix's gradient to every rank of its group
            out["gather_matrix_bytes"] += sum(math.prod(s) for s in group_shapes if len(s) >= 2) * g_bytes
    return out


def _machinery_ms(opt, reps: int = 50) -> float:
    """Median wall time of the per-step layout machinery: `_buckets` over every param group (host only)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            opt._buckets(group["params"], opt._fsdp_grads())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _factory(name):
    if name == "Adafactor":
        return lambda ps: fastopt.Adafactor(ps)
    if name == "CAME":
        return lambda ps: fastopt.CAME(ps, lr=2e-4)
    if name == "Lamb":
        return lambda ps: fastopt.Lamb(ps, lr=1e-3)
    return lambda ps: fastopt.AdamW8bit(ps, lr=1e-3)


def run(args) -> list[dict]:
    rows = []
    full = common.ParamSet("7b", f"llama-7b (32/32 layers), TP {TP} x FSDP {DP}",
                           tuple(common.model_shapes(common.LLAMA_7B, common.LLAMA_7B.layers)))
    for name in OPTIMIZERS:
        c = comm(name, full.shapes)
        # status "computed" says how the row was made; the reason says only what came out.
        summary = (f"{c['collectives']} collectives/step ({c['per_param_collectives']} if one per "
                   f"param and phase), {_size(c['buffer_bytes'])} reduced/step, "
                   f"{_size(c['ring_bytes_per_rank'])} sent per rank (ring)")
        if c["gather_matrix_bytes"]:
            summary += f"; gathering the gradient matrices instead: {_size(c['gather_matrix_bytes'])}"
        print(f"  layouts    7b  {name:10s} {summary}", flush=True)
        rows.append(common._result(args, STEM, f"fastopt.{name} communication", full, torch.float32, ours=True,
                                   status="computed", reason=summary, comm=c))
    for rank in GALORE_RANKS:
        c = galore_comm(full.shapes, rank)
        summary = (f"{c['collectives']} collectives/step ({c['per_param_collectives']} if one per param and "
                   f"phase), {_size(c['buffer_bytes'])} reduced/step, {_size(c['ring_bytes_per_rank'])} sent per "
                   f"rank (ring); every {c['refresh_every']} steps one all_to_all of the gradients' pieces "
                   f"({_size(c['refresh_grad_sent_bytes_per_rank'])} sent per rank, "
                   f"{_size(c['refresh_grad_reduce_bytes_per_rank'])} "
                   f"with a reduce of each whole gradient), {c['refresh_share_collectives'] + 1} all-reduces (the "
                   f"bases, failure flags), {_size(c['refresh_sent_bytes_per_rank'])} sent per rank in all "
                   f"({_size(c['refresh_sent_bytes_per_rank_per_step'])}/step over the gap), "
                   f"{c['refresh_svds_per_rank']} SVDs per rank; state per rank "
                   f"{_size(c['state_bytes_per_rank'])} (bases whole: {_size(c['state_bytes_per_rank_whole_bases'])}"
                   f"; moments whole too: {_size(c['state_bytes_per_rank_whole_moments'])}; AdamW: "
                   f"{_size(c['adamw_state_bytes_per_rank'])})")
        print(f"  layouts    7b  GaLore-r{rank:<4d} {summary}", flush=True)
        rows.append(common._result(args, STEM, f"fastopt.GaLoreAdamW communication (rank {rank})", full,
                                   torch.float32, ours=True, status="computed", reason=summary, comm=c,
                                   notes=f"rank {rank}, proj_type std, update_proj_gap {GALORE_GAP}: "
                                         f"{c['projected']} nn.Linear weights projected (LM head included), "
                                         "embedding and norms plain AdamW"))
    for pset in common.param_sets(args):
        for dtype in common.dtypes(args)[:1]:
            for name in OPTIMIZERS:
                made = {}

                def make(ps, _name=name):
                    made["opt"] = _factory(_name)(ps)
                    return made["opt"]

                r = common.measure(args, STEM, f"fastopt.{name} step", pset, dtype, make, ours=True,
                                   min_bytes=common.min_bytes(pset, dtype))
                rows.append(r)
                if r["status"] != "ok" or "opt" not in made:
                    continue
                ms = _machinery_ms(made["opt"])
                frac = ms / r["ms_median"]
                why = (f"layout machinery {ms:.4f} ms of the {r['ms_median']:.3f} ms timed step "
                       f"({100 * frac:.2f}%; bound 5% on a GPU)")
                print(f"  layouts    {pset.key:3s} {name:10s} {why}", flush=True)
                rows.append(common._result(args, STEM, f"fastopt.{name} layout machinery", pset, dtype, ours=True,
                                           status="computed", reason=why, machinery_ms=ms, overhead_frac=frac))
    return rows


if __name__ == "__main__":
    common.main(STEM, run)
