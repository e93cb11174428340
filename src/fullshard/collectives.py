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
# its flat shard (gather) or each peer's row (reduce-scatter) to that peer: one message
# per peer, (N-1)/N of the buffer on the wire, the bandwidth optimum. Small messages (at
# most runtime.SMALL_MESSAGE bytes to a peer, in host memory) go as one all_to_all_single,
# which gloo's worker threads run; larger ones point-to-point. Posting a point-to-point
# receive or send makes the training thread wait for gloo's network thread, which on busy
# cores costs up to milliseconds now and then; all_to_all leaves that wait to gloo's
# threads, for world - 1 extra copies of a gathered shard (one row per peer). On the tiny GPT of benchmarks/host_time.py
# (units of 70-100 KB per rank), fullshard's step overhead over DDP was 9.4 ms point-to-
# point and 3.1 ms all_to_all, alternated in one run (before the headers of Note [named
# hangs]). Between matrix products (gloo_collectives.py's last tables, world 2, mean
# ms, gather / reduce-scatter): 100 KB shards, point-to-point 0.56 / 0.64, all_to_all
# 0.52 / 0.49; 1 MB 1.59 / 1.61 against 1.62 / 2.07; 32 MB 23.8 / 40.4 against 29.2 / 47.9.
# The rows a reduce-scatter receives are summed in rank order either way, so the result
# does not depend on message timing or route. Every message on gloo starts with a header
# naming its unit, model and collective (Note [named hangs], tags.py).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fullshard import runtime
from fullshard.options import DEFAULT_TIMEOUT
from fullshard.runtime import SMALL_MESSAGE, MismatchedCall, MismatchedRows
from fullshard.tags import HEADER_BYTES, HEADER_TAG, first_mismatch, header, header_elements, p2p_tag, read_header

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

LOW_PRECISION = (torch.bfloat16, torch.float16)


# the bytes posted to receive each peer's row of an all_to_all: its longest row (Note [named hangs])
RECEIVE_CAPACITY = SMALL_MESSAGE + HEADER_BYTES


@dataclass(frozen=True)
class Caller:
    """Who issues a collective: what to call it when it does not finish, how long its waits may
    take, and, for a unit's, the unit's id and the collective's kind (tags.KINDS) its messages'
    headers carry (Note [named hangs])."""

    what: str = "a collective"
    timeout: timedelta = DEFAULT_TIMEOUT
    uid: int = 0
    kind: int = 0


def wait_all(works: list, caller: Caller, *, on_device: bool) -> None:
    """The current stream waits for `works`; only on the CPU does the host wait (Note [host syncs])."""
    runtime.active.wait_works(works, timeout=caller.timeout, what=caller.what, on_device=on_device)


def check_headers(received: torch.Tensor, expected: torch.Tensor, peers: list[int]) -> None:
    """Raise MismatchedRows when a header of `received` ([len(peers), 2] int64, from these group
    ranks) is not `expected` (Note [named hangs])."""
    wrong = first_mismatch(received, expected)
    if wrong is not None:
        raise MismatchedRows(peers[wrong[0]], wrong[1], read_header(expected.tolist()))


def all_to_all(sent: torch.Tensor, received: torch.Tensor, group: dist.ProcessGroup, rank: int) -> list:
    """sent[r] to group rank r ([world, row], each row led by its header), as one collective
    (Note [collective choice]), into `received` (a receive_buffer), where each
    peer's row may take up to RECEIVE_CAPACITY bytes (Note [named hangs]). It moves bytes:
    gloo's collectives take only some dtypes (not float8 nor int16), point-to-point messages any."""
    world, row = sent.size(0), sent[0].nbytes
    assert row <= RECEIVE_CAPACITY, f"an all_to_all row of {row} bytes"
    capacities = [RECEIVE_CAPACITY] * world
    capacities[rank] = row  # this rank's own row: gloo copies it, as long as sent
    work = dist.all_to_all_single(received[: sum(capacities)], sent.view(torch.uint8).view(-1), capacities,
                                  [row] * world, group=group, async_op=True)
    return runtime.active.launched([work], reads=[sent], writes=[received])


def receive_buffer(pool: "BufferPool", world: int, device: torch.device) -> torch.Tensor:
    """An all_to_all's receive buffer ([world * RECEIVE_CAPACITY] bytes: any row fits, and every
    unit's collectives reuse the same buffers)."""
    return pool.take((world * RECEIVE_CAPACITY,), torch.uint8, device)


