"""Every Triton kernel compiles for the GPU the benchmarks target (sm_90: H100/H200), without a GPU: the
interpreter that runs the kernels in the rest of the suite accepts programs the compiler rejects. See
tests/compile_check.py for how (a compile-only driver, every optimizer's Triton path on CPU tensors).

The compile takes minutes with a cold Triton cache, in a process of its own on one core: when this test is
collected with others, tests/conftest.py runs this test last and starts that process (`Compile`) when the tests
start, so the compile runs beside the rest of the suite (which mostly keeps one core busy) and this test only
collects its report. Under pytest-xdist (`./run.sh test`) it is the first test, run by the first worker beside
the other."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from fastopt import ops

triton = pytest.importorskip("triton")
HERE = Path(__file__).resolve().parent
STREAMING = {"adafactor._apply_kernel", "adafactor._vec_apply_kernel", "adafactor._vec_stats_kernel",
             "came._apply8_kernel", "came._apply_kernel", "came._res_stats_kernel", "came._vec_apply_kernel",
             "came._vec_stats_kernel", "factored._sq_stats_kernel", "factored._usq_kernel",
             "lamb._lamb8_apply_kernel", "lamb._lamb8_stats_kernel", "lamb._lamb_apply_kernel",
             "lamb._lamb_stats_kernel"}


def _ptxas() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def runs_here() -> bool:
    """The skip conditions below, negated (tests/conftest.py starts the compile early only then)."""
    return _ptxas().exists() and not (torch.cuda.is_available() and not ops.interpreting())


class Compile:
    """tests/compile_check.py running in a process of its own, its output and report in a temporary folder."""

    def __init__(self):
        self.dir = tempfile.TemporaryDirectory(prefix="fastopt-compile-")
        d = Path(self.dir.name)
        self.out, self.log = d / "compile.json", d / "compile.log"
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTOPT_BACKEND")}
        with open(self.log, "w") as log:
            # A session of its own: `close` kills the compilers it starts (ptxas) with it.
            self.proc = subprocess.Popen([sys.executable, str(HERE / "compile_check.py"), "--quick", "--arch", "90",
                                          "--json", str(self.out)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def result(self, timeout: float = 1800) -> tuple[int, str]:
        """(exit code, the log's tail) once it has finished; kills it after `timeout` seconds."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            code = "timed out"
        return code, self.log.read_text()[-8000:]

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self._kill()
        self.dir.cleanup()


@pytest.mark.skipif(not _ptxas().exists(), reason="this Triton build ships no ptxas (no CUDA back end)")
@pytest.mark.skipif(torch.cuda.is_available() and not ops.interpreting(),
                    reason="a CUDA device is here, and the rest of the suite compiles and runs every kernel on it; "
                    "this compile through a fake driver (4-6 minutes with a cold cache) is for machines without one "
                    "(by hand: python tests/compile_check.py)")
def test_every_kernel_compiles_for_sm90_without_spills_and_streams_in_vectors(request):
    early = getattr(request.config, "_fastopt_compile", None)  # started by tests/conftest.py after collection
    run = early or Compile()
    try:
        code, log = run.result()
        assert code == 0, log
        report = json.loads(run.out.read_text())
    finally:
        run.close()
    assert report["errors"] == [] and report["missing"] == []
    # every launch pins FP fusion (common.FP_FUSION): Triton 3.10 turns its default off, and 3.9 warns about it
    assert report["unpinned"] == []
    assert len(report["kernels"]) >= 19, sorted(report["kernels"])
    spills = {k: v["local_bytes_max"] for k, v in report["kernels"].items() if v["local_bytes_max"]}
    assert not spills, f"kernels that spill registers to local memory (bytes): {spills}"
    # ptxas spills into the stack frame, which LOCAL does not count. The tiles of two warpgroups (GaLore's
    # TILES_SM90, BM 128) were chosen for launches where they do not spill: the launches that take them keep none.
    from fastopt.kernels import galore
    big = galore.TILES_SM90["project"][0]
    stacks = {k: v["stack_max_by_bm"][str(big)] for k, v in report["kernels"].items()
              if str(big) in v.get("stack_max_by_bm", {})}
    assert stacks and not any(stacks.values()), f"stack frame bytes (spills) of BM={big} tiles: {stacks}"
    # The streaming kernels, given aligned tensors and sizes (common.ALIGNED), access memory in vectors: a
    # pointer read from a table has no known alignment, and without the hints every access is one element wide.
    scalar = {k: v["vectorized_aligned"] for k, v in report["kernels"].items()
              if k in STREAMING and not (v["vectorized_aligned"] and all(v["vectorized_aligned"]))}
    assert not scalar, f"streaming kernels with scalar-only global accesses on aligned workloads: {scalar}"
