"""FSDPModule: the methods every module fully_shard made a unit gets (FSDP2's surface), and
UnshardHandle."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from fullshard.errors import fail
from fullshard.hooks import UnitHooks, hooks_on, normal_tensors, unit_hooks, units_under
from fullshard.options import after_forward
from fullshard.unit import Unit


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
        self._switch(recurse, sync_grads=requires_gradient_sync, all_reduce_grads=requires_gradient_sync)

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch, honoured so that DDP code runs unchanged: assigning ``False`` is
        ``set_requires_gradient_sync(False)`` for this unit and every unit below it."""
        return all(unit.switches.sync_grads for unit in self._units(True))

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
        self._switch(recurse, all_reduce_grads=requires_all_reduce)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Keep the full parameters after backward (``False``), e.g. between accumulation steps.

        Args:
            reshard_after_backward: ``False`` leaves the unit full after its backward, so
                the next forward needs no all-gather; call ``reshard()`` when done.
            recurse: apply to every unit in this module's subtree.
        """
        self._switch(recurse, reshard_after_backward=reshard_after_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the full parameters after forward (``True``) or keep them until backward.

        ``True`` frees them even in the unit that ran its forward last, as FSDP2 does (by
        default fullshard keeps that unit's, whose backward starts at once: Note [kept after
        forward]); the root unit keeps them either way.

        Args:
            reshard_after_forward: as ``fully_shard``'s, a bool.
            recurse: apply to every unit in this module's subtree.
        """
        fields = after_forward(reshard_after_forward, 1, True, setter=True)  # an int k given to fully_shard goes
        for unit in self._units(recurse):
            unit.relayout(options=dataclasses.replace(unit.options, **fields))

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
        self._switch(False, unshard_in_backward=unshard_in_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients (not those of units below it, as FSDP2) by `factor`
        instead of the data-parallel size.

        Args:
            factor: a positive number (1.0: the sum over ranks).
        """
        if not (isinstance(factor, (int, float)) and factor > 0):
            raise fail(f"set_gradient_divide_factor({factor!r}): the factor must be a positive number",
                       "Pass e.g. 1.0 for the sum over ranks.")
        self._switch(False, divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Call ``hook(reduced)`` on each of this unit's reduced gradient rows (this rank's shard,
        after the reduction across replicas when hybrid), before they land on the gradients;
        the hook may change the row in place, e.g. all-reduce it over a group of your own. A
        hook that returns something with a ``wait()`` (an async collective's work) has its
        row landed at the end of backward, after that wait: its communication overlaps the
        rest of backward (Note [waited hooks] in reduce.py).

        Args:
            hook: ``hook(reduce_output: torch.Tensor) -> None`` (or a waitable).
            stream: not taken: the hook runs on the compute stream, which has waited for the
                reduction.
        """
        if not callable(hook) or stream is not None:
            raise fail("set_all_reduce_hook takes a callable and no stream",
                       "Pass hook(reduce_output) -> None; it runs on the compute stream after the reduction.")
        self._switch(False, all_reduce_hook=hook)

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: reshard every unit, drop gathers and
        reductions in flight and the step's full gradients, so the next step runs normally.
        Call it on the root (the outermost unit)."""
        hooks = unit_hooks(self)
        if hooks.root is not None and not hooks.is_root:
            raise fail("reset_iter_state() was called on a unit that is not the root",
                       "Call it on the outermost sharded module (the one whose forward you call).")
        if hooks.root is not None:
            hooks.root.reset()

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce this unit's gradients with sums only (``True``), dividing afterwards, never NCCL's
        average; on gloo fullshard always does."""
        if not isinstance(enable, bool):
            raise fail(f"set_force_sum_reduction_for_comms({enable!r}) takes a bool", "Pass True or False.")
        self._switch(False, force_sum=enable)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these units, in this order, when this unit's forward starts.

        Replaces the recorded forward order for this unit (and ignores the limiter).

        Args:
            modules: modules passed to ``fully_shard`` (units of the same model).
        """
        self._prefetch("forward", modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """Gather these units, in this order, when this unit's backward starts.

        Replaces the reversed forward order for this unit (and ignores the limiter).

        Args:
            modules: modules passed to ``fully_shard`` (units of the same model).
        """
        self._prefetch("backward", modules)

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
        self._switch(recurse, timeout=timedelta(seconds=seconds))

    def set_debug_checks(self, enabled: bool, *, recurse: bool = True) -> None:
        """Before every collective, check that all ranks run the same one: the same unit, the same
        step and (for reductions) gradients for the same parameters; raise naming what each rank
        was about to do when they differ. Off by default: it adds a small all-gather per
        collective (cost in docs/reliability.md).

        Args:
            enabled: turn the checks on or off.
            recurse: apply to every unit in this module's subtree.
        """
        self._switch(recurse, debug=bool(enabled))

    def set_nonfinite_grads(self, policy: str | None) -> None:
        """What a gradient with an inf or NaN does (after reduction; every rank decides alike).

        Args:
            policy: ``"raise"`` (a FullShardError naming the unit and step, from ``backward()``),
                ``"skip"`` (every rank drops all gradients of the step, so ``optimizer.step()``
                changes nothing; counted in ``fullshard.stats``) or ``None`` (no check, the
                default). A pipeline stage decides alone (docs/composition.md). It applies to this unit and every unit below it (on the root: the
                whole model).
        """
        if policy not in (None, "raise", "skip"):
            raise fail(f"set_nonfinite_grads({policy!r}) is not a policy", "Pass 'raise', 'skip' or None.")
        self._switch(True, nonfinite=policy)

    def _prefetch(self, side: str, modules: list[nn.Module]) -> None:
        targets = [hooks.unit for hooks in hooks_of(modules, f"set_modules_to_{side}_prefetch")]
        for hooks in hooks_on(self):
            hooks.set_prefetch_targets(**{side: targets})

    def _switch(self, recurse: bool, **switches: object) -> None:
        for unit in self._units(recurse):
            unit.switch(**switches)

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
            if any(not p.extension and not local.is_meta and
                   local.untyped_storage()._cdata != shard.untyped_storage()._cdata
                   for p, local, shard in zip(unit.params, moved, unit.layout.shards)):
                device = next(local.device for local in moved if not local.is_meta)
                unit.relayout(device=unit.group.device if unit.options.offload else device,
                              dtypes=[local.dtype for local in moved])
        return module

    def __deepcopy__(self, memo: dict) -> None:
        raise fail(
            f"a sharded {type(self).__name__} cannot be deep-copied: each rank holds only its shard",
            "Copy the model before sharding it, or build a new one and load "
            "fullshard.get_state_dict(model) into it.",
        )

for _name, _why in NOT_OFFERED.items():
    setattr(FSDPModule, _name, not_offered(_name, _why))

def hooks_of(modules: list[nn.Module], what: str) -> list[UnitHooks]:
    """The hooks of `modules`, which must all be units."""
    others = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
    if others:
        raise fail(f"{what} was given modules that are not units: {others}",
                   "Pass modules that fully_shard (or shard_model) made into units.")
    return [hooks for m in modules for hooks in hooks_on(m)]
