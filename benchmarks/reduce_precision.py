"""The error of each way to average gradients over the data-parallel ranks, against float64.

    PYTHONPATH=src python benchmarks/reduce_precision.py [--worlds 2,4,8] [--numel 1000000]

Each rank's gradient of one weight of `numel` values is its input (the weight is used as
sum(w * x)): a common part and a rank's own part of equal size, normal values scaled by 10^-3
to 10^2 per 100 values, as gradients of one layer differ in scale. fullshard runs on gloo
ranks (one process per rank, 127.0.0.1) with the weight in one unit, for each world size:
float32 reductions, reduce_dtype=bf16, and reduce_send_dtype bf16 and int8 (Note
[low-precision reductions]). Next to them, one process simulates NCCL's ring reduce-scatter
in bf16: the chunk of each rank starts at the next rank and travels the ring, each hop adding
its rank's bf16 values to the partial sum in float32 and rounding it to bf16 (NCCL's kernels
load, add and store so), then the sum is divided by the world and rounded. Printed: the
relative error ||got - exact|| / ||exact|| (2-norm) of the averaged gradient, and the
largest error of one value relative to the mean magnitude of its addends.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WAYS = {"fp32": None, "bf16 reduce (gloo)": dict(reduce_dtype=torch.bfloat16),
        "bf16 sent, fp32 sum": dict(reduce_send_dtype=torch.bfloat16),
        "int8 sent, fp32 sum": dict(reduce_send_dtype=torch.int8),
        "bf16 reduce, bf16 sent": dict(reduce_dtype=torch.bfloat16, reduce_send_dtype=torch.bfloat16)}


def gradient(rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s gradient: a part every rank shares and one of its own, alike in size."""
    common, own = torch.Generator().manual_seed(10_000), torch.Generator().manual_seed(rank)
    scales = (10 ** (torch.rand(-(-numel // 100), generator=common) * 5 - 3)).repeat_interleave(100)[:numel]
    return (torch.randn(numel, generator=common) + torch.randn(numel, generator=own)) * scales


def errors(got: torch.Tensor, xs: list[torch.Tensor]) -> tuple[float, float]:
    exact = sum(x.double() for x in xs) / len(xs)
    size = sum(x.double().abs() for x in xs) / len(xs)
    diff = got.double() - exact
    return (diff.norm() / exact.norm()).item(), (diff.abs() / size).max().item()


def ring_bf16(xs: list[torch.Tensor]) -> torch.Tensor:
    """NCCL's ring reduce-scatter of bf16 rows, averaged, simulated in one process."""
    world = len(xs)
    chunks = [x.to(torch.bfloat16).chunk(world) for x in xs]
    out = []
    for owner in range(world):
        order = [(owner + 1 + k) % world for k in range(world)]  # ends at the owner
        partial = chunks[order[0]][owner]
        for r in order[1:]:
            partial = (partial.float() + chunks[r][owner].float()).to(torch.bfloat16)
        out.append((partial.float() / world).to(torch.bfloat16))
    return torch.cat(out)


def sent_bf16(xs: list[torch.Tensor]) -> torch.Tensor:
    """fullshard's reduce_send_dtype=bf16 in one process: each rank adds its own float32 row,
    then every peer's bf16 row in rank order, in float32, and divides (Note [low-precision
    reductions]); checked equal to the ranks' result at the measured world sizes."""
    world = len(xs)
    out = []
    for owner in range(world):
        total = xs[owner].chunk(world)[owner].clone()
        for r in range(world):
            if r != owner:
                total += xs[r].chunk(world)[owner].to(torch.bfloat16).float()
        out.append(total / world)
    return torch.cat(out)


class Weight(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def rank_main(rank: int, world: int, port: int, numel: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import fullshard

    x = gradient(rank, numel)
    results = {}
    for way, policy in WAYS.items():
        model = Weight(numel)
        fullshard.fully_shard(model, mp_policy=fullshard.MixedPrecisionPolicy(**policy) if policy else None)
        with fullshard.stats(model) as stats:
            model(x).backward()
            sent = stats.reduce_scatter_bytes
        got = model.w.grad.full_tensor()
        results[way] = (got, sent)
    if rank == 0:
        xs = [gradient(r, numel) for r in range(world)]
        simulated = torch.equal(sent_bf16(xs), results["bf16 sent, fp32 sum"][0])
        queue.put({way: (*errors(got, xs), sent) for way, (got, sent) in results.items()} |
                  {"NCCL ring, bf16 (simulated)": (*errors(ring_bf16(xs), xs), 0), "simulated": simulated})
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--simulate", default="16,64", help="world sizes simulated in one process only")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    table = {}
    for world in worlds:
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(rank_main, args=(world, free_port(), args.numel, queue), nprocs=world)
        table[world] = queue.get()
        print(f"world {world} done", file=sys.stderr, flush=True)
    assert all(table[w].pop("simulated") for w in worlds), "the simulation of bf16 sent is not what ranks compute"
    ways = list(table[worlds[0]])
    print("relative error ||got - exact|| / ||exact|| (largest error of a value / its addends' mean size)\n")
    print("| way | " + " | ".join(f"world {w}" for w in worlds) + " |")
    print("|---|" + "---|" * len(worlds))
    for way in ways:
        print(f"| {way} | " + " | ".join(f"{table[w][way][0]:.2e} ({table[w][way][1]:.1e})" for w in worlds) + " |")
    print("\nsimulated in one process (the bf16-sent simulation equals the ranks' result bitwise at the worlds "
          "above)\n")
    simulated = [int(w) for w in args.simulate.split(",")]
    print("| way | " + " | ".join(f"world {w}" for w in simulated) + " |")
    print("|---|" + "---|" * len(simulated))
    rows = {"bf16 sent, fp32 sum": [], "NCCL ring, bf16": []}
    for world in simulated:
        xs = [gradient(r, args.numel // world * world) for r in range(world)]
        rows["bf16 sent, fp32 sum"].append(errors(sent_bf16(xs), xs))
        rows["NCCL ring, bf16"].append(errors(ring_bf16(xs), xs))
    for way, figures in rows.items():
        print(f"| {way} | " + " | ".join(f"{a:.2e} ({b:.1e})" for a, b in figures) + " |")
    print("\nbytes a rank sends in the reduce-scatter (ratio to fp32)\n")
    print("| way | " + " | ".join(f"world {w}" for w in worlds) + " |")
    print("|---|" + "---|" * len(worlds))
    for way in ways[:-1]:
        print(f"| {way} | " + " | ".join(f"{table[w][way][2]:,} ({table[w][way][2] / table[w]['fp32'][2]:.3f})"
                                         for w in worlds) + " |")


if __name__ == "__main__":
    main()
