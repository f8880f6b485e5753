"""fastopt.AdamW8bit: torch's AdamW with bitsandbytes' 8-bit block-wise states (math: reference/adamw8bit.py)."""
from __future__ import annotations

import math

import torch

from .. import ops
from ..distributed.layout import local, real_elements
from .base import BLOCK_SIZE, MIN_8BIT_SIZE, NONNEG, FastOptimizer, betas_rule, host_value, lr_rule


class AdamW8bit(FastOptimizer):
    """AdamW (decoupled weight decay, torch.optim.AdamW's update) whose two moments are stored in 8 bits.

    Tensors with at least `min_8bit_size` elements keep m and v as uint8 codes of bitsandbytes' dynamic maps
    (signed for m, unsigned for v) with one fp32 absmax per block of `block_size` elements: 2 bytes per
    element plus 8 bytes per block (2.03 bytes per element at the default block of 256). Smaller tensors keep
    full-precision state (fp32; fp64 for fp64 params). The fused step dequantizes, updates and requantizes in
    one pass per element, one launch for all 8-bit params of a device and dtype (compiled extension, CPU and
    CUDA; `FASTOPT_BACKEND=torch` runs the plain-torch reference instead).

    Args:
        params: iterable of params or param-group dicts.
        lr: learning rate.
        betas: (beta1, beta2), decay rates of the first and second moments.
        eps: added to sqrt(v) / sqrt(1 - beta2^t).
        weight_decay: decoupled decay, p <- p (1 - lr weight_decay).
        block_size: elements per quantization block, a power of two from 64 to 4096.
        min_8bit_size: tensors with fewer elements keep full-precision state (a group key: bitsandbytes'
            `GlobalOptimManager` overrides are not read; to keep a param's state in 32 bits, e.g. an embedding's,
            give it a group of its own with a `min_8bit_size` above its size).
        amsgrad, optim_bits, args, is_paged: bitsandbytes' `AdamW8bit` arguments, keyword-only here, accepted at
            its defaults (False, 32, None, False) so that its calls run unchanged; any other value is refused.

    State per param (tensors only; loads with `torch.load(weights_only=True)`), with bitsandbytes' key names:
    `step` (fp32 scalar on the param's device); 8-bit: `state1`, `state2` (uint8, the param's shape),
    `absmax1`, `absmax2` (fp32, ceil(numel / block_size)); full precision: `state1` (m), `state2` (v).
    bitsandbytes also stores `qmap1`/`qmap2`; here the maps are fixed (fastopt.reference.quant.dynamic_map),
    and `load_state_dict` takes a bitsandbytes state_dict as it is (the maps checked to be these, then dropped;
    `step` made a tensor); the other way, `to_bitsandbytes(opt.state_dict())` adds the maps bitsandbytes' step
    reads (with block_size=256, bitsandbytes' only one). Works with `torch.amp.GradScaler` without host sync: a
    step with a non-finite gradient changes nothing.
    """

    _name = "AdamW8bit"
    # Element-wise: a sharded param steps on its local piece with no collective, its 8-bit blocks cut from
    # the local piece (so they differ from a single process's blocks by the quantization error alone).
    _supports_layouts = True
    _triton_seam = False
    _extension_seam = True
    _elementwise_state = ("state1", "state2")
    _layout_keys = ("block_size", "min_8bit_size")
    _hyper_rules = dict(lr=lr_rule(">= 0"), betas=betas_rule(2), eps=NONNEG, weight_decay=NONNEG, block_size=BLOCK_SIZE,
                        min_8bit_size=MIN_8BIT_SIZE)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, block_size=256,
                 min_8bit_size=4096, *, amsgrad=False, optim_bits=32, args=None, is_paged=False):
        bnb_defaults_only(self._name, amsgrad=amsgrad, optim_bits=optim_bits, args=args, is_paged=is_paged)
        defaults = self._check_hyper(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                          block_size=block_size, min_8bit_size=min_8bit_size))
        super().__init__(params, defaults)

    def _whole_statistics(self, p):
        return False

    # ---- state and step ---------------------------------------------------------------------------------
    def _state_spec(self, p, group):
        shape = tuple(local(p).shape)
        if math.prod(self._global_shape(p)) >= group["min_8bit_size"]:
            blocks = (math.ceil(math.prod(shape) / group["block_size"]),)
            return {"state1": (shape, torch.uint8), "state2": (shape, torch.uint8),
                    "absmax1": (blocks, torch.float32), "absmax2": (blocks, torch.float32)}
        dt = self.state_dtype(p)
        return {"state1": (shape, dt), "state2": (shape, dt)}

    def _step_group(self, group, params, grads, states, scaler, layouts=None, sharded=False):
        bs = group["block_size"]
        cache = self._plan_cache(group, params, layouts)  # the bucket's: before its params are cut down
        params, grads, states = real_elements(params, grads, states, layouts, self._elementwise_state,
                                              {"absmax1": bs, "absmax2": bs})
        ops.adamw8bit_step(params, grads, states, lr=host_value(group["lr"]), betas=group["betas"], eps=group["eps"],
                           weight_decay=group["weight_decay"], block_size=group["block_size"],
                           inv_scale=scaler.inv_scale, found_inf=scaler.found_inf,
                           cache=cache)

    def _quantized_keys(self, group):
        bs = group["block_size"]
        return {"state1": ("absmax1", True, bs), "state2": ("absmax2", False, bs)}

    def _from_foreign(self, state_dict):
        """load_state_dict also takes bitsandbytes' `AdamW8bit` state_dicts (same codes, same maps, same blocks of 256):
        its per-param `__bnb_optimizer_quant_state__` entry is unpacked, `qmap1`/`qmap2` are checked against
        fastopt's fixed maps and dropped, its int `step` becomes a tensor, and its groups (lr, betas, eps,
        weight_decay; alpha, t_alpha, t_beta3 of its AdEMAMix variant are ignored) get this optimizer's
        `block_size` and `min_8bit_size`. `state1`/`state2` and `absmax1`/`absmax2` keep their names."""
        parts = self._foreign_parts(
            state_dict, lambda g: "block_size" not in g and {"lr", "betas", "eps", "weight_decay"} <= set(g))
        if parts is not None:
            state, groups = parts
            state_dict = {"state": {pid: _from_bnb(pid, st) for pid, st in state.items()},
                          "param_groups": [{**{k: v for k, v in g.items() if k not in _BNB_ONLY},
                                            "block_size": ours["block_size"], "min_8bit_size": ours["min_8bit_size"]}
                                           for g, ours in zip(groups, self.param_groups)]}
        return state_dict


