"""GPU-only checks of every fastopt optimizer: no host sync, CUDA graphs.

    python bench/gpu_checks.py [--only Adafactor,CAME-8bit] [--json out.json] [--jobs N] [--timeout S]
                               [--budget-s S] [--list]

What runs is an explicit list of configurations (`configurations()`: name, class, factory): every optimizer
class in `fastopt.__all__` at least once, plus the variants whose kernels differ (8-bit CAME and Lamb state,
Adafactor with momentum, GaLore's projected groups in 32 and 8 bits, ZeRO around a fastopt optimizer).
`--only` takes configuration names or class names (a class name selects every configuration of that class).

For each configuration, in its own subprocess (a failed capture can leave the CUDA context unusable;
up to --jobs at a time, each killed after --timeout seconds or what is left of --budget-s, whichever is less;
the rows it printed before are kept):

- no-host-sync: `torch.cuda.set_sync_debug_mode("error")` around the first step (state creation, kernel
  compilation), several more steps with fresh random gradients, and steps with GradScaler's
  `grad_scale` / `found_inf` set on the device (for optimizers that take them); any synchronizing call
  inside `step()` raises, and the check fails naming it (WARN instead when the only sync is Triton's
  autotuner benchmarking configs on the very first call). A configuration with `warmup` steps runs them
  eagerly first, unchecked: GaLore's first step is its SVD refresh, which reads the host by design.
- CUDA graph: after eager warm-up steps on a side stream (at least three, and past `warmup`), one `step()`
  is captured with static gradient tensors; each replay, after new gradients are copied into them, must give
  the same params and state as an identical optimizer stepped eagerly on the same gradients (fp32 within
  1e-6 relative, bf16 within one bf16 ulp), while pinned host memory is churned with garbage between
  replays. A step that reads host memory or Python state that changes between steps fails here even when
  capture itself succeeds. GaLore's captured step is one without an SVD (update_proj_gap 10**6): its
  refresh schedule lives on the host, so refresh steps must run outside a graph.

Params: fp32 and bf16 matrices, a 3-D tensor, vectors and a 0-d tensor in one optimizer (several buckets).
Each configuration's rows are printed, and --json rewritten (with the configurations still running under
"pending"), as soon as it finishes: a timeout around this script loses only the configurations then running.
Exit status 1 when any check fails or a configuration was not started (SKIP: --budget-s spent).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Callable

import torch

SHAPES = [((64, 96), torch.float32), ((128, 64), torch.float32), ((2, 8, 16), torch.float32), ((96,), torch.float32),
          ((), torch.float32), ((64, 96), torch.bfloat16), ((96,), torch.bfloat16)]
GALORE_RANK = 8          # <= the smallest matrix dim of SHAPES (the 8 x 16 matrices of the 3-D param)
GALORE_NO_REFRESH = 10 ** 6  # update_proj_gap: the SVD runs at step 1 only
GALORE_MIN_8BIT = 512    # GaLoreAdamW8bit: the projected moments of the two fp32 matrices (768, 1024) in 8 bits


@dataclass(frozen=True)
class Config:
    """One optimizer set-up to check. `cls`: the fastopt class `factory(params)` returns; `warmup`: eager,
    unchecked steps before the no-sync check (and before the graph's own warm-up ends); `why`: the reason;
    `amp`: True: step() takes grad_scale/found_inf set by hand, as GradScaler sets them; "scaler": steps through
    a whole ZeroGradScaler loop instead (the ZeRO wrapper takes them only after that scaler's inf check over its
    ranks, and passes them to the wrapped optimizer); False: no scaled phase."""
    name: str
    cls: str
    factory: Callable[[list], torch.optim.Optimizer]
    desc: str
    warmup: int = 0
    why: str = ""
    amp: bool | str = True


def _galore(cls, **kw):
    """`cls` with the matrices (2-D and the batched 3-D param) in a projected group, the rest plain AdamW."""
    def make(params):
        mats = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        return cls([{"params": mats, "rank": GALORE_RANK, "update_proj_gap": GALORE_NO_REFRESH},
                    {"params": rest}], lr=1e-3, **kw)
    return make


def configurations() -> list[Config]:
    import fastopt
    svd = "step 1 is GaLore's SVD refresh (torch.linalg.svd reads the host)"
    galore = f"matrices in a group with rank={GALORE_RANK}, update_proj_gap={GALORE_NO_REFRESH}; vectors plain"
    return [
        Config("Adafactor", "Adafactor", lambda ps: fastopt.Adafactor(ps), "Adafactor(params): relative step"),
        Config("Adafactor-beta1", "Adafactor", lambda ps: fastopt.Adafactor(ps, beta1=0.9),
               "Adafactor(params, beta1=0.9): first moment"),
        Config("Lamb", "Lamb", lambda ps: fastopt.Lamb(ps), "Lamb(params)"),
        Config("Lamb-8bit", "Lamb", lambda ps: fastopt.Lamb(ps, nbits=8), "Lamb(params, nbits=8)"),
        Config("CAME", "CAME", lambda ps: fastopt.CAME(ps, lr=1e-3), "CAME(params, lr=1e-3)"),
        Config("CAME-8bit", "CAME", lambda ps: fastopt.CAME(ps, lr=1e-3, nbits=8), "CAME(params, lr=1e-3, nbits=8)"),
        Config("AdamW8bit", "AdamW8bit", lambda ps: fastopt.AdamW8bit(ps), "AdamW8bit(params)"),
        Config("GaLoreAdamW", "GaLoreAdamW", _galore(fastopt.GaLoreAdamW), f"GaLoreAdamW: {galore}",
               warmup=1, why=svd),
        Config("GaLoreAdamW8bit", "GaLoreAdamW8bit",
               _galore(fastopt.GaLoreAdamW8bit, min_8bit_size=GALORE_MIN_8BIT),
               f"GaLoreAdamW8bit(min_8bit_size={GALORE_MIN_8BIT}): {galore}", warmup=1, why=svd),
        Config("ZeroRedundancyOptimizer", "ZeroRedundancyOptimizer",
               lambda ps: fastopt.ZeroRedundancyOptimizer(fastopt.Adafactor(ps, beta1=0.9)),
               "ZeroRedundancyOptimizer(Adafactor(params, beta1=0.9)): one rank, no process group", amp="scaler"),
    ]


def optimizer_classes() -> list[str]:
    import fastopt
    return [n for n in fastopt.__all__ if isinstance(getattr(fastopt, n, None), type)
            and issubclass(getattr(fastopt, n), torch.optim.Optimizer)]


def select(only: str, configs: list[Config] | None = None) -> list[Config]:
    """The configurations named in `only` (comma-separated configuration or class names; empty: all), in
    list order. An unknown name raises ValueError listing the known ones."""
    configs = configurations() if configs is None else configs
    names = [n.strip() for n in only.split(",") if n.strip()]
    if not names:
        return list(configs)
    unknown = [n for n in names if not any(n in (c.name, c.cls) for c in configs)]
    if unknown:
        raise ValueError(f"--only: unknown {', '.join(unknown)}; configurations: "
                         f"{', '.join(c.name for c in configs)} (or a class name: all of its configurations)")
    return [c for c in configs if c.name in names or c.cls in names]


def make_params(seed: int, device: str = "cuda") -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [(torch.randn(s, generator=g, device=device) * 0.1).to(dt).requires_grad_() for s, dt in SHAPES]


def new_grads(params, seed: int) -> list[torch.Tensor]:
    dev = params[0].device
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(p.shape, generator=g, device=dev).to(p.dtype) for p in params]


def state_tensors(opt, params) -> list[torch.Tensor]:
    return [v for p in params for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]


def _steps(opt, params, seed: int, n: int, scale: float = 1.0) -> int:
    """`n` eager steps with fresh gradients (seeds from `seed` on); returns the next seed."""
    for _ in range(n):
        for p, gr in zip(params, new_grads(params, seed)):
            p.grad = gr * scale
        seed += 1
        opt.step()
    return seed


def check_sync(cfg: Config) -> list[dict]:
    out = []
    params = make_params(0)
    opt = cfg.factory(params)
    seed = _steps(opt, params, 1, cfg.warmup)
    first = ("first step (state init, compile)" if not cfg.warmup else
             f"first step after {cfg.warmup} unchecked ({cfg.why})")
    phases = [(first, 1, False), ("4 more steps", 4, False)]
    zero_scaler = None
    if cfg.amp == "scaler":
        import fastopt
        zero_scaler = fastopt.ZeroGradScaler("cuda", init_scale=1024.0)
        zero_scaler.scale(torch.ones((), device="cuda"))  # its scale tensors, made before the checked steps
        # bf16 params get no gradient there: torch 2.11's CUDA unscale kernel (GradScaler's) has no bf16
        phases.append(("steps through ZeroGradScaler (step, update; no bf16 grads)", 3, True))
    elif cfg.amp and getattr(opt, "_step_supports_amp_scaling", False):
        phases.append(("steps with grad_scale/found_inf", 3, True))
    for name, steps, scaler in phases:
        if scaler and zero_scaler is None:
            opt.grad_scale = torch.tensor(1024.0, device="cuda")
            opt.found_inf = torch.zeros((), device="cuda")
        steps_done = 0
        try:
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(steps):
                    if scaler and zero_scaler is not None:
                        for p, gr in zip(params, new_grads(params, seed)):
                            p.grad = gr * 1024.0 if p.dtype != torch.bfloat16 else None
                        seed += 1
                        zero_scaler.step(opt)
                        zero_scaler.update()
                    else:
                        seed = _steps(opt, params, seed, 1, 1024.0 if scaler else 1.0)
                    steps_done += 1
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            out.append(dict(check=f"no-host-sync: {name}", status="PASS", detail=cfg.desc))
        except RuntimeError as e:
            # A one-time sync from Triton's autotuner (benchmarking configs on the first call) is reported,
            # not failed: warm up before capturing a graph. Any other sync fails.
            autotune = any("autotuner" in f.filename for f in traceback.extract_tb(e.__traceback__))
            status = "WARN" if autotune and steps_done == 0 and not cfg.warmup and name == first else "FAIL"
            out.append(dict(check=f"no-host-sync: {name}", status=status,
                            detail=f"{str(e).splitlines()[0]} at {_where(e)}"))
        finally:
            if scaler:
                opt.__dict__.pop("grad_scale", None)
                opt.__dict__.pop("found_inf", None)
    return out


def _where(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "fastopt" in f.filename or "kernels" in f.filename]
    f = frames[-1] if frames else traceback.extract_tb(e.__traceback__)[-1]
    return f"{os.path.relpath(f.filename)}:{f.lineno} ({f.name})"


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of the tolerance: fp32 1e-6 * max|b|; bf16/fp16 2^-7 * max|b| (one to two bf16 ulps
    of max|b|, 8 to 16 fp16 ones)."""
    ref = b.double().abs().max().item() if b.numel() else 0.0
    tol = max(ref, 1e-30) * (2.0 ** -7 if a.dtype in (torch.bfloat16, torch.float16) else 1e-6)
    return (a.double() - b.double()).abs().max().item() / tol if a.numel() else 0.0


def check_graph(cfg: Config) -> list[dict]:
    pa = make_params(0)
    pb = [p.detach().clone().requires_grad_() for p in pa]
    opt_a, opt_b = cfg.factory(pa), cfg.factory(pb)
    warm = max(3, cfg.warmup + 2)  # the captured step is never one of the unchecked warm-up steps
    static = new_grads(pa, 100)
    for p, g in zip(pa, static):
        p.grad = g
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(warm):
            for g, src in zip(static, new_grads(pa, 200 + k)):
                g.copy_(src)
            opt_a.step()
    torch.cuda.current_stream().wait_stream(side)
    for k in range(warm):
        for p, src in zip(pb, new_grads(pb, 200 + k)):
            p.grad = src
        opt_b.step()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            opt_a.step()
    except Exception as e:  # noqa: BLE001 - the capture's failure is the finding; reported with where it came from
        return [dict(check="cuda-graph: capture", status="FAIL", detail=f"{type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''} at {_where(e)}")]
    worst = 0.0
    for k in range(5):
        fresh = new_grads(pa, 300 + k)
        for g, src in zip(static, fresh):
            g.copy_(src)
        for p, src in zip(pb, fresh):
            p.grad = src.clone()
        # Churn pinned host memory with garbage: a captured copy from a host buffer the step freed after
        # capture would now read garbage (wrong results, or an illegal address) instead of passing silently.
        junk = [torch.full((n,), -0x5A5A5A5A5A5A5A5B, dtype=torch.int64, pin_memory=True)
                for n in (1, 4, 8, 16, 64, 256, 1024) for _ in range(4)]
        graph.replay()
        torch.cuda.synchronize()
        del junk
        opt_b.step()
        torch.cuda.synchronize()
        worst = max([worst] + [_close(a, b) for a, b in zip(pa, pb)]
                    + [_close(a, b) for a, b in zip(state_tensors(opt_a, pa), state_tensors(opt_b, pb))])
    moved = max(_close(a, b) for a, b in zip(pa, make_params(0)))
    status = "PASS" if worst <= 1.0 and moved > 1.0 else "FAIL"
    detail = (f"{cfg.desc}; {warm} eager warm-up steps, then 5 replays vs eager on the same grads: max diff "
              f"{worst:.3g} x tolerance (params and state); params moved: {moved > 1.0}")
    return [dict(check="cuda-graph: capture + replay == eager", status=status, detail=detail)]


def run_one(cfg: Config, emit: bool = False) -> list[dict]:
    """All checks of one configuration; with `emit`, each row is printed as `ROW <json>` as soon as it is
    known (the parent process keeps them even if a later check kills this one)."""
    from fastopt import ops
    rows: list[dict] = []
    t0 = time.monotonic()

    def add(new):
        for r in new:
            r.update(optimizer=cfg.name, backend=ops.backend(), seconds=round(time.monotonic() - t0, 1))
            if emit:
                print("ROW " + json.dumps(r), flush=True)
        rows.extend(new)

    for fn in (check_sync, check_graph):
        try:
            add(fn(cfg))
        except Exception as e:  # noqa: BLE001 - reported as a failure with its location
            add([dict(check=fn.__name__, status="FAIL", detail=f"{type(e).__name__}: {e} at {_where(e)}"[:400])])
    return rows


def _command(name: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--inline", "--config", name, "--json", "-"]


def _rows_in(out) -> list[dict]:
    """The `ROW <json>` lines of a child's stdout (str, or the bytes a TimeoutExpired carries, or None)."""
    if isinstance(out, bytes):
        out = out.decode(errors="replace")
    return [json.loads(ln[4:]) for ln in (out or "").splitlines() if ln.startswith("ROW ")]


def _subprocess(name: str, timeout: float) -> list[dict]:
    """Configuration `name` in a child process killed after `timeout` s; the rows it printed before dying are
    kept, followed by a FAIL row saying why it died."""
    t0 = time.monotonic()
    try:
        r = subprocess.run(_command(name), capture_output=True, text=True, timeout=timeout)
        got = _rows_in(r.stdout)
        if r.returncode not in (0, 1) or not got:
            tail = " | ".join(r.stderr.strip().splitlines()[-3:])
            got.append(dict(optimizer=name, check="subprocess", status="FAIL", detail=f"exit {r.returncode}: {tail}"))
    except subprocess.TimeoutExpired as e:
        got = _rows_in(e.stdout)
        got.append(dict(optimizer=name, check="subprocess", status="FAIL",
                        detail=f"timed out after {timeout:.0f} s ({len(got)} rows before)"))
    for row in got:
        row.setdefault("seconds", round(time.monotonic() - t0, 1))
    return got


def _print_row(row: dict) -> None:
    print(f"{row['status']:4s}  {row['optimizer']:24s} {row['check']:45s} {row.get('detail', '')}", flush=True)


def _write_json(path: str, rows: list[dict], pending: list[str], args) -> None:
    """The rows so far, in configuration order, with the configurations not finished yet (`pending`).
    Written to a temporary file and renamed: a kill mid-write leaves the previous version, never half a file."""
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               commit=os.environ.get("FASTOPT_COMMIT", "unknown"), timeout_s=args.timeout, budget_s=args.budget_s,
               pending=pending, rows=rows)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


# Monotonic clock of the --budget-s accounting (a test replaces it with a fake one).
_clock = time.monotonic
MIN_START_S = 10  # a configuration is not started with less of --budget-s left than this


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated configuration names (see --list) or class names "
                    "(every configuration of that class); default: all")
    ap.add_argument("--list", action="store_true", help="print the selected configurations and exit")
    ap.add_argument("--json", default=None, help="write the rows here ('-': as ROW lines on stdout, run in this "
                    "process: what each configuration's subprocess does)")
    ap.add_argument("--inline", action="store_true", help="run in this process (no subprocess per configuration)")
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)  # exactly one configuration (subprocesses)
    ap.add_argument("--timeout", type=float, default=150, help="seconds per configuration subprocess (at most)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for the whole run (gpu_check.sh passes its stage's time): each configuration's "
                    f"timeout is also cut to what is left of it, and none starts with less than {MIN_START_S} s left")
    ap.add_argument("--jobs", type=int, default=6, help="configuration subprocesses at a time")
    args = ap.parse_args(argv)
    configs = configurations()
    try:
        chosen = ([c for c in configs if c.name == args.config] if args.config is not None else
                  select(args.only, configs))
    except ValueError as e:
        ap.error(str(e))
    if not chosen:
        ap.error(f"--config {args.config!r}: no such configuration")
    if args.list:
        for c in chosen:
            print(f"{c.name:24s} {c.desc}")
        return 0
    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA device", file=sys.stderr)
        return 2
    if args.json == "-":  # a child process: rows go to stdout as they come (run_one's ROW lines)
        rows = [r for cfg in chosen for r in run_one(cfg, emit=True)]
        return 1 if any(r["status"] == "FAIL" for r in rows) else 0

    # Each configuration's rows are printed and the JSON rewritten as soon as it finishes, so a stage timeout
    # that stops this process loses only the configurations still running (listed under "pending").
    start = _clock()
    if not args.inline:  # the extension built once here (cached on disk), not raced for by the first children
        import fastopt.ext
        if not fastopt.ext.is_available():
            print(f"gpu_checks: the C++/CUDA extension did not build: {fastopt.ext.load_error()}", flush=True)
    done: dict[str, list[dict]] = {}

    def run(cfg: Config) -> list[dict]:
        left = float("inf") if args.budget_s is None else args.budget_s - (_clock() - start)
        if left < MIN_START_S:
            return [dict(optimizer=cfg.name, check="not started", status="SKIP",
                         detail=f"{max(left, 0):.0f} s of --budget-s {args.budget_s:.0f} left")]
        timeout = min(args.timeout, left)
        return run_one(cfg) if args.inline else _subprocess(cfg.name, timeout)

    def finished(cfg: Config, got: list[dict]) -> None:
        done[cfg.name] = got
        for row in got:
            _print_row(row)
        if args.json:
            _write_json(args.json, [r for c in chosen for r in done.get(c.name, [])],
                        [c.name for c in chosen if c.name not in done], args)

    if args.json:
        _write_json(args.json, [], [c.name for c in chosen], args)
    if args.inline:
        for cfg in chosen:
            finished(cfg, run(cfg))
    else:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(run, cfg): cfg for cfg in chosen}
            for fut in as_completed(futures):
                finished(futures[fut], fut.result())
    rows = [r for c in chosen for r in done[c.name]]
    return 1 if any(r["status"] in ("FAIL", "SKIP") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
