"""DiLoCo over torchft (Note [managed syncs] in fullshard/ft/diloco.py): each replica group a job
of its own (tests/diloco_replicas.py, forked by tests/replicas.py), its syncs on torchft's
Manager. Against the one-process simulation of tests/test_diloco.py; a group lost between syncs
left out of the next average and healed at a later one; a group lost inside a sync leaving the
others' state untouched until the sync is redone without it; bad set-ups refused by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is fullshard[ft]'s: pip install 'fullshard[ft]'")

from tests.diloco_replicas import diloco_rank
from tests.reference import ADAMW_TOL, max_diff
from tests.replicas import Replicas
from tests.test_diloco import simulate


def syncs(rows: list[dict]) -> dict[int, dict]:
    return {row["step"]: row for row in rows if row["synced"]}


def errors_of(first: dict, second: dict, **options) -> dict[tuple[int, int], str]:
    """Two groups of one rank, started with `options` and each its own, taken until both failed:
    what each said."""
    replicas = Replicas(replicas=0, target=diloco_rank, **options)
    try:
        replicas.start(0, **first)
        replicas.start(1, **second)
        go(replicas, {(0, 0), (1, 0)})
        replicas.wait_until(lambda: len(replicas.errors) == 2, "both groups' errors")
    finally:
        replicas.close()
    return replicas.errors


def go(replicas: Replicas, ranks: set[tuple[int, int]]) -> None:
    """Once every rank of `ranks` is ready, all take their first step (under load a group started
    first would otherwise take its first syncs alone)."""
    replicas.wait_until(lambda: ranks <= set(replicas.other.get("ready", {})), f"ranks {sorted(ranks)} ready")
    replicas.go.value = 1


def test_diloco_over_torchft_trains_like_the_simulation_and_refuses_what_it_cannot_do():
    """2 groups of 2 shards, H = 3, 2 fragments, 9 inner steps of AdamW: every sync commits with
    both groups, the synced fragment is bitwise alike in both right after it, and the parameters
    are the one-process simulation's within AdamW's parity tolerance (as in test_diloco: shards
    sum their gradients in another order). overlap=True, and ft.attach on a model DiLoCo holds,
    are refused on every rank before anything runs. Every listener (the lighthouse's, each
    group's store and Manager server, torchft's process groups) is on 127.0.0.1."""
    replicas = Replicas(replicas=2, group_size=2, steps=9, target=diloco_rank, sync_every=3, fragments=2,
                        refusals=True)
    try:
        go(replicas, {(g, k) for g in range(2) for k in range(2)})
        got = replicas.results({(g, k) for g in range(2) for k in range(2)}, deadline_s=60)
        finals, refused = replicas.other["final"], replicas.other["refused"]
        sockets = replicas.listeners()  # the lighthouse's and every rank's, the ranks still up
    finally:
        replicas.close()
    phases = [1, 0]  # (f + 1) * H // K % H
    for rank in range(2):
        mine, theirs = syncs(got[0, rank]), syncs(got[1, rank])
        assert sorted(mine) == sorted(theirs) == [1, 3, 4, 6, 7, 9], sorted(mine)
        for step, row in mine.items():
            fragment = phases.index(step % 3)
            assert row["participants"] == 2 and row["fragments"][fragment] == theirs[step]["fragments"][fragment]
        assert not any(row["healed"] for row in got[0, rank] + got[1, rank])
    assert all(final["phases"] == phases for final in finals.values())
    want = simulate(2, 9, 3, finals[0, 0]["names"], phases, False)
    for (group, _), final in finals.items():
        assert max_diff({k: torch.tensor(v) for k, v in final["params"].items()}, want[group]) <= ADAMW_TOL
    for said in refused.values():
        assert "overlap=True) over torchft is not offered" in said[0] and "already carries a model" in said[1], said
    assert len(sockets) == 5 and all(s.startswith("127.0.0.1:") for found in sockets.values() for s in found), sockets


def test_a_group_lost_between_syncs_is_left_out_then_heals_and_rejoins_at_a_sync():
    """H = 3, 15 inner steps. Group 1 is SIGKILLed in the forward of inner step 5: group 0's sync
    at 6 averages its own outer gradient alone (participants 1). Then group 1 restarts from
    nothing, trains its own inner steps and asks for a quorum at its first sync (3); group 0's
    next sync (9) heals it there: it takes group 0's state and inner step, sends no outer gradient (participants 1),
    and both hold bitwise the same parameters and DiLoCo state after it; the syncs at 12 and 15
    take both (participants 2)."""
    replicas = Replicas(replicas=0, steps=15, target=diloco_rank, sync_every=3)
    try:
        replicas.start(0, hold_at=7)  # after its lone sync, until group 1 is back
        replicas.start(1, kill={"where": "forward", "at": 5})
        go(replicas, {(0, 0), (1, 0)})
        replicas.wait_until(lambda: any(row["step"] == 6 for row in replicas.rows.get((0, 0), [])),
                            "group 0's sync at 6, alone")
        replicas.start(1)
        replicas.wait_until(lambda: replicas.rows.get((1, 0)), "group 1's first inner step after its restart")
        replicas.gate.value = 1  # group 0 goes on to its sync at 9, where group 1 waits at its own first
        got = replicas.results({(0, 0), (1, 0)}, deadline_s=60)
    finally:
        replicas.close()
    live, back = syncs(got[0, 0]), got[1, 0]
    assert {step: row["participants"] for step, row in live.items()} == {3: 2, 6: 1, 9: 1, 12: 2, 15: 2}, live
    healed = [row for row in back if row["healed"]]
    assert [(row["step"], row["synced"], row["participants"]) for row in healed] == [(9, True, 1)], back
    assert [row["step"] for row in back] == [1, 2, 9, 10, 11, 12, 13, 14, 15]  # its own 2, then the live group's
    assert syncs(back)[9]["state"] == live[9]["state"]  # the parameters, and the inner and outer state healed
    for step in (12, 15):  # each trained on its own data since: the parameters alike after each sync
        assert syncs(back)[step]["fragments"] == live[step]["fragments"], step


def test_a_group_lost_inside_a_sync_changes_nothing_and_the_sync_is_redone_without_it():
    """H = 3, 9 inner steps. Group 1 is SIGKILLed inside the all-gather of the sync at 6: group
    0's try fails and does not commit, and its parameters, anchors, inner and outer optimizer
    state and step are bitwise what they were before it (no half-applied outer step); the sync
    is redone in a quorum without group 1 and commits (participants 1)."""
    replicas = Replicas(replicas=0, steps=9, target=diloco_rank, sync_every=3)
    try:
        replicas.start(0)
        replicas.start(1, kill={"where": "sync", "at": 6})
        go(replicas, {(0, 0), (1, 0)})
        got = replicas.results({(0, 0)}, deadline_s=60)
    finally:
        replicas.close()
    live = syncs(got[0, 0])
    assert {step: row["participants"] for step, row in live.items()} == {3: 2, 6: 1, 9: 1}, live
    tries = live[6]["tries"]
    assert len(tries) >= 2 and len({t["state"] for t in tries}) == 1, tries
    assert len(live[3]["tries"]) == 1 and live[6]["state"] != tries[0]["state"]


def test_torchft_init_sync_is_refused():
    """torchft's default init_sync=True would copy one group's parameters into the others at
    their first sync and leave it alone in the average: refused by name on building DiLoCo."""
    replicas = Replicas(replicas=1, steps=3, target=diloco_rank, sync_every=3, init_sync=True)
    try:
        replicas.wait_until(lambda: replicas.errors, "the refusal")
    finally:
        replicas.close()
    assert "needs a Manager built with init_sync=False" in replicas.errors[0, 0]


def test_groups_with_other_fragments_fail_by_name_in_each():
    """Group 0 syncs its model whole every 3 steps, group 1 in 2 fragments every 4: their rows
    would differ in size. The first quorum's comparison of layouts fails each group by name,
    before any outer step."""
    for said in errors_of({}, {"sync_every": 4, "fragments": 2}, steps=8, sync_every=3).values():
        assert "DiLoCo's replica groups hold other models, fragments or settings" in said, said


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_nan_in_one_group_fails_every_group_by_name(dtype):
    """Group 1's parameter turns NaN before the sync at 3, its outer gradient sent as float32 or
    int8 blocks (whose scale would hide it): both groups raise naming replica 1, before any
    outer step."""
    for said in errors_of({}, {"poison_at": 3}, steps=6, sync_every=3, outer_dtype=dtype).values():
        assert "the outer gradient of replica 1 is not finite" in said, said
