"""The one benchmark harness every `bench/bench_<stem>.py` uses.

Writing a bench (the interface `bench/run.py` and `python -m fastopt.bench` rely on)
-------------------------------------------------------------------------------------
A file `bench/bench_<stem>.py` defines `STEM = "<stem>"` and `run(args) -> list[dict]`, one dict per
(parameter set, dtype, implementation), each made by `measure()` (or `skipped()` when a competitor cannot
run), and ends with `if __name__ == "__main__": common.main(STEM, run)`. Import the harness like this, so
the file works both as a script and when `run.py` loads it:

    try:
        from . import common          # loaded by bench/run.py / python -m fastopt.bench
    except ImportError:
        import common                 # python bench/bench_<stem>.py

Inside `run(args)`:

    for pset in common.param_sets(args):            # Llama-7B-like (a layer subset) and ~1B shapes
        for dtype in common.dtypes(args):           # torch.float32, torch.bfloat16
            mb = common.min_bytes(pset, dtype, ...)  # or your own count: the fewest bytes the step must move
            out.append(common.measure(args, STEM, "fastopt", pset, dtype, lambda ps: fastopt.X(ps),
                                      min_bytes=mb, ours=True, kernel_bytes=..., notes=...))
            out.append(common.measure(args, STEM, "torch.optim.X(foreach)", pset, dtype, make_eager, min_bytes=mb))

`measure()` builds the params with random (never zero) grads, makes the optimizer (a factory that raises
becomes a clean `skipped` row with the reason), runs one step to create the state, counts the state's
bytes, times `step()` (`triton.testing.do_bench`, quantiles 0.2/0.5/0.8, on CUDA; a wall clock on CPU),
counts kernel launches per step (torch.profiler on CUDA; None on CPU), and frees everything. A competitor
that fails mid-run is recorded as `error` with its reason; the suite goes on. Pass `step=` for a step
that is not just `opt.step()` (it gets the optimizer and the params).

Bytes: `min_bytes` is the fewest bytes the algorithm must move through device memory for one step over the
whole set (each input read once, each output written once; `common.min_bytes()` counts the usual cases). GB/s
and the fraction of the copy bandwidth are computed over it, for every implementation alike, so they
compare. `kernel_bytes` (optional, ours only) is what our kernels really move, from their passes.

Result dict fields (`FIELDS`): see `_result()` and bench/results/README.md (`n_timed` is do_bench's repeat count
estimated from one step on CUDA, exact on CPU and in rows timed with `reps`). The copy bandwidth (`dst.copy_(src)`
of a large buffer, bytes read plus bytes written) is measured once per process, in the same run, and stored with
the results.

Outputs (`write_outputs`): `<name>-<device>.json` (machine line: device, torch, Triton, git commit), a
markdown table `.md`, and a PNG bar chart `.png` (matplotlib, Agg). On CPU the sizes are reduced and the
JSON (`"cpu_numbers": true`) and the table say that the numbers are CPU numbers.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from fastopt._cli import unwritable_folder

SCHEMA = 1
BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
QUANTILES = (0.2, 0.5, 0.8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
CPU_NOTE = "CPU numbers at reduced sizes: they prove the harness runs, not GPU speed."  # JSON, console

FIELDS = (
    "bench", "impl", "ours", "set", "set_label", "n_params", "n_tensors", "dtype", "device", "backend", "status",
    "reason", "ms_median", "ms_p20", "ms_p80", "n_timed", "min_bytes_per_param", "kernel_bytes_per_param", "gbps",
    "frac_copy", "kernel_gbps", "kernel_frac_copy", "state_bytes", "state_bytes_per_param", "scratch_bytes_per_param",
    "launches_per_step", "copies_per_step", "speedup", "baseline", "notes",
    "comm", "machinery_ms", "overhead_frac",  # bench_layouts' computed rows (status "computed"), None elsewhere
)


# ---- parameter sets -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """A Llama-style decoder's dimensions; weights shaped like torch.nn.Linear (out_features, in_features)."""
    name: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv_dim: int  # k/v projection rows: n_kv_heads * head_dim (GQA when < hidden)


LLAMA_7B = Model("llama-7b", hidden=4096, intermediate=11008, layers=32, vocab=32000, kv_dim=4096)
# TinyLlama-1.1B's dimensions (Llama-2 vocabulary, 4 key/value heads of 64): about 1.1e9 parameters.
LLAMA_1B = Model("llama-1b", hidden=2048, intermediate=5632, layers=22, vocab=32000, kv_dim=256)
MODELS = {"7b": LLAMA_7B, "1b": LLAMA_1B}


@dataclass(frozen=True)
class ParamSet:
    key: str                                   # "7b" / "1b"
    label: str                                 # "llama-7b (4/32 layers)"
    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for _, s in self.shapes)


