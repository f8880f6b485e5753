"""fp32 params starting at 0 (so that only the update's own arithmetic shows), one step with beta2 close to 1: the
update's relative error against the float64 formula, for fastopt's Adam-type optimizers (torch back end, and the
C++ extension for AdamW8bit) beside torch.optim.AdamW (for-loop, foreach, fused). One step: bias corrections
1 - beta^1; at step t they are 1 - beta^t, the same cancellation while beta^t is near 1."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fastopt  # noqa: E402

g = torch.Generator().manual_seed(0)
gr = torch.randn(4096, generator=g, dtype=torch.float64)
for b2 in (0.999, 0.9999, 0.99999):
    b1, lr, eps = 0.9, 1e-3, 1e-8
    m, v = (1 - b1) * gr, (1 - b2) * gr * gr
    adamw = -lr / (1 - b1) * m / (v.sqrt() / (1 - b2) ** 0.5 + eps)   # torch.optim.AdamW, eps after correction
    lamb = -lr * (1 - b2) ** 0.5 / (1 - b1) * m / (v.sqrt() + eps)     # Lamb, GaLore: eps before it (p = 0: r = 1)
    kw = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0)
    runs = [("fastopt.AdamW8bit (32-bit states) torch", "torch", adamw,
             lambda ps: fastopt.AdamW8bit(ps, **kw, min_8bit_size=10 ** 9)),
            ("fastopt.AdamW8bit extension", "auto", adamw,
             lambda ps: fastopt.AdamW8bit(ps, **kw, min_8bit_size=10 ** 9)),
            ("fastopt.Lamb torch", "torch", lamb, lambda ps: fastopt.Lamb(ps, **kw)),
            ("fastopt.GaLoreAdamW (plain group) torch", "torch", lamb, lambda ps: fastopt.GaLoreAdamW(ps, **kw)),
            ("torch AdamW for-loop", "torch", adamw, lambda ps: torch.optim.AdamW(ps, **kw, foreach=False)),
            ("torch AdamW foreach", "torch", adamw, lambda ps: torch.optim.AdamW(ps, **kw, foreach=True)),
            ("torch AdamW fused", "torch", adamw, lambda ps: torch.optim.AdamW(ps, **kw, fused=True))]
    print(f"beta2 = {b2}: ||p - float64|| / ||float64 update||")
    for name, be, truth, mk in runs:
        os.environ["FASTOPT_BACKEND"] = be
        p = torch.zeros(4096, dtype=torch.float32, requires_grad=True)
        opt = mk([p])
        p.grad = gr.float()
        opt.step()
        print(f"  {name:42s} {(p.detach().double() - truth).norm().item() / truth.norm().item():.2e}")
