"""The seam: one function per fused op. Optimizer classes call these and never branch on the device.

Back end per call: `FASTOPT_BACKEND=torch|triton|auto` (default auto). auto sends CUDA tensors to the
Triton kernels (`fastopt.kernels`) and CPU tensors to the plain-torch reference (`fastopt.reference`).
`triton` with CPU tensors runs the real kernels through Triton's interpreter, which needs
`TRITON_INTERPRET=1` in the environment before Python starts; the test suite runs every kernel that way.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re

import torch

from .distributed.phases import drive

__all__ = ["backend", "use_triton", "triton_available", "adafactor_step", "lamb_step", "came_step", "adafactor_phases",
           "lamb_phases", "came_phases"]

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


def major_minor(version: str) -> tuple[int, int]:
    """(2, 10) of "2.10.0+cu128"; (0, 0) where it cannot tell."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def interpreter_clash(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton `triton_version`'s interpreter cannot run fastopt's kernels beside NumPy `numpy_version`, or
    None. Before 3.7 the interpreter reads a loop bound loaded from memory (`range(0, C, BLOCK)`) through int()
    of a one-element array, which NumPy 2.4 refuses: every kernel would fail inside with "only 0-dimensional
    arrays can be converted to Python scalars" (torch 2.10 and 2.11 pin Triton 3.6, torch 2.9 Triton 3.5)."""
    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) cannot run fastopt's kernels with "
                f"NumPy {numpy_version}: install numpy<2.4 or triton>=3.7, or use FASTOPT_BACKEND=torch")
    return None


def _interpreter_clash_here() -> str | None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):  # not interpreting() (compile_check replaces it)
        return None
    import numpy
    import triton
    return interpreter_clash(triton.__version__, numpy.__version__)


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
        clash = _interpreter_clash_here()
        if clash:
            raise RuntimeError(clash)
        return True
    if t.device.type == "cpu":
        raise RuntimeError("FASTOPT_BACKEND=triton cannot run on cpu tensors without Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before Python starts, or use FASTOPT_BACKEND=torch")
    raise RuntimeError(f"FASTOPT_BACKEND=triton runs Triton kernels on cuda tensors (and cpu ones under "
                       f"TRITON_INTERPRET=1), not on {t.device.type} tensors: use FASTOPT_BACKEND=auto or torch, "
                       f"which step them with the torch reference")


def on_device(device: torch.device):
    """The context a bucket's step runs in: its GPU made the current device, because Triton launches a kernel
    on the current device and its current stream whatever device the tensors are on (params spread over
    several GPUs of one process, as under `device_map="auto"`, would be stepped by the wrong GPU); nothing for
    other devices."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _resumed_on(gen, device: torch.device):
    """`gen`, each of its resumptions run on_device(device), the previous device current again before it
    yields: the steps of several buckets advance in turns (fastopt.distributed.phases), so no guard may stay
    entered across a yield."""
    while True:
        with on_device(device):
            try:
                req = next(gen)
            except StopIteration:
                return
        yield req


def _on_params_device(phases_fn):
    """A `*_phases` op whose every resumption runs on its bucket's device (`on_device`)."""
    @functools.wraps(phases_fn)
    def phases(params, *args, **kwargs):
        return _resumed_on(phases_fn(params, *args, **kwargs), params[0].device)
    return phases


def _dense(params: list, grads: list) -> tuple[list, list]:
    """Contiguous stand-ins for the params and grads the Triton kernels index as row-major memory (a transposed
    or channels_last param, a strided grad): the states are always contiguous, so the kernels step the
    stand-ins and `_write_back` copies them into the params. Contiguous tensors pass through (no copy). A grad
    in another dtype than its param comes as a copy in the param's dtype: the kernels read a bucket's params
    and grads through one element type (the optimizers cast such grads before; this covers direct calls).
    (`g.to(dtype, memory_format=torch.contiguous_format)` would hand back a transposed grad as it is.)"""
    return ([p if p.is_contiguous() else p.contiguous() for p in params],
            [g if g.is_contiguous() and g.dtype == p.dtype else g.to(p.dtype).contiguous()
             for p, g in zip(params, grads)])