def model_shapes(m: Model, layers: int, scale: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of `layers` decoder layers plus embeddings, final norm and LM head, each dimension
    divided by `scale` (1: the real shapes)."""
    def d(x):
        return max(1, x // scale)
    h, i, kv, v = d(m.hidden), d(m.intermediate), d(m.kv_dim), d(m.vocab)
    out = [("embed_tokens", (v, h))]
    for n in range(layers):
        out += [(f"layers.{n}.q_proj", (h, h)), (f"layers.{n}.k_proj", (kv, h)), (f"layers.{n}.v_proj", (kv, h)),
                (f"layers.{n}.o_proj", (h, h)), (f"layers.{n}.gate_proj", (i, h)), (f"layers.{n}.up_proj", (i, h)),
                (f"layers.{n}.down_proj", (h, i)), (f"layers.{n}.input_layernorm", (h,)),
                (f"layers.{n}.post_attention_layernorm", (h,))]
    out += [("norm", (h,)), ("lm_head", (v, h))]
    return out


def param_sets(args) -> list[ParamSet]:
    sets = []
    for key in args.sets:
        m = MODELS[key]
        layers = min(m.layers, args.layers_7b if key == "7b" else args.layers_1b)
        label = f"{m.name} ({layers}/{m.layers} layers" + (f", dims /{args.scale})" if args.scale > 1 else ")")
        sets.append(ParamSet(key, label, tuple(model_shapes(m, layers, args.scale))))
    return sets


def dtypes(args) -> list[torch.dtype]:
    return [DTYPES[d] for d in args.dtypes]


def elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def min_bytes(pset: ParamSet, dtype: torch.dtype, *, reads: int = 2, writes: int = 1, state_elem: float = 0.0,
              factored_state: int = 0, vector_state: int = 0, state_dtype: torch.dtype = torch.float32) -> int:
    """Fewest bytes one step must move over `pset`: `reads` param-sized reads (the gradient and the param:
    2) and `writes` param-sized writes (the param: 1) in the param dtype, `state_elem` bytes per element of
    elementwise state read+written (e.g. 8.0 for one fp32 moment), and `factored_state` row+column vectors
    (fp32) read and written per matrix, `vector_state` full-size fp32 vectors read and written per 1-D param."""
    s = elem_bytes(dtype)
    a = elem_bytes(state_dtype)
    total = 0
    for _, shape in pset.shapes:
        n = math.prod(shape)
        total += (reads + writes) * s * n + state_elem * n
        if len(shape) >= 2:
            b = math.prod(shape[:-2])
            total += factored_state * 2 * a * b * (shape[-2] + shape[-1])
        else:
            total += vector_state * 2 * a * n
    return int(total)


def make_params(pset: ParamSet, dtype: torch.dtype, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """Leaf params (randn * 0.02) with random full-rank grads (randn): never zeros, which can time faster."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for _, shape in pset.shapes:
        p = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
        p.requires_grad_(True)
        p.grad = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        params.append(p)
    return params


# ---- timing -------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], None], device: torch.device, warmup_ms: float, rep_ms: float) -> tuple[list[float], int]:
    """([p20, p50, p80] in ms, number of timed runs). CUDA: triton.testing.do_bench (CUDA events, L2
    flushed between runs). CPU: wall clock after warm-up, at least 5 runs, until `rep_ms` is spent."""
    if device.type == "cuda":
        from triton.testing import do_bench
        est_ms = _wall(fn, device, 1)
        q = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES))
        return [float(x) for x in q], max(1, int(rep_ms / max(est_ms, 1e-3)))
    t_end = time.perf_counter() + warmup_ms / 1e3
    fn()
    while time.perf_counter() < t_end:
        fn()
    times = []
    t_end = time.perf_counter() + rep_ms / 1e3
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    qs = statistics.quantiles(times, n=10, method="inclusive")
    return [qs[1], statistics.median(times), qs[7]], len(times)


def _wall(fn, device, n) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / n


_COPY: dict = {}


def copy_bandwidth(args) -> dict:
    """Device-to-device copy (`dst.copy_(src)`) of an `args.copy_mb` MiB buffer: GB/s counting bytes read
    plus bytes written. Measured once per process and device."""
    key = (str(args.device), args.copy_mb)
    if key not in _COPY:
        dev = torch.device(args.device)
        n = args.copy_mb * 2**20 // 4
        src = torch.randn(n, device=dev)
        dst = torch.empty_like(src)
        q, reps = time_fn(lambda: dst.copy_(src), dev, args.warmup_ms, args.rep_ms)
        moved = 2 * src.nbytes
        _COPY[key] = dict(bytes=moved, ms_median=q[1], ms_p20=q[0], ms_p80=q[2], n_timed=reps,
                          gbps=moved / (q[1] * 1e-3) / 1e9, method="dst.copy_(src), bytes read + written")
        del src, dst
        _free(dev)
    return _COPY[key]


