"""Where one optimizer step's time goes: host (Python and launches) against device (kernels), per step.

    python bench/profile_step.py --optim galore --set 1b --dtype fp32 [--rank 128] [--json out.json]

Times `--steps` steps three ways, after `--warmup` untimed ones:
  wall_ms     step() then a device sync, per step (median): what a training loop waits for;
  host_ms     step() alone, no sync (median): the Python and launch cost, the enqueueing of the work;
  device_ms   the kernels' own durations per step, summed (torch.profiler, CUDA only).
When host_ms is close to wall_ms and device_ms well below it, the step is host-bound: fewer launches or less
Python per param would help, faster kernels would not. Also the launches per step and the kernels that take
the most device time (name, calls per step, ms per step). Runs on CPU too (the torch reference; no device
numbers) so that CI exercises it; the numbers that mean something come from a GPU.

`--stub-kernels` (CPU): the fused path's host work without a GPU. The step goes down the Triton path with every
Triton kernel's launch a no-op that counts itself (`launches` then counts those), so host_ms is the Python and
table building of the fused step without the launches' own cost; the params do not change. It is how the
host time of GaLore's steps was taken apart on this project's CPU machine.

`--fresh-grads`: before each step (untimed), every gradient is replaced by a copy in new memory, as a training
loop with `zero_grad(set_to_none=True)` has its gradients allocated again by the next backward.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

try:
    from . import bench_galore, common
except ImportError:
    import bench_galore
    import common

import fastopt

OPTIMS = {
    "adafactor": lambda pset, ps, a: fastopt.Adafactor(ps),
    "came": lambda pset, ps, a: fastopt.CAME(ps, lr=2e-4),
    "came8": lambda pset, ps, a: fastopt.CAME(ps, lr=2e-4, nbits=8),
    "lamb": lambda pset, ps, a: fastopt.Lamb(ps, lr=1e-3),
    "lamb8": lambda pset, ps, a: fastopt.Lamb(ps, lr=1e-3, nbits=8),
    "adamw8bit": lambda pset, ps, a: fastopt.AdamW8bit(ps, lr=1e-3),
    "galore": lambda pset, ps, a: fastopt.GaLoreAdamW(
        bench_galore._groups(pset, ps, a.rank, bench_galore.NO_REFRESH), **bench_galore.HYPER),
    "galore8": lambda pset, ps, a: fastopt.GaLoreAdamW8bit(
        bench_galore._groups(pset, ps, a.rank, bench_galore.NO_REFRESH), **bench_galore.HYPER),
}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optim", choices=sorted(OPTIMS), default="galore")
    ap.add_argument("--set", choices=sorted(common.MODELS), default="1b")
    ap.add_argument("--layers", type=common.number(int, 1), default=None,
                    help="decoder layers (default: the suite's, 4 of 7b's 32, all 22 of 1b's)")
    ap.add_argument("--scale", type=common.number(int, 1), default=1, help="divide every dimension by this")
    ap.add_argument("--dtype", choices=sorted(common.DTYPES), default="fp32")
    ap.add_argument("--rank", type=common.number(int, 1), default=128,
                    help="GaLore's rank (divided by --scale, as the suite does)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup", type=common.number(int, 0), default=3)
    ap.add_argument("--steps", type=common.number(int, 1), default=10)
    ap.add_argument("--top", type=common.number(int, 1), default=8, help="kernels listed")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--stub-kernels", action="store_true",
                    help="CPU: the Triton path with no-op launches (its host work alone; see the docstring)")
    ap.add_argument("--fresh-grads", action="store_true",
                    help="each step's gradients in new memory (as after zero_grad(set_to_none=True))")
    return ap.parse_args(argv)


def _device_profile(fn, device: torch.device, steps: int, top: int) -> dict:
    """Kernels' durations and counts per step from torch.profiler (CUDA only)."""
    if device.type != "cuda":
        return {"device_ms": None, "launches": None, "top": []}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    common._sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        common._sync(device)
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per.setdefault(e.name, []).append(e.device_time_total / 1e3)  # us -> ms
    total = sum(sum(v) for v in per.values())
    rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"device_ms": total / steps, "launches": sum(len(v) for v in per.values()) / steps,
            "top": [{"kernel": k[:120], "calls": len(v) / steps, "ms": sum(v) / steps} for k, v in rows]}


