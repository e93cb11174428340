"""Session fixtures: persistent worlds of 1, 2 and 4 gloo ranks (see tests/world.py), and
the one uninterrupted `fullshard train` run that the CLI and reliability tests compare against."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from tests.runs import STRAIGHT, finish, fullshard
from tests.world import World, extra_groups

_worlds: dict[int, World] = {}


def world(size: int) -> World:
    if size not in _worlds:
        _worlds[size] = World(size, forked=True)
    return _worlds[size]


@pytest.fixture(scope="session")
def world1() -> World:
    return world(1)


@pytest.fixture(scope="session")
def world2() -> World:
    return world(2)


@pytest.fixture(scope="session")
def world4() -> World:
    return world(4)


# gloo runs a thread per process group that wakes every 10 ms: the groups a test file's meshes
# make, hundreds by the end of the suite, would cost the suite a core-minute of idle wake-ups
# (and destroying a gloo group aborts the process now and then: Note [exit] in fullshard/mesh.py)
MAX_EXTRA_GROUPS = 4


@pytest.fixture(autouse=True, scope="module")
def worlds_with_few_groups():
    """After each test file, a persistent world holding more than MAX_EXTRA_GROUPS process groups
    besides the default one starts afresh."""
    yield
    for w in _worlds.values():
        if max(w.run(extra_groups)) > MAX_EXTRA_GROUPS:
            w.restart()


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory) -> Path:
    """`fullshard train` with STRAIGHT's arguments on 2 ranks under torchrun, uninterrupted:
    its out directory (metrics.jsonl, loss.png, checkpoint/), which its tests only read. Made
    once per suite: the pytest workers share it (the first to need it runs it while holding a
    lock on the temporary directory they share, the other waits for it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is a directory of the run's
        shared = shared.parent
    out = shared / "straight"
    with open(shared / "straight.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "straight.done").is_file():
            shutil.rmtree(out, ignore_errors=True)  # a run that failed in another worker
            out.mkdir()
            finish(fullshard("train", *STRAIGHT, "--out", str(out), launcher="torchrun"))
            (shared / "straight.done").touch()
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for w in _worlds.values():
        w.close()
