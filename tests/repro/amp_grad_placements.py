"""Repro: DTensor gradients placed otherwise than their params, under a loss scaler. A TP model whose params are
all sharded along the one mesh dim (an embedding by RowwiseParallel(input_layouts=Replicate()), then Colwise and
Rowwise linears without bias) passes `_found_inf_agreed` (a28b009), yet torch 2.13 leaves the embedding's gradient
Replicate, and DTensor's unscale reduces found_inf over the dims sharding the FIRST gradient only: none. An inf in
rank 3's piece of the Colwise weight's gradient is seen by rank 3 alone. Runs on 4 gloo ranks:

    OMP_NUM_THREADS=1 .venv/bin/python tests/repro/amp_grad_placements.py [AdamW|Lamb[:sharded] ...]

Prints, per rank: the gradients' placements, whether GradScaler took the fused path, the scale after 3 steps.
At a28b009: Lamb fused, scales [65536, 65536, 65536, 16384] under both scalers (torch's AdamW alike). With the
fix (`_grads_placed_as_params`) Lamb takes GradScaler's own path: under ShardedGradScaler (`Lamb:sharded`) the
scales agree; under torch.amp.GradScaler rank 3 skips alone and Lamb's collectives wait (a hang, as a28b009's
amp_one_rank_inf.py shows for its layouts)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def case(rank, world, opt_name, sharded):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fastopt
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 12, bias=False),
                                torch.nn.Linear(12, 8, bias=False)).double()
    parallelize_module(model, mesh, {"0": RowwiseParallel(input_layouts=Replicate()), "1": ColwiseParallel(),
                                     "2": RowwiseParallel()})
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2) if opt_name == "AdamW" else fastopt.Lamb(params, lr=1e-2)
    scaler = (ShardedGradScaler if sharded else torch.amp.GradScaler)("cpu", init_scale=2.0 ** 14, growth_interval=1)
    fused = []
    for t in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randint(0, 16, (3, 5))).square().mean()).backward()
        if t == 1 and rank == 3:
            params[1].grad.to_local().view(-1)[0] = float("inf")  # rank 3's piece of the Colwise weight's grad
        fused.append(getattr(opt, "_step_supports_amp_scaling", False))
        scaler.step(opt)
        scaler.update()
    return [str(p.grad.placements) for p in params], fused, scaler.get_scale()


if __name__ == "__main__":
    from dist_utils import DistError, DistPool
    with DistPool(4, timeout=60) as pool:
        for name, sharded in [(a.split(":")[0], a.endswith(":sharded")) for a in sys.argv[1:]] or [
                ("AdamW", False), ("Lamb", False), ("Lamb", True)]:
            try:
                out = pool.run(case, name, sharded)
            except DistError as e:
                print(f"{name:5s} {'ShardedGradScaler' if sharded else 'GradScaler'}: {str(e).splitlines()[0]}")
                continue
            scales = [s for _, _, s in out]
            print(f"{name:5s} {'ShardedGradScaler' if sharded else 'GradScaler       '} grads {out[0][0]}, fused "
                  f"{out[0][1]}, scales per rank {scales} {'agree' if len(set(scales)) == 1 else 'DIVERGE'}",
                  flush=True)