class _NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` counts the launch and does nothing."""

    count = 0

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs) -> None:
        _NoLaunch.count += 1


@contextlib.contextmanager
def stubbed_kernels():
    """Every @triton.jit function in fastopt.kernels' modules replaced by a `_NoLaunch`, and fastopt.ops sending
    CPU tensors to the Triton path; both restored on exit."""
    import importlib
    import pkgutil

    import triton
    from fastopt import kernels, ops
    saved = [(ops, "use_triton", ops.use_triton)]
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, triton.runtime.jit.KernelInterface):  # jit, or the interpreter's
                saved.append((mod, name, obj))
                setattr(mod, name, _NoLaunch())
    ops.use_triton = lambda t: True
    try:
        yield
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)


def profile_step(args) -> dict:
    if args.stub_kernels:
        if args.device != "cpu":
            raise SystemExit("--stub-kernels measures the host work on the CPU: use it with --device cpu")
        with stubbed_kernels():
            return _profile_step(args)
    return _profile_step(args)


def param_set(args) -> common.ParamSet:
    """The shapes --set, --layers and --scale pick (by default 4 of 7b's 32 decoder layers, all 22 of 1b's); sets
    args.rank to GaLore's rank for them (divided by --scale, at most the smallest matrix's)."""
    m = common.MODELS[args.set]
    layers = min(m.layers, args.layers or (4 if args.set == "7b" else m.layers))
    pset = common.ParamSet(args.set, f"{m.name} ({layers}/{m.layers} layers)",
                           tuple(common.model_shapes(m, layers, args.scale)))
    args.rank = bench_galore._rank(args, pset, args.rank)
    return pset


def warm_up(opt, args) -> None:
    """The first step (the state, the compiled kernels; GaLore: the bases, by a stand-in for its SVD), then
    --warmup more."""
    first = bench_galore.standin_first_step if args.optim.startswith("galore") else contextlib.nullcontext
    with first():
        opt.step()
    for _ in range(args.warmup):
        opt.step()


def _profile_step(args) -> dict:
    device = torch.device(args.device)
    pset = param_set(args)
    dtype = common.DTYPES[args.dtype]
    params = common.make_params(pset, dtype, device)
    opt = OPTIMS[args.optim](pset, params, args)
    warm_up(opt, args)
    common._sync(device)
    wall, host = [], []
    _NoLaunch.count = 0
    for _ in range(args.steps):
        if args.fresh_grads:  # the copy is made while the old gradient still holds its memory
            for p in params:
                p.grad = p.grad.clone()
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        common._sync(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    dev = _device_profile(opt.step, device, args.steps, args.top)
    if args.stub_kernels:
        dev["launches"] = _NoLaunch.count / args.steps
    return {"optim": args.optim, "set": pset.label, "n_params": pset.n_params, "n_tensors": len(params),
            "dtype": args.dtype, "rank": args.rank if args.optim.startswith("galore") else None,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "stubbed": args.stub_kernels, "fresh_grads": args.fresh_grads,
            "steps": args.steps,
            "wall_ms": statistics.median(wall),
            "host_ms": statistics.median(host), **dev}


def report(r: dict) -> str:
    lines = [f"{r['optim']} on {r['set']}, {r['n_params'] / 1e6:.1f}M params in {r['n_tensors']} tensors, "
             f"{r['dtype']}" + (f", rank {r['rank']}" if r["rank"] else "") + f", {r['device']}, torch {r['torch']}",
             f"  wall   {r['wall_ms']:9.3f} ms/step (step + sync, median of {r['steps']})",
             f"  host   {r['host_ms']:9.3f} ms/step (step alone: Python and launches)"]
    if r["fresh_grads"]:
        lines[0] += ", gradients in new memory each step"
    if r["stubbed"]:
        lines[0] += ", Triton launches stubbed out"
        lines.append(f"  {r['launches']:.0f} (stubbed) Triton launches/step")
    if r["device_ms"] is not None:
        lines.append(f"  device {r['device_ms']:9.3f} ms/step (kernels' durations), {r['launches']:.0f} launches/step")
        lines += [f"    {k['ms']:8.3f} ms  {k['calls']:6.1f}x  {k['kernel']}" for k in r["top"]]
    return "\n".join(lines)


def finish(r: dict, text: str, path: Path | None) -> dict:
    """Print a run's report `text`, write its numbers `r` to `path` (unless None) as JSON, return them."""
    print(text, flush=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r, indent=1) + "\n")
    return r


def main(argv=None) -> dict:
    args = parse(argv)
    r = profile_step(args)
    return finish(r, report(r), args.json)


if __name__ == "__main__":
    main()
