"""Pieces of the reference math that several optimizers share."""
from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
# Philox-4x32 constants (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011), as in Triton.
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32 bits of a * b, for int64 `a` in [0, 2**32) and a constant b in [2**31, 2**32), without
    int64 overflow: a * (b - 2**32) is exact (|.| < 2**63), and a * b = that + a * 2**32."""
    p = a * (b - (1 << 32))
    lo = p & _M32
    return p.bitwise_right_shift_(32).add_(a), lo


def philox_randint(key0: int, key1: Tensor, counter: Tensor) -> Tensor:
    """Triton's `tl.randint(seed, offset)`: the first word of Philox-4x32-10 with key (seed's low, high 32 bits)
    = (key0, key1) and counter (offset, 0, 0, 0), as unsigned 32-bit values held in int64."""
    c0 = counter & _M32
    c1, c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0), torch.zeros_like(c0)
    k0, k1 = key0 & _M32, key1 & _M32
    for _ in range(10):
        hi_b, lo_b = _mulhilo32(c2, _ROUND_B)
        hi_a, lo_a = _mulhilo32(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b.bitwise_xor_(c1).bitwise_xor_(k0), lo_b, hi_a.bitwise_xor_(c3).bitwise_xor_(k1), lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0


def stochastic_round_bf16(x: Tensor, step: Tensor, index: int, emap: tuple | None = None) -> Tensor:
    """Round fp32 `x` to bf16 up or down with probability proportional to the distance (unbiased).

    Adds 16 random bits below bf16's mantissa cut, then truncates: E[round(x)] = x. The bits depend only on the
    param's `step` (its state's step counter), its `index` (its position in the optimizer's params, the same
    under every layout: `FastOptimizer._param_ids`) and each element's offset in the flattened global tensor:
    Triton's `tl.randint(seed, offset)` with seed = step * 2**32 + index and offset = global element offset
    (mod 2**32), the draw the kernels make. `emap`: where `x`'s elements lie in the global tensor
    (`Layout.element_map`: element l is global `table[(l + shift) // width] + (l + shift) % width`); None: `x`
    is the whole tensor (l itself). So a piece of a sharded param rounds as the whole param would in one
    process. No torch RNG is touched (the user's random stream does not move), replicas of a param on several
    ranks round identically, and both back ends round bit for bit alike.
    """
    n = x.numel()
    # Philox is ~120 int64 ops per element: on CPU, in chunks that stay in cache (2-3x faster than in one go).
    chunk = 1 << 16 if x.device.type == "cpu" else max(n, 1)
    key1 = step.to(torch.int64)
    noise = torch.empty(n, dtype=torch.int32, device=x.device)
    for start in range(0, n, chunk):
        offs = torch.arange(start, min(start + chunk, n), dtype=torch.int64, device=x.device)
        if emap is not None:
            table, width, shift = emap
            q = offs + shift
            offs = table[q // width] + q % width
        noise[start:start + chunk] = philox_randint(index, key1, offs) & 0xFFFF
    bits = x.to(torch.float32).view(torch.int32)
    out = ((bits + noise.view(x.shape)) & -65536).view(torch.float32)
    out = torch.where(torch.isfinite(x), out, x.to(torch.float32))
    return out.to(torch.bfloat16)


def sr_args(ids: list | None, layouts: list | None, device, n: int) -> list[tuple[int, tuple | None]]:
    """(index, emap) of `stochastic_round_bf16` for each of a bucket's `n` params: `ids` their positions in the
    optimizer (None: their positions in the bucket, for direct callers), `layouts` their layouts (None: whole)."""
    ids = range(n) if ids is None else ids
    layouts = layouts or [None] * n
    return [(i, None if lay is None else lay.element_map(device)) for i, lay in zip(ids, layouts)]


def store_unscaled(grad: Tensor, g: Tensor, found_inf: Tensor | None) -> None:
    """grad <- g (the gradient times GradScaler's 1/scale, in the step's math dtype) in grad's own dtype, unless
    found_inf is set: GradScaler's fused path leaves p.grad unscaled after a step it takes and as it was after one
    it skips, as torch's fused optimizers do."""
    g = g.to(grad.dtype).view_as(grad)
    grad.copy_(g if found_inf is None else torch.where(found_inf > 0, grad, g))
