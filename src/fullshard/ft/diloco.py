"""DiLoCo's replica groups on torchft: each sync of a fragment is a step of torchft's Manager.

Note [managed syncs]: over torchft, `fullshard.DiLoCo` runs its own outer step (Note [outer
steps] in fullshard/diloco.py) on the Manager's quorum, process group and heal:
- a quorum is formed at each sync of a fragment, not at each inner step: the groups train
  alone in between, and the Manager's step counts the syncs committed;
- a group behind the quorum (restarted, or one whose last sync did not commit) heals at once,
  before the sync's all-gather: the live group's shards, inner optimizer state, anchors, outer
  state and inner step replace its own (its inner steps since it started are dropped). It
  then sends zeros marked as not taking part, and takes the outer step the others take:
  afterwards it is bitwise equal to them. The state is read in torchft's quorum thread while
  the live group waits for that quorum, so nothing changes under it; this is why a sync is
  finished before the next inner step (no overlap over torchft);
- the outer gradients travel as one all-gather over the Manager's process group, averaged
  over the groups that take part (the quorum's participants, logged as `participants`);
- a group lost mid-sync makes the all-gather fail: the Manager's error, so this group's step
  does not commit, nothing is applied (parameters, anchors and outer state are as they were
  before the sync), and the sync is redone in a new quorum without the lost group, at most
  `max_retries` times in a row. A group whose sync committed while another's did not is
  further on; the other heals from it at the next quorum;
- when the quorum's groups change, they first compare digests of their models' layouts and
  DiLoCo's settings (one small all-gather): groups whose fragments differ would send rows of
  other sizes, which no header could name. A mismatch is a FullShardError in every group;
- every group must start with `init_sync=False` (torchft's default makes the groups at step
  0 copy one group's parameters and leave it alone in the first average) and reach each sync
  within the Manager's `quorum_timeout` of the others. torchft's lighthouse forms a quorum at
  once when every group of the last quorum asks; otherwise, of two heartbeating groups one alone
  forms none, and with three or more a group later than its `join_timeout_ms` is left out of
  that sync and heals at a later one.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn

from fullshard import runtime
from fullshard.diloco import Replicas
from fullshard.errors import fail, require
from fullshard.ft.manager import Manager, heal_from


class ManagedReplicas(Replicas):
    """The replica groups of torchft's quorum, for fullshard.DiLoCo: ``DiLoCo(model, inner,
    ManagedReplicas(manager), sync_every=H)`` on every rank of every group (Note [managed syncs])."""

    managed = True

    def __init__(self, manager: Manager) -> None:
        require(isinstance(manager, Manager), f"ManagedReplicas needs a fullshard.ft.Manager, got "
                f"{type(manager).__name__}", "Build it with fullshard.ft.Manager(...).")
        require(not manager._init_sync, "DiLoCo over torchft needs a Manager built with init_sync=False: torchft's "
                "init_sync makes every group at step 0 copy one group's parameters, leaving it alone in the first "
                "average", "Pass init_sync=False to fullshard.ft.Manager, and seed every group alike.")
        self.manager = manager
        self.checked = None  # the quorum whose groups' layouts were compared

    def bind(self, model: nn.Module, diloco: torch.optim.Optimizer) -> None:
        """A joining group heals from this one's model and DiLoCo's state (anchors, outer state, step)."""
        heal_from(self.manager, model, diloco, "ManagedReplicas")
        self.device, self.timeout = diloco.device, diloco.timeout

    def size(self) -> int:
        return self.manager.replica_count()

    def begin(self, layout: int) -> bool:
        self.manager.start_quorum()
        self.manager.wait_quorum()
        taking_part = self.manager.is_participating()  # False while this group heals
        self.manager.heal_now()
        if self.manager._quorum_id != self.checked:
            self.compare(layout)
        return taking_part

    def compare(self, layout: int) -> None:
        """Every group of a new quorum holds the same layout and settings, or a FullShardError in each."""
        mine = torch.tensor([layout], dtype=torch.int64).to(self.device)  # NCCL's rule: device tensors
        everyone = torch.zeros(self.manager.replica_count(), dtype=torch.int64, device=self.device)
        self.manager.all_gather(everyone, mine).wait()
        if self.manager.errored() is not None:
            return  # the exchange fails too; the sync is redone, and compares again
        seen = runtime.active.read_on_host(everyone, timeout=self.timeout, what="DiLoCo's comparison of layouts")
        if len(set(seen)) > 1:
            raise fail(f"DiLoCo's replica groups hold other models, fragments or settings (digests "
                       f"{list(seen)} in quorum order)", "Give every replica group the same model, shard it "
                       "alike over groups of the same size, and pass the same fragments, sync_every and outer_dtype.")
        self.checked = self.manager._quorum_id

    def exchange(self, rows: torch.Tensor, sent: torch.Tensor) -> list:
        return [self.manager.all_gather(rows, sent)]

    def wait(self, works: list, what: str, timeout: timedelta, device: torch.device) -> bool:
        for work in works:
            work.wait()
        return self.manager.errored() is None

    def commit(self) -> bool:
        return self.manager.should_commit()
