"""`fullshard train`: train a byte-level GPT with fullshard, end to end; `fullshard bench`: the
step benchmark against torch's FSDP2, FSDP1 and DDP; `fullshard plan`: every sharding's
predicted peak memory (as train reports it), traffic and step time, before running.

With no arguments it trains the "small" GPT on Python's own standard library (read as
bytes: nothing to download) on 2 local ranks for a few minutes, and writes to
runs/gpt: metrics.jsonl (a line per step), loss.png (loss curves and memory per rank)
and checkpoint/ (resumed automatically when the same command runs again). Launched
by torchrun it is one rank of the job; otherwise it starts the ranks itself.

The command's parts: config (options and their checks), machine (the GPUs and free
memory the checks weigh a run against), launcher (the ranks of a
local run, the run directory's lock), trainer (one rank's run: the loop), corpus (the
text and its batches), run_log (metrics.jsonl, loss.png, the summary).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from fullshard import __version__
from fullshard.errors import EveryRankError, FullShardError
from fullshard.cli.launcher import LAUNCHER_PID, hold_run_dir, launch, launch_replicas
from fullshard.cli.config import (TrainConfig, add_config_args, fatal, gpt_dims, memory_problem, parse_bytes,
                                    pipeline_problem, plan_problem, problem, unused_problem)
from fullshard.cli.machine import available_memory, cuda_gpus
from fullshard.cli.run_log import open_log

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (and exit status 2) instead of usage text."""

    def error(self, message: str) -> None:
        sys.exit(fatal(message))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its arguments are its own
        from fullshard.cli.bench import main as bench

        bench(argv[1:])
        return 0
    args = parser().parse_args(argv)
    if getattr(args, "fault_tolerant", False):  # torchft's servers log every quorum and commit at INFO
        os.environ.setdefault("RUST_LOG", "warn")
    if args.command == "plan":
        return plan_command(args)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if (message := problem(cfg)) is not None:
        return fatal(message)
    if cfg.fault_tolerant and LAUNCHER_PID not in os.environ and all(var in os.environ for var in TORCHRUN_VARS):
        return fatal("--fault-tolerant starts its replica groups and their lighthouse itself: run it without "
                     "torchrun (or, under torchrun, use fullshard.ft's recipe: docs/fault-tolerance.md)")
    if LAUNCHER_PID in os.environ or all(var in os.environ for var in TORCHRUN_VARS):  # one rank of a job
        try:  # the trainer (the library, DTensor, dynamo) is imported by the ranks alone, not by the launcher
            if cfg.fault_tolerant:
                from fullshard.cli.replica import train_replica

                return train_replica(cfg)
            from fullshard.cli.trainer import train

            return train(cfg)
        except FullShardError as e:  # what went wrong and how to fix it, in one line (one rank's, when all agree)
            if os.environ.get("RANK") == "0" or not isinstance(e, EveryRankError):
                print(f"fullshard: error: {e}", file=sys.stderr, flush=True)
            return 3
    return start_local_run(cfg, argv)


