"""When units gather, free and reduce: module hooks, autograd hooks and the final backward callback.

# Note [backward triggers]: a unit's backward starts when a gradient reaches any of its
# forward outputs (a hook on each output tensor gathers the parameters), and ends when
# the gradients of its forward inputs are computed (PostBackward, an identity autograd
# Function wrapped around the inputs, reduces the gradients). Units whose inputs need no
# gradient (the first unit takes token ids), outputs used by only part of the loss, and
# gradients that arrive late are handled by the final callback, which the engine runs
# once the whole backward is done. Every rank takes the same decisions as long as the
# model's control flow is the same on every rank, so collectives stay matched.
#
# Note [recomputed forward]: activation checkpointing runs a unit's forward again inside
# its backward. A non-reentrant recompute happens after the unit's backward has begun
# (phase BACKWARD), builds a graph that is thrown away, and must not reshard: the hooks
# only make sure the parameters are full. A reentrant recompute runs before the unit's
# backward, builds the graph that the nested backward uses, and is an ordinary forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import Enum, auto
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd import Variable

from fullshard.unit import Unit

HOOKS_ATTR = "_fullshard_hooks"


def unit_hooks(module: nn.Module) -> UnitHooks | None:
    return module.__dict__.get(HOOKS_ATTR)


class Phase(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists, mappings and dataclasses (model outputs)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors_in(item)]
    if isinstance(obj, Mapping):
        return [t for item in obj.values() for t in tensors_in(item)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    return []


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Apply `fn` to the tensors in nested tuples, lists and plain dicts, rebuilding them."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in (tuple, list):
        return type(obj)(map_tensors(fn, item) for item in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, item) for item in obj))
    if type(obj) is dict:
        return {key: map_tensors(fn, value) for key, value in obj.items()}
    return obj


class PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs whose backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx: Any, hooks: UnitHooks, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hooks = hooks
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hooks.post_backward()
        return (None, *grads)


class RootContext:
    """What the units under one root share: the list of units and the final backward callback."""

    def __init__(self, units: list[UnitHooks]) -> None:
        self.units = units
        self.callback_queued = False

    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self.final_callback)

    def final_callback(self) -> None:
        """End of backward: reduce what no PostBackward reduced, and reshard every unit."""
        with torch.profiler.record_function("fullshard::final_callback"):
            for hooks in reversed(self.units):
                hooks.finish_backward()
        self.callback_queued = False

    def recover(self) -> None:
        """A backward that raised never ran the final callback: start the next step clean."""
        if self.callback_queued:
            for hooks in self.units:
                hooks.reset()
            self.callback_queued = False


class UnitHooks:
    """The hooks of one unit; the root's also owns the RootContext (Note [backward triggers])."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.ctx: RootContext | None = None
        self.is_root = False
        self.free_after_forward = unit.config.free_after_forward
        self.phase = Phase.IDLE
        self.needs_reduce = False
        unit.module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
        unit.module.register_forward_hook(self.post_forward)

    def lazy_init(self) -> RootContext:
        """On the first forward, the outermost unit becomes the root of every unit below it.

        The root keeps its parameters full from forward to backward: backward starts with
        it, so freeing them would only gather them again at once.
        """
        if self.ctx is None:
            names = {module: name for name, module in self.unit.module.named_modules()}
            units = [hooks for module in names if (hooks := unit_hooks(module)) is not None]
            ctx = RootContext(units)
            for hooks in units:
                hooks.ctx = ctx
                hooks.is_root = hooks is self
                hooks.free_after_forward = hooks.unit.config.free_after_forward and not hooks.is_root
                hooks.unit.fqn = names[hooks.unit.module] or type(self.unit.module).__name__
        return self.ctx

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        ctx = self.lazy_init()
        if self.phase is Phase.BACKWARD:  # Note [recomputed forward]
            self.unit.wait_unshard()
            return None
        if self.is_root:
            ctx.recover()
        self.phase = Phase.FORWARD
        self.unit.unshard()
        self.unit.wait_unshard()
        if not torch.is_grad_enabled():
            return None
        self.needs_reduce = True
        return self.attach_post_backward(args, kwargs)

    def attach_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        inputs: list[torch.Tensor] = []
        map_tensors(lambda t: inputs.append(t) if t.requires_grad else None, (args, kwargs))
        if not inputs:
            return None
        outputs = iter(PostBackward.apply(self, *inputs))
        return map_tensors(lambda t: next(outputs) if t.requires_grad else t, (args, kwargs))

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.phase is Phase.BACKWARD:  # Note [recomputed forward]
            return
        self.phase = Phase.IDLE
        if not torch.is_grad_enabled():
            self.unit.reshard()
            return
        if self.free_after_forward:
            self.unit.reshard()
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self.pre_backward)

    def pre_backward(self, grad: torch.Tensor) -> None:
        self.ctx.queue_final_callback()
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            self.unit.unshard()
            self.unit.wait_unshard()

    def post_backward(self) -> None:
        self.unit.post_backward()
        self.needs_reduce = False
        self.phase = Phase.IDLE

    def finish_backward(self) -> None:
        if self.needs_reduce or self.unit.has_full_grads():
            self.unit.post_backward()
        elif self.unit.reshard_after_backward:
            self.unit.reshard()
        self.needs_reduce = False
        self.phase = Phase.IDLE

    def reset(self) -> None:
        self.unit.reshard()
        for p in self.unit.params:
            p.unsharded.grad = None
        self.needs_reduce = False
        self.phase = Phase.IDLE
