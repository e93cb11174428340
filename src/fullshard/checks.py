"""Cross-rank agreements: that every rank shards the same parameters with the same values."""

from __future__ import annotations

import zlib

import torch

from fullshard.collectives import all_gather_ints, all_gather_json, site
from fullshard.errors import CollectiveError, collective_failed, fail
from fullshard.mesh import ShardGroup
from fullshard.options import DEFAULT_TIMEOUT
from fullshard.tags import KINDS
from fullshard.units import described

PARAMETERS = site("the comparison of the parameters ranks shard")
DEBUG_CHECK = site("the debug check")
VALUES = site("the comparison of the values ranks shard")


# the integer type whose elements have the size of a dtype's, to sum a tensor's bits
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor subclass (e.g. of Note [all-gather extensions]) as its inner plain tensors, flat
    and back to back (their bytes: what ranks must agree on); a plain tensor as it is."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return tensor
    names, _ = tensor.__tensor_flatten__()
    inner = [plain(getattr(tensor, name)).detach().reshape(-1).view(torch.uint8) for name in names]
    return torch.cat(inner) if inner else torch.zeros(0, dtype=torch.uint8)


def bit_sums(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's bits summed as integers of its element size, wrapping (0 for meta tensors).
    Wrapping integer addition is associative, so equal values give equal sums on any device
    and CPU, in any summation order, where a float sum's rounding would not; and summing in
    the element's own size needs no widened copy of the tensor."""
    tensors = [plain(t) for t in tensors]
    sums = []
    for t in tensors:
        if not t.is_meta:
            bits = t.detach().reshape(-1).view(INT_OF_SIZE.get(t.element_size(), torch.int64))
            sums.append(bits.sum(dtype=bits.dtype).to(torch.int64))
    values = iter(torch.stack(sums).tolist() if sums else [])
    return [0 if t.is_meta else next(values) for t in tensors]

def dp_groups(group: ShardGroup) -> list[torch.distributed.ProcessGroup | None]:
    """The groups over which ranks must hold equal parameters: every rank (None), or, on a
    data-parallel sub-mesh, its shard and replicate groups (the other dims, e.g. tensor
    parallelism, hold other parts)."""
    if group.mesh.size() == torch.distributed.get_world_size():
        return [None]
    return group.process_groups

def check_ranks_agree(what: str, described: list[tuple], sums: list[int], device: torch.device,
                      groups: list[torch.distributed.ProcessGroup | None] = (None,), uid: int = 0) -> int:
    """Refuse, on every rank, ranks that would shard different parameters: `described` holds
    each parameter's (name, shape, dtype, requires_grad[, split dim]), `sums` its bit_sums. Ranks that
    differ would silently mix rows of different models. One small all-gather per group
    (None: every rank) when they agree. Returns the new unit's id (Note [named hangs]): the
    largest `uid` any rank proposes (each proposes one above its own live units')."""
    try:
        for group in groups:
            if torch.distributed.get_world_size(group) > 1:
                uid = compare_ranks(what, described, sums, device, group, uid)
    except CollectiveError as e:
        raise collective_failed(f"comparing {what} across ranks", e,
                                "Every rank must shard the same model at the same time; another rank did not, or "
                                "died.") from None
    return uid

def compare_ranks(what: str, described: list[tuple], sums: list[int], device: torch.device,
                  group: torch.distributed.ProcessGroup | None, uid: int) -> int:
    """check_ranks_agree within one group, without the deadline's message (ranks are the group's);
    the largest `uid` of the group's ranks."""
    timeout = DEFAULT_TIMEOUT
    digest = [zlib.crc32(repr(described).encode()), zlib.crc32(repr(sums).encode()), uid]
    digests = all_gather_ints(digest, device=device, timeout=timeout, group=group,
                              what=PARAMETERS)
    if len({structure for structure, _, _ in digests}) > 1:
        everyone = [[tuple(d[:1]) + (tuple(d[1]),) + tuple(d[2:]) for d in theirs]  # JSON made tuples lists
                    for theirs in all_gather_json(described, device=device, timeout=timeout, group=group)]
        differ = [f"rank {r}: {sorted(set(theirs) ^ set(described))}" for r, theirs in enumerate(everyone)
                  if theirs != described]
        raise fail(f"ranks would shard different parameters in {what} ((name, shape, dtype, requires_grad, ...) "
                   f"differing from this rank's: {'; '.join(differ)})",
                   "Build the same model on every rank, with the same parameters frozen (and the same "
                   "shard_placement_fn), before sharding.")
    if len({values for _, values, _ in digests}) == 1 or not sums:
        return max(theirs for _, _, theirs in digests)
    everyone = all_gather_ints(sums, device=device, timeout=timeout, group=group,  # same length: same parameters
                               what=VALUES)
    names = [d[0] for i, d in enumerate(described) if len({theirs[i] for theirs in everyone}) > 1]
    listing = ", ".join(map(repr, names[:8])) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    raise fail(f"ranks hold different values of {listing} in {what}: sharding would keep rank 0's rows of one "
               f"model and the other ranks' rows of others",
               "Seed every rank alike before building the model (torch.manual_seed(seed) with the same seed), or "
               "shard with fullshard.shard_model(model, ..., sync_module_states=True) to make rank 0's values win.")


def check_next_collective(group: ShardGroup, timeout, naming, mine: list[int]) -> None:
    """Debug checks: every rank of the unit's groups is about to run the same collective: `mine` is
    (unit id, kind: tags.GATHER or REDUCE, step, a hash of which parameters have gradients,
    whether the forward has none); `naming` names the unit (shared.Naming). One small
    all-gather per group."""
    for pg in group.process_groups:  # the ranks this unit communicates with
        try:
            everyone = all_gather_ints(mine, device=group.device, timeout=timeout, group=pg, what=DEBUG_CHECK)
        except CollectiveError as e:
            raise naming.failed("debug check", e) from None
        if any(theirs != mine for theirs in everyone):
            ranks = torch.distributed.get_process_group_ranks(pg)
            seen = "; ".join(f"rank {ranks[r]}: {KINDS[k]} of {described(i)} at step {s}" +
                             (f" (gradient mask {m:#x})" if k else "") + (" in a forward without gradients" if e else "")
                             for r, (i, k, s, m, e) in enumerate(everyone))
            raise fail(f"ranks disagree on the next collective ({seen})",
                       "Every rank must run the same units in the same order and compute gradients for the same "
                       "parameters while debug checks are on; make the model's control flow the same on every rank.")
