"""A randomized differential test of fastopt's optimizers under the layouts of tests/test_layouts.py against one
process.

A seed draws a run on 4 gloo ranks: a layout (DDP; TP by parallelize_module, Colwise/Rowwise with uneven shards
through replicated activations; FSDP2 `fully_shard` over 4 ranks, one unit or a unit per Linear; FSDP2 + TP on a
2 x 2 mesh; FSDP1 use_orig_params=True, its HYBRID_SHARD and over TP; plain tensors declared by hand with
`declare_shard`, flat ranges over the world or dim shards over the tp pair or the world), a small model with random
dims (odd sizes, dims below the world size, 1-D params, a matrix of 1-3 rows that some ranks hold none of, a 3-D
param), an optimizer that must be exact in float64 (Adafactor with or without beta1, relative_step /
scale_parameter / warmup_init, clip_threshold, weight decay; CAME; Lamb; GaLoreAdamW with a small rank and
update_proj_gap 1-3; AdamW8bit with 32-bit states through min_8bit_size), possibly over 2 param groups with their
own hyperparameters, and 6-10 steps drawn from ordinary operations, applied alike to the single-process reference
(the same model and optimizer on the whole batch, in the same micro-batches): zero_grad through the optimizer or
the model (set_to_none True/False) or none (accumulation across steps), 1-2 micro-batches, a param frozen or
unfrozen on every rank (before the forward or after the backward), a param's grad set to None on every rank before
the step, an lr changed in a group, an LR scheduler's step, GaLore's update_proj_gap and scale changed in a group,
a state_dict() round trip into a new optimizer (the scheduler rebuilt over it), fresh random data each step.

Seeds 3000-4999 (`COLOSSAL`, from a stream of their own: the seeds below draw what they drew before) draw
ColossalAI's declaration as the layout, `opt.setup_distributed(tp_group, dp_group, shard_to_working_param,
padding_map, is_zero)` as its LowLevelZeroPlugin and HybridParallelPlugin call it (`_Colossal`): a tp x dp mesh of
2 x 2, 1 x 4 (tp_group None, or a group of one) or 4 x 1 (at times without ZeRO and tp: LowLevelZeroPlugin on one
process, which passes is_zero=False with flattened masters); each param's working tensor whole or a d_tensor sharded
along a dim over tp (torch.chunk's rule: uneven, empty on some ranks); with is_zero, masters that are each rank's
equal range of the flattened working tensor, padded at the tail (some ranks hold padding only), the padding zeros
(ColossalAI's) or NaN; without, the working tensors themselves; the dicts in ColossalAI's forms and others; at times
a state_dict() before the declaration and the last param group added after it (`add_param_group`). Each rank runs
its dp part of the batch; the gradients are averaged over dp. The masters' padding must be left as it was.

From seed 5000 on (AMP_FROM; a stream of its own, drawn after the others: the lower seeds' runs stay as they were),
8 runs in 10 train with a loss scaler (init_scale 2**12, growth_interval 2: the scale grows and backs off within a
run; none under TP alone, see `_draw_amp`): torch.amp.GradScaler around the reference and around DDP and FSDP2
(fastopt's fused path: grad_scale and found_inf handed to step()), FSDP's ShardedGradScaler around FSDP1, its
HYBRID_SHARD and over TP, the pieces declared by hand and FSDP2 + TP (GradScaler's own path: unscale_, then a step
where no rank found an inf). About 1 step in 3 puts an inf, -inf or NaN into the gradient where one rank sees it:
an element of the logits' gradient in one data part's rows (a tensor hook: under DDP and FSDP one rank's own
micro-batch, before the reductions), an element of a param's gradient on one rank before DDP's all-reduce, or an
element of a reduced gradient on the ranks holding it (one rank for a Shard-placed or flat piece; a replica is never
made inconsistent); the reference gets the same element in its whole gradient. 4 steps in 10 call unscale_ before
the step, most of them then a clip (torch's clip_grad_norm_, per mesh under FSDP2 + TP; over the plain pieces for
FSDP1, whose own takes float64 norms in float32, and the declared ones) against torch's clip_grad_norm_ of the
reference's whole gradients. The clip norms, the scales after each step and the steps skipped (no param moved on
any rank) must equal the reference's. Where the run takes GradScaler's own path, the reference unscales first too
(the gradients unscaled in place, as that path leaves them: fastopt's fused step leaves them scaled), and a zero
state it made at a skipped first step (as torch's fused optimizers do) is not compared.

Params are compared after every step (FSDP1: at the end only: summon_full_params between steps with gradients
kept would reset FSDP1's flat gradient on ranks whose shard is all padding), and the states at the end, as
test_layouts compares them (TOL_REL, TOL_STATE). The reference steps on the torch back end; the run on the
back end drawn (torch; from time to time the Triton kernels, when TRITON_INTERPRET=1 is set).

    python tests/test_layouts_fuzz.py FIRST_SEED COUNT [OUT.jsonl]   # many seeds, one line per seed (with the
                                                                      # worst error; with a scaler, the steps
                                                                      # skipped and the scales)
    python tests/test_layouts_fuzz.py --show SEED                     # the drawn run of a seed
    python tests/test_layouts_fuzz.py --one SEED [UPTO] [DROP,...]    # one seed, its first UPTO steps, the
                                                                      # listed ops (step.key) removed
    python tests/test_layouts_fuzz.py --list S1,S2,... [OUT.jsonl]    # these seeds
    python tests/test_layouts_fuzz.py --min SEED                      # a failing seed minimized

TRITON_INTERPRET=1 runs the seeds drawn on the kernels there (else on the torch back end); FUZZ_ONLY=triton runs
those seeds alone; FUZZ_TIMEOUT (s, default 60) bounds a collective.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import sys
import time

import pytest
import torch
import torch.distributed as dist

from test_layouts import TOL_REL, TOL_STATE, _dim_piece, _flat_piece, _loss, _tp_groups

import fastopt

DT = torch.float64
WORLD = 4
MODES = ["ddp", "tp", "fsdp", "fsdp_tp", "fsdp1", "hsdp1", "fsdp1_tp", "flat", "explicit"]
FSDP1_MODES = ("fsdp1", "hsdp1", "fsdp1_tp")
BY_HAND = ("flat", "explicit", "colossal")
COLOSSAL = range(3000, 5000)  # seeds that draw ColossalAI's declaration (`setup_distributed`): a stream of their own
OPTS = ["adafactor", "came", "lamb", "galore", "adamw8bit"]
TRITON_OPTS = ("adafactor", "came", "lamb", "galore")
BATCH, SEQ = 8, 3
AMP_FROM = 5000  # seeds from here on: a loss scaler (_draw_amp)
SCALER_ARGS = dict(init_scale=2.0 ** 12, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)


# ---- the model --------------------------------------------------------------------------------------------------
class _Net(torch.nn.Module):
    """Embedding, LayerNorm, an MLP branch a -> b (b's bias drawn), `tiny` (t x d, t of 1-3: rows some ranks
    hold none of), `cube` (k x j x d, or none), LM head."""

    def __init__(self, vocab, d, h, bias_b, t, cube):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.norm = torch.nn.LayerNorm(d)
        self.a = torch.nn.Linear(d, h)
        self.b = torch.nn.Linear(h, d, bias=bias_b)
        self.tiny = torch.nn.Parameter(torch.randn(t, d) * 0.5)
        self.cube = torch.nn.Parameter(torch.randn(*cube, d) * 0.5) if cube else None
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def trunk(self, tok):
        """The model up to its LM head."""
        x = self.emb(tok)
        x = x + self.b(torch.tanh(self.a(self.norm(x))))
        x = x + torch.tanh(x @ self.tiny.t()) @ self.tiny
        if self.cube is not None:
            x = x + 0.3 * torch.tanh(torch.einsum("bsd,kjd->bsj", x, self.cube)).sum(-1, keepdim=True)
        return x

    def forward(self, tok):
        return self.head(self.trunk(tok))


def _build(cfg):
    torch.manual_seed(cfg["seed"])
    m = cfg["model"]
    return _Net(m["vocab"], m["d"], m["h"], m["bias_b"], m["t"], m["cube"]).double()


def _data(cfg, s):
    """Step s's global batch: fresh tokens and targets."""
    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + s)
    v = cfg["model"]["vocab"]
    return torch.randint(0, v, (BATCH, SEQ), generator=g), torch.randint(0, v, (BATCH, SEQ), generator=g)


