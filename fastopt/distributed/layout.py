"""How a parameter's local elements map onto its global tensor, read off the parameter itself.

A `Layout` says, for every dim of the global tensor, which global indices this rank holds (None: all of
them), and the process group over which partial statistics of this param must be summed (the ranks that
hold other pieces of it). DTensor placements give it: `Shard(d)` (tensor parallelism, FSDP2; uneven too),
`_StridedShard(d, split_factor)` (FSDP2 on top of TP) — which is not a `Shard` subclass and whose
`is_shard()` is False, so it is matched explicitly here — and `Replicate` (ignored: replicas hold the same
elements). Plain tensors have no layout: every rank holds all of it (single process, or DDP, whose
gradients are already averaged).

The global indices are computed by distributing a 1-D `arange` with the placements that act on each dim,
so they follow DTensor's own chunking rules exactly, uneven and strided shards included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Layout", "layout_of", "local"]


@dataclass(frozen=True)
class Layout:
    global_shape: tuple[int, ...]
    index: tuple[Tensor | None, ...]  # per dim: global indices held here (int64, on the param's device)
    group: object  # process group over which this param's partial statistics are summed
    group_key: tuple  # hashable identity of `group` (bucketing)

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    def dim_index(self, d: int, device) -> Tensor:
        idx = self.index[d]
        return torch.arange(self.global_shape[d], device=device) if idx is None else idx

    def batch_index(self, device) -> Tensor:
        """Global flat indices of the local matrices of a (..., R, C) param (its leading dims raveled)."""
        lead = self.global_shape[:-2]
        flat = torch.zeros(1, dtype=torch.long, device=device)
        for d, n in enumerate(lead):
            flat = (flat[:, None] * n + self.dim_index(d, device)[None, :]).reshape(-1)
        return flat


def local(t: Tensor) -> Tensor:
    """The local piece of a DTensor (sharing its storage), or `t` itself."""
    return t.to_local() if _is_dtensor(t) else t


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _shard_dim(placement) -> int | None:
    from torch.distributed.tensor.placement_types import Shard, _StridedShard
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim
    return None


@lru_cache(maxsize=None)
def _group_for(mesh, mesh_dims: tuple[int, ...]):
    if len(mesh_dims) == 1:
        return mesh.get_group(mesh_dims[0])
    if len(mesh_dims) == mesh.ndim and mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    names = mesh.mesh_dim_names
    if names is None:
        raise NotImplementedError("fastopt: a param sharded over several (not all) dims of an unnamed "
                                  "DeviceMesh; name the mesh dims (init_device_mesh(..., mesh_dim_names=...))")
    return mesh[tuple(names[d] for d in mesh_dims)]._flatten().get_group()


def layout_of(p: Tensor) -> Layout | None:
    """The layout of `p`, or None when this rank holds all of it (plain tensor, or a replicated DTensor)."""
    if not _is_dtensor(p):
        return None
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    mesh, placements = p.device_mesh, tuple(p.placements)
    sharded_mesh_dims = tuple(m for m, pl in enumerate(placements) if _shard_dim(pl) is not None)
    if not sharded_mesh_dims:
        return None
    index = []
    for d, n in enumerate(p.shape):
        acting = []
        for pl in placements:
            if _shard_dim(pl) == d:
                acting.append(_StridedShard(0, split_factor=pl.split_factor) if isinstance(pl, _StridedShard)
                              else Shard(0))
            else:
                acting.append(Replicate())
        if all(isinstance(a, Replicate) for a in acting):
            index.append(None)
            continue
        probe = torch.arange(n, dtype=torch.long, device=p.to_local().device)
        idx = distribute_tensor(probe, mesh, acting, src_data_rank=None).to_local()
        index.append(idx.clone())
    group = _group_for(mesh, sharded_mesh_dims)
    key = (id(mesh), sharded_mesh_dims)
    return Layout(tuple(p.shape), tuple(index), group, key)
