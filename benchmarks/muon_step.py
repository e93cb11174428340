"""Muon on a sharded GPT: fullshard.optim.Muon against the ways a user has today, and AdamW.

    PYTHONPATH=src python benchmarks/muon_step.py [--presets 15m,100m] [--worlds 2,4] [--rounds 3]
        [--accum 1] [--impls fullshard+Muon,AdamW]

Each run is a fresh torchrun launch of `--worlds` gloo ranks on 127.0.0.1 (one thread each),
training fullshard's GPT sharded per block on the same data; runs alternate over the
implementations (A B C D A B C D ...), medians over runs:

- fullshard+Muon: fullshard.optim.Muon on the hidden matrices, its AdamW groups for the rest
  (Note [matrix optimizers]: each matrix orthogonalized once, by its owner);
- FSDP2+torch.Muon: torch's FSDP2, torch.optim.Muon on the same matrices (DTensor gathers
  the matrix inside every Newton-Schulz matmul; every rank does every matrix), torch.optim.AdamW
  on the rest;
- fullshard+torch.Muon: the same on fullshard (its parameters are DTensors as FSDP2's);
- AdamW: fullshard with torch.optim.AdamW on every parameter.

Reported: the optimizer step's wall time (the slowest rank's, median over steps), the whole
step's (forward, backward, clip, optimizer step), the bytes a rank sends during the optimizer
step (the c10d calls it makes, DTensor's included, as gloo's algorithms move them: all_gather
(N-1)/N of the output, all_to_all what goes to other ranks, all-reduce and reduce-scatter
2(N-1)/N of the input), the Newton-Schulz FLOPs per rank
(max and max/mean over ranks) and, for fullshard+Muon, the share of its optimizer step spent in
its two exchanges (what layout (b) of Note [matrix optimizers] would save at most) and in
waiting for the slowest rank before each (measured with a barrier in front of each, which only
the benchmark adds: work the ranks do in different times, whatever their FLOPs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPLS = ["fullshard+Muon", "FSDP2+torch.Muon", "fullshard+torch.Muon", "AdamW"]
BATCHES = {"15m": (8, 128), "100m": (4, 128)}  # as fullshard bench: (global batch, sequence)
MUON_LR, ADAMW_LR = 0.02, 3e-4


def sent_bytes(run, world: int) -> int:
    """Bytes this rank sends in `run()`, from the c10d calls (eager and functional) it makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        sent = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name, out = func.__name__, func(*args, **(kwargs or {}))
            if func.namespace in ("c10d", "_c10d_functional"):
                if "alltoall" in name or "all_to_all" in name:
                    flat = args[1] if func.namespace == "c10d" else args[0]
                    splits = (args[3] if func.namespace == "c10d" else args[2]) or [flat.shape[0] // world] * world
                    row = flat[0].numel() * flat.element_size() if flat.numel() else 0
                    self.sent += (sum(splits) - splits[rank]) * row
                elif "allgather" in name or "all_gather" in name:
                    shard = args[1] if name.startswith("_allgather_base") else args[0]
                    shard = shard[0] if isinstance(shard, (list, tuple)) else shard
                    self.sent += (world - 1) * shard.numel() * shard.element_size()
                elif name.startswith("send"):  # point-to-point (gloo's route of fullshard's exchange)
                    self.sent += sum(t.numel() * t.element_size() for t in args[0])
                elif "allreduce" in name or "all_reduce" in name or "reduce_scatter" in name:
                    t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
                    t = args[1] if name.startswith("_reduce_scatter_base") else t
                    self.sent += 2 * (world - 1) * t.numel() * t.element_size() // world
            return out

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    rank = dist.get_rank()
    log = Log()
    originals = {name: getattr(funcol, name) for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")}

    def counted(name):  # DTensor's collectives, made inside its dispatch where the mode does not see them
        def call(t, *args, **kwargs):
            log.sent += (world - 1) * t.numel() * t.element_size() if name == "all_gather_single" else \
                2 * (world - 1) * t.numel() * t.element_size() // world
            return originals[name](t, *args, **kwargs)
        return call

    try:
        for name in originals:
            setattr(funcol, name, counted(name))
        with log:
            run()
    finally:
        for name, original in originals.items():
            setattr(funcol, name, original)
    return log.sent


def build(impl: str, preset: str):
    """The sharded GPT and its optimizers (the Muon one first) as `impl` trains it."""
    import torch
    from fullshard.gpt import GPT, PRESETS, Block, GPTConfig
    from fullshard.optim import Muon, muon_groups

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=BATCHES[preset][1], vocab_size=256, **PRESETS[preset]))
    if impl.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        fully_shard(model)
    else:
        import fullshard

        fullshard.shard_model(model, wrap={Block}, forward_prefetch=True)
    if impl == "AdamW":
        return model, [torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)]
    matrices, rest = muon_groups(model)
    if impl == "fullshard+Muon":
        return model, [Muon([{"params": matrices}, {"params": rest, "use_muon": False, "lr": ADAMW_LR}], lr=MUON_LR)]
    return model, [torch.optim.Muon(matrices, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAMW_LR)]


