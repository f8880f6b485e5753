"""bf16 stochastic rounding in one process, piece by piece: the kernels' `common.sr_round` against the reference's
`stochastic_round_bf16` element by element (element maps of every form, offsets past 2**32, a shift past int32),
non-finite values, `SRTable` following the params' ids, the reference's CPU chunks, and the ids themselves (a
param's position in the optimizer). tests/test_sr_layouts.py checks the same draws end to end under real
layouts on gloo processes; these find in seconds what a mutation sweep of that code found those tests missing.
"""
from __future__ import annotations

import pytest
import torch

import fastopt
from fastopt import ops
from fastopt.distributed.layout import Layout
from fastopt.reference.common import stochastic_round_bf16

triton = pytest.importorskip("triton")
tl = triton.language
from fastopt.kernels import common  # noqa: E402


@pytest.fixture
def kernel_device():
    """Where the Triton kernels run here: CUDA compiled, or the CPU under the interpreter."""
    if ops.interpreting():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


@triton.jit
def _sr_kernel(x_ptr, out_ptr, sr_ptr, step_ptr, start, n, k, GMAP: tl.constexpr, BLOCK: tl.constexpr):
    """out[start:start + n] = sr_round of x[start:start + n] as the pieces of param k of the table `sr_ptr`."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + start + offs, mask=mask, other=0.0)
    out = common.sr_round(x, sr_ptr, k, tl.load(step_ptr), offs, mask, GMAP)
    tl.store(out_ptr + start + offs, out, mask=mask)


def _dims(shape, *idx):
    return Layout(shape, tuple(idx), None, ("v",))


def _flat(shape, off, cnt, base=None):
    return Layout(shape, (None,) * len(shape), None, ("v",), flat=(off, cnt), base=base)


def _run(x, table, gmap, counts, step, block):
    """sr_round over the concatenated pieces of `x` (`counts` elements each) with an sr_table's (table, GMAP)."""
    out = torch.empty_like(x, dtype=torch.bfloat16)
    start = 0
    for k, n in enumerate(counts):
        _sr_kernel[(1,)](x, out, table, step, start, n, k, GMAP=gmap, BLOCK=block, **common.FP_FUSION)
        start += n
    return out


@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
def test_sr_round_draws_the_reference_noise(kernel_device, wide):
    """Each piece's elements get the reference's draw at their global offsets: a whole param, a flat range past
    2**32 (offsets taken mod 2**32), ZeRO over TP with a shift past int32 (int64 path only), a small ZeRO over TP,
    one map entry per element, rows of a 3-D piece, a flat range mid-row."""
    big = 1 << 31
    lays = [None, _flat((1 << 33,), (1 << 32) + 5, 9),
            _flat((1 << 23, 512), big + 7, 9, base=_dims((1 << 23, 512), None, None)),
            _flat((6, 10), 3, 11, base=_dims((6, 10), torch.arange(2, 6), torch.arange(4, 9))),
            _dims((5, 8), torch.arange(1, 4), torch.arange(1, 8, 3)),
            _dims((3, 3, 7), torch.arange(1, 3), None, torch.arange(2, 6)),
            _flat((3, 4, 5), 13, 17)]
    ids = [7, 3, 11, 0, 5, 2, 9]
    if not wide:  # what the int32 path takes: no shift or offset near 2**31
        keep = [k for k, lay in enumerate(lays) if lay is None or lay.base is None or lay.flat[0] < 1000]
        lays, ids = [lays[k] for k in keep], [ids[k] for k in keep]
    counts = [10 if lay is None else lay.count for lay in lays]
    x = 1 + torch.rand(sum(counts), generator=torch.Generator().manual_seed(3)).to(kernel_device) * 0.5
    step = torch.tensor(5.0, device=kernel_device)
    table, gmap = common.sr_table(ids, lays, counts, kernel_device)
    assert gmap == (2 if wide else 1)  # before any launch: an int32 path past int32 reads out of the table
    out = _run(x, table, gmap, counts, step, 32)
    bad, start = [], 0
    for k, (lay, n) in enumerate(zip(lays, counts)):
        emap = None if lay is None else lay.element_map(kernel_device)
        want = stochastic_round_bf16(x[start:start + n], step, ids[k], emap)
        if not torch.equal(out[start:start + n], want):
            bad.append((k, int((out[start:start + n] != want).sum()), n))
        start += n
    assert not bad, bad


