"""How a parameter's local elements map onto its global tensor, read off the parameter or declared by hand.

A `Layout` says which elements of the global tensor this rank holds, and over which process groups the
partial statistics of the param must be summed (the ranks that hold other pieces of it). Two kinds:

- dim layouts: for every dim, the global indices held here (None: all of them). DTensor placements give
  them: `Shard(d)` (tensor parallelism, FSDP2; uneven too), `_StridedShard(d, split_factor)` (FSDP2 on top
  of TP) — which is not a `Shard` subclass and whose `is_shard()` is False, so it is matched explicitly
  here — and `Replicate` (ignored: replicas hold the same elements). `declare_shard(p, ..., dim=d)` gives
  one for a plain tensor sharded by hand (Megatron-style layers).
- flat layouts: the rank holds the contiguous range [offset, offset + count) of the flattened global
  tensor (ZeRO shards: a range may start and end mid-row); local elements past `count` are padding, which
  the optimizers neither read nor write. `declare_shard(p, ..., flat_offset=o)` declares one; a flat range
  of a tensor that is itself sharded (ZeRO over TP: `FastOptimizer.setup_distributed`) has that tensor's
  layout as `base`; a range may lie partly or wholly in the padding past the end (clamped: no real elements
  there), as ZeRO gives the last ranks when the numel does not split evenly. `declare_fsdp(model)` declares
  the pieces FSDP1 (`FullyShardedDataParallel(use_orig_params=True)`) hands the optimizer as flat ranges (the
  optimizers do it themselves for the units they find: `declare_found_fsdp`).

A DTensor on a mesh without this rank (a sub-mesh) holds nothing here: its layout is `outside` (a flat range
of no elements, no group), and the optimizers skip the param on this rank (`FastOptimizer._buckets`), as DTensor's own ops
do, never joining a collective of a group it is not in.

Plain tensors without a declaration have no layout (None): every rank holds all of it (single process, or
DDP, whose gradients are already averaged).

Stable API (the optimizers and the GaLore layout support use it): `Layout` with `global_shape`, `index`,
`group`, `groups`, `group_key`, `flat`, `base`, `numel`, `count`, `outside`, `is_flat`, `dim_index`,
`batch_index`, `flat_index`, `element_map`, `factor_index`, `local_view`, `reduce`, `mesh`, `mesh_dims`, `shard_ranges`,
`shard_placements`, `fsdp`; `layout_of`, `local`, `collective`, `declare_shard`, `declare_fsdp`, `make_layout`,
`full_tensor`, `gather_to_owners`, `real_elements`, `check_cover`, `fsdp1_refusal`, `fsdp_grads`,
`declare_found_fsdp`.

A declaration is checked once, at the first step that uses it (`check_cover`): every rank of the declared groups
must declare the same global shape, and the real elements of the pieces must be every element of the global
tensor once, else a ValueError on every rank (a group larger than the ranks that hold pieces, overlapping ranges
or holes would count elements twice or not at all: silently wrong statistics; a rank alone with another global
shape would raise alone, or size its buffers otherwise, and leave the others waiting in a collective). DTensor
layouts are right by construction and are not checked.

A Layout is immutable and holds process groups: `copy.deepcopy` shares it (the groups are process-wide handles),
and pickling it raises (a process group does not pickle; save the optimizer's state_dict and declare again).
"""
from __future__ import annotations

import functools
import math
import operator
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Layout", "layout_of", "local", "is_dtensor", "collective", "declare_shard", "declare_fsdp", "make_layout",
           "full_tensor", "gather_to_owners", "real_elements", "check_cover", "fsdp1_refusal", "fsdp_grads",
           "declare_found_fsdp"]

_ATTR = "_fastopt_layout"  # where declare_shard keeps a plain tensor's declared layout


