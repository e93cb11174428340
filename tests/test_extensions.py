"""FSDP2's all-gather extensions (Note [all-gather extensions], fullshard/extension.py): a
parameter subclass that decides what its gather sends, at world 2, against torch's FSDP2
running the same subclass."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.testing._internal.two_tensor import TwoTensor

import fullshard
from tests.world import World


class HalfOnWire(TwoTensor):
    """Keeps fp32 values (twice, as TwoTensor does: every op runs on both) and gathers them
    as bf16, rebuilding an fp32 full parameter: half the bytes of an fp32 gather, and
    forward computes with the values rounded to bf16, as predictable bit for bit."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.a.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        if out is not None:  # refill the full parameter autograd may have saved (FSDP2 asks the subclass
            with torch.no_grad(), _unsafe_preserve_version_counter(out):  # to keep its version)
                out.copy_(gathered)
            return None
        full = gathered.to(param_dtype)
        return full, (full,)


def model_with(subclass) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        weight = layer.weight.detach()
        layer.weight = nn.Parameter(subclass(weight.clone(), weight.clone()))
    return model


def sgd_steps(model: nn.Module, shape: tuple[int, int], steps: int) -> list[float]:
    """`steps` SGD steps on this rank's random batches of `shape`; the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(*shape, generator=generator)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train(shard, steps: int = 3, debug: bool = False) -> dict:
    model = model_with(HalfOnWire)
    shard(model[0])
    shard(model[2])
    shard(model)
    if debug:
        model.set_debug_checks(True)
    losses = sgd_steps(model, (4, 8), steps)
    weights = [p.full_tensor() for p in model.parameters()]
    return {"losses": losses, "weights": [w.a if isinstance(w, TwoTensor) else w for w in weights],
            "model": model}


def half_on_wire_job() -> dict:
    ours = train(fullshard.fully_shard)
    with fullshard.stats(ours["model"]) as stats:
        x = torch.randn(4, 8)
        ours["model"](x).sum().backward()
        gather_bytes = stats.gather_bytes
    out = {"losses": ours["losses"], "weight sums": [w.double().sum().item() for w in ours["weights"]],
           "gather bytes": gather_bytes}
    from torch.distributed.fsdp import fully_shard

    theirs = train(fully_shard)
    out["same as FSDP2"] = ours["losses"] == theirs["losses"] and all(
        torch.equal(a, b) for a, b in zip(ours["weights"], theirs["weights"]))
    return out


def test_a_subclass_that_gathers_bf16_trains_as_on_fsdp2(world2):
    got = world2.run(half_on_wire_job)
    assert got[0]["weight sums"] == got[1]["weight sums"]  # every rank the same model
    assert all(g["same as FSDP2"] for g in got), got  # losses and weights bitwise FSDP2's
    # one backward: the two Linear units gather in forward, the first again in backward (the
    # last stays full), the root has no parameters; each weight as bf16, each bias as fp32,
    # (N-1)/N of every gather: rank 0 sends its half
    per_gather = {0: (8 * 16 // 2) * 2 + (16 // 2) * 4, 2: (16 * 4 // 2) * 2 + (4 // 2) * 4}
    assert got[0]["gather bytes"] == 2 * per_gather[0] + per_gather[2]


def float8_train(shard, steps: int = 3) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    shard(model[0])
    shard(model[2])
    shard(model)
    losses = sgd_steps(model, (16, 32), steps)
    return {"losses": losses, "weights": [plain_of(p.to_local()) for p in model.parameters()], "model": model}


def plain_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._tensor if hasattr(tensor, "_tensor") else tensor  # torchao's weight wrapper holds the fp32 values


def float8_job() -> dict:
    from torch.distributed.fsdp import fully_shard

    ours, theirs = float8_train(fullshard.fully_shard), float8_train(fully_shard)
    with fullshard.stats(ours["model"]) as stats:
        ours["model"](torch.randn(16, 32)).sum().backward()
        gather_bytes = stats.gather_bytes
    return {"same as FSDP2": ours["losses"] == theirs["losses"] and all(
                torch.equal(a, b) for a, b in zip(ours["weights"], theirs["weights"])),
            "losses": ours["losses"], "gather bytes": gather_bytes}


def test_torchao_float8_training_gathers_float8_and_matches_fsdp2():
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # a torchao built for another torch fails in its own ways
        pytest.skip(f"torchao's float8 training does not import here ({type(e).__name__}: {e})"[:200])
    # a world of its own: in a process that has run a bf16 matmul, oneDNN without AVX-512 (a CPU
    # without it, or ONEDNN_MAX_CPU_ISA=AVX2) cannot make torchao's float8 matmul ("could not
    # create a primitive descriptor for the matmul primitive", torch 2.13: a bf16 nn.Linear, then
    # a float8 one, in one process), and the pooled worlds run bf16 jobs
    with World(2, forked=True) as fresh:
        got = fresh.run(float8_job)
    assert all(g["same as FSDP2"] for g in got), got
    # a backward's gathers (both units in forward, the first again in backward): each weight as
    # float8 (1 byte, half of bf16's 2), each bias as fp32; rank 0 sends its half of each
    per_gather = {0: (64 * 32 // 2) * 1 + (64 // 2) * 4, 2: (32 * 64 // 2) * 1 + (32 // 2) * 4}
    assert got[0]["gather bytes"] == 2 * per_gather[0] + per_gather[2]


class TwoOnWire(TwoTensor):
    """PyTorch's own extension test pattern: both inner tensors go on the wire and the full
    parameter is a TwoTensor of the gathered ones, rebuilt in the same buffers each gather."""

    def fsdp_pre_all_gather(self, mesh):  # FSDP2's older, one-argument form
        return (self.a, self.b), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:  # the outputs are the buffers `out` was made of: nothing to do
            return None
        return TwoTensor(*outputs), outputs


def two_on_wire_job() -> dict:
    torch.manual_seed(0)
    model = model_with(TwoOnWire)
    reference = model_with(TwoTensor)
    for module in (model[0], model[2], model):
        fullshard.fully_shard(module)
    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(dist.get_world_size())]
    x = inputs[dist.get_rank()]
    outs = [model(x) for _ in range(2)]  # the second gather reuses the first's buffers
    want = reference(x)
    outs[1].sum().backward()
    for other in inputs:  # the average gradient over the ranks' batches, on one process
        reference(other).sum().backward()
    expected = reference[0].weight.grad.a / dist.get_world_size()
    rows = model[0].weight.grad.to_local()
    first = dist.get_rank() * rows.shape[0]
    return {"equal": all(torch.equal(o.a, want.a) and torch.equal(o.b, want.b) for o in outs),
            "type": type(outs[0]).__name__,
            "grad": (rows - expected[first : first + rows.shape[0]]).abs().max().item()}


def test_a_two_tensor_subclass_gathers_both_tensors_and_rebuilds_in_place(world2):
    for got in world2.run(two_on_wire_job):
        # the reduced gradient is a plain tensor (the two inner gradients are alike here); the
        # average over 2 ranks, summed in rank order: exact
        assert got == {"equal": True, "type": "TwoTensor", "grad": 0.0}


def variants_job() -> dict:
    """The bf16-gathering subclass under shard_model with forward prefetch, under CPU offload,
    with debug checks, and sharded as shard_grad_op and no_shard: the same losses and weights,
    bit for bit, as plain fully_shard."""
    import functools

    base = train(fullshard.fully_shard)
    prefetched = train(lambda m: None if not isinstance(m, nn.Sequential) else
                       fullshard.shard_model(m, wrap={nn.Linear}, forward_prefetch=True))
    offloaded = train(functools.partial(fullshard.fully_shard, offload_policy=fullshard.CPUOffloadPolicy()))
    checked = train(fullshard.fully_shard, debug=True)
    strategies = {strategy: train(lambda m, strategy=strategy: None if not isinstance(m, nn.Sequential) else
                                  fullshard.shard_model(m, wrap={nn.Linear}, strategy=strategy))
                  for strategy in ("shard_grad_op", "no_shard")}
    same = {name: run["losses"] == base["losses"] and all(torch.equal(a, b) for a, b in zip(run["weights"],
                                                                                          base["weights"]))
            for name, run in (("prefetch", prefetched), ("offload", offloaded), ("debug checks", checked),
                              *strategies.items())}
    return same


def test_extensions_with_prefetch_offload_debug_checks_and_other_strategies(world2):
    for got in world2.run(variants_job):
        # 2 ranks: every strategy sums the same two rows, so all are bitwise alike
        assert got == {"prefetch": True, "offload": True, "debug checks": True, "shard_grad_op": True,
                       "no_shard": True}, got


def int_reshard_job() -> dict:
    """reshard_after_forward=2 at world 4 (the gather before backward inside pairs of ranks,
    from the gathered outputs kept after forward): bitwise the same training as True."""
    def sharded(k):
        return lambda m: fullshard.fully_shard(m, reshard_after_forward=k if not isinstance(m, nn.Sequential) else True)

    kept, freed = train(sharded(2)), train(sharded(True))
    return {"same": kept["losses"] == freed["losses"] and all(torch.equal(a, b) for a, b in zip(kept["weights"],
                                                                                                freed["weights"]))}


def test_an_int_reshard_after_forward_with_extensions(world4):
    for got in world4.run(int_reshard_job):
        assert got == {"same": True}
