"""Helpers shared by fastopt's command lines (`python -m fastopt.demo`, the benchmark suite)."""
from __future__ import annotations

import os


def unwritable_folder(path) -> str | None:
    """Create folder `path` (and its parents) if needed: None when it can be written, else why not. The command
    lines check their --out with it before any work, which would otherwise fail only when writing its results."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    return None if os.access(path, os.W_OK) else "not writable"
