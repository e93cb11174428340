"""fully_shard: training parity with one process, the collectives it issues, memory it frees."""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard.gpt import GPT, Block, GPTConfig
from tests.models import SEQ, VOCAB, gpt_loss, model_spec, tiny_gpt, token_batch
from tests.reference import (CollectiveLog, assert_parity, full_state, global_batches,
                             local_slice, make_optimizer, max_diff, parity, train)

MODELS = ["gpt", "twice", "situations", "checkpoint_reentrant", "checkpoint_nonreentrant",
          "checkpoint_inner", "hf_gpt2", "hf_llama"]


def shard_each(units: set[type], **kwargs) -> callable:
    """fully_shard every instance of `units` bottom-up, then the root: FSDP2's usual recipe."""
    def shard(model: nn.Module) -> None:
        for module in reversed(list(model.modules())):
            if module is not model and isinstance(module, tuple(units)):
                fullshard.fully_shard(module, **kwargs)
        fullshard.fully_shard(model, **kwargs)
    return shard


def parity_job(model: str, optimizer: str, reshard_after_forward: bool) -> dict:
    factory, batch_fn, loss_fn, units = model_spec(model)
    torch.manual_seed(0)
    return parity(factory(), shard_each(units, reshard_after_forward=reshard_after_forward),
                  batch_fn, loss_fn, optimizer=optimizer)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_training_matches_single_process(request, world, model, reshard_after_forward):
    """Covers: uneven/empty shards, 0-d params, a block used twice, tied embedding and
    head in one unit, unused branches and outputs, frozen params, tuple/dict/dataclass
    outputs, reentrant and non-reentrant activation checkpointing, Hugging Face models."""
    pool = request.getfixturevalue(f"world{world}")
    for optimizer in ("sgd", "adamw"):
        results = pool.run(parity_job, model=model, optimizer=optimizer, reshard_after_forward=reshard_after_forward)
        assert_parity(results, optimizer)
        if world == 1:  # one rank computes exactly what one process computes
            assert results[0]["param"] == 0.0 and results[0]["loss"] == 0.0


