"""The test harness's worlds (tests/world.py): a rank that dies or hangs in a job is reported with
how it ended and what it last wrote, so that a failure seen once in CI can be read, not guessed;
a job that leaves a collective unmatched is named, not the job after it; and what a rank of the
fault-tolerance tests' replica groups (tests/replicas.py) said as it ended is read."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.world import World


def dying_job() -> None:
    if dist.get_rank() == 0:
        os.write(2, b"last words of rank 0\n")
        os.abort()


def stuck_job() -> None:
    if dist.get_rank() == 1:
        time.sleep(60)


def test_a_rank_that_dies_or_hangs_is_named_with_how_it_ended():
    with World(2, forked=True) as world:
        world.run(dist.get_rank)  # started: from here a job that takes seconds is stuck
        world.job_timeout_s = 2
        with pytest.raises(AssertionError) as stuck:
            world.run(stuck_job)
        with pytest.raises(AssertionError) as died:  # seen as soon as the rank is gone, not at the timeout
            world.run(dying_job)
    died, stuck = str(died.value), str(stuck.value)
    assert "ranks [0] did not answer" in died and "rank 0: killed by SIGABRT" in died, died
    assert "last words of rank 0" in died and "Fatal Python error: Aborted" in died, died
    assert "rank 1: stuck" in stuck and "in stuck_job" in stuck, stuck


def unmatched_job() -> None:
    """Rank 0 starts an all-gather the other rank never joins, and returns."""
    if dist.get_rank() == 0:
        rows = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(rows, torch.tensor([1, 2]), async_op=True)


def test_a_job_that_leaves_a_collective_unmatched_is_named():
    with World(2, forked=True, collective_timeout_s=3) as world:
        with pytest.raises(AssertionError) as left:
            world.run(unmatched_job)
        assert world.run(dist.get_rank) == [0, 1]  # a new world: the next job runs
    assert "unmatched_job" in str(left.value), left.value


def says_and_ends(reports) -> None:
    """A rank that reports its error and ends at once, as a failing rank does."""
    reports.put(("error", 0, 0, "said as it ended"))


def test_a_report_sent_as_a_rank_ended_is_read_though_the_test_saw_it_gone_first():
    """The fault-tolerance tests' replica groups (tests/replicas.py): waiting for ranks to end
    reads what they sent before they did. It once stopped reading when it found them gone, and
    a rank's named error, sent just before, seemed never said (both groups losing a rank, under
    the suite's load)."""
    pytest.importorskip("torchft", reason="tests/replicas.py's groups run on torchft, fullshard[ft]'s")
    from tests.replicas import Replicas

    replicas = Replicas(replicas=0)
    try:
        reports = replicas.ctx.Queue()
        replicas.queues.append(reports)
        rank = replicas.procs[0, 0] = replicas.ctx.Process(target=says_and_ends, args=(reports,))
        rank.start()
        rank.join(timeout=60)
        replicas.wait_until(lambda: not rank.is_alive(), "the rank ending")
        assert replicas.errors == {(0, 0): "said as it ended"}
    finally:
        replicas.close()