@dataclass(frozen=True, eq=False)
class Layout:
    global_shape: tuple[int, ...]
    index: tuple[Tensor | None, ...]  # dim layouts: per dim, global indices held here (int64); flat: all None
    group: object  # the first (for DTensors the only) process group over which partial statistics are summed
    group_key: tuple  # hashable identity of `groups` (bucketing: one collective per phase per key)
    flat: tuple[int, int] | None = None  # flat layouts: (offset, count) in the flattened `base` (or global)
    base: "Layout | None" = None  # flat layouts: the layout of the tensor that was flattened (None: global)
    groups: tuple = ()  # every group to sum over, in order (empty: (group,)); orthogonal groups, e.g. (tp, dp)
    mesh: object = None  # DTensor layouts: the param's DeviceMesh; `group` spans its dims `mesh_dims`
    mesh_dims: tuple[int, ...] = ()  # DTensor layouts: the mesh dims that shard the param
    outside: bool = False  # a DTensor whose mesh lacks this rank: nothing here, no group (`_outside_layout`)
    fsdp: bool = False  # an FSDP1 piece (`declare_fsdp`): whether it has a grad is agreed each step (`fsdp_grads`)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not self.groups:
            object.__setattr__(self, "groups", (self.group,))

    def __deepcopy__(self, memo):
        # Immutable, and its groups are this process's communicators: a copy of an optimizer (or of a model
        # whose tensors carry declarations) must keep summing over the very same groups.
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError("fastopt: a sharded param's Layout holds process groups, which do not pickle; save "
                        "optimizer.state_dict() instead, and declare the shards again (declare_shard / "
                        "setup_distributed) in the process that loads it")

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def is_flat(self) -> bool:
        return self.flat is not None

    @property
    def count(self) -> int:
        """Real (non-padding) elements held here."""
        if self.flat is not None:
            return self.flat[1]
        return math.prod(self.global_shape[d] if i is None else len(i) for d, i in enumerate(self.index))

    def dim_index(self, d: int, device) -> Tensor:
        """Dim layouts: the global indices of dim d held here."""
        if self.flat is not None:
            raise ValueError("Layout.dim_index: a flat layout has no per-dim indices; use flat_index")
        idx = self.index[d]
        return torch.arange(self.global_shape[d], device=device) if idx is None else idx.to(device)

    def batch_index(self, device) -> Tensor:
        """Dim layouts: global flat indices of the local matrices of a (..., R, C) param (leading dims raveled)."""
        lead = self.global_shape[:-2]
        flat = torch.zeros(1, dtype=torch.long, device=device)
        for d, n in enumerate(lead):
            flat = (flat[:, None] * n + self.dim_index(d, device)[None, :]).reshape(-1)
        return flat

    def flat_index(self, device) -> Tensor:
        """Global flat (row-major) index of every real local element, shaped like the local tensor (dim
        layouts) or 1-D of `count` (flat layouts). Cached per device."""
        key = ("flat", str(device))
        if key not in self._cache:
            if self.flat is not None:
                off, n = self.flat
                if self.base is None:
                    idx = torch.arange(off, off + n, dtype=torch.long, device=device)
                else:
                    idx = self.base.flat_index(device).reshape(-1)[off:off + n]
            else:
                idx = torch.zeros((), dtype=torch.long, device=device)
                for d, n in enumerate(self.global_shape):
                    idx = idx.unsqueeze(-1) * n + self.dim_index(d, device)
            self._cache[key] = idx
        return self._cache[key]

    def element_map(self, device) -> tuple[Tensor, int, int]:
        """`flat_index` in compact form, (table, width, shift): real local element l (row-major over the local
        tensor, or of the flat range's `count`) is global element `table[q // width] + q % width`, q = l + shift.
        Dim layouts whose last dim is held as consecutive indices (whatever the other dims hold: every `Shard`,
        and a `_StridedShard` that cuts that dim into chunks) have one table entry per local row (the global
        offset of its first element, int64) and width the local length of that dim; other dim layouts one
        entry per element (width 1). A flat range of the global tensor is ([offset], width 2**62, shift 0); one
        of a dim layout's local tensor takes that layout's map shifted by its offset. Cached per device.
        Stochastic rounding draws its noise at these offsets, so a piece rounds as the whole tensor would."""
        key = ("emap", str(device))
        if key not in self._cache:
            if self.flat is not None:
                off, n = self.flat
                if self.base is None:
                    out = (torch.tensor([off], dtype=torch.long, device=device), 1 << 62, 0)
                elif self.base.flat is None:
                    table, width, shift = self.base.element_map(device)
                    out = (table, width, shift + off)
                else:
                    out = (self.flat_index(device).reshape(-1), 1, 0)
            else:
                shape = self.global_shape
                last = self.dim_index(len(shape) - 1, device) if shape else None
                steps = None if last is None else torch.arange(len(last), dtype=torch.long, device=device)
                if last is None:  # a 0-d tensor: its one element
                    out = (torch.zeros(1, dtype=torch.long, device=device), 1, 0)
                elif len(last) and torch.equal(last, last[0] + steps):
                    table = torch.zeros((), dtype=torch.long, device=device)
                    for d, n in enumerate(shape[:-1]):
                        table = table.unsqueeze(-1) * n + self.dim_index(d, device)
                    table = table.reshape(-1) * shape[-1] + last[0]
                    out = (table, len(last), 0)
                else:
                    out = (self.flat_index(device).reshape(-1), 1, 0)
            self._cache[key] = out
        return self._cache[key]

    def factor_index(self, device) -> tuple[Tensor, Tensor]:
        """For a factored param (global shape (..., R, C)): the index of every real local element's row in
        the flattened row factor (..., R) and of its column in the flattened column factor (..., C), shaped
        like `flat_index`. Cached per device."""
        key = ("factor", str(device))
        if key not in self._cache:
            r, c = self.global_shape[-2:]
            f = self.flat_index(device)
            self._cache[key] = (f // c, (f // (r * c)) * c + f % c)
        return self._cache[key]

    def local_view(self, x: Tensor) -> Tensor:
        """The real elements of a local tensor (or of a state shaped like it), as a view: the local tensor
        itself for dim layouts, its first `count` flattened elements for flat layouts."""
        if self.flat is None:
            return x
        if not x.is_contiguous():
            raise ValueError(f"fastopt: a flat-sharded tensor must be contiguous (got strides {x.stride()})")
        return x.view(-1)[:self.flat[1]]

    def reduce(self, buf: Tensor) -> None:
        """Sum `buf` in place over every rank that holds a piece of the param: one all_reduce per group (none
        `outside` the param's mesh: this rank holds no piece)."""
        if self.outside:
            return
        for g in self.groups:
            dist.all_reduce(buf, group=g)

    def shard_ranges(self, n: int) -> list[tuple[int, int]]:
        """DTensor layouts: how a dim of size `n` of another tensor on this param's mesh, sharded with `Shard`
        on each of the mesh dims that shard this param (`shard_placements`), splits over the ranks of `group`:
        (start, size) for every rank of `group`, in group-rank order. torch.chunk's rule per mesh dim, nested
        in mesh-dim order, as DTensor cuts it (checked against DTensor for this rank). Cached per n."""
        key = ("ranges", n)
        if key not in self._cache:
            if self.mesh is None:
                raise ValueError("Layout.shard_ranges: only DTensor layouts have a mesh")
            coords = self.mesh.mesh
            out = []
            for gr in dist.get_process_group_ranks(self.group):
                at = (coords == gr).nonzero()[0].tolist()
                start, size = 0, n
                for md in self.mesh_dims:
                    k, w = at[md], coords.shape[md]
                    full = -(-size // w)
                    lo, hi = min(k * full, size), min((k + 1) * full, size)
                    start, size = start + lo, hi - lo
                out.append((start, size))
            _check_ranges(self, n, out)
            self._cache[key] = out
        return self._cache[key]

    def shard_placements(self, dim: int = 0) -> tuple:
        """DTensor layouts: `Shard(dim)` on every mesh dim that shards the param, `Replicate()` on the others:
        the placements of a tensor on this mesh cut along its `dim` over `group` (`shard_ranges`)."""
        from torch.distributed.tensor.placement_types import Replicate, Shard
        return tuple(Shard(dim) if d in self.mesh_dims else Replicate() for d in range(self.mesh.ndim))


def _check_ranges(lay: Layout, n: int, ranges: list[tuple[int, int]]) -> None:
    """Every rank's (start, size) of `shard_ranges` against DTensor's own cut for that rank's coordinate, on
    every rank alike (no rank raises alone and leaves the others in a collective). Skipped where this torch
    lacks the coordinate form of the function."""
    import inspect

    from torch.distributed.tensor import _utils
    fn = getattr(_utils, "_compute_local_shape_and_global_offset", None)
    if fn is None or "my_coordinate" not in inspect.signature(fn).parameters:
        return
    coords, placements = lay.mesh.mesh, lay.shard_placements()
    for gr, (start, size) in zip(dist.get_process_group_ranks(lay.group), ranges):
        at = (coords == gr).nonzero()[0].tolist()
        shape, offset = fn((n,), tuple(coords.shape), at, placements)
        if shape[0] != size or (size and offset[0] != start):  # an empty share's start means nothing
            raise ValueError(f"fastopt: DTensor cuts a dim of {n} into ({offset[0]}, {shape[0]}) on rank {gr}, "
                             f"fastopt computed ({start}, {size}): report this with your torch version")


def collective(new: str, old: str):
    """torch >= 2.13 names the flat collectives `*_single` and warns on the older names, which torch 2.11 has
    alone: the new name where it exists (looked up at each call, so a patched `dist` is seen)."""
    return getattr(dist, new, None) or getattr(dist, old)


# torch.compiler.disable for the optimizers' step(): eager under torch.compile (a graph break). torch's own lazy
# form where there is one (torch.optim's methods use it): torch.compiler.disable imports torch._dynamo when it
# decorates, 2.5 of the 2.8 s that `import fastopt` took after `import torch` (-X importtime, torch 2.13, 2-core
# CPU machine); this imports it at the first step, as torch.optim's first step does anyway.
eager_under_compile = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


# (dtype, shape, device) of a tensor: what a param's state, buckets and pieces were made for (one C-level call per
# param; the optimizers' and the ZeRO wrapper's per-step checks compare these)
param_meta = operator.attrgetter("dtype", "shape", "device")


def local(t: Tensor) -> Tensor:
    """The local piece of a DTensor (sharing its storage), or `t` itself."""
    return t.to_local() if is_dtensor(t) else t


@functools.lru_cache(maxsize=None)
def _dtensor_type():
    """torch's DTensor class, or () where this torch has none (isinstance is then False); looked up once: this
    runs for every param and state at every step."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return ()
    return DTensor


def is_dtensor(t) -> bool:
    return isinstance(t, _dtensor_type())


def _shard_dim(placement) -> int | None:
    from torch.distributed.tensor.placement_types import Shard, _StridedShard
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim
    return None


def _group_for(mesh, mesh_dims: tuple[int, ...]):
    # Not cached here: a DeviceMesh hashes by its ranks, so a cache would hand a mesh built after
    # destroy_process_group + init_process_group the destroyed group of an equal, older mesh. The mesh keeps
    # its own groups (and torch caches flattened meshes); a layout is built once per param and optimizer.
    if len(mesh_dims) == mesh.ndim and mesh.size() == dist.get_world_size():
        return dist.group.WORLD  # torch 2.11 gives a 1-D mesh over the world a group of its own: one bucket still
    if len(mesh_dims) == 1:
        return mesh.get_group(mesh_dims[0])
    names = mesh.mesh_dim_names
    if names is None:
        raise NotImplementedError("fastopt: a param sharded over several (not all) dims of an unnamed "
                                  "DeviceMesh; name the mesh dims (init_device_mesh(..., mesh_dim_names=...))")
    return mesh[tuple(names[d] for d in mesh_dims)]._flatten().get_group()


def _outside_layout(shape: tuple[int, ...]) -> Layout:
    """The layout of a DTensor of global `shape` on a rank outside its mesh: `to_local()` is an empty 1-D tensor
    there and the mesh has no group for this rank, so the param holds nothing here (a flat range of no elements:
    skipped by the optimizers, as DTensor's ops are no-ops on such a rank) and sums over nothing. Its global
    shape is the param's, so that checks of it (GaLore's rank) raise on these ranks as on the others. No mesh:
    its states are plain zeros, made without any group."""
    return Layout(shape, (None,) * len(shape), dist.GroupMember.NON_GROUP_MEMBER, ("outside",), flat=(0, 0),
                  outside=True)


def _dtensor_layout(p) -> Layout | None:
    return _placements_layout(p.device_mesh, tuple(p.placements), tuple(p.shape), p.to_local().device)


def strided_shard_refusal(torch_version: str) -> str | None:
    """Why fastopt refuses `_StridedShard` placements (FSDP2 over tensor parallelism) under torch
    `torch_version`, or None. Under torch 2.8 and 2.9 the tests of those layouts failed against a single process
    (relative errors 0.16 to 26, AdamW8bit's element-wise step among them, so the pieces themselves disagree
    with the layout read off the placements; which placement, not pinned down); torch 2.7 refuses their uneven
    pieces itself. From torch 2.10 on the whole suite passes."""
    from ..ops import major_minor
    if major_minor(torch_version) < (2, 10):
        return (f"fastopt needs torch >= 2.10 for _StridedShard placements (FSDP2 over tensor parallelism): under "
                f"torch {torch_version} their pieces do not match the layout fastopt reads off them")
    return None


def _placements_layout(mesh, placements: tuple, shape: tuple[int, ...], device) -> Layout | None:
    """The layout of a DTensor of global `shape` with `placements` on `mesh` (its local tensor on `device`)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if any(isinstance(pl, _StridedShard) for pl in placements):
        refusal = strided_shard_refusal(torch.__version__)
        if refusal:
            raise NotImplementedError(refusal)

    if mesh.get_coordinate() is None:  # a mesh without this rank (replicated or not): nothing here
        return _outside_layout(shape)
    sharded_mesh_dims = tuple(m for m, pl in enumerate(placements) if _shard_dim(pl) is not None)
    if not sharded_mesh_dims:
        return None
    index = []
    for d, n in enumerate(shape):
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
        probe = torch.arange(n, dtype=torch.long, device=device)
        idx = distribute_tensor(probe, mesh, acting, src_data_rank=None).to_local()
        index.append(idx.clone())
    group = _group_for(mesh, sharded_mesh_dims)
    return Layout(shape, tuple(index), group, _groups_key((group,)), mesh=mesh, mesh_dims=sharded_mesh_dims)


def layout_of(p: Tensor, *, owner: str = "fastopt.distributed.layout_of") -> Layout | None:
    """The layout of `p`: declared with `declare_shard`, else read off its DTensor placements, else, for a piece
    of a param of an FSDP1 unit, read off the unit (`declare_found_fsdp`); None when this rank holds all of it
    (plain tensor, a replicated DTensor, an FSDP1 unit that shards nothing; an FSDP1 piece whose unit is not
    found: `fsdp1_refusal` says why that cannot be stepped whole). Raises ValueError (naming `owner`) for a plain
    tensor without a declaration that views exactly the elements that a tensor declared with `declare_shard`
    viewed, in the same live storage (`torch.nn.Parameter(t)`, `t.detach()`, `t.data` or `t.view(...)` of a
    declared `t`): it would be taken for a whole tensor, its statistics silently computed over the piece alone."""
    declared = getattr(p, _ATTR, None)
    if declared is not None:
        return declared
    if is_dtensor(p):
        return _dtensor_layout(p)
    if getattr(p, "_fsdp_flattened", False) and declare_found_fsdp(p):
        return getattr(p, _ATTR, None)  # None: a whole param (NO_SHARD)
    if _DECLARED:
        _check_undeclared(p, owner)
    return None


# The memory declared by `declare_shard`: {`_elements_key` of a declared tensor: a weak reference to its
# storage}. A plain tensor without a declaration that views the same elements of the same storage is another
# tensor object made from a declared one. The storage, not the declared tensor object, is what must be alive:
# in `torch.nn.Parameter(declare_shard(t, ...))` t is freed at once, its storage lives on in the Parameter.
# An entry goes with its storage (whose address may then be reused); never keeps anything alive. One dict
# lookup per param and optimizer (`FastOptimizer._layout` caches the layouts).
_DECLARED: dict[tuple, weakref.ref] = {}


def _elements_key(t: Tensor) -> tuple | None:
    """(device, address of the first element, numel, "dense" or (shape, strides) for a non-contiguous view): the
    elements `t` views, the same for `Parameter(t)`, `t.detach()`, `t.data`, `t.view(...)`, and for no other
    param of a model (params that view one flat buffer, such as ZeRO pieces of a whole param or a contiguous param
    buffer, start at other addresses or have other sizes; strided views of other elements from the same address
    have other strides). An empty tensor (many share address 0): (device, "empty", its storage object's id,
    offset, shape). None for a meta tensor or one without storage."""
    if t.is_meta:
        return None
    try:
        if t.numel() == 0:  # many empty tensors share address 0: the storage object itself, and where in it
            return t.device, "empty", id(t.untyped_storage()), t.storage_offset(), tuple(t.shape)
        dense = "dense" if t.is_contiguous() else (tuple(t.shape), tuple(t.stride()))
        return t.device, t.data_ptr(), t.numel(), dense
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage (fake, functional)
        return None


def _forget(key: tuple, ref: weakref.ref) -> None:
    if _DECLARED.get(key) is ref:
        del _DECLARED[key]


def _remember(p: Tensor) -> None:
    """Record the memory of declared tensor `p` (`_DECLARED`)."""
    key = _elements_key(p)
    if key is None:
        return
    try:
        storage = p.untyped_storage()
        ref = _DECLARED.get(key)
        if ref is None or ref() is not storage:
            _DECLARED[key] = weakref.ref(storage, lambda r, key=key: _forget(key, r))
    except (RuntimeError, NotImplementedError, TypeError):  # no storage, or one that takes no weak reference
        pass


def _check_undeclared(p: Tensor, owner: str) -> None:
    """Raise when plain tensor `p`, which has no declaration, views exactly the elements of a declared tensor
    in the same, live, storage."""
    key = _elements_key(p)
    ref = _DECLARED.get(key) if key is not None else None
    if ref is None or ref() is None or ref() is not p.untyped_storage():
        return
    raise ValueError(
        f"{owner}: a param of local shape {tuple(p.shape)} has no declaration, but declare_shard was called on "
        "another tensor object sharing this param's storage (e.g. before wrapping it in torch.nn.Parameter, or "
        "on t where the optimizer got t.detach(), t.data or t.view(...)): declare the Parameter itself, or pass "
        "the declared tensor; undeclared, the piece would be stepped as a whole tensor, with statistics over "
        "this rank's elements alone")


def _groups_key(groups: tuple) -> tuple:
    """Params whose layouts name the same groups share a bucket, whatever the layouts' kinds: one collective
    per phase per group."""
    return ("groups",) + tuple(id(g) for g in groups)


def _check_groups(groups, owner: str) -> tuple:
    if groups is None:
        raise ValueError(f"{owner}: group=None: pass the process group of the ranks that hold the other pieces "
                         "(fastopt never assumes the whole world)")
    groups = tuple(groups) if isinstance(groups, (tuple, list)) else (groups,)
    if not groups or any(g is None for g in groups):
        raise ValueError(f"{owner}: group={groups!r} must be a process group or a non-empty tuple of them, "
                         "none of them None")
    if dist.is_available() and dist.is_initialized():
        for g in groups:  # a group without this rank would make every reduction a no-op: local, wrong statistics
            # new_group() hands non-members a sentinel, not a ProcessGroup
            if g is dist.GroupMember.NON_GROUP_MEMBER or (
                    isinstance(g, dist.ProcessGroup) and dist.get_rank(g) < 0):
                raise ValueError(f"{owner}: group={g!r} does not contain this rank ({dist.get_rank()}): pass the "
                                 "group of the ranks that hold this param's pieces, this one among them")
    return groups


def make_layout(local_shape, global_shape, group, *, dim=None, start=None, flat_offset=None, base=None,
                owner="declare_shard") -> Layout:
    """A Layout for a local tensor of `local_shape`, checked; see `declare_shard`. `base` (flat layouts only):
    the layout of the tensor that was flattened, when that tensor is itself a shard (ZeRO over TP)."""
    groups = _check_groups(group, owner)
    if not (isinstance(global_shape, (tuple, list, torch.Size)) and all(
            isinstance(n, int) and n >= 0 for n in global_shape)):
        raise ValueError(f"{owner}: global_shape={global_shape!r} must be a tuple of ints >= 0")
    global_shape = tuple(int(n) for n in global_shape)
    local_shape = tuple(local_shape)
    if (dim is None) == (flat_offset is None):
        raise ValueError(f"{owner}: pass exactly one of dim= (sharded along one dim) and flat_offset= "
                         f"(a contiguous range of the flattened tensor); got dim={dim!r}, flat_offset={flat_offset!r}")
    if dim is not None:
        nd = len(global_shape)
        if not (isinstance(dim, int) and -nd <= dim < nd):
            raise ValueError(f"{owner}: dim={dim!r} must be a dim of global_shape={global_shape}")
        dim %= nd
        if len(local_shape) != nd or any(a != b for d, (a, b) in enumerate(zip(local_shape, global_shape))
                                         if d != dim):
            raise ValueError(f"{owner}: the local shape {local_shape} must equal global_shape={global_shape} "
                             f"except along dim={dim}")
        n_loc, n = local_shape[dim], global_shape[dim]
        if start is None:
            if len(groups) != 1:
                raise ValueError(f"{owner}: start=None with several groups: pass start (the first global index "
                                 f"along dim={dim} held here)")
            # torch.chunk's rule, as DTensor's Shard: ceil(n / w) per rank, the last ones shorter or empty.
            w, r = dist.get_world_size(groups[0]), dist.get_rank(groups[0])
            size = -(-n // w)
            start = min(r * size, n)
            if n_loc != max(0, min(size, n - start)):
                raise ValueError(f"{owner}: the local size {n_loc} along dim={dim} is not torch.chunk's share "
                                 f"of {n} over {w} ranks for rank {r}; pass start= explicitly")
        if not (isinstance(start, int) and 0 <= start and start + n_loc <= n):
            raise ValueError(f"{owner}: start={start!r} must be an int with start + {n_loc} (the local size along "
                             f"dim={dim}) <= {n}")
        index = tuple(torch.arange(start, start + n_loc) if d == dim else None for d in range(nd))
        return Layout(global_shape, index, groups[0], _groups_key(groups), groups=groups)
    total = math.prod(global_shape) if base is None else base.count
    n_loc = math.prod(local_shape)
    if not (isinstance(flat_offset, int) and flat_offset >= 0):
        raise ValueError(f"{owner}: flat_offset={flat_offset!r} must be an int >= 0 (the first element held here "
                         "of the flattened tensor)")
    # A range past the end is padding, clamped to no real elements (ZeRO's last ranks when the numel does not
    # split evenly); a wrong offset leaves a hole in the cover, which `check_cover` refuses on every rank.
    flat_offset = min(flat_offset, total)
    count = min(n_loc, total - flat_offset)
    key = _groups_key(groups) if base is None else base.group_key + _groups_key(groups)
    all_groups = groups if base is None else tuple(base.groups) + groups
    return Layout(global_shape, (None,) * len(global_shape), all_groups[0], key, flat=(flat_offset, count),
                  base=base, groups=all_groups)


def declare_shard(p: Tensor, global_shape, group, *, dim: int | None = None, start: int | None = None,
                  flat_offset: int | None = None) -> Tensor:
    """Declare that plain tensor `p` is this rank's piece of a larger tensor, so that every fastopt optimizer
    gives the single-process result on it. Returns `p` (the declaration is kept on the tensor).

    Args:
        p: the local piece (a parameter sharded by hand).
        global_shape: the shape of the whole tensor.
        group: the process group of the ranks that hold the other pieces, or a tuple of orthogonal groups
            (e.g. (tp_group, dp_group)) whose product does; required: fastopt never assumes the whole world.
        dim: `p` holds the global indices [start, start + p.shape[dim]) along `dim`, all of every other dim.
        start: with `dim`, the first global index held here (default: torch.chunk's rule over `group`).
        flat_offset: instead of `dim`, `p` holds the elements [flat_offset, flat_offset + p.numel()) of the
            flattened (row-major) tensor, which may start and end mid-row; those past the end are padding (all
            of them may be: no real elements here). `p` must be contiguous: its elements in memory order. A
            wrong offset is refused at the first step, on every rank.

    Statistics over the whole tensor (row and column sums, norms) are summed over `group` with one
    collective per phase for all the params that share it. Declare on the very tensor the optimizer gets
    (`torch.nn.Parameter(t)` makes a new tensor object: declare the Parameter) and before its first step. An
    optimizer handed an undeclared tensor that views exactly the elements of a declared one
    (`torch.nn.Parameter(t)`, `t.detach()`, `t.data`, `t.view(...)`) raises ValueError by its first step
    (`layout_of`), rather than step the piece as a whole tensor; it need not be alive, its storage must (in
    `torch.nn.Parameter(declare_shard(t, ...))` the Parameter keeps it; an empty piece is matched by its storage
    object, offset and shape, so the ranks without elements refuse it too). Not caught: a view of an empty piece
    with another shape, and a copy made after the declared tensor's storage moved (`.data` replaced, resized).
    """
    if is_dtensor(p):
        raise ValueError("declare_shard: p is a DTensor; its layout is read off its placements")
    if flat_offset is not None and not p.is_contiguous():
        raise ValueError(f"declare_shard: p holds a flat range (flat_offset={flat_offset}), its elements in memory "
                         f"order, so it must be contiguous (got shape {tuple(p.shape)}, strides {p.stride()}): "
                         "declare p.contiguous() and give the optimizer that tensor")
    lay = make_layout(tuple(p.shape), global_shape, group, dim=dim, start=start, flat_offset=flat_offset)
    setattr(p, _ATTR, lay)
    _remember(p)
    return p


_FSDP_WHOLE = "_fastopt_fsdp_whole"  # declare_fsdp's mark on the params of FSDP1 units that shard nothing


def declare_fsdp(model: torch.nn.Module) -> torch.nn.Module:
    """Declare the params of every FSDP1 unit in `model` (`torch.distributed.fsdp.FullyShardedDataParallel`
    built with `use_orig_params=True`), so that every fastopt optimizer gives the single-process result on them.
    Returns `model`. `layout_of` does this itself (`declare_found_fsdp`) for the units whose pieces it is
    handed, so the optimizers need no call; calling it once after wrapping spares them the search.

    FSDP1 hands the optimizer each param as a 1-D view of the range of its flattened elements that falls in
    this rank's shard of the unit's flat parameter: it may start and end mid-row, and it is empty on ranks that
    hold none of it. Nothing on the param says which param it is a piece of: only the unit's FlatParamHandle
    knows. Each param becomes a flat range of its global tensor over the unit's process group
    (`declare_shard(..., flat_offset=...)`; under HYBRID_SHARD, the shard group: the replicas hold the same
    pieces); under FSDP1 over tensor parallelism (a unit with `device_mesh=mesh["dp"]` around DTensor params), a
    flat range of the param's TP piece, as ZeRO over TP (`setup_distributed`). A rank that holds none of a param
    gets no gradient for it from FSDP1, yet takes part in its collectives while the ranks that hold its elements
    have one: at each step the ranks of a unit agree on which of its params have a gradient somewhere
    (`fsdp_grads`: one small all_reduce, on the host where the unit's backend takes CPU tensors). Units that shard
    nothing (NO_SHARD, or a world of one) hand over whole params, marked as such. The statistics are summed over
    the unit's process group on the params' device: with `CPUOffload(offload_params=True)` that group needs a backend for CPU tensors (e.g.
    `init_process_group("cpu:gloo,cuda:nccl")`). FSDP2 (`fully_shard`) needs no declaration: its params are
    DTensors.

    Raises ValueError for a unit built with `use_orig_params=False`: it hands the optimizer one FlatParameter
    of several params' elements, whose statistics no optimizer can take apart (`fsdp1_refusal`); and for a
    model without FSDP1 units."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    units = [u for u in FullyShardedDataParallel.fsdp_modules(model) if getattr(u, "_handle", None) is not None]
    if not units:
        raise ValueError("declare_fsdp: the model has no FullyShardedDataParallel (FSDP1) unit with params; FSDP2 "
                         "(fully_shard) makes DTensor params, which need no declaration")
    for unit in units:
        if unit._handle.flat_param._params is None:
            raise ValueError("declare_fsdp: a FullyShardedDataParallel unit was built with use_orig_params=False: "
                             "it hands the optimizer one FlatParameter that concatenates several params, so no "
                             "statistic over a param (row and column factors, norms, projections) can be taken; "
                             "build it with use_orig_params=True")
        _declare_unit(unit._handle)
    return model


def _declare_unit(handle) -> None:
    """`declare_fsdp` for the params of one FSDP1 unit (its FlatParamHandle, use_orig_params=True)."""
    fp = handle.flat_param
    infos, specs = fp._shard_param_infos, getattr(fp, "_param_extensions", None) or (None,) * len(fp._params)
    if not len(fp._params) == len(fp._shapes) == len(infos) == len(specs):
        raise RuntimeError(f"declare_fsdp: FSDP1's flat parameter lists {len(fp._params)} params, "
                           f"{len(fp._shapes)} shapes, {len(infos)} shard ranges and {len(specs)} extensions: "
                           "report this with your torch version")
    for p, shape, info, spec in zip(fp._params, fp._shapes, infos, specs):
        if not handle.uses_sharded_strategy:
            setattr(p, _FSDP_WHOLE, True)
            continue
        # FSDP1 over tensor parallelism flattens a DTensor's local piece (its spec kept as the extension):
        # a flat range of that piece, as ZeRO over TP (`setup_distributed`)
        base = None if spec is None else _placements_layout(spec.mesh, tuple(spec.placements),
                                                            tuple(spec.shape), p.device)
        # the piece from FSDP1's record, not from p: a unit found in the middle of a forward holds whole params
        offset, count = (info.intra_param_start_idx, info.numel_in_shard) if info.in_shard else (math.prod(shape), 0)
        lay = make_layout((count,), tuple(shape) if base is None else base.global_shape,
                          handle.process_group, flat_offset=offset, base=base, owner="declare_fsdp")
        setattr(p, _ATTR, replace(lay, fsdp=True))
        _remember(p)


_FSDP_UNFOUND = "_fastopt_fsdp_unfound"  # the mark of an FSDP1 piece a search found no unit for: not searched again


def declare_found_fsdp(p: Tensor) -> bool:
    """For a piece `p` of a param of an FSDP1 unit (`_fsdp_flattened`, use_orig_params=True) not declared yet:
    find the FlatParamHandles alive in this process (one pass over the objects Python's collector tracks: tens of
    milliseconds for a few hundred thousand objects, once; FSDP1 keeps no way from a param to its unit) and
    declare the params of every one that holds an undeclared param (`declare_fsdp`). Every rank finds the same
    units, so all declare alike. Whether `p` is declared now, or marked whole (False for a FlatParameter,
    use_orig_params=False, which no declaration can take apart, and for a piece of no unit found)."""
    import gc

    if fsdp1_refusal(p, "") is None:
        return True
    if getattr(p, "_is_flat_param", False) or getattr(p, _FSDP_UNFOUND, False):
        return False
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    for obj in gc.get_objects():
        if issubclass(type(obj), FlatParamHandle):  # type(): isinstance would ask proxies for __class__
            params = obj.flat_param._params
            if params and any(getattr(q, _ATTR, None) is None and not getattr(q, _FSDP_WHOLE, False)
                              for q in params):
                _declare_unit(obj)
    if fsdp1_refusal(p, "") is None:
        return True
    setattr(p, _FSDP_UNFOUND, True)
    return False


def fsdp1_refusal(p: Tensor, owner: str) -> str | None:
    """Why `p` (named by `owner`, e.g. "Adafactor: param_groups[0]['params'][3]") cannot be stepped as a whole
    tensor when it is FSDP1's and not declared (`declare_fsdp`): a FlatParameter of several params, or a flat
    piece of one; None for any other tensor."""
    if (not getattr(p, "_fsdp_flattened", False) or getattr(p, _FSDP_WHOLE, False)
            or getattr(p, _ATTR, None) is not None):
        return None
    if getattr(p, "_is_flat_param", False):
        return (f"{owner} is an FSDP1 FlatParameter (FullyShardedDataParallel with use_orig_params=False): "
                "the elements of several params flattened together and sharded, whose statistics (row and column "
                "factors, norms, projections) cannot be taken apart; build the FullyShardedDataParallel units with "
                "use_orig_params=True (fastopt reads their pieces' places off them), or shard with FSDP2 "
                "(torch.distributed.fsdp.fully_shard)")
    return (f"{owner} (local shape {tuple(p.shape)}) is a piece of a param flattened and sharded by FSDP1 "
            "(FullyShardedDataParallel), and no FSDP1 unit holding it was found in this process: stepped as a "
            "whole tensor, its statistics would be taken over this rank's piece alone. Call "
            "fastopt.distributed.declare_fsdp(model) on the wrapped model, or shard with FSDP2 "
            "(torch.distributed.fsdp.fully_shard)")


def _takes_cpu(group) -> bool:
    return "gloo" in str(dist.get_backend(group))


def fsdp_grads(pieces: list) -> dict:
    """{id(p): whether some rank of its unit has a gradient for it} for FSDP1 pieces `pieces` ((param, layout) in
    the optimizer's order of params, alike on every rank). A rank that holds none of a param's elements has no
    gradient for it (FSDP1 sets it to None), yet must step the param's empty piece, and join its collectives,
    exactly when the ranks that hold its elements do: whether they have one depends on what happened since the
    backward (the user's `p.grad = None`, a param frozen or unfrozen, FSDP1's own resets in
    `summon_full_params`, `state_dict()` and forward), which only they know. So the ranks of each unit's process
    group take the maximum of every param's flag, with one all_reduce per group and step: of host integers where
    the group's backend takes CPU tensors (gloo, "cpu:gloo,cuda:nccl"), no device sync; else (NCCL alone) of a
    tensor on the params' device, read back: one device sync. (A gloo group of the same ranks would need every
    rank of the world to make it, or, made by its ranks alone, takes the name of any other group of those ranks
    made so, such as a DeviceMesh's, and hangs.)"""
    by_group: dict = {}
    for p, lay in pieces:
        by_group.setdefault(id(lay.groups[-1]), (lay.groups[-1], []))[1].append(p)
    out = {}
    for group, params in by_group.values():
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                             device="cpu" if _takes_cpu(group) else params[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        out.update(zip(map(id, params), map(bool, flags.tolist())))
    return out


def full_tensor(x: Tensor, layout: Layout | None, dst: int | None = None) -> Tensor:
    """The whole global tensor on every rank from its local piece `x` (real elements only), with one
    all_reduce per group of the layout: each rank scatters its elements into zeros, the sum assembles them
    (exactly: every element is one rank's, the others add zeros). With `dst` (a rank of the layout's last group)
    the sum over that group is a reduce onto it instead: the whole tensor on the ranks of that group rank, the
    others get partial sums. Moves the whole tensor: for tests, checkpoint tools and GaLore's projection, not
    for per-step statistics. Replicated pieces (a dim layout under a mesh dim it is replicated over) are not
    double-counted: only the layout's groups are summed over."""
    if layout is None:
        return x
    out = torch.zeros(layout.numel, dtype=x.dtype, device=x.device)
    out[layout.flat_index(x.device).reshape(-1)] = layout.local_view(x).reshape(-1)
    if dst is None:
        layout.reduce(out)
    else:
        *first, last = layout.groups
        for g in first:
            dist.all_reduce(out, group=g)
        dist.reduce(out, dst=dist.get_global_rank(last, dst), group=last)
    return out.view(layout.global_shape)


def _runs(idx: Tensor) -> list[int]:
    """[start, length, start, length, ...]: the runs of consecutive integers of a 1-D index, in order."""
    out: list[int] = []
    for x in idx.tolist():
        if out and out[-2] + out[-1] == x:
            out[-1] += 1
        else:
            out += [x, 1]
    return out


def _piece_code(lay: Layout) -> list[int]:
    """This rank's piece of a tensor as a few ints (`gather_to_owners` sends them to the other ranks): [1, offset,
    count] for a flat range of the global tensor; else 0, then per dim -1 (all of it) or the number of runs of its
    index followed by each run's (start, length). Cached on the layout."""
    if "piece_code" not in lay._cache:
        if lay.is_flat:
            code = [1, *lay.flat]
        else:
            code = [0]
            for idx in lay.index:
                runs = _runs(idx) if idx is not None else None
                code += [-1] if runs is None else [len(runs) // 2, *runs]
        lay._cache["piece_code"] = code
    return lay._cache["piece_code"]


def _read_piece(code: list[int], pos: int, shape: tuple) -> tuple[object, int, int]:
    """(where, size, next pos): one piece of `_piece_code` read at `code[pos]`, for a tensor of global `shape`;
    `where` is (offset, count) of a flat range, or per dim the global indices (None: all of them)."""
    if code[pos] == 1:
        off, count = code[pos + 1], code[pos + 2]
        return (off, count), count, pos + 3
    pos += 1
    where, size = [], 1
    for n in shape:
        k = code[pos]
        pos += 1
        if k < 0:
            where.append(None)
            size *= n
            continue
        runs = code[pos:pos + 2 * k]
        pos += 2 * k
        where.append(runs)
        size *= sum(runs[1::2])
    return where, size, pos


def _place(whole: Tensor, where, piece: Tensor) -> None:
    """whole (the global tensor) <- `piece` (flat, row-major) at `where` (`_read_piece`)."""
    if isinstance(where, tuple):
        off, count = where
        whole.view(-1)[off:off + count] = piece
        return
    nd, dev = whole.dim(), whole.device
    idx = [torch.arange(n, device=dev) if runs is None else
           torch.cat([torch.arange(s, s + k, device=dev) for s, k in zip(runs[::2], runs[1::2])])
           if runs else torch.zeros(0, dtype=torch.long, device=dev)
           for n, runs in zip(whole.shape, where)]
    if any(i.numel() == 0 for i in idx):
        return
    ix = tuple(i.view([-1 if e == d else 1 for e in range(nd)]) for d, i in enumerate(idx))
    whole[ix] = piece.view([i.numel() for i in idx])


def gather_to_owners(xs: list[Tensor], layouts: list[Layout], owners: list[int], group) -> dict[int, Tensor]:
    """The whole global tensor of each `xs[j]` (local pieces; `layouts[j]` dim layouts or flat ranges of the
    global tensor, every one over the one group `group`) on group rank `owners[j]` alone: {j: whole tensor} for
    the j this rank owns. Each rank sends each owner its real local elements, nothing else: one all_to_all for
    all of them (the bytes of this rank's pieces, about 1/world of the tensors, where a reduce of each
    zero-filled whole tensor sends (world - 1)/world of it), after two small all_gathers of every rank's
    `_piece_code`s (how many, then the codes), which say where each piece goes. In the promoted dtype of `xs`.
    An owner holds, for a moment, its tensors twice (received pieces and the assembled wholes)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    dev = xs[0].device
    dtype = xs[0].dtype
    for x in xs[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    mine = [c for lay in layouts for c in _piece_code(lay)]
    gather = collective("all_gather_single", "all_gather_into_tensor")
    lens = torch.empty(world, dtype=torch.long, device=dev)
    gather(lens, torch.tensor([len(mine)], dtype=torch.long, device=dev), group=group)
    lens = lens.tolist()
    codes = torch.zeros(world * max(lens), dtype=torch.long, device=dev)
    sent = torch.zeros(max(lens), dtype=torch.long, device=dev)
    sent[:len(mine)] = torch.tensor(mine, dtype=torch.long)
    gather(codes, sent, group=group)
    codes = codes.view(world, max(lens)).tolist()
    pieces = []  # pieces[k][j] = (where, size) of rank k's piece of xs[j]
    for k in range(world):
        pos, row = 0, []
        for lay in layouts:
            where, size, pos = _read_piece(codes[k], pos, lay.global_shape)
            row.append((where, size))
        pieces.append(row)
    order = sorted(range(len(xs)), key=lambda j: owners[j])  # grouped by destination, in order within each
    send = torch.cat([layouts[j].local_view(xs[j]).reshape(-1).to(dtype) for j in order]) if xs else \
        torch.zeros(0, dtype=dtype, device=dev)
    in_splits = [sum(pieces[me][j][1] for j in range(len(xs)) if owners[j] == o) for o in range(world)]
    owned = [j for j in order if owners[j] == me]
    out_splits = [sum(pieces[k][j][1] for j in owned) for k in range(world)]
    recv = torch.empty(sum(out_splits), dtype=dtype, device=dev)
    dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    out, pos = {}, 0
    for j in owned:
        out[j] = torch.zeros(layouts[j].global_shape, dtype=dtype, device=dev)
    for k in range(world):
        for j in owned:
            where, size = pieces[k][j]
            _place(out[j], where, recv[pos:pos + size])
            pos += size
    return out


def real_elements(params: list, grads: list, states: list[dict], layouts: list | None, elementwise: tuple,
                  absmax: dict | None = None) -> tuple[list, list, list]:
    """Views of the real elements of every flat-sharded param of a bucket (padding cut off), of its grad and
    of its element-wise states (`elementwise` keys, shaped like the local tensor); 8-bit scale keys in
    `absmax` ({key: block_size}) are cut to the blocks of the real elements (blocks start at element 0, so
    the first ones are the same blocks). Params of other layouts pass through unchanged."""
    if layouts is None or not any(lay is not None and lay.is_flat for lay in layouts):
        return params, grads, states
    absmax = absmax or {}
    ps, gs, ss = [], [], []
    for p, g, s, lay in zip(params, grads, states, layouts):
        if lay is None or not lay.is_flat:
            ps.append(p), gs.append(g), ss.append(s)
            continue
        view = dict(s)
        for k in elementwise:
            if k in s:
                view[k] = lay.local_view(s[k])
        for k, block in absmax.items():
            if k in s:
                view[k] = s[k][:-(-lay.count // block)]
        ps.append(lay.local_view(p)), gs.append(lay.local_view(g)), ss.append(view)
    return ps, gs, ss


# ---- declarations: every element once ----------------------------------------------------------------------
_CHECKSUM_MOD = (1 << 31) - 1  # index sums are compared modulo this prime: any world size sums them in int64
_SHAPE_MOD = (1 << 61) - 1  # global shapes are compared by a fingerprint modulo this prime, in 3 limbs of 21 bits
_LIMB = 21  # a limb's square (< 2**42) summed over fewer than 2**21 ranks fits in int64


def _shape_limbs(shape: tuple[int, ...]) -> list[int]:
    """A fingerprint of a global shape (its ndim and sizes in base 1_000_003 modulo a 61-bit prime: exact for up
    to 2 dims below 1_000_003, a hash beyond) as three 21-bit limbs, then their squares. Summed over W ranks,
    each limb l gives W * l and each square W * l**2 on every rank exactly when all ranks have the same
    fingerprint: sum(l**2) - sum(l)**2 / W is W times the variance of the limb over the ranks. (The sum alone
    would pass a rank whose shape is the mean of the others', leaving it to step while they raise.)"""
    h = len(shape)
    for n in shape:
        h = (h * 1_000_003 + n) % _SHAPE_MOD
    limbs = [(h >> (_LIMB * k)) & ((1 << _LIMB) - 1) for k in range(3)]
    return limbs + [x * x for x in limbs]


def _index_prefix_sum(lay: Layout, m: int) -> int:
    """The sum of the global flat indices of the first `m` real local elements of `lay` (row-major over the
    local piece for dim layouts, in order for flat ones), exactly (python ints), without an index tensor."""
    if m <= 0:
        return 0
    if lay.flat is not None:
        off = lay.flat[0]
        if lay.base is None:
            return m * off + m * (m - 1) // 2
        return _index_prefix_sum(lay.base, off + m) - _index_prefix_sum(lay.base, off)
    shape = lay.global_shape
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    idx = [range(n) if i is None else i.tolist() for n, i in zip(shape, lay.index)]
    sizes = [len(i) for i in idx]

    def whole(d: int) -> int:  # the sum over the full sub-product of dims d..
        return sum(sum(idx[e]) * strides[e] * math.prod(sizes[f] for f in range(d, len(sizes)) if f != e)
                   for e in range(d, len(sizes)))

    def prefix(d: int, k: int) -> int:
        if k <= 0 or d == len(sizes):
            return 0
        rest = math.prod(sizes[d + 1:])
        q, r = divmod(k, rest)
        out = rest * sum(idx[d][:q]) * strides[d] + q * whole(d + 1)
        if r:
            out += r * idx[d][q] * strides[d] + prefix(d + 1, r)
        return out

    return prefix(0, m)


def check_cover(layouts: list, names: list[str], device, owner: str) -> None:
    """Check, with one all_reduce per group for all of them, that the ranks of the groups of each declared layout
    in `layouts` (all with the same groups; `names[i]` says which param each is) declare one global shape
    (`_shape_limbs`), and that their pieces hold every element of the global tensor exactly once: the real
    elements must count the global numel, and their global flat indices must sum (modulo a prime) to
    0 + 1 + ... + (numel - 1), which catches overlapping pieces that leave as many holes. Raises ValueError on
    every rank, for the same param (all see the same sums, and a disagreement on a shape is seen by all); marks
    the layouts checked, so that a layout costs this once, at the first step that uses it. Skipped without an
    initialized process group or when every group has one rank (nothing to sum over)."""
    if not layouts:
        return
    lay0 = layouts[0]
    if (dist.is_available() and dist.is_initialized()
            and all(isinstance(g, dist.ProcessGroup) for g in lay0.groups)
            and any(dist.get_world_size(g) > 1 for g in lay0.groups)):
        rows = [[lay.count, _index_prefix_sum(lay, lay.count) % _CHECKSUM_MOD, *_shape_limbs(lay.global_shape)]
                for lay in layouts]
        buf = torch.tensor(rows, dtype=torch.int64, device=device)
        lay0.reduce(buf)
        sizes = " x ".join(str(dist.get_world_size(g)) for g in lay0.groups)
        world = math.prod(dist.get_world_size(g) for g in lay0.groups)
        for lay, name, mine, (count, checksum, *shape_sums) in zip(layouts, names, rows, buf.tolist()):
            if any(total != world * x for total, x in zip(shape_sums, mine[2:])):
                raise ValueError(f"{owner}: {name} is declared with global shape {lay.global_shape} here and with "
                                 f"another on some rank of its group of {sizes} ranks: the ranks disagree on its "
                                 "global shape; declare the same global shape on every rank that holds a piece")
            n = lay.numel
            # each rank's sum is reduced modulo the prime, their sum over the ranks is not (yet)
            if count == n and checksum % _CHECKSUM_MOD == (n * (n - 1) // 2) % _CHECKSUM_MOD:
                continue
            why = (f"hold {count} of its elements in all, not its {n}" if count != n else
                   f"hold {n} elements in all, but some twice and others not at all (overlapping ranges)")
            raise ValueError(f"{owner}: {name} of global shape {lay.global_shape} is declared over a group of "
                             f"{sizes} ranks whose pieces {why}: declare it over exactly the ranks that hold its "
                             "pieces (replicas of a piece belong to other groups), with pieces that cover it once")
    for lay in layouts:
        lay._cache["covered"] = True
