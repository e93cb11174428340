"""CPU-seconds and page faults per training step, variant against variant, alternated run by run:
two versions of fullshard's source, an environment variable, DDP, on `fullshard bench`'s GPT.

    .venv/bin/python benchmarks/step_cpu.py ROUNDS STEPS NAME=SRC:IMPL[:VAR=VALUE...] ...
    .venv/bin/python benchmarks/step_cpu.py 4 15 new=src:fullshard old=/tmp/old/src:fullshard ddp=src:ddp

IMPL is fullshard or ddp. Each variant is a fresh 2-rank torchrun launch (gloo, one thread per rank) with SRC first on
PYTHONPATH and VAR=VALUE in its environment, training `fullshard bench`'s 15m GPT in fp32
(PRESET=100m for the other) as `fullshard bench` does (its model, data, AdamW and clipping):
3 warm-up steps, then STEPS timed ones. Reported per variant, medians over rounds: the step's
wall time, the CPU-seconds of a step summed over both ranks (every thread), the minor page
faults of a step summed over both ranks, and the CPU against the last variant's. `fullshard
bench` compares implementations of one tree; this compares trees and settings, for a change
whose effect is a few percent of the step (run enough rounds for the spread to settle).
"""

from __future__ import annotations

import gc
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict

RESULT = re.compile(r"rank \d step ([\d.]+) cpu ([\d.]+) faults (\d+)")


def rank(impl: str, steps: int) -> None:
    """One rank of one run: its step's wall time, CPU-seconds and minor page faults, printed."""
    import torch
    import torch.distributed as dist

    from fullshard.cli.bench import BATCHES, build_model, wrap

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    preset = os.environ.get("PRESET", "15m")
    model = wrap(impl, build_model(preset), "fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batch, seq = BATCHES[preset]
    me, local = dist.get_rank(), batch // dist.get_world_size()
    generator = torch.Generator().manual_seed(0)

    if impl == "fullshard":
        import fullshard
        clip = fullshard.clip_grad_norm_
    else:
        clip = lambda model, norm: torch.nn.utils.clip_grad_norm_(model.parameters(), norm)  # noqa: E731

    def step() -> None:
        data = torch.randint(0, 256, (batch, seq + 1), generator=generator)[me * local:(me + 1) * local]
        model(data[:, :-1], data[:, 1:]).backward()
        clip(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
    dist.barrier()
    cpu, wall, faults = time.process_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    dist.barrier()
    print(f"rank {me} step {(time.perf_counter() - wall) / steps:.4f} cpu {(time.process_time() - cpu) / steps:.4f} "
          f"faults {(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) // steps}", flush=True)
    model = optimizer = None  # Note [exit] in fullshard/mesh.py
    gc.collect()
    dist.destroy_process_group()


def run(src: str, impl: str, extra: dict[str, str], steps: int) -> tuple[float, float, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.path.abspath(src),
           **extra}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.abspath(__file__), "--rank", impl, str(steps)], env=env, capture_output=True,
                          text=True, timeout=600)
    ranks = RESULT.findall(done.stdout)
    if done.returncode or len(ranks) != 2:
        raise SystemExit(f"{impl} from {src} failed:\n{done.stderr[-3000:]}")
    return float(ranks[0][0]), sum(float(r[1]) for r in ranks), sum(int(r[2]) for r in ranks)


def main() -> None:
    rounds, steps = int(sys.argv[1]), int(sys.argv[2])
    variants = {}
    for spec in sys.argv[3:]:
        name, rest = spec.split("=", 1)
        src, impl, *pairs = rest.split(":")
        variants[name] = (src, impl, dict(pair.split("=", 1) for pair in pairs))
    runs = defaultdict(list)
    for r in range(rounds):
        for name, (src, impl, extra) in variants.items():
            runs[name].append(run(src, impl, extra, steps))
        print(f"round {r}: " + ", ".join(f"{name} {runs[name][-1][1]:.3f} CPU-s" for name in variants), flush=True)
    last = statistics.median(x[1] for x in runs[list(variants)[-1]])
    print(f"\n{rounds} rounds x {steps} steps, medians (CPU and faults summed over both ranks)\n")
    print("| variant | step s | CPU-s per step | against the last | minor faults per step |\n|---|---|---|---|---|")
    for name in variants:
        step, cpu, faults = (statistics.median(x[k] for x in runs[name]) for k in range(3))
        print(f"| {name} | {step:.3f} | {cpu:.3f} | {cpu / last:.3f} | {faults:.0f} |")


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank(sys.argv[2], int(sys.argv[3]))
    else:
        main()
