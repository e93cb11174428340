"""Routes: how the rows of one of a unit's collectives move between the ranks of its group,
chosen once, when the unit's plans are made (gather.py, reduce.py), and the communication
buffers they reuse.

# Note [collective choice]: NCCL (and any backend but gloo) uses its native
# all-gather and reduce-scatter over the flat buffer. On gloo these are slow:
# `benchmarks/gloo_collectives.py` on 2 CPU cores, world 2, median of 25 (ms; 1, 8 and
# 32 MiB buffers): all_gather_into_tensor 0.6 / 4.5 / 32-76, point-to-point 0.4 / 2.9
# / 10.8; reduce_scatter_tensor (an all-reduce of the whole input inside gloo) 1.7 /
# 8.2 / 39, point-to-point 0.7 / 4.0 / 15 (world 4 alike). So on gloo each rank sends
# its flat shard (gather) or each peer's row (reduce-scatter) to that peer: one message
# per peer, (N-1)/N of the buffer on the wire, the bandwidth optimum. Small messages (at
# most SMALL_MESSAGE bytes to a peer, in host memory) go as one all_to_all_single, which
# gloo's worker threads run; larger ones point-to-point. Posting a point-to-point receive
# or send makes the training thread wait for gloo's network thread, which on busy cores
# costs up to milliseconds now and then; all_to_all leaves that wait to gloo's threads,
# for world - 1 extra copies of a gathered shard (one row per peer). On the tiny GPT of
# benchmarks/host_time.py (units of 70-100 KB per rank), fullshard's step overhead over
# DDP was 9.4 ms point-to-point and 3.1 ms all_to_all, alternated in one run (before the
# headers of Note [named hangs]). Between matrix products (gloo_collectives.py's last
# tables, world 2, mean ms, gather / reduce-scatter): 100 KB shards, point-to-point 0.56 /
# 0.64, all_to_all 0.52 / 0.49; 1 MB 1.59 / 1.61 against 1.62 / 2.07; 32 MB 23.8 / 40.4
# against 29.2 / 47.9. The rows a reduce-scatter receives are summed in rank order either
# way, so the result does not depend on message timing or route. Every message on gloo
# starts with a header naming its unit, model and collective (Note [named hangs], tags.py),
# which the route makes once and which travels inside the rows' own messages.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fullshard import runtime
from fullshard.runtime import MismatchedRows, failed_wait
from fullshard.tags import HEADER_BYTES, HEADER_TAG, first_mismatch, header, header_elements, p2p_tag, read_header

# torch 2.13 renamed the flat collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# the largest message to one peer that gloo sends as one all_to_all (Note [collective choice])
SMALL_MESSAGE = 256 * 1024
# the bytes posted to receive each peer's row of an all_to_all: its longest row (Note [named hangs])
RECEIVE_CAPACITY = SMALL_MESSAGE + HEADER_BYTES
# Note [short waits]: a small all_to_all on gloo (AllToAll, checked) is done a fraction of a
# millisecond after its peers issue it, and most of a blocking wait for it is the hand-offs
# between threads: gloo's worker sleeps until its network thread is woken, then wakes the
# training thread, each on a core the other rank's compute may hold. Polling it first, with a
# yield of the core between polls, saves the last of them. On the tiny GPT of
# benchmarks/host_time.py the forward waits were 0.17 ms in the median but 0.51 ms in the mean
# (rare waits of milliseconds); fullshard's step overhead over DDP fell from 0.51-0.52 of
# FSDP2's to 0.27-0.28. Other waits block at once: larger messages (point-to-point, the first
# of whose messages comes only when a late peer gets there) outlast any poll worth its CPU, and
# polling the host's other waits gained nothing (docs/benchmarks.md, "Short waits").
SHORT_WAIT_S = 1e-3
YIELD = getattr(os, "sched_yield", lambda: time.sleep(0))  # os.sched_yield is POSIX's
# point-to-point: the bytes of a peer's rows that travel behind the header in the first of its two
# messages, whose receive holds HEADER_BYTES + FIRST_BYTES, the longest first message (Note [named hangs])
FIRST_BYTES = 64 * 1024


class BufferPool:
    """Reuses communication buffers of equal size on the CPU while units follow one
    another, so each unit does not allocate (and fault in) its own. On GPUs the caching
    allocator already does this, per stream, so nothing is kept."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer allocated on the current stream (Note [streams])."""
        free = self.free[(shape, dtype, device)]
        if not free:
            return torch.empty(shape, dtype=dtype, device=device)
        buffer = free.pop()
        if runtime.active.tracks:  # to a stream model, as good as new (give checked its users were done)
            runtime.active.allocated(buffer)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """`buffer` is no longer used by any stream."""
        rt = runtime.active
        if rt.tracks:
            rt.freed(buffer)
        if buffer.device.type == "cpu":
            self.free[(tuple(buffer.shape), buffer.dtype, buffer.device)].append(buffer)

    def release(self) -> None:
        """Hand every kept buffer back to the allocator (between phases that use other memory)."""
        self.free.clear()


