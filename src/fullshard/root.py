"""Root: the units under one root, as one step runs them: the start of each forward, the final
callback at the end of backward (Note [backward triggers]), and what every unit under the root
shares (its buffers, its memory meter, its statistics, the scheduler hooks.py makes for it)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable

from fullshard import runtime
from fullshard.collectives import all_gather_ints, site
from fullshard.errors import fail
from fullshard.routes import BufferPool
from fullshard.runtime import Failing, labelled
from fullshard.stats import Stats, new_meter
from fullshard.tags import described
from fullshard.unit import ShardState, Unit

FIRST_FORWARD = site("the check of the first forward")
NONFINITE = site("the non-finite check")


class Root:
    """What the units under one root share (the scheduler, buffers, stats) and what happens once
    per step for all of them: the start of forward, the final callback of backward."""

    def __init__(self, units: list, scheduler) -> None:
        self.units = units  # every unit's UnitHooks (hooks.py, which makes the root), the root's first
        self.scheduler = scheduler  # hooks.Scheduler: the prefetch order and the reduction in flight
        self.pool = BufferPool()
        self.meter = new_meter()  # full parameter and gradient bytes alive, and their peaks (Unit.metered)
        self.stats = Stats(self)
        self.callback_queued = False
        self.step = 0  # backward passes finished
        self.steps_counted = 0  # likewise, for Stats (which a reset rebases)
        self.skipped = 0  # steps whose gradients were dropped for being non-finite
        self.checked_first_forward = False

    def start_forward(self) -> None:
        """The root's forward begins: the step counts on, and parameters assigned in the shards'
        place since the last forward are taken (Note [replaced parameters])."""
        self.scheduler.start_forward()
        evaluating = not torch.is_grad_enabled()
        for hooks in self.units:
            unit = hooks.unit
            unit.begin_forward(self.step + 1, evaluating)
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
            with Failing(root, "check of the first forward"):
                everyone = all_gather_ints([torch.is_grad_enabled(), root.uid], device=root.group.device,
                                           timeout=root.timeout, group=group, what=FIRST_FORWARD)
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
            for hooks in self.units:
                hooks.unit.begin_backward()
            Variable._execution_engine.queue_callback(self.final_callback)

    def final_callback(self) -> None:
        """End of backward: reduce what no PostBackward reduced, reshard every unit, and land
        the gradients that waited for the host (Note [landing])."""
        with labelled("fullshard::final_callback"):
            for hooks in reversed(self.units):  # issue every reduction left, then wait: they overlap
                hooks.finish_backward()
            for hooks in reversed(self.units):
                hooks.unit.grads.finish()
            for hooks in reversed(self.units):  # the all-reduce hooks' communication (Note [waited hooks])
                hooks.unit.grads.land_hooked()
            reduced = any(hooks.unit.grads.reduced for hooks in self.units)  # alike on every rank: reductions are collectives
            if any(hooks.unit.grads.unlanded for hooks in self.units):  # the one host sync, Note [host syncs]
                self.host_waits("the gradients copied to host memory")
            for hooks in self.units:
                hooks.unit.grads.land_queued()
            if [hooks.unit.grads.settle_all_reduce() for hooks in self.units].count(True):
                self.host_waits("the gradients all-reduced across replicas")  # once for every unit
        self.scheduler.end_backward()
        self.callback_queued = False
        self.steps_counted += 1
        self.step += 1
        self.pool.release()  # forward's activations may reuse that memory
        if reduced:  # a backward under no_sync has nothing new to check
            self.settle_nonfinite()

    def host_waits(self, what: str) -> None:
        """The host waits for the compute stream (Note [host syncs]), bounded by the root's timeout."""
        unit = self.units[0].unit
        with Failing(unit, "end of backward"):
            runtime.active.host_waits(unit.compute_device, timeout=unit.timeout,
                                      what=f"{what} at the end of backward of step {self.step}")

    def settle_nonfinite(self) -> None:
        """With a non-finite policy on some unit, every rank learns whether any rank's reduced
        gradient had an inf or NaN, and all raise (if that unit's policy on any rank is "raise")
        or all skip the step (no gradients). Ranks may run other units (pipeline stages), so
        each reports a code, 2 x its first such unit's index + 1 if its policy raises. One read
        of the device flags per backward that reduced (Note [host syncs])."""
        checked = [hooks.unit for hooks in self.units if hooks.unit.switches.nonfinite is not None]
        if not checked:
            return
        unit = self.units[0].unit
        bad = torch.full((1,), -1, dtype=torch.int64, device=unit.compute_device)  # first unit not finite, or -1
        for other in reversed(checked):
            if other.grads.finite is not None:
                bad = torch.where(other.grads.finite, bad, 2 * other.index + (other.switches.nonfinite == "raise"))
            other.grads.clear_finite()
        with Failing(unit, "non-finite check"):
            codes = [code for (code,) in all_gather_ints(bad, device=unit.compute_device, timeout=unit.timeout,
                                                         what=NONFINITE)]
        if all(code < 0 for code in codes):
            return
        for hooks in self.units:  # skipped, or cleared before raising: a caller that catches the error and
            for p in hooks.unit.params:  # steps anyway must not write inf/NaN into the parameters
                p.drop_grad()
        if not any(code >= 0 and code % 2 for code in codes):
            self.skipped += 1
            return
        mine = codes[dist.get_rank()]
        where = f"unit {unit.names[mine // 2]!r}" if mine >= 0 else \
            f"a unit of rank {next(r for r, code in enumerate(codes) if code >= 0)}"
        raise fail(f"the gradient of {where} at step {self.step} is not finite (inf or NaN) after reduction",
                   "Lower the learning rate, train in bf16/fp32 or with loss scaling (fullshard.GradScaler for "
                   "fp16), or call model.set_nonfinite_grads('skip') to skip such steps on every rank.")

    def recover(self) -> None:
        """A backward that raised never ran the final callback: start the next step clean."""
        if self.callback_queued:
            self.reset()

    def reset(self) -> None:
        """Drop the step in flight: every unit sharded, no gather or reduction pending, no full gradient."""
        for hooks in self.units:
            hooks.reset()
        self.scheduler.end_backward()
        self.callback_queued = False
