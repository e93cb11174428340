"""Every documented misuse raises FullShardError, on every rank, before anything changes."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fullshard
from fullshard import FullShardError


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def raises(fn) -> str:
    """The FullShardError message `fn` raises ('' if it raises nothing)."""
    try:
        fn()
    except FullShardError as e:
        return str(e)
    return ""


def misuse_job() -> dict[str, str]:
    """Each misuse, with checks that the model is untouched afterwards."""
    out: dict[str, str] = {}
    model = Tied()
    fullshard.fully_shard(model.head)
    before = [type(p) for p in model.embed.parameters()]
    out["shared param"] = raises(lambda: fullshard.fully_shard(model))
    out["shared param untouched"] = "" if (not isinstance(model, fullshard.FSDPModule)
                                           and [type(p) for p in model.embed.parameters()] == before) else "changed"
    plain = nn.Linear(2, 2)
    fullshard.fully_shard(plain)
    out["double shard"] = raises(lambda: fullshard.fully_shard(plain))
    seq = nn.Sequential(nn.Linear(2, 2))
    fullshard.fully_shard(seq[0])
    out["shard_model on sharded"] = raises(lambda: fullshard.shard_model(seq))
    out["unknown strategy"] = raises(lambda: fullshard.shard_model(nn.Linear(2, 2), strategy="zero3"))
    out["bad wrap"] = raises(lambda: fullshard.shard_model(nn.Linear(2, 2), wrap="Block"))
    out["wrap selects ModuleList"] = raises(
        lambda: fullshard.shard_model(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])), wrap={nn.ModuleList}))
    out["bad prefetch"] = raises(lambda: fullshard.shard_model(nn.Linear(2, 2), backward_prefetch="early"))
    out["bad limit"] = raises(lambda: fullshard.shard_model(nn.Linear(2, 2), limit_all_gathers=0))
    out["bad reshard"] = raises(lambda: fullshard.fully_shard(nn.Linear(2, 2), reshard_after_forward="yes"))
    out["bad mp type"] = raises(lambda: fullshard.fully_shard(nn.Linear(2, 2), mp_policy=torch.bfloat16))
    out["bad dtype"] = raises(lambda: fullshard.MixedPrecisionPolicy(param_dtype=torch.int8))
    on_meta = nn.Linear(2, 2)
    on_meta.bias = nn.Parameter(torch.zeros(2, device="meta"))
    out["mixed devices"] = raises(lambda: fullshard.fully_shard(on_meta))
    world = dist.get_world_size()
    out["strategy/mesh"] = raises(lambda: fullshard.shard_model(
        nn.Linear(2, 2), strategy="full_shard", mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("replicate",))))
    out["not sharded"] = raises(lambda: fullshard.clip_grad_norm_(nn.Linear(2, 2), 1.0))
    out["parameters for a model"] = raises(lambda: fullshard.clip_grad_norm_(model.parameters(), 1.0))
    out["deepcopy"] = raises(lambda: copy.deepcopy(plain))
    out["full_params writeback rank0"] = raises(
        lambda: fullshard.full_params(plain, writeback=True, rank0_only=True).__enter__())
    seen = {}

    def try_full_params(*args) -> None:
        seen["error"] = raises(lambda: fullshard.full_params(plain).__enter__())

    plain.register_forward_pre_hook(try_full_params)  # runs after fullshard's own pre-forward hook
    plain(torch.ones(1, 2))
    out["full_params in forward"] = seen["error"]
    return out


def test_every_misuse_raises_a_clear_error_on_every_rank(world2):
    for got in world2.run(misuse_job):
        for case, message in got.items():
            if case.endswith("untouched"):
                assert message == "", case
            else:
                assert message, f"{case}: no FullShardError"
        assert "'weight'" in got["shared param"] and "common ancestor" in got["shared param"]
        assert "zero3" in got["unknown strategy"] and "'full_shard'" in got["unknown strategy"]
        assert "takes the sharded model" in got["parameters for a model"]
        assert "meta" in got["mixed devices"]


def mesh_size_job() -> dict:
    two = DeviceMesh("cpu", [0, 1])  # a mesh of ranks 0 and 1 only
    return {"two": raises(lambda: fullshard.fully_shard(nn.Linear(2, 2), mesh=two))}


def test_a_rank_outside_the_mesh_is_refused(world4):
    for rank, got in enumerate(world4.run(mesh_size_job)):
        if rank < 2:
            assert got["two"] == "", got
        else:
            assert f"rank {rank} is not in the mesh" in got["two"], got


def test_no_process_group():
    # this pytest process never joins a process group
    assert "init_process_group" in raises(lambda: fullshard.fully_shard(nn.Linear(2, 2)))
    assert issubclass(FullShardError, ValueError)
