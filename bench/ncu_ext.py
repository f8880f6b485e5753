"""The extension's quantize and AdamW8bit kernels alone, for Nsight Compute (`ncu -k regex:... python
bench/ncu_ext.py`) or plain timing (CUDA events, median of 20) at several block sizes."""
from __future__ import annotations

import sys

import torch

import fastopt
from fastopt import ops


ONCE = "once" in sys.argv  # each kernel once, no warm-up (for ncu)


def timed(fn, reps=20):
    if ONCE:
        fn()
        return float("nan")
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 256 * 2**20
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, device="cuda", dtype=dtype)
        codes = torch.empty(n, dtype=torch.uint8, device="cuda")
        for b in (256, 2048):
            absmax = torch.empty(-(-n // b), device="cuda")
            ms = timed(lambda: ops.quantize_blockwise_([x], [codes], [absmax], block_size=b))
            out = torch.empty_like(x)
            ms2 = timed(lambda: ops.dequantize_blockwise_([codes], [absmax], [out], block_size=b))
            print(f"{dtype} n={n} B={b}: quantize {ms:.3f} ms ({n * (x.element_size() + 1) / ms / 1e6:.0f} GB/s), "
                  f"dequantize {ms2:.3f} ms ({n * (x.element_size() + 1) / ms2 / 1e6:.0f} GB/s)")
        p = torch.nn.Parameter(torch.randn(n, device="cuda", dtype=dtype))
        p.grad = torch.randn_like(p)
        opt = fastopt.AdamW8bit([p], lr=1e-3)
        ms = timed(opt.step)
        print(f"{dtype} n={n}: AdamW8bit step {ms:.3f} ms "
              f"({n * (3 * p.element_size() + 2 + 8 / 256) / ms / 1e6:.0f} GB/s)")
        del x, codes, p, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
