"""`fullshard train` started as a user starts it, for test_cli.py and test_reliability.py.

Every run of these tests uses the arguments in STRAIGHT (plus where to write and how to
launch), so each can be compared step by step with the one uninterrupted run of the
`straight_run` fixture (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from tests.world import free_port, rank_env

TINY = ["--preset", "tiny", "--seq-len", "32", "--global-batch", "8", "--eval-interval", "10", "--eval-batches", "2",
        "--sample-bytes", "20"]
# 30 steps: the validation loss falls visibly; a checkpoint every 5 steps leaves room
# for kills after a checkpoint and well before the end
STRAIGHT = [*TINY, "--steps", "30", "--ckpt-interval", "5"]
# a run takes seconds on 2 quiet cores and under a minute on busy ones; one still
# running after this is hung
RUN_TIMEOUT_S = 300


def fullshard(*args: str, launcher: str = "self") -> subprocess.Popen:
    """`fullshard ...` starting its own ranks ("self"), under `torchrun --nproc_per_node 2`
    ("torchrun"), or as the single rank of a 1-rank job given torchrun's environment
    ("rank": no launcher process)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fullshard.cli", *args]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "fullshard.cli", *args]
    elif launcher == "rank":
        env.update(rank_env(0, 1, free_port()))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(run: subprocess.Popen) -> str:
    """The run's output, once it has ended well."""
    try:
        out, err = run.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_all(run.pid)
        raise
    assert run.returncode == 0, err[-3000:]
    return out


def kill_all(pid: int) -> None:
    """SIGKILL a process and every process below it (a launcher gives its ranks sessions of their own)."""
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


def wait_for_step(run: subprocess.Popen, out: Path, step: int) -> None:
    """Return once the run has logged `step`, or has ended."""
    wait_until(run, lambda: logged_step(out / "metrics.jsonl") >= step, f"step {step} logged")


def wait_until(run: subprocess.Popen, reached: Callable[[], bool], what: str) -> None:
    """Poll until `reached()` or the run has ended; a run past RUN_TIMEOUT_S is killed."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while run.poll() is None and not reached():
        if time.monotonic() > deadline:
            kill_all(run.pid)
            raise AssertionError(f"no {what} in {RUN_TIMEOUT_S} s")
        time.sleep(0.02)


def logged_step(log: Path) -> int:
    """The last step in metrics.jsonl so far (rank 0 may be writing it: a partial line is skipped)."""
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line).get("step", 0))
        except json.JSONDecodeError:
            continue
    return max(steps)


def wait_for_checkpoint(run: subprocess.Popen, out: Path, step: int) -> None:
    """Return once out/checkpoint's LATEST names a checkpoint of `step` or later (saves are
    written in the background, so a logged step does not mean its checkpoint is complete), or
    the run has ended."""
    wait_until(run, lambda: checkpointed_step(out / "checkpoint") >= step, f"checkpoint of step {step}")


def checkpointed_step(ckpt: Path) -> int:
    """The step of the checkpoint LATEST names (-1: none yet)."""
    try:
        version = (ckpt / "LATEST").read_text().strip()
        return json.loads((ckpt / version / "fullshard.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1
