"""Checkpoints that survive a change of layout (issue 8), for every fastopt optimizer.

- torch.distributed.checkpoint on 4 gloo processes: saved under FSDP2+TP (2x2 mesh), loaded under FSDP2+TP
  (bit for bit), FSDP2 over 4 ranks, TP over 4 ranks and a single process; the resumed run equals the
  uninterrupted one within 1e-5 of the update's size (8-bit state across layouts: within the 8-bit noise).
- Plain state_dict: `torch.load(weights_only=True)`, bit-identical resume; every mismatch or corruption fails
  loudly and leaves the optimizer bit for bit as it was (DCP too).
- DCP's state initialisation (a fake step) changes nothing.
- 8-bit and 32-bit state of one optimizer: a plain state_dict loads either way with the saved settings; DCP's
  cast of 8-bit codes into a 32-bit template is refused (one process and FSDP2), dequantized values are not.
- States saved by transformers' Adafactor, came-pytorch's CAME and bitsandbytes' AdamW8bit load and continue.
- The ZeRO wrapper's sharded and consolidated state_dicts, for every optimizer.
Float64 params and fresh random (full-rank) gradients for every step. Everything runs the plain-torch back
end: what is tested here is the state's form and movement (the kernels get the same local tensors as before,
and their own tests cover them on both back ends).
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from conftest import DIST_WORLD, TOL, check_foreign_group_count_refused, save_load

import fastopt
from fastopt import checkpoint as ckpt

WORLD = DIST_WORLD  # the session pool's ranks (conftest.py)
STEPS = 8
HALF = STEPS // 2
TOL_REL = 1e-5  # issue 8: resumed vs uninterrupted, relative to the size of the resumed steps' update
DT = torch.float64

# name -> (class name, kwargs). 8-bit cases use small blocks so that the small params hold several.
CASES = {
    "adafactor": ("Adafactor", dict()),
    "adafactor_momentum": ("Adafactor", dict(beta1=0.9, weight_decay=0.1, lr=1e-2, relative_step=False)),
    "lamb": ("Lamb", dict(lr=1e-2, weight_decay=0.01)),
    "lamb_8bit": ("Lamb", dict(lr=1e-2, nbits=8, block_size=64, min_8bit_size=0)),
    "came": ("CAME", dict(lr=1e-2, weight_decay=0.01)),
    "came_8bit": ("CAME", dict(lr=1e-2, nbits=8)),
    "adamw8bit": ("AdamW8bit", dict(lr=1e-2, block_size=64, min_8bit_size=0)),
    "galore": ("GaLoreAdamW", dict(lr=1e-2)),
    "galore_8bit": ("GaLoreAdamW8bit", dict(lr=1e-2, block_size=64, min_8bit_size=0)),
}
EIGHT_BIT = {"lamb_8bit", "came_8bit", "adamw8bit", "galore_8bit"}
# The same optimizer with 32-bit state (case, overrides): the yardstick of the 8-bit noise.
TWIN_32 = {"lamb_8bit": ("lamb_8bit", dict(nbits=32)), "came_8bit": ("came_8bit", dict(nbits=32)),
           "adamw8bit": ("adamw8bit", dict(min_8bit_size=10**9)), "galore_8bit": ("galore", {})}


def make_opt(case, model, **over):
    cls_name, kw = CASES[case]
    cls = getattr(fastopt, cls_name)
    kw = {**kw, **over}
    if cls_name.startswith("GaLore"):  # project the matrices, plain AdamW for the rest
        mats = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        return cls([{"params": mats, "rank": 2, "update_proj_gap": 3}, {"params": rest}], **kw)
    return cls(model.parameters(), **kw)


class MLP(torch.nn.Module):
    """Uneven dims (10 rows over 4 TP ranks: 3, 3, 3, 1), a bias-free layer, a norm's vectors."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = torch.nn.Linear(12, 10, dtype=DT)
        self.down = torch.nn.Linear(10, 6, bias=False, dtype=DT)
        self.norm = torch.nn.LayerNorm(6, dtype=DT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=DT) * 0.5)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def step_fresh(opt, params, steps):
    """`steps` steps of `opt` over `params` (plain or DTensor): at each, fresh gradients from randn seeded by the
    step, drawn in the params' order and placed like their param (the same on every rank and under any layout)."""
    from torch.distributed.tensor import distribute_tensor
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        for p in params:
            gr = torch.randn(p.shape, generator=gen, dtype=DT)
            p.grad = distribute_tensor(gr, p.device_mesh, p.placements, src_data_rank=None) \
                if ckpt.is_dtensor(p) else gr
        opt.step()
        opt.zero_grad(set_to_none=True)


def grads_for(step):
    """Fresh full-rank gradients of every param at `step`: the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=g, dtype=DT) for n, p in MLP().named_parameters()}


def build(layout):
    """MLP under `layout`: fsdp_tp (2x2 mesh: TP inside, FSDP2 across), fsdp (4), tp (4), single."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = MLP()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    elif layout == "tp":
        parallelize_module(model, init_device_mesh("cpu", (WORLD,)), plan)
    return model


def train(model, opt, steps):
    from torch.distributed.tensor import distribute_tensor
    for step in steps:
        gs = grads_for(step)
        for n, p in model.named_parameters():
            g = gs[n]
            if ckpt.is_dtensor(p):
                g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)


def full(t):
    return t.full_tensor() if ckpt.is_dtensor(t) else t


def full_params(model):
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def full_states(model, opt):
    """Every param's state as full tensors by param name; 8-bit states dequantized, absmax dropped."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    with ckpt.dequantized_8bit(opt):
        osd = get_optimizer_state_dict(model, opt)
    return {n: {k: full(_values(v)).clone() for k, v in st.items()} for n, st in osd["state"].items()}


def _values(v):
    """A state_dict's state tensor: the tensor itself, or the dequantized form of 8-bit codes (nested)."""
    return v[ckpt.DEQUANTIZED] if isinstance(v, dict) else v


def rel_err(ours: dict, ref: dict, base: dict | None = None) -> float:
    """||ours - ref|| / ||ref - base|| (base None: / ||ref||), over every tensor, in float64."""
    num = sum((ours[k].double() - ref[k].double()).square().sum() for k in ref) ** 0.5
    den = sum((ref[k].double() - (0 if base is None else base[k].double())).square().sum() for k in ref) ** 0.5
    assert den > 0, "the reference did not move: the comparison would prove nothing"
    return float(num / den)


def _flat_states(states):
    return {f"{n}.{k}": v for n, st in states.items() for k, v in st.items() if k != "step"}


# ---- DCP across layouts (4 gloo processes) --------------------------------------------------------------
@pytest.fixture
def shared_dir(pool):
    d = tempfile.mkdtemp(prefix="fastopt-ckpt-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _options(flat):
    """DCP's StateDictOptions: the default, or torchtitan's flattened optimizer state (`flat`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=flat)


def _save_then_continue(case, path, flat):
    """fsdp_tp: HALF steps, DCP save, the other HALF: (params and states saved, params and states at the end,
    the 8-bit yardstick)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    model = build("fsdp_tp")
    opt = make_opt(case, model)
    train(model, opt, range(HALF))
    osd = get_optimizer_state_dict(model, opt, options=_options(flat))
    dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=path)
    mid, saved = full_params(model), full_states(model, opt)
    train(model, opt, range(HALF, STEPS))
    return mid, saved, full_params(model), full_states(model, opt), _noise(case, model, mid)


def _noise(case, model, mid):
    """How far 8-bit state moves the run of `model` (STEPS under fsdp_tp) from the same run with 32-bit state,
    relative to the update after `mid`; None for 32-bit cases."""
    if case not in EIGHT_BIT:
        return None
    twin = build("fsdp_tp")
    twin_case, over = TWIN_32[case]
    twin_opt = make_opt(twin_case, twin, **over)
    train(twin, twin_opt, range(STEPS))
    return rel_err(full_params(twin), full_params(model), mid)


def _resume(case, path, target, flat):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    model = build(target)
    opt = make_opt(case, model)
    single = target == "single"
    with ckpt.dequantized_8bit(opt) if single else contextlib.nullcontext():
        osd = get_optimizer_state_dict(model, opt, options=_options(flat))
        sd = {"model": get_model_state_dict(model), "optim": osd}
    dcp.load(sd, checkpoint_id=path, no_dist=single)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"], options=_options(flat))
    loaded = full_states(model, opt)
    train(model, opt, range(HALF, STEPS))
    return loaded, full_params(model), full_states(model, opt)


def _dcp_case(rank, world, case, path, flat):
    os.environ["FASTOPT_BACKEND"] = "torch"
    mid, saved, final, states, noise = _save_then_continue(case, path, flat)
    out = {"noise": noise}
    for target in ("fsdp_tp", "fsdp", "tp", "single"):
        if target == "single" and rank != 0:
            dist.barrier()
            continue
        loaded, params, st = _resume(case, path, target, flat)
        out[target] = dict(
            exact=all(torch.equal(params[k], final[k]) for k in final),
            loaded_exact=all(torch.equal(a, b) for a, b in zip(_flat_states(loaded).values(),
                                                                _flat_states(saved).values())),
            # what a requantization into other blocks may move each element by: -1 to the map's lowest value
            loaded_moved=max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))
                             for a, b in zip(_flat_states(loaded).values(), _flat_states(saved).values())),
            param_err=rel_err(params, final, mid),
            state_err=rel_err(_flat_states(st), _flat_states(states)),
            keys_equal=all(sorted(st[n]) == sorted(states[n]) for n in states) and sorted(st) == sorted(states),
            steps=sorted({float(s["step"]) for s in st.values()}),
        )
        if target == "single":
            dist.barrier()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("case, flat", [(c, False) for c in CASES] +
                         [(c, True) for c in ("adafactor", "galore", "adamw8bit", "galore_8bit")])
def test_dcp_reshards_fsdp_tp_to_fsdp_tp_single(pool, shared_dir, case, flat):
    """Saved under FSDP2+TP, loaded under FSDP2+TP, FSDP2, TP and one process; also in DCP's flattened form
    (torchtitan's `flatten_optimizer_state_dict=True`), 8-bit states included."""
    results = pool.run(_dcp_case, case, os.path.join(shared_dir, "ckpt"), flat)
    for rank, res in enumerate(results):
        for target in ("fsdp_tp", "fsdp", "tp", "single"):
            if target not in res:
                continue
            r = res[target]
            where = f"{case}, rank {rank}, loaded under {target}"
            assert r["keys_equal"], where
            assert r["steps"] == [float(STEPS)], (where, r["steps"])
            if target == "fsdp_tp" or case not in EIGHT_BIT:
                assert r["loaded_exact"], f"{where}: the loaded state differs from the saved one"
            if target == "fsdp_tp":
                assert r["exact"], f"{where}: resuming in the same layout is not bit for bit"
                continue
            if case in EIGHT_BIT:
                # Other blocks: requantized, each element within half a step of its new block (at most
                # 1 - 0.99297 of the block's absmax); the run stays within the 8-bit noise itself (8-bit vs
                # 32-bit state over the same run).
                assert r["loaded_moved"] <= 0.00704, (where, r["loaded_moved"])
                assert r["param_err"] <= res["noise"], (where, r["param_err"], res["noise"])
            else:
                assert r["param_err"] <= TOL_REL, (where, r["param_err"])
                assert r["state_err"] <= TOL_REL, (where, r["state_err"])


