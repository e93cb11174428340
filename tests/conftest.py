"""Session fixtures: persistent worlds of 1, 2 and 4 gloo ranks (see tests/world.py)."""

from __future__ import annotations

import pytest

from tests.world import World

_worlds: dict[int, World] = {}


def world(size: int) -> World:
    if size not in _worlds:
        _worlds[size] = World(size)
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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for w in _worlds.values():
        w.close()
