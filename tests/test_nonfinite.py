"""An inf or NaN survives every way gradients go on the wire (Note [block codes]): exact, bf16 and
int8 rows, on the rank that sends it and on the rank that keeps it, with plain backward, no_sync,
hybrid sharding and CPU offload; the loss scaler, the non-finite check and clipping then see what
they see after an exact reduction. And an average whose sum would overflow stays finite (Note
[averaging])."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard

N = 1200  # a row of 600 (world 2) or 300 (world 4): int8 blocks of 256 and a shorter last one
FORMATS = {"exact": None, "bf16": torch.bfloat16, "int8": torch.int8}
VALUES = {"nan": [math.nan], "+inf": [math.inf], "-inf": [-math.inf], "nan and inf in one block": [math.nan, math.inf]}


class Weights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()  # its gradient is x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.part = Weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(x)


def gradient(rank: int, value: str | None, where: str) -> torch.Tensor:
    """A rank's gradient: small values (an int8 block of a large scale would round them to 0), and
    on rank 0 the non-finite `value` in its own row ("kept": the rank that keeps it adds it as it
    is) or in rank 1's ("sent": it crosses the wire)."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(rank)) * 1e-3
    if value is not None and rank == 0:
        at = 10 if where == "kept" else N // dist.get_world_size() + 10
        for i, v in enumerate(VALUES[value]):
            x[at + i] = v
    return x


def build(send: torch.dtype | None, mode: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = None
    if mode.startswith("hybrid"):
        shape = {"hybrid 1x2": (1, 2), "hybrid 2x1": (2, 1), "hybrid 2x2": (2, 2)}[mode]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = Model()
    policy = fullshard.MixedPrecisionPolicy(reduce_send_dtype=send) if send else None
    offload = fullshard.CPUOffloadPolicy(pin_memory=False) if mode == "offload" else None
    for module in (model.part, model):
        fullshard.fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=offload)
    assert mesh is None or mesh.size() == world
    return model


def backward(model: nn.Module, x: torch.Tensor, mode: str) -> None:
    """One step's gradients: under no_sync a micro-batch of x held unreduced, then one of zeros
    that reduces both."""
    if mode == "no_sync":
        with fullshard.no_sync(model):
            model(x).backward()
        model(torch.zeros_like(x)).backward()
    else:
        model(x).backward()


def nonfinite_job(modes: list[str]) -> dict:
    """For every format, mode, value and place: which values of the averaged gradient are NaN,
    +inf and -inf against the exact average's, what clip_grad_norm_ returns, and that
    set_nonfinite_grads('raise') raises."""
    world = dist.get_world_size()
    failures, cases = [], 0
    for name, send in FORMATS.items():
        for mode in modes:
            model = build(send, mode)
            for value in VALUES:
                for where in ("kept", "sent"):
                    case = (name, mode, value, where)
                    cases += 1
                    x = gradient(dist.get_rank(), value, where)
                    want = sum(gradient(r, value, where).double() for r in range(world)) / world
                    model.zero_grad()
                    backward(model, x, mode)
                    got = model.part.w.grad.full_tensor().double()
                    for kind in ("isnan", "isposinf", "isneginf"):
                        if not torch.equal(getattr(torch, kind)(got), getattr(torch, kind)(want)):
                            failures.append((*case, kind, torch.nonzero(getattr(torch, kind)(got)).flatten().tolist()))
                    norm = fullshard.clip_grad_norm_(model, 1.0).item()
                    want_norm = torch.linalg.vector_norm(want).item()
                    if not (math.isnan(norm) and math.isnan(want_norm) or norm == want_norm):
                        failures.append((*case, "norm", norm, want_norm))
                    model.zero_grad()
                    model.set_nonfinite_grads("raise")
                    try:
                        backward(model, x, mode)
                        failures.append((*case, "did not raise"))
                    except fullshard.FullShardError as e:
                        if "is not finite" not in str(e):
                            failures.append((*case, str(e)[:200]))
                    model.set_nonfinite_grads(None)
    return {"failures": failures, "cases": cases}


def check_nonfinite(results: list[dict], modes: list[str]) -> None:
    for got in results:
        assert got["cases"] == len(FORMATS) * len(modes) * len(VALUES) * 2
        assert not got["failures"], got["failures"][:10]


def test_a_nonfinite_gradient_reaches_every_rank_in_every_format_at_world_2(world2):
    modes = ["plain", "no_sync", "hybrid 1x2", "hybrid 2x1", "offload"]
    check_nonfinite(world2.run(nonfinite_job, modes=modes), modes)


def test_a_nonfinite_gradient_reaches_every_rank_in_every_format_at_world_4(world4):
    modes = ["plain", "no_sync", "hybrid 2x2", "offload"]
    check_nonfinite(world4.run(nonfinite_job, modes=modes), modes)


def scaler_job() -> dict:
    """fp16-style loss scaling over each format: a NaN in one rank's sent row makes every rank skip
    the step and halve the scale; the next, finite step is taken."""
    out = {}
    for name, send in FORMATS.items():
        torch.manual_seed(0)
        model = build(send, "plain")
        before = model.part.w.full_tensor().clone()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = fullshard.GradScaler("cpu", init_scale=16.0)
        for value in ("nan", None):
            x = gradient(dist.get_rank(), value, "sent")
            scaler.scale(model(x)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out.setdefault(name, []).append((scaler.get_scale(), torch.equal(model.part.w.full_tensor(), before)))
    return out


def test_the_loss_scaler_skips_a_step_whose_gradient_is_nan_in_every_format(world2):
    for got in world2.run(scaler_job):
        for name, steps in got.items():
            # the NaN step: skipped (weights unchanged), scale halved; the finite one: taken
            assert steps == [(8.0, True), (8.0, False)], (name, steps)


def overflow_job(modes: list[str]) -> dict:
    """Every rank's gradients of 3e38, whose float32 sum is inf, average to 3e38 in every format."""
    out = {}
    for name, send in FORMATS.items():
        for mode in modes:
            model = build(send, mode)
            model(torch.full((N,), 3e38)).backward()
            got = model.part.w.grad.full_tensor()
            out[name, mode] = (bool(torch.isfinite(got).all()), (got / 3e38 - 1).abs().max().item())
    return out


def check_overflow(results: list[dict]) -> None:
    for got in results:
        for case, (finite, error) in got.items():
            # exact and bf16 rows: 3e38 rounded (bf16: to 8 bits); int8: every value its block's max
            assert finite and error <= 2**-8, (case, finite, error)


def test_an_average_whose_sum_overflows_stays_finite(world2, world4):
    check_overflow(world2.run(overflow_job, modes=["plain", "hybrid 1x2", "hybrid 2x1", "offload"]))
    check_overflow(world4.run(overflow_job, modes=["plain", "hybrid 2x2"]))


def test_fp16_rows_are_not_offered():
    with pytest.raises(fullshard.FullShardError, match="float16 is not offered"):
        fullshard.MixedPrecisionPolicy(reduce_send_dtype=torch.float16)
