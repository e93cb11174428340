"""What the units under one root share (`Shared`: their buffers, memory meter and step, which the
root writes once per step for all of them) and how a unit's collectives are named in errors
(`Naming`). Both sit below unit.py and reduce.py, which read them and never call back up."""

from __future__ import annotations

import torch.distributed as dist

from fullshard.errors import DIVERGED, FullShardError, collective_failed, fail
from fullshard.routes import BufferPool
from fullshard.runtime import MismatchedRows
from fullshard.accounting import new_meter
from fullshard.tags import KINDS, sent_by
from fullshard.units import described


class Shared:
    """One per root (a unit not yet under one has its own): the communication buffers its units
    reuse, the meter of full bytes alive, the step and whether it computes gradients."""

    def __init__(self, model: str, names: list[str] | None = None) -> None:
        self.model = model  # "model 12 (GPT)": the root unit's id and class, Note [named hangs]
        self.names = names or [""]  # every unit's fqn by index, for messages
        self.pool = BufferPool()
        self.meter = new_meter()  # [full parameter bytes alive, their peak, full gradient bytes, their peak]
        self.step = 0  # the step that runs now (the root's backward passes finished + 1)
        self.evaluating = False  # in a forward without gradients, for the debug checks


class Naming:
    """A unit in words, for the errors of its collectives (Note [named hangs])."""

    def __init__(self, uid: int, class_name: str, shared: Shared) -> None:
        self.uid, self.class_name, self.shared = uid, class_name, shared
        self.fqn = ""  # the root names it at lazy init
        self.whats: dict[str, str] = {}  # this step's names of collectives
        self.whats_step = -1

    @property
    def described(self) -> str:
        return f"unit {self.fqn or self.class_name!r} of {self.shared.model}"

    def what(self, collective: str) -> str:
        """This step's name of a collective of this unit ("the all-gather of unit 'h.1' of ... at step 3")."""
        step = self.shared.step
        if step != self.whats_step:
            self.whats, self.whats_step = {}, step
        name = self.whats.get(collective)
        if name is None:
            name = self.whats[collective] = f"the {collective} of {self.described} at step {step}"
        return name

    def failed(self, collective: str, error: Exception) -> FullShardError:
        """The one error of a failed collective of this unit: did not finish, found another overdue
        (naming it), or met a peer's rows of another collective (naming its unit and model)."""
        if isinstance(error, MismatchedRows):  # named by its header: a reduction may fail in its all-reduce
            return fail(f"rank {dist.get_rank()}: {self.what(KINDS[error.mine[1]])} received "
                        f"{sent_by(error.header, described)} from group rank {error.peer}", DIVERGED)
        return collective_failed(self.what(collective), error, DIVERGED)
