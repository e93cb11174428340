"""`fullshard train` end to end: tiny runs at 1 and 2 ranks, outputs, errors, and the launcher
of local runs. Resuming after a kill is in test_reliability.py, which shares the 2-rank run
(tests/runs.py)."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from fullshard import cli
from fullshard.cli import launcher, trainer
from fullshard.errors import FullShardError
from fullshard.cli.config import TrainConfig
from tests.runs import STRAIGHT, finish, fullshard, metrics


def test_one_and_two_ranks_give_the_same_first_step_and_the_loss_falls(straight_run, tmp_path):
    finish(fullshard("train", *STRAIGHT, "--steps", "1", "--out", str(tmp_path), "--no-background-saves",
                     launcher="rank"))
    one, two = metrics(tmp_path), metrics(straight_run)
    first = lambda rows: next(r for r in rows if "loss" in r)
    # the same global batch and initial weights; only the order of the batch sums differs
    assert first(one)["loss"] == pytest.approx(first(two)["loss"], abs=1e-5)
    assert first(one)["grad_norm"] == pytest.approx(first(two)["grad_norm"], rel=1e-4)
    assert (tmp_path / "checkpoint" / "LATEST").is_file()  # its one save blocked; the straight run's did not
    vals = [r["val_loss"] for r in two if "val_loss" in r]
    assert len(vals) == 4 and vals[-1] < vals[0] - 0.5  # validation loss falls visibly in 30 steps


PIPELINED = [*STRAIGHT[:STRAIGHT.index("--steps")], "--pp", "2", "--oversubscribe", "--grad-accum", "2"]


def test_a_pipeline_of_two_stages_trains_and_resumes(tmp_path, capsys):
    """`fullshard train --pp 2 --nproc 4`: 2 stages of 2 data-parallel ranks through 1F1B, the
    same metrics and plot as any run; run again with more steps on 2 ranks (2 stages of 1), it
    resumes from its checkpoint. And `fullshard plan --pp 2` prices the stages and the bubble."""
    first = finish(fullshard("train", *PIPELINED, "--nproc", "4", "--steps", "4", "--ckpt-interval", "2",
                             "--eval-interval", "2", "--out", str(tmp_path)))
    assert "stage 1 of 2 (1F1B)" in first and "validation loss" in first
    again = finish(fullshard("train", *PIPELINED, "--nproc", "2", "--steps", "6", "--ckpt-interval", "2",
                             "--eval-interval", "2", "--out", str(tmp_path)))
    assert "at step 4" in again and "stage 1 of 2 (1F1B)" in again
    rows = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))  # every step once
    assert rows[-1]["loss"] < rows[0]["loss"]
    for row in rows:  # every rank's memory; fullshard's bytes and the activations between stages
        assert len(row["peak_mem_mb"]) == (4 if row["step"] <= 4 else 2), row
        assert row["sent_bytes"] > 0 and row["grad_norm"] > 0
    vals = [r["val_loss"] for r in metrics(tmp_path) if "val_loss" in r]
    assert len(vals) == 4 and vals[-1] < vals[0]  # before step 1, and at steps 2, 4 (resumed), 6
    assert (tmp_path / "loss.png").stat().st_size > 0
    # priced for an A100, which needs no probe of this machine (test_planner.py runs the CPU's)
    assert cli.main(["plan", "--preset", "tiny", "--pp", "2", "--world-size", "4", "--microbatches", "4",
                     "--hardware", "a100", "--memory-budget", "80GB"]) == 0
    shown = capsys.readouterr().out
    assert "| 1 | 1 | " in shown and "| 2 | 1 | " in shown and "the bubble is 20% of it" in shown


def test_outputs_are_well_formed(straight_run):
    rows = metrics(straight_run)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for r in steps:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mb", "sent_bytes", "step_s"} <= set(r)
        assert len(r["peak_mem_mb"]) == 2 and r["sent_bytes"] > 0 and r["step_s"] > 0
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
    (["train", "--global-batch", "3"], "must divide into 2 data-parallel ranks"),
    (["launch"], "invalid choice"),
    (["train", "--eval-interval", "0"], "--eval-interval must be at least 1, got 0"),
    (["train", "--n-layer", "0"], "--n-layer must be at least 1, got 0"),
    (["train", "--n-layer", "-1"], "--n-layer must be at least 1, got -1"),
    (["train", "--timeout", "inf"], "--timeout must be a finite number"),
    (["train", "--preset", "tiny", "--n-head", "3"], "--n-head 3 must divide the width (--n-embd 64)"),
    (["train", "--lr", "nan"], "--lr must be a finite number"),
    (["train", "--data", "EMPTY_FILE"], "0 bytes is too little text"),
    (["train", "--data", "20_BYTE_FILE"], "20 bytes is too little text"),
    (["train", "--out", "20_BYTE_FILE"], "is a file"),
    (["train", "--out", "/proc/fullshard/run"], "cannot hold a run"),
    # values a fuzzer found passing the checks, then growing without bound or failing in every rank
    (["train", "--n-layer", "99999999999999999999"], "--n-layer must be at most 1024, got 99999999999999999999"),
    (["train", "--n-embd", "100000000"], "--n-embd must be at most 131072"),
    (["train", "--n-embd", "65536", "--n-head", "1"], "this run needs at least"),
    (["train", "--global-batch", "1000000000"], "this run needs at least"),
    (["train", "--nproc", "100000", "--oversubscribe", "--global-batch", "100000"], "this run needs at least"),
    (["train", "--seq-len", "100000000000"], "--seq-len must be at most"),
    (["train", "--steps", "100000000000000000000"], "--steps must be at most"),
    (["train", "--seed", "100000000000000000000"], "--seed must be at most 4294967295"),
    (["train", "--seed", "-1"], "--seed must not be negative"),
    (["train", "--lr", "1e308"], "--lr must be at most 10"),
    (["train", "--sample-bytes", "100000000000"], "--sample-bytes must be at most"),
    (["train", "--wrap", "0"], "--wrap must be 'block', 'none' or a parameter count from 1"),
    (["train", "--data", ""], "--data is empty"),
    (["train", "--out", " "], "--out is empty"),
    (["plan", "--n-layer", "99999999999999999999"], "--n-layer must be at most 1024"),
    (["plan", "--vocab", "0"], "--vocab must be at least 1, got 0"),
    (["plan", "--vocab", "-1"], "--vocab must be at least 1, got -1"),
    (["plan", "--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    (["plan", "--seq-len", "-1"], "--seq-len must be at least 1"),
    (["plan", "--batch", "0"], "--batch must be at least 1"),
    (["plan", "--batch", "-1"], "--batch must be at least 1"),
    (["plan", "--batch", "100000000000000000000"], "--batch must be at most"),
    (["plan", "--world-size", "100000000000000000000"], "--world-size must be at most 1048576"),
    (["plan", "--world-size", "0"], "--world-size must be at least 1"),
    (["plan", "--n-layer", "1024", "--n-embd", "131072", "--n-head", "1"], "cannot fit in 2 ranks of --memory-budget 2GiB"),
    (["plan", "--memory-budget", "lots"], "--memory-budget must be a size"),
    # checked whatever the other flags say
    (["train", "--memory-budget", "nan"], "--memory-budget must be a size"),
    (["train", "--memory-budget", "1XB"], "--memory-budget must be a size"),
    (["train", "--memory-budget", ""], "--memory-budget must be a size"),
    (["train", "--memory-budget", "2GiB"], "add --plan auto"),
    (["train", "--plan", "auto"], "--plan auto needs --memory-budget"),
    # Muon's learning rate, checked before any rank starts, and only with Muon
    (["train", "--optimizer", "muon", "--muon-lr", "-1"], "--muon-lr must be positive"),
    (["train", "--optimizer", "muon", "--muon-lr", "nan"], "--muon-lr must be a finite number, got nan"),
    (["train", "--optimizer", "muon", "--muon-lr", "inf"], "--muon-lr must be a finite number, got inf"),
    (["train", "--optimizer", "muon", "--muon-lr", "1e9"], "--muon-lr must be at most 10"),
    (["train", "--optimizer", "adamw", "--muon-lr", "-1"], "--muon-lr is Muon's learning rate, and --optimizer is adamw"),
    # a flag that would do nothing here is refused, not announced
    (["train", "--reduce", "bf16", "--nproc", "1"], "--reduce bf16 would change nothing here: one rank"),
    (["train", "--reduce", "int8", "--strategy", "no_shard"], "--reduce int8 would change nothing here: no_shard"),
    (["train", "--gather", "int8", "--nproc", "1"], "--gather int8 would change nothing here: one rank"),
    # pipeline stages: enough blocks, microbatches and ranks, and what a pipeline does not take
    (["train", "--pp", "0"], "--pp must be at least 1, got 0"),
    (["train", "--pp", "2", "--preset", "tiny", "--grad-accum", "2", "--n-layer", "1"], "--pp 2 needs a block a stage"),
    (["train", "--pp", "2"], "--pp 2 needs at least as many microbatches a step: pass --grad-accum 2"),
    (["train", "--pp", "2", "--grad-accum", "2", "--nproc", "3", "--oversubscribe"],
     "--pp 2 must divide the 3 ranks into stages"),
    (["train", "--pp", "2", "--grad-accum", "2", "--strategy", "hybrid_shard"], "--pp does not take --strategy"),
    (["train", "--pp", "2", "--grad-accum", "2", "--precision", "fp16"], "--pp does not take --precision fp16"),
    (["plan", "--pp", "2", "--world-size", "3"], "--pp 2 needs a --world-size it divides (not 3)"),
])
def test_bad_arguments_exit_with_one_line(monkeypatch, capsys, tmp_path, args, says):
    for name, text in {"EMPTY_FILE": b"", "20_BYTE_FILE": b"def f(): return 42\n\n"}.items():
        (tmp_path / name).write_bytes(text)
    args = [str(tmp_path / arg) if arg.isupper() else arg for arg in args]
    # in this process: arguments that passed every check would fail here, not start a run
    for var in (*cli.TORCHRUN_VARS, launcher.LAUNCHER_PID):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cli, "launch", lambda *a: pytest.fail(f"{args} started ranks"))
    monkeypatch.setattr(trainer, "train", lambda *a: pytest.fail(f"{args} started training"))
    # as on a machine with 2 CPU cores and no GPU (2 ranks by default), whatever this one has
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert exit_status(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and says in err


def test_more_ranks_than_gpus_are_refused_by_name(monkeypatch, capsys, tmp_path):
    for var in (*cli.TORCHRUN_VARS, launcher.LAUNCHER_PID):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cli, "cuda_gpus", lambda: 1)  # the launcher's count (a CUDA build of torch's)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the rank's
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cli, "launch", lambda *a: pytest.fail("ranks started"))
    assert exit_status(["train", "--nproc", "2", "--out", str(tmp_path)]) == 2
    assert "--nproc 2 is more than the 1 GPUs here" in capsys.readouterr().err
    # under torchrun: the rank whose local rank has no GPU says so, before set_device fails
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(FullShardError, match="local rank 1 of this machine, which has 1 GPUs"):
        trainer.join_job(TrainConfig())


def test_nccl_communicators_are_made_when_the_group_is(monkeypatch, tmp_path):
    """init_process_group gets the rank's GPU (device_id), so NCCL makes its communicators
    there and then, not inside the first training step."""
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(trainer.dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(trainer.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(trainer.dist, "get_world_size", lambda: 1)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        launcher.STORE_FILE: str(tmp_path / "store")}.items():
        monkeypatch.setenv(name, value)
    assert trainer.join_job(TrainConfig())[2] == torch.device("cuda", 0)
    assert seen["device_id"] == torch.device("cuda", 0)


class Started(Exception):
    """The checks passed: the command got as far as starting its ranks."""


FUZZ_INTS = ["-1", "0", "1", "99999999999999999999", "1e8", "nan", ""]
FUZZ_FLOATS = ["-1", "0", "nan", "inf", "-inf", "1e308", "1e-308", "x"]


@pytest.mark.parametrize("option", [f.name for f in dataclasses.fields(TrainConfig) if f.type != "bool"])
def test_every_fuzzed_value_ends_in_one_line_or_a_run_that_starts(monkeypatch, capsys, tmp_path, option):
    """Every option given hostile values: each ends in one line and status 2 before any rank
    starts, or passes every check and gets as far as starting the ranks."""
    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == option)
    values = FUZZ_FLOATS if field.type == "float" else FUZZ_INTS if field.type.startswith("int") else \
        ["", " ", "\0", "x" * 5000, "/proc/self/mem", "/proc/1/cwd", "-1", "0"]
    for var in (*cli.TORCHRUN_VARS, launcher.LAUNCHER_PID):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cli, "launch", lambda *a: (_ for _ in ()).throw(Started()))
    monkeypatch.chdir(tmp_path)  # relative --out values are made here
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for value in values:
        args = ["train", "--preset", "tiny", "--out", str(tmp_path), f"--{option.replace('_', '-')}={value}"]
        try:
            status = exit_status(args)
        except Started:
            status = "started"
        out, err = capsys.readouterr()
        assert status == "started" or status == 2 and out == "" and err.count("\n") == 1, (value, status, err)


def test_version(capsys):
    """One version: fullshard.__version__, which pyproject.toml takes (an installed fullshard's
    metadata says the same), also when run from a source tree (PYTHONPATH=src)."""
    import importlib.metadata

    from fullshard import __version__

    assert exit_status(["--version"]) == 0
    assert capsys.readouterr().out == f"fullshard {__version__}\n"
    assert importlib.metadata.version("fullshard") == __version__


def test_the_command_exits_with_mains_status_and_no_traceback():
    """The real `python -m fullshard.cli`: what the tests above call in-process, as a process."""
    run = fullshard("train", "--strategy", "zero3")
    out, err = run.communicate(timeout=120)  # a torch import: seconds, even on busy cores
    assert run.returncode == 2
    assert out == "" and err.count("\n") == 1 and "unknown --strategy 'zero3'" in err and "Traceback" not in err


LAUNCHER_CHECK = """
import json, sys
from fullshard import cli

