"""Unit: the parameters of one fully_shard call, communicated together: its state machine.

A training step moves every unit through the same cycle (hooks.py decides when):

    SHARDED --unshard()--> GATHERING --wait_unshard(): finish_gather--> SHARDED --> FULL
    FULL    --reshard()-->                                                 SHARDED
    SHARDED --unshard()--> GATHERING --wait_unshard()-->                   FULL     (before backward)
    FULL    --post_backward(): grads.issue(), reshard()-->                 SHARDED, its reduction in flight
    finish_reductions() lands that reduction on the shards' gradients a little later.

(finish_gather leaves the unit SHARDED with the full parameters gathered into storage the
modules do not hold yet; a unit whose shards are its full parameters, one rank in the same
dtype, goes from SHARDED to FULL without gathering.) Every transition checks the state it
starts from (`move`). How a gather or a reduction runs is its plan's (gather.py, reduce.py):
made with the layout, here and at relayout, and for the reductions again for another set of
trainable parameters or other reduction switches.

Between steps every unit is SHARDED with no collective in flight: the modules hold
the DTensor shards, which is all the optimizer sees. While FULL, the modules hold the
full parameters (plain tensors, or DTensors on a tensor-parallel or SPMD mesh), views of
one storage per unit that exists only while needed.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from enum import Enum, auto

import torch
import torch.distributed as dist
from torch import nn

from fullshard import extension, low_precision, quantize, units  # noqa: F401 (the formats register)
from fullshard.checks import check_next_collective
from fullshard.errors import CollectiveError, FullShardError, fail, replaced_while_full
from fullshard.gather import Context, Gathering, GatherPlan, format_for
from fullshard.layout import UnitLayout
from fullshard.mesh import ShardGroup, smaller_group
from fullshard.options import UnitOptions, UnitSwitches
from fullshard.param import OwnedParam, ShardedParam, has_extension, local_values, rows_first, shard_numel
from fullshard.reduce import Reductions
from fullshard.routes import stream_runtime
from fullshard.runtime import NOTHING, label, profiling
from fullshard.shared import Naming, Shared
from fullshard.accounting import new_counts
from fullshard.tags import GATHER


class Phase(Enum):
    """Where a step is for the unit, as its hooks saw it (Note [backward triggers])."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


class ShardState(Enum):
    SHARDED = auto()  # the modules hold the shards; no gather in flight
    GATHERING = auto()  # a gather into the full storage is in flight (`gathering`)
    FULL = auto()  # the modules hold the full parameters


