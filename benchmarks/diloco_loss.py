"""Does DiLoCo train? fullshard.DiLoCo against synchronous training and one replica alone.

    PYTHONPATH=src .venv/bin/python benchmarks/diloco_loss.py [steps] [seeds] [OUT.png]

The tiny GPT (fullshard.gpt.PRESETS["tiny"]) on the CLI's corpus (Python's standard library,
bytes), sequences of 64, a global batch of 16, AdamW (lr 3e-3, no decay) inside. Each run is a
fresh 2-process gloo launch; every rank shards its model over itself, so each rank is one
replica group, training on its half of each global batch:
- sync: synchronous hybrid sharding (shard groups of 1 rank, the gradients all-reduced across
  the two at every step), the whole global batch a step;
- H=... : DiLoCo over the 2 replicas (Nesterov SGD, lr 0.7, momentum 0.9; once plain averaging,
  lr 1 without momentum), syncing every H steps, fp32 or int8 outer gradients, 1 fragment or 3
  (a unit each) with overlap (streaming);
- alone: one rank, its replica's half batch only (what DiLoCo must beat).
Reported: the validation loss at the end (32 batches of the validation text, the model replica 0
holds after the last step: with 400 steps and one fragment, right after a sync), mean and spread
over seeds, and the bytes a rank sends to the other replica per step; with OUT.png, the
training-loss curves (replica 0's).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SEQ, GLOBAL_BATCH, LR, EVAL_BATCHES = 64, 16, 3e-3, 32
RUNS = {  # name: (sync_every, fragments, outer dtype, overlap, outer lr, outer momentum); None: not DiLoCo
    "sync": None, "H=10": (10, 1, "fp32", False, 0.7, 0.9), "H=50": (50, 1, "fp32", False, 0.7, 0.9),
    "H=100": (100, 1, "fp32", False, 0.7, 0.9), "H=50 int8": (50, 1, "int8", False, 0.7, 0.9),
    "H=50 K=3 overlap int8": (50, 3, "int8", True, 0.7, 0.9),
    "H=50, outer lr 1, no momentum": (50, 1, "fp32", False, 1.0, 0.0), "alone": None,
}
DTYPES = {"fp32": torch.float32, "int8": torch.int8}


def run(rank: int, world: int, name: str, seed: int, steps: int, out: str) -> None:
    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(out + ".store", world), rank=rank, world_size=world)
    import fullshard
    from fullshard.cli.corpus import batch_offsets, batch_rows, corpus
    from fullshard.gpt import GPT, PRESETS, GPTConfig

    train_data, val_data, _ = corpus(None)
    train_data, val_data = torch.frombuffer(train_data, dtype=torch.uint8), torch.frombuffer(val_data, dtype=torch.uint8)
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=SEQ, **PRESETS["tiny"]))
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    if name != "sync":  # each rank shards its own model (a group of 1); sync: hybrid, all-reducing each step
        mesh = mesh["shard"]
    for block in model.h:
        fullshard.fully_shard(block, mesh=mesh)
    fullshard.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    settings = RUNS[name]
    if settings is not None:
        sync_every, fragments, dtype, overlap, outer_lr, outer_momentum = settings
        optimizer = fullshard.DiLoCo(model, optimizer, dist.group.WORLD, sync_every=sync_every, fragments=fragments,
                                     outer_dtype=DTYPES[dtype], overlap=overlap,
                                     outer_optimizer=lambda params: torch.optim.SGD(
                                         params, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0))
    losses = []
    for step in range(steps):
        offsets = batch_offsets(len(train_data), step, seed=seed, seq_len=SEQ, batch=GLOBAL_BATCH)
        mine = offsets.chunk(world)[rank] if name != "alone" else offsets.chunk(2)[0]
        loss = model(*batch_rows(train_data, mine, SEQ, "cpu"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if settings is not None:
        optimizer.finish()  # overlap: the last step's sync
    model.eval()
    with torch.no_grad():
        val = sum(model(*batch_rows(val_data, batch_offsets(len(val_data), -1 - i, seed=0, seq_len=SEQ,
                                                             batch=GLOBAL_BATCH), SEQ, "cpu")).item()
                  for i in range(EVAL_BATCHES)) / EVAL_BATCHES
    if rank == 0:
        sent = optimizer.bytes_sent if settings is not None else fullshard.stats(model).cross_group_bytes
        with open(out, "w") as f:
            json.dump({"losses": losses, "val": val, "sent_per_step": sent / steps}, f)
    dist.destroy_process_group()


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    plot = sys.argv[3] if len(sys.argv) > 3 else None
    results: dict[str, list[dict]] = {name: [] for name in RUNS}
    for seed in range(seeds):
        for name in RUNS:
            with tempfile.TemporaryDirectory() as scratch:
                world, out = (1 if name == "alone" else 2), os.path.join(scratch, "result.json")
                mp.spawn(run, args=(world, name, seed, steps, out), nprocs=world)
                results[name].append(json.loads(open(out).read()))
            print(f"seed {seed} {name}: validation loss {results[name][-1]['val']:.4f}", file=sys.stderr, flush=True)
    print(f"| run | validation loss at step {steps}, mean of {seeds} seeds | spread (max - min) | "
          f"bytes to the other replica per step per rank |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        vals = [r["val"] for r in runs]
        sent = "-" if name == "alone" else f"{statistics.median(r['sent_per_step'] for r in runs):,.0f}"
        print(f"| {name} | {statistics.fmean(vals):.4f} | {max(vals) - min(vals):.4f} | {sent} |")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, runs in results.items():
            mean = [statistics.fmean(v) for v in zip(*(r["losses"] for r in runs))]
            window = 20
            smooth = [statistics.fmean(mean[max(0, i - window + 1): i + 1]) for i in range(len(mean))]
            ax.plot(range(1, len(smooth) + 1), smooth, label=name, linewidth=0.9)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (replica 0, mean of {seeds} seeds, {window}-step mean)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=110)


if __name__ == "__main__":
    main()