# bitsandbytes' 8-bit optimizer arguments that fastopt takes at their defaults only: name -> (default, why).
_BNB_ARGS = {
    "amsgrad": (False, "AMSGrad is not implemented"),
    "optim_bits": (32, "as in bitsandbytes, only its default is accepted (the moments of tensors with at least "
                   "min_8bit_size elements are 8-bit)"),
    "args": (None, "pass the settings as arguments"),
    "percentile_clipping": (100, "gradient clipping by percentile is not implemented"),
    "block_wise": (True, "the states are always quantized block-wise"),
    "is_paged": (False, "paged (unified-memory) states are not implemented"),
}


def bnb_defaults_only(owner: str, **given) -> None:
    """Refuse, naming it, any of bitsandbytes' arguments (`_BNB_ARGS`) given another value than its default:
    bitsandbytes' calls (AdamW8bit's, galore-torch's GaLoreAdamW8bit's) then run unchanged."""
    for name, value in given.items():
        default, why = _BNB_ARGS[name]
        if (value is not None) if default is None else (value != default):
            raise ValueError(f"{owner}: {name}={value!r} is not supported ({why}); bitsandbytes' default "
                             f"{default!r} is accepted")


# Group keys of bitsandbytes' 8-bit Adam family that fastopt's AdamW8bit does not have.
_BNB_ONLY = ("alpha", "t_alpha", "t_beta3", "amsgrad", "optim_bits", "percentile_clipping", "block_wise",
             "max_unorm", "skip_zeros", "is_paged")


def _from_bnb(pid, st: dict) -> dict:
    """One param's state in bitsandbytes' layout -> fastopt's (see AdamW8bit.load_state_dict)."""
    from ..reference.quant import dynamic_map
    if not isinstance(st, dict):
        return st
    st = dict(st)
    st.update(st.pop("__bnb_optimizer_quant_state__", {}))
    for key, signed in (("qmap1", True), ("qmap2", False)):
        qmap = st.pop(key, None)
        if qmap is not None and not torch.equal(qmap.to("cpu", torch.float32), dynamic_map(signed, "cpu")):
            raise ValueError(f"AdamW8bit.load_state_dict: state[{pid!r}][{key!r}] is not bitsandbytes' dynamic "
                             f"{'signed' if signed else 'unsigned'} map, the only one fastopt uses")
    if not isinstance(st.get("step"), torch.Tensor) and "step" in st:
        st["step"] = torch.tensor(float(st["step"]))
    return st


_BNB_BLOCK_SIZE = 256  # bitsandbytes' 8-bit optimizers quantize their states in blocks of 256, not a setting there


def to_bitsandbytes(state_dict: dict) -> dict:
    """A fastopt `AdamW8bit` state_dict that bitsandbytes' `AdamW8bit` loads and steps on.

    bitsandbytes' step reads each 8-bit state's maps (`qmap1`, signed; `qmap2`, unsigned) from the state itself,
    which fastopt's state_dict does not hold (its maps are fixed): loaded as it is, bitsandbytes' first step
    stops with `KeyError: 'qmap1'`. This adds them to every 8-bit state (full-precision states need none) and
    leaves `state_dict` as it was (the state tensors are shared, not copied). Groups quantized in other blocks
    than bitsandbytes' 256 are refused, naming the group: bitsandbytes would misread their absmax.
    """
    from ..reference.quant import dynamic_map
    for i, g in enumerate(state_dict["param_groups"]):
        if g.get("block_size", _BNB_BLOCK_SIZE) != _BNB_BLOCK_SIZE:
            raise ValueError(f"to_bitsandbytes: param_groups[{i}] has block_size={g['block_size']}; bitsandbytes' "
                             f"AdamW8bit reads 8-bit states in blocks of {_BNB_BLOCK_SIZE} only")
    state = {}
    for pid, st in state_dict["state"].items():
        st = dict(st)
        if isinstance(st.get("state1"), torch.Tensor) and st["state1"].dtype == torch.uint8:
            dev = st["state1"].device  # copies of the cached maps: the state_dict's owner may write its tensors
            st["qmap1"], st["qmap2"] = dynamic_map(True, dev).clone(), dynamic_map(False, dev).clone()
        state[pid] = st
    return {**state_dict, "state": state}
