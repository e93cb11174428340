"""Message headers: which model, unit and collective a message on gloo belongs to, and how
big it is (Note [named hangs]): functions over ints and tensors (units.py names a header's unit).

# Note [named hangs]: every unit has an id (`Unit.uid`) that all ranks agreed on when
# fully_shard made it (checks.check_ranks_agree: the number of units made before it, the
# largest any rank counted); a model is named by its root unit's id. On gloo every message
# of a unit's collective starts with a HEADER_BYTES header: the unit's id, the collective's
# kind and the bytes each peer sends. A rank whose peer sent another collective's message
# raises at once, naming both units and models, instead of mixing the rows (silently wrong
# losses) or, for a message of another size, letting gloo abort the process ("Received data
# size doesn't match"), which it does only for a message longer than the receive posted:
# - all_to_all (small messages, Note [collective choice]): the header leads each row, and the
#   receive posted for each peer holds the longest row this route sends (RECEIVE_CAPACITY),
#   so a row of another size arrives whole or short, never too long;
# - point-to-point (larger ones): two messages to each peer. The first holds the header and
#   the rows' first FIRST_BYTES (routes.py), under HEADER_TAG, into a receive that holds the
#   longest such message; the rest follows under a tag of the header's own (`p2p_tag`), so
#   rows of another unit or size are never matched with this receive. The first messages
#   are checked before the rest is waited for, so a mismatch is seen at once;
# - the all-reduce across replicas: on gloo every replica's row goes to every other over one
#   of the routes above (Note [replica sums] in reduce.py), headers included.
# No header travels alone, or in a collective of its own that the rows wait for.
# A peer that skipped a unit, ran another model or died makes the others wait until the
# timeout (Unit.set_timeout), then raise an error naming the collective. NCCL's collectives
# carry no header: there the first forward's check (root.py), debug checks and the hang watch
# (runtime.HangWatch, since waits do not block the host on GPUs) name a divergence.
"""

from __future__ import annotations

import functools
import zlib

import torch

HEADER_BYTES = 16  # two int64: MAGIC, kind and unit id; the bytes each peer sends
HEADER_TAG = 15  # of every point-to-point first message (the header's); the rest's tags are above it
MAGIC = 0x46534844  # "FSHD": a header at all
KIND_BITS, UID_BITS = 4, 28
# by index: the kind a header carries (an all-reduce across more than two replicas is two
# rounds, Note [replica sums]: the second is its own kind)
KINDS = ("all-gather", "reduce-scatter", "all-reduce across replicas", "all-reduce across replicas (second round)")
GATHER, REDUCE, ALL_REDUCE, ALL_REDUCE_GATHER = range(len(KINDS))


@functools.lru_cache(maxsize=4096)
def header(uid: int, kind: int, nbytes: int) -> torch.Tensor:
    """The header of a unit's collective of `kind` (an index into KINDS) in which each peer
    sends `nbytes` ([2] int64, on the CPU; made once, never written; a plain tensor even when
    first made inside a torch.func transform, which must not wrap what outlives it)."""
    with torch._C._DisableFuncTorch():
        return torch.tensor([MAGIC << 32 | kind << UID_BITS | uid, nbytes], dtype=torch.int64)


def read_header(words: list[int]) -> tuple[int, int, int] | None:
    """(uid, kind, nbytes) of a header's two words, as received; None when they are not a header."""
    ident, nbytes = words
    if ident >> 32 != MAGIC:
        return None
    return ident & ((1 << UID_BITS) - 1), (ident >> UID_BITS) & ((1 << KIND_BITS) - 1), nbytes


def header_elements(dtype: torch.dtype) -> int:
    """How many elements of `dtype` a header takes at the start of a row."""
    return max(1, HEADER_BYTES // dtype.itemsize)


def p2p_tag(uid: int, kind: int, nbytes: int) -> int:
    """The tag of the rows of a unit's collective on gloo's point-to-point messages: a hash of
    the header, above HEADER_TAG, so rows of another unit, collective or size go unmatched
    (a collision of two headers' tags is a 1 in 2^30 chance per pair of messages in flight)."""
    return HEADER_TAG + 1 + zlib.crc32(f"{uid},{kind},{nbytes}".encode()) % (2**30)


def first_mismatch(received: torch.Tensor, expected: torch.Tensor) -> tuple[int, tuple[int, int, int] | None] | None:
    """The first row of `received` ([peers, 2] int64 headers, as received) that is not `expected`:
    (its index, what it says, None when it is no header); None when all are."""
    if torch.equal(received, expected.expand_as(received)):
        return None
    want = expected.tolist()
    for peer, words in enumerate(received.tolist()):
        if words != want:
            return peer, read_header(words)
    return None


def sent_by(header: tuple[int, int, int] | None, described) -> str:
    """What a peer's rows were, by their header, in words (`described`: units.described)."""
    uid, kind, nbytes = header or (-1, -1, 0)
    if not 0 <= kind < len(KINDS):
        return "rows that are no fullshard collective's"
    return f"the {KINDS[kind]} of {described(uid)} ({nbytes} bytes from each rank)"
