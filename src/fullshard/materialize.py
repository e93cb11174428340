"""Deferred initialization: materialize a meta-device model module by module while sharding it.

# Note [same values as eager]: eager construction initializes each module in __init__,
# in construction order. Materialization calls each module's init (param_init_fn(module)
# or module.reset_parameters()) on fresh full tensors, module by module in
# named_modules() order, and streams each module's values into the shards before the
# next module. When initialization lives in those functions and named_modules() order is
# construction order (as for Linear, Embedding, LayerNorm stacks and fullshard's GPT),
# the random draws come in the same order, so the sharded values equal those of the same
# model built eagerly on the compute device with the same seed. A parameter shared by
# several modules is initialized once, by the first of them.
#
# At any moment a rank holds its shards plus one module's full parameters.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from fullshard.checks import bit_sums, check_ranks_agree, dp_groups
from fullshard.collectives import broadcast_from_rank0
from fullshard.errors import fail
from fullshard.hooks import units_under
from fullshard.param import ShardedParam, local_values
from fullshard.param import sharded_params


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def check_initializable(model: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> None:
    """Refuse, before anything changes, meta tensors that nothing would initialize."""
    if init_fn is not None:
        return
    orphans = [f"{name}.{key}" if name else key
               for name, module in model.named_modules() if not hasattr(module, "reset_parameters")
               for key, t in [*module._parameters.items(), *module._buffers.items()] if t is not None and t.is_meta]
    if orphans:
        raise fail(
            f"these meta-device tensors would stay uninitialized: {orphans} (their modules have no "
            f"reset_parameters())",
            "Pass shard_model(param_init_fn=fn), where fn(module) initializes the module's own parameters "
            "and buffers in place (for Hugging Face models: param_init_fn=model._init_weights), or build "
            "the model on a real device.",
        )


def sync_eager(model: nn.Module, device: torch.device, groups: list[dist.ProcessGroup | None]) -> None:
    """sync_module_states for a model built on a real device: the values of rank 0 of each of
    `groups` in turn (None: every rank; the dims of a data-parallel sub-mesh, whose other dims,
    e.g. tensor parallelism, hold other parts), sent from `device`'s memory (a model built on
    the CPU for GPUs goes there and back)."""
    with torch.no_grad():
        for module in model.modules():
            tensors = [local_values(t) for t in [*module._parameters.values(), *module._buffers.values()]
                       if t is not None]
            for group in groups:
                broadcast_from_rank0(tensors, device=device, group=group)


def materialize(model: nn.Module, *, init_fn: Callable[[nn.Module], None] | None, sync: bool) -> None:
    """Real storage for every unit of a sharded meta model, then initialize it module by
    module (Note [same values as eager]); with `sync`, rank 0's values win."""
    units = [unit for unit in units_under(model) if unit.compute_device.type == "meta"]  # real ones keep their values
    for unit in units:
        unit.relayout(device=unit.group.device)
    device = units[0].group.device if units else torch.device("cpu")
    # the ranks that hold this model's values: every rank, or a data-parallel sub-mesh's groups
    # (a pipeline stage's ranks, whose other stages initialize other parameters meanwhile)
    groups = dp_groups(units[0].group) if units else [None]
    by_param = sharded_params(units)
    done: set[ShardedParam] = set()
    uninitialized: list[str] = []
    described: list[tuple] = []  # each initialized parameter, and its bit_sums, for check_ranks_agree
    sums: list[int] = []
    with torch.no_grad():
        for name, module in model.named_modules():
            params = {key: by_param[p] for key, p in module._parameters.items() if p in by_param}
            params = {key: p for key, p in params.items() if p not in done}
            buffers = [key for key, b in module._buffers.items() if b is not None and b.is_meta]
            if not params and not buffers:
                continue
            fresh = {key: nn.Parameter(unset(p.global_shape, p.sharded.dtype, device),
                                       requires_grad=p.sharded.requires_grad) for key, p in params.items()}
            module._parameters.update(fresh)
            for key in buffers:
                module._buffers[key] = unset(module._buffers[key].shape, module._buffers[key].dtype, device)
            if init_fn is not None:
                init_fn(module)
            else:
                module.reset_parameters()
            tensors = {**fresh, **{key: module._buffers[key] for key in buffers}}
            uninitialized += [f"{name}.{key}" if name else key for key, t in tensors.items() if is_unset(t)]
            if sync:
                for group in groups:
                    broadcast_from_rank0(list(tensors.values()), group=group)
            else:
                described += [(f"{name}.{key}" if name else key, tuple(t.shape), str(t.dtype), t.requires_grad)
                              for key, t in fresh.items()]
                sums += bit_sums(list(fresh.values()))
            for key, p in params.items():
                p.write_back(fresh[key])
                module._parameters[key] = p.sharded
                done.add(p)
    if uninitialized:
        raise fail(f"initialization left these meta-device tensors unset: {uninitialized}",
                   "Make param_init_fn (or the modules' reset_parameters()) initialize every parameter and "
                   "buffer the module owns directly.")
    if not sync:
        check_ranks_agree("the model initialized from the meta device", described, sums, device, groups)


def unset(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new tensor whose untouched elements can be recognized: NaN (floats) or zero."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def is_unset(t: torch.Tensor) -> bool:
    return (t.dtype.is_floating_point or t.dtype.is_complex) and bool(torch.isnan(t).any())
