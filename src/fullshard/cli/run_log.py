"""What a run leaves in --out besides its checkpoint: metrics.jsonl (a line per step),
loss.png and the closing summary. Rank 0 alone writes them, inside --out only (Note
[confined files]: a link planted under one of these names is refused, not followed).
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import TextIO

from fullshard.errors import FullShardError
from fullshard.checkpoint.files import Folder

METRICS, PLOT = "metrics.jsonl", "loss.png"
MAX_METRICS = 1 << 30


def read_rows(log: Path) -> list[dict]:
    """The rows of metrics.jsonl. A last line without its newline is one that a killed run
    was writing: it is dropped (the step it logged is trained again after a resume). Any
    other line that is not JSON was damaged by something else, and is an error."""
    try:
        with Folder.open(log.parent) as folder:
            kind = folder.kind(log.name)
            text = folder.read(log.name, MAX_METRICS, math.inf).decode("utf-8", "replace") if kind else ""
    except OSError as e:
        raise FullShardError(f"{log} cannot be read ({e.strerror or e}): it must be a regular file, not a link. "
                             f"Remove it (it only records the run) and run the same command again") from None
    lines = text.splitlines()
    if text and not text.endswith("\n"):
        lines.pop()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise FullShardError(f"{log}, line {number}, is not JSON ({e.msg}): the file was damaged. Delete "
                                 f"that line (or the file: it only records the run) and run the same command "
                                 f"again") from None
    return rows


def open_log(out: Path, start: int) -> TextIO:
    """metrics.jsonl, open for appending the steps after `start` (the step resumed from;
    0: a new run, whose log starts empty). Rows past `start` go: they are trained again."""
    kept = [row for row in read_rows(out / METRICS) if row["step"] <= start] if start else []
    with Folder.open(out) as folder:
        folder.write_durably(METRICS, "".join(json.dumps(row) + "\n" for row in kept).encode())
        return os.fdopen(folder.open_regular(METRICS, os.O_WRONLY | os.O_APPEND), "a")


def append_log(out: Path) -> TextIO:
    """metrics.jsonl, open for appending as it is (Note [replica groups]: the groups take turns
    writing it; the launcher emptied it for a new run)."""
    with Folder.open(out, create=True) as folder:
        return os.fdopen(folder.open_regular(METRICS, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")


def latest_rows(rows: list[dict]) -> list[dict]:
    """Each step's last row, in step order: a replica group resumed from a checkpoint behind the
    log trains those steps again, and the rows they wrote last stand."""
    return sorted({row["step"]: row for row in rows}.values(), key=lambda row: row["step"])


def summary(steps: int, rows: list[dict], out: Path) -> str:
    """The closing table: validation loss, speed, memory and where the outputs are."""
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    trained = [r for r in rows if "loss" in r]
    tok_s = sorted(r["tokens_per_s"] for r in trained)[len(trained) // 2] if trained else 0.0
    peak = max((max(r["peak_mem_mb"]) for r in trained), default=0.0)
    sent = sorted(r["sent_bytes"] for r in trained)[len(trained) // 2] if trained else 0
    lines = [
        "| | |", "|---|---|",
        f"| validation loss | {vals[0]:.4f} -> {vals[-1]:.4f} |" if vals else "| validation loss | - |",
        f"| training loss (last step) | {trained[-1]['loss']:.4f} |" if trained else "| training loss | - |",
        f"| steps | {trained[-1]['step'] if trained else 0} of {steps} |",
        f"| tokens/s (median) | {tok_s:.0f} |",
        f"| peak memory per rank (CPU: the process's resident set; GPU: max_memory_allocated) | {peak:.0f} MiB |",
        f"| sent per step per rank (median) | {sent / 2**20:.1f} MiB |",
        f"| metrics | {out / 'metrics.jsonl'} |",
        f"| plot | {out / 'loss.png'} |",
        f"| checkpoint | {out / 'checkpoint'} (resumed by running the same command again) |",
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, saves: list[int] = ()) -> None:
    """Training and validation loss, each rank's peak memory, and the wall time of each step
    (since the step before, so a checkpoint's stall shows at the step after `saves`). A run
    resumed at another world size has rows with more or fewer ranks: each rank's curve
    covers the steps it ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (losses, memory, times) = plt.subplots(1, 3, figsize=(16, 4))
    train_rows = [r for r in rows if "loss" in r]
    losses.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="training", linewidth=0.8)
    val_rows = [r for r in rows if "val_loss" in r]
    losses.plot([r["step"] for r in val_rows], [r["val_loss"] for r in val_rows], "o-", label="validation")
    fewer = [r for r in train_rows if r.get("participants", 0) < max(x.get("participants", 0) for x in train_rows)]
    if fewer:  # replica groups left out of these steps (--fault-tolerant)
        losses.plot([r["step"] for r in fewer], [r["loss"] for r in fewer], "rx", label="fewer replica groups")
    losses.set(xlabel="step", ylabel="loss (nats per byte)", title="loss")
    losses.legend()
    for rank in range(max((len(r["peak_mem_mb"]) for r in train_rows), default=0)):
        ran = [r for r in train_rows if rank < len(r["peak_mem_mb"])]
        memory.plot([r["step"] for r in ran], [r["peak_mem_mb"][rank] for r in ran], label=f"rank {rank}")
    memory.set(xlabel="step", ylabel="MiB", title="peak memory per rank (CPU: resident set; GPU: allocated)")
    memory.legend()
    timed = [r for r in train_rows if "step_s" in r]
    times.plot([r["step"] for r in timed], [r["step_s"] for r in timed], linewidth=0.8, label="step")
    for i, step in enumerate(saves):
        times.axvline(step + 1, color="gray", linestyle=":", linewidth=0.8, label="after a checkpoint" if i == 0 else None)
    times.set(xlabel="step", ylabel="seconds", title="wall time per step (validation steps included)")
    times.legend()
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    with Folder.open(path.parent) as folder:
        folder.write_durably(path.name, image.getvalue())