# ---- drawing a run ----------------------------------------------------------------------------------------------
def _draw_model(rnd, mode):
    tp = {"tp": 4, "fsdp_tp": 2, "fsdp1_tp": 2}.get(mode)
    m = dict(vocab=rnd.choice([5, 7, 9, 11, 13]), d=rnd.choice([3, 4, 5, 6, 7, 9]), h=rnd.choice([2, 3, 5, 6, 8, 10]),
             bias_b=rnd.random() < 0.5, t=rnd.choice([1, 2, 3]),
             cube=rnd.choice([None, [1, 2], [2, 3], [3, 2]]))
    if tp:
        # parallelize_module: the MLP's hidden dim sharded (unevenly: through replicated activations), the embedding
        # and the head over the vocabulary, at times
        m["tp_emb"], m["tp_head"] = rnd.random() < 0.5, rnd.random() < 0.6
        if -(-m["vocab"] // tp) * (tp - 1) >= m["vocab"]:
            # an empty shard of the embedding: torch's DTensor embedding raises there in the forward
            # ("index_select(): self indexing axis dim should be positive"), the other ranks hang
            m["tp_emb"] = False
    return m


def _shapes(m):
    """name -> shape, in the model's parameter order."""
    d, h, v = m["d"], m["h"], m["vocab"]
    out = {"tiny": (m["t"], d)}
    if m["cube"]:
        out["cube"] = (*m["cube"], d)
    out.update({"emb.weight": (v, d), "norm.weight": (d,), "norm.bias": (d,), "a.weight": (h, d), "a.bias": (h,),
           "b.weight": (d, h)})
    if m["bias_b"]:
        out["b.bias"] = (d,)
    out["head.weight"] = (v, d)
    return out


def _draw_opt(rnd, name, shapes):
    """(groups: list of (param names, hyperparameters)) and the constructor's defaults."""
    names = list(shapes)
    o = dict(name=name)
    two = rnd.random() < 0.4
    if name == "adafactor":
        rel = rnd.random() < 0.35
        base = dict(relative_step=rel, scale_parameter=rnd.random() < 0.5,
                    warmup_init=rel and rnd.random() < 0.5, beta1=rnd.choice([None, 0.9, 0.5]),
                    clip_threshold=rnd.choice([1.0, 0.3, 1e3]), weight_decay=rnd.choice([0.0, 0.01, 0.1]),
                    decay_rate=rnd.choice([-0.8, -0.5]))
        if not rel:
            base["lr"] = rnd.choice([1e-2, 3e-3, 3e-2])
        alt = dict(beta1=rnd.choice([None, 0.8]), weight_decay=rnd.choice([0.0, 0.05]),
                   clip_threshold=rnd.choice([1.0, 0.5]))
        if not rel:
            alt["lr"] = base["lr"] * 2
    elif name == "came":
        base = dict(lr=rnd.choice([1e-2, 3e-3]), betas=rnd.choice([(0.9, 0.999, 0.9999), (0.8, 0.99, 0.95)]),
                    clip_threshold=rnd.choice([1.0, 0.3]), weight_decay=rnd.choice([0.0, 0.01]))
        alt = dict(lr=base["lr"] * 3, weight_decay=0.05, betas=(0.5, 0.9, 0.9))
    elif name == "lamb":
        base = dict(lr=rnd.choice([1e-2, 3e-3]), betas=rnd.choice([(0.9, 0.999), (0.8, 0.95)]),
                    weight_decay=rnd.choice([0.0, 0.01, 0.1]), bias_correction=rnd.random() < 0.7,
                    max_trust_ratio=rnd.choice([None, None, 2.0]), eps=rnd.choice([1e-6, 1e-8]))
        alt = dict(lr=base["lr"] / 2, weight_decay=0.0, max_trust_ratio=rnd.choice([None, 0.5]))
    elif name == "adamw8bit":
        base = dict(lr=rnd.choice([1e-2, 3e-3]), betas=rnd.choice([(0.9, 0.999), (0.8, 0.95)]),
                    weight_decay=rnd.choice([0.0, 0.01]), min_8bit_size=1 << 40)  # 32-bit states
        alt = dict(lr=base["lr"] * 2, weight_decay=0.1, betas=(0.5, 0.9))
    else:  # galore: matrices projected (rank <= their smaller dim), vectors plain
        base = dict(lr=rnd.choice([1e-2, 3e-3]), weight_decay=rnd.choice([0.0, 0.01]),
                    correct_bias=rnd.random() < 0.8, betas=rnd.choice([(0.9, 0.999), (0.8, 0.95)]))
        mats = [n for n in names if len(shapes[n]) >= 2]
        vecs = [n for n in names if len(shapes[n]) < 2]
        low = min(min(shapes[n][-2:]) for n in mats)

        def proj():
            return dict(rank=rnd.randint(1, min(2, low)), update_proj_gap=rnd.randint(1, 3),
                        scale=rnd.choice([0.25, 1.0]), proj_type=rnd.choice(["std", "std", "reverse_std", "left",
                                                                             "right"]))
        groups = []
        if two and len(mats) > 1:
            cut = rnd.randint(1, len(mats) - 1)
            sh = rnd.sample(mats, len(mats))
            groups += [(sorted(sh[:cut], key=names.index), proj()),
                       (sorted(sh[cut:], key=names.index), {**proj(), "lr": base["lr"] * 2})]
        else:
            groups.append((mats, proj()))
        groups.append((vecs, {}))
        o.update(defaults=base, groups=groups)
        return o
    if two:
        sh = rnd.sample(names, len(names))
        cut = rnd.randint(1, len(names) - 1)
        groups = [(sorted(sh[:cut], key=names.index), {}), (sorted(sh[cut:], key=names.index), alt)]
    else:
        groups = [(names, {})]
    o.update(defaults=base, groups=groups)
    return o


def _draw_colossal(rnd, shapes, o):
    """ColossalAI's hand-over to `setup_distributed` (`_Colossal`): the mesh (tp x dp of 2 x 2, 1 x 4 with
    tp_group None, as LowLevelZeroPlugin passes, or a group of one, 4 x 1), ZeRO or not, each param's sharded dim
    over tp (None: whole; negative at times), the form of the dicts, the padding's content (ColossalAI's zeros, or
    NaN: fastopt never reads it), a state_dict() before the declaration, LowLevelZeroPlugin on one process (4 x 1
    without ZeRO: each rank alone, flattened masters, is_zero=False); and at times the last param group added
    after it (`add_param_group`), split off the only one where there is one, or GaLore's last projected group moved
    last (`o` changed in place: the reference gets the same groups)."""
    tp = rnd.choice([2, 2, 1, 4])
    c = dict(tp=tp, zero=rnd.random() < 0.7, sd_first=rnd.random() < 0.5, fill=rnd.choice([0.0, "nan"]),
             tp_group={1: rnd.choice(["none", "one"]), 2: "new", 4: rnd.choice(["new", "world"])}[tp],
             dp_group=rnd.choice(["new", "world"]) if tp == 1 else "new")
    c["maps"] = rnd.choice(["working", "shard", "none"] if c["zero"] else ["hybrid", "self", "none"])
    sharded = c["tp_group"] != "none"
    c["dims"] = {n: rnd.randrange(len(s)) - rnd.choice([0, 0, 0, len(s)]) if sharded and rnd.random() < 0.6 else None
                 for n, s in shapes.items()}
    c["empty_spec"] = rnd.random() < 0.3  # whole params carry a d_tensor layout that shards no dim
    c["late"] = rnd.random() < 0.5
    if c["late"] and len(o["groups"]) == 1:
        names = o["groups"][0][0]
        late = rnd.sample(names, rnd.randint(1, len(names) - 1))
        o["groups"] = [([n for n in names if n not in late], {}), ([n for n in names if n in late], {})]
    if c["late"] and o["name"] == "galore" and rnd.random() < 0.5:  # a projected group added late
        o["groups"][-2:] = o["groups"][-1:] + o["groups"][-2:-1]
    if tp == 4 and not c["zero"] and rnd.random() < 0.5:
        # LowLevelZeroPlugin on one process (each rank alone, its dp group of one): is_zero=False, flattened masters
        c.update(tp_group="none", maps="flat", dims=dict.fromkeys(shapes))
    return c


def draw(seed: int) -> dict:
    rnd = random.Random(f"{seed}/colossal" if seed in COLOSSAL else seed)
    mode = "colossal" if seed in COLOSSAL else rnd.choice(MODES)
    model = _draw_model(rnd, mode)
    shapes = _shapes(model)
    name = rnd.choice(OPTS)
    cfg = dict(seed=seed, mode=mode, model=model, opt=_draw_opt(rnd, name, shapes), steps=[])
    if mode == "fsdp":
        cfg["fsdp_units"] = rnd.random() < 0.5
        cfg["reshard"] = rnd.random() < 0.5
    if mode == "explicit":  # each param: replicated, or a dim shard over the tp pair or the world
        cfg["declare"] = {n: rnd.choice([None, ("tp", rnd.randrange(len(s))), ("world", rnd.randrange(len(s)))])
                          for n, s in shapes.items()}
    if mode == "colossal":
        cfg["colossal"] = _draw_colossal(rnd, shapes, cfg["opt"])
    relative = name == "adafactor" and cfg["opt"]["defaults"]["relative_step"]
    cfg["sched"] = not relative and rnd.random() < 0.4
    triton = random.Random(f"{seed}/triton")  # a stream of its own
    cfg["backend"] = "triton" if name in TRITON_OPTS and triton.random() < 0.25 else "torch"
    names = list(shapes)
    n = rnd.randint(6, 10)
    for s in range(n):
        st = {}
        st["zero"] = rnd.choice(["opt_none", "opt_zeros", "model_none", "model_zeros", "skip"]) if s else "opt_none"
        if mode in BY_HAND and st["zero"].startswith("model"):
            st["zero"] = "opt" + st["zero"][len("model"):]  # the optimizer holds the pieces, not the model
        st["accum"] = rnd.choice([1, 2])
        if rnd.random() < 0.3:
            st["freeze"] = [(rnd.choice(["pre", "post"]), rnd.choice(names))]
        if rnd.random() < 0.2:
            st["none"] = rnd.choice(names)
        if not relative and rnd.random() < 0.2:
            st["lr"] = (rnd.randrange(len(cfg["opt"]["groups"])), rnd.choice([0.5, 2.0, 0.0]))
        if cfg["sched"] and rnd.random() < 0.6:
            st["sched"] = True
        if rnd.random() < 0.15:
            st["reload"] = True
        more = random.Random(f"{seed}/{s}")  # a stream of its own (the draws above stay as they were)
        if name == "galore" and more.random() < 0.2:  # group keys are read at each step (README)
            st["gap"] = (more.randrange(len(cfg["opt"]["groups"]) - 1), more.randint(1, 3), more.choice([0.25, 1.0]))
        cfg["steps"].append(st)
    if seed >= AMP_FROM:
        _draw_amp(cfg, names)
    return cfg


# ---- building both sides ------------------------------------------------------------------------------------------
def _make_opt(o, params_by_name):
    """The drawn optimizer over `params_by_name` (name -> tensor), its groups as drawn."""
    groups = [{"params": [params_by_name[n] for n in names], **hp} for names, hp in o["groups"] if names]
    kw = dict(o["defaults"])
    if o["name"] == "adafactor":
        return fastopt.Adafactor(groups, **kw)
    if o["name"] == "came":
        return fastopt.CAME(groups, **kw)
    if o["name"] == "lamb":
        return fastopt.Lamb(groups, **kw)
    if o["name"] == "adamw8bit":
        return fastopt.AdamW8bit(groups, **kw)
    return fastopt.GaLoreAdamW(groups, **kw)


def _sched(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _tp_plan(cfg, tp):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    m = cfg["model"]
    even = m["h"] % tp == 0
    plan = {"a": ColwiseParallel() if even else ColwiseParallel(output_layouts=Replicate()),
            "b": RowwiseParallel() if even else RowwiseParallel(input_layouts=Replicate())}
    if m.get("tp_emb"):
        plan["emb"] = RowwiseParallel(input_layouts=Replicate())
    if m.get("tp_head"):
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


class _ByHand:
    """Plain tensors sharded by hand: every rank runs the whole model on the whole batch; each piece adds its
    slice of the model's gradient to its own (the model's are then cleared: the pieces accumulate across steps);
    after the step the assembled pieces are written back into the model."""

    def __init__(self, cfg, model, rank):
        from fastopt.distributed import declare_shard
        self.model = model
        self.full = dict(model.named_parameters())
        self.tp, _ = _tp_groups(rank)
        self.cut = {}
        self.pieces = {}
        for n, full in self.full.items():
            if cfg["mode"] == "flat":
                piece, _ = _flat_piece(full.detach(), dist.group.WORLD)
                self.cut[n] = lambda g: _flat_piece(g, dist.group.WORLD)[0]
                self.pieces[n] = declare_shard(torch.nn.Parameter(piece.clone()), full.shape, dist.group.WORLD,
                                               flat_offset=dist.get_rank() * piece.numel())
            else:
                dec = cfg["declare"][n]
                if dec is None:
                    self.cut[n] = lambda g: g
                    self.pieces[n] = torch.nn.Parameter(full.detach().clone())
                else:
                    grp = self.tp if dec[0] == "tp" else dist.group.WORLD
                    self.cut[n] = lambda g, d=dec[1], grp=grp: _dim_piece(g, d, grp)
                    self.pieces[n] = declare_shard(torch.nn.Parameter(self.cut[n](full.detach()).clone()),
                                                   full.shape, grp, dim=dec[1])

    def scatter_grads(self):
        for n, full in self.full.items():
            if full.grad is None:
                continue
            g = self.cut[n](full.grad).clone()
            piece = self.pieces[n]
            if piece.grad is None:
                piece.grad = g
            else:
                piece.grad.add_(g)
            full.grad = None

    def gather(self, opt):
        from fastopt.distributed import full_tensor
        with torch.no_grad():
            for n, full in self.full.items():
                piece = self.pieces[n]
                full.copy_(full_tensor(piece.detach(), opt._layout(piece)).view_as(full))


class _Colossal(_ByHand):
    """ColossalAI's hand-over (LowLevelZeroPlugin, HybridParallelPlugin): each param's working tensor is its TP
    piece, a d_tensor (`dist_layout`: global shape, the dim sharded over tp) or whole; with ZeRO (is_zero) the
    optimizer gets a trainable master of its dp rank's equal range of the flattened working tensor, padded at the
    tail to a multiple of the dp size (ColossalAI's `_create_master_param_current_rank`), and the dicts that map it
    to the working tensor and give its padding; without, the working tensor itself. Each rank runs the whole model
    on its dp part of the batch; the gradients are averaged over dp (ColossalAI's reduce-scatter, DDP's all-reduce),
    and each piece gets its slice of them, padding filled as drawn."""

    def __init__(self, cfg, model, rank):
        from test_layouts import _FakeDistLayout
        c = self.c = cfg["colossal"]
        self.cfg, self.model, self.full = cfg, model, dict(model.named_parameters())
        tp, dp = c["tp"], WORLD // c["tp"]
        # every rank creates every group, in the same order; tp groups hold consecutive ranks, as ColossalAI's mesh
        tps = [dist.new_group(list(range(i * tp, (i + 1) * tp))) for i in range(dp)]
        dps = [dist.new_group(list(range(j, WORLD, tp))) for j in range(tp)]
        self.tp, self.dp = tps[rank // tp], dps[rank % tp]
        if c["tp_group"] in ("none", "world"):
            self.tp = None if c["tp_group"] == "none" else dist.group.WORLD
        if c["dp_group"] == "world":
            self.dp = dist.group.WORLD
        self.split = (dist.get_rank(self.dp), dp)  # the batch part of this rank
        self.cut, self.pieces, self.working, self.pads, self.real = {}, {}, {}, {}, {}
        fill = float(c["fill"])
        for n, full in self.full.items():
            d = c["dims"][n]

            def work_of(g, d=d):
                return g if d is None else _dim_piece(g, d % g.dim(), self.tp)
            work = work_of(full.detach()).clone()
            if not c["zero"]:
                work = torch.nn.Parameter(work)
            if d is not None or c["empty_spec"]:
                work.dist_layout = _FakeDistLayout(tuple(full.shape), d)
                if d is None:
                    work.dist_layout.sharding_spec.dim_partition_dict = {}
            if not c["zero"] and c["maps"] != "flat":
                self.cut[n], self.pieces[n] = work_of, work
                continue
            if c["maps"] == "flat":  # the master: the flattened working param, with the dicts and no padding
                piece = torch.nn.Parameter(work.detach().reshape(-1).clone())
                self.cut[n], self.pieces[n] = (lambda g, work_of=work_of: work_of(g).reshape(-1)), piece
                self.working[id(piece)], self.pads[id(work)] = work, 0
                continue
            piece, pad = _flat_piece(work, self.dp)
            real = self.real[n] = max(0, min(piece.numel(), work.numel() - self.split[0] * piece.numel()))

            def cut(g, work_of=work_of, real=real):
                x = _flat_piece(work_of(g), self.dp)[0].clone()
                x[real:] = fill
                return x
            piece = torch.nn.Parameter(cut(full.detach()))
            self.cut[n], self.pieces[n], self.working[id(piece)] = cut, piece, work
            if c["maps"] != "none":
                self.pads[id(work) if c["maps"] == "working" else id(piece)] = pad

    def make_opt(self):
        """The drawn optimizer over the pieces, declared as ColossalAI's plugins declare it (a state_dict() first,
        at times); its last group added after the declaration, at times."""
        o, c = self.cfg["opt"], self.c
        late = o["groups"][-1] if c["late"] else None
        opt = _make_opt(dict(o, groups=o["groups"][:-1]) if late else o, self.pieces)
        if c["sd_first"]:
            opt.state_dict()
        if c["zero"]:
            maps = (self.working, None if c["maps"] == "none" else self.pads)
        else:  # HybridParallelPlugin's, without ZeRO: ({}, defaultdict(int))
            from collections import defaultdict
            maps = {"hybrid": ({}, defaultdict(int)), "self": ({id(p): p for p in self.pieces.values()}, None),
                    "none": (None, None), "flat": (self.working, self.pads)}[c["maps"]]
        opt.setup_distributed(self.tp, self.dp, *maps, is_zero=c["zero"])
        if late:
            opt.add_param_group({"params": [self.pieces[n] for n in late[0]], **late[1]})
        return opt

    def scatter_grads(self):
        for full in self.full.values():
            if full.grad is not None:
                dist.all_reduce(full.grad, group=self.dp)
                full.grad.div_(self.split[1])
        super().scatter_grads()

    def padding_bad(self):
        """The masters whose padding the steps changed (fastopt neither reads nor writes it)."""
        return [(n, "padding") for n, r in self.real.items()
                if not torch.equal(self.pieces[n].detach()[r:].nan_to_num(7.0),
                                   torch.full_like(self.pieces[n].detach()[r:], float(self.c["fill"])).nan_to_num(7.0))]


def _setup(rank, cfg):
    """(model the loop runs, params by name as the optimizer gets them, by-hand helper or None, batch part, parts)."""
    from torch.distributed.device_mesh import init_device_mesh
    mode = cfg["mode"]
    model = _build(cfg)
    by_hand, part, parts = None, 0, 1
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        part, parts = rank, WORLD
    elif mode == "tp":
        from torch.distributed.tensor.parallel import parallelize_module
        parallelize_module(model, init_device_mesh("cpu", (WORLD,)), _tp_plan(cfg, WORLD))
    elif mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD,))
        if cfg["fsdp_units"]:
            for mod in (model.a, model.b, model.head):
                fully_shard(mod, mesh=mesh, reshard_after_forward=cfg["reshard"])
        fully_shard(model, mesh=mesh, reshard_after_forward=cfg["reshard"])
        part, parts = rank, WORLD
    elif mode == "fsdp_tp":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], _tp_plan(cfg, 2))
        fully_shard(model, mesh=mesh["dp"])
        part, parts = rank // 2, 2
    elif mode in FSDP1_MODES:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        kw = dict(use_orig_params=True)
        if mode == "hsdp1":
            kw.update(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=init_device_mesh("cpu", (2, 2)))
            part, parts = rank, WORLD
        elif mode == "fsdp1_tp":
            from torch.distributed.tensor.parallel import parallelize_module
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], _tp_plan(cfg, 2))
            kw.update(device_mesh=mesh["dp"])
            part, parts = rank // 2, 2
        else:
            part, parts = rank, WORLD
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                         auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), **kw)
        if mode == "fsdp1_tp":
            fastopt.distributed.declare_fsdp(model)
    else:
        by_hand = (_Colossal if mode == "colossal" else _ByHand)(cfg, model, rank)
        part, parts = getattr(by_hand, "split", (part, parts))
    inner = model.module if mode == "ddp" else model
    if by_hand:
        params = by_hand.pieces
    else:
        params = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in inner.named_parameters()}
        params = {n: params[n] for n, _ in _build(cfg).named_parameters()}
    return model, inner, params, by_hand, part, parts