@dataclass
class Flight:
    """One collective in flight: its works, what it receives into, this rank's send buffer
    (kept alive until the sends are done), and who issued it (for its waits); point-to-point
    also the works of the first messages, which carry the headers, and what they send and
    receive."""

    works: list
    received: torch.Tensor | None
    sent: torch.Tensor | None
    what: str
    timeout: timedelta
    first_works: list = field(default_factory=list)
    firsts: torch.Tensor | None = None  # [peers, HEADER_BYTES + FIRST_BYTES] uint8, in host memory
    heads: torch.Tensor | None = None  # the first messages this rank sends, [HEADER_BYTES + first bytes] each


def route_for(group: dist.ProcessGroup | None, device: torch.device, numel: int, dtype: torch.dtype, *, uid: int,
              kind: int, native: bool = True) -> Route:
    """Note [collective choice]: the route of a unit's collective of `kind` (tags.KINDS) over
    `group` whose rows hold `numel` elements of `dtype` for each peer. `native`: the backend's
    own collective may be used (a reduction that sums on the receiving rank may not)."""
    if group is None:
        return Local(group, device, numel, dtype, uid, kind)
    rt = runtime.active
    gloo = rt.backend(group, device) == "gloo"
    if not gloo:
        return Native(group, device, numel, dtype, uid, kind) if native else \
            AllToAll(group, device, numel, dtype, uid, kind, checked=False)
    if rt.host_memory(device) and numel * dtype.itemsize <= SMALL_MESSAGE:
        return AllToAll(group, device, numel, dtype, uid, kind, checked=True)
    return PointToPoint(group, device, numel, dtype, uid, kind)


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup) -> list:
    """Start reducing `tensor` in place over `group` (the all-reduce across replicas): the backend's own."""
    return issued([dist.all_reduce(tensor, op=op, group=group, async_op=True)], reads=[tensor], writes=[tensor])


