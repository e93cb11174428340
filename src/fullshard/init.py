"""fully_shard's steps (shard_unit): which parameters a unit takes and from where, where
they are split, the class swap and the state-dict hooks of a unit's modules."""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem

from fullshard import runtime, stage_state
from fullshard.checks import bit_sums, check_ranks_agree, dp_groups
from fullshard.errors import fail
from fullshard.hooks import HOOKS_ATTR, OWNER, Phase, UnitHooks, claim, hooks_on, units_under
from fullshard.mesh import ShardGroup, check_tp_mesh, shard_group, spmd_dp_mesh
from fullshard.module import FSDPModule
from fullshard.options import Schedule, UnitOptions, after_forward
from fullshard.param import OwnedParam, local_values
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fullshard.units import next_uid, unit_of
from fullshard.unit import Unit


def from_spmd_mesh(owned: list[OwnedParam], mesh, dp_mesh_dims) -> tuple[list[OwnedParam], object]:
    """Note [SPMD meshes]: the parameters and the data-parallel mesh that `dp_mesh_dims` names in
    `mesh`; each parameter, a DTensor on `mesh` replicated over those dims, becomes the DTensor of
    the other dim (or its local part), keeping its spec there to show while full."""
    from torch.distributed.tensor import DTensor, Replicate  # noqa: PLC0415

    dp_mesh, dp_dims, tp_name = spmd_dp_mesh(mesh, dp_mesh_dims)
    out = []
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
        out.append(dataclasses.replace(o, view=(p._spec, dp_dims),
                                       param=nn.Parameter(local, requires_grad=p.requires_grad)))
    return out, dp_mesh

# Note [meshes of one call]: FSDP2's shard_placement_fn may return a ShardPlacementResult
# that puts a parameter on a mesh of its own (torchtitan shards MoE experts over the
# expert-data-parallel mesh, the rest of the block over the data-parallel one, in one
# fully_shard call). fully_shard then makes one unit per mesh, all of the same modules:
# the call's own mesh's first, whose hooks run first and which is the root when the
# module is. Each unit gathers and reduces over its own mesh; the module's hooks are a
# list (hooks.hooks_on), and every FSDPModule method applies to all of a module's units.

def set_split_dims(owned: list[OwnedParam], shard_placement_fn) -> list[OwnedParam]:
    """The parameters with the dim each is split along, and the mesh it is sharded over, from FSDP2's
    shard_placement_fn (Note [another dim], Note [meshes of one call]): None is Shard(0) on the
    call's mesh; a negative dim counts from the last; a ShardPlacementResult names a mesh too."""
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415

    out = []
    for o in owned:
        placement = shard_placement_fn(o.param)
        if hasattr(placement, "mesh_info") and hasattr(placement, "placement"):  # torch's ShardPlacementResult
            o = dataclasses.replace(o, mesh=result_mesh(placement.mesh_info, o.fqn))
            placement = placement.placement
        if placement is None:
            out.append(o)
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
        out.append(dataclasses.replace(o, dim=placement.dim % max(ndim, 1)))
    return out

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
        if hooks.unit.phase is Phase.IDLE and hooks.shown is None:
            hooks.unit.reshard()
            hooks.unit.adopt_replaced()

def reshard_for_load(module: nn.Module, *args) -> None:
    """Before load_state_dict: the shards on the modules, for the load to copy into or assign over."""
    reshard_for_state_dict(module, "", False)

