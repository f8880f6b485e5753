"""Compile every Triton kernel of fastopt for a real GPU target, on a machine without a GPU.

The test suite runs the kernels through Triton's interpreter, which accepts programs the compiler rejects
(a `tl.dot` tile under 16, a non-power-of-2 `tl.arange`, mixed pointer and integer types, fp64 where the
target has no instruction). This script installs a driver that reports a CUDA target (sm_90 by default) and
turns every launch into a compile-only warmup, then drives each optimizer through its Triton path on CPU
tensors: dtypes, options, GradScaler, 8-bit states, and sharded layouts (declared on a one-rank gloo group,
which exercises the MAPPED kernels; the numbers are meaningless, nothing runs). Triton compiles to a cubin
with its bundled ptxas.

    python tests/compile_check.py [--arch 90] [--quick] [--json out.json] [-k label]

Prints one line per compiled kernel (specializations, registers, spill bytes, shared memory from cuobjdump)
and exits non-zero when a kernel fails to compile, when a `*_kernel` of fastopt.kernels was never launched, or
when one was launched without `enable_fp_fusion` (kernels/common.py's FP_FUSION).
Run without TRITON_INTERPRET (tests/test_compile.py does).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_check: unset TRITON_INTERPRET (the interpreter never compiles)")
os.environ["FASTOPT_BACKEND"] = "triton"
# Without line info (no debug scopes in the LLVM IR, no .loc in the PTX): the same registers, spills, shared memory
# and vector widths in every row of the --json table over the --quick matrix, in 304 CPU s where 325 s were taken
# with it (each measured once, under other load, 2-core CPU machine).
os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import fastopt  # noqa: E402
import fastopt.kernels  # noqa: E402
from fastopt import ops  # noqa: E402
from fastopt.distributed import declare_shard  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


class CompileOnlyDriver:
    """What JITFunction.run asks of the active driver, for a GPU that is not there."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class Recorder:
    def __init__(self):
        self.kernels = defaultdict(list)   # kernel name -> [(compiled kernel, workload label)]
        self.errors = []                   # (kernel name, specialization, message)
        self.unpinned = set()              # kernels launched without an explicit enable_fp_fusion (common.FP_FUSION)
        self.bm = {}                       # id(compiled kernel) -> its BM constexpr, for kernels that have one
        self.context = ""

    def install(self):
        rec = self
        orig_run, orig_compile = JITFunction.run, JITFunction._do_compile

        def run(self, *args, grid, warmup, **kwargs):
            if "enable_fp_fusion" not in kwargs:
                rec.unpinned.add(f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__name__}")
            return orig_run(self, *args, grid=grid, warmup=True, **kwargs)

        def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
            name = f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__name__}"
            try:
                kernel = orig_compile(self, key, signature, device, constexprs, options, attrs, warmup)
            except Exception as e:  # noqa: BLE001 -- every failure is recorded and reported, then exit 1
                consts = {k[0] if isinstance(k, tuple) and len(k) == 1 else k: v for k, v in constexprs.items()}
                rec.errors.append((name, f"{rec.context}; constexprs={consts}; signature={signature}",
                                   "".join(traceback.format_exception_only(type(e), e))[-3000:]))
                return None
            rec.kernels[name].append((kernel, rec.context))
            names = getattr(self, "arg_names", [])
            consts = {names[k[0]] if isinstance(k, tuple) and len(k) == 1 and isinstance(k[0], int) else k: v
                      for k, v in constexprs.items()}
            if "BM" in consts:
                rec.bm[id(kernel)] = consts["BM"]
            return kernel

        JITFunction.run = run
        JITFunction._do_compile = do_compile


def launched_kernels() -> set[str]:
    """Every `*_kernel` JITFunction defined in fastopt.kernels: the entry points that must compile."""
    names = set()
    for mod in pkgutil.iter_modules(fastopt.kernels.__path__):
        m = importlib.import_module(f"fastopt.kernels.{mod.name}")
        for attr, val in vars(m).items():
            if isinstance(val, JITFunction) and attr.endswith("_kernel") and val.fn.__module__ == m.__name__:
                names.add(f"{mod.name}.{attr}")
    return names


