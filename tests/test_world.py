"""The test harness's worlds (tests/world.py): a rank that dies or hangs in a job is reported with
how it ended and what it last wrote, so that a failure seen once in CI can be read, not guessed."""

from __future__ import annotations

import os
import time

import pytest
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
