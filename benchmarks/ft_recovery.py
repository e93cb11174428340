"""What a killed rank costs: `fullshard train --fault-tolerant` (2 replica groups of 1 rank)
against `--max-restarts 1` (2 ranks, every rank restarted from the newest checkpoint), the same
model, steps, data and checkpoint interval (issue #45's comparison).

    .venv/bin/python benchmarks/ft_recovery.py [rounds] [steps] [kill step] [ckpt interval]

Each round runs both modes without a failure and with one rank SIGKILLed once the log holds
`kill step` steps, alternating (A B A B). Reported: the median wall time of each run, the
wall time a kill adds, and the steps of work lost (with restarts: the steps since the
checkpoint the ranks resume from; fault tolerant: committed steps lost, and steps redone).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = ["--preset", "tiny", "--nproc", "2", "--seq-len", "32", "--global-batch", "8", "--eval-interval", "1000",
          "--eval-batches", "1", "--sample-bytes", "0", "--timeout", "30"]
MODES = {"fault tolerant": ["--replicas", "2", "--fault-tolerant"], "max-restarts": ["--max-restarts", "1"]}


def run(mode: str, steps: int, kill_at: int | None, interval: int) -> tuple[float, str]:
    """One command's wall time and its stderr and stdout; with `kill_at`, a rank SIGKILLed then."""
    out = Path(tempfile.mkdtemp(prefix="ft-recovery-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "fullshard.cli", "train", *COMMON, *MODES[mode], "--steps",
                             str(steps), "--ckpt-interval", str(interval), "--out", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_at is not None:
        log = out / "metrics.jsonl"
        while not (log.is_file() and len(log.read_text().splitlines()) >= kill_at):
            time.sleep(0.05)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ranks = [pid for pid in children if b"FULLSHARD_STORE_FILE=" in Path(f"/proc/{pid}/environ").read_bytes()]
        os.kill(int(ranks[-1]), signal.SIGKILL)  # the last rank started (not the launcher's remover)
    stdout, stderr = proc.communicate()
    took = time.monotonic() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0 or [r["step"] for r in rows if "loss" in r][-1] != steps:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{stderr[-2000:]}")
    return took, stdout + stderr


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    interval = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    walls: dict[tuple[str, bool], list[float]] = {}
    lost: dict[str, list[int]] = {}
    for _ in range(rounds):
        for mode in MODES:
            for killed in (False, True):
                took, text = run(mode, steps, kill_at if killed else None, interval)
                walls.setdefault((mode, killed), []).append(took)
                if killed and mode == "max-restarts":
                    resumed = int(re.search(r"resumed from .* at step (\d+)", text).group(1))
                    lost.setdefault(mode, []).append(kill_at - resumed)
    print(f"{rounds} rounds; {steps} steps of the tiny GPT on 2 ranks; a rank killed at step ~{kill_at}; "
          f"a checkpoint every {interval} steps\n")
    print("| mode | run, no failure (s) | run, one rank killed (s) | wall time the kill adds (s) | steps of work lost |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        plain, killed = statistics.median(walls[mode, False]), statistics.median(walls[mode, True])
        steps_lost = f"{statistics.median(lost[mode]):.0f} (redone from the checkpoint)" if mode in lost else \
            "0 committed (the failed step redone at once)"
        print(f"| {mode} | {plain:.1f} | {killed:.1f} | {killed - plain:+.1f} | {steps_lost} |")


if __name__ == "__main__":
    main()
