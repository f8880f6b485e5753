#!/usr/bin/env bash
# Before the device calls, on the development machine (it has the package index; the GPU machine has none):
#
#   bash bench/gpu_prep.sh
#
# writes .fastopt_commit (the device gets the tree without .git) and downloads into .whl/ the test
# dependencies the GPU image lacks (came-pytorch, galore-torch, bitsandbytes), as wheels for its Python 3.12.
# Both paths are git-ignored; name them in the device call's `carry`: [".whl", ".fastopt_commit"]. Then the
# calls of bench/gpu_check.sh's header.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
git rev-parse HEAD > .fastopt_commit
rm -rf .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl came-pytorch galore-torch bitsandbytes==0.50.2
echo "commit $(cat .fastopt_commit); wheels: $(ls .whl | tr '\n' ' ')($(du -sh .whl | cut -f1), the device takes 64 MiB in all)"
