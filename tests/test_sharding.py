"""Shard layout and the unit collectives, checked against torch.chunk, torch.cat and sums."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import fullshard
from fullshard.gather import GatherPlan, Values, gather_values
from fullshard.hooks import units_under
from fullshard.reduce import ReducePlan
from fullshard.routes import BufferPool
from tests.world import COLLECTIVE_TIMEOUT_S

TIMEOUT = timedelta(seconds=COLLECTIVE_TIMEOUT_S)  # no hang is tested here: the world's own timeout
# 0-d; fewer rows than 4 ranks (empty shards); uneven; even; 1-d and 2-d
SHAPES = [(), (1,), (3,), (1, 5), (7, 2), (4, 3), (13,)]


class Assorted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(shape)) for shape in SHAPES)
        self.left = nn.Linear(3, 3)
        self.right = nn.Linear(3, 3)
        self.right.weight = self.left.weight  # tied inside one unit

    def forward(self, coeffs: list[torch.Tensor]) -> torch.Tensor:
        total = sum((p * c).sum() for p, c in zip(self.params, coeffs))
        return total + self.left.weight.sum() + 2 * self.right.weight.sum()


def layout_job() -> dict:
    torch.manual_seed(0)
    module = Assorted()
    originals = [p.detach().clone() for p in module.params]
    n_params = len(list(module.parameters()))
    fullshard.fully_shard(module)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"local": [], "placements": [], "full_equal": [], "tied": module.left.weight is module.right.weight,
           "n_params": len(list(module.parameters())) == n_params}
    for p, original in zip(module.params, originals):
        want = original if original.dim() == 0 else torch.chunk(original, world)[rank] \
            if rank < len(torch.chunk(original, world)) else original[:0]
        out["local"].append(p.to_local().shape == want.shape and torch.equal(p.to_local(), want))
        out["placements"].append(str(p.placements))
        out["full_equal"].append(torch.equal(p.full_tensor(), original))
    # gradient of sum(p * c_rank): the average over ranks of c_rank, whatever the layout
    generator = torch.Generator().manual_seed(rank)
    coeffs = [torch.randn(shape, generator=generator) for shape in SHAPES]
    module(coeffs).backward()
    gathered = [torch.zeros(world, *shape) for shape in SHAPES]
    for g, c in zip(gathered, coeffs):
        dist.all_gather_into_tensor(g, c.reshape(1, *c.shape).contiguous())
    out["grads"] = [torch.allclose(p.grad.full_tensor(), g.mean(0), atol=1e-7) for p, g in zip(module.params, gathered)]
    out["tied_grad"] = torch.allclose(module.left.weight.grad.full_tensor(), torch.full((3, 3), 3.0))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_shards_follow_torch_chunk_and_padding_is_invisible(request, world):
    for got in request.getfixturevalue(f"world{world}").run(layout_job):
        assert all(got["local"]) and all(got["full_equal"]) and all(got["grads"])
        assert got["placements"][0] == str((Replicate(),))  # a 0-d parameter cannot be split
        assert set(got["placements"][1:]) == {str((Shard(0),))}
        assert got["tied"] and got["n_params"] and got["tied_grad"]


class Rows(nn.Module):
    """Parameters for the plans' test: uneven rows, a 1-d one, a row vector, a 0-d one, two of 2."""

    def __init__(self, rows_of_first: int, world: int) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(shape)) for shape in
                                       [(rows_of_first, 2), (5,), (1, 3), (), (2,), (2,), (world * 6,)])


