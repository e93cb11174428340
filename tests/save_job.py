"""Run by torchrun for tests/test_state_dict.py's crash test: saves checkpoints of a model
whose every parameter equals the step, writing its pid first so the test can kill it.

    save_job.py <checkpoint> <pid dir> <first step> <last step>
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import fullshard
from tests.models import tiny_gpt

dist.init_process_group("gloo")
torch.set_num_threads(1)
path, pids, first, last = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
(pids / f"rank{dist.get_rank()}").write_text(str(os.getpid()))
model = fullshard.shard_model(tiny_gpt())
optimizer = torch.optim.AdamW(model.parameters())
for step in range(first, last + 1):
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(float(step))
    fullshard.save(path, model, optimizer, step=step, extra={"step": step})
dist.barrier()
dist.destroy_process_group()
