"""DiLoCo across replica groups (fullshard.DiLoCo, Note [outer steps] in fullshard/diloco.py):
against a one-process simulation of its replicas, replicas bitwise equal after each sync in every
wire dtype, H = 1 against synchronous hybrid sharding, a resume from its state dict, and bad
input and non-finite outer gradients as named errors on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from tests.models import named_mesh
from tests.reference import ADAMW_TOL, full_state, max_diff

WIDTH, OUT, BATCH = 16, 4, 8
INNER_LR = 1e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def make_model() -> nn.Sequential:
    """Three blocks (each a unit) and a head (the root's), the same values on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)],
                         nn.Linear(WIDTH, OUT))


def replica_batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s whole batch of inner step `step` (its data differ from the others')."""
    generator = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, OUT, generator=generator)


def sharded(mesh) -> nn.Sequential:
    model = make_model()
    for block in model[:3]:
        fullshard.fully_shard(block, mesh=mesh)
    fullshard.fully_shard(model, mesh=mesh)
    return model


def inner_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=INNER_LR)


def inner_step(model: nn.Module, replica: int, step: int, shard: int, shards: int) -> None:
    x, y = replica_batch(replica, step)
    loss = nn.functional.mse_loss(model(x.chunk(shards)[shard]), y.chunk(shards)[shard])
    loss.backward()


def diloco_job(shape: tuple[int, int], steps: int, sync_every: int, fragments: int = 1, dtype: str = "fp32",
               overlap: bool = False, inner: str = "adamw", outer: str = "nesterov") -> dict:
    """`steps` inner steps of DiLoCo over the replicas of a (replicate, shard) mesh: the full
    parameters, the fragments (names, phases), whether every replica held bitwise the same
    fragment right after each sync, and the bytes sent."""
    mesh = named_mesh(shape, ("replicate", "shard"))
    replica, shard = mesh.get_local_rank(0), mesh.get_local_rank(1)
    model = sharded(mesh["shard"])
    outer_optimizer = (lambda params: torch.optim.SGD(params, lr=1.0)) if outer == "plain" else fullshard.diloco.nesterov
    diloco = fullshard.DiLoCo(model, inner_optimizer(model, inner), mesh["replicate"], sync_every=sync_every,
                              fragments=fragments, outer_dtype=DTYPES[dtype], overlap=overlap,
                              outer_optimizer=outer_optimizer)
    equal_after_sync, norms = [], []
    for step in range(1, steps + 1):
        inner_step(model, replica, step, shard, shape[1])
        want = torch.nn.utils.get_total_norm([p.grad.full_tensor() for p in model.parameters()])
        norms.append((fullshard.clip_grad_norm_(model, 1e9).item(), want.item()))  # this replica's own
        diloco.step()
        diloco.zero_grad()
        landed = step - overlap
        for f in diloco.fragments:
            if landed >= 1 and landed % sync_every == f.phase:
                equal_after_sync.append(replicas_equal([p.sharded.to_local() for p in f.params], mesh["replicate"]))
    diloco.finish()
    return {"params": full_state(model), "names": [f.names for f in diloco.fragments],
            "phases": [f.phase for f in diloco.fragments], "equal_after_sync": equal_after_sync,
            "bytes_sent": diloco.bytes_sent, "norms": norms, "stats_cross": fullshard.stats(model).cross_group_bytes}