def _full(p):
    from dist_utils import whole
    return whole(p).detach().clone()


@contextlib.contextmanager
def _backend(name):
    saved = os.environ.get("FASTOPT_BACKEND")
    os.environ["FASTOPT_BACKEND"] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("FASTOPT_BACKEND", None)
        else:
            os.environ["FASTOPT_BACKEND"] = saved


@contextlib.contextmanager
def _counting_launches(on):
    """[the number of Triton kernel launches inside] (counted where `on`)."""
    n = [0]
    if not on:
        yield n
        return
    import triton
    cls = type(triton.jit(lambda: None))
    orig = cls.__getitem__
    cls.__getitem__ = lambda self, grid: n.__setitem__(0, n[0] + 1) or orig(self, grid)
    try:
        yield n
    finally:
        cls.__getitem__ = orig


# ---- the loss scaler (seeds from AMP_FROM) -------------------------------------------------------------------
def _draw_amp(cfg, names):
    """Seeds from AMP_FROM (a stream of its own, drawn after the others): a loss scaler (most runs) and, where it
    is on, the steps' non-finite gradient elements (step["poison"]) and unscale_ with or without a clip before the
    step (step["unscale"]: None, or the clip's max_norm). A poison: "act", an element of the logits' gradient of
    one data part's rows in micro-batch `micro` (under DDP and FSDP one rank's own micro-batch; under TP and by
    hand, where the ranks share the batch, every rank); "hook" (DDP), an element of a param's gradient on one rank
    before the all-reduce; "shard" (not DDP), an element of a param's reduced gradient, put on the ranks that hold
    it (one rank for an element of a Shard-placed or flat piece; a replica is never made inconsistent)."""
    rnd = random.Random(f"{cfg['seed']}/amp")
    # not under TP alone, whose params it does not shard stay plain tensors: torch 2.13's GradScaler refuses them
    # beside DTensors in its foreach inf check ("got mixed torch.Tensor and DTensor"; under implicit_replication,
    # DTensor's found_inf reduction reads the first gradient's placements: "'Tensor' object has no attribute
    # 'placements'" where that one is plain)
    cfg["scaler"] = rnd.random() < 0.8 and cfg["mode"] != "tp"
    if not cfg["scaler"]:
        return
    kinds = ("act", "hook") if cfg["mode"] == "ddp" else ("act", "shard", "shard")
    for st in cfg["steps"]:
        if rnd.random() < 0.35:
            st["poison"] = dict(kind=rnd.choice(kinds), name=rnd.choice(names), part=rnd.randrange(WORLD),
                                micro=rnd.randrange(st["accum"]), at=rnd.random(),
                                value=rnd.choice(["inf", "-inf", "nan"]))
        if rnd.random() < 0.4:
            st["unscale"] = rnd.choice([None, 0.05, 0.5, 1e3])


