"""A faster Triton interpreter for the test suite: nested @triton.jit calls skip a redundant re-patch.

Under TRITON_INTERPRET=1 a kernel launch (`GridExecutor.__call__`) patches triton.language's builtins with
their interpreted versions for the whole grid (`_patch_lang`) and restores them at the end. Triton 3.6-3.9
also calls `_patch_lang` again at every call of a nested @triton.jit helper (`InterpretedFunction.__call__`),
in every program of the grid: an `inspect.getmembers` sweep over triton.language, its tensor class and its
math module each time, whose builtins are already patched (the sweep wraps only members still marked as
builtins, so it changes nothing). In the multi-process kernel tests that sweep took 40% of the time (cProfile
of test_layouts' came8 placements case: 51005 sweeps, 13.0 s of 31 s).

`install()` makes a nested call skip `_patch_lang` when a launch is running whose own patch already covers
the language modules the helper sees (the same module objects: they are patched in place), and otherwise
leaves the call as Triton has it. The helper then runs exactly as before; the kernels compute the same thing.
And it keeps the patch for the rest of the process: `_patch_lang` patches a language module the first time a
kernel or helper sees it, and a launch's end restores nothing, so the next launch sweeps nothing either
(Triton itself never restores what a nested call patched). The wrappers are the same at every launch (the
interpreter's one builder and semantic), and nothing in an interpreting process uses triton.language outside
a launch. Two sweeps per launch were left.

It also memoizes four functions of types that interpreted operations call again and again (`_memoize`): the
NumPy dtype of a Triton type (a 20-entry dict built at each call), and the block types the builder and
`block_type.with_element_ty` construct (each a new object whose constructor validates and formats its shape),
keyed by the identity of the scalar type and the shape, for scalar types of the plain `tl.dtype` class only
(pointer and block types are not hashable); and `tl.tensor`'s constructor, whose shape (a tuple of constexprs),
numel and dtype depend on the type alone: computed once per type object and kept on it. Nothing mutates a type
after construction, and Triton compares block types by value, never by `is`. Six steps of one process's CAME 8-bit
and Adafactor with bf16 stochastic rounding (tests/test_sr_layouts.py's shapes) under the interpreter, the first
three memos on and off: 17-23% faster, the same bits; the constructor's on top of them, with CAME, CAME 8-bit,
Adafactor and Lamb: 10-16% faster (CPU seconds, process_time), the same bits.

Three methods of the interpreter's semantic object get fast paths (`_semantic`): the broadcast of two operands
of one type, the computation type of two scalar types, and a cast to the type a value has.

Steps of CAME 8-bit, Adafactor, Lamb and GaLore 8-bit on tests/test_conventions.py's shapes (CPU time per step,
the best of 6 blocks of 5 steps, the best of 3 runs each way, interleaved): the kept patch and these fast paths
together against the memos alone took CAME 8-bit from 0.104 to 0.080 s, Adafactor 0.070 to 0.055 s, Lamb 0.043 to
0.037 s, GaLore 8-bit 0.074 to 0.072 s (its matmuls are NumPy's), the same bits.

Then the operations with a Python number or a scalar (`x * 0.5`, `ptr + offs`), where the broadcast's fast path
missed (operands of different types): cProfile of one process's Adafactor bf16 and CAME 8-bit steps showed the
builtin wrapper chain, `binary_op_type_checking_impl` and `broadcast_impl_value` on top. More fast paths, each
making Triton's own calls in Triton's order for the cases it is written for and calling Triton's for the rest:
- the broadcast splats a plain or pointer scalar against a block with the builder's own splat (the block type
  from the memo, kept on the block type asked; `to_ir` skipped: the splat reads only the shape), returns blocks
  of one shape (a pointer block and its offsets, its mask) and two scalars as they are, as Triton's does;
- `binary_op_type_checking_impl` (`_ops`) for tensors of plain scalar types and Python int/float/bool operands:
  no pointer checks (no pointer there), no `numbers.Number` ABC checks; a pointer and an integer offset straight
  to the broadcast (Triton's checks pass, no arithmetic on pointers). The numbers still go through Triton's
  `to_tensor_type` and `_cast_to_computation_type` (promotion, range errors, constant), so they stay exact;
- `binary_op_sanitize_overflow_impl`: without the debug option its int64 recomputation only feeds a
  `device_assert` that returns at once; skipped for two operands of one plain integer type and this semantic's
  own add/sub/mul (NumPy array arithmetic, which raises nothing there);
- the interpreter's builtin wrappers (`_patch_attr`): the function called with the same arguments, without the
  lambda's dict copy and the `builtin` wrapper's check; Triton's lambda under `triton_as_it_is()`;
- `_unwrap_if_constexpr`: exact tensor/int/float/bool/str/None types as they are, a plain constexpr's value.
tests/test_interp_speed.py runs blocks of every float and integer width with Python numbers and scalars on either
side (fp64-only constants, NaN, inf, -0.0, int32 wrap-around, uint8, bool, pointers) and the refused operands
(out-of-range and negative constants, float offsets) with and without them: the same bits, the same errors. Same
benchmark on (1,), (5, 6), (2, 3, 4, 5) and (12,) params (CPU s/step, best of 5 blocks of 3 steps, best of 3
interleaved runs; a shared 2-core machine): Adafactor bf16 with stochastic rounding 0.205 to 0.133, Adafactor
fp32 0.132 to 0.095, CAME 0.196 to 0.136, CAME 8-bit 0.183 to 0.134, Lamb 0.031 to 0.021, GaLore 8-bit 0.095 to
0.074; params and states bit-identical after 6 steps (and to `triton_as_it_is()`). tests/test_sr_layouts.py -k
came8-triton on that machine under a load of 5 to 13: pytest's time 85-153 s before, 57-106 s after; CPU time
(user, the gloo ranks included) 104 s before, 86 s after. A memo of `_validate_np_data_size` per scalar type
did not help (its dict lookup costs what the check does).

Then the casts between bf16 and fp32 (`_convert`): the interpreter converts each with `_convert_float`'s general
bit surgery (about 1 ms a call whatever the size: 1232 calls, 1.3 s of 27.6 s in one cProfile of Adafactor bf16 SR
and CAME 8-bit steps); for arrays without nonzero subnormals that is a 16-bit shift (see `_convert`), and Triton's
code does the rest. tests/test_interp_speed.py compares the two on every bf16 value and every fp32 upper half with
eight kinds of lower half (subnormals, views), and a kernel's casts between fp32, bf16, fp16, fp64 and every
integer width (masked loads with `other`, masked stores, where/maximum/minimum, sum/max) both ways. Same benchmark
as above (the best of 3 interleaved runs each way): Adafactor bf16 with stochastic rounding 0.136 to 0.120 s/step;
the others, which cast no bf16, within the machine's noise (Adafactor fp32 0.096 / 0.094, CAME 0.139 / 0.132,
CAME 8-bit 0.137 / 0.140, Lamb 0.024 / 0.024, GaLore 8-bit 0.083 / 0.087); params and states bit-identical after 6
steps, to `triton_as_it_is()` and to the run before. The rest of that profile is flat (`semantic.load` 1.9 s with
the builder's load 1.0 s of it, `create_addptr` 0.55, `create_splat` 0.69, `TensorHandle` validation 0.53,
`scalar_constant` 0.70 of 14 s): a fast path for any one of them would save at most a few percent, below what this
machine's noise lets one measure, so none was added.

The gloo processes of tests/dist_utils.py install it too (they ran Triton's interpreter as it is before).

It does nothing where Triton's interpreter lacks the pieces it relies on (another Triton version), and
nothing unless TRITON_INTERPRET is set; under Triton 3.6-3.8, whose binary operations have another shape, it
installs all but their fast paths (`_ops`, written for 3.9). `installed()` and `ops_installed()` say what took effect;
tests/test_interp_speed.py checks that it did and that kernels give the same bits with and without it.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re

_state = {"installed": False, "ops": False}


def installed() -> bool:
    return _state["installed"]


def ops_installed() -> bool:
    """Whether the binary operations' fast paths (`_ops`) took effect too (not under Triton 3.6-3.8, whose
    binary operations have another shape: there they are Triton's own, and the rest is installed)."""
    return _state["installed"] and _state["ops"]


