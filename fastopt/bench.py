"""`python -m fastopt.bench`: the benchmark suite (bench/run.py of the source tree; same options).

The benches live in the repository's `bench/` folder, next to `fastopt/` (one stem per optimizer, like
every other folder), not in the installed package. This module finds that folder and runs `bench/run.py`
from it: from a source checkout or an editable install (`pip install -e .`, as `./run.sh` does) it is the
`bench/` beside this package; otherwise set `FASTOPT_BENCH_DIR` to a checkout's `bench/`, or run from
the checkout's root.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

_PKG = "fastopt._bench_suite"


def bench_dir() -> Path:
    candidates = []
    if os.environ.get("FASTOPT_BENCH_DIR"):
        candidates.append(Path(os.environ["FASTOPT_BENCH_DIR"]))
    candidates += [Path(__file__).resolve().parent.parent / "bench", Path.cwd() / "bench"]
    for c in candidates:
        if (c / "run.py").is_file() and (c / "common.py").is_file():
            return c.resolve()
    raise SystemExit("fastopt.bench: the benchmark suite ships with the source repository (bench/run.py), not "
                     "the installed package; looked in " + ", ".join(str(c) for c in candidates) +
                     ". Run from a clone's root, or set FASTOPT_BENCH_DIR to its bench/ folder.")


def load_suite(path: Path | None = None):
    """bench/run.py as the module `fastopt._bench_suite.run` (bench/ becomes a package, so its files'
    relative imports work)."""
    path = path or bench_dir()
    pkg = sys.modules.get(_PKG)
    if pkg is None or list(pkg.__path__) != [str(path)]:
        spec = importlib.machinery.ModuleSpec(_PKG, None, is_package=True)
        spec.submodule_search_locations = [str(path)]
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[_PKG] = pkg
        for name in [m for m in sys.modules if m.startswith(_PKG + ".")]:
            del sys.modules[name]
    return importlib.import_module(_PKG + ".run")


def main(argv=None):
    return load_suite().main(argv, prog="python -m fastopt.bench")


if __name__ == "__main__":
    main()
