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

pytest.importorskip("torchft", reason="torchft is fullshard[ft]'s: pip install 'fullshard[ft]'")

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
    assert took < 2 + 15, took  # the quorum timeout (2 s, not torchft's 60), and time to say so on busy cores


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


def test_a_heal_during_a_background_save_and_a_restart_with_no_live_peer_resumes_from_disk(tmp_path):
    """Each group saves in the background after every committed step: replica 1 killed in the
    all-reduce and restarted heals from replica 0 while replica 0's save is in flight, bitwise.
    Then both end at one step, and replica 1 restarted alone (no live peer to heal from) resumes
    from its last checkpoint: at that step, with replica 0's state there, not from step 0."""
    replicas = Replicas(replicas=0, steps=10_000, checkpoint=str(tmp_path))
    try:
        replicas.lose_and_heal("allreduce")
        last = replicas.rows[1, 0][-1]["step"] + 1
        replicas.procs[0, 0].kill()  # no live peer: an idle one would still be a member of the quorum
        replicas.stop.value = last + 2
        replicas.start(1)
        replicas.results({(1, 0)})
    finally:
        replicas.close()
    theirs = by_step(replicas.rows[0, 0])
    healed = [rows for key, rows in replicas.rows.items() if key[:2] == (1, 0)][-2]
    assert healed and all(theirs[row["step"]]["digest"] == row["digest"] for row in committed(healed))
    assert replicas.resumed[1, 0] == {"step": last, "digest": theirs[last - 1]["digest"]}
    assert [row["step"] for row in committed(replicas.rows[1, 0])] == [last, last + 1]


def test_both_groups_losing_a_rank_at_once_resume_from_disk_and_agree(tmp_path):
    """2 x 2, rank 1 of each group SIGKILLed in the backward of step 4: no group is left to heal
    from, each group's rank 0 fails by name; restarted, each resumes from its last checkpoint
    (a group behind heals from the one ahead), and they train on bitwise equal."""
    replicas = Replicas(replicas=0, group_size=2, steps=10_000, checkpoint=str(tmp_path), min_replicas=2)
    try:
        for replica in range(2):
            replicas.start(replica, kill={"where": "backward", "at": 4}, kill_rank=1)
        replicas.wait_until(lambda: not any(p.is_alive() for p in replicas.procs.values()), "every rank ending")
        errors = dict(replicas.errors)
        for replica in range(2):
            replicas.start(replica)
        replicas.wait_until(lambda: all(len(committed(replicas.rows.get((r, 0), []))) >= 2 for r in range(2)),
                            "both groups training again")
        replicas.stop_soon()
        replicas.results({(r, k) for r in range(2) for k in range(2)})
    finally:
        replicas.close()
    assert set(errors) == {(0, 0), (1, 0)} and all("did not finish" in e for e in errors.values()), errors
    resumed = {key: value["step"] for key, value in replicas.resumed.items()}
    assert set(resumed) == {(r, k) for r in range(2) for k in range(2)} and 3 <= min(resumed.values()), resumed
    for rank in range(2):
        ours, theirs = by_step(replicas.rows[0, rank]), by_step(replicas.rows[1, rank])
        common = sorted(set(ours) & set(theirs))
        assert len(common) >= 2 and all(ours[s]["digest"] == theirs[s]["digest"] for s in common)


