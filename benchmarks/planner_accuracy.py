"""Planner accuracy: predicted vs measured peak memory per rank, and bytes, per configuration
and CPU capability level.

    .venv/bin/python benchmarks/planner_accuracy.py                      # every level this CPU has
    .venv/bin/python benchmarks/planner_accuracy.py --levels avx2 small,2,full_shard,bf16

A level below the CPU's own is emulated by capping every kernel library torch uses at it:
ATen's own kernels (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA, which decides
how bf16 matmuls run) and MKL's (MKL_ENABLE_INSTRUCTIONS). Capping ATen alone changes
nothing measurable; capping oneDNN at AVX2 reproduces an AVX2 machine's bf16 memory.
The planner's runtime probe (Note [runtime probe] in fullshard/planner.py) runs under the
same caps, as it would on such a machine.

Each configuration runs in a fresh `torchrun` whose ranks return freed memory to the OS as
`fullshard train`'s do (return_freed_memory in fullshard/accounting.py; no environment variable), so
that the resident set follows live memory; the measured figure is each rank's whole peak
RSS (VmHWM), the largest over ranks: the planner's basis, what `fullshard train` reports
(less the text train holds beside, which train adds to the plan itself). Bytes are
fullshard.stats' count of one step, and the step time the median of steps 2-6 (slowest
rank); all are compared with fullshard.plan's prediction for the same configuration (wrap
per block, limit 2) on the "cpu" hardware figures. World 4 runs 4 ranks
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

LEVELS = {  # capability level -> the environment that caps every kernel library at it
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}

# (preset, world, strategy, precision, batch per rank[, wrap "blocks"/"none", checkpointing]): per-block
# units without checkpointing unless said; the last rows are candidates the planner chooses for
# tight budgets (tests/test_planner.py)
CASES = [
    ("small", 1, "full_shard", "fp32", 8), ("small", 2, "full_shard", "fp32", 8), ("small", 2, "shard_grad_op", "fp32", 8),
    ("small", 2, "no_shard", "fp32", 8), ("small", 2, "full_shard", "bf16", 8), ("small", 4, "full_shard", "fp32", 8),
    ("small", 4, "hybrid_shard", "fp32", 8),
    ("15m", 1, "full_shard", "fp32", 4), ("15m", 2, "full_shard", "fp32", 4), ("15m", 2, "shard_grad_op", "fp32", 4),
    ("15m", 2, "no_shard", "fp32", 4), ("15m", 2, "full_shard", "bf16", 4), ("15m", 2, "shard_grad_op", "bf16", 4),
    ("15m", 4, "full_shard", "fp32", 4), ("15m", 4, "hybrid_shard", "fp32", 4), ("15m", 4, "full_shard", "bf16", 4),
    ("small", 2, "full_shard", "fp32", 8, "blocks", True), ("small", 2, "full_shard", "fp32", 8, "none", False),
    ("small", 2, "shard_grad_op", "fp32", 8, "none", True), ("small", 2, "full_shard", "bf16", 8, "none", True),
]


def worker(preset: str, strategy: str, precision: str, batch: int, wrap: str, checkpointing: bool,
           out: str) -> None:
    import torch
    import torch.distributed as dist

    import fullshard
    from fullshard.gpt import GPT, PRESETS, Block, GPTConfig
    from fullshard.accounting import process_memory, return_freed_memory

    return_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    x = torch.randint(0, 256, (batch, 129))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=128, vocab_size=256, **PRESETS[preset]))
    mp = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else None
    mesh = None
    if strategy == "hybrid_shard":  # groups of 2, as the planner's "2 ranks per node"
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("replicate", "shard"))
    fullshard.shard_model(model, wrap={Block} if wrap == "blocks" else None, strategy=strategy, mp_policy=mp,
                          forward_prefetch=True, mesh=mesh, checkpoint={Block} if checkpointing else False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(6):
        start = time.perf_counter()
        with fullshard.stats(model) as stats:
            model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    peak = torch.tensor([float(process_memory("VmHWM")), statistics.median(times[1:])])  # the first step warms up
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"peak": peak[0].item(), "step_s": peak[1].item(),
                                         "intra": stats.intra_group_bytes, "cross": stats.cross_group_bytes}))
    dist.destroy_process_group()


def levels_here() -> list[str]:
    """The capability levels this CPU runs: its own and every one below."""
    import torch

    order = ["default", "avx2", "avx512"]
    own = torch.backends.cpu.get_cpu_capability().lower()
    return order[: order.index(own) + 1] if own in order else ["default"]


def main() -> None:
    import torch

    import fullshard
    from fullshard import planner
    from fullshard.gpt import GPT, PRESETS, GPTConfig

    args = sys.argv[1:]
    levels = levels_here()
    if args[:1] == ["--levels"]:
        levels, args = args[1].split(","), args[2:]
    only = args  # e.g. "small,2,full_shard,bf16" to run some cases only
    print("| level | preset | world | strategy | precision | batch/rank | wrap | checkpointing | "
          "runtime MiB (probed) | predicted MiB | measured MiB | error | predicted bytes = measured | predicted s/step | measured s/step | "
          "time error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        os.environ.update(LEVELS[level])  # for the workers and for the planner's probe
        planner._probed.clear()
        for preset, world, strategy, precision, batch, *how in CASES:
            wrap, checkpointing = how or ("blocks", False)
            name = f"{preset},{world},{strategy},{precision}" + (f",{wrap},{int(checkpointing)}" if how else "")
            if only and name not in only:
                continue
            got = run_case(preset, world, strategy, precision, batch, wrap, checkpointing)
            with torch.device("meta"):
                model = GPT(GPTConfig(block_size=128, vocab_size=256, **PRESETS[preset]))
            hardware = dataclasses.replace(planner.HARDWARE["cpu"], ranks_per_node=2)
            plan = fullshard.plan(model, world_size=world, memory_budget=1e15, batch=batch, seq=128,
                                  precisions=(precision,), strategies=(strategy,), hardware=hardware)
            c = next(c for c in plan.candidates
                     if c.wrap == wrap and c.limit_all_gathers == 2 and c.checkpointing == checkpointing)
            exact = c.sent_intra == got["intra"] and c.sent_cross == got["cross"]
            print(f"| {level} | {preset} | {world} | {strategy} | {precision} | {batch} | {wrap} | "
                  f"{'yes' if checkpointing else 'no'} | "
                  f"{plan.hardware.runtime[precision] / 2**20:.1f} | {c.peak / 2**20:.1f} | {got['peak'] / 2**20:.1f} "
                  f"| {100 * (c.peak - got['peak']) / got['peak']:+.1f}% | "
                  f"{'yes' if exact else 'no: ' + str((c.sent_intra, got['intra'], c.sent_cross, got['cross']))} "
                  f"| {c.step_s:.3f} | {got['step_s']:.3f} | "
                  f"{100 * (c.step_s - got['step_s']) / got['step_s']:+.0f}% |", flush=True)
        for name in LEVELS[level]:
            del os.environ[name]


def run_case(preset: str, world: int, strategy: str, precision: str, batch: int, wrap: str,
             checkpointing: bool) -> dict:
    """One configuration in a fresh `torchrun` (the level's caps are in os.environ)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__,
               "--worker", preset, strategy, precision, str(batch), wrap, str(int(checkpointing)), str(out)]
        for attempt in (1, 2):  # a run that crashes in torch's teardown is tried once more, and said so
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode == 0:
                break
            last = [line for line in done.stderr.splitlines() if line.strip()][-3:]
            print(f"(retrying {preset} {world} {strategy} {precision}: exit {done.returncode}: {last})", flush=True)
        else:
            raise RuntimeError(done.stderr[-3000:])
        return json.loads(out.read_text())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6], sys.argv[7] == "1", sys.argv[8])
    else:
        main()
