"""The collectives of a unit, as pure functions over tensors and process groups.

This is the only library module that calls torch.distributed's collectives (the CLI and
the benchmark call their own). It knows the row layout of Note [shard layout] (param.py)
but nothing of units or modules. A unit's collectives are split into an issue (returns a
pending object at once) and a wait.

# Note [collective choice]: NCCL (and any backend but gloo) uses its native
# all-gather and reduce-scatter over the flat buffer. On gloo these are slow:
# `benchmarks/gloo_collectives.py` on 2 CPU cores, world 2, median of 25 (ms; 1, 8 and
# 32 MiB buffers): all_gather_into_tensor 0.6 / 4.5 / 32-76, point-to-point 0.4 / 2.9
# / 10.8; reduce_scatter_tensor (an all-reduce of the whole input inside gloo) 1.7 /
# 8.2 / 39, point-to-point 0.7 / 4.0 / 15 (world 4 alike). So on gloo each rank sends
# its flat shard (gather) or each peer's row (reduce-scatter) straight to that peer:
# one message per peer, (N-1)/N of the buffer on the wire, the bandwidth optimum.
# The rows a reduce-scatter receives are summed in rank order, so the result does not
# depend on message timing.
#
# Note [streams]: on CUDA the gather and the reduction run on side streams so they
# overlap compute, ordered with events and without record_stream: every buffer the
# compute stream uses or frees is allocated on the compute stream, a side stream
# touches it only after waiting for the compute stream, and the compute stream waits
# for the side stream before it reads the result or drops its reference. Buffers
# allocated on a side stream are used only there.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective that failed or did not finish within its timeout."""


def wait_all(works: list, timeout: timedelta) -> None:
    """Wait for `works`, giving up after `timeout` (Note [named hangs])."""
    try:
        for work in works:
            work.wait(timeout)
    except RuntimeError as e:  # the backends raise RuntimeError subclasses for timeouts and lost peers
        raise CollectiveError(str(e).splitlines()[0]) from e


def p2p_tag(unit_index: int, kind: int) -> int:
    """The message tag of a unit's gather (kind 0) or reduce-scatter (kind 1) on gloo.

    # Note [named hangs]: every point-to-point message carries its unit's tag, so a rank
    # that skipped a unit (or took another branch) is never matched with another unit's
    # message of the same size (which would be silent corruption): its peers wait, time
    # out, and raise an error naming the unit, the collective and the step.
    """
    return 16 + 2 * unit_index + kind


def all_gather_ints(values: list[int], *, device: torch.device, timeout: timedelta) -> list[list[int]]:
    """Every rank's `values` (the same length on every rank), rank by rank."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size() * len(values), dtype=torch.int64, device=device)
    wait_all([_all_gather_single(out, mine, async_op=True)], timeout)
    return out.view(-1, len(values)).tolist()


def all_gather_objects(obj: object) -> list[object]:
    """Every rank's `obj` (small, picklable, our own), rank by rank."""
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_(tensor: torch.Tensor, op: str) -> None:
    """Reduce `tensor` in place over every rank: op "sum" or "max"."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        dist.broadcast(t, src=0)


def broadcast_object(obj: object) -> object:
    """Rank 0's `obj` (small, picklable, our own) on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    dist.barrier()


def uses_p2p(group: dist.ProcessGroup) -> bool:
    """Note [collective choice]."""
    return dist.get_backend(group) == "gloo"


class BufferPool:
    """Reuses communication buffers of equal size on the CPU while units follow one
    another, so each unit does not allocate (and fault in) its own. On GPUs the caching
    allocator already does this, per stream, so nothing is kept."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self.free[(shape, dtype, device)]
        return free.pop() if free else torch.empty(shape, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        if buffer.device.type == "cpu":
            self.free[(tuple(buffer.shape), buffer.dtype, buffer.device)].append(buffer)

    def release(self) -> None:
        """Hand every kept buffer back to the allocator (between phases that use other memory)."""
        self.free.clear()


_side_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream | None:
    """The process's stream for `purpose` ("gather" or "reduce") on a GPU; None on CPU."""
    if device.type != "cuda":
        return None
    if (device, purpose) not in _side_streams:
        _side_streams[(device, purpose)] = torch.cuda.Stream(device, priority=-1)
    return _side_streams[(device, purpose)]


def wait_for_compute(stream: torch.cuda.Stream | None) -> None:
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))


def compute_waits_for(stream: torch.cuda.Stream | None) -> None:
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


def exchange(sends: list[torch.Tensor], recvs: list[torch.Tensor], peers: list[int], group: dist.ProcessGroup,
             tag: int) -> list:
    """Point-to-point: sends[i] to group rank peers[i], recvs[i] from it (Note [collective choice])."""
    works = [dist.isend(t, group=group, group_dst=r, tag=tag) for t, r in zip(sends, peers)]
    return works + [dist.irecv(t, group=group, group_src=r, tag=tag) for t, r in zip(recvs, peers)]