def test_the_lighthouse_command_listens_on_its_address_only_and_refuses_a_host_name():
    import subprocess
    import sys

    from tests.replicas import listening
    from tests.world import child_pythonpath
    env = {**__import__("os").environ, "PYTHONPATH": child_pythonpath(), "RUST_LOG": "warn"}
    refused = subprocess.run([sys.executable, "-m", "fullshard.ft", "--bind", "localhost"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "bind='localhost' is not an IP address" in refused.stderr, refused.stderr
    served = subprocess.Popen([sys.executable, "-m", "fullshard.ft", "--bind", "127.0.0.1", "--port", "0"], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        line = served.stdout.readline()
        assert line.startswith("lighthouse at http://127.0.0.1:"), line
        port = line.split("http://127.0.0.1:", 1)[1].split(":", 1)[0]
        assert listening(served.pid) == [f"127.0.0.1:{port}"]
    finally:
        served.terminate()
        assert served.wait(timeout=30) == 0


def test_steps_that_cannot_commit_end_the_run_after_max_retries_by_name():
    """A group alone where the Manager needs 2 (min_replica_size): no step commits, and the
    third in a row ends it (max_retries=2), instead of torchft's retrying forever."""
    replicas = Replicas(replicas=1, steps=10_000, min_replica_size=2, max_retries=2)
    try:
        replicas.wait_until(lambda: (0, 0) in replicas.errors, "the group's error")
    finally:
        replicas.close()
    assert "fault tolerance: 3 steps in a row did not commit (max_retries=2)" in replicas.errors[0, 0]
    assert [row["committed"] for row in replicas.rows[0, 0]] == [False, False]


def test_addresses_are_ip_literals_and_a_wildcard_warns():
    from fullshard import FullShardError
    from fullshard.ft.network import host_of, replica_env

    assert host_of("127.0.0.1") == "127.0.0.1" and host_of("::1") == "::1"
    assert replica_env("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo"}
    for wrong in ("localhost", "vm", "127.0.0.1:80", 1):
        with pytest.raises(FullShardError, match="bind=.* (is not an IP address|must be an IP address)"):
            host_of(wrong)
    with pytest.warns(UserWarning, match="listens on every interface"):
        host_of("0.0.0.0")
    with pytest.raises(FullShardError, match="is the address of no interface of this host"):
        replica_env("192.0.2.7")  # TEST-NET-1: no interface here holds it


# ---- fullshard train --fault-tolerant ----------------------------------------------------------


def train_killing_group_1(out, kills: tuple[int, ...], extra: tuple[str, ...] = ()) -> tuple[list[dict], str]:
    """`fullshard train` of the tiny GPT for 200 steps as 2 replica groups of 1 rank (and the
    options `extra`), group 1's rank SIGKILLed once metrics.jsonl holds each of `kills` rows and
    group 1 took part in a step since it (re)started (under load it may join late): the rows and
    the launcher's stderr, once it ended with 0 and said it restarted group 1 after each kill."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from tests.world import child_pythonpath
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen([sys.executable, "-m", "fullshard.cli", "train", "--preset", "tiny", "--steps", "200",
                            "--nproc", "2", "--replicas", "2", "--fault-tolerant", "--seq-len", "64",
                            "--global-batch", "32", "--eval-interval", "1000", "--eval-batches", "1",
                            "--sample-bytes", "0", "--timeout", "20", "--out", str(out), *extra],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = out / "metrics.jsonl"
        started = 0  # rows logged when group 1 last started: it takes part in a later one
        for after_rows in kills:
            deadline = time.monotonic() + 120
            while not (log.is_file() and len(lines := log.read_text().splitlines()) >= after_rows
                       and any('"participants": 2' in line for line in lines[started:])):
                assert run.poll() is None and time.monotonic() < deadline, run.communicate()
                time.sleep(0.02)
            ranks = subprocess.run(["pgrep", "-P", str(run.pid)], capture_output=True, text=True).stdout.split()
            group_1 = [pid for pid in ranks if b"FULLSHARD_REPLICA=1\0" in open(f"/proc/{pid}/environ", "rb").read()]
            assert len(group_1) == 1, ranks
            os.kill(int(group_1[0]), signal.SIGKILL)
            started = len(lines)
        out_text, err = run.communicate(timeout=180)
    finally:
        run.kill()
    (out / "launcher-stderr.txt").write_text(err)  # kept for reading when an assertion below fails
    assert run.returncode == 0, err[-3000:]
    assert err.count("replica group 1: rank 0 was killed by SIGKILL; restarting it") == len(kills), err[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()], err


@pytest.mark.parametrize("extra", [(), ("--sync-every", "5")], ids=["every step", "DiLoCo"])
def test_a_killed_replica_group_heals_and_one_restarted_too_late_trains_nothing_alone(tmp_path, extra):
    """The issue's bar check: 2 ranks as 2 replica groups, a rank SIGKILLed at about step 20: the
    command ends with 0, metrics.jsonl holds every step once, participants go 2 -> 1 -> 2. (200
    steps of 32 x 64 tokens, not 60 of 8 x 32: a restarted group takes ~3 s to rejoin, and on an
    idle machine the smaller steps took 16 ms: the live group finished first.)

    Then, in the same run, group 1 killed again 5 steps before the end: the live group finishes
    before the restarted one is up, so that one never finds a group to heal from. It takes no
    step alone (Note [rejoining first]; before, it trained the run again from step 1 for
    LATE_GROUP_S and logged those rows a second time) and the launcher ends it as soon as the live
    group finished, saying so (Note [late groups]; before, after LATE_GROUP_S): still every step
    logged once.

    The same with DiLoCo syncing every 5 steps (docs/diloco.md): the rows of a sync's steps
    carry its participants (Note [diloco rows]), the killed group left out of the next sync or
    two, then healed at a sync; restarted too late, from nothing, it syncs alone and logs
    nothing (Note [diloco rows]; before, it logged its steps again). The rows reach steps 20 and
    195 at syncs."""
    rows, err = train_killing_group_1(tmp_path, (20, 195), extra)
    assert [row["step"] for row in rows] == list(range(1, 201)), ([row["step"] for row in rows], err[-3000:])
    participants = [row["participants"] for row in rows[:195]]  # before the second kill
    fewer = [i for i, n in enumerate(participants) if n == 1 and i >= 19]
    assert fewer and all(n == 2 for n in participants[fewer[-1] + 1:]) and participants[-1] == 2, participants
    if "replica group 1 was restarted too late to heal" in err:  # ended by the launcher, never healed: no
        # step after the second kill had it (one that heals in the last step may end on its own; a healing
        # group is no participant of that step)
        after = [row["participants"] for row in rows[194:]]
        assert 1 in after and all(n == 1 for n in after[after.index(1):]), after
    assert "s after another finished --steps" not in err, err[-3000:]


# Stand-in ranks of `fullshard train --fault-tolerant` (no torch: Note [late groups] is the launcher's):
# group 1 kills itself, the launcher restarts it while group 0 lives (rejoining), the restarted one says
# it is up (and with `healed`, reports its heal as a rank does), and group 0 finishes --steps only then.
STAND_IN = """
import os, signal, sys, time
store, healed = os.environ["FULLSHARD_STORE_FILE"], sys.argv[1] == "healed"
if os.environ["FULLSHARD_REPLICA"] == "1":
    if os.environ["FULLSHARD_REJOINING"] != "1":
        os.kill(os.getpid(), signal.SIGKILL)
    if healed:
        from fullshard.cli.launcher import report_healed
        report_healed()
    open(store + ".up", "w").close()
    time.sleep(60)
restarted = os.path.join(os.path.dirname(store), "replica-1-attempt-1.up")
deadline = time.monotonic() + 60
while not os.path.exists(restarted) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


@pytest.mark.parametrize("healed", [False, True], ids=["not healed", "healed"])
def test_a_group_restarted_too_late_is_ended_once_another_finished_and_a_healed_one_is_waited_for(
        monkeypatch, capsys, healed):
    """Note [late groups]: when group 0 finishes, a restarted group 1 that has not healed is ended at
    once (LATE_GROUP_S made a minute: the test would wait it out), saying so; one that healed is waited
    for, up to LATE_GROUP_S (made 1 s), and then ended, saying that."""
    import sys

    from fullshard.cli import launcher
    monkeypatch.setattr(launcher, "LATE_GROUP_S", 1 if healed else 60)
    start = time.monotonic()
    status = launcher.launch_replicas([sys.executable, "-c", STAND_IN, "healed" if healed else "-"], nproc=2,
                                      replicas=2, bind="127.0.0.1", max_restarts=0)
    err = capsys.readouterr().err
    assert status == 0, err
    assert "replica group 1: rank 0 was killed by SIGKILL; restarting it" in err, err
    if healed:
        assert "fullshard: replica group 1 was not done 1 s after another finished --steps; ending it" in err, err
    else:
        assert "fullshard: replica group 1 was restarted too late to heal: another group finished --steps first; " \
               "ending it" in err, err
        assert time.monotonic() - start < 30


@pytest.mark.parametrize("args, words", [
    (["--replicas", "2"], "--replicas 2 is for --fault-tolerant (replica groups on torchft) or --sync-every"),
    (["--ft-bind", "127.0.0.2"], "--ft-bind is the address of --fault-tolerant's listeners"),
    (["--replicas", "2", "--fault-tolerant", "--strategy", "hybrid_shard"], "does not take --strategy hybrid_shard"),
    (["--replicas", "2", "--fault-tolerant", "--precision", "fp16"], "does not take --precision fp16"),
    (["--replicas", "2", "--fault-tolerant", "--ft-bind", "localhost"], "bind='localhost' is not an IP address"),
    (["--replicas", "0", "--fault-tolerant"], "--replicas must be at least 1"),
    (["--replicas", "2", "--fault-tolerant", "--nproc", "3", "--oversubscribe"],
     "--nproc 3 must divide into --replicas 2 groups"),
])
def test_train_refuses_fault_tolerance_it_cannot_run_in_one_line(args, words, capsys, tmp_path):
    from fullshard import cli
    assert cli.main(["train", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_train_without_torchft_names_the_install_line(monkeypatch, capsys, tmp_path):
    import importlib.metadata

    from fullshard import cli
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "torchft":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert cli.main(["train", "--out", str(tmp_path), "--replicas", "2", "--fault-tolerant"]) == 2
    assert "fault tolerance needs torchft, which is not installed. Install it: pip install 'fullshard[ft]'" in \
        capsys.readouterr().err


def test_train_fault_tolerant_under_torchrun_points_to_the_recipe(monkeypatch, capsys, tmp_path):
    from fullshard import cli
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(var, value)
    assert cli.main(["train", "--out", str(tmp_path), "--replicas", "2", "--fault-tolerant"]) == 2
    assert "run it without torchrun (or, under torchrun, use fullshard.ft's recipe" in capsys.readouterr().err


def test_the_test_worlds_listen_on_127_0_0_1_only(world2):
    """The rank pools every multi-process test runs in: their store and gloo's sockets are all on
    127.0.0.1 (torch's TCPStore would listen on every interface: tests/world.py binds it)."""
    from tests.replicas import listening
    world2.run(dist_barrier)
    sockets = {proc.pid: listening(proc.pid) for proc in world2.procs}
    assert all(found and all(s.startswith("127.0.0.1:") for s in found) for found in sockets.values()), sockets


def dist_barrier() -> None:
    import torch.distributed as dist
    dist.barrier()


def test_groups_on_two_addresses_listen_each_on_its_own_and_heal_across():
    """The groups as two hosts would run them, each bound to its own address (127.0.0.2 and
    127.0.0.3, the lighthouse on the first): a kill and a heal across them, bitwise; every
    torchft listener on its group's address. The group's own gloo group binds lo's first address
    (GLOO_SOCKET_IFNAME=lo: 127.0.0.1), as docs/fault-tolerance.md says."""
    binds = {0: "127.0.0.2", 1: "127.0.0.3"}
    replicas = Replicas(replicas=0, steps=10_000, bind="127.0.0.2", binds=binds)
    try:
        replicas.lose_and_heal("allreduce")
        sockets = replicas.listeners()
    finally:
        replicas.close()
    assert sockets.pop("lighthouse")[0].startswith("127.0.0.2:")
    for replica, address in binds.items():
        found = sockets[f"replica {replica} rank 0"]
        assert sum(s.startswith(address + ":") for s in found) >= 3, found  # store, Manager server, gloo across
        assert all(s.startswith((address + ":", "127.0.0.1:")) for s in found), found
    theirs = by_step(replicas.rows[0, 0])
    assert all(theirs[row["step"]]["digest"] == row["digest"] for row in committed(replicas.rows[1, 0]))


def test_another_torchft_release_is_refused_by_name(monkeypatch):
    import importlib.metadata

    from fullshard import FullShardError
    from fullshard.ft.network import check_torchft
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.0.dev1" if name == "torchft" else real(name))
    with pytest.raises(FullShardError, match=r"checked with torchft 0\.2\.0, and torchft 0\.3\.0\.dev1 is installed"):
        check_torchft()


def test_the_manager_and_attach_refuse_what_would_bypass_them():
    from torch import nn

    from fullshard import FullShardError, ft
    with pytest.raises(FullShardError, match="max_retries=-1 must be an int of at least 0"):
        ft.Manager(max_retries=-1)
    with pytest.raises(FullShardError, match="takes no load_state_dict/state_dict"):
        ft.Manager(load_state_dict=lambda sd: None, state_dict=dict)
    with pytest.raises(FullShardError, match="attach needs a fullshard.ft.Manager, got Manager"):
        import torchft.manager
        ft.attach(torchft.manager.Manager.__new__(torchft.manager.Manager), nn.Linear(2, 2))
    other = ft.Manager.__new__(ft.Manager)
    other._checkpoint_transport = object()  # as if built with checkpoint_transport=torchft's own
    with pytest.raises(FullShardError, match="heals over another checkpoint transport"):
        ft.attach(other, nn.Linear(2, 2))


def source_refusals_job() -> dict:
    """What a live group refuses to send, each by name: state a joiner could not check."""
    from datetime import timedelta

    import torch.distributed as dist

    import fullshard
    from fullshard.ft.transport import HealTransport, shards_of
    from tests.models import tiny_gpt
    from tests.test_errors import raises

    model = fullshard.fully_shard(tiny_gpt())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    transport = HealTransport(dist.group.WORLD, timedelta(seconds=5))
    state = {"user": {"fullshard": None}, "torchft": {"step": 0, "batches_committed": 0}}
    out = {"unattached": raises(lambda: transport.send_checkpoint([0], 0, state, timedelta(seconds=5)))}
    transport.attach(model, optimizer)
    optimizer.state[next(model.parameters())]["preconditioner"] = torch.zeros(7, 7)
    out["shape"] = raises(lambda: shards_of(model, optimizer))
    del optimizer.state[next(model.parameters())]["preconditioner"]
    state = {"user": {"fullshard": shards_of(model, optimizer), "loader": {"tensor": torch.zeros(2)}},
             "torchft": {"step": 0, "batches_committed": 0}}
    out["json"] = raises(lambda: transport.header(0, state))
    return out


def test_a_live_group_refuses_to_send_what_a_joiner_could_not_check(world1):
    got = world1.run(source_refusals_job)[0]
    assert "asked for its state before fullshard.ft.attach" in got["unattached"], got
    assert "healing carries optimizer state shaped as its parameter or scalars" in got["shape"], got
    assert "state registered as 'loader' as JSON, and it is not JSON" in got["json"], got