def newton_schulz_flops(impl: str, optimizer, world: int, rank: int) -> float:
    """This rank's Newton-Schulz FLOPs per step: its owned matrices (fullshard+Muon), every
    matrix on every rank (torch.optim.Muon), none (AdamW)."""
    from fullshard.optim import Muon

    if impl == "AdamW":
        return 0.0
    muon = Muon.cost.__get__(optimizer)  # 4 m^2 n + 2 m^3 per iteration for an m x n matrix, m <= n
    steps = optimizer.param_groups[0]["ns_steps"]
    params = [p for g in optimizer.param_groups if g.get("use_muon", True) is not False for p in g["params"]]
    if impl == "fullshard+Muon":
        return steps * sum(muon(p.shape) for p in params if optimizer.matrix_of(p).owner == rank)
    return steps * sum(muon(p.shape) for p in params)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import fullshard
    from fullshard.optim import MatrixOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizers = build(args.impl, args.preset)
    global_batch, seq = BATCHES[args.preset]
    generator = torch.Generator().manual_seed(0)
    local = global_batch // world
    exchange = [0.0, 0.0]  # seconds in the exchanges, waiting for the slowest rank before them
    if args.impl == "fullshard+Muon":  # time the two exchanges, apart from the ranks' skew before them
        send_rows = MatrixOptimizer.send_rows

        def timed(self, send, sizes, device, m, digest, leg, what):
            start = time.perf_counter()
            dist.barrier(m.group.shard_pg)
            ready = time.perf_counter()
            try:
                return send_rows(self, send, sizes, device, m, digest, leg, what)
            finally:
                exchange[0] += time.perf_counter() - ready
                exchange[1] += ready - start

        MatrixOptimizer.send_rows = timed

    def optimizer_step() -> None:
        for optimizer in optimizers:
            optimizer.step()

    def step(measure_bytes: bool = False) -> tuple[float, float, int]:
        start = time.perf_counter()
        for _ in range(args.accum):  # micro-batches of the same size: a step of accum x the tokens
            data = torch.randint(0, 256, (global_batch, seq + 1), generator=generator)[rank * local:(rank + 1) * local]
            loss = model(data[:, :-1], data[:, 1:]) / args.accum
            loss.backward()
        if args.impl.startswith("FSDP2"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        else:
            fullshard.clip_grad_norm_(model, 1.0)
        opt_start = time.perf_counter()
        sent = sent_bytes(optimizer_step, world) if measure_bytes else optimizer_step()
        end = time.perf_counter()
        for optimizer in optimizers:
            optimizer.zero_grad()
        return end - start, end - opt_start, sent or 0

    for _ in range(args.warmup):
        step()
    sent = step(measure_bytes=True)[2]
    steps, opts, shares = [], [], []
    for _ in range(args.steps):
        dist.barrier()
        exchange[:] = [0.0, 0.0]
        whole, opt, _ = step()
        figures = torch.tensor([whole, opt, *exchange], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the slowest rank's
        steps.append(figures[0].item())
        opts.append(figures[1].item())
        shares.append((figures[2].item() / figures[1].item(), figures[3].item() / figures[1].item()))
    flops = torch.tensor([newton_schulz_flops(args.impl, optimizers[0], world, rank)], dtype=torch.float64)
    gathered = [torch.zeros_like(flops) for _ in range(world)]
    dist.all_gather(gathered, flops)
    flops_per_rank = [g.item() for g in gathered]
    if rank == 0:
        mean = statistics.mean(flops_per_rank)
        Path(args.out).write_text(json.dumps({
            "step": statistics.median(steps), "opt": statistics.median(opts), "sent": sent,
            "flops": max(flops_per_rank), "imbalance": max(flops_per_rank) / mean if mean else 0.0,
            "exchange": statistics.median(s[0] for s in shares), "skew": statistics.median(s[1] for s in shares)}))
    dist.barrier()
    dist.destroy_process_group()


def launch(impl: str, preset: str, world: int, steps: int, warmup: int, accum: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               __file__, "--worker", "--impl", impl, "--preset", preset, "--steps", str(steps),
               "--warmup", str(warmup), "--accum", str(accum), "--out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise RuntimeError(f"{impl} {preset} world {world} failed:\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def table(preset: str, world: int, runs: dict[str, list[dict]], accum: int) -> str:
    med = {impl: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for impl, rs in runs.items()}
    fsdp2, adamw = med.get("FSDP2+torch.Muon"), med["AdamW"]
    tokens = BATCHES[preset][0] * BATCHES[preset][1] * accum
    lines = [f"\n### {preset}, world {world}, {tokens:,} tokens per step ({len(runs['AdamW'])} alternating runs)\n",
             "| impl | optimizer step s | / FSDP2+torch.Muon | whole step s | / AdamW | sent in the optimizer step MB "
             "| Newton-Schulz GFLOP, max rank | max/mean | exchanges' share of the optimizer step | waiting for "
             "the slowest rank |", "|---|---|---|---|---|---|---|---|---|---|"]
    for impl, m in med.items():
        share = f"{m['exchange']:.2f} | {m['skew']:.2f}" if impl == "fullshard+Muon" else "- | -"
        lines.append(f"| {impl} | {m['opt']:.3f} | {m['opt'] / fsdp2['opt'] if fsdp2 else float('nan'):.2f} | "
                     f"{m['step']:.3f} | "
                     f"{m['step'] / adamw['step']:.2f} | {m['sent'] / 2**20:.1f} | {m['flops'] / 1e9:.1f} | "
                     f"{m['imbalance']:.2f} | {share} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="15m,100m")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step (gradients accumulated)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--impl")
    parser.add_argument("--preset")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for preset in args.presets.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            runs: dict[str, list[dict]] = {impl: [] for impl in args.impls.split(",")}
            for _ in range(args.rounds):
                for impl in runs:
                    runs[impl].append(launch(impl, preset, world, args.steps, args.warmup, args.accum))
            print(table(preset, world, runs, args.accum), flush=True)


if __name__ == "__main__":
    main()
