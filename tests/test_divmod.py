"""kernels.common.divmod_near (the 8-bit CAME apply's rows and columns of flat offsets, without a 64-bit division
per element) against torch's // and %, over every range it is used in and at its edges."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from conftest import triton_device  # noqa: E402
from fastopt.kernels.common import FP_FUSION, divmod_near  # noqa: E402

WIDTH = 4096  # values per divisor: x / d up to just below 2^12, the helper's stated range


@triton.jit
def _divmod_kernel(x_ptr, d_ptr, q_ptr, r_ptr, WIDTH: tl.constexpr):
    i = tl.program_id(0)
    d = tl.load(d_ptr + i)  # one divisor per program, a scalar loaded as the kernels load C and R
    offs = i * WIDTH + tl.arange(0, WIDTH)
    q, r = divmod_near(tl.load(x_ptr + offs), d, 1.0 / d.to(tl.float32))
    tl.store(q_ptr + offs, q)
    tl.store(r_ptr + offs, r)


def _divisors() -> list[int]:
    """Every divisor to 300, powers of two and their neighbours to 2^44, 3 and 5 times powers of two, primes near
    2^24 and 2^31, and random ones to 2^44: where an fp32 reciprocal is exact, rounds down or rounds up."""
    ds = set(range(1, 301))
    for k in range(9, 45):
        ds.update({2 ** k - 1, 2 ** k, 2 ** k + 1, 3 * 2 ** (k - 2), 5 * 2 ** (k - 3)})
    ds.update({16777213, 16777259, 2147483647, 2147483659, 4095, 4097, 12289, 50257, 128256})
    g = torch.Generator().manual_seed(0)
    ds.update(int(v) for v in torch.randint(1, 2 ** 44, (60,), generator=g))
    return sorted(ds)


def _values(d: int, top: int) -> list[int]:
    """WIDTH values x >= 0 with x / d < 2^12 and x < top: 0, every multiple k d to 1364 d and its two neighbours, a
    program's last offset past a row start (d + 1023), the range's top; repeated to fill WIDTH where `top` cut."""
    xs = [0] + [k * d + o for k in range(1, 1365) for o in (-1, 0, 1)] + [d + 1023, 4095 * d, 4096 * d - 1]
    xs = [x for x in xs if x < top] + [top - 1 - i for i in range(WIDTH) if top - 1 - i < 4096 * d]
    return xs[:WIDTH]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_divmod_near_is_floor_division_and_remainder(dtype):
    """Every value of _values for every divisor of _divisors, in int64, and in int32 (as the 8-bit CAME apply
    takes it when its R and C are below 2^30) for the divisors below 2^30 with x + d < 2^31."""
    device = triton_device()
    narrow = dtype == torch.int32
    ds = [d for d in _divisors() if d < 2 ** 30 or not narrow]
    x = torch.tensor([_values(d, 2 ** 31 - d if narrow else 2 ** 62) for d in ds], dtype=dtype)
    assert x.shape == (len(ds), WIDTH) and int(x.min()) >= 0
    d = torch.tensor(ds, dtype=dtype)
    q, r = torch.empty_like(x, device=device), torch.empty_like(x, device=device)
    _divmod_kernel[(len(ds),)](x.to(device), d.to(device), q, r, WIDTH=WIDTH, **FP_FUSION)
    want_q, want_r = x // d[:, None], x % d[:, None]
    bad = ((q.cpu() != want_q) | (r.cpu() != want_r)).nonzero()
    assert bad.numel() == 0, (f"{bad.shape[0]} of {x.numel()} differ; first: x={int(x[tuple(bad[0])])} "
                              f"d={ds[int(bad[0, 0])]} gave q={int(q[tuple(bad[0])])} r={int(r[tuple(bad[0])])}")
