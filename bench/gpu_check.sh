#!/usr/bin/env bash
# One command for a GPU machine: run from the repository root with $OUT set (the lent GPU's result folder).
#
#   bash bench/gpu_check.sh
#
# Installs nothing from the network (an editable install with --no-deps --no-index; when that fails, the
# later stages run from a copy of the tree laid out as installed, in /tmp/fastopt_src), then, each stage under
# its own timeout and the whole under GPU_CHECK_BUDGET_S (default 560 s, for a device call of timeout_s 600):
#   1. nvidia-smi and the versions of torch/Triton/CUDA
#   2. the pytest suite on this machine, compiled Triton (TRITON_INTERPRET unset), TESTS_MAX_S (200) at most,
#      in passes: the tests that use CUDA first, then those on CPU tensors and the gloo `dist` tests (both of
#      which CI runs too) with the time left                                       -> $OUT/pytest.log
#   3. bench/gpu_checks.py: no host sync in step(), CUDA-graph capture + replay   -> $OUT/gpu_checks.json
#   4. (opt-in, stage `demo`) the demo on the GPU, every optimizer, DEMO_STEPS (30) -> demo/ in results.tar.gz
#   4b. (opt-in, stage `profile`) bench/profile_step.py: host against device time of one step, the slow cases
#                                                                                   -> profile/ in results.tar.gz
#   4c. (opt-in, stage `tiles`) bench/galore_tiles.py: GaLore's matmul tiles timed -> galore_tiles.json in the tarball
#   5. the benchmark suite (bench/run.py) with the time that is left, the benches in BENCH_FIRST (default
#      adamw8bit,lamb,came,galore: the kernels changed since the last GPU run) first         -> $OUT/suite-<gpu>.{json,md,png}
# Everything printed goes to $OUT/gpu_check.log; the per-bench files go into $OUT/results.tar.gz (the
# device returns at most 8 files). Unpack that into bench/results/ to commit it.
# Wheels in .whl/ (carried) are installed to /tmp/site first: the image lacks some test dependencies (the
# install stage fails, saying which, when one is still missing: its comparison tests would skip).
# Knobs: PYTHON, GPU_CHECK_BUDGET_S, PYTEST_WORKERS (default 8 with pytest-xdist, 0: serial),
# PYTEST_ARGS (a -k there replaces the passes' split: one pass without `dist`, then `dist`), BENCH_FIRST,
# BENCH_ARGS, FASTOPT_COMMIT, and
#   GPU_CHECK_STAGES   the stages to run, of: info install tests gpu_checks demo profile tiles bench (default:
#                      info install tests gpu_checks bench)
#   TESTS_MAX_S        the tests stage's cap (default 200)
#   CHECKS_MAX_S       the gpu_checks stage's cap (default 75: ten configurations, up to 6 at a time, 3-7 s each
#                      on the H100; each is killed at what is left of the stage, and gpu_checks.json is
#                      rewritten as each ends)
# The commit the results record: FASTOPT_COMMIT, else `git rev-parse HEAD`, else the file .fastopt_commit (the
# device gets the tree without .git: write it before the call, `git rev-parse HEAD > .fastopt_commit`, and
# carry it; it is git-ignored). Without any of them the results say "commit": "unknown" and this warns.
# bench/gpu_prep.sh writes .fastopt_commit and fetches the wheels, on the development machine, before the calls.
#
# A session has 15 minutes of device time, the machine's start (a minute or more) and its idle waits counted:
# one call of the defaults (timeout_s 600), then, at once (the machine stays warm 30 s), what that call's
# summary lists as skipped or not run, with what is left, e.g.
#      GPU_CHECK_STAGES="info install bench" GPU_CHECK_BUDGET_S=230 BENCH_FIRST= \
#        BENCH_ARGS="--benches came,lamb" bash bench/gpu_check.sh
# and give the machine back. The bench writes a suite file per call: keep the per-bench files of both.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the results}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the stages may run from another folder (install)
PY=${PYTHON:-python3}
BENCH_FIRST=${BENCH_FIRST-adamw8bit,lamb,came,galore}  # set empty for the suite's own order
BUDGET=${GPU_CHECK_BUDGET_S:-560}
T0=$(date +%s)
unset TRITON_INTERPRET
export FASTOPT_BACKEND=auto PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# Build caches where they can be written whatever HOME is (kept when set): the extension's and Triton's.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/fastopt-ext}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
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
  # Missing ones make their comparison tests skip (test_galore.py entirely): said loudly, and the stage exits 3.
  local deps=0
  if compgen -G ".whl/*.whl" >/dev/null; then
    if timeout -k 5 "$T" "$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site \
        .whl/*.whl; then
      export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    else
      echo "WARNING: installing the carried wheels (.whl/) failed"
      deps=3
    fi
  else
    echo "WARNING: no .whl/ carried: the comparisons with the packages below that the image lacks will skip"
  fi
  "$PY" -c "
