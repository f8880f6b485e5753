"""GaLore's matmul tiles on this GPU: the step time of fastopt.GaLoreAdamW (no SVD) for tile choices of the
projection and of the back-projection (kernels/galore.py's TILES_SM90 on an H100/H200, TILES elsewhere).

    python bench/galore_tiles.py [--set 7b] [--dtypes fp32,bf16] [--ranks 128,1024] [--json out.json]

For each parameter set, dtype and rank: the step with the shipped tiles first (`default`), then each
candidate of `--project` with the back-projection's tiles as they are, then each of `--back` with the
projection's as they are; every candidate's first step is checked against the default's (params after one
step from the same state, relative difference of the update within `--rtol`, `--rtol-16` for bf16/fp16
params, whose rounding to the param moves an element by a whole ulp: other tiles sum the products in another
order, so the last bits may differ; the checks catch a broken tile, not a rounding). Times: do_bench's median,
as the suite takes them. The numbers decide kernels/galore.py's tiles; they are not a benchmark of their own.
On CPU (`--device cpu`, with TRITON_INTERPRET=1 and FASTOPT_BACKEND=triton, at a small `--scale`) it runs the
same code through the interpreter, which is how CI checks it; its times mean nothing.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton

try:
    from . import bench_galore, common
except ImportError:
    import bench_galore
    import common

import fastopt
from fastopt import ops

# (BM, BN, BK, num_warps, num_stages): TILES, then larger tiles for the H100's tensor cores (TILES_SM90 among them).
CANDIDATES = [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 64, 32, 8, 3),
              (128, 128, 32, 8, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4),
              (128, 128, 32, 4, 4), (256, 64, 32, 8, 3)]


def _tiles(s: str) -> list[tuple[int, ...]]:
    out = []
    for item in s.split(";"):
        t = tuple(int(x) for x in item.split(","))
        if len(t) != 5:
            raise argparse.ArgumentTypeError(f"{item!r}: expected BM,BN,BK,num_warps,num_stages")
        out.append(t)
    return out


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=sorted(common.MODELS), default="7b")
    ap.add_argument("--layers", type=common.number(int, 1), default=None, help="decoder layers (default: the suite's)")
    ap.add_argument("--scale", type=common.number(int, 1), default=1, help="divide every dimension by this")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", type=common._csv_of(common.DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[128, 1024])
    ap.add_argument("--project", type=_tiles, default=CANDIDATES, help="'BM,BN,BK,warps,stages;...'")
    ap.add_argument("--back", type=_tiles, default=CANDIDATES, help="the same, for the back-projection")
    ap.add_argument("--rtol", type=float, default=1e-4, help="of a candidate's update against the default's")
    ap.add_argument("--rtol-16", type=float, default=5e-2, help="the same for bf16/fp16 params")
    ap.add_argument("--rep-ms", type=float, default=200.0)
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting new cases after this long")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def _case(args, pset, dtype, rank, k, device) -> list[dict]:
    params = common.make_params(pset, dtype, device)
    for p in params:
        p.grad = torch.randn_like(p)
    opt = fastopt.GaLoreAdamW(bench_galore._groups(pset, params, rank, bench_galore.NO_REFRESH),
                              **bench_galore.HYPER)
    with bench_galore.standin_first_step():
        opt.step()  # the bases and the state
    start = [p.detach().clone() for p in params]
    state = {p: {key: v.clone() for key, v in s.items()} for p, s in opt.state.items()}
    table = k.tiles_for(device)  # the one these launches take (TILES_SM90 on an H100/H200), changed in place
    shipped = dict(table)
    rows, ref = [], None

    def run(stage, tiles):
        nonlocal ref
        table.update(shipped)
        if stage is not None:
            table[stage] = tiles
        opt._plans.clear()  # launches and tables are rebuilt with these tiles
        for p, p0 in zip(params, start):
            p.data.copy_(p0)
        for p, s in opt.state.items():
            for key, v in s.items():
                v.copy_(state[p][key])
        opt.step()
        common._sync(device)
        delta = [(p.detach() - p0).double() for p, p0 in zip(params, start)]
        if ref is None:
            ref, err = delta, 0.0
        else:
            num = sum(float((d - r).norm() ** 2) for d, r in zip(delta, ref))
            den = sum(float(r.norm() ** 2) for r in ref)
            err = (num / den) ** 0.5
        (_, ms, _), n = common.time_fn(opt.step, device, 30.0, args.rep_ms)
        rtol = args.rtol if dtype in (torch.float32, torch.float64) else args.rtol_16
        rows.append({"set": pset.label, "dtype": str(dtype).replace("torch.", ""), "rank": rank,
                     "stage": stage or "default", "tiles": list(tiles if stage else ()),
                     "ms_median": ms, "n_timed": n, "rel_err": err, "ok": err <= rtol})
        r = rows[-1]
        print(f"  {r['stage']:8s} {str(tuple(r['tiles'])):24s} {ms:9.3f} ms  err {err:.1e}"
              + ("" if r["ok"] else "  OVER --rtol"), flush=True)

    try:
        run(None, ())
        for stage, cands in (("project", args.project), ("back", args.back)):
            for tiles in cands:
                try:
                    run(stage, tiles)
                except triton.runtime.errors.OutOfResources as e:  # shared memory or registers: reported
                    rows.append({"set": pset.label, "dtype": str(dtype), "rank": rank, "stage": stage,
                                 "tiles": list(tiles), "error": f"{type(e).__name__}: {e}"[:300]})
                    print(f"  {stage:8s} {str(tiles):24s} failed: {rows[-1]['error'][:120]}", flush=True)
    finally:
        table.update(shipped)
    return rows


def main(argv=None) -> list[dict]:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    elif not ops.use_triton(torch.empty(0, device=device)):
        raise SystemExit("galore_tiles.py times the Triton kernels: on CPU set TRITON_INTERPRET=1 and "
                         "FASTOPT_BACKEND=triton")
    from fastopt.kernels import galore as k
    m = common.MODELS[args.set]
    layers = min(m.layers, args.layers or (4 if args.set == "7b" else m.layers))
    pset = common.ParamSet(args.set, f"{m.name} ({layers}/{m.layers} layers)",
                           tuple(common.model_shapes(m, layers, args.scale)))
    t0, rows = time.perf_counter(), []
    for dt in args.dtypes:
        for rank in args.ranks:
            if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
                print(f"budget: {dt} rank {rank} not run", flush=True)
                continue
            print(f"{pset.label}, {dt}, rank {rank} (shipped tiles {k.tiles_for(device)})", flush=True)
            rows += _case(args, pset, common.DTYPES[dt], rank, k, device)
            common._free(device)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        args.json.write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