class _Amp:
    """Both sides' loss scalers (torch.amp.GradScaler around the reference, DDP and FSDP2; FSDP's ShardedGradScaler
    around FSDP1, the pieces declared by hand and FSDP2 + TP) and the poisons of the steps."""

    def __init__(self, cfg, ref, inner, ref_params, params, part, parts):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        self.mode, self.ref_params, self.params = cfg["mode"], ref_params, params
        self.part, self.parts = part, parts
        self.ref_scaler = torch.amp.GradScaler("cpu", **SCALER_ARGS)
        # GradScaler's own unscale_ and skip (README): params sharded as plain tensors, and DTensor params whose
        # found_inf torch does not agree over their ranks (params on two meshes, or Replicate-placed ones)
        self.torch_path = self.mode in FSDP1_MODES or self.mode in BY_HAND or self.mode == "fsdp_tp"
        self.scaler = (ShardedGradScaler if self.torch_path else torch.amp.GradScaler)("cpu", **SCALER_ARGS)
        self.now = (-1, -1)  # (step, micro-batch) of the backward running
        self.log = []  # (step, skipped by the reference, its scale after the step)
        self.steps = cfg["steps"]
        ref.head.register_forward_hook(lambda mod, args, out: self._act(out, True))
        inner.head.register_forward_hook(lambda mod, args, out: self._act(out, False))
        if self.mode == "ddp":
            hooked = {st["poison"]["name"] for st in self.steps if st.get("poison", {}).get("kind") == "hook"}
            mine = dict(inner.named_parameters())
            for n in hooked:
                for p, is_ref in ((ref_params[n], True), (mine[n], False)):
                    frozen = not p.requires_grad
                    p.requires_grad_(True)  # register_hook refuses a tensor that requires no gradient
                    p.register_hook(lambda g, n=n, is_ref=is_ref: self._hook(g, n, is_ref))
                    p.requires_grad_(not frozen)

    def _poison(self, kind):
        """This backward's poison of `kind`, or None."""
        s, m = self.now
        p = self.steps[s].get("poison") if 0 <= s < len(self.steps) else None
        if p is None or p["kind"] != kind or min(p["micro"], self.steps[s]["accum"] - 1) != m:
            return None
        return p

    def _act(self, out, is_ref):
        from fastopt.distributed.layout import local
        p = self._poison("act")
        if p is None or not out.requires_grad or not (is_ref or self.part == p["part"] % self.parts):
            return

        def hook(g):
            g = g.clone(memory_format=torch.contiguous_format)
            rows = -(-g.shape[0] // self.parts) if is_ref else g.shape[0]  # the part's rows (chunk's sizes)
            off = p["part"] % self.parts * rows if is_ref else 0
            blk = local(g)[off:off + rows]
            k = min(int(p["at"] * blk.numel()), blk.numel() - 1)
            blk.view(-1)[k] = float(p["value"])  # (a view: the rows are contiguous)
            return g
        out.register_hook(hook)

    def _hook(self, g, n, is_ref):
        p = self._poison("hook")
        if p is None or p["name"] != n or not (is_ref or dist.get_rank() == p["part"]):
            return g
        g = g.clone(memory_format=torch.contiguous_format)  # (a weight's gradient may come transposed)
        g.view(-1)[min(int(p["at"] * g.numel()), g.numel() - 1)] = float(p["value"])
        return g

    def shard(self, st, opt):
        """A "shard" poison: the element put into the reduced gradient on the ranks holding it, and into the
        reference's."""
        from fastopt.distributed.layout import local
        p = st.get("poison")
        if not p or p["kind"] != "shard" or self.ref_params[p["name"]].grad is None:
            return
        ref_g, q = self.ref_params[p["name"]].grad, self.params[p["name"]]
        g = min(int(p["at"] * ref_g.numel()), ref_g.numel() - 1)
        v = float(p["value"])
        with torch.no_grad():
            ref_g.view(-1)[g] = v
            if q.grad is None:
                return  # (FSDP1: a rank holding none of the param)
            lay, loc = opt._layout(q), local(q.grad)
            if lay is None:
                loc.view(-1)[g] = v
                return
            hit = (lay.flat_index(loc.device).reshape(-1) == g).nonzero()
            if len(hit):
                lay.local_view(loc).view(-1)[int(hit[0, 0])] = v

    def prepare(self, s, st, opt, ref_opt, ref, model):
        """Before step s (the reference holding a gradient): a "shard" poison, unscale_ and the clip drawn, the
        params kept to tell a skipped step. Returns [("clip_norm", s, ours, reference's)] where the norms
        differ."""
        self.shard(st, opt)
        self.unscaled = "unscale" in st
        out = []
        if self.unscaled:
            out = [(k, s, a, b) for k, a, b in self.clip(st, opt, ref_opt, ref, model)]
        self.snapshot()
        return out

    def ref_step(self, ref_opt):
        """The reference's scaler.step and update; where the run takes GradScaler's own path, after its unscale_
        (the grads unscaled in place, as that path leaves them; and as torch's fused optimizers do, it makes the
        zero state of a param whose first step is skipped)."""
        if self.torch_path and not self.unscaled:
            self.ref_scaler.unscale_(ref_opt)
        self.ref_scaler.step(ref_opt)
        self.ref_scaler.update()

    def step(self, opt):
        """scaler.step and update, the gradients kept before (their local tensors) for `after`'s check, except
        where GradScaler's own path unscales them inside step() (`torch_path` without unscale_ before)."""
        from fastopt.distributed.layout import local
        self.grads = None
        if self.unscaled or not self.torch_path:
            self.grads = ({n: local(p.grad).clone() for n, p in self.params.items() if p.grad is not None},
                          self.scaler.get_scale())
        self.scaler.step(opt)
        self.scaler.update()

    def clip(self, st, opt, ref_opt, ref, model):
        """unscale_ on both sides, then the step's clip: the reference's whole grads by torch, the run's by torch
        (DDP, DTensor params) or over the plain pieces (`_clip_pieces`). Returns [("clip_norm", ours, reference's)]
        where the norms differ."""
        self.ref_scaler.unscale_(ref_opt)
        self.scaler.unscale_(opt)
        mx = st["unscale"]
        if mx is None:
            return []
        ref_n = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), mx))
        if self.mode in FSDP1_MODES or self.mode in BY_HAND:
            n = _clip_pieces(opt, self.params, [n for n, p in self.ref_params.items() if p.grad is not None], mx)
        else:
            n = _clip_meshes(model.parameters(), mx)
        n = float(_full(n))
        same = (math.isnan(n) and math.isnan(ref_n)) or n == ref_n or abs(n - ref_n) <= 1e-9 * abs(ref_n)
        return [] if same else [("clip_norm", n, ref_n)]

    def snapshot(self):
        from fastopt.distributed.layout import local
        self.before = ([p.detach().clone() for p in self.ref_params.values()],
                       [local(p).detach().clone() for p in self.params.values()])

    def after(self, s):
        """("scale", s, ours, reference's) and ("skipped", s, ours, reference's) where they differ: a step is
        skipped where no rank's params moved. ("grad", s, name) where the gradient (its local tensor) is not as
        torch's fused optimizers leave it, bit for bit: the scaled one times 1/scale after a step taken on
        GradScaler's fused path, as it was after one skipped or after unscale_ (`step` kept them)."""
        from fastopt.distributed.layout import local
        ref_b, b = self.before
        ref_moved = any(not torch.equal(a, p) for a, p in zip(ref_b, self.ref_params.values()))
        moved = torch.tensor([float(any(not torch.equal(a, local(p)) for a, p in zip(b, self.params.values())))])
        dist.all_reduce(moved, op=dist.ReduceOp.MAX)
        out = []
        if self.scaler.get_scale() != self.ref_scaler.get_scale():
            out.append(("scale", s, self.scaler.get_scale(), self.ref_scaler.get_scale()))
        if bool(moved) != ref_moved:
            out.append(("skipped", s, not bool(moved), not ref_moved))
        if self.grads is not None:
            grads, scale = self.grads
            for n, g in grads.items():
                q = self.params[n].grad
                want = g if self.unscaled or not bool(moved) else g * (1.0 / scale)
                # NaN where it was: a skipped step's gradients may hold NaN (an inf times 0 in the backward)
                if q is None or not torch.isclose(local(q), want, rtol=0, atol=0, equal_nan=True).all():
                    out.append(("grad", s, n))
        self.log.append((s, not ref_moved, self.ref_scaler.get_scale()))
        return out


