"""The data-parallel DeviceMesh: build it, validate it, and read off the facts a unit needs."""

from __future__ import annotations

import atexit
import functools
import gc
import os
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard.errors import collective_failed, fail


@dataclass(frozen=True)
class ShardGroup:
    """Who holds which rows of a unit: `world` ranks share one copy, `replicas` copies exist.

    `shard_pg` is None when one rank holds whole parameters (world 1), `replicate_pg`
    is None when there is one copy; collectives over a missing group are skipped.
    """

    mesh: DeviceMesh
    device: torch.device
    shard_pg: dist.ProcessGroup | None
    replicate_pg: dist.ProcessGroup | None
    rank: int
    world: int
    replicas: int
    sharded_placements: tuple[Placement, ...]  # for parameters with a dim 0
    replicated_placements: tuple[Placement, ...]  # for 0-d parameters

    @property
    def process_groups(self) -> list[dist.ProcessGroup]:
        """The groups a unit communicates over: its shard group and replicate group, where they exist."""
        return [pg for pg in (self.shard_pg, self.replicate_pg) if pg is not None]

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The mesh of the shard dim alone (the last dim of a hybrid mesh), as FSDP2 gives its
        all-gather extensions."""
        return self.mesh if self.mesh.ndim == 1 else self.mesh[self.mesh.mesh_dim_names[-1]]

    @property
    def dp_size(self) -> int:
        """Ranks that each compute on their own data: gradients are averaged over them."""
        return self.world * self.replicas


# Note [mesh identity]: a DeviceMesh compares and hashes by its ranks, layout, device type and
# dim names, not by its process groups: two init_device_mesh calls of one shape make equal
# meshes, each with groups of its own. What fullshard derives from a mesh is therefore kept by
# the mesh object (its id, while it lives), never looked up by equality: an equal older mesh,
# alive on one rank (its model not yet garbage-collected) and gone on another, would give the
# ranks of one group different process groups (a new model's gradients on the old mesh's
# groups on some ranks only), and their DTensor collectives would wait for each other for the
# groups' timeout (30 minutes for the groups a DeviceMesh makes).
_derived: dict[int, tuple[weakref.ref, dict]] = {}  # id(mesh) -> (mesh, {key: what fullshard made of it})
_timed_groups: dict[timedelta, dist.ProcessGroup] = {}  # of every rank: no mesh's, the process's


REPLICA_OF = "_fullshard_replica_of"  # set on a model by fullshard.DiLoCo


@dataclass(frozen=True)
class ReplicaOf:
    """A model that is one of several replica groups' in the job (fullshard.DiLoCo): the groups
    its gradient norm is summed over, the group of its own ranks (its checkpoints' agreements,
    Note [replica checkpoints]) and the group of the ranks that hold its shards in the other
    replica groups."""

    norm_groups: list
    own: dist.ProcessGroup
    replicas: dist.ProcessGroup


def replica_of(model: torch.nn.Module) -> ReplicaOf | None:
    return getattr(model, REPLICA_OF, None)


def _forget(mesh_id: int, ref: weakref.ref) -> None:
    """Drop what was derived from a mesh that is gone (not an entry of a newer mesh with its id)."""
    entry = _derived.get(mesh_id)
    if entry is not None and entry[0] is ref:
        del _derived[mesh_id]


def of_mesh(mesh: DeviceMesh, key, make: Callable[[], object]):
    """What fullshard derives from `mesh` under `key` (its spanned dims, its smaller groups, its
    join with a TP mesh): made once, kept with this mesh object and dropped with it (Note [mesh
    identity]: never another, equal mesh's)."""
    entry = _derived.get(id(mesh))
    if entry is None or entry[0]() is not mesh:
        entry = _derived[id(mesh)] = (weakref.ref(mesh, functools.partial(_forget, id(mesh))), {})
    derived = entry[1]
    if key not in derived:
        derived[key] = make()
    return derived[key]


def timed_group(timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group of every rank whose collectives give up after `timeout`, for the
    collectives of code we call but do not write (torch.distributed.checkpoint's): made
    once per timeout, by every rank (creating it is itself collective)."""
    if timeout not in _timed_groups:
        try:
            _timed_groups[timeout] = dist.new_group(backend="gloo", timeout=timeout)
        except RuntimeError as e:  # the store's wait for the other ranks timed out
            raise collective_failed("creating a process group", e, "Every rank must make the same call (a save, "
                                    "load or state dict); another rank did not, or died. Restart the job.",
                                    timeout) from None
    return _timed_groups[timeout]


def _release_groups() -> None:
    """Free the process groups fullshard holds while the interpreter is still whole.

    # Note [exit]: a sharded model sits in reference cycles (hooks point back at their
    # modules), so it is usually freed by the interpreter's last garbage collection inside
    # its shutdown, and with it the gloo process groups its units hold. A gloo group
    # destroyed there aborts the process now and then ("terminate called without an active
    # exception" from a gloo thread; 4 of 33 exits of 2-rank jobs with torch 2.13, none
    # of 90 with this). Collecting at exit, before the shutdown, frees them first.
    """
    _derived.clear()
    _timed_groups.clear()
    gc.collect()


atexit.register(_release_groups)


def smaller_group(group: ShardGroup, size: int) -> dist.ProcessGroup | None:
    """This rank's group of `size` consecutive ranks of its shard group (reshard_after_forward
    as an int: within a node when `size` is the ranks per node); None for size 1.

    Every rank creates every such group of the mesh, as torch.distributed requires, once
    per process.
    """
    if size == 1:
        return None
    def make() -> dict[int, dist.ProcessGroup]:
        rows = group.mesh.mesh.reshape(-1, group.world).tolist()  # each row: one shard group's global ranks
        blocks = [row[i : i + size] for row in rows for i in range(0, group.world, size)]
        return {rank: pg for ranks in blocks for pg in [dist.new_group(ranks)] for rank in ranks}

    return of_mesh(group.mesh, ("groups of", size), make).get(dist.get_rank())


def default_device_type() -> str:
    """GPU when the process group speaks NCCL and a GPU is present, else CPU."""
    backend = str(dist.get_backend())
    return "cuda" if torch.cuda.is_available() and "nccl" in backend else "cpu"


def compute_device(device_type: str) -> torch.device:
    """This rank's device: the current GPU (checked against LOCAL_RANK), or the CPU."""
    if device_type != "cuda":
        return torch.device(device_type)
    current = torch.cuda.current_device()
    check_local_gpu(current, os.environ.get("LOCAL_RANK"), torch.cuda.device_count())
    return torch.device("cuda", current)


def check_local_gpu(current: int, local_rank: str | None, visible: int) -> None:
    """Refuse a rank whose current GPU is not its LOCAL_RANK's: GPU LOCAL_RANK modulo the
    GPUs it sees (one per rank, or several ranks sharing the visible set, each on its own
    one); every rank left on cuda:0 shares one GPU and runs silently slow (or out of memory)."""
    if local_rank is None or visible < 1 or not local_rank.isdigit():
        return
    expected = int(local_rank) % visible
    if current == expected:
        return
    raise fail(
        f"rank {dist.get_rank() if dist.is_initialized() else '?'} has LOCAL_RANK={local_rank} but computes on "
        f"cuda:{current} (of {visible} GPUs it sees), not cuda:{expected}: ranks of a node would share a GPU",
        "Call torch.cuda.set_device(int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()) before "
        "init_process_group and sharding, or give each rank one GPU with CUDA_VISIBLE_DEVICES.",
    )


def require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise fail(
            "fullshard needs an initialized torch.distributed process group",
            'Call torch.distributed.init_process_group("gloo") (CPU) or ("nccl") (GPUs) '
            "first, e.g. under torchrun; a single process can use world_size=1.",
        )


def build_mesh(mesh_dims: tuple[str, ...]) -> DeviceMesh:
    """A mesh over every rank with the given roles; hybrid shards within the ranks of one
    node (LOCAL_WORLD_SIZE)."""
    require_process_group()
    world = dist.get_world_size()
    device_type = default_device_type()
    if mesh_dims != ("replicate", "shard"):
        return init_device_mesh(device_type, (world,), mesh_dim_names=mesh_dims)
    shard_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if shard_size < 1 or world % shard_size:
        raise fail(
            f"hybrid sharding over groups of {shard_size} ranks does not divide the world size {world}",
            "Set LOCAL_WORLD_SIZE to the ranks per node, or pass a 2-D mesh "
            'init_device_mesh(device, (replicas, shard_size), mesh_dim_names=("replicate", "shard")).',
        )
    return init_device_mesh(
        device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
    )


def mesh_roles(mesh: DeviceMesh) -> tuple[str, ...]:
    """Role of each mesh dim: a 1-D mesh shards (unless named ("replicate",)), a 2-D mesh replicates
    over its first dim and shards over its second."""
    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        if names in (None, ("shard",), ("replicate",)):
            return names or ("shard",)
        return ("shard",)
    if mesh.ndim == 2:  # as FSDP2: by position, whatever the names (e.g. ("dp_replicate", "dp_shard"))
        return ("replicate", "shard")
    raise fail(
        f"a data-parallel mesh must be 1-D, or 2-D (replicate, shard); got {mesh.ndim}-D with dims {names}",
        'Build it with init_device_mesh(device, (replicas, shard_size), mesh_dim_names=("replicate", "shard")).',
    )


def spanned_dims(mesh: DeviceMesh) -> frozenset[int]:
    """The dims of `mesh`'s root mesh that it reaches along from this rank, found by ranks (so a
    flattened dim counts as the dims it joins); worked out once per mesh, when a unit is made:
    a mesh tensor read in a training step would look like a host sync."""
    def make() -> frozenset[int]:
        root = mesh._get_root_mesh()
        if root is mesh:
            return frozenset(range(root.ndim))
        ranks, coordinate = set(mesh.mesh.flatten().tolist()), root.get_coordinate()
        neighbours = {k: [*coordinate[:k], (coordinate[k] + 1) % root.size(k), *coordinate[k + 1 :]]
                      for k in range(root.ndim) if root.size(k) > 1}
        return frozenset(k for k, other in neighbours.items() if root.mesh[tuple(other)].item() in ranks)

    return of_mesh(mesh, "spanned dims", make)


def replica_dims(meshes: list[DeviceMesh]) -> dict[DeviceMesh, set[int]]:
    """Per root mesh, the dims along which ranks hold copies of what a parameter not split over
    them holds: those `meshes` (a model's units' data-parallel meshes and its TP meshes) span."""
    dims: dict[DeviceMesh, set[int]] = {}
    for mesh in meshes:
        dims.setdefault(mesh._get_root_mesh(), set()).update(spanned_dims(mesh))
    return dims


def counted_copy(mesh: DeviceMesh, copies: dict[DeviceMesh, set[int]], spans: bool = True) -> bool:
    """Whether a global sum counts this rank's piece of a value on `mesh` (`spans` False: a plain
    tensor, on no dim of it): only at coordinate 0 of the dims in `copies` (replica_dims of the
    model) it does not span, whose ranks hold copies; along any other dim (pipeline stages)
    ranks hold other parts."""
    root = mesh._get_root_mesh()
    coordinate, spanned = root.get_coordinate(), spanned_dims(mesh) if spans else frozenset()
    return all(coordinate[k] == 0 for k in copies.get(root, set()) - spanned)


def spmd_layout(group: ShardGroup, tp: DTensorSpec | None, zero_dim: bool,
                dim: int = 0) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of a parameter's shard split along `dim`: the data-parallel
    ones, then (for a tensor-parallel DTensor, Note [tensor parallel parameters]) the TP mesh's."""
    dp = group.replicated_placements if zero_dim else group.sharded_placements
    if dim:
        dp = tuple(Shard(dim) if isinstance(p, Shard) else p for p in dp)
    if tp is None:
        return group.mesh, dp
    split = 1  # TP shards of dim 0 that the dp split goes inside
    for tp_dim, placement in enumerate(tp.placements):
        if placement.is_shard(0):
            split *= tp.mesh.size(tp_dim)
    if split > 1:
        dp = tuple(_StridedShard(0, split_factor=split) if isinstance(p, Shard) else p for p in dp)
    return spmd_mesh(group.mesh, tp.mesh), (*dp, *tp.placements)


def spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of both dims (dp's, then TP's), made once per pair; RuntimeError when they are
    not distinct dims of one mesh."""
    def make() -> DeviceMesh:
        joined = DeviceMesh._concatenate([dp_mesh, tp_mesh])
        spanned_dims(joined)  # for clip_grad_norm_, now rather than in a training step
        return joined

    return of_mesh(dp_mesh, ("joined with", id(tp_mesh), tp_mesh), make)  # this TP mesh (Note [mesh identity])


def spmd_dp_mesh(mesh: DeviceMesh, dims) -> tuple[DeviceMesh, frozenset[int], str | None]:
    """FSDP2's dp_mesh_dims (torch 2.13) on a full SPMD mesh: the data-parallel mesh it names (its
    shard dims flattened into one, then its replicate dims likewise before them for hybrid
    sharding), the indices of those dims in `mesh`, and the one other dim (tensor parallelism),
    if any (Note [SPMD meshes], param.py)."""
    shard, replicate = tuple(getattr(dims, "shard_names", ())), tuple(getattr(dims, "replicate_names", ()))
    names = mesh.mesh_dim_names or ()
    others = [name for name in names if name not in shard + replicate]
    if not shard or any(name not in names for name in shard + replicate) or len(others) > 1:
        raise fail(f"dp_mesh_dims={dims!r} on a mesh of dims {names}: fullshard takes shard dims (and replicate "
                   f"dims) that are named dims of the mesh, and at most one other dim (tensor parallelism)",
                   "Name the shard dims, e.g. DataParallelMeshDims(shard=\"dp\"), of a mesh built with "
                   "mesh_dim_names; or pass mesh=mesh[\"dp\"] with tensor-parallel DTensors on mesh[\"tp\"].")

    def one(group: tuple[str, ...]) -> DeviceMesh:
        return mesh[group[0]] if len(group) == 1 else mesh[group]._flatten("_".join(group))

    dp = DeviceMesh._concatenate([one(replicate), one(shard)]) if replicate else one(shard)
    return dp, frozenset(names.index(name) for name in shard + replicate), others[0] if others else None


def check_tp_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, placements: tuple, fqn: str) -> None:
    """Refuse a tensor-parallel DTensor parameter that fullshard cannot shard further over `dp_mesh`."""
    if tp_mesh.ndim != 1 or not all(p.is_shard() or p.is_replicate() for p in placements) or \
            any(isinstance(p, _StridedShard) for p in placements):
        raise fail(f"parameter {fqn!r} is a DTensor on a {tp_mesh.ndim}-D mesh with placements {placements}; "
                   f"fullshard shards DTensors of 1-D tensor parallelism (Shard or Replicate placements)",
                   "Apply tensor parallelism over one mesh dim (parallelize_module(module, mesh_2d['tp'], plan)), "
                   "then fully_shard(module, mesh=mesh_2d['dp']).")
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise fail(f"parameter {fqn!r} is a tensor-parallel DTensor, and the data-parallel and TP meshes must "
                   f"be named dims of one mesh", 'Build init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", '
                   '"tp")) and pass mesh_2d["dp"] to fully_shard, mesh_2d["tp"] to parallelize_module.')
    try:
        spmd_mesh(dp_mesh, tp_mesh)
    except RuntimeError as e:
        raise fail(f"parameter {fqn!r}: its TP mesh {tp_mesh.mesh_dim_names} and the data-parallel mesh "
                   f"{dp_mesh.mesh_dim_names} are not distinct dims of one mesh ({e})",
                   'Slice both from one mesh: mesh_2d["dp"] for fully_shard, mesh_2d["tp"] for tensor '
                   "parallelism.") from None


def shard_group(mesh: DeviceMesh | None) -> ShardGroup:
    """Validate `mesh` (None: 1-D over the default process group) and describe it."""
    require_process_group()
    if mesh is None:
        mesh = init_device_mesh(default_device_type(), (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise fail(f"mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}",
                   "Build one with torch.distributed.device_mesh.init_device_mesh.")
    if mesh.get_coordinate() is None:
        raise fail(
            f"rank {dist.get_rank()} is not in the mesh {mesh}",
            "Pass each rank a mesh it is in: the data-parallel dims of a mesh over every rank (e.g. "
            'mesh_3d["dp"] of a (pp, dp, tp) mesh), or a mesh of the group of ranks it trains with.',
        )
    roles = mesh_roles(mesh)
    groups = {role: mesh.get_group(dim) for dim, role in enumerate(roles)}
    sizes = {role: mesh.size(dim) for dim, role in enumerate(roles)}
    world = sizes.get("shard", 1)
    replicas = sizes.get("replicate", 1)
    placements = {"shard": Shard(0), "replicate": Replicate()}
    return ShardGroup(
        mesh=mesh,
        device=compute_device(mesh.device_type),
        shard_pg=groups["shard"] if world > 1 else None,
        replicate_pg=groups["replicate"] if replicas > 1 else None,
        rank=mesh.get_local_rank(roles.index("shard")) if "shard" in roles else 0,
        world=world,
        replicas=replicas,
        sharded_placements=tuple(placements[role] for role in roles),
        replicated_placements=tuple(Replicate() for _ in roles),
    )
