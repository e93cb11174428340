"""`fullshard train` end to end: tiny runs at 1 and 2 ranks, outputs, errors. Resuming after
a kill is in test_reliability.py, which shares the 2-rank run (tests/runs.py)."""

from __future__ import annotations

import os

import pytest
import torch

from fullshard import cli
from tests.runs import STRAIGHT, finish, fullshard, metrics


def test_one_and_two_ranks_give_the_same_first_step_and_the_loss_falls(straight_run, tmp_path):
    finish(fullshard("train", *STRAIGHT, "--steps", "1", "--out", str(tmp_path), launcher="rank"))
    one, two = metrics(tmp_path), metrics(straight_run)
    first = lambda rows: next(r for r in rows if "loss" in r)
    # the same global batch and initial weights; only the order of the batch sums differs
    assert first(one)["loss"] == pytest.approx(first(two)["loss"], abs=1e-5)
    assert first(one)["grad_norm"] == pytest.approx(first(two)["grad_norm"], rel=1e-4)
    vals = [r["val_loss"] for r in two if "val_loss" in r]
    assert len(vals) == 4 and vals[-1] < vals[0] - 0.5  # validation loss falls visibly in 30 steps


def test_outputs_are_well_formed(straight_run):
    rows = metrics(straight_run)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for r in steps:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mb", "sent_bytes"} <= set(r)
        assert len(r["peak_mem_mb"]) == 2 and r["sent_bytes"] > 0
    png = (straight_run / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (straight_run / "checkpoint" / "LATEST").is_file()


def exit_status(args: list[str]) -> int:
    """`cli.main(args)` as the process's exit status: argparse's errors exit, ours return."""
    try:
        return cli.main(args)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("args, says", [
    (["train", "--strategy", "zero3"], "unknown --strategy 'zero3'"),
    (["train", "--steps", "-5"], "--steps must be at least 1"),
    (["train", "--data", "/no/such/path"], "no such file or directory"),
    (["train", "--nproc", "64"], "pass --oversubscribe"),
    (["train", "--steps", "many"], "invalid int value"),
    (["train", "--global-batch", "3"], "must divide into 2 ranks"),
    (["launch"], "invalid choice"),
])
def test_bad_arguments_exit_with_one_line(monkeypatch, capsys, args, says):
    # in this process: arguments that passed every check would fail here, not start a run
    for var in cli.TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cli, "launch", lambda *a: pytest.fail(f"{args} started ranks"))
    monkeypatch.setattr(cli, "train", lambda *a: pytest.fail(f"{args} started training"))
    # as on a machine with 2 CPU cores and no GPU (2 ranks by default), whatever this one has
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert exit_status(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and says in err


def test_version(capsys):
    assert exit_status(["--version"]) == 0
    assert capsys.readouterr().out.startswith("fullshard ")


def test_the_command_exits_with_mains_status_and_no_traceback():
    """The real `python -m fullshard.cli`: what the tests above call in-process, as a process."""
    run = fullshard("train", "--strategy", "zero3")
    out, err = run.communicate(timeout=120)  # a torch import: seconds, even on busy cores
    assert run.returncode == 2
    assert out == "" and err.count("\n") == 1 and "unknown --strategy 'zero3'" in err and "Traceback" not in err
