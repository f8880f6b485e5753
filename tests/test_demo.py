"""The demo (`python -m fastopt.demo`): the CLI end to end on 4 gloo processes (TP 2 x FSDP2 2), and that run
against a single process with the same seed and data.

One CLI run in float64 of every optimizer (a module fixture: starting 4 processes costs most of this file's time)
serves both the smoke test and the comparisons; --model llama gets one more. Tolerance of the comparison: in float64
the two runs do the same arithmetic up to the order of sums (TP splits the o/down projections' contractions into
partial sums joined by an all-reduce, FSDP2 averages the gradients of two half-batches, the optimizers sum their
statistics over ranks), each reordering worth ~1e-16 relative, which 8 steps amplify by a few orders of magnitude
at most (measured: losses ~4e-16 apart, weights ~1e-13); so losses must agree within 1e-9 absolute and each
trained weight within TOL[float64] = 1e-9 of the size of its total update. The loss moves by more than 3e-2 per
step, and a wrong batch slice (tried: every dp rank on the first half-batch gives 0.12), a missing gradient average
or a statistic summed over the wrong ranks moves it by far more than that tolerance. AdamW8bit is not exact by
design (see its test).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import TOL, rel_update_error
from fastopt import demo

pytestmark = pytest.mark.dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXACT = ["adafactor", "came", "lamb", "galore", "adamw"]
OPTIMS = EXACT + ["adamw8bit"]
ARGS = ["--optim", ",".join(OPTIMS), "--steps", "8", "--batch", "8", "--ctx", "16", "--dtype", "float64",
        "--device", "cpu", "--save-params"]


def _cli_tp2_dp2(out, argv) -> tuple[str, dict]:
    """`python -m fastopt.demo --tp 2 --dp 2 ...` as a user runs it: its stdout and results.json."""
    proc = subprocess.run([sys.executable, "-m", "fastopt.demo", "--tp", "2", "--dp", "2", "--out", str(out), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The ranks leave by os._exit: nothing they created may be left for the resource tracker to clean up.
    assert "leaked" not in proc.stderr, proc.stderr[-4000:]
    with open(out / "results.json") as f:
        return proc.stdout, json.load(f)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-tp")
    return (out, *_cli_tp2_dp2(out, ARGS))


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-single")
    args = demo.parse_args(["--tp", "1", "--dp", "1", "--out", str(out), *ARGS])
    results = demo.run(args, demo.Parallel(0, 1, 1, 1, torch.device("cpu")))
    return out, {r["optim"]: r for r in results}


def test_cli_trains_and_reports(tp_run):
    out, stdout, res = tp_run
    assert res["layout"] == "TP 2 x FSDP2 2 on 4 gloo processes (CPUs)"
    assert "| optimizer | final loss" in stdout
    by_name = {r["optim"]: r for r in res["results"]}
    assert list(by_name) == OPTIMS
    for name, r in by_name.items():
        assert f"| {name} | " in stdout and "skipped" not in r, (name, r)
        losses = r["losses"]
        assert len(losses) == 8 and all(math.isfinite(v) for v in losses), (name, losses)
        assert abs(losses[0] - res["uniform_loss"]) < 0.5, (name, losses[0])  # a fresh model guesses ~uniformly
        assert losses[-1] < losses[0] - 0.1, (name, losses)  # and learns within 8 steps
        assert r["state_bytes_per_param"] > 0 and r["step_ms"] > 0
        assert r["final_loss"] == pytest.approx(sum(losses[-5:]) / 5), (name, r["final_loss"])  # "last 5 steps"
        assert os.path.getsize(out / f"model-{name}.pt") > 0
    # AdamW's two float64 moments are 16 B/param: every element held by some rank (the sum over all 4 ranks of
    # their local pieces, not one rank's nor the global tensor counted on each); the params TP leaves whole
    # (embeddings, head, norm weights) counted on both TP ranks: below twice that.
    assert 16 <= by_name["adamw"]["state_bytes_per_param"] < 2 * 16, by_name["adamw"]
    # Adafactor keeps factored second moments only: a small fraction of AdamW's two full moments.
    assert by_name["adafactor"]["state_bytes_per_param"] < 0.2 * by_name["adamw"]["state_bytes_per_param"]
    with open(out / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _initial_params() -> dict:
    args = demo.parse_args(["--tp", "1", "--dp", "1", *ARGS])
    model = demo.build_model(len(set(demo.corpus())), args, demo.Parallel(0, 1, 1, 1, torch.device("cpu")))
    return {n: p.detach() for n, p in model.named_parameters()}


def _trained(out, name) -> dict:
    return torch.load(out / f"model-{name}.pt", weights_only=True)


def _losses(results, name) -> list:
    r = {r["optim"]: r for r in results}[name]
    assert "losses" in r, f"{name}: {r.get('skipped')}"
    return r["losses"]


@pytest.mark.parametrize("name", EXACT)
def test_tp_fsdp_matches_single_process(tp_run, single_run, name):
    tp_out, _, tp_res = tp_run
    one_out, one_res = single_run
    tp_losses = _losses(tp_res["results"], name)
    one_losses = _losses(list(one_res.values()), name)
    diff = max(abs(a - b) for a, b in zip(tp_losses, one_losses))
    assert len(tp_losses) == len(one_losses) == 8 and diff <= 1e-9, (tp_losses, one_losses)

    tp_params, one_params, init = _trained(tp_out, name), _trained(one_out, name), _initial_params()
    assert list(tp_params) == list(one_params) == list(init)
    for n in init:
        assert tp_params[n].dtype == torch.float64 and tp_params[n].shape == init[n].shape, n
        err = rel_update_error([tp_params[n]], [one_params[n]], [init[n]])
        assert err <= TOL[torch.float64], f"{name}: {n}: relative update error {err:.3g}"


def test_single_process_state_bytes_per_param(single_run):
    """One process, float64: AdamW holds exactly two moments per param (16 B; its step counters aside)."""
    _, one_res = single_run
    assert one_res["adamw"]["state_bytes_per_param"] == 16.0, one_res["adamw"]


def test_tp_fsdp_adamw8bit_tracks_like_single_process(tp_run, single_run):
    """8-bit blocks are cut from each rank's local shard, not from the whole tensor, so the sharded run rounds its
    states differently: not exact. It must track AdamW (full-precision state, one process) as closely as the
    single-process 8-bit run does, within 2x (the suite's rule for low-precision runs; measured ratio ~1.0)."""
    tp_out, _, tp_res = tp_run
    one_out, one_res = single_run
    results = list(one_res.values())
    truth = _losses(results, "adamw")
    tp_gap = max(abs(a - b) for a, b in zip(_losses(tp_res["results"], "adamw8bit"), truth))
    one_gap = max(abs(a - b) for a, b in zip(_losses(results, "adamw8bit"), truth))
    assert 0 < one_gap and tp_gap <= 2 * one_gap, (tp_gap, one_gap)

    init = _initial_params()
    names = list(init)
    truth_p, tp_p, one_p = _trained(one_out, "adamw"), _trained(tp_out, "adamw8bit"), _trained(one_out, "adamw8bit")
    tp_err = rel_update_error([tp_p[n] for n in names], [truth_p[n] for n in names], [init[n] for n in names])
    one_err = rel_update_error([one_p[n] for n in names], [truth_p[n] for n in names], [init[n] for n in names])
    assert 0 < one_err < 0.1 and tp_err <= 2 * one_err, (tp_err, one_err)


def test_hf_llama_tp_fsdp_matches_single_process(tmp_path):
    """--model llama: transformers' LlamaForCausalLM (its attention, rotary positions) under the same TP plan."""
    pytest.importorskip("transformers")
    argv = ["--model", "llama", "--optim", "adafactor", *ARGS[2:]]
    _, tp_res = _cli_tp2_dp2(tmp_path / "tp", argv)
    tp_losses = _losses(tp_res["results"], "adafactor")
    args = demo.parse_args(["--tp", "1", "--dp", "1", "--out", str(tmp_path / "one"), *argv])
    cpu = demo.Parallel(0, 1, 1, 1, torch.device("cpu"))
    one_losses = _losses(demo.run(args, cpu), "adafactor")
    assert one_losses[-1] < one_losses[0] - 0.1, one_losses
    assert max(abs(a - b) for a, b in zip(tp_losses, one_losses)) <= 1e-9, (tp_losses, one_losses)

    init = {n: p.detach() for n, p in demo.build_model(len(set(demo.corpus())), args, cpu).named_parameters()}
    tp_params, one_params = _trained(tmp_path / "tp", "adafactor"), _trained(tmp_path / "one", "adafactor")
    assert list(tp_params) == list(init) and any(".self_attn.q_proj." in n for n in init)
    err = rel_update_error(list(tp_params.values()), [one_params[n] for n in tp_params], list(init.values()))
    assert err <= TOL[torch.float64], err


def test_stochastic_round_flag_reaches_the_optimizers(tmp_path, monkeypatch):
    """--dtype bfloat16 --stochastic-round (one process, 3 steps): Adafactor, CAME and Lamb are built with
    bf16_stochastic_round=True, their trained bf16 weights differ from those of the same run rounding to nearest,
    and results.json says which run it was; AdamW is left as it is."""
    built = {}
    make = demo.make_optimizer

    def spy(name, model, **kw):
        opt = make(name, model, **kw)
        built.setdefault(name, []).append(opt.defaults.get("bf16_stochastic_round"))
        return opt

    monkeypatch.setattr(demo, "make_optimizer", spy)
    cpu = demo.Parallel(0, 1, 1, 1, torch.device("cpu"))
    argv = ["--optim", "adafactor,came,lamb,adamw", "--steps", "3", "--batch", "4", "--ctx", "16", "--dtype",
            "bfloat16", "--device", "cpu", "--save-params"]
    for flag, out in (([], "nearest"), (["--stochastic-round"], "sr")):
        demo.run(demo.parse_args(["--tp", "1", "--dp", "1", "--out", str(tmp_path / out), *argv, *flag]), cpu)
        with open(tmp_path / out / "results.json") as f:
            assert json.load(f)["stochastic_round"] is bool(flag)
    assert built == {"adafactor": [False, True], "came": [False, True], "lamb": [False, True], "adamw": [None, None]}
    for name in ("adafactor", "came", "lamb"):
        sr, nearest = _trained(tmp_path / "sr", name), _trained(tmp_path / "nearest", name)
        assert all(t.dtype == torch.bfloat16 for t in sr.values()), name
        assert any(not torch.equal(sr[n], nearest[n]) for n in sr), name
    assert all(torch.equal(a, b) for a, b in zip(_trained(tmp_path / "sr", "adamw").values(),
                                                 _trained(tmp_path / "nearest", "adamw").values()))


def test_optimizer_without_layout_support_is_skipped_not_fatal(tmp_path, monkeypatch, capsys):
    """An optimizer that refuses DTensor params (NotImplementedError on its first step) gets a 'skipped' row;
    the others still train."""
    class Refuses(torch.optim.SGD):
        def step(self, closure=None):
            raise NotImplementedError("Refuses does not support sharded (DTensor) parameters yet")

    real = demo.make_optimizer
    monkeypatch.setattr(demo, "make_optimizer", lambda name, model, **kw: Refuses(model.parameters(), lr=0.1)
                        if name == "lamb" else real(name, model))
    args = demo.parse_args(["--tp", "1", "--dp", "1", "--device", "cpu", "--optim", "lamb,adamw", "--steps", "2",
                            "--batch", "2", "--ctx", "8", "--out", str(tmp_path)])
    lamb, adamw = demo.run(args, demo.Parallel(0, 1, 1, 1, torch.device("cpu")))
    assert lamb == dict(optim="lamb", skipped="Refuses does not support sharded (DTensor) parameters yet",
                        params=adamw["params"])
    assert len(adamw["losses"]) == 2
    assert "| lamb | skipped: Refuses does not support" in capsys.readouterr().out


def test_step_ms_is_the_median_of_the_step_times(tmp_path, monkeypatch, capsys):
    """results.json's and the table's "median step ms": the median of the timed steps (forward, backward, step),
    from a clock that makes steps of 5, 1, 9, 400 and 3 ms (median 5; mean 83.6, the fastest 1, the last 3)."""
    # perf_counter's calls: run()'s start, then per step train()'s t0 and its end, then run()'s end. Between the
    # steps (data, loss.item()) the clock moves on by a second, which is not step time.
    moves = iter([0.0] + [m for ms in (5.0, 1.0, 9.0, 400.0, 3.0) for m in (1e3, ms)])
    now = [0.0]

    def clock():
        now[0] += next(moves, 1e3) / 1e3
        return now[0]

    monkeypatch.setattr(demo, "time", type("Clock", (), {"perf_counter": staticmethod(clock)}))
    args = demo.parse_args(["--tp", "1", "--dp", "1", "--device", "cpu", "--optim", "adamw", "--steps", "5",
                            "--batch", "2", "--ctx", "8", "--out", str(tmp_path)])
    (r,) = demo.run(args, demo.Parallel(0, 1, 1, 1, torch.device("cpu")))
    assert r["step_ms"] == pytest.approx(5.0)
    with open(tmp_path / "results.json") as f:
        assert json.load(f)["results"][0]["step_ms"] == pytest.approx(5.0)
    assert "| 5.0 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--tp", "3"], "--tp 3: must divide the model's 4 attention heads"),
    (["--dp", "3", "--batch", "16"], "--batch 16: must be a multiple of --dp 3"),
    (["--optim", "adafactor,sgd"], "--optim sgd: choose from"),
    (["--optim", "adamw,adafactor,adamw"], "--optim adamw: given twice"),  # trained twice, two rows of one name
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--tp", "0"], "--tp 0: must be >= 1"),  # before the defaults divide by it (was a ZeroDivisionError)
    (["--dp", "0"], "--dp 0: must be >= 1"),
    (["--stochastic-round"], "--stochastic-round: only with --dtype bfloat16"),
    (["--timeout", "-1"], "--timeout -1.0: must be a number of seconds > 0"),  # was gloo's error from every rank
    (["--timeout", "nan"], "--timeout nan: must be a number of seconds > 0"),
    (["--ctx", "50000"], "--ctx 50000: must be below the corpus's"),  # was torch.randint's error mid-run
])
def test_bad_arguments_name_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--device", "cpu", *argv])
    assert needle in capsys.readouterr().err


