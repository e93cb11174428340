"""Root: the units under one root, as one step runs them: the start of each forward, the
prefetch order and the reduction in flight (Scheduler), the final callback at the end of
backward (Note [backward triggers]), and what every unit under the root shares (shared.Shared:
its buffers, its memory meter, its step; its statistics). It asks its units through their
methods; nothing below calls back into it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable

from fullshard import runtime
from fullshard.checks import dp_groups
from fullshard.collectives import all_gather_ints, site
from fullshard.errors import CollectiveError, fail
from fullshard.options import Schedule
from fullshard.runtime import NOTHING, label, profiling
from fullshard.shared import Shared
from fullshard.accounting import Stats
from fullshard.unit import ShardState, Unit
from fullshard.units import described

FIRST_FORWARD = site("the check of the first forward")
NONFINITE = site("the non-finite check")


class Scheduler:
    """The forward order (recorded each step, reversed for backward), the limiter and the
    reduction in flight. Orders are lists with a position map, so each lookup is O(1)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.order: list[Unit] = []  # this step's forward order, first calls only
        self.position: dict[Unit, int] = {}  # index in `order`
        self.last_order: list[Unit] = []
        self.last_position: dict[Unit, int] = {}
        self.ahead: dict[Unit, None] = {}  # gathered ahead of use, not used yet (insertion-ordered)
        self.reducing: Unit | None = None  # the unit whose reduction is in flight

    def start_forward(self) -> None:
        if self.order:
            self.last_order, self.last_position = self.order, self.position
            self.order, self.position = [], {}

    def record(self, unit: Unit) -> None:
        """`unit` starts its forward or backward: it is no longer ahead of use."""
        self.ahead.pop(unit, None)
        if unit not in self.position:
            self.position[unit] = len(self.order)
            self.order.append(unit)

    def prefetch(self, targets: list[Unit], *, limited: bool) -> None:
        limit = self.schedule.limit if limited else None
        for target in targets:
            if limit is not None and len(self.ahead) >= limit:
                return
            if target.state is ShardState.SHARDED:
                target.unshard(adopt=False)  # the root scanned for replaced parameters, Note [replaced parameters]
                self.ahead[target] = None

    def prefetch_forward(self, unit: Unit, targets: list[Unit] | None) -> None:
        """Before `unit`'s forward: its explicit targets, or those after it in the last forward."""
        if targets is not None:
            self.prefetch(targets, limited=False)
        elif self.schedule.forward_prefetch and unit in self.last_position:
            self.prefetch(self.last_order[self.last_position[unit] + 1 :], limited=True)

    def prefetch_backward(self, unit: Unit, targets: list[Unit] | None) -> None:
        """Around `unit`'s backward: its explicit targets, or those before it in this forward, nearest first."""
        if targets is not None:
            self.prefetch(targets, limited=False)
        elif unit in self.position:
            self.prefetch(self.order[self.position[unit] - 1 :: -1] if self.position[unit] else [], limited=True)

    def ran_last(self, unit: Unit) -> bool:
        """Whether `unit` was the last to start its forward in the previous step."""
        return bool(self.last_order) and self.last_order[-1] is unit

    def drop_unused_prefetches(self) -> None:
        """End of forward: units prefetched but never run (the order changed) are freed."""
        for unit in self.ahead:
            unit.reshard()
        self.ahead.clear()

    def reduce_issued(self, unit: Unit) -> None:
        """`unit`'s reduction is in flight: wait for the one issued before it."""
        if self.reducing is not None and self.reducing is not unit:
            self.reducing.finish_reductions()
        self.reducing = unit

    def end_backward(self) -> None:
        self.drop_unused_prefetches()
        self.reducing = None


def worst(codes: list[int]) -> int:
    """Of the ranks' non-finite codes (Root.settle_nonfinite), one that raises, else any found, else -1."""
    return max(codes, key=lambda code: (code >= 0 and code % 2 == 1, code >= 0, code))