def replicas_equal(tensors: list[torch.Tensor], mesh) -> bool:
    """Whether every replica holds bitwise these values."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).view(torch.int32)
    rows = torch.empty(mesh.size() * flat.numel(), dtype=torch.int32)
    dist.all_gather_into_tensor(rows, flat, group=mesh.get_group())  # noqa
    rows = rows.view(mesh.size(), -1)
    return all(torch.equal(rows[0], row) for row in rows)


def simulate(replicas: int, steps: int, sync_every: int, names: list[list[str]], phases: list[int],
             overlap: bool) -> list[dict[str, torch.Tensor]]:
    """DiLoCo in one process: `replicas` plain copies, each on its whole batch with its own AdamW,
    the fragments' outer steps (Nesterov SGD on float32 anchors, the outer gradients averaged in
    replica order) as Note [outer steps] says: each replica's parameters."""
    models = [make_model() for _ in range(replicas)]
    inners = [inner_optimizer(m, "adamw") for m in models]
    params = [dict(m.named_parameters()) for m in models]
    anchors = {name: nn.Parameter(p.detach().clone(), requires_grad=False) for name, p in params[0].items()}
    outer = fullshard.diloco.nesterov(list(anchors.values()))
    pending: list[tuple[list[str], dict[str, torch.Tensor]]] = []

    def apply(fragment: list[str], average: dict[str, torch.Tensor]) -> None:
        for anchor in anchors.values():
            anchor.grad = None
        for name in fragment:
            anchors[name].grad = average[name]
        outer.step()
        for name in fragment:
            for replica in params:
                replica[name].data.copy_(anchors[name])

    for step in range(1, steps + 1):
        for replica, (model, inner) in enumerate(zip(models, inners)):
            inner_step(model, replica, step, 0, 1)
            inner.step()
            inner.zero_grad()
        for fragment, average in pending:
            apply(fragment, average)
        pending = []
        for fragment, phase in zip(names, phases):
            if step % sync_every == phase:
                average = {}
                for name in fragment:
                    total = torch.zeros_like(anchors[name])
                    for replica in params:
                        total += anchors[name] - replica[name].detach()
                    average[name] = total / replicas
                pending.append((fragment, average))
        if not overlap:
            for fragment, average in pending:
                apply(fragment, average)
            pending = []
    for fragment, average in pending:
        apply(fragment, average)
    return [{name: p.detach() for name, p in replica.items()} for replica in params]