def test_out_that_cannot_be_written_is_refused_before_training(tmp_path, capsys):
    """--out under a plain file: refused by the parser, naming the flag (it failed after training, with an error
    from whichever rank reached it first)."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit):
        demo.parse_args(["--device", "cpu", "--out", str(tmp_path / "afile" / "sub")])
    assert f"--out {tmp_path / 'afile' / 'sub'}: cannot be created or written" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a command refused for another flag leaves no folder behind
        demo.parse_args(["--device", "cpu", "--tp", "3", "--out", str(tmp_path / "new" / "sub")])
    assert not (tmp_path / "new").exists()
    args = demo.parse_args(["--device", "cpu", "--out", str(tmp_path / "new" / "sub")])
    assert (tmp_path / "new" / "sub").is_dir() and args.out == str(tmp_path / "new" / "sub")


def test_run_sh_setup_follows_fastopt_torch(tmp_path):
    """`./run.sh setup` with a stub venv whose python logs its arguments: the first setup installs the torch
    requirement (pip leaves a torch that satisfies it as it is), a second with the same FASTOPT_TORCH does
    nothing, and a changed FASTOPT_TORCH sets up again and asks pip for the new requirement."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "python"
    stub.write_text(f'#!/bin/sh\necho "$*" >>"{log}"\n')
    stub.chmod(0o755)

    def setup(requirement):
        env = dict(os.environ, FASTOPT_VENV=str(venv), FASTOPT_TORCH=requirement)
        p = subprocess.run(["bash", os.path.join(ROOT, "run.sh"), "setup"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stderr
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return calls

    first = ["-m pip install -q --upgrade pip", "-m pip install -q torch==2.13.0",
             f"-m pip install -q -e {ROOT}[test]"]
    assert setup("torch==2.13.0") == first
    assert setup("torch==2.13.0") == []
    assert setup("torch>=2.14") == [first[0], "-m pip install -q torch>=2.14", first[2]]
    # `./run.sh demo` runs in the caller's folder (a relative --out lands there), set up already
    stub.write_text(f'#!/bin/sh\necho "$(pwd) $*" >>"{log}"\n')
    env = dict(os.environ, FASTOPT_VENV=str(venv), FASTOPT_TORCH="torch>=2.14")
    p = subprocess.run(["bash", os.path.join(ROOT, "run.sh"), "demo", "--out", "rel"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert log.read_text().splitlines() == [f"{tmp_path} -m fastopt.demo --out rel"]
