"""Session fixtures: persistent worlds of 1, 2 and 4 gloo ranks (see tests/world.py), and
the one uninterrupted `fullshard train` run that the CLI and reliability tests compare against."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runs import STRAIGHT, finish, fullshard
from tests.world import World

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


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory) -> Path:
    """`fullshard train` with STRAIGHT's arguments on 2 ranks under torchrun, uninterrupted:
    its out directory (metrics.jsonl, loss.png, checkpoint/)."""
    out = tmp_path_factory.mktemp("straight")
    finish(fullshard("train", *STRAIGHT, "--out", str(out), launcher="torchrun"))
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for w in _worlds.values():
        w.close()
