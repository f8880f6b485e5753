"""Repro: an inf in ONE rank's piece of a DTensor gradient, beside a param placed Replicate over a mesh dim (or on
another mesh), placed first. torch 2.13's DTensor unscale (`found_inf_reduce_handler`) reduces found_inf over the
mesh dims that shard the first gradient of each device/dtype only, so ranks disagree on skipping the step and
their loss scales drift apart. Runs on 4 gloo ranks:

    OMP_NUM_THREADS=1 .venv/bin/python tests/repro/amp_one_rank_inf.py

Prints each rank's scale after the steps for: torch.optim.AdamW (torch's own path) and fastopt.Lamb, each under
torch.amp.GradScaler and FSDP's ShardedGradScaler (which sums found_inf over the ranks in unscale_); arguments
`AdamW`, `Lamb:sharded`, ... pick cases. Before the fix (`_found_inf_agreed`) Lamb's scales diverge under both
scalers; after it, Lamb takes GradScaler's own path: under ShardedGradScaler they agree; under torch.amp.GradScaler
the ranks that found no inf step alone and Lamb's collectives wait for the others (a hang, as under FSDP1)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def case(rank, world, opt_name, sharded):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import fastopt
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    shapes, plc = [(9, 5), (7, 9)], [[Replicate(), Shard(0)], [Shard(0), Shard(1)]]
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, dtype=torch.float64), mesh, pl))
              for s, pl in zip(shapes, plc)]
    opt = torch.optim.AdamW(params, lr=1e-2) if opt_name == "AdamW" else fastopt.Lamb(params, lr=1e-2)
    scaler = (ShardedGradScaler if sharded else torch.amp.GradScaler)("cpu", init_scale=2.0 ** 12, growth_interval=1)
    for t in range(3):
        scale = float(scaler.scale(torch.ones(())))
        for p, s, pl in zip(params, shapes, plc):
            p.grad = distribute_tensor(torch.randn(s, dtype=torch.float64) * scale, mesh, pl)
        if t == 1 and rank == 3:
            p.grad.to_local().view(-1)[0] = float("inf")  # one element of rank 3's piece of the second param
        scaler.step(opt)
        scaler.update()
    return scaler.get_scale()


if __name__ == "__main__":
    from dist_utils import DistPool
    with DistPool(4, timeout=60) as pool:
        for name, sharded in [(a.split(":")[0], a.endswith(":sharded")) for a in sys.argv[1:]] or [
                ("AdamW", False), ("AdamW", True), ("Lamb", False), ("Lamb", True)]:
            scales = pool.run(case, name, sharded)
            print(f"{name:5s} {'ShardedGradScaler' if sharded else 'GradScaler       '} scales per rank: {scales}"
                  f" {'agree' if len(set(scales)) == 1 else 'DIVERGE'}")
