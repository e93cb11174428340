"""Unit: the parameters of one fully_shard call, communicated together.

A training step moves every unit through the same cycle (hooks.py decides when):

    SHARDED --unshard()/wait_unshard()--> FULL      before the unit's forward
    FULL    --reshard()-->               SHARDED    after forward if it frees then
    SHARDED --unshard()/wait_unshard()--> FULL      before the unit's backward
    FULL    --reduce_grads(), reshard()--> SHARDED  after the unit's backward

Between steps every unit is SHARDED: the modules hold the DTensor shards, which is
all the optimizer sees. While FULL, the modules hold plain full parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import nn

from fullshard.collectives import PendingGather, copy_out, gather_full, pack_grads, reduce_scatter_grads
from fullshard.mesh import ShardGroup
from fullshard.param import ShardedParam, shard_numel


class ShardState(Enum):
    SHARDED = auto()
    FULL = auto()


@dataclass(frozen=True)
class UnitConfig:
    """Options resolved once at fully_shard time; the hot path reads only these."""

    free_after_forward: bool


@dataclass
class OwnedParam:
    """A parameter a unit will manage, with every place it is registered."""

    param: nn.Parameter
    fqn: str  # relative to the unit's module
    slots: list[tuple[nn.Module, str]]


class Unit:
    """The shards of one unit, their all-gather into full parameters, and their gradient reduction."""

    def __init__(self, module: nn.Module, owned: list[OwnedParam], group: ShardGroup, config: UnitConfig) -> None:
        self.module = module
        self.group = group
        self.config = config
        self.fqn = ""  # set by the root at lazy init, for messages and profiler labels
        shard_numels = [shard_numel(o.param.shape, group.world) for o in owned]
        dtype = owned[0].param.dtype if owned else torch.float32
        device = torch.device("meta") if any(o.param.is_meta for o in owned) else group.device
        self.local_flat = torch.zeros(sum(shard_numels), dtype=dtype, device=device)  # [unit_shard_numel]
        self.params: list[ShardedParam] = []
        offset = 0
        for o, numel in zip(owned, shard_numels):
            segment = self.local_flat[offset : offset + numel]
            self.params.append(ShardedParam(o.param, o.slots, o.fqn, group, segment))
            offset += numel
        for p in self.params:
            p.to_sharded()
        self.state = ShardState.SHARDED
        self.pending: PendingGather | None = None
        self.sync_grads = True
        self.reshard_after_backward = True

    # ---- all-gather -------------------------------------------------------------

    def unshard(self) -> None:
        """Start gathering the full parameters; a no-op when full or already gathering."""
        if self.state is ShardState.FULL or self.pending is not None or self.group.shard_pg is None:
            return
        with torch.profiler.record_function(f"fullshard::gather {self.fqn}"):
            self.pending = gather_full(self.local_flat, group=self.group.shard_pg, async_op=True)

    def wait_unshard(self) -> None:
        """Finish the gather and register the full parameters on the modules."""
        if self.state is ShardState.FULL:
            return
        if self.group.shard_pg is not None:
            self.unshard()
            with torch.profiler.record_function(f"fullshard::wait gather {self.fqn}"):
                gathered = self.pending.wait()  # [world * unit_shard_numel]
            self.pending = None
            for p in self.params:
                p.alloc_full()
            copy_out(gathered, [p.full_padded for p in self.params],
                     [p.shard_numel for p in self.params], world=self.group.world)
            with torch.no_grad():
                for p in self.params:
                    if p.replicated:  # keep every rank's copy equal to the one used, Note [shard layout]
                        p.local_shard().copy_(p.unsharded)
        for p in self.params:
            p.to_full()
        self.state = ShardState.FULL

    def reshard(self) -> None:
        """Drop the full parameters and put the shards back on the modules; a no-op when sharded."""
        if self.pending is not None:  # a prefetch nobody used: finish it, then drop it
            self.pending.wait()
            self.pending = None
        if self.state is ShardState.SHARDED:
            return
        for p in self.params:
            p.to_sharded()
            p.release_full()
        self.state = ShardState.SHARDED

    # ---- gradients ----------------------------------------------------------------

    def has_full_grads(self) -> bool:
        return any(p.unsharded.grad is not None for p in self.params)

    def post_backward(self) -> None:
        """Reduce (unless gradient sync is off: full gradients then keep accumulating) and reshard."""
        if self.sync_grads:
            self.reduce_grads()
        if self.reshard_after_backward:
            self.reshard()

    def reduce_grads(self) -> None:
        """Average the full gradients over the data-parallel ranks into the shards' gradients.

        One reduce-scatter (plus one all-reduce across replicas) for the whole unit. A
        parameter no rank computed a gradient for keeps the gradient it had.
        """
        grad_params = [p for p in self.params if p.sharded.requires_grad]
        if not grad_params:
            return
        full_grads = [p.unsharded.grad for p in grad_params]
        numels = [p.shard_numel for p in grad_params]
        group = self.group
        with torch.profiler.record_function(f"fullshard::reduce_scatter {self.fqn}"):
            packed = pack_grads(full_grads, numels, world=group.world,
                                dtype=grad_params[0].sharded.dtype, device=self.local_flat.device)
            for p in grad_params:
                p.unsharded.grad = None
            shard = reduce_scatter_grads(packed, shard_group=group.shard_pg,
                                         replicate_group=group.replicate_pg, dp_size=group.dp_size)
        total = sum(numels)
        flags = shard[total:].tolist()
        offset = 0
        for p, numel, flag in zip(grad_params, numels, flags):
            if flag:
                p.accumulate_grad(shard[offset : offset + p.local_shape.numel()].view(p.local_shape))
            offset += numel
