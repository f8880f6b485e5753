"""8-bit block-wise quantization: fastopt.quantize_blockwise / dequantize_blockwise, the csrc/ extension
(C++ CPU kernels; CUDA on GPUs), the plain-torch reference, and the extension's build (JIT, cmake, nvcc).

The two paths: `impl="torch"` (FASTOPT_BACKEND=torch: fastopt.reference.quant) and `impl="ext"` (the compiled
extension, built once per session into the torch extensions cache). The oracles: bitsandbytes' CPU
quantize_blockwise and a brute-force nearest-code search.
"""
from __future__ import annotations

import io
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from conftest import near_decision_points

import fastopt
from fastopt import ext, ops
from fastopt.reference import quant as R

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
BLOCKS = [64, 256, 4096]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _data(n: int, dtype=torch.float32, seed: int = 0, signed: bool = True) -> torch.Tensor:
    """Values spread over every decade the dynamic map resolves (1e-7 .. 1 relative to the block max)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.empty(n, dtype=torch.float64).uniform_(
        -6, 0, generator=g)
    return (x if signed else x.abs()).to(dtype)


def _brute_codes(x: torch.Tensor, block_size: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest map value by exhaustive fp32 distance, first (lowest) index among equals."""
    code = R.create_dynamic_map(signed)
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % block_size
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block_size)
    absmax = blocks.abs().amax(1)
    xn = torch.where(absmax[:, None] > 0, blocks / absmax[:, None], torch.zeros_like(blocks)).reshape(-1)
    dist = (xn[:, None] - code[None, :]).abs()
    return dist.argmin(1)[: flat.numel()].to(torch.uint8), absmax


def test_dynamic_maps_equal_bitsandbytes():
    F = pytest.importorskip("bitsandbytes.functional")
    for signed in (True, False):
        ours = R.create_dynamic_map(signed)
        assert torch.equal(ours, F.create_dynamic_map(signed=signed))
        assert ours.dtype == torch.float32 and ours.numel() == 256 and bool((ours[1:] > ours[:-1]).all())
        assert ours[-1] == 1.0 and (ours == 0).sum() == 1


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_nearest(impl, block_size, signed):
    """Exactly the brute-force nearest code (ties to the lower index), odd length, a block of zeros."""
    x = _data(3 * block_size + 37, signed=signed, seed=block_size)
    x[block_size:2 * block_size] = 0.0
    codes, absmax = fastopt.quantize_blockwise(x, block_size, signed=signed)
    want, want_absmax = _brute_codes(x, block_size, signed)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert absmax.dtype == torch.float32 and absmax.shape == (4,)
    assert torch.equal(absmax, want_absmax)
    assert torch.equal(codes, want), f"{(codes != want).sum().item()} codes differ from the nearest"
    assert absmax[1] == 0 and bool((codes[block_size:2 * block_size] == (127 if signed else 0)).all())


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_match_bitsandbytes(impl, block_size, dtype):
    """Against bitsandbytes' compiled CPU quantize_blockwise (its C kernel for fp32/bf16/fp16 input; same map,
    same block): the same absmax, and codes that are never farther from x / absmax than bitsandbytes' codes.
    Loose because that kernel is approximate, not because ours is: its search is not exactly nearest-code:
    for |x / absmax| >= 1e-4 it returns a neighbour of the nearest code for about 2% of the values (up to a
    fifth of a code gap off, measured on this data), below that it cannot resolve the map's smallest values
    (about 70% of such codes differ here). So: equal or adjacent codes where bitsandbytes resolves the map,
    ours never the farther one anywhere, and a round-trip error no larger. The exact comparison, with
    bitsandbytes' exact quantizer, is test_codes_equal_bitsandbytes_exact_op."""
    F = pytest.importorskip("bitsandbytes.functional")
    x = _data(50 * block_size + 11, dtype=dtype, seed=7)
    codes, absmax = fastopt.quantize_blockwise(x, block_size)
    b_codes, b_state = F.quantize_blockwise(x, code=F.create_dynamic_map(signed=True), blocksize=block_size)
    assert torch.equal(absmax, b_state.absmax)
    code = R.create_dynamic_map(True).double()
    xn = (x.float() / absmax.repeat_interleave(block_size)[: x.numel()]).double()
    ours_d = (xn - code[codes.long()]).abs()
    theirs_d = (xn - code[b_codes.long()]).abs()
    assert bool((ours_d <= theirs_d).all()), f"{(ours_d > theirs_d).sum().item()} codes farther than bitsandbytes'"
    resolved = xn.abs() >= 1e-4
    diff = (codes.long() - b_codes.long())[resolved]
    assert diff.abs().max() <= 1, "codes differ by more than one step where bitsandbytes resolves the map"
    assert (diff != 0).float().mean() < 0.05, f"{(diff != 0).sum().item()} of {diff.numel()} codes differ"
    ours_rt = fastopt.dequantize_blockwise(codes, absmax, block_size)
    theirs_rt = F.dequantize_blockwise(b_codes, absmax=absmax, code=F.create_dynamic_map(signed=True),
                                       blocksize=block_size).float()
    ours_err = (ours_rt.double() - x.double()).abs().sum()
    theirs_err = (theirs_rt.double() - x.double()).abs().sum()
    assert ours_err <= theirs_err, f"round-trip error {ours_err:.6g} > bitsandbytes' {theirs_err:.6g}"


def _bnb_exact_quantizer():
    """bitsandbytes' exact block-wise quantizer: the `bitsandbytes::quantize_blockwise` op on float64 input,
    which its CPU backend serves with a plain-torch nearest-code search (argmin of the fp32 distance to every
    map value, ties to the lower index) instead of its approximate C kernel (fp32/bf16/fp16 input only)."""
    pytest.importorskip("bitsandbytes")
    try:
        return torch.ops.bitsandbytes.quantize_blockwise
    except (AttributeError, RuntimeError):
        pytest.skip("the installed bitsandbytes registers no torch.ops.bitsandbytes.quantize_blockwise op")


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("blocks", [1, 50])
def test_codes_equal_bitsandbytes_exact_op(impl, block_size, dtype, signed, blocks):
    """Codes and absmax equal bitsandbytes' exact quantizer's, element for element (odd lengths: a partial
    last block of 11 elements). The two scale a block differently, x / absmax (ours, one rounding) against
    x * (1 / absmax) (bitsandbytes, two): the search itself must agree everywhere, so bitsandbytes' op is also
    fed our fp32 quotients (each block's absmax is then exactly 1, which makes its scaling the identity).
    End to end the codes must agree wherever the two quotients round alike, which on fp32 data here is every
    element (0 differ of up to 204811); bf16 inputs land exactly on a midpoint between two map values more
    often, where the last bit of the quotient decides (up to 38 of 204811 codes differ here, a neighbour
    each, half of them nearer x / absmax in exact arithmetic, half farther)."""
    op = _bnb_exact_quantizer()
    x = _data(blocks * block_size + 11, dtype=dtype, seed=7, signed=signed)
    code = R.create_dynamic_map(signed)
    codes, absmax = fastopt.quantize_blockwise(x, block_size, signed=signed)
    b_codes, b_absmax = op(x.double(), code, block_size)
    assert torch.equal(absmax, b_absmax)
    scale = absmax.repeat_interleave(block_size)[: x.numel()]
    assert bool((scale > 0).all())  # no block of zeros: bitsandbytes' op would divide by 0
    xn = x.float() / scale
    n_codes, n_absmax = op(xn.double(), code, block_size)
    assert torch.equal(n_absmax, torch.ones_like(absmax))
    assert torch.equal(codes, n_codes), f"{(codes != n_codes).sum().item()} codes differ on the same quotients"
    alike = xn == x.float() * (1 / scale)
    assert torch.equal(codes[alike], b_codes[alike]), f"{(codes != b_codes)[alike].sum().item()} codes differ"
    if dtype == torch.float32:
        assert torch.equal(codes, b_codes), f"{(codes != b_codes).sum().item()} of {x.numel()} codes differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 255, 1000, 4097])
def test_roundtrip_any_length_and_dtype(impl, dtype, n):
    """Any float dtype in and out, any length (partial last block): the error of each element is at most half
    the largest gap of the map times its block's absmax; x is rounded to fp32 first (codes of bf16 input are
    those of x.float())."""
    bs = 256
    x = _data(n, dtype=dtype, seed=n)
    codes, absmax = fastopt.quantize_blockwise(x, bs)
    assert absmax.shape == (math.ceil(n / bs),)
    c32, a32 = fastopt.quantize_blockwise(x.float(), bs)
    assert torch.equal(codes, c32) and torch.equal(absmax, a32)
    code = R.create_dynamic_map(True)
    half_gap = (code[1:] - code[:-1]).max().item() / 2
    back = fastopt.dequantize_blockwise(codes, absmax, bs, dtype=torch.float32)
    scale = absmax.repeat_interleave(bs)[:n]
    assert bool(((back - x.float()).abs() <= (half_gap + 1e-6) * scale).all())  # + fp32 rounding of back
    for out_dtype in DTYPES:
        y = fastopt.dequantize_blockwise(codes, absmax, bs, dtype=out_dtype)
        assert y.dtype == out_dtype and y.shape == x.shape
        assert torch.equal(y, back.to(out_dtype))


