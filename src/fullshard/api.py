"""fully_shard(): the FSDP2-style entry point of the sharding core (its steps are init.py's,
the methods units get module.py's), register_fsdp_forward_method and share_comm_ctx."""

from __future__ import annotations

import functools

import torch
from torch import nn

from fullshard.errors import fail
from fullshard.hooks import hooks_on
from fullshard.init import shard_unit
from fullshard.module import FSDPModule, hooks_of
from fullshard.options import Schedule, after_forward
from fullshard.policy import MixedPrecisionPolicy, OffloadPolicy, checked_policies


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` (e.g. Hugging Face's ``generate``) gather and free the
    unit's parameters around it as its forward does, for methods that compute without
    calling ``forward`` through ``__call__``.

    Args:
        module: a module ``fully_shard`` made a unit.
        method_name: the method to wrap, on this module object.
    """
    if not isinstance(module, FSDPModule):
        raise fail(f"register_fsdp_forward_method needs a unit, got a {type(module).__name__}",
                   "Call fully_shard (or shard_model) on the module first.")
    every, original = hooks_on(module), getattr(module, method_name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        for hooks in every:
            args, kwargs = hooks.pre_forward(module, args, kwargs)
        output = original(*args, **kwargs)
        for hooks in reversed(every):
            output = hooks.post_forward(module, args, output)
        return output

    setattr(module, method_name, wrapped)

def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2's call to make several roots (pipeline stages' model chunks) share their
    communication streams. fullshard's streams are one set per device for the whole process
    (runtime.side_stream), shared by every root already, so this checks its argument only.

    Args:
        modules: units (``FSDPModule``), as FSDP2 takes them.
    """
    hooks_of(modules, "share_comm_ctx")

def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: torch.distributed.device_mesh.DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = True,
    shard_placement_fn=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims=None,
) -> nn.Module:
    """Make `module` one unit: its parameters (those no inner unit owns) are sharded together.

    Apply bottom-up: inner modules first, the root last. Afterwards every managed
    parameter is an ``nn.Parameter`` wrapping a ``DTensor`` sharded ``Shard(0)`` (or the
    dim ``shard_placement_fn`` gives) over the mesh's shard dimension (``Replicate()`` over
    a replicate dimension), so an optimizer built from ``model.parameters()`` steps on
    shards. Before the unit's forward and backward one all-gather rebuilds the full
    parameters; after its backward one reduce-scatter leaves each rank the average
    gradient of its shard. The module's
    buffers move to the compute device (in place: the buffer objects stay the same, so
    references to them stay valid); they are not sharded.

    Args:
        module: the module to shard; it is returned, with its class swapped to a subclass
            of both ``FSDPModule`` and its own class. A list of modules becomes one unit,
            gathered before the first of them runs and freed after the last (as FSDP2's).
        mesh: ``None`` for a 1-D mesh over the default process group; a 1-D ``DeviceMesh``
            (dims named ``("replicate",)`` replicate instead of sharding); or a 2-D mesh with
            dims ``("replicate", "shard")`` for hybrid sharding. With tensor parallelism it
            is the data-parallel dims of a larger mesh (``mesh_2d["dp"]``), and parameters
            that are DTensors on its TP dim are sharded further (docs/composition.md).
        reshard_after_forward: ``True`` frees the full parameters after forward and gathers
            them again for backward; ``False`` keeps them until the end of backward; an
            ``int`` k keeps 1/k of them, so the gather before backward stays inside groups
            of k consecutive ranks (e.g. a node); ``None`` (FSDP2's default) is ``True``, the
            root keeping them either way. A forward without autograd (``torch.no_grad()``)
            always frees them.
        shard_placement_fn: FSDP2's per-parameter placement: a function of each parameter
            returning ``Shard(d)`` to split it along dim d (a negative d counts from the
            last), ``None`` for ``Shard(0)``, or torch's ``ShardPlacementResult(placement,
            mesh_info)`` to shard it over another mesh as well (an ``FSDPMeshInfo`` of a 1-D
            mesh, or an ``HSDPMeshInfo`` of a 2-D one; Note [meshes of one call]).
        mp_policy: a :class:`MixedPrecisionPolicy` (torch's own is taken too).
        offload_policy: a :class:`CPUOffloadPolicy`, or :class:`OffloadPolicy` for none
            (torch's own are taken too).
        ignored_params: parameters under `module` that stay as they are: not sharded, not
            moved, their gradients not reduced.
        dp_mesh_dims: FSDP2's (torch 2.13) ``DataParallelMeshDims``: ``mesh`` is then the full
            mesh, every parameter a DTensor on it replicated over the dims named here (shard
            dims, and replicate dims for hybrid sharding), with at most one other dim (tensor
            parallelism). While full, parameters are DTensors on that mesh again.

    Raises:
        FullShardError: before anything changes, on any argument fully_shard does not take
            (each error says what and how to fix it), e.g. when the module is already sharded,
            a parameter belongs to another unit, this rank is not in the mesh, ranks hold
            different parameters, or the parameters are on different devices.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise fail(f"fully_shard takes a module or a non-empty list of modules, got {module!r:.80}",
                   "Pass e.g. model.layers[0], or [model.norm, model.output] to shard them as one unit.")
    what = type(modules[0]).__name__ if len(modules) == 1 else \
        f"group [{', '.join(type(m).__name__ for m in modules)}]"
    if any(isinstance(m, FSDPModule) for m in modules):
        raise fail(f"this {what} is already sharded",
                   "Call fully_shard once per module, inner modules first and the root last.")
    if type(reshard_after_forward) not in (bool, int, type(None)):  # refused before any work
        after_forward(reshard_after_forward, 1, True)
    mp_policy, offload_policy = checked_policies(mp_policy, offload_policy)
    if ignored_params is not None and not all(isinstance(p, nn.Parameter) for p in ignored_params):
        raise fail("ignored_params must be a set of the module's nn.Parameters", "Pass e.g. {model.head.weight}.")
    shard_unit(modules, what, mesh=mesh, reshard_after_forward=reshard_after_forward,
               shard_placement_fn=shard_placement_fn, mp_policy=mp_policy, offload_policy=offload_policy,
               ignored=ignored_params or (), dp_mesh_dims=dp_mesh_dims, exclude=(), schedule=Schedule())
    return module