def all_reduce_bytes(numel: int, element_size: int, size: int) -> int:
    """What a rank sends in a bandwidth-optimal all-reduce over `size` ranks."""
    return 2 * (size - 1) * numel * element_size // size


@dataclass
class PendingGather:
    """An all-gather in flight into `gathered`: every rank's flat shard, rank after rank
    ([world, unit_shard_numel]), or on gloo only the peers' ([world - 1, ...]): a rank's
    own shard goes from `local_flat` straight to its rows of the full parameters."""

    works: list
    gathered: torch.Tensor
    local_flat: torch.Tensor  # what this rank sent
    staged: bool  # `local_flat` is a pool buffer (a cast or moved copy of the shard)
    rank: int
    world: int
    stream: torch.cuda.Stream | None
    sent_bytes: int


def gather_full(
    shard: torch.Tensor, *, group: dist.ProcessGroup | None, dtype: torch.dtype, device: torch.device,
    pool: BufferPool, tag: int,
) -> PendingGather:
    """Start gathering every rank's flat shard over `group` in `dtype` on `device`.

    The shard is first moved to the compute device (CPU offload) and cast (mixed
    precision), so the gather moves `dtype`'s bytes. With no group (one rank holds
    every row) nothing is sent: the staged shard is the result.
    """
    world, rank = (group.size(), group.rank()) if group is not None else (1, 0)
    stream = side_stream(device, "gather")
    wait_for_compute(stream)  # the optimizer may have just written the shard
    with torch.cuda.stream(stream):  # a no-op for None (CPU)
        staged = shard.dtype != dtype or shard.device != device
        local_flat = shard
        if staged:
            local_flat = pool.take((shard.numel(),), dtype, device)  # [unit_shard_numel]
            local_flat.copy_(shard, non_blocking=True)  # pinned host memory: overlaps compute on GPUs
        sent = (world - 1) * local_flat.numel() * local_flat.element_size()
        if group is None:
            gathered, works = local_flat.new_empty((0, local_flat.numel())), []
        elif uses_p2p(group):
            peers = [r for r in range(world) if r != rank]
            gathered = pool.take((world - 1, local_flat.numel()), local_flat.dtype, local_flat.device)
            works = exchange([local_flat] * len(peers), list(gathered), peers, group, tag)
        else:
            gathered = pool.take((world, local_flat.numel()), local_flat.dtype, local_flat.device)
            works = [_all_gather_single(gathered.view(-1), local_flat, group=group, async_op=True)]
    return PendingGather(works, gathered, local_flat, staged, rank, world, stream, sent)


def finish_gather(pending: PendingGather, fulls: list[torch.Tensor], shard_numels: list[int], pool: BufferPool, *,
                  timeout: timedelta) -> None:
    """Wait for the gather and move each rank's rows into the parameters' padded full tensors.

    `fulls` were allocated on the compute stream before the gather was issued.
    """
    world = pending.world
    with torch.cuda.stream(pending.stream):
        wait_all(pending.works, timeout)
        outs = [full.view(world, -1) for full in fulls]  # each [world, shard_numel]
        with torch.no_grad():
            if pending.gathered.size(0) == world:
                torch.split_with_sizes_copy(pending.gathered, shard_numels, dim=1, out=outs)
            else:
                rows = list(pending.gathered)
                rows.insert(pending.rank, pending.local_flat)
                for r, row in enumerate(rows):
                    torch.split_with_sizes_copy(row, shard_numels, out=[out[r] for out in outs])
    compute_waits_for(pending.stream)
    pool.give(pending.gathered)
    if pending.staged:
        pool.give(pending.local_flat)


