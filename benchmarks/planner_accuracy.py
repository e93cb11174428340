"""Planner accuracy: predicted vs measured peak memory per rank, and bytes, per configuration.

    .venv/bin/python benchmarks/planner_accuracy.py

Each configuration runs in a fresh `torchrun` with MALLOC_MMAP_THRESHOLD_=65536, so that
memory the allocator frees goes back to the OS and the resident set follows live
memory; the measured figure is the peak RSS (VmHWM) above the RSS before the model is
built. Bytes are fullshard.stats' count of one step, and the step time the median of steps
2-6 (slowest rank); all are compared with fullshard.plan's prediction for the same
configuration (wrap per block, limit 2) on the "cpu" hardware figures. World 4 runs 4 ranks
on this machine's 2 cores, so its times are not comparable.
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [  # (preset, world, strategy, precision, batch per rank)
    ("small", 1, "full_shard", "fp32", 8), ("small", 2, "full_shard", "fp32", 8), ("small", 2, "shard_grad_op", "fp32", 8),
    ("small", 2, "no_shard", "fp32", 8), ("small", 2, "full_shard", "bf16", 8), ("small", 4, "full_shard", "fp32", 8),
    ("small", 4, "hybrid_shard", "fp32", 8),
    ("15m", 1, "full_shard", "fp32", 4), ("15m", 2, "full_shard", "fp32", 4), ("15m", 2, "shard_grad_op", "fp32", 4),
    ("15m", 2, "no_shard", "fp32", 4), ("15m", 2, "full_shard", "bf16", 4), ("15m", 2, "shard_grad_op", "bf16", 4),
    ("15m", 4, "full_shard", "fp32", 4), ("15m", 4, "hybrid_shard", "fp32", 4), ("15m", 4, "full_shard", "bf16", 4),
]


def worker(preset: str, strategy: str, precision: str, batch: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import fullshard
    from fullshard.gpt import GPT, PRESETS, Block, GPTConfig
    from fullshard.stats import process_memory

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    x = torch.randint(0, 256, (batch, 129))
    open("/proc/self/clear_refs", "w").write("5")
    base = process_memory("VmRSS")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=128, vocab_size=256, **PRESETS[preset]))
    mp = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else None
    mesh = None
    if strategy == "hybrid_shard":  # groups of 2, as the planner's "2 ranks per node"
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("replicate", "shard"))
    fullshard.shard_model(model, wrap={Block}, strategy=strategy, mp_policy=mp, forward_prefetch=True, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(6):
        start = time.perf_counter()
        with fullshard.stats(model) as stats:
            model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    peak = torch.tensor([float(process_memory("VmHWM") - base), statistics.median(times[1:])])  # the first step warms up
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"peak": peak[0].item(), "step_s": peak[1].item(),
                                         "intra": stats.intra_group_bytes, "cross": stats.cross_group_bytes}))
    dist.destroy_process_group()


def main() -> None:
    import torch

    import fullshard
    from fullshard.gpt import GPT, PRESETS, GPTConfig

    print("| preset | world | strategy | precision | batch/rank | predicted MB | measured MB | error | "
          "predicted bytes = measured | predicted s/step | measured s/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    only = sys.argv[1:]  # e.g. "small,2,full_shard,bf16" to run some cases only
    for preset, world, strategy, precision, batch in CASES:
        if only and f"{preset},{world},{strategy},{precision}" not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__,
                   "--worker", preset, strategy, precision, str(batch), str(out)]
            for attempt in (1, 2):  # a run that crashes in torch's teardown is tried once more, and said so
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode == 0:
                    break
                last = [line for line in done.stderr.splitlines() if line.strip()][-3:]
                print(f"(retrying {preset} {world} {strategy} {precision}: exit {done.returncode}: {last})", flush=True)
            else:
                raise RuntimeError(done.stderr[-3000:])
            got = json.loads(out.read_text())
        with torch.device("meta"):
            model = GPT(GPTConfig(block_size=128, vocab_size=256, **PRESETS[preset]))
        from fullshard.planner import HARDWARE

        hardware = dataclasses.replace(HARDWARE["cpu"], ranks_per_node=2)
        plan = fullshard.plan(model, world_size=world, memory_budget=1e15, batch=batch, seq=128, precisions=(precision,),
                              strategies=(strategy,), hardware=hardware)
        c = next(c for c in plan.candidates if c.wrap == "blocks" and c.limit_all_gathers == 2 and not c.checkpointing)
        exact = c.sent_intra == got["intra"] and c.sent_cross == got["cross"]
        print(f"| {preset} | {world} | {strategy} | {precision} | {batch} | {c.peak / 2**20:.1f} | {got['peak'] / 2**20:.1f} "
              f"| {100 * (c.peak - got['peak']) / got['peak']:+.1f}% | "
              f"{'yes' if exact else 'no: ' + str((c.sent_intra, got['intra'], c.sent_cross, got['cross']))} "
              f"| {c.step_s:.3f} | {got['step_s']:.3f} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    else:
        main()