def _clip_pieces(opt, params, names, max_norm):
    """clip_grad_norm_ over plain pieces (FSDP1's own refuses float64 gradients: it takes their norms in float32;
    pieces declared by hand): the norm of the whole gradients of `names` (each element's square once, however
    many ranks hold it; one all_reduce), every piece's gradient scaled alike."""
    from fastopt.distributed.layout import local
    sq = [torch.zeros(_numel(opt, params[n]), dtype=DT) for n in names]
    cnt = [torch.zeros_like(b) for b in sq]
    for n, b, c in zip(names, sq, cnt):
        q = params[n]
        if q.grad is None:
            continue
        lay, g = opt._layout(q), local(q.grad)
        idx = torch.arange(g.numel()) if lay is None else lay.flat_index(g.device).reshape(-1)
        vals = g.reshape(-1) if lay is None else lay.local_view(g).reshape(-1)
        b[idx] = vals.square()
        c[idx] = 1.0
    buf = torch.stack([torch.cat(sq), torch.cat(cnt)]) if names else torch.zeros(2, 0, dtype=DT)
    dist.all_reduce(buf)
    total = (buf[0] / buf[1].clamp(min=1)).sum().sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for n in names:
        if params[n].grad is not None:
            params[n].grad.mul_(coef)
    return total


