"""Host-side helpers for the multi-tensor Triton kernels, and device helpers several kernels share.

A multi-tensor launch covers every param of a bucket with one grid: each program looks up its param in
a small int32 table (`prog_param`), then that param's pointers in int64 pointer tables. The tables that do
not change between steps (param and state pointers, shapes, program maps) are built once and cached by the
optimizer; only the gradient pointers are rebuilt per step (grads are reallocated after
`zero_grad(set_to_none=True)`), with an asynchronous copy from pinned memory: no host sync.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Tests set this: scratch buffers are filled with NaN before each step, so an element no kernel wrote fails loudly.
POISON = False


def acc_type(dtype: torch.dtype):
    """Accumulation type of the kernels: fp64 for fp64 params, fp32 for everything else."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def ptr_table(tensors: list, device: torch.device) -> torch.Tensor:
    """int64 table of data pointers (0 for None) on `device`."""
    return to_device([0 if t is None else t.data_ptr() for t in tensors], torch.int64, device)


class GradTable:
    """The gradient pointer table of a bucket, rebuilt only when a gradient moved: a step whose grads sit where
    they sat last step copies nothing from the host, so a CUDA graph captured after warm-up steps replays with a
    table that stays valid (a per-step copy from a pinned buffer would read whatever reused that buffer)."""

    __slots__ = ("key", "table")

    def __init__(self):
        self.key, self.table = None, None

    def __call__(self, grads: list, device: torch.device) -> torch.Tensor:
        key = tuple(g.data_ptr() for g in grads)
        if key != self.key:
            self.table, self.key = ptr_table(grads, device), key
        return self.table


def program_table(counts: list[int], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """(prog_param, starts): program `pid` works on param prog_param[pid], its starts[i]-th program is pid."""
    starts, owner = [], []
    for i, n in enumerate(counts):
        starts.append(len(owner))
        owner.extend([i] * n)
    return to_device(owner, torch.int32, device), starts


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tile_shape(max_cols: int, tile: int = 4096, max_cols_block: int = 1024) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for row-block programs that sweep all columns of their rows."""
    block_c = min(max_cols_block, next_pow2(max_cols))
    block_r = max(1, min(64, tile // block_c))
    return block_r, block_c


def bucket_key(*tensor_lists) -> tuple:
    """Identity of a bucket's persistent tensors: the cached tables stay valid while this is unchanged."""
    return tuple((t.data_ptr(), tuple(t.shape)) if t is not None else None for ts in tensor_lists for t in ts)


@triton.jit
def load_ptr(table, i, ref):
    """Entry `i` of an int64 pointer table, as a pointer of `ref`'s element type."""
    return tl.load(table + i).to(ref.dtype)


@triton.jit
def keep_limit(n, found_inf_ptr, HAS_INF: tl.constexpr):
    """`n`, or 0 when GradScaler found an inf this step: stores masked with `idx < keep_limit(n, ...)` then
    write nothing. (A limit, not a boolean: the interpreter cannot `&` a scalar boolean into a mask.)"""
    if HAS_INF:
        return tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    else:
        return n


@triton.jit
def stochastic_round_bf16(x, seed, offs):
    """fp32 -> bf16 rounding up or down with probability proportional to distance (unbiased)."""
    bits = x.to(tl.int32, bitcast=True)
    noise = (tl.randint(seed, offs.to(tl.int32)) & 0xFFFF).to(tl.int32)
    rounded = ((bits + noise) & -65536).to(tl.float32, bitcast=True)
    finite = (x == x) & (tl.abs(x) < float("inf"))
    return tl.where(finite, rounded, x).to(tl.bfloat16)


@triton.jit
def round_to(x, out_ty: tl.constexpr):
    """Round-to-nearest-even cast for stores. bf16 is rounded by hand: Triton's interpreter truncates on that
    cast (the compiled path rounds to nearest even too, so both agree bit for bit)."""
    if out_ty == tl.bfloat16:
        xf = x.to(tl.float32)
        bits = xf.to(tl.int32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & -65536
        finite = (xf == xf) & (tl.abs(xf) < float("inf"))
        return tl.where(finite, bits.to(tl.float32, bitcast=True), xf).to(tl.bfloat16)
    else:
        return x.to(out_ty)


@triton.jit
def _segment_sum_kernel(parts_ptr, seg_start_ptr, seg_len_ptr, out_ptr, WIDTH: tl.constexpr,
                        BLOCK: tl.constexpr):
    """out[i, k] = sum_j parts[seg_start[i] + j, k] for j < seg_len[i]: per-param sums of per-program partials."""
    i = tl.program_id(0)
    start = tl.load(seg_start_ptr + i).to(tl.int64)
    n = tl.load(seg_len_ptr + i)
    for k in tl.static_range(WIDTH):
        acc = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
        for j0 in range(0, n, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            acc += tl.load(parts_ptr + (start + j) * WIDTH + k, mask=j < n, other=0.0)
        tl.store(out_ptr + i * WIDTH + k, tl.sum(acc, 0))


def segment_sum(parts: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor, out: torch.Tensor,
                width: int) -> None:
    n = seg_start.numel()
    if n:
        _segment_sum_kernel[(n,)](parts, seg_start, seg_len, out, WIDTH=width, BLOCK=256 if not INTERPRET else 64)


def reduce_fp64(reduce, buf: torch.Tensor) -> None:
    """`reduce(buf)` through a float64 copy when `buf` is narrower: the buffers that ranks sum are float64 in the
    reference (its `reduction_sizes`, which the layout benchmark counts), whatever the kernels accumulate in."""
    if buf.dtype == torch.float64:
        reduce(buf)
        return
    wide = buf.to(torch.float64)
    reduce(wide)
    buf.copy_(wide)
