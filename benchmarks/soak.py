"""Soak: a long `fullshard train` run, sampling each rank's resident memory, threads and
open file descriptors as it goes.

    .venv/bin/python benchmarks/soak.py [steps] [out dir]

Runs the tiny model at world 2 with a checkpoint every 50 steps (and evaluation every
100), samples /proc of every rank once a second alongside the step it is at, and prints
the figures at the end of warm-up (step 100) and at the end, with their growth.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def sample(pid: int) -> tuple[float, int, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
        threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
        return rss, threads, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "runs/soak")
    cmd = [sys.executable, "-m", "fullshard.cli", "train", "--preset", "tiny", "--steps", str(steps),
           "--ckpt-interval", "50", "--eval-interval", "100", "--out", str(out), "--no-resume", "--sample-bytes", "0"]
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log, samples = out / "metrics.jsonl", []  # (step, {pid: (rss MB, threads, fds)})
    while run.poll() is None:
        time.sleep(1.0)
        lines = log.read_text().splitlines() if log.is_file() else []
        step = json.loads(lines[-1])["step"] if lines else 0
        ranks = {pid: s for pid in descendants(run.pid) if "fullshard.cli" in Path(f"/proc/{pid}/cmdline").read_text()
                 and (s := sample(pid)) is not None} if Path(f"/proc/{run.pid}").exists() else {}
        if ranks:
            samples.append((step, ranks))
    training = [s for s in samples if 100 <= s[0] < steps]  # after warm-up, before the final report
    warm, end = training[0], training[-1]
    print(f"`{' '.join(cmd[1:])}` (exit {run.returncode}), {len(samples)} samples, one a second\n")
    print(f"| rank (pid) | RSS MB at step {warm[0]} | at step {end[0]} | growth | highest in between | threads | open fds |")
    print("|---|---|---|---|---|---|---|")
    for pid, (rss, threads, fds) in sorted(end[1].items()):
        w = warm[1].get(pid)
        if w:
            peak = max(s[1][pid][0] for s in training if pid in s[1])
            print(f"| {pid} | {w[0]:.1f} | {rss:.1f} | {100 * (rss - w[0]) / w[0]:+.2f}% | {peak:.1f} "
                  f"| {w[1]} -> {threads} | {w[2]} -> {fds} |")


if __name__ == "__main__":
    main()