class Root:
    """What the units under one root share (the scheduler, buffers, stats) and what happens once
    per step for all of them: the start of forward, the final callback of backward."""

    def __init__(self, units: list[Unit], schedule: Schedule, model: str, names: list[str]) -> None:
        self.units = units  # every unit under the root, the root's first
        self.scheduler = Scheduler(schedule)
        self.shared = Shared(model, names)
        self.stats = Stats(self)
        self.callback_queued = False
        self.step = 0  # backward passes finished
        self.steps_counted = 0  # likewise, for Stats (which a reset rebases)
        self.skipped = 0  # steps whose gradients were dropped for being non-finite
        self.checked_first_forward = False
        for index, (unit, fqn) in enumerate(zip(units, names)):
            unit.join(fqn, index, self.shared)

    def start_forward(self) -> None:
        """The root's forward begins: the step counts on, and parameters assigned in the shards'
        place since the last forward are taken (Note [replaced parameters])."""
        self.scheduler.start_forward()
        self.shared.step, self.shared.evaluating = self.step + 1, not torch.is_grad_enabled()
        for unit in self.units:
            unit.drop_small()  # a copy a forward without backward left
            if unit.state is not ShardState.FULL:
                unit.adopt_replaced()

    def check_first_forward(self, root: Unit) -> None:
        """Before the first gather: every rank runs this forward, of this model (Note [named
        hangs]), and all with gradients or all without. The usual first mistakes, evaluating on
        rank 0 alone before training or calling two models in another order on some ranks, then
        fail here at once on every rank, instead of after the timeout or with rows mixed (one
        small all-gather per model, once)."""
        if self.checked_first_forward:
            return
        # the shard group only: forward communicates nowhere else (no_shard's forward, evaluation
        # on one rank included, needs no peer; its reductions check their headers)
        for group in [root.group.shard_pg] if root.group.shard_pg is not None else []:
            try:
                everyone = all_gather_ints([torch.is_grad_enabled(), root.uid], device=root.group.device,
                                           timeout=root.timeout, group=group, what=FIRST_FORWARD)
            except CollectiveError as e:
                raise root.failed("check of the first forward", e) from None
            if len(set(map(tuple, everyone))) > 1:
                ranks = dist.get_process_group_ranks(group)
                seen = "; ".join(f"rank {ranks[r]}: {described(uid, whole_model=True)}, "
                                 f"{'training (with gradients)' if grad else 'without gradients (evaluation)'}"
                                 for r, (grad, uid) in enumerate(everyone))
                raise fail(f"ranks run their first forward differently ({seen})",
                           "Every rank must run every forward of a sharded model, in the same order, since each "
                           "gathers parameters from all ranks: run the same models in the same order on every "
                           "rank, and evaluate on every rank (average the losses with dist.all_reduce), or on "
                           "rank 0 alone inside `with fullshard.full_params(model, rank0_only=True, "
                           "writeback=False):`, which every rank enters.")
        self.checked_first_forward = True  # only once it passed: a caller that catches the error is checked again

    # ---- backward ---------------------------------------------------------------------

    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            self.shared.evaluating = False
            Variable._execution_engine.queue_callback(self.final_callback)

    def final_callback(self) -> None:
        """End of backward: reduce what no PostBackward reduced, reshard every unit, and land
        the gradients that waited for the host (Note [landing])."""
        units = self.units
        with label("fullshard::final_callback") if profiling() else NOTHING:
            for unit in reversed(units):  # issue every reduction left, then wait: they overlap
                unit.finish_backward()
            for unit in reversed(units):
                unit.finish_reductions()
            for unit in reversed(units):  # the all-reduce hooks' communication (Note [waited hooks])
                unit.land_hooked()
            reduced = any(unit.reduced() for unit in units)  # alike on every rank: reductions are collectives
            if any(unit.has_unlanded() for unit in units):  # the one host sync, Note [host syncs]
                self.host_waits("the gradients copied to host memory")
            for unit in units:
                unit.land_queued()
            if [unit.settle_all_reduce() for unit in units].count(True):
                self.host_waits("the gradients all-reduced across replicas")  # once for every unit
        self.scheduler.end_backward()
        self.callback_queued = False
        self.steps_counted += 1
        self.step += 1
        self.shared.pool.release()  # forward's activations may reuse that memory
        if reduced:  # a backward under no_sync has nothing new to check
            self.settle_nonfinite()

    def host_waits(self, what: str) -> None:
        """The host waits for the compute stream (Note [host syncs]), bounded by the root's timeout."""
        unit = self.units[0]
        try:
            runtime.active.host_waits(unit.compute_device, timeout=unit.timeout,
                                      what=f"{what} at the end of backward of step {self.step}")
        except CollectiveError as e:
            raise unit.failed("end of backward", e) from None

    def settle_nonfinite(self) -> None:
        """With a non-finite policy on some unit, every rank that holds this model (every rank, or
        a pipeline stage's: those of its units' groups) learns whether any had an inf or NaN in
        a reduced gradient, and all raise (if that unit's policy on any rank is "raise") or all
        skip the step (no gradients). Each reports a code, 2 x its first such unit's index + 1
        if its policy raises. One read of the device flags per backward that reduced (Note
        [host syncs]). A stage agrees within itself alone: its backward ends while other stages
        still exchange activations with their neighbours (Note [pipeline stages])."""
        checked = [unit for unit in self.units if unit.switches.nonfinite is not None]
        if not checked:
            return
        unit = self.units[0]
        bad = torch.full((1,), -1, dtype=torch.int64, device=unit.compute_device)  # first unit not finite, or -1
        for other in reversed(checked):
            finite = other.take_nonfinite()
            if finite is not None:
                bad = torch.where(finite, bad, 2 * other.index + (other.switches.nonfinite == "raise"))
        groups, own = [g for g in dp_groups(unit.group) if g is None or dist.get_world_size(g) > 1], None
        codes = runtime.active.read_on_host(bad, timeout=unit.timeout, what=NONFINITE) if not groups else []  # alone
        try:
            for group in groups:  # a sub-mesh's groups in turn, each passing on the worst code it saw
                codes = [code for (code,) in all_gather_ints(bad, device=unit.compute_device, timeout=unit.timeout,
                                                             group=group, what=NONFINITE)]
                own = codes[dist.get_rank(group)] if own is None else own
                bad = torch.tensor([worst(codes)], dtype=torch.int64, device=unit.compute_device)
        except CollectiveError as e:
            raise unit.failed("non-finite check", e) from None
        code = worst(codes)
        own = codes[0] if own is None else own
        if code < 0:
            return
        for other in self.units:  # skipped, or cleared before raising: a caller that catches the error and
            for p in other.params:  # steps anyway must not write inf/NaN into the parameters
                p.drop_grad()
        if not code % 2:
            self.skipped += 1
            return
        where = f"unit {self.shared.names[own // 2]!r}" if own >= 0 else "a unit of another rank"
        raise fail(f"the gradient of {where} at step {self.step} is not finite (inf or NaN) after reduction",
                   "Lower the learning rate, train in bf16/fp32 or with loss scaling (fullshard.GradScaler for "
                   "fp16), or call model.set_nonfinite_grads('skip') to skip such steps on every rank.")


    def recover(self) -> None:
        """A backward that raised never ran the final callback: start the next step clean."""
        if self.callback_queued:
            self.reset()

    def reset(self) -> None:
        """Drop the step in flight: every unit sharded, no gather or reduction pending, no full gradient."""
        for unit in self.units:
            unit.reset()
        self.scheduler.end_backward()
        self.callback_queued = False