import importlib.util as u
missing = [m for m in ('transformers', 'accelerate', 'came_pytorch', 'galore_torch', 'bitsandbytes')
           if u.find_spec(m) is None]
for m in missing:
    print('WARNING: test dependency', m, 'is missing: the tests comparing with it skip')
raise SystemExit(1 if missing else 0)" || deps=3
  if timeout -k 5 "$T" "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . ; then
    "$PY" -c "import fastopt, fastopt.kernels; print('fastopt from', fastopt.__file__)" && return $deps
  fi
  # Without the install, the repository's own fastopt/ (no kernels/ inside) comes first on sys.path whenever
  # the current folder does (python -c, -m pytest), whatever PYTHONPATH says. So the later stages run from a
  # copy of the tree whose fastopt/ holds kernels/ and csrc/ as an installed package does.
  echo "editable install failed: the stages below run from a copy of the tree laid out as installed"
  local src=/tmp/fastopt_src f
  rm -rf "$src" && mkdir -p "$src" || return 1
  for f in *; do  # not the dot folders (.git, .venv, .whl)
    cp -r "$f" "$src/" || return 1
  done
  cp -r kernels "$src/fastopt/kernels" && cp -r csrc "$src/fastopt/csrc" && cd "$src" || return 1
  export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" FASTOPT_BENCH_DIR="$src/bench"
  "$PY" -c "import fastopt, fastopt.kernels; print('fastopt from', fastopt.__file__)" || return 1
  return $deps
}

tests() {
  local par=() par1=()
  local workers=${PYTEST_WORKERS:-8}
  if [ "$workers" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
    par=(-n "$workers" --dist loadfile)
    # The CUDA passes spread single tests: a worker that crashes (a segfault) is then replaced and its test
    # reported, where loadfile's rescheduling raised INTERNALERROR (xdist 3, seen 2026-11-24) and left the rest
    # of the pass unrun. The dist pass keeps loadfile: a module's process pool serves all its tests.
    par1=(-n "$workers" --dist load --max-worker-restart 100)
  fi
  # Passes in the order of what only this machine can run, each given the stage's time left, so that a stage
  # cut short has run the CUDA tests whole (pytest prints its summary and failures only at a pass's end):
  #   gpu: every test but the `dist` ones whose name has no "cpu" (CUDA devices, compiled Triton, the
  #        extension's CUDA kernels, and tests that take the device the machine has);
  #   cpu: the tests on CPU tensors, which CI runs too (here under this image's torch);
  #   dist: gloo processes on CPU, which CI runs too.
  # A -k in PYTEST_ARGS replaces the passes' own (pytest keeps the last -k): then one pass without `dist`.
  local t0 rc=0 r left name sel mark xopts
  local passes=("gpu|not cpu|not dist" "cpu|cpu|not dist" "dist||dist")
  case " ${PYTEST_ARGS:-} " in *" -k"*) passes=("selected||not dist" "dist||dist") ;; esac
  t0=$(date +%s)
  : >"$OUT/pytest.log"
  for p in "${passes[@]}"; do
    IFS='|' read -r name sel mark <<<"$p"
    left=$((T - ($(date +%s) - t0)))
    if [ "$left" -lt 30 ]; then
      echo "=== tests: pass $name not run: ${left}s left" | tee -a "$OUT/pytest.log"
      continue
    fi
    echo "=== tests: pass $name (${left}s left)" | tee -a "$OUT/pytest.log"
    xopts=("${par1[@]}")
    [ "$name" = dist ] && xopts=("${par[@]}")
    # shellcheck disable=SC2086
    timeout -k 10 "$left" "$PY" -m pytest tests -q -ra -p no:cacheprovider --continue-on-collection-errors \
      "${xopts[@]}" -m "$mark" ${sel:+-k "$sel"} --junitxml="$WORK/junit-$name.xml" ${PYTEST_ARGS:-} 2>&1 |
      tee -a "$OUT/pytest.log"
    r=${PIPESTATUS[0]}
    # pytest's 5: no tests collected (a pass that PYTEST_ARGS left empty); 124: the pass ran past its time
    [ "$r" = 124 ] && echo "=== tests: pass $name TIMED OUT" | tee -a "$OUT/pytest.log"
    [ "$r" = 5 ] && r=0
    [ "$rc" = 0 ] && rc=$r
  done
  return "$rc"
}

