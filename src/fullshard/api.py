"""fully_shard() and FSDPModule: the FSDP2-style public surface of the sharding core."""

from __future__ import annotations

import dataclasses
import functools
import gc
import zlib
from datetime import timedelta
from typing import Iterable

import torch
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from fullshard import runtime
from fullshard.collectives import all_gather_ints, all_gather_json

from fullshard.errors import fail
from fullshard.hooks import (HOOKS_ATTR, Phase, Schedule, UnitHooks, hooks_for, hooks_on, normal_tensors, unit_hooks,
                             units_under)
from fullshard.mesh import ShardGroup, check_tp_mesh, shard_group, spmd_dp_mesh
from fullshard.param import local_values
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fullshard.runtime import CollectiveError
from fullshard.unit import OwnedParam, Unit, UnitConfig, unit_of

# Original parameter -> description of the unit that took it. A parameter registered in
# two units would get two independent shards that silently drift apart (the failure of
# tied weights split across units), so a second unit asking for it is refused.
_OWNER = WeakIdKeyDictionary()  # weak, by identity: tensors compare elementwise
_optimizer_hook = None  # check_optimizer_step's handle, once registered


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` makes the parameters full."""

    def __init__(self, units: list[Unit]) -> None:
        self._units = units

    @normal_tensors
    def wait(self) -> None:
        for unit in self._units:
            unit.wait_unshard()


# FSDP2's FSDPModule methods fullshard does not offer, each with why (set on FSDPModule below it)
NOT_OFFERED = {
    "set_custom_all_gather": "a unit's gather is fullshard's own (one all-gather, or point-to-point on gloo), "
                             "not a pluggable collective",
    "set_custom_reduce_scatter": "a unit's reduction is fullshard's own; set_all_reduce_hook runs your code on "
                                 "its result",
    "set_post_optim_event": "the gathers wait for the compute stream, which the optimizer step ran on; no event "
                            "is needed",
    "set_reduce_scatter_unused_params": "parameters no rank has a gradient for keep theirs, by the has-gradient "
                                        "flags",
    "set_reduce_scatter_max_input_buffers": "fullshard's buffer pool sizes itself",
    "set_separate_reduce_scatter_group": "reductions run on the shard group's own stream already",
    "set_allocate_memory_from_process_group_for_comm": "communication buffers come from fullshard's pool",
    "set_symm_mem_for_comm": "symmetric-memory collectives are not used",
}


def not_offered(name: str, why: str):
    """An FSDPModule method of FSDP2's that fullshard does not offer: calling it says why."""
    def method(self, *args, **kwargs) -> None:
        raise fail(f"{name} is an FSDP2 method fullshard does not offer: {why}",
                   "Drop the call (docs/migrating.md lists every difference from FSDP2).")
    method.__name__ = name
    method.__doc__ = f"Not offered: {why} (docs/migrating.md)."
    return method


class FSDPModule(TorchFSDPModule):
    """Mixin of every module passed to ``fully_shard``; its class becomes ``FSDP<Original>``.

    # Note [torch's FSDPModule]: it subclasses torch's FSDPModule, so frameworks that find
    # FSDP2's units with isinstance (Lightning Fabric's no_backward_sync, torchtitan's
    # chunked loss, the HF Trainer's reshard before building the optimizer) find fullshard's.
    # Every method torch's class defines is defined here again, doing fullshard's thing or
    # raising a named refusal (NOT_OFFERED), so none falls through to torch's code, which
    # reads FSDP2's own state; tests/test_fsdp2_dropin.py checks the list against torch's
    # class, so a method a new torch adds fails a test instead of falling through.
    """

    def __new__(cls, *args, **kwargs):
        """Constructing a module of a swapped class (e.g. nn.Sequential slicing builds
        ``self.__class__(...)``) builds one of the original class, unsharded, as FSDP2 does."""
        original = next(c for c in cls.__mro__ if not issubclass(c, TorchFSDPModule))
        module = original.__new__(original)
        module.__init__(*args, **kwargs)
        return module

    def _get_fsdp_state(self) -> None:
        """FSDP2's private state object; fullshard has none of its kind."""
        raise fail(f"{type(self).__name__} is sharded by fullshard, which keeps no FSDP2 state object "
                   f"(_get_fsdp_state, fully_shard.state)", "Use the FSDPModule methods (README's API table); "
                   "code reaching into FSDP2's internals does not run on fullshard.")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's switch to issue the pre-forward all-gather without waiting; fullshard's gathers are
        always issued asynchronously and prefetched, so this changes nothing."""
        if not isinstance(async_op, bool):
            raise fail(f"_set_unshard_async_op({async_op!r}) takes a bool", "Pass True or False.")

    @normal_tensors
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's full parameters now (e.g. before a forward the hooks cannot see).

        Args:
            async_op: return a handle at once and finish when its ``wait()`` is called.
        """
        units = self._units(False)
        for unit in units:
            unit.unshard()
        if async_op:
            return UnshardHandle(units)
        for unit in units:
            unit.wait_unshard()
        return None

    @normal_tensors
    def reshard(self) -> None:
        """Free this unit's full parameters; the modules hold the shards again."""
        for unit in self._units(False):
            unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn gradient reduction off (accumulate full gradients locally) or back on.

        Args:
            requires_gradient_sync: ``False`` skips the reduce-scatter after backward; the
                full gradients accumulate until a backward with sync on reduces them. With
                hybrid sharding it sets the all-reduce across replicas too (as FSDP2's does),
                so ``True`` undoes an earlier ``set_requires_all_reduce(False)``.
            recurse: apply to every unit in this module's subtree.
        """
        for unit in self._units(recurse):
            unit.sync_grads = requires_gradient_sync
            unit.all_reduce_grads = requires_gradient_sync

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch, honoured so that DDP code runs unchanged: assigning ``False`` is
        ``set_requires_gradient_sync(False)`` for this unit and every unit below it."""
        return all(unit.sync_grads for unit in self._units(True))

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.set_requires_gradient_sync(bool(value))

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding: keep reducing inside the shard group but skip the all-reduce across
        replicas (``False``), e.g. for all but the last micro-batch of an accumulation.

        Gradients stay sharded and reduced within the group; the first backward with the
        switch back on all-reduces everything accumulated since, in one collective. This
        saves the cross-node traffic of accumulation at no extra memory, unlike
        ``set_requires_gradient_sync(False)``, which skips all reduction but holds full
        gradients.

        Args:
            requires_all_reduce: ``False`` skips the cross-replica all-reduce.
            recurse: apply to every unit in this module's subtree.
        """
        for unit in self._units(recurse):
            unit.all_reduce_grads = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Keep the full parameters after backward (``False``), e.g. between accumulation steps.

        Args:
            reshard_after_backward: ``False`` leaves the unit full after its backward, so
                the next forward needs no all-gather; call ``reshard()`` when done.
            recurse: apply to every unit in this module's subtree.
        """
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the full parameters after forward (``True``) or keep them until backward.

        ``True`` frees them even in the unit that ran its forward last, as FSDP2 does (by
        default fullshard keeps that unit's, whose backward starts at once: Note [kept after
        forward]); the root unit keeps them either way.

        Args:
            reshard_after_forward: as ``fully_shard``'s, a bool.
            recurse: apply to every unit in this module's subtree.
        """
        if not isinstance(reshard_after_forward, bool):
            raise fail(f"set_reshard_after_forward({reshard_after_forward!r}) takes a bool",
                       "Pass True or False (an int k is given to fully_shard).")
        for unit in self._units(recurse):
            unit.config = dataclasses.replace(unit.config, free_after_forward=reshard_after_forward,
                                              post_forward_world=1)
            unit.small_group = None  # an int k given to fully_shard no longer applies
            unit.drop_small()
            hooks = hooks_for(unit)
            hooks.free_after_forward = reshard_after_forward and not hooks.is_root
            hooks.keep_if_last = not reshard_after_forward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's hint that the next backward ends an accumulation, accepted for its code: fullshard
        finishes every backward's reductions at its end (they land on the shards' gradients
        before ``backward()`` returns), whatever this says."""
        if not isinstance(is_last_backward, bool):
            raise fail(f"set_is_last_backward({is_last_backward!r}) takes a bool", "Pass True or False.")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Skip the gather before this unit's backward (``False``) when backward needs none of its
        parameters, e.g. an embedding's; its gradients are still reduced.

        Args:
            unshard_in_backward: ``False`` gathers nothing in backward.
        """
        if not isinstance(unshard_in_backward, bool):
            raise fail(f"set_unshard_in_backward({unshard_in_backward!r}) takes a bool", "Pass True or False.")
        for unit in self._units(False):
            unit.unshard_in_backward = unshard_in_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients (not those of units below it, as FSDP2) by `factor`
        instead of the data-parallel size.

        Args:
            factor: a positive number (1.0: the sum over ranks).
        """
        if not (isinstance(factor, (int, float)) and factor > 0):
            raise fail(f"set_gradient_divide_factor({factor!r}): the factor must be a positive number",
                       "Pass e.g. 1.0 for the sum over ranks.")
        for unit in self._units(False):
            unit.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Call ``hook(reduced)`` on each of this unit's reduced gradient rows (this rank's shard,
        after the reduction across replicas when hybrid), before they land on the gradients;
        the hook may change the row in place, e.g. all-reduce it over a group of your own.

        Args:
            hook: ``hook(reduce_output: torch.Tensor) -> None``.
            stream: not taken: the hook runs on the compute stream, which has waited for the
                reduction.
        """
        if not callable(hook) or stream is not None:
            raise fail("set_all_reduce_hook takes a callable and no stream",
                       "Pass hook(reduce_output) -> None; it runs on the compute stream after the reduction.")
        for unit in self._units(False):
            unit.all_reduce_hook = hook

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: reshard every unit, drop gathers and
        reductions in flight and the step's full gradients, so the next step runs normally.
        Call it on the root (the outermost unit)."""
        hooks = unit_hooks(self)
        if hooks.ctx is not None and not hooks.is_root:
            raise fail("reset_iter_state() was called on a unit that is not the root",
                       "Call it on the outermost sharded module (the one whose forward you call).")
        if hooks.ctx is not None:
            hooks.ctx.reset()

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce this unit's gradients with sums only (``True``), dividing afterwards, never NCCL's
        average; on gloo fullshard always does."""
        if not isinstance(enable, bool):
            raise fail(f"set_force_sum_reduction_for_comms({enable!r}) takes a bool", "Pass True or False.")
        for unit in self._units(False):
            unit.force_sum = enable

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these units, in this order, when this unit's forward starts.

        Replaces the recorded forward order for this unit (and ignores the limiter).

        Args:
            modules: modules passed to ``fully_shard`` (units of the same model).
        """
        for hooks in hooks_on(self):
            hooks.forward_targets = hooks_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these units, in this order, when this unit's backward starts.

        Replaces the reversed forward order for this unit (and ignores the limiter).

        Args:
            modules: modules passed to ``fully_shard`` (units of the same model).
        """
        for hooks in hooks_on(self):
            hooks.backward_targets = hooks_of(modules, "set_modules_to_backward_prefetch")

    def set_timeout(self, seconds: float, *, recurse: bool = True) -> None:
        """Give up on a collective of these units after `seconds` (default 300) with a
        FullShardError naming the unit, the collective and the step, instead of hanging.

        Args:
            seconds: how long a gather or reduction may wait for the other ranks.
            recurse: apply to every unit in this module's subtree.
        """
        if not (isinstance(seconds, (int, float)) and seconds > 0):
            raise fail(f"set_timeout({seconds!r}): the timeout must be a positive number of seconds",
                       "Pass e.g. 120.")
        for unit in self._units(recurse):
            unit.timeout = timedelta(seconds=seconds)

    def set_debug_checks(self, enabled: bool, *, recurse: bool = True) -> None:
        """Before every collective, check that all ranks run the same one: the same unit, the same
        step and (for reductions) gradients for the same parameters; raise naming what each rank
        was about to do when they differ. Off by default: it adds a small all-gather per
        collective (cost in docs/reliability.md).

        Args:
            enabled: turn the checks on or off.
            recurse: apply to every unit in this module's subtree.
        """
        for unit in self._units(recurse):
            unit.debug = bool(enabled)

    def set_nonfinite_grads(self, policy: str | None) -> None:
        """What a gradient with an inf or NaN does (after reduction; every rank decides alike).

        Args:
            policy: ``"raise"`` (a FullShardError naming the unit and step, from ``backward()``),
                ``"skip"`` (every rank drops all gradients of the step, so ``optimizer.step()``
                changes nothing; counted in ``fullshard.stats``) or ``None`` (no check, the
                default). It applies to this unit and every unit below it (on the root: the
                whole model).
        """
        if policy not in (None, "raise", "skip"):
            raise fail(f"set_nonfinite_grads({policy!r}) is not a policy", "Pass 'raise', 'skip' or None.")
        for unit in self._units(True):
            unit.nonfinite = policy

    def _units(self, recurse: bool) -> list[Unit]:
        return units_under(self) if recurse else [hooks.unit for hooks in hooks_on(self)]

    def _apply(self, fn, recurse: bool = True) -> nn.Module:
        """Module.to_empty / .to / .double() moved or converted the shards off the unit's storage:
        move the unit after them, in their dtype (a meta-built unit gets real storage here, which
        the user's init then fills). Storages are told apart by identity: an empty shard (a rank
        holding no row) has no data pointer, as a meta one has none."""
        module = super(TorchFSDPModule, self)._apply(fn, recurse)  # torch's own reads FSDP2's state
        for unit in self._units(False):
            moved = [p.local_shard() for p in unit.params]  # a module group's members move their own in turn
            if any(not local.is_meta and local.untyped_storage()._cdata != shard.untyped_storage()._cdata
                   for local, shard in zip(moved, unit.shards)):
                device = next(local.device for local in moved if not local.is_meta)
                unit.materialize(unit.group.device if unit.config.offload else device,
                                 [local.dtype for local in moved])
        return module

    def __deepcopy__(self, memo: dict) -> None:
        raise fail(
            f"a sharded {type(self).__name__} cannot be deep-copied: each rank holds only its shard",
            "Copy the model before sharding it, or build a new one and load "
            "fullshard.get_state_dict(model) into it.",
        )


for _name, _why in NOT_OFFERED.items():
    setattr(FSDPModule, _name, not_offered(_name, _why))


def check_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Before every optimizer step (a global hook, registered by the first fully_shard): refuse
    an optimizer that would silently not train a sharded model. Only the parameters that are
    not DTensors, few in a sharded model, need a look."""
    stale, unaveraged, sharded = [], [], False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, torch.distributed.tensor.DTensor):
                sharded = True
            elif p in _OWNER:
                stale.append(_OWNER[p])
            elif p.grad is not None and p not in _DDP_AVERAGED and p not in _IGNORED:
                unaveraged.append(p)
    if stale:
        raise fail(f"this {type(optimizer).__name__} holds {len(stale)} parameters that fully_shard replaced "
                   f"(e.g. {stale[0]}), so its steps would never change the model",
                   "Build the optimizer after shard_model / fully_shard, from model.parameters().")
    if sharded and unaveraged and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        unaveraged = [p for p in unaveraged if p not in ddp_averaged()]
        if unaveraged:
            shapes = [tuple(p.shape) for p in unaveraged[:6]]
            raise fail(f"this {type(optimizer).__name__} steps on {len(unaveraged)} parameters that no unit manages "
                       f"(shapes {shapes}) next to sharded ones: their gradients were not averaged across "
                       f"ranks, so every rank would train its own copy of them",
                       "Call fully_shard on the root module too, last (after its blocks), or use "
                       "fullshard.shard_model, whose root is always a unit.")


_DDP_AVERAGED = WeakIdKeyDictionary()  # parameters a DistributedDataParallel (e.g. replicate()'s) averages
_IGNORED = WeakIdKeyDictionary()  # ignored_params: the user averages (or means to keep) them


def ddp_averaged() -> WeakIdKeyDictionary:
    """Parameters that live DistributedDataParallel instances (torch's replicate() makes one)
    average. Found by a scan of the heap, on the path that would otherwise refuse the step,
    and remembered, so a model that composes with DDP pays for it once."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel):  # type(), not isinstance: a dead weakref.proxy raises
            _DDP_AVERAGED.update((p, True) for p in obj.parameters() if p.requires_grad)
    return _DDP_AVERAGED


def from_torch_policy(policy):
    """FSDP2's own MixedPrecisionPolicy or offload policy (a script importing them from torch)
    as fullshard's, field for field; anything else as it is."""
    from torch.distributed import fsdp  # noqa: PLC0415

    if isinstance(policy, fsdp.MixedPrecisionPolicy):
        return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                    output_dtype=policy.output_dtype, cast_forward_inputs=policy.cast_forward_inputs)
    if isinstance(policy, fsdp.CPUOffloadPolicy):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if type(policy) is fsdp.OffloadPolicy:
        return OffloadPolicy()
    return policy


def from_spmd_mesh(owned: list[OwnedParam], mesh, dp_mesh_dims):
    """Note [SPMD meshes]: the data-parallel mesh that `dp_mesh_dims` names in `mesh`; each
    parameter, a DTensor on `mesh` replicated over those dims, becomes the DTensor of the other
    dim (or its local part), keeping its spec there to show while full."""
    from torch.distributed.tensor import DTensor, Replicate  # noqa: PLC0415

    dp_mesh, dp_dims, tp_name = spmd_dp_mesh(mesh, dp_mesh_dims)
    for o in owned:
        p = o.param
        if not isinstance(p, DTensor) or p.device_mesh != mesh or \
                any(not isinstance(p.placements[i], Replicate) for i in dp_dims):
            what = f"a DTensor placed {tuple(p.placements)} on {p.device_mesh}" if isinstance(p, DTensor) else \
                "a plain tensor"
            raise fail(f"with dp_mesh_dims, parameter {o.fqn!r} must be a DTensor on the mesh passed, Replicate() "
                       f"on its data-parallel dims; it is {what}", "Distribute every parameter over the full mesh "
                       "first (distribute_tensor / distribute_module), or pass the data-parallel sub-mesh as mesh.")
        local = local_values(p)
        if tp_name is not None:
            tp = mesh.mesh_dim_names.index(tp_name)
            local = DTensor.from_local(local, mesh[tp_name], [p.placements[tp]], run_check=False, shape=p.shape,
                                       stride=p.stride())
        o.view = (p._spec, dp_dims)
        o.param = nn.Parameter(local, requires_grad=p.requires_grad)
    return dp_mesh


# Note [meshes of one call]: FSDP2's shard_placement_fn may return a ShardPlacementResult
# that puts a parameter on a mesh of its own (torchtitan shards MoE experts over the
# expert-data-parallel mesh, the rest of the block over the data-parallel one, in one
# fully_shard call). fully_shard then makes one unit per mesh, all of the same modules:
# the call's own mesh's first, whose hooks run first and which is the root when the
# module is. Each unit gathers and reduces over its own mesh; the module's hooks are a
# list (hooks.hooks_on), and every FSDPModule method applies to all of a module's units.


def set_split_dims(owned: list[OwnedParam], shard_placement_fn) -> None:
    """Set the dim each parameter is split along, and the mesh it is sharded over, from FSDP2's
    shard_placement_fn (Note [another dim], Note [meshes of one call]): None is Shard(0) on the
    call's mesh; a negative dim counts from the last; a ShardPlacementResult names a mesh too."""
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415

    for o in owned:
        placement = shard_placement_fn(o.param)
        if hasattr(placement, "mesh_info") and hasattr(placement, "placement"):  # torch's ShardPlacementResult
            placement, o.mesh = placement.placement, result_mesh(placement.mesh_info, o.fqn)
        if placement is None:
            continue
        ndim = o.param.dim()
        if type(placement) is not Shard or not -ndim <= placement.dim < max(ndim, 1):
            raise fail(f"shard_placement_fn returned {placement!r} for {o.fqn!r}, a parameter of shape "
                       f"{tuple(o.param.shape)}", f"Return None or Shard(d) with -{ndim} <= d < {ndim} "
                       "(a 0-d parameter takes None or Shard(0)), or a ShardPlacementResult of one.")
        if placement.dim % max(ndim, 1) and isinstance(o.param, DTensor):
            raise fail(f"shard_placement_fn asked for Shard({placement.dim}) for {o.fqn!r}, a tensor-parallel "
                       "DTensor; fullshard splits those along dim 0 only", "Return None for tensor-parallel "
                       "parameters.")
        o.dim = placement.dim % max(ndim, 1)


def result_mesh(mesh_info, fqn: str):
    """The DeviceMesh of a ShardPlacementResult's FSDPMeshInfo (1-D: shard over it) or HSDPMeshInfo
    (replicate over dim 0, shard over dim 1), as fully_shard's `mesh` argument would give it."""
    mesh = getattr(mesh_info, "mesh", None)
    shard, replicate = getattr(mesh_info, "shard_mesh_dim", None), getattr(mesh_info, "replicate_mesh_dim", None)
    layout = (mesh.ndim, shard, replicate) if mesh is not None else None
    if layout not in ((1, 0, None), (2, 1, 0)) or getattr(mesh_info, "dp_mesh_dims", None) is not None:
        raise fail(f"shard_placement_fn gave {fqn!r} a mesh of {type(mesh_info).__name__} {layout} (ndim, shard "
                   f"dim, replicate dim)", "Give an FSDPMeshInfo of a 1-D mesh (shard_mesh_dim=0), or an "
                   "HSDPMeshInfo of a 2-D mesh (replicate_mesh_dim=0, shard_mesh_dim=1).")
    return mesh


def reshard_for_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """model.state_dict() between steps returns the shards, also of a unit a forward left full
    (the root's, kept for a backward that has not come) or whose parameters were assigned."""
    for hooks in hooks_on(module):
        if hooks.phase is Phase.IDLE and hooks.shown is None:
            hooks.unit.reshard()
            hooks.unit.adopt_replaced()


def reshard_for_load(module: nn.Module, *args) -> None:
    """Before load_state_dict: the shards on the modules, for the load to copy into or assign over."""
    reshard_for_state_dict(module, "", False)


def adopt_loaded(module: nn.Module, incompatible_keys) -> None:
    """After load_state_dict(assign=True): what it assigned becomes the shards at once, so the
    parameters an optimizer is built from next, full_params and clipping see are the unit's."""
    for hooks in hooks_on(module):
        if hooks.phase is Phase.IDLE and hooks.shown is None:
            hooks.unit.adopt_replaced()


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


def hooks_of(modules: list[nn.Module], what: str) -> list[UnitHooks]:
    """The hooks of `modules`, which must all be units."""
    others = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
    if others:
        raise fail(f"{what} was given modules that are not units: {others}",
                   "Pass modules that fully_shard (or shard_model) made into units.")
    return [hooks for m in modules for hooks in hooks_on(m)]


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Put the buffers under `module` on the compute device, as the parameters are (a model
    built on the CPU keeps e.g. rotary `inv_freq` there, and forward would mix devices).
    As FSDP2 does, each buffer object stays and only its data moves, so every reference to
    it (a buffer registered in several modules, one a user kept) stays valid; meta buffers
    wait for materialization."""
    with torch.no_grad():
        for buffer in module.buffers():  # each tensor once
            if not buffer.is_meta and runtime.active.elsewhere(buffer, device):
                buffer.data = runtime.active.to_device(buffer, device)


_FSDP_CLASSES: dict[type, type] = {}


def fsdp_class(cls: type) -> type:
    """FSDP<cls>: a subclass of both FSDPModule and `cls`, so the module keeps its behaviour."""
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def owned_params(module: nn.Module, exclude: Iterable[nn.Parameter] = ()) -> list[OwnedParam]:
    """The parameters under `module` that no inner unit manages, each with every place it is registered.

    Places inside inner units count too: a tied weight an inner unit left to this one is
    swapped there as well. Modules under PyTorch's replicate() are its, as in FSDP2: their
    gradients are DDP's to average.
    """
    excluded = set(exclude)
    managed = {tensor for unit in units_under(module) for p in unit.params for tensor in (p.sharded, p.unsharded)}
    replicated = {m for top in module.modules() if "replicate" in top.__dict__.get(REGISTRY_KEY, {})
                  for m in top.modules()}
    owned: dict[nn.Parameter, OwnedParam] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if sub in replicated:
            continue
        for name, param in sub._parameters.items():
            if param is None or param in excluded or param in managed:
                continue
            if param not in owned:
                owned[param] = OwnedParam(param, f"{prefix}.{name}" if prefix else name, [])
            if (sub, name) not in owned[param].slots:
                owned[param].slots.append((sub, name))
    return list(owned.values())


def owned_by(modules: list[nn.Module], exclude: Iterable[nn.Parameter]) -> list[OwnedParam]:
    """owned_params of one module, or of a module group (Note [module groups]), whose members'
    names are prefixed by their position ("[1].weight") and whose shared parameters count once."""
    if len(modules) == 1:
        return owned_params(modules[0], exclude)
    merged: dict[nn.Parameter, OwnedParam] = {}
    for i, module in enumerate(modules):
        for o in owned_params(module, exclude):
            if o.param in merged:
                merged[o.param].slots.extend(slot for slot in o.slots if slot not in merged[o.param].slots)
            else:
                merged[o.param] = OwnedParam(o.param, f"[{i}].{o.fqn}", o.slots)
    return list(merged.values())


def check_owned(what: str, owned: list[OwnedParam], group: ShardGroup) -> None:
    """Refuse parameters that another unit manages, DTensors of a parallelism fullshard cannot
    shard further, or parameters on several devices."""
    for o in owned:
        if o.param in _OWNER:
            raise fail(
                f"parameter {o.fqn!r} of this {what} is already managed by the unit of {_OWNER[o.param]}; "
                f"a parameter must belong to exactly one unit",
                "Shard the lowest common ancestor of every module that uses it instead (e.g. do "
                "not shard an output head separately when its weight is tied to the embedding), "
                "or use fullshard.shard_model, which leaves tied parameters to that ancestor.",
            )
        if isinstance(o.param, torch.distributed.tensor.DTensor):
            owner = unit_of(o.param)
            if owner is not None:
                raise fail(f"parameter {o.fqn!r} of this {what} is already sharded by the unit of a "
                           f"{type(owner.module).__name__} that contains it",
                           "Apply fully_shard bottom-up: the blocks first, the root last (or use "
                           "fullshard.shard_model, which does).")
            check_tp_mesh(group.mesh, o.param.device_mesh, tuple(o.param.placements), o.fqn)
    devices = {o.param.device for o in owned}
    if len(devices) > 1:
        listing = ", ".join(f"{o.fqn!r} on {o.param.device}" for o in owned)
        raise fail(f"the parameters of this {what} are on different devices ({listing})",
                   "Move the module to one device (module.to(device)) before sharding it.")


# the integer type whose elements have the size of a dtype's, to sum a tensor's bits
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_sums(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's bits summed as integers of its element size, wrapping (0 for meta tensors).
    Wrapping integer addition is associative, so equal values give equal sums on any device
    and CPU, in any summation order, where a float sum's rounding would not; and summing in
    the element's own size needs no widened copy of the tensor."""
    sums = []
    for t in tensors:
        if not t.is_meta:
            bits = t.detach().reshape(-1).view(INT_OF_SIZE.get(t.element_size(), torch.int64))
            sums.append(bits.sum(dtype=bits.dtype).to(torch.int64))
    values = iter(torch.stack(sums).tolist() if sums else [])
    return [0 if t.is_meta else next(values) for t in tensors]


def dp_groups(group: ShardGroup) -> list[torch.distributed.ProcessGroup | None]:
    """The groups over which ranks must hold equal parameters: every rank (None), or, on a
    data-parallel sub-mesh, its shard and replicate groups (the other dims, e.g. tensor
    parallelism, hold other parts)."""
    if group.mesh.size() == torch.distributed.get_world_size():
        return [None]
    return group.process_groups


def check_ranks_agree(what: str, described: list[tuple], sums: list[int], device: torch.device,
                      groups: list[torch.distributed.ProcessGroup | None] = (None,)) -> None:
    """Refuse, on every rank, ranks that would shard different parameters: `described` holds
    each parameter's (name, shape, dtype, requires_grad[, split dim]), `sums` its bit_sums. Ranks that
    differ would silently mix rows of different models. One small all-gather per group
    (None: every rank) when they agree."""
    try:
        for group in groups:
            if torch.distributed.get_world_size(group) > 1:
                compare_ranks(what, described, sums, device, group)
    except CollectiveError as e:
        raise fail(f"rank {torch.distributed.get_rank()}: comparing {what} across ranks did not finish ({e})",
                   "Every rank must shard the same model at the same time; another rank did not, or died.") from None


def compare_ranks(what: str, described: list[tuple], sums: list[int], device: torch.device,
                  group: torch.distributed.ProcessGroup | None) -> None:
    """check_ranks_agree within one group, without the deadline's message (ranks are the group's)."""
    timeout = timedelta(seconds=300)
    digest = [zlib.crc32(repr(described).encode()), zlib.crc32(repr(sums).encode())]
    digests = all_gather_ints(digest, device=device, timeout=timeout, group=group)
    if len({structure for structure, _ in digests}) > 1:
        everyone = [[tuple(d[:1]) + (tuple(d[1]),) + tuple(d[2:]) for d in theirs]  # JSON made tuples lists
                    for theirs in all_gather_json(described, device=device, timeout=timeout, group=group)]
        differ = [f"rank {r}: {sorted(set(theirs) ^ set(described))}" for r, theirs in enumerate(everyone)
                  if theirs != described]
        raise fail(f"ranks would shard different parameters in {what} ((name, shape, dtype, requires_grad, ...) "
                   f"differing from this rank's: {'; '.join(differ)})",
                   "Build the same model on every rank, with the same parameters frozen (and the same "
                   "shard_placement_fn), before sharding.")
    if len({values for _, values in digests}) == 1 or not sums:
        return
    everyone = all_gather_ints(sums, device=device, timeout=timeout, group=group)  # same length: same parameters
    names = [d[0] for i, d in enumerate(described) if len({theirs[i] for theirs in everyone}) > 1]
    listing = ", ".join(map(repr, names[:8])) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    raise fail(f"ranks hold different values of {listing} in {what}: sharding would keep rank 0's rows of one "
               f"model and the other ranks' rows of others",
               "Seed every rank alike before building the model (torch.manual_seed(seed) with the same seed), or "
               "shard with fullshard.shard_model(model, ..., sync_module_states=True) to make rank 0's values win.")


def after_forward(reshard_after_forward: bool | int, group: ShardGroup) -> tuple[bool, int]:
    """(free after forward, the post-forward world of Note [smaller world after forward]) of a
    unit over `group` for fully_shard's `reshard_after_forward`."""
    if type(reshard_after_forward) is not int:
        return reshard_after_forward, 1
    k = reshard_after_forward
    if k not in (1, group.world) and group.mesh.size() != torch.distributed.get_world_size():
        raise fail(f"reshard_after_forward={k} on a data-parallel mesh of part of the ranks",
                   "Pass True or False with a sub-mesh (e.g. with tensor parallelism).")
    if not 1 <= k <= group.world or group.world % k:
        raise fail(f"reshard_after_forward={k} does not divide the {group.world} ranks parameters are "
                   f"sharded over", f"Pass a divisor of {group.world}, e.g. the ranks per node.")
    return k > 1, 1 if k == group.world else k  # k = world is True; k = 1 keeps everything


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
    _exclude: Iterable[nn.Parameter] = (),
    _schedule: Schedule = Schedule(),
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
        FullShardError: before anything changes, when the module is already sharded, a
            parameter belongs to another unit, this rank is not in the mesh, ranks hold
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
    if reshard_after_forward is None:  # FSDP2's default: free, except the root's (which fullshard always keeps)
        reshard_after_forward = True
    if type(reshard_after_forward) not in (bool, int):
        raise fail(f"reshard_after_forward={reshard_after_forward!r} is not a bool or an int",
                   "Pass True (free after forward), False (keep until after backward) or an int k (keep "
                   "1/k after forward, gathered in backward inside groups of k ranks).")
    mp_policy, offload_policy = from_torch_policy(mp_policy), from_torch_policy(offload_policy)
    for name, policy, kind in (("mp_policy", mp_policy, MixedPrecisionPolicy),
                               ("offload_policy", offload_policy, OffloadPolicy)):
        if policy is not None and not isinstance(policy, kind):
            raise fail(f"{name} must be a fullshard.{kind.__name__} or None, got {type(policy).__name__}",
                       f"Pass fullshard.{kind.__name__}(...).")
    if ignored_params is not None and not all(isinstance(p, nn.Parameter) for p in ignored_params):
        raise fail("ignored_params must be a set of the module's nn.Parameters", "Pass e.g. {model.head.weight}.")
    global _optimizer_hook
    owned = owned_by(modules, [*_exclude, *(ignored_params or ())])
    _IGNORED.update((p, True) for p in ignored_params or ())
    if shard_placement_fn is not None:
        set_split_dims(owned, shard_placement_fn)
    if dp_mesh_dims is not None:  # Note [SPMD meshes]
        if mesh is None:
            raise fail("fully_shard(dp_mesh_dims=...) needs the full mesh", "Pass mesh=the mesh the parameters "
                       "are DTensors on, e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=(\"dp\", \"tp\")).")
        mesh = from_spmd_mesh(owned, mesh, dp_mesh_dims)
    primary = shard_group(mesh)
    parts = [(primary, [o for o in owned if o.mesh is None or o.mesh == primary.mesh])]  # Note [meshes of one call]
    for o in owned:
        if o.mesh is not None and o.mesh != primary.mesh:
            part = next((p for sg, p in parts if sg.mesh == o.mesh), None)
            if part is None:
                parts.append((shard_group(o.mesh), part := []))
            part.append(o)
    for group, part in parts:
        check_owned(what, part, group)
        check_ranks_agree(f"this {what}",
                          [(o.fqn, tuple(o.param.shape), str(o.param.dtype), o.param.requires_grad, o.dim)
                           for o in part], bit_sums([local_values(o.param) for o in part]), group.device,
                          dp_groups(group))
    mp = mp_policy or MixedPrecisionPolicy()
    units = []
    for group, part in parts:
        free, post_forward_world = after_forward(reshard_after_forward, group)
        config = UnitConfig(
            free_after_forward=free,
            post_forward_world=post_forward_world,
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            input_dtype=mp.param_dtype if mp.cast_forward_inputs else None,
            output_dtype=mp.output_dtype,
            offload=isinstance(offload_policy, CPUOffloadPolicy),
            pin_memory=isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory,
        )
        units.append(Unit(modules, part, group, config))
    for o in owned:
        _OWNER[o.param] = f"{what} (as {o.fqn!r})"
    # the call's own mesh's unit hooks the modules last, so its pre-forward runs first (the root's is the root)
    hooks = [UnitHooks(unit, _schedule) for unit in reversed(units)][::-1]
    for m in modules:
        move_buffers(m, primary.device)
        m.__class__ = fsdp_class(type(m))
        m.__dict__[HOOKS_ATTR] = hooks
        m.register_state_dict_pre_hook(reshard_for_state_dict)
        m.register_load_state_dict_pre_hook(reshard_for_load)
        m.register_load_state_dict_post_hook(adopt_loaded)
        # PyTorch's composable APIs look here for what manages a module: replicate() leaves a unit's
        # parameters to it, as it does FSDP2's (it would all-reduce their gradients a second time)
        m.__dict__.setdefault(REGISTRY_KEY, {})["fully_shard"] = RegistryItem()
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(check_optimizer_step)
    return module
