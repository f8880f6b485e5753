"""bf16 stochastic rounding under every layout (4 gloo processes on CPU): a piece of a sharded param draws the
noise the whole param draws in one process (seeded by the param's position in the optimizer and the step, at
each element's offset in the global tensor), so bf16 params stepped with `bf16_stochastic_round=True` are bit for
bit the single process's: DTensor placements (Shard of every dim, uneven, 2-D meshes, FSDP2 over TP's
_StridedShard), flat ranges cut mid-row, ColossalAI's ZeRO over TP, and fastopt's ZeroRedundancyOptimizer (whose
ranks hold other params at other positions).

The settings keep every reduction exact, so that only the noise can tell a layout from one process: gradients
of +-0.5, 1 and 2 (their squares sum exactly in fp32, in any order), no RMS clip (clip_threshold 1e30: the clip
factor is 1 exactly), Adafactor without parameter scaling, CAME with beta1 = 0 (M_t = U: the instability is
eps2 alone, and the 8-bit momentum's local blocks never reach the update), Lamb with its trust ratio clamped
(max_trust_ratio 0.01, below every ||p|| / ||a|| here). The updates (about 2e-3, on params of order 1 whose bf16
spacing is 4e-3 to 1.6e-2) are below a bf16 ulp, so the noise decides how most elements round."""
from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import whole
from test_layouts import (CASES, FLAT_SHAPES, ZERO_TP_SHAPES, _meshes_and_placements, run_flat_ranges, run_placements,
                          step_all)

import fastopt

STEPS = 6
OPTS = {
    "adafactor": ("Adafactor", dict(lr=2e-3, relative_step=False, scale_parameter=False, clip_threshold=1e30,
                                    beta1=0.9, weight_decay=0.01)),
    "came": ("CAME", dict(lr=2e-3, betas=(0.0, 0.999, 0.9999), clip_threshold=1e30, weight_decay=0.01)),
    "came8": ("CAME", dict(lr=2e-3, betas=(0.0, 0.999, 0.9999), clip_threshold=1e30, weight_decay=0.01, nbits=8)),
    "lamb": ("Lamb", dict(lr=0.2, weight_decay=0.01, max_trust_ratio=0.01)),
}
ZERO_SHAPES = [(7, 5), (16, 36), (13,), (3, 4, 5), (2, 9)]  # (16, 36): split over the 4 ranks, cut mid-row
# fastopt.ZeroRedundancyOptimizer splits a param of at least world * zero._ALIGN elements (4096 a rank) into ranges
# that start at multiples of _ALIGN. Lowered to 64 here, so that the (16, 36) param splits (at 128, 320 and 448:
# mid-row), as a (64, 272) one would at 4096-multiples; under the interpreter its 576 elements take 5 programs
# of a kernel where 17408 took 136. The wrapper's splits at the real _ALIGN: tests/test_zero.py.
SPLIT_ALIGN = 64


@contextlib.contextmanager
def _split_align():
    from fastopt.distributed import zero
    saved, zero._ALIGN = zero._ALIGN, SPLIT_ALIGN
    try:
        yield
    finally:
        zero._ALIGN = saved


def _opt(name, params, sr=True):
    cls, kw = OPTS[name]
    return getattr(fastopt, cls)(params, bf16_stochastic_round=sr, **kw)


def _problem(shapes, seed):
    """bf16 params from randn; gradients of +-0.5, 1, 2, fresh each step."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    vals = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], dtype=torch.bfloat16)
    grads = [[vals[torch.randint(len(vals), s, generator=g)] for s in shapes] for _ in range(STEPS)]
    return init, grads


def _single(name, init, grads, sr=True):
    """The params after STEPS steps of one process."""
    params = [torch.nn.Parameter(p.clone()) for p in init]
    step_all(_opt(name, params, sr), params, grads)
    return [p.detach() for p in params]


def _check(where, name, got, init, grads):
    """Every param of `got` bit for bit the single process's on this back end, and stochastic rounding did
    something there (its params differ from a run with round-to-nearest)."""
    want = _single(name, init, grads)
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.view_as(b), b), (where, name, k, int((a.view_as(b) != b).sum()), b.numel())
    backend = os.environ["FASTOPT_BACKEND"]
    os.environ["FASTOPT_BACKEND"] = "torch"  # a property of the problem: the quick back end tells
    try:
        nearest = _single(name, init, grads, sr=False)
    finally:
        os.environ["FASTOPT_BACKEND"] = backend
    assert any(not torch.equal(a, b) for a, b in zip(want, nearest)), (where, name)


def _verify(checks):
    """`_check` of each (where, name, got, init, grads) of `checks` on one rank each, in turn (every rank has the
    same whole params `got`): the single-process runs are the test's cost under the interpreter, and the ranks
    make them side by side once every collective of the cases is done."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for c in checks[rank::world]:
        _check(*c)


