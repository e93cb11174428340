"""FSDP2 code run on fullshard: what PyTorch's fully_shard documents, done the same way,
each at world 2 (some at 4) against the unsharded model."""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from collections.abc import Mapping, MutableMapping

import pytest
import torch
import torch.distributed as dist
import torch.distributed.device_mesh
import torch.distributed.fsdp._fully_shard._fsdp_common
from torch import nn
from torch.distributed.fsdp import fully_shard as TORCH_FULLY_SHARD  # a name bound at import, as torchtitan's
from torch.distributed.tensor import DTensor

import fullshard
from fullshard.module import NOT_OFFERED
from fullshard.hooks import unit_hooks
from fullshard.gpt import Block
from tests.models import tiny_gpt, token_batch
from tests.reference import ADAMW_TOL, LOSS_TOL, SGD_TOL, full_state, max_diff
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
    (FSDP2's way to load without initializing), in two parts as from a checkpoint of two files,
    and of full tensors into a real one: forward and the optimizer see the loaded values. A
    forward before every parameter has values is refused, naming what is missing."""
    torch.manual_seed(0)
    source = tiny_gpt()
    want = {k: v.clone() for k, v in source.named_parameters()}
    fullshard.shard_model(source, wrap={Block})
    with torch.device("meta"):
        model = tiny_gpt()
    for block in model.h:
        fullshard.fully_shard(block)
    fullshard.fully_shard(model)
    shards = source.state_dict()  # DTensor shards
    names = list(shards)
    for part in (names[::2], names[1::2]):
        model.load_state_dict({k: shards[k] for k in part}, strict=False, assign=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built after the load: holds the loaded params
    x, y = batch()
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    moved = max_diff(full_state(model), want)
    torch.manual_seed(1)
    other = fullshard.shard_model(tiny_gpt(), wrap={Block})
    other.load_state_dict(want, strict=False, assign=True)  # full tensors
    at_once = all(isinstance(p, DTensor) for p in other.parameters())  # what an optimizer built now would hold
    other(x, y)
    with torch.device("meta"):
        small = nn.Linear(4, 2)
    fullshard.fully_shard(small)
    early = raises(lambda: small(torch.ones(1, 4)))
    small.load_state_dict({"weight": torch.ones(2, 4)}, strict=False, assign=True)
    half = raises(lambda: small(torch.ones(1, 4)))
    small.load_state_dict({"bias": torch.ones(2)}, strict=False, assign=True)
    return {"early": early, "half": half, "small": small(torch.ones(1, 4)).tolist(),
            "loss": abs(loss.item() - source(x, y).item()), "moved": moved, "full": max_diff(full_state(other), want),
            "assigned are shards": all(isinstance(p, DTensor) for p in model.parameters()) and at_once}


def test_load_state_dict_with_assign_is_what_forward_computes_with(world2):
    for got in world2.run(assign_job):
        assert got["loss"] == 0.0 and got["assigned are shards"] and got["full"] == 0.0, got
        assert got["moved"] > 0, got  # the optimizer stepped the parameters forward used
        assert "meta device" in got["early"] and "['bias']" in got["half"], got
        assert got["small"] == [[5.0, 5.0]], got


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


def fsdp2_script_job() -> dict:
    """A training script written for PyTorch's FSDP2, with only its import changed: per-block
    fully_shard with FSDP2's defaults, torch's clip_grad_norm_ on the DTensor gradients,
    accumulation with FSDP2's switches, model.state_dict() saved and loaded with DCP, and torch's
    get_model_state_dict / set_model_state_dict(broadcast_from_rank0=True)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=None, mp_policy=MixedPrecisionPolicy(),
                    offload_policy=OffloadPolicy())
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    world, rank = dist.get_world_size(), dist.get_rank()
    norm_diffs = []
    for step in range(2):
        micro = [token_batch(torch.Generator().manual_seed(10 * step + m), 2 * world) for m in range(2)]
        for m, (x, y) in enumerate(micro):
            last = m == len(micro) - 1
            model.set_requires_gradient_sync(last)
            model.set_is_last_backward(last)
            (model(x.chunk(world)[rank], y.chunk(world)[rank]) / len(micro)).backward()
            (reference(x, y) / len(micro)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        norm_diffs.append(abs(norm.full_tensor().item() - ref_norm.item()))
    state = {"model": model.state_dict()}
    directory = f"/tmp/fullshard_fsdp2_script_{os.getppid()}"
    dcp.save(state, checkpoint_id=directory)
    trained = full_state(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    reloaded = max_diff(full_state(model), trained)
    # torch's state-dict API: full on rank 0, then broadcast back into the shards
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return {"norm": max(norm_diffs), "param": max_diff(full_state(model), full_state(reference)),
            "reloaded": reloaded, "broadcast": max_diff(full_state(model), trained)}


def test_an_fsdp2_training_script_runs_with_only_its_import_changed(world2):
    for got in world2.run(fsdp2_script_job):
        assert got["norm"] <= 1e-6 and got["param"] <= 2e-5 and got["reloaded"] == got["broadcast"] == 0.0, got


def methods_job() -> dict:
    """FSDPModule's methods of FSDP2, each against what it promises."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    x, y = batch()

    def sharded(**kwargs) -> nn.Module:
        torch.manual_seed(0)
        return fullshard.shard_model(tiny_gpt(), wrap={Block}, **kwargs)

    def gathers(model: nn.Module) -> int:
        model(x, y).backward()  # a first step records the forward order
        with fullshard.stats(model) as s:
            model(x, y).backward()
        return s.gathers

    def grads(model: nn.Module) -> dict:
        model(x, y).backward()
        return {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    kept, freed = sharded(), sharded()
    kept.set_reshard_after_forward(False)
    freed.set_reshard_after_forward(True)  # FSDP2's: the block that ran last frees too
    out["gathers"] = (gathers(sharded()), gathers(kept), gathers(freed))
    torch.manual_seed(0)
    embedded = nn.Sequential(nn.Embedding(61, 8), nn.Linear(8, 61))
    reference = copy.deepcopy(embedded)
    fullshard.fully_shard(embedded[0])
    fullshard.fully_shard(embedded)
    embedded[0].set_unshard_in_backward(False)  # an embedding's backward needs only the indices
    same = token_batch(torch.Generator().manual_seed(0), 2)[0]  # on every rank: the average is the reference's
    with fullshard.stats(embedded) as s:
        embedded(same).sum().backward()
    reference(same).sum().backward()
    out["unshard in backward"] = (s.gathers, (embedded[0].weight.grad.full_tensor()
                                              - reference[0].weight.grad).abs().max().item())
    summed = sharded()
    for unit in [summed, *summed.h]:  # each unit's own, as FSDP2's
        unit.set_gradient_divide_factor(1.0)
    calls = []
    hooked = sharded()
    for block in hooked.h:
        block.set_all_reduce_hook(lambda row: (calls.append(row.numel()), row.mul_(2)))
    plain, total, doubled = grads(sharded()), grads(summed), grads(hooked)
    out["sum"] = max((total[n] - dist.get_world_size() * plain[n]).abs().max().item() for n in plain)
    out["hook"] = (len(calls), max((doubled[n] - 2 * plain[n]).abs().max().item() for n in plain if ".h." in n or
                                   n.startswith("h.")), max((doubled[n] - plain[n]).abs().max().item()
                                                            for n in plain if not n.startswith("h.")))
    # an exception in backward, reset_iter_state, then the step again: as if nothing happened
    failing = sharded()
    failing.h[1].register_full_backward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        failing(x, y).backward()
    except RuntimeError:
        failing.reset_iter_state()
    failing.h[1]._backward_hooks.clear()
    failing.zero_grad()
    again = grads(failing)
    out["reset"] = max((again[n] - plain[n]).abs().max().item() for n in plain)
    # state_dict after a forward whose backward never came: still the shards
    shown = sharded()
    shown(x, y)
    out["state_dict"] = all(isinstance(v, DTensor) for k, v in shown.state_dict().items() if k.endswith("weight"))
    # a method that computes without forward, registered to gather around it
    scored = sharded()
    scored.embed = lambda idx: scored.wte(idx) + scored.wpe(torch.arange(idx.shape[1]))
    fullshard.register_fsdp_forward_method(scored, "embed")
    with torch.no_grad():
        torch.manual_seed(0)
        plain = tiny_gpt()
        out["method"] = (scored.embed(x) - plain.wte(x) - plain.wpe(torch.arange(x.shape[1]))).abs().max().item()
    # a 2-D mesh of any dim names is (replicate, shard); ignored parameters stay plain
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(0)
    model = tiny_gpt()
    fullshard.fully_shard(model, mesh=mesh, ignored_params={model.wpe.weight})
    out["mesh"] = [repr(p) for p in model.wte.weight.placements]
    out["ignored"] = type(model.wpe.weight).__name__
    model(x, y).backward()  # the ignored weight's gradient is the user's; the optimizer check leaves it
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    out["not offered"] = raises(lambda: kept.set_custom_all_gather(None))
    fullshard.share_comm_ctx([kept, model])  # fullshard's streams are the process's already
    out["share not a unit"] = raises(lambda: fullshard.share_comm_ctx([nn.Linear(2, 2)]))
    return out


def torch_methods() -> list[str]:
    """Every method torch's FSDPModule defines (a new torch's included), private ones too."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, value in vars(FSDPModule).items() if callable(value) or isinstance(value, staticmethod)]


def torch_class_job() -> dict:
    """Note [torch's FSDPModule]: a fullshard unit is one of torch's FSDPModules, and each of the
    methods torch's class defines is fullshard's: it works, or refuses by name."""
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    model = fullshard.shard_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), wrap={nn.Linear})
    sliced = model[0:1]  # nn.Sequential slicing constructs a module of the swapped class anew
    return {"isinstance": [isinstance(m, FSDPModule) for m in (model, model[0], model[1])],
            "falls through": [n for n in torch_methods() if n not in vars(fullshard.FSDPModule)],
            "state": raises(lambda: model._get_fsdp_state()),
            "not offered": {n: bool(raises(lambda: getattr(model, n)(None))) for n in NOT_OFFERED},
            "sliced": type(sliced).__name__, "async hint": raises(lambda: model._set_unshard_async_op(True))}