def start_local_run(cfg: TrainConfig, argv: list[str]) -> int:
    """Check what depends on the rank count, hold the run directory, and start the ranks."""
    gpus = cuda_gpus()
    nproc = cfg.nproc or gpus or 2
    if gpus and nproc > gpus:
        return fatal(f"--nproc {nproc} is more than the {gpus} GPUs here: each rank takes a GPU of its own. "
                     f"Pass --nproc {gpus} or fewer")
    cores = os.cpu_count() or 1
    if not gpus and nproc > cores and not cfg.oversubscribe:
        return fatal(f"--nproc {nproc} is more than the {cores} CPU cores here; pass --oversubscribe to run anyway")
    if (message := unused_problem(cfg, nproc, nproc // cfg.replicas)) is not None:  # shard groups: a replica group
        return fatal(message)
    if (message := pipeline_problem(cfg, nproc)) is not None:
        return fatal(message)
    if nproc % cfg.replicas:
        return fatal(f"--nproc {nproc} must divide into --replicas {cfg.replicas} groups of equal size")
    if cfg.global_batch % (nproc // cfg.pp * cfg.grad_accum):
        return fatal(f"--global-batch {cfg.global_batch} must divide into {nproc // cfg.pp} data-parallel ranks x "
                     f"{cfg.grad_accum} micro-batches")
    if (message := memory_problem(cfg, nproc, available_memory(), "of memory available here")) is not None:
        return fatal(message)
    try:
        lock = hold_run_dir(Path(cfg.out))
    except FullShardError as e:
        return fatal(str(e))
    with lock:  # Note [one run per directory]
        if cfg.fault_tolerant:
            resumable = cfg.resume and any((Path(cfg.out) / "checkpoint" / f"replica_{g}" / "LATEST").is_file()
                                           for g in range(cfg.replicas))
            if not resumable:  # a new run's log starts empty (Note [replica rows])
                open_log(Path(cfg.out), 0).close()
            return launch_replicas([sys.executable, "-m", "fullshard.cli", *argv], nproc, cfg.replicas, cfg.ft_bind,
                                   cfg.max_restarts)
        return launch([sys.executable, "-m", "fullshard.cli", *argv], nproc, cfg.max_restarts)


def parser() -> Parser:
    """`fullshard train|plan|bench`, each with its options."""
    top = Parser(prog="fullshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version", version=f"fullshard {__version__}")
    commands = top.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="train a GPT with fullshard (try --help)",
                                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(train_parser)
    commands.add_parser("bench", help="fullshard vs torch FSDP2, FSDP1, DDP (arguments: fullshard bench --help)",
                        add_help=False)
    plan_parser = commands.add_parser("plan", help="predict memory, traffic and step time of every sharding of a "
                                      "GPT and choose one for a memory budget",
                                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    plan_parser.add_argument("--preset", default="small", help="model size: tiny, small, 15m, 100m")
    plan_parser.add_argument("--n-layer", type=int, help="override the preset's number of blocks")
    plan_parser.add_argument("--n-embd", type=int, help="override the preset's width")
    plan_parser.add_argument("--n-head", type=int, help="override the preset's heads")
    plan_parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    plan_parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    plan_parser.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    plan_parser.add_argument("--world-size", type=int, default=2, help="ranks")
    plan_parser.add_argument("--memory-budget", default="2GiB", help="bytes per rank, e.g. 2GiB")
    plan_parser.add_argument("--hardware", default="cpu", help="cpu, a100 or h100 (fullshard.planner.HARDWARE)")
    plan_parser.add_argument("--optimizer", default="adamw",
                             help="adamw, sgd, muon (fullshard.optim.Muon on the matrices, AdamW on the rest) or none")
    plan_parser.add_argument("--pp", type=int, default=1, help="pipeline stages (as fullshard train --pp): each "
                             "stage planned over world-size / pp ranks, the bubble priced")
    plan_parser.add_argument("--microbatches", type=int, default=0, help="with --pp: the schedule's microbatches "
                             "a step, of --batch sequences each (0: --pp)")
    return top


def plan_command(args: argparse.Namespace) -> int:
    """`fullshard plan`: the candidates as a table, and the chosen one."""
    import torch

    import fullshard
    from fullshard.gpt import GPT, GPTConfig

    budget = parse_bytes(args.memory_budget)
    if (message := plan_problem(args, budget)) is not None:
        return fatal(message)
    dims = gpt_dims(args)
    if args.pp > 1:
        return pipeline_plan(args, budget, dims)
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=args.seq_len, vocab_size=args.vocab, **dims))
    try:
        plan = fullshard.plan(model, world_size=args.world_size, memory_budget=budget, batch=args.batch,
                              seq=args.seq_len, hardware=args.hardware, optimizer=args.optimizer)
    except FullShardError as e:
        return fatal(str(e))
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {dims}, {params / 1e6:.1f}M parameters; world {args.world_size}, batch {args.batch} x {args.seq_len} "
          f"per rank; {plan.hardware.name}; budget {budget / 2**20:.0f} MiB per rank\n")
    print(plan.table())
    print("\n" + plan.explain())
    if plan.hardware.device == "cpu":
        print("\nPeaks are each rank's whole process, as `fullshard train` reports them, less the text it trains on "
              "(train adds it: the default corpus is about 30 MiB); a plan fits when its peak and 10% do.")
    else:
        print(f"\nPeaks are torch.cuda.max_memory_allocated, as `fullshard train` reports them on GPUs; a plan fits "
              f"when its peak and the runtime ({plan.hardware.name}'s CUDA context and NCCL buffers) do.")
    return 0


def pipeline_plan(args: argparse.Namespace, budget: int, dims: dict) -> int:
    """`fullshard plan --pp P`: each stage of `fullshard train --pp` (gpt.GPTStage) planned over its
    world-size / P ranks, its peak with the activations 1F1B keeps in flight (stage s holds
    P - s microbatches' at once), and the pipeline's step: each microbatch passes the slowest
    stage, and for P - 1 microbatch-times of the step a stage waits (the bubble)."""
    import torch

    import fullshard
    from fullshard.gpt import GPTConfig, GPTStage

    stages, microbatches = args.pp, args.microbatches or args.pp
    if args.world_size % stages or dims["n_layer"] < stages or microbatches < stages:
        return fatal(f"--pp {stages} needs a --world-size it divides (not {args.world_size}), a block a stage (the "
                     f"GPT has {dims['n_layer']}) and at least as many --microbatches (not {microbatches})")
    per_stage = -(-dims["n_layer"] // stages)
    rows, slowest = [], 0.0
    for s in range(stages):
        with torch.device("meta"):
            stage = GPTStage(GPTConfig(block_size=args.seq_len, vocab_size=args.vocab, **dims),
                             range(s * per_stage, min(dims["n_layer"], (s + 1) * per_stage)))
        try:
            plan = fullshard.plan(stage, world_size=args.world_size // stages, memory_budget=budget, batch=args.batch,
                                  seq=args.seq_len, hardware=args.hardware, optimizer=args.optimizer)
        except FullShardError as e:
            return fatal(f"stage {s + 1} of {stages}: {e}")
        chosen = plan.chosen
        in_flight = min(stages - s, microbatches)
        peak = chosen.peak + (in_flight - 1) * chosen.memory.get("activations", 0)
        slowest = max(slowest, chosen.step_s)
        rows.append(f"| {s + 1} | {len(stage.h)} | {chosen.strategy} | {chosen.precision} | {in_flight} | "
                    f"{peak / 2**20:.0f} | {chosen.step_s:.3f} |")
    step = (microbatches + stages - 1) * slowest
    print(f"GPT {dims} in {stages} stages (1F1B, {microbatches} microbatches of {args.batch} x {args.seq_len} "
          f"per data-parallel rank), {args.world_size // stages} ranks each; budget {budget / 2**20:.0f} MiB per "
          f"rank\n")
    print("| stage | blocks | strategy | precision | microbatches in flight | peak MiB per rank | s per microbatch |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nstep: ({microbatches} microbatches + {stages - 1}) x the slowest stage's {slowest:.3f} s = {step:.3f} s; "
          f"the bubble is {(stages - 1) / (microbatches + stages - 1):.0%} of it (more --microbatches shrink it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
