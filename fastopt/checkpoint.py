"""Optimizer state that survives a change of layout (issue 8): how `FastOptimizer.state_dict()` and
`load_state_dict()` present state, so that `torch.distributed.checkpoint` (DCP) reshards it and a plain
`torch.save` / `torch.load(weights_only=True)` resumes bit for bit.

A param's state, in memory and in a state_dict:

- `step`: an fp32 scalar tensor, the same on every rank (python numbers are accepted on load).
- Element-wise states (Adam moments, Adafactor's vector second moment and momentum, 8-bit codes; each
  optimizer names them: `FastOptimizer._elementwise_keys`): shaped like the param. For a DTensor param they
  are DTensors with the param's mesh and placements (the optimizer's kernels get their local tensors, which
  share storage), so DCP saves each element once and reloads it under any other layout. On load, a plain
  tensor of the param's global shape is cut to this rank's piece, and a DTensor with other placements is
  redistributed.
- Sharded states that are not shaped like the param (GaLore's projected moments and bases of a DTensor param):
  DTensors of their own global shape on the param's mesh (the moments cut along one dim over the ranks that
  shard the param, the bases like the param along the dims they share with it; `FastOptimizer._dtensor_forms`);
  DCP and `load_state_dict` treat them as the element-wise ones (a whole plain tensor is cut on load).
- Whole states (Adafactor's and CAME's row and column statistics; GaLore's bases and projected moments of
  plain params and flat ranges, and the projected moments of declared dim shards): plain tensors, identical on
  every rank, so they load under any layout as they are.
- 8-bit states (codes + one fp32 absmax per block) come in two forms, under different keys, so that DCP
  (which fills the template's keys from the checkpoint's keys of the same name, casting dtypes silently)
  never copies one form into the other:
  - codes: `state1` (uint8) + `absmax1`. An optimizer of plain params (single process, DDP) saves these:
    compact, exact, bitsandbytes' format.
  - dequantized: `state1: {"fp32": values}` (fp32; `DEQUANTIZED`), no absmax. The blocks of a DTensor param
    are cut from this rank's local piece and mean nothing under another layout, so an optimizer with any
    DTensor param saves every 8-bit state in this form (a DTensor for a DTensor param; its plain params too,
    which may be DTensors under another layout), and so does any optimizer within `dequantized_8bit(...)`.
    DCP addresses the values as `state.<fqn>.state1.fp32`. Nested under the codes' key, the form also takes
    DCP's flattened form (`flatten_optimizer_state_dict=True`, torchtitan's), which rebuilds each state from
    the keys the optimizer holds in memory (the codes' and the absmax's): the codes' key finds the nested
    values, the absmax's key finds nothing and comes as an empty dict, which is ignored.
  `load_state_dict` takes either form under any layout (and fp32 values under the codes' key without the
  absmax: older fastopt state_dicts, came-pytorch): dequantized values are requantized into the blocks of the
  new local piece with `requantize`, which gives back the very same values, bit for bit, wherever a new block
  holds the elements of one old block (the same layout, or layouts whose local pieces start on block
  boundaries); elsewhere each element moves by at most half a quantization step of its new block. Codes saved
  by plain params are dequantized whole before that.
  With DCP, the template and the checkpoint must hold the same form: DDP -> FSDP2/TP fails with DCP's
  "Missing key in checkpoint ... state1.fp32" unless the DDP side saved within `dequantized_8bit(opt)` (do
  that whenever a checkpoint may be resumed under another layout); FSDP2/TP -> single process or DDP needs
  its template built within `dequantized_8bit(opt)`, or DCP misses `state1`. So does a full state on rank 0
  (`full_state_dict=True`) loaded into plain params: torch's unflattening otherwise fails on rank 0 (IndexError)
  and the other ranks take zeroed moments.
- 8-bit and 32-bit state of one optimizer (`nbits`; AdamW8bit's and others' `min_8bit_size`): a state_dict's
  param_groups replace the optimizer's, these settings included (torch's rule; DCP fills the template's groups
  from the checkpoint's alike), so a state_dict loads as the optimizer that saved it: a plain state_dict of
  8-bit state into an optimizer built with 32-bit state (or the reverse) resumes bit for bit, and the
  optimizer has the saved settings from then on. With DCP the template has the loading optimizer's own keys:
  32-bit -> 8-bit stops at DCP's "Missing key in checkpoint ... absmax"; 8-bit codes -> 32-bit state find
  the template's float state under their own key (`state1`, `exp_avg`), and DCP casts them into it, leaving
  the absmax behind. `load_state_dict` refuses that with a ValueError naming the key: a state that is 8-bit
  under the state_dict's settings and 32-bit under the optimizer's own, given as floats without its absmax,
  every one a whole number from 0 to 255, is taken for cast codes. All zeros are read as zeros where codes
  would mean zeros too (the unsigned map's code 0; a fresh state: zero codes, absmax and step), and refused
  under the signed map after a step (its code 0 is its lowest value times the absmax). Build the loading
  optimizer with the checkpoint's settings, so that its template asks for the codes and their absmax.
  Dequantized values under the codes' key (older fastopt, came-pytorch) still load under any settings, as
  real moments are not all whole numbers up to 255 (a zero momentum after a step excepted, as above).

DCP's `get_optimizer_state_dict` runs a fake step (zero grads, lr=0) on an optimizer whose state is empty; a
fastopt optimizer's state mapping is never empty in that sense (`StateDict`), and its `state_dict()` lists
zero state for every trainable param that has none yet, so DCP gets a template without any step being taken.
`state_dict()` holds the state tensors themselves, as torch.optim's does (copies cost a second copy of the state
on its device for as long as a save holds them), so DCP's `load`, which writes into the template in place, writes
into the optimizer's state; `load_state_dict` then checks everything and installs copies. To keep the optimizer as
it was should the checkpoint be bad, load into `copy.deepcopy(get_optimizer_state_dict(model, opt))`.

Usage (every rank; the loading side may use another mesh, parallelism or world size)::

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    ...
    sd = {"optim": get_optimizer_state_dict(model, opt)}   # the template (zero state if opt is fresh)
    dcp.load(sd, checkpoint_id=path)                        # no_dist=True in a single process
    set_optimizer_state_dict(model, opt, sd["optim"])

8-bit state between plain params (single process, DDP) and DTensor params: `with dequantized_8bit(opt):`
around `get_optimizer_state_dict` on the side with plain params, for the save and for the template alike.

Not covered: plain tensors sharded by hand (`declare_shard`, `setup_distributed`'s flat ZeRO ranges) keep
element-wise state of their local piece (and declared dim shards GaLore's bases of their piece), which DCP
cannot reshard; save those with their own layout.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from .distributed.layout import is_dtensor, local
from .reference import quant as q

__all__ = ["StateDict", "state_of", "dequantized_8bit", "DEQUANTIZED", "requantize", "is_dtensor"]


class StateDict(defaultdict):
    """torch.optim's `state` mapping (param -> dict), truthy even when empty; its truth test first makes the
    zero state of its optimizer's trainable params that have none (`FastOptimizer._make_zero_states`).

    `torch.distributed.checkpoint.state_dict._init_optim_state`, which DCP's get_ and set_optimizer_state_dict
    run first, tests the state and, when it is empty, steps the optimizer with zero grads and lr=0 to create it;
    that step is not harmless here (Adafactor's relative step size ignores lr, and refuses lr=0 with
    relative_step=True), so the test makes the zero state instead. DCP's flattened form
    (`flatten_optimizer_state_dict=True`) is then rebuilt from the keys of each param's state, as it is after
    torch's step: a fresh optimizer would otherwise take no state from it, silently."""

    _owner = None  # weakref of the optimizer (not copied or pickled: the optimizer sets it again)

    def __bool__(self) -> bool:
        opt = self._owner() if self._owner is not None else None
        if opt is not None:
            opt._make_zero_states()
        return True


