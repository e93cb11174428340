"""Train a small GPT on 2 local ranks with fullshard.shard_model and print the loss per step.

Run it with `make train`, or:
    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py
The data is the bytes of Python's own standard library (no download), so the loss
falls from ln(256) = 5.5 as the model learns what Python source looks like.
"""

import os
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fullshard
from fullshard.gpt import GPT, Block, GPTConfig

STEPS, GLOBAL_BATCH, SEQ = 200, 16, 128

# set up: one rank per process, gloo on CPU, NCCL on GPUs
backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
else:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

# data: the standard library's source as bytes, the same on every rank
files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
data = torch.tensor(list(b"".join(f.read_bytes() for f in files)), dtype=torch.long)
generator = torch.Generator().manual_seed(0)

# model: the same initial weights on every rank, then sharded per block
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=SEQ, vocab_size=256, n_layer=4, n_head=4, n_embd=128)).to(device)
fullshard.shard_model(model, wrap={Block}, strategy="full_shard")
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

# train: each rank takes its slice of the global batch
local = GLOBAL_BATCH // world
for step in range(STEPS):
    start = time.perf_counter()
    offsets = torch.randint(0, len(data) - SEQ - 1, (GLOBAL_BATCH,), generator=generator)[rank * local:(rank + 1) * local]
    x = torch.stack([data[o:o + SEQ] for o in offsets]).to(device)
    y = torch.stack([data[o + 1:o + SEQ + 1] for o in offsets]).to(device)
    loss = model(x, y)
    loss.backward()
    norm = fullshard.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(loss := loss.detach())
    if rank == 0:
        print(f"step {step:3d}  loss {loss.item() / world:.4f}  grad norm {norm.item():.3f}  "
              f"{time.perf_counter() - start:.2f} s", flush=True)

dist.barrier()
dist.destroy_process_group()
