"""Fault tolerance on torchft (docs/fault-tolerance.md): fullshard inside each replica group,
torchft's Manager across groups. Every process on 127.0.0.1; the replica groups are forked
processes (tests/replicas.py), the lighthouse one of its own.

Parity here is bitwise: the recipe runs the arithmetic of FSDP2 with torchft in the same order
(the same reduce-scatter inside a group, the same all-reduce across groups, then AdamW), and a
healed group receives the live group's bytes.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.replicas import Replicas, batch_of, digest

KILL_POINTS = ("forward", "backward", "allreduce", "optimizer")


def committed(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row["committed"]]


def by_step(rows: list[dict]) -> dict[int, dict]:
    return {row["step"]: row for row in committed(rows)}


@pytest.mark.parametrize("group_size", [1, 2])
def test_the_recipe_is_fsdp2_with_torchft_bitwise_and_listens_only_on_the_bind_address(group_size):
    """2 replica groups x 1 and x 2 ranks, no failure: every loss and every parameter and
    optimizer state shard equal to torch's FSDP2 with torchft's Manager on the same seeds."""
    runs = {}
    for kind in ("fullshard", "fsdp2"):
        replicas = Replicas(kind, replicas=2, group_size=group_size, steps=5, min_replicas=2)
        try:
            ranks = {(r, k) for r in range(2) for k in range(group_size)}
            runs[kind] = replicas.results(ranks)
            if kind == "fullshard":  # every listener of the lighthouse and of every rank, still up
                sockets = replicas.listeners()
                assert len(sockets) == 1 + len(ranks)
                assert all(s.startswith("127.0.0.1:") for found in sockets.values() for s in found), sockets
                # the lighthouse; each rank: its gloo groups, rank 0 also the store and the Manager's server
                assert len(sockets.pop("lighthouse")) == 1 and all(len(found) >= 2 for found in sockets.values()), sockets
        finally:
            replicas.close()
    for key, rows in runs["fullshard"].items():
        assert [r["step"] for r in rows] == list(range(5)) and all(r["participants"] == 2 for r in rows)
        theirs = runs["fsdp2"][key]
        assert [(r["loss"], r["digest"]) for r in rows] == [(r["loss"], r["digest"]) for r in theirs], key
    assert runs["fullshard"][0, 0][-1]["digest"] == runs["fullshard"][1, 0][-1]["digest"]


def replay(rows: list[dict]) -> str:
    """One process, no sharding, the logged steps: each committed step's gradient the average of
    its participants' (their batches by the step and their place), as torchft sums and divides.
    One thread, as each rank has: a CPU kernel's sums split over threads in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return replayed(rows)
    finally:
        torch.set_num_threads(threads)


