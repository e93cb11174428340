"""When units gather, free and reduce: module hooks and autograd hooks (the Root's final callback ends
backward); and the optimizer step pre-hook that refuses an optimizer that would not train a sharded model.

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
#
# Note [kept after forward]: two units keep their full parameters from forward to
# backward whatever reshard_after_forward says, because backward needs them at once:
# the root (whose outputs are the first to get gradients) and the unit that started
# its forward last in the previous step (the first to get gradients in a sequential
# model). Freeing them would only gather them again: one gather per step each saved,
# for one unit's full parameters held a little longer. set_reshard_after_forward(True)
# asks for FSDP2's behaviour instead: the unit that ran last frees too (the root never).
#
# Note [forward inside full_params]: inside full_params the modules hold the full master
# parameters, so a forward there (evaluation, generation a token at a time) runs like the
# unsharded model: the hooks neither gather, cast nor free, and no collective runs, so
# ranks need not take part together. With rank0_only the other ranks hold shards only;
# a forward there raises at once instead of waiting for a gather rank 0 never joins.
#
# Note [compiled modules]: the hooks run eagerly, never traced by torch.compile: they
# communicate, keep state across steps and read clocks, which a traced graph could only
# replay or guard on (recompiling at every step). A compiled unit (`block.compile()`,
# before or after fully_shard) therefore runs its forward as compiled graphs between
# hooks that gather before it and free after it, as an eager unit does.
#
# Note [prefetch]: a unit's gather is issued before it is needed so that it runs while
# other units compute (the paper's backward and forward prefetch). Forward prefetch
# follows the order the units ran in during the previous forward (each forward records
# it anew, so a changed branch is followed from the next step on); backward prefetch
# follows the reverse of this step's forward order. A unit's explicit prefetch list
# replaces the recorded order for it. The limiter counts units gathered ahead of use:
# a recorded-order prefetch stops at `limit` of them, which bounds the full parameters
# alive at once to the units in use plus `limit`. Reductions overlap too: a unit's
# reduce-scatter is issued at its post-backward and waited for at the next unit's.
#
# Note [inference mode]: a tensor made under torch.inference_mode() can never be written in
# place outside it, and fullshard keeps tensors across steps (communication buffers in
# its pool, the 1/k copy after forward, gradient flags) and writes them in place at the
# next step. So every hook, and every entry point a user may call under inference mode
# (unshard, full_params), runs fullshard's own work with inference mode off and
# gradients off (`normal_tensors`): what it makes is an ordinary tensor, and the user's
# forward under inference mode computes with ordinary full parameters. An evaluation
# under inference mode then works before the first step, between steps and after the
# last, as under no_grad.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
from collections import UserDict
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from fullshard import runtime
from fullshard.errors import CollectiveError, collective_failed, fail
from fullshard.options import Schedule
from fullshard.param import OwnedParam
from fullshard.root import Root
from fullshard.unit import Phase, Unit

HOOKS_ATTR = "_fullshard_hooks"


@contextlib.contextmanager
def ordinary_tensors() -> Iterator[None]:
    """Inference mode off and gradients off, when inside inference mode (Note [inference mode])."""
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def normal_tensors(fn: Callable) -> Callable:
    """`fn`, a public function that may communicate, run under ordinary_tensors (Note
    [inference mode]); a collective that fails inside it and is not yet a unit's named error
    (DTensor's, of a tensor-parallel value) is raised as the FullShardError that names it."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with ordinary_tensors():
            try:
                return fn(*args, **kwargs)
            except CollectiveError as e:
                raise collective_failed(fn.__name__, e) from None

    return run


# ---- the optimizer's step pre-hook: a guard against optimizers that would not train the model ----

# Original parameter -> description of the unit that took it. A parameter registered in
# two units would get two independent shards that silently drift apart (the failure of
# tied weights split across units), so a second unit asking for it is refused.
OWNER = WeakIdKeyDictionary()  # weak, by identity: tensors compare elementwise

_optimizer_hook = None  # check_optimizer_step's handle, once registered


def claim(owned: list[OwnedParam], what: str, ignored) -> None:
    """Record what a new unit took (and the parameters its call left to the user), and guard
    optimizer steps from now on (check_optimizer_step)."""
    global _optimizer_hook
    for o in owned:
        OWNER[o.param] = f"{what} (as {o.fqn!r})"
    IGNORED.update((p, True) for p in ignored)
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(check_optimizer_step)

def check_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Before every optimizer step (a global hook, registered by the first fully_shard): refuse
    an optimizer that would silently not train a sharded model. Only the parameters that are
    not DTensors, few in a sharded model, need a look. It is also the first write to the
    shards after a background save's copies: those are ordered before it here."""
    if runtime.BEFORE_NEXT_STEP:
        runtime.order_before_step()
    stale, unaveraged, sharded = [], [], False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, torch.distributed.tensor.DTensor):
                sharded = True
            elif p in OWNER:
                stale.append(OWNER[p])
            elif p.grad is not None and p not in DDP_AVERAGED and p not in IGNORED:
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