def install() -> bool:
    if _state["installed"]:
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    grid_call = getattr(getattr(it, "GridExecutor", None), "__call__", None)
    nested_call = getattr(getattr(it, "InterpretedFunction", None), "__call__", None)
    if grid_call is None or nested_call is None or not hasattr(it, "_patch_lang"):
        return False
    try:
        grid_src, nested_src = inspect.getsource(grid_call), inspect.getsource(nested_call)
    except (OSError, TypeError):
        return False
    # The shapes this relies on: the launch patches for its whole run; the nested call patches, then runs the
    # rewritten function, raising InterpreterError on an exception.
    if ("_patch_lang(self.fn)" not in grid_src or "restore()" not in grid_src
            or "_patch_lang(self.fn)" not in nested_src or "self.rewrite()" not in nested_src):
        return False

    langs = (tl, tl.core)
    covered: list[frozenset] = []  # per running launch: ids of the language modules its patch covers

    memo: dict = {}

    def seen(fn) -> frozenset:
        key = id(fn.__globals__)  # a module's globals: the modules they name do not change
        if key not in memo:
            memo[key] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs)
        return memo[key]

    def launch(self, *args, **kwargs):
        covered.append(seen(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            covered.pop()

    def nested(self, *args, **kwargs):
        if not covered:
            return nested_call(self, *args, **kwargs)
        if not seen(self.fn) <= covered[-1]:
            # Triton's own call patches what it sees (tl.core, for triton.language's own helpers such as tl.sum),
            # and nothing undoes that before this launch ends: later calls of the launch need not patch it again.
            covered[-1] |= seen(self.fn)
            return nested_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise it.InterpreterError(repr(e)) from e

    patch_lang = it._patch_lang
    patched: set = set()  # ids of the language modules patched for the rest of the process

    class Kept:
        def restore(self):  # what a launch calls at its end: the patch stays
            pass

    kept = Kept()

    def patch_once(fn):
        """Triton's `_patch_lang` the first time a function sees a language module, kept for good: later launches
        would patch it with the same wrappers and restore it again."""
        need = seen(fn)
        if not need <= patched:
            patch_lang(fn)  # the scope it returns is dropped: nothing restores this patch
            patched.update(need)
        return kept

    memoized, semantic = _memoize(it, tl), _semantic(it, tl)
    ops = _ops(it, tl, it.interpreter_semantic) if semantic is not None else None
    convert = _convert(it, tl)
    if memoized is None or semantic is None or convert is None:
        return False
    _state["ops"] = ops is not None
    if ops is None:  # binary operations of another shape (Triton 3.6-3.8): Triton's own, the rest installed
        sem = it.interpreter_semantic
        own = (type(sem).binary_op_type_checking_impl.__get__(sem), it._patch_attr, tl.core._unwrap_if_constexpr,
               type(sem).binary_op_sanitize_overflow_impl.__get__(sem))
        ops = (own, own)
    ours, theirs = memoized
    sem_ours, sem_theirs = semantic
    ops_ours, ops_theirs = ops
    _state["calls"] = {"patched": (launch, nested, patch_once, *ours, *sem_ours, *ops_ours, convert[0]),
                       "triton": (grid_call, nested_call, patch_lang, *theirs, *sem_theirs, *ops_theirs, convert[1])}
    _use("patched")
    _state["installed"] = True
    return True


def _memoize(it, tl):
    """((memoized np dtype, builder block type, with_element_ty), (Triton's three)), or None where they do not
    have the shapes relied on."""
    np_dtype = getattr(it, "_get_np_dtype", None)
    block_ty = getattr(getattr(it, "InterpreterBuilder", None), "get_block_ty", None)
    with_elt = getattr(tl.block_type, "with_element_ty", None)
    tensor_init = tl.tensor.__init__
    try:
        srcs = [inspect.getsource(f) for f in (np_dtype, block_ty, with_elt, tensor_init)]
    except (OSError, TypeError):
        return None
    if ("np_types" not in srcs[0] or "return tl.block_type(dtype, shape)" not in srcs[1]
            or "return block_type(scalar_ty, self.shape)" not in srcs[2]
            or set(re.findall(r"self\.(\w+) =", srcs[3])) != {"handle", "shape", "numel", "type", "dtype"}):
        return None
    plain = tl.dtype
    dtypes: dict = {}
    blocks: dict = {}  # (id(scalar type), shape) -> (block type, the scalar type: kept alive, its id not reused)

    def np_dtype_memo(t):
        if type(t) is tl.block_type:  # its element type's (block types are not hashable)
            t = t.element_ty
        if type(t) is not plain:
            return np_dtype(t)
        try:
            return dtypes[t]
        except KeyError:
            r = dtypes[t] = np_dtype(t)
            return r

    def block(make, args, scalar, shape):
        """make(*args): a block type of `scalar` and `shape`, built once per pair."""
        if type(scalar) is not plain or not all(type(n) is int for n in shape):
            return make(*args)
        key = (id(scalar), tuple(shape))
        hit = blocks.get(key)
        if hit is None:
            hit = blocks[key] = (make(*args), scalar)
        return hit[0]

    def get_block_ty(self, dtype, shape):
        return block(block_ty, (self, dtype, shape), dtype, shape)

    def with_element_ty(self, scalar_ty):
        """The memo's block type, also kept on the block type it is asked of, per plain scalar type object."""
        if type(scalar_ty) is not plain:
            return block(with_elt, (self, scalar_ty), scalar_ty, self.shape)
        kept = self.__dict__.get("_fastopt_with")
        if kept is None:
            kept = self._fastopt_with = {}
        hit = kept.get(id(scalar_ty))
        if hit is None:
            hit = (block(with_elt, (self, scalar_ty), scalar_ty, self.shape), scalar_ty)
            if all(type(n) is int for n in self.shape):  # what the memo keeps (else a new type each call)
                kept[id(scalar_ty)] = hit
        return hit[0]

    kinds = (plain, tl.block_type, tl.pointer_type)

    def tensor(self, handle, type):
        """tl.tensor's constructor, its shape, numel and dtype (functions of `type` alone, which no one mutates)
        computed once per type object and kept on it."""
        info = type.__dict__.get("_fastopt_tensor") if type.__class__ in kinds else False
        if not info:
            tensor_init(self, handle, type)
            if info is None:
                type._fastopt_tensor = (self.shape, self.numel, self.dtype)
            return
        self.handle, self.type = handle, type
        self.shape, self.numel, self.dtype = info

    return (np_dtype_memo, get_block_ty, with_element_ty, tensor), (np_dtype, block_ty, with_elt, tensor_init)


def _semantic(it, tl):
    """((the interpreter's semantic's broadcast with its fast path, its memoized computation type), (Triton's two,
    bound)), or None where they do not have the shapes relied on.

    Every binary operation of an interpreted kernel goes through `binary_op_type_checking_impl`: the computation
    type of its operands' scalar types (a pure function of them and of the flags: a chain of type tests), a cast
    of each operand to it, then `broadcast_impl_value`, which compares the operands' block shapes dim by dim even
    when they are equal. With the block types memoized (`_memoize`), two blocks of one scalar type and shape have
    the very same type object: for those, and for two scalars of one type, the broadcast returns both operands as
    they are, as Triton's own does after its comparisons. The computation type is memoized for scalar types of
    the plain `tl.dtype` class (what raises is not kept, and raises again). In one rank's cProfile of
    tests/test_sr_layouts.py's CAME 8-bit case, the two took 25 of the 67 s spent in kernel launches; after them,
    `cast` took 7.4 of 53 s, most of it in `dtype.__eq__` on the way to returning its input unchanged."""
    sem = getattr(it, "interpreter_semantic", None)
    broadcast = getattr(type(sem), "broadcast_impl_value", None)
    comp_type = getattr(type(sem), "computation_type_impl", None)
    cast = getattr(type(sem), "cast", None)
    try:
        srcs = [inspect.getsource(f) for f in (broadcast, comp_type, cast)]
    except (OSError, TypeError):
        return None
    if ("lhs_ty = lhs.type" not in srcs[0] or "# (scalar, scalar) => returns original blocks" not in srcs[0]
            or list(inspect.signature(comp_type).parameters) != ["self", "a_ty", "a_is_scalar", "b_ty",
                                                                  "b_is_scalar", "div_or_mod"]
            or "if src_sca_ty == dst_sca_ty:\n            return input" not in srcs[2]
            or list(inspect.signature(cast).parameters)[:3] != ["self", "input", "dst_ty"]):
        return None
    # the constructor the broadcast's splat calls: `make_tensor` (3.9), `tensor` (3.6-3.8)
    make = next((getattr(sem, m) for m in ("make_tensor", "tensor")
                 if f"self.{m}(self.builder.create_splat(" in srcs[0]), None)
    if make is None:
        return None
    plain = tl.dtype
    block_type = tl.block_type
    types: dict = {}

    def cast_fast(input, dst_ty, *args, **kwargs):
        """Triton's cast returns its input when the scalar types are equal (by name, for the plain class) before
        anything else: that test without the properties and the constexpr unwrapping of `dtype.__eq__`."""
        src = input.type
        if type(src) is block_type:
            src = src.element_ty
        if type(dst_ty) is plain and type(src) is plain and (src is dst_ty or src.name == dst_ty.name):
            return input
        return cast(sem, input, dst_ty, *args, **kwargs)

    builder = sem.builder
    shape_tuple = tl.core.tuple  # a block type's shape: its `values`, a list of ints (block_type's constructor)
    scalars = (plain, tl.pointer_type)  # not blocks (`is_block()` False), their own `scalar`

    def splat(block_ty, value):
        """Triton's make_shape_compatible(block, scalar) for a scalar of a plain or pointer type (its own `scalar`):
        its block type (memoized by `with_element_ty` for plain types) and the builder's own splat, which reads only
        that type's shape (`to_ir` skipped)."""
        ty = block_ty.with_element_ty(value.type)
        return make(builder.create_splat(ty, value.handle), ty)

    def broadcast_fast(lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        if lhs_ty is rhs_ty:
            return lhs, rhs
        lt, rt = type(lhs_ty), type(rhs_ty)
        if lt is block_type:
            if rt in scalars:
                return lhs, splat(lhs_ty, rhs)
            if (rt is block_type and type(lhs_ty.shape) is shape_tuple and type(rhs_ty.shape) is shape_tuple
                    and lhs_ty.shape.values == rhs_ty.shape.values):
                return lhs, rhs  # blocks of one shape, another scalar type (a pointer block and its offsets or mask)
        elif lt in scalars:
            if rt is block_type:
                return splat(rhs_ty, lhs), rhs
            if rt in scalars:
                return lhs, rhs  # two scalars (a pointer and its offset): Triton's returns them as they are
        return broadcast(sem, lhs, rhs)

    def computation_type(a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod):
        if type(a_ty) is not plain or type(b_ty) is not plain:
            return comp_type(sem, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
        key = (a_ty, bool(a_is_scalar), b_ty, bool(b_is_scalar), bool(div_or_mod))
        hit = types.get(key)
        if hit is None:
            hit = types[key] = comp_type(sem, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
        return hit

    return (broadcast_fast, computation_type, cast_fast), (broadcast.__get__(sem), comp_type.__get__(sem),
                                                           cast.__get__(sem))


def _ops(it, tl, sem):
    """((binary operands' type checking, the language's builtin wrapper, constexpr unwrapping, the overflow check:
    faster), (Triton's four)), or None where they do not have the shapes relied on (`sanitize_fast` says more).

    - `binary_op_type_checking_impl` (every binary operation): for two tensors of plain scalar types (or blocks of
      them), or one of those and a Python int, float or bool, with the arithmetic check on, it makes Triton's own
      calls in Triton's order (the computation type of the two scalar types, the cast of each operand to it, the
      Python number through Triton's own `_cast_to_computation_type`, which range-checks it and builds its
      constant, then the broadcast) and skips what cannot apply to them: the pointer checks (a plain type is no
      pointer) and the `numbers.Number` tests (an ABC check each). Anything else (pointers, constexprs, NumPy
      scalars, subclasses) goes to Triton's.
    - `_patch_attr`: the interpreter wraps each language builtin in a lambda that copies its keyword arguments
      into a new dict (dropping a caller's `_semantic`: builtins such as `tensor.__add__` pass theirs to `add`)
      and calls the builtin's wrapper, which checks `_semantic` and calls the function. The kept wrapper passes
      the function the same arguments itself (the caller's `_semantic` replaced by the interpreter's, last), and
      calls Triton's lambda where a `member` keyword is passed (that lambda's own parameter) or under
      `triton_as_it_is()` (the kept wrappers outlive the switch).
    - `_unwrap_if_constexpr`: a tensor, int, float, bool, str or None (exact types) is returned as it is and a
      plain constexpr gives its value, as Triton's isinstance chain does; anything else goes to Triton's."""
    binop = getattr(type(sem), "binary_op_type_checking_impl", None)
    patch_attr = getattr(it, "_patch_attr", None)
    unwrap = getattr(tl.core, "_unwrap_if_constexpr", None)
    sanitize = getattr(type(sem), "binary_op_sanitize_overflow_impl", None)
    device_assert = getattr(type(sem), "device_assert", None)
    try:
        srcs = [inspect.getsource(f) for f in (binop, patch_attr, unwrap, type(sem)._cast_to_computation_type,
                                               sanitize, device_assert)]
    except (OSError, TypeError, AttributeError):
        return None
    binop_lines = [line.strip() for line in srcs[0].splitlines()[3:]]
    if (binop_lines != [
            "lhs_is_scalar = isinstance(lhs, numbers.Number)",
            "rhs_is_scalar = isinstance(rhs, numbers.Number)",
            "# implicit typecasting",
            "lhs_sca_ty = self.to_tensor_type(lhs) if lhs_is_scalar else lhs.dtype",
            "rhs_sca_ty = self.to_tensor_type(rhs) if rhs_is_scalar else rhs.dtype",
            "self.check_ptr_type_impl(lhs_sca_ty, rhs_sca_ty, allow_lhs_ptr)",
            "self.check_ptr_type_impl(rhs_sca_ty, lhs_sca_ty, allow_rhs_ptr)",
            "if arithmetic_check and not lhs_sca_ty.is_ptr() and not rhs_sca_ty.is_ptr():",
            "ret_sca_ty = self.computation_type_impl(lhs_sca_ty, lhs_is_scalar, rhs_sca_ty, rhs_is_scalar, div_or_mod)",
            "lhs = self._cast_to_computation_type(lhs, ret_sca_ty)",
            "rhs = self._cast_to_computation_type(rhs, ret_sca_ty)",
            "else:",
            "lhs, rhs = self.to_tensor(lhs), self.to_tensor(rhs)",
            "", "# implicit broadcasting",
            "lhs, rhs = self.broadcast_impl_value(lhs, rhs)",
            "return lhs, rhs"]
            or list(inspect.signature(binop).parameters) != ["self", "lhs", "rhs", "allow_lhs_ptr", "allow_rhs_ptr",
                                                             "arithmetic_check", "div_or_mod"]
            or "if not isinstance(value, numbers.Number):\n            return self.cast(value, dtype)" not in srcs[3]
            or "member(*args, **" not in srcs[1]
            or 'if k != "_semantic"}, _semantic=interpreter_semantic))' not in srcs[1]
            or "scope.set_attr(obj, name, new_member)" not in srcs[1]
            or list(inspect.signature(patch_attr).parameters) != ["obj", "name", "member", "builder", "scope"]
            or "return o.value if isinstance(o, constexpr) else o" not in srcs[2]
            or getattr(it, "interpreter_semantic", None) is not sem
            # the overflow check: its condition's only use is the device_assert at its end, a no-op without debug
            or srcs[4].count("self.device_assert(cond, msg, None)") != 1 or srcs[4].count("cond") != 2
            or not srcs[4].rstrip().endswith("self.device_assert(cond, msg, None)")
            or "if not self.builder.options.debug:\n            return\n" not in srcs[5]
            or list(inspect.signature(sanitize).parameters) != ["self", "lhs", "rhs", "binary_op"]):
        return None
    plain, block_type, tensor, pointer_type = tl.dtype, tl.block_type, tl.tensor, tl.pointer_type
    numbers_ = (int, float, bool)

    def scalar_ty(t):
        """The scalar type of a tensor's type when it is of the plain class (a block's element type), else None."""
        if type(t) is block_type:
            t = t.element_ty
        return t if type(t) is plain else None

    def ptr_ty(t):
        """Whether a tensor's type is a pointer of the pointer_type class or a block of them."""
        if type(t) is block_type:
            t = t.element_ty
        return type(t) is pointer_type

    def binop_fast(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        if arithmetic_check:
            lt, rt = type(lhs), type(rhs)
            if lt is tensor:
                lhs_sca_ty = scalar_ty(lhs.type)
                if lhs_sca_ty is not None:
                    if rt is tensor:
                        rhs_sca_ty = scalar_ty(rhs.type)
                        if rhs_sca_ty is not None:
                            ret = sem.computation_type_impl(lhs_sca_ty, False, rhs_sca_ty, False, div_or_mod)
                            lhs, rhs = sem.cast(lhs, ret), sem.cast(rhs, ret)
                            return sem.broadcast_impl_value(lhs, rhs)
                    elif rt in numbers_:
                        ret = sem.computation_type_impl(lhs_sca_ty, False, sem.to_tensor_type(rhs), True, div_or_mod)
                        lhs = sem.cast(lhs, ret)
                        rhs = sem._cast_to_computation_type(rhs, ret)
                        return sem.broadcast_impl_value(lhs, rhs)
            elif lt in numbers_ and rt is tensor:
                rhs_sca_ty = scalar_ty(rhs.type)
                if rhs_sca_ty is not None:
                    ret = sem.computation_type_impl(sem.to_tensor_type(lhs), True, rhs_sca_ty, False, div_or_mod)
                    lhs = sem._cast_to_computation_type(lhs, ret)
                    rhs = sem.cast(rhs, ret)
                    return sem.broadcast_impl_value(lhs, rhs)
        if allow_lhs_ptr and type(lhs) is tensor and ptr_ty(lhs.type):
            # a pointer and an integer offset: Triton's pointer checks pass, no arithmetic (pointers), the offset
            # made a tensor by `to_tensor` (a tensor as it is), then the broadcast
            if type(rhs) is tensor:
                rhs_sca_ty = scalar_ty(rhs.type)
                if rhs_sca_ty is not None and not rhs_sca_ty.is_floating():
                    return sem.broadcast_impl_value(lhs, rhs)
            elif type(rhs) is int and not sem.to_tensor_type(rhs).is_floating():
                return sem.broadcast_impl_value(lhs, sem.to_tensor(rhs))
        return binop(sem, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    sem_cls = type(sem)
    arith = (sem_cls.add, sem_cls.sub, sem_cls.mul)

    def sanitize_fast(lhs, rhs, binary_op):
        """Without the debug option the check's condition goes to a `device_assert` that returns at once: for two
        operands of one plain integer type and Triton's own add, sub or mul of this semantic, nothing the check
        computes (int64 casts, the operation, two comparisons: NumPy array operations, which do not raise) is
        used, so it is skipped. Anything else (or with debug on) runs Triton's."""
        if not sem.builder.options.debug and getattr(binary_op, "__self__", None) is sem \
                and getattr(binary_op, "__func__", None) in arith:
            a, b = scalar_ty(lhs.type), scalar_ty(rhs.type)
            if a is not None and a is b and a.is_int():
                return None
        return sanitize(sem, lhs, rhs, binary_op)

    builtin_code = tl.core.builtin(lambda _semantic=None: None).__code__
    fast = _state.setdefault("fast", [False])

    class Capture:
        def set_attr(self, obj, name, value):
            self.value = value

    def patch_attr_fast(obj, name, member, builder, scope):
        capture = Capture()
        patch_attr(obj, name, member, builder, capture)
        slow = capture.value  # Triton's lambda
        if getattr(member, "__code__", None) is not builtin_code or member.__code__.co_freevars != ("fn",):
            scope.set_attr(obj, name, slow)
            return
        fn = member.__closure__[0].cell_contents  # what core.builtin's wrapper calls

        def new_member(*args, **kwargs):  # kwargs: a dict of this call's own
            if not fast[0] or "member" in kwargs:
                return slow(*args, **kwargs)
            kwargs.pop("_semantic", None)
            kwargs["_semantic"] = sem
            return fn(*args, **kwargs)

        scope.set_attr(obj, name, new_member)

    constexpr = tl.core.constexpr
    as_is = frozenset((tensor, int, float, bool, str, type(None)))

    def unwrap_fast(o):
        t = type(o)
        if t in as_is:
            return o
        if t is constexpr:
            return o.value
        return unwrap(o)

    return ((binop_fast, patch_attr_fast, unwrap_fast, sanitize_fast),
            (binop.__get__(sem), patch_attr, unwrap, sanitize.__get__(sem)))


def _convert(it, tl):
    """(the interpreter's `_convert_float` with a fast path, Triton's), or None where it does not have the shape
    relied on.

    The interpreter's casts between bf16 and fp32 (`cast_impl`, no rounding mode) take `_convert_float`'s general
    path: the bits split into sign, exponent and significand, renormalized, clamped and put together again (about
    1 ms a call, whatever the block's size). bf16 and fp32 have the same exponent (8 bits, bias 127), so for every
    input that is not a nonzero subnormal, that path gives the sign, the exponent as it is and the significand
    shifted by 16 bits: bf16 to fp32 is the bits shifted left by 16 (all 65536 bf16 inputs checked), fp32 to bf16
    the upper 16 bits (truncation, the rounding mode being None). Each element's result depends on its own bits
    only. Triton's path mangles nonzero subnormals (bf16 0x0001 does not become fp32 0x00010000): an array holding
    any goes to Triton's, as does every other pair of types, a rounding mode, a 0-d array, or an input of another
    NumPy dtype."""
    convert = getattr(it, "_convert_float", None)
    cast_impl = getattr(getattr(it, "InterpreterBuilder", None), "cast_impl", None)
    try:
        srcs = [inspect.getsource(f) for f in (convert, cast_impl)]
    except (OSError, TypeError):
        return None
    if (list(inspect.signature(convert).parameters) != ["input", "input_dtype", "output_dtype", "rounding_mode"]
            or "input_bin = np.frombuffer(input.tobytes(), dtype=input_uint_dtype)" not in srcs[0]
            or "return output.reshape(input.shape)" not in srcs[0]
            or "_convert_float(src.data, src_element_type, dst_element_type, None)" not in srcs[1]
            or (tl.bfloat16.primitive_bitwidth, tl.bfloat16.fp_mantissa_width, tl.bfloat16.exponent_bias,
                tl.float32.primitive_bitwidth, tl.float32.fp_mantissa_width, tl.float32.exponent_bias)
            != (16, 7, 127, 32, 23, 127)):
        return None
    import numpy as np
    plain, ndarray = tl.dtype, np.ndarray
    u16, f32 = np.dtype(np.uint16), np.dtype(np.float32)
    u16_mag, u16_one, u16_sub = np.uint16(0x7FFF), np.uint16(1), np.uint16(0x7F)
    u32_mag, u32_one, u32_sub = np.uint32(0x7FFFFFFF), np.uint32(1), np.uint32(0x7FFFFF)
    sixteen32 = np.uint32(16)

    def convert_fast(input, input_dtype, output_dtype, rounding_mode):
        if (rounding_mode is None and type(input) is ndarray and input.ndim and type(input_dtype) is plain
                and type(output_dtype) is plain):  # (a 0-d array's shift would give a NumPy scalar)
            src, dst = input_dtype.name, output_dtype.name
            if src == "bf16" and dst == "fp32" and input.dtype == u16:
                # a nonzero subnormal: 1 <= magnitude <= 0x7F, i.e. magnitude - 1 < 0x7F (unsigned, 0 wraps)
                if not ((input & u16_mag) - u16_one < u16_sub).any():
                    return input.astype(np.uint32, order="C") << sixteen32
            elif src == "fp32" and dst == "bf16" and input.dtype == f32:
                bits = input.view(np.uint32)
                if not ((bits & u32_mag) - u32_one < u32_sub).any():
                    return (bits >> sixteen32).astype(np.uint16, order="C")
        return convert(input, input_dtype, output_dtype, rounding_mode)

    # and this Triton's conversion is the shift (else nothing is patched): every bf16 value but nonzero subnormals,
    # every fp32 upper half of a nonzero exponent with lower halves 0, 0x7FFF, 0x8000 and 0xFFFF (normal values,
    # infinities and NaNs)
    bf = np.arange(2**16, dtype=np.uint16)
    bf = bf[((bf & 0x7FFF) == 0) | ((bf & 0x7FFF) >= 0x80)]
    up = (bf.astype(np.uint32) << sixteen32, convert(bf, tl.bfloat16, tl.float32, None))
    bf = bf[(bf & 0x7F80) != 0]  # a nonzero exponent: no fp32 subnormal whatever the lower half
    u = (bf.astype(np.uint32) << sixteen32)[:, None] | np.array([0, 0x7FFF, 0x8000, 0xFFFF], np.uint32)
    down = (bf.repeat(4).reshape(-1, 4), convert(u.view(np.float32), tl.float32, tl.bfloat16, None))
    if not all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in (up, down)):
        return None
    return convert_fast, convert


def _use(which: str) -> None:
    import triton.language as tl
    from triton.runtime import interpreter as it
    sem = it.interpreter_semantic
    (it.GridExecutor.__call__, it.InterpretedFunction.__call__, it._patch_lang, it._get_np_dtype,
     it.InterpreterBuilder.get_block_ty, tl.block_type.with_element_ty, tl.tensor.__init__,
     sem.broadcast_impl_value, sem.computation_type_impl, sem.cast, sem.binary_op_type_checking_impl,
     it._patch_attr, tl.core._unwrap_if_constexpr, sem.binary_op_sanitize_overflow_impl,
     it._convert_float) = _state["calls"][which]
    # the kept builtin wrappers (`_ops`): Triton's lambda under triton_as_it_is()
    _state.setdefault("fast", [False])[0] = which == "patched"


@contextlib.contextmanager
def triton_as_it_is():
    """Triton's own calls for the duration (what tests/test_interp_speed.py compares with)."""
    _use("triton")
    try:
        yield
    finally:
        _use("patched")