def unscale_grads_(grads: list, inv_scale: torch.Tensor | None, found_inf: torch.Tensor | None = None) -> None:
    """grads *= GradScaler's 1/scale in place, each in its own dtype, unless found_inf (0. or 1., on the device) is
    set: after a step on GradScaler's fused path, p.grad holds the unscaled gradient where the step was taken and is
    left as it was where it was skipped, as after torch's fused optimizers. The kernels store it in the pass that
    reads the gradient; this separate op (one more read and write of each of `grads`, on the fused path only, no
    host sync) covers what they cannot: gradients entering through a matmul (GaLore's projected params), copies a
    kernel read instead of the gradient itself (`_dense`, a cast or redistributed gradient)."""
    if inv_scale is None or not grads:
        return
    factor = inv_scale if found_inf is None else torch.where(found_inf > 0, torch.ones_like(inv_scale), inv_scale)
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, gs in by_dtype.items():
        if dtype == torch.float16:  # in fp32, then rounded once: 1/scale is below fp16's range past a scale of 2^24
            for g in gs:
                g.copy_(g.float().mul_(factor))
        else:  # 1/scale, a power of 2, is exact in every other float dtype: the product is rounded once
            torch._foreach_mul_(gs, factor)


def _unscale_copies(grads: list, dense: list, inv_scale, found_inf) -> None:
    """After a kernel that stored the unscaled gradient into `dense` (`_dense`'s): the grads it read as copies."""
    unscale_grads_([g for g, d in zip(grads, dense) if d is not g], inv_scale, found_inf)


def _write_back(params: list, work: list) -> None:
    for p, w in zip(params, work):
        if w is not p:
            p.copy_(w)


@_on_params_device
def adafactor_phases(params, grads, states, *, inv_scale=None, found_inf=None, sharded=False, cache=None,
                     layouts=None, **hyper):
    """One Adafactor step over a bucket (same device and dtype) of local tensors, as a generator
    (fastopt.distributed.phases): with `sharded`, it yields each phase's flat buffer to be summed across the
    ranks that share these params and goes on once it is. `layouts[i]` maps param i's local elements onto its
    global tensor (None: it is all here); `cache` keeps the kernels' tables (and the index maps of sharded
    params) between steps."""
    from .distributed.layout import real_elements
    params, grads, states = real_elements(params, grads, states, layouts, ("exp_avg", "exp_avg_sq"))
    if use_triton(params[0]):
        from .kernels import adafactor as k
        work, dense = _dense(params, grads)
        yield from k.adafactor_phases(work, dense, states, inv_scale=inv_scale, found_inf=found_inf,
                                      sharded=sharded, cache=cache, layouts=layouts, **hyper)
        _write_back(params, work)
        _unscale_copies(grads, dense, inv_scale, found_inf)
    else:
        from .reference import adafactor as r
        yield from r.adafactor_phases(params, grads, states, inv_scale=inv_scale, found_inf=found_inf,
                                      sharded=sharded, layouts=layouts, **hyper)


def adafactor_step(params, grads, states, *, reduce=None, **kw):
    """`adafactor_phases` run through: `reduce(buf)` sums each buffer across the ranks that share these params
    (None: a single process)."""
    drive(adafactor_phases(params, grads, states, sharded=reduce is not None, **kw), reduce)


@_on_params_device
def lamb_phases(params, grads, states, *, inv_scale=None, found_inf=None, sharded=False, cache=None, layouts=None,
                **hyper):
    """One LAMB step over a bucket (same device and dtype), as a generator (see `adafactor_phases`): with
    `sharded`, it yields the flat buffer of per-param squared norms [||p_0||^2, ||a_0||^2, ...] to be summed
    across the ranks that share these params; `cache` keeps the kernels' tables between steps. The norms are
    sums over elements, so any layout works on the local elements alone; `layouts` cuts the padding off flat
    shards and places the elements for stochastic rounding (`sr_ids`: the params' ids seeding it)."""
    from .distributed.layout import real_elements
    bs = hyper.get("block_size", 256)  # lamb_phases' default
    absmax = {"exp_avg_absmax": bs, "exp_avg_sq_absmax": bs}
    params, grads, states = real_elements(params, grads, states, layouts, ("exp_avg", "exp_avg_sq"), absmax)
    if use_triton(params[0]):
        from .kernels import lamb as k
        work, dense = _dense(params, grads)
        yield from k.lamb_phases(work, dense, states, inv_scale=inv_scale, found_inf=found_inf, sharded=sharded,
                                 cache=cache, layouts=layouts, **hyper)
        _write_back(params, work)
        _unscale_copies(grads, dense, inv_scale, found_inf)
    else:
        from .reference import lamb as r
        yield from r.lamb_phases(params, grads, states, inv_scale=inv_scale, found_inf=found_inf, sharded=sharded,
                                 layouts=layouts, **hyper)


