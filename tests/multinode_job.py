"""Run by torchrun on each "node" of tests/test_hybrid.py: hybrid sharding with mesh=None.

Writes what each rank sees to <out>/rank<N>.json: its node, the global ranks of its
shard and replicate groups, and how far training drifts from one process.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import fullshard
from fullshard.gpt import Block
from tests.models import gpt_loss, tiny_gpt, token_batch
from tests.reference import full_state, global_batches, make_optimizer, max_diff, train

dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
model = tiny_gpt()
reference = tiny_gpt()
reference.load_state_dict(model.state_dict())
fullshard.shard_model(model, wrap={Block}, strategy="hybrid_shard")  # groups of LOCAL_WORLD_SIZE ranks
mesh = model.wte.weight.device_mesh
batches = global_batches(token_batch, 3, 8)
loss = gpt_loss
got = train(model, make_optimizer("adamw", model), batches, loss, world=dist.get_world_size())
want = train(reference, make_optimizer("adamw", reference), batches, loss)
report = {
    "node": int(os.environ["GROUP_RANK"]),
    "shard_group": dist.get_process_group_ranks(mesh.get_group("shard")),
    "replicate_group": dist.get_process_group_ranks(mesh.get_group("replicate")),
    "loss": max(abs(a - b) for a, b in zip(got, want)),
    "param": max_diff(full_state(model), full_state(reference)),
}
Path(sys.argv[1], f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
dist.barrier()
dist.destroy_process_group()