checks() {
  # Each configuration's timeout is cut to what is left of the stage (less 15 s to kill it and write its rows),
  # so a slow one ends as a FAIL row instead of the stage's timeout taking every row with it.
  timeout -k 10 "$T" "$PY" bench/gpu_checks.py --json "$OUT/gpu_checks.json" --budget-s $((T - 15))
}

demo() {
  # The demo on the GPU (one device: one process, NCCL not exercised), every optimizer, a few steps.
  timeout -k 10 "$T" "$PY" -m fastopt.demo --steps "${DEMO_STEPS:-30}" \
    --optim adafactor,came,lamb,galore,adamw8bit,adamw --out "$WORK/results/demo" 2>&1 | tail -n 30
  return "${PIPESTATUS[0]}"
}

profile() {
  # Where the step time goes (host: Python and launches; device: kernels) for the cases the H100 run of
  # 2026-11-24 found slow (GaLore: host time at 4e950aa, 513 launches a step on the 1b set then; 9 at 8a1c9ed, and
  # replayed launches since 1dd785d), the 8-bit states; Adafactor for contrast.
  mkdir -p "$WORK/results/profile"
  local t0 c rc=0
  t0=$(date +%s)
  for c in "galore 1b fp32" "galore 7b bf16 --rank 1024" "galore8 1b fp32" "adamw8bit 7b fp32" "came8 7b fp32" \
      "lamb8 7b bf16" "adafactor 7b fp32"; do
    local left=$((T - ($(date +%s) - t0)))
    if [ "$left" -lt 20 ]; then
      echo "=== profile: no time left for $c and the cases after it (not run, not failed)"
      break
    fi
    set -- $c
    # shellcheck disable=SC2086
    timeout -k 5 "$left" "$PY" bench/profile_step.py --optim "$1" --set "$2" --dtype "$3" "${@:4}" \
      --json "$WORK/results/profile/$1-$2-$3${4:+-r$5}.json" || rc=$?
  done
  return $rc
}

tiles() {
  # Opt-in (not in the default stages): bench/galore_tiles.py, GaLore's matmul tiles timed on the 7b set
  # (TILES_ARGS adds to or overrides its arguments); it starts no new case after --budget-s.
  local budget=$((T - 60))
  [ "$budget" -lt 5 ] && budget=5
  # shellcheck disable=SC2086
  timeout -k 10 "$T" "$PY" bench/galore_tiles.py --budget-s "$budget" --json "$WORK/results/galore_tiles.json" \
    ${TILES_ARGS:-}
}

bench() {
  # run.py starts no new measurement after --budget-s; the timeout leaves it 45 s to finish the last one.
  local budget=$((T - 45))
  [ "$budget" -lt 5 ] && budget=5
  # shellcheck disable=SC2086
  timeout -k 10 "$T" "$PY" bench/run.py --out "$WORK/results" --budget-s "$budget" \
    ${BENCH_FIRST:+--first "$BENCH_FIRST"} ${BENCH_ARGS:-}
}