def test_units_are_torchs_fsdpmodules_and_no_method_falls_through_to_torchs(world2):
    for got in world2.run(torch_class_job):
        assert got["isinstance"] == [True, True, True]
        assert got["falls through"] == [], f"torch's FSDPModule has methods fullshard lacks: {got['falls through']}"
        assert "keeps no FSDP2 state object" in got["state"] and all(got["not offered"].values())
        assert got["sliced"] == "Sequential" and got["async hint"] == ""


def framework_shards(model: nn.Module) -> None:
    """What a framework does: torch's fully_shard, looked up by attribute when it runs."""
    import torch.distributed.fsdp

    for block in model.h:
        torch.distributed.fsdp.fully_shard(block)
    torch.distributed.fsdp.fully_shard(model)


def replace_job() -> dict:
    """Note [replacing FSDP2]: inside replace_fsdp2, torch's fully_shard (by attribute, and as a
    name bound at import, here TORCH_FULLY_SHARD) is fullshard's and trains exactly as FSDP2
    does; FSDP2 models made before go on working; after it, torch's names are torch's again."""
    from torch.distributed.fsdp import FSDPModule

    x, y = batch()

    def losses(model: nn.Module) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for _ in range(3):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    torch.manual_seed(0)
    theirs = tiny_gpt()
    framework_shards(theirs)  # torch's FSDP2
    with fullshard.replace_fsdp2():
        torch.manual_seed(0)
        ours = tiny_gpt()
        framework_shards(ours)
        torch.manual_seed(0)
        bound = tiny_gpt()
        TORCH_FULLY_SHARD(bound)
        inside = {"ours": unit_hooks(ours) is not None and unit_hooks(bound) is not None,
                  "torch's FSDP2 alongside": losses(theirs), "fullshard": losses(ours)}
    return {**inside, "restored": torch.distributed.fsdp.fully_shard is not fullshard.fully_shard
            and TORCH_FULLY_SHARD is not fullshard.fully_shard, "isinstance": isinstance(ours, FSDPModule)}


