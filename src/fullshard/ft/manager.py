"""torchft's Manager for fullshard models: its server on the run's one address (Note [one
address]), healing over HealTransport, a bounded number of uncommitted steps, refusals final;
`attach` joins a sharded model and its optimizer to it.

Note [heal timing]: torchft forms each step's quorum in its own thread, started by
OptimizerWrapper.zero_grad, and a live group sends its state from that thread while the step's
forward runs. The state it reads (the shards, the optimizer's state) changes only in the
optimizer step, and the step waits for the quorum: every cross-replica all-reduce does, and
should_commit here does too, for a step with none. A joining group receives into new buffers
in that thread and loads them in the main thread, inside should_commit, after its backward:
its gradients are the live groups' average (torchft zeroes a joiner's own), so its optimizer
step is theirs, bitwise.

Note [uncommitted steps]: a step whose cross-replica all-reduce failed (a group died inside it)
does not commit: torchft's Manager answers should_commit False, OptimizerWrapper skips
optimizer.step(), and the next quorum leaves the dead group out. The hook's all-reduce, once
waited for, zeroes what a failed all-reduce left in the gradients, so nothing downstream sees it: not the non-finite
check, not clip_grad_norm_ (whose norm is then 0). torchft retries an uncommitted step forever
by default; here `max_retries` (10) bounds the consecutive failures, and a FullShardError from
the heal (a refusal, a wrong attach) ends the run at once: retrying could not change it.

Note [lost lighthouse]: without the lighthouse no quorum forms, so no step can commit: each
group's next quorum fails after `quorum_timeout`, and the Manager raises a FullShardError that
names the lighthouse. Nothing half-done is kept (the failing step never commits); the groups
resume from their last checkpoints once the lighthouse is back. (torchft 0.2.0's
LighthouseServer.shutdown() leaves its port listening: stop it by ending its process.)
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torchft.manager
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions
from torchft.manager import _ManagedWork
from torchft.work import _DummyWork

from fullshard.errors import FullShardError, fail, require
from fullshard.ft.network import ProcessGroupGloo, host_of, url_host
from fullshard.ft.transport import Healed, HealTransport, shards_of
from fullshard.hooks import units_of
from fullshard.state_dict import load_model_state, load_optimizer_state

PATCH_LOCK = threading.Lock()  # torchft.manager.ManagerServer is substituted for one constructor call at a time


class Manager(torchft.manager.Manager):
    """torchft's Manager with every listener on `bind` (127.0.0.1 unless named: Note [one
    address]). The other arguments are torchft's; the defaults that differ:
    - `pg`: a ProcessGroupGloo on `bind` (for GPUs pass torchft's ProcessGroupNCCL);
    - `checkpoint_transport`: HealTransport over `pg` (never torchft's HTTP server);
    - `min_replica_size` 1, `max_retries` 10 (Note [uncommitted steps]), `hostname` `bind`.
    """

    def __init__(self, *, bind: str = "127.0.0.1", pg=None, checkpoint_transport=None, min_replica_size: int = 1,
                 max_retries: int = 10, timeout: timedelta = timedelta(seconds=60),
                 hostname: str | None = None, **kwargs: Any) -> None:
        host = host_of(bind)
        self.lighthouse = kwargs.get("lighthouse_addr") or os.environ.get("TORCHFT_LIGHTHOUSE")
        require(isinstance(max_retries, int) and max_retries >= 0, f"max_retries={max_retries!r} must be an int of "
                "at least 0", "Pass how many steps in a row may fail to commit before the run stops, e.g. 10.")
        require("load_state_dict" not in kwargs and "state_dict" not in kwargs, "fullshard.ft.Manager takes no "
                "load_state_dict/state_dict", "fullshard.ft.attach(manager, model, optimizer) registers the model's "
                "and optimizer's; register other state with manager.register_state_dict_fn(key, load, save) (JSON).")
        pg = pg if pg is not None else ProcessGroupGloo(bind, timeout)
        transport = checkpoint_transport if checkpoint_transport is not None else HealTransport(pg, timeout)
        with PATCH_LOCK:
            torchft.manager.ManagerServer = bound_server(host)
            try:
                super().__init__(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_replica_size,
                                 checkpoint_transport=transport,
                                 max_retries=max_retries, timeout=timeout, hostname=hostname or host, **kwargs)
            finally:
                torchft.manager.ManagerServer = SERVER

    def start_quorum(self, *args: Any, **kwargs: Any) -> None:
        with quorum_errors(self):  # it waits for the previous step's quorum first
            super().start_quorum(*args, **kwargs)

    def wait_quorum(self) -> None:
        with quorum_errors(self):
            super().wait_quorum()

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """torchft's, after the quorum (Note [heal timing]); a FullShardError of the heal is raised."""
        self.wait_quorum()
        self.raise_refusal()
        try:
            return super().should_commit(timeout)
        except RuntimeError as e:
            if "max_retries" not in str(e):
                raise
            raise fail(f"fault tolerance: {self._commit_failures} steps in a row did not commit (max_retries="
                       f"{self._max_retries}): the replica groups cannot form a working quorum",
                       "See the groups' logs for why (a group that dies at every step, a lighthouse that is gone); "
                       "restart the run (fullshard.load resumes from the last checkpoint).") from None


    def raise_refusal(self) -> None:
        """A FullShardError that ended this step's heal (a refusal, a wrong attach): retrying cannot change it."""
        final = self.errored()
        if final is not None and isinstance(final.original_exception, FullShardError):
            raise final.original_exception

    def heal_now(self) -> None:
        """Load what this quorum's heal received, in the calling thread, before the step's
        collectives rather than in should_commit (a DiLoCo sync: Note [managed syncs])."""
        self.wait_quorum()
        if self._healing:
            self._apply_pending_state_dict()
            self._healing = False
        self.raise_refusal()

    def all_gather(self, rows: torch.Tensor, row: torch.Tensor):
        """`row` of every replica group of the quorum into `rows`, in their order in it; a failure
        is the Manager's error, as torchft's allreduce's is (the step then does not commit)."""
        if self.errored():
            return _DummyWork(rows)
        self.wait_quorum()
        try:
            work = self._pg.allgather_into_tensor_coalesced([rows], [row], AllgatherOptions())
        except Exception as e:
            self.report_error(e)
            return _DummyWork(rows)
        return _ManagedWork(self, work, rows)

    def replica_count(self) -> int:
        """How many replica groups this quorum's process group holds (a healing one included)."""
        self.wait_quorum()
        return self._pg.size()


SERVER = torchft.manager.ManagerServer


@contextlib.contextmanager
def quorum_errors(manager: Manager):
    """A quorum that could not be formed, said by name (Note [lost lighthouse])."""
    try:
        yield
    except FullShardError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise fail(f"fault tolerance: replica group {manager._replica_id!r} got no quorum for step "
                   f"{manager.current_step()} ({type(e).__name__}: {first}): the lighthouse at {manager.lighthouse!r} is "
                   f"gone or unreachable, or this group's rank 0 (whose Manager server asks it) died, or the other "
                   f"groups are alive and not asking (of two, one alone forms no quorum: one finished, or far "
                   f"behind); nothing of this step was committed", "Start the lighthouse again, then the replica groups: each resumes from "
                   "its last checkpoint (fullshard.load, and manager.load_state_dict for torchft's step; "
                   "docs/fault-tolerance.md).") from None


def bound_server(host: str):
    """torchft's ManagerServer, with its listener on `host` instead of every interface."""

    def build(*, bind: str, **kwargs: Any):
        port = bind.rsplit(":", 1)[1]
        return SERVER(bind=f"{url_host(host)}:{port}", **kwargs)

    return build


@dataclass
class Averaging:
    """A row's all-reduce across replica groups in flight; zeros once waited for if it failed
    (Note [uncommitted steps])."""
    manager: Manager
    work: Any
    row: torch.Tensor

    def wait(self) -> None:
        self.work.wait()
        if self.manager.errored() is not None:
            self.row.zero_()


def attach(manager: Manager, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Run `model`'s cross-replica all-reduce on `manager` (every unit's all-reduce hook), and
    let a joining group heal from this one's shards and `optimizer`'s state.

    Call it on every rank after fully_shard/shard_model and building the optimizer, before the
    first step; the loop is then torchft's: ``optimizer = torchft.optim.OptimizerWrapper(manager,
    optimizer)``, ``optimizer.zero_grad()`` (the quorum), forward, backward, ``optimizer.step()``
    (steps only if every replica group's step commits)."""
    heal_from(manager, model, optimizer, "attach")
    units = units_of(model, "fault tolerance")

    def all_reduce(row: torch.Tensor) -> Averaging:
        """The average over the participating replica groups, waited for at the end of backward
        (Note [waited hooks] in reduce.py)."""
        return Averaging(manager, manager.allreduce(row), row)

    for unit in units:
        unit.module.set_all_reduce_hook(all_reduce)


def heal_from(manager: Manager, model: nn.Module, optimizer: torch.optim.Optimizer | None, what: str) -> None:
    """Let a joining group heal from this one's shards and `optimizer`'s state, once per Manager."""
    require(isinstance(manager, Manager), f"{what} needs a fullshard.ft.Manager, got "
            f"{type(manager).__name__}", "Build it with fullshard.ft.Manager(...), which listens on your address "
            "and heals over fullshard's transport.")
    transport = manager._checkpoint_transport
    require(isinstance(transport, HealTransport), "the Manager heals over another checkpoint transport",
            "Leave checkpoint_transport out: fullshard.ft.Manager heals over HealTransport.")
    require("fullshard" not in manager._load_state_dict_fns, "this Manager already carries a model: ft.attach and "
            "fullshard.ft.ManagedReplicas each join one model to a Manager, once",
            "Use ft.attach for an all-reduce across groups every step, or DiLoCo(..., ManagedReplicas(manager)) "
            "for syncs every H steps, not both.")
    transport.attach(model, optimizer)

    def load(healed: Healed) -> None:
        if optimizer is not None:
            load_optimizer_state(model, optimizer, healed.optim_sd)
        load_model_state(model, healed.model_sd)

    manager.register_state_dict_fn("fullshard", load, lambda: shards_of(model, optimizer))
