"""Reliability: killed ranks, hangs turned into named errors, silent-wrong-result guards, bad input."""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fullshard
from fullshard import cli
from fullshard.cli import trainer
from fullshard.gpt import Block
from fullshard.cli.run_log import read_rows
from tests.models import gpt_loss, tiny_gpt, token_batch
from tests.reference import full_state, global_batches, local_slice, make_optimizer, max_diff, train
from tests.runs import (RUN_TIMEOUT_S, STRAIGHT, finish, fullshard as fullshard_cli, metrics, wait_for_checkpoint,
                        wait_for_step)
from tests.test_errors import raises
from tests.world import World


# ---- killed ranks -------------------------------------------------------------------------


def ranks_of(pid: int) -> list[int]:
    """The rank processes under a `fullshard train` launcher."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"fullshard.cli" in cmdline.read_bytes() and int(cmdline.parent.name) != pid:
                stat = Path(cmdline.parent, "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid:
                    found.append(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return found


def rendezvous_of(rank: int) -> Path:
    """The directory of the FileStore a rank of `fullshard train` meets its peers in."""
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{rank}/environ").read_text().split("\0") if "=" in item)
    return Path(environ["FULLSHARD_STORE_FILE"]).parent


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_a_killed_run_and_killed_ranks_resume_like_an_uninterrupted_run(straight_run, tmp_path, monkeypatch, capsys):
    """Kill a run's launcher: its ranks die with it, and the same command again resumes. While
    that run lives, a third in the same directory is refused. Kill one of its ranks: the
    launcher restarts them all, and they resume. The curve is the uninterrupted run's, bit
    for bit."""
    command = ["train", *STRAIGHT, "--max-restarts", "1", "--out", str(tmp_path)]
    rng = random.Random(1)
    first = fullshard_cli(*command)
    wait_for_checkpoint(first, tmp_path, 5)
    orphans = ranks_of(first.pid)
    assert first.poll() is None and orphans, "the run ended before it could be killed"
    rendezvous = rendezvous_of(orphans[0])
    os.kill(first.pid, signal.SIGKILL)  # the launcher alone (Note [orphans] in fullshard/cli/launcher.py)
    killed = time.monotonic()
    deadline = time.monotonic() + 2  # the kernel kills them at once; an orphan would train on for seconds
    while any(alive(pid) for pid in orphans) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(alive(pid) for pid in orphans), "ranks outlived their launcher"
    while rendezvous.exists() and time.monotonic() < deadline + 3:  # Note [rendezvous directory]
        time.sleep(0.01)
    assert not rendezvous.exists(), f"the killed launcher's {rendezvous} outlived it"
    with capsys.disabled():  # docs/reliability.md
        print(f"the killed launcher's rendezvous directory was gone {time.monotonic() - killed:.3f} s after the kill")
    first.communicate(timeout=RUN_TIMEOUT_S)
    stale = rendezvous.parent / "999999999-1234-abcd"  # a launcher and remover killed together left it
    stale.mkdir()
    again = fullshard_cli(*command)
    wait_for_step(again, tmp_path, 16)  # 14 steps before the end
    wait_for_checkpoint(again, tmp_path, 15)
    # the same command while this run lives: refused in this process before it starts ranks
    monkeypatch.setattr(cli, "launch", lambda *a: pytest.fail("a second run started in a directory in use"))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # the 2 ranks fit, as on the 2-core machine
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is in use by another run (pid {again.pid} on " in err, err
    time.sleep(rng.uniform(0.0, 0.3))  # a random moment: maybe while a checkpoint writes in the background
    ranks = ranks_of(again.pid)
    assert again.poll() is None and ranks, "the run ended before a rank could be killed"
    assert not stale.exists(), "a new run left a gone launcher's rendezvous directory"
    os.kill(rng.choice(ranks), signal.SIGKILL)
    out = finish(again)  # with its one restart: a second failure would have ended it with an error
    # each time from the newest complete checkpoint: step 5 or later, then step 15 or later
    resumed = [int(step) for step in re.findall(r"resumed from .* at step (\d+)", out)]
    assert len(resumed) == 2 and resumed[0] in range(5, 20, 5) and resumed[1] in range(15, 30, 5), out
    got, want = metrics(tmp_path), metrics(straight_run)
    assert [r["step"] for r in got] == [r["step"] for r in want]  # every step once, none lost
    assert [r.get("loss") for r in got] == [r.get("loss") for r in want]  # bit for bit, data order included
    assert [r.get("val_loss") for r in got] == [r.get("val_loss") for r in want]


def test_a_run_resumes_at_another_world_size_over_a_torn_last_line(straight_run, tmp_path):
    """Resume a 2-rank run at 1 rank, from a metrics.jsonl whose last line a kill tore: the
    torn line goes, the step is trained again, and the plot shows both world sizes."""
    shutil.copytree(straight_run, tmp_path, dirs_exist_ok=True)
    (tmp_path / "loss.png").unlink()
    with open(tmp_path / "metrics.jsonl", "a") as log:
        log.write('{"step": 31, "loss": 2.01')  # rank 0 killed mid-write
    out = finish(fullshard_cli("train", *STRAIGHT, "--steps", "31", "--out", str(tmp_path), launcher="rank"))
    assert "resumed from" in out and "at step 30" in out
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [r["step"] for r in metrics(straight_run)] + [31]
    assert len(rows[-2]["peak_mem_mb"]) == 2 and len(rows[-1]["peak_mem_mb"]) == 1
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_only_a_torn_last_line_of_metrics_is_skipped(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert read_rows(log) == [{"step": 1}, {"step": 2}]
    log.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')  # damaged inside: not a kill's doing
    assert f"{log}, line 2, is not JSON" in raises(lambda: read_rows(log))


# ---- hangs become errors that name the place --------------------------------------------


def stopped_peer_job(timeout_s: float) -> dict:
    """Rank 1 never reaches the CLI's metrics all-gather (as if stopped by SIGSTOP); rank 0 must
    fail it within the timeout, naming it."""
    if dist.get_rank() == 1:
        return {}
    start = time.monotonic()
    message = raises(lambda: trainer.exchange_metrics([1.0, 2.0], step=7, device=torch.device("cpu"),
                                                      timeout=timedelta(seconds=timeout_s)))
    return {"message": message, "seconds": time.monotonic() - start}


def test_a_stopped_rank_fails_the_clis_own_collectives_naming_them():
    world = World(2, forked=True)  # a new world: the job leaves its process group unusable
    try:
        got = world.collect(stopped_peer_job, timeout_s=1.0)[0]
    finally:
        world.kill()
    assert "rank 0: the all-gather of step 7's metrics did not finish" in got["message"]
    assert 1 <= got["seconds"] < 10


# ---- silent-wrong-result guards ---------------------------------------------------------


def nonfinite_job(policy: str, on_block: bool = False) -> dict:
    torch.manual_seed(0)
    model = fullshard.shard_model(tiny_gpt(), wrap={Block})
    (model.h[0] if on_block else model).set_nonfinite_grads(policy)  # before the first forward
    opt = make_optimizer("adamw", model)
    batches = global_batches(token_batch, 2, 8)
    rank, world = dist.get_rank(), dist.get_world_size()
    train(model, opt, batches[:1], gpt_loss, world=world)
    before = full_state(model)
    loss = model(*local_slice(batches[1], rank, world))
    if rank == 1:
        loss = loss * float("nan")
    message = raises(loss.backward)
    opt.step()
    opt.zero_grad()
    return {"message": message, "changed": max_diff(full_state(model), before),
            "skipped": fullshard.stats(model).skipped_steps}


def test_nonfinite_gradients_raise_or_skip_on_every_rank(world2):
    for got in world2.run(nonfinite_job, policy="raise"):
        assert "is not finite" in got["message"] and "at step 2" in got["message"]
    for got in world2.run(nonfinite_job, policy="skip"):
        assert got["message"] == "" and got["changed"] == 0.0 and got["skipped"] == 1
    for got in world2.run(nonfinite_job, policy="raise", on_block=True):  # one unit's policy: it alone is checked
        assert "unit 'h.0'" in got["message"] and "at step 2" in got["message"]
    for got in world2.run(nonfinite_job, policy="skip", on_block=True):
        assert got["message"] == "" and got["changed"] == 0.0 and got["skipped"] == 1


def disagree_job() -> str:
    torch.manual_seed(0)
    model = tiny_gpt()
    if dist.get_rank() == 1:
        model.h[0].ln_1.weight.requires_grad_(False)
    return raises(lambda: fullshard.shard_model(model, wrap={Block}))


def test_ranks_that_would_shard_different_parameters_are_refused(world2):
    for message in world2.run(disagree_job):
        assert "ranks would shard different parameters" in message and "ln_1.weight" in message


def load_reaches_compute_job(path: str) -> list[float]:
    """After load, the next forward computes with the loaded values, even in units that were
    kept full (the root and last block after a forward without backward; units with
    reshard_after_backward off)."""
    batches = global_batches(token_batch, 3, 8)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    saved = fullshard.shard_model(tiny_gpt(), wrap={Block})
    train(saved, make_optimizer("adamw", saved), batches[:2], gpt_loss, world=world)
    fullshard.save(path, saved)
    x = local_slice(batches[2], rank, world)
    with torch.no_grad():
        want = saved(x[0])
    diffs = []
    for keep in ("forward without backward", "reshard_after_backward off"):
        torch.manual_seed(5)
        model = fullshard.shard_model(tiny_gpt(), wrap={Block})
        if keep == "forward without backward":
            model(*x)
            model(*x)  # the second forward keeps the last block full too
        else:
            model.set_reshard_after_backward(False)
            model(*x).backward()
        fullshard.load(path, model)
        with torch.no_grad():
            diffs.append((model(x[0]) - want).abs().max().item())
    return diffs


def test_a_loaded_checkpoint_reaches_the_compute_copy(world2, tmp_path):
    for diffs in world2.run(load_reaches_compute_job, path=str(tmp_path / "ckpt")):
        assert diffs == [0.0, 0.0]


class Payload:
    """Pickles as a call to os.system: what a malicious checkpoint would hide in its metadata."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def corrupt_job(root: str) -> dict:
    torch.manual_seed(0)
    model = fullshard.shard_model(tiny_gpt(), wrap={Block})
    good, bad, evil = Path(root, "good"), Path(root, "bad"), Path(root, "evil")
    fullshard.save(good, model)
    fullshard.save(bad, model)
    dist.barrier()
    if dist.get_rank() == 0:
        shard = next(fullshard.checkpoint_dir(bad).glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
        shutil.copytree(fullshard.checkpoint_dir(good), evil)
        (evil / ".metadata").write_bytes(pickle.dumps(Payload(str(Path(root, "pwned")))))
    dist.barrier()
    return {"truncated": raises(lambda: fullshard.load(bad, model)),
            "evil": raises(lambda: fullshard.load(evil, model)),
            "ran code": Path(root, "pwned").exists(),
            "good still loads": raises(lambda: fullshard.load(good, model)) == ""}


def test_corrupted_and_malicious_checkpoints_are_refused(world2, tmp_path):
    for got in world2.run(corrupt_job, root=str(tmp_path)):
        assert "is damaged" in got["truncated"] and "nothing was loaded" in got["truncated"]
        assert "could not be read" in got["evil"] and "found a call of posix.system" in got["evil"], got["evil"]
        assert not got["ran code"] and got["good still loads"]


# ---- bad input ------------------------------------------------------------------------------


def bad_input_job() -> dict:
    torch.manual_seed(0)
    model = fullshard.shard_model(tiny_gpt(), wrap={Block})
    before = full_state(model)
    calls = {
        "clip max_norm": lambda: fullshard.clip_grad_norm_(model, -1.0),
        "clip norm_type": lambda: fullshard.clip_grad_norm_(model, 1.0, norm_type="two"),
        "full_params flag": lambda: fullshard.full_params(model, writeback="yes").__enter__(),
        "state dict flag": lambda: fullshard.get_state_dict(model, full="yes"),
        "state dict optimizer": lambda: fullshard.get_state_dict(model, optimizer="adam"),
        "sharded rank0_only": lambda: fullshard.get_state_dict(model, full=False, rank0_only=True),
        "set_state_dict": lambda: fullshard.set_state_dict(model, model_sd=[1, 2]),
        "set_state_dict full=True of shards": lambda: fullshard.set_state_dict(
            model, model_sd=fullshard.get_state_dict(model, full=False)[0]),
        "set_state_dict full=False of full values": lambda: fullshard.set_state_dict(
            model, model_sd=fullshard.get_state_dict(model)[0], full=False),
        "set_state_dict full flag": lambda: fullshard.set_state_dict(model, model_sd={}, full="yes"),
        "init_weights_from": lambda: fullshard.init_weights_from(model, "weights.pt"),
        "save path": lambda: fullshard.save(None, model),
        "save step": lambda: fullshard.save("x", model, step="ten"),
        "load path": lambda: fullshard.load(3, model),
        "export path": lambda: fullshard.export(model, None),
        "timeout": lambda: model.set_timeout(0),
        "nonfinite": lambda: model.set_nonfinite_grads("ignore"),
        "prefetch list": lambda: model.h[0].set_modules_to_forward_prefetch([torch.nn.Linear(1, 1)]),
    }
    out = {name: raises(call) for name, call in calls.items()}
    out["unchanged"] = max_diff(full_state(model), before) == 0.0
    return out


def test_bad_input_to_every_public_function_is_refused_before_anything_changes(world2):
    for got in world2.run(bad_input_job):
        assert got.pop("unchanged")
        for name, message in got.items():
            assert message, f"{name}: no FullShardError"
        assert "pass full=False" in got["set_state_dict full=True of shards"], got
        assert "pass full=True" in got["set_state_dict full=False of full values"], got
