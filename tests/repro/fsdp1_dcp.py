"""FSDP1 (use_orig_params=True) on 4 gloo ranks: DCP save and load of the optimizer state into a fresh FSDP1 model.
Usage: python tests/repro/fsdp1_dcp.py [torch|lamb|adamw8bit]"""
import os, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def case(rank, world, which, path):
    import torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    import fastopt

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Linear(6, 3)).double()
        m = FSDP(m, device_id=torch.device("cpu"), use_orig_params=True)
        if which == "torch":
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        elif which == "lamb":
            opt = fastopt.Lamb(m.parameters(), lr=1e-2)
        else:
            opt = fastopt.AdamW8bit(m.parameters(), lr=1e-2, min_8bit_size=1 << 40)
        return m, opt

    m, opt = build()
    m(torch.randn(4, 5, dtype=torch.float64)).square().sum().backward()
    opt.step()
    osd = get_optimizer_state_dict(m, opt)
    out = {"saved_keys": sorted(osd)}
    dcp.save({"optim": osd}, checkpoint_id=path)
    m2, opt2 = build()
    sd = {"optim": get_optimizer_state_dict(m2, opt2)}
    out["template_keys"] = sorted(sd["optim"])
    try:
        dcp.load(sd, checkpoint_id=path)
        set_optimizer_state_dict(m2, opt2, sd["optim"])
        out["loaded"] = True
    except BaseException as e:
        out["loaded"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


if __name__ == "__main__":
    from dist_utils import run
    which = sys.argv[1] if len(sys.argv) > 1 else "lamb"
    for r, res in enumerate(run(case, 4, which, tempfile.mkdtemp())):
        print(which, "rank", r, res)