def _full_case(rank, world, case):
    """torch.save of the full optimizer state on rank 0 (StateDictOptions full_state_dict + cpu_offload, as
    accelerate's and torchtune's FSDP2 checkpoints take it), loaded by broadcast from rank 0 under fsdp_tp and
    fsdp."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    os.environ["FASTOPT_BACKEND"] = "torch"
    save, load = (StateDictOptions(full_state_dict=True, cpu_offload=True),
                  StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    model = build("fsdp_tp")
    opt = make_opt(case, model)
    train(model, opt, range(HALF))
    osd = get_optimizer_state_dict(model, opt, options=save)
    tensors = [t for st in osd.get("state", {}).values() for v in st.values()
               for t in (v.values() if isinstance(v, dict) else [v])]
    out = {"rank0_full": all(torch.is_tensor(t) and not ckpt.is_dtensor(t) and t.device.type == "cpu"
                             for t in tensors) and len(tensors) > 0,
           "others_empty": not osd.get("state")}
    buf = io.BytesIO()
    torch.save({"model": get_model_state_dict(model, options=save), "optim": osd}, buf)
    mid, saved = full_params(model), full_states(model, opt)
    train(model, opt, range(HALF, STEPS))
    final, noise = full_params(model), _noise(case, model, mid)
    for target in ("fsdp_tp", "fsdp"):
        model = build(target)
        opt = make_opt(case, model)
        buf.seek(0)
        sd = torch.load(buf, weights_only=True) if rank == 0 else {"model": {}, "optim": {}}
        set_model_state_dict(model, sd["model"], options=load)
        set_optimizer_state_dict(model, opt, sd["optim"], options=load)
        loaded, want = _flat_states(full_states(model, opt)), _flat_states(saved)
        train(model, opt, range(HALF, STEPS))
        same_keys = sorted(loaded) == sorted(want)
        out[target] = dict(
            keys_equal=same_keys,
            loaded_exact=same_keys and all(torch.equal(loaded[k], want[k]) for k in want),
            loaded_moved=max(float((loaded[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-300))
                             for k in want) if same_keys else float("inf"),
            param_err=rel_err(full_params(model), final, mid), noise=noise)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("case", ["adafactor_momentum", "came_8bit", "lamb", "galore_8bit"])
def test_full_state_dict_on_rank0_resumes(pool, case):
    """The full (gathered, on rank 0's CPU) optimizer state of an FSDP2+TP run, saved with torch.save and
    broadcast from rank 0 into FSDP2+TP (the same run, bit for bit) and FSDP2 over 4 ranks: factored, projected
    and 8-bit states come back whole, as plain CPU tensors on rank 0 only."""
    for rank, res in enumerate(pool.run(_full_case, case)):
        assert res["rank0_full"] if rank == 0 else res["others_empty"], (case, rank)
        for target in ("fsdp_tp", "fsdp"):
            r, where = res[target], f"{case}, rank {rank}, loaded under {target}"
            assert r["keys_equal"], f"{where}: the loaded state has other keys than the saved one"
            if target == "fsdp_tp" or case not in EIGHT_BIT:
                assert r["loaded_exact"], f"{where}: the loaded state differs from the saved one"
            if target == "fsdp_tp":
                assert r["param_err"] == 0, (where, r["param_err"])
            elif case in EIGHT_BIT:  # requantized into other blocks: see test_dcp_reshards_...
                assert r["loaded_moved"] <= 0.00704, (where, r["loaded_moved"])
                assert r["param_err"] <= r["noise"], (where, r["param_err"], r["noise"])
            else:
                assert r["param_err"] <= TOL_REL, (where, r["param_err"])


# ---- DCP: corrupted and mismatched checkpoints -------------------------------------------------------------
def _snapshot(opt):
    """Every state tensor of `opt` (local pieces) and its hyperparameters, copied."""
    from fastopt.distributed.layout import local
    state = [{k: local(v).clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]
             if p in opt.state]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, groups


def _same(a, b) -> bool:
    (sa, ga), (sb, gb) = a, b
    return ga == gb and len(sa) == len(sb) and all(
        sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb))


def _dcp_bad_case(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    os.environ["FASTOPT_BACKEND"] = "torch"
    out = {}
    model = build("fsdp_tp")
    opt = make_opt("adafactor_momentum", model)
    train(model, opt, range(HALF))
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=os.path.join(path, "good"))
    lamb_model = build("fsdp_tp")
    lamb = make_opt("lamb", lamb_model)
    train(lamb_model, lamb, range(2))
    dcp.save({"optim": get_optimizer_state_dict(lamb_model, lamb)}, checkpoint_id=os.path.join(path, "lamb"))
    train(model, opt, range(HALF, HALF + 2))  # the optimizer now differs from both checkpoints
    before = _snapshot(opt)

    # A non-finite value in one rank's piece only: every rank refuses, none changes. The templates that DCP fills
    # are deep copies: get_optimizer_state_dict's holds the optimizer's own state tensors (as torch's optimizers'
    # do), which dcp.load would overwrite before set_optimizer_state_dict checks anything (the README's advice).
    sd = {"optim": copy.deepcopy(get_optimizer_state_dict(model, opt))}
    dcp.load(sd, checkpoint_id=os.path.join(path, "good"))
    if rank == 1:
        sd["optim"]["state"]["up.weight"]["exp_avg"].to_local()[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"up\.weight.*'exp_avg'.*non-finite" if rank == 1 else "non-finite.*rank 1"):
        set_optimizer_state_dict(model, opt, sd["optim"])
    out["nan_unchanged"] = _same(before, _snapshot(opt))

    # Another optimizer's checkpoint: DCP finds the keys missing before it reads anything (the live template).
    sd = {"optim": get_optimizer_state_dict(model, opt)}
    with pytest.raises(CheckpointException, match="Missing key in checkpoint"):
        dcp.load(sd, checkpoint_id=os.path.join(path, "lamb"))
    out["other_ckpt_unchanged"] = _same(before, _snapshot(opt))
    # ... and another optimizer's state_dict handed over directly names the keys.
    with pytest.raises(ValueError, match="lacks|expected"):
        set_optimizer_state_dict(model, opt, get_optimizer_state_dict(lamb_model, lamb))
    out["other_sd_unchanged"] = _same(before, _snapshot(opt))

    # A truncated data file: DCP raises while reading, into a copy of the template, so nothing changed.
    dist.barrier()
    if rank == 0:
        shutil.copytree(os.path.join(path, "good"), os.path.join(path, "cut"))
        for f in sorted(os.listdir(os.path.join(path, "cut"))):
            if f.endswith(".distcp"):
                name = os.path.join(path, "cut", f)
                with open(name, "r+b") as fh:
                    fh.truncate(os.path.getsize(name) // 3)
    dist.barrier()
    sd = {"optim": copy.deepcopy(get_optimizer_state_dict(model, opt))}
    with pytest.raises(CheckpointException):  # DCP's wrapper of each rank's reader error
        dcp.load(sd, checkpoint_id=os.path.join(path, "cut"))
    out["cut_unchanged"] = _same(before, _snapshot(opt))
    return out


@pytest.mark.dist
def test_dcp_corrupted_or_mismatched_checkpoint_fails_and_changes_nothing(pool, shared_dir):
    for rank, res in enumerate(pool.run(_dcp_bad_case, shared_dir)):
        assert all(res.values()), (rank, res)


def _other_placements_case(rank, world, case):
    """Two matrices sharded [Shard(0), Shard(1)] on a 2x2 mesh take HALF steps; their state_dict loads straight
    (no DCP) into the same matrices sharded [Shard(1), Shard(0)] on that mesh, where every rank's piece has the
    same shape and, on ranks 1 and 2, other elements. The other HALF steps, with fresh gradients, must equal
    the single process's uninterrupted run, params and states."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    os.environ["FASTOPT_BACKEND"] = "torch"
    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (8, 6), "b": (4, 10)}
    init = {n: torch.randn(s, generator=g, dtype=DT) * 0.5 for n, s in shapes.items()}

    def module(values, placements=None):
        m = torch.nn.Module()
        for n, v in values.items():
            t = v.clone() if placements is None else distribute_tensor(v.clone(), mesh, placements, src_data_rank=None)
            m.register_parameter(n, torch.nn.Parameter(t))
        return m

    def run(m, opt, steps):
        step_fresh(opt, list(m.parameters()), steps)

    ref = module(init)
    ref_opt = make_opt(case, ref)
    run(ref, ref_opt, range(HALF))
    mid = full_params(ref)
    run(ref, ref_opt, range(HALF, STEPS))
    first = module(init, [Shard(0), Shard(1)])
    first_opt = make_opt(case, first)
    run(first, first_opt, range(HALF))
    sd = copy.deepcopy(first_opt.state_dict())
    other = module(full_params(first), [Shard(1), Shard(0)])
    opt = make_opt(case, other)
    opt.load_state_dict(sd)
    run(other, opt, range(HALF, STEPS))
    states = {f"{n}.{k}": full(v) for n, p in other.named_parameters() for k, v in opt.state[p].items()
              if k != "step"}
    ref_states = {f"{n}.{k}": v for n, q in ref.named_parameters() for k, v in ref_opt.state[q].items() if k != "step"}
    return dict(param_err=rel_err(full_params(other), full_params(ref), mid),
                state_err=rel_err(states, ref_states), local=[tuple(p.to_local().shape) for p in other.parameters()],
                first_local=[tuple(p.to_local().shape) for p in first.parameters()])


@pytest.mark.dist
@pytest.mark.parametrize("case", ["adafactor_momentum", "lamb"])
def test_state_dict_of_other_placements_on_the_mesh_loads(pool, case):
    """load_state_dict redistributes DTensor states saved under other placements on the params' mesh (pieces of
    the same local shape, holding other elements: a load without it would not notice)."""
    for rank, res in enumerate(pool.run(_other_placements_case, case)):
        assert res["local"] == res["first_local"], res  # same local shapes: only the values tell
        assert res["param_err"] <= TOL[DT], (case, rank, res["param_err"])
        assert res["state_err"] <= TOL[DT], (case, rank, res["state_err"])


# ---- ZeRO: sharded and consolidated state_dicts, every optimizer -------------------------------------------
@pytest.mark.dist
@pytest.mark.parametrize("name", [n for n in fastopt.__all__ if isinstance(getattr(fastopt, n), type) and issubclass(
    getattr(fastopt, n), fastopt.optim.base.FastOptimizer)])
def test_zero_state_dicts_round_trip_and_load_unwrapped(pool, name):
    from test_zero import _state_dict_roundtrip, check_state_dict_roundtrip
    check_state_dict_roundtrip(pool.run(_state_dict_roundtrip, name, True))


# ---- plain state_dict under DDP ------------------------------------------------------------------------------
def _ddp_train(model, opt, steps, rank):
    for step in steps:
        # The same batch on every rank: DDP's average is then exact whatever order gloo sums in (a resumed
        # DDP model's first buckets differ from the rebuilt ones of a model that has run).
        g = torch.Generator().manual_seed(100 * step)
        x, y = torch.randn(5, 12, generator=g, dtype=DT), torch.randn(5, 6, generator=g, dtype=DT)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _ddp_case(rank, world, path):
    os.environ["FASTOPT_BACKEND"] = "torch"
    out = {}
    for case in CASES:
        model = torch.nn.parallel.DistributedDataParallel(MLP())
        opt = make_opt(case, model.module)
        _ddp_train(model, opt, range(HALF), rank)
        name = os.path.join(path, f"{case}.pt")
        if rank == 0:
            torch.save(opt.state_dict(), name)
        mid = copy.deepcopy(model.module.state_dict())
        dist.barrier()
        _ddp_train(model, opt, range(HALF, STEPS), rank)
        resumed = MLP()
        resumed.load_state_dict(mid)
        resumed = torch.nn.parallel.DistributedDataParallel(resumed)
        r_opt = make_opt(case, resumed.module)
        r_opt.load_state_dict(torch.load(name, weights_only=True))
        _ddp_train(resumed, r_opt, range(HALF, STEPS), rank)
        out[case] = dict(params=all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters())),
                         states=_equal_sd(opt.state_dict(), r_opt.state_dict()),
                         final=[p.detach().clone() for p in resumed.parameters()])
    return out


@pytest.mark.dist
def test_ddp_plain_state_dict_resumes_bit_for_bit(pool, shared_dir):
    results = pool.run(_ddp_case, shared_dir)
    for case in CASES:
        for rank, res in enumerate(results):
            assert res[case]["params"] and res[case]["states"], f"{case}, rank {rank}: resume is not bit for bit"
            assert all(torch.equal(a, b) for a, b in zip(res[case]["final"], results[0][case]["final"])), case


