"""Params and grads that are not contiguous (a transposed weight, a channels_last convolution, a grad with other
strides than its param) step exactly as their contiguous copies do (the oracle, stepped on the plain-torch back
end), on both back ends: the kernels index row-major memory, so fastopt.ops hands them contiguous stand-ins and
writes the result back."""
from __future__ import annotations

import pytest
import torch
from conftest import on_torch_backend

import fastopt

STEPS = 6
OPTS = {
    "adafactor": lambda ps: fastopt.Adafactor(ps, lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.1),
    "adafactor_relative": lambda ps: fastopt.Adafactor(ps),
    "came": lambda ps: fastopt.CAME(ps, lr=1e-2, weight_decay=0.1),
    "came8": lambda ps: fastopt.CAME(ps, lr=1e-2, nbits=8),
    "lamb": lambda ps: fastopt.Lamb(ps, lr=1e-2, weight_decay=0.1),
    "lamb8": lambda ps: fastopt.Lamb(ps, lr=1e-2, nbits=8, min_8bit_size=1),
    "galore": lambda ps: fastopt.GaLoreAdamW([{"params": ps[:2], "rank": 2, "update_proj_gap": 3},
                                              {"params": ps[2:]}], lr=1e-2),
    "adamw8bit": lambda ps: fastopt.AdamW8bit(ps, lr=1e-2, min_8bit_size=1),
}


def _params(strided: bool, device, gen) -> list:
    """A transposed matrix, a 2-D param whose grads come with other strides, a channels_last 4-D weight."""
    a = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    b = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    c = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    if strided:
        a = a.t().contiguous().t()                       # same values, column-major storage
        c = c.contiguous(memory_format=torch.channels_last)
    return [torch.nn.Parameter(t.to(device)) for t in (a, b, c)]


def _run(name, strided, device) -> list:
    gen = torch.Generator().manual_seed(0)
    params = _params(strided, device, gen)
    if strided:
        assert not params[0].is_contiguous() and not params[2].is_contiguous()
    opt = OPTS[name](params)
    for _ in range(STEPS):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen, dtype=p.dtype).to(device)
            if strided and i == 1:
                g = g.t().contiguous().t()  # a grad laid out unlike its (contiguous) param
            p.grad = g
        opt.step()
    return [p.detach().contiguous() for p in params], opt


@pytest.mark.parametrize("name", list(OPTS))
def test_strided_params_step_like_their_contiguous_copies(name, backend, device, monkeypatch):
    """The contiguous copies (the oracle) step on the plain-torch back end, the strided params on `backend`."""
    with on_torch_backend(monkeypatch):
        ref, ref_opt = _run(name, False, device)
    ours, opt = _run(name, True, device)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    for p_ref, p in zip(ref_opt.param_groups[0]["params"], opt.param_groups[0]["params"]):
        for key, t in ref_opt.state[p_ref].items():
            torch.testing.assert_close(opt.state[p][key], t, rtol=1e-13, atol=1e-15, msg=key)