def pack_rows(grads: list[torch.Tensor | None], shard_numels: list[int], ranks: list[int], out: torch.Tensor) -> None:
    """Write, for each r = ranks[i], rank r's rows of every full gradient into out[i],
    followed by one has-gradient flag per gradient ([len(ranks), grad_shard_numel + n_flags]).

    Rows are zero where a gradient is missing or padded; the flags are 1 where this rank
    has the gradient, so after the reduction each rank knows whether any rank had one (a
    gradient no rank has stays None, as in plain PyTorch). A 0-d gradient is in every row.
    The flags are written on the device, so packing never waits for the GPU.
    """
    total = sum(shard_numels)
    out[:, total:].fill_(1)
    runs = [(i, r) for i, r in enumerate(ranks) if i == 0 or r != ranks[i - 1] + 1]  # starts of consecutive ranks
    offset = 0
    for i, (grad, numel) in enumerate(zip(grads, shard_numels)):
        dst = out[:, offset : offset + numel]  # [len(ranks), shard_numel]
        offset += numel
        if grad is None:
            dst.zero_()
            out[:, total + i].zero_()
        elif grad.dim() == 0:
            dst.copy_(grad.expand(len(ranks), 1))
        elif numel:
            flat = grad.reshape(-1)
            for (i, first), (j, _) in zip(runs, runs[1:] + [(len(ranks), None)]):
                whole = max(0, min(j - i, flat.numel() // numel - first))  # ranks whose rows are all real
                dst[i : i + whole].copy_(flat[first * numel : (first + whole) * numel].view(whole, numel))
                if i + whole < j:  # a rank with some real rows, then ranks with none
                    rest = max(0, flat.numel() - (first + whole) * numel)
                    dst[i + whole, :rest].copy_(flat[(first + whole) * numel :])
                    dst[i + whole, rest:].zero_()
                    dst[i + whole + 1 : j].zero_()


@dataclass
class PendingReduce:
    """A reduce-scatter in flight; `finish_reduce` turns it into this rank's averaged row."""

    works: list
    sent: torch.Tensor | None  # [world - 1 or world, row_numel], kept alive until the sends are done
    received: torch.Tensor | None  # [world - 1, row_numel] rows from the peers, in rank order (gloo)
    shard: torch.Tensor  # [row_numel]
    stream: torch.cuda.Stream | None
    replicate_group: dist.ProcessGroup | None
    divide_after: int  # what the sum is still to be divided by
    traffic: list[tuple[str, int]] = field(default_factory=list)  # (collective, bytes this rank sent)


def reduce_scatter_grads(
    grads: list[torch.Tensor | None],
    shard_numels: list[int],
    *,
    groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None],
    dp_size: int,
    shard: torch.Tensor,
    pool: BufferPool,
    tag: int,
) -> PendingReduce:
    """Start summing the full gradients' rows over the shard group into `shard`, this
    rank's row ([grad_shard_numel + n_flags], of the reduce dtype, on the compute stream).

    `groups` is (shard group, replicate group). Across replicas (hybrid sharding) the row
    is then all-reduced, and all is divided by the data-parallel size (eq. 1 of the
    paper): afterwards, or for fp16, whose sums would overflow sooner, before. On gloo a
    rank's own row is packed straight into the result, which then adds the peers' rows
    (Note [collective choice]).
    """
    shard_group, replicate_group = groups
    dtype, device, row_numel = shard.dtype, shard.device, shard.numel()
    world, rank = (shard_group.size(), shard_group.rank()) if shard_group is not None else (1, 0)
    stream = side_stream(device, "reduce")
    works, sent, received, traffic = [], None, None, []
    p2p = shard_group is not None and uses_p2p(shard_group)
    peers = [r for r in range(world) if r != rank]
    own = shard_group is None or p2p
    if own:
        pack_rows(grads, shard_numels, [rank], shard.view(1, -1))  # own row straight into the result
    if shard_group is not None:
        sent = pool.take((len(peers) if p2p else world, row_numel), dtype, device)  # [world (- 1), row_numel]
        pack_rows(grads, shard_numels, peers if p2p else list(range(world)), sent)
    divide_after = dp_size
    if dtype == torch.float16 and dp_size > 1:
        for rows in (sent, shard if own else None):
            if rows is not None:
                rows.div_(dp_size)
        divide_after = 1
    if p2p:
        received = pool.take((world - 1, row_numel), dtype, device)  # [world - 1, row_numel]
        works = exchange(list(sent), list(received), peers, shard_group, tag)
    elif shard_group is not None:
        wait_for_compute(stream)  # the gradients were packed on the compute stream
        with torch.cuda.stream(stream):
            works = [_reduce_scatter_single(shard, sent.view(-1), op=dist.ReduceOp.SUM, group=shard_group,
                                            async_op=True)]
    if shard_group is not None:
        traffic.append(("reduce_scatter", (world - 1) * row_numel * shard.element_size()))
    return PendingReduce(works, sent, received, shard, stream, replicate_group, divide_after, traffic)


def finish_reduce(pending: PendingReduce, pool: BufferPool, *, timeout: timedelta) -> torch.Tensor:
    """Wait for the reduction; return this rank's row averaged over the data-parallel ranks."""
    shard = pending.shard
    with torch.cuda.stream(pending.stream):
        wait_all(pending.works, timeout)
        if pending.received is not None:  # own row first, then the peers' in rank order
            for row in pending.received:
                shard.add_(row)
        if pending.replicate_group is not None:
            replicas = pending.replicate_group.size()
            wait_all([dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=pending.replicate_group, async_op=True)],
                     timeout)
            pending.traffic.append(("all_reduce", all_reduce_bytes(shard.numel(), shard.element_size(), replicas)))
        if pending.divide_after > 1:
            shard.div_(pending.divide_after)
    compute_waits_for(pending.stream)
    for buffer in (pending.sent, pending.received):
        if buffer is not None:
            pool.give(buffer)
    return shard


def all_reduce_tensors(tensors: list[torch.Tensor], *, group: dist.ProcessGroup, timeout: timedelta) -> int:
    """Sum `tensors` in place over `group`, packed into one all-reduce; returns the bytes this rank sent."""
    flat = torch.cat([t.reshape(-1) for t in tensors])  # [sum of numels]
    wait_all([dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)], timeout)
    torch.split_with_sizes_copy(flat, [t.numel() for t in tensors], out=[t.view(-1) for t in tensors])
    return all_reduce_bytes(flat.numel(), flat.element_size(), group.size())