def test_every_fastopt_optimizer_has_a_case():
    classes = {n for n in fastopt.__all__ if isinstance(getattr(fastopt, n), type)
               and issubclass(getattr(fastopt, n), fastopt.optim.base.FastOptimizer)}
    assert classes <= {c for c, _ in CASES.values()}, classes - {c for c, _ in CASES.values()}


# ---- plain state_dict, one process --------------------------------------------------------------------------
def _set_grads(model, step):
    gs = grads_for(step)
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p) if p.numel() == 0 else gs[n].clone()


def _run(model, opt, steps):
    for s in steps:
        _set_grads(model, s)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _equal_sd(a, b) -> bool:
    return a["param_groups"] == b["param_groups"] and sorted(a["state"]) == sorted(b["state"]) and all(
        sorted(a["state"][i]) == sorted(b["state"][i]) and all(
            isinstance(a["state"][i][k], dict) == isinstance(b["state"][i][k], dict)
            and torch.equal(_values(a["state"][i][k]), _values(b["state"][i][k])) for k in a["state"][i])
        for i in a["state"])


@pytest.mark.parametrize("case", list(CASES))
def test_plain_state_dict_resumes_bit_for_bit(case, monkeypatch):
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    straight = MLP()
    s_opt = make_opt(case, straight)
    _run(straight, s_opt, range(STEPS))
    model = MLP()
    opt = make_opt(case, model)
    _run(model, opt, range(HALF))
    sd = save_load(opt.state_dict())  # weights_only: tensors and plain numbers only
    mid = copy.deepcopy(model.state_dict())
    resumed = MLP()
    resumed.load_state_dict(mid)
    r_opt = make_opt(case, resumed)
    r_opt.load_state_dict(sd)
    _run(resumed, r_opt, range(HALF, STEPS))
    for (n, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), f"{case}: {n} differs after resuming"
    assert _equal_sd(s_opt.state_dict(), r_opt.state_dict()), f"{case}: states differ after resuming"
    if case in EIGHT_BIT - {"came_8bit"}:  # codes and absmax as they are: compact, bitsandbytes' format
        assert any(v.dtype == torch.uint8 for st in sd["state"].values() for v in st.values())


