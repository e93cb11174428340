"""Pipelined training step: fullshard stages against FSDP2 stages under torch's schedules.

    PYTHONPATH=src .venv/bin/python benchmarks/pipeline_step.py [rounds] [steps]

The 15m GPT (fullshard.gpt.GPTStage, 8 blocks of width 384, head untied) split the
torchtitan way into 2 stages (Schedule1F1B) or 4 (ScheduleInterleaved1F1B, 2 a rank), on 4
gloo ranks as pp 2 x dp 2, each block and each stage a unit of fullshard's fully_shard or
torch's; AdamW, global batch 8 x 128, 4 microbatches. Runs alternate implementation and
schedule (A B C D, A B C D, ...), each a fresh 4-process launch: after 2 warm-up steps,
`steps` timed steps. Reported, medians over rounds: the step (rank 0's median, every rank
waiting for all at its end), the peak resident memory of the busiest rank, and the bytes a
rank sends per step (the mean over ranks): its data-parallel collectives (fullshard's own
count; FSDP2's from its c10d calls with gloo's algorithms, as `fullshard bench` converts them)
and the activations and gradients its stages send each other.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCHEDULES = {"Schedule1F1B": 1, "ScheduleInterleaved1F1B": 2}  # stages a rank holds
IMPLS = ("fullshard", "fsdp2")
GLOBAL_BATCH, SEQ, MICROBATCHES, WARMUP = 8, 128, 4, 2


def run(rank: int, port: int, impl: str, schedule: str, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.utils._python_dispatch import TorchDispatchMode

    import fullshard
    from fullshard.gpt import PRESETS, Block, GPTConfig, GPTStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    per_rank = SCHEDULES[schedule]
    n_stages = 2 * per_rank
    indices = [pp_rank + 2 * k for k in range(per_rank)]
    cfg = GPTConfig(block_size=SEQ, vocab_size=256, **PRESETS["15m"])
    per_stage = cfg.n_layer // n_stages
    if impl == "fullshard":
        shard = fullshard.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    stages, runners = [], []
    for index in indices:
        torch.manual_seed(index)
        stage = GPTStage(cfg, range(index * per_stage, (index + 1) * per_stage))
        for block in [m for m in stage.modules() if isinstance(m, Block)]:
            shard(block, mesh=mesh["dp"])
        shard(stage, mesh=mesh["dp"])
        stages.append(stage)
        runners.append(PipelineStage(stage, index, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    runner = getattr(schedules, schedule)(runners if per_rank > 1 else runners[0], n_microbatches=MICROBATCHES,
                                          loss_fn=loss)
    optimizer = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=3e-4)
    generator = torch.Generator().manual_seed(0)
    pp_group = mesh["pp"].get_group()

    def step() -> None:
        data = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=generator).chunk(2)[dp_rank]
        last = {"target": data[:, 1:]} if n_stages - 1 in indices else {}
        runner.step(data[:, :-1], **last) if 0 in indices else runner.step(**last)
        optimizer.step()
        optimizer.zero_grad()

    class Sent(TorchDispatchMode):
        """Bytes sent: the stages' sends to each other, and FSDP2's collectives as gloo moves them."""

        between_stages = 0
        collectives = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if func.namespace == "c10d":
                if name.startswith("send") and args[1] is pp_group:
                    self.between_stages += sum(t.nbytes for t in args[0])
                elif impl == "fsdp2" and name.startswith("_allgather_base"):
                    self.collectives += args[1].nbytes  # (N - 1) / N of the buffer over 2 dp ranks
                elif impl == "fsdp2" and name.startswith("_reduce_scatter_base"):
                    self.collectives += args[1].nbytes  # gloo: an all-reduce of the whole input, 2 (N - 1) / N
            return func(*args, **(kwargs or {}))

    for _ in range(WARMUP):
        step()
    with Sent() as sent:
        if impl == "fullshard":
            counters = [fullshard.stats(s) for s in stages]
            for c in counters:
                c.reset()
            step()
            collective_bytes = sum(c.sent_bytes for c in counters)
        else:
            step()
            collective_bytes = sent.collectives
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    figures = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            collective_bytes + sent.between_stages], dtype=torch.float64)
    everyone = [torch.zeros_like(figures) for _ in range(4)]
    dist.all_gather(everyone, figures)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step": statistics.median(times), "rss": [e[0].item() for e in everyone],
                       "sent": statistics.mean(e[1].item() for e in everyone)}, f)
    dist.barrier()
    dist.destroy_process_group()


def launch(impl: str, schedule: str, steps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(run, args=(port, impl, schedule, steps, out.name), nprocs=4)
        with open(out.name) as f:
            return json.load(f)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(rounds):
        for schedule in SCHEDULES:
            for impl in IMPLS:
                results.setdefault((schedule, impl), []).append(launch(impl, schedule, steps))
    print(f"15m GPT, pp 2 x dp 2 on 4 gloo ranks, {MICROBATCHES} microbatches, global batch {GLOBAL_BATCH} x {SEQ}, "
          f"{rounds} alternating rounds x {steps} steps, medians\n")
    print("| schedule | impl | step s | peak RSS MB (busiest rank) | sent MB/step per rank | step / FSDP2 | "
          "RSS / FSDP2 | sent / FSDP2 |")
    print("|---|---|---|---|---|---|---|---|")
    for schedule in SCHEDULES:
        med = {impl: {key: statistics.median(max(r[key]) if key == "rss" else r[key]
                                            for r in results[(schedule, impl)]) for key in ("step", "rss", "sent")}
               for impl in IMPLS}
        for impl in IMPLS:
            m, base = med[impl], med["fsdp2"]
            print(f"| {schedule} | {impl} | {m['step']:.3f} | {m['rss'] / 2**20:.0f} | {m['sent'] / 2**20:.1f} | "
                  f"{m['step'] / base['step']:.2f} | {m['rss'] / base['rss']:.2f} | {m['sent'] / base['sent']:.2f} |")


if __name__ == "__main__":
    main()
