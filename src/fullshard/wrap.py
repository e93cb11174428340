"""shard_model(): the FSDP paper's whole-model conveniences on top of fully_shard.

It decides which modules become units (wrap policy), turns the strategy name into
fully_shard arguments (strategies.STRATEGIES), and calls fully_shard bottom-up.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.distributed.device_mesh import DeviceMesh


from fullshard.checks import dp_groups
from fullshard.module import FSDPModule
from fullshard.errors import fail
from fullshard.init import shard_unit
from fullshard.options import Schedule
from fullshard.materialize import check_initializable, has_meta, materialize, sync_eager
from fullshard.mesh import build_mesh, compute_device, mesh_roles, shard_group
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, checked_policies
from fullshard.strategies import STRATEGIES

WrapPolicy = Iterable[type] | int | Callable[[nn.Module, str], bool] | None

# Containers that hold modules but are never called: a unit there would never gather.
NOT_CALLED = (nn.ModuleList, nn.ModuleDict)


def shard_model(
    model: nn.Module,
    *,
    wrap: WrapPolicy = None,
    strategy: str = "full_shard",
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: CPUOffloadPolicy | None = None,
    backward_prefetch: str | None = "pre",
    forward_prefetch: bool = False,
    limit_all_gathers: int | None = 2,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    checkpoint: bool | Iterable[type] = False,
) -> nn.Module:
    """Shard a whole model: chosen submodules become units, the root becomes the last unit.

    A parameter used by several modules (tied weights) is left to the lowest unit that
    contains all of them, so it stays one parameter with one shard.

    Args:
        model: the model; returned, sharded in place.
        wrap: which submodules become units. A set or tuple of module classes (each
            instance becomes a unit); an ``int`` N (bottom-up, a module becomes a unit when
            the parameters it holds that no inner unit owns number at least N; module
            containers that are never called, ``ModuleList`` and ``ModuleDict``, are
            skipped); or a
            callable ``(module, qualified_name) -> bool`` called for every submodule. ``None``
            makes the whole model one unit.
        strategy: ``"full_shard"`` (free full parameters after forward), ``"shard_grad_op"``
            (keep them until after backward), ``"no_shard"`` (replicate, as DDP), or
            ``"hybrid_shard"`` (shard inside groups of ranks, replicate across groups).
        mesh: ``None`` builds one over every rank (for hybrid_shard, groups of
            ``LOCAL_WORLD_SIZE`` ranks); else a mesh whose dims fit the strategy.
        mp_policy: a :class:`MixedPrecisionPolicy` for every unit.
        offload_policy: a :class:`CPUOffloadPolicy` for every unit.
        backward_prefetch: ``"pre"``, ``"post"`` or ``None``.
        forward_prefetch: prefetch the next unit in the recorded forward order.
        limit_all_gathers: at most this many units gathered ahead of use; ``None``: no limit.
        param_init_fn: for a model built on the meta device: ``fn(module)`` initializes, in
            place, the parameters and buffers the module owns directly; called for each such
            module in ``named_modules()`` order (default: ``module.reset_parameters()``). Each
            module is materialized, initialized and streamed into the shards in turn, so a
            rank never holds more than one module's full parameters beyond its shards.
        sync_module_states: make rank 0's parameters and buffers win (eager or meta).
        checkpoint: activation checkpointing (non-reentrant): a set of module classes whose
            every instance recomputes its forward in backward instead of keeping its
            activations, or ``True`` for the classes of ``wrap``. The recomputation runs on
            the full parameters the unit's backward gathers, so it adds no gather.

    Raises:
        FullShardError: before anything changes, on an unknown strategy or wrap policy,
            a mesh that does not fit the strategy, a model that is already sharded, or meta
            tensors that nothing would initialize (after initialization: any left unset).
    """
    if strategy not in STRATEGIES:
        raise fail(f"unknown strategy {strategy!r}", f"Use one of {', '.join(map(repr, STRATEGIES))}.")
    spec = STRATEGIES[strategy]
    if mesh is not None and mesh_roles(mesh) != spec["mesh_dims"]:
        raise fail(
            f"strategy {strategy!r} needs a mesh with dims {spec['mesh_dims']}, got dims "
            f"{mesh.mesh_dim_names} of shape {tuple(mesh.shape)}",
            f"Pass mesh=None, or build it with init_device_mesh(device, shape, mesh_dim_names={spec['mesh_dims']}).",
        )
    if backward_prefetch not in ("pre", "post", None):
        raise fail(f"backward_prefetch={backward_prefetch!r} is not one of 'pre', 'post', None",
                   "Pass 'pre' (the default), 'post' or None.")
    if limit_all_gathers is not None and (type(limit_all_gathers) is not int or limit_all_gathers < 1):
        raise fail(f"limit_all_gathers={limit_all_gathers!r} is not a positive int or None",
                   "Pass e.g. 2 (the default) or None for no limit.")
    mp_policy, offload_policy = checked_policies(mp_policy, offload_policy)
    already = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if already:
        raise fail(f"the model is already sharded (units at {already})",
                   "Call shard_model once, on a model that has not been passed to fully_shard.")
    meta = has_meta(model)
    if param_init_fn is not None and not meta:
        raise fail("param_init_fn was given but the model has no meta-device tensors to initialize",
                   "Build the model under `with torch.device('meta'):` to defer its initialization, or drop "
                   "param_init_fn.")
    if meta:
        check_initializable(model, param_init_fn)
    recomputed = checkpointed_classes(checkpoint, wrap)
    units = choose_units(model, wrap)
    if mesh is None:
        mesh = build_mesh(spec["mesh_dims"])
    if sync_module_states and not meta:
        sync_eager(model, compute_device(mesh.device_type), dp_groups(shard_group(mesh)))
    schedule = Schedule(prefetch_before_backward=backward_prefetch == "pre",
                        prefetch_after_backward=backward_prefetch == "post",
                        forward_prefetch=bool(forward_prefetch), limit=limit_all_gathers)
    inner_mp = None if mp_policy is None else dataclasses.replace(mp_policy, output_dtype=None)
    for module, exclude, _ in units:
        shard_unit([module], type(module).__name__, mesh=mesh, reshard_after_forward=spec["reshard_after_forward"],
                   shard_placement_fn=None, mp_policy=mp_policy if module is model else inner_mp,  # output_dtype:
                   offload_policy=offload_policy, ignored=(), dp_mesh_dims=None,  # the root's output only
                   exclude=exclude, schedule=schedule)
    if meta:
        materialize(model, init_fn=param_init_fn, sync=sync_module_states)
    recompute(model, recomputed)
    return model


def recompute(model: nn.Module, classes: tuple[type, ...]) -> None:
    """Activation checkpointing (non-reentrant) of every instance of `classes` in `model`:
    backward recomputes its forward instead of keeping its activations."""
    for module in model.modules():
        if isinstance(module, classes):
            module.forward = functools.partial(torch_checkpoint, module.forward, use_reentrant=False)


def checkpointed_classes(checkpoint: bool | Iterable[type], wrap: WrapPolicy) -> tuple[type, ...]:
    """The module classes `checkpoint` asks to recompute (shard_model's argument), checked."""
    if checkpoint is False or checkpoint is None:
        return ()
    if checkpoint is True:
        if not isinstance(wrap, (set, frozenset, tuple, list)):
            raise fail(f"checkpoint=True takes its classes from wrap, which is {wrap!r}, not a set of classes",
                       "Pass checkpoint={Block} (the classes to recompute), or wrap={Block} with checkpoint=True.")
        checkpoint = wrap
    classes = tuple(checkpoint) if isinstance(checkpoint, (set, frozenset, tuple, list)) else None
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise fail(f"checkpoint={checkpoint!r} is not True, False or a set of module classes",
                   "Pass e.g. checkpoint={Block}, or checkpoint=True with wrap={Block}.")
    return classes


def choose_units(model: nn.Module,
                 wrap: WrapPolicy) -> list[tuple[nn.Module, list[nn.Parameter], list[nn.Parameter]]]:
    """Units bottom-up (the root last), each with the parameters it must leave to an ancestor
    and those it owns.

    A parameter whose holders are not all inside a unit's subtree (a tied weight) is
    left to the lowest enclosing unit; a unit left with no parameters is dropped.
    """
    holders = holder_names(model)
    modules = list(model.named_modules())
    select = selector(wrap)
    chosen: list[tuple[nn.Module, list[nn.Parameter], list[nn.Parameter]]] = []
    taken: set[nn.Parameter] = set()
    for name, module in reversed(modules):  # reversed pre-order: children before parents
        inside = [p for p in unique_params(module) if p not in taken]
        exclude = [p for p in inside if not all(is_within(h, name) for h in holders[p])] if name else []
        excluded = set(exclude)  # parameters hash by identity
        own = [p for p in inside if p not in excluded]
        if name and not (own and select(module, name, own)):
            continue
        if isinstance(module, NOT_CALLED):
            if not isinstance(wrap, int):
                raise fail(f"the wrap policy selects {name!r}, a {type(module).__name__}, whose forward is "
                           f"never called, so its unit would never be gathered",
                           "Select the modules inside it instead (e.g. the blocks, not the list of blocks).")
            continue
        chosen.append((module, exclude, own))
        taken.update(own)
    return chosen


def selector(wrap: WrapPolicy) -> Callable[[nn.Module, str, list[nn.Parameter]], bool]:
    """Turn a wrap policy into `(module, name, params it would own) -> becomes a unit`."""
    if wrap is None:
        return lambda module, name, own: False
    if isinstance(wrap, bool) or not (isinstance(wrap, (int, set, frozenset, tuple, list)) or callable(wrap)):
        raise fail(f"wrap={wrap!r} is not a wrap policy",
                   "Pass a set of module classes, an int parameter count, or a callable (module, name) -> bool.")
    if isinstance(wrap, int):
        if wrap < 1:
            raise fail(f"wrap={wrap} must be a positive parameter count", "Pass e.g. wrap=1_000_000.")
        return lambda module, name, own: sum(p.numel() for p in own) >= wrap
    if isinstance(wrap, (set, frozenset, tuple, list)):
        classes = tuple(wrap)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise fail(f"wrap={wrap!r} must hold nn.Module classes", "Pass e.g. wrap={Block}.")
        return lambda module, name, own: isinstance(module, classes)
    return lambda module, name, own: bool(wrap(module, name))


def holder_names(model: nn.Module) -> dict[nn.Parameter, list[str]]:
    """Every module name under which each parameter is registered (shared modules count twice)."""
    holders: dict[nn.Parameter, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(param, []).append(name)
    return holders


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    return list(dict.fromkeys(module.parameters()))


def is_within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")
