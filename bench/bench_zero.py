"""fastopt.ZeroRedundancyOptimizer: data-parallel memory and time, and the wrapper's own overhead.

Two measurements:

1. Data parallelism on CPU processes (`python bench/bench_zero.py`, gloo, `--world` processes, default 2):
   an MLP of `--layers` Linear(`--dim`, `--dim`) layers trained with torch.optim.AdamW (`--opt adafactor`:
   fastopt.Adafactor with beta1=0.9) under
   - "DDP": torch's DistributedDataParallel and the plain optimizer: every rank holds all state;
   - "ZeRO-1", "ZeRO-1 overlap", "ZeRO-2", "ZeRO-2 overlap": the model unwrapped, the optimizer wrapped.
   Per scheme, in fresh processes: the median [p20-p80] time of one iteration (zero_grad, forward, backward,
   step; rank 0's clock, a barrier before each), the peak resident memory of rank 0 over its resident
   memory before the optimizer was built (`ru_maxrss` minus RSS: includes every temporary), and exact tensor
   counts on rank 0 (bytes of the distinct storages): optimizer state bytes, and gradient bytes held after
   backward (`.grad` plus the wrapper's ZeRO-2 accumulators, which hold one count per param after the
   gradients). The processes run with `MALLOC_MMAP_THRESHOLD_=65536`, so that glibc
   hands large blocks back at free and resident memory follows the live tensors (this slows allocation for
   every scheme alike). Written to `bench/results/zero-dp-cpu.{json,md}`.
2. The wrapper at world size 1 (`run(args)`, the suite interface of bench/common.py; run by
   `bench/run.py` and by this script unless `--no-overhead`): one `step()` of fastopt.Adafactor alone and
   wrapped (no process group), over the suite's parameter sets, on CUDA when present. At world size 1 the
   wrapper communicates nothing; the difference is its bookkeeping (hyperparameter sync per step).

CPU timings of several processes on a shared machine measure the machine as much as the scheme: compare the
rows of one run only, and read the memory columns first.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from . import common
except ImportError:
    import common

import fastopt

STEM = "zero"
SCHEMES = {
    "DDP": None,
    "ZeRO-1": dict(partition_grad=False, overlap_communication=False),
    "ZeRO-1 overlap": dict(partition_grad=False, overlap_communication=True),
    "ZeRO-2": dict(partition_grad=True, overlap_communication=False),
    "ZeRO-2 overlap": dict(partition_grad=True, overlap_communication=True),
}


def _backend(params) -> str:
    return "triton" if fastopt.ops.use_triton(params[0]) else "torch reference"


# ---- 2. the suite rows: overhead at world size 1 -----------------------------------------------------------
def run(args) -> list[dict]:
    out = []
    for pset in common.param_sets(args):
        for dtype in common.dtypes(args):
            mb = common.min_bytes(pset, dtype, reads=2, writes=1, factored_state=1, vector_state=1)
            out.append(common.measure(args, STEM, "ZeRO wrapper(fastopt.Adafactor), world 1", pset, dtype,
                                      lambda ps: fastopt.ZeroRedundancyOptimizer(fastopt.Adafactor(ps)),
                                      min_bytes=mb, ours=True, backend=_backend,
                                      notes="no process group: the wrapper's bookkeeping around the same step"))
            out.append(common.measure(args, STEM, "fastopt.Adafactor", pset, dtype, lambda ps: fastopt.Adafactor(ps),
                                      min_bytes=mb, backend=_backend))
    return out


# ---- 1. data parallelism on CPU processes -----------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensor_bytes(ts) -> int:
    """Bytes of the distinct storages behind `ts` (views of one flat buffer count the buffer once)."""
    seen, total = set(), 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def _dp_worker(rank: int, world: int, init_file: str, out_dir: str, cfg: dict) -> tuple:
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    d = cfg["dim"]
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh())
                                  for _ in range(cfg["layers"])])
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], d, generator=gen)
    y = torch.randn(cfg["batch"], d, generator=gen)
    params = list(model.parameters())
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-3)) if cfg["opt"] == "adamw" else \
        (lambda ps: fastopt.Adafactor(ps, beta1=0.9))
    # Warm-up outside the measurement: a first backward, and a first optimizer step on a tiny param (its
    # first call imports torch internals worth more resident memory than a small model's state).
    torch.nn.functional.mse_loss(model(x), y).backward()
    tiny = torch.nn.Parameter(torch.zeros(4, 4))
    tiny.grad = torch.ones(4, 4)
    make([tiny]).step()
    for p in params:
        p.grad = None
    dist.barrier()
    base_rss = _rss_bytes()
    scheme = SCHEMES[cfg["scheme"]]
    if scheme is None:
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_mb"])
        opt = make(params)
    else:
        net = model
        opt = fastopt.ZeroRedundancyOptimizer(make(params), bucket_size_mb=cfg["bucket_mb"], **scheme)
    times, grad_bytes = [], 0
    for it in range(cfg["warmup"] + cfg["iters"]):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        if it == 0:
            held = [p.grad for p in params]
            if scheme is not None:
                held += [b.acc for b in opt._red]
            grad_bytes = _tensor_bytes(held)
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    inner = opt if scheme is None else opt.optim
    state = _tensor_bytes(t for st in inner.state.values() for t in st.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    timed = times[cfg["warmup"]:]
    qs = statistics.quantiles(timed, n=10, method="inclusive")
    res = dict(rank=rank, ms_median=statistics.median(timed), ms_p20=qs[1], ms_p80=qs[7], n_timed=len(timed),
               state_bytes=state, grad_bytes=grad_bytes, peak_over_base_bytes=peak - base_rss,
               param_bytes=_tensor_bytes(params))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()  # no rank closes its connections while another still talks to it
    dist.destroy_process_group()
    return net, opt  # for the caller to keep alive: see _dp_spawned


def _dp_spawned(rank: int, world: int, init_file: str, out_dir: str, cfg: dict) -> None:
    keep = _dp_worker(rank, world, init_file, out_dir, cfg)  # noqa: F841 - never freed, on purpose
    # The work is done and written. Leave without the interpreter's teardown: gloo's background threads can
    # abort it ("terminate called without an active exception"), which mp.spawn would report as a failure.
    # Nor is DDP freed first: its Reducer held the last reference to the destroyed gloo group, whose destructor
    # joined a gloo thread that waited for the GIL this thread held (a hung CI run, torch 2.13, 2026-11-24).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_dp(cfg: dict, schemes=tuple(SCHEMES)) -> list[dict]:
    """One row per scheme (names of SCHEMES), each measured in `cfg["world"]` fresh processes."""
    import torch.multiprocessing as mp

    # glibc: big blocks from mmap, returned at free, so that resident memory follows the live tensors (by
    # default the mmap threshold grows after the first free and freed blocks linger in the heap).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    rows = []
    for scheme in schemes:
        with tempfile.TemporaryDirectory(prefix="fastopt-bench-zero-") as tmp:
            c = dict(cfg, scheme=scheme)
            mp.spawn(_dp_spawned, args=(cfg["world"], os.path.join(tmp, "rdv"), tmp, c), nprocs=cfg["world"],
                     join=True)
            per = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(cfg["world"])]
        r0 = per[0]
        rows.append(dict(scheme=scheme, **{k: r0[k] for k in ("ms_median", "ms_p20", "ms_p80", "n_timed",
                                                                "state_bytes", "grad_bytes", "peak_over_base_bytes",
                                                                "param_bytes")},
                         state_bytes_per_rank=[p["state_bytes"] for p in per],
                         grad_bytes_per_rank=[p["grad_bytes"] for p in per]))
        print(f"  {scheme:15s} {r0['ms_median']:9.2f} ms  state {r0['state_bytes'] / 2**20:8.2f} MiB  "
              f"grads {r0['grad_bytes'] / 2**20:8.2f} MiB  "
              f"peak over base {r0['peak_over_base_bytes'] / 2**20:8.1f} MiB", flush=True)
    return rows


def dp_markdown(rows: list[dict], cfg: dict, machine: dict) -> str:
    mib = 2 ** 20
    lines = ["# fastopt benchmark: ZeRO-1/2 vs DDP on CPU processes", "",
             "**CPU numbers**: gloo over local processes on a shared machine; compare rows of this run only.", "",
             f"Machine: {common.machine_line(machine)} · {machine.get('cpu_count')} CPUs", "",
             f"{cfg['world']} processes × {cfg['threads']} thread(s); model: {cfg['layers']} × Linear({cfg['dim']}, "
             f"{cfg['dim']}) + tanh, {rows[0]['param_bytes'] / mib:.1f} MiB of fp32 params; local batch "
             f"{cfg['batch']}; optimizer {cfg['opt']}; buckets {cfg['bucket_mb']} MiB; {cfg['iters']} timed "
             f"iterations after {cfg['warmup']}.", "",
             "ms: one iteration (zero_grad, forward, backward, step) on rank 0, median [p20–p80]. state / grads: "
             "tensor bytes on rank 0 (grads: held after backward, ZeRO-2 accumulators included). peak: rank 0's "
             "peak resident memory over its resident memory before the optimizer was built.", "",
             "| scheme | ms [p20–p80] | state MiB (rank 0) | grads MiB (rank 0) | peak over base MiB |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['ms_median']:.3g} [{r['ms_p20']:.3g}–{r['ms_p80']:.3g}] | "
                     f"{r['state_bytes'] / mib:.2f} | {r['grad_bytes'] / mib:.2f} | "
                     f"{r['peak_over_base_bytes'] / mib:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = common.parser("fastopt benchmark: ZeRO-1/2 vs DDP (CPU processes) and the wrapper's overhead")
    count = common.number
    p.add_argument("--world", type=count(int, 1), default=2, help="CPU processes for the data-parallel comparison")
    p.add_argument("--threads", type=count(int, 1), default=1, help="intra-op threads per process")
    p.add_argument("--dim", type=count(int, 1), default=1024)
    p.add_argument("--layers", type=count(int, 1), default=8)
    p.add_argument("--batch", type=count(int, 1), default=32, help="local batch per rank")
    p.add_argument("--opt", choices=["adamw", "adafactor"], default="adamw")
    p.add_argument("--bucket-mb", type=count(float, 0, lo_open=True), default=25.0)
    p.add_argument("--warmup", type=count(int, 0), default=3)
    p.add_argument("--iters", type=count(int, 1), default=10)
    p.add_argument("--no-dp", action="store_true", help="skip the data-parallel comparison")
    p.add_argument("--no-overhead", action="store_true", help="skip the world-size-1 overhead rows")
    args = common.finish_args(p.parse_args(argv), p)
    machine = common.machine_info(args)
    out = Path(args.out) if args.out else common.RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    if not args.no_dp:
        cfg = dict(world=args.world, threads=args.threads, dim=args.dim, layers=args.layers, batch=args.batch,
                   opt=args.opt, bucket_mb=args.bucket_mb, warmup=args.warmup, iters=args.iters)
        print(f"data parallel: {cfg}", flush=True)
        rows = run_dp(cfg)
        stem = "zero-dp-cpu"
        (out / f"{stem}.json").write_text(json.dumps(dict(schema=common.SCHEMA, name="zero-dp", machine=machine,
                                                          cpu_numbers=True, settings=cfg, results=rows),
                                                     indent=1) + "\n")
        (out / f"{stem}.md").write_text(dp_markdown(rows, cfg, machine))
        print(f"wrote {out / (stem + '.json')}\nwrote {out / (stem + '.md')}")
    if not args.no_overhead:
        results = run(args)
        paths = common.write_outputs(results, args, STEM, machine=machine)
        common.print_results(results)
        for path in paths.values():
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
