"""The accelerator seam: every stream, event, collective wait and host transfer of fullshard
(on a CPU with the plain runtime, the plans' collectives skip it: Note [nothing per
collective on a CPU]).

`runtime.active` forwards to torch.cuda on GPUs and does nothing but wait on the CPU; it
also says what a device and a group are (`host_memory`, `backend`), which the plans read
once when they choose their routes. A test can install another object with the same
methods (fullshard/testing/stream_model.py models CUDA's streams on the CPU and sees every
kernel through a dispatch mode, recording per buffer the stream of each read, write and
free), which is how the ordering below is checked without a GPU. Training makes no call for
that model: what only it needs (`launched`, `allocated`, `freed`) is called when the
runtime `tracks`. Note [streams] and Note [host syncs] below.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from fullshard.errors import CollectiveError

log = logging.getLogger("fullshard")

# Note [streams]: on CUDA a unit's gather runs on the "gather" stream, its reduction on
# the "reduce" stream and the cross-replica all-reduce on the "all_reduce" stream, so all
# three overlap compute. They are ordered with wait_stream and events, never with
# record_stream:
# - a side stream waits for the compute stream before it reads anything the compute
#   stream wrote (shards the optimizer stepped, gradients packed for the reduction);
# - the compute stream waits for the side stream before it reads the result or frees a
#   buffer the side stream used (a buffer belongs to the stream it was allocated on);
# - a collective runs on its process group's own stream, which waits for the stream that
#   issues it; `wait_works` makes the waiting stream wait for the collective.
# At the end of backward the compute stream has waited for every side stream.
#
# Note [host syncs]: the host never waits for the GPU inside a step except once, at the
# end of backward, and only when it must read what the GPU produced: gradients copied to
# pinned host memory (CPU offload), has-gradient flags of parameters some rank had no
# gradient for, and the non-finite check. Everything else (collective waits included)
# is ordered on streams, so the host runs ahead and keeps the GPU fed. Every host wait
# is bounded (Runtime.sync_event), so a stuck GPU becomes a named error, not a hang.


# Note [abandoned collectives]: a collective that timed out may never finish (a peer is
# stopped, or waits in another collective), and a process group's destructor waits for
# the collectives in flight: the rank that raised would hang at exit for the group's own
# timeout (30 minutes by default), and its launcher with it. So once a wait fails, its
# works and every process group are kept alive for the rest of the process (the job
# cannot go on with them anyway): nothing waits for them at exit.


# Note [nothing per collective on a CPU]: with the plain runtime (`PLAIN`) on a CPU there is
# no stream to order and the host itself waits, so a plan, which knows from when it is made
# whether its device is a CPU, makes no call of this seam per collective there
# (routes.stream_runtime: one identity check): it waits on the works itself (`failed_wait` only when
# one fails), skips the stream calls, and labels its work for a profiler only while one
# records (`profiling()`, else `NOTHING`: a label is an op of its own, a few microseconds).
# A stream model (fullshard.testing), installed before or after the plans were made, or a
# GPU gets every call.
NOTHING = contextlib.nullcontext()  # a `with` that does nothing: no label, no stream
profiling = torch.autograd._profiler_enabled  # whether a profiler records now
label = torch.profiler.record_function


def failed_wait(works: list, error: RuntimeError) -> CollectiveError:
    """The error of a host wait on `works` that raised (the backends raise RuntimeError subclasses
    for timeouts and lost peers); the works are never destroyed (Note [abandoned collectives])."""
    abandon(works)
    return CollectiveError(str(error).splitlines()[0])


def abandon(works: list) -> None:
    """Never destroy these works or any process group (Note [abandoned collectives])."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {})) if world is not None else []
    for obj in [*works, *groups]:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # a reference no interpreter teardown drops


class MismatchedRows(CollectiveError):
    """A peer sent the rows of another collective (Note [named hangs], tags.py): `peer` is its
    rank in the group, `header` what its rows' header says, (unit id, kind, bytes), None when
    they had none; `mine` this rank's header."""

    def __init__(self, peer: int, header: tuple[int, int, int] | None, mine: tuple[int, int, int]) -> None:
        super().__init__(f"group rank {peer} sent the rows of " + ("another collective" if header is None else
                                                                    f"collective {header} (unit id, kind, bytes)"))
        self.peer, self.header, self.mine = peer, header, mine


class MismatchedCall(CollectiveError):
    """A peer reached another of fullshard's all-gathers of integers (collectives.all_gather_ints)."""

    names_the_collective = True  # errors.collective_failed says it as it is

    def __init__(self, what: str, peer: int, theirs: str) -> None:
        super().__init__(f"{what} met {theirs} of group rank {peer}")


class OverdueCollective(CollectiveError):
    """A collective the hang watch saw overdue, raised by a later wait (of any unit): its
    message names the overdue collective, its unit and step, not the waiter."""

    names_the_collective = True  # errors.collective_failed says it as it is


