"""Every Triton kernel compiles for the GPU the benchmarks target (sm_90: H100/H200), without a GPU: the
interpreter that runs the kernels in the rest of the suite accepts programs the compiler rejects. See
tests/compile_check.py for how (a compile-only driver, every optimizer's Triton path on CPU tensors)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
HERE = Path(__file__).resolve().parent


def _ptxas() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not _ptxas().exists(), reason="this Triton build ships no ptxas (no CUDA back end)")
def test_every_kernel_compiles_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTOPT_BACKEND")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = tmp_path / "compile.json"
    r = subprocess.run([sys.executable, str(HERE / "compile_check.py"), "--quick", "--arch", "90", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, f"{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert report["errors"] == [] and report["missing"] == []
    assert len(report["kernels"]) >= 19, sorted(report["kernels"])
    spills = {k: v["local_bytes_max"] for k, v in report["kernels"].items() if v["local_bytes_max"]}
    assert not spills, f"kernels that spill registers to local memory (bytes): {spills}"