def test_stochastic_rounding_keeps_inf_and_every_nan(kernel_device):
    """inf stays inf and every NaN stays NaN, also those whose payload the noise would carry out of the top bit
    (0x7FFFFFFF, 0xFFFFFFFF: without the finite guard they come out as +-0), in the kernels and the reference."""
    bits = torch.tensor([0x7F800000, -0x800000, 0x7FC00000, -0x400000, 0x7FFFFFFF, -1, 0x7FFF0001, -0xFFFF],
                        dtype=torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.tensor([1.0, -3.5])]).repeat(8).to(kernel_device)
    table, gmap = common.sr_table([4], [None], [x.numel()], kernel_device)
    for step in range(1, 4):
        st = torch.tensor(float(step), device=kernel_device)
        out = _run(x, table, gmap, [x.numel()], st, 128)
        for name, y in (("kernel", out.float()), ("reference", stochastic_round_bf16(x, st, 4).float())):
            assert torch.equal(torch.isnan(y), torch.isnan(x)), (name, step, int((y.isnan() != x.isnan()).sum()))
            assert torch.equal(y[x.isinf()], x[x.isinf()]), (name, step)
            assert torch.isfinite(y[x.isfinite()]).all(), (name, step)


def test_sr_table_follows_the_ids():
    """SRTable builds its table again when the params' ids change (a param group removed before them), for whole
    params and pieces alike, and keeps the kernels' order (here bucket 1 first)."""
    lays = [None, Layout((4, 6), (torch.arange(1, 3), None), None, ("k",))]
    for layouts in ([None, None], lays):
        t = common.SRTable(layouts, [5, 12], [1, 0], torch.device("cpu"))
        a, _ = t([3, 8])
        assert a.view(-1)[0].item() == 8 and a.view(-1)[common.SR_WIDTH].item() == 3
        b, _ = t([4, 9])
        assert b.view(-1)[0].item() == 9 and b.view(-1)[common.SR_WIDTH].item() == 4


def test_reference_noise_offsets_run_on_past_a_chunk():
    """The reference draws on CPU in chunks of 2**16 elements: the tail of a longer tensor rounds as the same
    elements declared as a flat range at their offset (a chunk that restarted its offsets at 0 would not)."""
    n, cut = (1 << 16) + 4000, (1 << 16) + 17
    x = 1 + torch.rand(n, generator=torch.Generator().manual_seed(0)) * 0.5
    step = torch.tensor(3.0)
    whole = stochastic_round_bf16(x, step, 2)
    tail = stochastic_round_bf16(x[cut:], step, 2, (torch.tensor([cut]), 1 << 62, 0))
    assert torch.equal(whole[cut:], tail), int((whole[cut:] != tail).sum())


SR_KW = {"Adafactor": dict(lr=1e-3, relative_step=False, scale_parameter=False), "CAME": dict(lr=1e-3),
         "Lamb": dict(lr=1e-2)}


@pytest.mark.parametrize("name", list(SR_KW))
def test_noise_seeded_by_the_position_in_the_optimizer(backend, device, name):
    """A param's noise is seeded by its position over all the optimizer's groups, not in its bucket: params
    stepped after one without a gradient (in no bucket) round as the reference does with their own ids, from
    what a twin optimizer without stochastic rounding computes in fp32."""
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 16), (40,), (8, 16)]
    init = [1 + 0.25 * torch.rand(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g).bfloat16().to(device) for s in shapes]
    params = [torch.nn.Parameter(x.bfloat16().to(device)) for x in init]
    twins = [torch.nn.Parameter(x.bfloat16().float().to(device)) for x in init]
    cls = getattr(fastopt, name)
    opt = cls([{"params": params[:1]}, {"params": params[1:]}], bf16_stochastic_round=True, **SR_KW[name])
    twin = cls([{"params": twins[:1]}, {"params": twins[1:]}], **SR_KW[name])
    for p, q, gr in zip(params[1:], twins[1:], grads[1:]):
        p.grad, q.grad = gr.clone(), gr.float()
    opt.step()
    twin.step()
    for k in (1, 2):
        want = stochastic_round_bf16(twins[k].detach(), opt.state[params[k]]["step"], k)
        assert torch.equal(params[k].detach(), want), (k, int((params[k].detach() != want).sum()))