def _clip_meshes(params, max_norm):
    """torch's clip_grad_norm_ over DDP's or DTensor params; under FSDP2 + TP, whose params lie on two meshes (dp x
    tp, and dp for those TP leaves whole), where torch's refuses to stack their norms ("All operands in
    aten.stack.default must have the same mesh"), the norms taken per mesh and assembled (as torchtitan does), then
    torch's clip_grads_with_norm_ per mesh."""
    params = [p for p in params if p.grad is not None]
    meshes = {}
    for p in params:
        meshes.setdefault(getattr(p, "device_mesh", None), []).append(p)
    if len(meshes) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = torch.linalg.vector_norm(torch.stack([_full(torch.nn.utils.get_total_norm([p.grad for p in ps]))
                                                  for ps in meshes.values()]))
    for ps in meshes.values():  # (one foreach over both meshes: "Cannot run aten.mul.Tensor on inputs with
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)  # different meshes")
    return total


def _numel(opt, q):
    """The whole tensor's number of elements of param (or piece) q."""
    lay = opt._layout(q)
    return q.numel() if lay is None else math.prod(lay.global_shape)


# ---- one run on every rank ----------------------------------------------------------------------------------------
def _fuzz(rank, world, cfg, upto=None):
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel
    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # FSDP2, on the head's reshaped logits
    mode = cfg["mode"]
    ref = _build(cfg)
    names = [n for n, _ in ref.named_parameters()]
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_params = dict(ref.named_parameters())
    with _backend("torch"):
        ref_opt = _make_opt(cfg["opt"], ref_params)
    model, inner, params, by_hand, part, parts = _setup(rank, cfg)
    assert list(params) == names, (list(params), names)
    # the trainable tensors whose requires_grad a freeze toggles: the model's params (by hand: the whole ones,
    # which then get no gradient, and their pieces, which a state_dict() then gives no zero state)
    mine = dict(inner.named_parameters()) if by_hand else params
    mine = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in mine.items()}

    def make():
        return by_hand.make_opt() if mode == "colossal" else _make_opt(cfg["opt"], params)
    opt = make()
    ref_sched = sched = None
    if cfg.get("sched"):
        ref_sched, sched = _sched(ref_opt), _sched(opt)
    errs = []
    amp = _Amp(cfg, ref, inner, ref_params, params, part, parts) if cfg.get("scaler") else None
    amp_bad = []  # the loss scaler's: (what, step, ours, reference's)
    launches = 0  # Triton launches of the steps on the kernels
    steps = cfg["steps"] if upto is None else cfg["steps"][:upto]
    for s, st in enumerate(steps):
        tok, tgt = _data(cfg, s)
        z = st["zero"]
        if z != "skip":
            none = z.endswith("none")
            ref_opt.zero_grad(set_to_none=none) if z.startswith("opt") else ref.zero_grad(set_to_none=none)
            opt.zero_grad(set_to_none=none) if z.startswith("opt") else model.zero_grad(set_to_none=none)

        def toggles(point):
            for pt, n in st.get("freeze", ()):
                if pt == point:
                    for p in (ref_params[n], mine[n]) + ((params[n],) if by_hand else ()):
                        p.requires_grad_(not p.requires_grad)

        toggles("pre")
        accum = st["accum"]
        for m in range(accum):
            t, y = tok.chunk(accum)[m], tgt.chunk(accum)[m]
            if amp:
                amp.now = (s, m)
            loss = _loss(ref, t, y) / accum
            if loss.requires_grad:
                (amp.ref_scaler.scale(loss) if amp else loss).backward()
            t, y = t.chunk(parts)[part], y.chunk(parts)[part]
            loss = _loss(model, t, y) / accum
            if loss.requires_grad:
                (amp.scaler.scale(loss) if amp else loss).backward()
        if by_hand:
            by_hand.scatter_grads()
        if mode in FSDP1_MODES:
            # FSDP1's post-backward (FlatParamHandle._use_sharded_grad_views) sets the grad of every param that does
            # not require one to None, a grad kept from before its freeze included: so does the reference
            for p in ref_params.values():
                if not p.requires_grad:
                    p.grad = None
        toggles("post")
        if st.get("none"):
            ref_params[st["none"]].grad = None
            params[st["none"]].grad = None
        # with a scaler: GradScaler refuses a step that recorded no inf check (the reference holding no gradient)
        scaled = amp is not None and any(p.grad is not None for p in ref_params.values())
        if scaled:
            amp_bad += amp.prepare(s, st, opt, ref_opt, ref, model)
        with _backend("torch"):
            if scaled:
                amp.ref_step(ref_opt)
            else:
                ref_opt.step()
        with _backend(cfg["backend"]), _counting_launches(cfg["backend"] == "triton") as n:
            if scaled:
                amp.step(opt)
            else:
                opt.step()
        launches += n[0]
        if by_hand:
            by_hand.gather(opt)
        if scaled:
            amp_bad += amp.after(s)
        if st.get("lr"):
            g, f = st["lr"]
            g = min(g, len(opt.param_groups) - 1)
            ref_opt.param_groups[g]["lr"] *= f
            opt.param_groups[g]["lr"] *= f
        if st.get("gap"):  # a projected group's update_proj_gap and scale
            g, gap, scale = st["gap"]
            for o in (ref_opt, opt):
                o.param_groups[g].update(update_proj_gap=gap, scale=scale)
        if st.get("sched"):
            ref_sched.step()
            sched.step()
        if st.get("reload"):
            ref_opt.state_dict()  # which makes the zero state of params without state (README, Checkpoints)
            sd = copy.deepcopy(opt.state_dict())
            ssd = sched.state_dict() if sched else None
            opt = make()
            if sched:
                sched = _sched(opt)
                sched.load_state_dict(ssd)
            opt.load_state_dict(sd)
        if mode not in FSDP1_MODES:
            ours = {n: _full(p) for n, p in inner.named_parameters()}
            errs.append(("step", s, _err(ours, ref_params, init)))
    ctx = FullyShardedDataParallel.summon_full_params(model) if mode in FSDP1_MODES else contextlib.nullcontext()
    with ctx:
        ours = {n.replace("_fsdp_wrapped_module.", ""): _full(p) for n, p in inner.named_parameters()}
    final = _err(ours, ref_params, init)
    errs.append(("final", len(steps) - 1, final))
    per_param = {n: float((ours[n] - ref_params[n].detach()).abs().max()) for n in names}
    if amp is not None and amp.torch_path:  # the reference's zero state of a first step skipped (ref_step)
        for n, p in ref_params.items():
            if not opt.state.get(params[n]) and ref_opt.state.get(p) and float(ref_opt.state[p]["step"]) == 0:
                del ref_opt.state[p]
    state_bad = _compare_states(mode, opt, ref_opt, params, ref_params, by_hand)
    from fastopt.distributed.layout import local
    den = sum(float((p.detach() - init[n]).square().sum()) for n, p in ref_params.items()) ** 0.5
    return dict(errs=errs, err=max(e[2] for e in errs), per_param=per_param, state_bad=state_bad, amp_bad=amp_bad,
                amp_log=amp.log if amp else [],
                params=[ours[n] for n in names], den=den, launches=launches,
                held=sum(local(p).numel() for p in params.values()))