def lamb_step(params, grads, states, *, reduce=None, **kw):
    """`lamb_phases` run through: `reduce(buf)` sums the norms across the ranks (None: a single process)."""
    drive(lamb_phases(params, grads, states, sharded=reduce is not None, **kw), reduce)


@_on_params_device
def came_phases(params, grads, states, *, inv_scale=None, found_inf=None, sharded=False, cache=None, layouts=None,
                **hyper):
    """One CAME step over a bucket (same device and dtype), as a generator (see `adafactor_phases`): with
    `sharded`, it yields a flat buffer to be summed across the ranks that share these params once per phase:
    the G^2 row/column sums, the per-param sums of U^2, the instability row/column sums; `cache` keeps the
    kernels' tables between steps. `layouts` as in `adafactor_phases`."""
    from .distributed.layout import real_elements
    from .reference.came import QBLOCK
    params, grads, states = real_elements(params, grads, states, layouts, ("exp_avg", "exp_avg_sq"),
                                          {"exp_avg_absmax": QBLOCK})
    if use_triton(params[0]):
        from .kernels import came as k
        work, dense = _dense(params, grads)
        yield from k.came_phases(work, dense, states, inv_scale=inv_scale, found_inf=found_inf, sharded=sharded,
                                 cache=cache, layouts=layouts, **hyper)
        _write_back(params, work)
        _unscale_copies(grads, dense, inv_scale, found_inf)
    else:
        from .reference import came as r
        yield from r.came_phases(params, grads, states, inv_scale=inv_scale, found_inf=found_inf, sharded=sharded,
                                 layouts=layouts, **hyper)


def came_step(params, grads, states, *, reduce=None, **kw):
    """`came_phases` run through: `reduce(buf)` sums each buffer across the ranks (None: a single process)."""
    drive(came_phases(params, grads, states, sharded=reduce is not None, **kw), reduce)


# ---- 8-bit block-wise state: the compiled extension (csrc/, built by fastopt.ext) ------------------------
# Every backend but `torch` runs these in the extension, on CPU (C++ kernels) and CUDA alike: there are no
# Triton kernels for them. `torch` runs fastopt.reference.quant / .adamw8bit. Formats: see reference/quant.py.

__all__ += ["use_extension", "quantize_blockwise", "dequantize_blockwise", "quantize_blockwise_",
            "dequantize_blockwise_", "adamw8bit_step"]


def use_extension() -> bool:
    """Whether the 8-bit ops run in the compiled extension (every FASTOPT_BACKEND but `torch`)."""
    return backend() != "torch"


def load_extension() -> None:
    """Build (first use) or load the compiled extension; its error, the same at every call, when it cannot be."""
    from . import ext
    ext.load()


def _ext_ops():
    load_extension()
    return torch.ops.fastopt


def quantize_blockwise(x: torch.Tensor, block_size: int = 256, signed: bool = True):
    """(codes uint8 [x.shape], absmax fp32 [ceil(n / block_size)]) of any float tensor."""
    from .reference import quant as q
    q.check_block_size(block_size)
    q.check_float(x)
    if not use_extension():
        return q.quantize_blockwise(x, block_size, signed)
    return _ext_ops().quantize_blockwise(x, q.dynamic_map(signed, x.device), block_size)


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, block_size: int = 256, signed: bool = True,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """map[codes] * absmax of each block, as `dtype`, in codes' shape."""
    from .reference import quant as q
    if not use_extension():
        return q.dequantize_blockwise(codes, absmax, block_size, signed, dtype)
    q.check_block_size(block_size, "dequantize_blockwise")
    if dtype not in q.FLOAT_DTYPES:
        raise ValueError(f"dequantize_blockwise: dtype={dtype} must be a floating-point dtype "
                         "(float32, float64, bfloat16 or float16)")
    if codes.dtype != torch.uint8:
        raise ValueError(f"dequantize_blockwise: codes has dtype {codes.dtype}; expected torch.uint8")
    return _ext_ops().dequantize_blockwise(codes, absmax, q.dynamic_map(signed, codes.device), block_size, dtype)