def test_replace_fsdp2_runs_code_that_calls_torchs_fully_shard_on_fullshard(world2):
    for got in world2.run(replace_job):
        assert got["ours"] and got["restored"] and got["isinstance"]
        assert got["fullshard"] == got["torch's FSDP2 alongside"]  # bitwise: the same arithmetic as FSDP2


class ExpertLayer(nn.Module):
    """A layer whose "experts" shard over another mesh than its dense part (torchtitan's MoE with
    expert parallelism passes such placements through shard_placement_fn)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.experts = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(torch.relu(self.dense(x))).square().mean()


def placement_result_job(shard_dim: int) -> dict:
    """Note [meshes of one call]: a ShardPlacementResult puts a parameter on a mesh of its own,
    here an HSDP mesh (replicate 2 x shard world/2) for the experts beside the call's 1-D mesh,
    split along `shard_dim`; 3 SGD steps against torch FSDP2 and one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    mesh_2d = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    expert_mesh = HSDPMeshInfo(mesh=mesh_2d, shard_mesh_dim=1, replicate_mesh_dim=0)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    local = x.chunk(dist.get_world_size())[dist.get_rank()]

    def train(model: nn.Module, inputs: torch.Tensor) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _ in range(3):
            loss = model(inputs)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    models = {}
    for name in ("fullshard", "torch", "one process"):
        torch.manual_seed(0)
        models[name] = ExpertLayer()
    for name, shard in (("fullshard", fullshard.fully_shard), ("torch", torch_fully_shard)):
        expert_params = set(models[name].experts.parameters())
        shard(models[name], shard_placement_fn=lambda p, e=expert_params: ShardPlacementResult(
            Shard(shard_dim if p.dim() == 2 else 0), expert_mesh) if p in e else None)
    for name, model in models.items():
        train(model, x if name == "one process" else local)
    placements = {n: tuple(p.placements) for n, p in models["fullshard"].named_parameters()}
    state = {n: p.full_tensor() for n, p in models["fullshard"].named_parameters()}
    return {"placements": {n: [repr(p) for p in ps] for n, ps in placements.items()},
            "same as torch": max_diff(state, {n: p.full_tensor() for n, p in models["torch"].named_parameters()}),
            "reference": max_diff(state, dict(models["one process"].named_parameters())),
            "meshes": [tuple(p.device_mesh.shape) for p in models["fullshard"].parameters()]}


@pytest.mark.skipif(not hasattr(torch.distributed.fsdp._fully_shard._fsdp_common, "ShardPlacementResult"),
                    reason="ShardPlacementResult is torch 2.13's: no code before it returns one")
