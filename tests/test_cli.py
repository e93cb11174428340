"""`fullshard train` end to end: tiny runs at 1 and 2 ranks, resume after a kill, outputs, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY = ["--preset", "tiny", "--seq-len", "32", "--global-batch", "8", "--eval-interval", "10", "--eval-batches", "2",
        "--sample-bytes", "20"]


def fullshard(*args: str, launcher: str = "self", **kwargs) -> subprocess.Popen:
    """`fullshard ...` (starting its own ranks), or one rank of `torchrun --nproc_per_node 2`."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fullshard.cli", *args]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "fullshard.cli", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)


def finish(run: subprocess.Popen) -> str:
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    return out


def kill_all(pid: int) -> None:
    """SIGKILL a process and every process below it (torch's launcher gives ranks their own sessions)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    family, todo = [], [pid]
    while todo:
        family.append(todo.pop())
        todo += parents.get(family[-1], [])
    for member in family:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two")
    finish(fullshard("train", *TINY, "--steps", "30", "--ckpt-interval", "10", "--out", str(out), launcher="torchrun"))
    return out


def test_one_and_two_ranks_give_the_same_first_step_and_the_loss_falls(two_rank_run, tmp_path):
    finish(fullshard("train", *TINY, "--steps", "1", "--nproc", "1", "--out", str(tmp_path)))
    one, two = metrics(tmp_path), metrics(two_rank_run)
    first = lambda rows: next(r for r in rows if "loss" in r)
    # the same global batch and initial weights; only the order of the batch sums differs
    assert first(one)["loss"] == pytest.approx(first(two)["loss"], abs=1e-5)
    assert first(one)["grad_norm"] == pytest.approx(first(two)["grad_norm"], rel=1e-4)
    vals = [r["val_loss"] for r in two if "val_loss" in r]
    assert len(vals) == 4 and vals[-1] < vals[0] - 0.5  # validation loss falls visibly in 30 steps


def test_outputs_are_well_formed(two_rank_run):
    rows = metrics(two_rank_run)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for r in steps:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mb", "sent_bytes"} <= set(r)
        assert len(r["peak_mem_mb"]) == 2 and r["sent_bytes"] > 0
    png = (two_rank_run / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (two_rank_run / "checkpoint" / "LATEST").is_file()


def test_a_killed_run_resumes_on_the_same_curve(two_rank_run, tmp_path):
    run = fullshard("train", *TINY, "--steps", "30", "--ckpt-interval", "10", "--out", str(tmp_path),
                    launcher="torchrun")
    log = tmp_path / "metrics.jsonl"
    while run.poll() is None and not (log.is_file() and any(json.loads(line).get("step", 0) >= 13
                                                              for line in log.read_text().splitlines())):
        time.sleep(0.02)
    assert run.poll() is None, "the run ended before it could be killed"
    kill_all(run.pid)  # after the checkpoint of step 10, before step 20's
    run.wait()
    out = finish(fullshard("train", *TINY, "--steps", "30", "--ckpt-interval", "10", "--out", str(tmp_path),
                           launcher="torchrun"))
    assert "at step 10" in out
    resumed, straight = metrics(tmp_path), metrics(two_rank_run)
    assert [r["step"] for r in resumed] == [r["step"] for r in straight]  # no step twice, none missing
    for a, b in zip(resumed, straight):
        assert a.get("loss") == b.get("loss") and a.get("val_loss") == b.get("val_loss")  # bit for bit


@pytest.mark.parametrize("args, says", [
    (["train", "--strategy", "zero3"], "unknown --strategy 'zero3'"),
    (["train", "--steps", "-5"], "--steps must be at least 1"),
    (["train", "--data", "/no/such/path"], "no such file or directory"),
    (["train", "--nproc", "64"], "pass --oversubscribe"),
    (["train", "--steps", "many"], "invalid int value"),
    (["train", "--global-batch", "3"], "must divide into 2 ranks"),
    (["launch"], "invalid choice"),
])
def test_bad_arguments_exit_with_one_line(args, says):
    run = fullshard(*args)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 2
    assert err.count("\n") == 1 and says in err and "Traceback" not in err


def test_version():
    run = fullshard("--version")
    assert finish(run).startswith("fullshard ")
