"""Time the ways to all-gather and reduce-scatter a flat buffer on the backend in use.

    torchrun --standalone --nproc_per_node 2 benchmarks/gloo_collectives.py

Each way moves the same logical data: an all-gather builds [world * n] from every
rank's [n]; a reduce-scatter leaves each rank the sum of its [n] row of a [world, n]
input. Ways are alternated round by round; the first tables show medians per call
after a barrier. The last ones time the two ways gloo takes inside a step (Note
[collective choice]), point-to-point and all_to_all, each call after a few matrix
products and no barrier, as between a unit's compute: mean and median per call, for
shards (messages to each peer) from 100 KB to 32 MB.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
ROUNDS = int(os.environ.get("ROUNDS", 15))


def all_gather_single(n):
    x, out = torch.randn(n), torch.empty(world * n)
    return lambda: dist.all_gather_into_tensor(out, x)


def all_gather_list(n):
    x, outs = torch.randn(n), [torch.empty(n) for _ in range(world)]
    return lambda: dist.all_gather(outs, x)


def all_gather_by_all_reduce(n):
    out = torch.zeros(world * n)
    def run():
        out.zero_()
        out[rank * n:(rank + 1) * n] = 1.0
        dist.all_reduce(out)
    return run


def all_gather_by_broadcast(n):
    out = torch.empty(world * n)
    return lambda: [dist.broadcast(out[r * n:(r + 1) * n], src=r) for r in range(world)]


def all_gather_by_p2p(n):
    x, out = torch.randn(n), torch.empty(world * n)
    def run():
        out[rank * n:(rank + 1) * n] = x
        works = [dist.isend(x, r) for r in range(world) if r != rank]
        works += [dist.irecv(out[r * n:(r + 1) * n], r) for r in range(world) if r != rank]
        for w in works:
            w.wait()
    return run


def all_gather_by_all_to_all(n):
    x, send, out = torch.randn(n), torch.empty(world * n), torch.empty(world * n)
    def run():
        send.view(world, n).copy_(x.expand(world, n))
        dist.all_to_all_single(out, send)
    return run


def reduce_scatter_single(n):
    x, out = torch.randn(world * n), torch.empty(n)
    return lambda: dist.reduce_scatter_tensor(out, x)


def reduce_scatter_list(n):
    xs, out = list(torch.randn(world * n).chunk(world)), torch.empty(n)
    return lambda: dist.reduce_scatter(out, xs)


def reduce_scatter_by_all_reduce(n):
    x = torch.randn(world * n)
    return lambda: dist.all_reduce(x)


def reduce_scatter_by_reduce(n):
    x = torch.randn(world * n)
    return lambda: [dist.reduce(x[r * n:(r + 1) * n], dst=r) for r in range(world)]


def reduce_scatter_by_all_to_all(n):
    x, rows = torch.randn(world * n), torch.empty(world * n)
    def run():
        dist.all_to_all_single(rows, x)
        return rows.view(world, n).sum(0)
    return run


def reduce_scatter_by_p2p(n):
    x, rows = torch.randn(world * n), torch.empty(world, n)
    def run():
        works = [dist.isend(x[r * n:(r + 1) * n], r) for r in range(world) if r != rank]
        works += [dist.irecv(rows[r], r) for r in range(world) if r != rank]
        for w in works:
            w.wait()
        rows[rank] = x[rank * n:(rank + 1) * n]
        return rows.sum(0)
    return run


WAYS = [all_gather_single, all_gather_list, all_gather_by_all_reduce, all_gather_by_broadcast, all_gather_by_p2p,
        all_gather_by_all_to_all,
        reduce_scatter_single, reduce_scatter_list, reduce_scatter_by_all_reduce, reduce_scatter_by_reduce,
        reduce_scatter_by_all_to_all, reduce_scatter_by_p2p]
def timed(ways, n: int, rounds: int, before) -> dict[str, list[float]]:
    """Seconds per call of each way at shard size `n`, alternated round by round, each call after `before()`."""
    fns = {way.__name__: way(n) for way in ways}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            before()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


for mb in (1, 8, 32):
    n = mb * 2**20 // 4 // world  # each rank's shard; the full buffer is `mb` MiB of fp32
    times = timed(WAYS, n, ROUNDS, dist.barrier)
    if rank == 0:
        print(f"\nfull buffer {mb} MiB (shard {n * 4 / 2**20:.1f} MiB), world {world}, median ms:")
        for name, ts in times.items():
            print(f"  {name:30s} {1e3 * statistics.median(ts):8.2f}")

weights = torch.randn(128, 128)
for kb in (100, 1000, 8000, 32000):
    times = timed((all_gather_by_p2p, all_gather_by_all_to_all, reduce_scatter_by_p2p, reduce_scatter_by_all_to_all),
                  kb * 1000 // 4, ROUNDS * 10 if kb < 1000 else ROUNDS, lambda: [weights @ weights for _ in range(3)])
    if rank == 0:
        print(f"\nbetween matrix products: shard {kb} KB, world {world}, mean / median ms:")
        for name, ts in times.items():
            print(f"  {name:30s} {1e3 * statistics.mean(ts):8.2f} {1e3 * statistics.median(ts):8.2f}")
dist.destroy_process_group()