# test_layouts.CASES (Shard of every dim, uneven, 2-D meshes, FSDP2 over TP) and _StridedShard alone, whose
# pieces hold non-consecutive indices of the dim (the element map's one-entry-per-element form when it is the last).
DTENSOR_CASES = list(CASES.values()) + [((12,), (2, 2), [("SS", 0, 2), ("R",)]),
                                        ((3, 12), (2, 2), [("SS", 1, 2), ("R",)])]


def _dtensor_case(name, cases=DTENSOR_CASES):
    init, grads = _problem([c[0] for c in cases], seed=11)
    params, _ = run_placements(init, grads, _meshes_and_placements(cases), lambda ps: _opt(name, ps))
    return [("dtensor", name, [whole(p.detach()) for p in params], init, grads)]


def _flat_case(rank, name):
    """Flat ranges over the world (mid-row, across the matrices of a 3-D batch, into padding), and ColossalAI's
    ZeRO over TP (flat ranges of TP pieces), each kind in an optimizer of its own."""
    from fastopt.distributed import full_tensor
    shapes = FLAT_SHAPES + ZERO_TP_SHAPES
    init, grads = _problem(shapes, seed=12)
    pieces = run_flat_ranges(rank, init, grads, lambda ps: _opt(name, ps))
    got = [full_tensor(p, opt._layout(p)).view(s) for (p, opt), s in zip(pieces, shapes)]
    nf = len(FLAT_SHAPES)
    return [(where, name, got[part], init[part], [gs[part] for gs in grads])
            for where, part in (("flat", slice(0, nf)), ("zero_tp", slice(nf, None)))]


def _zero_case(name):
    """fastopt.ZeroRedundancyOptimizer (ZeRO-2): the (16, 36) param split over the ranks (`_split_align`), the
    others whole on their owners; each rank's wrapped optimizer holds its own params and pieces, at other positions
    than one process's. Every rank's backward gives the same gradients, which the wrapper averages exactly."""
    init, grads = _problem(ZERO_SHAPES, seed=13)
    params = [torch.nn.Parameter(p.clone()) for p in init]
    with _split_align():
        zero = fastopt.ZeroRedundancyOptimizer(_opt(name, params), partition_grad=True)
        assert zero._split == {1: (0, 128, 320, 448, 576)}, zero._split
        assert len(zero.optim.param_groups[0]["params"]) < len(params)
        for gs in grads:
            sum((p * g).sum() for p, g in zip(params, gs)).backward()  # each param's gradient: its g, exactly
            zero.step()
            zero.zero_grad()
    return [("zero", name, [p.detach() for p in params], init, grads)]


def _case(rank, world, name, backend):
    saved = os.environ.get("FASTOPT_BACKEND")
    os.environ["FASTOPT_BACKEND"] = backend
    try:
        _verify(_dtensor_case(name) + _flat_case(rank, name) + _zero_case(name))
    finally:
        os.environ["FASTOPT_BACKEND"] = saved if saved is not None else "torch"


