"""The main job: train a small Llama-style causal LM with fastopt's optimizers under TP x FSDP2.

    python -m fastopt.demo [--tp 2] [--dp 2] [--optim adafactor,adamw] [--steps 100] [--out demo-out]

A tiny decoder (RMSNorm, causal self-attention, SwiGLU MLP; plain torch modules, nothing downloaded; or, with
`--model llama`, transformers' LlamaForCausalLM of the same shape) learns a generated text corpus at character
level. By default it runs on 4 CPU processes (gloo) as tensor parallelism 2 x FSDP2 2: a 2-D DeviceMesh ("dp",
"tp"), `parallelize_module` with ColwiseParallel (q/k/v, gate/up) and RowwiseParallel (o, down) over "tp", then
`fully_shard` over "dp". With CUDA GPUs it uses them, one process per GPU, with NCCL. `--tp 1 --dp 1` trains in
this process alone; under `torchrun` the ranks come from its environment instead of being spawned here.

The optimizers run unchanged on the DTensor parameters that this produces. Every dp rank trains on its slice of
the same global batch and FSDP2 averages the gradients, so a run takes the same steps as a single process does
(tests/test_demo.py checks the loss curves and the trained weights against one in float64).

Rank 0 shows a progress bar (loss, step time) per optimizer, then a table: final loss, optimizer-state bytes per
parameter (summed over all ranks, divided by the model's parameter count: state replicated on several ranks
counts on each), median step time. It writes the loss curves (loss.png) and the numbers (results.json) to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ._cli import unwritable_folder
from .distributed.layout import local

WORDS = ("the optimizer keeps row and column factors of the second moment so memory grows with rows plus "
         "columns not rows times columns shards of a matrix share their statistics through one small "
         "collective per step and every rank takes the same step as a single process would").split()

OPTIMIZERS = ("adafactor", "came", "lamb", "galore", "adamw8bit", "adamw")

# The model's shape. DTensor.from_local in the TP activations assumes even splits, so HEADS and FF must divide
# by --tp (checked in parse_args).
D_MODEL, LAYERS, HEADS, FF = 64, 2, 4, 172


def corpus(n_chars: int = 40_000, seed: int = 0) -> str:
    rng = random.Random(seed)
    out, n = [], 0
    while n < n_chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.head_dim = d // heads
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        # Head counts and widths come from the tensors (-1), not from the config: under tensor parallelism
        # q/k/v hold this rank's heads only and the attention output is this rank's slice of the features.
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o_proj(a)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab, d=D_MODEL, layers=LAYERS, heads=HEADS, ff=FF, ctx=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


def make_optimizer(name: str, model: nn.Module, stochastic_round: bool = False):
    """Optimizer `name` over the model's params; learning rates picked by a short sweep on this model (100 steps,
    one process). `stochastic_round`: bf16 params of Adafactor, CAME and Lamb rounded stochastically (updates
    below half a bf16 ulp are not lost; the same draw on every layout as in one process)."""
    import fastopt
    params = list(model.parameters())
    sr = dict(bf16_stochastic_round=stochastic_round)
    if name == "adafactor":
        # No first moment (transformers' default): factored second moments only, O(rows + columns) state.
        return fastopt.Adafactor(params, lr=3e-3, relative_step=False, scale_parameter=False, **sr)
    if name == "came":
        return fastopt.CAME(params, lr=5e-4, **sr)
    if name == "lamb":
        return fastopt.Lamb(params, lr=5e-2, **sr)
    if name == "adamw8bit":
        return fastopt.AdamW8bit(params, lr=1e-2)
    if name == "galore":
        # Rank 16 of the 64-wide projections; the projection is refreshed every 20 steps.
        groups = fastopt.get_galore_param_groups(model, weight_decay=0.0, rank=16, update_proj_gap=20, scale=0.25)
        return fastopt.GaLoreAdamW(groups, lr=1e-2)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    raise ValueError(f"make_optimizer: name={name!r} must be one of {', '.join(OPTIMIZERS)}")


def state_bytes(opt) -> int:
    """Bytes of optimizer state held by this process (local pieces of DTensor states; step counters aside)."""
    total = 0
    for st in opt.state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                t = local(t)
                total += t.numel() * t.element_size()
    return total


@dataclass
class Parallel:
    """Where this process stands: its rank, the (dp, tp) mesh (None in a single process), its device."""
    rank: int
    world: int
    tp: int
    dp: int
    device: torch.device
    mesh: object = None

    @property
    def dp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh["dp"].get_local_rank()

    def describe(self) -> str:
        where = "GPU" if self.device.type == "cuda" else "CPU"
        if self.mesh is None:
            return f"1 process ({where})"
        return f"TP {self.tp} x FSDP2 {self.dp} on {self.world} {dist.get_backend()} processes ({where}s)"


class HFLlama(nn.Module):
    """transformers' LlamaForCausalLM (rotary positions, its own attention) with the same tiny shape, built from a
    config (nothing downloaded); returns logits like TinyLlama."""

    def __init__(self, vocab, ctx=64):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=D_MODEL, intermediate_size=FF, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=ctx,
                          tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
        self.lm = LlamaForCausalLM(cfg)
        # Its attention reshapes with -1 heads, so the projections shard over TP like TinyLlama's.
        self.blocks = self.lm.model.layers

    def forward(self, idx):
        return self.lm(input_ids=idx).logits


# Sub-module names inside a block: q/k/v and gate/up split their output features over TP, o/down their inputs.
TP_PLAN = {
    "tiny": dict(q_proj="col", k_proj="col", v_proj="col", o_proj="row", gate_proj="col", up_proj="col",
                 down_proj="row"),
    "llama": {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
              "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"},
}


def build_model(vocab: int, args, par: Parallel) -> nn.Module:
    """The same initial weights on every rank (same seed, built whole), then sharded: TP over "tp", FSDP2 over
    "dp". A dim of size 1 gets no wrapper."""
    torch.manual_seed(args.seed)
    model = (HFLlama if args.model == "llama" else TinyLlama)(vocab, ctx=args.ctx)
    model = model.to(device=par.device, dtype=getattr(torch, args.dtype))
    if par.tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        for blk in model.blocks:
            parallelize_module(blk, par.mesh["tp"], {name: ColwiseParallel() if kind == "col" else RowwiseParallel()
                                                     for name, kind in TP_PLAN[args.model].items()})
    if par.dp > 1:
        from torch.distributed.fsdp import fully_shard
        for blk in model.blocks:
            fully_shard(blk, mesh=par.mesh["dp"])
        fully_shard(model, mesh=par.mesh["dp"])
    return model


def _progress(name: str, steps: int, show: bool):
    if not show:
        return range(steps)
    try:
        from tqdm import tqdm
    except ImportError:
        return range(steps)
    if not hasattr(tqdm, "_lock"):
        # tqdm's default lock adds a multiprocessing lock (a named semaphore) for bars drawn from several
        # processes. One process draws here, and a spawned rank leaves by os._exit, which skips that
        # semaphore's cleanup: "resource_tracker: There appear to be 1 leaked semaphore objects" at the end.
        tqdm.set_lock(threading.RLock())
    return tqdm(range(steps), desc=f"{name:>10}", ncols=90)


def train(name: str, data: torch.Tensor, vocab: int, args, par: Parallel) -> dict:
    """Train a fresh model with optimizer `name`. Every rank returns the same losses and state bytes, and its own
    step times."""
    model = build_model(vocab, args, par)
    n_params = sum(p.numel() for p in model.parameters())  # global sizes, DTensor or not
    try:
        opt = make_optimizer(name, model, stochastic_round=args.stochastic_round)
    except NotImplementedError as e:
        return dict(optim=name, skipped=str(e), params=n_params)
    gen = torch.Generator().manual_seed(args.seed)
    per_rank = args.batch // par.dp
    rows = slice(par.dp_rank * per_rank, (par.dp_rank + 1) * per_rank)
    losses, times = [], []
    bar = _progress(name, args.steps, par.rank == 0)
    for step in bar:
        # Every rank draws the same global batch and keeps its dp slice: the run sees the data a single
        # process with --batch sequences would, so their loss curves can be compared.
        ix = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=gen)[rows].tolist()
        x = torch.stack([data[i:i + args.ctx] for i in ix]).to(par.device)
        y = torch.stack([data[i + 1:i + args.ctx + 1] for i in ix]).to(par.device)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        try:
            opt.step()
        except NotImplementedError as e:
            # An optimizer without DTensor support refuses on its first step, on every rank alike (the params
            # are the same kind everywhere) and before it changes anything: skip it, keep the others.
            if step == 0:
                if hasattr(bar, "close"):
                    bar.close()
                return dict(optim=name, skipped=str(e), params=n_params)
            raise
        opt.zero_grad(set_to_none=True)
        if par.device.type == "cuda":
            torch.cuda.synchronize(par.device)
        times.append(time.perf_counter() - t0)
        loss = loss.detach()
        if par.dp > 1:
            # The global batch's mean loss: the mean over the dp ranks' equal slices.
            dist.all_reduce(loss, group=par.mesh.get_group("dp"))
            loss = loss / par.dp
        losses.append(loss.item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.3f}", ms=f"{1e3 * times[-1]:.0f}", refresh=False)
    nbytes = torch.tensor([float(state_bytes(opt))], dtype=torch.float64, device=par.device)
    if par.mesh is not None:
        dist.all_reduce(nbytes)
    out = dict(optim=name, losses=losses, final_loss=statistics.mean(losses[-5:]),
               state_bytes_per_param=nbytes.item() / n_params, step_ms=1e3 * statistics.median(times),
               params=n_params)
    if args.save_params:
        # full_tensor() is a collective: every rank gathers, rank 0 writes.
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                for n, p in model.named_parameters()}
        if par.rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save(full, os.path.join(args.out, f"model-{name}.pt"))
    return out


def report(results: list[dict], args, par: Parallel, vocab: int, wall_s: float) -> None:
    """The table, the plot and results.json (rank 0 only)."""
    n = results[0]["params"]
    sr = " (Adafactor, CAME, Lamb: stochastic rounding)" if args.stochastic_round else ""
    print(f"\n{par.describe()}; {n} params; {args.steps} steps of {args.batch} x {args.ctx} tokens; {args.dtype}{sr}; "
          f"trained in {wall_s:.1f} s (start-up not counted)")
    print("| optimizer | final loss (last 5 steps) | state bytes/param (all ranks) | median step ms |")
    print("|---|---|---|---|")
    for r in results:
        if "skipped" in r:
            print(f"| {r['optim']} | skipped: {r['skipped']} | | |")
        else:
            print(f"| {r['optim']} | {r['final_loss']:.3f} | {r['state_bytes_per_param']:.2f} | "
                  f"{r['step_ms']:.1f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(layout=par.describe(), tp=par.tp, dp=par.dp, device=par.device.type, steps=args.steps,
                       batch=args.batch, ctx=args.ctx, dtype=args.dtype, stochastic_round=args.stochastic_round,
                       seed=args.seed, vocab=vocab,
                       uniform_loss=math.log(vocab), wall_s=wall_s, results=results), f, indent=1)
    trained = [r for r in results if "losses" in r]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in trained:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["optim"])
    ax.axhline(math.log(vocab), color="gray", lw=0.8, ls=":", label="uniform guess")
    ax.set_title(par.describe(), fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    path = os.path.join(args.out, "loss.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    print(f"loss curves: {path}; numbers: {os.path.join(args.out, 'results.json')}")


def run(args, par: Parallel) -> list[dict]:
    """Train every optimizer of --optim on this rank; rank 0 reports."""
    t0 = time.perf_counter()
    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    if par.rank == 0:
        print(f"{par.describe()}; corpus: {len(text)} characters, vocabulary {len(chars)}; "
              f"uniform-guess loss {math.log(len(chars)):.3f}")
    results = [train(name, data, len(chars), args, par) for name in args.optim]
    if par.rank == 0:
        report(results, args, par, len(chars), time.perf_counter() - t0)
    return results


def _distributed(rank: int, world: int, args, init_method: str, local_rank: int) -> list[dict]:
    """One rank of a multi-process run: process group, (dp, tp) mesh, training."""
    from torch.distributed.device_mesh import init_device_mesh
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # A rank left waiting by another that failed gives up after this long instead of gloo's 30 minutes.
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    try:
        mesh = init_device_mesh(device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
        results = run(args, Parallel(rank, world, args.tp, args.dp, device, mesh))
        dist.barrier()  # no rank closes its connections while another still talks to it
        return results
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, args, init_method: str) -> None:
    _distributed(rank, world, args, init_method, local_rank=rank)
    # The work is done and written. Leave without the interpreter's teardown: gloo's background threads can
    # abort it ("terminate called without an active exception"), which mp.spawn would report as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fastopt.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optim", default="adafactor,adamw",
                    help=f"comma-separated, from {', '.join(OPTIMIZERS)} (default: adafactor,adamw)")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: 2 when the number of "
                    "processes to fill is even, else 1; that number is 4 on the CPU, the GPU count with GPUs, "
                    "torchrun's world size under torchrun)")
    ap.add_argument("--dp", type=int, default=None, help="FSDP2 degree (default: the processes to fill / tp)")
    ap.add_argument("--model", choices=("tiny", "llama"), default="tiny",
                    help="tiny: the plain-torch decoder above; llama: transformers' LlamaForCausalLM, same shape")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: the CUDA GPUs (NCCL) when there are any, else CPU processes (gloo)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=None, help="global batch (sequences), split over the dp ranks "
                    "(default: 16, rounded up to a multiple of --dp)")
    ap.add_argument("--ctx", type=int, default=64, help="sequence length")
    ap.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32",
                    help="params and activations (float64: for exact comparisons between layouts)")
    ap.add_argument("--stochastic-round", action="store_true",
                    help="with --dtype bfloat16: Adafactor, CAME and Lamb round the params stochastically")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="demo-out", help="folder for loss.png and results.json")
    ap.add_argument("--save-params", action="store_true", help="also write each trained model's full tensors "
                    "to OUT/model-<optim>.pt")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits in a collective")
    args = ap.parse_args(argv)

    args.optim = [s.strip().lower() for s in args.optim.split(",") if s.strip()]
    unknown = [s for s in args.optim if s not in OPTIMIZERS]
    if unknown or not args.optim:
        ap.error(f"--optim {','.join(unknown) or '(empty)'}: choose from {', '.join(OPTIMIZERS)}")
    twice = [s for k, s in enumerate(args.optim) if s in args.optim[:k]]
    if twice:
        ap.error(f"--optim {twice[0]}: given twice (each optimizer trains once)")
    if args.model == "llama":
        try:
            import transformers  # noqa: F401
        except ImportError:
            ap.error("--model llama: needs transformers (pip install transformers), or use --model tiny")
    # Before the defaults below divide by --tp and --dp.
    for flag, value in (("--tp", args.tp), ("--dp", args.dp), ("--steps", args.steps), ("--batch", args.batch),
                        ("--ctx", args.ctx)):
        if value is not None and value < 1:
            ap.error(f"{flag} {value}: must be >= 1")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        ap.error(f"--timeout {args.timeout}: must be a number of seconds > 0")
    n_chars = len(corpus())
    if args.ctx >= n_chars - 1:
        ap.error(f"--ctx {args.ctx}: must be below the corpus's {n_chars} characters less one (a sequence and its "
                 "next-character targets are cut from it)")
    if args.stochastic_round and args.dtype != "bfloat16":
        ap.error(f"--stochastic-round: only with --dtype bfloat16 (rounds bf16 params; these are {args.dtype})")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    n_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    # The processes to fill: torchrun's, else one per GPU, else 4 on the CPU.
    slots = int(os.environ["WORLD_SIZE"]) if launched else n_gpus if args.device == "cuda" else 4
    if args.tp is None:
        args.tp = 2 if slots % 2 == 0 else 1
    if args.dp is None:
        args.dp = max(1, slots // args.tp)
    if args.batch is None:
        args.batch = -(-16 // args.dp) * args.dp
    if HEADS % args.tp or FF % args.tp:
        ap.error(f"--tp {args.tp}: must divide the model's {HEADS} attention heads and MLP width {FF} "
                 "(tensor-parallel activations assume even splits)")
    if args.batch % args.dp:
        ap.error(f"--batch {args.batch}: must be a multiple of --dp {args.dp} (each dp rank takes an equal slice)")
    world = args.tp * args.dp
    if launched and int(os.environ["WORLD_SIZE"]) != world:
        ap.error(f"--tp {args.tp} --dp {args.dp}: {world} ranks, but torchrun started {os.environ['WORLD_SIZE']}")
    if args.device == "cuda" and not launched and world > n_gpus:
        ap.error(f"--tp {args.tp} --dp {args.dp}: needs {world} GPUs, {n_gpus} found (--device cpu runs gloo "
                 "processes on the CPU instead)")
    why = unwritable_folder(args.out)  # last: a refused command leaves no folder; before training, not at its end
    if why:
        ap.error(f"--out {args.out}: cannot be created or written ({why})")
    return args


def main(argv=None) -> list[dict] | None:
    """Run the demo; returns rank 0's results (None on the other ranks of a torchrun launch)."""
    args = parse_args(argv)
    world = args.tp * args.dp
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # torchrun (or any launcher that sets the env:// variables): this process is one rank.
        rank = int(os.environ["RANK"])
        results = _distributed(rank, world, args, "env://", int(os.environ.get("LOCAL_RANK", rank)))
        return results if rank == 0 else None
    if world == 1:
        device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cpu":
            torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        return run(args, Parallel(0, 1, 1, 1, device))
    import torch.multiprocessing as mp
    # CPU ranks fork from a forkserver that imported torch and fastopt once, instead of each importing them
    # (seconds apiece, on every rank of a small CPU machine), and torch._dynamo, which an optimizer's first step
    # imports. Not this module: under `python -m fastopt.demo` each rank runs it again as __mp_main__, and runpy
    # warns ("'fastopt.demo' found in sys.modules ... unpredictable behaviour") when the forkserver imported it.
    # GPU ranks are spawned: nothing may have initialized CUDA in a process they fork from.
    method = "forkserver" if args.device == "cpu" and "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
                                   "torch.distributed.fsdp", "torch._dynamo", "fastopt"]
                                  + (["transformers.models.llama.modeling_llama"] if args.model == "llama" else []))
    with tempfile.TemporaryDirectory(prefix="fastopt-demo-") as tmp:
        # file:// rendezvous: no port to pick or to collide with.
        try:
            mp.start_processes(_spawned, args=(world, args, f"file://{os.path.join(tmp, 'rendezvous')}"),
                               nprocs=world, start_method=method)
        except KeyboardInterrupt:  # Ctrl-C reached every process of the group: they have stopped
            print("\ninterrupted", file=sys.stderr)
            raise SystemExit(130) from None
    with open(os.path.join(args.out, "results.json")) as f:
        return json.load(f)["results"]


if __name__ == "__main__":
    main()
