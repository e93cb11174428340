"""Host time per step and per unit: fullshard against torch's FSDP2 and DDP on a GPT so small
that the step is the framework's own work (issue #27's measure).

    .venv/bin/python benchmarks/host_time.py [rounds] [steps]

A GPT of 2 blocks (width 64, 2 heads, vocabulary 512, sequence 32), global batch 4, on 2
gloo ranks, fp32, SGD: fullshard (shard_model, a unit per block and the root), FSDP2
(fully_shard per block, then the root), each with its defaults and with forward prefetch
("+fp": fullshard's forward_prefetch=True; FSDP2's set_modules_to_forward_prefetch of the
next unit on each unit), and DDP, alternated round by round (A B C A B C ...), each round `steps` timed steps after 3 warm-up ones. Times are rank 0's, medians over
every step of every round: the step, its forward and its backward (each ended by a barrier,
so a rank waiting for its peer counts), as wall time and as the main thread's CPU time
(time.thread_time: the host's own work, not its waits nor gloo's threads). Per unit:
(implementation - DDP) / 3 units.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

IMPLS = ("fullshard", "fullshard+fp", "fsdp2", "fsdp2+fp", "ddp")
UNITS = 3


def build(impl: str) -> torch.nn.Module:
    from fullshard.gpt import GPT, Block, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=512, n_layer=2, n_head=2, n_embd=64))
    if impl.startswith("fullshard"):
        import fullshard

        fullshard.shard_model(model, wrap={Block}, forward_prefetch=impl.endswith("+fp"))
    elif impl.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        fully_shard(model)
        if impl.endswith("+fp"):  # each unit gathers the next one before it runs
            units = [model, *model.h]
            for unit, after in zip(units, units[1:]):
                unit.set_modules_to_forward_prefetch([after])
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model


def timed_round(impl: str, steps: int) -> list[tuple[float, ...]]:
    model = build(impl)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    out = []
    for i in range(steps + 3):
        x = torch.randint(0, 512, (2, 33), generator=generator)
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.thread_time()
        loss = model(x[:, :-1], x[:, 1:])
        cpu_forward = time.thread_time()
        dist.barrier()
        forward = time.perf_counter()
        cpu_forward_end = time.thread_time()
        loss.backward()
        cpu_backward = time.thread_time()
        dist.barrier()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        cpu_end = time.thread_time()
        dist.barrier()
        end = time.perf_counter()
        if i >= 3:
            out.append((end - start, forward - start, backward - forward,
                        cpu_end - cpu_start - (cpu_forward_end - cpu_forward), cpu_forward - cpu_start,
                        cpu_backward - cpu_forward_end))
    return out


def overhead_ratio(round_times: dict[str, list[tuple[float, ...]]], suffix: str, at: int) -> float:
    """One round's (fullshard - DDP) / (FSDP2 - DDP) of the medians at column `at`."""
    med = {impl: statistics.median(t[at] for t in round_times[impl]) for impl in round_times}
    return (med["fullshard" + suffix] - med["ddp"]) / (med["fsdp2" + suffix] - med["ddp"])


def worker(rank: int, port: int, rounds: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    times: dict[str, list[tuple[float, ...]]] = {impl: [] for impl in IMPLS}
    per_round: list[dict[str, list[tuple[float, ...]]]] = []
    for _ in range(rounds):
        per_round.append({})
        for impl in IMPLS:
            per_round[-1][impl] = timed_round(impl, steps)
            times[impl] += per_round[-1][impl]
    if rank == 0:
        med = {impl: [statistics.median(t[k] for t in times[impl]) * 1e3 for k in range(6)] for impl in IMPLS}
        print(f"tiny GPT (2 blocks, width 64, vocab 512, seq 32, global batch 4), world 2 gloo, fp32, "
              f"{rounds} rounds x {steps} steps, medians (ms)")
        for title, at in (("wall time", 0), ("main thread's CPU time", 3)):
            print(f"\n{title}:\n")
            print("| | step | forward | backward | step - DDP | forward per unit - DDP | backward per unit - DDP |")
            print("|---|---|---|---|---|---|---|")
            ddp = med["ddp"][at : at + 3]
            for impl in IMPLS:
                step, fwd, bwd = med[impl][at : at + 3]
                print(f"| {impl} | {step:.2f} | {fwd:.2f} | {bwd:.2f} | {step - ddp[0]:.2f} | "
                      f"{(fwd - ddp[1]) / UNITS:.2f} | {(bwd - ddp[2]) / UNITS:.2f} |")
            for suffix, how in (("", "defaults"), ("+fp", "forward prefetch")):
                ours, theirs = med["fullshard" + suffix][at] - ddp[0], med["fsdp2" + suffix][at] - ddp[0]
                rounds_ = [overhead_ratio(r, suffix, at) for r in per_round]  # each round's own medians
                print(f"\n{how}: (fullshard - DDP) / (FSDP2 - DDP) = {ours / theirs:.2f}; by round "
                      f"{', '.join(f'{x:.2f}' for x in rounds_)} (at most 0.5 in {sum(x <= 0.5 for x in rounds_)} "
                      f"of {len(rounds_)})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, rounds, steps), nprocs=2)