@pytest.mark.parametrize("case", list(CASES))
def test_dcp_state_initialisation_takes_no_step(case, monkeypatch):
    """DCP's get_optimizer_state_dict on a fresh optimizer runs a fake step (zero grads, lr=0) when the state
    is empty; ours makes (and keeps) zero state instead: params and the later run are untouched."""
    from torch.distributed.checkpoint.state_dict import (_init_optim_state, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    model, twin = MLP(), MLP()
    opt, t_opt = make_opt(case, model), make_opt(case, twin)
    _init_optim_state(opt)
    osd = get_optimizer_state_dict(model, opt)
    assert all(p.grad is None for p in model.parameters())
    assert len(opt.state) == len(osd["state"]) and all(  # the zero state, kept for DCP's flattened form
        not v.any() for st in opt.state.values() for v in st.values())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert sorted(osd["state"]) == sorted(n for n, _ in model.named_parameters())
    assert all(float(st["step"]) == 0 and all(not v.any() for v in st.values()) for st in osd["state"].values())
    set_optimizer_state_dict(model, opt, osd)  # a fresh optimizer's state_dict is a fresh optimizer
    _run(model, opt, range(HALF))
    _run(twin, t_opt, range(HALF))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert _equal_sd(opt.state_dict(), t_opt.state_dict())


def _bad_state_dicts(case, good):
    """(what, state_dict, error pattern): each one thing wrong with `good`."""
    other = "lamb" if CASES[case][0] != "Lamb" else "adafactor"
    o_model = MLP()
    o_opt = make_opt(other, o_model)
    _run(o_model, o_opt, range(2))
    yield "other optimizer", o_opt.state_dict(), "lacks|keys|param groups|state_dict, but one of"
    sd = copy.deepcopy(good)
    sd["param_groups"][-1]["params"] = sd["param_groups"][-1]["params"][:-1]
    yield "param count", sd, r"has \d+ params in the state_dict"
    sd = copy.deepcopy(good)
    sd["param_groups"].append(copy.deepcopy(sd["param_groups"][-1]))
    yield "group count", sd, "param groups"
    pid, key = next((i, k) for i, st in good["state"].items() for k, v in st.items()
                    if k != "step" and v.dim() >= 1 and v.is_floating_point())
    sd = copy.deepcopy(good)
    sd["state"][pid][key] = torch.zeros(tuple(s + 1 for s in sd["state"][pid][key].shape))
    yield "shape", sd, rf"\[{key!r}\] has shape"
    sd = copy.deepcopy(good)
    sd["state"][pid][key].view(-1)[-1] = float("nan")
    yield "nan", sd, "non-finite"
    sd = copy.deepcopy(good)
    sd["state"][pid][key] = sd["state"][pid][key].to(torch.int32)
    yield "dtype", sd, "dtype"
    sd = copy.deepcopy(good)
    del sd["state"][pid][key]
    yield "missing key", sd, "missing"
    for bad in ("seven", torch.tensor([3.0, 3.0]), True):  # not one number: a str, several elements, a bool
        sd = copy.deepcopy(good)
        sd["state"][pid]["step"] = bad
        yield f"step {bad!r}", sd, r"\['step'\] must be a scalar tensor or number"
    for bad in (-1.0, float("inf")):  # a step count no run reaches: the bias corrections would be garbage
        sd = copy.deepcopy(good)
        sd["state"][pid]["step"] = torch.tensor(bad)
        yield f"step {bad}", sd, r"\['step'\]=.* must be a finite number >= 0"
    sd = copy.deepcopy(good)
    sd["state"][max(sd["state"]) + 10] = copy.deepcopy(sd["state"][pid])
    yield "unknown param", sd, "unknown param id"
    yield "not a state_dict", {"state": {}}, "expected a dict with keys"


def _trained(case, monkeypatch):
    """(model, optimizer of `case`) after 3 steps, on the torch back end."""
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    model = MLP()
    opt = make_opt(case, model)
    _run(model, opt, range(3))
    return model, opt


def _refused_unchanged(case, model, opt, good, variants) -> None:
    """After 2 more steps: each (what, state_dict, error pattern) of `variants` raises the ValueError matching
    its pattern and leaves the optimizer as it was; then `good` (saved at step 3) still loads."""
    _run(model, opt, range(3, 5))
    before = _snapshot(opt)
    for what, sd, pattern in variants:
        with pytest.raises(ValueError, match=pattern):
            opt.load_state_dict(sd)
        assert _same(before, _snapshot(opt)), f"{case}: a {what} mismatch changed the optimizer"
    opt.load_state_dict(good)
    assert not _same(before, _snapshot(opt))


@pytest.mark.parametrize("case", list(CASES))
def test_mismatched_state_dict_fails_and_changes_nothing(case, monkeypatch):
    model, opt = _trained(case, monkeypatch)
    good = save_load(opt.state_dict())
    _refused_unchanged(case, model, opt, good, list(_bad_state_dicts(case, good)))


@pytest.mark.parametrize("case", list(CASES))
def test_loaded_state_is_the_optimizers_own(case, monkeypatch):
    """load_state_dict copies what it loads, the step included: the steps after it leave the state_dict as it
    was, and one state_dict loaded into two optimizers gives two runs, each the uninterrupted one."""
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    straight = MLP()
    _run(straight, make_opt(case, straight), range(STEPS))
    model = MLP()
    opt = make_opt(case, model)
    _run(model, opt, range(HALF))
    sd = save_load(opt.state_dict())
    kept = copy.deepcopy(sd)
    runs = []
    for _ in range(2):
        resumed = MLP()
        resumed.load_state_dict(model.state_dict())
        r_opt = make_opt(case, resumed)
        r_opt.load_state_dict(sd)
        runs.append((resumed, r_opt))
    for resumed, r_opt in runs:
        _run(resumed, r_opt, range(HALF, STEPS))
    assert _equal_sd(sd, kept), f"{case}: the steps after loading changed the state_dict"
    for resumed, _ in runs:
        for (n, a), b in zip(straight.named_parameters(), resumed.parameters()):
            assert torch.equal(a, b), f"{case}: {n} differs after resuming"


@pytest.mark.parametrize("case", sorted(EIGHT_BIT))
def test_bad_dequantized_8bit_state_is_refused_unchanged(case, monkeypatch):
    """The dequantized form of an 8-bit state is checked as the codes are: values of another shape with as many
    elements (transposed: they would requantize into blocks as many, and be installed in that shape), non-finite
    values (absmax NaN), a nested dict with more than the values, and the values beside the codes' absmax (two
    forms of one state) are refused, naming the key, and the optimizer stays as it was."""
    model, opt = _trained(case, monkeypatch)
    with ckpt.dequantized_8bit(opt):
        good = save_load(opt.state_dict())
    codes = save_load(opt.state_dict())
    pid, key = next((i, k) for i, st in good["state"].items() for k, v in st.items()
                    if isinstance(v, dict) and v[ckpt.DEQUANTIZED].dim() == 2
                    and v[ckpt.DEQUANTIZED].shape[0] != v[ckpt.DEQUANTIZED].shape[1])
    akey = next(a for g in opt.param_groups for k, (a, _s, _b) in opt._quantized_keys(g).items() if k == key)
    transposed, nan, extra, both = (copy.deepcopy(good) for _ in range(4))
    vals = good["state"][pid][key][ckpt.DEQUANTIZED]
    transposed["state"][pid][key] = {ckpt.DEQUANTIZED: vals.t().contiguous()}
    nan["state"][pid][key][ckpt.DEQUANTIZED][0, -1] = float("nan")
    extra["state"][pid][key]["scale"] = torch.ones(1)
    both["state"][pid][akey] = codes["state"][pid][akey]  # the codes' absmax beside the dequantized values
    _refused_unchanged(case, model, opt, good, [
        ("shape", transposed, rf"\[{key!r}\] has shape"), ("nan", nan, rf"\[{key!r}\] holds non-finite"),
        ("extra key", extra, rf"\[{key!r}\] is a dict with keys"),
        ("both forms", both, rf"holds both {key!r}.fp32 \(dequantized\) and {akey!r}")])


@pytest.mark.parametrize("case", sorted(EIGHT_BIT - {"came_8bit"}))
def test_8bit_codes_cast_to_floats_beside_their_absmax_are_refused_unchanged(case, monkeypatch):
    """8-bit codes cast to floating point next to their absmax (a state_dict converted whole, `.float()` on every
    tensor) are neither the codes nor a dequantized form (which has no absmax): refused, naming the key and the
    dtype, and the optimizer stays as it was; a cast back to uint8 would take any floats for codes, silently."""
    model, opt = _trained(case, monkeypatch)
    good = save_load(opt.state_dict())
    keys = _codes_keys(opt)
    pid, key = next((i, k) for i, st in good["state"].items() for k in keys if k in st)
    assert good["state"][pid][key].dtype == torch.uint8 and keys[key] in good["state"][pid]
    sd = copy.deepcopy(good)
    sd["state"][pid][key] = sd["state"][pid][key].float()
    _refused_unchanged(case, model, opt, good,
                       [("cast", sd, rf"\[{key!r}\] has dtype torch.float32, expected torch.uint8")])


# ---- 8-bit: the dequantized form requantizes exactly where the blocks allow ----------------------------------
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block", [64, 256])
def test_requantize_gives_back_the_dequantized_values(block, signed, monkeypatch):
    from fastopt.reference.quant import dynamic_map
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    g = torch.Generator().manual_seed(block)
    n = 7 * block + 29  # a partial last block
    x = torch.randn(n, generator=g) * torch.logspace(-6, 2, n)[torch.randperm(n, generator=g)]
    x = x if signed else x.abs()
    if signed:  # blocks whose largest magnitude is negative: the map's -0.99297 codes it, not -1
        x[: 3 * block] = -x[: 3 * block].abs()
        # ... and blocks where a positive value just under it is coded 0.99297 too (map[254] = -map[0]): the
        # largest magnitude after dequantizing is positive, and is not the scale
        x[3 * block:5 * block] /= x[3 * block:5 * block].abs().max()
        x[3 * block:5 * block:block] = 9.95  # first: the one that max() finds
        x[3 * block + 1:5 * block:block] = -10.0
    codes, absmax = fastopt.quantize_blockwise(x, block, signed)
    if signed:
        assert all(codes[b:b + block].max() == 254 for b in (3 * block, 4 * block))
    vals = fastopt.dequantize_blockwise(codes, absmax, block, signed)
    c2, a2 = ckpt.requantize(vals, block, signed)
    assert torch.equal(fastopt.dequantize_blockwise(c2, a2, block, signed), vals)
    assert torch.equal(c2, codes)
    c3, a3 = fastopt.quantize_blockwise(vals, block, signed)  # why requantize exists
    assert signed != torch.equal(fastopt.dequantize_blockwise(c3, a3, block, signed), vals)
    # Blocks cut elsewhere (another layout): each value moves by at most half a gap of the map, scaled.
    shifted = vals[block // 2:]
    c4, a4 = ckpt.requantize(shifted, block, signed)
    back = fastopt.dequantize_blockwise(c4, a4, block, signed)
    m = dynamic_map(signed)
    step = torch.cat([m.diff() / 2, 1 + m[:1]]).max()  # half a gap, or -1's distance to the map's lowest value
    scale = a4.repeat_interleave(block)[: shifted.numel()]
    assert ((back - shifted).abs() <= step * scale * (1 + 1e-5)).all()


def test_requantize_gives_back_blocks_led_by_the_signed_maps_lowest_code(monkeypatch):
    """A block whose largest magnitude is the signed map's lowest value (code 0: -0.99297 times the absmax) gives
    back its dequantized largest magnitude over 0.99297, which rounds an ulp away from the absmax in about one
    block in 150, and then the other values of the block come out of other products: requantize tries the scales
    next to it, so that every block comes back bit for bit, with the very codes."""
    from fastopt.reference.quant import dynamic_map
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    g = torch.Generator().manual_seed(0)
    blocks, block = 4096, 64
    codes = torch.randint(1, 254, (blocks, block), generator=g)
    codes[:, 0] = 0  # the block's largest magnitude: codes 1..253 are smaller (254, as large, is left out)
    codes = codes.to(torch.uint8).view(-1)
    absmax = torch.rand(blocks, generator=g) * torch.logspace(-6, 2, blocks)[torch.randperm(blocks, generator=g)]
    vals = fastopt.dequantize_blockwise(codes, absmax, block, True)
    off = vals.view(blocks, block).abs().amax(dim=1) / -dynamic_map(True)[0] != absmax
    assert off.sum() >= 5, int(off.sum())  # the case this is about occurs
    c2, a2 = ckpt.requantize(vals, block, True)
    assert torch.equal(fastopt.dequantize_blockwise(c2, a2, block, True), vals)
    assert torch.equal(c2, codes)


@pytest.mark.parametrize("case", ["adamw8bit", "lamb_8bit"])
def test_dequantized_zero_blocks_requantize_into_the_very_codes(case, monkeypatch):
    """Blocks of an 8-bit state that hold only zeros (rows of a param whose gradient stayed zero: absmax 0) come
    back from the dequantized form as the very codes saved (the signed map's code of 0), so that the state_dict
    after a load is the one saved, bit for bit."""
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    model = MLP()
    opt = make_opt(case, model)
    for s in range(HALF):
        _set_grads(model, s)
        model.up.weight.grad[:6] = 0  # 72 elements: the first block of 64 stays zero
        opt.step()
        opt.zero_grad(set_to_none=True)
    key, akey = next((k, a) for k, (a, signed, _b) in opt._quantized_keys(opt.param_groups[0]).items() if signed)
    st = opt.state[model.up.weight]
    assert float(st[akey][0]) == 0 and float(st[akey][1]) > 0 and int(st[key].view(-1)[0]) != 0  # code 0 is not 0
    with ckpt.dequantized_8bit(opt):
        sd = save_load(opt.state_dict())
    loaded = make_opt(case, MLP())
    loaded.load_state_dict(sd)
    assert _equal_sd(loaded.state_dict(), opt.state_dict()), case


def test_checkpoint_helpers_refuse_what_they_cannot_use():
    """requantize of 8-bit codes (not values) or with a bad block size, and dequantized_8bit of no optimizer or of
    one that keeps no fastopt 8-bit state (a torch optimizer, a model): errors naming the helper, where the codes
    were quantized as values and the flag was set on anything (DCP then missed a key, far from the cause)."""
    codes, _ = fastopt.quantize_blockwise(torch.randn(300), 64)
    with pytest.raises(ValueError, match=re.escape("requantize: x has dtype torch.uint8; expected a floating")):
        ckpt.requantize(codes, 64, True)
    with pytest.raises(ValueError, match=re.escape("requantize: block_size=100 must be a power of two")):
        ckpt.requantize(torch.randn(300), 100, True)
    model = torch.nn.Linear(4, 4)
    for bad, what in ((torch.optim.SGD(model.parameters(), lr=0.1), "SGD"), (model, "Linear")):
        with pytest.raises(TypeError, match=f"dequantized_8bit: {what} is not a fastopt optimizer"):
            with ckpt.dequantized_8bit(fastopt.Adafactor(model.parameters()), bad):
                pass
    with pytest.raises(TypeError, match="dequantized_8bit: name the optimizers"):
        with ckpt.dequantized_8bit():
            pass


def test_dequantized_8bit_nests(monkeypatch):
    """An inner `dequantized_8bit` block (a helper that saves within one, called within another) leaves the
    outer one's form in place when it ends, and the optimizer's own form comes back after the outer one."""
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    model, opt = _nbits_side("adamw8bit", 8)
    _run(model, opt, range(2))
    keys = _codes_keys(opt)
    with ckpt.dequantized_8bit(opt):
        with ckpt.dequantized_8bit(opt):
            inner = opt.state_dict()
        outer = opt.state_dict()
    after = opt.state_dict()
    for sd in (inner, outer):
        assert all(isinstance(st[k], dict) and a not in st for st in sd["state"].values() for k, a in keys.items())
    assert all(st[k].dtype == torch.uint8 and a in st for st in after["state"].values() for k, a in keys.items())


# ---- 8-bit and 32-bit state of the same optimizer (nbits, min_8bit_size) --------------------------------------
def _nbits_side(case, bits):
    """(model, optimizer) of the 8-bit `case` with 8-bit state, or with 32-bit state (`TWIN_32`)."""
    name, over = (case, {}) if bits == 8 else TWIN_32[case]
    model = MLP()
    return model, make_opt(name, model, **over)


def _straight(case, bits):
    """The uninterrupted run: its params (by name) and its optimizer."""
    model, opt = _nbits_side(case, bits)
    _run(model, opt, range(STEPS))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt


def _settings(opt):
    return [{k: g.get(k) for k in opt._layout_keys} for g in opt.param_groups]


def _codes_keys(opt):
    """The codes' keys of every 8-bit state of `opt`, with their absmax keys."""
    return {key: akey for g in opt.param_groups for key, (akey, _s, _b) in opt._quantized_keys(g).items()
            if any(akey in opt.state[p] for p in g["params"])}


def _dcp_load_into(src_model, src_opt, model, opt, path):
    """`src_opt` saved with DCP, loaded into a deep copy of `opt`'s template (one process; the template holds
    `opt`'s own state tensors, which a refused load must leave as they were): the filled copy."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    dcp.save({"optim": get_optimizer_state_dict(src_model, src_opt)}, checkpoint_id=path, no_dist=True)
    sd = {"optim": copy.deepcopy(get_optimizer_state_dict(model, opt))}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    return sd["optim"]


@pytest.mark.parametrize("case", sorted(EIGHT_BIT))
def test_dcp_between_8bit_and_32bit_state_refuses_or_resumes(case, tmp_path, monkeypatch):
    """DCP from an optimizer with 8-bit state into the template of the same optimizer with 32-bit state: the
    codes' key is the 32-bit state's, so DCP casts the codes into the float template, and it fills the groups
    from the checkpoint's (nbits=8 ...), but the absmax is not in that template: load_state_dict refuses,
    naming the key and the settings, and changes nothing (it used to requantize the codes 0..255 as moments,
    with absmax 255). The other way DCP misses the absmax itself. Built with the checkpoint's settings, as the
    error says, the loading optimizer resumes bit for bit. Zero codes are codes too once a step has set the
    absmax (the signed map's code 0 is its lowest value); a fresh checkpoint (zero codes, absmax 0, step 0)
    loads into the 32-bit template as the zero state it is."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    for saved, other in ((8, 32), (32, 8)):
        final, _ = _straight(case, saved)
        src_model, src_opt = _nbits_side(case, saved)
        _run(src_model, src_opt, range(HALF))
        mid = copy.deepcopy(src_model.state_dict())
        model, opt = _nbits_side(case, other)
        _run(model, opt, range(1))
        before = _snapshot(opt)
        path = str(tmp_path / f"from{saved}")
        if saved == 8:
            sd = _dcp_load_into(src_model, src_opt, model, opt, path)
            with pytest.raises(ValueError, match=r"\['(state1|exp_avg)'\] holds whole numbers from 0 to 255 and no "
                               r"'(absmax1|exp_avg_absmax)'.*param_groups have (nbits=8|min_8bit_size=0).*build the "
                               "loading optimizer with the checkpoint's settings"):
                set_optimizer_state_dict(model, opt, sd)
        else:
            with pytest.raises(CheckpointException, match="Missing key in checkpoint.*absmax"):
                _dcp_load_into(src_model, src_opt, model, opt, path)
        assert _same(before, _snapshot(opt)), f"{case}: {saved}-bit -> {other}-bit changed the optimizer"
        model, opt = _nbits_side(case, saved)  # the checkpoint's settings
        model.load_state_dict(mid)
        set_optimizer_state_dict(model, opt, _dcp_load_into(src_model, src_opt, model, opt, path + "same"))
        _run(model, opt, range(HALF, STEPS))
        assert all(torch.equal(p, final[n]) for n, p in model.named_parameters()), (case, saved)

    # Every code 0 (the signed map's lowest value times the absmax: a valid state) after a step: refused.
    src_model, src_opt = _nbits_side(case, 8)
    _run(src_model, src_opt, range(HALF))
    for st in src_opt.state.values():
        for key in _codes_keys(src_opt):
            if key in st:
                st[key].zero_()
    model, opt = _nbits_side(case, 32)
    sd = _dcp_load_into(src_model, src_opt, model, opt, str(tmp_path / "zero_codes"))
    with pytest.raises(ValueError, match="holds whole numbers from 0 to 255"):
        set_optimizer_state_dict(model, opt, sd)
    # A fresh 8-bit optimizer's checkpoint: zeros, read as zeros; the run is the 8-bit one from the start.
    final, _ = _straight(case, 8)
    src_model, src_opt = _nbits_side(case, 8)
    model, opt = _nbits_side(case, 32)
    set_optimizer_state_dict(model, opt, _dcp_load_into(src_model, src_opt, model, opt, str(tmp_path / "fresh")))
    assert _settings(opt) == _settings(src_opt)
    _run(model, opt, range(STEPS))
    assert all(torch.equal(p, final[n]) for n, p in model.named_parameters()), case


@pytest.mark.parametrize("case", sorted(EIGHT_BIT))
def test_plain_state_dict_between_8bit_and_32bit_state_takes_the_saved_settings(case, monkeypatch):
    """load_state_dict takes a state_dict's param groups, as torch's does, the 8-bit settings (nbits,
    min_8bit_size, block_size) included: an optimizer built with 32-bit state loads an 8-bit one's codes and
    absmax as they are and goes on as that optimizer, bit for bit, and the other way round."""
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    for saved, other in ((8, 32), (32, 8)):
        final, s_opt = _straight(case, saved)
        src_model, src_opt = _nbits_side(case, saved)
        _run(src_model, src_opt, range(HALF))
        model, opt = _nbits_side(case, other)
        assert _settings(opt) != _settings(src_opt)
        model.load_state_dict(src_model.state_dict())
        opt.load_state_dict(save_load(src_opt.state_dict()))
        assert _settings(opt) == _settings(src_opt)
        _run(model, opt, range(HALF, STEPS))
        assert all(torch.equal(p, final[n]) for n, p in model.named_parameters()), (case, saved)
        assert _equal_sd(opt.state_dict(), s_opt.state_dict()), (case, saved)


@pytest.mark.parametrize("case", sorted(EIGHT_BIT))
def test_dequantized_form_of_zero_moments_loads_into_32bit_state(case, monkeypatch):
    """The dequantized form (`{<key>: {"fp32": values}}`: DTensor params, `dequantized_8bit`) holds values
    whatever they are, never cast codes: moments that are all zero after steps (a param whose gradient stayed
    zero) load into an optimizer built with 32-bit state, with the saved settings, as zeros."""
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    src_model, src_opt = _nbits_side(case, 8)
    _run(src_model, src_opt, range(HALF))
    with ckpt.dequantized_8bit(src_opt):
        sd = src_opt.state_dict()
    zeroed = 0
    for st in sd["state"].values():
        for k, v in st.items():
            if isinstance(v, dict):
                st[k] = {ckpt.DEQUANTIZED: torch.zeros_like(v[ckpt.DEQUANTIZED])}
                zeroed += 1
    assert zeroed and all(float(st["step"]) > 0 for st in sd["state"].values())
    model, opt = _nbits_side(case, 32)
    opt.load_state_dict(save_load(sd))
    with ckpt.dequantized_8bit(opt):
        assert _equal_sd(opt.state_dict(), sd), case


@pytest.mark.parametrize("case", sorted(EIGHT_BIT))
def test_dequantized_state_under_the_codes_key_still_loads(case, tmp_path, monkeypatch):
    """fp32 values under the codes' key without the absmax (older fastopt state_dicts of DTensor params or
    within dequantized_8bit; came-pytorch) are values, not codes, into the optimizer with 32-bit state too,
    plain or through DCP: requantized in the same blocks, the very codes and absmax saved. Whole numbers
    there are values too when the optimizer itself keeps 8-bit state under these settings (DCP would have
    asked for the absmax, so it cannot have cast codes)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    src_model, src_opt = _nbits_side(case, 8)
    _run(src_model, src_opt, range(HALF))

    def older(sd):  # the dequantized values unnested, straight under the codes' key
        return {**sd, "state": {i: {k: (v[ckpt.DEQUANTIZED] if isinstance(v, dict) else v) for k, v in st.items()}
                                for i, st in sd["state"].items()}}
    with ckpt.dequantized_8bit(src_opt):
        sd, osd = older(src_opt.state_dict()), older(get_optimizer_state_dict(src_model, src_opt))
    assert any(k in st and st[k].dtype == torch.float32 for st in sd["state"].values() for k in _codes_keys(src_opt))
    model, opt = _nbits_side(case, 32)
    opt.load_state_dict(save_load(sd))
    assert _equal_sd(opt.state_dict(), src_opt.state_dict()), case
    import torch.distributed.checkpoint as dcp
    model, opt = _nbits_side(case, 32)
    path = str(tmp_path / "older")
    dcp.save({"optim": osd}, checkpoint_id=path, no_dist=True)
    template = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(template, checkpoint_id=path, no_dist=True)
    set_optimizer_state_dict(model, opt, template["optim"])
    assert _equal_sd(opt.state_dict(), src_opt.state_dict()), case

    whole = copy.deepcopy(sd)
    for st in whole["state"].values():
        for k in _codes_keys(src_opt):
            if k in st:
                st[k] = torch.full_like(st[k], 2.0)
    model, opt = _nbits_side(case, 8)
    opt.load_state_dict(whole)
    params = [(p, g) for g in opt.param_groups for p in g["params"]]  # the state_dict's ids
    checked = 0
    for i, st in whole["state"].items():
        p, g = params[i]
        for k, (a, signed, block) in opt._quantized_keys(g).items():
            if a in opt.state[p]:
                back = fastopt.dequantize_blockwise(opt.state[p][k], opt.state[p][a], block, signed)
                assert torch.equal(back.view_as(st[k]), st[k]), (case, i, k)
                checked += 1
    assert checked, case


@pytest.mark.parametrize("case", sorted(EIGHT_BIT))
def test_whole_numbers_that_cannot_be_codes_load_into_32bit_state(case, monkeypatch):
    """fp32 values under the codes' key without the absmax, into the optimizer with 32-bit state (where DCP casts
    8-bit codes): only whole numbers from 0 to 255 may be codes, and all zeros only under the signed map after a
    step. Negative whole numbers (signed states), 256, and the zeros of an unsigned state after steps load as
    values (the requantized state gives them back); the codes of an unsigned state, up to its 255, are refused,
    naming it. Into an optimizer whose state is 8-bit under other settings (block_size 128: its template asks for
    the codes and their absmax, so DCP cannot have cast them) the same whole numbers load as values."""
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    src_model, src_opt = _nbits_side(case, 8)
    _run(src_model, src_opt, range(HALF))
    with ckpt.dequantized_8bit(src_opt):
        dq = src_opt.state_dict()
    codes_sd = src_opt.state_dict()
    older = {**dq, "state": {i: {k: (v[ckpt.DEQUANTIZED] if isinstance(v, dict) else v) for k, v in st.items()}
                             for i, st in dq["state"].items()}}
    kinds = {k: signed for g in src_opt.param_groups for k, (a, signed, _b) in src_opt._quantized_keys(g).items()
             if any(a in src_opt.state[p] for p in g["params"])}

    def edited(fill):  # `older` with fill(key, signed, values) under each codes' key (None: as it is)
        sd = copy.deepcopy(older)
        for st in sd["state"].values():
            for k, signed in kinds.items():
                if k in st:
                    new = fill(k, signed, st[k])
                    st[k] = st[k] if new is None else new
        return sd
    variants = [("negative", edited(lambda k, s, v: torch.full_like(v, -3.0) if s else None)),
                ("256", edited(lambda k, s, v: torch.full_like(v, 256.0)))]
    if not all(kinds.values()):
        variants.append(("unsigned zeros", edited(lambda k, s, v: None if s else torch.zeros_like(v))))
    for what, sd in variants:
        assert all(float(st["step"]) > 0 for st in sd["state"].values())
        model, opt = _nbits_side(case, 32)
        opt.load_state_dict(save_load(sd))
        ps = [(q, g) for g in opt.param_groups for q in g["params"]]
        checked = 0
        for i, st in sd["state"].items():
            q, g = ps[i]
            for k, (a, signed, block) in opt._quantized_keys(g).items():
                if k in st and a in opt.state[q]:
                    back = fastopt.dequantize_blockwise(opt.state[q][k], opt.state[q][a], block, signed)
                    assert torch.equal(back.view_as(st[k]), st[k]), (case, what, i, k)
                    checked += 1
        assert checked, (case, what)
    for k, signed in kinds.items():
        if signed:
            continue
        sd = copy.deepcopy(older)
        cast = 0
        for i, st in sd["state"].items():
            if k in st:
                st[k] = codes_sd["state"][i][k].float().view_as(st[k])
                cast += int((st[k] == 255).any())
        assert cast, (case, k)
        model, opt = _nbits_side(case, 32)
        before = _snapshot(opt)
        with pytest.raises(ValueError, match=rf"\[{k!r}\] holds whole numbers from 0 to 255 and no"):
            opt.load_state_dict(save_load(sd))
        assert _same(before, _snapshot(opt)), (case, k)
        if "block_size" in opt._layout_keys:
            opt = make_opt(case, MLP(), block_size=128)
            opt.load_state_dict(save_load(sd))
            ps = [q for g in opt.param_groups for q in g["params"]]
            akey = next(a for g in opt.param_groups for key, (a, _s, _b) in opt._quantized_keys(g).items()
                        if key == k)
            assert all(akey in opt.state[ps[i]] for i, st in sd["state"].items() if k in st), (case, k)


# ---- interoperability ----------------------------------------------------------------------------------------
def test_loads_transformers_adafactor_state_and_continues():
    transformers = pytest.importorskip("transformers")
    from conftest import TOL
    kw = dict(beta1=0.9, weight_decay=0.01, scale_parameter=True, relative_step=True, warmup_init=False)
    theirs_model, ours_model = MLP(), MLP()
    theirs = transformers.optimization.Adafactor(theirs_model.parameters(), lr=None, **kw)
    _run(theirs_model, theirs, range(HALF))
    ours_model.load_state_dict(theirs_model.state_dict())
    mid = {n: p.detach().clone() for n, p in ours_model.named_parameters()}
    ours = fastopt.Adafactor(ours_model.parameters(), **kw)
    ours.load_state_dict(save_load(theirs.state_dict()))  # int step, RMS: dropped
    _run(theirs_model, theirs, range(HALF, STEPS))
    _run(ours_model, ours, range(HALF, STEPS))
    err = rel_err({n: p.detach() for n, p in ours_model.named_parameters()},
                  {n: p.detach() for n, p in theirs_model.named_parameters()}, mid)
    assert err <= TOL[DT], err
    sd_t, sd_o = theirs.state_dict(), ours.state_dict()
    for pid, st in sd_t["state"].items():
        for k, v in st.items():
            if k not in ("RMS", "step"):
                assert torch.allclose(sd_o["state"][pid][k], v, rtol=TOL[DT], atol=0), (pid, k)
        assert float(sd_o["state"][pid]["step"]) == st["step"] == STEPS


@pytest.mark.parametrize("name", ["adafactor", "came"])
def test_foreign_state_of_strided_and_empty_params_loads_and_continues(name, backend, device):
    """transformers' and came-pytorch's states are zeros_like(grad): a transposed or channels_last weight's
    take its strides, and the loaded copies are made row-major, as the kernels read them (before, the Triton
    back end stepped them as if they were); an empty param's state (its column factor a mean over no rows:
    NaN) is dropped, as this optimizer keeps none (before, the load was refused). Both back ends, on
    float64 params, 4 steps there and 4 here against 8 there."""
    if name == "adafactor":
        Ref = pytest.importorskip("transformers").optimization.Adafactor
        cls, kw = fastopt.Adafactor, dict(lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.01)
    else:
        Ref = pytest.importorskip("came_pytorch").CAME
        cls, kw = fastopt.CAME, dict(lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(5)
    layouts = [lambda t: t.t().contiguous().t(), lambda t: t.contiguous(memory_format=torch.channels_last),
               lambda t: t, lambda t: t]
    shapes = [(6, 4), (2, 3, 4, 4), (0, 5), (5,)]
    init = [f(torch.randn(s, generator=g, dtype=DT)) for f, s in zip(layouts, shapes)]
    grads = [[f(torch.randn(s, generator=g, dtype=DT)) for f, s in zip(layouts, shapes)] for _ in range(STEPS)]
    assert not init[0].is_contiguous() and not init[1].is_contiguous()

    def feed(opt, params, steps):
        for t in steps:
            for p, gr in zip(params, grads[t]):
                p.grad = gr.to(p.device)  # a copy keeps the strides, as autograd gives a param's grad
            opt.step()

    truth = [p.clone().requires_grad_() for p in init]
    feed(Ref(truth, **kw), truth, range(STEPS))
    theirs = [p.clone().requires_grad_() for p in init]
    ref_opt = Ref(theirs, **kw)
    feed(ref_opt, theirs, range(HALF))
    saved = save_load(ref_opt.state_dict())
    assert not saved["state"][0]["exp_avg"].is_contiguous() and not saved["state"][1]["exp_avg"].is_contiguous()
    assert not torch.isfinite(saved["state"][2]["exp_avg_sq_col"]).all()
    mid = [p.detach().clone() for p in theirs]
    ours = [p.detach().clone().to(device).requires_grad_() for p in theirs]
    opt = cls(ours, **kw)
    opt.load_state_dict(saved)
    assert ours[2] not in opt.state and all(v.is_contiguous() for i in (0, 1, 3) for v in opt.state[ours[i]].values())
    feed(opt, ours, range(HALF, STEPS))
    keep = [0, 1, 3]
    err = rel_err({i: ours[i].detach().cpu() for i in keep}, {i: truth[i].detach() for i in keep},
                  {i: mid[i] for i in keep})
    assert err <= TOL[DT], err
    assert float(opt.state[ours[0]]["step"]) == STEPS


def test_loads_bitsandbytes_adamw8bit_state_same_codes():
    bnb = pytest.importorskip("bitsandbytes")
    kw = dict(lr=1e-2, betas=(0.9, 0.995), eps=1e-8, weight_decay=0.01)
    model = torch.nn.Linear(48, 96, dtype=torch.float32)  # weight: 4608 elements >= min_8bit_size, 18 blocks
    theirs = bnb.optim.AdamW8bit(model.parameters(), **kw)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        theirs.step()
    saved = save_load(theirs.state_dict())
    ours = fastopt.AdamW8bit(model.parameters(), **kw)
    ours.load_state_dict(saved)
    quant = {k: v for k, v in theirs.state_dict()["state"][0]["__bnb_optimizer_quant_state__"].items()
             if not k.startswith("qmap")}
    st = ours.state[model.weight]
    assert sorted(st) == ["absmax1", "absmax2", "state1", "state2", "step"] and float(st["step"]) == 3
    for k, v in quant.items():
        assert torch.equal(st[k], v), k
    small = ours.state[model.bias]  # 96 elements: 32-bit state in both
    assert small["state1"].dtype == torch.float32 and torch.equal(
        small["state1"], theirs.state_dict()["state"][1]["__bnb_optimizer_quant_state__"]["state1"])
    bad = copy.deepcopy(saved)
    bad["state"][0]["__bnb_optimizer_quant_state__"]["qmap1"][5] += 0.01
    before = _snapshot(ours)
    with pytest.raises(ValueError, match="qmap1"):
        ours.load_state_dict(bad)
    assert _same(before, _snapshot(ours))


def test_bitsandbytes_state_takes_its_hyperparameters_and_this_optimizers_layout_and_continues():
    """bitsandbytes' AdamW8bit state_dict (fp32 Linear, 3 steps, hyperparameters other than this optimizer's)
    loads with bitsandbytes' lr, betas, eps and weight_decay (its AdEMAMix keys alpha, t_alpha, t_beta3 dropped)
    and this optimizer's block_size and min_8bit_size: under min_8bit_size=0 the bias's fp32 state becomes 8-bit
    here. Refused, naming what does not fit, and leaving the optimizer as it was: blocks of 64 here (bitsandbytes'
    are 256); a min_8bit_size above the weight's size (its codes have no place in 32-bit state); bitsandbytes'
    params in two groups, one here; torch.optim.SGD's state_dict (neither bitsandbytes' nor ours: named by the keys
    it lacks), and torch.optim's AdamW, Adam, NAdam and RAdam before their first step (every key bitsandbytes' groups
    have, and flags of their own: maximize=True would have loaded and been ignored); bitsandbytes' own before its
    first step loads. Loaded into the default layout, 20 more steps track float64 torch.optim.AdamW, started from
    bitsandbytes' dequantized moments at step 3, no worse than bitsandbytes' own continued run (the 8-bit weight,
    within NOISE of test_adamw8bit.py) and within TOL[float32] (the fp32-state bias)."""
    bnb = pytest.importorskip("bitsandbytes")
    kw = dict(lr=2e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    model = torch.nn.Linear(48, 96, dtype=torch.float32)  # weight: 4608 elements, 18 blocks of 256; bias: 96
    g = torch.Generator().manual_seed(5)

    def set_grads(*params_lists):
        for ps in zip(*params_lists):
            grad = torch.randn(ps[0].shape, generator=g, dtype=torch.float64)
            for p in ps:
                p.grad = grad.to(p.dtype)

    def copies(dtype=torch.float32):
        return [torch.nn.Parameter(p.detach().to(dtype, copy=True)) for p in model.parameters()]

    theirs = bnb.optim.AdamW8bit(model.parameters(), **kw)
    for _ in range(3):
        set_grads(list(model.parameters()))
        theirs.step()
    saved = save_load(theirs.state_dict())
    assert {"alpha", "t_alpha", "t_beta3"} <= set(saved["param_groups"][0])
    bias_state = saved["state"][1]["__bnb_optimizer_quant_state__"]
    ours = fastopt.AdamW8bit(copies(), min_8bit_size=0)
    ours.load_state_dict(saved)
    assert {k: v for k, v in ours.param_groups[0].items() if k != "params"} == {
        **kw, "block_size": 256, "min_8bit_size": 0}
    st = ours.state[ours.param_groups[0]["params"][1]]
    for k, signed in (("1", True), ("2", False)):
        codes, absmax = fastopt.quantize_blockwise(bias_state["state" + k], 256, signed=signed)
        assert torch.equal(st["state" + k], codes) and torch.equal(st["absmax" + k], absmax), k

    check_foreign_group_count_refused(bnb.optim.AdamW8bit, fastopt.AdamW8bit, **kw)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    refused = [
        ({"block_size": 64}, saved, r"state[0]['absmax1'] has shape (18,), expected (72,)"),
        ({"min_8bit_size": 10**9}, saved, "state[0] has keys ['absmax1', 'absmax2', 'state1', 'state2', 'step'], "
                                          "expected ['state1', 'state2', 'step'] (missing [], unexpected "
                                          "['absmax1', 'absmax2'])"),
        ({}, sgd.state_dict(), "param_groups[0] lacks ['betas', 'block_size', 'eps', 'min_8bit_size']: "
                               "not an AdamW8bit state_dict"),
    ]
    # torch.optim's Adam family before its first step: every key of bitsandbytes' groups, no state to tell them
    # apart; its flags (maximize=True here, ignored if it loaded) say whose it is.
    for cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.NAdam, torch.optim.RAdam):
        refused.append(({}, cls(copies(), maximize=True, **kw).state_dict(),
                        "param_groups[0] lacks ['block_size', 'min_8bit_size']: not an AdamW8bit state_dict"))
    for over, sd, message in refused:
        params = copies()
        opt = fastopt.AdamW8bit(params, **over)
        set_grads(params)
        opt.step()
        before = _snapshot(opt)
        with pytest.raises(ValueError, match=re.escape(f"AdamW8bit.load_state_dict: {message}")):
            opt.load_state_dict(sd)
        assert _same(before, _snapshot(opt)), over
    # bitsandbytes' own before its first step still loads: its hyperparameters, no state.
    fresh = fastopt.AdamW8bit(copies())
    fresh.load_state_dict(save_load(bnb.optim.AdamW8bit(copies(), **kw).state_dict()))
    assert len(fresh.state) == 0 and {k: v for k, v in fresh.param_groups[0].items() if k != "params"} == {
        **kw, "block_size": 256, "min_8bit_size": 4096}

    # The continued runs, from the params and the state `saved` holds (bitsandbytes' own: loaded back).
    mid = [p.detach().to(torch.float64, copy=True) for p in model.parameters()]
    ours_params, truth_params = copies(), copies(torch.float64)
    theirs = bnb.optim.AdamW8bit(model.parameters(), **kw)
    theirs.load_state_dict(saved)
    ours = fastopt.AdamW8bit(ours_params)
    ours.load_state_dict(saved)
    truth = torch.optim.AdamW(truth_params, **kw)
    for p, i in zip(truth_params, (0, 1)):
        s = saved["state"][i]["__bnb_optimizer_quant_state__"]
        m, v = s["state1"].double(), s["state2"].double()
        if "absmax1" in s:
            m = fastopt.dequantize_blockwise(s["state1"], s["absmax1"], 256, signed=True).double()
            v = fastopt.dequantize_blockwise(s["state2"], s["absmax2"], 256, signed=False).double()
        truth.state[p] = {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}
    for _ in range(20):
        set_grads(list(model.parameters()), ours_params, truth_params)
        for opt in (theirs, ours, truth):
            opt.step()
    assert float(ours.state[ours_params[0]]["step"]) == 23
    err = {name: rel_err({"w": ps[0].detach()}, {"w": truth_params[0].detach()}, {"w": mid[0]})
           for name, ps in (("ours", ours_params), ("bnb", list(model.parameters())))}
    assert err["ours"] <= 1.01 * err["bnb"], err
    assert rel_err({"b": ours_params[1].detach()}, {"b": truth_params[1].detach()}, {"b": mid[1]}) <= TOL[torch.float32]


def test_loads_came_pytorch_state_into_8bit_came():
    """came-pytorch's fp32 momentum is the dequantized form: it requantizes into this CAME's 8-bit blocks
    (each value within half a step of its block), the factors load as they are, and the runs stay together."""
    came_pytorch = pytest.importorskip("came_pytorch")
    from fastopt.reference.came import QBLOCK
    from fastopt.reference.quant import dynamic_map
    kw = dict(lr=1e-2, weight_decay=0.01)
    theirs_model, ours_model, twin_model = MLP(), MLP(), MLP()
    theirs = came_pytorch.CAME(theirs_model.parameters(), **kw)
    _run(theirs_model, theirs, range(HALF))
    for m in (ours_model, twin_model):
        m.load_state_dict(theirs_model.state_dict())
    mid = {n: p.detach().clone() for n, p in ours_model.named_parameters()}
    ours = fastopt.CAME(ours_model.parameters(), nbits=8, **kw)
    twin = fastopt.CAME(twin_model.parameters(), nbits=32, **kw)  # the yardstick: the same load, 32-bit
    saved = save_load(theirs.state_dict())
    ours.load_state_dict(saved)
    twin.load_state_dict(saved)
    m = dynamic_map(True)
    step = torch.cat([m.diff() / 2, 1 + m[:1]]).max()
    for p, st in zip(ours_model.parameters(), saved["state"].values()):
        mine = ours.state[p]
        back = fastopt.dequantize_blockwise(mine["exp_avg"], mine["exp_avg_absmax"], QBLOCK)
        scale = mine["exp_avg_absmax"].repeat_interleave(QBLOCK)[: back.numel()].view_as(back)
        assert ((back - st["exp_avg"].float()).abs() <= step * scale * (1 + 1e-5)).all()
        for k in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col", "exp_avg_sq"):
            if k in st:
                assert torch.equal(mine[k], st[k]), k
    _run(theirs_model, theirs, range(HALF, STEPS))
    _run(ours_model, ours, range(HALF, STEPS))
    _run(twin_model, twin, range(HALF, STEPS))
    params = lambda model: {n: p.detach() for n, p in model.named_parameters()}  # noqa: E731
    assert rel_err(params(twin_model), params(theirs_model), mid) <= 1e-9
    assert rel_err(params(ours_model), params(theirs_model), mid) <= 0.03  # 8-bit momentum; measured 0.0089


# ---- 8-bit state between plain params (DDP) and DTensor params (FSDP2, TP) ----------------------------------
def _dcp_8bit_case(rank, world, case, path):
    """DDP (every rank the whole model, the same averaged gradients) saves HALF steps of 8-bit state with DCP;
    FSDP2 and TP resume from it. The codes form (saved as is) fails loudly, naming the dequantized key the
    template asks for; saved within `dequantized_8bit` it resumes within the 8-bit noise; the plain state_dict
    (codes of whole tensors) loads directly. And the reverse: FSDP2's checkpoint into DDP's template."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    os.environ["FASTOPT_BACKEND"] = "torch"
    ref = MLP()
    ref_opt = make_opt(case, ref)
    train(ref, ref_opt, range(HALF))
    mid, mid_state = full_params(ref), {k: v.clone() for k, v in ref.state_dict().items()}
    plain_sd = copy.deepcopy(ref_opt.state_dict())  # codes + absmax of whole tensors
    train(ref, ref_opt, range(HALF, STEPS))
    final = full_params(ref)
    twin = MLP()
    twin_case, over = TWIN_32[case]
    twin_opt = make_opt(twin_case, twin, **over)
    train(twin, twin_opt, range(STEPS))
    out = {"noise": rel_err(full_params(twin), final, mid)}

    ddp = MLP()
    ddp_opt = make_opt(case, ddp)
    train(ddp, ddp_opt, range(HALF))
    codes, fp32 = os.path.join(path, "codes"), os.path.join(path, "fp32")
    dcp.save({"model": get_model_state_dict(ddp), "optim": get_optimizer_state_dict(ddp, ddp_opt)},
             checkpoint_id=codes)
    with ckpt.dequantized_8bit(ddp_opt):
        dcp.save({"model": get_model_state_dict(ddp), "optim": get_optimizer_state_dict(ddp, ddp_opt)},
                 checkpoint_id=fp32)
    for target in ("fsdp", "tp"):
        model = build(target)
        opt = make_opt(case, model)
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        with pytest.raises(CheckpointException, match="Missing key in checkpoint.*\\.fp32"):
            dcp.load(sd, checkpoint_id=codes)
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=fp32)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        train(model, opt, range(HALF, STEPS))
        out[target] = rel_err(full_params(model), final, mid)
        # The plain state_dict of the single process (torch.save's), codes and all, straight into load_state_dict.
        model = build(target)
        opt = make_opt(case, model)
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, checkpoint_id=fp32)
        set_model_state_dict(model, sd["model"])
        opt.load_state_dict(copy.deepcopy(plain_sd))
        train(model, opt, range(HALF, STEPS))
        out[target + "_plain_sd"] = rel_err(full_params(model), final, mid)

    # The reverse: FSDP2 saves (dequantized form); DDP's plain template misses the codes' keys, and within
    # dequantized_8bit it loads.
    fsdp = build("fsdp")
    fsdp_opt = make_opt(case, fsdp)
    train(fsdp, fsdp_opt, range(HALF))
    back = os.path.join(path, "fsdp")
    dcp.save({"optim": get_optimizer_state_dict(fsdp, fsdp_opt)}, checkpoint_id=back)
    model = MLP()
    model.load_state_dict(mid_state)
    opt = make_opt(case, model)
    sd = {"optim": get_optimizer_state_dict(model, opt)}
    with pytest.raises(CheckpointException, match="Missing key in checkpoint"):
        dcp.load(sd, checkpoint_id=back)
    with ckpt.dequantized_8bit(opt):
        sd = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=back)
    set_optimizer_state_dict(model, opt, sd["optim"])
    train(model, opt, range(HALF, STEPS))
    out["fsdp_to_ddp"] = rel_err(full_params(model), final, mid)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(EIGHT_BIT))