@pytest.mark.parametrize("fragments, overlap", [(1, False), (2, True)])
def test_diloco_trains_like_a_simulation_of_its_replicas(world4, fragments, overlap):
    """2 replicas of 2 shards, H = 3, 7 inner steps of AdamW: every rank's parameters are the
    one-process simulation's within AdamW's parity tolerance (the shards' gradients are summed in
    another order than one process sums the whole batch's, and AdamW divides by their square
    roots), every fragment is bitwise alike on both replicas right after each sync, and
    clip_grad_norm_ measures each replica group's own gradients (not a sum over the groups)."""
    results = world4.run(diloco_job, shape=(2, 2), steps=7, sync_every=3, fragments=fragments, overlap=overlap)
    want = simulate(2, 7, 3, results[0]["names"], results[0]["phases"], overlap)
    assert len(results[0]["names"]) == fragments and sorted(sum(results[0]["names"], [])) == sorted(want[0])
    for rank, got in enumerate(results):  # ranks 0, 1: replica 0; 2, 3: replica 1
        assert max_diff(got["params"], want[rank // 2]) <= ADAMW_TOL
        assert got["equal_after_sync"] and all(got["equal_after_sync"]), got["equal_after_sync"]
        assert all(abs(clipped - own) <= 1e-6 * own for clipped, own in got["norms"]), got["norms"]
    # the replicas trained apart since the last sync (with overlap, the last step's syncs land in
    # finish(): every fragment has just synced), and DiLoCo is not plain averaging every step
    assert max_diff(want[0], want[1]) > 1e-4 if not overlap else max_diff(want[0], want[1]) == 0
    assert max_diff(want[0], simulate(2, 7, 1, results[0]["names"], [0] * fragments, False)[0]) > 1e-4


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_low_precision_outer_gradients_keep_replicas_bitwise_equal(world4, dtype):
    """Outer gradients sent as bf16 or int8 blocks, summed in float32: bitwise the same parameters
    on every replica after each sync, within the wire's rounding of the float32 run, in the bytes
    Note [outer steps] counts (besides the headers, 1/2 and about 1/4 of float32's: int8 adds a
    float32 scale per block of 256 and pads each parameter's codes to 8 bytes)."""
    exact = world4.run(diloco_job, shape=(2, 2), steps=6, sync_every=2, fragments=2)
    low = world4.run(diloco_job, shape=(2, 2), steps=6, sync_every=2, fragments=2, dtype=dtype)
    for got, reference in zip(low, exact):
        assert got["equal_after_sync"] and all(got["equal_after_sync"])
        assert 0 < max_diff(got["params"], reference["params"]) <= 1e-2
    headers = 6 * fullshard.diloco.HEADER  # 2 fragments, each synced 3 times, to 1 other replica
    ratio = (low[0]["bytes_sent"] - headers) / (exact[0]["bytes_sent"] - headers)
    assert (0.5 if dtype == "bf16" else 0.25) <= ratio <= (0.55 if dtype == "bf16" else 0.3), ratio


def synchronous_job() -> dict:
    """Hybrid sharding over (2, 2), SGD on the replicas' batches together: the full parameters,
    the bytes this rank sent across replicas and its trainable local values."""
    mesh = named_mesh((2, 2), ("replicate", "shard"))
    model = make_model()
    for block in model[:3]:
        fullshard.fully_shard(block, mesh=mesh)
    fullshard.fully_shard(model, mesh=mesh)
    optimizer = inner_optimizer(model, "sgd")
    replica, shard = mesh.get_local_rank(0), mesh.get_local_rank(1)
    for step in range(1, 5):
        inner_step(model, replica, step, shard, 2)
        optimizer.step()
        optimizer.zero_grad()
    return {"params": full_state(model), "cross_bytes": fullshard.stats(model).cross_group_bytes,
            "local_values": sum(p.to_local().numel() for p in model.parameters())}


def test_sync_every_step_with_a_plain_outer_step_is_synchronous_training_in_its_bytes(world4):
    """H = 1, outer SGD at lr 1 without momentum, inner SGD: each step averages the replicas'
    parameters, which is synchronous training's step on the averaged gradient. Not bitwise: DiLoCo
    rounds theta - lr * g on each replica and then averages theta - that, where synchronous
    training rounds the average gradient first; within a few float32 ulps of the parameters."""
    diloco = world4.run(diloco_job, shape=(2, 2), steps=4, sync_every=1, inner="sgd", outer="plain")
    synchronous = world4.run(synchronous_job)
    every_other = world4.run(diloco_job, shape=(2, 2), steps=4, sync_every=2, inner="sgd", outer="plain")
    for got, want, sparse in zip(diloco, synchronous, every_other):
        assert max_diff(got["params"], want["params"]) <= 1e-6
        # bytes across replicas: synchronous training's, but for the headers (40 bytes a sync here,
        # 8 a unit there), and 1/H of it syncing every H steps
        one_sync = fullshard.diloco.HEADER + 4 * want["local_values"]
        assert got["bytes_sent"] == 4 * one_sync and abs(got["bytes_sent"] - want["cross_bytes"]) <= 4 * 32
        assert got["stats_cross"] == got["bytes_sent"]  # fullshard.stats counts DiLoCo's syncs across replicas
        assert sparse["bytes_sent"] == 2 * one_sync


def clone_state(value):
    """A copy of nested dicts and lists of tensors (DTensors stay DTensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_state(v) for v in value]
    return value


def schedule(diloco: fullshard.DiLoCo, step: int) -> None:
    """A learning-rate schedule, as a scheduler sets it: it must reach the inner optimizer after a load too."""
    for group in diloco.param_groups:
        group["lr"] = INNER_LR * (1 + step / 8)


def resume_job(tmp: str) -> dict:
    """8 inner steps straight, and 4, then the state dicts of the model and DiLoCo (a sync in
    flight, with overlap), or each replica group's checkpoint, loaded into a model and DiLoCo
    built afresh, and 4 more: the final parameters; and the error of a save of both groups to
    one path."""
    mesh = named_mesh((2, 2), ("replicate", "shard"))
    replica, shard = mesh.get_local_rank(0), mesh.get_local_rank(1)

    def build():
        model = sharded(mesh["shard"])
        diloco = fullshard.DiLoCo(model, inner_optimizer(model, "adamw"), mesh["replicate"], sync_every=3,
                                  fragments=2, overlap=True)
        return model, diloco

    def train(model, diloco, steps):
        for step in steps:
            schedule(diloco, step)
            inner_step(model, replica, step, shard, 2)
            diloco.step()
            diloco.zero_grad()

    model, diloco = build()
    train(model, diloco, range(1, 9))
    diloco.finish()
    straight = full_state(model)
    model, diloco = build()
    train(model, diloco, range(1, 5))  # step 4 started fragment 0's sync (phase 1)
    try:
        fullshard.save(f"{tmp}/one", model, diloco)
        refused = ""
    except fullshard.FullShardError as e:
        refused = str(e)
    saved_model, saved_diloco = clone_state(model.state_dict()), clone_state(diloco.state_dict())
    assert any("outer_pending" in values for values in saved_diloco["state"].values())
    fullshard.save(f"{tmp}/replica_{replica}", model, diloco, step=4)
    resumed = {}
    for way in ("state dicts", "checkpoint"):
        model, diloco = build()
        if way == "checkpoint":
            assert fullshard.load(f"{tmp}/replica_{replica}", model, diloco)["step"] == 4
        else:
            model.load_state_dict(saved_model)
            diloco.load_state_dict(saved_diloco)
        train(model, diloco, range(5, 9))
        diloco.finish()
        resumed[way] = full_state(model)
    return {"straight": straight, "resumed": resumed, "refused": refused}


def test_a_resumed_diloco_trains_on_bit_for_bit(world4, tmp_path):
    """Its state dict holds the anchors, the outer momentum, the average of a sync in flight and
    the step: a resume between syncs, an exchange in flight, from the state dicts or from each
    replica group's own checkpoint (Note [replica checkpoints]), under a learning-rate schedule
    (set on DiLoCo's param_groups, which must stay the inner optimizer's after a load), is
    bitwise the uninterrupted run; two groups saving to one path are refused by name."""
    for got in world4.run(resume_job, tmp=str(tmp_path)):
        for way, resumed in got["resumed"].items():
            assert all(torch.equal(got["straight"][k], resumed[k]) for k in got["straight"]), way
        assert "replica groups save to one path" in got["refused"], got["refused"]


def reshard_job(tmp: str) -> dict:
    """resume_job's checkpoints of 2 replica groups of 2 shards (step 4, a sync in flight), each
    loaded into a group of 1 shard, then inner steps 5 to 8: the final parameters."""
    mesh = named_mesh((2, 1), ("replicate", "shard"))
    replica = mesh.get_local_rank(0)
    model = sharded(mesh["shard"])
    diloco = fullshard.DiLoCo(model, inner_optimizer(model, "adamw"), mesh["replicate"], sync_every=3,
                              fragments=2, overlap=True)
    step = fullshard.load(f"{tmp}/replica_{replica}", model, diloco)["step"]
    for step in range(step + 1, 9):
        schedule(diloco, step)
        inner_step(model, replica, step, 0, 1)
        diloco.step()
        diloco.zero_grad()
    diloco.finish()
    return full_state(model)


def test_a_diloco_checkpoint_loads_at_another_shard_group_size(world4, world2, tmp_path):
    """Each replica group's checkpoint of 2 shards, saved with a sync in flight, loaded by groups
    of 1 shard: the anchors, the outer momentum and the average in flight are resharded with the
    parameters, and the run goes on as the uninterrupted 2-shard run, within AdamW's parity
    tolerance (one shard sums its gradients in another order than two)."""
    saved = world4.run(resume_job, tmp=str(tmp_path))  # ranks 0, 1: replica 0; 2, 3: replica 1
    for replica, got in enumerate(world2.run(reshard_job, tmp=str(tmp_path))):
        assert max_diff(got, saved[2 * replica]["straight"]) <= ADAMW_TOL


def bad_job(case: str) -> str:
    """DiLoCo given `case`'s bad input on every rank (or on replica 1's ranks): the error."""
    mesh = named_mesh((2, 2), ("replicate", "shard"))
    replica, shard = mesh.get_local_rank(0), mesh.get_local_rank(1)
    model = sharded(mesh["shard"])
    if case == "other model" and replica == 1:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)],
                              nn.Linear(WIDTH, OUT + 1))
        for block in model[:3]:
            fullshard.fully_shard(block, mesh=mesh["shard"])
        fullshard.fully_shard(model, mesh=mesh["shard"])
    if case == "other values" and replica == 1:
        with torch.no_grad():
            model[3].weight.to_local().add_(1.0)
    inner = inner_optimizer(model, "sgd")
    args = {"sync_every": 2, "replicas": mesh["replicate"]}
    args.update({
        "sync_every 0": {"sync_every": 0},
        "float16": {"outer_dtype": torch.float16},
        "overlapping fragments": {"fragments": [[model[0]], [model[0], model[1], model[2], model]]},
        "fragments leaving units out": {"fragments": [[model[0]]]},
        "a fragment of no unit": {"fragments": [[nn.Linear(2, 2)]]},
        "5 fragments": {"fragments": 5},
        "3 fragments in 2 steps": {"fragments": 3},
        "the shard group as replicas": {"replicas": mesh["shard"]},
        "other settings": {"sync_every": 2 + replica},
    }.get(case, {}))
    try:
        diloco = fullshard.DiLoCo(model, inner, args.pop("replicas"), **args)
        if case == "a hostile step":  # a state dict whose step is not a count
            state = diloco.state_dict()
            for values in state["state"].values():
                values["diloco_step"] = torch.tensor(float("nan"))
            diloco.load_state_dict(state)
        if case == "a step ahead" and replica == 1:  # as if resumed from a state of another step
            state = diloco.state_dict()
            for values in state["state"].values():
                values["diloco_step"] = torch.tensor(2.0)
            diloco.load_state_dict(state)
        for step in range(1, 4):
            inner_step(model, replica, step, shard, 2)
            diloco.step()
            diloco.zero_grad()
    except fullshard.FullShardError as e:
        return str(e)
    return "no error"


BAD = {
    "sync_every 0": "DiLoCo(sync_every=0) must be an int of at least 1",
    "float16": "DiLoCo(outer_dtype=torch.float16) is not offered",
    "overlapping fragments": "is in fragments 0 and 1",
    "fragments leaving units out": "DiLoCo's fragments leave out units",
    "a fragment of no unit": "fragment 0 holds a Linear that is not one of the model's units",
    "5 fragments": "DiLoCo(fragments=5) must be from 1 to the 4 units with trainable parameters",
    "3 fragments in 2 steps": "3 fragments take turns within sync_every=2 steps",
    "the shard group as replicas": "DiLoCo's replica group holds ranks",
    "other model": "DiLoCo's replicas hold other parameters, fragments or settings",
    "other values": "DiLoCo's replicas start from different parameter values",
    "other settings": "DiLoCo's replicas hold other parameters, fragments or settings",
    "a step ahead": "sent fragment 0 after its inner step",
    "a hostile step": "DiLoCo's saved diloco_step is tensor(nan), not a count of inner steps",
}


def test_bad_input_is_a_named_error_on_every_rank(world4):
    """Settings, fragments and replica groups that cannot work, replicas of another model, other
    values, other settings (a per-rank choice) or out of step: a FullShardError naming it on every
    rank, before any outer step."""
    for case, words in BAD.items():
        for rank, message in enumerate(world4.run(bad_job, case=case)):
            assert words in message, (case, rank, message)


def nonfinite_job(dtype: str) -> dict:
    """A NaN in one shard of replica 1 before a sync, the inner step a no-op (no gradients): the
    error on every rank, and whether each rank's parameters are bitwise as before that step."""
    mesh = named_mesh((2, 2), ("replicate", "shard"))
    replica, shard = mesh.get_local_rank(0), mesh.get_local_rank(1)
    model = sharded(mesh["shard"])
    inner = inner_optimizer(model, "sgd")
    diloco = fullshard.DiLoCo(model, inner, mesh["replicate"], sync_every=2, outer_dtype=DTYPES[dtype])
    inner_step(model, replica, 1, shard, 2)
    diloco.step()
    diloco.zero_grad()
    if replica == 1 and shard == 0:
        with torch.no_grad():
            model[1][0].weight.to_local().view(-1)[3] = float("nan")
    before = [p.to_local().detach().clone() for p in model.parameters()]
    try:  # no gradients: the inner step changes nothing, the sync is due
        diloco.step()
        message = "no error"
    except fullshard.FullShardError as e:
        message = str(e)
    after = [p.to_local().detach() for p in model.parameters()]
    return {"message": message, "unchanged": all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                                                for a, b in zip(before, after))}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_a_non_finite_outer_gradient_is_a_named_error_and_changes_nothing(world4, dtype):
    """In every wire format (int8 blocks flag the NaN's block, Note [block codes]): every rank,
    the replica-1 ranks whose shard is finite too, raises naming replica 1, before any outer step."""
    for got in world4.run(nonfinite_job, dtype=dtype):
        assert "the outer gradient of replica 1 is not finite" in got["message"], got["message"]
        assert got["unchanged"]