def received_rows(received: torch.Tensor, rank: int, row: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The peers' rows of an all_to_all in `received` (as all_to_all laid them out), each led by
    its header: those of the ranks before this one and after it, [peers, row] of `dtype` each
    (a shorter row fills only its start)."""
    world = received.numel() // RECEIVE_CAPACITY
    stride = RECEIVE_CAPACITY // dtype.itemsize
    typed = received.view(dtype)
    before = typed.as_strided((rank, row // dtype.itemsize), (stride, 1), 0)
    after = typed.as_strided((world - 1 - rank, row // dtype.itemsize), (stride, 1),
                             (rank * RECEIVE_CAPACITY + row) // dtype.itemsize)
    return before, after


def check_rows(before: torch.Tensor, after: torch.Tensor, expected: torch.Tensor, rank: int) -> None:
    """check_headers of the headers leading the peers' rows of an all_to_all (received_rows')."""
    lead = header_elements(before.dtype)
    headers = torch.cat([before[:, :lead], after[:, :lead]]).view(torch.int64)  # [world - 1, 2]
    check_headers(headers, expected, [r for r in range(headers.size(0) + 1) if r != rank])


def write_header(rows: torch.Tensor, caller: Caller, nbytes: int) -> torch.Tensor:
    """Lead every row of `rows` ([n, row] of any dtype) with the header of `caller`'s collective; returns it."""
    mine = header(caller.uid, caller.kind, nbytes)
    rows.view(torch.uint8)[:, :HEADER_BYTES].copy_(mine.view(torch.uint8).expand(rows.size(0), -1))
    return mine


# the int64s of every all-gather of integers' frame: its call site, its length, then up to 6 values
FRAME = 8
SITES: dict[int, str] = {}  # the call sites of all_gather_ints, by code, for messages


def site(what: str) -> str:
    """Register a call site of all_gather_ints at import, so that every process can name it."""
    SITES[zlib.crc32(what.encode())] = what
    return what


INTEGERS, JSON_LENGTHS, HEADERS = (site("an all-gather of integers"), site("the lengths of an all-gather of JSON"),
                                   site("the headers of an all-reduce across replicas"))


def all_gather_ints(values: list[int] | torch.Tensor, *, device: torch.device, timeout: timedelta,
                    group: dist.ProcessGroup | None = None, what: str = INTEGERS) -> list[list[int]]:
    """Every rank's `values` (the same length on every rank of `group`, default: all), rank by
    rank; reading them is a host sync. Every call sends a frame of FRAME integers first, naming
    its call site (`what`) and length, with the values when they fit: ranks that reached other
    calls exchange frames of one size and learn it (MismatchedCall), where rows of other sizes
    would make gloo abort the process (Note [named hangs]). Plain tensors even inside a
    torch.func transform (a forward under torch.func.jvp checks its first forward with one:
    torch before 2.10 cannot read back a tensor the transform wrapped)."""
    code = zlib.crc32(what.encode())
    with torch._C._DisableFuncTorch():
        mine = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64, device=device)
        n = mine.numel()
        frame = torch.zeros(FRAME, dtype=torch.int64, device=device)  # filled on the device: no copy from the host
        frame[0].fill_(code)
        frame[1].fill_(n)
        if n <= FRAME - 2:
            frame[2 : 2 + n].copy_(mine.reshape(-1))
        frames = gather_rows(frame, group, Caller(what, timeout))
        for peer, (their_site, their_n, *_) in enumerate(frames):
            if (their_site, their_n) != (code, n):
                raise MismatchedCall(what, peer, SITES.get(their_site, "another of fullshard's collectives"))
        if n <= FRAME - 2:
            return [row[2 : 2 + n] for row in frames]
        return gather_rows(mine.to(torch.int64), group, Caller(what, timeout))


def gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None, caller: Caller) -> list[list]:
    """Every rank's `row` (of one length on every rank), read on the host."""
    rt = runtime.active
    out = torch.empty(dist.get_world_size(group) * row.numel(), dtype=row.dtype, device=row.device)
    works = rt.launched([_all_gather_single(out, row, group=group, async_op=True)], reads=[row], writes=[out])
    wait_all(works, caller, on_device=row.device.type == "cuda")
    return rt.read_on_host(out.view(-1, row.numel()), timeout=caller.timeout, what=caller.what)


