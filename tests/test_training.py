"""Training helpers: global gradient clipping, accumulation with and without sync, full parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fullshard
from tests.models import model_spec
from tests.reference import ADAMW_TOL, assert_parity, full_state, global_batches, local_slice, make_optimizer, \
    max_diff, parity


def sharded(model_name: str, strategy: str = "full_shard") -> tuple[nn.Module, nn.Module, callable, callable]:
    factory, batch_fn, loss_fn, units = model_spec(model_name)
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    fullshard.shard_model(model, wrap=units, strategy=strategy)
    return model, reference, batch_fn, loss_fn


def clip_job(model: str, strategy: str, norm_type: float) -> dict:
    m, reference, batch_fn, loss_fn = sharded(model, strategy)
    batch = global_batches(batch_fn, 1, 8)[0]
    loss_fn(m, local_slice(batch, dist.get_rank(), dist.get_world_size())).backward()
    loss_fn(reference, batch).backward()
    got = fullshard.clip_grad_norm_(m, 0.01, norm_type)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, norm_type)
    grads = max_diff({n: p.grad.full_tensor() for n, p in m.named_parameters() if p.grad is not None},
                     {n: p.grad for n, p in reference.named_parameters() if p.grad is not None})
    # and over a few steps of training, clipping every step
    factory, _, _, units = model_spec(model)
    torch.manual_seed(0)
    trained = parity(factory(), lambda x: fullshard.shard_model(x, wrap=units, strategy=strategy), batch_fn, loss_fn,
                     clip=(lambda x: fullshard.clip_grad_norm_(x, 0.01, norm_type),
                           lambda x: torch.nn.utils.clip_grad_norm_(x.parameters(), 0.01, norm_type)))
    return {"norm": got.item(), "want": want.item(), "plain": type(got) is torch.Tensor and got.dim() == 0,
            "grads": grads, "trained": trained}


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
@pytest.mark.parametrize("model", ["gpt", "situations"])
def test_clip_grad_norm_is_global_and_equal_on_every_rank(world4, model, strategy, norm_type):
    results = world4.run(clip_job, model=model, strategy=strategy, norm_type=norm_type)
    norms = {r["norm"] for r in results}
    assert len(norms) == 1  # bitwise the same on every rank
    for r in results:
        assert r["plain"]
        # the norm sums squares in another order than one process: a few fp32 ulps
        assert r["norm"] == pytest.approx(r["want"], rel=1e-6)
        assert r["grads"] < 1e-8  # clipped gradients: ~1e-8 gradient noise scaled by the clip factor
        assert_parity([r["trained"]], "adamw")


def accumulation_job(mode: str, strategy: str) -> dict:
    """4 micro-batches per step, against one process on the whole (4x larger) batch."""
    model, reference, batch_fn, loss_fn = sharded("gpt", strategy)
    rank, world = dist.get_rank(), dist.get_world_size()
    opt, ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", reference)
    micro, steps, reductions = 4, 2, []
    for big in global_batches(batch_fn, steps, 8 * micro):
        parts = [tuple(t.chunk(micro)[k] for t in big) for k in range(micro)]
        with fullshard.stats(model) as stats:
            for k, part in enumerate(parts):
                last = k == micro - 1
                if mode == "no_sync" and not last:
                    with fullshard.no_sync(model):
                        (loss_fn(model, local_slice(part, rank, world)) / micro).backward()
                else:
                    model.set_requires_gradient_sync(last or mode == "sync_every_step")
                    (loss_fn(model, local_slice(part, rank, world)) / micro).backward()
        reductions.append(stats.reduce_scatters + stats.all_reduces)
        opt.step()
        opt.zero_grad()
        loss_fn(reference, big).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"param": max_diff(full_state(model), full_state(reference)), "reductions": reductions}


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
@pytest.mark.parametrize("mode", ["no_sync", "set_requires_gradient_sync", "sync_every_step"])
def test_gradient_accumulation_equals_one_big_batch(world2, mode, strategy):
    for r in world2.run(accumulation_job, mode=mode, strategy=strategy):
        assert r["param"] <= ADAMW_TOL  # 2 steps
        # 3 units: without sync only the last micro-batch reduces
        assert r["reductions"] == ([3 * 4] * 2 if mode == "sync_every_step" else [3] * 2)


def full_params_job() -> dict:
    model, reference, _, _ = sharded("gpt")
    want = full_state(reference)
    rank = dist.get_rank()
    out = {}
    with fullshard.full_params(model, writeback=False):
        out["read"] = all(type(p) is nn.Parameter for p in model.parameters())
        out["values"] = max_diff({n: p.detach() for n, p in model.named_parameters()}, want)
        for p in model.parameters():
            p.data.add_(1.0)
    out["discarded"] = max_diff(full_state(model), want)
    with fullshard.full_params(model):
        for p in model.parameters():
            p.data.mul_(2.0)
    out["written"] = max_diff(full_state(model), {n: 2 * t for n, t in want.items()})
    with fullshard.full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
        out["rank0_only"] = all(isinstance(p, DTensor) != (rank == 0) for p in model.parameters())
        out["cpu"] = all(p.device.type == "cpu" for p in model.parameters())
    out["after"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


def test_full_params_read_write_and_rank0_only(world2):
    for got in world2.run(full_params_job):
        assert got["read"] and got["rank0_only"] and got["cpu"] and got["after"]
        assert got["values"] == 0.0 and got["discarded"] == 0.0 and got["written"] == 0.0