def resource_usage(kernel) -> dict:
    """Registers, spill (local) bytes and static shared memory of a compiled kernel, from cuobjdump."""
    out = {"shared": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps}
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return out
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    ptx = kernel.asm.get("ptx", "")
    out["vector_accesses"] = len(re.findall(r"\b(?:ld|st)\.global(?:\.\w+)*\.v[248]\.", ptx))
    for key, field in (("regs", "REG"), ("stack", "STACK"), ("local", "LOCAL")):
        m = re.search(rf"\b{field}:(\d+)", text)
        if m:
            out[key] = int(m.group(1))
    return out


# ---- workloads: every optimizer through ops' Triton path -------------------------------------------------

def _params(shapes, dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _step(opt, params, steps=2, scaler=False):
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        if scaler:
            opt.grad_scale = torch.tensor(1024.0)
            opt.found_inf = torch.tensor(0.0)
        opt.step()


def _sharded(dtype, group):
    """Pieces of larger tensors declared on a one-rank group: a row range, a column range, a batch of
    matrices cut along its first dim, and a flat range that starts and ends mid-row with tail padding."""
    g = torch.Generator().manual_seed(1)
    mk = lambda *s: torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype))  # noqa: E731
    return [declare_shard(mk(5, 24), (16, 24), group, dim=0, start=3),
            declare_shard(mk(16, 7), (16, 24), group, dim=1, start=10),
            declare_shard(mk(2, 6, 9), (5, 6, 9), group, dim=0, start=1),
            declare_shard(mk(40), (9, 11), group, flat_offset=70),
            declare_shard(mk(7), (30,), group, dim=0, start=20)]


SHAPES = [(64, 48), (3, 40, 24), (200, 1), (1, 300), (37,), (1,), ()]
# Sizes that are multiples of common.ALIGN_ELEMS, as in large models: the ALIGNED (vectorized) kernels.
SHAPES16 = [(64, 48), (2, 32, 16), (256,), (48,)]


# --quick (the test suite's): GradScaler as each dtype is trained (bf16 and fp64 without, fp16 with, fp32 both);
# GaLore trimmed as below. Without --quick: every combination.
QUICK_SCALER = {torch.float32: (False, True), torch.bfloat16: (False,), torch.float16: (True,),
                torch.float64: (False,)}
PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")


