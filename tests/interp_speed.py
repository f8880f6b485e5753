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

The gloo processes of tests/dist_utils.py install it too (they ran Triton's interpreter as it is before).

It does nothing where Triton's interpreter lacks the pieces it relies on (another Triton version), and
nothing unless TRITON_INTERPRET is set. `installed()` says whether it took effect; tests/test_interp_speed.py
checks that it did and that kernels give the same bits with and without it.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re

_state = {"installed": False}


def installed() -> bool:
    return _state["installed"]


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
    if memoized is None or semantic is None:
        return False
    ours, theirs = memoized
    sem_ours, sem_theirs = semantic
    _state["calls"] = {"patched": (launch, nested, patch_once, *ours, *sem_ours),
                       "triton": (grid_call, nested_call, patch_lang, *theirs, *sem_theirs)}
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
        return block(with_elt, (self, scalar_ty), scalar_ty, self.shape)

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

    def broadcast_fast(lhs, rhs):
        if lhs.type is rhs.type:
            return lhs, rhs
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


def _use(which: str) -> None:
    import triton.language as tl
    from triton.runtime import interpreter as it
    sem = it.interpreter_semantic
    (it.GridExecutor.__call__, it.InterpretedFunction.__call__, it._patch_lang, it._get_np_dtype,
     it.InterpreterBuilder.get_block_ty, tl.block_type.with_element_ty, tl.tensor.__init__,
     sem.broadcast_impl_value, sem.computation_type_impl, sem.cast) = _state["calls"][which]


@contextlib.contextmanager
def triton_as_it_is():
    """Triton's own calls for the duration (what tests/test_interp_speed.py compares with)."""
    _use("triton")
    try:
        yield
    finally:
        _use("patched")