def torch_fsdp2_job() -> float:
    """Largest difference between fullshard and torch's own fully_shard on the same training."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    ours = tiny_gpt()
    theirs = copy.deepcopy(ours)
    shard_each({Block})(ours)
    for block in theirs.h:
        torch_fully_shard(block)
    torch_fully_shard(theirs)
    batches = global_batches(token_batch, 3, 8)
    world = dist.get_world_size()
    loss = gpt_loss
    a = train(ours, make_optimizer("adamw", ours), batches, loss, world=world)
    b = train(theirs, make_optimizer("adamw", theirs), batches, loss, world=world)
    return max(abs(x - y) for x, y in zip(a, b)) + max_diff(full_state(ours), full_state(theirs))


def test_bitwise_equal_to_torch_fsdp2(world2):
    # Same shard layout, same reduction order: not one bit differs from torch FSDP2.
    assert world2.run(torch_fsdp2_job) == [0.0, 0.0]


def padded_numel(shape: torch.Size, world: int) -> int:
    return 1 if len(shape) == 0 else math.ceil(shape[0] / world) * math.prod(shape[1:])


def collectives_job(reshard_after_forward: bool) -> dict:
    torch.manual_seed(0)
    model = tiny_gpt()
    world = dist.get_world_size()
    blocks = [sum(padded_numel(p.shape, world) for p in block.parameters()) for block in model.h]
    root_params = [model.wte.weight, model.wpe.weight, *model.ln_f.parameters()]
    root = sum(padded_numel(p.shape, world) for p in root_params)
    shard_each({Block}, reshard_after_forward=reshard_after_forward)(model)
    batch = local_slice(token_batch(torch.Generator().manual_seed(0), 8), dist.get_rank(), world)
    model(*batch).backward()  # first step: lazy init
    with CollectiveLog() as log, fullshard.stats(model) as stats:
        model(*batch).backward()
    flags = [len(list(block.parameters())) for block in model.h] + [len(root_params)]  # one per parameter
    # Note [kept after forward]: the root and the last block (h.1) gather once
    gathered = blocks + [root] + (blocks[:1] if reshard_after_forward else [])
    rows = [n + f for n, f in zip(blocks + [root], flags)]  # a reduce-scatter row: shard + has-gradient flags
    return {
        "per_unit": {name: dict(counts) for name, counts in stats.per_unit.items()},
        "bytes": [stats.gather_bytes, stats.gather_wire_bytes, stats.reduce_scatter_bytes,
                  stats.reduce_scatter_wire_bytes, stats.all_reduce_bytes, stats.steps],
        # unit bytes x (N-1)/N per gather and per reduce-scatter (padded unit bytes: world x shard)
        "want_bytes": [4 * (world - 1) * sum(gathered), 4 * (world - 1) * sum(gathered),
                       4 * (world - 1) * sum(rows), 4 * (world - 1) * sum(rows), 0, 1],
        "messages": log.messages(world, itemsize=4),  # gloo: each collective is one message to each peer
        "want_messages": sorted((gathered + rows) * (world - 1)),
    }


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("world", [2, 4])
def test_one_collective_per_unit_per_pass_with_exact_bytes(request, world, reshard_after_forward):
    # full_shard: a block gathers before forward and again before backward, except the
    # root and the block that ran last (backward needs them at once, Note [kept after
    # forward]); every unit reduce-scatters once. shard_grad_op: every unit gathers once.
    # The bytes follow the formulas (a gather sends its unit's bytes x (N-1)/N), and the
    # messages on the wire are one per peer per collective, each a whole unit's flat
    # shard or row: no unit is split into several collectives.
    gathers = 2 if reshard_after_forward else 1
    for got in request.getfixturevalue(f"world{world}").run(collectives_job, reshard_after_forward=reshard_after_forward):
        assert got["per_unit"] == {"h.0": {"gathers": gathers, "reduce_scatters": 1},
                                   "h.1": {"gathers": 1, "reduce_scatters": 1},
                                   "<root>": {"gathers": 1, "reduce_scatters": 1}}
        assert got["bytes"] == got["want_bytes"]
        assert got["messages"] == got["want_messages"]


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def memory_job() -> dict:
    before = live_tensor_bytes()  # what earlier jobs in this persistent rank left (DCP keeps some)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=64))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_each({Block})(model)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    optimizer = make_optimizer("adamw", model)
    train(model, optimizer, global_batches(token_batch, 2, 8), gpt_loss, world=dist.get_world_size())
    return {"full": full_bytes, "shard": shard_bytes, "live": live_tensor_bytes() - before}


def test_full_parameters_are_freed_between_steps(world2):
    results = world2.run(memory_job)
    assert sum(got["shard"] for got in results) == results[0]["full"]  # the shards partition the model
    for got in results:
        assert got["shard"] <= got["full"] / 2 * 1.02  # half each, up to the uneven split of a few rows
        # everything alive between steps: the shards and AdamW's two moments (3 x shard;
        # zero_grad() dropped the gradients; communication buffers went back to the
        # allocator at the end of backward) plus small change (measured: 136 bytes); one
        # full copy of the parameters would add 2 x shard on top
        assert got["live"] < 3 * got["shard"] + got["full"] * 0.05, got


def api_job() -> dict:
    torch.manual_seed(0)
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    shard_each({Block})(model)
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {
        "swapped": [isinstance(m, fullshard.FSDPModule) and isinstance(m, type(r))
                    for m, r in [(model, reference), (model.h[0], reference.h[0])]],
        "placements": {str(p.placements) for p in model.parameters()},
        "local_rows": model.wte.weight.to_local().shape[0],
        "full_equal": max_diff(full_state(model), full_state(reference)),
        "is_param": all(isinstance(p, nn.Parameter) for p in model.parameters()),
    }
    # explicit unshard/reshard: full plain tensors on the module, then shards again
    model.h[0].unshard()
    out["unshard"] = [type(p) is nn.Parameter and p.shape == q.shape and torch.equal(p, q)
                      for p, q in zip(model.h[0].parameters(), reference.h[0].parameters())]
    model.h[0].reshard()
    handle = model.h[1].unshard(async_op=True)
    handle.wait()
    out["async"] = all(type(p) is nn.Parameter for p in model.h[1].parameters())
    model.h[1].reshard()
    # evaluation without autograd leaves no unit full, whatever reshard_after_forward says
    batch = local_slice(token_batch(torch.Generator().manual_seed(0), 8), rank, world)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            logits = model(batch[0])
        out[context.__name__] = [all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()),
                                 # logits below 8: 2 ulps, as LOSS_TOL (tests/reference.py)
                                 torch.allclose(logits, reference(batch[0]), atol=1e-6)]
    # gradients land on the shards as DTensors in the parameter dtype
    model(*batch).backward()
    out["grads"] = {(type(p.grad).__name__, p.grad.dtype, str(p.grad.placements)) for p in model.parameters()}
    return out


def test_parameters_are_dtensor_shards_and_modules_keep_their_class(world4):
    for rank, got in enumerate(world4.run(api_job)):
        assert got["swapped"] == [True, True]
        assert got["placements"] == {"(Shard(dim=0),)"}
        assert got["local_rows"] == [16, 16, 16, 13][rank]  # 61 rows split as torch.chunk does
        assert got["full_equal"] == 0.0  # padding is invisible
        assert got["is_param"]
        assert all(got["unshard"]) and got["async"]
        assert got["no_grad"] == [True, True] and got["inference_mode"] == [True, True]
        assert got["grads"] == {("DTensor", torch.float32, "(Shard(dim=0),)")}


def accumulate_job() -> float:
    """Two backward calls without zero_grad sum their gradients, as in plain PyTorch."""
    torch.manual_seed(0)
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    shard_each({Block})(model)
    batches = global_batches(token_batch, 2, 8)
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in batches:
        model(*local_slice(batch, rank, world)).backward()
        reference(*batch).backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return max_diff(got, {n: p.grad for n, p in reference.named_parameters()})


def test_gradients_accumulate_without_zero_grad(world2):
    # summed gradients of two steps: each a regrouped sum as in one step (tests/reference.py),
    # so they differ by a few roundings of gradients below ~0.1 (an ulp under 7.5e-9), twice
    assert max(world2.run(accumulate_job)) < 1e-7