def dequantize_blockwise_(codes: list, absmax: list, out: list, *, block_size: int = 256, signed: bool = True):
    """out[i] <- dequantized (codes[i], absmax[i]) for every i, in one launch (out: one float dtype, contiguous).

    With `quantize_blockwise_` this is the generic way for an optimizer to keep any state in 8 bits:
    dequantize into fp32 scratch, run its own fp32 math, requantize in place."""
    from .reference import quant as q
    q.check_block_size(block_size, "dequantize_blockwise_")
    if not codes:
        return
    if not use_extension():
        for c, a, o in zip(codes, absmax, out):
            o.copy_(q.dequantize_blockwise(c, a, block_size, signed, o.dtype))
        return
    _ext_ops().dequantize_blockwise_multi_(codes, absmax, out, q.dynamic_map(signed, codes[0].device), block_size)


def quantize_blockwise_(xs: list, codes: list, absmax: list, *, block_size: int = 256, signed: bool = True,
                        found_inf: torch.Tensor | None = None):
    """codes[i], absmax[i] <- quantized xs[i] for every i, in place and in one launch; nothing is written when
    `found_inf` (GradScaler's, on the device) is nonzero. xs: one float dtype; codes, absmax contiguous."""
    from .reference import quant as q
    q.check_block_size(block_size, "quantize_blockwise_")
    if not xs:
        return
    for x in xs:
        q.check_float(x, "quantize_blockwise_", "xs[i]")
    if not use_extension():
        from .reference.adamw8bit import _commit
        for x, c, a in zip(xs, codes, absmax):
            c_new, a_new = q.quantize_blockwise(x, block_size, signed)
            _commit(c, c_new.view_as(c), found_inf)
            _commit(a, a_new.view_as(a), found_inf)
        return
    _ext_ops().quantize_blockwise_multi_([x.contiguous() for x in xs], codes, absmax,
                                         q.dynamic_map(signed, xs[0].device), block_size, found_inf)


def adamw8bit_step(params, grads, states, *, lr, betas, eps, weight_decay, block_size, inv_scale=None,
                   found_inf=None, cache=None):
    """One AdamW step over a bucket (same device and dtype): 8-bit states (keys state1, state2, absmax1,
    absmax2) and full-precision ones (state1, state2) alike; each state's `step` is already advanced.
    The extension runs one fused launch for the 8-bit params and one for the others. `cache` (a dict the
    caller keeps per bucket) holds their address tables on the device, rebuilt only when a tensor moved: a
    step of tensors that stayed put copies nothing from the host (what a CUDA graph of the step needs)."""
    if not use_extension():
        from .reference import adamw8bit as r
        r.adamw8bit_step(params, grads, states, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         block_size=block_size, inv_scale=inv_scale, found_inf=found_inf)
        return
    from .reference import quant as q
    fo = _ext_ops()
    beta1, beta2 = betas
    work, dense = _dense(params, grads)
    eight = [i for i, s in enumerate(states) if "absmax1" in s]
    full = [i for i, s in enumerate(states) if "absmax1" not in s]
    if eight:
        dev = params[0].device
        lists = ([work[i] for i in eight], [dense[i] for i in eight], [states[i]["state1"] for i in eight],
                 [states[i]["state2"] for i in eight], [states[i]["absmax1"] for i in eight],
                 [states[i]["absmax2"] for i in eight], [states[i]["step"] for i in eight])
        table = _ext_table(cache, "adamw8bit_table", lists, block_size)
        fo.adamw8bit_step_(*lists, q.dynamic_map(True, dev), q.dynamic_map(False, dev),
                           lr, beta1, beta2, eps, weight_decay, block_size, inv_scale, found_inf, table)
    if full:
        lists = ([work[i] for i in full], [dense[i] for i in full], [states[i]["state1"] for i in full],
                 [states[i]["state2"] for i in full], [states[i]["step"] for i in full])
        table = _ext_table(cache, "adamw32_table", lists)
        fo.adamw32_step_(*lists, lr, beta1, beta2, eps, weight_decay, inv_scale, found_inf, table)
    _write_back(params, work)
    _unscale_copies(grads, dense, inv_scale, found_inf)  # the extension stored the unscaled gradient in `dense`


