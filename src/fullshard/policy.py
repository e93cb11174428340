"""User-facing policies and the strategy table that maps names to fully_shard arguments."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fullshard.blocks import BLOCK
from fullshard.errors import fail

# what MixedPrecisionPolicy offers: block-quantized gathers (quantize.py), rows sent for a
# float32 sum (low_precision.py)
GATHER_DTYPES = tuple(getattr(torch, name) for name in ("int8", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))
REDUCE_SEND_DTYPES = (torch.bfloat16, torch.int8)  # not fp16: its range would make large gradients inf


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication; master shards keep their own dtype.

    Args:
        param_dtype: dtype of the gathered (full) parameters used in forward and
            backward. The shard is cast before the all-gather, so the gather moves
            bytes of this dtype. ``None`` computes in the master dtype.
        reduce_dtype: dtype in which gradients are reduce-scattered; defaults to
            ``param_dtype``. Reduced gradients land on the shards in the master dtype.
        output_dtype: cast floating-point outputs of the module to this dtype.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
        gather_dtype: ``torch.int8`` sends each floating-point shard as int8 with one
            float32 scale per block of ``gather_block`` values, rebuilt in ``param_dtype``
            (Note [int8 gathers] in ``fullshard/quantize.py``): about half of bf16's bytes,
            forward and backward within half a quantization step of the masters, gradients
            and masters exact. ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` send the
            same bytes with a float8 value per element (relative steps of 2**-4 or 2**-3,
            for blocks of values of unlike sizes). ``None`` sends ``param_dtype``.
        gather_block: values per scale of a quantized gather.
        reduce_send_dtype: ``torch.bfloat16`` sends each rank's gradient rows in bf16,
            ``torch.int8`` as int8 blocks of 256 values with a float32 scale each (an inf or
            NaN arrives as itself); the receiving rank sums them in float32 and rounds once to
            ``reduce_dtype`` (Note [low-precision reductions] in
            ``fullshard/low_precision.py``): 0.5x (0.26x) of float32's bytes, with an error
            that does not grow with the world, unlike a bf16 reduce-scatter's.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    gather_dtype: torch.dtype | None = None
    gather_block: int = BLOCK
    reduce_send_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.gather_dtype is not None and self.gather_dtype not in GATHER_DTYPES:
            raise fail(f"MixedPrecisionPolicy(gather_dtype={self.gather_dtype!r}) is not offered",
                       "Pass torch.int8, torch.float8_e4m3fn or torch.float8_e5m2 (block-quantized gathers), "
                       "or None (gathers in param_dtype).")
        if self.reduce_send_dtype is not None and self.reduce_send_dtype not in REDUCE_SEND_DTYPES:
            raise fail(f"MixedPrecisionPolicy(reduce_send_dtype={self.reduce_send_dtype!r}) is not offered",
                       "Pass torch.bfloat16 (rows sent in bf16) or torch.int8 (blocks with a scale each), both "
                       "summed in float32; or None (rows sent in reduce_dtype). float16 is not offered: its range "
                       "turns gradients above 65504 into inf; bf16 sends as few bytes with float32's range.")
        if type(self.gather_block) is not int or not 1 <= self.gather_block <= 1 << 20:
            raise fail(f"MixedPrecisionPolicy(gather_block={self.gather_block!r}) must be an int from 1 to 2**20",
                       "Pass e.g. 256 (the default).")
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise fail(
                    f"MixedPrecisionPolicy({name}={dtype!r}) is not a floating-point torch.dtype",
                    "Pass e.g. torch.bfloat16, torch.float16 or torch.float32, or None.",
                )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (FSDP2's default ``offload_policy``): shards stay on the compute device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients and so the optimizer step on the CPU.

    Args:
        pin_memory: pin the CPU shards so host-device copies can run asynchronously
            (only used when the compute device is a GPU).
    """

    pin_memory: bool = True


def from_torch_policy(policy):
    """FSDP2's own MixedPrecisionPolicy or offload policy (a script importing them from torch)
    as fullshard's, field for field; anything else as it is."""
    from torch.distributed import fsdp  # noqa: PLC0415

    if isinstance(policy, fsdp.MixedPrecisionPolicy):
        return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                    output_dtype=policy.output_dtype, cast_forward_inputs=policy.cast_forward_inputs)
    if isinstance(policy, fsdp.CPUOffloadPolicy):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if type(policy) is fsdp.OffloadPolicy:
        return OffloadPolicy()
    return policy


def checked_policies(mp_policy, offload_policy) -> tuple[MixedPrecisionPolicy | None, OffloadPolicy | None]:
    """fully_shard's and shard_model's policies as fullshard's (torch's own taken field for
    field), refusing anything else."""
    mp_policy, offload_policy = from_torch_policy(mp_policy), from_torch_policy(offload_policy)
    for name, policy, kind in (("mp_policy", mp_policy, MixedPrecisionPolicy),
                               ("offload_policy", offload_policy, OffloadPolicy)):
        if policy is not None and not isinstance(policy, kind):
            raise fail(f"{name} must be a fullshard.{kind.__name__} or None, got {type(policy).__name__}",
                       f"Pass fullshard.{kind.__name__}(...).")
    return mp_policy, offload_policy