def test_train_with_sync_every_trains_replica_groups_that_sync_and_resumes(tmp_path):
    """`fullshard train --replicas 2 --sync-every 4 --outer-dtype int8`: 12 steps, the bytes to the
    other replica group in the rows of steps 4, 8 and 12 only, each a sync of every trainable value
    in int8 blocks (about a quarter of float32's 4 bytes a value), a checkpoint per replica group;
    the same command with --steps 16 resumes both groups at step 12."""
    import json
    import os
    import subprocess
    import sys

    from tests.world import child_pythonpath
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}

    def train(steps: int) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "fullshard.cli", "train", "--preset", "tiny", "--steps",
                               str(steps), "--nproc", "2", "--replicas", "2", "--sync-every", "4", "--outer-dtype",
                               "int8", "--seq-len", "32", "--global-batch", "8", "--eval-interval", "4",
                               "--eval-batches", "1", "--sample-bytes", "0", "--timeout", "60", "--out", str(tmp_path)],
                              env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    done = train(12)
    assert "DiLoCo: 2 replica groups of 1 rank(s), syncing every 4 steps" in done.stdout
    assert all((tmp_path / "checkpoint" / f"replica_{r}" / "LATEST").is_file() for r in (0, 1))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    synced = {row["step"]: row["replica_bytes"] for row in rows if row.get("replica_bytes")}
    assert sorted(synced) == [4, 8, 12] and len(set(synced.values())) == 1, synced
    parameters = 118_016  # the tiny GPT's, at --seq-len 32
    assert parameters < synced[4] < 0.27 * 4 * parameters, synced
    assert all(row["sent_bytes"] == row["replica_bytes"] for row in rows if "loss" in row)  # groups of 1 rank
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    done = train(16)
    assert "at step 12" in done.stdout, done.stdout[-2000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(0, 17)), steps