@pytest.mark.parametrize("world, shard_dim", [(2, 0), (4, 0), (4, 1)])
def test_a_shard_placement_result_shards_a_parameter_over_its_own_mesh(request, world, shard_dim):
    for got in request.getfixturevalue(f"world{world}").run(placement_result_job, shard_dim=shard_dim):
        assert got["meshes"] == [(world,), (world,), (2, world // 2), (2, world // 2)]
        assert got["placements"]["experts.weight"] == ["Replicate()", f"Shard(dim={shard_dim})"]
        # at 2 ranks a sum of two rows is the same whoever adds it: bitwise FSDP2's; at 4,
        # gloo's reduce-scatter (FSDP2's) adds in another order than fullshard's rank order
        assert got["same as torch"] <= (0.0 if world == 2 else SGD_TOL), got
        assert got["reference"] <= SGD_TOL, got


def test_fsdp2_methods_do_what_fsdp2_documents(world2):
    for got in world2.run(methods_job):
        # by default the root and the block that ran last keep theirs until backward (1 gather each),
        # h.0 gathers again (2); kept: every block once; FSDP2's freeing: h.1 gathers again too
        assert got["gathers"] == (4, 3, 5), got
        assert got["sum"] <= 1e-6, got
        calls, hooked, others = got["hook"]
        assert calls == 2 and hooked <= 1e-6 and others == 0.0, got  # once per block unit, in place
        assert got["reset"] <= 1e-6 and got["state_dict"] and got["method"] <= 1e-6, got
        assert got["mesh"] == ["Replicate()", "Shard(dim=0)"] and got["ignored"] == "Parameter", got
        # the root kept until its backward (1 gather), the embedding gathered for forward only (1)
        assert got["unshard in backward"][0] == 2 and got["unshard in backward"][1] <= 1e-5, got
        assert "does not offer" in got["not offered"], got
        assert "not units" in got["share not a unit"], got


def replicate_job() -> dict:
    """replicate() (DDP, composable) composed with fullshard both ways, each trained like one
    process: over a model whose blocks are fullshard units (it all-reduces the rest and leaves
    the units' gradients to them), and under a fullshard root (the root leaves the replicated
    block's parameters plain, DDP's to average)."""
    from torch.distributed._composable.replicate import replicate

    from tests.reference import global_batches, train

    batches = global_batches(lambda g, b: token_batch(g, b), 3, 4)
    got = {}
    for outer in ("replicate", "fully_shard"):
        torch.manual_seed(0)
        model = tiny_gpt()
        reference = copy.deepcopy(model)
        if outer == "replicate":
            for block in model.h:
                fullshard.fully_shard(block)
            replicate(model)
        else:
            replicate(model.h[0])
            fullshard.fully_shard(model.h[1])
            fullshard.fully_shard(model)
        losses = train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, lambda m, b: m(*b),
                       world=dist.get_world_size())
        want = train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches, lambda m, b: m(*b))
        got[outer] = {"loss": max(abs(g - w) for g, w in zip(losses, want)),
                      "param": max_diff(full_state(model), full_state(reference)),
                      "plain": sorted({type(p).__name__ for p in model.h[0].parameters()})}
    return got


def test_replicate_and_fullshard_compose_both_ways(world2):
    for got in world2.run(replicate_job):
        for outer, case in got.items():
            assert case["loss"] <= 1e-6 and case["param"] <= 2.5e-7, (outer, case)
        assert got["fully_shard"]["plain"] == ["Parameter"], got  # not DTensor shards


def group_job() -> dict:
    """fully_shard([norm, head]) as one unit (torchtitan's way with a final norm and output
    head): one gather per forward and one per backward for both, trains like one process."""
    from tests.reference import global_batches, train

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 4))

    def loss_fn(model: nn.Module, b) -> torch.Tensor:
        return nn.functional.cross_entropy(model(b[0]), b[1])

    model, reference = build(), build()
    fullshard.fully_shard(model[0])
    grouped = fullshard.fully_shard([model[2], model[3]])
    fullshard.fully_shard(model)
    batches = global_batches(lambda g, n: (torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)),
                             3, 8)
    got = train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, loss_fn, world=dist.get_world_size())
    want = train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches, loss_fn)
    with fullshard.stats(model) as s:
        loss_fn(model, batches[0]).backward()
        gathers = s.gathers
    return {"loss": max(abs(g - w) for g, w in zip(got, want)), "param": max_diff(full_state(model),
                                                                                  full_state(reference)),
            "gathers": gathers, "types": [type(m).__name__ for m in grouped]}