def count_launches(fn: Callable[[], None], device: torch.device, steps: int = 3) -> tuple[float | None, float | None]:
    """(kernel launches per step, memcpy/memset per step) from torch.profiler; (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    kernels = copies = 0
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        name = e.name.lower()
        if name.startswith("memcpy") or name.startswith("memset"):
            copies += 1
        else:
            kernels += 1
    if kernels == 0:
        return None, None  # the profiler saw no device activity: say nothing rather than 0
    return kernels / steps, copies / steps


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
    return total


def scratch_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the device buffers fastopt's kernels keep between steps beside the state (pointer tables, statistics
    and partial-sum buffers of the cached plans in `opt._plans`); 0 for other optimizers."""
    seen = {t.data_ptr() for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)}
    total = 0

    def visit(x, depth):
        nonlocal total
        if depth > 4:
            return
        if isinstance(x, torch.Tensor):
            if x.data_ptr() not in seen and x.numel():
                seen.add(x.data_ptr())
                total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v, depth + 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v, depth + 1)
        elif type(x).__module__.startswith("fastopt.") and hasattr(x, "__dict__"):
            for v in vars(x).values():
                visit(v, depth + 1)

    visit(getattr(opt, "_plans", None), 0)
    return total


# ---- one measurement ----------------------------------------------------------------------------------
def _result(args, bench, impl, pset, dtype, *, ours=False, status="ok", reason="", backend="", notes="", **kw) -> dict:
    r = dict.fromkeys(FIELDS)
    r.update(bench=bench, impl=impl, ours=ours, set=pset.key, set_label=pset.label, n_params=pset.n_params,
             n_tensors=len(pset.shapes), dtype=DTYPE_NAMES.get(dtype, str(dtype)), device=str(args.device),
             backend=backend, status=status, reason=reason, notes=notes)
    r.update(kw)
    return r


def skipped(args, bench, impl, pset, dtype, reason, **kw) -> dict:
    """A row for a competitor that cannot run here, with the reason."""
    return _result(args, bench, impl, pset, dtype, status="skipped", reason=reason, **kw)


def _over_budget(args) -> bool:
    deadline = getattr(args, "deadline", None)
    return deadline is not None and time.monotonic() > deadline


def measure(args, bench: str, impl: str, pset: ParamSet, dtype: torch.dtype,
            make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *, min_bytes: float,
            ours: bool = False, kernel_bytes: float | None = None, backend: str | Callable = "", notes: str = "",
            step: Callable | None = None, seed: int = 0, first: Callable | None = None,
            reps: int | None = None) -> dict:
    """Time one implementation on one parameter set and dtype; see the module docstring.
    `min_bytes` / `kernel_bytes`: bytes one step moves over the whole set (not per parameter).
    `backend`: a label, or a function of the params returning one (called after the optimizer is made).
    `first`: a context manager factory around the untimed first step (e.g. a stand-in for its set-up work).
    `reps`: time exactly this many steps, one at a time (wall clock after a device sync; p20 and p80 are then
    the fastest and the slowest), and count launches over one, instead of do_bench's warm-up and repetitions:
    for steps that take seconds."""
    device = torch.device(args.device)
    n = pset.n_params
    base = dict(ours=ours, notes=notes, min_bytes_per_param=min_bytes / n,
                kernel_bytes_per_param=None if kernel_bytes is None else kernel_bytes / n)
    if _over_budget(args):
        return skipped(args, bench, impl, pset, dtype, "time budget of the run spent", **base)
    if args.only and not any(s in impl for s in args.only):
        return skipped(args, bench, impl, pset, dtype, "not selected (--only)", **base)
    try:
        return _measure(args, bench, impl, pset, dtype, make_opt, base, backend, step, seed, first, reps)
    except Exception as e:  # noqa: BLE001 - one failing implementation must not end the suite; recorded
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        return _result(args, bench, impl, pset, dtype, status="error", reason=msg, **base)
    finally:
        _free(device)