def test_dcp_8bit_ddp_to_fsdp_and_tp(pool, shared_dir, case):
    for rank, res in enumerate(pool.run(_dcp_8bit_case, case, shared_dir)):
        for k in ("fsdp", "tp", "fsdp_plain_sd", "tp_plain_sd", "fsdp_to_ddp"):
            # within the 8-bit noise itself (8-bit vs 32-bit state over the same run); codes copied into the
            # fp32 template were 3.9 of the update away
            assert res[k] <= res["noise"], (case, rank, k, res[k], res["noise"])


def _dcp_codes_into_fsdp_32bit_case(rank, world, case, path):
    """DDP's 8-bit codes (plain params, the same on every rank) saved with DCP, loaded into the template of
    FSDP2 params with 32-bit state: DCP casts the codes into the DTensor template and each rank checks its
    piece; every rank refuses and none changes (the template a deep copy, as the README advises)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    os.environ["FASTOPT_BACKEND"] = "torch"
    ddp, ddp_opt = _nbits_side(case, 8)
    train(ddp, ddp_opt, range(HALF))
    dcp.save({"optim": get_optimizer_state_dict(ddp, ddp_opt)}, checkpoint_id=path)
    model = build("fsdp")
    twin_case, over = TWIN_32[case]
    opt = make_opt(twin_case, model, **over)
    train(model, opt, range(1))
    before = _snapshot(opt)
    sd = {"optim": copy.deepcopy(get_optimizer_state_dict(model, opt))}
    dcp.load(sd, checkpoint_id=path)
    error = None
    try:
        set_optimizer_state_dict(model, opt, sd["optim"])
    except ValueError as e:
        error = str(e)
    return dict(error=error, unchanged=_same(before, _snapshot(opt)))


@pytest.mark.dist
@pytest.mark.parametrize("case", ["adamw8bit", "galore_8bit"])
def test_dcp_8bit_codes_into_fsdp_32bit_template_fail_on_every_rank(pool, shared_dir, case):
    for rank, res in enumerate(pool.run(_dcp_codes_into_fsdp_32bit_case, case, os.path.join(shared_dir, case))):
        assert res["error"] is not None and "holds whole numbers from 0 to 255" in res["error"], (rank, res)
        assert res["unchanged"], rank


# ---- load_state_dict agrees over the ranks that share the params, never the world -------------------------
def _submesh_case(rank, world):
    """Two independent 2-rank meshes ({0, 1}, {2, 3}) in a 4-rank world, and pieces declared over {0, 1} /
    {2, 3}: ranks 2, 3 load a second optimizer (another stage's model) that ranks 0, 1 never load, which must
    not hang; a non-finite value in rank 1's piece is refused on ranks 0 and 1, and only there."""
    from fastopt.distributed import declare_shard
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    os.environ["FASTOPT_BACKEND"] = "torch"
    meshes = [DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])]  # every rank builds every mesh
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh, half = meshes[rank // 2], halves[rank // 2]
    g = torch.Generator().manual_seed(0)

    def build():
        p = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4, generator=g), mesh, [Shard(0)]))
        q = declare_shard(torch.nn.Parameter(torch.randn(3, 5, generator=g)), (6, 5), half, dim=0)
        opt = fastopt.Lamb([p, q], lr=1e-2)
        p.grad = distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])
        q.grad = torch.ones(3, 5)
        opt.step()
        return opt
    out = {}
    opt = build()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    if rank >= 2:
        other = build()
        other.load_state_dict(copy.deepcopy(other.state_dict()))
    before = _snapshot(opt)
    sd = copy.deepcopy(opt.state_dict())
    if rank == 1:
        sd["state"][1]["exp_avg"][0, 0] = float("nan")  # the declared piece: plain local state
    _nan_refused_on_ranks_0_1(opt, sd, 1, rank, before, out)
    # A state missing on one rank of a param's group (the declared piece's), or from another step there (the
    # DTensor's): that rank would restart its piece, or step it apart, silently. Refused there, and only there.
    for pid, edit in ((1, lambda st: st.pop(1)), (0, lambda st: st[0].update(step=torch.tensor(5.0)))):
        sd = copy.deepcopy(opt.state_dict())
        if rank == 1:
            edit(sd["state"])
        if rank < 2:
            with pytest.raises(ValueError, match=rf"state\[{pid}\] holds (no state|the state of step [15]) here and "
                               r"(no state|the state of step [15]) on rank [01], which shares this param"):
                opt.load_state_dict(sd)
            out[f"unchanged_{pid}"] = _same(before, _snapshot(opt))
        else:
            opt.load_state_dict(sd)
    dist.barrier()
    return out


