#!/usr/bin/env bash
# One command for a GPU machine: run from the repository root with $OUT set (the lent GPU's result folder).
#
#   bash bench/gpu_check.sh
#
# Installs nothing from the network (an editable install with --no-deps --no-index; falls back to a copied
# source tree on PYTHONPATH), then, each stage under its own timeout and the whole under GPU_CHECK_BUDGET_S
# (default 530 s, inside the device's 10-minute command limit):
#   1. nvidia-smi and the versions of torch/Triton/CUDA
#   2. the whole pytest suite on CUDA, compiled Triton (TRITON_INTERPRET unset)   -> $OUT/pytest.log
#   3. bench/gpu_checks.py: no host sync in step(), CUDA-graph capture + replay   -> $OUT/gpu_checks.json
#   4. the benchmark suite (bench/run.py) with the time that is left              -> $OUT/suite-<gpu>.{json,md,png}
# Everything printed goes to $OUT/gpu_check.log; the per-bench files go into $OUT/results.tar.gz (the
# device returns at most 8 files). Unpack that into bench/results/ to commit it.
# Wheels in .whl/ (carried) are installed to /tmp/site first: the image lacks some test dependencies.
# Knobs: PYTHON, GPU_CHECK_BUDGET_S, PYTEST_WORKERS (default 4 with pytest-xdist, 0: serial),
# PYTEST_ARGS, BENCH_ARGS, FASTOPT_COMMIT (recorded when the tree has no .git), and for splitting the work over
# several device calls (each at most 10 minutes; the machine stays warm only 30 s between them):
#   GPU_CHECK_STAGES   the stages to run, of: info install tests gpu_checks bench (default: all five)
#   TESTS_MAX_S        the tests stage's cap (default 270; e.g. 500 when a call runs info install tests alone)
#   CHECKS_MAX_S       the gpu_checks stage's cap (default 240: ten configurations, up to 6 at a time)
# e.g. call 1: GPU_CHECK_STAGES="info install tests" TESTS_MAX_S=500 bash bench/gpu_check.sh
#      call 2: GPU_CHECK_STAGES="info install gpu_checks bench" bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the results}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-530}
T0=$(date +%s)
unset TRITON_INTERPRET
export FASTOPT_BACKEND=auto PYTHONUNBUFFERED=1 MPLBACKEND=Agg
WORK=$(mktemp -d /tmp/gpu_check.XXXX)
declare -A RC SECS
ORDER=()
T=0

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# stage NAME MAX_SECONDS RESERVE_SECONDS fn: sets T = min(MAX, time left - RESERVE), the timeout that fn
# gives its commands; skips the stage when less than 10 s would be left.
stage() {
  local name=$1 max=$2 reserve=$3 fn=$4
  T=$(($(left) - reserve))
  [ "$T" -gt "$max" ] && T=$max
  ORDER+=("$name")
  if [ "$T" -lt 10 ]; then
    echo "=== $name: SKIPPED (no time left)"
    RC[$name]=skip SECS[$name]=0
    return
  fi
  echo "=== $name (timeout ${T}s, $(left)s of ${BUDGET}s left)"
  local s rc
  s=$(date +%s)
  "$fn"
  rc=$?
  RC[$name]=$rc SECS[$name]=$(($(date +%s) - s))
  [ "$rc" = 124 ] && echo "=== $name: TIMED OUT after ${T}s"
  echo "=== $name: exit $rc (${SECS[$name]}s)"
}

info() {
  timeout -k 5 "$T" nvidia-smi || echo "nvidia-smi failed"
  timeout -k 5 "$T" "$PY" -c "
import torch, sys
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda)
try:
    import triton; print('triton', triton.__version__)
except ImportError as e: print('triton: not importable:', e)
assert torch.cuda.is_available(), 'no CUDA device visible to torch'
print('device:', torch.cuda.get_device_name(), '| SMs', torch.cuda.get_device_properties(0).multi_processor_count)
"
}