@pytest.mark.parametrize("args, words", [
    (["--sync-every", "4"], "--sync-every 4 syncs replica groups: add --replicas 2 or more"),
    (["--replicas", "2", "--sync-every", "-1"], "--sync-every must not be negative, got -1"),
    (["--outer-lr", "0.5"], "--outer-lr is DiLoCo's; add --sync-every H"),
    (["--replicas", "2", "--sync-every", "4", "--outer-dtype", "fp16"], "unknown --outer-dtype 'fp16'"),
    (["--replicas", "2", "--sync-every", "4", "--outer-momentum", "1"], "--outer-momentum must be at least 0 and below 1"),
    (["--replicas", "2", "--sync-every", "2", "--fragments", "3", "--preset", "tiny"],
     "--fragments 3 take turns within --sync-every 2 steps"),
    (["--replicas", "2", "--sync-every", "8", "--fragments", "4", "--preset", "tiny"],
     "--fragments 4: the model has 3 units"),
    (["--replicas", "2", "--sync-every", "4", "--strategy", "hybrid_shard"],
     "--sync-every does not take --strategy hybrid_shard"),
])
def test_train_refuses_diloco_it_cannot_run_in_one_line(args, words, capsys, tmp_path):
    from fullshard import cli
    assert cli.main(["train", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
