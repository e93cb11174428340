"""FSDP2 code run on fullshard: what PyTorch's fully_shard documents, done the same way,
each at world 2 against the unsharded model."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fullshard
from fullshard.gpt import Block
from tests.models import tiny_gpt, token_batch
from tests.reference import full_state, max_diff
from tests.test_errors import raises


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(torch.Generator().manual_seed(seed + dist.get_rank()), 2)


def conversion_job() -> dict:
    """module.to(float64) after sharding, and a meta Linear(4, 1) made real with to_empty on
    2 ranks (rank 1 holds no row of its weight)."""
    torch.manual_seed(0)
    model = tiny_gpt()
    reference = copy.deepcopy(model).double()
    fullshard.shard_model(model, wrap={Block})
    model.to(torch.float64)
    dtypes = {p.dtype for p in model.parameters()}
    x, y = batch()
    loss = model(x, y)
    loss.backward()
    with torch.device("meta"):
        small = nn.Linear(4, 1)
    fullshard.fully_shard(small)
    small.to_empty(device="cpu")
    with torch.no_grad():
        for p in small.parameters():
            p.fill_(0.5)
    out = small(torch.ones(2, 4))
    return {"dtypes": sorted(map(str, dtypes)), "loss": abs(loss.item() - reference(x, y).item()),
            "grad dtype": str(next(model.parameters()).grad.dtype), "small": out.tolist(),
            "meta left": any(p.is_meta for p in small.parameters())}


def test_module_to_and_to_empty_after_sharding_act_on_the_shards(world2):
    for got in world2.run(conversion_job):
        assert got["dtypes"] == ["torch.float64"] and got["grad dtype"] == "torch.float64", got
        assert got["loss"] <= 1e-12, got  # float64 throughout
        assert got["small"] == [[2.5], [2.5]] and not got["meta left"], got  # 4 x 0.5 x 1 + 0.5


def assign_job() -> dict:
    """load_state_dict(assign=True) of DTensor shards into a model sharded on the meta device
    (FSDP2's way to load without initializing), and of full tensors into a real one: forward
    and the optimizer see the loaded values."""
    torch.manual_seed(0)
    source = tiny_gpt()
    want = {k: v.clone() for k, v in source.named_parameters()}
    fullshard.shard_model(source, wrap={Block})
    with torch.device("meta"):
        model = tiny_gpt()
    for block in model.h:
        fullshard.fully_shard(block)
    fullshard.fully_shard(model)
    model.load_state_dict(source.state_dict(), assign=True)  # DTensor shards
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built after the load: holds the loaded params
    x, y = batch()
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    moved = max_diff(full_state(model), want)
    torch.manual_seed(1)
    other = fullshard.shard_model(tiny_gpt(), wrap={Block})
    other.load_state_dict(want, strict=False, assign=True)  # full tensors
    other(x, y)
    return {"loss": abs(loss.item() - source(x, y).item()), "moved": moved, "full": max_diff(full_state(other), want),
            "assigned are shards": all(isinstance(p, DTensor) for p in model.parameters())}


def test_load_state_dict_with_assign_is_what_forward_computes_with(world2):
    for got in world2.run(assign_job):
        assert got["loss"] == 0.0 and got["assigned are shards"] and got["full"] == 0.0, got
        assert got["moved"] > 0, got  # the optimizer stepped the parameters forward used


def accumulation_job() -> dict:
    """param_dtype bf16 with reduce_dtype fp32 and gradient sync off: micro-batch gradients
    accumulate in fp32, as the reduction would sum them."""
    mp = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    grads = {}
    for sync_each in (True, False):
        torch.manual_seed(0)
        model = fullshard.shard_model(tiny_gpt(), wrap={Block}, mp_policy=mp)
        for micro in range(4):
            model.set_requires_gradient_sync(sync_each or micro == 3)
            model(*batch(micro)).backward()
        grads[sync_each] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"diff": max((grads[True][n] - grads[False][n]).abs().max().item() for n in grads[True]),
            "scale": max(g.abs().max().item() for g in grads[True].values())}


def test_unsynced_micro_batches_accumulate_in_the_reduce_dtype(world2):
    for got in world2.run(accumulation_job):
        # both sum 4 fp32 gradients of bf16 computations, in another order: a few fp32 roundings
        assert got["diff"] <= 1e-5 * got["scale"], got


def jvp_job() -> dict:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(plain)
    fullshard.fully_shard(plain[0])
    fullshard.fully_shard(plain)
    x, v = torch.randn(3, 4), torch.randn(3, 4)
    out, tangent = torch.func.jvp(plain, (x,), (v,))
    want_out, want_tangent = torch.func.jvp(reference, (x,), (v,))
    return {"out": (out - want_out).abs().max().item(), "tangent": (tangent - want_tangent).abs().max().item()}


def test_forward_mode_autodiff_through_a_sharded_module(world2):
    for got in world2.run(jvp_job):
        assert got["out"] == 0.0 and got["tangent"] == 0.0, got
