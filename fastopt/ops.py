"""The seam: one function per fused op. Optimizer classes call these and never branch on the device.

Back end per call: `FASTOPT_BACKEND=torch|triton|auto` (default auto). auto sends CUDA tensors to the
Triton kernels (`fastopt.kernels`) and CPU tensors to the plain-torch reference (`fastopt.reference`).
`triton` with CPU tensors runs the real kernels through Triton's interpreter, which needs
`TRITON_INTERPRET=1` in the environment before Python starts; the test suite runs every kernel that way.
"""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["backend", "use_triton", "triton_available", "adafactor_step"]

_BACKENDS = ("auto", "torch", "triton")


def backend() -> str:
    b = os.environ.get("FASTOPT_BACKEND", "auto").strip().lower() or "auto"
    if b not in _BACKENDS:
        raise ValueError(f"FASTOPT_BACKEND={b!r} must be one of {', '.join(_BACKENDS)}")
    return b


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels handle tensors on `t`'s device under the current FASTOPT_BACKEND."""
    b = backend()
    if b == "torch":
        return False
    if b == "auto":
        return t.device.type == "cuda" and triton_available() and not interpreting()
    if not triton_available():
        raise RuntimeError("FASTOPT_BACKEND=triton but Triton is not installed: pip install triton")
    if t.device.type == "cuda":
        return True
    if t.device.type == "cpu" and interpreting():
        return True
    raise RuntimeError(f"FASTOPT_BACKEND=triton cannot run on {t.device.type} tensors: on CPU set "
                       "TRITON_INTERPRET=1 before Python starts (Triton's interpreter), or use FASTOPT_BACKEND=torch")


def adafactor_step(params, grads, states, *, inv_scale=None, found_inf=None, reduce=None, cache=None, **hyper):
    """One Adafactor step over a bucket (same device and dtype). `reduce(buf)` sums a flat buffer across the
    ranks that share these params (None: single process); `cache` keeps the kernels' tables between steps."""
    if use_triton(params[0]):
        from .kernels import adafactor as k
        k.adafactor_step(params, grads, states, inv_scale=inv_scale, found_inf=found_inf, reduce=reduce,
                         cache=cache, **hyper)
    else:
        from .reference import adafactor as r
        r.adafactor_step(params, grads, states, inv_scale=inv_scale, found_inf=found_inf, reduce=reduce, **hyper)
