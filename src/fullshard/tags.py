"""Message tags: which unit's collective a message belongs to, on gloo (Note [named hangs]).
A point-to-point message carries its tag; an all_to_all's rows carry it in their last
STAMP_BITS elements. Pure functions over ints and tensors."""

from __future__ import annotations

import torch

# Note [named hangs]: every point-to-point message carries its unit's tag, so a rank
# that skipped a unit (or took another branch) is never matched with another unit's
# message of the same size (which would be silent corruption): its peers wait, time
# out, and raise an error naming the unit, the collective and the step. A collective
# carries no tag, so each row of a small message on gloo (Note [collective choice]) ends
# with its tag's STAMP_BITS bits, as elements 0 and 1 (exact in every dtype but float8_e8m0fnu,
# which has no 0: there a mismatch is still seen, its tag not read): a rank that receives
# another unit's rows of the same size raises at once, naming both. (Rows of
# another size make gloo abort the receiving process: "Received data size doesn't match
# expected size"; set_debug_checks(True) names the units first.) On GPUs
# waits do not block the host; runtime.HangWatch keeps the timeout there, and host
# waits are bounded by it too.

STAMP_BITS = 24


def p2p_tag(unit_index: int, kind: int) -> int:
    """The message tag of a unit's gather (kind 0) or reduce-scatter (kind 1) on gloo."""
    return 16 + 2 * unit_index + kind


def tag_unit(tag: int) -> tuple[int, int]:
    """The unit index and kind whose p2p_tag is `tag`."""
    return divmod(tag - 16, 2)


def stamp(tag: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`tag`'s bits, lowest first ([STAMP_BITS] of 0 and 1 in `dtype`)."""
    return torch.tensor([(tag >> i) & 1 for i in range(STAMP_BITS)], dtype=dtype, device=device)


def mismatched(stamps: torch.Tensor, tag: int) -> tuple[int, int | None] | None:
    """The first row of `stamps` ([world, STAMP_BITS], as received) that is not `tag`'s stamp:
    (its index, the tag it carries, None when it is no stamp at all); None when all are."""
    expected = stamp(tag, stamps.dtype, stamps.device)
    if torch.equal(stamps, expected.expand_as(stamps)):
        return None
    want = expected.tolist()
    for peer, bits in enumerate(stamps.tolist()):
        if bits != want:
            valid = all(b in (0, 1) for b in bits)
            return peer, sum(int(b) << i for i, b in enumerate(bits)) if valid else None
    return None