HEAVY = ("torch", "torch.distributed.tensor", "torch._dynamo", "fullshard.api", "fullshard.cli.trainer")
seen = {}
cli.launch = lambda command, nproc, restarts: seen.update(heavy=[m for m in HEAVY if m in sys.modules]) or 0
status = cli.main(["train", "--preset", "tiny", "--steps", "1", "--out", sys.argv[1]])
print(json.dumps({"status": status, **seen}))
"""


def test_the_launcher_starts_the_ranks_without_torch_on_a_cpu_build(tmp_path):
    """A local run's launcher passes every check and starts the ranks having imported neither the
    library, DTensor nor dynamo, nor, with a build of torch for CPUs alone, torch itself (1.3-1.5
    s and CPU-seconds less of a one-step run at 2 cores: docs/benchmarks.md): a CUDA build's
    launcher imports torch to count the GPUs. (The package's names load on first use:
    test_design.py.)"""
    import json
    import subprocess

    import torch

    from tests.world import child_pythonpath
    run = subprocess.run([sys.executable, "-c", LAUNCHER_CHECK, str(tmp_path)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": child_pythonpath()}, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    cpu_build = torch.version.cuda is None and torch.version.hip is None
    assert got["status"] == 0 and got["heavy"] == ([] if cpu_build else ["torch"]), got


# ---- the launcher of local runs (fullshard.cli.launcher), with stand-in ranks -------------------
# Ranks here are small Python programs (no torch import: milliseconds), started by the
# launcher exactly as it starts `fullshard train`'s ranks.


def launch(rank_code: str, nproc: int = 2) -> int:
    return launcher.launch([sys.executable, "-c", rank_code], nproc, max_restarts=0)


def test_the_launcher_exits_with_the_status_a_rank_failed_with(capsys):
    # 3 is a FullShardError while training, which the rank has said in one line
    assert launch("import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)") == 3
    assert capsys.readouterr().err == ""
    # a rank killed (or crashed): 1, and a line naming it
    assert launch("import os, signal; os.environ['RANK'] == '1' and os.kill(os.getpid(), signal.SIGKILL)") == 1
    assert capsys.readouterr().err == "fullshard: error: rank 1 was killed by SIGKILL; its output is above\n"


@pytest.fixture
def no_signal_reaches_pytest():
    """A stop signal the launcher failed to catch fails the test instead of ending pytest."""
    def caught(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the test")

    before = {sig: signal.signal(sig, caught) for sig in launcher.STOP_SIGNALS}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_launcher_ends_its_ranks_and_exits_with_128_plus_the_signal(no_signal_reaches_pytest, capsys,
                                                                              tmp_path, sig):
    # each rank records its pid and waits; rank 0 then stops the launcher, as Ctrl-C or kill would
    code = (f"import os, pathlib, signal, time; pathlib.Path({str(tmp_path)!r}, os.environ['RANK']).write_text("
            f"str(os.getpid())); os.environ['RANK'] == '0' and os.kill(os.getppid(), {int(sig)}); time.sleep(60)")
    assert launch(code) == 128 + sig
    err = capsys.readouterr().err
    assert err == f"fullshard: stopped by {sig.name}; the same command resumes from the newest checkpoint\n"
    pids = [rank.read_text() for rank in tmp_path.iterdir()]  # rank 1's may be empty: ended mid-write
    assert (tmp_path / "0").is_file() and not any(Path("/proc", pid).exists() for pid in pids if pid)


RENDEZVOUS_CHECK = """
import os, stat, sys
store = os.environ["FULLSHARD_STORE_FILE"]
folder = os.path.dirname(store)
open(store, "a").close()  # as torch's FileStore makes it
info = os.stat(folder)
if stat.S_IMODE(info.st_mode) != 0o700 or info.st_uid != os.getuid():
    sys.exit(4)
