"""int8 and float8 block-quantized all-gathers (Note [int8 gathers], fullshard/quantize.py): the
bytes they send, exactly, the error they make, and training next to bf16 gathers."""

from __future__ import annotations

import math

import pytest

import torch
import torch.distributed as dist

from types import SimpleNamespace

import fullshard
from fullshard.gpt import Block
from fullshard.hooks import units_under
from fullshard.gather import Context
from fullshard.options import UnitOptions
from fullshard.quantize import Quantized, quantized_bytes
from tests.models import overfit, tiny_gpt, token_batch


@pytest.mark.parametrize("block", [256, 64, 1000])
def test_the_error_of_each_block_is_at_most_half_its_step(block):
    """One rank's shard through quantize and dequantize: every value within s/2 of its block's
    s = max|x| / 127 (float32 arithmetic adds at most a few ulps), zeros exact; for the default
    block and for the other sizes MixedPrecisionPolicy(gather_block=...) offers."""
    generator = torch.Generator().manual_seed(0)
    shard = torch.randn(1000, generator=generator) * torch.logspace(-3, 2, 1000)  # blocks of unlike scales
    shard[256:512] = 0
    full = torch.empty(1000)
    param = SimpleNamespace(shard_numel=1000, full_padded=full, replicated=False)  # what the format reads
    options = UnitOptions(True, gather_dtype=torch.int8, gather_block=block)
    quantizer = Quantized(param, torch.float32, Context(options, shard.device, 1))
    q, scales = quantizer.inputs(shard)
    assert q.dtype == torch.int8 and q.numel() == 1000 and scales.numel() == -(-1000 // block)
    quantizer.allocate(small=False)
    q_out, s_out = quantizer.outputs(small=False)
    q_out.copy_(q)
    s_out.copy_(scales)
    quantizer.after(small=False)
    error = (full - shard).abs()
    step = scales.repeat_interleave(block)[:1000]
    assert (error <= step / 2 * (1 + 1e-6)).all(), (error / step).max()
    assert torch.equal(full[256:512], shard[256:512])
    assert quantized_bytes(1000, block) == 1000 + 4 * -(-1000 // block)


def test_float8_gathers_keep_each_value_within_its_relative_step():
    """gather_dtype=float8_e4m3fn: the same blocks and scales (s = max|x| / 448), each value a
    float8 with 3 mantissa bits: within 2^-4 of itself, or, below e4m3's normal range
    (2^-6 s), within half its subnormal spacing 2^-9 s."""
    generator = torch.Generator().manual_seed(0)
    shard = torch.randn(1000, generator=generator) * torch.logspace(-3, 2, 1000)
    full = torch.empty(1000)
    param = SimpleNamespace(shard_numel=1000, full_padded=full, replicated=False)
    options = UnitOptions(True, gather_dtype=torch.float8_e4m3fn)
    quantizer = Quantized(param, torch.float32, Context(options, shard.device, 1))
    q, scales = quantizer.inputs(shard)
    assert q.dtype == torch.float8_e4m3fn and q.numel() == 1000 and scales.numel() == 4
    quantizer.allocate(small=False)
    for out, value in zip(quantizer.outputs(small=False), (q, scales)):
        out.copy_(value)
    quantizer.after(small=False)
    s = scales.repeat_interleave(256)[:1000]
    bound = torch.maximum(shard.abs() * 2**-4, s * 2**-10) * (1 + 1e-6)
    assert ((full - shard).abs() <= bound).all(), ((full - shard).abs() / bound).max()


def through_gather(shard: torch.Tensor, dtype: torch.dtype, host: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's shard quantized and rebuilt as a gather does (`host`: the CPU's plain path when
    the scales allow; False: the path a GPU takes every time): (the full values, the scales sent)."""
    full = torch.empty(shard.numel())
    param = SimpleNamespace(shard_numel=shard.numel(), full_padded=full, replicated=False)
    quantizer = Quantized(param, torch.float32, Context(UnitOptions(True, gather_dtype=dtype), shard.device, 1))
    quantizer.host = host
    q, scales = quantizer.inputs(shard)
    quantizer.allocate(small=False)
    for out, value in zip(quantizer.outputs(small=False), (q, scales)):
        out.copy_(value)
    quantizer.after(small=False)
    return full, scales


def test_nonfinite_and_subnormal_weights_come_back_as_themselves_in_every_block_format():
    """Note [block codes]: a NaN, +inf or -inf in a block (alone, together, beside large and tiny
    values) is rebuilt as itself, and the block's finite values stay within half its step; blocks
    of float32 subnormals keep their values (1 and 2 ulps exact, 190 ulps within half a step,
    where a scale rounded to the nearest subnormal clamped them); on both the CPU's path and the
    GPU's."""
    ulp = 2.0**-149
    generator = torch.Generator().manual_seed(0)
    shard = torch.randn(1100, generator=generator)
    shard[3], shard[300], shard[301], shard[600], shard[601], shard[602] = \
        math.nan, math.inf, -math.inf, math.nan, math.inf, 1e30
    shard[768:1024] = torch.arange(256) % 3 * ulp  # 0, 1 and 2 ulps
    shard[1024:] = torch.linspace(-190, 190, 76).round() * ulp
    finite = torch.isfinite(shard)
    for dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
        for host in (True, False):
            full, scales = through_gather(shard, dtype, host)
            for kind in (torch.isnan, torch.isposinf, torch.isneginf):
                assert torch.equal(kind(full), kind(shard)), (dtype, host, kind)
            assert (scales[:3] < 0).all() and (scales[3:] > 0).all(), scales  # the flag: three blocks
            error = (full - shard).abs()[finite]
            if dtype == torch.int8:
                bound = scales.abs().repeat_interleave(256)[:1100][finite] / 2
            else:  # float8: relative 2^-4 (e5m2 2^-3), or below its normal range half its subnormal step
                s = scales.abs().repeat_interleave(256)[:1100][finite]
                bound = torch.maximum(shard[finite].abs() * (2**-4 if dtype == torch.float8_e4m3fn else 2**-3),
                                      s * 2**-9)
            assert (error <= bound * (1 + 1e-6)).all(), (dtype, host, (error / bound).max())
            assert torch.equal(full[768:1024], shard[768:1024]), (dtype, host)  # a few ulps: exact


def train(gather_dtype, steps: int = 6, block: int = 256) -> dict:
    torch.manual_seed(0)
    model = tiny_gpt()
    policy = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, gather_dtype=gather_dtype, gather_block=block)
    fullshard.shard_model(model, wrap={Block}, mp_policy=policy)
    with fullshard.stats(model) as stats:
        losses = overfit(model, steps)
        sent = stats.gather_bytes
        per_unit = {name: dict(counts) for name, counts in stats.per_unit.items()}
    world = dist.get_world_size()
    predicted = 0  # Note [int8 gathers]'s formula, per parameter of each unit, times its gathers
    for unit in units_under(model):
        per_gather = sum(quantized_bytes(p.shard_numel, block) if p.sharded.dtype.is_floating_point and not p.replicated
                         else p.shard_numel * 2 for p in unit.params)
        predicted += per_unit.get(unit.fqn, {}).get("gathers", 0) * (world - 1) * per_gather
    return {"losses": losses, "sent": sent, "predicted": predicted}


def int8_job() -> dict:
    int8, bf16, float8 = train(torch.int8), train(None), train(torch.float8_e4m3fn)
    small = train(torch.int8, block=16)  # more scales: more bytes, a finer step
    return {"sent": int8["sent"], "predicted": int8["predicted"], "ratio": int8["sent"] / bf16["sent"],
            "block 16": small,
            "losses": int8["losses"], "bf16 losses": bf16["losses"], "float8 losses": float8["losses"],
            "float8 sent": float8["sent"]}


def test_int8_gathers_send_the_formula_s_bytes_and_train_like_bf16_gathers(world2):
    for got in world2.run(int8_job):
        assert got["sent"] == got["predicted"], got  # exact, as the planner predicts it
        # (1 + 4/B)/2 of bf16's for big shards; this GPT's shards are small (a LayerNorm's 15
        # values take a scale of their own: (15 + 4)/30)
        assert 0.5 < got["ratio"] < 0.6, got
        # weights within half a step (1/254 of a block's largest) against bf16's 1/256 rounding:
        # the losses stay within 2% of bf16 gathers' over 6 AdamW steps (lr 1e-2) while both fall
        for a, b in zip(got["losses"], got["bf16 losses"]):
            assert abs(a - b) <= 0.02 * b, got
        assert got["losses"][-1] < got["losses"][0]
        # float8 (e4m3) gathers: the same bytes; weights within 2^-4 of themselves (bf16: 2^-8),
        # the losses within 3% of bf16 gathers'
        assert got["float8 sent"] == got["sent"], got
        for a, b in zip(got["float8 losses"], got["bf16 losses"]):
            assert abs(a - b) <= 0.03 * b, got
        # gather_block=16: the formula's bytes for that block, more than 256's, and the losses
        # as close to bf16 gathers' (each value within half a step of a block 16 times smaller)
        small = got["block 16"]
        assert small["sent"] == small["predicted"] > got["sent"], got
        for a, b in zip(small["losses"], got["bf16 losses"]):
            assert abs(a - b) <= 0.02 * b, got


def int_reshard_job() -> dict:
    """int8 gathers with reshard_after_forward=2 at world 4: the gather before backward runs
    inside pairs of ranks on the dequantized rows kept after forward, the same weights a
    quantized gather gives, so training is bitwise that of reshard_after_forward=True."""
    def run(k) -> list[float]:
        torch.manual_seed(0)
        model = tiny_gpt()
        policy = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, gather_dtype=torch.int8)
        for block in model.h:
            fullshard.fully_shard(block, reshard_after_forward=k, mp_policy=policy)
        fullshard.fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = token_batch(torch.Generator().manual_seed(dist.get_rank()), 2)
        losses = []
        for _ in range(3):
            loss = model(*batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses + [p.full_tensor().double().sum().item() for p in model.parameters()]

    return {"same": run(2) == run(True)}


def test_int8_gathers_with_an_int_reshard_after_forward(world4):
    for got in world4.run(int_reshard_job):
        assert got == {"same": True}
