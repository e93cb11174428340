"""What fault tolerance costs (issue #45): the step of fullshard.ft's recipe (2 replica groups on
torchft) against plain hybrid sharding of the same ranks, and how long a lost group takes to be
left out and to come back.

    .venv/bin/python benchmarks/ft_step.py [rounds] [steps] [presets] [group sizes]

e.g. `benchmarks/ft_step.py 3 30 tiny,15m 1,2`. Per round and setting, alternating: plain
hybrid sharding (fully_shard per block and root over a (2, G) mesh: the cross-replica
all-reduce inside fullshard, one process group) and the recipe (2 groups of G ranks, torchft's
Manager, quorum and commit every step, the all-reduce through the units' all-reduce hook);
AdamW, 4 sequences per group per step, one thread per rank, tests/replicas.py's processes.
Step time: the median over every step but the first 3 of every round of rank 0 of group 0, and
of it the medians of the seconds in torchft's quorum (zero_grad and wait_quorum), in the
cross-replica all-reduce the units' hook issues and waits for, and in should_commit. Then
one run with a failure: group 1 SIGKILLed inside the all-reduce and restarted at once; the
seconds from the kill to group 0's next committed step, and from the restart to group 1's
first committed step (its heal included).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at INFO (read when they load)

import torch  # noqa: E402

from tests.replicas import Replicas, batch_of, build_model  # noqa: E402
from tests.world import World  # noqa: E402

SEQ = {"tiny": 8, "15m": 64, "100m": 64}
WARMUP = 3
PARTS: dict[tuple[str, int], list[dict]] = {}  # the recipe's rows: seconds in torchft's quorum, all-reduce, commit


def hybrid_job(group_size: int, preset: str, steps: int) -> list[float]:
    """Plain hybrid sharding over a (2, group_size) mesh: each step's seconds on this rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fullshard
    mesh = init_device_mesh("cpu", (2, group_size), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = build_model({"preset": None if preset == "tiny" else preset, "seq": SEQ[preset]})
    for block in model.h:
        fullshard.fully_shard(block, mesh=mesh)
    fullshard.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = dist.get_rank()
    times = []
    for step in range(steps):
        start = time.perf_counter()
        x, y = batch_of(step, rank // group_size, rank % group_size, group_size, SEQ[preset])
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def ft_steps(group_size: int, preset: str, steps: int) -> list[float]:
    replicas = Replicas(replicas=2, group_size=group_size, steps=steps, min_replicas=2,
                        preset=None if preset == "tiny" else preset, seq=SEQ[preset], digests=False)
    try:
        rows = replicas.results({(r, k) for r in range(2) for k in range(group_size)}, deadline_s=600)[0, 0]
    finally:
        replicas.close()
    PARTS.setdefault((preset, group_size), []).extend(rows[WARMUP:])
    return [b["t"] - a["t"] for a, b in zip(rows, rows[1:])]


def failure(preset: str) -> tuple[float, float]:
    """(kill -> group 0's next committed step, restart -> group 1's first committed step), seconds."""
    replicas = Replicas(replicas=0, steps=10_000, preset=None if preset == "tiny" else preset, seq=SEQ[preset],
                        digests=False)
    try:
        replicas.lose_and_heal("allreduce")
    finally:
        replicas.close()
    killed, restarted = replicas.killed_at.value, replicas.started_at[1]
    after_kill = min(r["t"] for r in replicas.rows[0, 0] if r["committed"] and r["t"] > killed) - killed
    back = min(r["t"] for r in replicas.rows[1, 0] if r["committed"]) - restarted
    return after_kill, back


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    presets = sys.argv[3].split(",") if len(sys.argv) > 3 else ["tiny", "15m"]
    sizes = [int(g) for g in sys.argv[4].split(",")] if len(sys.argv) > 4 else [1, 2]
    worlds = {g: World(2 * g, forked=True) for g in sizes}
    times: dict[tuple[str, int, str], list[float]] = {}
    try:
        for _ in range(rounds):
            for preset in presets:
                for g in sizes:
                    times.setdefault((preset, g, "hybrid"), []).extend(
                        worlds[g].run(hybrid_job, group_size=g, preset=preset, steps=steps)[0][WARMUP:])
                    times.setdefault((preset, g, "ft"), []).extend(ft_steps(g, preset, steps)[WARMUP - 1:])
    finally:
        for world in worlds.values():
            world.close()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {rounds} rounds x {steps} steps\n")
    print("| model | groups x ranks | hybrid step (ms) | fullshard.ft step (ms) | ratio | of which quorum (ms) | "
          "all-reduce waited in the hook (ms) | commit (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in presets:
        for g in sizes:
            plain = statistics.median(times[preset, g, "hybrid"]) * 1e3
            ft = statistics.median(times[preset, g, "ft"]) * 1e3
            parts = {key: statistics.median(row[key] for row in PARTS[preset, g]) * 1e3
                     for key in ("quorum_s", "reduce_s", "commit_s")}
            print(f"| {preset} | 2 x {g} | {plain:.1f} | {ft:.1f} | {ft / plain:.2f}x | {parts['quorum_s']:.1f} | "
                  f"{parts['reduce_s']:.1f} | {parts['commit_s']:.1f} |")
    for preset in presets[:1]:
        after_kill, back = failure(preset)
        print(f"\n{preset}, 2 x 1: kill -> group 0's next committed step {after_kill:.2f} s; "
              f"restart -> group 1's first committed step {back:.2f} s")


if __name__ == "__main__":
    main()
