"""Scheduler: which units gather ahead of use and when reductions are waited for
(Note [prefetch], hooks.py), for the units under one root."""

from __future__ import annotations

from fullshard.options import Schedule
from fullshard.unit import ShardState, Unit


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
            self.reducing.finish_reduce()
        self.reducing = unit

    def end_backward(self) -> None:
        self.drop_unused_prefetches()
        self.reducing = None
