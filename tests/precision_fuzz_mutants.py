"""Mutants of the torch back end (fastopt/reference/*, monkeypatched in this process only) that
tests/test_precision_fuzz.py must catch: each runs the fuzzer's torch seeds of the optimizers it touches and
prints how many of them fail (and with which rule). Nothing in fastopt is edited.

    python tests/precision_fuzz_mutants.py [SEEDS_PER_MUTANT] [MUTANT ...]
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import test_precision_fuzz as pf  # noqa: E402
from fastopt.reference import adafactor, adamw8bit, came, galore, lamb  # noqa: E402

COMMITS = (adafactor, came, lamb, galore, adamw8bit)  # each module holds its own name `_commit`


def _unskipped(dst, new, found_inf):
    """GradScaler's found_inf ignored: the overflowed step is taken."""
    dst.copy_(new.to(dst.dtype))


def _truncating(orig):
    def commit(dst, new, found_inf):
        """bf16 params rounded toward zero (the low 16 bits cut) instead of to nearest even."""
        if dst.dtype == torch.bfloat16 and new.dtype == torch.float32:
            new = (new.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        orig(dst, new, found_inf)
    return commit


def _kw(fn, **over):
    def wrapped(*a, **k):
        k.update(over)
        return fn(*a, **k)
    return wrapped


def _bf16_moments(orig):
    def store(state, m, v, *a, **k):
        """Lamb / GaLore's 32-bit moments stored at bf16 precision (a wrong rounding of the state)."""
        return orig(state, m.to(torch.bfloat16).float(), v.to(torch.bfloat16).float(), *a, **k)
    return store


def _sr_step_off(orig):
    def sr(x, step, index, emap=None):
        """Stochastic rounding's noise drawn with the step before (not the one the README names)."""
        return orig(x, step - 1, index, emap)
    return sr


MUTANTS = {
    # name: (optimizers whose seeds it runs, [(module, attribute, replacement factory)])
    "unskipped_overflow": (pf.of.OPTS, [(m, "_commit", lambda orig: _unskipped) for m in COMMITS]),
    "lamb_eps_dropped": (("lamb",), [(lamb, "lamb_phases", lambda orig: _kw(orig, eps=0.0))]),
    "adamw8bit_eps_dropped": (("adamw8bit",), [(adamw8bit, "adamw8bit_step", lambda orig: _kw(orig, eps=0.0))]),
    "adafactor_eps2_dropped": (("adafactor",), [(adafactor, "adafactor_phases",
                                                 lambda orig: _kw_eps_pair(orig))]),
    "grads_not_unscaled": (("lamb", "adamw8bit", "adafactor", "came"),
                           [(lamb, "lamb_phases", lambda orig: _kw(orig, inv_scale=None)),
                            (adamw8bit, "adamw8bit_step", lambda orig: _kw(orig, inv_scale=None)),
                            (adafactor, "adafactor_phases", lambda orig: _kw(orig, inv_scale=None)),
                            (came, "came_phases", lambda orig: _kw(orig, inv_scale=None))]),
    "moments_in_bf16": (("lamb", "galore"), [(lamb, "store_moments", _bf16_moments),
                                             (galore, "store_moments", _bf16_moments)]),
    "bf16_truncated": (("adafactor", "came", "lamb"), [(m, "_commit", _truncating) for m in (adafactor, came, lamb)]),
    "sr_noise_step_off": (("adafactor", "came", "lamb"), [(m, "stochastic_round_bf16", _sr_step_off)
                                                         for m in (adafactor, came, lamb)]),
}


def _kw_eps_pair(orig):
    def wrapped(*a, **k):
        """Adafactor's eps2 (the floor of RMS(p) in the relative step size) dropped."""
        k["eps"] = (k["eps"][0], 0.0)
        return orig(*a, **k)
    return wrapped


def seeds_for(opts, count, need=None):
    out, seed = [], 0
    while len(out) < count and seed < 20000:
        cfg = pf.draw(seed)
        if cfg["backend"] == "torch" and cfg["opt"] in opts and (need is None or need(cfg)):
            out.append(seed)
        seed += 1
    return out


NEEDS = {
    "unskipped_overflow": lambda c: c["scaler"] is not None,
    "grads_not_unscaled": lambda c: c["scaler"] is not None,
    "sr_noise_step_off": lambda c: any(c["sr"]),
    "bf16_truncated": lambda c: "bf16" in c["dtypes"],
}


def main(argv):
    import warnings
    warnings.filterwarnings("ignore")
    count = int(argv[0]) if argv else 40
    names = argv[1:] or list(MUTANTS)
    for name in names:
        opts, patches = MUTANTS[name]
        seeds = seeds_for(opts, count, NEEDS.get(name))
        saved = [(m, attr, getattr(m, attr)) for m, attr, _ in patches]
        for m, attr, make in patches:
            setattr(m, attr, make(getattr(m, attr)))
        caught, example = 0, None
        try:
            for seed in seeds:
                bad = pf.run(pf.draw(seed))
                if bad:
                    caught += 1
                    example = example or (seed, bad[0])
        finally:
            for m, attr, orig in saved:
                setattr(m, attr, orig)
        print(f"{name}: caught by {caught} of {len(seeds)} seeds; e.g. {example}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
