"""Run a function on N gloo processes on CPU: `run(fn, world_size, *args)` or a reusable `DistPool`.

`fn(rank, world_size, *args)` must be a module-level function (spawned processes import it by name); it runs
after `torch.distributed.init_process_group("gloo")` (file:// rendezvous in a fresh temporary folder) and its
return value comes back pickled by value, one entry per rank. If any rank raises, the parent raises
`DistError` with every failing rank's traceback; if the ranks do not all answer within `timeout` seconds
(a rank stuck in a collective that a failed rank never joined), the processes are killed and `DistError`
says which ranks never answered.

Starting processes costs seconds (each imports torch), so the tests share one `DistPool` of 4 ranks (the
session-scoped `pool` fixture of tests/conftest.py): the same processes and process group serve every call,
and the pool restarts itself after a failure, so one failing test cannot poison the next, and once its ranks
hold more than MAX_GROUPS process groups (below). Without CUDA the ranks fork from a forkserver that imported
torch, Triton, fastopt and the test modules once for this Python process (`_preload`): a start or restart then
costs a fork a rank, not its imports (torch and fastopt about 6 CPU s, the test modules it runs more), which
took a quarter of the suite's CPU on the 2-core CI machine. With CUDA they are spawned: the test modules ask for
CUDA devices when imported, and a process forked after that cannot use CUDA. Forked ranks share the
forkserver's str hash seed, where torchrun's processes each draw one: ranks iterating a set of strings in
different orders (a collective per key in set order) would go unnoticed in the pool; `run`'s fresh processes
are spawned.

Children run with one intra-op thread and with the parent's environment at the pool's start plus `env` (set
as the rank's first act: a forked rank inherits the forkserver's); `FASTOPT_BACKEND` can also be set by `fn`
itself, since fastopt reads it at every call.
"""
from __future__ import annotations

import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

__all__ = ["run", "DistPool", "DistError", "placement"]


class DistError(RuntimeError):
    """A function run on the process group raised on some rank, or some rank never answered."""


def _worker(rank: int, world_size: int, init_file: str, tasks, results, coll_timeout: float, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    import interp_speed  # the parent's faster interpreter (tests/conftest.py installs it there), here too
    interp_speed.install()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=coll_timeout))
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            task_id, payload = item
            try:
                fn, args = pickle.loads(payload)
                out = (task_id, rank, True, pickle.dumps(fn(rank, world_size, *args)))
            except BaseException:  # the parent re-raises it with this traceback
                out = (task_id, rank, False, traceback.format_exc())
            results.put(out + (_groups_alive(),))
    finally:
        dist.destroy_process_group()


def _groups_alive() -> int:
    """The process groups this rank belongs to (the default one, and those that DeviceMeshes and new_group made)."""
    from torch.distributed import distributed_c10d as c10d
    world = getattr(c10d, "_world", None)
    return len(getattr(world, "pg_map", ()))


# A gloo process group keeps a thread polling its sockets (and two work threads) until the process ends; groups
# cannot be destroyed from task to task (torch caches DTensor sharding and flattened meshes by equal meshes, which
# would hand a later task an earlier task's destroyed group). Tasks that build meshes leave groups behind: 150 per
# rank over the suite, whose polling made its later tests 1.4x slower on 2 cores. Past this many groups on a rank
# the pool restarts its processes (a few seconds) before the next task.
MAX_GROUPS = 32


START_METHOD = "spawn" if torch.cuda.is_available() else "forkserver"