def group_to_empty_job() -> list:
    """A module group built on meta, made real by to_empty and filled: every member computes
    with its filled values (each member's to_empty moves its own parameters in turn)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fullshard.fully_shard([model[0], model[1]])
    fullshard.fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    return model(torch.ones(1, 4)).tolist()


def test_a_group_of_modules_is_one_unit(world2):
    for got in world2.run(group_to_empty_job):
        assert got == [[5.5, 5.5]], got  # (4 x 0.5 + 0.5) = 2.5, then 4 x 0.5 x 2.5 + 0.5
    for got in world2.run(group_job):
        assert got["loss"] <= 1e-6 and got["param"] <= 2.5e-7, got
        # the root (no parameters of its own: 1 empty gather), model[0] (forward and backward: 2)
        # and the group, which ran last and so is kept until its backward (1): its two modules
        # gather together, where two units would gather 3 times
        assert got["gathers"] == 4 and got["types"] == ["FSDPLayerNorm", "FSDPLinear"], got


class Mixed(nn.Module):
    """Four dtypes in one unit: a float64 layer, a float32 one, frozen bf16 weights (as a
    quantized base under trainable adapters) and a 0-d float16 scale."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 6).to(torch.bfloat16).requires_grad_(False)
        self.inner, self.outer = nn.Linear(6, 5).double(), nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.frozen(x.to(self.frozen.weight.dtype)).to(self.inner.weight.dtype)
        return self.outer(torch.tanh(self.inner(x)).to(self.outer.weight.dtype)) * self.scale.to(x.dtype)


