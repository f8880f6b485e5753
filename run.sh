#!/usr/bin/env bash
# One entry point for people and CI. Sets up .venv on first use (and again when setup.py, run.sh or
# FASTOPT_TORCH changes), then:
#   ./run.sh demo  [args]   the main job: the training demo (python -m fastopt.demo)
#   ./run.sh test  [args]   the whole test suite, every Triton kernel through the interpreter on CPU
#   ./run.sh bench [args]   the benchmark suite (reduced CPU sizes without a GPU)
# FASTOPT_TORCH picks the torch requirement (default torch==2.13.0, the CPU build on this project's machines).
# demo and bench run in the folder they are called from (a relative --out lands there); test in the repository.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${FASTOPT_VENV:-.venv}
case "$venv" in /*) ;; *) venv="$here/$venv" ;; esac
py="$venv/bin/python"

setup() {
  [ -x "$py" ] || python3 -m venv "$venv"
  local want torch=${FASTOPT_TORCH:-torch==2.13.0}
  want=$( (cat "$here/setup.py" "$here/run.sh"; echo "$torch") | sha256sum | cut -c1-16)
  if [ "$(cat "$venv/.fastopt-setup" 2>/dev/null)" != "$want" ]; then
    "$py" -m pip install -q --upgrade pip
    # torch first and pinned: an unpinned torch pulled in by an extra would fetch a multi-GB CUDA build.
    # pip leaves an installed torch that satisfies the requirement as it is, and replaces one that does not.
    "$py" -m pip install -q "$torch"
    "$py" -m pip install -q -e "$here[test]"
    echo "$want" >"$venv/.fastopt-setup"
  fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)  setup; exec "$py" -m fastopt.demo "$@" ;;
  test)  setup; cd "$here"; export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
         # FASTOPT_TEST_WORKERS (default 2, 0: one process) pytest-xdist workers, each test to whichever is free
         # (worksteal: the tests take from 0.01 s to a minute); a worker starts its own gloo pool at its first
         # test on one (tests/conftest.py).
         par=(); w=${FASTOPT_TEST_WORKERS:-2}
         if [ "$w" != 0 ] && "$py" -c "import xdist" 2>/dev/null; then par=(-n "$w" --dist worksteal); fi
         exec "$py" -m pytest tests -q -ra --durations=15 "${par[@]}" "$@" ;;
  bench) setup; exec "$py" -m fastopt.bench "$@" ;;
  setup) setup ;;
  *) echo "usage: ./run.sh demo|test|bench|setup [args]" >&2; exit 2 ;;
esac