def workloads(group, quick: bool):
    """(label, build) pairs; build() returns (optimizer, params, steps, scaler)."""
    W = []
    for dtype in DTYPES:
        d = str(dtype).split(".")[-1]
        layouts = [("dense", lambda dtype=dtype: _params(SHAPES, dtype)),
                   ("sharded", lambda dtype=dtype: _sharded(dtype, group)),
                   ("aligned", lambda dtype=dtype: _params(SHAPES16, dtype))]
        for lay, mk in layouts:
            for scaler in QUICK_SCALER[dtype] if quick else (False, True):
                tag = f"{d} {lay}{' scaler' if scaler else ''}"
                W.append((f"Adafactor relative {tag}", lambda mk=mk, s=scaler: (fastopt.Adafactor(ps := mk()), ps, 2, s)))
                W.append((f"Adafactor beta1 wd {tag}", lambda mk=mk, s=scaler: (fastopt.Adafactor(
                    ps := mk(), lr=1e-2, relative_step=False, scale_parameter=False, beta1=0.9, weight_decay=0.1),
                    ps, 2, s)))
                W.append((f"CAME {tag}", lambda mk=mk, s=scaler: (fastopt.CAME(ps := mk(), lr=1e-3,
                                                                               weight_decay=0.1), ps, 2, s)))
                W.append((f"CAME 8-bit {tag}", lambda mk=mk, s=scaler: (fastopt.CAME(ps := mk(), lr=1e-3, nbits=8),
                                                                        ps, 2, s)))
                W.append((f"Lamb {tag}", lambda mk=mk, s=scaler: (fastopt.Lamb(ps := mk(), weight_decay=0.1,
                                                                               max_trust_ratio=10.0), ps, 2, s)))
                W.append((f"Lamb 8-bit {tag}", lambda mk=mk, s=scaler: (fastopt.Lamb(
                    ps := mk(), nbits=8, min_8bit_size=1, bias_correction=False), ps, 2, s)))
                for nbits in (32, 8):
                    for proj in PROJ_TYPES:
                        # quick: GaLore's kernels see local rectangles (no MAPPED variants) and differ by dtype,
                        # HAS_SCALE and 8-bit only: the five projections and the sharded rectangles in fp32 alone;
                        # aligned (rank 16: every size and stride of the products a multiple of 16, where
                        # kernels/galore.py takes TILES_SM90) the 32-bit std one, whose matmuls the 8-bit share.
                        if quick and proj != "std" and (dtype != torch.float32 or lay != "dense" or scaler):
                            continue
                        if (quick and lay == "sharded" and dtype != torch.float32) or (
                                lay == "aligned" and (proj != "std" or (quick and nbits == 8))):
                            continue
                        rank = 16 if lay == "aligned" else 2
                        W.append((f"GaLore {nbits}-bit {proj} {tag}", lambda mk=mk, s=scaler, n=nbits, pt=proj,
                                  r=rank: (*_galore(mk(), n, pt, r), 3, s)))
        if dtype == torch.bfloat16:
            for lay, mk in layouts[:2]:
                W.append((f"Adafactor stochastic-round bf16 {lay}", lambda mk=mk: (fastopt.Adafactor(
                    ps := mk(), bf16_stochastic_round=True, warmup_init=True), ps, 2, False)))
                W.append((f"CAME stochastic-round bf16 {lay}", lambda mk=mk: (fastopt.CAME(
                    ps := mk(), lr=1e-3, bf16_stochastic_round=True), ps, 2, False)))
                W.append((f"CAME 8-bit stochastic-round bf16 {lay}", lambda mk=mk: (fastopt.CAME(
                    ps := mk(), lr=1e-3, nbits=8, bf16_stochastic_round=True), ps, 2, False)))
                W.append((f"Lamb stochastic-round bf16 {lay}", lambda mk=mk: (fastopt.Lamb(
                    ps := mk(), bf16_stochastic_round=True), ps, 2, False)))
                W.append((f"Lamb 8-bit stochastic-round bf16 {lay}", lambda mk=mk: (fastopt.Lamb(
                    ps := mk(), nbits=8, min_8bit_size=1, bf16_stochastic_round=True), ps, 2, False)))
    return W