def _preload() -> list:
    """What the forkserver imports before it forks ranks: torch's distributed packages, torch._dynamo (which the
    first step of a torch.optim optimizer imports, 2.5 s), Triton, fastopt, and this folder's modules that this
    process has imported (the test modules, whose functions the ranks run)."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sorted(name for name, mod in list(sys.modules.items()) if "." not in name
                  and os.path.dirname(os.path.abspath(getattr(mod, "__file__", None) or "/")) == here)
    return ["torch", "torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo", "triton", "fastopt", *ours]


class DistPool:
    """`world_size` spawned gloo processes that run functions on request; use as a context manager."""

    def __init__(self, world_size: int, timeout: float = 120.0, env: dict | None = None,
                 start_method: str = START_METHOD):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"DistPool: world_size={world_size!r} must be an int >= 1")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"DistPool: start_method={start_method!r} must be 'spawn' or 'forkserver'")
        self.start_method = start_method
        self.world_size = world_size
        self.timeout = float(timeout)
        self.env = dict(env or {})
        self._procs: list = []
        self._task_id = 0

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(_preload())  # read when this Python process's forkserver starts
        self._dir = tempfile.mkdtemp(prefix="fastopt-dist-")
        init_file = os.path.join(self._dir, "rendezvous")
        self._tasks = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        saved = dict(os.environ)
        os.environ.update({"OMP_NUM_THREADS": "1", **self.env})
        try:  # the environment is also the forkserver's, where this starts it
            # A collective left waiting by a failed rank gives up after `timeout` too.
            self._procs = [ctx.Process(target=_worker, daemon=True,
                                       args=(r, self.world_size, init_file, self._tasks[r], self._results,
                                             self.timeout, dict(os.environ)))
                           for r in range(self.world_size)]
            for p in self._procs:
                p.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def close(self) -> None:
        """Stop the processes: politely when idle, by kill when they do not exit."""
        if not self._procs:
            return
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        shutil.rmtree(self._dir, ignore_errors=True)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join()
        self._procs = []
        shutil.rmtree(self._dir, ignore_errors=True)

    def run(self, fn, *args) -> list:
        """`[fn(rank, world_size, *args) for each rank]`, run concurrently on the process group."""
        if not self._procs:
            self._start()
        self._task_id += 1
        tid = self._task_id
        payload = pickle.dumps((fn, args))
        for q in self._tasks:
            q.put((tid, payload))
        ok: dict = {}
        failed: dict = {}
        crowded = False
        deadline = time.monotonic() + self.timeout + 30.0  # collectives time out first; this catches the rest
        while len(ok) + len(failed) < self.world_size:
            try:
                task_id, rank, success, data, groups = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if not dead and time.monotonic() < deadline:
                    continue
                missing = sorted(set(range(self.world_size)) - set(ok) - set(failed))
                codes = {r: self._procs[r].exitcode for r in dead}
                self._kill()
                msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
                why = (f"ranks {dead} exited with codes {codes}" if dead
                       else f"no answer within {self.timeout + 30:.0f}s")
                raise DistError(f"{getattr(fn, '__name__', fn)}: ranks {missing} never answered ({why}){msg}") from None
            if task_id != tid:
                continue
            (ok if success else failed)[rank] = data
            crowded = crowded or groups > MAX_GROUPS
        if failed:
            self._kill()  # ranks may disagree on where they are in the collective sequence: start afresh
            msg = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
            raise DistError(f"{getattr(fn, '__name__', fn)} failed on ranks {sorted(failed)}:{msg}")
        if crowded:
            self.close()  # the next run starts fresh processes
        return [pickle.loads(ok[r]) for r in range(self.world_size)]


def run(fn, world_size: int, *args, timeout: float = 120.0, env: dict | None = None) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh gloo processes, spawned as torchrun's are started
    (each its own interpreter, str hash seed included); per-rank results in rank order."""
    with DistPool(world_size, timeout=timeout, env=env, start_method="spawn") as pool:
        return pool.run(fn, *args)


def placement(spec):
    """A DTensor placement from its short spec: ("R",) Replicate, ("S", d) Shard(d), ("SS", d, split_factor)
    _StridedShard (FSDP2 over TP)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    if spec[0] == "R":
        return Replicate()
    if spec[0] == "S":
        return Shard(spec[1])
    return _StridedShard(spec[1], split_factor=spec[2])


def whole(t):
    """The whole tensor of DTensor `t` on every rank (a plain `t` as it is): torch's `full_tensor()`, but for
    placements that hold a `_StridedShard`, which fastopt's layout assembles from the pieces
    (`fastopt.distributed.layout.full_tensor`): torch 2.11, the GPU machine's, cannot redistribute a
    `_StridedShard` that no Shard of its dim follows (`_StridedShard(0, split_factor=2)` alone, or beside a
    Replicate: "unable to be interpreted into a corresponding shard_order"), where torch 2.13 can. Not circular
    where the tests step such params: their pieces come from torch's `distribute_tensor`, so a layout that misread
    them would put their elements in the wrong places here and fail the comparison."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from fastopt.distributed import layout_of
    from fastopt.distributed.layout import full_tensor, is_dtensor
    if not is_dtensor(t):
        return t
    if any(isinstance(pl, _StridedShard) for pl in t.placements):
        return full_tensor(t.to_local(), layout_of(t))
    return t.full_tensor()


def scaled_dtensor_step(scaler, opt, params, grads, plc, all_inf: bool) -> list[int]:
    """One `scaler.step(opt)` of torch.amp.GradScaler over DTensor params: each whole gradient of `grads`
    multiplied by the current scale (or, with `all_inf`, every element inf, so on every rank) and distributed
    with its param's (mesh, placements) of `plc`; then `scaler.update()`. Returns the indices of the params whose
    DTensor grad's local tensor is not, after the step, as torch's fused optimizers leave it (the scaled one times
    1/scale, bit for bit; as it was on the skipped step): for the caller to assert after its collectives."""
    import torch
    from torch.distributed.tensor import distribute_tensor
    scale = float(scaler.scale(torch.ones(())))
    for p, g, (m, pl) in zip(params, grads, plc):
        g = torch.full_like(g, float("inf")) if all_inf else g * scale
        p.grad = distribute_tensor(g, m, pl, src_data_rank=None)
    scaled = [p.grad.to_local().clone() for p in params]
    scaler.step(opt)
    scaler.update()
    return [k for k, (p, s) in enumerate(zip(params, scaled))
            if not torch.equal(p.grad.to_local(), s if all_inf else s * (1.0 / scale))]
