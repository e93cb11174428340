"""Training-step benchmark: fullshard against torch FSDP2, FSDP1, DDP and one process.

    fullshard bench                        # or: make bench, or benchmarks/bench_step.py
    fullshard bench --presets 15m --rounds 2 --dtypes fp32,bf16

Every implementation trains the same GPT on the same data at world 2 (gloo on CPU,
one thread per rank; "single" is one process with one thread on the whole global
batch), sharded per block; torch's implementations with their defaults, fullshard
with `forward_prefetch=True`. Implementations are alternated run by run (A B C ... A B C ...) so that the
machine's drift hits all alike; each run is a fresh torchrun launch. Reported per
implementation, medians over runs:

- step: wall time of a training step (forward, backward, clip, optimizer step);
- cpu: CPU-seconds per step summed over ranks (user + system, all threads);
- rss: peak resident memory of the busiest rank (the OS's ru_maxrss);
- sent: bytes a rank sends per step, as the backend's algorithms move them;
- loss: the final loss (same data everywhere, so it must agree);
- syncs: fullshard's host syncs per step (forward, backward, clip) with the non-finite
  check on, as `fullshard train` runs by default (without offload: the one read of every
  unit's non-finite flag), counted after the measurements on a model of CUDA streams
  (fullshard.testing.stream_model): on a GPU each stalls the host until the GPU catches up. A
  small constant, whatever the number of units;
and each figure's ratio to FSDP2's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCHES = {"15m": (8, 128), "100m": (4, 128)}  # preset (fullshard.gpt.PRESETS) -> (global batch, sequence)
IMPLS = ["fullshard", "fsdp2", "fsdp1", "ddp", "single"]
RUN_TIMEOUT_S = 600  # one torchrun launch: its steps take seconds to minutes


def build_model(preset: str):
    import torch
    from fullshard.gpt import GPT, PRESETS, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=BATCHES[preset][1], vocab_size=256, **PRESETS[preset]))


def wrap(impl: str, model, dtype: str):
    """Shard or replicate `model` as `impl` does; returns (model, bytes sent per step or None)."""
    import torch
    from fullshard.gpt import Block

    bf16 = dtype == "bf16"
    if impl == "fullshard":
        import fullshard
        mp = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
        return fullshard.shard_model(model, wrap={Block}, mp_policy=mp, forward_prefetch=True)
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
        for block in model.h:
            fully_shard(block, mp_policy=mp)
        return fully_shard(model, mp_policy=mp)
    if impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        mp = MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                        device_id=torch.device("cpu"), mixed_precision=mp, use_orig_params=True)
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    return model


def sent_bytes_per_step(impl: str, model, step) -> int:
    """Bytes this rank sends in one step, from the collectives the step issues.

    fullshard reports its own (fullshard.stats). For torch's implementations the c10d
    calls are logged and converted with gloo's algorithms: all-gather and ring
    all-reduce send (N-1)/N and 2(N-1)/N of the buffer; gloo's reduce-scatter runs an
    all-reduce of the whole input. DDP reduces in C++ (invisible to the log): one
    all-reduce of every gradient.
    """
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    world = dist.get_world_size()
    if impl == "fullshard":
        import fullshard
        with fullshard.stats(model) as s:
            step()
        return s.sent_bytes
    if impl == "ddp":
        step()
        return sum(2 * (world - 1) * p.numel() * p.element_size() // world for p in model.parameters())

    class Log(TorchDispatchMode):
        sent = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if func.namespace == "c10d":
                if name.startswith(("_allgather_base", "allgather_")):  # FSDP2; FSDP1 (list form)
                    shard = args[1] if name.startswith("_allgather_base") else args[1][0]
                    self.sent += (world - 1) * shard.numel() * shard.element_size()
                elif name.startswith(("_reduce_scatter_base", "allreduce")):
                    t = args[1] if name.startswith("_reduce") else args[0][0]
                    self.sent += 2 * (world - 1) * t.numel() * t.element_size() // world
            return func(*args, **(kwargs or {}))

    with Log() as log:
        step()
    return log.sent


def host_syncs_per_step(model, batch: tuple, optimizer) -> int:
    """fullshard's host syncs in one training step (forward, backward, clip) as `fullshard
    train` runs it, with the non-finite check on (its default): counted on
    fullshard.testing.stream_model's model of CUDA streams. The step's gradients are dropped and
    the model's own non-finite policy is left as it was."""
    import fullshard
    from fullshard import runtime
    from fullshard.hooks import units_under
    from fullshard.testing.stream_model import StreamModel

    policies = [unit.switches.nonfinite for unit in units_under(model)]
    model.set_nonfinite_grads("raise")
    model_rt = StreamModel()
    try:
        with runtime.installed(model_rt), model_rt.tracking(), model_rt.counting_scalars():
            model(*batch).backward()
            fullshard.clip_grad_norm_(model, 1.0)
    finally:
        for unit, policy in zip(units_under(model), policies):
            unit.switch(nonfinite=policy)
        optimizer.zero_grad()
    return model_rt.host_syncs


def worker(args: argparse.Namespace) -> None:
    """One run: train `args.steps` timed steps after warm-up; rank 0 writes the figures."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    distributed = args.impl != "single"
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    model = wrap(args.impl, build_model(args.preset), args.dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    global_batch, seq = BATCHES[args.preset]
    generator = torch.Generator().manual_seed(0)
    local = global_batch // world
    autocast = args.dtype == "bf16" and args.impl in ("ddp", "single")

    def step() -> float:
        data = torch.randint(0, 256, (global_batch, seq + 1), generator=generator)[rank * local:(rank + 1) * local]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        if args.impl == "fsdp1":
            model.clip_grad_norm_(1.0)
        elif args.impl == "fullshard":
            import fullshard
            fullshard.clip_grad_norm_(model, 1.0)
        elif args.impl == "fsdp2":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            norm.full_tensor()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach().float()
        if distributed:
            dist.all_reduce(loss)
        return loss.item() / world

    for _ in range(args.warmup):
        step()
    if distributed:
        sent = sent_bytes_per_step(args.impl, model, step)
    else:
        step()  # as many steps as the distributed runs take
        sent = 0
    times, losses = [], []
    cpu0 = time.process_time()
    for _ in range(args.steps):
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu0) / args.steps
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    syncs = -1  # not counted
    if args.impl == "fullshard":  # after the measurements, on a batch of its own: the figures above stay alike
        data = torch.randint(0, 256, (global_batch, seq + 1), generator=torch.Generator().manual_seed(1))
        data = data[rank * local:(rank + 1) * local]
        syncs = host_syncs_per_step(model, (data[:, :-1], data[:, 1:]), optimizer)
    figures = torch.tensor([cpu, rss], dtype=torch.float64)
    if distributed:
        gathered = [torch.zeros_like(figures) for _ in range(world)]
        dist.all_gather(gathered, figures)
    else:
        gathered = [figures]
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "step": statistics.median(times), "cpu": sum(g[0].item() for g in gathered),
            "rss": max(g[1].item() for g in gathered), "sent": sent, "loss": losses[-1], "syncs": syncs}))
    if distributed:
        dist.barrier()
        # Note [exit] in fullshard/mesh.py, for every implementation: torch's FSDP2 too sits in
        # reference cycles, and a gloo group it holds freed in the interpreter's shutdown aborts
        # now and then (twice in a row in one bench on 2026-12-05, which ended it); freed here
        model = optimizer = None
        gc.collect()
        dist.destroy_process_group()


def launch(impl: str, preset: str, dtype: str, steps: int, warmup: int) -> dict:
    """One fresh run; a run that crashes is tried once more and the retry is reported (a
    gloo process group freed during the interpreter's shutdown aborts now and then: Note
    [exit] in fullshard/mesh.py, which `worker` follows)."""
    try:
        return launch_once(impl, preset, dtype, steps, warmup)
    except RuntimeError as e:
        print(f"retrying {impl} {preset} {dtype} after: {str(e).splitlines()[-1][:200]}", flush=True)
        return launch_once(impl, preset, dtype, steps, warmup)


def launch_once(impl: str, preset: str, dtype: str, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={1 if impl == 'single' else 2}", "-m", "fullshard.cli.bench", "--worker", "--impl", impl,
               "--preset", preset, "--dtype", dtype, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        try:  # a run that hangs (a rank stuck at exit) fails, and is retried once, instead of stopping the bench
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{impl} {preset} {dtype} did not end within {RUN_TIMEOUT_S} s:\n"
                               f"{(e.stderr or b'')[-4000:]!r}") from None
        if done.returncode:
            raise RuntimeError(f"{impl} {preset} {dtype} failed:\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def table(preset: str, dtype: str, runs: dict[str, list[dict]]) -> str:
    med = {impl: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for impl, rs in runs.items()}
    base = med.get("fsdp2")
    lines = [f"\n### {preset}, {dtype}, world 2 ({len(next(iter(runs.values())))} alternating runs)\n",
             "| impl | step s | cpu s/step | peak RSS MB | sent MB/step | final loss | host syncs/step | step / FSDP2 "
             "| cpu / FSDP2 | RSS / FSDP2 | sent / FSDP2 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for impl, m in med.items():
        ratios = [f"{m[k] / base[k]:.2f}" if base and base[k] else "-" for k in ("step", "cpu", "rss", "sent")]
        syncs = f"{m['syncs']:.0f}" if m.get("syncs", -1) >= 0 else "-"
        lines.append(f"| {impl} | {m['step']:.3f} | {m['cpu']:.3f} | {m['rss'] / 2**20:.0f} | {m['sent'] / 2**20:.1f} "
                     f"| {m['loss']:.4f} | {syncs} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fullshard bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="15m,100m")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--dtypes", default="fp32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    for name, given, known in (("preset", args.presets, BATCHES), ("impl", args.impls, IMPLS),
                               ("dtype", args.dtypes, ("fp32", "bf16"))):
        if unknown := [x for x in given.split(",") if x not in known]:
            parser.error(f"unknown --{name}s {','.join(unknown)}; choose from {','.join(known)}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  fullshard bench {' '.join(argv if argv is not None else sys.argv[1:])}",
          flush=True)
    for preset in args.presets.split(","):
        for dtype in args.dtypes.split(","):
            runs: dict[str, list[dict]] = {impl: [] for impl in args.impls.split(",")}
            for _ in range(args.rounds):
                for impl in runs:
                    runs[impl].append(launch(impl, preset, dtype, args.steps, args.warmup))
            print(table(preset, dtype, runs), flush=True)


if __name__ == "__main__":
    main()