def mixed_dtypes_job(tmp: str) -> dict:
    """Parameters of four dtypes in one unit, trained 3 SGD steps against one process on the
    whole batch: without a param_dtype each computes in its own dtype (the gather moves bytes,
    gradients reduce per dtype), also with CPU offload and with reshard_after_forward=2 at
    world 4; with param_dtype=float32 all compute in float32 (the reference computes on float32
    copies of the masters). Shards and gradients keep the masters' dtypes, and a checkpoint of
    the mixed unit loads back bitwise."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cases = {"own dtypes": {}, "offload": {"offload_policy": fullshard.CPUOffloadPolicy(pin_memory=False)},
             "fp32 compute": {"mp_policy": fullshard.MixedPrecisionPolicy(param_dtype=torch.float32)}}
    if world == 4:
        cases["reshard to 2"] = {"reshard_after_forward": 2}
    got = {}
    for name, options in cases.items():
        torch.manual_seed(0)
        model = Mixed()
        reference = copy.deepcopy(model)
        fullshard.fully_shard(model, **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(step))
            model(x.chunk(world)[rank]).square().mean().backward()
            if "mp_policy" in options:  # fp32 compute, masters of their own dtypes
                copies = {n: p.float() for n, p in reference.named_parameters()}
                torch.func.functional_call(reference, copies, (x,)).square().mean().backward()
            else:
                reference(x).square().mean().backward()
            grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
            for opt in (optimizer, ref_optimizer):
                opt.step()
                opt.zero_grad()
        with fullshard.full_params(model, writeback=False):
            kept = sorted({str(p.dtype) for p in model.parameters()})
        got[name] = {"dtypes": sorted({str(p.dtype) for p in model.parameters()}), "full_params": kept,
                     "grad dtypes": grad_dtypes, "param": max_diff(full_state(model), full_state(reference))}
    path = os.path.join(tmp, "mixed")
    fullshard.save(path, model, optimizer, step=3)
    fresh = Mixed()
    fullshard.fully_shard(fresh, mp_policy=fullshard.MixedPrecisionPolicy(param_dtype=torch.float32))
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fullshard.load(path, fresh, fresh_optimizer)
    got["reload"] = max_diff(full_state(fresh), full_state(model))
    return got


def test_parameters_of_several_dtypes_share_a_unit(world2, world4, tmp_path):
    all_dtypes = ["torch.bfloat16", "torch.float16", "torch.float32", "torch.float64"]
    for world, tmp in ((world2, tmp_path / "2"), (world4, tmp_path / "4")):
        for got in world.run(mixed_dtypes_job, tmp=str(tmp)):
            assert got["reload"] == 0.0, got
            for name in ("own dtypes", "offload", "fp32 compute") + (("reshard to 2",) if world is world4 else ()):
                case = got[name]
                assert case["dtypes"] == all_dtypes and case["grad dtypes"] == all_dtypes[1:], (name, case)
                assert case["full_params"] == all_dtypes, (name, case)  # full_params shows the masters
                # the same arithmetic as one process but for the order in which ranks' gradients are summed:
                # float32 rounding of parameters near 1, times lr, over 3 steps
                assert case["param"] <= 1e-7, (name, case)


class Experts(nn.Module):
    """A layer and two experts' weights [experts, in, out]: with fewer experts than ranks,
    FSDP2 users split such weights along another dim than 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)
        self.experts = nn.Parameter(torch.randn(2, 5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) + torch.einsum("bi,eio->bo", x, self.experts)


def last_dim(param: nn.Parameter):
    from torch.distributed.tensor import Shard  # noqa: PLC0415

    return Shard(-1) if param.dim() >= 2 else None


def placement_job(tmp: str) -> dict:
    """shard_placement_fn splitting every matrix along its last dim: placements and local
    shapes as DTensor's Shard(d) chunks them, AdamW with clipping against one process (also with
    CPU offload, and built on meta then to_empty and filled in full_params), a checkpoint that
    loads into a dim-0 model bitwise, and refusals of what cannot be split."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415

    world, rank = dist.get_world_size(), dist.get_rank()
    got = {}
    for name in ("fp32", "offload", "meta"):
        torch.manual_seed(0)
        reference = Experts()
        with torch.device("meta" if name == "meta" else "cpu"):
            model = Experts()
        fullshard.fully_shard(model, shard_placement_fn=last_dim, offload_policy=fullshard.CPUOffloadPolicy(
            pin_memory=False) if name == "offload" else None)
        if name == "meta":
            model.to_empty(device="cpu")
            with fullshard.full_params(model):
                model.load_state_dict(reference.state_dict())
        else:
            model.load_state_dict({k: v.detach().clone() for k, v in reference.state_dict().items()}, assign=True)
        got[name] = {"layout": {n: (repr(p.placements[0]), tuple(p.to_local().shape))
                                for n, p in model.named_parameters()}}
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
        norms = []
        for step in range(3):
            x = torch.randn(4 * world, 5, generator=torch.Generator().manual_seed(step))
            model(x.chunk(world)[rank]).square().mean().backward()
            reference(x).square().mean().backward()
            norms.append(abs(fullshard.clip_grad_norm_(model, 0.5).item() -
                             torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item()))
            for opt in (optimizer, ref_optimizer):
                opt.step()
                opt.zero_grad()
        got[name].update(param=max_diff(full_state(model), full_state(reference)), norm=max(norms))
    path = os.path.join(tmp, "placed")
    fullshard.save(path, model, optimizer, step=3)
    rows = Experts()
    fullshard.fully_shard(rows)
    rows_optimizer = torch.optim.AdamW(rows.parameters(), lr=0.01)
    fullshard.load(path, rows, rows_optimizer)
    got["reload"] = max_diff(full_state(rows), full_state(model))
    got["refused"] = [raises(lambda fn=fn: fullshard.fully_shard(Experts(), shard_placement_fn=fn))
                      for fn in (lambda p: Replicate(), lambda p: Shard(p.dim()))]
    return got


def test_shard_placement_fn_splits_along_another_dim(world4, tmp_path):
    shapes = {name: p.shape for name, p in Experts().named_parameters()}
    for rank, got in enumerate(world4.run(placement_job, tmp=str(tmp_path))):
        expected = {}  # torch.chunk's split over 4 ranks along the dim asked for, as DTensor's Shard(d) places it
        for name, shape in shapes.items():
            dim = len(shape) - 1 if len(shape) >= 2 else 0
            chunks = torch.empty(shape).chunk(4, dim)
            local = chunks[rank].shape if rank < len(chunks) else shape[:dim] + (0,) + shape[dim + 1 :]
            expected[name] = (f"Shard(dim={dim})", tuple(local))
        for name in ("fp32", "offload", "meta"):
            case = got[name]
            assert case["layout"] == expected, (name, case)
            assert case["param"] <= ADAMW_TOL and case["norm"] <= LOSS_TOL, (name, case)
        assert got["reload"] == 0.0, got
        assert "Shard(d)" in got["refused"][0] and "Shard(d)" in got["refused"][1], got["refused"]


class Lookup(nn.Module):
    """A bf16-computed layer beside an integer parameter (a frozen index table), fed a batch
    object rather than a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.index = nn.Parameter(torch.tensor([1048577, 3, 70000, 2]), requires_grad=False)

    def forward(self, batch) -> torch.Tensor:
        x = batch["x"] if isinstance(batch, Mapping) else batch.x
        return self.proj(x), self.index.clone()


def details_job() -> dict:
    """What FSDP2 code relies on beyond the methods: torch's MixedPrecisionPolicy object taken,
    a dataclass or OrderedDict input cast to param_dtype (the caller's object left as it was), a
    custom mapping passed on, an integer parameter kept as it is under a param_dtype, and hooks
    registered with register_post_accumulate_grad_hook on the shards run once per reduced
    gradient, so an optimizer stepped inside backward trains like one stepped after."""
    import collections

    @dataclasses.dataclass
    class Batch:  # built only by the caller: its __post_init__ reads the tensor, and it has an InitVar
        x: torch.Tensor
        scale: dataclasses.InitVar[float] = 1.0

        def __post_init__(self, scale: float) -> None:
            self.rows = self.x.shape[0]

    class Box(MutableMapping):  # a mapping type fullshard cannot copy safely: passed on as it is
        def __init__(self, **items) -> None:
            self.items_ = items

        def __getitem__(self, key):
            return self.items_[key]

        def __setitem__(self, key, value) -> None:
            self.items_[key] = value

        def __delitem__(self, key) -> None:
            del self.items_[key]

        def __iter__(self):
            return iter(self.items_)

        def __len__(self) -> int:
            return len(self.items_)

    torch.manual_seed(0)
    model = Lookup()  # torch's own policy object, as a script importing it from torch passes it
    fullshard.fully_shard(model, mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    inputs = {"dataclass": Batch(torch.ones(2, 4)), "OrderedDict": collections.OrderedDict(x=torch.ones(2, 4))}
    got = {name: str(model(batch)[0].dtype) for name, batch in inputs.items()}
    got["caller's"] = [str(inputs["dataclass"].x.dtype), str(inputs["OrderedDict"]["x"].dtype)]
    got["index"] = model(inputs["dataclass"])[1].tolist()
    inner = Lookup()  # an inner unit, as its inputs are activations that require gradients
    fullshard.fully_shard(inner)
    box = Box(x=torch.ones(2, 4, requires_grad=True))
    inner(box)[0].sum().backward()
    got["box"] = box["x"] is not None and box["x"].grad is not None

    torch.manual_seed(0)
    stepped = tiny_gpt()
    after = copy.deepcopy(stepped)
    for model in (stepped, after):
        fullshard.shard_model(model, wrap={Block})
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in stepped.parameters()}
    calls = []

    def step_in_backward(param: nn.Parameter) -> None:
        calls.append(1)
        optimizers[param].step()
        optimizers[param].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step_in_backward) for p in stepped.parameters()]
    optimizer = torch.optim.SGD(after.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step)
        stepped(x, y).backward()
        after(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    got["calls"] = len(calls) / 3 / len(list(stepped.parameters()))
    got["in backward"] = max_diff(full_state(stepped), full_state(after))
    for handle in handles:  # a hook whose closure holds its parameter is a cycle the garbage collector
        handle.remove()  # cannot see through (autograd keeps the hooks): it would outlive the test
    return got


def test_inputs_integer_parameters_and_post_accumulate_hooks_as_fsdp2(world2):
    for got in world2.run(details_job):
        assert got["dataclass"] == got["OrderedDict"] == "torch.bfloat16", got
        assert got["caller's"] == ["torch.float32", "torch.float32"] and got["box"], got
        assert got["index"] == [1048577, 3, 70000, 2], got  # bf16 would give 1048576 and 70144
        assert got["calls"] == 1.0 and got["in backward"] == 0.0, got


def stages_job() -> dict:
    """Two groups of ranks, each sharding its own model over a mesh of its own ranks
    (DeviceMesh.from_group, as pipeline stages do; stage 1 in one unit, stage 0 in three):
    3 AdamW steps with clip_grad_norm_ and debug checks on train each like one process on its
    group's whole batch, the norm clipped to is over both models' gradients (every stage's, as a
    pipeline clips) on every rank, and a non-finite gradient on one rank of a stage skips the step
    on every rank of that stage (a stage agrees within itself: Root.settle_nonfinite), the other
    stage stepping."""
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    stage = rank // 2
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = DeviceMesh.from_group(groups[stage], "cpu")
    models = []
    for seed in (0, 1):  # both stages' models on every rank, for the references
        torch.manual_seed(seed)
        models.append(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
    model = copy.deepcopy(models[stage])
    if stage == 0:
        for layer in (model[0], model[2]):
            fullshard.fully_shard(layer, mesh=mesh)
    fullshard.fully_shard(model, mesh=mesh)
    model.set_debug_checks(True)
    model.set_nonfinite_grads("skip")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in models]
    norms = []
    for step in range(3):
        xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + s)) for s in (0, 1)]
        model(xs[stage].chunk(2)[rank % 2]).square().mean().backward()
        for m, x in zip(models, xs):
            m(x).square().mean().backward()
        squares = [torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]) ** 2 for m in models]
        total = (squares[0] + squares[1]).sqrt()
        for m in models:
            torch.nn.utils.clip_grads_with_norm_(m.parameters(), 0.05, total)
        norms.append(abs(fullshard.clip_grad_norm_(model, 0.05).item() - total.item()))
        for opt in (optimizer, *ref_optimizers):
            opt.step()
            opt.zero_grad()
    bad = torch.full((2, 6), float("nan") if rank == 3 else 1.0)  # one rank of stage 1
    model(bad).sum().backward()
    return {"param": max_diff(full_state(model), full_state(models[stage])), "norm": max(norms),
            "skipped": all(p.grad is None for p in model.parameters()),
            "stepping": all(p.grad is not None for p in model.parameters())}