def _err(ours, ref_params, init):
    """||ours - ref|| / ||ref - init|| over all params; the error itself where the reference has not moved."""
    num = sum(float((ours[n] - p.detach()).square().sum()) for n, p in ref_params.items()) ** 0.5
    den = sum(float((p.detach() - init[n]).square().sum()) for n, p in ref_params.items()) ** 0.5
    return num / den if den > 0 else num


def _compare_states(mode, opt, ref_opt, params, ref_params, by_hand):
    """test_layouts' state comparison: every state of every param against the single process's; ColossalAI's
    masters (`_Colossal`): their padding as it was."""
    from fastopt.distributed import full_tensor
    from fastopt.distributed.layout import local
    from fastopt.reference import galore as ref_galore
    bad = []
    group_of = {id(q): g for g in opt.param_groups for q in g["params"]}
    for n, p in params.items():
        p_ref = ref_params[n]
        st, st_ref = opt.state.get(p, {}), ref_opt.state.get(p_ref, {})
        if sorted(st) != sorted(st_ref):
            bad.append((n, "keys", sorted(st), sorted(st_ref)))
            continue
        lay = opt._layout(p)
        pieces = opt._elementwise_keys(group_of[id(p)]) if lay is not None else ()
        for k, v_ref in st_ref.items():
            if not isinstance(v_ref, torch.Tensor):
                continue
            v = local(st[k])
            if k == "step":
                if float(v) != float(v_ref):
                    bad.append((n, k, float(v), float(v_ref)))
                continue
            if hasattr(st[k], "full_tensor"):
                from dist_utils import whole
                v = whole(st[k])
            elif k in (ref_galore.LEFT, ref_galore.RIGHT) and ref_galore.keeps_local_bases(lay):
                v_ref = ref_galore.basis_piece(v_ref, k, lay)
            elif tuple(v.shape) != tuple(v_ref.shape) or k in pieces:
                v = full_tensor(v, lay).view_as(v_ref)
            d = float((v.double() - v_ref.double()).norm())
            r = d / float(v_ref.double().norm()) if float(v_ref.double().norm()) > 0 else d
            if r > TOL_STATE:
                bad.append((n, k, r))
    return bad + (by_hand.padding_bad() if mode == "colossal" else [])


def check(results, tp=False, backend="torch") -> list[str]:
    """Problems found in one run's per-rank results; `tp`: a layout with tensor parallelism."""
    bad = []
    for r, res in enumerate(results):
        if res["err"] > TOL_REL:
            first = next(e for e in res["errs"] if e[2] > TOL_REL)
            worst = sorted(res["per_param"].items(), key=lambda kv: -kv[1])[:3]
            bad.append(f"rank {r}: relative update error {res['err']:.3g} (first at step {first[1]}: {first[2]:.3g});"
                       f" params most off: {worst}")
        if backend == "triton" and res["held"] and not res["launches"]:  # (a rank may hold no element at all)
            bad.append(f"rank {r}: drawn on the Triton kernels, but none was launched")
        if res["state_bad"]:
            bad.append(f"rank {r}: states off: {res['state_bad'][:4]}")
        if res.get("amp_bad"):
            bad.append(f"rank {r}: loss scaler (what, step, ours, reference's): {res['amp_bad'][:3]}")
    for r, res in enumerate(results[1:], 1):
        if not all(torch.equal(a, b) for a, b in zip(res["params"], results[0]["params"])):
            # Under TP the params replicated over it are stepped on every TP rank from gradients that torch's TP
            # backward computes there, equal to rounding only (seen: 8.7e-19 apart): held to TOL_REL then
            d = sum(float((a - b).square().sum()) for a, b in zip(res["params"], results[0]["params"])) ** 0.5
            rel = d / res["den"] if res["den"] > 0 else d
            if not (tp and rel <= TOL_REL):
                bad.append(f"rank {r}: params differ from rank 0's (relative to the update {rel:.3g})")
    return bad