class HangWatch:
    """Note [named hangs] on GPUs, where waits do not block the host: a background thread
    polls a marker behind each collective in flight (an event the stream records after
    waiting for it, so no buffer is kept alive) and, for one still pending past its
    deadline, logs an error naming it; the next wait of any unit, and every host wait,
    raises it as OverdueCollective. The thread runs on the GPU it watches and ends when
    nothing is left to watch or once a collective is overdue."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watched: list[tuple[float, object, str]] = []  # (monotonic deadline, marker with query(), message)
        self.overdue: str | None = None
        self.thread: threading.Thread | None = None
        self.poll_s = 0.5
        self.wake = threading.Event()  # set: poll now

    def add(self, marker: object, timeout: timedelta, what: str, *, device: int | None) -> None:
        """Watch `marker` (`device`: the GPU it was recorded on, None for fakes)."""
        with self.lock:
            self.watched.append((time.monotonic() + timeout.total_seconds(), marker,
                                 f"{what} did not finish within {timeout.total_seconds():g} s"))
            if self.thread is None and self.overdue is None:
                self.thread = threading.Thread(target=self.run, args=(device,), name="fullshard-hang-watch",
                                               daemon=True)
                self.thread.start()

    def check(self) -> None:
        """Raise the first overdue collective seen, if any."""
        if self.overdue is not None:
            raise OverdueCollective(self.overdue)

    def scan(self) -> None:
        now = time.monotonic()
        with self.lock:
            still = []
            for due, marker, message in self.watched:
                if marker.query():
                    continue
                if now > due and self.overdue is None:
                    self.overdue = message
                    log.error("fullshard: %s", message)
                still.append((due, marker, message))
            self.watched = still

    def run(self, device: int | None) -> None:
        if device is not None:
            torch.cuda.set_device(device)  # a new thread starts on cuda:0; query() must not touch it
        while True:
            self.wake.wait(self.poll_s)
            self.wake.clear()
            try:
                self.scan()
            except Exception:  # a failed query must not end the watch silently: log it and go on
                log.exception("fullshard: the hang watch could not poll a collective")
            with self.lock:
                if not self.watched or self.overdue is not None:
                    self.thread = None
                    return


# a host wait polls its event, sleeping at most this long in between: it wakes at most this
# late after the GPU got there (a fraction of a ms per host sync), at <= 2000 wake-ups a second
MAX_PAUSE_S = 5e-4


def device_backend(name: str, device_type: str) -> str:
    """The backend of a process group's name for tensors of `device_type`: a group made by
    init_process_group() without a backend is "cpu:gloo,cuda:nccl", whose CUDA collectives are
    NCCL's (and average as NCCL does)."""
    if ":" not in name:
        return name
    backends = dict(part.split(":", 1) for part in name.split(","))
    return backends.get(device_type, name)


