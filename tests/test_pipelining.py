"""torch.distributed.pipelining's schedules driving fullshard stages (Note [pipeline stages] in
fullshard/stage_state.py): every schedule torch ships, one and several stages per rank, with
fullshard's fully_shard and with torch's under replace_fsdp2(), against one process on the
whole batch and bitwise against FSDP2 where FSDP2's own gradients are right."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard import stage_state
from tests.models import named_mesh
from tests.reference import FSDP2_ON_CPU

WIDTH, MICROBATCHES, BATCH, STEPS = 16, 4, 8, 3
# schedule -> where a rank's stages are: one per rank, "loop" (rank r: r, r + pp), "v" (r, 2 pp - 1 - r)
SCHEDULES = {"ScheduleGPipe": None, "Schedule1F1B": None, "ScheduleLoopedBFS": "loop",
             "ScheduleInterleaved1F1B": "loop", "ScheduleInterleavedZeroBubble": "loop",
             "ScheduleZBVZeroBubble": "v", "ScheduleDualPipeV": "v"}
# the schedules whose backward is split in two (inputs, then weights): with FSDP2 their weights'
# gradients come out wrong (it shows the shards where the weight pass looks for the weights,
# Note [shown parameters] in fullshard/unit.py), so there fullshard is compared with one process only
SPLIT_BACKWARD = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}


def stage_module(index: int) -> nn.Sequential:
    """Stage `index` of the pipeline: two Linear + Tanh blocks, seeded by its index."""
    torch.manual_seed(index)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def batches(dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A data-parallel rank's (inputs, targets) of each step."""
    generator = torch.Generator().manual_seed(dp_rank)
    return [(torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator))
            for _ in range(STEPS)]


def stage_indices(layout: str | None, pp: int, pp_rank: int) -> list[int]:
    if layout is None:
        return [pp_rank]
    return [pp_rank, pp_rank + pp] if layout == "loop" else [pp_rank, 2 * pp - 1 - pp_rank]


def sharder(impl: str):
    """fully_shard as `impl` says: fullshard's, torch's under replace_fsdp2(), or torch's own."""
    if impl == "fullshard":
        return fullshard.fully_shard
    from torch.distributed.fsdp import fully_shard  # at call time: replace_fsdp2 may have rebound it

    return fully_shard