def adopt_loaded(module: nn.Module, incompatible_keys) -> None:
    """After load_state_dict(assign=True): what it assigned becomes the shards at once, so the
    parameters an optimizer is built from next, full_params and clipping see are the unit's."""
    for hooks in hooks_on(module):
        if hooks.unit.phase is Phase.IDLE and hooks.shown is None:
            hooks.unit.adopt_replaced()

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
    fqns: dict[nn.Parameter, str] = {}  # the first name of each
    slots: dict[nn.Parameter, dict[tuple[nn.Module, str], None]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if sub in replicated:
            continue
        for name, param in sub._parameters.items():
            if param is None or param in excluded or param in managed:
                continue
            fqns.setdefault(param, f"{prefix}.{name}" if prefix else name)
            slots.setdefault(param, {})[(sub, name)] = None
    return [OwnedParam(param, fqn, tuple(slots[param])) for param, fqn in fqns.items()]

def owned_by(modules: list[nn.Module], exclude: Iterable[nn.Parameter]) -> list[OwnedParam]:
    """owned_params of one module, or of a module group (Note [module groups]), whose members'
    names are prefixed by their position ("[1].weight") and whose shared parameters count once."""
    if len(modules) == 1:
        return owned_params(modules[0], exclude)
    merged: dict[nn.Parameter, OwnedParam] = {}
    for i, module in enumerate(modules):
        for o in owned_params(module, exclude):
            first = merged.get(o.param)
            merged[o.param] = OwnedParam(o.param, f"[{i}].{o.fqn}", o.slots) if first is None else \
                dataclasses.replace(first, slots=tuple(dict.fromkeys(first.slots + o.slots)))
    return list(merged.values())

def check_owned(what: str, owned: list[OwnedParam], group: ShardGroup) -> None:
    """Refuse parameters that another unit manages, DTensors of a parallelism fullshard cannot
    shard further, or parameters on several devices."""
    for o in owned:
        if o.param in OWNER:
            raise fail(
                f"parameter {o.fqn!r} of this {what} is already managed by the unit of {OWNER[o.param]}; "
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

def shard_unit(modules: list[nn.Module], what: str, *, mesh, reshard_after_forward: bool | int, shard_placement_fn,
               mp_policy: MixedPrecisionPolicy | None, offload_policy: OffloadPolicy | None,
               ignored: Iterable[nn.Parameter], dp_mesh_dims, exclude: Iterable[nn.Parameter],
               schedule: Schedule) -> None:
    """fully_shard's work once its arguments are checked: `modules` become one unit (one per
    mesh, Note [meshes of one call]) of the parameters no inner unit owns, minus `exclude`
    (shard_model's parameters left to an outer unit); `schedule` is the prefetch schedule
    the unit applies if it becomes a root."""
    torchs = [f"{name or '<root>'} ({type(sub).__name__})" for module in modules for name, sub in module.named_modules()
              if "fully_shard" in sub.__dict__.get(REGISTRY_KEY, {}) and not hooks_on(sub)]
    if torchs:  # their parameters are FSDP2's DTensors: nothing fullshard could shard or reduce
        raise fail(f"this {what} holds modules that torch's own fully_shard (FSDP2) shards: {torchs}",
                   "Shard every unit of a model (each pipeline stage included) with one library: fullshard's "
                   "fully_shard or shard_model, or torch's fully_shard under fullshard.replace_fsdp2().")
    owned = owned_by(modules, [*exclude, *ignored])
    if shard_placement_fn is not None:
        owned = set_split_dims(owned, shard_placement_fn)
    if dp_mesh_dims is not None:  # Note [SPMD meshes]
        if mesh is None:
            raise fail("fully_shard(dp_mesh_dims=...) needs the full mesh", "Pass mesh=the mesh the parameters "
                       "are DTensors on, e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=(\"dp\", \"tp\")).")
        owned, mesh = from_spmd_mesh(owned, mesh, dp_mesh_dims)
    primary = shard_group(mesh)
    parts = [(primary, [o for o in owned if o.mesh is None or o.mesh == primary.mesh])]  # Note [meshes of one call]
    for o in owned:
        if o.mesh is not None and o.mesh != primary.mesh:
            part = next((p for sg, p in parts if sg.mesh == o.mesh), None)
            if part is None:
                parts.append((shard_group(o.mesh), part := []))
            part.append(o)
    uids = []
    for group, part in parts:
        check_owned(what, part, group)
        uids.append(check_ranks_agree(f"this {what}",
                                      [(o.fqn, tuple(o.param.shape), str(o.param.dtype), o.param.requires_grad, o.dim)
                                       for o in part], bit_sums([local_values(o.param) for o in part]),
                                      group.device, dp_groups(group), next_uid(uids[-1] if uids else -1)))
    mp = mp_policy or MixedPrecisionPolicy()
    units = []
    for (group, part), uid in zip(parts, uids):
        options = UnitOptions(
            **after_forward(reshard_after_forward, group.world,
                            group.mesh.size() == torch.distributed.get_world_size()),
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            input_dtype=mp.param_dtype if mp.cast_forward_inputs else None,
            output_dtype=mp.output_dtype,
            offload=isinstance(offload_policy, CPUOffloadPolicy),
            gather_dtype=mp.gather_dtype,
            gather_block=mp.gather_block,
            reduce_send_dtype=mp.reduce_send_dtype,
            pin_memory=isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory,
        )
        units.append(Unit(modules, part, group, options, uid))
    claim(owned, what, ignored)
    # the call's own mesh's unit hooks the modules last, so its pre-forward runs first (the root's is the root)
    hooks = [UnitHooks(unit, schedule) for unit in reversed(units)][::-1]
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
        stage_state.register(m)  # Note [pipeline stages]
