"""Block-quantized all-gathers: a parameter's shard goes on the wire as int8 (or float8) with
one scale per block of values, and is rebuilt in the full parameter's dtype.

# Note [int8 gathers]: with MixedPrecisionPolicy(gather_dtype=torch.int8), each floating-point
# parameter's shard is sent as int8 in blocks of `gather_block` values (256 by default; the
# last block may be shorter), q = round(x / s) with s = max|x| / 127 over its block (s = 1
# for a block of zeros), plus one float32 scale per block. After the gather every rank holds
# every rank's q and s and writes q * s, in the full parameter's dtype, into the full
# parameter. A rank sends, per parameter, n + 4 * ceil(n / B) bytes for a shard of n
# elements instead of 2n for bf16: (1 + 4 / B) / 2 of bf16's bytes, 0.508 at B = 256. The masters stay as they are
# and the gradients are exact (the reduce-scatter is unchanged): forward and backward compute
# with weights within half a quantization step (s / 2) of the masters, the same weights in
# both (the shard does not change between them, and rounding is deterministic). 0-d and
# integer parameters go as they are. Under hybrid sharding the quantized gather is the one
# inside the shard group; the traffic across groups is the gradients' all-reduce, exact.
# gather_dtype=torch.float8_e4m3fn (or float8_e5m2) is the same with s = max|x| / 448 (57344)
# and q = x / s rounded to that float8: the same bytes, a relative step of 2**-4 (2**-3) for
# every value rather than an absolute one of s, which keeps the small values of a block whose
# sizes differ widely.
"""

from __future__ import annotations

import torch

from fullshard import runtime
from fullshard.blocks import Codes, blocks_of, decode, encode_, flagged
from fullshard.gather import Context, Plain, register_format
from fullshard.param import ShardedParam

def quantized_bytes(numel: int, block: int) -> int:
    """What one rank's shard of `numel` values takes on the wire (Note [int8 gathers])."""
    return numel + 4 * blocks_of(numel, block)


class Quantized(Plain):
    """A floating-point parameter gathered as int8 blocks and their scales (Note [int8 gathers])."""

    static = False

    def __init__(self, p: ShardedParam, full_dtype: torch.dtype, context: Context) -> None:
        super().__init__(p, full_dtype, context)
        self.block, self.world, device = context.options.gather_block, context.world, context.device
        self.qdtype = context.options.gather_dtype
        self.codes = Codes(self.qdtype)
        self.host = runtime.active.host_memory(device)  # the scales readable at no cost (Note [block codes])
        self.numel = p.shard_numel
        self.blocks = blocks_of(self.numel, self.block)
        self.dtypes, self.numels = [self.qdtype, torch.float32], [self.numel, self.blocks]
        # every rank's q ([world * numel] int8 or float8) and scales ([world * blocks] float32)
        self.q = torch.empty(0, dtype=self.qdtype, device=device)
        self.scales = torch.empty(0, dtype=torch.float32, device=device)

    def allocate(self, small: bool) -> None:
        if small:  # the 1/k copy holds values: its rows go to the full parameter
            return
        for buffer, numel in ((self.q, self.world * self.numel), (self.scales, self.world * self.blocks)):
            buffer.resize_(numel)  # memory, on the compute stream (Note [gather streams])
            buffer.untyped_storage().resize_(numel * buffer.element_size())
            if runtime.active.tracks:
                runtime.active.allocated(buffer)

    def inputs(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """This rank's shard (flat, on the device) as q and one float32 scale per block (Note [block codes])."""
        values = shard.new_zeros(self.blocks * self.block, dtype=torch.float32)
        values[: self.numel].copy_(shard.reshape(-1))  # the last block padded with zeros, which are not sent
        scales = encode_(values.view(self.blocks, self.block), self.codes, self.host)
        q = values.to(self.qdtype)  # float8: rounded to nearest by the cast
        return [q[: self.numel], scales]

    def outputs(self, small: bool) -> list[torch.Tensor]:
        return [self.p.full_padded.view(-1)] if small else [self.q, self.scales]  # the 1/k copy holds values

    def after(self, small: bool) -> None:
        """Write every rank's q * s into the full parameter, block by block (no [world * numel]
        float32 copy of q); the 1/k copy's rows are values already."""
        if small:
            return
        full = self.p.full_padded.view(self.world, -1)  # [world, numel]
        scales = self.scales.view(self.world, self.blocks)
        q = self.q.view(self.world, self.numel)
        whole = self.numel // self.block * self.block
        slow = flagged(scales, self.host)
        if whole:
            decode(q[:, :whole].view(self.world, -1, self.block), scales[:, : whole // self.block, None],
                   full[:, :whole].view(self.world, -1, self.block), self.codes, full=slow)
        if whole < self.numel:  # the last, shorter block
            decode(q[:, whole:], scales[:, -1:], full[:, whole:], self.codes, full=slow)

    def free(self) -> None:
        for buffer in (self.q, self.scales):
            buffer.untyped_storage().resize_(0)


register_format(lambda p, options: options.gather_dtype is not None and p.sharded.dtype.is_floating_point
                and not p.replicated and not p.extension, Quantized)
