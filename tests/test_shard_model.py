"""shard_model: wrap policies and strategies, each trained against the single-process reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard.gpt import Block
from tests.models import gpt_loss, hybrid_mesh, model_spec
from tests.reference import (ADAMW_TOL, LOSS_TOL, SGD_TOL, assert_parity, full_state, global_batches,
                             make_optimizer, max_diff, parity, train)

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


def inference_job(strategy: str, optimizer: str) -> dict:
    """Note [inference mode]: evaluations under torch.inference_mode() before the first step,
    between steps and after the last, against the same model in one process: training goes on
    as the reference's, and every evaluation computes what the reference computes then."""
    factory, batch_fn, loss_fn, units = model_spec("gpt")
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    mesh = hybrid_mesh(dist.get_world_size(), 1) if strategy == "hybrid_shard" else None
    fullshard.shard_model(model, wrap=units, strategy=strategy, mesh=mesh)
    opt, ref_opt = make_optimizer(optimizer, model), make_optimizer(optimizer, reference)
    batches = global_batches(batch_fn, 3, 8)
    evaluated = batches[0][0]  # the whole global batch, on every rank
    outputs, losses = [], []
    for i, batch in enumerate([*batches, None]):
        with torch.inference_mode():
            outputs.append((model(evaluated) - reference(evaluated)).abs().max().item())
            if i == 1:  # the other ways in under inference mode: full_params, and unshard by hand
                with fullshard.full_params(model, writeback=False):
                    outputs.append((model(evaluated) - reference(evaluated)).abs().max().item())
                model.unshard()
                model.reshard()
        if batch is not None:
            losses.append(train(model, opt, [batch], loss_fn, world=dist.get_world_size())[0]
                          - train(reference, ref_opt, [batch], loss_fn)[0])
    return {"outputs": outputs, "loss": max(abs(d) for d in losses),
            "param": max_diff(full_state(model), full_state(reference))}


@pytest.mark.parametrize("strategy", [*STRATEGIES, "hybrid_shard"])
def test_inference_mode_evaluations_before_between_and_after_steps_train_on(world2, strategy):
    for optimizer in ("sgd", "adamw"):
        for got in world2.run(inference_job, strategy=strategy, optimizer=optimizer):
            # before any step: the same weights on the same batch, computed alike
            assert got["outputs"][0] == 0.0, got
            # after steps: the parameters' parity (SGD/ADAMW_TOL) carried through a forward of
            # logits of magnitude ~1, so a few times the parameter tolerance
            assert max(got["outputs"]) <= 10 * (SGD_TOL if optimizer == "sgd" else ADAMW_TOL), got
            assert got["loss"] <= LOSS_TOL and got["param"] <= (SGD_TOL if optimizer == "sgd" else ADAMW_TOL), got


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


# ---- scheduling: prefetch order, limiter, overlap ------------------------------------


def gpt4():
    from fullshard.gpt import GPT, GPTConfig
    from tests.models import SEQ, VOCAB
    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=4, n_head=2, n_embd=32))


def record_schedule(model: nn.Module, step) -> list[tuple[str, str]]:
    """The order of one step's events: a unit's hook entering ("fwd"/"bwd"), its gather
    being issued ("gather"), its gradient computation ("grad", when the gradient of its
    first op's output is computed), and its reduction being issued ("reduce")."""
    from fullshard.reduce import Reductions
    from fullshard.root import Scheduler
    from fullshard.unit import Phase, ShardState, Unit

    events: list[tuple[str, str]] = []
    saved = Unit.unshard, Reductions.issue, Scheduler.record

    def unshard(self, adopt=True):
        if self.state is ShardState.SHARDED:
            events.append(("gather", self.fqn))
        saved[0](self, adopt)

    def reduce_grads(self, *args):
        events.append(("reduce", self.naming.fqn))
        saved[1](self, *args)

    def record(self, unit):
        events.append(("fwd" if unit.phase is Phase.FORWARD else "bwd", unit.fqn))
        saved[2](self, unit)

    handles = [block.ln_1.register_full_backward_pre_hook(lambda m, g, name=f"h.{i}": events.append(("grad", name)))
               for i, block in enumerate(model.h)]
    Unit.unshard, Reductions.issue, Scheduler.record = unshard, reduce_grads, record
    try:
        step()
    finally:
        Unit.unshard, Reductions.issue, Scheduler.record = saved
        for handle in handles:
            handle.remove()
    return events