main() {
  if [ -z "${FASTOPT_COMMIT:-}" ] && git rev-parse HEAD >/dev/null 2>&1; then
    FASTOPT_COMMIT=$(git rev-parse HEAD)
  elif [ -z "${FASTOPT_COMMIT:-}" ] && [ -f .fastopt_commit ]; then
    FASTOPT_COMMIT=$(tr -d '[:space:]' <.fastopt_commit)
  fi
  export FASTOPT_COMMIT=${FASTOPT_COMMIT:-unknown}
  echo "gpu_check: commit $FASTOPT_COMMIT, budget ${BUDGET}s, $(date -u)"
  local nocommit=""
  if [ "$FASTOPT_COMMIT" = unknown ]; then
    nocommit="WARNING: COMMIT UNKNOWN: no .git, no FASTOPT_COMMIT, no .fastopt_commit; every result will say
WARNING: \"commit\": \"unknown\". Before the device call: git rev-parse HEAD > .fastopt_commit, and carry it."
    echo "$nocommit"
  fi
  local want=" ${GPU_CHECK_STAGES:-info install tests gpu_checks bench} "
  # The reserves keep time for the stages after each one, counted only when those stages run.
  local r_tests=0 r_checks=0 r_bench=0
  [[ $want == *" bench "* ]] && r_bench=90
  [[ $want == *" gpu_checks "* ]] && r_checks=75
  [[ $want == *" tests "* ]] && r_tests=100
  [[ $want == *" info "* ]] && stage info 60 $((r_tests + r_checks + r_bench + 60)) info
  [[ $want == *" install "* ]] && stage install 90 $((r_tests + r_checks + r_bench + 30)) install
  [[ $want == *" install "* && "${RC[install]}" != 0 && "${RC[install]}" != 3 ]] && \
    echo "WARNING: install failed; the stages below will fail to import fastopt"
  [[ $want == *" tests "* ]] && stage tests "${TESTS_MAX_S:-200}" $((r_checks + r_bench)) tests
  [[ $want == *" gpu_checks "* ]] && stage gpu_checks "${CHECKS_MAX_S:-75}" "$r_bench" checks
  [[ $want == *" demo "* ]] && stage demo 90 "$r_bench" demo
  [[ $want == *" profile "* ]] && stage profile 150 "$r_bench" profile
  [[ $want == *" tiles "* ]] && stage tiles 540 "$r_bench" tiles
  [[ $want == *" bench "* ]] && stage bench 600 10 bench

  # The suite files go to $OUT as they are, everything else into one tarball (at most 8 files come back).
  mkdir -p "$WORK/results"
  cp "$WORK"/results/suite-* "$OUT"/ 2>/dev/null
  cp "$WORK"/junit*.xml "$WORK/results/" 2>/dev/null
  tar -czf "$OUT/results.tar.gz" -C "$WORK/results" .

  echo
  echo "=== summary ($(($(date +%s) - T0))s of ${BUDGET}s)"
  local fail=0 n
  for n in "${ORDER[@]}"; do
    printf '%-12s exit %-5s %4ss\n' "$n" "${RC[$n]}" "${SECS[$n]}"
    [ "${RC[$n]}" = 0 ] || fail=1
  done
  [ -f "$OUT/gpu_checks.json" ] && grep -o '"status": "\(FAIL\|SKIP\)"' "$OUT/gpu_checks.json" | sort | uniq -c
  [ -f "$OUT/gpu_checks.json" ] && "$PY" -c "import json, sys; p = json.load(open(sys.argv[1])).get('pending')
if p: print('gpu_checks: not finished (no rows):', ', '.join(p))" "$OUT/gpu_checks.json"
  [ -f "$OUT/pytest.log" ] && grep -E "[0-9]+ (passed|failed|errors?)|no tests ran|not run:" "$OUT/pytest.log" |
    tail -n 3
  [ -n "$nocommit" ] && echo "$nocommit"
  return $fail
}

main 2>&1 | tee -a "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