def test_shapes_and_empty(impl):
    x = _data(3 * 5 * 7).view(3, 5, 7)
    codes, absmax = fastopt.quantize_blockwise(x, 64)
    assert codes.shape == (3, 5, 7) and absmax.shape == (2,)
    assert fastopt.dequantize_blockwise(codes, absmax, 64).shape == (3, 5, 7)
    assert torch.equal(codes.flatten(), fastopt.quantize_blockwise(x.flatten(), 64)[0])
    xt = x.transpose(0, 2)  # non-contiguous input: quantized in its logical (row-major) order
    assert torch.equal(fastopt.quantize_blockwise(xt, 64)[0], fastopt.quantize_blockwise(xt.contiguous(), 64)[0])
    codes, absmax = fastopt.quantize_blockwise(torch.empty(0), 256)
    assert codes.shape == (0,) and absmax.shape == (0,)
    assert fastopt.dequantize_blockwise(codes, absmax, 256).shape == (0,)


@pytest.mark.parametrize("bad", [0, 32, 63, 100, 8192, 256.0, True, None])
def test_invalid_block_size(impl, bad):
    with pytest.raises(ValueError, match="block_size"):
        fastopt.quantize_blockwise(torch.randn(10), bad)
    codes, absmax = fastopt.quantize_blockwise(torch.randn(10), 64)
    with pytest.raises(ValueError, match="block_size"):
        fastopt.dequantize_blockwise(codes, absmax, bad)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64])
def test_non_float_input(impl, dtype):
    with pytest.raises(ValueError, match=str(dtype).replace("torch.", "")):
        fastopt.quantize_blockwise(torch.zeros(10, dtype=dtype))


def test_dequantize_argument_errors(impl):
    codes, absmax = fastopt.quantize_blockwise(torch.randn(300), 64)
    with pytest.raises(ValueError, match="absmax"):
        fastopt.dequantize_blockwise(codes, absmax[:-1], 64)
    for wide in (torch.float64, torch.bfloat16):  # both back ends: absmax is float32, as quantize returns it
        with pytest.raises(ValueError, match="absmax.*float32"):
            fastopt.dequantize_blockwise(codes, absmax.to(wide), 64)
    with pytest.raises(ValueError, match="uint8"):
        fastopt.dequantize_blockwise(codes.int(), absmax, 64)
    with pytest.raises(ValueError, match="dtype"):
        fastopt.dequantize_blockwise(codes, absmax, 64, dtype=torch.int32)


def test_extension_matches_reference_bitwise(built):
    """The C++ kernels and the torch reference give identical codes, absmax and dequantized values."""
    for block_size in (64, 128, 512, 2048, 4096):
        for dtype in DTYPES:
            for signed in (True, False):
                x = _data(block_size * 3 + 5, dtype=dtype, signed=signed, seed=block_size)
                code = R.dynamic_map(signed)
                c1, a1 = torch.ops.fastopt.quantize_blockwise(x, code, block_size)
                c2, a2 = R.quantize_blockwise(x, block_size, signed)
                assert torch.equal(c1, c2) and torch.equal(a1, a2), (block_size, dtype, signed)
                y1 = torch.ops.fastopt.dequantize_blockwise(c1, a1, code, block_size, dtype)
                assert torch.equal(y1, R.dequantize_blockwise(c2, a2, block_size, signed, dtype))