def _held(n, kind, g):
    """A dim's indices held by a piece: all (None), a consecutive range, or a non-consecutive subset."""
    if kind == "all":
        return None
    if kind == "range":
        a = int(torch.randint(n, (), generator=g))
        return torch.arange(a, a + 1 + int(torch.randint(n - a, (), generator=g)))
    keep = torch.randperm(n, generator=g)[:max(2, n // 2)].sort().values
    return keep if not torch.equal(keep, keep[0] + torch.arange(len(keep))) else keep[[0, -1]]


def _every_layout(shapes):
    """Layouts of each shape: dim layouts holding all, a consecutive range or a non-consecutive subset of each dim;
    flat ranges of the global tensor, of such a layout (ZeRO over TP) and of a flat range of it."""
    from fastopt.distributed.layout import Layout
    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        whole_dims = (None,) * len(shape)
        for kinds in itertools.product(["all", "range", "subset"], repeat=len(shape)):
            dims = Layout(shape, tuple(_held(n, k, g) for n, k in zip(shape, kinds)), None, ("k",))
            yield dims
            n = dims.count
            for off, cnt in {(0, n), (1, n - 1), (n // 3, n // 2), (n - 1, 1)}:
                if cnt > 0:
                    of_dims = Layout(shape, whole_dims, None, ("k",), flat=(off, cnt), base=dims)
                    yield Layout(shape, whole_dims, None, ("k",), flat=(off, cnt))
                    yield of_dims
                    if cnt > 1:
                        yield Layout(shape, whole_dims, None, ("k",), flat=(1, cnt - 1), base=of_dims)


def test_element_map_is_flat_index():
    """`Layout.element_map` (the compact map the stochastic rounding draws its offsets through) gives every real
    local element the global offset `Layout.flat_index` gives it, for `_every_layout` of 0 to 4 dims."""
    checked = 0
    for lay in _every_layout([(), (7,), (5, 6), (3, 4, 5), (2, 3, 4, 5)]):
        table, width, shift = lay.element_map("cpu")
        q = torch.arange(lay.count) + shift
        assert torch.equal(table[q // width] + q % width, lay.flat_index("cpu").reshape(-1)), lay
        checked += 1
    assert checked > 300


def test_index_prefix_sum_is_the_sum_of_the_first_flat_indices():
    """`_index_prefix_sum(lay, m)` (check_cover's checksum of a piece) is the sum of the first m global flat
    indices of `Layout.flat_index`, for every m and `_every_layout` of 1 to 3 dims. check_cover sums it over the
    ranks, where a wrong partial-row term of right declarations cancels out."""
    from fastopt.distributed.layout import _index_prefix_sum
    checked = 0
    for lay in _every_layout([(7,), (5, 6), (3, 4, 5)]):
        idx = lay.flat_index("cpu").reshape(-1)
        for m in range(lay.count + 1):
            assert _index_prefix_sum(lay, m) == int(idx[:m].sum()), (lay, m)
            checked += 1
    assert checked > 1000


def test_batch_index_is_the_global_matrix_of_each_local_matrix():
    """`Layout.batch_index` (GaLore's rectangles of a (..., R, C) param whose leading dims are sharded: the matrix
    of the global batch that each local matrix is) gives, for every local matrix in the local tensor's row-major
    order, the global batch index of its elements' `Layout.flat_index`, for the dim layouts of `_every_layout` of
    2 to 5 dims: several leading dims, each held whole, as a range or as a subset."""
    checked = 0
    for lay in _every_layout([(5, 6), (3, 4, 5), (2, 3, 4, 5), (3, 2, 4, 3, 2)]):
        if lay.is_flat:
            continue
        r, c = lay.global_shape[-2:]
        f = lay.flat_index("cpu")
        want = (f[..., 0, 0] // (r * c)).reshape(-1)
        assert torch.equal(lay.batch_index("cpu"), want), lay
        assert torch.equal(f // (r * c), want.view(f.shape[:-2] + (1, 1)).expand(f.shape)), lay  # one matrix each
        checked += 1
    assert checked > 300


@pytest.mark.dist
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(OPTS))
def test_stochastic_rounding_under_every_layout_matches_single_process(pool, name, backend):
    if backend == "triton" and not (fastopt.ops.triton_available() and fastopt.ops.interpreting()):
        pytest.skip("the gloo cases hold CPU tensors: the kernels need TRITON_INTERPRET=1")
    pool.run(_case, name, backend)


def _schedule_case(rank, world, name, backend):
    """What training loops do between steps, under fastopt.ZeroRedundancyOptimizer (ZeRO-1 with overlapped
    all-reduces, and ZeRO-2) and under FSDP2's fully_shard, against one process doing the same: a param group
    added after 2 steps (existing params keep their positions, new ones are appended; the (16, 36) param among
    them is split), a frozen param, a param without a gradient on some steps. Every element bit for bit."""
    import fastopt
    from torch.distributed.fsdp import fully_shard
    saved = os.environ.get("FASTOPT_BACKEND")
    os.environ["FASTOPT_BACKEND"] = backend
    try:
        init, grads = _problem(ZERO_SHAPES, seed=14)
        first = 3  # ZERO_SHAPES[:3] from the start, the others added after ADD_AT steps
        add_at, frozen, gradless = 2, 2, (4, {1, 3})

        def train(wrap):
            params = [torch.nn.Parameter(p.clone(), requires_grad=k != frozen) for k, p in enumerate(init)]
            opt = wrap(_opt(name, params[:first]))
            for t, gs in enumerate(grads):
                if t == add_at:
                    opt.add_param_group({"params": params[first:]})
                live = params if t >= add_at else params[:first]
                loss = sum((p * g).sum() for k, (p, g) in enumerate(zip(live, gs))
                           if p.requires_grad and not (k == gradless[0] and t in gradless[1]))
                loss.backward()
                opt.step()
                opt.zero_grad()
            return [p.detach() for p in params], opt

        want, _ = train(lambda o: o)
        for kw in (dict(overlap_communication=True), dict(partition_grad=True)):
            with _split_align():
                got, zero = train(lambda o, kw=kw: fastopt.ZeroRedundancyOptimizer(o, **kw))
            assert zero._split == {1: (0, 128, 320, 448, 576)}, (kw, zero._split)
            for k, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), (name, kw, k, int((a != b).sum()), b.numel())

        # FSDP2: dims of 7 and 3 over 4 ranks (uneven, empty local pieces)
        def model():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(
                torch.bfloat16)

        def fit(m):
            opt = _opt(name, list(m.parameters()))
            g = torch.Generator().manual_seed(1)
            for _ in range(STEPS):
                x, y = torch.randn(8, 6, generator=g).bfloat16(), torch.randn(8, 3, generator=g).bfloat16()
                ((m(x).float() - y.float()) ** 2).sum().backward()
                opt.step()
                opt.zero_grad()

        ref = model()
        fit(ref)
        m = model()
        for layer in (m[0], m[2], m):
            fully_shard(layer)
        fit(m)
        for k, (a, b) in enumerate(zip(m.parameters(), ref.parameters())):
            a = a.full_tensor()
            assert torch.equal(a, b.detach()), (name, "fsdp2", k, int((a != b).sum()), b.numel())
    finally:
        os.environ["FASTOPT_BACKEND"] = saved if saved is not None else "torch"


@pytest.mark.dist
@pytest.mark.parametrize("name", ["adafactor", "lamb"])
def test_stochastic_rounding_through_a_training_schedule_matches_single_process(pool, name):
    """On the torch back end: the ids are the optimizer's (fastopt/optim/base.py, zero.py), whichever back end
    draws with them (the kernels' use of them: the test above)."""
    pool.run(_schedule_case, name, "torch")


# The element maps' forms, one DTensor param each: rows cut unevenly by columns, rows of a 2-D mesh cut by
# columns, rows in two runs (FSDP2 over TP), non-consecutive indices of the last dim (one entry per element).
INT64_CASES = [CASES["tp_cols_uneven"], CASES["fsdp_rows_tp_cols"], CASES["fsdp_x_tp_strided"], DTENSOR_CASES[-1]]


def _int64_case(rank, world, name):
    """The kernels' int64 path (GMAP 2, for pieces whose offsets pass 2**31): taken here by lowering the int32
    limit, on DTensor pieces of every element-map form (`INT64_CASES`), the flat ranges and ZeRO over TP (whose
    maps are shifted). The int32 path: the test above, on every case."""
    from fastopt.kernels import common
    saved, real, seen = common._INT32_MAX, common.sr_table, []

    def spy(*args):
        out = real(*args)
        seen.append(out[1])
        return out

    common._INT32_MAX, common.sr_table = 8, spy
    os.environ["FASTOPT_BACKEND"] = "triton"
    try:
        _verify(_dtensor_case(name, INT64_CASES) + _flat_case(rank, name))
    finally:
        common._INT32_MAX, common.sr_table = saved, real
        os.environ["FASTOPT_BACKEND"] = "torch"
    assert 2 in seen and 1 not in seen, seen


@pytest.mark.dist
@pytest.mark.parametrize("name", ["came8", "lamb"])  # sr_round's callers: 8-bit factored, element-wise
def test_stochastic_rounding_int64_offsets_match_single_process(pool, name):
    if not (fastopt.ops.triton_available() and fastopt.ops.interpreting()):
        pytest.skip("the gloo cases hold CPU tensors: the kernels need TRITON_INTERPRET=1")
    pool.run(_int64_case, name)
