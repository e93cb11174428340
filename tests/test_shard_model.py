"""shard_model: wrap policies and strategies, each trained against the single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard.gpt import Block
from tests.models import model_spec
from tests.reference import assert_parity, parity

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard"]


def wrap_policy(kind: str, units: set[type]):
    if kind == "classes":
        return units
    if kind == "int":
        return 3000  # in the tiny GPT: attention 3.7k, its c_attn 2.8k, MLP Linears 3.7k and 3.6k
    if kind == "callable":
        return lambda module, name: isinstance(module, tuple(units))
    return None


def unit_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, fullshard.FSDPModule)]


def shard_model_job(model: str, strategy: str, wrap: str, optimizer: str) -> dict:
    factory, batch_fn, loss_fn, units = model_spec(model)
    torch.manual_seed(0)
    module = factory()
    policy = wrap_policy(wrap, units)
    result = parity(module, lambda m: fullshard.shard_model(m, wrap=policy, strategy=strategy),
                    batch_fn, loss_fn, optimizer=optimizer)
    result["units"] = unit_names(module)
    result["placements"] = sorted({str(p.placements) for p in module.parameters()})
    return result


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("wrap", ["classes", "int", "callable", "none"])
def test_wrap_policies_and_strategies_match_single_process(world2, strategy, wrap):
    for optimizer in ("sgd", "adamw"):
        results = world2.run(shard_model_job, model="gpt", strategy=strategy, wrap=wrap, optimizer=optimizer)
        assert_parity(results, optimizer)
        units = results[0]["units"]
        if wrap in ("classes", "callable"):
            assert units == ["", "h.0", "h.1"]
        elif wrap == "int":  # bottom-up: the MLP's Linears reach 3000, then attention; blocks keep 120
            assert units == ["", "h.0.attn", "h.0.mlp.c_fc", "h.0.mlp.c_proj", "h.1.attn", "h.1.mlp.c_fc",
                             "h.1.mlp.c_proj"]
        else:
            assert units == [""]
        want = "(Replicate(),)" if strategy == "no_shard" else "(Shard(dim=0),)"
        assert want in results[0]["placements"]


@pytest.mark.parametrize("model", ["hf_gpt2", "hf_llama", "situations"])
@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_on_hugging_face_and_awkward_models(request, model, world):
    pool = request.getfixturevalue(f"world{world}")
    for strategy in STRATEGIES:
        assert_parity(pool.run(shard_model_job, model=model, strategy=strategy, wrap="classes", optimizer="adamw"),
                      "adamw")


def tied_head_job() -> dict:
    """A wrap policy that selects a head whose weight is tied to the embedding."""
    factory, batch_fn, loss_fn, _ = model_spec("hf_gpt2")
    torch.manual_seed(0)
    model = factory()
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    result = parity(model, lambda m: fullshard.shard_model(m, wrap={GPT2Block, nn.Linear}), batch_fn, loss_fn)
    result["tied"] = model.lm_head.weight is model.transformer.wte.weight
    result["units"] = unit_names(model)
    return result


def test_tied_weights_stay_one_parameter_in_the_common_ancestor(world2):
    for got in world2.run(tied_head_job):
        assert got["tied"]
        assert "lm_head" not in got["units"]  # its only parameter belongs to the root
        assert_parity([got], "adamw")


def strategy_mesh_job() -> list[str]:
    """shard_model with an explicit mesh whose dims fit the strategy."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    out = []
    for strategy, names in [("full_shard", ("shard",)), ("no_shard", ("replicate",))]:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fullshard.shard_model(model, strategy=strategy, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=names))
        out.append(str(model[0].weight.placements))
    return out


def test_explicit_mesh(world2):
    assert world2.run(strategy_mesh_job)[0] == ["(Shard(dim=0),)", "(Replicate(),)"]