def issued(works: list, *, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> list:
    """`works` just issued, told to a stream model when one is installed (runtime.launched, read
    here so that a plan's collective makes no call of the seam: Note [nothing per collective on
    a CPU])."""
    rt = runtime.active
    return rt.launched(works, reads=reads, writes=writes) if rt.tracks else works


def stream_runtime(cpu: bool):
    """The runtime a plan on a CPU (`cpu`) or a GPU orders its streams and waits with now, None
    where it needs none: the plain runtime on a CPU (Note [nothing per collective on a CPU])."""
    rt = runtime.active
    return None if cpu and rt is runtime.PLAIN else rt


def poll_briefly(works: list) -> None:
    """Note [short waits]: poll `works` for up to SHORT_WAIT_S, yielding the core between polls,
    before the blocking wait."""
    end = time.perf_counter() + SHORT_WAIT_S
    while not all(work.is_completed() for work in works) and time.perf_counter() < end:
        YIELD()


def wait_works(rt, works: list, flight: Flight, *, on_device: bool) -> None:
    """The current stream waits for `works` (`rt`: stream_runtime's); on the CPU with the plain
    runtime the host waits here, up to the flight's timeout."""
    if rt is not None:
        rt.wait_works(works, timeout=flight.timeout, what=flight.what, on_device=on_device)
        return
    try:
        for work in works:
            work.wait(flight.timeout)
    except RuntimeError as e:
        raise failed_wait(works, e) from e


class Route:
    """How rows of `numel` elements of `dtype` for each peer move in `group`: made once, with
    the header of Note [named hangs] (the unit's id, the collective's kind, the bytes a peer
    is sent). `lead` elements of header lead each row of a send buffer; `staged`: a gather's
    payload must be in one (send_buffer) before it goes."""

    name = "local"
    lead = 0
    staged = False

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, numel: int, dtype: torch.dtype,
                 uid: int, kind: int) -> None:
        self.group, self.device, self.numel, self.dtype = group, device, numel, dtype
        self.world, self.rank = (group.size(), group.rank()) if group is not None else (1, 0)
        self.peers = [r for r in range(self.world) if r != self.rank]
        self.on_device = not runtime.active.host_memory(device)
        self.cpu = device.type == "cpu"
        self.header = header(uid, kind, numel * dtype.itemsize)  # [2] int64, made once

    def send_buffer(self, pool: BufferPool, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A buffer to send `rows` rows from (1: a gather's, every peer the same; world: a
        reduction's, a row per rank) and its payload: [numel] or [rows, numel]."""
        sent = pool.take((rows, self.lead + self.numel), self.dtype, self.device)
        return sent, (sent[0, self.lead :] if rows == 1 else sent[:, self.lead :])

    def gather(self, payload: torch.Tensor, sent: torch.Tensor | None, pool: BufferPool, what: str,
               timeout: timedelta) -> Flight:
        """Start sending `payload` ([numel], in `sent` when it came from send_buffer) to every peer."""
        return Flight([], None, sent, what, timeout)

    def reduce(self, sent: torch.Tensor, shard: torch.Tensor, op: dist.ReduceOp, pool: BufferPool, what: str,
               timeout: timedelta) -> Flight:
        """Start sending each peer its row of `sent` (send_buffer's, [world, ...]): natively
        summed into `shard` (op), else received for the caller to sum."""
        return Flight([], None, sent, what, timeout)

    def finish(self, flight: Flight) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the collective (the headers first, checked: MismatchedRows) and return
        the peers' rows, those of the ranks before this one and after it ([n, numel] each;
        a native reduction: none)."""
        wait_works(stream_runtime(self.cpu), flight.works, flight, on_device=self.on_device)
        empty = torch.empty((0, self.numel), dtype=self.dtype, device=self.device)
        return empty, empty

    def give(self, flight: Flight, pool: BufferPool) -> None:
        for buffer in (flight.sent, flight.received, flight.firsts, flight.heads):
            if buffer is not None:
                pool.give(buffer)

    def check(self, headers: torch.Tensor, works: list) -> None:
        """Raise MismatchedRows when a peer's header ([peers, 2] int64) is not this route's,
        leaving `works` (rows that will never be matched) to Note [abandoned collectives]."""
        check_headers(headers, self.header, self.peers, works)


def check_headers(headers: torch.Tensor, expected: torch.Tensor, peers: list[int], works: list) -> None:
    """Raise MismatchedRows when one of `headers` ([len(peers), 2] int64, from these group ranks) is
    not `expected`, leaving `works` to Note [abandoned collectives]."""
    if torch.equal(headers, expected.expand_as(headers)):
        return
    wrong = first_mismatch(headers, expected)
    if wrong is not None:
        runtime.abandon(works)
        raise MismatchedRows(peers[wrong[0]], wrong[1], read_header(expected.tolist()))


class Local(Route):
    """No group: one rank holds every row; nothing moves."""


class Native(Route):
    """The backend's own all-gather and reduce-scatter (NCCL)."""

    name = "native"

    def gather(self, payload, sent, pool, what, timeout):
        gathered = pool.take((self.world, self.numel), self.dtype, self.device)  # [world, numel]
        works = issued([all_gather_single(gathered.view(-1), payload, group=self.group, async_op=True)],
                         reads=[payload], writes=[gathered])
        return Flight(works, gathered, sent, what, timeout)

    def reduce(self, sent, shard, op, pool, what, timeout):
        works = issued([reduce_scatter_single(shard, sent.view(-1), op=op, group=self.group, async_op=True)],
                         reads=[sent], writes=[shard])
        return Flight(works, None, sent, what, timeout)

    def finish(self, flight):
        wait_works(stream_runtime(self.cpu), flight.works, flight, on_device=self.on_device)
        rows = flight.received
        if rows is None:
            return super().finish(flight)
        return rows[: self.rank], rows[self.rank + 1 :]


class PointToPoint(Route):
    """Gloo, large messages: each peer's rows sent to it in two messages (Note [named hangs]):
    the header with the rows' first FIRST_BYTES under HEADER_TAG, into a receive that holds
    any such message, then the rest under a tag hashing the header, which rows of another
    unit or size never match."""

    name = "p2p"

    def __init__(self, group, device, numel, dtype, uid, kind):
        super().__init__(group, device, numel, dtype, uid, kind)
        self.tag = p2p_tag(uid, kind, numel * dtype.itemsize)
        # the rows the first message carries: none where they are in device memory (gloo sends
        # host memory; a model of a GPU, testing.stream_model), which the host would have to read
        self.first = 0 if self.on_device else min(numel, FIRST_BYTES // dtype.itemsize)
        self.head_bytes = HEADER_BYTES + self.first * dtype.itemsize

    def head(self, firsts: torch.Tensor, heads: torch.Tensor) -> None:
        """Write the header and `firsts` ([n, first], the rows' first elements) into `heads`
        ([n, head_bytes] uint8)."""
        heads[:, :HEADER_BYTES].copy_(self.header.view(torch.uint8).expand(heads.size(0), -1))
        if self.first:
            heads[:, HEADER_BYTES:].copy_(firsts.view(torch.uint8))

    def exchange(self, sends: list[torch.Tensor], heads: list[torch.Tensor], pool: BufferPool, flight: Flight
                 ) -> Flight:
        """Issue the messages: `heads` and the rest of `sends` (each [numel]) to each peer in turn."""
        peers, group, tag, first = self.peers, self.group, self.tag, self.first
        received = pool.take((self.world - 1, self.numel), self.dtype, self.device)  # [world - 1, numel]
        firsts = pool.take((len(peers), HEADER_BYTES + FIRST_BYTES), torch.uint8, torch.device("cpu"))
        flight.received, flight.firsts = received, firsts
        flight.first_works = [dist.irecv(firsts[i], group=group, group_src=r, tag=HEADER_TAG)
                              for i, r in enumerate(peers)]
        flight.first_works += [dist.isend(head, group=group, group_dst=r, tag=HEADER_TAG)
                               for head, r in zip(heads, peers)]
        if first < self.numel:
            works = [dist.irecv(row[first:], group=group, group_src=r, tag=tag) for row, r in zip(received, peers)]
            works += [dist.isend(t[first:], group=group, group_dst=r, tag=tag) for t, r in zip(sends, peers)]
            flight.works = issued(works, reads=sends, writes=[received])
        return flight

    def gather(self, payload, sent, pool, what, timeout):
        head = pool.take((1, self.head_bytes), torch.uint8, torch.device("cpu"))  # every peer's
        self.head(payload[: self.first].view(1, -1), head)
        flight = Flight([], None, sent, what, timeout, heads=head)
        return self.exchange([payload] * len(self.peers), [head[0]] * len(self.peers), pool, flight)

    def reduce(self, sent, shard, op, pool, what, timeout):
        heads = pool.take((len(self.peers), self.head_bytes), torch.uint8, torch.device("cpu"))
        self.head(sent[:, : self.first][self.peers], heads)  # [peers, first]
        flight = Flight([], None, sent, what, timeout, heads=heads)
        return self.exchange([sent[r] for r in self.peers], list(heads), pool, flight)

    def finish(self, flight):
        rt = stream_runtime(self.cpu)
        if rt is not None:  # the first messages are in host memory: the host reads them
            rt.wait_host_works(flight.first_works, timeout=flight.timeout, what=flight.what)
        else:
            wait_works(None, flight.first_works, flight, on_device=False)
        firsts = flight.firsts
        self.check(firsts[:, :HEADER_BYTES].view(torch.int64), flight.works)
        rows = flight.received
        if self.first:
            rows[:, : self.first].view(torch.uint8).copy_(firsts[:, HEADER_BYTES : self.head_bytes])
        wait_works(rt, flight.works, flight, on_device=self.on_device)
        return rows[: self.rank], rows[self.rank :]


class AllToAll(Route):
    """Gloo, small messages in host memory (`checked`): one all_to_all of rows, each led by the
    header, into receives that hold the longest row this route sends (Note [named hangs]).
    Also a reduction that sums on the receiving rank over another backend (unchecked: NCCL's
    rows carry no header)."""

    name = "all_to_all"
    staged = True

    def __init__(self, group, device, numel, dtype, uid, kind, *, checked: bool):
        super().__init__(group, device, numel, dtype, uid, kind)
        self.checked = checked
        if checked:
            self.lead = header_elements(dtype)
            self.row = (self.lead + numel) * dtype.itemsize  # bytes a peer is sent
            assert self.row <= RECEIVE_CAPACITY, f"an all_to_all row of {self.row} bytes"
            self.capacities = [RECEIVE_CAPACITY] * self.world
            self.capacities[self.rank] = self.row  # this rank's own row: gloo copies it, as long as sent
            self.received_bytes, self.rows_sent = sum(self.capacities), [self.row] * self.world
            self.headers = self.header.view(torch.uint8).expand(self.world, -1)  # one per row, as bytes
            stride = RECEIVE_CAPACITY // dtype.itemsize  # of the peers' rows in a receive buffer, in elements
            after = (self.rank * RECEIVE_CAPACITY + self.row) // dtype.itemsize
            self.rows_before = ((self.rank, self.lead + numel), (stride, 1), 0)
            self.rows_after = ((self.world - 1 - self.rank, self.lead + numel), (stride, 1), after)

    def send(self, sent: torch.Tensor, pool: BufferPool, what: str, timeout: timedelta) -> Flight:
        """One all_to_all of `sent` ([world, lead + numel], a row per rank)."""
        if not self.checked:
            received = pool.take((self.world, self.numel), self.dtype, self.device)
            work = dist.all_to_all_single(received, sent, group=self.group, async_op=True)
            return Flight(issued([work], reads=[sent], writes=[received]), received, sent, what, timeout)
        sent.view(torch.uint8)[:, :HEADER_BYTES].copy_(self.headers)
        received = pool.take((self.world * RECEIVE_CAPACITY,), torch.uint8, self.device)  # any row fits
        work = dist.all_to_all_single(received[: self.received_bytes], sent.view(torch.uint8).view(-1),
                                      self.capacities, self.rows_sent, group=self.group, async_op=True)
        return Flight(issued([work], reads=[sent], writes=[received]), received, sent, what, timeout)

    def send_buffer(self, pool, rows):
        sent = pool.take((self.world, self.lead + self.numel), self.dtype, self.device)  # a row per rank
        return sent, (sent[0, self.lead :] if rows == 1 else sent[:, self.lead :])

    def gather(self, payload, sent, pool, what, timeout):
        sent[1:, self.lead :].copy_(payload.expand(self.world - 1, -1))  # every peer gets this rank's row
        return self.send(sent, pool, what, timeout)

    def reduce(self, sent, shard, op, pool, what, timeout):
        return self.send(sent, pool, what, timeout)

    def finish(self, flight):
        rt = stream_runtime(self.cpu)
        if self.checked and rt is None:
            poll_briefly(flight.works)
        wait_works(rt, flight.works, flight, on_device=self.on_device)
        received = flight.received
        if not self.checked:
            return received[: self.rank], received[self.rank + 1 :]
        typed = received.view(self.dtype)
        before, after = typed.as_strided(*self.rows_before), typed.as_strided(*self.rows_after)
        lead = self.lead
        self.check(torch.cat([before[:, :lead], after[:, :lead]]).view(torch.int64), [])
        return before[:, lead:], after[:, lead:]
