"""The training stall of a checkpoint: fullshard's blocking save, fullshard's background save
(save(block=False)), and torch.distributed.checkpoint's async_save of PyTorch's FSDP2.

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/save_stall.py [preset] [rounds] [dir]

Both models are the benchmark GPT (fullshard bench's presets, 100m unless told), a unit per
block and the root, AdamW, fp32, with every optimizer state present. Each measure trains 4
steps, saves, and trains on until the save has finished and one step more; the ways are
alternated round by round (A B C A B C ...); each way saves to one path, replacing its last
checkpoint every round (fullshard switches LATEST and removes the old version, DCP
overwrites its files). The stall of a save is the wall time its steps
took beyond as many steps of the median step before it: the call itself, plus the slowdown
of the steps that ran while the background write competed for the cores. Also printed: the
call's own time (the staging copy, for the background saves), the seconds until the
checkpoint was complete (host memory: benchmarks/checkpoint_memory.py, where no training
step runs beside the save).
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fullshard
from fullshard.cli.bench import BATCHES, build_model
from fullshard.gpt import Block

WAYS = ["fullshard blocking", "fullshard background", "FSDP2 + DCP async_save"]

dist.init_process_group("gloo")
torch.set_num_threads(1)
preset = sys.argv[1] if len(sys.argv) > 1 else "100m"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
root = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.gettempdir())
rank, world = dist.get_rank(), dist.get_world_size()
batch, seq = BATCHES[preset]
generator = torch.Generator().manual_seed(rank)


def fsdp2_model():
    from torch.distributed.fsdp import fully_shard

    model = build_model(preset)
    for block in model.h:
        fully_shard(block)
    return fully_shard(model)


ours = fullshard.shard_model(build_model(preset), wrap={Block})
theirs = fsdp2_model()
optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (ours, theirs)}
dcp_group = dist.new_group(backend="gloo")  # DCP's advice: async saves on a group of their own


def train_step(model) -> float:
    dist.barrier()
    start = time.perf_counter()
    x = torch.randint(0, 256, (batch // world, seq + 1), generator=generator)
    model(x[:, :-1], x[:, 1:]).backward()
    optimizers[id(model)].step()
    optimizers[id(model)].zero_grad()
    dist.barrier()
    return time.perf_counter() - start


def save(way: str, path: Path):
    """Start the save; returns a function of `wait` that says whether it has finished (waiting when asked)."""
    if way == "fullshard blocking":
        fullshard.save(path, ours, optimizers[id(ours)], step=1)
        return lambda wait: True
    if way == "fullshard background":
        handle = fullshard.save(path, ours, optimizers[id(ours)], step=1, block=False)

        def finished(wait: bool) -> bool:
            if wait:
                handle.result()
            return handle.done()
        return finished
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(theirs, optimizers[id(theirs)])
    future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), process_group=dcp_group)
    future = getattr(future, "upload_completion", future)  # newer torch returns a pair of futures

    def finished(wait: bool) -> bool:
        if wait:
            future.result()
        return future.done()
    return finished


def measure(way: str, index: int) -> tuple[float, ...]:
    """One save of `way` to its own path (the same every round: each save replaces the last,
    as a run that keeps one checkpoint does)."""
    model = theirs if way.startswith("FSDP2") else ours
    before = [train_step(model) for _ in range(4)]
    dist.barrier()
    start = time.perf_counter()
    finished = save(way, root / f"save-stall-{index}")
    call = time.perf_counter() - start
    steps = 0
    while True:  # the ranks agree on whether every rank's write has ended
        done = torch.tensor([float(finished(False))])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            break
        train_step(model)
        steps += 1
    finished(wait=True)
    complete = time.perf_counter() - start
    train_step(model)
    steps += 1
    spent = time.perf_counter() - start
    return spent - steps * statistics.median(before), call, complete, statistics.median(before)


results = {way: [] for way in WAYS}
for r in range(rounds):
    for i, way in enumerate(WAYS):
        results[way].append(measure(way, i))
if rank == 0:
    shard = sum(p.to_local().numel() * 4 for p in ours.parameters())
    print(f"{preset}, world {world}, AdamW fp32: this rank's shards {shard / 2**20:.0f} MB + optimizer state "
          f"{2 * shard / 2**20:.0f} MB; {rounds} rounds, medians\n")
    print("| way | stall per checkpoint, s | the call, s | until complete, s | step, s |")
    print("|---|---|---|---|---|")
    for way in WAYS:
        med = [statistics.median(m[k] for m in results[way]) for k in range(4)]
        print(f"| {way} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {med[3]:.2f} |")
    staged = fullshard.checkpoint.background.staging_of(ours).bytes()
    print(f"\nfullshard's staging buffers (kept for the next save): {staged / 2**20:.0f} MB per rank")
dist.barrier()
dist.destroy_process_group()
