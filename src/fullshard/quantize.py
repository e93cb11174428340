"""Block-quantized all-gathers: a parameter's shard goes on the wire as int8 with one scale
per block of values, and is rebuilt in the full parameter's dtype.

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
"""

from __future__ import annotations

import torch

GATHER_BLOCK = 256  # values per scale: the default of MixedPrecisionPolicy.gather_block


def quantized_bytes(numel: int, block: int) -> int:
    """What one rank's shard of `numel` values takes on the wire (Note [int8 gathers])."""
    return numel + 4 * -(-numel // block)


class BlockQuantized:
    """One parameter's int8 gather (Note [int8 gathers]): what it sends and its output buffers."""

    def __init__(self, numel: int, block: int, device: torch.device) -> None:
        self.numel, self.block = numel, block
        self.blocks = -(-numel // block)
        self.device = device
        self.outputs: list[torch.Tensor] = []  # [world * numel] int8, [world * blocks] float32

    def inputs(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """This rank's shard (flat, `numel` values) as int8 and one float32 scale per block."""
        values = torch.zeros(self.blocks * self.block, dtype=torch.float32, device=shard.device)
        values[: self.numel].copy_(shard.reshape(-1))  # the last block padded with zeros, which are not sent
        blocks = values.view(self.blocks, self.block)
        scales = blocks.abs().amax(dim=1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return [q.view(-1)[: self.numel], scales]

    def output_buffers(self, world: int) -> list[torch.Tensor]:
        if not self.outputs:
            self.outputs = [torch.empty(world * self.numel, dtype=torch.int8, device=self.device),
                            torch.empty(world * self.blocks, dtype=torch.float32, device=self.device)]
        else:
            for buffer in self.outputs:
                buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        return self.outputs

    def dequantize(self, full_padded: torch.Tensor, world: int) -> None:
        """Write every rank's q * s into `full_padded` ([world * numel] of the full dtype, as rows)."""
        q, scales = self.outputs
        steps = scales.view(world, self.blocks).repeat_interleave(self.block, dim=1)[:, : self.numel]
        full_padded.view(world, -1).copy_(q.view(world, self.numel).to(torch.float32) * steps)

    def free(self) -> None:
        for buffer in self.outputs:
            buffer.untyped_storage().resize_(0)
