"""The benchmark harness end to end on CPU at a tiny size: outputs exist and hold what they promise."""
from __future__ import annotations

import importlib
import json
import math

import pytest
import torch

from fastopt import bench as fbench

TINY = ["--device", "cpu", "--scale", "64", "--layers-7b", "1", "--layers-1b", "1", "--warmup-ms", "1",
        "--rep-ms", "5", "--copy-mb", "4"]


@pytest.fixture(scope="module")
def suite():
    run = fbench.load_suite()
    return run, importlib.import_module(run.__package__ + ".common"), \
        importlib.import_module(run.__package__ + ".bench_adafactor")


def test_suite_end_to_end_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTOPT_BACKEND", "auto")
    paths = fbench.main(TINY + ["--benches", "adafactor", "--out", str(tmp_path)])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"{s}-cpu.{e}" for s in ("suite", "adafactor") for e in ("json", "md", "png"))
    assert set(paths) == {"json", "md", "png"}

    doc = json.loads((tmp_path / "suite-cpu.json").read_text())
    assert doc["cpu_numbers"] is True and "CPU numbers" in doc["note"]
    m = doc["machine"]
    assert m["torch"] == torch.__version__ and m["commit"] and m["device"] == "cpu" and "triton" in m
    assert doc["copy"]["gbps"] > 0 and doc["copy"]["bytes"] == 2 * 4 * 2**20
    rows = doc["results"]
    assert len(rows) == 2 * 2 * 3  # sets x dtypes x implementations
    assert {r["impl"] for r in rows} == {"fastopt.Adafactor", "transformers Adafactor",
                                         "torch.optim.Adafactor(foreach)"}
    for r in rows:
        assert set(r) == set(doc["fields"])
        assert r["status"] == "ok", r
        assert 0 < r["ms_p20"] <= r["ms_median"] <= r["ms_p80"]
        assert r["launches_per_step"] is None  # counted with torch.profiler on CUDA only
        assert r["gbps"] == pytest.approx(r["min_bytes_per_param"] * r["n_params"] / (r["ms_median"] * 1e-3) / 1e9)
        assert r["frac_copy"] == pytest.approx(r["gbps"] / doc["copy"]["gbps"])
        assert r["state_bytes"] > 0
        elem = 4 if r["dtype"] == "fp32" else 2
        # read grad + read param + write param, plus the (small) second-moment state
        assert 3 * elem < r["min_bytes_per_param"] < 3 * elem + 1
    ours = [r for r in rows if r["ours"]]
    assert len(ours) == 4 and all(r["backend"] == "torch reference" and r["speedup"] > 0 for r in ours)
    assert all(r["kernel_bytes_per_param"] > 2 * r["min_bytes_per_param"] for r in ours)

    md = (tmp_path / "suite-cpu.md").read_text()
    assert "**CPU numbers**" in md and "| bench | params | dtype | impl |" in md
    assert md.count("**fastopt.Adafactor**") == 4
    assert (tmp_path / "suite-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_param_sets_have_llama_shapes(suite):
    _, common, _ = suite
    assert sum(math.prod(s) for _, s in common.model_shapes(common.LLAMA_7B, 32)) == 6_738_415_616  # Llama-2-7B
    assert sum(math.prod(s) for _, s in common.model_shapes(common.LLAMA_1B, 22)) == 1_100_048_384  # TinyLlama
    shapes = dict(common.model_shapes(common.LLAMA_7B, 1))
    assert shapes["layers.0.q_proj"] == (4096, 4096) and shapes["layers.0.gate_proj"] == (11008, 4096)
    assert shapes["layers.0.down_proj"] == (4096, 11008) and shapes["embed_tokens"] == (32000, 4096)
    assert shapes["layers.0.input_layernorm"] == (4096,)


def test_byte_counts(suite):
    _, common, ada = suite
    ps = common.ParamSet("t", "t", (("w", (4, 6)), ("b", (6,))))
    # w: 3 x 4 B x 24 + row/col state r+w 2 x 4 B x 10; b: 3 x 4 B x 6 + second moment r+w 2 x 4 B x 6
    assert ada.min_bytes(ps, torch.float32) == 288 + 80 + 72 + 48
    assert ada.min_bytes(ps, torch.bfloat16) == 144 + 80 + 36 + 48
    big = common.ParamSet("m", "m", (("w", (4096, 4096)),))
    n = 4096 * 4096
    for dtype, s in ((torch.float32, 4), (torch.bfloat16, 2)):
        kb = ada.kernel_bytes(big, dtype) / n
        assert 6 * s < kb < 6 * s + 3  # g read 3x, p read 2x + written 1x, plus partial column sums


def test_failing_competitors_are_recorded(suite, tmp_path):
    _, common, _ = suite
    args = common.finish_args(common.parser().parse_args(TINY + ["--out", str(tmp_path)]))
    ps = common.ParamSet("t", "tiny", (("w", (8, 16)),))

    def broken_ctor(params):
        raise ImportError("no module named competitor")

    class Boom(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("step failed")

    rows = [common.measure(args, "x", "broken", ps, torch.float32, broken_ctor, min_bytes=1),
            common.measure(args, "x", "boom", ps, torch.float32, lambda p: Boom(p, lr=0.1), min_bytes=1),
            common.measure(args, "x", "sgd", ps, torch.float32, lambda p: torch.optim.SGD(p, lr=0.1), min_bytes=1536,
                           ours=True)]
    assert rows[0]["status"] == "skipped" and "no module named competitor" in rows[0]["reason"]
    assert rows[1]["status"] == "error" and "step failed" in rows[1]["reason"]
    assert rows[2]["status"] == "ok" and rows[2]["min_bytes_per_param"] == 12
    paths = common.write_outputs(rows, args, "x")
    md = paths["md"].read_text()
    assert "skipped: could not be constructed: ImportError: no module named competitor" in md
    assert "error: RuntimeError: step failed" in md


def test_bench_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTOPT_BENCH_DIR", str(tmp_path))  # not a bench folder: falls back to the repo's
    assert (fbench.bench_dir() / "run.py").is_file()


def test_layouts_bench_counts_collectives_and_bytes(tmp_path, monkeypatch):
    """bench_layouts end to end at a tiny size, and its TP 8 x FSDP 8 communication counted independently
    from the Llama-7B shapes: matrices reduce over the 64-rank world, norm weights over their 8-rank dp group."""
    monkeypatch.setenv("FASTOPT_BACKEND", "auto")
    run = fbench.load_suite()
    common = importlib.import_module(run.__package__ + ".common")
    fbench.main(TINY + ["--benches", "layouts", "--dtypes", "fp32", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "layouts-cpu.json").read_text())
    rows = {r["impl"]: r for r in doc["results"]}
    shapes = [s for _, s in common.model_shapes(common.LLAMA_7B, 32)]
    mats, vecs = [s for s in shapes if len(s) == 2], [s for s in shapes if len(s) == 1]
    assert len(mats) == 32 * 7 + 2 and len(vecs) == 32 * 2 + 1
    rc = sum(r + c for r, c in mats)  # one fp64 row sum and column sum per row and column of every matrix
    expected = {  # name: (collectives, bytes reduced per step)
        "Adafactor": (2 + 1, 8 * rc + 8 * 2 * len(mats) + 8 * 2 * len(vecs)),
        "CAME": (3 + 1, 2 * 8 * rc + 8 * len(mats) + 8 * len(vecs)),
        "Lamb": (1 + 1, 4 * 2 * len(shapes)),
        "AdamW8bit": (0, 0),
    }
    for name, (n_coll, n_bytes) in expected.items():
        r = rows[f"fastopt.{name} communication"]
        assert r["status"] == "computed" and r["comm"]["collectives"] == n_coll, r
        assert r["comm"]["buffer_bytes"] == n_bytes, (name, r["comm"])
        ring = sum(2 * (g["ranks"] - 1) / g["ranks"] * g["buffer_bytes"] for g in r["comm"]["groups"].values())
        assert r["comm"]["ring_bytes_per_rank"] == pytest.approx(ring)
        if name in ("Adafactor", "CAME"):  # O(rows + columns): far below gathering the matrices
            assert r["comm"]["gather_matrix_bytes"] == 4 * sum(a * b for a, b in mats)
            assert 200 * n_bytes < r["comm"]["gather_matrix_bytes"]
        step = [x for x in doc["results"] if x["impl"] == f"fastopt.{name} step"]
        over = [x for x in doc["results"] if x["impl"] == f"fastopt.{name} layout machinery"]
        assert len(step) == len(over) == 2 and all(x["status"] == "ok" for x in step)
        assert all(x["status"] == "computed" and 0 < x["overhead_frac"] < 1 for x in over)
