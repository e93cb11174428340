"""What a Shard(d>0) shard's layout costs (Note [another dim] in fullshard/param.py).

    .venv/bin/python benchmarks/split_dim_layout.py [rows cols world]

fullshard stores a parameter split along dim 1 rows-first, so its shard is a strided view
(the transpose of a contiguous block) and a gather copies contiguous memory into the send
buffer. FSDP2 keeps the shard contiguous in the parameter's own order, so its gather (and
the gradient landing after the reduce-scatter) copies through a transpose instead. This
times, alternating A B A B, the optimizer step (AdamW, foreach) on each layout and the
copy each layout makes per gather and per reduction; medians of 15.
"""

import statistics
import sys
import time

import torch

rows, cols, world = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (2048, 2048, 2)
torch.set_num_threads(1)
shard_cols = cols // world
strided = torch.zeros(shard_cols, rows).t()  # fullshard: [rows, shard_cols], storage rows-first
contiguous = torch.zeros(rows, shard_cols)  # FSDP2: [rows, shard_cols], contiguous
send = torch.empty(shard_cols * rows)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def adamw(shard: torch.Tensor):
    p = torch.nn.Parameter(shard.clone() if shard.is_contiguous() else torch.zeros(shard_cols, rows).t())
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], foreach=True)
    opt.step()
    return lambda: opt.step()


steps = {"strided": adamw(strided), "contiguous": adamw(contiguous)}
copies = {"strided": lambda: send.copy_(strided.t().reshape(-1)),  # rows-first memory: a plain copy
          "contiguous": lambda: send.view(shard_cols, rows).copy_(contiguous.t())}  # through a transpose
times = {f"{what} {layout}": [] for what in ("optimizer step", "gather copy") for layout in steps}
for _ in range(15):
    for layout in steps:
        times[f"optimizer step {layout}"].append(timed(steps[layout]))
        times[f"gather copy {layout}"].append(timed(copies[layout]))
print(f"parameter [{rows}, {cols}] split along dim 1 over {world} ranks: shard [{rows}, {shard_cols}], one thread")
print("| | strided (fullshard) ms | contiguous (FSDP2) ms |\n|---|---|---|")
for what in ("optimizer step", "gather copy"):
    s, c = (statistics.median(times[f"{what} {layout}"]) * 1e3 for layout in ("strided", "contiguous"))
    print(f"| {what} | {s:.2f} | {c:.2f} |")