def without(cfg, drops=(), upto=None):
    """`cfg` with the ops `drops` ("step.key", e.g. "3.freeze") removed and only its first `upto` steps."""
    cfg = copy.deepcopy(cfg)
    for d in drops:
        s, k = d.split(".")
        cfg["steps"][int(s)].pop(k, None)
        if k == "zero":
            cfg["steps"][int(s)]["zero"] = "opt_none"
        if k == "accum":
            cfg["steps"][int(s)]["accum"] = 1
    if upto is not None:
        cfg["steps"] = cfg["steps"][:upto]
    return cfg


# Seeds the suite runs: every layout and optimizer, each op (freeze, grad None, lr, scheduler, GaLore's gap,
# reload, 2-3 param groups); 7, 50 and 57 on the kernels under TRITON_INTERPRET=1. 60 (FSDP1, Lamb): a param with
# no gradient at its first step, then a state_dict() round trip: state_dict() made its zero state on the one rank
# holding elements of it only, and load_state_dict refused the checkpoint on every rank ("state[4] holds no state
# here and the state of step 0 on rank 3"); 218 and 621 (AdamW8bit under FSDP1 and HYBRID_SHARD) alike.
# ColossalAI's declaration: 3014 (GaLore) and 3041 (Adafactor, NaN padding) under ZeRO over TP 2 x 2; 3487 (CAME)
# without ZeRO, HybridParallelPlugin's dicts; 3016 (AdamW8bit) under ZeRO over 4 ranks, tp_group None as
# LowLevelZeroPlugin passes it; each with a group added after the declaration. 3383 (Adafactor): LowLevelZeroPlugin on
# one process, flattened masters with is_zero=False, which setup_distributed refused before. With a loss scaler
# (AMP_FROM): 5040 (DDP, an inf from one rank before the all-reduce), 5007 (FSDP2, one rank's micro-batch and one
# rank's shard), 5041 (declared pieces, unscale_ and clips), 5045 (FSDP2 + TP, Lamb: an inf in one TP rank's piece,
# beside the params on the dp mesh alone; the ranks skipped different steps before `_found_inf_agreed`).
FIXED_SEEDS = [3, 5, 7, 20, 28, 31, 35, 38, 40, 50, 57, 60, 3014, 3041, 3487, 3016, 3383, 5040, 5007, 5041, 5045]


@pytest.mark.dist
@pytest.mark.parametrize("seed", FIXED_SEEDS)
def test_layouts_fuzz_fixed_seeds(pool, seed):
    cfg = draw(seed)
    if cfg["backend"] == "triton" and not (fastopt.ops.triton_available() and fastopt.ops.interpreting()):
        cfg["backend"] = "torch"
    bad = check(pool.run(_fuzz, cfg), "tp" in cfg["mode"], cfg["backend"])
    assert not bad, "\n".join([json.dumps(cfg)] + bad)


# ---- many seeds from the command line ---------------------------------------------------------------------------
def _run(pool, me, cfg):
    from dist_utils import DistError
    _run.last = None  # the ranks' results, for the line of a seed
    try:
        _run.last = pool.run(me._fuzz, cfg)
        return check(_run.last, "tp" in cfg["mode"], cfg["backend"])
    except DistError as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return ["EXC: " + " | ".join(lines[:1] + [ln for ln in lines if "Error" in ln][:4])]


def minimize(pool, me, cfg):
    """The shortest prefix of the steps that still fails, then each op removed that the failure does not need
    (zero_grad made the ordinary `opt.zero_grad()`, accum made 1)."""
    bad = _run(pool, me, cfg)
    if not bad:
        return dict(ok=True)
    lo, hi = 1, len(cfg["steps"])
    while lo < hi:  # failures persist once they occur (a param off stays off)
        mid = (lo + hi) // 2
        if _run(pool, me, without(cfg, (), mid)):
            hi = mid
        else:
            lo = mid + 1
    cfg = without(cfg, (), hi)
    drops = []
    for s, st in enumerate(cfg["steps"]):
        for k in ("freeze", "none", "lr", "sched", "gap", "reload", "zero", "accum", "poison", "unscale"):
            if k in st and not (k == "zero" and st[k] == "opt_none") and not (k == "accum" and st[k] == 1):
                trial = drops + [f"{s}.{k}"]
                b = _run(pool, me, without(cfg, trial))
                if b:
                    drops, bad = trial, b
    cfg = without(cfg, drops)
    return dict(cfg=cfg, bad=bad[:2], drops=drops, upto=hi)


def main(argv):
    if argv[0] == "--show":
        print(json.dumps(draw(int(argv[1])), indent=1))
        return
    from dist_utils import DistPool
    import test_layouts_fuzz as me  # the ranks import the function by its module's name, not __main__
    env = {"FASTOPT_BACKEND": "torch"}
    with DistPool(WORLD, timeout=float(os.environ.get("FUZZ_TIMEOUT", 60)), env=env) as pool:
        if argv[0] == "--one":
            cfg = draw(int(argv[1]))
            upto = int(argv[2]) if len(argv) > 2 and argv[2] != "-" else None
            drops = argv[3].split(",") if len(argv) > 3 and argv[3] else ()
            cfg = without(cfg, drops, upto)
            if os.environ.get("FUZZ_BACKEND"):
                cfg["backend"] = os.environ["FUZZ_BACKEND"]
            if cfg["backend"] == "triton" and not os.environ.get("TRITON_INTERPRET"):
                cfg["backend"] = "torch"
            print(json.dumps(cfg))
            t0 = time.time()
            bad = _run(pool, me, cfg)
            print(json.dumps(dict(ok=not bad, bad=bad, secs=round(time.time() - t0, 1))))
            return
        if argv[0] == "--min":
            print(json.dumps(minimize(pool, me, draw(int(argv[1])))))
            return
        if argv[0] == "--list":  # --list S1,S2,... [OUT.jsonl]
            seeds = [int(x) for x in argv[1].split(",")]
        else:
            seeds = range(int(argv[0]), int(argv[0]) + int(argv[1]))
        out = open(argv[2], "a") if len(argv) > 2 else sys.stdout
        for seed in seeds:
            cfg = draw(seed)
            if cfg["backend"] == "triton" and not os.environ.get("TRITON_INTERPRET"):
                cfg["backend"] = "torch"
            if os.environ.get("FUZZ_ONLY") and cfg["backend"] != os.environ["FUZZ_ONLY"]:
                continue  # FUZZ_ONLY=triton: the seeds drawn on the kernels alone
            t0 = time.time()
            bad = _run(pool, me, cfg)
            rec = dict(seed=seed, ok=not bad, bad=bad, secs=round(time.time() - t0, 1), mode=cfg["mode"],
                       opt=cfg["opt"]["name"], backend=cfg["backend"])
            if _run.last:  # the worst update error over the ranks; with a scaler, the reference's skipped steps
                rec["err"] = max(r["err"] for r in _run.last)  # and its scales
                if cfg.get("scaler"):
                    rec["skipped"] = [s for s, k, _ in _run.last[0]["amp_log"] if k]
                    rec["scales"] = [sc for _, _, sc in _run.last[0]["amp_log"]]
            out.write(json.dumps(rec) + "\n")
            out.flush()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