DDP_AVERAGED = WeakIdKeyDictionary()  # parameters a DistributedDataParallel (e.g. replicate()'s) averages

IGNORED = WeakIdKeyDictionary()  # ignored_params: the user averages (or means to keep) them

def ddp_averaged() -> WeakIdKeyDictionary:
    """Parameters that live DistributedDataParallel instances (torch's replicate() makes one)
    average. Found by a scan of the heap, on the path that would otherwise refuse the step,
    and remembered, so a model that composes with DDP pays for it once."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel):  # type(), not isinstance: a dead weakref.proxy raises
            DDP_AVERAGED.update((p, True) for p in obj.parameters() if p.requires_grad)
    return DDP_AVERAGED


def hooks_on(module: nn.Module) -> list[UnitHooks]:
    """The hooks of the units a fully_shard call made of `module`: one, or one per mesh (Note
    [meshes of one call]), the call's own mesh's first."""
    return module.__dict__.get(HOOKS_ATTR, [])


def unit_hooks(module: nn.Module) -> UnitHooks | None:
    """The hooks of `module`'s unit over the mesh of its fully_shard call, if it is a unit."""
    hooks = hooks_on(module)
    return hooks[0] if hooks else None


def hooks_for(unit: Unit) -> UnitHooks:
    return next(hooks for hooks in hooks_on(unit.module) if hooks.unit is unit)


def units_under(module: nn.Module) -> list[Unit]:
    """The units of `module` and its submodules, outermost first (a module group's once)."""
    return list(dict.fromkeys(hooks.unit for m in module.modules() for hooks in hooks_on(m)))