def _measure(args, bench, impl, pset, dtype, make_opt, base, backend, step, seed, first, reps) -> dict:
    device = torch.device(args.device)
    n = pset.n_params
    params = make_params(pset, dtype, device, seed)
    try:
        opt = make_opt(params)
    except Exception as e:  # noqa: BLE001 - a competitor that cannot run here is recorded, not fatal
        return skipped(args, bench, impl, pset, dtype, f"could not be constructed: {type(e).__name__}: {e}"[:300],
                       **base)
    label = backend(params) if callable(backend) else backend
    fn = (lambda: step(opt, params)) if step is not None else opt.step
    with first() if first is not None else contextlib.nullcontext():
        fn()  # creates the state (and compiles kernels)
    _sync(device)
    sbytes = state_bytes(opt)
    scratch = scratch_bytes(opt)
    if reps is None:
        q, reps = time_fn(fn, device, args.warmup_ms, args.rep_ms)
        launches, copies = count_launches(fn, device)
    else:
        times = sorted(_wall(fn, device, 1) for _ in range(reps))
        q = [times[0], statistics.median(times), times[-1]]
        launches, copies = count_launches(fn, device, steps=1)
    cp = copy_bandwidth(args)
    mb, kb = base["min_bytes_per_param"], base["kernel_bytes_per_param"]
    gbps = mb * n / (q[1] * 1e-3) / 1e9
    return _result(args, bench, impl, pset, dtype, backend=label, ms_p20=q[0], ms_median=q[1], ms_p80=q[2],
                   n_timed=reps, gbps=gbps, frac_copy=gbps / cp["gbps"],
                   kernel_gbps=None if kb is None else kb * n / (q[1] * 1e-3) / 1e9,
                   kernel_frac_copy=None if kb is None else kb * n / (q[1] * 1e-3) / 1e9 / cp["gbps"],
                   state_bytes=sbytes, state_bytes_per_param=sbytes / n, scratch_bytes_per_param=scratch / n, launches_per_step=launches, copies_per_step=copies, **base)


