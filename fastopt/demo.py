"""The main job, for now: train a small Llama-style causal LM with fastopt's optimizers on CPU.

    python -m fastopt.demo [--optim adafactor,adamw] [--steps 60] [--out demo-out]

A tiny decoder (RMSNorm, causal self-attention, SwiGLU MLP; plain torch modules, nothing downloaded) learns
a generated text corpus at character level. For each optimizer it shows a progress bar with the loss and
step time, then prints a table (final loss, optimizer-state bytes per parameter, median step time) and
writes a PNG of the loss curves. The 4-process TP x FSDP2 run of issue 9 is still to come (TODO(#9)).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

WORDS = ("the optimizer keeps row and column factors of the second moment so memory grows with rows plus "
         "columns not rows times columns shards of a matrix share their statistics through one small "
         "collective per step and every rank takes the same step as a single process would").split()


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
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj,
                                                                                    self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o_proj(a)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab, d=64, layers=2, heads=4, ff=172, ctx=64):
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


def make_optimizer(name: str, params):
    import fastopt
    if name == "adafactor":
        return fastopt.Adafactor(params, lr=1e-2, relative_step=False, scale_parameter=False, beta1=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=3e-3)
    cls = {n.lower(): getattr(fastopt, n) for n in fastopt.__all__ if isinstance(getattr(fastopt, n), type)}
    if name not in cls:
        raise SystemExit(f"--optim {name!r}: choose from adafactor, adamw, {', '.join(sorted(cls))}")
    return cls[name](params, lr=3e-3)


def state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def train(name, data, vocab, steps, batch, ctx, seed=0):
    torch.manual_seed(seed)
    model = TinyLlama(vocab, ctx=ctx)
    opt = make_optimizer(name, model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(seed)
    losses, times = [], []
    try:
        from tqdm import tqdm
        bar = tqdm(range(steps), desc=f"{name:>10}", ncols=90)
    except ImportError:
        bar = range(steps)
    for _ in bar:
        ix = torch.randint(0, len(data) - ctx - 1, (batch,), generator=gen)
        x = torch.stack([data[i:i + ctx] for i in ix.tolist()])
        y = torch.stack([data[i + 1:i + ctx + 1] for i in ix.tolist()])
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.3f}", ms=f"{1e3 * times[-1]:.0f}")
    return dict(optim=name, losses=losses, final_loss=statistics.mean(losses[-5:]),
                state_bytes_per_param=state_bytes(opt) / n_params, step_ms=1e3 * statistics.median(times),
                params=n_params)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optim", default="adafactor,adamw", help="comma-separated list")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--out", default="demo-out", help="folder for the loss plot")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    print(f"corpus: {len(text)} characters, vocabulary {len(chars)}; uniform-guess loss {math.log(len(chars)):.3f}")
    results = [train(name.strip().lower(), data, len(chars), args.steps, args.batch, args.ctx)
               for name in args.optim.split(",") if name.strip()]
    print(f"\n| optimizer | final loss | state bytes/param | median step ms |  ({results[0]['params']} params)")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['optim']} | {r['final_loss']:.3f} | {r['state_bytes_per_param']:.2f} | {r['step_ms']:.1f} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return results
    os.makedirs(args.out, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot(r["losses"], label=r["optim"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    path = os.path.join(args.out, "loss.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    print(f"loss curves: {path}")
    return results


if __name__ == "__main__":
    main()