def replayed(rows: list[dict]) -> str:
    from tests.models import tiny_gpt
    torch.manual_seed(0)
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for row in committed(rows):
        grads = []
        for place in range(row["participants"]):
            model.zero_grad()
            model(*batch_of(row["step"], place, 0, 1)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *each in zip(model.parameters(), *grads):
            total = each[0].clone()
            for g in each[1:]:
                total += g
            p.grad = total / row["participants"]
        optimizer.step()
    return digest(model, optimizer)


def test_a_replica_group_killed_anywhere_in_a_step_is_left_out_then_heals_bitwise():
    """Replica 1 SIGKILLed in the forward, the backward, the cross-replica all-reduce and the
    optimizer step, restarted after each: replica 0 never restarts, commits every step once
    (the failed one is redone at once with 1 participant, changing nothing before), and each
    restarted replica 1 heals to replica 0's parameters, optimizer state and step and stays
    bitwise equal to it. A replay of replica 0's logged participants gives its parameters."""
    replicas = Replicas(replicas=0, steps=10_000)
    try:
        replicas.start(0)
        replicas.wait_until(lambda: replicas.rows.get((0, 0)), "replica 0's first step")
        for where in KILL_POINTS:
            replicas.start(1, kill={"where": where})
            replicas.wait_until(lambda: not replicas.procs[1, 0].is_alive(), f"replica 1 dying in the {where}")
        replicas.start(1)
        replicas.wait_until(lambda: len(committed(replicas.rows.get((1, 0), []))) >= 3, "replica 1 rejoining")
        replicas.stop_soon()
        replicas.results({(0, 0), (1, 0)})
    finally:
        replicas.close()
    survivor = replicas.rows[0, 0]
    steps = [row["step"] for row in committed(survivor)]
    assert steps == list(range(steps[0], steps[0] + len(steps))), steps  # each step once, none lost
    for before, after in zip(survivor, survivor[1:]):
        if not before["committed"]:  # a step that could not commit changed nothing, and was redone
            assert after["step"] == before["step"] and before["digest"] == (
                by_step(survivor).get(before["step"] - 1, {"digest": before["digest"]})["digest"])
    assert sum(not row["committed"] for row in survivor) >= 2  # the all-reduce and the forward/backward kills
    assert [row["participants"] for row in committed(survivor)].count(1) >= len(KILL_POINTS)
    lives = [rows for key, rows in replicas.rows.items() if key[:2] == (1, 0)]
    assert len(lives) == len(KILL_POINTS) + 1
    theirs = by_step(survivor)
    for rows in lives:  # the heal: at the first step it ran, and every step after
        assert rows and all(theirs[row["step"]]["digest"] == row["digest"] for row in committed(rows)), rows
    assert replay(survivor) == survivor[-1]["digest"]


def test_muon_and_clipping_at_two_ranks_per_group_heal_after_a_rank_of_a_group_dies():
    """2 x 2 with fullshard.optim.Muon (and AdamW for the rest) and clip_grad_norm_ every step, the
    non-finite check set to raise: rank 1 of replica 1 SIGKILLed in the backward; its peer fails
    by name, replica 0 goes on; replica 1 restarted heals Muon's momentum, AdamW's moments and the
    step, and is bitwise replica 0 from then on."""
    replicas = Replicas(replicas=0, group_size=2, steps=10_000, optimizer="muon", clip=True)
    try:
        replicas.start(0)
        replicas.wait_until(lambda: replicas.rows.get((0, 0)), "replica 0's first step")
        replicas.start(1, kill={"where": "backward"}, kill_rank=1)
        replicas.wait_until(lambda: not any(replicas.procs[1, k].is_alive() for k in range(2)), "replica 1 ending")
        replicas.start(1)
        replicas.wait_until(lambda: all(len(committed(replicas.rows.get((1, k), []))) >= 3 for k in range(2)),
                            "replica 1 rejoining")
        replicas.stop_soon()
        replicas.results({(r, k) for r in range(2) for k in range(2)})
    finally:
        replicas.close()
    # the killed rank's peer: its next collective fails by name, at once (the socket closed)
    assert "did not finish" in replicas.errors[1, 0] and "Connection" in replicas.errors[1, 0], replicas.errors
    for rank in range(2):
        survivor = replicas.rows[0, rank]
        steps = [row["step"] for row in committed(survivor)]
        assert steps == list(range(steps[0], steps[0] + len(steps))), steps
        assert all(row["norm"] is not None and row["norm"] == row["norm"] for row in survivor)  # finite, no raise
        theirs = by_step(survivor)
        rejoined = committed(replicas.rows[1, rank])
        assert rejoined and all(theirs[row["step"]]["digest"] == row["digest"] for row in rejoined)


def test_a_joining_group_of_another_model_is_refused_by_name_and_the_run_goes_on():
    """A group whose model is laid out otherwise asks to heal: it stops with the refusal (no
    retry), the live group commits on."""
    replicas = Replicas(replicas=0, steps=10_000)
    try:
        replicas.start(0)
        replicas.wait_until(lambda: replicas.rows.get((0, 0)), "replica 0's first step")
        replicas.options["other_model"] = True
        replicas.start(1)
        replicas.wait_until(lambda: (1, 0) in replicas.errors, "the joiner's refusal")
        done = len(committed(replicas.rows[0, 0]))
        replicas.wait_until(lambda: len(committed(replicas.rows[0, 0])) >= done + 3, "replica 0 going on")
        replicas.stop_soon()
        replicas.results({(0, 0)})
    finally:
        replicas.close()
    assert "refused the state a live group sent to heal it" in replicas.errors[1, 0]
    assert "laid out otherwise" in replicas.errors[1, 0]
    assert not replicas.rows.get((1, 0))  # it never stepped


def test_the_lighthouse_lost_is_a_named_error_on_every_group():
    replicas = Replicas(replicas=2, steps=10_000, quorum_timeout_s=2)
    try:
        replicas.wait_until(lambda: all(len(replicas.rows.get((r, 0), [])) >= 2 for r in range(2)), "training")
        replicas.lighthouse.kill()
        start = time.monotonic()
        replicas.wait_until(lambda: len(replicas.errors) == 2, "both groups' errors", deadline_s=30)
        took = time.monotonic() - start
    finally:
        replicas.close()
    for error in replicas.errors.values():
        assert "got no quorum for step" in error and "the lighthouse at 'http://127.0.0.1:" in error, error
        assert "nothing of this step was committed" in error
    assert took < 2 + 5, took  # the quorum timeout, and the time to say so


# ---- hostile and wrong peers: the transport alone, rank 0 the source, rank 1 the joiner ----------


def peer_job(cases: list[str]) -> list[tuple[str, str]]:
    """Each rank a model sharded over a mesh of its own (so both have one layout); rank 0 sends
    each case's message, rank 1 receives it and says what came of it."""
    import copy
    import json
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import fullshard
    from fullshard.ft.transport import HealTransport, shards_of
    from tests.models import tiny_gpt, token_batch

    rank = dist.get_rank()
    groups = [dist.new_group([0]), dist.new_group([1])]
    torch.manual_seed(0)
    model = tiny_gpt()
    for block in model.h:
        fullshard.fully_shard(block, mesh=DeviceMesh.from_group(groups[rank], "cpu"))
    fullshard.fully_shard(model, mesh=DeviceMesh.from_group(groups[rank], "cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1 + rank):  # the joiner one step further, on other data: a heal must change it
        model(*token_batch(torch.Generator().manual_seed(rank * 10 + step), 2)).backward()
        optimizer.step()
        optimizer.zero_grad()
    timeout = timedelta(seconds=5)
    transport = HealTransport(dist.group.WORLD, timeout)
    transport.attach(model, optimizer)
    state = {"user": {"fullshard": shards_of(model, optimizer), "data": {"epoch": 2}},
             "torchft": {"step": 3, "batches_committed": 6}}
    outcomes = []
    for case in cases:
        if rank == 0:
            header, tensors = transport.header(3, state)
            if case == "valid":
                transport.send_parts([1], json.dumps(header).encode(), tensors, timeout)
                continue
            if case == "layout":  # refused on the metadata: nothing is sent
                continue
            bad = copy.deepcopy(header)
            first = bad["tensors"][0]
            text = {
                "oversized": None, "not json": b"{'step': 3", "schema": json.dumps({**bad, "extra": 1}).encode(),
                "dtype": json.dumps({**bad, "tensors": [{**first, "dtype": "object"}, *bad["tensors"][1:]]}).encode(),
                "bytes": json.dumps({**bad, "tensors": [{**first, "nbytes": first["nbytes"] * 2},
                                                        *bad["tensors"][1:]]}).encode(),
                "shape": json.dumps({**bad, "tensors": [{**first, "shape": [10**6, 30], "local": [10**6, 30],
                                                         "nbytes": 4 * 30 * 10**6}, *bad["tensors"][1:]]}).encode(),
                "huge state": json.dumps({**bad, "tensors": [*bad["tensors"], {
                    "key": "optim.state.wte.weight.extra", "dtype": "float32", "shape": [10**6, 10**6],
                    "local": [10**6, 10**6], "nbytes": 4 * 10**12}]}).encode(),
                "step": json.dumps({**bad, "step": 2}).encode(),
            }[case]
            length = torch.tensor([10**12 if text is None else len(text)], dtype=torch.int64)
            dist.send(length, 1)
            if text is not None:
                dist.send(torch.frombuffer(bytearray(text), dtype=torch.uint8), 1)
            continue
        metadata = transport.metadata()
        if case == "layout":
            metadata = json.dumps({**json.loads(metadata), "layout": "0" * 64})
        try:
            healed = transport.recv_checkpoint(0, metadata, 3, timeout)["user"]
        except fullshard.FullShardError as e:
            outcomes.append((case, str(e)))
            continue
        fullshard.state_dict.load_optimizer_state(model, optimizer, healed["fullshard"].optim_sd)
        fullshard.state_dict.load_model_state(model, healed["fullshard"].model_sd)
        outcomes.append((case, json.dumps(healed["data"])))
    dist.barrier()
    digests = [None, None]
    dist.all_gather_object(digests, digest(model, optimizer))
    outcomes.append(("equal", str(digests[0] == digests[1])))
    return outcomes


REFUSALS = {
    "layout": "laid out otherwise than this group's",
    "oversized": "its header would be 1000000000000 bytes, and this model's is at most",
    "not json": "its header is not JSON",
    "schema": "its header has the keys",
    "dtype": "dtype 'object' is none of fullshard's",
    "bytes": "says model.wte.weight is 14640 bytes, and float32 [61, 30] is 7320",
    "shape": "where this rank holds float32 [61, 30]",
    "huge state": "larger than its parameter",
    "step": "it sends the state of step 2, and the quorum healed to step 3",
}


def test_a_heal_from_a_hostile_or_wrong_peer_is_refused_by_name_before_its_bytes(world2):
    """Each refusal is a FullShardError naming what was wrong, raised before a buffer of the
    header's sizes is made; a valid heal after them all lands bitwise (the streams stayed in step)."""
    cases = [*REFUSALS, "valid"]
    outcomes = dict(world2.run(peer_job, cases=cases)[1])
    for case, words in REFUSALS.items():
        assert "refused the state a live group sent to heal it" in outcomes[case] and words in outcomes[case], \
            (case, outcomes[case])
    assert outcomes["valid"] == '{"epoch": 2}' and outcomes["equal"] == "True"