def test_dequantize_rounds_halfway_values_to_even_as_torch_casts(built):
    """Dequantized values exactly halfway between two neighbours of bf16 or fp16 (normal and subnormal), where
    random data (as in test_extension_matches_reference_bitwise) almost never lands: the extension's bf16/fp16
    stores round them to even, bit for bit as torch's cast (and the reference) do. Code 255 of either map is 1.0,
    so each block's values are its absmax exactly: the absmax values are the ties, of both parities."""
    k = torch.arange(0x3400, 0x4400, dtype=torch.int64)  # bf16 ties: low 16 bits 0x8000, values 2^-23 .. 2^9
    bf16_ties = ((k << 16) | 0x8000).to(torch.int32).view(torch.float32)
    e = torch.arange(113, 143, dtype=torch.int64).repeat_interleave(64)  # fp16 normal ties: low 13 bits 0x1000
    mant = torch.arange(e.numel(), dtype=torch.int64) * 37 % 1024
    f16_ties = ((e << 23) | (mant << 13) | 0x1000).to(torch.int32).view(torch.float32)
    f16_sub = (torch.arange(1024, dtype=torch.float64) + 0.5).mul(2.0 ** -24).float()  # fp16 subnormal ties
    for dtype, absmax in ((torch.bfloat16, bf16_ties), (torch.float16, torch.cat([f16_ties, f16_sub]))):
        for signed in (True, False):
            code = R.dynamic_map(signed)
            assert code[255] == 1.0
            codes = torch.full((absmax.numel() * 64,), 255, dtype=torch.uint8)
            want = absmax.repeat_interleave(64).to(dtype)
            assert torch.equal(R.dequantize_blockwise(codes, absmax, 64, signed, dtype), want)
            got = torch.ops.fastopt.dequantize_blockwise(codes, absmax, code, 64, dtype)
            bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero().flatten()
            assert not bad.numel(), (dtype, signed, bad.numel(), absmax[bad[:3] // 64].tolist())


def test_codes_on_the_decision_points_equal_the_reference(built):
    """Values on and one or two ulps beside the points where the nearest code changes (conftest's
    near_decision_points; signed and unsigned maps, blocks of 256 and 64): the extension's codes and absmax
    equal the reference's, every one, on the CPU and on CUDA where there is a GPU (whose kernels divide by the
    absmax through its reciprocal, fastopt_core.h's div_fast)."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for signed in (True, False):
        for block in (256, 64):
            x = near_decision_points(signed, block)
            c2, a2 = R.quantize_blockwise(x, block, signed)
            for dev in devices:
                c1, a1 = torch.ops.fastopt.quantize_blockwise(x.to(dev), R.dynamic_map(signed, dev), block)
                bad = (c1.cpu() != c2).nonzero().flatten().tolist()
                assert not bad, (signed, block, dev, len(bad), x[bad[:5]].tolist())
                assert torch.equal(a1.cpu(), a2), (signed, block, dev)


@pytest.mark.parametrize("blocks", [4, 6], ids=["one_short", "one_long"])
def test_quantize_multi_op_refuses_an_absmax_of_the_wrong_length(built, blocks):
    """quantize_blockwise_multi_ writes ceil(n / block_size) absmax values (5 for 300 elements in blocks of 64):
    an absmax one block short (the partial last block's value would be written past its end) or one too long is
    refused, naming it, and nothing is written."""
    n = 300
    x = torch.randn(n)
    codes = torch.full((n,), 7, dtype=torch.uint8)
    absmax = torch.full((blocks,), float("nan"))
    with pytest.raises(RuntimeError, match=re.escape("quantize_blockwise_multi_: absmax[0] must be float32 with "
                                                     "ceil(300 / 64)")):
        torch.ops.fastopt.quantize_blockwise_multi_([x], [codes], [absmax], R.dynamic_map(True), 64)
    assert bool((codes == 7).all()) and bool(absmax.isnan().all())


def test_non_finite_values_quantize_alike_on_both_paths(built):
    """Blocks holding a NaN, an inf, a -inf, NaNs only, and a NaN beside an inf: the C++ kernels and the torch
    reference give the same codes, absmax and dequantized values. A NaN is passed over by the block's absmax (a
    block of NaN only has absmax 0) and takes code 0, a finite value (the reference's absmax was the NaN: its
    whole block dequantized to NaN)."""
    for signed in (True, False):
        x = _data(64 * 6, signed=signed, seed=3)
        x[3] = float("nan")
        x[64 + 5] = float("inf")
        x[128 + 7] = -float("inf") if signed else float("inf")
        x[192:256] = float("nan")
        x[256 + 1], x[256 + 2] = float("nan"), float("inf")
        code = R.dynamic_map(signed)
        c1, a1 = torch.ops.fastopt.quantize_blockwise(x, code, 64)
        c2, a2 = R.quantize_blockwise(x, 64, signed)
        assert torch.equal(c1, c2) and torch.equal(a1, a2), signed
        assert a2[0] == x[:64].nan_to_num(0.0).abs().max() and c2[3] == 0 and a2[3] == 0
        y1 = torch.ops.fastopt.dequantize_blockwise(c1, a1, code, 64, torch.float32)
        y2 = R.dequantize_blockwise(c2, a2, 64, signed)
        assert torch.equal(y1.isnan(), y2.isnan()) and torch.equal(y1[~y1.isnan()], y2[~y2.isnan()])
        assert int(y2[:64].isnan().sum()) == 0  # the NaN's block keeps its other 63 values, and the NaN a code


def test_multi_tensor_in_place(impl):
    """quantize_blockwise_ / dequantize_blockwise_ over several tensors (one an empty one) equal the
    one-tensor calls; GradScaler's found_inf=1 writes nothing."""
    xs = [_data(n, seed=n) for n in (5000, 0, 1, 300)]
    codes = [torch.full(x.shape, 77, dtype=torch.uint8) for x in xs]
    absmax = [torch.full((math.ceil(x.numel() / 128),), float("nan")) for x in xs]
    ops.quantize_blockwise_(xs, codes, absmax, block_size=128, signed=False,
                            found_inf=torch.ones((), dtype=torch.float32))
    assert all(bool((c == 77).all()) for c in codes) and all(bool(a.isnan().all()) for a in absmax)
    ops.quantize_blockwise_(xs, codes, absmax, block_size=128, signed=False,
                            found_inf=torch.zeros((), dtype=torch.float32))
    outs = [torch.full(x.shape, float("nan"), dtype=torch.bfloat16) for x in xs]
    ops.dequantize_blockwise_(codes, absmax, outs, block_size=128, signed=False)
    for x, c, a, o in zip(xs, codes, absmax, outs):
        c1, a1 = fastopt.quantize_blockwise(x, 128, signed=False)
        assert torch.equal(c, c1) and torch.equal(a, a1)
        assert torch.equal(o, fastopt.dequantize_blockwise(c1, a1, 128, signed=False, dtype=torch.bfloat16))


def test_multi_tensor_wrappers_take_empty_lists_and_strided_inputs(impl):
    """Empty lists are nothing to do (no device to read from the first tensor); an `xs[i]` that is not contiguous
    (a transposed matrix) is quantized in its logical order, as quantize_blockwise quantizes it."""
    ops.quantize_blockwise_([], [], [], block_size=64)
    ops.dequantize_blockwise_([], [], [], block_size=64)
    x = _data(70 * 96, seed=11).view(70, 96).t()
    assert not x.is_contiguous()
    codes, absmax = [torch.full(x.shape, 7, dtype=torch.uint8)], [torch.full((105,), float("nan"))]
    ops.quantize_blockwise_([x], codes, absmax, block_size=64)
    want = fastopt.quantize_blockwise(x.contiguous(), 64)
    assert torch.equal(codes[0], want[0]) and torch.equal(absmax[0], want[1])


def test_wrapper_errors_name_the_argument_alike_on_both_paths(impl):
    """The wrappers' own refusals, the same words whichever path runs (the extension would name its own
    arguments, `x`, `dtype has dtype Int`), before anything is written; an absmax one block too long is refused
    as one too short is."""
    codes, absmax = fastopt.quantize_blockwise(torch.randn(300), 64)
    with pytest.raises(ValueError, match=re.escape("dequantize_blockwise: dtype=torch.int32 must be a floating")):
        fastopt.dequantize_blockwise(codes, absmax, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"absmax\b.*\b6\b"):
        fastopt.dequantize_blockwise(codes, torch.cat([absmax, absmax[:1]]), 64)
    xs = [torch.randn(100), torch.zeros(100, dtype=torch.int32)]
    out_codes = [torch.full((100,), 7, dtype=torch.uint8) for _ in xs]
    out_absmax = [torch.full((2,), float("nan")) for _ in xs]
    with pytest.raises(ValueError, match=re.escape("quantize_blockwise_: xs[i] has dtype torch.int32; expected a")):
        ops.quantize_blockwise_(xs, out_codes, out_absmax, block_size=64)
    assert all(bool((c == 7).all()) for c in out_codes) and all(bool(a.isnan().all()) for a in out_absmax)


def test_back_end_setting_and_device_pick_the_path(monkeypatch):
    """FASTOPT_BACKEND read as documented (case and blanks aside; unset or empty: auto); the 8-bit ops run in the
    extension under every setting but `torch`; auto sends CUDA tensors (a stand-in with a CUDA device here: only
    the device is read) to Triton, except under TRITON_INTERPRET=1, whose kernels run on CPU tensors."""
    cuda_like = types.SimpleNamespace(device=torch.device("cuda", 0))
    cpu = torch.empty(1)
    for setting, want in (("", "auto"), ("  ", "auto"), (" Torch ", "torch"), ("TRITON", "triton"), ("auto", "auto")):
        monkeypatch.setenv("FASTOPT_BACKEND", setting)
        assert ops.backend() == want, setting
        assert ops.use_extension() is (want != "torch"), setting
    monkeypatch.delenv("FASTOPT_BACKEND")
    assert ops.backend() == "auto" and ops.use_extension()
    for setting in ("auto", "torch"):
        monkeypatch.setenv("FASTOPT_BACKEND", setting)
        for interpret in ("1", "0", ""):
            monkeypatch.setenv("TRITON_INTERPRET", interpret)
            assert ops.use_triton(cpu) is False
            want = setting == "auto" and interpret != "1" and ops.triton_available()
            assert ops.use_triton(cuda_like) is want, (setting, interpret)
    if ops.triton_available():
        monkeypatch.setenv("FASTOPT_BACKEND", "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert ops.use_triton(cuda_like) is True


def test_use_triton_without_triton_and_on_devices_it_does_not_run(monkeypatch):
    """Without Triton installed, auto steps every tensor with the torch reference (CUDA ones too: they would import
    the kernels and fail) and FASTOPT_BACKEND=triton says what to install, on every device; with it, `triton`
    refuses tensors on a device that is neither CUDA nor CPU (meta here), under TRITON_INTERPRET=1 too (only CPU
    tensors go to the interpreter)."""
    cuda_like = types.SimpleNamespace(device=torch.device("cuda", 0))
    cpu, meta = torch.empty(1), torch.empty(1, device="meta")
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        monkeypatch.setenv("FASTOPT_BACKEND", "auto")
        assert ops.use_triton(cuda_like) is False and ops.use_triton(cpu) is False, interpret
        monkeypatch.setenv("FASTOPT_BACKEND", "triton")
        for t in (cuda_like, cpu):
            with pytest.raises(RuntimeError, match=re.escape("FASTOPT_BACKEND=triton but Triton is not installed: "
                                                             "pip install triton")):
                ops.use_triton(t)
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        with pytest.raises(RuntimeError, match=re.escape("(and cpu ones under TRITON_INTERPRET=1), not on meta "
                                                         "tensors: use FASTOPT_BACKEND=auto or torch")):
            ops.use_triton(meta)
        monkeypatch.setenv("FASTOPT_BACKEND", "auto")
        assert ops.use_triton(meta) is False
        monkeypatch.setenv("FASTOPT_BACKEND", "triton")


def test_adamw8bit_step_table_cache_follows_tensors_that_move_or_shrink(built, monkeypatch):
    """ops.adamw8bit_step with a `cache` steps bit for bit as with none (the step op then builds its own tables):
    while the tensors stay put (no table built again), after a grad moves (both built again), and after every
    tensor shrinks in place to a prefix (same addresses, fewer elements: built again, not taken from the cache,
    which the step op would refuse as built for other tensors). Two 8-bit params (one of a partial block) and one
    with fp32 state; fresh random grads each step."""
    monkeypatch.setenv("FASTOPT_BACKEND", "auto")
    bs, sizes, eight = 64, (300, 1000, 7), (True, True, False)
    builds = []
    orig = ops.build_ext_table
    monkeypatch.setattr(ops, "build_ext_table", lambda op, *a: builds.append(op) or orig(op, *a))

    def bucket():
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(n, generator=gen) for n in sizes]
        states = [dict(state1=torch.full((n,), 127, dtype=torch.uint8), state2=torch.zeros(n, dtype=torch.uint8),
                       absmax1=torch.zeros(-(-n // bs)), absmax2=torch.zeros(-(-n // bs)), step=torch.zeros(()))
                  if e else dict(state1=torch.zeros(n), state2=torch.zeros(n), step=torch.zeros(()))
                  for n, e in zip(sizes, eight)]
        return params, [torch.zeros(n) for n in sizes], states

    def shrunk(params, grads, states, ks):
        cut = {"state1": lambda k: k, "state2": lambda k: k, "absmax1": lambda k: -(-k // bs),
               "absmax2": lambda k: -(-k // bs)}
        return ([p[:k] for p, k in zip(params, ks)], [g[:k] for g, k in zip(grads, ks)],
                [{key: v if key == "step" else v[:cut[key](k)] for key, v in st.items()} for st, k in zip(states, ks)])

    runs = {"cached": bucket(), "none": bucket()}
    init = [p.clone() for p in runs["none"][0]]
    kept, cache, gen = [], {}, torch.Generator().manual_seed(1)
    for t in range(6):
        fresh = [torch.randn(n, generator=gen) for n in sizes]
        for name, (params, grads, states) in runs.items():
            if t == 2:  # the grads move (the old ones stay alive: the new ones get other addresses)
                kept.append(grads)
                grads = [torch.zeros_like(g) for g in grads]
            if t == 4:  # everything shrinks to a prefix of itself: the same addresses, fewer elements
                params, grads, states = shrunk(params, grads, states, (250, 950, 5))
            for g, f in zip(grads, fresh):
                g.copy_(f[:g.numel()])
            for st in states:
                st["step"] += 1
            builds.clear()
            ops.adamw8bit_step(params, grads, states, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                               block_size=bs, cache=cache if name == "cached" else None)
            runs[name] = (params, grads, states)
            if name == "cached":
                assert builds == (["adamw8bit_table", "adamw32_table"] if t in (0, 2, 4) else []), (t, builds)
    (pc, _, sc), (pn, _, sn) = runs["cached"], runs["none"]
    assert [p.numel() for p in pc] == [250, 950, 5]
    for a, b, x in zip(pc, pn, init):
        assert torch.equal(a, b) and not torch.equal(a, x[:a.numel()])
    for a, b in zip(sc, sn):
        for k in a:
            assert torch.equal(a[k], b[k]), k


# ---- the extension's build ----------------------------------------------------------------------------

def test_extension_uses_the_process_libstdcxx(built):
    """The built library links the libstdc++ the process already runs, dynamically. The lent H100's compiler
    (a gcc-toolset-style CC/CXX) linked it statically when left alone: a second copy of the locale machinery, and
    every C++ error message with a number in it crashed the process (SIGSEGV in num_put) instead of raising."""
    if not sys.platform.startswith("linux") or shutil.which("readelf") is None or shutil.which("nm") is None:
        pytest.skip("reads /proc/self/maps and the library's ELF symbols (Linux, binutils' readelf and nm)")
    mapped = [line.split()[-1] for line in open("/proc/self/maps") if "fastopt_ext_" in line]
    assert mapped, "the extension is not mapped into this process"
    lib = Path(mapped[0])
    (runtime,) = ext._runtime_libstdcxx()
    assert "libstdc++.so" in runtime
    ldflags = [ln for ln in (lib.parent / "build.ninja").read_text().splitlines() if ln.startswith("ldflags")]
    assert ldflags and runtime in ldflags[0].split(), ldflags  # linked against it by name, ahead of the default
    dyn = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "[libstdc++.so" in dyn, dyn
    # The statically linked copy showed as libstdc++'s own symbols defined in the extension (the H100's build
    # exported std::locale::id::_M_id; a gcc-toolset link still NEEDs libstdc++.so for the rest).
    syms = subprocess.run(["nm", "-DC", "--defined-only", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    assert "std::locale::id::_M_id" not in syms and "std::locale::locale()" not in syms
    with pytest.raises(ValueError, match=r"block_size=63 must be a power of two"):  # formats an int64
        torch.ops.fastopt.quantize_blockwise(torch.randn(10), R.dynamic_map(True), 63)


def test_extension_registers_ops(built):
    assert ext.is_available() and ext.load_error() is None
    assert ext.how_loaded() in ("built", "waited", "cache")
    for op in ("quantize_blockwise", "dequantize_blockwise", "quantize_blockwise_multi_",
               "dequantize_blockwise_multi_", "adamw8bit_step_", "adamw32_step_", "adamw8bit_table",
               "adamw32_table"):
        assert hasattr(torch.ops.fastopt, op)
    assert ext.has_cuda_kernels() == (torch.cuda.is_available() and torch.version.cuda is not None)
    # Fake (meta) kernels: shapes for torch.compile.
    x = torch.empty(1000, device="meta")
    codes, absmax = torch.ops.fastopt.quantize_blockwise(x, torch.empty(256, device="meta"), 256)
    assert codes.shape == (1000,) and codes.dtype == torch.uint8 and absmax.shape == (4,)


def test_fake_kernels_give_the_real_shapes_and_dtypes(built):
    """The meta (torch.compile) kernels: the shapes and dtypes the CPU kernels return, for every output dtype and
    lengths around a block's edge; the AdamW tables of the sizes the step ops take."""
    fo, meta = torch.ops.fastopt, torch.device("meta")
    for n in (0, 1, 64, 65, 1000):
        for bs in (64, 256):
            real = fo.quantize_blockwise(torch.randn(n), R.dynamic_map(True), bs)
            fake = fo.quantize_blockwise(torch.empty(n, device=meta), torch.empty(256, device=meta), bs)
            assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real], (n, bs)
    codes, absmax = fo.quantize_blockwise(torch.randn(3, 100), R.dynamic_map(True), 64)
    for dtype in DTYPES:
        real = fo.dequantize_blockwise(codes, absmax, R.dynamic_map(True), 64, dtype)
        fake = fo.dequantize_blockwise(codes.to(meta), absmax.to(meta), torch.empty(256, device=meta), 64, dtype)
        assert fake.device == meta and (fake.shape, fake.dtype) == (real.shape, real.dtype) == ((3, 100), dtype)
    full = [[torch.zeros(n) for n in (7, 3000)] for _ in range(4)] + [[torch.ones(()), torch.ones(())]]
    real = fo.adamw32_table(*full)
    fake = fo.adamw32_table(*[[t.to(meta) for t in ts] for ts in full])
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


def test_fake_adamw8bit_table_has_the_real_shape(built):
    """The meta kernel of adamw8bit_table (torch.compile traces the 8-bit step with it): the shape and dtype of the
    CPU op's table, for one param and for several (one of a partial block)."""
    fo, meta, bs = torch.ops.fastopt, torch.device("meta"), 64
    for sizes in ((7,), (7, 3000, 64)):
        lists = ([torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes],
                 [torch.zeros(n, dtype=torch.uint8) for n in sizes], [torch.zeros(n, dtype=torch.uint8) for n in sizes],
                 [torch.zeros(-(-n // bs)) for n in sizes], [torch.zeros(-(-n // bs)) for n in sizes],
                 [torch.ones(()) for _ in sizes])
        real = fo.adamw8bit_table(*lists, bs)
        fake = fo.adamw8bit_table(*[[t.to(meta) for t in ts] for ts in lists], bs)
        assert fake.device == meta and (fake.shape, fake.dtype) == (real.shape, real.dtype), sizes


def test_build_key_names_everything_the_library_depends_on(tmp_path, monkeypatch):
    """A change to any file of csrc/ that the build compiles or includes, to the torch or CUDA version, the
    compiler, or (CUDA builds) the architectures gives another build folder; a CPU-only build ignores the .cu
    files and the architectures (no needless rebuild); so do bytes moved from one file to the next, across the
    next file's name written into them too. Reads a copy of csrc/, with the architectures set."""
    src = tmp_path / "csrc"
    shutil.copytree(CSRC, src, ignore=shutil.ignore_patterns("tests"))
    monkeypatch.setattr(ext, "source_dir", lambda: src)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    monkeypatch.delenv("CXX", raising=False)

    def keys():
        return ext.build_key(False), ext.build_key(True)

    base = keys()
    assert base[0] != base[1] and keys() == base
    monkeypatch.setenv("FASTOPT_EXT_CUDA", "0")
    assert ext.build_key() == base[0]
    files = sorted(f for f in src.iterdir() if f.suffix in (".cpp", ".h", ".cuh", ".cu"))
    assert {f.name for f in files} >= {"bindings.cpp", "cpu_kernels.cpp", "fastopt_core.h", "quant_cuda.cu"}
    for f in files:
        text = f.read_bytes()
        f.write_bytes(text + b"\n// changed\n")
        cpu_key, cuda_key = keys()
        assert cuda_key != base[1], f.name
        assert (cpu_key == base[0]) == (f.suffix == ".cu"), f.name
        f.write_bytes(text)
    assert keys() == base
    # The same bytes in all, the end of bindings.cpp moved to the start of cpu_kernels.cpp (the next file hashed);
    # then bytes moved across the next file's name written into them (one stream of names and bytes for both)
    first, second = (src / "bindings.cpp").read_bytes(), (src / "cpu_kernels.cpp").read_bytes()
    for a, b in ((first[:-20], first[-20:] + second),
                 (first + b"cpu_kernels.cppX", second), (first, b"Xcpu_kernels.cpp" + second)):
        (src / "bindings.cpp").write_bytes(a)
        (src / "cpu_kernels.cpp").write_bytes(b)
        cpu_key, cuda_key = keys()
        assert cpu_key != base[0] and cuda_key != base[1]
        if b is second:
            moved = cpu_key
        elif b.startswith(b"X"):
            assert cpu_key != moved
    (src / "bindings.cpp").write_bytes(first)
    (src / "cpu_kernels.cpp").write_bytes(second)
    assert keys() == base
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert keys()[0] == base[0] and keys()[1] != base[1]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    for change in (lambda mp: mp.setattr(torch, "__version__", torch.__version__ + ".other"),
                   lambda mp: mp.setattr(torch.version, "cuda", "99.9"), lambda mp: mp.setenv("CXX", "clang++")):
        with monkeypatch.context() as mp:
            change(mp)
            changed = keys()
        assert changed[0] != base[0] and changed[1] != base[1]
        assert keys() == base


def _stub_build(tmp_path, monkeypatch, log, check=None):
    """The build of `_build_and_load` stubbed, its cache in `tmp_path`: the compiler, the toolchain check and the
    loader log to `log`; the compiler then runs `check(name, build_directory)` if given (which may raise, as a
    failed build) and writes a library file. Nothing is compiled or loaded."""
    from torch.utils import cpp_extension

    def fake_compile(name, build_directory, with_cuda, **kw):
        log.append(("compile", with_cuda, os.environ.get("TORCH_CUDA_ARCH_LIST")))
        if check is not None:
            check(name, Path(build_directory))
        (Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_compile)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: log.append(("dlopen", Path(path).name)))
    monkeypatch.setattr(ext, "_check_toolchain", lambda with_cuda: log.append(("toolchain", with_cuda)))


def test_cache_lock_and_architectures_of_a_build_without_compiling(tmp_path, monkeypatch):
    """How a load finds, builds or waits for the library, with the compiler, the toolchain check and the loader
    stubbed (nothing is compiled or loaded): a folder with a library but no BUILD_OK (a build killed while
    linking) and torch's stale build lock is built again, the stale lock removed first, under our exclusive lock,
    then marked; the next load takes the cache alone (no toolchain check); one that finds the library built by
    another process once it holds the lock says "waited". A CUDA build compiles for the architectures of
    `_cuda_arch_list()` and puts TORCH_CUDA_ARCH_LIST back as it was, set or not."""
    monkeypatch.setenv("FASTOPT_EXT_CUDA", "0")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    log = []

    def locked(name, d):
        assert not (d / "lock").exists(), "torch's stale build lock is still there: its build would wait forever"
        if sys.platform != "win32":
            import fcntl
            fd = os.open(tmp_path / f"{name}.lock", os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):  # held exclusively: not even a shared lock is granted
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            finally:
                os.close(fd)

    _stub_build(tmp_path, monkeypatch, log, locked)
    name = f"fastopt_ext_{ext.build_key(False)}"
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"\x7fE")  # cut short
    (tmp_path / name / "lock").touch()
    assert ext._build_and_load(False) == "built"
    assert log == [("toolchain", False), ("compile", False, None)], log
    assert (tmp_path / name / "BUILD_OK").read_text() == ext.build_key(False) + "\n"
    log.clear()
    assert ext._build_and_load(False) == "cache" and log == [("dlopen", f"{name}.so")], log

    monkeypatch.setenv("FASTOPT_EXT_CUDA", "1")
    arch = ext._cuda_arch_list()  # the visible GPUs' ("" without one)
    log.clear()
    assert ext._build_and_load(False) == "built"
    assert log == [("toolchain", True), ("compile", True, arch)] and "TORCH_CUDA_ARCH_LIST" not in os.environ, log
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5;8.0")
    log.clear()
    assert ext._build_and_load(False) == "built"
    assert log == [("toolchain", True), ("compile", True, "7.5;8.0")], log
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "7.5;8.0"

    class BuiltWhileWaiting(ext._FileLock):  # another process held the lock and finished the build
        def __enter__(self):
            d = self.path.with_suffix("")
            (d / f"{d.name}.so").write_bytes(b"\x7fELF")
            (d / "BUILD_OK").write_text("\n")
            return super().__enter__()

    monkeypatch.setattr(ext, "_FileLock", BuiltWhileWaiting)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    log.clear()
    assert ext._build_and_load(False) == "waited"
    name = f"fastopt_ext_{ext.build_key(True)}"
    assert log == [("toolchain", True), ("dlopen", f"{name}.so")], log


def test_a_failed_load_raises_the_same_error_every_time(monkeypatch):
    """load() tries once per process: a failure is kept and raised again, the same exception, by every later call
    (is_available() False, load_error() that exception, how_loaded() None); FASTOPT_EXT_VERBOSE reaches the build.
    The build is stubbed (this process's own extension state is put back after)."""
    monkeypatch.setattr(ext, "_loaded", False)
    monkeypatch.setattr(ext, "_error", None)
    monkeypatch.setattr(ext, "_how", None)
    tries = []

    def fail(verbose):
        tries.append(verbose)
        raise RuntimeError("fastopt.ext: building the C++ extension needs ninja: pip install ninja")

    monkeypatch.setattr(ext, "_build_and_load", fail)
    monkeypatch.setenv("FASTOPT_EXT_VERBOSE", "1")
    with pytest.raises(RuntimeError, match="pip install ninja") as first:
        ext.load()
    assert not ext.is_available() and ext.load_error() is first.value and ext.how_loaded() is None
    with pytest.raises(RuntimeError) as again:
        ext.load(verbose=False)
    assert again.value is first.value and tries == [True]


def test_build_key_names_the_python_and_the_libstdcxx_it_links(monkeypatch):
    """The build folder changes with the Python version (torch's headers and the extension's flags are per
    interpreter; several virtual environments share ~/.cache/torch_extensions) and with the libstdc++ the library
    is linked against (`_runtime_libstdcxx`), CPU and CUDA builds alike."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    monkeypatch.delenv("CXX", raising=False)

    def keys():
        return ext.build_key(False), ext.build_key(True)

    base = keys()
    for change in (lambda mp: mp.setattr(ext, "sys", types.SimpleNamespace(version_info=(3, 99, 0))),
                   lambda mp: mp.setattr(ext, "_runtime_libstdcxx", lambda: ("/opt/other/lib64/libstdc++.so.6",))):
        with monkeypatch.context() as mp:
            change(mp)
            changed = keys()
        assert changed[0] != base[0] and changed[1] != base[1]
        assert keys() == base


def test_cuda_kernels_are_built_only_where_torch_can_run_them(monkeypatch):
    """FASTOPT_EXT_CUDA=0|1 (or false/true, no/yes, off/on; case and blanks aside) decides; unset, empty or auto,
    the CUDA kernels are built where torch is a CUDA build that sees a GPU, not for a CUDA torch on a machine without
    one (nvcc would be needed for nothing) nor for a CPU-only torch; anything else is refused, naming the variable
    (`false` meant auto, a CUDA build, before). FASTOPT_EXT_VERBOSE reads alike. The architectures:
    TORCH_CUDA_ARCH_LIST (blanks aside), else every visible GPU's, each once, in order (the build key must not
    change with the order the GPUs are numbered in)."""
    for avail, cuda, want in ((True, "12.8", True), (False, "12.8", False), (True, None, False)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda avail=avail: avail)
        monkeypatch.setattr(torch.version, "cuda", cuda)
        for flag in ("", " ", "auto", " Auto"):
            monkeypatch.setenv("FASTOPT_EXT_CUDA", flag)
            assert ext._with_cuda() is want, (avail, cuda, flag)
        monkeypatch.delenv("FASTOPT_EXT_CUDA")
        assert ext._with_cuda() is want, (avail, cuda)
        for flag, forced in (("0", False), (" 0 ", False), ("false", False), ("No", False), ("OFF", False),
                             ("1", True), (" 1", True), ("true", True), ("Yes", True), ("on", True)):
            monkeypatch.setenv("FASTOPT_EXT_CUDA", flag)
            assert ext._with_cuda() is forced, (avail, cuda, flag)
    for flag in ("2", "cuda", "y"):
        monkeypatch.setenv("FASTOPT_EXT_CUDA", flag)
        with pytest.raises(ValueError, match=f"FASTOPT_EXT_CUDA='{flag}' must be one of 0, 1"):
            ext._with_cuda()
    for flag, verbose in (("", False), ("0", False), ("false", False), ("1", True), ("on", True)):
        monkeypatch.setenv("FASTOPT_EXT_VERBOSE", flag)
        assert ext._env_flag("FASTOPT_EXT_VERBOSE") in ((None, False) if not verbose else (True,)), flag
    monkeypatch.setenv("FASTOPT_EXT_VERBOSE", "loud")
    with pytest.raises(ValueError, match="FASTOPT_EXT_VERBOSE='loud'"):
        ext._env_flag("FASTOPT_EXT_VERBOSE")
    monkeypatch.delenv("FASTOPT_EXT_CUDA")
    caps = {0: (9, 0), 1: (8, 0), 2: (9, 0), 3: (8, 6)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert ext._cuda_arch_list() == "8.0;8.6;9.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", " ")
    assert ext._cuda_arch_list() == "8.0;8.6;9.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", " 7.5;8.0 ")
    assert ext._cuda_arch_list() == "7.5;8.0"


def test_a_marked_build_whose_library_is_gone_is_built_again(tmp_path, monkeypatch):
    """A build folder with BUILD_OK but no library (deleted by hand, or by a cache cleaner that removes large files)
    is neither taken from the cache nor as built by another process: it is built again (build stubbed), the mark
    removed while the library is linked (another process's warm-cache check would dlopen it half written)."""
    monkeypatch.setenv("FASTOPT_EXT_CUDA", "0")
    log = []

    def unmarked(name, d):
        assert not (d / "BUILD_OK").exists(), "BUILD_OK stands beside a library being linked"

    _stub_build(tmp_path, monkeypatch, log, unmarked)
    name = f"fastopt_ext_{ext.build_key(False)}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "BUILD_OK").write_text(ext.build_key(False) + "\n")
    assert ext._build_and_load(False) == "built"
    assert log == [("toolchain", False), ("compile", False, None)], log
    assert (tmp_path / name / f"{name}.so").is_file() and (tmp_path / name / "BUILD_OK").is_file()


def test_a_cuda_build_puts_the_architecture_setting_back_exactly_even_when_it_fails(tmp_path, monkeypatch):
    """TORCH_CUDA_ARCH_LIST set but empty (or blank) means "the visible GPUs'": the build compiles for those, and the
    variable is put back as it was (not left at the GPUs' list), after a build that fails too (build stubbed;
    two GPUs faked)."""
    monkeypatch.setenv("FASTOPT_EXT_CUDA", "1")
    caps = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    for i, setting in enumerate(("", " ")):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", setting)
        log = []
        _stub_build(tmp_path / f"built{i}", monkeypatch, log)
        assert ext._build_and_load(False) == "built"
        assert log == [("toolchain", True), ("compile", True, "8.0;9.0")], log
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == setting

        def broken(name, build_directory):
            raise RuntimeError("Error building extension")

        log.clear()
        _stub_build(tmp_path / f"broken{i}", monkeypatch, log, broken)
        with pytest.raises(RuntimeError, match="Error building extension"):
            ext._build_and_load(False)
        assert log == [("toolchain", True), ("compile", True, "8.0;9.0")], log
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == setting
        assert not list((tmp_path / f"broken{i}").rglob("BUILD_OK"))


def test_a_cached_library_that_does_not_load_is_built_again_from_nothing(tmp_path, monkeypatch):
    """A marked build whose library dlopen refuses (cut short on disk) is built again under the lock, from an empty
    folder (ninja would take the damaged library, newer than its objects, as built); a process that finds, once it
    holds the lock, another library than the one refused (built by another process meanwhile, of the same size) loads
    that one (build and loader stubbed)."""
    monkeypatch.setenv("FASTOPT_EXT_CUDA", "0")
    name = f"fastopt_ext_{ext.build_key(False)}"
    for rebuilt_meanwhile in (False, True):
        root = tmp_path / str(rebuilt_meanwhile)
        log = []
        _stub_build(root, monkeypatch, log, lambda name, d: log.append(sorted(f.name for f in d.iterdir())))
        d = root / name
        d.mkdir(parents=True)
        for f, data in ((f"{name}.so", b"\x7fE"), ("bindings.o", b"\x7fF"), ("BUILD_OK", ext.build_key(False) + "\n")):
            (d / f).write_bytes(data) if isinstance(data, bytes) else (d / f).write_text(data)

        def dlopen(path):
            log.append(("dlopen", Path(path).read_bytes()))
            if Path(path).read_bytes() == b"\x7fE":
                if rebuilt_meanwhile:
                    os.replace(d / "bindings.o", path)  # another file of the same size: a library another
                    # process built (of the same sources, its size is the size the refused one was meant to have)
                raise OSError(f"{path}: file too short")

        monkeypatch.setattr(torch.ops, "load_library", dlopen)
        if rebuilt_meanwhile:
            assert ext._build_and_load(False) == "waited"
            assert log == [("dlopen", b"\x7fE"), ("toolchain", False), ("dlopen", b"\x7fF")], log
        else:
            assert ext._build_and_load(False) == "built"
            assert log == [("dlopen", b"\x7fE"), ("toolchain", False), ("compile", False, None), []], log
            assert (d / "BUILD_OK").read_text() == ext.build_key(False) + "\n"
            assert (d / f"{name}.so").read_bytes() == b"\x7fELF"
            log.clear()
            assert ext._build_and_load(False) == "cache" and log == [("dlopen", b"\x7fELF")], log


def test_a_library_that_does_not_load_is_remembered_like_a_failed_build(tmp_path, monkeypatch):
    """A library that dlopen refuses, cached and then built again (cut short on disk both times: OSError, not
    RuntimeError), fails load() as a build error does: is_available() False (not raising), load_error() that
    OSError, the same exception raised again by a later load() without another try (this process's own extension
    state is put back after; the compiler stubbed, the loader real)."""
    from torch.utils import cpp_extension
    monkeypatch.setattr(ext, "_loaded", False)
    monkeypatch.setattr(ext, "_error", None)
    monkeypatch.setattr(ext, "_how", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("FASTOPT_EXT_CUDA", "0")
    monkeypatch.setattr(ext, "_check_toolchain", lambda with_cuda: None)
    builds = []

    def cut_short(name, build_directory, **kw):  # as torch's: compile, link, then load the library
        builds.append(name)
        (Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF")
        torch.ops.load_library(str(Path(build_directory) / f"{name}.so"))

    monkeypatch.setattr(cpp_extension, "load", cut_short)
    name = f"fastopt_ext_{ext.build_key(False)}"
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"\x7fELF")
    (tmp_path / name / "BUILD_OK").write_text(ext.build_key(False) + "\n")
    assert not ext.is_available()
    assert builds == [name] and not (tmp_path / name / "BUILD_OK").exists()
    first = ext.load_error()
    assert isinstance(first, OSError) and ext.how_loaded() is None
    tries = []
    monkeypatch.setattr(ext, "_build_and_load", lambda verbose: tries.append(verbose))
    with pytest.raises(OSError) as again:
        ext.load()
    assert again.value is first and tries == []


def test_toolchain_check_asks_for_nvcc_only_for_the_cuda_kernels(monkeypatch):
    """No CUDA toolkit (CUDA_HOME None): a CPU build goes ahead, with a CUDA torch or a CPU-only one; a CUDA build
    names the toolkit of torch's CUDA version, or (CPU-only torch) the torch build (ninja stubbed as present; the
    compiler is this Python, which is on PATH)."""
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setenv("CXX", sys.executable)
    for cuda, says in (("12.8", "which need nvcc from the CUDA toolkit 12.8"), (None, "is a CPU-only build")):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        ext._check_toolchain(False)
        with pytest.raises(RuntimeError, match=re.escape(says)) as e:
            ext._check_toolchain(True)
        # pip's CUDA torch ships no nvcc: FASTOPT_EXT_CUDA=0 alone leaves CUDA tensors with no kernels at all
        assert cuda is None or "FASTOPT_BACKEND=torch" in str(e.value), e.value


def test_a_loaded_extension_is_not_looked_up_again(built, monkeypatch):
    """Once loaded, load() returns at once: the 8-bit ops call it at every use (a step of AdamW8bit), and a second
    look-up would hash every source (build_key), dlopen the library and register the fake kernels again."""
    ext.load()
    tries = []
    monkeypatch.setattr(ext, "_build_and_load", lambda verbose: tries.append(verbose) or "cache")
    monkeypatch.setattr(ext, "_register_fakes", lambda: tries.append("fakes"))
    monkeypatch.setenv("FASTOPT_BACKEND", "auto")
    codes, absmax = ops.quantize_blockwise(torch.linspace(-1, 1, 300), 64)
    ext.load()
    assert ext.is_available() and ext.how_loaded() in ("built", "waited", "cache") and tries == []
    assert codes.shape == (300,) and absmax.shape == (5,)


def test_a_build_hands_the_compiler_the_cuda_files_and_flags_for_the_cuda_kernels_only(tmp_path, monkeypatch):
    """What `_build_and_load` hands torch's builder (cpp_extension.load stubbed: nothing is compiled or loaded): the
    C++ sources, and for a CUDA build the .cu files too with -DFASTOPT_WITH_CUDA on the host and the nvcc compiles
    alike (bindings.cpp registers the CUDA kernels under it: without it a CUDA build would load but refuse CUDA
    tensors); csrc/ on the include path and the process's libstdc++ (`_runtime_libstdcxx`) ahead of the compiler's
    own, CPU and CUDA builds alike; a library, not a Python module."""
    from torch.utils import cpp_extension
    calls = []

    def fake_compile(name, sources, build_directory, **kw):
        calls.append(dict(kw, sources=[Path(s).name for s in sources]))
        (Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    monkeypatch.setattr(cpp_extension, "load", fake_compile)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    monkeypatch.setattr(ext, "_check_toolchain", lambda with_cuda: None)
    monkeypatch.setattr(ext, "_runtime_libstdcxx", lambda: ("/opt/rt/lib64/libstdc++.so.6",))
    for flag in ("0", "1"):
        monkeypatch.setenv("FASTOPT_EXT_CUDA", flag)
        assert ext._build_and_load(False) == "built", flag
    cpu, cuda = calls
    assert cpu["with_cuda"] is False and cpu["sources"] == ["bindings.cpp", "cpu_kernels.cpp"]
    assert cuda["with_cuda"] is True
    assert cuda["sources"] == ["bindings.cpp", "cpu_kernels.cpp", "quant_cuda.cu", "adamw_cuda.cu"]
    assert "-DFASTOPT_WITH_CUDA" not in cpu["extra_cflags"] + cpu["extra_cuda_cflags"]
    assert "-DFASTOPT_WITH_CUDA" in cuda["extra_cflags"] and "-DFASTOPT_WITH_CUDA" in cuda["extra_cuda_cflags"]
    for kw in calls:
        assert kw["extra_include_paths"] == [str(ext.source_dir())] and kw["is_python_module"] is False
        assert kw["extra_ldflags"] == ["/opt/rt/lib64/libstdc++.so.6"]


def test_the_libstdcxx_named_is_the_mapped_file_ninja_can_take(tmp_path, monkeypatch):
    """`_runtime_libstdcxx` reads /proc/self/maps (a fake here; uncached): the first mapped libstdc++.so that is a
    file, one replaced on disk since it was mapped (" (deleted)", as a package upgrade leaves it) taken as the file
    now at its path; not one whose path ninja could not take unquoted (whitespace, `$`) nor one that is gone; ()
    when none is left or /proc cannot be read."""
    libs = {}
    for name in ("a$b", "a b", "lib64"):
        (tmp_path / name).mkdir()
        libs[name] = tmp_path / name / "libstdc++.so.6"
        libs[name].write_bytes(b"\x7fELF")
    row = "7f0a1c000000-7f0a1c200000 r-xp 00000000 08:01 1234                       "
    maps = ["7f0a1b000000-7f0a1b021000 rw-p 00000000 00:00 0 ",
            row + str(tmp_path / "gone" / "libstdc++.so.6"), row + str(libs["a$b"]), row + str(libs["a b"]),
            row + str(libs["lib64"]) + " (deleted)", row + str(libs["a$b"])]

    def fake_open(lines):
        def open_(path, *args, **kw):
            assert path == "/proc/self/maps"
            if lines is None:
                raise FileNotFoundError(path)
            return io.StringIO("".join(line + "\n" for line in lines))
        return open_

    read = ext._runtime_libstdcxx.__wrapped__
    for lines, want in ((maps, (str(libs["lib64"]),)), (maps[:4], ()), ([], ()), (None, ())):
        monkeypatch.setattr(ext, "open", fake_open(lines), raising=False)
        assert read() == want, lines


def test_the_sources_are_found_in_the_package_then_beside_it(tmp_path, monkeypatch):
    """source_dir(): csrc/ inside the installed package (fastopt/csrc, where a wheel puts it), else next to the
    package (a source checkout); neither: an error that says to reinstall (the module's path faked)."""
    site = (tmp_path / "site").resolve()
    for d in (site / "fastopt" / "csrc", site / "csrc"):
        d.mkdir(parents=True)
        (d / "bindings.cpp").write_text("")
    monkeypatch.setattr(ext, "__file__", str(site / "fastopt" / "ext.py"))
    assert ext.source_dir() == site / "fastopt" / "csrc"
    (site / "fastopt" / "csrc" / "bindings.cpp").unlink()
    assert ext.source_dir() == site / "csrc"
    (site / "csrc" / "bindings.cpp").unlink()
    with pytest.raises(RuntimeError, match=re.escape("reinstall fastopt (pip install fastopt)")):
        ext.source_dir()


_BUILD_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from fastopt import ext
    from fastopt.reference import quant as R
    t0 = time.perf_counter()
    ext.load()
    codes, absmax = torch.ops.fastopt.quantize_blockwise(torch.linspace(-1, 1, 300), R.dynamic_map(True), 64)
    want = R.quantize_blockwise(torch.linspace(-1, 1, 300), 64)
    assert torch.equal(codes, want[0]) and torch.equal(absmax, want[1])
    print(ext.how_loaded(), f"{time.perf_counter() - t0:.2f}")
""")


def test_cold_cache_build_four_processes(tmp_path):
    """Four processes start together on an empty TORCH_EXTENSIONS_DIR: one compiles, three wait on the lock
    and load its library; a fifth finds it in the cache. CPU-only build (FASTOPT_EXT_CUDA=0) to keep it small."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), FASTOPT_EXT_CUDA="0",
               FASTOPT_EXT_VERBOSE="0", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_SCRIPT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    hows = sorted(out.split()[0] for out, _ in outs)
    # One compiles; the others wait on its lock (or, if one started only after the build, find it built).
    assert hows.count("built") == 1 and set(hows) <= {"built", "waited", "cache"}, hows
    assert len([d for d in (tmp_path / "ext").iterdir() if d.is_dir()]) == 1
    p = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    how, seconds = p.stdout.split()
    assert how == "cache", p.stdout
    # A warm cache loads the library and nothing else (no compiler, no ninja, no lock): well under a second
    # on an idle machine; 10 s leaves room for a loaded CI runner, and a rebuild takes minutes.
    assert float(seconds) < 10, f"warm-cache load took {seconds} s"
    print(f"warm-cache load: {seconds} s")


def test_missing_ninja_names_the_fix(tmp_path, monkeypatch):
    """No ninja on a cold cache: an error that says what to install (checked in a child process, so that
    this process's loaded extension is not involved)."""
    script = textwrap.dedent("""
        import torch.utils.cpp_extension as ce
        def no_ninja():
            raise RuntimeError("Ninja is required to load C++ extensions")
        ce.verify_ninja_availability = no_ninja
        from fastopt import ext
        assert not ext.is_available()
        print(ext.load_error())
    """)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), FASTOPT_EXT_CUDA="0")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "pip install ninja" in p.stdout


def _load_error_in_child(**env) -> str:
    """The RuntimeError ext.load() raises in a child process (CPU kernels only, ninja stubbed as present; `env`
    added to this process's), so that this process's loaded extension is not involved; fails if load() works."""
    script = textwrap.dedent("""
        import torch.utils.cpp_extension as ce
        ce.verify_ninja_availability = lambda: None
        from fastopt import ext
        try:
            ext.load()
        except RuntimeError as e:
            print(e)
        else:
            raise SystemExit("ext.load() built or loaded the extension")
    """)
    env = dict(os.environ, FASTOPT_EXT_CUDA="0", **env)
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def test_missing_compiler_names_the_fix(tmp_path):
    """No C++ compiler (CXX names none) on a cold cache: load() raises an error that says what to install
    (checked in a child process, so that this process's loaded extension is not involved; ninja is stubbed as
    present, so that the compiler check is the one reached whatever this machine has)."""
    out = _load_error_in_child(TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), CXX="no-such-cxx")
    assert "'no-such-cxx' is not on PATH" in out and "install g++" in out, out
    assert not any((tmp_path / "ext").rglob("*.so")), "a library was built"


def test_cuda_kernels_with_cpu_only_torch_name_the_fix(tmp_path):
    """FASTOPT_EXT_CUDA=1 with a CPU-only torch (torch.version.cuda None, faked in the child so that any torch
    shows it): the error says the torch build is CPU-only and what to install, not "install the toolkit None"
    (checked in a child process on a cold cache; ninja is stubbed as present)."""
    script = textwrap.dedent("""
        import torch
        import torch.utils.cpp_extension as ce
        ce.verify_ninja_availability = lambda: None
        torch.version.cuda = None
        from fastopt import ext
        try:
            ext.load()
        except RuntimeError as e:
            print(e)
        else:
            raise SystemExit("ext.load() built or loaded CUDA kernels with a CPU-only torch")
    """)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), FASTOPT_EXT_CUDA="1")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "CPU-only build" in p.stdout and "install a CUDA build of torch" in p.stdout, p.stdout
    assert "FASTOPT_EXT_CUDA=0" in p.stdout and "None (" not in p.stdout, p.stdout
    assert not any((tmp_path / "ext").rglob("*.so")), "a library was built"


def test_cmake_builds_and_ctest_passes(tmp_path):
    """The torch-free core and its C++ unit tests, without Python (CPU part; the CUDA files are compiled by the nvcc
    test below). Among them csrc/tests/test_cuda.cu on the CPU: the CUDA kernels (device code paths included)
    built by g++ against the CUDA emulator of csrc/tests/emu, equal to the CPU kernels bit for bit, with misaligned
    vector accesses trapped by UBSan; ctest runs it on the emulator's default 3 multiprocessors, and it runs again
    here on 1 (one persistent block walking every tile) and 5 (more blocks than tiles of some tests). Each file is
    its own object, and no inline function of fastopt_core.h may be emitted out of line in both a kernel object
    (compiled with __CUDA_ARCH__) and a host one: the linker would keep one copy for both, and the CPU kernels
    could run the device variant or the reverse."""
    cmake, ctest = shutil.which("cmake"), shutil.which("ctest")
    if cmake is None or ctest is None:
        pytest.skip("cmake/ctest not installed")
    build = tmp_path / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    for cmd in ([cmake, "-S", str(REPO), "-B", str(build), "-DFASTOPT_CUDA=OFF", *gen],
                [cmake, "--build", str(build), "-j", "2"],
                [ctest, "--test-dir", str(build), "--output-on-failure"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "100% tests passed" in r.stdout
    assert "cuda_emulated" in r.stdout, r.stdout  # the CUDA kernels ran, through the emulator

    objs = {o.name.split(".")[0]: o for o in build.glob("CMakeFiles/test_cuda_emu.dir/**/*.o")}
    sides = {"kernels": ["quant_cuda_emu", "adamw_cuda_emu"], "host": ["test_cuda_emu", "cpu_kernels"]}
    assert set(objs) >= {n for names in sides.values() for n in names}, sorted(objs)

    def weak_fastopt(obj):
        nm = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True, check=True)
        return {line.split(" ", 2)[2] for line in nm.stdout.splitlines()
                if line.split(" ")[1:2] in (["W"], ["V"], ["u"]) and " fastopt::" in " " + line.split(" ", 2)[2]}

    if shutil.which("nm"):
        kernel_side, host_side = (set().union(*(weak_fastopt(objs[n]) for n in names)) for names in sides.values())
        assert not kernel_side & host_side, sorted(kernel_side & host_side)
    exe = build / "test_cuda_emu"
    for sms in ("1", "5"):
        r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, FASTOPT_EMU_SMS=sms))
        assert r.returncode == 0 and "all CUDA tests passed" in r.stdout, \
            f"FASTOPT_EMU_SMS={sms}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


def test_nvcc_compiles_every_cu_file(tmp_path):
    """Every .cu file of csrc/ (kernels and the CUDA unit test) compiles for sm_90; nothing runs them here. No
    kernel spills registers to local memory, but for fp64 params (adamw8bit_kernel<double, 4>: 78 bytes a thread
    at 3 blocks per SM): the launch bounds are chosen so that the software-pipelined tiles fit."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    files = sorted(CSRC.rglob("*.cu"))
    assert {f.name for f in files} >= {"quant_cuda.cu", "adamw_cuda.cu"}
    procs = [(f, subprocess.Popen([nvcc, "-arch=sm_90", "-std=c++17", "-O3", "-Xptxas", "-v", "-I", str(CSRC), "-c",
                                   str(f), "-o", str(tmp_path / (f.stem + ".o"))], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)) for f in files]
    kernels, spills = 0, []
    for f, p in procs:
        out = p.communicate(timeout=600)[0]
        assert p.returncode == 0, f"{f.name}:\n{out[-4000:]}"
        assert (tmp_path / (f.stem + ".o")).stat().st_size > 0
        name = None
        for line in out.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                name = m.group(1)
                kernels += 1
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m and name and (int(m.group(1)) or int(m.group(2))) and "Id" not in name.split("kernel", 1)[1][:3]:
                spills.append(f"{name}: {line.strip()}")
    assert kernels == 3 * 4 * 2 + 4, kernels  # {quantize, dequantize, adamw8bit} x 4 dtypes x KMAX 4, 16; adamw32
    assert not spills, "\n".join(spills)


@pytest.mark.gpu
def test_cuda_unit_test_passes(tmp_path):
    """csrc/tests/test_cuda.cu (the CUDA kernels against the CPU kernels, without torch: every block size, whole
    blocks in vectors and tensors one element off their alignment) built with nvcc alone and run on this GPU."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    major, minor = torch.cuda.get_device_capability()
    exe = tmp_path / "test_cuda"
    cmd = [nvcc, f"-arch=sm_{major}{minor}", "-std=c++17", "-O3", "-I", str(CSRC), str(CSRC / "tests" / "test_cuda.cu"),
           str(CSRC / "quant_cuda.cu"), str(CSRC / "adamw_cuda.cu"), str(CSRC / "cpu_kernels.cpp"), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "all CUDA tests passed" in r.stdout, f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


def test_kernel_sources_include_no_torch():
    """Only bindings.cpp may include torch: the kernels build with nvcc/g++ alone."""
    for f in CSRC.rglob("*"):
        if f.suffix in (".h", ".cuh", ".cpp", ".cu") and f.name != "bindings.cpp":
            text = f.read_text()
            for banned in ("<torch/", "<ATen/", "<c10/", "<pybind11/"):
                assert banned not in text, f"{f.relative_to(REPO)} includes {banned}"


# ---- CUDA (skipped without a GPU) ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [64, 256, 2048, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
def test_cuda_matches_reference_bitwise(built, block_size, dtype, offset):
    """The CUDA kernels' codes, absmax and dequantized values equal the reference's, and run on the
    current stream with no host sync. offset=1: input and codes one element into their memory, so no block
    is aligned for the kernels' vector loads and stores (they go element by element)."""
    x = _data(block_size * 37 + 3, dtype=dtype, seed=3)
    for signed in (True, False):
        xs = x if signed else x.abs()
        code = R.dynamic_map(signed, "cuda")
        c2, a2 = R.quantize_blockwise(xs, block_size, signed)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            xc = torch.cat([xs.new_zeros(offset), xs]).cuda()[offset:]
            torch.cuda.set_sync_debug_mode("error")
            try:
                c1, a1 = torch.ops.fastopt.quantize_blockwise(xc, code, block_size)
                c1 = torch.cat([c1.new_zeros(offset), c1])[offset:]
                y1 = torch.ops.fastopt.dequantize_blockwise(c1, a1, code, block_size, dtype)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        stream.synchronize()
        assert offset == 0 or (xc.data_ptr() % (4 * xc.element_size()) and c1.data_ptr() % 4)
        assert torch.equal(c1.cpu(), c2) and torch.equal(a1.cpu(), a2)
        assert torch.equal(y1.cpu(), R.dequantize_blockwise(c2, a2, block_size, signed, dtype))


def test_the_cache_is_torchs_extensions_folder_xdg_cache_home_included(tmp_path, monkeypatch):
    """Without TORCH_EXTENSIONS_DIR the cache is where torch puts its own extensions: `torch_extensions` in
    $XDG_CACHE_HOME (a cluster's answer to a small or read-only home), else in ~/.cache; a relative
    XDG_CACHE_HOME is ignored (the XDG spec's rule)."""
    from torch.utils import cpp_extension
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ext._extensions_root() == tmp_path / "xdg" / "torch_extensions"
    assert ext._extensions_root() == Path(cpp_extension.get_default_build_root())
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert ext._extensions_root() == tmp_path / "home" / ".cache" / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "te"))
    assert ext._extensions_root() == tmp_path / "te"


def test_an_unwritable_cache_names_the_fix(tmp_path):
    """A cold cache that cannot be written (here a TORCH_EXTENSIONS_DIR under a regular file; a read-only folder
    fails alike for any user but root): an error that names the folder and what to set, not a bare OSError
    (checked in a child process, so that this process's loaded extension is not involved; ninja is stubbed)."""
    (tmp_path / "file").write_text("")
    root = tmp_path / "file" / "ext"
    out = _load_error_in_child(TORCH_EXTENSIONS_DIR=str(root))
    assert f"extension cache {root} cannot be written" in out, out
    assert "set TORCH_EXTENSIONS_DIR to a writable folder" in out and "FASTOPT_BACKEND=torch" in out, out