# ---- machine, outputs ---------------------------------------------------------------------------------
def _git(*cmd) -> str | None:
    try:
        r = subprocess.run(["git", *cmd], cwd=REPO_DIR, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def machine_info(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        extra = dict(sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                     cpu_threads=None)
    else:
        name = platform.processor() or platform.machine()
        extra = dict(cpu_count=os.cpu_count(), cpu_threads=torch.get_num_threads())
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    commit = _git("rev-parse", "HEAD") or os.environ.get("FASTOPT_COMMIT") or "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no")
    dirty = None if status is None else bool(status)
    return dict(device=str(device), device_name=name, torch=torch.__version__, triton=triton_v,
                cuda=torch.version.cuda, python=platform.python_version(), commit=commit, dirty=dirty,
                cpu_numbers=device.type != "cuda", date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                fp32_matmul=torch.backends.cuda.matmul.fp32_precision, **extra)


def device_tag(args) -> str:
    """`cpu` or the GPU's name; `-tf32` after it for a --tf32 run, whose files then stand beside the default's."""
    device = torch.device(args.device)
    tf32 = "-tf32" if getattr(args, "tf32", False) else ""
    if device.type != "cuda":
        return "cpu" + tf32
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    return (re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cuda") + tf32


def machine_line(m: dict) -> str:
    commit = m["commit"][:12] + (" (uncommitted changes)" if m.get("dirty") else "")
    tf32 = " · fp32 matmuls in TF32" if m.get("fp32_matmul") == "tf32" else ""
    return (f"{m['device_name']} · torch {m['torch']} · Triton {m['triton']}{tf32} · commit {commit} · {m['date']}")


def add_speedups(results: list[dict]) -> None:
    """On each of our rows: speedup = fastest other ok implementation's median / ours, in the same
    (bench, set, dtype)."""
    for r in results:
        if not r.get("ours") or r["status"] != "ok":
            continue
        others = [o for o in results if not o.get("ours") and o["status"] == "ok" and o["bench"] == r["bench"]
                  and o["set"] == r["set"] and o["dtype"] == r["dtype"]]
        if others:
            best = min(others, key=lambda o: o["ms_median"])
            r["speedup"] = best["ms_median"] / r["ms_median"]
            r["baseline"] = best["impl"]


# The issues' targets (H100), checked on every run; `targets()` rows go to the JSON and the table.
# (bench prefix, our impl, baseline impl or None for the fastest other one, speedup factor)
SPEED_TARGETS = (
    ("adafactor", "fastopt.Adafactor", None, 5.0),
    ("came", "fastopt.CAME", "came-pytorch CAME", 5.0),
    ("lamb", "fastopt.Lamb", "eager LAMB (per-param loop)", 3.0),
    ("galore-", "fastopt.GaLoreAdamW", "galore-torch GaLoreAdamW", 3.0),
    ("galore8-", "fastopt.GaLoreAdamW8bit", "galore-torch GaLoreAdamW8bit", 3.0),
    ("adamw8bit", "fastopt.AdamW8bit", "torch.optim.AdamW(fused)", 1.0),
)
BANDWIDTH_TARGET = 0.8      # of the copy bandwidth, over the step's minimal bytes (issue 9)
STATE_TARGET_ADAMW8BIT = 0.255  # of torch's fused fp32 AdamW state: "a quarter", 2.03 of 8 B/param (issue 5)
OVERHEAD_TARGET = 0.05      # layout machinery over the single-process step


def _matches(r: dict, bench: str, impl: str) -> bool:
    b = r["bench"]
    if b.endswith("-refresh"):  # GaLore's refresh steps are reported, not targeted
        return False
    bench_ok = b.startswith(bench) if bench.endswith("-") else b == bench
    return bench_ok and (r["impl"] == impl or r["impl"].startswith(impl + "("))


def targets(results: list[dict]) -> list[dict]:
    """One row per (target, case): `what`, `case`, `measured` (a number), `goal`, `met` (bool, or None where
    the case did not run). Speed: our median against the named baseline's in the same (bench, set, dtype);
    bandwidth, as issue 9 words it: the step's minimal bytes over the median time, over the copy bandwidth
    (`frac_copy`). What the kernels actually move (`kernel_frac_copy`: Adafactor's, CAME's and Lamb's exact
    statistics read the gradient or the param in more than one pass) is in the table, not judged."""
    rows = []

    def case(r):
        return f"{r['bench']} · {r['impl']} · {r['set']} · {r['dtype']}"

    def add(what, r, measured, goal, at_least=True):
        met = None if measured is None else (measured >= goal if at_least else measured <= goal)
        rows.append(dict(what=what, case=case(r), measured=measured, goal=goal, at_least=at_least, met=met))

    for bench, impl, base, factor in SPEED_TARGETS:
        for r in results:
            if not r.get("ours") or not _matches(r, bench, impl):
                continue
            ok = r["status"] == "ok"
            if base is None:
                speed = r.get("speedup") if ok else None
                add(f"speed >= {factor:g}x the fastest eager one", r, speed, factor)
            else:
                ref = [o for o in results if o["impl"] == base and o["bench"] == r["bench"] and o["set"] == r["set"]
                       and o["dtype"] == r["dtype"] and o["status"] == "ok"]
                speed = ref[0]["ms_median"] / r["ms_median"] if ok and ref else None
                add(f"speed >= {factor:g}x {base}", r, speed, factor)
                if bench == "adamw8bit":
                    state = (r["state_bytes"] / ref[0]["state_bytes"]) if ok and ref and ref[0]["state_bytes"] else None
                    add(f"state <= {STATE_TARGET_ADAMW8BIT:g} of {base}'s (2.03 of 8 B/param)", r, state, STATE_TARGET_ADAMW8BIT,
                        at_least=False)
            add(f"minimal bytes >= {BANDWIDTH_TARGET:.0%} of copy bandwidth", r,
                r.get("frac_copy") if ok else None, BANDWIDTH_TARGET)
    for r in results:
        if r.get("ours") and r["bench"] in ("quantize", "dequantize"):
            add(f"minimal bytes >= {BANDWIDTH_TARGET:.0%} of copy bandwidth", r,
                r.get("frac_copy") if r["status"] == "ok" else None, BANDWIDTH_TARGET)
        if r.get("overhead_frac") is not None:
            add(f"layout machinery <= {OVERHEAD_TARGET:.0%} of the step", r, r["overhead_frac"], OVERHEAD_TARGET,
                at_least=False)
    return rows


def targets_table(rows: list[dict], cpu_numbers: bool) -> list[str]:
    if not rows:
        return []
    met = sum(1 for t in rows if t["met"])
    lines = ["", "## Targets (the issues' H100 targets)", ""]
    if cpu_numbers:
        lines += ["CPU numbers: the targets are for an H100, so none is judged here (met: –).", ""]
    else:
        lines += [f"{met} of {len(rows)} met ({sum(1 for t in rows if t['met'] is None)} did not run).", ""]
    lines += ["| target | case | measured | met |", "|---|---|---|---|"]
    for t in rows:
        m = t["measured"]
        shown = "–" if m is None else (f"{m:.2f}x" if "speed" in t["what"] else f"{100 * m:.1f}%")
        verdict = "–" if t["met"] is None or cpu_numbers else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['what']} | {t['case']} | {shown} | {verdict} |")
    return lines


def _fmt(x, spec="{:.3g}"):
    return "–" if x is None else spec.format(x)


def markdown_table(results: list[dict], machine: dict, copy: dict | None, title: str = "") -> str:
    lines = []
    if title:
        lines += [f"# {title}", ""]
    if machine.get("cpu_numbers"):
        lines += ["**CPU numbers** (no GPU: reduced sizes, fastopt on its torch reference path unless the backend "
                  "column says otherwise). They prove the harness runs; they say nothing about GPU speed.", ""]
    lines += [f"Machine: {machine_line(machine)}", ""]
    if copy:
        lines += [f"Device-to-device copy measured in the same run: {copy['gbps']:.4g} GB/s "
                  f"({copy['bytes'] / 2**20:.0f} MiB moved, bytes read + written, median {copy['ms_median']:.3g} ms).",
                  ""]
    lines += ["ms: median step time, [p20–p80]. GB/s and % copy: the minimal bytes of the step (min B/param, each "
              "input read once and each output written once) over the median time; kernel B/param: what our "
              "kernels actually move, and kernel % copy the same over the median time. scratch B/param: the device "
              "buffers our kernels keep beside the state. speedup: the fastest other implementation's median over "
              "ours.", ""]
    hdr = ["bench", "params", "dtype", "impl", "backend", "ms [p20–p80]", "speedup", "min B/param",
           "kernel B/param", "GB/s", "% copy", "kernel % copy", "state B/param", "scratch B/param", "launches/step",
           "status"]
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|" + "---|" * len(hdr))
    for r in results:
        if r["status"] == "ok":
            ms = f"{r['ms_median']:.3g} [{r['ms_p20']:.3g}–{r['ms_p80']:.3g}]"
            status = "ok"
        else:
            ms = "–"
            status = f"{r['status']}: {r['reason']}".replace("|", "/")
        lines.append("| " + " | ".join([
            r["bench"], f"{r['set_label']}, {r['n_params'] / 1e6:.4g}M", r["dtype"],
            ("**" + r["impl"] + "**") if r.get("ours") else r["impl"], r.get("backend") or "–", ms,
            _fmt(r.get("speedup"), "{:.2f}x"), _fmt(r.get("min_bytes_per_param"), "{:.2f}"),
            _fmt(r.get("kernel_bytes_per_param"), "{:.2f}"), _fmt(r.get("gbps"), "{:.4g}"),
            _fmt(None if r.get("frac_copy") is None else 100 * r["frac_copy"], "{:.0f}%"),
            _fmt(None if r.get("kernel_frac_copy") is None else 100 * r["kernel_frac_copy"], "{:.0f}%"),
            _fmt(r.get("state_bytes_per_param"), "{:.3g}"), _fmt(r.get("scratch_bytes_per_param"), "{:.3g}"),
            _fmt(r.get("launches_per_step"), "{:.0f}"), status,
        ]) + " |")
    lines += targets_table(targets(results), bool(machine.get("cpu_numbers")))
    notes = sorted({f"{r['bench']}/{r['impl']}: {r['notes']}" for r in results if r.get("notes")})
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], machine: dict, path: Path) -> Path | None:
    """Bar chart: median ms per step (log scale, p20–p80 whiskers) and % of copy bandwidth, per case
    (bench, set, dtype); one colour per implementation. None without matplotlib (the JSON and the table are
    written all the same)."""
    try:
        import matplotlib
    except ImportError as e:
        print(f"   no plot: {e}", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return None
    cases = list(dict.fromkeys((r["bench"], r["set"], r["dtype"]) for r in ok))
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    cmap = plt.get_cmap("tab10" if len(impls) <= 10 else "tab20")
    colour = {impl: cmap(k % cmap.N) for k, impl in enumerate(impls)}
    per_case = max(sum(1 for r in ok if (r["bench"], r["set"], r["dtype"]) == c) for c in cases)
    fig, axes = plt.subplots(2, 1, figsize=(min(40, max(8, 0.45 * per_case * len(cases) + 3)), 8), squeeze=False)
    ax_t, ax_b = axes[0][0], axes[1][0]
    seen = set()
    for c, case in enumerate(cases):
        rows = [r for r in ok if (r["bench"], r["set"], r["dtype"]) == case]
        width = 0.8 / len(rows)
        for k, r in enumerate(rows):
            x = c + (k - (len(rows) - 1) / 2) * width
            label = None if r["impl"] in seen else r["impl"]
            seen.add(r["impl"])
            err = [[r["ms_median"] - r["ms_p20"]], [r["ms_p80"] - r["ms_median"]]]
            ax_t.bar(x, r["ms_median"], width, yerr=err, capsize=2, color=colour[r["impl"]], label=label,
                     edgecolor="black" if r.get("ours") else None)
            ax_b.bar(x, 100 * r["frac_copy"], width, color=colour[r["impl"]],
                     edgecolor="black" if r.get("ours") else None)
    labels = [f"{b}\n{s} {d}" for b, s, d in cases]
    for ax in (ax_t, ax_b):
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(labels, fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("ms per step (median, p20–p80)")
    ax_b.set_ylabel("% of measured copy bandwidth\n(minimal bytes / median time)")
    ax_b.axhline(80, color="grey", lw=0.8, ls="--")
    ax_t.legend(fontsize=7, ncol=min(4, len(impls)))
    title = machine_line(machine)
    if machine.get("cpu_numbers"):
        title = "CPU numbers (reduced sizes) — " + title
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(results: list[dict], args, name: str, *, machine: dict | None = None) -> dict[str, Path]:
    """`<name>-<device>.json`, `.md` and `.png` under args.out (default bench/results/)."""
    out = Path(args.out) if args.out else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    machine = machine or machine_info(args)
    add_speedups(results)
    copy = _COPY.get((str(args.device), args.copy_mb))
    stem = f"{name}-{device_tag(args)}"
    doc = dict(schema=SCHEMA, name=name, machine=machine, cpu_numbers=machine["cpu_numbers"], copy=copy,
               settings=dict(sets=args.sets, dtypes=args.dtypes, layers_7b=args.layers_7b, layers_1b=args.layers_1b,
                             scale=args.scale, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, copy_mb=args.copy_mb),
               fields=list(FIELDS), results=results, targets=targets(results))
    if machine["cpu_numbers"]:
        doc["note"] = CPU_NOTE
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(doc, indent=1) + "\n")
    paths["md"].write_text(markdown_table(results, machine, copy, title=f"fastopt benchmark: {name}"))
    png = plot(results, machine, out / f"{stem}.png")
    if png is not None:
        paths["png"] = png
    return paths


# ---- command line -------------------------------------------------------------------------------------
def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _csv_of(choices) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated, non-empty list of names from `choices`."""
    def parse(s: str) -> list[str]:
        items = _csv(s)
        if not items:
            raise argparse.ArgumentTypeError(f"{s!r}: give at least one of {', '.join(choices)}")
        for x in items:
            if x not in choices:
                raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(choices)}")
        return items
    return parse


def number(kind: type, lo: float, hi: float | None = None, *, lo_open: bool = False,
            why: str = "") -> Callable[[str], float]:
    """argparse type: a finite `kind` (int or float) >= lo (> lo with `lo_open`) and <= hi. A bad value is an
    argparse error (exit code 2) that names the flag, the value and the range."""
    rng = (f"in [{lo:g}, {hi:g}]" if hi is not None else f"{'>' if lo_open else '>='} {lo:g}") + why

    def parse(s: str):
        try:
            x = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s}: not {'an integer' if kind is int else 'a number'}, must be "
                                             f"{rng}") from None
        if not (math.isfinite(x) and (x > lo if lo_open else x >= lo) and (hi is None or x <= hi)):
            raise argparse.ArgumentTypeError(f"{s}: must be {rng}")
        return x
    return parse


def _device(s: str) -> str:
    try:
        kind = torch.device(s).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{s!r}: must be cpu or cuda (cuda:N)")
    return s


def parser(description: str = "fastopt benchmark", prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, prog=prog)
    n7, n1 = LLAMA_7B.layers, LLAMA_1B.layers
    p.add_argument("--device", type=_device, default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--sets", type=_csv_of(MODELS), default=["7b", "1b"], help="parameter sets: 7b,1b")
    p.add_argument("--dtypes", type=_csv_of(DTYPES), default=["fp32", "bf16"],
                   help="param dtypes: fp32,bf16[,fp16,fp64]")
    p.add_argument("--layers-7b", type=number(int, 1, n7, why=f" (the 7B set has {n7} layers)"), default=None,
                   help=f"decoder layers of the 7B set (1 to {n7}; default 4 on CUDA, 1 on CPU)")
    p.add_argument("--layers-1b", type=number(int, 1, n1, why=f" (the 1B set has {n1} layers)"), default=None,
                   help=f"decoder layers of the 1B set (1 to {n1}; default {n1} on CUDA, 1 on CPU)")
    p.add_argument("--scale", type=number(int, 1), default=None, help="divide every dimension by this, >= 1 "
                   "(default 1 on CUDA, 16 on CPU)")
    p.add_argument("--warmup-ms", type=number(float, 0), default=None,
                   help="warm-up per timing, >= 0 (default 50 CUDA, 20 CPU)")
    p.add_argument("--rep-ms", type=number(float, 0, lo_open=True), default=None,
                   help="timed time per measurement, > 0 (default 300 CUDA, 200 CPU)")
    p.add_argument("--copy-mb", type=number(int, 1), default=None,
                   help="copy-bandwidth buffer, MiB, >= 1 (default 2048 CUDA, 64 CPU)")
    p.add_argument("--only", type=_csv, default=[], help="time only implementations whose name contains one of these")
    p.add_argument("--budget-s", type=number(float, 0, lo_open=True), default=None,
                   help="stop timing (rows become 'skipped') after this many seconds, > 0")
    p.add_argument("--tf32", action="store_true",
                   help="fp32 matmuls in TF32 for every implementation (torch.set_float32_matmul_precision('high'):"
                        " galore-torch's products, and fastopt's GaLore follows it); default: torch's")
    p.add_argument("--out", default=None, help=f"output folder (default {RESULTS_DIR})")
    return p


def finish_args(args, p: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Fill the device-dependent defaults and the deadline (the values themselves are checked by `parser()`);
    an error names its argument through `p.error` (usage, exit code 2) as the parser's own do."""
    def error(msg):
        if p is None:
            raise SystemExit(msg)
        p.error(msg)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        error(f"argument --device: {args.device} but CUDA is not available")
    for name, gpu, cpu in (("layers_7b", 4, 1), ("layers_1b", 22, 1), ("scale", 1, 16), ("warmup_ms", 50.0, 20.0),
                           ("rep_ms", 300.0, 200.0), ("copy_mb", 2048, 64)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    out = Path(args.out) if args.out else RESULTS_DIR
    why = unwritable_folder(out)  # before any timing, not after the first bench
    if why:
        error(f"argument --out: {out} cannot be created or written ({why})")
    args.deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    if args.tf32:  # for the whole process, as a training script would set it; the JSON's machine.fp32_matmul.
        # The legacy setter: code that reads the legacy flags (allow_tf32) fails after the new API's setter.
        torch.set_float32_matmul_precision("high")
    return args


@contextlib.contextmanager
def cpu_mode(args):
    """Around a whole run. In CPU mode (no CUDA device, or --device cpu): print first that the numbers are CPU
    numbers, and step with one torch thread unless OMP_NUM_THREADS says otherwise: torch's default of one
    thread per core ran a loaded 2-core machine 10-100x slower (740 ms/step against 6.6 ms with one thread).
    The thread count goes to the JSON's `machine.cpu_threads`; the previous count is restored on the way out."""
    if torch.device(args.device).type == "cuda":
        yield
        return
    before = torch.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not omp:
        torch.set_num_threads(1)
    n = torch.get_num_threads()
    threads = f"{n} torch thread{'s' if n != 1 else ''} " + (
        f"(OMP_NUM_THREADS={omp})" if omp else "(OMP_NUM_THREADS unset: set it to use more)")
    try:
        from fastopt import ops
        triton = ("Triton on, through its interpreter" if ops.use_triton(torch.empty(0))
                  else "Triton off (fastopt on its torch reference path)")
    except Exception as e:  # noqa: BLE001 - FASTOPT_BACKEND=triton without the interpreter: each row says why
        triton = f"Triton: {type(e).__name__}"
    why = "no CUDA device" if not torch.cuda.is_available() else "--device cpu"
    print(f"CPU mode ({why}): dimensions /{args.scale}, {triton}, {threads}. {CPU_NOTE}", flush=True)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def print_results(results: list[dict]) -> None:
    """One line per row; our rows show their speedup, which `add_speedups()` (run by `write_outputs()`) fills."""
    w = max([10] + [len(r["bench"]) for r in results])
    for r in results:
        head = f"  {r['bench']:{w}s} {r['set']:3s} {r['dtype']:5s} {r['impl']:32s}"
        if r["status"] == "ok":
            sp = f"  {r['speedup']:.2f}x vs {r['baseline']}" if r.get("speedup") else ""
            print(f"{head} {r['ms_median']:9.3f} ms {r['gbps']:8.1f} GB/s {100 * r['frac_copy']:5.1f}% copy{sp}",
                  flush=True)
        else:
            print(f"{head} {r['status']}: {r['reason']}", flush=True)


def check_only(args, results: list[dict]) -> None:
    """After a run: an `--only` name that selected no implementation is a typo, which would otherwise pass as a
    run that measured less. None selected anything: exit with an error (exit code 2); some did: a warning.
    Either lists the implementations the run offered."""
    if not args.only:
        return
    impls = sorted({r["impl"] for r in results if r["impl"] != "(bench)"})
    unmatched = [s for s in args.only if not any(s in impl for impl in impls)]
    if not unmatched:
        return
    msg = (f"argument --only: {', '.join(unmatched)} matched no implementation of this run "
           f"(its implementations: {', '.join(impls) or 'none'})")
    if len(unmatched) == len(args.only):
        print(f"error: {msg}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def main(stem: str, run: Callable, argv=None) -> dict[str, Path]:
    """Entry point of a single `bench_<stem>.py` run as a script."""
    p = parser(f"fastopt benchmark: {stem}")
    args = finish_args(p.parse_args(argv), p)
    with cpu_mode(args):
        results = run(args)
        paths = write_outputs(results, args, stem)
    print_results(results)
    for p in paths.values():
        print(f"wrote {p}")
    check_only(args, results)
    return paths