def schedule_job(backward_prefetch, forward_prefetch: bool, limit) -> dict:
    from tests.models import token_batch
    from tests.reference import global_batches, local_slice

    torch.manual_seed(0)
    model = gpt4()
    result = parity(model, lambda m: fullshard.shard_model(m, wrap={Block}, backward_prefetch=backward_prefetch,
                                                           forward_prefetch=forward_prefetch, limit_all_gathers=limit),
                    token_batch, gpt_loss, steps=3)
    batch = local_slice(global_batches(token_batch, 1, 8)[0], dist.get_rank(), dist.get_world_size())
    with fullshard.stats(model) as stats:
        result["events"] = record_schedule(model, lambda: model(*batch).backward())
    result["peak"] = stats.peak_full_param_bytes
    world = dist.get_world_size()
    padded = lambda params: sum(4 * world * -(-p.shape[0] // world) * p[0].numel() for p in params)
    plain = gpt4()
    result["block"] = padded(plain.h[0].parameters())
    result["root"] = padded([plain.wte.weight, plain.wpe.weight, *plain.ln_f.parameters()])
    result["left_full"] = stats.full_param_bytes
    return result


def test_backward_prefetch_modes(world2):
    # Backward runs h.3 (kept full after forward), h.2, h.1, h.0, then the root's
    # reduction in the final callback. "pre" gathers the next unit before the current
    # unit's gradient computation, "post" after it, None only when the unit is reached.
    want = {
        "pre": [("bwd", "h.3"), ("gather", "h.2"), ("grad", "h.3"), ("reduce", "h.3"),
                ("bwd", "h.2"), ("gather", "h.1"), ("grad", "h.2"), ("reduce", "h.2")],
        "post": [("bwd", "h.3"), ("grad", "h.3"), ("gather", "h.2"), ("reduce", "h.3"),
                 ("bwd", "h.2"), ("grad", "h.2"), ("gather", "h.1"), ("reduce", "h.2")],
        None: [("bwd", "h.3"), ("grad", "h.3"), ("reduce", "h.3"),
               ("bwd", "h.2"), ("gather", "h.2"), ("grad", "h.2"), ("reduce", "h.2")],
    }
    for mode, events in want.items():
        for got in world2.run(schedule_job, backward_prefetch=mode, forward_prefetch=False, limit=1):
            assert_parity([got], "adamw")
            backward = got["events"][got["events"].index(("bwd", "h.3")):]
            assert backward[: len(events)] == events, (mode, backward)
            assert backward[-1] == ("reduce", "<root>")
            assert got["left_full"] == 0  # after the step no unit holds full parameters


def test_forward_prefetch_follows_the_recorded_order(world2):
    for limit, ahead in [(1, 1), (2, 2)]:
        for got in world2.run(schedule_job, backward_prefetch="pre", forward_prefetch=True, limit=limit):
            assert_parity([got], "adamw")
            forward = got["events"][: got["events"].index(("fwd", "h.3")) + 1]
            # the root gathers itself, then `limit` units ahead; each unit's start then
            # tops the prefetch up again, so a unit never waits for its own gather to begin
            assert forward[:2] == [("fwd", "<root>"), ("gather", "<root>")]
            assert forward[2 : 2 + ahead] == [("gather", f"h.{i}") for i in range(ahead)]
            assert [e for e in forward if e[0] == "gather"] == [("gather", n) for n in ["<root>", "h.0", "h.1", "h.2", "h.3"]]
            assert forward.index(("gather", "h.1")) < forward.index(("fwd", "h.0")) + (2 if limit == 1 else 0)


def test_limiter_bounds_full_parameters(world2):
    # Full parameters alive at once, exactly: the root, the block computing and `limit`
    # blocks gathered ahead (in backward the kept last block is the one computing).
    # Peak memory falls with the limit; with 4 blocks a limit of 3 is no limit.
    peaks = {}
    for limit in (None, 3, 2, 1):
        got = world2.run(schedule_job, backward_prefetch="pre", forward_prefetch=True, limit=limit)[0]
        assert_parity([got], "adamw")
        peaks[limit] = got["peak"]
        root = got["root"]
    block = got["block"]
    for limit in (3, 2, 1):
        assert peaks[limit] == root + (1 + limit) * block, (limit, peaks)
    assert peaks[None] == peaks[3]


def explicit_prefetch_job() -> list[tuple[str, str]]:
    from tests.models import token_batch
    from tests.reference import global_batches, local_slice

    torch.manual_seed(0)
    model = gpt4()
    for block in reversed(model.h):
        fullshard.fully_shard(block)
    fullshard.fully_shard(model)
    model.h[0].set_modules_to_forward_prefetch([model.h[2], model.h[1]])
    model.h[3].set_modules_to_backward_prefetch([model.h[0]])
    batch = local_slice(global_batches(token_batch, 1, 8)[0], dist.get_rank(), dist.get_world_size())
    model(*batch).backward()
    return record_schedule(model, lambda: model(*batch).backward())


def test_explicit_prefetch_lists_override_the_order(world2):
    for events in world2.run(explicit_prefetch_job):
        fwd_h0 = events.index(("fwd", "h.0"))
        assert events[fwd_h0 : fwd_h0 + 4] == [("fwd", "h.0"), ("gather", "h.0"), ("gather", "h.2"), ("gather", "h.1")]
        bwd_h3 = events.index(("bwd", "h.3"))
        assert events[bwd_h3 : bwd_h3 + 2] == [("bwd", "h.3"), ("gather", "h.0")]


class Branchy(nn.Module):
    """Takes a different middle block on odd steps: the forward order changes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(6, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        path = [0, 1, 3] if self.calls % 2 else [0, 2, 3]
        x = self.embed(x)
        for i in path:
            x = self.blocks[i](x)
        return nn.functional.cross_entropy(self.head(x), y)


def branchy_job() -> dict:
    from tests.models import situations_batch

    torch.manual_seed(0)
    result = parity(Branchy(), lambda m: fullshard.shard_model(m, wrap={nn.Sequential}, forward_prefetch=True,
                                                               limit_all_gathers=None),
                    situations_batch, gpt_loss, steps=4)
    return result


def test_changed_forward_order_is_followed_and_stays_exact(world2):
    assert_parity(world2.run(branchy_job), "adamw")