def state_of(opt, state) -> StateDict:
    """`state` as the StateDict of optimizer `opt`."""
    out = StateDict(dict, state)
    out._owner = weakref.ref(opt)
    return out


def local_state(st: dict, p: Tensor) -> dict:
    """`st` with the local tensors of its DTensor states (sharing storage): what the kernels update. `st`
    itself for a plain param (no copy: this runs for every param at every step)."""
    return {k: local(v) for k, v in st.items()} if is_dtensor(p) else st


def like_param(t: Tensor, p: Tensor) -> Tensor:
    """`t`, this rank's piece of a state shaped like DTensor `p`, as a DTensor with p's mesh and placements
    (sharing t's storage)."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def as_dtensor(t: Tensor, p: Tensor, form: tuple) -> Tensor:
    """`t`, this rank's piece of a state of DTensor param `p` whose `form` is (global shape, placements) on
    p's mesh (`FastOptimizer._dtensor_forms`), as a DTensor (sharing t's storage)."""
    from torch.distributed.tensor import DTensor
    shape, placements = form
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t, p.device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def as_step(step, where: str, device) -> Tensor:
    """A state's `step` as the kernels read it: a new fp32 0-dim tensor on `device`, from a one-element tensor or
    a Python number (transformers', came-pytorch's and galore-torch's int); anything else, a DTensor, or a value
    that is not a finite number >= 0 is a ValueError naming `where`['step']."""
    if is_dtensor(step):  # kept as it comes, it would be a DTensor in the state: the kernels mix it with plain tensors
        raise ValueError(f"{where}['step'] is a DTensor; this state is a plain tensor, the same on every rank")
    if isinstance(step, Tensor) and step.numel() == 1 and not step.is_complex():
        step = step.detach().reshape(()).to(dtype=torch.float32, copy=True)
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        step = torch.tensor(float(step), dtype=torch.float32)
    else:
        raise ValueError(f"{where}['step'] must be a scalar tensor or number, got {type(step).__name__}")
    if not step.is_meta and (not torch.isfinite(step) or step < 0):  # checked where it is: params may be on meta
        raise ValueError(f"{where}['step']={float(step)} must be a finite number >= 0")
    return step.to(device)


def zero_state(spec: dict, p: Tensor, forms: dict) -> dict:
    """The state a param starts from: step 0 and zeros of `spec` (key -> (local shape, dtype)); the keys of
    `forms` (a DTensor param's sharded states: key -> (global shape, placements)) are DTensors."""
    dev = local(p).device
    st = {"step": torch.zeros((), dtype=torch.float32, device=dev)}
    for key, (shape, dtype) in spec.items():
        t = torch.zeros(shape, dtype=dtype, device=dev)
        st[key] = as_dtensor(t, p, forms[key]) if key in forms else t
    return st


@contextlib.contextmanager
def dequantized_8bit(*optimizers):
    """Within this block, the state_dicts of `optimizers` hold every 8-bit state in its dequantized fp32 form,
    nested under the codes' key as {DEQUANTIZED: values} (as DTensor params always do): what an optimizer of
    plain params (single process, DDP) saves for a checkpoint that DTensor params (FSDP2, TP) will load, and its
    DCP template for a checkpoint that DTensor params saved; also a checkpoint meant for other block sizes."""
    from .distributed.zero import ZeroRedundancyOptimizer
    from .optim.base import FastOptimizer
    if not optimizers:
        raise TypeError("dequantized_8bit: name the optimizers, e.g. `with dequantized_8bit(opt):`")
    for o in optimizers:  # another object would take the flag and read it nowhere: no error, no dequantized state
        if not isinstance(o, (FastOptimizer, ZeroRedundancyOptimizer)):
            raise TypeError(f"dequantized_8bit: {type(o).__name__} is not a fastopt optimizer or "
                            "ZeroRedundancyOptimizer (other optimizers keep no 8-bit states of fastopt's)")
    saved = [o.__dict__.get("_dequantize_8bit", False) for o in optimizers]
    for o in optimizers:
        o._dequantize_8bit = True
    try:
        yield
    finally:
        for o, s in zip(optimizers, saved):
            o._dequantize_8bit = s


DEQUANTIZED = "fp32"  # an 8-bit state's dequantized form in a state_dict: {codes' key: {DEQUANTIZED: values}}


def export_state(st: dict, quantized: dict, force_dequantize: bool) -> dict:
    """One param's state for a state_dict: its tensors themselves (detached), as torch.optim's state_dict holds
    them, with no copy on their device (a copy doubled the state's memory while a checkpoint was saved); 8-bit
    states dequantized ({DEQUANTIZED: values} under the codes' key, without the absmax: new tensors) when the param
    is a DTensor or `force_dequantize`. DCP loads into a template in place, so a template made from these is the
    optimizer's own state: `import_state` copies what it installs, and the tests that a refused load changes
    nothing fill a deep copy of the template."""
    out = {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in st.items()}
    for key, (akey, signed, block) in quantized.items():
        if akey not in st or st[key].dtype != torch.uint8:
            continue
        codes = st[key]
        if not (force_dequantize or is_dtensor(codes)):
            continue
        vals = ops.dequantize_blockwise(local(codes).contiguous(), st[akey], block, signed, torch.float32)
        del out[akey]
        out[key] = {DEQUANTIZED: like_param(vals, codes) if is_dtensor(codes) else vals}
    return out


def requantize(x: Tensor, block_size: int, signed: bool) -> tuple[Tensor, Tensor]:
    """(codes, absmax) of fp32 values `x`, in blocks of `block_size` of its flattened elements.

    Where a block's values are exactly map[c] * a for codes c and one scale a (they were dequantized from
    blocks cut the same way), this finds such a pair, so that dequantizing gives `x` back bit for bit; the
    plain nearest quantization (`quantize_blockwise`) cannot always, because the signed map's most negative
    value is not -1: a block whose largest magnitude is negative comes back with a smaller absmax. The scale
    is the block's largest magnitude over the map value that coded it: 1, or (signed map) -map[0] = 0.99297,
    which codes a negative absmax and may code the largest positive value too (map[254] = -map[0]), so both are
    tried whatever the sign. Other blocks get the nearest quantization."""
    q.check_float(x, "requantize")  # before the cast below would take 8-bit codes for values
    q.check_block_size(block_size, "requantize")
    x = x.to(torch.float32)
    codes, absmax = q.quantize_blockwise(x, block_size, signed)
    if x.numel() == 0:
        return codes, absmax
    blocks = q._blocks(x, block_size)
    m = q.dynamic_map(signed, x.device)
    mag = blocks.abs().amax(dim=1)
    done = torch.zeros(blocks.shape[0], dtype=torch.bool, device=x.device)
    flat_codes = codes.reshape(-1).clone()
    n = x.numel()
    cands = []
    for top in ([m[-1], -m[0]] if signed else [m[-1]]):
        a0 = mag / top
        up, down = torch.full_like(a0, float("inf")), torch.zeros_like(a0)
        up1, down1 = torch.nextafter(a0, up), torch.nextafter(a0, down)
        # mag / top may round an ulp or two away from the scale the values were made with
        cands += [a0, up1, down1, torch.nextafter(up1, up), torch.nextafter(down1, down)]
    for a in cands:
        safe = torch.where(a > 0, a, torch.ones_like(a))
        c = q.nearest_code((blocks / safe[:, None]).reshape(-1), m).view(blocks.shape)
        ok = (m[c.long()] * a[:, None] == blocks).all(dim=1) & ~done
        sel = ok.repeat_interleave(block_size)[:n]
        flat_codes = torch.where(sel, c.reshape(-1)[:n], flat_codes)
        absmax = torch.where(ok, a, absmax)
        done |= ok
    return flat_codes.view(x.shape), absmax


def all_finite(t: Tensor) -> Tensor:
    """`torch.isfinite(t).all()` (a bool scalar on t's device) without its full-size temporaries: ATen's
    isfinite is `(t == t) * (t.abs() != inf)` on every device, a copy of t and three bool tensors of its size,
    where the smallest and largest element (NaN propagates through both) are one reduction that writes two
    scalars. A float tensor of any strides; an empty one is finite."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def _local_of(v: Tensor, p: Tensor, form: tuple, key: str, where: str) -> Tensor:
    """This rank's piece of sharded state `v` of DTensor param `p`, whose `form` is (global shape, placements)
    on p's mesh: `v` a DTensor (redistributed), or a plain tensor of the global shape (cut), or a plain local
    piece (as it is; its shape is checked by the caller)."""
    from torch.distributed.tensor import distribute_tensor
    shape, placements = form
    if is_dtensor(v):
        if tuple(v.shape) != tuple(shape):
            raise ValueError(f"{where}[{key!r}] has shape {tuple(v.shape)}, expected {tuple(shape)}")
        if v.device_mesh != p.device_mesh:
            raise ValueError(f"{where}[{key!r}] is a DTensor on another device mesh than its param")
        if tuple(v.placements) != tuple(placements):
            v = v.redistribute(p.device_mesh, placements)
        return v.to_local()
    if tuple(v.shape) == tuple(shape):
        return distribute_tensor(v.to(local(p).device), p.device_mesh, placements, src_data_rank=None).to_local()
    return v


def import_state(st, p: Tensor, spec: dict, quantized: dict, forms: dict, where: str, device,
                 cast_keys: frozenset = frozenset(), cast_note: str = "") -> tuple[dict, str | None]:
    """The state to install for param `p` from saved state `st`, as (state, problem with its values or None).

    Structural mismatches (keys, shapes, dtypes) raise ValueError at once: every rank sees the same ones.
    Non-finite values, and 8-bit codes that DCP cast to floating point (`cast_keys`: the 8-bit states that the
    loading optimizer itself keeps in 32 bits under the same key; `cast_note` says how the settings differ),
    may sit in one rank's piece only, so they are returned for the caller to agree on across ranks before
    raising."""
    if not isinstance(st, dict):
        raise ValueError(f"{where} is a {type(st).__name__}, expected a dict of tensors")
    # Cast codes can only be floats that came under the codes' key, without their absmax: not the dequantized
    # form (nested under the key), which a 32-bit template never asks for, nor codes dequantized here with theirs.
    cast_keys = frozenset(k for k in cast_keys if isinstance(st.get(k), Tensor) and st[k].is_floating_point()
                          and quantized[k][0] not in st)
    st = _dequantized_forms(st, p, spec, quantized, forms, where)
    akeys = {akey: key for key, (akey, _s, _b) in quantized.items() if akey in spec}
    dequantized = {key for akey, key in akeys.items()
                   if akey not in st and isinstance(st.get(key), Tensor) and st[key].is_floating_point()}
    expected = (set(spec) | {"step"}) - {quantized[k][0] for k in dequantized}
    if set(st) != expected:
        missing, extra = sorted(expected - set(st)), sorted(set(st) - expected)
        raise ValueError(f"{where} has keys {sorted(st)}, expected {sorted(expected)} (missing {missing}, "
                         f"unexpected {extra}): not this optimizer's state, or other hyperparameters")
    out, problem = {}, None
    out["step"] = step = as_step(st["step"], where, device)
    for key, (shape, dtype) in spec.items():
        if key in akeys and akeys[key] in dequantized:
            continue  # rebuilt from the dequantized codes below
        v = st[key]
        if not isinstance(v, Tensor):
            hint = ("; an empty dict is what DCP's flatten_optimizer_state_dict=True makes of a state that the "
                    "optimizer holds and the checkpoint lacks") if isinstance(v, dict) and not v else ""
            raise ValueError(f"{where}[{key!r}] is a {type(v).__name__}, expected a tensor{hint}")
        elem = key in forms
        if is_dtensor(v) and not elem:
            raise ValueError(f"{where}[{key!r}] is a DTensor; this state is a plain tensor, the same on every rank")
        here = _local_of(v, p, forms[key], key, where) if elem else v
        if key in dequantized:
            akey, signed, block = quantized[key]
            absmax_shape, _ = spec[akey]
            if tuple(here.shape) != tuple(shape):
                raise ValueError(f"{where}[{key!r}] has shape {tuple(here.shape)} here, expected {tuple(shape)}")
            if not all_finite(here):
                problem = problem or f"{where}[{key!r}] holds non-finite values"
                continue
            if key in cast_keys and _cast_codes(here, signed, step):
                problem = problem or (
                    f"{where}[{key!r}] holds whole numbers from 0 to 255 and no {akey!r}: 8-bit codes cast to "
                    f"{here.dtype} without their absmax, what torch.distributed.checkpoint loads from a checkpoint "
                    f"of 8-bit state into the template of an optimizer that keeps this state in 32 bits "
                    f"({cast_note}); build the loading optimizer with the checkpoint's settings, so that its "
                    f"template (get_optimizer_state_dict) asks for the codes and {akey!r}")
                continue
            codes, absmax = requantize(here.to(device), block, signed)
            if tuple(absmax.shape) != tuple(absmax_shape):
                raise ValueError(f"{where}[{key!r}]: {absmax.numel()} blocks, expected {absmax_shape}")
            out[key] = as_dtensor(codes, p, forms[key]) if elem else codes
            out[akey] = absmax
            continue
        if tuple(here.shape) != tuple(shape):
            raise ValueError(f"{where}[{key!r}] has shape {tuple(here.shape)}"
                             f"{' here' if elem else ''}, expected {tuple(shape)}")
        if dtype == torch.uint8 and here.dtype != torch.uint8:
            raise ValueError(f"{where}[{key!r}] has dtype {here.dtype}, expected torch.uint8 (8-bit codes), or "
                             f"a float tensor without {quantized.get(key, ('its absmax',))[0]!r} (dequantized)")
        if dtype != torch.uint8 and not here.is_floating_point():
            raise ValueError(f"{where}[{key!r}] has dtype {here.dtype}, expected a floating-point tensor")
        # Float state takes the dtype the optimizer keeps for this param (fp32 saved for an fp64 param, or the
        # reverse), and row-major strides (transformers' and torch's states are zeros_like(grad), which keeps a
        # transposed or channels_last grad's): the kernels read it with the param's state dtype, as row-major.
        t = here.detach().to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        checked = here.detach().to(dtype) if t.is_meta else t  # on meta params: the saved values, cast
        if checked.is_floating_point() and not checked.is_meta and not all_finite(checked):
            cast = f" as {dtype}" if t.dtype != here.dtype else ""
            problem = problem or f"{where}[{key!r}] holds non-finite values{cast}"
        out[key] = as_dtensor(t, p, forms[key]) if elem else t
    return out, problem


def _cast_codes(v: Tensor, signed: bool, step: Tensor) -> bool:
    """Whether float values `v` under an 8-bit state's key without its absmax may be 8-bit codes cast to
    floating point rather than dequantized values: every one a whole number from 0 to 255. All zeros are
    codes only under the signed map after a step (its code 0 is its lowest value times the absmax, which the
    first step sets; the unsigned map's code 0 and a fresh state's zero codes are the value 0, so zeros load
    as what they are either way)."""
    if v.numel() == 0 or not bool(((v >= 0) & (v <= 255) & (v == v.round())).all()):
        return False
    return bool(v.any()) or (signed and bool(step > 0))


def _dequantized_forms(st: dict, p: Tensor, spec: dict, quantized: dict, forms: dict, where: str) -> dict:
    """`st` with every 8-bit state in the one form `import_state` reads for it: the codes with their absmax,
    or the dequantized values under the codes' key without the absmax (the form of older fastopt state_dicts
    and of libraries that keep fp32 state under that name, e.g. came-pytorch).

    Read here: the dequantized values nested under the codes' key (every optimizer with DTensor params, and any
    under `dequantized_8bit`), unnested, with the empty dict that DCP's flattened form puts under the absmax's
    key dropped; and, for an element-wise state of a DTensor param, the codes and absmax of the whole tensor
    that plain params save (single process, DDP): dequantized here, so that `import_state` cuts this rank's
    piece and requantizes it into its own blocks. Codes of a DTensor's
    local blocks are never in a state_dict (their blocks mean nothing under another layout)."""
    out = None
    for key, (akey, signed, block) in quantized.items():
        if akey not in spec:
            continue  # 32-bit state here
        nested = st.get(key)
        if isinstance(nested, dict):
            vals = nested.get(DEQUANTIZED)
            if set(nested) != {DEQUANTIZED} or not isinstance(vals, Tensor):
                raise ValueError(f"{where}[{key!r}] is a dict with keys {sorted(nested, key=str)}, expected 8-bit "
                                 f"codes (a uint8 tensor, with {akey!r}) or their dequantized form "
                                 f"{{{DEQUANTIZED!r}: a float tensor}}")
            if akey in st and not (isinstance(st[akey], dict) and not st[akey]):
                raise ValueError(f"{where} holds both {key!r}.{DEQUANTIZED} (dequantized) and {akey!r} (the 8-bit "
                                 "codes' absmax): one form per state (a state_dict saved with 8-bit codes, loaded "
                                 "through a template of the dequantized form: save it within fastopt.checkpoint."
                                 "dequantized_8bit(opt) too)")
            out = dict(st) if out is None else out
            out[key] = vals
            out.pop(akey, None)
            continue
        codes, absmax = st.get(key), st.get(akey)
        if not (key in forms and isinstance(codes, Tensor) and isinstance(absmax, Tensor)
                and codes.dtype == torch.uint8):
            continue
        whole = tuple(forms[key][0])
        if is_dtensor(codes) or is_dtensor(absmax) or tuple(codes.shape) != whole or \
                absmax.numel() != q.num_blocks(codes.numel(), block):
            raise ValueError(f"{where}[{key!r}] holds 8-bit codes of shape {tuple(codes.shape)} with "
                             f"{absmax.numel()} blocks in {akey!r}; for a DTensor param this state (of shape "
                             f"{whole}) is in the state_dict in its dequantized form {key!r}.{DEQUANTIZED} (save "
                             "under fastopt.checkpoint.dequantized_8bit), or as the codes of the whole tensor that "
                             "plain params save")
        out = dict(st) if out is None else out
        vals = ops.dequantize_blockwise(codes.to(local(p).device).contiguous(), absmax.to(local(p).device),
                                        block, signed, torch.float32)
        out[key] = vals.view(whole)
        del out[akey]
    return st if out is None else out


def agreement_groups(params: list, layouts: list) -> list:
    """The process groups over which the ranks that share `params` agree on a verdict (`agree`): every dim
    group of each DTensor param's mesh and every group of each declared layout (`layouts[i]`, None for plain
    or DTensor params), one object per communicator, in an order that every rank derives alone: rank gap
    (large first: the outer mesh dims before the inner ones, as the mesh's dims come), then ranks, then name.
    Groups of one rank are left out; ranks that share none of these params are never among them. Each comes
    as (group, the indices of the params that span it, in order)."""
    found = {}

    def add(g, i):
        if not isinstance(g, dist.ProcessGroup):
            return
        ranks = tuple(sorted(dist.get_process_group_ranks(g)))
        if len(ranks) > 1:
            members = found.setdefault((-(ranks[1] - ranks[0]), ranks, dist._get_process_group_name(g)), (g, []))[1]
            if not members or members[-1] != i:
                members.append(i)

    for i, (p, lay) in enumerate(zip(params, layouts)):
        if is_dtensor(p):
            mesh = p.device_mesh
            if mesh.get_coordinate() is None:  # a mesh without this rank: it holds nothing of p
                continue
            for d in range(mesh.ndim):
                add(mesh.get_group(d), i)
        elif lay is not None:
            for g in lay.groups:
                add(g, i)
    return [found[k] for k in sorted(found)]


def agree_states(groups: list, marks: list, failed: bool, describe: Callable[[int, Any, Any, int], str]) -> str | None:
    """What is wrong when the ranks that share a param would load different states for it (`marks[i]`: None
    for no state, else its step), or None. One sweep of all_gather_object over `agreement_groups`' groups in
    their common order, on every rank of them whatever it found before (`failed`: this rank refuses already,
    and its marks may be incomplete: no rank of its groups compares them). `describe(i, mine, theirs, rank)`
    words a difference in param i. A rank that restarts a param's state while the others go on, or goes on
    from another step, would step its piece apart from theirs, silently: a checkpoint whose ranks' files come
    from different steps, or a state_dict edited on one rank."""
    if not (groups and dist.is_available() and dist.is_initialized()):
        return None
    found_problem = None
    for g, members in groups:
        mine = [marks[i] for i in members]
        got = [None] * dist.get_world_size(g)
        dist.all_gather_object(got, (failed, mine), group=g)
        if found_problem is not None or any(f for f, _m in got):
            continue
        ranks = dist.get_process_group_ranks(g)
        for r, (_f, theirs) in zip(ranks, got):
            if len(theirs) != len(mine):  # other params span this group there: nothing to compare them with
                continue
            k = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
            if k is not None:
                found_problem = describe(members[k], mine[k], theirs[k], r)
                break
    return found_problem


def agree(problem: str | None, groups: list) -> None:
    """Raise ValueError(problem) on every rank of `groups` (`agreement_groups`) when any of them has one.

    Two sweeps of all_gather_object over the groups in their common order: the first passes a verdict along a
    mesh's dims (or any orthogonal groups) to every rank of the mesh, the second across meshes and declared
    groups that share ranks. Only ranks that hold these params take part; none when `groups` is empty."""
    if groups and dist.is_available() and dist.is_initialized():
        me = dist.get_rank()
        known = None if problem is None else (problem, me)
        for _sweep in range(2):
            for g, _members in groups:
                found = [None] * dist.get_world_size(g)
                dist.all_gather_object(found, known, group=g)
                known = known or next((f for f in found if f is not None), None)
        if known is not None:
            f, r = known
            raise ValueError(f + (f" (on rank {r})" if r != me else ""))
        return
    if problem is not None:
        raise ValueError(problem)