def units_of(model: nn.Module, what: str) -> list[Unit]:
    """units_under a model a public function (`what`) was given, refusing anything else."""
    if not isinstance(model, nn.Module):  # e.g. model.parameters(), as torch's clip_grad_norm_ takes
        raise fail(f"{what} takes the sharded model (an nn.Module), got {type(model).__name__}",
                   "Pass the model itself (torch's own clip_grad_norm_ takes model.parameters() and works on "
                   "fullshard's gradients too).")
    units = units_under(model)
    if not units:
        raise fail(f"{what} was given a model that fullshard has not sharded",
                   "Call fullshard.shard_model(model) or fully_shard on it first.")
    return units


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


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any, *, output: bool = False) -> Any:
    """Apply `fn` to the tensors in nested tuples, lists, mappings and dataclasses, rebuilding
    only what changes (the caller's objects are left as they were).

    A dataclass is copied and its changed fields set (no __init__ or __post_init__ runs); a
    dict or UserDict (e.g. a Hugging Face BatchEncoding) is copied; a module's `output` that
    is another mutable mapping (e.g. a Hugging Face model output) is updated in place.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    named = isinstance(obj, tuple) and hasattr(obj, "_fields")  # a namedtuple
    if type(obj) in (tuple, list) or named:
        items = [map_tensors(fn, item, output=output) for item in obj]
        if all(new is old for new, old in zip(items, obj)):
            return obj
        return type(obj)(*items) if named else type(obj)(items)
    if isinstance(obj, Mapping):
        changed = {key: new for key, value in obj.items()
                   if (new := map_tensors(fn, value, output=output)) is not value}
        if not changed:
            return obj
        if output and isinstance(obj, MutableMapping):
            out = obj
        elif isinstance(obj, (dict, UserDict)):
            out = copy.copy(obj)
        else:  # a mapping type whose copy might share its contents: left as it is
            return obj
        for key, value in changed.items():  # not update(): Hugging Face's ModelOutput refuses it
            out[key] = value
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {f.name: new for f in dataclasses.fields(obj)
                   if (new := map_tensors(fn, value := getattr(obj, f.name), output=output)) is not value}
        if not changed:
            return obj
        out = copy.copy(obj)
        for name, value in changed.items():
            object.__setattr__(out, name, value)  # frozen dataclasses too
        return out
    return obj


def cast_floats(obj: Any, dtype: torch.dtype | None, *, output: bool = False) -> Any:
    """`obj` with its floating-point tensors cast to `dtype` (mixed precision); as is for None."""
    if dtype is None:
        return obj
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, obj, output=output)


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


# Note [module groups]: fully_shard([m1, m2]) makes one unit of several modules, as FSDP2
# does (e.g. a final norm and the output head): every member carries the unit's hooks. The
# first member to start its forward gathers (and its inputs carry the PostBackward that
# reduces); the others then run on the full parameters, and the unit frees them after the
# last member's forward. Every member's outputs trigger the gather before backward, and a
# member whose gradients arrive after the reduction is reduced at the end of backward
# (finish_backward), as a unit used twice is.


class UnitHooks:
    """The hooks of one unit (Note [backward triggers]): they turn module and autograd events
    into calls of the unit and of its Root, which the outermost unit's hooks make at lazy init."""

    def __init__(self, unit: Unit, schedule: Schedule) -> None:
        self.unit = unit
        self.schedule = schedule  # the root's applies to every unit under it (its Scheduler's)
        self.root: Root | None = None
        self.is_root = False
        self.forward_targets: list[Unit] | None = None  # explicit prefetch lists (set_prefetch_targets)
        self.backward_targets: list[Unit] | None = None
        self.shown: bool | None = None  # inside full_params: whether this rank sees the full parameters (show)
        self.members = frozenset(id(m) for m in unit.modules) if len(unit.modules) > 1 else frozenset()
        self.to_run: set[int] = set()  # a module group's members yet to run this forward (Note [module groups])
        for module in unit.modules:
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward)

    def lazy_init(self) -> Root:
        """On the first forward, the outermost unit becomes the root of every unit below it."""
        if self.root is None:
            names = {module: name for name, module in self.unit.module.named_modules()}
            hooks = list(dict.fromkeys(h for module in names for h in hooks_on(module)))
            fqns = [names[h.unit.module] or "<root>" for h in hooks]
            root = Root([h.unit for h in hooks], self.schedule, f"model {self.unit.uid} ({self.unit.class_name})",
                        fqns)  # Note [named hangs]
            for h in hooks:
                h.root = root
                h.is_root = h is self
        return self.root

    def set_prefetch_targets(self, *, forward: list[Unit] | None = None, backward: list[Unit] | None = None) -> None:
        """FSDP2's set_modules_to_forward_prefetch / _backward_prefetch: explicit lists (one side at a time)."""
        if forward is not None:
            self.forward_targets = forward
        if backward is not None:
            self.backward_targets = backward

    def show(self, visible: bool | None) -> None:
        """Inside full_params (Note [forward inside full_params]): whether this rank sees the full
        parameters; None when the context ends."""
        self.shown = visible

    @torch.compiler.disable  # Note [compiled modules]
    @normal_tensors
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        root = self.lazy_init()
        if self.shown is not None:  # Note [forward inside full_params]
            if not self.shown:
                raise fail("a forward ran inside full_params(rank0_only=True) on a rank other than 0, which holds "
                           "only shards and cannot gather them while rank 0 computes alone",
                           "Run the model only on rank 0 inside that context (e.g. `if rank == 0: evaluate()`).")
            return args, kwargs
        args, kwargs = cast_floats((args, kwargs), self.unit.options.input_dtype)
        if self.unit.phase is Phase.BACKWARD:  # Note [recomputed forward]
            self.unit.wait_unshard(adopt=False)
            return args, kwargs
        if self.unit.phase is Phase.FORWARD and id(module) in self.to_run:  # Note [module groups]
            return args, kwargs
        self.to_run = set(self.members)
        if self.is_root:
            root.recover()
            root.start_forward()
            root.check_first_forward(self.unit)
        self.unit.phase = Phase.FORWARD
        scheduler = root.scheduler
        scheduler.record(self.unit)
        self.unit.unshard(adopt=False)  # the root's start_forward scanned, Note [replaced parameters]
        scheduler.prefetch_forward(self.unit, self.forward_targets)
        grad = torch.is_grad_enabled()
        if grad:  # while the gather is in flight: the hook needs only the inputs
            args, kwargs = self.attach_post_backward(args, kwargs)
        self.unit.wait_unshard(adopt=False)  # may raise: the unit then expects no post-backward, as before it
        if grad:
            self.unit.expects_post_backward = True
        return args, kwargs

    def attach_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        inputs: list[torch.Tensor] = []  # in the order map_tensors meets them below

        def collect(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                inputs.append(t)
            return t  # unchanged: nothing is rebuilt

        map_tensors(collect, (args, kwargs))
        if not inputs:
            return args, kwargs
        outputs = iter(PostBackward.apply(self, *inputs))
        return map_tensors(lambda t: next(outputs) if t.requires_grad else t, (args, kwargs))

    @torch.compiler.disable  # Note [compiled modules]
    @normal_tensors
    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.shown is not None:
            return output
        output = cast_floats(output, self.unit.options.output_dtype, output=True)
        if self.unit.phase is Phase.BACKWARD:  # Note [recomputed forward]
            return output
        self.to_run.discard(id(module))
        if self.to_run:  # Note [module groups]: members still to run
            if torch.is_grad_enabled():
                self.hook_backward(output)
            return output
        self.unit.phase = Phase.IDLE
        if self.is_root:
            self.root.scheduler.drop_unused_prefetches()
        if not torch.is_grad_enabled():
            self.unit.reshard()
            return output
        options = self.unit.options  # as options.after_forward resolved reshard_after_forward
        if options.free_after_forward and not self.is_root and \
                not (options.keep_last and self.root.scheduler.ran_last(self.unit)):  # Note [kept after forward]
            self.unit.free_after_forward()
        self.hook_backward(output)
        return output

    def hook_backward(self, output: Any) -> None:
        """The first gradient that reaches an output of the unit starts its backward."""
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self.pre_backward)

    @torch.compiler.disable  # Note [compiled modules]
    def pre_backward(self, grad: torch.Tensor) -> None:
        if not self.root.callback_queued:  # by the first unit whose backward starts
            self.root.queue_final_callback()
        if self.unit.phase is not Phase.BACKWARD:
            self.unit.phase = Phase.BACKWARD
            scheduler, unshard = self.root.scheduler, self.unit.switches.unshard_in_backward
            scheduler.record(self.unit)
            if unshard:
                self.unit.unshard(adopt=False)
            if scheduler.schedule.prefetch_before_backward:
                scheduler.prefetch_backward(self.unit, self.backward_targets)
            if unshard:
                self.unit.wait_unshard(adopt=False)

    def post_backward(self) -> None:
        scheduler = self.root.scheduler
        if scheduler.schedule.prefetch_after_backward:
            scheduler.prefetch_backward(self.unit, self.backward_targets)
        self.unit.post_backward()
        scheduler.reduce_issued(self.unit)
