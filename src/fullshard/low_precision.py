"""Gradients sent in low precision and summed in float32: a row format of reduce.py.

# Note [low-precision reductions]: with MixedPrecisionPolicy(reduce_send_dtype=...), each rank's
# rows of a unit's reduce-scatter go on the wire as bf16, or as int8 in blocks of BLOCK
# values with one float32 scale each (ZeRO++'s qgZ: s = max|x| / 127 over the block, q = round(x /
# s); an inf or NaN arrives as itself, Note [block codes]); every block lies inside one parameter's
# row (or the has-gradient flags'), so a parameter of small gradients never shares a scale with one
# of large gradients, and the flags (0 or 1) arrive exact (fp16 is not offered: its range turns
# finite gradients above 65504 into inf). The receiving rank adds its own row as it is and every
# peer's row, decoded, in rank order into a float32 sum (the reduce dtype's when that is wider),
# divides there and rounds once to the reduce dtype: each value is rounded once on the wire and
# once at the end, whatever the world size. NCCL's own reduce-scatter in bf16 instead rounds the
# partial sum at every hop of its ring, an error that grows with the world (docs/precision.md
# measures both). So the rows never go through a backend's reduction: on NCCL they move as one
# all_to_all, on gloo by its usual routes (Note [collective choice]). A peer's row costs bf16's 2
# bytes a value, or int8's 1 + 4 / BLOCK (and up to 3 bytes of padding a row), against 4 for
# float32. The all-reduce across replicas (hybrid sharding, no_shard) sends the reduce dtype as
# before.
"""

from __future__ import annotations

import torch

from fullshard.blocks import BLOCK, Codes, blocks_of, decode, encode_, flagged
from fullshard.options import UnitOptions
from fullshard.reduce import register_row_format
from fullshard.routes import BufferPool

INT8 = Codes(torch.int8)


def sent_bytes(segments: list[int], send_dtype: torch.dtype) -> int:
    """The bytes one row of these segments (parameters' row lengths, then the flags') takes on
    the wire (the planner prices reductions with it)."""
    numel = sum(segments)
    if send_dtype != torch.int8:
        return numel * send_dtype.itemsize
    return 4 * sum(blocks_of(n) for n in segments) + -(-numel // 4) * 4


class LowPrecision:
    """Rows sent as `options.reduce_send_dtype`, summed in float32 where they arrive (Note
    [low-precision reductions]): reduce.Exact's methods."""

    native = False  # a backend's reduce-scatter would round its partial sums

    def __init__(self, dtype: torch.dtype, segments: list[int], options: UnitOptions, host: bool) -> None:
        self.dtype, self.send, self.host = dtype, options.reduce_send_dtype, host
        self.numel = sum(segments)
        self.wire_numel = sent_bytes(segments, self.send) // (1 if self.send == torch.int8 else self.send.itemsize)
        self.wire_dtype = torch.uint8 if self.send == torch.int8 else self.send
        # int8: per segment, (its start in a row, its first block, its length)
        self.segments, start, block = [], 0, 0
        for n in segments:
            self.segments.append((start, block, n))
            start, block = start + n, block + blocks_of(n)
        self.blocks = block
        self.scale_bytes = 4 * block

    def pack_into(self, payload: torch.Tensor, pool: BufferPool) -> torch.Tensor:
        """The rows are packed in the reduce dtype: into the payload when it goes as it is."""
        if self.wire_dtype == self.dtype:
            return payload
        return pool.take((payload.size(0), self.numel), self.dtype, payload.device)  # [world, numel]

    def encode(self, rows: torch.Tensor, payload: torch.Tensor, pool: BufferPool) -> None:
        if rows is payload:
            return
        if self.send != torch.int8:
            payload.copy_(rows)
            return
        world = rows.size(0)
        padded = pool.take((world, self.blocks * BLOCK), torch.float32, rows.device)  # blocks in place
        padded.zero_()
        for start, block, n in self.segments:
            padded[:, block * BLOCK : block * BLOCK + n].copy_(rows[:, start : start + n])
        scales = encode_(padded.view(world, self.blocks, BLOCK), INT8, self.host)  # [world, blocks]
        payload[:, : self.scale_bytes].view(torch.float32).copy_(scales)
        q = payload[:, self.scale_bytes : self.scale_bytes + self.numel].view(torch.int8)
        for start, block, n in self.segments:
            q[:, start : start + n].copy_(padded[:, block * BLOCK : block * BLOCK + n])
        pool.give(padded)

    def add(self, total: torch.Tensor, row: torch.Tensor, alpha: float) -> None:
        """Add alpha times a peer's row, decoded, to the sum `total` ([numel], float32 or wider)."""
        if self.send != torch.int8:
            total.add_(row, alpha=alpha)
            return
        scales = row[: self.scale_bytes].view(torch.float32)  # [blocks]
        q = row[self.scale_bytes : self.scale_bytes + self.numel].view(torch.int8)
        full = flagged(scales, self.host)
        for start, block, n in self.segments:
            whole = n // BLOCK
            if whole:  # q * s, block by block, with no float32 copy of q
                end = start + whole * BLOCK
                decode(q[start:end].view(whole, BLOCK), scales[block : block + whole, None],
                       total[start:end].view(whole, BLOCK), INT8, full=full, add=True, alpha=alpha)
            if n % BLOCK:  # the segment's last, shorter block
                last = start + whole * BLOCK
                decode(q[last : start + n], scales[block + whole : block + whole + 1], total[last : start + n],
                       INT8, full=full, add=True, alpha=alpha)


register_row_format(lambda options: options.reduce_send_dtype is not None, LowPrecision)