def all_gather_json(obj: object, *, device: torch.device, timeout: timedelta,
                    group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's `obj` (JSON-serializable), rank by rank, as JSON: nothing another process
    sends is unpickled. An all-gather of the lengths, then one of the bytes."""
    rt = runtime.active
    mine = json.dumps(obj).encode()
    longest = max(n for (n,) in all_gather_ints([len(mine)], device=device, timeout=timeout, group=group,
                                                 what=JSON_LENGTHS))
    sent = torch.zeros(longest, dtype=torch.uint8, device=device)  # [longest]
    sent[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else sent[:0]
    out = torch.empty(dist.get_world_size(group) * longest, dtype=torch.uint8, device=device)  # [world * longest]
    works = rt.launched([_all_gather_single(out, sent, group=group, async_op=True)], reads=[sent], writes=[out])
    wait_all(works, Caller("an all-gather of JSON", timeout), on_device=device.type == "cuda")
    rows = out.view(-1, longest).cpu()
    return [json.loads(bytes(row.numpy().tobytes()).rstrip(b"\0")) for row in rows]


def all_reduce_(tensor: torch.Tensor, op: str, *, timeout: timedelta, what: str) -> None:
    """Reduce `tensor` in place over every rank: op "sum" or "max". It must be in the
    memory of the process group's device (a GPU's for NCCL, never pinned host memory).
    Raises CollectiveError naming `what` when it does not finish within `timeout`."""
    rt = runtime.active
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    works = rt.launched([dist.all_reduce(tensor, op=reduce_op, async_op=True)], reads=[tensor], writes=[tensor])
    wait_all(works, Caller(what, timeout), on_device=tensor.device.type == "cuda")


def broadcast_from_rank0(tensors: list[torch.Tensor], *, device: torch.device | None = None,
                         timeout: timedelta = DEFAULT_TIMEOUT, group: dist.ProcessGroup | None = None) -> None:
    """Rank 0's (of `group`, default: all) values of `tensors` on every rank of it, sent from
    `device`'s memory (tensors elsewhere, e.g. a model built on the CPU for GPUs, go there and
    back); None: as they are. Raises CollectiveError when one does not arrive within `timeout`."""
    rt = runtime.active
    for t in tensors:
        sent = t if device is None else rt.to_device(t, device)
        works = rt.launched([dist.broadcast(sent, group=group, group_src=0, async_op=True)], reads=[sent],
                            writes=[sent])
        wait_all(works, Caller("a broadcast from rank 0", timeout), on_device=sent.device.type == "cuda")
        if sent is not t:
            t.copy_(sent)


def barrier(timeout: timedelta, what: str) -> None:
    """Every rank gets here, within `timeout` (a CollectiveError naming `what` otherwise)."""
    wait_all(runtime.active.launched([dist.barrier(async_op=True)], reads=[], writes=[]), Caller(what, timeout),
             on_device=False)



# Note [averaging]: gradients are averaged over the dp_size data-parallel ranks (divided by
# a unit's set_gradient_divide_factor instead, when set). fp16 rows are divided before the sum, whose fp16 range
# would overflow sooner. Otherwise NCCL averages inside the collectives (ReduceOp.AVG,
# no extra kernel or pass over the row); elsewhere the sum is divided afterwards. Each
# rank's rows are added in rank order. On gloo the reduce-scatter of a shard group
# (full_shard, shard_grad_op, hybrid's shard groups) adds the received bf16/fp16 rows
# in an fp32 scratch row from the BufferPool and divides there, so the row is rounded
# to the reduce dtype once. Only that path: the all-reduce across replicas (hybrid,
# no_shard) and NCCL's collectives sum in the reduce dtype inside the backend.


@dataclass(frozen=True)
class Averaging:
    """How a reduction over `summed_over` ranks becomes the gradient divided by the divisor
    (dp_size, or set_gradient_divide_factor's), Note [averaging]."""

    divide_first: bool  # divide the rows by the divisor before the sum
    op: dist.ReduceOp  # of the collectives
    divide_after: float  # what the result is still to be divided by


def averaging(backend: str, dtype: torch.dtype, *, dp_size: int, summed_over: int, divide_by: float,
              force_sum: bool = False) -> Averaging:
    """Note [averaging] for a reduction over `summed_over` of the `dp_size` data-parallel ranks,
    divided by `divide_by` (dp_size, or a factor set_gradient_divide_factor gave); `force_sum`:
    sums only, never the backend's average (set_force_sum_reduction_for_comms)."""
    if dtype == torch.float16 and divide_by != 1:
        return Averaging(True, dist.ReduceOp.SUM, 1)
    if backend == "nccl" and not force_sum and summed_over > 1 and divide_by == dp_size:  # gloo has no AVG
        return Averaging(False, dist.ReduceOp.AVG, dp_size // summed_over)
    return Averaging(False, dist.ReduceOp.SUM, divide_by)


class BufferPool:
    """Reuses communication buffers of equal size on the CPU while units follow one
    another, so each unit does not allocate (and fault in) its own. On GPUs the caching
    allocator already does this, per stream, so nothing is kept."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer allocated on the current stream (Note [streams])."""
        free = self.free[(shape, dtype, device)]
        buffer = free.pop() if free else torch.empty(shape, dtype=dtype, device=device)
        runtime.active.allocated(buffer)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """`buffer` is no longer used by any stream."""
        runtime.active.freed(buffer)
        if buffer.device.type == "cpu":
            self.free[(tuple(buffer.shape), buffer.dtype, buffer.device)].append(buffer)

    def release(self) -> None:
        """Hand every kept buffer back to the allocator (between phases that use other memory)."""
        self.free.clear()


@dataclass
class Headers:
    """The headers of a point-to-point exchange (Note [named hangs]): their works, this rank's
    (kept alive until sent) and the peers' as they arrive ([peers, 2] int64, on the CPU)."""

    works: list
    mine: torch.Tensor
    theirs: torch.Tensor
    peers: list[int]

    def check(self, caller: Caller, works: list) -> None:
        """Wait for the peers' headers (the host waits: they are in host memory) and raise
        MismatchedRows when one is not this collective's, leaving its `works` (the rows, which
        will never be matched) to Note [abandoned collectives]."""
        runtime.active.wait_host_works(self.works, timeout=caller.timeout, what=caller.what)
        try:
            check_headers(self.theirs, self.mine, self.peers)
        except MismatchedRows:
            runtime.abandon(works)
            raise


def exchange(sends: list[torch.Tensor], recvs: list[torch.Tensor], peers: list[int], group: dist.ProcessGroup,
             caller: Caller) -> tuple[Headers, list]:
    """Point-to-point: sends[i] to group rank peers[i], recvs[i] from it, each pair of messages
    after its header (Note [collective choice], Note [named hangs])."""
    nbytes = recvs[0].nbytes if recvs else 0
    mine = header(caller.uid, caller.kind, nbytes)
    theirs = torch.empty((len(peers), 2), dtype=torch.int64)
    header_works = [dist.irecv(theirs[i], group=group, group_src=r, tag=HEADER_TAG) for i, r in enumerate(peers)]
    header_works += [dist.isend(mine, group=group, group_dst=r, tag=HEADER_TAG) for r in peers]
    tag = p2p_tag(caller.uid, caller.kind, nbytes)
    works = [dist.irecv(t, group=group, group_src=r, tag=tag) for t, r in zip(recvs, peers)]
    works += [dist.isend(t, group=group, group_dst=r, tag=tag) for t, r in zip(sends, peers)]
    return Headers(header_works, mine, theirs, peers), runtime.active.launched(works, reads=sends, writes=recvs)


def all_reduce_bytes(numel: int, element_size: int, size: int) -> int:
    """What a rank sends in a bandwidth-optimal all-reduce over `size` ranks."""
    return 2 * (size - 1) * numel * element_size // size


@dataclass
class PendingGather:
    """An all-gather in flight into `gathered`: on the native route every rank's flat shard, rank
    after rank ([world, unit_shard_numel]); point-to-point only the peers' ([world - 1, ...]);
    all_to_all every rank's row, led by its header, as `all_to_all` lays them out (uint8). A
    rank's own shard goes from `local_flat` straight to its rows of the full parameters."""

    works: list
    gathered: torch.Tensor
    local_flat: torch.Tensor  # what this rank sent
    sent: torch.Tensor | None  # the pool buffer `local_flat` is in (a cast, moved or headed copy of the shard)
    route: str  # runtime.route's, or "none" (no group)
    headers: Headers | None  # point-to-point's
    expected: torch.Tensor | None  # all_to_all's: the header every row must lead with
    rank: int
    world: int
    device: torch.device
    stream: torch.cuda.Stream | None
    sent_bytes: int
    caller: Caller


def gather_full(
    shards: list[torch.Tensor], *, group: dist.ProcessGroup | None, dtype: torch.dtype, device: torch.device,
    pool: BufferPool, caller: Caller, bytes_of: list[torch.dtype] | None = None,
) -> PendingGather:
    """Start gathering every rank's flat shard (`shards`, back to back) over `group` in
    `dtype` on `device`.

    The shards are first copied into one send buffer on the compute device, the copy
    doing the move of CPU offload and the cast of mixed precision, so the gather moves
    `dtype`'s bytes; with `bytes_of` (dtype uint8), each shard goes as the bytes of its
    dtype there (Note [bytes on the wire]). With no group (one rank holds every row)
    nothing is sent: the send buffer is the result.
    """
    rt = runtime.active
    world, rank = (group.size(), group.rank()) if group is not None else (1, 0)
    casts = bytes_of or [None] * len(shards)
    sizes = [s.numel() * (cast.itemsize if cast else 1) for s, cast in zip(shards, casts)]
    numel = sum(sizes)
    route = rt.route(group, device, numel * dtype.itemsize) if group is not None else "none"
    lead = header_elements(dtype) if route == "all_to_all" else 0  # the header's elements leading each row
    stream = rt.side_stream(device, "gather")
    rt.wait_stream(stream, rt.current_stream(device))  # the optimizer may have just written the shard
    with rt.use(stream):
        elsewhere = bool(shards) and rt.elsewhere(shards[0], device)  # a unit's shards share one device
        if lead or len(shards) != 1 or shards[0].dtype != dtype or elsewhere or bytes_of is not None:
            sent = pool.take((world, lead + numel) if lead else (numel,), dtype, device)
            local_flat = sent[0, lead:] if lead else sent  # [unit_shard_numel], of dtype
            offset = 0
            if shards and bytes_of is None and not elsewhere:
                torch.cat(shards, out=local_flat)  # one kernel that also casts (mixed precision)
                if rt.tracks:
                    rt.reads(*shards)
                    rt.writes(local_flat)
                shards = []
            for shard, cast, size in zip(shards, casts, sizes):  # from pinned host memory: overlaps compute on GPUs
                if cast is None:
                    rt.copy_(local_flat[offset : offset + size], shard)
                elif shard.dtype == cast:
                    rt.copy_(local_flat[offset : offset + size], shard.view(torch.uint8))
                else:  # moved and cast on this stream, then its bytes
                    converted = pool.take((shard.numel(),), cast, device)
                    rt.copy_(converted, shard)
                    rt.copy_(local_flat[offset : offset + size], converted.view(torch.uint8))
                    pool.give(converted)
                offset += size
        else:
            sent, local_flat = None, shards[0]
        sent_bytes = (world - 1) * local_flat.numel() * local_flat.element_size()
        headers, expected = None, None
        if group is None:
            gathered, works = local_flat.new_empty((0, local_flat.numel())), []
        elif lead:  # every peer gets the same row: the header, then this rank's shard
            expected = write_header(sent[:1], caller, local_flat.nbytes)
            sent[1:].copy_(sent[0].expand(world - 1, -1))
            gathered = receive_buffer(pool, world, device)
            works = all_to_all(sent, gathered, group, rank)
        elif route == "p2p":
            peers = [r for r in range(world) if r != rank]
            gathered = pool.take((world - 1, local_flat.numel()), local_flat.dtype, local_flat.device)
            headers, works = exchange([local_flat] * len(peers), list(gathered), peers, group, caller)
        else:
            gathered = pool.take((world, local_flat.numel()), local_flat.dtype, local_flat.device)
            works = rt.launched([_all_gather_single(gathered.view(-1), local_flat, group=group, async_op=True)],
                                reads=[local_flat], writes=[gathered])
    return PendingGather(works, gathered, local_flat, sent, route, headers, expected, rank, world, device, stream,
                         sent_bytes, caller)


def finish_gather(pending: PendingGather, fulls: list[torch.Tensor], shard_numels: list[int],
                  pool: BufferPool) -> None:
    """Wait for the gather and move each rank's rows into the parameters' padded full tensors.

    `fulls` were allocated on the compute stream before the gather was issued.
    """
    rt = runtime.active
    world, rank = pending.world, pending.rank
    with rt.use(pending.stream):
        if pending.headers is not None:
            pending.headers.check(pending.caller, pending.works)
        wait_all(pending.works, pending.caller, on_device=pending.stream is not None)
        outs = [full.view(world, -1) for full in fulls]  # each [world, shard_numel]
        with torch.no_grad():
            if pending.route == "native":
                torch.split_with_sizes_copy(pending.gathered, shard_numels, dim=1, out=outs)
                rt.reads(pending.gathered)
            else:
                if pending.route == "all_to_all":
                    before, after = received_rows(pending.gathered, rank, pending.sent[0].nbytes, pending.sent.dtype)
                    check_rows(before, after, pending.expected, rank)
                    lead = header_elements(pending.sent.dtype)
                    before, after = before[:, lead:], after[:, lead:]
                else:  # point-to-point, or no group: the peers' rows, if any
                    before, after = pending.gathered[:rank], pending.gathered[rank:]
                for rows, first in ((before, 0), (after, rank + 1)):
                    if rows.size(0):
                        torch.split_with_sizes_copy(rows, shard_numels, dim=1,
                                                    out=[out[first : first + rows.size(0)] for out in outs])
                torch.split_with_sizes_copy(pending.local_flat, shard_numels, out=[out[rank] for out in outs])
                rt.reads(pending.gathered, pending.local_flat)
        rt.writes(*fulls)
    rt.wait_stream(rt.current_stream(pending.device), pending.stream)
    pool.give(pending.gathered)
    if pending.sent is not None:
        pool.give(pending.sent)


def pack_rows(grads: list[torch.Tensor | None], shard_numels: list[int], out: torch.Tensor) -> None:
    """Write every rank's rows of every full gradient into out[rank], followed by one
    has-gradient flag per gradient ([world, grad_shard_numel + n_flags]).

    Rows are zero where a gradient is missing or padded; the flags are 1 where this rank
    has the gradient, so after the reduction each rank knows whether any rank had one (a
    gradient no rank has stays None, as in plain PyTorch). A 0-d gradient is in every row.
    The flags are written on the device, so packing never waits for the GPU. When every
    gradient is there in the row's dtype, one fused chunk-and-concatenate kernel packs
    them all (torch._chunk_cat pads each chunk as Note [shard layout] does).
    """
    world = out.size(0)
    fused = True
    for g in grads:  # a loop, not all(): per reduce-scatter, kept free of calls
        fused = fused and g is not None and g.dtype == out.dtype
    if fused:
        parts = [g.reshape(1).expand(world) if g.dim() == 0 else g for g in grads]
        flags = torch.ones((world, len(grads)), dtype=out.dtype, device=out.device)
        torch._chunk_cat([*parts, flags], dim=0, num_chunks=world, out=out)
    else:
        total = sum(shard_numels)
        out[:, total:].fill_(1)
        offset = 0
        for i, (grad, numel) in enumerate(zip(grads, shard_numels)):
            dst = out[:, offset : offset + numel]  # [world, shard_numel]
            offset += numel
            if grad is None:
                dst.zero_()
                out[:, total + i].zero_()
            elif grad.dim() == 0:
                dst.copy_(grad.expand(world, 1))
            elif numel:
                flat = grad.reshape(-1)
                whole = min(world, flat.numel() // numel)  # ranks whose rows are all real
                dst[:whole].copy_(flat[: whole * numel].view(whole, numel))
                if whole < world:  # a rank with some real rows, then ranks with none
                    rest = flat.numel() - whole * numel
                    dst[whole, :rest].copy_(flat[whole * numel :])
                    dst[whole, rest:].zero_()
                    dst[whole + 1 :].zero_()
    rt = runtime.active
    if rt.tracks:
        rt.reads(*[g for g in grads if g is not None])
        rt.writes(out)


@dataclass
class PendingReduce:
    """A reduction in flight; `finish_reduce` turns it into this rank's averaged row."""

    works: list  # the reduce-scatter (or the point-to-point messages, or the all_to_all) inside the shard group
    sent: torch.Tensor | None  # [world, (header +) row_numel], kept alive until the sends are done
    received: torch.Tensor | None  # point-to-point: rows from the peers, in rank order ([world - 1, row_numel]);
    # all_to_all: every rank's, each led by its header, as `all_to_all` lays them out (uint8)
    route: str  # runtime.route's, or "none" (no shard group)
    headers: Headers | None  # point-to-point's
    expected: torch.Tensor | None  # all_to_all's: the header every row must lead with
    rank: int
    shard: torch.Tensor  # [row_numel]
    stream: torch.cuda.Stream | None  # the reduce stream
    replicate_group: dist.ProcessGroup | None
    op: dist.ReduceOp  # of both collectives, Note [averaging]
    divide_after: float  # what the result is still to be divided by
    caller: Caller
    all_reduce_works: list | None = None  # across replicas, once issued
    all_reduce_stream: torch.cuda.Stream | None = None
    traffic: list[tuple[str, int]] = field(default_factory=list)  # (collective, bytes this rank sent)


def reduce_scatter_grads(
    grads: list[torch.Tensor | None],
    shard_numels: list[int],
    *,
    groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None],
    dp_size: int,
    divide_by: float,
    force_sum: bool,
    shard: torch.Tensor,
    pool: BufferPool,
    caller: Caller,
) -> PendingReduce:
    """Start summing the full gradients' rows over the shard group into `shard`, this
    rank's row ([grad_shard_numel + n_flags], of the reduce dtype, allocated on the
    compute stream), then all-reducing it across replicas (hybrid sharding, no_shard).

    `groups` is (shard group, replicate group); the result is divided by `divide_by`: `dp_size`,
    the data-parallel size (eq. 1 of the paper), unless set_gradient_divide_factor said
    otherwise. On gloo a rank's own row is packed straight into the result, which then adds
    the peers' rows (Note [collective choice]); the result is averaged as Note [averaging] says.
    """
    rt = runtime.active
    shard_group, replicate_group = groups
    dtype, device, row_numel = shard.dtype, shard.device, shard.numel()
    world, rank = (shard_group.size(), shard_group.rank()) if shard_group is not None else (1, 0)
    compute, stream = rt.current_stream(device), rt.side_stream(device, "reduce")
    sent, received, works, headers, expected = None, None, [], None, None
    route = rt.route(shard_group, device, row_numel * shard.element_size()) if shard_group is not None else "none"
    gloo = route in ("p2p", "all_to_all")
    lead = header_elements(dtype) if route == "all_to_all" else 0  # the header's elements leading each row
    peers = [r for r in range(world) if r != rank]
    rows = None  # [world, row_numel]: every rank's rows
    if shard_group is None:
        pack_rows(grads, shard_numels, shard.view(1, -1))  # the only row is the result
    else:
        sent = pool.take((world, lead + row_numel), dtype, device)
        rows = sent[:, lead:]
        pack_rows(grads, shard_numels, rows)
        if gloo:  # own row straight into the result, Note [collective choice]
            shard.copy_(rows[rank])
    own = shard_group is None or gloo
    group = shard_group or replicate_group
    backend = "gloo" if group is None or gloo else dist.get_backend(group)
    summed_over = world * (replicate_group.size() if replicate_group is not None else 1)
    how = averaging(backend, dtype, dp_size=dp_size, summed_over=summed_over, divide_by=divide_by,
                    force_sum=force_sum)
    op, divide_after = how.op, how.divide_after
    if how.divide_first:
        for divided in (rows, shard if own else None):
            if divided is not None:
                divided.div_(divide_by)
                rt.writes(divided)
    rt.wait_stream(stream, compute)  # Note [streams]: the rows were packed on the compute stream
    with rt.use(stream):
        if lead:
            expected = write_header(sent, caller, rows[0].nbytes)
            received = receive_buffer(pool, world, device)
            works = all_to_all(sent, received, shard_group, rank)
        elif gloo:
            received = pool.take((world - 1, row_numel), dtype, device)  # [world - 1, row_numel]
            headers, works = exchange([sent[r] for r in peers], list(received), peers, shard_group, caller)
        elif shard_group is not None:
            works = rt.launched([_reduce_scatter_single(shard, sent.view(-1), op=op, group=shard_group,
                                                        async_op=True)], reads=[sent], writes=[shard])
    pending = PendingReduce(works, sent, received, route, headers, expected, rank, shard, stream, replicate_group, op,
                            divide_after, caller)
    if shard_group is not None:
        pending.traffic.append(("reduce_scatter", (world - 1) * row_numel * shard.element_size()))
    if replicate_group is not None and not gloo:
        with rt.use(stream):  # at once, on its own stream, behind the reduce-scatter
            wait_all(works, caller, on_device=stream is not None)
        pending.works = []
        start_all_reduce(pending)
    return pending


def start_all_reduce(pending: PendingReduce) -> None:
    """Issue the all-reduce of the row across replicas on the all-reduce stream, after the reduce stream
    (on gloo, once every replica's header says it reduces the same row: Note [named hangs])."""
    rt = runtime.active
    shard, group, caller = pending.shard, pending.replicate_group, pending.caller
    if rt.checks_headers(group):
        check_over(group, dataclasses.replace(caller, kind=2), shard.nbytes)
    pending.all_reduce_stream = rt.side_stream(shard.device, "all_reduce")
    rt.wait_stream(pending.all_reduce_stream, pending.stream)
    with rt.use(pending.all_reduce_stream):
        pending.all_reduce_works = rt.launched(
            [dist.all_reduce(shard, op=pending.op, group=group, async_op=True)], reads=[shard], writes=[shard])
    pending.traffic.append(("all_reduce", all_reduce_bytes(shard.numel(), shard.element_size(), group.size())))


def check_over(group: dist.ProcessGroup, caller: Caller, nbytes: int) -> None:
    """Every rank of `group` is about to run `caller`'s collective on `nbytes`: its header,
    all-gathered (a fixed size, so any peer's fits) and waited for; MismatchedRows otherwise."""
    mine = header(caller.uid, caller.kind, nbytes)
    everyone = all_gather_ints(mine, device=torch.device("cpu"), timeout=caller.timeout, group=group,
                               what=HEADERS)
    check_headers(torch.tensor(everyone, dtype=torch.int64), mine, list(range(len(everyone))))


def finish_reduce(pending: PendingReduce, pool: BufferPool) -> torch.Tensor:
    """Wait for the reduction; return this rank's row averaged over the data-parallel ranks,
    ready for the compute stream."""
    rt = runtime.active
    shard, stream, rank = pending.shard, pending.stream, pending.rank
    with rt.use(stream):
        if pending.headers is not None:
            pending.headers.check(pending.caller, pending.works)
        wait_all(pending.works, pending.caller, on_device=stream is not None)
        if pending.received is not None:  # own row first, then the peers' in rank order, Note [averaging]
            if pending.route == "all_to_all":
                before, after = received_rows(pending.received, rank, pending.sent[0].nbytes, shard.dtype)
                check_rows(before, after, pending.expected, rank)
                lead = header_elements(shard.dtype)
                peer_rows = [*before[:, lead:], *after[:, lead:]]
            else:
                peer_rows = list(pending.received)
            total = shard
            if shard.dtype in LOW_PRECISION:  # round once, Note [averaging]
                total = pool.take((shard.numel(),), torch.float32, shard.device)  # [row_numel]
                total.copy_(shard)
            for row in peer_rows:
                total.add_(row)
            if total is not shard:
                shard.copy_(total.div_(pending.divide_after))
                pending.divide_after = 1
                rt.reads(total)
                pool.give(total)
            rt.reads(pending.received)
            rt.writes(shard)
    if pending.replicate_group is not None and pending.all_reduce_works is None:  # gloo: now the row is summed
        start_all_reduce(pending)
    last = pending.all_reduce_stream or stream
    with rt.use(last):
        wait_all(pending.all_reduce_works or [], pending.caller, on_device=last is not None)
        if pending.divide_after != 1:
            shard.div_(pending.divide_after)
            rt.writes(shard)
    rt.wait_stream(rt.current_stream(shard.device), last)
    for buffer in (pending.sent, pending.received):
        if buffer is not None:
            pool.give(buffer)
    return shard


def redistribute(value, placements: tuple):
    """A DTensor gradient (a tensor-parallel partial sum) in `placements`: DTensor's own
    collective over the TP mesh's groups, under their process group's timeout (DTensor's
    collectives take no other; a TP group created by init_device_mesh has the default
    group's)."""
    return value.redistribute(placements=placements)


def full_tensor(value):
    """A DTensor whole on every rank of its mesh (every rank of it must call): DTensor's own
    all-gather, under its process groups' timeout, as redistribute."""
    return value.full_tensor()


def all_reduce_tensors(tensors: list[torch.Tensor], *, group: dist.ProcessGroup, caller: Caller) -> int:
    """Sum `tensors` in place over `group`, packed into one all-reduce; returns the bytes this rank sent."""
    rt = runtime.active
    flat = torch.cat([t.reshape(-1) for t in tensors])  # [sum of numels]
    if rt.checks_headers(group):
        check_over(group, caller, flat.nbytes)
    rt.reads(*tensors)
    rt.allocated(flat)
    rt.writes(flat)
    works = rt.launched([dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)],
                        reads=[flat], writes=[flat])
    wait_all(works, caller, on_device=flat.device.type == "cuda")
    torch.split_with_sizes_copy(flat, [t.numel() for t in tensors], out=[t.view(-1) for t in tensors])
    rt.reads(flat)
    rt.writes(*tensors)
    rt.freed(flat)
    return all_reduce_bytes(flat.numel(), flat.element_size(), group.size())
