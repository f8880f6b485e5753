"""The Triton kernels' 8-bit nearest-code search (kernels/common.py: a bucket table and one threshold compare;
csrc/tests/test_core.cpp checks the extension's twin), against the reference's searchsorted-and-compare."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from conftest import triton_device  # noqa: E402
from fastopt.kernels.common import (FP_FUSION, Q_BUCKET_BITS, Q_BUCKETS, Q_LO, nearest_code,  # noqa: E402
                                    search_table)
from fastopt.reference import quant as R  # noqa: E402


def _near_every_edge(table, signed: bool) -> torch.Tensor:
    """fp32 values within 20 ulps of every map value, decision threshold and bucket edge of a search table, in
    [-1, 1] (and [0, 1] unsigned), with uniform ones."""
    b = torch.arange(Q_BUCKETS, dtype=torch.int64)
    edges = torch.where(b == 0, 0, Q_LO + ((b - 1) << (23 - Q_BUCKET_BITS))).to(torch.int32).view(torch.float32)
    centers = torch.cat([table[:511].cpu(), edges, -edges, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    bits = (centers.view(torch.int32).to(torch.int64)[:, None] + torch.arange(-20, 21)[None, :]).flatten()
    x = bits[(bits >= -(1 << 31)) & (bits < 1 << 31)].to(torch.int32).view(torch.float32)
    x = x[(x.abs() <= 1) & ((x >= 0) | signed)]
    g = torch.Generator().manual_seed(0)
    return torch.cat([x, torch.rand(50000, generator=g) * (2 if signed else 1) - (1 if signed else 0)])


@triton.jit
def _search_kernel(x_ptr, t_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, nearest_code(tl.load(x_ptr + i, mask=i < n, other=0.0), t_ptr), mask=i < n)


@pytest.mark.parametrize("signed", [True, False])
def test_triton_search_is_the_nearest_code(signed):
    """kernels.common.nearest_code (the Triton kernels' 8-bit search: a bucket table and one threshold compare)
    equals the reference's searchsorted-and-compare on values packed around every edge the tables have."""
    device = triton_device()
    search = _search_kernel
    table = search_table(signed, device)
    assert torch.equal(table[:256].cpu(), R.dynamic_map(signed))  # `table + code` dequantizes
    x = _near_every_edge(table, signed).to(device)
    out = torch.empty(x.numel(), dtype=torch.int32, device=device)
    search[(triton.cdiv(x.numel(), 1024),)](x, table, out, x.numel(), BLOCK=1024, **FP_FUSION)
    want = R.nearest_code(x.cpu(), R.dynamic_map(signed)).to(torch.int32)
    bad = (out.cpu() != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} of {x.numel()} codes differ, first x={x[bad[0]].item()!r}"
    nan = torch.full((4,), float("nan"), device=device)
    search[(1,)](nan, table, out, 4, BLOCK=1024, **FP_FUSION)
    assert out[:4].tolist() == [0] * 4