def test_groups_of_ranks_each_shard_their_own_model(world4):
    for rank, got in enumerate(world4.run(stages_job)):
        assert got["param"] <= ADAMW_TOL and got["norm"] <= LOSS_TOL, got
        assert got["skipped"] if rank // 2 == 1 else got["stepping"], (rank, got)


def pipeline_mesh_job() -> dict:
    """A (pp, dp, tp) mesh of 2 x 2 x 1: each pp coordinate's model is sharded over mesh["dp"],
    with a plain parameter and a DTensor on mesh["tp"] left out of sharding (ignored_params). The
    norm clip_grad_norm_ returns counts each stage's pieces once: the plain and TP ones once per
    stage (not per dp rank), and both stages'."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh.get_local_rank("pp")
    totals = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        layer = nn.Linear(3, 4)
        layer.plain = nn.Parameter(torch.full((2,), 1.0 + seed))
        layer.tp = nn.Parameter(distribute_tensor(torch.full((3,), 2.0 + seed), mesh["tp"], [Replicate()]))
        if seed == stage:
            model = layer
        x = torch.ones(1, 3)  # the average over dp ranks of the same row
        (layer(x).sum() + layer.plain.sum() * 3 + layer.tp.to_local().sum() * 5).backward()
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in layer.parameters()]
        totals.append(torch.nn.utils.get_total_norm(grads) ** 2)
    for p in model.parameters():
        p.grad = None
    fullshard.fully_shard(model, mesh=mesh["dp"], ignored_params={model.plain, model.tp})
    model(torch.ones(1, 3)).sum().backward()  # half the batch on each dp rank
    model.plain.grad = torch.full((2,), 3.0)  # the ignored ones' gradients, as DDP would leave them
    model.tp.grad = distribute_tensor(torch.full((3,), 5.0), mesh["tp"], [Replicate()])
    return {"norm": abs(fullshard.clip_grad_norm_(model, 1e9).item() - (totals[0] + totals[1]).sqrt().item())}


def test_a_pipeline_mesh_counts_each_stage_once(world4):
    for got in world4.run(pipeline_mesh_job):
        assert got["norm"] <= LOSS_TOL, got


class SpmdMLP(nn.Module):
    """Weights split by tensor parallelism (columns, then rows) and a replicated scale, written
    for DTensor inputs on the full mesh."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.g = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(3, 8)), \
            nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.relu(x @ self.w1.T) @ self.w2.T) * self.g


