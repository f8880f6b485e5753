"""Host-side helpers for the multi-tensor Triton kernels, and device helpers several kernels share.

A multi-tensor launch covers every param of a bucket with one grid: each program looks up its param in
a small int32 table (`prog_param`), then that param's pointers in int64 pointer tables. The tables that do
not change between steps (param and state pointers, shapes, program maps) are built once and cached by the
optimizer; only the gradient pointers are rebuilt per step (grads are reallocated after
`zero_grad(set_to_none=True)`), with an asynchronous copy from pinned memory: no host sync.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from fastopt.reference.quant import dynamic_map, on_device

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Launch options of every kernel: fused multiply-adds on, as every result of this package was tested and timed
# with. Triton 3.9 warns at a process's first compile that leaves this to its default, which Triton 3.10 turns off.
FP_FUSION = {"enable_fp_fusion": True}
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


# Alignment the kernels may declare (ALIGNED): every pointer in a bucket's tables 16-byte aligned, and every
# row length, element count and shard offset the kernels build masks and row starts from a multiple of this
# many elements. Fresh tensors always are (the allocators align to 64 bytes or more) and so are the shapes of
# large models; views at odd offsets (DDP's gradient bucket views, hand-made flat buffers) or odd sizes run the
# same kernels without the declaration.
ALIGN_BYTES = 16
ALIGN_ELEMS = 16


def aligned(tensors) -> bool:
    """Whether every tensor (None entries ignored) starts on an ALIGN_BYTES boundary."""
    return all(t is None or t.data_ptr() % ALIGN_BYTES == 0 for t in tensors)


def multiples(sizes) -> bool:
    """Whether every size is a multiple of ALIGN_ELEMS."""
    return all(int(n) % ALIGN_ELEMS == 0 for n in sizes)


class GradTable:
    """The gradient pointer table of a bucket, rebuilt only when a gradient moved: a step whose grads sit where
    they sat last step copies nothing from the host, so a CUDA graph captured after warm-up steps replays with a
    table that stays valid (a per-step copy from a pinned buffer would read whatever reused that buffer).
    `aligned`: whether the grads of the last call are all 16-byte aligned."""

    __slots__ = ("key", "table", "aligned")

    def __init__(self):
        self.key, self.table, self.aligned = None, None, False

    def __call__(self, grads: list, device: torch.device) -> torch.Tensor:
        key = tuple(g.data_ptr() for g in grads)
        if key != self.key:
            self.table, self.key, self.aligned = ptr_table(grads, device), key, aligned(grads)
        return self.table


def cached_plan(cache: dict | None, tag: tuple, params, states, layouts, build):
    """A bucket's plan (its tables and scratch buffers), `build()` when `cache` holds none for these params (by
    address and shape), state tensors (by address) and layouts: the cache keeps the last plan only."""
    key = tag + tuple((p.data_ptr(), tuple(p.shape)) for p in params) + tuple(
        (k, t.data_ptr()) for s in states for k, t in s.items()) + tuple(map(id, layouts or ()))
    plan = cache.get(key) if cache is not None else None
    if plan is None:
        plan = build()
        if cache is not None:
            cache.clear()
            cache[key] = plan
    return plan


def program_table(counts: list[int], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """(prog_param, starts): program `pid` works on param prog_param[pid], its starts[i]-th program is pid."""
    starts, owner = [], []
    for i, n in enumerate(counts):
        starts.append(len(owner))
        owner.extend([i] * n)
    return to_device(owner, torch.int32, device), starts


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code: triton.cdiv is a constexpr function, several microseconds a call on the host."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# Row-block programs a factored launch should have at least (a few per SM of an H100's 132) before its blocks
# grow taller.
MIN_PROGRAMS = 512


def tile_shape(max_cols: int, total_rows: int = 1 << 40, tile: int = 4096, max_cols_block: int = 1024,
               max_rows_block: int = 64) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for row-block programs that sweep all columns of their rows in [BLOCK_R, BLOCK_C]
    tiles of `tile` elements. Blocks are as tall as `max_rows_block` allows while `total_rows` (of the bucket)
    still gives MIN_PROGRAMS programs: the statistics kernels write one fp32 row of column partials per
    program, 4 / BLOCK_R bytes per element of scratch (1/16 at 64 rows; 1 byte with 4-row blocks)."""
    block_r = max_rows_block
    while block_r > 1 and total_rows // block_r < MIN_PROGRAMS:
        block_r //= 2
    block_c = min(max_cols_block, next_pow2(max_cols), max(1, tile // block_r))
    block_r = max(1, min(max_rows_block, tile // block_c))
    return block_r, block_c


def bucket_key(*tensor_lists) -> tuple:
    """Identity of a bucket's persistent tensors: the cached tables stay valid while this is unchanged."""
    return tuple((t.data_ptr(), tuple(t.shape)) if t is not None else None for ts in tensor_lists for t in ts)


@triton.jit
def load_ptr(table, i, ref, ALIGNED: tl.constexpr = False):
    """Entry `i` of an int64 pointer table, as a pointer of `ref`'s element type; with ALIGNED, declared
    16-byte aligned (the host checked it: `aligned()`), which lets the compiler issue 16-byte vector accesses.
    A pointer read from memory is otherwise of unknown alignment, and every access stays one element wide."""
    p = tl.load(table + i).to(ref.dtype)
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def load16(ptr, ALIGNED: tl.constexpr):
    """`*ptr` (a row length, element count or offset from a meta table), declared a multiple of 16 with ALIGNED:
    the masks and row starts built from it then cover whole 16-byte vectors of any element size. (The hint
    must sit on the load itself: `tl.multiple_of` on a helper's argument is silently dropped.)"""
    x = tl.load(ptr)
    if ALIGNED:
        x = tl.multiple_of(x, 16)
    return x


@triton.jit
def keep_limit(n, found_inf_ptr, HAS_INF: tl.constexpr):
    """`n`, or 0 when GradScaler found an inf this step: stores masked with `idx < keep_limit(n, ...)` then
    write nothing. (A limit, not a boolean: the interpreter cannot `&` a scalar boolean into a mask.)"""
    if HAS_INF:
        return tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    else:
        return n


@triton.jit
def unscale_factor(inv_scale_ptr, HAS_SCALE: tl.constexpr):
    """What the gradient is multiplied by: GradScaler's 1/scale (read on the device), or 1."""
    if HAS_SCALE:
        return tl.load(inv_scale_ptr)
    else:
        return 1.0


@triton.jit
def store_grad(g_ptr, offs, g, keep, HAS_SCALE: tl.constexpr):
    """GradScaler's fused path (HAS_SCALE): the gradient times 1/scale (`g`, as the step uses it) stored over the
    gradient in its own dtype, masked like the param's store (`keep`: nothing where found_inf is set), in the
    pass that reads it last: torch's fused optimizers leave p.grad unscaled after a step. Nothing without a
    scale."""
    if HAS_SCALE:
        tl.store(g_ptr + offs, round_to(g, g_ptr.dtype.element_ty), mask=keep)


@triton.jit
def divmod_near(x, d, rcp):
    """(x // d, x % d) for integers x >= 0 and a scalar d >= 1 of x's dtype with x / d < 2^12 (an offset past a row's
    start within one program's span, in rows of d; int32 needs x + d < 2^31): the quotient estimated in fp32 from
    rcp ~ 1 / d (taken once per program, a few ulps off at most) is within 0.01 of x / d, so its truncation is off
    by one at most, which one step on the remainder's sign corrects. Ten or so instructions where `//` and `%` took
    a reciprocal and some twenty more per element (and in int64 a call for operands over 32 bits)."""
    q = (x.to(tl.float32) * rcp).to(x.dtype)
    r = x - q * d
    low = r < 0
    q = tl.where(low, q - 1, q)
    r = tl.where(low, r + d, r)
    high = r >= d
    return tl.where(high, q + 1, q), tl.where(high, r - d, r)


@triton.jit
def param_of_program(meta_ptr, prog_param_ptr, ALIGNED: tl.constexpr = False):
    """(row j of an int64 meta table of width 3 [numel, first program, a third column], numel, first program,
    third column) of this program's param, for the kernels that give each param a run of programs; with
    ALIGNED the numel is declared a multiple of 16 (the host checked it)."""
    pid = tl.program_id(0)
    j = tl.load(prog_param_ptr + pid)
    n = load16(meta_ptr + j * 3, ALIGNED)
    prog_start = tl.load(meta_ptr + j * 3 + 1)
    third = tl.load(meta_ptr + j * 3 + 2)
    return j, n, prog_start, third


@triton.jit
def stochastic_round_bf16(x, seed, offs):
    """fp32 -> bf16 rounding up or down with probability proportional to distance (unbiased)."""
    bits = x.to(tl.int32, bitcast=True)
    noise = (tl.randint(seed, offs.to(tl.int32)) & 0xFFFF).to(tl.int32)
    rounded = ((bits + noise) & -65536).to(tl.float32, bitcast=True)
    finite = (x == x) & (tl.abs(x) < float("inf"))
    return tl.where(finite, rounded, x).to(tl.bfloat16)


# The stochastic rounding table of a bucket (`sr_table`): SR_COLS int64 columns per param, in the order the
# kernels number the params: the param's id (its position in the optimizer: the seed's low word), where its
# element map's table starts in this same tensor, the map's width and shift (`Layout.element_map`); the maps'
# tables follow.
SR_WIDTH = 4
SR_COLS = tl.constexpr(SR_WIDTH)
_INT32_MAX = 2 ** 31 - 1


class SRTable:
    """A bucket's `sr_table`, made when a step first rounds stochastically and again when the ids change.
    `layouts` and `counts` (real local elements) in the kernels' order; `order[k]`: the bucket position of the
    kernels' param k."""

    def __init__(self, layouts: list, counts: list[int], order: list[int], device):
        self.layouts, self.counts, self.order, self.device = layouts, counts, order, device
        self._key = self._table = None

    def __call__(self, ids: list[int] | None) -> tuple[torch.Tensor, int]:
        ids = [k if ids is None else ids[k] for k in self.order]
        if ids != self._key:
            self._table = sr_table(ids, self.layouts, self.counts, self.device)
            self._key = ids
        return self._table


def sr_table(ids: list[int], layouts: list, counts: list[int], device) -> tuple[torch.Tensor, int]:
    """(table, GMAP) for `sr_round`: `ids`, `layouts` and `counts` (real local elements) of the bucket's params
    in kernel order. GMAP 0: no param is sharded (every local offset is the global one; the table holds the ids'
    rows only); 1: every shifted offset fits int32, so the kernels find the row with an int32 division; 2: int64.
    A whole param, or a flat range (one row), gets a width no offset reaches."""
    if all(lay is None for lay in layouts):
        return to_device([x for i in ids for x in (i, 0, 1, 0)], torch.int64, device), 0
    maps = [(torch.zeros(1, dtype=torch.int64, device=device), 1 << 62, 0) if lay is None else lay.element_map(device)
            for lay in layouts]
    narrow = all(shift + n < _INT32_MAX and (width == 1 << 62 or width < _INT32_MAX)
                 for (_t, width, shift), n in zip(maps, counts))
    rows, tables, at = [], [], SR_WIDTH * len(ids)
    for i, (table, width, shift) in zip(ids, maps):
        rows += [i, at, _INT32_MAX if narrow and width == 1 << 62 else width, shift]
        tables.append(table)
        at += table.numel()
    head = to_device(rows, torch.int64, device)
    return torch.cat([head] + [t.to(device=device, dtype=torch.int64) for t in tables]), 1 if narrow else 2


@triton.jit
def sr_round(x, sr_ptr, k, step, offs, mask, GMAP: tl.constexpr):
    """`stochastic_round_bf16` of param k's local elements at `offs`, as fastopt.reference.common's: the seed is
    step * 2**32 + the param's id; the noise offset the element's in the global tensor (with GMAP, through the
    param's element map: table[q // width] + q % width, q = offs + shift, in int32 where GMAP is 1; else `offs`
    itself). `mask`: the elements stored (the others may index anywhere)."""
    row = sr_ptr + k * SR_COLS
    seed = (step.to(tl.int64) << 32) + tl.load(row)
    if GMAP == 1:
        width = tl.load(row + 2).to(tl.int32)
        q = (offs + tl.load(row + 3)).to(tl.int32)
        r = q // width
        offs = tl.load(sr_ptr + tl.load(row + 1) + r, mask=mask, other=0) + (q - r * width)
    elif GMAP == 2:
        width = tl.load(row + 2)
        q = offs + tl.load(row + 3)
        r = q // width
        offs = tl.load(sr_ptr + tl.load(row + 1) + r, mask=mask, other=0) + (q - r * width)
    return stochastic_round_bf16(x, seed, offs)


@triton.jit
def sr_round_at(x, sr_ptr, k, step, goffs):
    """`sr_round` where the kernel has each element's global offset `goffs` already (the factored kernels: from
    their row and column maps)."""
    return stochastic_round_bf16(x, (step.to(tl.int64) << 32) + tl.load(sr_ptr + k * SR_COLS), goffs)


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


# ---- 8-bit nearest-code search (the tables of csrc/fastopt_core.h, built here in torch) --------------------
# The nearest code of x is the number of decision thresholds <= x (threshold c: the smallest fp32 value the rule
# "right neighbour when strictly nearer, ties to the lower code" sends to code c + 1). A table indexed by x's
# sign, binade and top Q_BUCKET_BITS mantissa bits gives that count at the low end of x's bucket; for both
# dynamic maps one more threshold compare finishes it (asserted when the table is built). Two dependent
# gathers instead of the nine of a binary search over the map.
Q_BUCKET_BITS = 7
Q_LO, Q_HI = 0x33800000, 0x3F800000  # 2^-24 and 1.0: buckets [0, Q_LO), the binades up to 1.0, [1.0, inf]
Q_BUCKETS = 2 + ((Q_HI - Q_LO) >> (23 - Q_BUCKET_BITS))  # per sign
Q_START_BYTE = 512 * 4  # table layout (fp32): [0, 256) the map, [256, 512) thresholds, then uint8 starts
_Q_LO, _Q_HI, _Q_SHIFT = tl.constexpr(Q_LO), tl.constexpr(Q_HI), tl.constexpr(23 - Q_BUCKET_BITS)
_Q_BUCKETS, _Q_START_BYTE = tl.constexpr(Q_BUCKETS), tl.constexpr(Q_START_BYTE)


def _order(x: torch.Tensor) -> torch.Tensor:
    """fp32 values as int64 in their total order (-0.0 and +0.0 both 0)."""
    b = x.view(torch.int32).to(torch.int64)
    return torch.where(b < 0, -(b & 0x7FFFFFFF), b)


def _from_order(o: torch.Tensor) -> torch.Tensor:
    bits = torch.where(o >= 0, o, (-o) | 0x80000000)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


@functools.lru_cache(maxsize=None)
def _search_table_cpu(signed: bool) -> torch.Tensor:
    keys = dynamic_map(signed)
    left, right = keys[:-1], keys[1:]
    lo, hi = _order(left) + 1, _order(right)  # bisect (left, right]: right itself is nearer to right
    while bool((lo < hi).any()):
        active, mid = lo < hi, lo + (hi - lo) // 2
        x = _from_order(mid)
        goes_right = (x - right).abs() < (x - left).abs()
        hi = torch.where(active & goes_right, mid, hi)
        lo = torch.where(active & ~goes_right, mid + 1, lo)
    thresh = _from_order(lo)
    b = torch.arange(Q_BUCKETS, dtype=torch.int64)
    shift = 23 - Q_BUCKET_BITS
    lo_bits = torch.where(b == 0, 0, Q_LO + ((b - 1) << shift)).to(torch.int32).view(torch.float32)
    hi_bits = torch.where(b == Q_BUCKETS - 1, 0x7F800000, Q_LO + (b << shift) - 1).to(torch.int32).view(torch.float32)
    low, high = torch.cat([lo_bits, -hi_bits]), torch.cat([hi_bits, -lo_bits])  # sign-major, as the search indexes
    start = torch.searchsorted(thresh, low, right=True)
    steps = int((torch.searchsorted(thresh, high, right=True) - start).max())
    assert steps <= 1, f"dynamic map (signed={signed}): {steps} thresholds in one bucket; the search does one compare"
    table = torch.zeros(512 + (2 * Q_BUCKETS + 3) // 4, dtype=torch.float32)
    table[:256] = keys
    table[256:511] = thresh
    table[511] = float("nan")  # no code above 255: never <= x
    table.view(torch.uint8)[Q_START_BYTE:Q_START_BYTE + 2 * Q_BUCKETS] = start.to(torch.uint8)
    return table


_device_tables: dict = {}


def search_table(signed: bool, device: torch.device) -> torch.Tensor:
    """The 8-bit map with its search tables (layout above), cached per device. Its first 256 values are the map
    itself, so `table + code` dequantizes. Do not modify."""
    return on_device(_device_tables, signed, device, _search_table_cpu)


@triton.jit
def map_values(codes, table_ptr):
    """table_ptr[codes] for int32 codes in [0, 256), any shape: a search_table()'s map, or its thresholds at
    table_ptr + 256. The 256 values are read once per program into shared memory and gathered from there
    (tl.gather over a 1-D source lowers to shared-memory loads), where `tl.load(table_ptr + codes)` is a
    gather from global memory per element: codes spread over the table's 1 KB cost a warp several L1
    wavefronts each, and the 8-bit paths take 2 to 8 such lookups per element."""
    table = tl.load(table_ptr + tl.arange(0, 256))
    return tl.reshape(tl.gather(table, tl.reshape(codes, (codes.numel,)), 0), codes.shape)


@triton.jit
def nearest_code(x, table_ptr):
    """Code (int32) of the nearest map value for each fp32 x in [-1, 1] (x / absmax of its block), ties to the
    lower code; NaN gives 0. `table_ptr`: a search_table(). The bucket's start comes from global memory (a
    6 KB table of bytes), its one threshold from shared memory (map_values)."""
    bits = x.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    b = tl.where(a < _Q_LO, 0, tl.where(a >= _Q_HI, _Q_BUCKETS - 1, 1 + ((a - _Q_LO) >> _Q_SHIFT)))
    b = tl.where(bits < 0, b + _Q_BUCKETS, b)
    start = tl.load(table_ptr.to(tl.pointer_type(tl.uint8)) + _Q_START_BYTE + b).to(tl.int32)
    code = start + (map_values(start, table_ptr + 256) <= x).to(tl.int32)
    return tl.where(x == x, code, 0)


@triton.jit
def quantize_rows(x, table_ptr):
    """(codes uint8, absmax fp32) of each row of an fp32 [blocks, B] tile of whole blocks (zeros past the end), as
    fastopt.reference.quant.quantize_blockwise makes them: absmax the largest |x| of the row's numbers (a NaN is
    passed over, a row of NaN only has 0, as the extension's fmaxf from 0), x / absmax (IEEE division) to the
    nearest map value (nearest_code: ties to the lower code, NaN to 0)."""
    absmax = tl.max(tl.where(x == x, tl.abs(x), 0.0), axis=1)
    safe = tl.where(absmax > 0, absmax, 1.0)
    xn = tl.where(absmax[:, None] > 0, tl.math.div_rn(x, safe[:, None]), 0.0)
    return nearest_code(xn, table_ptr).to(tl.uint8), absmax


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
        _segment_sum_kernel[(n,)](parts, seg_start, seg_len, out, WIDTH=width, BLOCK=256 if not INTERPRET else 64,
                                  **FP_FUSION)


def sum_fp64(buf: torch.Tensor):
    """Yield `buf` to be summed over the ranks (fastopt.distributed.phases) through a float64 copy when it is
    narrower: the buffers that ranks sum are float64 in the reference (its `reduction_sizes`, which the layout
    benchmark counts), whatever the kernels accumulate in."""
    if buf.dtype == torch.float64:
        yield buf
        return
    wide = buf.to(torch.float64)
    yield wide
    buf.copy_(wide)
