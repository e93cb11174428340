"""Block quantization, one copy for the int8 and float8 gathers (quantize.py) and the int8
gradient rows (low_precision.py): values in blocks, one float32 scale a block, each value a
code of int8 or float8.

# Note [block codes]: a block's scale is s = max|x| / Q (Q: 127 for int8, the format's largest
# value for float8) and its codes q = x / s, rounded for int8 (float8: by the cast), clamped to
# +-Q; a value comes back as q * s, within s / 2 of itself for int8. Two kinds of block need
# more, and get it without a byte more on the wire:
# - a block holding an inf or a NaN: its scale is sent negative (the flag), its finite values
#   are scaled to Q' (the code just below Q: 126, or float8's next-largest value), and codes
#   name the rest: +Q is +inf, -Q is -inf, NaN is int8's unused -128 or float8's NaN. Each
#   non-finite value comes back as itself, so an inf or NaN on any rank reaches every rank as
#   it would through an exact reduction or gather (the loss scaler, the non-finite check and
#   clipping see it); a scale of NaN, or of 1 as for a block of zeros, would hide it;
# - a block whose s would be a float32 subnormal (max|x| below about 1.5e-36): s rounded to
#   the nearest subnormal could be below max|x| / Q, and q beyond Q clamped away. So s is
#   rounded up to the subnormal grid there: each value still within half its block's step (a
#   value of a few subnormal ulps comes back exact).
# On the CPU reading the scales costs the host nothing, so a buffer whose scales need neither
# takes the plain path (what the formats always did, bit for bit); on a GPU, where reading
# them is a host sync, every buffer takes the full one (a few elementwise kernels more).
"""

from __future__ import annotations

import torch

BLOCK = 256  # values per scale: the gathers' default (MixedPrecisionPolicy.gather_block) and the rows'
FLOAT32_MAX = torch.finfo(torch.float32).max
NORMAL = torch.finfo(torch.float32).tiny  # the smallest normal float32: below it, scales are subnormal
SUBNORMAL = 2.0**-149  # float32's subnormal grid


def blocks_of(numel: int, block: int = BLOCK) -> int:
    """How many blocks (and scales) `numel` values take, the last one shorter if need be."""
    return -(-numel // block)


class Codes:
    """The codes of one quantized dtype: Q, Q' and the code of NaN (Note [block codes])."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.integer = not dtype.is_floating_point
        if self.integer:
            self.top, self.below = float(torch.iinfo(dtype).max), float(torch.iinfo(dtype).max - 1)
            self.nan = float(torch.iinfo(dtype).min)  # -128: the code the values never take
        else:
            top = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
            self.top = top.item()
            self.below = (top.view(torch.uint8) - 1).view(dtype).item()  # the next-largest value
            self.nan = float("nan")


def plain_scales(scales: torch.Tensor) -> bool:
    """Whether every block of these scales (amax / Q) is finite and normal or zero: the plain path."""
    return bool(((scales >= NORMAL) & (scales <= FLOAT32_MAX) | (scales == 0)).all())


def encode_(blocks: torch.Tensor, codes: Codes, host: bool) -> torch.Tensor:
    """Turn `blocks` ([..., B] float32, a block per last dim) in place into its codes (as float32
    values) and return the scales ([...], negative for a block with non-finite values). `host`:
    the host may read the scales (Note [block codes])."""
    amax = blocks.abs().amax(dim=-1)  # NaN where a block holds one
    scales = amax / codes.top
    if host and plain_scales(scales):
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a block of zeros: any scale
        blocks.div_(scales[..., None])
        if codes.integer:
            blocks.round_()
        blocks.clamp_(-codes.top, codes.top)
        return scales
    finite = torch.isfinite(blocks)
    flagged = ~torch.isfinite(amax)  # [...]
    largest = torch.where(finite, blocks.abs(), 0).amax(dim=-1)  # of the finite values
    q_max = torch.where(flagged, codes.below, codes.top)  # [...]
    scales = largest / q_max
    on_grid = (largest.double() / q_max / SUBNORMAL).ceil() * SUBNORMAL  # rounded up, exact in float32
    scales = torch.where((scales < NORMAL) & (largest > 0), on_grid.float(), scales)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = blocks / scales[..., None]
    if codes.integer:
        q.round_()
    q = torch.minimum(torch.maximum(q, -q_max[..., None]), q_max[..., None])
    q = torch.where(blocks == float("inf"), codes.top, q)
    q = torch.where(blocks == float("-inf"), -codes.top, q)
    if codes.integer:  # float8: x / s is NaN already
        q = torch.where(torch.isnan(blocks), codes.nan, q)
    blocks.copy_(q)
    return torch.where(flagged, -scales, scales)


def flagged(scales: torch.Tensor, host: bool) -> bool:
    """Whether decoding these scales needs the full path: a block flagged non-finite, or, off the
    host, any (it cannot look)."""
    return not host or bool((scales < 0).any())


def decode(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, codes: Codes, *, full: bool,
           add: bool = False, alpha: float = 1.0) -> None:
    """out = q * scales (`add`: out += alpha * q * scales), q [..., k, b] of codes, scales [..., k, 1]
    (broadcast), computed in float32 and rounded once to out's dtype; `full` (flagged()): with
    the non-finite codes of flagged blocks read as their values."""
    if not full:
        if add:
            out.addcmul_(q, scales, value=alpha)
        elif codes.integer:
            torch.mul(q, scales, out=out)
        else:  # torch does not promote float8: its values fit out's dtype exactly
            out.copy_(q)
            out.mul_(scales)
        return
    codes_read = q.float()  # exact: every int8 and float8 value is a float32
    values = codes_read * scales.abs()
    marked = scales < 0
    values = torch.where(marked & (codes_read == codes.top), float("inf"), values)
    values = torch.where(marked & (codes_read == -codes.top), float("-inf"), values)
    if codes.integer:  # float8's NaN is NaN times the scale already
        values = torch.where(marked & (codes_read == codes.nan), float("nan"), values)
    if add:
        out.add_(values, alpha=alpha)
    else:
        out.copy_(values)
