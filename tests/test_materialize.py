"""Deferred initialization: meta-built models materialized while sharding, equal to eager ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard import FullShardError
from fullshard.gpt import GPT, Block, GPTConfig
from fullshard.accounting import process_memory
from tests.models import gpt_loss, hf_llama, hf_loss, hf_units, tiny_gpt, token_batch
from tests.world import World
from tests.reference import full_state, global_batches, make_optimizer, max_diff, train
from tests.test_errors import raises


def meta_equals_eager_job() -> float:
    torch.manual_seed(0)
    eager = fullshard.shard_model(tiny_gpt(), wrap={Block})
    torch.manual_seed(0)
    with torch.device("meta"):
        deferred = tiny_gpt()
    fullshard.shard_model(deferred, wrap={Block})
    return max_diff(full_state(deferred), full_state(eager))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_meta_built_model_equals_eager_built(request, world):
    # same seed, same random draws in the same order (Note [same values as eager]): exact
    assert request.getfixturevalue(f"world{world}").run(meta_equals_eager_job) == [0.0] * world


def sync_job(meta: bool) -> float:
    torch.manual_seed(dist.get_rank())  # every rank starts from different values
    if meta:
        with torch.device("meta"):
            model = tiny_gpt()
    else:
        model = tiny_gpt()
    fullshard.shard_model(model, wrap={Block}, sync_module_states=True)
    torch.manual_seed(0)
    rank0 = tiny_gpt()  # what rank 0 built
    return max_diff(full_state(model), full_state(rank0))


@pytest.mark.parametrize("meta", [False, True])
def test_sync_module_states_makes_rank0_win(world2, meta):
    assert world2.run(sync_job, meta=meta) == [0.0, 0.0]


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))  # initialized in __init__ only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class HalfInit(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)  # forgets the bias


def errors_job() -> list[str]:
    messages = []
    for build, kwargs in [(lambda: nn.Sequential(nn.Linear(4, 4), NoInit()), {}),
                          (lambda: nn.Sequential(HalfInit(4, 4)), {}),
                          (lambda: nn.Sequential(nn.Linear(4, 4)), {"param_init_fn": lambda m: None})]:
        with torch.device("meta"):
            model = build()
        messages.append(raises(lambda: fullshard.shard_model(model, **kwargs)))
    messages.append(raises(lambda: fullshard.shard_model(nn.Linear(2, 2), param_init_fn=lambda m: None)))
    return messages


def test_uninitialized_meta_tensors_are_named(world2):
    for no_init, half, noop, eager in world2.run(errors_job):
        assert "'1.scale'" in no_init and "param_init_fn" in no_init  # refused before anything changed
        assert "'0.bias'" in half and "'0.weight'" not in half  # left unset by reset_parameters
        assert "'0.weight'" in noop and "'0.bias'" in noop
        assert "no meta-device tensors" in eager


def hf_pretrained_job() -> dict:
    """Pretrained weights into a meta-built Llama: rotary tables (non-persistent buffers)
    are initialized, the weights streamed in, and it computes as the eager model does."""
    torch.manual_seed(0)
    eager = hf_llama()
    pretrained = {k: v.clone() for k, v in eager.state_dict().items()}
    with torch.device("meta"):
        model = hf_llama()
    fullshard.shard_model(model, wrap=hf_units("hf_llama"), param_init_fn=model._init_weights)
    fullshard.init_weights_from(model, pretrained)
    batch = global_batches(token_batch, 1, 4)[0]
    fullshard.shard_model(eager, wrap=hf_units("hf_llama"))
    with torch.no_grad():
        got, want = hf_loss(model, batch).item(), hf_loss(eager, batch).item()
    buffers = max((a - b).abs().max().item() for a, b in zip(model.buffers(), eager.buffers()))
    return {"params": max_diff(full_state(model), full_state(eager)), "buffers": buffers, "loss": abs(got - want),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight}


def test_pretrained_weights_into_a_meta_built_hugging_face_model(world2):
    for got in world2.run(hf_pretrained_job):
        assert got == {"params": 0.0, "buffers": 0.0, "loss": 0.0, "tied": True}


def bad_state_dict_job() -> str:
    model = fullshard.shard_model(tiny_gpt(), wrap={Block})
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    state.pop("wpe.weight")
    state["extra.weight"] = torch.zeros(1)
    state["ln_f.bias"] = torch.zeros(7)
    before = full_state(model)
    try:
        fullshard.init_weights_from(model, state)
    except FullShardError as e:
        assert max_diff(full_state(model), before) == 0.0  # nothing was copied
        return str(e)
    return ""


def test_init_weights_from_lists_every_mismatch(world2):
    for message in world2.run(bad_state_dict_job):
        assert "missing: ['wpe.weight']" in message and "unexpected: ['extra.weight']" in message
        assert "ln_f.bias: state dict (7,), model (30,)" in message


def to_empty_job() -> dict:
    """The FSDP2-style path: fully_shard on meta, Module.to_empty, then the user's init."""
    torch.manual_seed(0)
    eager = tiny_gpt()
    with torch.device("meta"):
        model = tiny_gpt()
    for block in model.h:
        fullshard.fully_shard(block)
    fullshard.fully_shard(model)
    on_meta = all(p.to_local().is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    placed = {(p.to_local().device.type, type(p).__name__) for p in model.parameters()}
    fullshard.init_weights_from(model, eager.state_dict())
    batches = global_batches(token_batch, 3, 8)
    loss = gpt_loss
    got = train(model, make_optimizer("adamw", model), batches, loss, world=dist.get_world_size())
    want = train(eager, make_optimizer("adamw", eager), batches, loss)
    return {"on_meta": on_meta, "placed": placed, "loss": max(abs(a - b) for a, b in zip(got, want)),
            "param": max_diff(full_state(model), full_state(eager))}


def test_fully_shard_on_meta_then_to_empty(world2):
    from tests.reference import assert_parity

    results = world2.run(to_empty_job)
    for got in results:
        assert got["on_meta"] and got["placed"] == {("cpu", "DTensor")}
    assert_parity(results, "adamw")


def construction_memory_job() -> dict:
    """Peak resident memory of building a 113M-parameter (454 MB) GPT on meta and sharding it."""
    cfg = GPTConfig(block_size=64, vocab_size=256, n_layer=16, n_head=8, n_embd=768)
    with torch.device("meta"):
        probe = GPT(cfg)
    full = sum(p.numel() * 4 for p in probe.parameters())
    unit = sum(p.numel() * 4 for p in probe.h[0].parameters())  # a block's full parameters: 28 MB
    open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from now
    before = process_memory("VmRSS")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    fullshard.shard_model(model, wrap={Block})
    return {"full": full, "unit": unit, "peak": process_memory("VmHWM") - before,
            "shard": sum(p.to_local().numel() * 4 for p in model.parameters())}


def test_meta_model_built_at_about_size_over_n_plus_one_unit(monkeypatch):
    # A fresh world, whose processes' memory has seen nothing else, with glibc's mmap
    # threshold fixed: by default glibc raises it each time a large block is freed, so
    # later blocks come from the heap, whose freed pages stay resident. Which blocks that
    # catches depends on timing: the peak then varied from 254 to 293 MB over six runs of
    # this job; with the threshold fixed it was 255 MB in all six. The test measures what
    # materialization holds, not that policy of the allocator.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    with World(2) as fresh:
        results = fresh.run(construction_memory_job)
    for got in results:
        assert got["shard"] <= got["full"] // 2 * 1.02
        # eager construction holds all 454 MB; here: the shards (227 MB), one unit's full
        # storage (28 MB) and one module's fresh tensors at a time (at most a block's
        # largest Linear, 9.4 MB), which leaves ~19 MB of the second unit for the runtime's
        # own memory while initializing (code of the init and copy kernels paged in: a few
        # MB on any CPU, far below the ~60 MB of a training step's, Note [runtime probe])
        assert got["peak"] <= got["full"] // 2 + 2 * got["unit"], got