class Runtime:
    """CUDA streams and events where the device is a GPU; on the CPU streams are None."""

    def __init__(self) -> None:
        self.streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self.watch = HangWatch()
        self.backends: dict[tuple, str] = {}  # each (group, device type)'s backend, read once

    # ---- streams and events, Note [streams] ----------------------------------------------

    def side_stream(self, device: torch.device, purpose: str) -> torch.cuda.Stream | None:
        """The process's stream for `purpose` ("gather", "reduce", "all_reduce") on a GPU; None on CPU."""
        if device.type != "cuda":
            return None
        if (device, purpose) not in self.streams:
            self.streams[(device, purpose)] = torch.cuda.Stream(device, priority=-1)
        return self.streams[(device, purpose)]

    def current_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def wait_stream(self, waiter: torch.cuda.Stream | None, waited: torch.cuda.Stream | None) -> None:
        """`waiter` runs what it is given next only after all that `waited` was given so far."""
        if waiter is not None and waited is not None and waiter is not waited:
            waiter.wait_stream(waited)

    def use(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        """Make `stream` current inside the context (nothing for None)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record_event(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        return stream.record_event() if stream is not None else None

    def sync_event(self, event: torch.cuda.Event | None, *, timeout: timedelta, what: str) -> None:
        """The host waits for `event` (a host sync, Note [host syncs]), up to `timeout`:
        polled, so a GPU stuck behind a collective becomes an error naming it (the hang
        watch's OverdueCollective), or naming `what` when no collective is known overdue."""
        if event is None:
            return
        deadline = time.monotonic() + timeout.total_seconds()
        pause = 1e-5
        while not event.query():
            self.watch.check()
            if time.monotonic() > deadline:
                self.watch.scan()
                self.watch.check()
                raise CollectiveError(f"{what} did not finish within {timeout.total_seconds():g} s")
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)

    # ---- collectives -------------------------------------------------------------------

    def backend(self, group: dist.ProcessGroup, device: torch.device) -> str:
        """The backend that runs `group`'s collectives on `device`'s tensors ("gloo", "nccl",
        ...), which routes.route_for and the averaging choose by."""
        key = (group, device.type)
        name = self.backends.get(key)
        if name is None:
            name = self.backends[key] = device_backend(dist.get_backend(group), device.type)
        return name

    def host_memory(self, device: torch.device) -> bool:
        """Whether tensors on `device` live in host memory (gloo's collectives then run on the host)."""
        return device.type == "cpu"

    def launched(self, works: list, *, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> list:
        """`works` were just issued on the current stream, reading and writing these buffers (a
        stream model's: the module's `launched` calls it only when one `tracks`)."""
        return works

    def wait_works(self, works: list, *, timeout: timedelta, what: str, on_device: bool) -> None:
        """The current stream waits for `works` (`what` names them in errors). On a GPU
        (`on_device`) only the stream waits and the hang watch keeps the timeout; on the
        CPU the host waits, up to `timeout`."""
        self.watch.check()
        try:
            if on_device:
                for work in works:
                    work.wait()  # no timeout: stream ordering only, the host does not block
                if works:
                    self.watch.add(self.marker(), timeout, what, device=self.gpu())
            else:
                for work in works:
                    work.wait(timeout)
        except CollectiveError:
            raise
        except RuntimeError as e:
            raise failed_wait(works, e) from e

    def wait_host_works(self, works: list, *, timeout: timedelta, what: str) -> None:
        """The host waits for `works`, gloo's messages in host memory (Note [named hangs]'s headers)."""
        self.wait_works(works, timeout=timeout, what=what, on_device=False)

    def marker(self) -> object:
        """An event on the current stream: its query() says whether the stream got there."""
        return torch.cuda.current_stream().record_event()

    def gpu(self) -> int | None:
        """The current GPU, which the hang watch's thread polls on."""
        return torch.cuda.current_device()

    # ---- buffers, Note [streams] ------------------------------------------------------
    # These record what each stream reads and writes for the CPU model of streams
    # (fullshard.testing.stream_model); here they do nothing, and callers that would build
    # arguments for them first ask `tracks`.

    tracks = False

    def allocated(self, tensor: torch.Tensor) -> None:
        """`tensor`'s memory was just allocated on the current stream."""

    def freed(self, tensor: torch.Tensor) -> None:
        """`tensor`'s memory goes back to the allocator now, from its allocation stream."""

    # ---- host and device memory, Note [host syncs] ---------------------------------------

    def elsewhere(self, tensor: torch.Tensor, device: torch.device) -> bool:
        """Whether `tensor` lives in other memory than `device`'s (host memory for a GPU)."""
        return tensor.device != device

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` into `dst` on the current stream, without waiting (also between host and device memory)."""
        dst.copy_(src, non_blocking=True)

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`tensor` in `device`'s memory (itself when it is there already), copied on the current stream."""
        return tensor.to(device, non_blocking=True)

    def to_host(self, tensor: torch.Tensor, *, pin: bool) -> torch.Tensor:
        """Start copying `tensor` to host memory (pinned: asynchronously); valid on the host
        after `host_waits`. A CPU tensor is returned as it is."""
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        return host

    def host_buffer(self, shape: torch.Size, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
        """A new tensor in host memory (pinned: a GPU copies into it asynchronously)."""
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    def host_reads(self, *tensors: torch.Tensor) -> None:
        """The host reads these host buffers now (after waiting for the event of their copies)."""

    def host_waits(self, device: torch.device, *, timeout: timedelta, what: str) -> None:
        """The host waits for everything issued so far on the current stream (a host sync),
        up to `timeout` (see `sync_event`)."""
        stream = self.current_stream(device)
        self.sync_event(self.record_event(stream), timeout=timeout, what=what)

    def read_on_host(self, tensor: torch.Tensor, *, timeout: timedelta, what: str) -> list:
        """`tensor`'s values in Python: on a GPU a host sync, bounded as `host_waits` is."""
        if tensor.device.type == "cuda":
            self.host_waits(tensor.device, timeout=timeout, what=what)
        return tensor.tolist()


active = PLAIN = Runtime()  # PLAIN: the runtime training uses; a test may install another

# Streams the compute stream must wait for before it next writes the shards (a background
# save's copies of them, Note [background saves]): waited for by the optimizer's step, the
# first such write, so that the forward and backward between run unordered with the copies.
BEFORE_NEXT_STEP: list[tuple[torch.device, object]] = []


def before_next_step(device: torch.device, stream: object) -> None:
    BEFORE_NEXT_STEP.append((device, stream))


def order_before_step() -> None:
    """The compute stream waits for every stream recorded by before_next_step (the optimizer
    step pre-hook calls it when there is one)."""
    while BEFORE_NEXT_STEP:
        device, stream = BEFORE_NEXT_STEP.pop()
        active.wait_stream(active.current_stream(device), stream)


def launched(works: list, *, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> list:
    """`works` just issued on the current stream, reading and writing these buffers: told to the
    runtime only when it `tracks` (a stream model), so that training pays no call for it."""
    return active.launched(works, reads=reads, writes=writes) if active.tracks else works


@contextlib.contextmanager
def installed(runtime: object) -> Iterator[object]:
    """Use `runtime` (an object with Runtime's methods) inside the context."""
    global active
    before, active = active, runtime
    try:
        yield runtime
    finally:
        active = before
