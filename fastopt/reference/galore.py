"""GaLore-AdamW in plain torch: the spec, the CPU path and the oracle of the Triton kernels.

Zhao et al., "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection" (2024), Algorithm 2,
with the exact conventions of galore-torch's `GaLoreAdamW` (transformers-style AdamW). For a projected
matrix p (m x n) with gradient G at step t (t counts from 1):

    refresh when (t - 1) % update_proj_gap == 0:                          (Alg. 2, "if t mod T = 0")
        U, s, Vh = svd(float32(G))                                        reduced SVD, always in fp32
        P = U[:, :r]   (m x r)       left side
        Q = Vh[:r, :]  (r x n)       right side
    R   = P^T G  |  G Q^T  |  P^T G Q^T                                   projected gradient (left|right|full)
    m_t = beta1 m_{t-1} + (1 - beta1) R                                   moments of the projected shape
    v_t = beta2 v_{t-1} + (1 - beta2) R^2
    N   = m_t / (sqrt(v_t) + eps)                                         eps on the uncorrected sqrt(v)
    eta = lr sqrt(1 - beta2^t) / (1 - beta1^t)
    p   = p - eta * scale * (P N  |  N Q  |  P N Q)                       back-projection
    p   = p - lr * weight_decay * p                                       decoupled decay, after the update

The side follows galore-torch's `GaLoreProjector`: `std` projects the smaller dimension (right when
m >= n, else left), `reverse_std` the larger one, `left` / `right` / `full` as named. The moments are not
reset when the subspace changes (galore-torch keeps them). Params without a projection (groups without
`rank`) take the same AdamW step on the whole gradient.

Beyond galore-torch: a param with more than two dims is a batch of matrices over its last two dims, each with
its own projection (an SVD per matrix); the bases are kept in the param's state dtype (fp64 for fp64 params,
else fp32, where galore-torch rounds them to the param's dtype); with 8-bit state (`exp_avg` / `exp_avg_sq`
uint8 codes in the block-wise format of fastopt/reference/quant.py, signed map for m, unsigned for v) m_{t-1}
and v_{t-1} are the dequantized states, N uses the exact m_t, v_t, and those are requantized after the update.

Sharded params (fastopt/distributed/layout.py): a param sharded along dims (DTensor or declared) keeps the rows of
P and the columns of Q of its own piece (`keeps_local_bases`: all that its products read), flat ranges whole
bases. A rank's piece is a set of rectangles of the matrices (one for a dim layout, a few for a flat range); the
SVD takes the whole gradient (assembled on refresh steps only, on one rank per param: `refresh_bases` spreads a
bucket's SVDs over its ranks), R is the sum over the ranks of each rank's rectangles' products (P_r^T G_r placed
at the rectangle's columns, G_r Q_r^T at its rows, P_r^T G_r Q_r^T added whole), and each rank writes the
back-projection's entries of its own rectangles. The moments of a DTensor param are sharded along one dim of their
(projected) shape over the ranks of its layout's group (`moment_cut`: the first dim with at least as many entries
as ranks, cut as DTensor's `Shard` cuts it, `Layout.shard_ranges`): the sum of R is a reduce-scatter that leaves
each rank its slice, Adam runs on it, and an all-gather assembles the whole N (`MomentExchange`); the moments of
other sharded params are whole on every rank (R all-reduced).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.phases import Exchange
from .common import store_unscaled
from .lamb import _commit, load_moments, step_size, store_moments

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")
# State keys of the bases: P (m x r, the left side) and Q (r x n, the right side).
LEFT, RIGHT = "proj_left", "proj_right"


def projection_side(shape, proj_type: str) -> str:
    """'left', 'right' or 'full': which side of the (..., m, n) matrix is projected (galore-torch's rule)."""
    m, n = shape[-2], shape[-1]
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    return proj_type


def projected_shape(shape, rank: int, side: str) -> tuple:
    """Shape of R (and of the moments)."""
    *batch, m, n = shape
    return tuple(batch) + {"left": (rank, n), "right": (m, rank), "full": (rank, rank)}[side]


def basis_shapes(shape, rank: int, side: str) -> dict:
    """State key -> shape of the bases a side needs."""
    *batch, m, n = shape
    out = {}
    if side in ("left", "full"):
        out[LEFT] = tuple(batch) + (m, rank)
    if side in ("right", "full"):
        out[RIGHT] = tuple(batch) + (rank, n)
    return out


def is_projected(state: dict) -> bool:
    return LEFT in state or RIGHT in state


def orthogonal_bases(g: Tensor, rank: int, side: str, dtype: torch.dtype) -> dict:
    """The new bases from the SVD of the (unscaled) gradient: galore-torch's `get_orthogonal_matrix`, in
    fp32 whatever the gradient's dtype; returned in `dtype`. A batch of matrices takes one SVD per matrix, on
    a copy of its own: a batched SVD's last bits depend on where each matrix sits in memory (LAPACK's
    vectorized paths), and each matrix must get the bases it would get as a param of its own."""
    g = g.float()
    if g.dim() == 2:
        u, _s, vh = torch.linalg.svd(g, full_matrices=False)
    else:
        parts = [torch.linalg.svd(x.clone(), full_matrices=False) for x in g.reshape(-1, *g.shape[-2:])]
        u = torch.stack([x[0] for x in parts]).view(*g.shape[:-2], *parts[0][0].shape)
        vh = torch.stack([x[2] for x in parts]).view(*g.shape[:-2], *parts[0][2].shape)
    # Copies of the rank columns / rows: a slice in the SVD's dtype would keep the whole U or Vh alive (min(m, n)
    # columns or rows, not `rank`) until the bucket's bases are committed, every refreshed param's at once.
    out = {}
    if side in ("left", "full"):
        out[LEFT] = u[..., :, :rank].to(dtype).contiguous()
    if side in ("right", "full"):
        out[RIGHT] = vh[..., :rank, :].to(dtype).contiguous()
    return out


def state_views(state: dict, shape) -> tuple[Tensor | None, Tensor | None, tuple]:
    """(P as (B', m', r), Q as (B', r, n'), the moments' (B, a, b) shape) of a projected param of global `shape`
    (..., m, n), B the product of its leading dims; B', m', n' those of the bases as the state keeps them: the
    whole ones, or the local piece's (`keeps_local_bases`)."""
    *batch, m, n = shape
    left, right = (_as_3d(state[k]) if k in state else None for k in (LEFT, RIGHT))
    a = left.shape[2] if left is not None else m
    b = right.shape[1] if right is not None else n
    return left, right, (math.prod(batch), a, b)


def _as_3d(x: Tensor) -> Tensor:
    return x.view(math.prod(x.shape[:-2]), *x.shape[-2:])


def keeps_local_bases(lay) -> bool:
    """Whether a param of layout `lay` keeps its bases cut like its local piece: P's rows and Q's columns (and
    the leading dims) are those of the local piece, which is all of them its back-projection reads; for params
    sharded along dims: DTensor params (`lay.mesh`), whose bases are DTensors on the param's mesh, sharded like
    the param along their kept dims and replicated along the rank-sized one (`GaLoreAdamW._dtensor_forms`), and
    declared dim shards (`declare_shard(dim=...)`, `setup_distributed` without ZeRO), whose bases are plain
    tensors of the local piece's rows and columns, like their element-wise state. Flat ranges and replicated
    params keep whole bases."""
    return lay is not None and not lay.is_flat


def basis_piece(basis: Tensor, key: str, lay) -> Tensor:
    """What the state keeps of a whole basis (`key` LEFT: (..., m, r), RIGHT: (..., r, n)) of a param of layout
    `lay`: the local piece's leading indices and rows (P) or columns (Q) where `keeps_local_bases`, else all."""
    if not keeps_local_bases(lay):
        return basis
    nd = basis.dim()
    rank_dim = nd - 1 if key == LEFT else nd - 2
    for d, idx in enumerate(lay.index):
        if idx is not None and d != rank_dim:
            basis = basis.index_select(d, idx.to(basis.device))
    return basis


def whole_basis_shape(shape, key: str, basis: Tensor) -> tuple:
    """The whole shape of basis `key` of a param of global `shape` (..., m, n), from the state's `basis` (whole
    or cut: its rank-sized dim is whole)."""
    if key == LEFT:
        return tuple(shape[:-1]) + (basis.shape[-1],)
    return tuple(shape[:-2]) + (basis.shape[-2], shape[-1])


SHARE_ELEMENTS = 1 << 26  # refresh_bases: the largest buffer of new bases all-reduced at once (256 MiB fp32)


def share_chunks(sizes: list[int]) -> list[range]:
    """The bases (of these numels, in order) that `refresh_bases` all-reduces together: consecutive runs of at
    most SHARE_ELEMENTS elements, or one basis alone."""
    out, start, fill = [], 0, 0
    for j, n in enumerate(sizes):
        if j > start and fill + n > SHARE_ELEMENTS:
            out.append(range(start, j))
            start, fill = j, 0
        fill += n
    if sizes:
        out.append(range(start, len(sizes)))
    return out


def refresh_bases(grads: list[Tensor], states: list[dict], refresh: list[bool], *, rank: int,
                  inv_scale: Tensor | None = None, found_inf: Tensor | None = None,
                  layouts: list | None = None) -> None:
    """New bases for the params flagged in `refresh` (one bucket); the SVD runs on these steps only. Shared by
    both back ends (the SVD is torch.linalg.svd on either). A step GradScaler skips keeps the old bases.

    Sharded params take turns over the ranks of their layout's (last) group: the k-th one's whole gradient is
    assembled on group rank k % world, each rank computes the SVDs of its params (at the same time as the
    others), and all-reduces of the new bases of the bucket over that group (zeros where a rank computed none:
    exact sums), in buffers of at most `SHARE_ELEMENTS` (or one basis), hand every rank all of them (each keeps
    its part: `basis_piece`), bit for bit the bases of one process. A layout with one group (DTensors, most
    declared shards) assembles with `gather_to_owners`: each rank sends each owner its pieces, one all_to_all
    for the bucket, so that each rank then holds the gradients of its own params only and has sent about
    1/world of the bucket's gradients. A layout over several groups (ZeRO over TP: (tp, dp)) all-reduces the
    whole gradient over the other groups and reduces it over the last one onto the owner (`full_tensor` with
    dst): the ranks that share the owner's rank in the last group compute the same SVD (exact sums: the same
    input), 1/world of them each. An SVD that fails on its rank (a non-finite gradient without GradScaler, out
    of memory) is known to every rank of the layout's groups by one all-reduce per group of a flag per rank of
    the last, and all of them raise. (Replicas outside those groups, e.g. the tp peers of a param that only dp
    shards, compute the same SVD on the same input and fail alike on a non-finite gradient; an out-of-memory on
    one of them alone cannot reach the others.) Replicated params compute their SVD on every rank."""
    from ..distributed.layout import full_tensor, gather_to_owners
    layouts = layouts if layouts is not None else [None] * len(grads)
    todo = [i for i, s in enumerate(states) if refresh[i] and is_projected(s)]
    spread = [i for i in todo if layouts[i] is not None]  # one bucket: the same groups
    group = layouts[spread[0]].groups[-1] if spread else None
    world = dist.get_world_size(group) if spread else 1
    me = dist.get_rank(group) if spread else 0
    owner = {i: k % world for k, i in enumerate(spread)}
    whole = {}
    if spread and len(layouts[spread[0]].groups) == 1:  # every piece sent first: the SVDs then run at once
        got = gather_to_owners([grads[i] for i in spread], [layouts[i] for i in spread],
                               [owner[i] for i in spread], group)
        whole = {spread[j]: g for j, g in got.items()}
    elif spread:
        for i in spread:
            g = full_tensor(grads[i], layouts[i], dst=owner[i])
            if owner[i] == me:
                whole[i] = g
    new, failed = {}, None
    for i in todo:
        if i in owner and owner[i] != me:
            continue
        s = states[i]
        g = whole.pop(i) if i in owner else grads[i]
        side = "full" if LEFT in s and RIGHT in s else ("left" if LEFT in s else "right")
        dt = (s[LEFT] if LEFT in s else s[RIGHT]).dtype
        g = g.to(dt)
        if inv_scale is not None:
            g = g * inv_scale.to(dt)
        if found_inf is not None:  # an inf gradient would make the SVD fail; the step is discarded anyway
            g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
        try:
            new[i] = orthogonal_bases(g, rank, side, dt)
        except RuntimeError as e:  # torch.linalg.LinAlgError, out of memory: raised below on every rank alike
            if i not in owner:  # a replicated param: computed on every rank, it fails on every rank
                raise
            failed = failed or e
    if spread:
        flags = torch.zeros(world, dtype=torch.float32, device=grads[spread[0]].device)
        flags[me] = failed is not None
        layouts[spread[0]].reduce(flags)  # over every group: the peers computing the same SVDs learn it too
        bad = flags.nonzero().flatten().tolist()
        if bad:
            why = f": {failed}" if failed is not None else ""
            raise RuntimeError(f"GaLoreAdamW: the SVD of a projected gradient failed on rank(s) {bad} of the "
                               f"param's group (a non-finite gradient?){why}") from failed
    slots = [(i, key) for i in spread for key in (LEFT, RIGHT) if key in states[i]]
    shapes = {(i, key): whole_basis_shape(layouts[i].global_shape, key, states[i][key]) for i, key in slots}
    for chunk in share_chunks([math.prod(shapes[slot]) for slot in slots]):  # the shared bases, bounded
        part = [slots[j] for j in chunk]
        ref = states[part[0][0]][part[0][1]]
        buf = torch.zeros(sum(math.prod(shapes[slot]) for slot in part), dtype=ref.dtype, device=ref.device)
        off, views = 0, []
        for i, key in part:
            views.append(buf[off:off + math.prod(shapes[i, key])].view(shapes[i, key]))
            off += views[-1].numel()
            if i in new:
                views[-1].copy_(new[i][key].reshape(shapes[i, key]))
        dist.all_reduce(buf, group=group)
        for (i, key), v in zip(part, views):
            _commit(states[i][key], basis_piece(v, key, layouts[i]), found_inf)
    for i in todo:
        if i not in owner:  # a replicated param: whole bases
            for key, basis in new[i].items():
                _commit(states[i][key], basis.reshape(states[i][key].shape), found_inf)


class Rect:
    """A rectangle of a projected param's matrices held here: global `batch` indices (B_r), `rows` and `cols`
    (None: all of them), and `view(x)`, the (B_r, rows, cols) view of those elements in the local tensor x
    (which must be contiguous for flat layouts: then the rectangle is a contiguous range of it). `own_bases`:
    the state's bases are this rectangle's already (`keeps_local_bases`). `spans`: the three as slices where
    each is a run of consecutive indices (as Shard(d) and flat ranges hold them; read once, when the rectangle
    is built), else None: then `pick` and `place` take views (`target`) instead of gathering and scattering."""

    __slots__ = ("batch", "rows", "cols", "view", "own_bases", "spans")

    def __init__(self, batch, rows, cols, view, own_bases=False):
        self.batch, self.rows, self.cols, self.view, self.own_bases = batch, rows, cols, view, own_bases
        spans = tuple(_span(ix) for ix in (batch, rows, cols))
        self.spans = spans if all(sp is not None for sp in spans) else None

    def target(self, out: Tensor, rows: bool, cols: bool) -> Tensor | None:
        """The view of a whole (B, a, b) `out` at the rectangle's batch, rows (if `rows`) and columns (if
        `cols`), or None where they are not runs (`spans`)."""
        if self.spans is None:
            return None
        b, r, c = self.spans
        return out[b, r if rows else slice(None), c if cols else slice(None)]

    def pick(self, x: Tensor, rows: bool, cols: bool) -> Tensor:
        """The rectangle's batch, rows (if `rows`) and columns (if `cols`) of a whole (B, a, b) tensor."""
        view = self.target(x, rows, cols)
        if view is not None:
            return view
        if self.batch is not None:
            x = x[self.batch]
        if rows and self.rows is not None:
            x = x[:, self.rows]
        if cols and self.cols is not None:
            x = x[:, :, self.cols]
        return x

    def place(self, out: Tensor, x: Tensor, rows: bool, cols: bool) -> None:
        """out[batch, rows (if `rows`), cols (if `cols`)] += x, for a whole (B, a, b) `out`."""
        view = self.target(out, rows, cols)
        if view is not None:
            view.add_(x)
            return
        b = self.batch if self.batch is not None else torch.arange(out.shape[0], device=out.device)
        r = self.rows if rows and self.rows is not None else torch.arange(out.shape[1], device=out.device)
        c = self.cols if cols and self.cols is not None else torch.arange(out.shape[2], device=out.device)
        out.index_put_((b[:, None, None], r[None, :, None], c[None, None, :]), x, accumulate=True)


def _span(ix: Tensor | None) -> slice | None:
    """slice(None) for None (every index), slice(a, b) for the indices a, a + 1, ..., b - 1, else None. Reads
    `ix` on the host: called when a rectangle is built, which local_rects does once per layout."""
    if ix is None:
        return slice(None)
    v = ix.cpu()
    if v.numel() == 0:
        return None
    a = int(v[0])
    return slice(a, a + v.numel()) if torch.equal(v, torch.arange(a, a + v.numel(), dtype=v.dtype)) else None


def _batch_count(shape) -> int:
    return math.prod(shape[:-2])


def _flat_rects(off: int, count: int, shape, batch_ix, row_ix, col_ix) -> list[Rect]:
    """A range [off, off + count) of the flattened (B, m, n) tensor `shape` as rectangles (a partial row, whole
    rows, a partial row, per matrix), each a contiguous range of the local flat tensor; global indices through
    batch_ix / row_ix / col_ix (the flattened tensor's own indices when it is a piece of a larger one)."""
    nb, m, n = shape
    rects, pos, end = [], off, off + count
    while pos < end:
        b, within = divmod(pos, m * n)
        i, j = divmod(within, n)
        if j or end - pos < n:
            k, width = 1, min(n - j, end - pos)
        else:
            k, width = min((end - pos) // n, m - i), n
        lo = pos - off

        def view(x, lo=lo, k=k, width=width):
            return x.reshape(-1)[lo:lo + k * width].view(1, k, width)

        rows = row_ix[i:i + k] if row_ix is not None else torch.arange(i, i + k)
        cols = col_ix[j:j + width] if col_ix is not None else torch.arange(j, j + width)
        rects.append(Rect(batch_ix[b:b + 1], rows, cols, view))
        pos += k * width
    return rects


def local_rects(lay, shape, local_shape, device) -> list[Rect]:
    """The rectangles of a (..., m, n) param of global `shape` that this rank holds under layout `lay`
    (None: all of it), whose local tensor has `local_shape`. Built once per layout and device (cached on
    the layout): every step uses them."""
    if lay is None:
        return [Rect(None, None, None, lambda x: x.reshape(_batch_count(shape), shape[-2], shape[-1]))]
    key = ("galore_rects", tuple(shape), tuple(local_shape), str(device))
    if key not in lay._cache:
        lay._cache[key] = _local_rects(lay, tuple(shape), tuple(local_shape), device)
    return lay._cache[key]


def _local_rects(lay, shape, local_shape, device) -> list[Rect]:
    nd = len(shape)
    if not lay.is_flat:
        if math.prod(local_shape) == 0:
            return []
        lead_sharded = any(lay.index[d] is not None for d in range(nd - 2))
        batch = lay.batch_index(device) if lead_sharded else None
        rows = lay.dim_index(nd - 2, device) if lay.index[nd - 2] is not None else None
        cols = lay.dim_index(nd - 1, device) if lay.index[nd - 1] is not None else None
        loc = (_batch_count(local_shape), local_shape[-2], local_shape[-1])
        return [Rect(batch, rows, cols, lambda x: x.reshape(loc), own_bases=keeps_local_bases(lay))]
    off, count = lay.flat
    base = lay.base
    if base is None:
        arange = torch.arange(_batch_count(shape), device=device)
        return [Rect(r.batch.to(device), r.rows.to(device), r.cols.to(device), r.view)
                for r in _flat_rects(off, count, (_batch_count(shape), shape[-2], shape[-1]), arange, None, None)]
    # A flat range of a piece that is itself sharded along dims (ZeRO over TP): rectangles of that piece.
    piece = tuple(shape[d] if i is None else len(i) for d, i in enumerate(base.index))
    rects = _flat_rects(off, count, (_batch_count(piece), piece[-2], piece[-1]), base.batch_index(device),
                        base.dim_index(nd - 2, device), base.dim_index(nd - 1, device))
    return [Rect(r.batch.to(device), r.rows.to(device), r.cols.to(device), r.view) for r in rects]


def local_bases(state: dict, shape, rect: Rect) -> tuple[Tensor | None, Tensor | None]:
    """(P at the rectangle's batch and rows, Q at its batch and columns), 3-D; None if absent."""
    left, right, _ = state_views(state, shape)
    if rect.own_bases:
        return left, right
    left = rect.pick(left, True, False) if left is not None else None
    right = rect.pick(right, False, True) if right is not None else None
    return left, right


def partial_projection(g: Tensor, state: dict, shape, rects: list[Rect], out: Tensor) -> None:
    """out (the whole R, (B, a, b)) <- this rank's part of R: the sum over its rectangles of P_r^T G_r,
    G_r Q_r^T or P_r^T G_r Q_r^T at their places, zeros elsewhere. Summed over the ranks, it is R."""
    if len(rects) == 1 and rects[0].batch is None and rects[0].rows is None and rects[0].cols is None:
        left, right = local_bases(state, shape, rects[0])
        r = rects[0].view(g)
        if left is not None:
            r = left.transpose(1, 2) @ r
        if right is not None:
            r = r @ right.transpose(1, 2)
        out.copy_(r)
        return
    out.zero_()
    for rect in rects:
        left, right = local_bases(state, shape, rect)
        r = rect.view(g)
        if left is not None:
            r = left.transpose(1, 2) @ r
        if right is not None:
            r = r @ right.transpose(1, 2)
        rect.place(out, r, rows=left is None, cols=right is None)


def local_back_projection(n: Tensor, state: dict, shape, rect: Rect) -> Tensor:
    """The rectangle's piece of P N, N Q or P N Q, from the whole N (B, a, b)."""
    left, right = local_bases(state, shape, rect)
    u = rect.pick(n, rows=left is None, cols=right is None)
    if left is not None:
        u = left @ u
    if right is not None:
        u = u @ right
    return u


def moment_cut(lay, whole) -> tuple[int, int, int] | None:
    """(dim, start, count): the slice of the moments (projected shape `whole`) that this rank keeps, for a
    DTensor layout `lay`; None where the moments are whole (plain params, declared shards, flat ranges). The
    dim is the first of `whole` with at least as many entries as the group has ranks (so that few ranks, if
    any, are left without a share: torch.chunk's rule can still leave the last ones empty), else the largest:
    the same on every rank. Its cut is `Layout.shard_ranges` (DTensor's `Shard(dim)`)."""
    if lay is None or lay.mesh is None:
        return None
    d = moment_dim(whole, dist.get_world_size(lay.group))
    start, count = lay.shard_ranges(whole[d])[dist.get_rank(lay.group)]
    return d, start, count


def moment_dim(whole, world: int) -> int:
    """The dim of the moments (projected shape `whole`) cut over `world` ranks (`moment_cut`)."""
    return next((d for d, n in enumerate(whole) if n >= world), max(range(len(whole)), key=lambda d: whole[d]))


class MomentExchange:
    """The collectives of a bucket's projected params whose moments are sharded (`moment_cut`): `scatter`
    reduce-scatters their partial R's (each whole, of its natural shape in `shapes`, viewed as (pre, D, post)
    around the cut dim D) so that each rank gets the sum of its slice, `gather` all-gathers every rank's slice
    (N, written over it) back into the whole tensors. One collective each for the bucket. The send buffer
    holds, for each rank k of the group, the slice of rank k of every param one after the other, each padded to
    the param's longest share (padding is summed and never read). The params' layouts (`layouts`) share one
    group (a bucket), not necessarily one mesh.

    A param cut along its outermost dim into equal shares in the group's rank order (`even`: pre == 1, rank k
    holding rows [k D / W, (k + 1) D / W), as FSDP2's Shard(0) cuts a dim that the ranks divide; a mesh may list
    its ranks in another order) is, viewed as (W, D / W * post), rank-major already: those params
    come first in each rank's part of the buffer, packed by one torch.cat and unpacked by one
    torch.split_with_sizes_copy for all of them (the copy-in and copy-out FSDP2 does), the others by a copy
    each way per param."""

    def __init__(self, layouts: list, shapes: list[tuple], device):
        self.group = layouts[0].group
        self.world = dist.get_world_size(self.group)
        me = dist.get_rank(self.group)
        self.entries = []
        for lay, whole in zip(layouts, shapes):
            d = moment_dim(whole, self.world)
            n = whole[d]
            pre, post = math.prod(whole[:d]), math.prod(whole[d + 1:])
            ranges = lay.shard_ranges(n)
            c = max(size for _, size in ranges)
            even = pre == 1 and all((start, size) == (k * c, c) for k, (start, size) in enumerate(ranges))
            pick = pos = None  # the index tensors of the per-param copies: the even params need none
            if not even:
                key = ("galore_cut", n, str(device))
                if key not in lay._cache:
                    pick, pos = [], torch.empty(n, dtype=torch.long)
                    for k, (start, size) in enumerate(ranges):
                        pick += list(range(start, start + size)) + [0] * (c - size)
                        pos[start:start + size] = torch.arange(k * c, k * c + size)
                    lay._cache[key] = (torch.tensor(pick, dtype=torch.long, device=device), pos.to(device))
                pick, pos = lay._cache[key]
            mine = tuple(whole[:d]) + (ranges[me][1],) + tuple(whole[d + 1:])
            self.entries.append([None, (pre, n, post), c, (mine, ranges[me][1]), pick, pos, even])
        col = 0
        for entry in sorted(self.entries, key=lambda e: not e[6]):  # the even ones first (stable: same order)
            entry[0] = col
            col += entry[1][0] * entry[2] * entry[1][2]
        self.chunk = col
        self.even = [k for k, e in enumerate(self.entries) if e[6]]
        self.even_cols = sum(self._width(k) for k in self.even)

    def _width(self, k: int) -> int:
        """Elements of each rank's share of the k-th param (c * post)."""
        _col, (_pre, _n, post), c, *_ = self.entries[k]
        return c * post

    def scatter(self, wholes: list[Tensor], recv: Tensor):
        """Reduce-scatter the whole partial R's `wholes` (a generator: yields the request,
        fastopt.distributed.phases) into `recv` (`chunk` elements, contiguous), then returns this rank's slice of
        each summed R (views of `recv` where they are contiguous there, else copies; shaped like the local
        moments)."""
        r0, w = wholes[0], self.world
        self.wholes, self.recv = wholes, recv
        send = torch.empty(w, self.chunk, dtype=r0.dtype, device=r0.device)
        if self.even:
            into = send if self.even_cols == self.chunk else send[:, :self.even_cols]
            torch.cat([wholes[k].view(w, self._width(k)) for k in self.even], 1, out=into)
        for r, (col, (pre, n, post), c, _mine, pick, _pos, even) in zip(wholes, self.entries):
            if pre * c * post and not even:
                block = r.reshape(pre, n, post).index_select(1, pick).view(pre, w, c, post)
                send[:, col:col + pre * c * post].view(w, pre, c, post).copy_(block.transpose(0, 1))
        yield Exchange("reduce_scatter", recv, send, self.group)
        # This rank's slice of a param sits in its padded block (pre, c, post): a contiguous piece of it where
        # the cut dim is the outermost (pre == 1), else copied out (and back in `gather`).
        self.pieces = []
        for col, (pre, _n, post), c, (mine, count), _p, _q, _e in self.entries:
            block = recv[col:col + pre * c * post].view(pre, c, post)[:, :count]
            self.pieces.append((block, block.contiguous().view(mine)))
        return [piece for _b, piece in self.pieces]

    def gather(self):
        """All-gather (a generator, as `scatter`) the slices in the receive buffer (written over since
        `scatter`, or into the pieces it returned) into the whole tensors."""
        r0, w = self.wholes[0], self.world
        for block, piece in self.pieces:
            if not block.is_contiguous():  # `piece` is a copy
                block.copy_(piece.view(block.shape))
        out = torch.empty(w, self.chunk, dtype=r0.dtype, device=r0.device)
        yield Exchange("all_gather", out, self.recv, self.group)
        if self.even:
            whole = out if self.even_cols == self.chunk else out[:, :self.even_cols]
            widths = [self._width(k) for k in self.even]
            torch.split_with_sizes_copy(whole, widths, 1,
                                        out=[self.wholes[k].view(w, c) for k, c in zip(self.even, widths)])
        for r, (col, (pre, n, post), c, _mine, _pick, pos, even) in zip(self.wholes, self.entries):
            if pre * c * post and not even:
                block = out[:, col:col + pre * c * post].view(w, pre, c, post).transpose(0, 1)
                r.reshape(pre, n, post).copy_(block.reshape(pre, w * c, post).index_select(1, pos))
        self.wholes = self.recv = self.pieces = None  # the step's buffers are not kept (a replay keeps this)


class BucketPlan:
    """The projected params of a bucket, for both back ends: `shapes[i]` (global), `shape3s[i]` (R as (B, a, b)),
    `rows[i]` (`moment_cut`), and `proj`, their indices with the whole-moment params first, the order of their
    R's in the bucket's flat buffer of `size` elements (so that `reduce` sums a prefix of it). The step's scratch
    buffer has `scratch_size` elements: R's buffer, then the receive buffer of the sharded moments' exchange
    (`exchange`), both inside it so that the launches of a step can be replayed (kernels/galore.py)."""

    def __init__(self, params: list[Tensor], states: list[dict], layouts: list):
        self.shapes, self.shape3s, self.rows = {}, {}, {}
        for i, s in enumerate(states):
            if is_projected(s):
                lay = layouts[i]
                self.shapes[i] = lay.global_shape if lay is not None else tuple(params[i].shape)
                self.shape3s[i] = state_views(s, self.shapes[i])[2]
                self.rows[i] = moment_cut(lay, self.natural(i))
        self.proj = sorted(self.shapes, key=lambda i: self.rows[i] is not None)
        self.starts, self.size = {}, 0
        for i in self.proj:
            self.starts[i], self.size = self.size, self.size + math.prod(self.shape3s[i])
        self.cut = [i for i in self.proj if self.rows[i] is not None]
        self.whole_size = self.starts[self.cut[0]] if self.cut else self.size  # the params with whole moments
        self.exchange = MomentExchange([layouts[i] for i in self.cut], [self.natural(i) for i in self.cut],
                                       params[0].device) if self.cut else None
        self.scratch_size = self.size + (self.exchange.chunk if self.cut else 0)

    def natural(self, i: int) -> tuple:
        """R's shape with the param's leading dims (the moments' global shape)."""
        return self.shapes[i][:-2] + self.shape3s[i][1:]

    def views(self, buf: Tensor, which=None) -> dict:
        """{i: R of projected param i, (B, a, b)}: views of the step's scratch buffer `buf`, for the params
        `which` (default: all)."""
        return {i: buf[self.starts[i]:self.starts[i] + math.prod(self.shape3s[i])].view(self.shape3s[i])
                for i in (self.proj if which is None else which)}

    def reduce(self, buf: Tensor, sharded: bool):
        """Sum the partial R's in `buf` (the step's scratch buffer), a generator (fastopt.distributed.phases):
        the whole-moment params' prefix yielded to be summed, the others reduce-scattered; returns {i: this
        rank's slice of R} for the latter (`gather` sends N back)."""
        if sharded and self.whole_size:
            yield buf[:self.whole_size]
        if not self.cut:
            return {}
        wholes = [r.view(self.natural(i)) for i, r in self.views(buf, self.cut).items()]
        return dict(zip(self.cut, (yield from self.exchange.scatter(wholes, buf[self.size:self.scratch_size]))))

    def gather(self):
        if self.exchange is not None:
            yield from self.exchange.gather()


def galore_phases(params: list[Tensor], grads: list[Tensor], states: list[dict], *, lr, betas, eps, weight_decay,
                  scale=1.0, block_size: int = 256, correct_bias: bool = True, inv_scale: Tensor | None = None,
                  found_inf: Tensor | None = None, layouts: list | None = None, sharded: bool = False):
    """One step over a bucket (same device and dtype) whose bases are already refreshed (`refresh_bases`);
    each state's `step` is already advanced. Math in fp64 for fp64 params, else fp32. A generator that yields
    its collectives (fastopt.distributed.phases) when `sharded`. The step size is
    lr sqrt(1 - beta2^t) / (1 - beta1^t), or lr without `correct_bias` (galore-torch's correct_bias=False).

    Sharded params (`layouts[i]`): each rank projects its piece of the gradient into a flat buffer of every
    projected param's whole R; the part of the params with whole moments is summed over the ranks (one
    all-reduce for the bucket), that of the params with sharded moments (DTensors) is reduce-scattered
    (`MomentExchange`); Adam runs on the rows whose moments this rank keeps, N is all-gathered, and each rank
    back-projects onto its piece."""
    beta1, beta2 = betas
    layouts = layouts if layouts is not None else [None] * len(params)
    acc = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    device = params[0].device
    # Phase 1: the projected gradients of the whole bucket in one flat buffer, those with whole moments first.
    plan = BucketPlan(params, states, layouts)
    shapes, proj = plan.shapes, plan.proj
    buf = torch.empty(plan.scratch_size, dtype=acc, device=device)
    rs, rects = plan.views(buf), {}
    for i in proj:
        rects[i] = local_rects(layouts[i], shapes[i], tuple(params[i].shape), device)
        g = grads[i].to(acc)
        if inv_scale is not None:
            g = g * inv_scale.to(acc)
            store_unscaled(grads[i], g, found_inf)
        partial_projection(g.contiguous(), states[i], shapes[i], rects[i], rs[i])
    mine = yield from plan.reduce(buf, sharded)
    # Phase 2: Adam on the projected gradients (the rows kept here), N written over them; plain AdamW for the
    # params without a projection.
    for i, (p, g, s) in enumerate(zip(params, grads, states)):
        if i in rs:
            r = mine.get(i, rs[i])
        else:
            r = g.to(acc)
            if inv_scale is not None:
                r = r * inv_scale.to(acc)
                store_unscaled(g, r, found_inf)
        m_old, v_old = load_moments(s, acc, block_size)
        m = beta1 * m_old.reshape(r.shape) + (1 - beta1) * r
        v = beta2 * v_old.reshape(r.shape) + (1 - beta2) * r * r
        n = m / (v.sqrt() + eps)
        store_moments(s, m.view(s["exp_avg"].shape), v.view(s["exp_avg"].shape), block_size, found_inf)
        if i in rs:
            r.copy_(n)
            continue
        eta = step_size(s["step"], lr=lr, betas=betas, bias_correction=correct_bias).to(acc)
        p_new = p.to(acc) - eta * n
        if weight_decay > 0:
            p_new = p_new - (lr * weight_decay) * p_new
        _commit(p, p_new, found_inf)
    yield from plan.gather()
    # Phase 3: the back-projection of the whole N onto the local piece, then the decoupled decay.
    for i in proj:
        p, s = params[i], states[i]
        eta = step_size(s["step"], lr=lr, betas=betas, bias_correction=correct_bias).to(acc)
        work = p.detach().clone().to(acc).contiguous()
        for rect in rects[i]:
            piece = rect.view(work)
            piece -= eta * (scale * local_back_projection(rs[i], s, shapes[i], rect))
            if weight_decay > 0:
                piece -= (lr * weight_decay) * piece
        _commit(p, work.view(p.shape), found_inf)
