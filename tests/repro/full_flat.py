"""FSDP2 on 4 gloo ranks: the full optimizer state on rank 0 in DCP's flattened form
(StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)), loaded into a fresh
FSDP2 model with broadcast_from_rank0=True and flatten_optimizer_state_dict=True.
Usage: python tests/repro/full_flat.py [torch|lamb]"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def case(rank, world, which):
    import torch
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import fastopt

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)).double()
        fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2) if which == "torch" else fastopt.Lamb(m.parameters(), lr=1e-2)
        return m, opt

    m, opt = build()
    m(torch.randn(4, 8, dtype=torch.float64)).square().sum().backward()
    opt.step()
    osd = get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                      flatten_optimizer_state_dict=True))
    m2, opt2 = build()
    try:
        set_optimizer_state_dict(m2, opt2, osd if rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                          flatten_optimizer_state_dict=True))
        return "loaded"
    except BaseException as e:
        return f"{type(e).__name__}: {str(e)[:150]}"


if __name__ == "__main__":
    from dist_utils import run
    which = sys.argv[1] if len(sys.argv) > 1 else "lamb"
    for r, res in enumerate(run(case, 4, which, timeout=60)):
        print(which, "rank", r, res)
