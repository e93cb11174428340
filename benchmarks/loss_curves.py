"""Loss curves of `fullshard train` runs, grouped: each group's band (min to max over its runs)
and mean, and each run's gap to the first group's run of the same seed; with the table of
mean losses over step windows and the bytes sent per step.

    python benchmarks/loss_curves.py OUT.png NAME=DIR[,DIR...] [NAME=DIR[,DIR...] ...] [--gap-range 0.03]

The first group is the reference (e.g. fp32 reductions over seeds 0, 1, 2); the others'
runs are paired with its runs in order (the same seed). The validation loss is the runs' last;
--gap-range is the gap plot's half-height.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

WINDOWS = [(1, 10), (41, 50), (91, 100), (191, 200), (291, 300)]


def rows(directory: str) -> list[dict]:
    return [json.loads(line) for line in (Path(directory) / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args = sys.argv[1:]
    gap_range = 0.03  # low-precision reductions' gaps; the spread's band goes far beyond (median 0.14 there)
    if "--gap-range" in args:
        at = args.index("--gap-range")
        gap_range = float(args[at + 1])
        del args[at : at + 2]
    out, specs = args[0], args[1:]
    groups = {name: [rows(d) for d in dirs.split(",")] for name, dirs in (spec.split("=", 1) for spec in specs)}
    fig, (curves, gaps) = plt.subplots(1, 2, figsize=(13, 4.5))
    reference = next(iter(groups.values()))
    last = max(r["step"] for r in reference[0] if "val_loss" in r)
    windows_ = [(a, b) for a, b in WINDOWS if b <= last]
    print("| runs | count | " + " | ".join(f"loss, steps {a}-{b}" for a, b in windows_) +
          f" | validation loss, step {last} | sent per step per rank (mean) |")
    print("|---|---|" + "---|" * (len(windows_) + 2))
    for name, runs in groups.items():
        steps = [r["step"] for r in runs[0] if "loss" in r]
        losses = [[r["loss"] for r in run if "loss" in r] for run in runs]
        low, high = [min(v) for v in zip(*losses)], [max(v) for v in zip(*losses)]
        mean = [statistics.fmean(v) for v in zip(*losses)]
        line, = curves.plot(steps, mean, label=f"{name} (mean of {len(runs)})", linewidth=0.8)
        curves.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
        for i, (run, base) in enumerate(zip(losses, (([r["loss"] for r in b if "loss" in r]) for b in reference))):
            if run is not base and runs is not reference:
                gaps.plot(steps, [a - b for a, b in zip(run, base)], color=line.get_color(), linewidth=0.6,
                          label=name if i == 0 else None)
        windows = [statistics.fmean(v for s, v in zip(steps, mean) if a <= s <= b) for a, b in windows_]
        val = [r["val_loss"] for run in runs for r in run if r["step"] == last and "val_loss" in r]
        sent = statistics.fmean(r["sent_bytes"] for r in runs[0] if "sent_bytes" in r)  # DiLoCo: the syncs' spread
        print(f"| {name} | {len(runs)} | " + " | ".join(f"{w:.3f}" for w in windows) +
              f" | {statistics.fmean(val):.4f} ({min(val):.4f}-{max(val):.4f}) | {sent:,.0f} B |")
    # the reference's own spread over its runs, at each step
    ref_losses = [[r["loss"] for r in run if "loss" in r] for run in reference]
    spread = [max(v) - min(v) for v in zip(*ref_losses)]
    ref_steps = [r["step"] for r in reference[0] if "loss" in r]
    gaps.fill_between(ref_steps, [-s for s in spread], spread, color="grey", alpha=0.25,
                      label=f"± {next(iter(groups))} run-to-run spread (max - min over seeds)")
    curves.set(xlabel="step", ylabel="training loss", title="training loss: band = min..max over seeds")
    curves.set_ylim(top=3.5)
    curves.legend()
    gaps.set(xlabel="step", ylabel="loss - same seed's reference loss",
             title=f"each run against {next(iter(groups))}'s run of the same seed")
    gaps.axhline(0, color="black", linewidth=0.5)
    gaps.set_ylim(-gap_range, gap_range)
    gaps.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
