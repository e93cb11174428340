"""fullshard composed with the rest of PyTorch's training stack: activation checkpointing
as a shard_model knob (the planner's checkpointing goes through the same path)."""

from __future__ import annotations

import torch
from torch import nn

import fullshard
from fullshard.gpt import Block
from tests.models import gpt_loss, model_spec, tiny_gpt, token_batch
from tests.reference import assert_parity, parity
from tests.test_errors import raises


def saved_bytes(model: nn.Module, batch) -> tuple[int, float]:
    """Bytes autograd saves for backward in one forward (what checkpointing saves), and the
    gathers of a whole step."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with fullshard.stats(model) as s:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = gpt_loss(model, batch)
        loss.backward()
        gathers = s.gathers
    return saved, gathers


def checkpoint_job(checkpoint, model: str = "gpt") -> dict:
    factory, batch_fn, loss_fn, units = model_spec(model)
    torch.manual_seed(0)
    knob = dict(wrap=set(units), checkpoint=checkpoint)
    result = parity(factory(), lambda m: fullshard.shard_model(m, **knob), batch_fn, loss_fn, optimizer="adamw")
    costs = {}
    for on in (False, checkpoint):
        torch.manual_seed(0)
        sharded = fullshard.shard_model(tiny_gpt(), wrap={Block}, checkpoint=on)
        costs[bool(on)] = saved_bytes(sharded, token_batch(torch.Generator().manual_seed(0), 4))
    return {**result, "saved": {k: v[0] for k, v in costs.items()}, "gathers": {k: v[1] for k, v in costs.items()}}


def test_checkpointing_as_a_knob_trains_like_one_process_and_saves_activations(world2):
    for checkpoint in ({Block}, True):
        results = world2.run(checkpoint_job, checkpoint=checkpoint)
        assert_parity(results, "adamw")
        for got in results:
            assert got["saved"][True] < got["saved"][False] / 2, got["saved"]  # blocks keep only their inputs
            assert got["gathers"][True] == got["gathers"][False]  # recomputing gathers nothing more
    assert_parity(world2.run(checkpoint_job, checkpoint=True, model="hf_llama"), "adamw")


def bad_checkpoint_job() -> dict:
    return {"int wrap": raises(lambda: fullshard.shard_model(tiny_gpt(), wrap=1000, checkpoint=True)),
            "string": raises(lambda: fullshard.shard_model(tiny_gpt(), wrap={Block}, checkpoint="Block")),
            "not modules": raises(lambda: fullshard.shard_model(tiny_gpt(), checkpoint={int}))}


def test_a_checkpoint_argument_that_names_no_module_classes_is_refused(world1):
    got = world1.run(bad_checkpoint_job)[0]
    assert "takes its classes from wrap" in got["int wrap"]
    assert "not True, False or a set of module classes" in got["string"] and got["not modules"]
