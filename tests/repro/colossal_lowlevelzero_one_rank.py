"""LowLevelZeroPlugin on one process: ColossalAI's LowLevelZeroOptimizer flattens every master (a 1-D split of the
working param over a ZeRO group of one), and the plugin then calls setup_distributed(None, the default group,
{id(master): working}, {id(working): 0}, is_zero=False) (is_zero is `dp_size > 1 and zero_stage > 0`). fastopt
refused the mapping ("without is_zero=True they must be the same tensor") before the fix; it now steps as one
process."""
import tempfile

import torch
import torch.distributed as dist

import fastopt

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
torch.manual_seed(0)
working = torch.randn(5, 3, dtype=torch.float64)
ref = torch.nn.Parameter(working.clone())
master = torch.nn.Parameter(working.reshape(-1).clone())
opt, ref_opt = (fastopt.Adafactor([q], lr=1e-2, relative_step=False) for q in (master, ref))
opt.setup_distributed(None, dist.group.WORLD, {id(master): working}, {id(working): 0}, False)
for _ in range(4):
    g = torch.randn(5, 3, dtype=torch.float64)
    ref.grad, master.grad = g.clone(), g.reshape(-1).clone()
    opt.step()
    ref_opt.step()
print("factored like one process:", sorted(opt.state[master]) == sorted(ref_opt.state[ref]),
      "max param diff:", float((master.detach().view(5, 3) - ref.detach()).abs().max()))
dist.destroy_process_group()
