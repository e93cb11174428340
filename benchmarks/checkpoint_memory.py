"""Peak resident memory per rank of a checkpoint save and load, and of a full state dict.

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/checkpoint_memory.py [preset] [dir]

Builds the benchmark GPT (fullshard bench's presets), takes one AdamW step so the
optimizer has state, then measures each operation's rise of peak RSS above the RSS
before it (/proc/self/clear_refs restarts the peak).
"""

import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fullshard
from fullshard.gpt import Block

from fullshard.cli.bench import BATCHES, build_model
from fullshard.accounting import process_memory


def measure(label: str, fn) -> None:
    open("/proc/self/clear_refs", "w").write("5")
    before = process_memory("VmRSS")
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    rise = torch.tensor([float(process_memory("VmHWM") - before)])
    dist.all_reduce(rise, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"| {label} | {rise.item() / 2**20:.0f} | {took:.2f} |", flush=True)


dist.init_process_group("gloo")
torch.set_num_threads(1)
preset = sys.argv[1] if len(sys.argv) > 1 else "100m"
root = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.gettempdir())
path = root / f"fullshard-ckpt-{preset}"
batch, seq = BATCHES[preset]
model = fullshard.shard_model(build_model(preset), wrap={Block})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, 256, (batch // dist.get_world_size(), seq + 1))
model(x[:, :-1], x[:, 1:]).backward()
optimizer.step()
optimizer.zero_grad()
params = sum(p.numel() * 4 for p in model.parameters())
shard = sum(p.to_local().numel() * 4 for p in model.parameters())
unit = sum(p.numel() * 4 for p in model.h[0].parameters())
if dist.get_rank() == 0:
    print(f"{preset}: model {params / 2**20:.0f} MB fp32, shard per rank {shard / 2**20:.0f} MB "
          f"(+ AdamW state {2 * shard / 2**20:.0f} MB), one block {unit / 2**20:.0f} MB, world {dist.get_world_size()}\n")
    print("| operation | peak RSS rise per rank, MB | seconds |\n|---|---|---|")
measure("fullshard.save (model + optimizer)", lambda: fullshard.save(path, model, optimizer, step=1))
measure("fullshard.save(block=False), then result(): the first (allocates the staging buffers)",
        lambda: fullshard.save(path, model, optimizer, step=1, block=False).result())
measure("fullshard.save(block=False), then result(): the next (reuses them)",
        lambda: fullshard.save(path, model, optimizer, step=1, block=False).result())
measure("fullshard.load (model + optimizer)", lambda: fullshard.load(path, model, optimizer))
measure("get_state_dict(full=True, cpu_offload=True), model only", lambda: fullshard.get_state_dict(model))
measure("get_state_dict(full=True, rank0_only=True), model only",
        lambda: fullshard.get_state_dict(model, rank0_only=True))
measure("fullshard.export (safetensors, rank 0 writes)", lambda: fullshard.export(model, root / f"{preset}.safetensors"))
dist.barrier()
dist.destroy_process_group()