@pytest.mark.dist
def test_load_state_dict_agrees_over_the_params_groups_only(pool):
    results = pool.run(_submesh_case)  # the pool's timeout turns a hang into a failure
    want = {"unchanged": True, "unchanged_0": True, "unchanged_1": True}
    assert results[0] == results[1] == want and results[2] == results[3] == {}, results


def _nan_refused_on_ranks_0_1(opt, sd, pid, rank, before, out):
    """`sd`, with a NaN in rank 1's piece of state[pid]['exp_avg'] (a param shared by ranks 0 and 1 alone), is
    refused on ranks 0 and 1 (named as rank 1's on rank 0), which stay as `before` (out["unchanged"]); ranks 2 and
    3 load it."""
    if rank < 2:
        with pytest.raises(ValueError, match=rf"state\[{pid}\]\['exp_avg'\] holds non-finite" +
                           ("" if rank == 1 else r".*on rank 1")):
            opt.load_state_dict(sd)
        out["unchanged"] = _same(before, _snapshot(opt))
    else:
        opt.load_state_dict(sd)


def _outside_mesh_case(rank, world):
    """A matrix sharded over a mesh of ranks {0, 1} alone (every rank builds it, as torch requires) and a plain
    matrix, in a 4-rank world: ranks 2, 3 hold nothing of the DTensor and no group of its mesh. The state_dict of
    HALF steps loads into a new optimizer on every rank and the run resumes as the uninterrupted one of a single
    process; a non-finite value in rank 1's piece is refused on ranks 0 and 1 (named as rank 1's on rank 0), and
    nothing changes there, while ranks 2, 3 load theirs."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    os.environ["FASTOPT_BACKEND"] = "torch"
    sub = DeviceMesh("cpu", [0, 1])
    g = torch.Generator().manual_seed(0)
    init = {"a": torch.randn(8, 6, generator=g, dtype=DT), "b": torch.randn(3, 5, generator=g, dtype=DT)}

    def module(sharded):
        m = torch.nn.Module()
        for n, v in init.items():
            t = distribute_tensor(v.clone(), sub, [Shard(0)], src_data_rank=None) if sharded and n == "a" else v.clone()
            m.register_parameter(n, torch.nn.Parameter(t))
        return m

    def run(m, opt, steps):
        step_fresh(opt, list(m.parameters()), steps)
    ref = module(False)
    ref_opt = make_opt("lamb", ref)
    run(ref, ref_opt, range(HALF))
    mid = full_params(ref)
    run(ref, ref_opt, range(HALF, STEPS))
    first = module(True)
    first_opt = make_opt("lamb", first)
    run(first, first_opt, range(HALF))
    sd = copy.deepcopy(first_opt.state_dict())
    model = module(True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(getattr(first, n))  # nothing to copy on ranks 2, 3: their pieces of `a` are empty
    opt = make_opt("lamb", model)
    opt.load_state_dict(copy.deepcopy(sd))
    out = {}
    before = _snapshot(opt)
    bad = copy.deepcopy(sd)
    if rank == 1:
        a = bad["state"][0]["exp_avg"]
        piece = a.to_local().clone()
        piece[0, 0] = float("nan")
        bad["state"][0]["exp_avg"] = DTensor.from_local(piece, sub, a.placements, run_check=False, shape=a.shape,
                                                        stride=a.stride())
    _nan_refused_on_ranks_0_1(opt, bad, 0, rank, before, out)
    run(model, opt, range(HALF, STEPS))
    params = {"b": model.b.detach()}
    if rank < 2:
        params["a"] = model.a.detach().full_tensor()  # a collective over ranks 0, 1 alone
    else:
        assert model.a.to_local().numel() == 0
    out["err"] = rel_err(params, {n: full_params(ref)[n] for n in params}, {n: mid[n] for n in params})
    dist.barrier()
    return out


@pytest.mark.dist
def test_load_state_dict_of_a_dtensor_on_a_mesh_without_this_rank(pool):
    results = pool.run(_outside_mesh_case)  # the pool's timeout turns a hang into a failure
    assert [sorted(r) for r in results] == [["err", "unchanged"]] * 2 + [["err"]] * 2, results
    for rank, res in enumerate(results):
        assert res.get("unchanged", True), rank
        assert res["err"] <= TOL[DT], (rank, res["err"])


def _one_rank_refuses_case(rank, world):
    """Two matrices sharded over the 4 ranks; the state_dict's first state is unreadable on rank 1 only (a
    state_dict edited there), which stops that rank's load at it: its verdict, the cause, must be every rank's,
    not a difference in the states the ranks would load (rank 1 has none to compare after the first). Then a
    DTensor state on a mesh of the same ranks in another order (each piece of the param's local shape, holding
    other elements) is refused on every rank, not taken piece by piece."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    os.environ["FASTOPT_BACKEND"] = "torch"
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g, dtype=DT), mesh, [Shard(0)],
                                                   src_data_rank=None)) for s in ((8, 6), (4, 10))]
    opt = fastopt.Lamb(params, lr=1e-2)
    step_fresh(opt, params, range(2))
    before = _snapshot(opt)
    sd = copy.deepcopy(opt.state_dict())
    if rank == 1:
        sd["state"][0]["step"] = "seven"
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(sd)
    out = dict(message=str(info.value), unchanged=_same(before, _snapshot(opt)))
    # A state on a mesh of the same ranks in another order: pieces of the same shape, of other elements.
    other = DeviceMesh("cpu", list(reversed(range(world))))
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg"] = DTensor.from_local(sd["state"][0]["exp_avg"].to_local(), other, [Shard(0)],
                                                   run_check=False)
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(sd)
    out.update(mesh=str(info.value), mesh_unchanged=_same(before, _snapshot(opt)))
    return out