# the launcher holds no listening socket: none of its descriptors is a socket in state LISTEN
mine = {os.readlink(f"/proc/{os.getppid()}/fd/{fd}") for fd in os.listdir(f"/proc/{os.getppid()}/fd")}
listening = {f"socket:[{line.split()[9]}]" for name in ("/proc/net/tcp", "/proc/net/tcp6") if os.path.exists(name)
             for line in open(name).read().splitlines()[1:] if line.split()[3] == "0A"}
if mine & listening:
    sys.exit(5)
if os.getuid() == 0:  # another local user (nobody) can neither read nor write the rendezvous
    child = os.fork()
    if child == 0:
        os.setgid(65534)
        os.setuid(65534)
        refused = 0
        for attempt in (lambda: os.listdir(folder), lambda: open(store).read(),
                        lambda: open(store, "a").write("garbage"),
                        lambda: open(os.path.join(folder, "attempt-1"), "w").write("garbage")):
            try:
                attempt()
            except PermissionError:
                refused += 1
        os._exit(0 if refused == 4 else 6)
    sys.exit(os.waitpid(child, 0)[1] >> 8)
"""


def test_a_local_runs_rendezvous_is_reachable_by_this_user_alone():
    """Note [local launch]: the ranks meet in a FileStore in a mode-0700 directory; nothing
    listens for it, and (run as root, the check also as another user) no other local user
    can list, read or write the job's keys, nor plant the next attempt's."""
    assert launch(RENDEZVOUS_CHECK, nproc=1) == 0