def _galore(params, nbits, proj_type, rank=2):
    from fastopt.distributed import layout_of
    shape = lambda p: getattr(layout_of(p), "global_shape", p.shape)  # noqa: E731
    mats = [p for p in params if len(shape(p)) >= 2 and min(shape(p)[-2:]) >= rank]
    rest = [p for p in params if p not in set(mats)]
    groups = [{"params": mats, "rank": rank, "update_proj_gap": 2, "proj_type": proj_type}]
    groups += [{"params": rest}] if rest else []
    return fastopt.GaLoreAdamW(groups, lr=1e-3, nbits=nbits, min_8bit_size=1), params


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    ap.add_argument("--json", help="write the per-kernel resource table here")
    ap.add_argument("-k", default="", help="only the workloads whose label contains this")
    ap.add_argument("--quick", action="store_true", help="the test suite's smaller matrix (see QUICK_SCALER)")
    args = ap.parse_args()

    driver.set_active(CompileOnlyDriver(args.arch))
    ops.interpreting = lambda: True   # lets FASTOPT_BACKEND=triton take CPU tensors; the kernels see no interpreter
    rec = Recorder()
    rec.install()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        group = dist.new_group([0])
        t0 = time.time()
        failed_workloads = []
        ran = 0
        # Every workload with GaLore's default dot precisions (tf32x3; bf16/fp16 operands), the forced fp32
        # ones on the "GaLore 32-bit std" workloads (7 with --quick: each dtype, layout and GradScaler setting).
        for precision in ("auto", "ieee", "tf32"):
            os.environ["FASTOPT_GALORE_DOT"] = precision
            for label, build in workloads(group, args.quick):
                if args.k not in label or (precision != "auto" and not label.startswith("GaLore 32-bit std")):
                    continue
                rec.context = f"{label} dot={precision}"
                ran += 1
                try:
                    opt, params, steps, scaler = build()
                    _step(opt, params, steps, scaler)
                except Exception:  # noqa: BLE001 -- reported below; the other workloads still run
                    failed_workloads.append((rec.context, traceback.format_exc()[-3000:]))
        dist.destroy_process_group()
    if not ran:
        sys.exit(f"compile_check: -k {args.k!r} matches no workload (labels are case-sensitive, e.g. 'Lamb 8-bit "
                 "float32 dense')")
    elapsed = time.time() - t0

    table = {}
    for name, ks in sorted(rec.kernels.items()):
        usage = [resource_usage(k) for k, _ in ks]
        narrow = [u.get("regs", 0) for u, (_, label) in zip(usage, ks) if "float64" not in label]
        table[name] = {"specializations": len(ks),
                       "regs_max": max(narrow, default=0),
                       "regs_max_fp64": max((u.get("regs", 0) for u, (_, label) in zip(usage, ks)
                                             if "float64" in label), default=0),
                       "local_bytes_max": max(u.get("local", 0) for u in usage),
                       "stack_max": max(u.get("stack", 0) for u in usage),
                       # stack frame (where ptxas spills: LOCAL counts .local arrays only) by the BM tile size
                       "stack_max_by_bm": {str(bm): max(u.get("stack", 0) for u, (k, _) in zip(usage, ks)
                                                        if rec.bm.get(id(k)) == bm)
                                           for bm in sorted({rec.bm[id(k)] for k, _ in ks if id(k) in rec.bm})},
                       "shared_max": max(u["shared"] for u in usage),
                       "vectorized_specializations": sum(u["vector_accesses"] > 0 for u in usage),
                       "vectorized_aligned": [u["vector_accesses"] > 0 for u, (_, label) in zip(usage, ks)
                                              if " aligned" in label]}
    print(f"Triton {triton.__version__}, target sm_{args.arch}: {sum(len(v) for v in rec.kernels.values())} "
          f"specializations of {len(rec.kernels)} kernels compiled in {elapsed:.0f} s")
    print("Max over specializations. regs: fp32/bf16/fp16 params; regs64: fp64 params. local B: spilled bytes.")
    print("vec: specializations with 16/8/4-byte vector global loads or stores (of those from aligned workloads).")
    print(f"{'kernel':40s} {'specs':>5s} {'regs':>5s} {'regs64':>6s} {'local B':>7s} {'stack B':>7s} {'shared B':>8s} "
          f"{'vec':>9s}")
    for name, row in table.items():
        print(f"{name:40s} {row['specializations']:5d} {row['regs_max']:5d} {row['regs_max_fp64']:6d} "
              f"{row['local_bytes_max']:7d} "
              f"{row['stack_max']:7d} {row['shared_max']:8d} "
              f"{row['vectorized_specializations']:3d} ({sum(row['vectorized_aligned'])}/{len(row['vectorized_aligned'])})")
    missing = sorted(launched_kernels() - set(rec.kernels)) if not args.k else []
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "arch": args.arch, "kernels": table,
                                               "errors": [e[:2] for e in rec.errors], "missing": missing,
                                               "unpinned": sorted(rec.unpinned)},
                                              indent=1))
    seen = set()
    for name, where, msg in rec.errors:  # a kernel that fails to compile fails again at every launch: once each
        if (name, msg) not in seen:
            seen.add((name, msg))
            print(f"\nCOMPILE ERROR in {name} ({where}):\n{msg}")
    for where, tb in failed_workloads:
        print(f"\nWORKLOAD FAILED ({where}):\n{tb}")
    if missing:
        print(f"\nNever launched (add a workload): {', '.join(missing)}")
    if rec.unpinned:
        print("\nLaunched without enable_fp_fusion (pass **kernels.common.FP_FUSION): "
              f"{', '.join(sorted(rec.unpinned))}")
    ok = not (rec.errors or failed_workloads or missing or rec.unpinned)
    print("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
