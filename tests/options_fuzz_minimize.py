"""Greedy minimizer of a failing tests/test_options_fuzz.py run: drops params, groups, group options, steps,
None gradients and extras while the run still fails (any failure whose first message has the same kind).

    python tests/options_fuzz_minimize.py SEED            # prints the minimal cfg (JSON) and its failures
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import warnings  # noqa: E402
warnings.filterwarnings("ignore")

import test_options_fuzz as F  # noqa: E402

PER_PARAM = ("zero_init", "scales", "noncontig")


def kind(bad):
    return re.sub(r"[-+0-9.e]+", "#", bad[0].split(")")[-1].split(":")[-1]) if bad else None


def fails(cfg, want):
    try:
        bad, _ = F.run(copy.deepcopy(cfg))
    except Exception:  # noqa: BLE001  (another failure than the one minimized)
        return False
    return bool(bad) and (want is None or kind(bad) == want)


def drop_param(cfg, k):
    c = copy.deepcopy(cfg)
    i = 0
    for g in c["groups"]:
        if k < i + len(g["shapes"]):
            del g["shapes"][k - i]
            break
        i += len(g["shapes"])
    c["groups"] = [g for g in c["groups"] if g["shapes"]] or c["groups"]
    for key in PER_PARAM:
        if key in c:
            del c[key][k]
    c["none"] = [row[:k] + row[k + 1:] for row in c["none"]]
    return c


def candidates(cfg):
    n = sum(len(g["shapes"]) for g in cfg["groups"])
    for k in range(n):
        if n > 1:
            yield drop_param(cfg, k)
    for t in range(cfg["steps"] - 1, 0, -1):
        c = copy.deepcopy(cfg)
        c["steps"] = t
        c["none"] = c["none"][:t]
        yield c
    for gi, g in enumerate(cfg["groups"]):
        for key in list(g["own"]):
            if key in ("galore", "galore_omit"):
                continue
            c = copy.deepcopy(cfg)
            del c["groups"][gi]["own"][key]
            yield c
    for t, row in enumerate(cfg["none"]):
        for k, v in enumerate(row):
            if v:
                c = copy.deepcopy(cfg)
                c["none"][t][k] = False
                yield c
    for k, s in enumerate(cfg["scales"]):
        if s != 1.0:
            c = copy.deepcopy(cfg)
            c["scales"][k] = 1.0
            yield c
    for key in ("changes", "numpy_keys"):
        if cfg.get(key):
            c = copy.deepcopy(cfg)
            c[key] = []
            yield c
    for key in ("grad_noncontig", "add_later", "reload_at"):
        if cfg.get(key):
            c = copy.deepcopy(cfg)
            c[key] = None
            yield c
    if any(cfg.get("noncontig", [])):
        c = copy.deepcopy(cfg)
        c["noncontig"] = [False] * len(c["noncontig"])
        yield c


def minimize(cfg):
    bad, _ = F.run(copy.deepcopy(cfg))
    if not bad:
        return cfg, bad
    want = kind(bad)
    changed = True
    while changed:
        changed = False
        for c in candidates(cfg):
            if fails(c, want):
                cfg, changed = c, True
                break
    return cfg, F.run(copy.deepcopy(cfg))[0]


if __name__ == "__main__":
    arg = sys.argv[1]
    cfg = json.loads(open(arg).read()) if arg.endswith(".json") else F.draw(int(arg))
    cfg, bad = minimize(cfg)
    print(json.dumps(cfg))
    print("\n".join(bad))