def _ext_table(cache: dict | None, op: str, lists: tuple, *args):
    """The extension's address table of `lists` (torch.ops.fastopt.<op>), from `cache` while none of the
    tensors moved or changed size; None without a cache (the step op then builds and copies its own)."""
    if cache is None:
        return None
    key = (tuple((t.data_ptr(), t.numel()) for ts in lists for t in ts), *args)
    hit = cache.get(op)
    if hit is None or hit[0] != key:
        hit = cache[op] = (key, build_ext_table(op, lists, *args))
    return hit[1]


def build_ext_table(op: str, lists: tuple, *args) -> torch.Tensor:
    """torch.ops.fastopt.<op>(*lists, *args): a copy from the host (tests count these calls)."""
    return getattr(_ext_ops(), op)(*lists, *args)


# ---- GaLore: low-rank projection (fastopt/reference/galore.py, kernels/galore.py) ------------------------
__all__ += ["galore_refresh", "galore_step", "galore_phases"]


def galore_refresh(grads, states, refresh, *, rank, inv_scale=None, found_inf=None, layouts=None):
    """New projection bases (torch.linalg.svd of each flagged param's whole gradient, in fp32) for the params
    whose `refresh` flag is set; every back end runs the same SVD. A step GradScaler skips keeps the old
    bases. Sharded params (`layouts`) assemble their whole gradient on these steps only, each on one rank of
    its (last) group, which computes its SVD (one all_to_all of the pieces for the bucket; over several groups,
    all-reduces over the others and a reduce over the last); all-reduces of bounded buffers share the bucket's
    new bases, each rank keeping its part (`refresh_bases`)."""
    from .reference import galore as r
    r.refresh_bases(grads, states, refresh, rank=rank, inv_scale=inv_scale, found_inf=found_inf, layouts=layouts)


@_on_params_device
def galore_phases(params, grads, states, *, inv_scale=None, found_inf=None, cache=None, layouts=None,
                  sharded=False, **hyper):
    """One GaLore-AdamW step over a bucket (same device and dtype) with bases already refreshed: projection,
    Adam on the projected moments (fp32 or 8-bit block-wise), back-projection fused with the parameter update.
    Params without bases take plain AdamW (flat shards: real elements only). A generator (see
    `adafactor_phases`): with `sharded`, the local products go into one flat buffer that it yields to be summed
    across the ranks (one collective per step for the bucket; DTensors' sharded moments: a reduce-scatter and
    an all-gather). `cache` keeps the kernels' small tables between steps."""
    from .distributed.layout import real_elements
    absmax = {"exp_avg_absmax": hyper["block_size"], "exp_avg_sq_absmax": hyper["block_size"]}
    if layouts is not None:  # flat shards of params without a projection: cut the padding off
        plain = [lay if "proj_left" not in s and "proj_right" not in s else None for s, lay in zip(states, layouts)]
        params, grads, states = real_elements(params, grads, states, plain, ("exp_avg", "exp_avg_sq"), absmax)
    if use_triton(params[0]):
        from .kernels import galore as k
        yield from k.galore_phases(params, grads, states, inv_scale=inv_scale, found_inf=found_inf, cache=cache,
                                   layouts=layouts, sharded=sharded, **hyper)
        # The kernels store the unscaled gradient of the params without a projection that they read in place;
        # a projected param's enters through the projection's matmul, which cannot store it.
        from .reference.galore import is_projected
        unscale_grads_([g for g, s in zip(grads, states) if is_projected(s) or not g.is_contiguous()], inv_scale,
                       found_inf)
    else:
        from .reference import galore as r
        yield from r.galore_phases(params, grads, states, inv_scale=inv_scale, found_inf=found_inf, layouts=layouts,
                                   sharded=sharded, **hyper)


def galore_step(params, grads, states, *, reduce=None, **kw):
    """`galore_phases` run through: `reduce(buf)` sums the buffer across the ranks (None: a single process)."""
    drive(galore_phases(params, grads, states, sharded=reduce is not None, **kw), reduce)
