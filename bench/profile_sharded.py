"""Host time of one optimizer step on FSDP2-like pieces: every param a DTensor sharded Shard(0) over a 1-D mesh of
`--world` gloo processes on CPU, the fused path's kernels stubbed out (bench/profile_step.py's --stub-kernels).

    python bench/profile_sharded.py --optim galore --set 1b --scale 8 --world 2

What it times is the Python of a sharded step (the layouts' views, job tables, launches, collectives' packing)
and the gloo collectives themselves; the kernels do nothing, so the params do not change. Prints rank 0's median
host ms per step and the (stubbed) Triton launches per step; --json writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from . import common, profile_step
except ImportError:
    import common
    import profile_step


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optim", choices=sorted(profile_step.OPTIMS), default="galore")
    ap.add_argument("--set", choices=sorted(common.MODELS), default="1b")
    ap.add_argument("--layers", type=common.number(int, 1), default=None, help="decoder layers (default: 4 of 7b's 32, all 22 of 1b's)")
    ap.add_argument("--scale", type=common.number(int, 1), default=8, help="divide every dimension by this")
    ap.add_argument("--rank", type=common.number(int, 1), default=128, help="GaLore's rank (divided by --scale)")
    ap.add_argument("--world", type=common.number(int, 1), default=2, help="gloo processes")
    ap.add_argument("--warmup", type=common.number(int, 0), default=3)
    ap.add_argument("--steps", type=common.number(int, 1), default=10)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    # one process of the run: its rank, the rendezvous file, where rank 0 writes its numbers
    ap.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _rank(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.world)
    try:
        mesh = init_device_mesh("cpu", (args.world,))
        pset = profile_step.param_set(args)
        gen = torch.Generator().manual_seed(0)
        params = []
        for _, shape in pset.shapes:
            p = torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen) * 0.02, mesh, [Shard(0)]))
            p.grad = distribute_tensor(torch.randn(shape, generator=gen), mesh, [Shard(0)])
            params.append(p)
        with profile_step.stubbed_kernels():
            opt = profile_step.OPTIMS[args.optim](pset, params, args)
            profile_step.warm_up(opt, args)
            host = []
            profile_step._NoLaunch.count = 0
            for _ in range(args.steps):
                t0 = time.perf_counter()
                opt.step()
                host.append((time.perf_counter() - t0) * 1e3)
        if rank == 0:
            r = {"optim": args.optim, "set": pset.label, "n_params": pset.n_params, "n_tensors": len(params),
                 "world": args.world, "rank": args.rank if args.optim.startswith("galore") else None,
                 "torch": torch.__version__, "steps": args.steps, "host_ms": statistics.median(host),
                 "launches": profile_step._NoLaunch.count / args.steps}
            Path(out).write_text(json.dumps(r))
        dist.barrier()  # no rank closes its connections while another still talks to it
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker is not None:
        rank, init, out = args.worker
        _rank(int(rank), args, init, out)
        # The work is done and written. Leave without the interpreter's teardown: gloo's background threads can
        # abort it ("terminate called without an active exception": rank 1 exited with -6 in a suite run, after
        # the barrier and destroy_process_group below), as fastopt.demo's and bench_zero's ranks do.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    # The ranks run this file (not a pickled function: the suite loads bench/ as a package of its own, which
    # spawned interpreters could not import).
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "rank0.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(r), init, out], env=env)
                 for r in range(args.world)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"profile_sharded: ranks exited with {codes}")
        r = json.loads(Path(out).read_text())
    return profile_step.finish(r, f"{r['optim']} on {r['set']}, {r['n_params'] / 1e6:.1f}M params in "
                               f"{r['n_tensors']} tensors, Shard(0) over {r['world']} gloo processes, torch "
                               f"{r['torch']}, Triton launches stubbed out\n"
                               f"  host   {r['host_ms']:9.3f} ms/step (rank 0, median of {r['steps']})\n"
                               f"  {r['launches']:.0f} (stubbed) Triton launches/step", args.json)


if __name__ == "__main__":
    main()