class Unit:
    """The shards of one unit, their all-gather into full parameters, and their gradient reduction."""

    def __init__(self, modules: list[nn.Module], owned: list[OwnedParam], group: ShardGroup,
                 options: UnitOptions, uid: int) -> None:
        self.uid = uid  # agreed by every rank of its groups, Note [named hangs]
        self.modules = modules  # one, or FSDP2's group of modules sharded together (Note [module groups])
        self.module = modules[0]
        self.group = group
        self.options = options
        self.switches = UnitSwitches()
        self.fqn = ""  # set by the root at lazy init (join), for messages and profiler labels
        self.class_name = type(self.module).__name__  # before fully_shard swaps the class, for messages
        self.index = 0  # position among the root's units (lazy init), for the non-finite check
        self.shared = Shared(f"model {uid} ({self.class_name})")  # the root's after lazy init (join)
        self.naming = Naming(uid, self.class_name, self.shared)
        self.counts = new_counts()  # this unit's collectives (accounting.Stats reads them)
        self.phase = Phase.IDLE
        self.expects_post_backward = False  # a forward with gradients ran: its PostBackward, or the root's callback, reduces
        self.layout = UnitLayout([shard_numel(rows_first(local_values(o.param).shape, o.dim), group.world)
                                  for o in owned], [has_extension(local_values(o.param)) for o in owned], group)
        self.layout.set_dtypes([o.param.dtype for o in owned], options)
        self.compute_device = torch.device("meta") if any(o.param.is_meta for o in owned) else group.device
        segments = self.layout.allocate(self.compute_device, options)
        self.params = [ShardedParam(o.param, o.slots, o.fqn, group, *segment, o.dim, o.view)
                       for o, segment in zip(owned, segments)]
        self.layout.release()
        self.state = ShardState.SHARDED
        self.gathering: Gathering | None = None  # while GATHERING
        self.gathering_plan: GatherPlan | None = None
        self.grads = Reductions(self.params, self.layout, group, uid, self.counts, self.shared, self.naming)
        self.make_plans()
        for p in self.params:
            p.to_sharded()
        units.register(self)
        self.unset: set[str] = set()  # parameters of a meta-built unit that assign=True loads have not reached

    # ---- what configures it ----------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        return self.switches.timeout

    def switch(self, **fields: object) -> None:
        """Change switches (FSDP2's setters): a new UnitSwitches with these fields."""
        self.switches = dataclasses.replace(self.switches, **fields)
        self.grads.plans.clear()  # the averaging follows the divide factor and force_sum
        for p in self.params:  # DTensor's collectives of tensor-parallel parameters: within the unit's timeout
            p.caller = dataclasses.replace(p.caller, timeout=self.timeout)
        if "reshard_after_backward" in fields and self.state is ShardState.SHARDED:  # Note [shown parameters]
            for p in self.params:
                p.to_full() if self.expects_post_backward and not fields["reshard_after_backward"] else \
                    p.to_sharded()

    def make_plans(self) -> None:
        """The gather plans (a unit whose shards are its full parameters has none: Note [stable
        full params]), made with the layout; the reduce plans are made at the first reduction of
        each set of trainable parameters."""
        layout, group = self.layout, self.group
        self.grads.plans.clear()
        self.gather = self.small_gather = None
        if layout.full_flat is None or self.compute_device.type == "meta":
            return
        context = Context(self.options, self.compute_device, group.world, group.shard_mesh, self.module,
                          layout.extension_policy)
        formats = [format_for(p, dtype, context) for p, dtype in zip(self.params, layout.full_dtypes)]
        self.gather = GatherPlan(formats, group.shard_pg, self.compute_device, layout.wire_dtype, self.uid,
                                 storage=layout.full_flat, storage_bytes=layout.full_bytes, offload=self.options.offload)
        small_group = smaller_group(group, self.options.post_forward_world)
        if small_group is not None:
            self.small_gather = GatherPlan(formats, small_group, self.compute_device, layout.wire_dtype, self.uid,
                                           storage=layout.full_flat, storage_bytes=layout.full_bytes, small=True)

    def relayout(self, *, options: UnitOptions | None = None, device: torch.device | None = None,
                 dtypes: list[torch.dtype] | None = None) -> None:
        """The one entry point for what the unit derives from its options, device and dtypes
        (set_reshard_after_forward's new options; Module.to_empty / .to / .double(), deferred
        init and a first assign-load giving a meta-built unit storage on `device`, in `dtypes`).
        Storage is remade only for a new device: the shards keep the values they hold (none for
        meta). Which parameters are trainable is read at each reduction."""
        if options is not None:
            self.options = options
            if self.state is not ShardState.GATHERING:  # a gather may be reading the 1/k copy
                self.drop_small()
        if device is not None:
            assert self.state is ShardState.SHARDED, f"relayout(device=...) in state {self.state.name}"
            self.compute_device = device
            self.unset = set()
            if dtypes is not None:
                self.layout.set_dtypes(dtypes, self.options)
            for p, segment in zip(self.params, self.layout.allocate(device, self.options)):
                p.rebind(*segment)
            self.layout.release()
        self.make_plans()

    def join(self, fqn: str, index: int, shared: Shared) -> None:
        """Lazy init: the root names the unit and shares with it what its units share."""
        self.fqn, self.index, self.shared = fqn, index, shared
        self.naming.fqn, self.naming.shared = fqn, shared
        self.grads.shared = shared

    @property
    def described(self) -> str:
        return self.naming.described

    @property
    def step(self) -> int:
        return self.shared.step

    def reset(self) -> None:
        """Drop the step in flight (a backward that raised): sharded, nothing pending, no full gradient."""
        self.grads.reset()
        self.reshard()
        self.expects_post_backward = False
        self.phase = Phase.IDLE

    def move(self, to: ShardState, *starts: ShardState) -> None:
        """Change state, checking the transition starts from one of `starts`."""
        assert self.state in starts, f"unit {self.fqn!r}: {self.state.name} -> {to.name}, expected from " \
                                     f"{'/'.join(s.name for s in starts)}"
        self.state = to

    def metered(self, delta: int) -> None:
        """Add `delta` bytes to the root's meter of full parameters (at 0), raising its peak (at 1)."""
        meter = self.shared.meter
        meter[0] += delta
        if meter[0] > meter[1]:
            meter[1] = meter[0]

    # ---- the error path, Note [named hangs] -------------------------------------------

    def failed(self, collective: str, error: Exception) -> FullShardError:
        return self.naming.failed(collective, error)

    # ---- all-gather -------------------------------------------------------------

    def unshard(self, adopt: bool = True) -> None:
        """Start gathering the full parameters; a no-op when full or already gathering.
        `adopt`: first take parameters assigned in the shards' place (the hooks scan for them
        once per step instead, at the root's forward: Note [replaced parameters])."""
        if self.state is not ShardState.SHARDED:
            return
        if adopt:
            self.adopt_replaced()  # before the gather reads the shards
        if self.unset or self.compute_device.type == "meta":
            self.check_has_values()
        if self.gather is None:
            return
        if self.switches.debug:  # every rank about to gather this unit at this step
            check_next_collective(self.group, self.timeout, self.naming,
                                  [self.uid, GATHER, self.shared.step, 0, self.shared.evaluating])
        small = self.small_gather is not None and self.small_gather.kept is not None
        plan = self.small_gather if small else self.gather
        with label(f"fullshard::gather {self.fqn}") if profiling() else NOTHING:
            try:
                what = self.naming.what("all-gather") if stream_runtime(plan.cpu) is not None else ""  # for a stream model, the hang watch
                self.gathering = plan.issue(self.layout.shards, self.shared.pool, what, self.timeout)
            except CollectiveError as e:
                raise self.naming.failed("all-gather", e) from None
        self.gathering_plan = plan
        self.metered(self.layout.full_bytes)
        self.move(ShardState.GATHERING, ShardState.SHARDED)
        if plan.world > 1:
            self.counts["gathers"] += 1
            self.counts["gather_bytes"] += (plan.world - 1) * self.gathering.payload.nbytes

    def wait_unshard(self, adopt: bool = True) -> None:
        """Finish the gather and register the full parameters on the modules (`adopt`: as unshard's)."""
        if self.state is ShardState.FULL:
            replaced = None
            for p in self.params:  # loops, not replacement() calls: before every use of a full unit
                for module, name in p.slots:
                    if module._parameters.get(name) is not p.unsharded:
                        replaced = p
            if replaced is not None:
                raise replaced_while_full(replaced.fqn)
            return
        if adopt and self.state is ShardState.GATHERING:  # a prefetch: replaced parameters drop what it gathered
            self.adopt_replaced()
        self.unshard(adopt)  # adopts replaced parameters unless already gathering (a prefetch: scanned above)
        if self.gathering is not None:
            start = time.perf_counter()
            with label(f"fullshard::wait gather {self.fqn}") if profiling() else NOTHING:
                self.finish_gather()
            self.counts["wait_s"] += time.perf_counter() - start
        for p in self.params:  # ShardedParam.to_full, inline: once per parameter per gather
            full, shard = p.unsharded, p.sharded
            if full.requires_grad != shard.requires_grad:
                full.requires_grad_(shard.requires_grad)
            for module, name in p.slots:
                module._parameters[name] = full
        self.move(ShardState.FULL, ShardState.SHARDED)  # finish_gather left GATHERING

    def finish_gather(self) -> None:
        """Wait for the gather in flight into the full parameters; drop the copy it gathered from."""
        plan, gathering = self.gathering_plan, self.gathering
        self.gathering = None
        try:
            plan.finish(gathering, self.shared.pool)
        except CollectiveError as e:
            raise self.naming.failed("all-gather", e) from None
        self.move(ShardState.SHARDED, ShardState.GATHERING)  # gathered into storage the modules do not hold yet
        if plan.small:  # the copy it gathered from
            self.metered(-plan.drop())

    def check_has_values(self) -> None:
        """Refuse to gather a unit still on the meta device, or one that assign=True loads gave
        only some of its values (a forward would compute with zeros)."""
        if self.compute_device.type == "meta" or self.unset:
            what = "its parameters are on the meta device" if self.compute_device.type == "meta" else \
                f"parameters {sorted(self.unset)} were given no values by load_state_dict(assign=True)"
            raise fail(f"unit {self.fqn or self.class_name!r} cannot run: {what}",
                       "Give every parameter values first: model.to_empty(device=...) then initialize (e.g. "
                       "reset_parameters()), or load_state_dict(..., assign=True) of every parameter.")

    # Note [replaced parameters]: load_state_dict(assign=True), or a user's assignment, may put
    # another tensor in a shard's place between steps; the unit takes it as the shard
    # (adopt_replaced). Looking costs a check of every slot of every parameter, so the root
    # looks once per step, at the start of its forward, for every unit under it; unshard()
    # called by a user looks again (a load may have happened since). A replacement while a
    # unit is FULL (after a forward without backward) is refused by wait_unshard, which the
    # hooks run before every use of a full unit.

    def adopt_replaced(self) -> None:
        """Take parameters assigned in the shards' place between steps (load_state_dict(assign=True))
        as the shards (ShardedParam.adopt); a unit still on the meta device gets storage first,
        its other parameters waiting for theirs (a checkpoint loaded file by file), and a gather
        in flight (a prefetch of the old values) is dropped."""
        moved = False  # the usual answer, found without a call per parameter
        for p in self.params:
            for module, name in p.slots:
                held = module._parameters.get(name)
                moved |= held is not p.sharded and held is not p.unsharded  # Note [shown parameters]
        if not moved:
            return
        replaced = [(p, new) for p in self.params if (new := p.replacement(full=False)) is not None]
        if self.state is ShardState.GATHERING:
            self.reshard()
        if self.compute_device.type == "meta" and not replaced[0][1].is_meta:
            self.relayout(device=self.group.device if self.options.offload else replaced[0][1].device)
            self.unset = {p.fqn for p in self.params}
        self.unset -= {p.fqn for p, _ in replaced}
        for p, new in replaced:
            p.adopt(new)
        units.register(self)  # an adopted DTensor is the shard now

    def free_after_forward(self) -> None:
        """reshard() after forward, keeping this rank's 1/k first (Note [smaller world after forward])."""
        if self.small_gather is not None and self.state is ShardState.FULL:
            self.metered(self.small_gather.keep(self.group.world // self.options.post_forward_world))
        self.reshard(keep_small=True)

    def drop_small(self) -> None:
        if self.small_gather is not None:
            self.metered(-self.small_gather.drop())

    # Note [shown parameters]: the modules hold a unit's shards (its DTensor parameters) while it
    # is sharded and its full parameters while it is full. Turning resharding after backward off
    # (set_reshard_after_backward(False), which a pipeline schedule calls before each
    # microbatch's backward, Note [pipeline stages]) shows the full parameter objects of a
    # sharded unit whose backward is due, their memory freed until a gather fills it (a unit
    # with no backward due keeps its shards shown: an optimizer may be built from them). Those
    # are what autograd gives gradients to, and torch's split backward (the zero-bubble
    # schedules' weight pass) finds the weights to compute gradients for among the parameters
    # the stage module holds as the backward starts. (FSDP2 shows the shards there, and those
    # schedules then drop part of the weights' gradients.) Any reshard, and turning resharding
    # after backward back on, shows the shards again.

    def reshard(self, keep_small: bool = False) -> None:
        """Drop the full parameters and put the shards back on the modules; a no-op when sharded."""
        if not keep_small:
            self.drop_small()
        if self.state is ShardState.GATHERING:  # a prefetch nobody used: finish it, then drop it
            self.finish_gather()
        elif self.state is ShardState.FULL:
            for p in self.params:  # ShardedParam.to_sharded, inline
                shard = p.sharded
                for module, name in p.slots:
                    module._parameters[name] = shard
        else:
            return
        if self.gather is not None:
            self.gather.free()
            self.metered(-self.layout.full_bytes)
        self.state = ShardState.SHARDED

    # ---- gradients: the unit's Reductions (reduce.py) -----------------------------

    def post_backward(self) -> None:
        """Start reducing (unless gradient sync is off: full gradients then keep accumulating) and reshard."""
        if self.switches.sync_grads:
            self.grads.issue(self.switches, self.options, self.compute_device)
        else:
            self.grads.hold(self.timeout)
        if self.switches.reshard_after_backward:
            self.reshard()
        self.expects_post_backward = False
        self.phase = Phase.IDLE

    def finish_backward(self) -> None:
        """The end of backward (the root's final callback): reduce what no PostBackward reduced
        (Note [module groups], gradients that arrived late), or reshard."""
        if self.expects_post_backward or self.grads.has_full_grads():
            self.post_backward()
        else:
            if self.switches.reshard_after_backward:
                self.reshard()
            self.phase = Phase.IDLE

    def finish_reductions(self) -> None:
        """Wait for this unit's reductions in flight and land them (or queue them, Note [landing])."""
        self.grads.finish()

    def land_hooked(self) -> None:
        self.grads.land_hooked()

    def reduced(self) -> bool:
        """Whether a reduction of this unit finished in this backward."""
        return self.grads.reduced

    def has_unlanded(self) -> bool:
        return bool(self.grads.unlanded)

    def land_queued(self) -> None:
        self.grads.land_queued()

    def settle_all_reduce(self) -> bool:
        return self.grads.settle_all_reduce(self.switches.all_reduce_grads, self.timeout, self.compute_device)

    def take_nonfinite(self) -> torch.Tensor | None:
        """Whether every gradient reduced since the last call was finite (0-d bool on the device),
        when a non-finite policy is set and something was reduced; the flag starts over."""
        finite, self.grads.finite = self.grads.finite, None
        return finite
