"""The benchmark suite: every `bench/bench_*.py` present, merged into one JSON, markdown table and PNG.

    python bench/run.py [--benches adafactor,came] [--out DIR] [common options]
    python -m fastopt.bench [same options]        # finds this folder; see fastopt/bench.py

Each bench module follows the interface in bench/common.py (`STEM`, `run(args) -> list[dict]`). A bench
that fails to import or raises is recorded as an `error` row and the suite goes on. Outputs under
bench/results/ (or --out): `<stem>-<device>.{json,md,png}` per bench and `suite-<device>.{json,md,png}`
for all, rewritten after every bench so that a run cut short keeps what it measured.
"""
from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

try:
    from . import common
except ImportError:
    import common

HERE = Path(__file__).resolve().parent


LAST = ("galore_refresh",)  # steps of seconds each (GaLore's SVDs): run after everything else


def discover() -> list[str]:
    """Stems of the bench_<stem>.py files in this folder, sorted, those in `LAST` at the end."""
    return sorted((p.stem[len("bench_"):] for p in HERE.glob("bench_*.py")), key=lambda s: (s in LAST, s))


def load(stem: str):
    if __package__:
        return importlib.import_module(f"{__package__}.bench_{stem}")
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(f"bench_{stem}")


def _error_rows(args, stem: str, msg: str) -> list[dict]:
    ps = common.param_sets(args)[0]
    return [common._result(args, stem, "(bench)", ps, common.dtypes(args)[0], status="error", reason=msg[:300])]


def main(argv=None, prog: str | None = None) -> dict:
    p = common.parser("fastopt benchmark suite: every bench/bench_*.py", prog=prog)
    p.add_argument("--benches", type=common._csv, default=None, help="stems to run (default: all present)")
    p.add_argument("--first", type=common._csv, default=None,
                   help="stems to run before the others, in this order (e.g. those a change touched, when the "
                        "device's time may run out)")
    p.add_argument("--list", action="store_true", help="list the benches that would run, in order, and exit")
    args = p.parse_args(argv)
    found = discover()
    stems = found if args.benches is None else args.benches
    if not stems:
        p.error("argument --benches: give at least one stem (found: " + (", ".join(found) or "none") + ")")
    for name, given in (("--benches", stems), ("--first", args.first or [])):
        missing = [s for s in given if s not in found]
        if missing:
            p.error(f"argument {name}: no bench/bench_{missing[0]}.py (found: {', '.join(found) or 'none'})")
        twice = [s for k, s in enumerate(given) if s in given[:k]]
        if twice:
            p.error(f"argument {name}: {twice[0]} given twice")
    if args.first:
        stems = [s for s in args.first if s in stems] + [s for s in stems if s not in args.first]
    if args.list:  # in the order they would run
        print("\n".join(stems))
        return {}
    args = common.finish_args(args, p)
    with common.cpu_mode(args):  # first line on CPU: CPU numbers, one torch thread unless OMP_NUM_THREADS is set
        return _run(args, stems)


def _run(args, stems: list[str]) -> dict:
    machine = common.machine_info(args)
    print(f"machine: {common.machine_line(machine)}", flush=True)
    cp = common.copy_bandwidth(args)
    print(f"copy bandwidth: {cp['gbps']:.1f} GB/s (median of dst.copy_(src), {cp['bytes'] / 2**20:.0f} MiB moved)",
          flush=True)
    suite: list[dict] = []
    paths: dict = {}
    for stem in stems:
        t0 = time.monotonic()
        print(f"== bench {stem}", flush=True)
        try:
            mod = load(stem)
            rows = list(mod.run(args))
        except Exception as e:  # noqa: BLE001 - one broken bench must not end the suite; recorded as a row
            traceback.print_exc()
            rows = _error_rows(args, stem, f"{type(e).__name__}: {e}")
        common.write_outputs(rows, args, stem, machine=machine)  # fills the speedups that print_results shows
        common.print_results(rows)
        suite += rows
        paths = common.write_outputs(suite, args, "suite", machine=machine)
        print(f"   ({time.monotonic() - t0:.1f} s)", flush=True)
    for path in paths.values():
        print(f"wrote {path}")
    common.check_only(args, suite)
    return paths


if __name__ == "__main__":
    main()