install() {
  # Test dependencies the device image lacks (came-pytorch, galore-torch, ...) can travel as wheels in .whl/
  # (see the device notes: pip download --no-deps --only-binary=:all: ... -d .whl NAME==VERSION; carry .whl).
  if compgen -G ".whl/*.whl" >/dev/null; then
    timeout -k 5 "$T" "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if timeout -k 5 "$T" "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . ; then
    "$PY" -c "import fastopt, fastopt.kernels; print('fastopt from', fastopt.__file__)" && return 0
  fi
  echo "editable install failed: using a copied tree on PYTHONPATH"
  local src=/tmp/fastopt_src
  rm -rf "$src" && mkdir -p "$src" && cp -r fastopt "$src/" && cp -r kernels "$src/fastopt/kernels" || return 1
  [ -d csrc ] && cp -r csrc "$src/"
  export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" FASTOPT_BENCH_DIR="$PWD/bench"
  "$PY" -c "import fastopt, fastopt.kernels; print('fastopt from', fastopt.__file__)"
}

tests() {
  local par=()
  local workers=${PYTEST_WORKERS:-4}
  if [ "$workers" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
    par=(-n "$workers" --dist loadfile)
  fi
  # shellcheck disable=SC2086
  timeout -k 10 "$T" "$PY" -m pytest tests -q -ra -p no:cacheprovider --continue-on-collection-errors "${par[@]}" \
    --junitxml="$WORK/junit.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
  return "${PIPESTATUS[0]}"
}

checks() {
  timeout -k 10 "$T" "$PY" bench/gpu_checks.py --json "$OUT/gpu_checks.json"
}

bench() {
  # run.py starts no new measurement after --budget-s; the timeout leaves it 45 s to finish the last one.
  # shellcheck disable=SC2086
  timeout -k 10 "$T" "$PY" bench/run.py --out "$WORK/results" --budget-s $((T - 45)) ${BENCH_ARGS:-}
}

main() {
  if [ -z "${FASTOPT_COMMIT:-}" ] && git rev-parse HEAD >/dev/null 2>&1; then
    FASTOPT_COMMIT=$(git rev-parse HEAD)
  fi
  export FASTOPT_COMMIT=${FASTOPT_COMMIT:-unknown}
  echo "gpu_check: commit $FASTOPT_COMMIT, budget ${BUDGET}s, $(date -u)"
  local want=" ${GPU_CHECK_STAGES:-info install tests gpu_checks bench} "
  # The reserves keep time for the stages after each one, counted only when those stages run.
  local r_tests=0 r_checks=0 r_bench=0
  [[ $want == *" bench "* ]] && r_bench=90
  [[ $want == *" gpu_checks "* ]] && r_checks=90
  [[ $want == *" tests "* ]] && r_tests=100
  [[ $want == *" info "* ]] && stage info 60 $((r_tests + r_checks + r_bench + 60)) info
  [[ $want == *" install "* ]] && stage install 90 $((r_tests + r_checks + r_bench + 30)) install
  [[ $want == *" install "* && "${RC[install]}" != 0 ]] && \
    echo "WARNING: install failed; the stages below will fail to import fastopt"
  [[ $want == *" tests "* ]] && stage tests "${TESTS_MAX_S:-270}" $((r_checks + r_bench)) tests
  [[ $want == *" gpu_checks "* ]] && stage gpu_checks "${CHECKS_MAX_S:-240}" "$r_bench" checks
  [[ $want == *" bench "* ]] && stage bench 600 10 bench

  # The suite files go to $OUT as they are, everything else into one tarball (at most 8 files come back).
  mkdir -p "$WORK/results"
  cp "$WORK"/results/suite-* "$OUT"/ 2>/dev/null
  cp "$WORK/junit.xml" "$WORK/results/" 2>/dev/null
  tar -czf "$OUT/results.tar.gz" -C "$WORK/results" .

  echo
  echo "=== summary ($(($(date +%s) - T0))s of ${BUDGET}s)"
  local fail=0 n
  for n in "${ORDER[@]}"; do
    printf '%-12s exit %-5s %4ss\n' "$n" "${RC[$n]}" "${SECS[$n]}"
    [ "${RC[$n]}" = 0 ] || fail=1
  done
  [ -f "$OUT/gpu_checks.json" ] && grep -o '"status": "\(FAIL\|SKIP\)"' "$OUT/gpu_checks.json" | sort | uniq -c
  [ -f "$OUT/pytest.log" ] && tail -n 1 "$OUT/pytest.log"
  return $fail
}

main 2>&1 | tee -a "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