def spmd_job() -> dict:
    """fully_shard(model, mesh=full_mesh, dp_mesh_dims=...) (torch 2.13's SPMD meshes) on
    (dp 2, tp 2) and on (replicate 2, shard 2): the same placements as torch's FSDP2, and 3 SGD
    steps on DTensor inputs give FSDP2's parameters (each rank's gradient on the data-parallel
    dims is its partial sum, averaged as FSDP2 averages it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    got = {}
    for names, dims, layouts in (
            (("dp", "tp"), DataParallelMeshDims(shard="dp"), [[Replicate(), Shard(0)], [Replicate(), Shard(1)],
                                                             [Replicate(), Replicate()]]),
            (("rep", "shard"), DataParallelMeshDims(shard="shard", replicate="rep"), [[Replicate(), Replicate()]] * 3)):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        runs = {}
        for shard_it in (fullshard.fully_shard, torch_fully_shard):
            torch.manual_seed(0)
            model = SpmdMLP()
            for (name, p), layout in zip(list(model.named_parameters()), layouts):
                setattr(model, name, nn.Parameter(distribute_tensor(p.detach(), mesh, layout)))
            shard_it(model, mesh=mesh, dp_mesh_dims=dims)
            placements = [tuple(p.placements) for p in model.parameters()]
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                batch = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
                dp_rank = mesh.get_local_rank(0) * 2 + mesh.get_local_rank(1) if names[0] == "rep" else \
                    mesh.get_local_rank(0)
                batch = batch.chunk(4 if names[0] == "rep" else 2)[dp_rank]
                x = DTensor.from_local(batch, mesh, [Shard(0), Shard(0) if names[0] == "rep" else Replicate()])
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            runs[shard_it] = ([repr(p) for p in placements], {n: p.full_tensor() for n, p in model.named_parameters()})
        (ours, our_values), (theirs, their_values) = runs[fullshard.fully_shard], runs[torch_fully_shard]
        got[names[0]] = {"placements": ours == theirs, "param": max_diff(our_values, their_values)}
    plain = nn.Linear(2, 2)
    got["plain refused"] = raises(lambda: fullshard.fully_shard(plain, mesh=mesh, dp_mesh_dims=dims))
    got["no mesh"] = raises(lambda: fullshard.fully_shard(nn.Linear(2, 2), dp_mesh_dims=dims))
    got["unknown dim"] = raises(lambda: fullshard.fully_shard(
        nn.Linear(2, 2), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")))
    return got


@pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"),
                    reason="DataParallelMeshDims is torch 2.13's: there is no FSDP2 to compare with before it")
def test_spmd_meshes_with_dp_mesh_dims_train_as_fsdp2(world4):
    for got in world4.run(spmd_job):
        for name in ("dp", "rep"):
            assert got[name]["placements"], got
            assert got[name]["param"] <= SGD_TOL, got  # the same arithmetic, averaged over ranks in another order
        assert "must be a DTensor on the mesh passed" in got["plain refused"], got
        assert "needs the full mesh" in got["no mesh"] and "named dims of the mesh" in got["unknown dim"], got