def collectives_job(seed: int, rows_of_first: int) -> dict:
    """GatherPlan against torch.cat (two gathers in flight at once, as prefetch issues them);
    ReducePlan against a mean; through the route gloo takes for these sizes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = Rows(rows_of_first, world)
    fullshard.fully_shard(module)
    unit = units_under(module)[0]
    params, cpu, f32, pool = unit.params, torch.device("cpu"), torch.float32, BufferPool()
    generator = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(p.shape, generator=generator) for p in params[:3]]  # same on every rank
    padded = [torch.cat([f, f.new_zeros(world * p.rows_per_shard - f.shape[0], *f.shape[1:])])
              for f, p in zip(fulls, params)]
    local = [q.chunk(world)[rank].reshape(-1).contiguous() for q in padded]

    def plan(dtype: torch.dtype, ps: list) -> GatherPlan:
        return GatherPlan([Values(p, dtype, cpu) for p in ps], unit.group.shard_pg, cpu, dtype, unit.uid, storage=None)

    first, second = plan(f32, params[:3]), plan(f32, params[:3])
    flights = [first.issue(local, pool, "first", TIMEOUT), second.issue([2 * t for t in local], pool, "second",
                                                                         TIMEOUT)]
    first.finish(flights[0], pool)
    second.finish(flights[1], pool)
    gather_ok = all(torch.equal(f.full, q) and torch.equal(g.full, 2 * q)
                    for f, g, q in zip(first.formats, second.formats, padded))
    odd_ok = []  # dtypes gloo's collectives refuse: the small route moves the rows' bytes
    for dtype in (torch.int16, torch.float8_e4m3fn):
        values = torch.arange(world * 6, dtype=torch.float32).to(dtype)  # alike on every rank
        got = gather_values([params[6]], [values.view(world, 6)[rank].clone()], dtype, unit.group.shard_pg, cpu,
                            unit.uid, pool, "odd", TIMEOUT)[0]
        odd_ok.append(torch.equal(got.view(torch.uint8), values.view(torch.uint8)))

    grads = [torch.randn(f.shape, generator=torch.Generator().manual_seed(seed + rank + 1)) for f in fulls]
    grads.append(torch.tensor(float(rank)))  # 0-d
    grads.append(None if rank == 0 else torch.ones(2))  # only some ranks have it
    grads.append(None)  # no rank has it
    reduce_plan = ReducePlan(params[:6], f32, unit.group, cpu, unit.uid, divide_by=world, force_sum=False,
                             options=unit.options)
    shard = reduce_plan.finish(reduce_plan.issue(grads, pool, True, "reduce", TIMEOUT), pool)
    numels = [p.shard_numel for p in params[:6]]
    all_grads = [[torch.zeros_like(g) for _ in range(world)] for g in grads[:3]]
    for bucket, g in zip(all_grads, grads[:3]):
        dist.all_gather(bucket, g)
    offset, reduce_ok = 0, []
    for bucket, numel, p in zip(all_grads, numels, params):
        mean = torch.stack(bucket).mean(0)
        padded_mean = torch.cat([mean, mean.new_zeros(world * p.rows_per_shard - mean.shape[0], *mean.shape[1:])])
        # the rows are added in another order than torch.mean's: fp32 rounding of a sum of `world`
        # N(0, 1) values, a few 1e-7 where they cancel near zero
        reduce_ok.append(torch.allclose(shard[offset : offset + numel], padded_mean.chunk(world)[rank].reshape(-1),
                                        atol=1e-6))
        offset += numel
    total = sum(numels)
    return {
        "route": first.route(sum(p.shard_numel for p in params[:3])).name,
        "gather": gather_ok,
        "odd dtypes": odd_ok,
        "reduce": reduce_ok,
        "scalar": shard[total - 3].item() * world,  # sum of ranks
        "flags": [f > 0 for f in shard[total:].tolist()],
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("rows_of_first", [9, 300_000])  # gloo's routes: all_to_all, then point-to-point
def test_collectives_against_cat_and_mean(request, world, rows_of_first):
    for got in request.getfixturevalue(f"world{world}").run(collectives_job, seed=world, rows_of_first=rows_of_first):
        assert got["route"] == ("all_to_all" if rows_of_first == 9 else "p2p")
        assert got["gather"] and all(got["reduce"])
        assert got["odd dtypes"] == [True, True]
        assert got["scalar"] == pytest.approx(sum(range(world)))
        # flags: every rank has the first 4 gradients; the 5th on ranks 1..; the 6th nowhere
        assert got["flags"] == [True, True, True, True, True, False]
