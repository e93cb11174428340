"""What torch.distributed.pipelining's schedules reach for in a stage made of fullshard units,
through torch's `fully_shard.state(module)`: FSDP2's names, fullshard's units behind them.

# Note [pipeline stages]: a schedule (torch.distributed.pipelining) runs a stage's forward and
# backward once per microbatch. Before each backward it turns the stage's gradient sync,
# resharding after backward and "last backward" off (FSDPModule's setters), so every unit
# keeps its full gradients, unreduced, summing the microbatches, and its full parameters.
# After the stage's last backward it turns them on again, then, through torch's own
# `fully_shard.state(stage)`, calls `post_backward()` on every param group of every state in
# `_state_ctx.all_states` (a unit here: reduce what the microbatches accumulated, once, and
# reshard), then the root's `_root_post_backward_final_callback()` (wait for those
# reductions, land them, settle the all-reduce across replicas and the non-finite check).
# Multi-stage schedules also `unshard(async_op=True)` every unit of a stage ahead of its
# actions, `wait()` the handles and `reshard()` the units after. torch's `fully_shard.state`
# reads the module's composable-state dict under torch's own fully_shard function, so
# fully_shard puts a StageState there for every module it makes a unit; REACHED lists what
# the schedules reach for, which tests/test_pipelining.py checks against torch's source.
# Anything else asked of it (torch's FSDP2 around or inside fullshard units, which would
# drive them as its own) is a FullShardError naming what was asked.
"""

from __future__ import annotations

import weakref

import torch.nn as nn
from torch.distributed._composable.contract import STATE_KEY

from fullshard.errors import fail
from fullshard.hooks import unit_hooks, units_under
from fullshard.unit import Unit

# the attributes of `fully_shard.state(stage)` and of what it holds that torch's schedules use
# (torch.distributed.pipelining.stage: perform_reduce_grad), by the object they are read from
REACHED = {"state": ("_state_ctx", "_root_post_backward_final_callback"), "context": ("all_states",),
           "unit state": ("_fsdp_param_groups", "_fsdp_param_group"), "param group": ("post_backward",)}


class Unsupported:
    """A stand-in of FSDP2's state objects: any attribute not offered is a FullShardError."""

    what = "a fullshard unit's state"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise fail(f"{self.what} was asked for {name!r}, which only torch's FSDP2 has: a module that fullshard "
                   f"shards is being driven as torch's FSDP2 module (torch's fully_shard applied around or inside "
                   f"fullshard units, or code that reaches into FSDP2's internals)",
                   "Shard every unit of a model (each pipeline stage included) with one library: fullshard's "
                   "fully_shard or shard_model, or torch's fully_shard under fullshard.replace_fsdp2().")


class StageState(Unsupported):
    """torch's `fully_shard.state(module)` of a module fully_shard made a unit (Note [pipeline
    stages]): its own context, whose states are the units under the module."""

    what = "the state of a module fullshard shards"

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)  # the module holds this object: no cycle

    @property
    def _state_ctx(self) -> StageState:
        return self

    @property
    def all_states(self) -> list[UnitState]:
        module = self.module()
        return [] if module is None else [UnitState(unit) for unit in units_under(module)]

    def _root_post_backward_final_callback(self) -> None:
        """After the schedule's post_backward of every unit: the end of the stage's backward."""
        module = self.module()
        hooks = unit_hooks(module) if module is not None else None
        if hooks is not None and hooks.root is not None:  # a stage that never ran forward has nothing to end
            hooks.root.final_callback()


class UnitState(Unsupported):
    """One unit, as an FSDP2 state holding one param group."""

    what = "the state of a fullshard unit"

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

    @property
    def _fsdp_param_groups(self) -> list[ParamGroup]:
        return [ParamGroup(self.unit)]

    @property
    def _fsdp_param_group(self) -> ParamGroup:  # torch before 2.9 holds one group per state
        return ParamGroup(self.unit)


class ParamGroup(Unsupported):
    """One unit's parameters, as FSDP2's param group."""

    what = "a fullshard unit's param group"

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

    def post_backward(self) -> None:
        """Reduce the full gradients the microbatches accumulated (with gradient sync back on)
        and reshard, as the unit's own post-backward does."""
        self.unit.finish_backward()


def state_key() -> object | None:
    """The key torch's `fully_shard.state(module)` reads a module's composable-state dict under,
    as it reads it (None when torch's FSDP2 looks elsewhere, or is not there)."""
    try:
        from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard
    except ImportError:
        return None

    asked = []

    class Reader(dict):
        def get(self, key, default=None):
            asked.append(key)
            return default

    probe = nn.Module()
    probe.__dict__[STATE_KEY] = Reader()
    try:
        torch_fully_shard.state(probe)
    except Exception:  # noqa: BLE001 (any change of torch's lookup means: not ours to fill)
        return None
    return asked[0] if len(asked) == 1 else None


KEY = state_key()


def register(module: nn.Module) -> None:
    """Make torch's `fully_shard.state(module)` this unit's StageState."""
    if KEY is not None:
        module.__dict__.setdefault(STATE_KEY, {})[KEY] = StageState(module)