@pytest.mark.dist
def test_refusals_over_a_mesh_name_their_cause_on_every_rank(pool):
    results = pool.run(_one_rank_refuses_case)
    for rank, res in enumerate(results):
        assert res["unchanged"] and res["mesh_unchanged"], rank
        assert re.search(r"state\[0\]\['exp_avg'\] is a DTensor on another device mesh than its param", res["mesh"]), \
            (rank, res["mesh"])
        assert re.search(r"state\[0\]\['step'\] must be a scalar tensor or number, got str" +
                         ("" if rank == 1 else r".* \(on rank 1\)$"), res["message"]), (rank, res["message"])


def _whole_states_case(rank, world):
    """Adafactor (with momentum) over a matrix sharded over the 4 ranks and a plain matrix, after 2 steps. A
    DTensor (replicated, of the right global shape) where a state must be a plain tensor, the same on every rank:
    the row statistic of the sharded param, any state of the plain param (the kernels get it as it is, beside a
    plain grad), the step, is refused on every rank, and nothing changes; the state_dict itself loads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    os.environ["FASTOPT_BACKEND"] = "torch"
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(8, 6, generator=g, dtype=DT), mesh, [Shard(0)],
                                                   src_data_rank=None)),
              torch.nn.Parameter(torch.randn(3, 5, generator=g, dtype=DT))]
    cls_name, kw = CASES["adafactor_momentum"]
    opt = getattr(fastopt, cls_name)(params, **kw)
    step_fresh(opt, params, range(2))
    before = _snapshot(opt)
    out = {}
    for pid, key in ((0, "exp_avg_sq_row"), (0, "step"), (1, "exp_avg_sq_col"), (1, "exp_avg"), (1, "step")):
        sd = copy.deepcopy(opt.state_dict())
        whole = sd["state"][pid][key]
        assert not ckpt.is_dtensor(whole), (pid, key)
        sd["state"][pid][key] = DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
        error = None
        try:
            opt.load_state_dict(sd)
        except ValueError as e:
            error = str(e)
        out[f"{pid}.{key}"] = (error, _same(before, _snapshot(opt)))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    out["loads"] = _same(before, _snapshot(opt))
    return out


@pytest.mark.dist
def test_dtensor_for_a_whole_state_is_refused_unchanged(pool):
    for rank, res in enumerate(pool.run(_whole_states_case)):
        assert res.pop("loads"), rank
        for where, (error, unchanged) in res.items():
            pid, key = where.split(".")
            assert error is not None and re.search(
                rf"state\[{pid}\]\['{key}'\] is a DTensor; this state is a plain tensor", error), (rank, where, error)
            assert unchanged, (rank, where)


def _whole_codes_case(rank, world):
    """The 8-bit codes and absmax of whole tensors (what plain params save) load into the same matrix sharded
    over the 4 ranks and resume (within the 8-bit noise: requantized into each piece's blocks); with one absmax
    block too few or too many (the codes' shape right) they are refused on every rank, naming the state, and
    nothing changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    os.environ["FASTOPT_BACKEND"] = "torch"
    mesh = init_device_mesh("cpu", (world,))
    init = torch.randn(16, 10, generator=torch.Generator().manual_seed(0), dtype=DT)  # 3 blocks of 64

    def run(p, opt, steps):
        step_fresh(opt, [p], steps)
    ref = torch.nn.Parameter(init.clone())
    kw = CASES["adamw8bit"][1]
    ref_opt = fastopt.AdamW8bit([ref], **kw)
    run(ref, ref_opt, range(HALF))
    mid, sd = ref.detach().clone(), copy.deepcopy(ref_opt.state_dict())
    run(ref, ref_opt, range(HALF, STEPS))
    twin = torch.nn.Parameter(init.clone())
    twin_opt = fastopt.AdamW8bit([twin], **{**kw, **TWIN_32["adamw8bit"][1]})  # 32-bit state: the 8-bit noise
    run(twin, twin_opt, range(STEPS))

    def err(p):
        return float((full(p.detach()) - ref.detach()).norm() / (ref.detach() - mid).norm())
    p = torch.nn.Parameter(distribute_tensor(init.clone(), mesh, [Shard(0)], src_data_rank=None))
    opt = fastopt.AdamW8bit([p], **kw)
    run(p, opt, range(1))  # a state of its own, which a refused load must leave as it is
    before = _snapshot(opt)
    out = {}
    for name, edit in (("fewer", lambda a: a[:-1]), ("more", lambda a: torch.cat([a, a[-1:]]))):
        bad = copy.deepcopy(sd)
        assert bad["state"][0]["state2"].dtype == torch.uint8 and bad["state"][0]["absmax2"].numel() == 3
        bad["state"][0]["absmax2"] = edit(bad["state"][0]["absmax2"])
        error = None
        try:
            opt.load_state_dict(bad)
        except ValueError as e:
            error = str(e)
        out[name] = (error, _same(before, _snapshot(opt)))
    p = torch.nn.Parameter(distribute_tensor(mid.clone(), mesh, [Shard(0)], src_data_rank=None))
    opt = fastopt.AdamW8bit([p], **kw)
    opt.load_state_dict(copy.deepcopy(sd))
    run(p, opt, range(HALF, STEPS))
    out.update(err=err(p), noise=err(twin))
    return out


@pytest.mark.dist
def test_whole_8bit_codes_with_other_blocks_into_dtensor_params_are_refused_unchanged(pool):
    for rank, res in enumerate(pool.run(_whole_codes_case)):
        assert res["err"] <= res["noise"], (rank, res["err"], res["noise"])
        for name, blocks in (("fewer", 2), ("more", 4)):
            error, unchanged = res[name]
            assert error is not None and re.search(
                rf"state\[0\]\['state2'\] holds 8-bit codes of shape \(16, 10\) with {blocks} blocks in 'absmax2'; "
                r"for a DTensor param", error), (rank, name, error)
            assert unchanged, (rank, name)


@pytest.mark.parametrize("case, form", [(c, "codes") for c in CASES] + [(c, "dequantized") for c in sorted(EIGHT_BIT)]
                         + [(c, "no_template") for c in CASES])
def test_dcp_flattened_form_resumes(case, form, monkeypatch, tmp_path):
    """torchtitan's StateDictOptions(flatten_optimizer_state_dict=True): DCP rebuilds each param's state from the
    keys the optimizer has, so a fresh optimizer used to load nothing and fail; the zero state its state_dict
    makes (and keeps) gives them, and the run resumes bit for bit. 8-bit states too, as codes or in their
    dequantized form (nested under the codes' key, whose absmax key DCP gives an empty dict). no_template: the
    flattened state_dict kept by torch.save and handed to set_optimizer_state_dict of a fresh optimizer with no
    get_optimizer_state_dict before it; DCP's `_init_optim_state` tests `opt.state`, whose truth test makes the
    zero state (torch's AdamW gets its own from a step at lr=0). Before, no state loaded, silently, and the run
    went on from fresh moments (CAME 0.6 off after 3 steps)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model, twin = MLP(), MLP()
    opt, t_opt = make_opt(case, model), make_opt(case, twin)
    _run(model, opt, range(HALF))
    _run(twin, t_opt, range(HALF))
    form_of = ckpt.dequantized_8bit if form == "dequantized" else lambda o: contextlib.nullcontext()
    with form_of(opt):
        saved = get_optimizer_state_dict(model, opt, options=flat)
        dcp.save({"optim": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    if form == "dequantized":
        assert any(k.endswith(f".{ckpt.DEQUANTIZED}") for k in saved), sorted(saved)
    fresh = MLP()
    fresh.load_state_dict(model.state_dict())
    f_opt = make_opt(case, fresh)
    if form == "no_template":
        assert len(f_opt.state) == 0
        box = {"optim": save_load(saved)}
    else:
        with form_of(f_opt):
            box = {"optim": get_optimizer_state_dict(fresh, f_opt, options=flat)}
        dcp.load(box, checkpoint_id=str(tmp_path), no_dist=True)
    set_optimizer_state_dict(fresh, f_opt, box["optim"], options=flat)
    assert all(float(f_opt.state[p]["step"]) == HALF for p in fresh.parameters())
    _run(fresh, f_opt, range(HALF, STEPS))
    _run(twin, t_opt, range(HALF, STEPS))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), twin.parameters()))
    assert _equal_sd(f_opt.state_dict(), t_opt.state_dict())


@pytest.mark.parametrize("case", ["adafactor", "adamw8bit", "galore_8bit"])
def test_dcp_flattened_form_takes_a_param_without_state(case, monkeypatch, tmp_path):
    """DCP's flattened form gives every trainable param a state, {} for one that has none (a 0-element param
    never gets any): that loads as no state, as torch's load_state_dict takes a param absent from 'state', and
    the run resumes bit for bit. A frozen param in the optimizer gets no state (no zero state from
    state_dict(): all of a frozen model's would be allocated)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    monkeypatch.setenv("FASTOPT_BACKEND", "torch")
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def build():
        model = MLP()
        model.empty = torch.nn.Parameter(torch.zeros(0, 3, dtype=DT))
        model.frozen = torch.nn.Parameter(torch.linspace(-1, 1, 15, dtype=DT).view(3, 5), requires_grad=False)
        opt = make_opt(case, model)
        return model, opt

    (model, opt), (twin, t_opt) = build(), build()
    _run(model, opt, range(HALF))
    _run(twin, t_opt, range(HALF))
    assert model.empty not in opt.state or not opt.state[model.empty]
    dcp.save({"optim": get_optimizer_state_dict(model, opt, options=flat)}, checkpoint_id=str(tmp_path),
             no_dist=True)
    fresh, f_opt = build()
    fresh.load_state_dict(model.state_dict())
    box = {"optim": get_optimizer_state_dict(fresh, f_opt, options=flat)}
    dcp.load(box, checkpoint_id=str(tmp_path), no_dist=True)
    assert not any(k.startswith("state.empty.") for k in box["optim"])  # no state saved for it
    # nor for a frozen param: state_dict() makes zero state for the trainable params alone, as DCP does
    assert not any(k.startswith("state.frozen.") for k in box["optim"])
    assert not opt.state.get(model.frozen) and not f_opt.state.get(fresh.frozen)
    set_optimizer_state_dict(fresh, f_opt, box["optim"], options=flat)
    _run(fresh, f_opt, range(HALF, STEPS))
    _run(twin, t_opt, range(HALF, STEPS))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), twin.parameters()))
    assert _equal_sd(f_opt.state_dict(), t_opt.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_is_isfinite_all_without_full_size_temporaries(dtype):
    """ckpt.all_finite (load_state_dict's check of every float state, GaLore's of a refreshing gradient) is
    torch.isfinite(t).all() on any strides and on empty tensors, and makes no tensor of t's size (isfinite
    makes a copy of t and three bool tensors of its size)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.numels += [t.numel() for t in (out if isinstance(out, (tuple, list)) else (out,))
                            if isinstance(t, torch.Tensor)]
            return out

    torch.manual_seed(0)
    x = torch.randn(64, 48, dtype=dtype).t()  # strided
    assert bool(ckpt.all_finite(torch.empty(0, 3, dtype=dtype)))
    for v in (None, float("nan"), float("inf"), -float("inf")):
        y = x.clone().t().contiguous().t()  # the same strides as x
        if v is not None:
            y[5, 7] = v
        with Sizes() as sizes:
            got = ckpt.all_finite(y)
        assert bool(got) == bool(torch.isfinite(y).all()) == (v is None), v
        assert max(sizes.numels, default=0) <= 1, sizes.numels
