#!/usr/bin/env bash
# Before a GPU session, on a machine without a GPU: the GPU machine's torch and Triton (torch 2.11.0+cu130,
# which pins Triton 3.6.0) in a virtual environment of their own, and there
#   1. the whole test suite (./run.sh test: every kernel through Triton 3.6's interpreter, the gloo dist tests);
#   2. every Triton kernel compiled for sm_90 by Triton 3.6 (tests/compile_check.py);
#   3. the extension built with its CUDA kernels against torch 2.11's CUDA headers (FASTOPT_EXT_CUDA=1, nvcc),
#      and loaded.
# so that the GPU's minutes go to what only the GPU can tell. On the 2-core CPU machine: about 18 + 3 + 1 minutes,
# and 5 GB of wheels the first time.
#
#   bash bench/gpu_versions_check.sh [pytest args]
#   GPU_TORCH (torch==2.11.0), GPU_VENV (/tmp/fastopt-gpu-versions), CUDA_HOME (/usr/local/cuda),
#   GPU_CHECK_PARTS ("tests compile extension")
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${GPU_VENV:-/tmp/fastopt-gpu-versions}
py=$venv/bin/python
export FASTOPT_VENV=$venv FASTOPT_TORCH=${GPU_TORCH:-torch==2.11.0}
parts=" ${GPU_CHECK_PARTS:-tests compile extension} "
./run.sh setup
# The venv's editable fastopt (fastopt.kernels included) points at this checkout, whichever one set it up.
"$py" -m pip install -q --no-deps -e .
# Triton 3.6's interpreter takes int() of one-element arrays, which NumPy 2.4 refuses (ops.interpreter_clash).
"$py" -m pip install -q "numpy<2.4"
"$py" -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__,
           'numpy', numpy.__version__, 'commit', '$(git rev-parse --short HEAD 2>/dev/null)')"
status=0
if [[ $parts == *" tests "* ]]; then
  echo "== 1. the test suite"
  ./run.sh test "$@" || status=1
fi
if [[ $parts == *" compile "* ]]; then
  echo "== 2. every Triton kernel compiled for sm_90"
  cache=$(mktemp -d)
  (unset TRITON_INTERPRET; TRITON_CACHE_DIR=$cache "$py" tests/compile_check.py) || status=1
  rm -rf "$cache"
fi
if [[ $parts == *" extension "* ]]; then
  echo "== 3. the extension with its CUDA kernels (sm_90)"
  exts=$(mktemp -d)
  CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FASTOPT_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=$exts \
    "$py" -c "
from fastopt import ext
ext.load()
assert ext.has_cuda_kernels(), 'built without its CUDA kernels'
print('built and loaded with its CUDA kernels:', ext.how_loaded())" || status=1
  rm -rf "$exts"
fi
echo "== $([ $status = 0 ] && echo OK || echo FAILED)"
exit $status