def schedule_job(schedule: str, impl: str) -> dict:
    """STEPS SGD steps of a pipeline of (pp 2) x (dp 2) ranks under `schedule`, each block and
    each stage a unit: the last stage's losses and every stage's full parameters after."""
    from torch.distributed.pipelining import PipelineStage, schedules

    mesh = named_mesh((2, 2), ("pp", "dp"))
    pp_rank, dp_mesh = mesh["pp"].get_local_rank(), mesh["dp"]
    layout = SCHEDULES[schedule]
    indices = stage_indices(layout, 2, pp_rank)
    n_stages = 2 * len(indices)
    replacing = fullshard.replace_fsdp2() if impl == "replace_fsdp2" else None
    try:
        shard = sharder(impl)
        modules, stages = [], []
        for index in indices:
            module = stage_module(index)
            for block in (module[0], module[2]):
                shard(block, mesh=dp_mesh)
            shard(module, mesh=dp_mesh)
            modules.append(module)
            stages.append(PipelineStage(module, index, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
        runner = getattr(schedules, schedule)(stages if layout else stages[0], n_microbatches=MICROBATCHES,
                                              loss_fn=loss_fn)
        optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
        losses = []
        for inputs, targets in batches(mesh["dp"].get_local_rank()):
            step_losses: list[torch.Tensor] = []
            last = {"target": targets, "losses": step_losses} if n_stages - 1 in indices else {}
            runner.step(inputs, **last) if 0 in indices else runner.step(**last)
            optimizer.step()
            optimizer.zero_grad()
            if step_losses:
                losses.append(torch.stack(step_losses).mean().item())
    finally:
        if replacing is not None:
            replacing.restore()
    return {"losses": losses, "dp_rank": mesh["dp"].get_local_rank(),
            "params": {index: [p.full_tensor().detach() for p in module.parameters()] for index, module in
                       zip(indices, modules)}}


def reference(n_stages: int) -> dict:
    """One process, the whole model on the whole global batch (both data-parallel ranks' data)."""
    model = nn.Sequential(*[stage_module(i) for i in range(n_stages)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for (x0, y0), (x1, y1) in zip(batches(0), batches(1)):
        per_rank = [loss_fn(model(x), y) for x, y in ((x0, y0), (x1, y1))]
        loss = (per_rank[0] + per_rank[1]) / 2  # the mean of equal-sized halves: the global batch's mean
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append([t.item() for t in per_rank])
    return {"losses": losses, "params": {i: [p.detach().clone() for p in stage.parameters()]
                                         for i, stage in enumerate(model)}}


def merged(results: list[dict]) -> dict:
    """Every stage's parameters (the same on its dp ranks: checked) and each dp rank's losses."""
    params, losses = {}, {}
    for got in results:
        for index, tensors in got["params"].items():
            if index in params:
                assert all(torch.equal(a, b) for a, b in zip(params[index], tensors)), index
            params[index] = tensors
        if got["losses"]:
            losses[got["dp_rank"]] = got["losses"]
    return {"params": params, "losses": losses}


# fp32: the pipeline sums each weight's gradient over 4 microbatches and 2 dp ranks where one
# process sums the 16 rows at once, so the two differ by the rounding of a few regrouped
# additions (SGD_TOL's argument in tests/reference.py); a few steps of lr 0.1 keep it within 1e-6
TOL = 1e-6


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_runs_fullshard_stages_like_one_process(world4, schedule):
    layout = SCHEDULES[schedule]
    want = reference(4 if layout else 2)
    ours = merged(world4.run(schedule_job, schedule=schedule, impl="fullshard"))
    replaced = merged(world4.run(schedule_job, schedule=schedule, impl="replace_fsdp2"))
    for index, tensors in want["params"].items():
        for got, expected, other in zip(ours["params"][index], tensors, replaced["params"][index]):
            assert torch.equal(got, other)  # fullshard.fully_shard and torch's under replace_fsdp2: one code path
            torch.testing.assert_close(got, expected, rtol=0, atol=TOL)
    for dp_rank, losses in ours["losses"].items():
        for got, expected in zip(losses, want["losses"]):
            assert abs(got - expected[dp_rank]) <= TOL, (dp_rank, losses, want["losses"])
    if schedule in SPLIT_BACKWARD or not FSDP2_ON_CPU:
        return
    theirs = merged(world4.run(schedule_job, schedule=schedule, impl="fsdp2"))
    assert theirs["losses"] == ours["losses"]  # FSDP2's order of operations on 2 dp ranks: bitwise equal
    for index, tensors in theirs["params"].items():
        assert all(torch.equal(a, b) for a, b in zip(ours["params"][index], tensors)), index


def reached_by_schedules() -> dict[str, set[str]]:
    """What torch.distributed.pipelining's source reads from `fully_shard.state(stage)`, its
    context, states and param groups (stage.perform_reduce_grad), by the names it uses."""
    from torch.distributed.pipelining import stage

    tree = ast.parse(inspect.getsource(stage))
    chains: dict[str, set[str]] = {"state": set(), "context": set(), "unit state": set(), "param group": set()}
    loops = {}  # loop variable -> what it iterates over
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            loops[node.target.id] = ast.unparse(node.iter)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.value, (ast.Name, ast.Attribute)):
            continue
        owner = ast.unparse(node.value)
        if owner == "distributed_state":
            chains["state"].add(node.attr)
        elif owner.endswith("._state_ctx"):
            chains["context"].add(node.attr)
        elif owner in loops and loops[owner].endswith(".all_states"):
            chains["unit state"].add(node.attr)
        elif owner in loops and "_fsdp_param_group" in loops[owner]:
            chains["param group"].add(node.attr)
    return chains


def test_what_the_schedules_reach_for_is_what_fullshard_offers():
    """A torch release whose schedules reach for more of FSDP2's state fails here, naming it."""
    for kind, names in reached_by_schedules().items():
        assert names, f"torch's pipelining no longer reads a {kind} the way stage_state.REACHED says"
        assert names <= set(stage_state.REACHED[kind]), (kind, names - set(stage_state.REACHED[kind]))
    assert stage_state.KEY is not None, "torch's fully_shard.state no longer reads a module's composable state"
