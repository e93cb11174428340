"""A model of CUDA streams, events and memory that runs on the CPU: fullshard's stream order, checked.

`StreamModel` has the methods of `fullshard.runtime.Runtime`; installed in a rank
(`fullshard.runtime.installed(StreamModel())`) it makes the CPU look like a GPU with
CUDA's semantics, while the tensors and the gloo collectives stay real. The tests run
every strategy under it (tests/test_streams.py) and `fullshard bench` counts host syncs
with it. What it models:

- streams: a compute stream, one per side-stream purpose ("gather", "reduce",
  "all_reduce"), a stream per collective in flight (it waits for the stream that issued
  it, as NCCL's does), and the host. Each keeps a vector clock: how far it is ordered
  after every other stream, through wait_stream, events, collective waits and host
  syncs. Work a stream is given after the host did something is ordered after it.
- buffers (by storage): every read and write is recorded with its stream and clock. A
  read of a buffer written on another stream, or a write of one read or written there,
  must be ordered after it; a buffer freed (to the allocator or a pool) must be ordered,
  on the stream that allocated it, after every other stream's use. Memory the code put
  in host memory (`to_host`, or marked by the test as a model built on the CPU) is read
  and written by the host, and no collective may touch it (NCCL reads device memory).
- host syncs: `host_waits`, `sync_event` and `read_on_host` of device memory are counted,
  and so are `.item()`/`bool()` of tensors while `counting_scalars()` is on.

A violation is recorded as a line naming the buffer, both streams and where in
fullshard the access happened; `violations` collects them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections import Counter
from datetime import timedelta
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fullshard.param import local_values
from fullshard.runtime import Runtime

SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.clock = 0  # operations given so far
        self.seen: dict[Stream, int] = {}  # for each other stream: up to which operation this one runs after it

    def after(self, other: Stream, clock: int) -> bool:
        return other is self or self.seen.get(other, 0) >= clock

    def join(self, seen: dict[Stream, int]) -> None:
        for stream, clock in seen.items():
            if stream is not self and clock > self.seen.get(stream, 0):
                self.seen[stream] = clock

    def __repr__(self) -> str:
        return self.name


class Buffer:
    """One storage: its allocating stream and the last read and write by each stream."""

    def __init__(self, tensor: torch.Tensor, where: str) -> None:
        self.shape, self.dtype, self.where = tuple(tensor.shape), tensor.dtype, where
        self.host = False
        self.allocated_on: Stream | None = None
        self.last: dict[tuple[Stream, str], tuple[int, str]] = {}  # (stream, "read"/"write") -> (clock, where)

    @property
    def label(self) -> str:
        """The buffer in words, for a violation (made only then: most buffers have none)."""
        return f"{self.shape} {str(self.dtype).removeprefix('torch.')} (first seen at {self.where})"


class ModelWork:
    """A collective in flight on its own stream; the model's `wait_works` orders the waiter after it."""

    def __init__(self, work: object, stream: Stream) -> None:
        self.work = work
        self.stream = stream
        self.seen = {**stream.seen, stream: stream.clock}

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Tracking(TorchDispatchMode):
    """Sees every operation: counts tensor-to-Python reads (`.item()`, `bool()`: host syncs
    on a GPU) while the model is counting, carries host memory through operations (what
    is computed from host memory is in host memory), and records operations that mix host
    and device memory (a device mismatch on a GPU; copies and 0-d operands excepted) and
    collectives on host memory."""

    def __init__(self, model: StreamModel) -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        model, kwargs = self.model, kwargs or {}
        if model.counting and func in SCALAR_READS:
            model.host_syncs += 1
            model.sync_sites[f"{func.__name__} at {caller_site()}"] += 1
        out = func(*args, **kwargs)
        if model.copying:
            return out
        kernel = func.namespace not in ("c10d", "_c10d_functional") and not func.is_view
        if model.host_storages:  # what is computed from host memory is in host memory
            self.carry_host(func, args, kwargs, out)
        if kernel:
            model.kernel(func, args, kwargs, out)
        return out

    def carry_host(self, func, args: tuple, kwargs: dict, out) -> None:
        model = self.model
        inputs = [local_values(t) for t in tensors_in(args, kwargs)]
        host = [model.is_host(t) for t in inputs]
        if not any(host):
            return
        if func.namespace in ("c10d", "_c10d_functional"):
            model.violations.append(f"collective {func.__name__} at {caller_site()} on host memory: NCCL reads and "
                                    f"writes device memory only")
        elif func is not torch.ops.aten.copy_.default and any(h for h, t in zip(host, inputs) if t.dim()) and \
                any(not h for h, t in zip(host, inputs) if t.dim()):
            model.violations.append(f"{func.__name__} at {caller_site()} mixes host and device memory")
        known = {t.untyped_storage()._cdata for t in inputs}
        model.mark_host(*[t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                          and local_values(t).untyped_storage()._cdata not in known])


def caller_site() -> str:
    """file:line of the innermost fullshard frame on the stack that is not the seam's (runtime.py,
    routes.issued, which tells the model of a collective), else the innermost of the code that
    called into torch (a script's, a test's), else the innermost of torch's own.
    Asked at every operation: what each code object is, and each site's words, are made once."""
    frame = sys._getframe(1)
    caller = in_torch = None
    while frame is not None:
        code = frame.f_code
        kind = FRAME_KINDS.get(code)
        if kind is None:
            kind = FRAME_KINDS[code] = frame_kind(code)
        if kind == SITE:
            return site_text(code, frame.f_lineno, True)
        if kind == CALLER and caller is None:
            caller = frame
        elif kind == TORCH and in_torch is None:
            in_torch = frame
        frame = frame.f_back
    fallback = caller or in_torch
    return site_text(fallback.f_code, fallback.f_lineno, False) if fallback is not None else "?"


SITE, CALLER, TORCH, PASSED = range(4)
FRAME_KINDS: dict = {}  # code object -> SITE (fullshard's, not the seam's), CALLER, TORCH or PASSED


def frame_kind(code) -> int:
    name = code.co_filename
    seam = name.endswith(("runtime.py", "stream_model.py")) or code.co_name == "issued"
    if "/fullshard/" in name and not seam:
        return SITE
    if name.endswith(("stream_model.py", "_python_dispatch.py", "contextlib.py")):
        return PASSED
    return TORCH if "/torch/" in name else CALLER


@functools.lru_cache(maxsize=None)
def site_text(code, line: int, named: bool) -> str:
    where = f"{code.co_filename.rsplit('/', 1)[-1]}:{line}"
    return f"{where} ({code.co_name})" if named else where


ARGUMENTS: dict = {}  # an operator -> (its arguments' names, whether it writes each)


def arguments_of(func) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    got = ARGUMENTS.get(func)
    if got is None:
        schema = func._schema.arguments
        got = ARGUMENTS[func] = (tuple(a.name for a in schema),
                                 tuple(a.alias_info is not None and a.alias_info.is_write for a in schema))
    return got


def tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an operator's arguments (aten takes tensors and lists of them)."""
    out = []
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor):
            out.append(arg)
        elif isinstance(arg, (list, tuple)):
            out.extend(t for t in arg if isinstance(t, torch.Tensor))
    return out


class StreamModel:
    """fullshard.runtime.Runtime's methods over modelled streams; see the module docstring.

    `native`: use the collectives NCCL would (all-gather, reduce-scatter) instead of gloo's
    point-to-point rows. `skip_waits`: (waiter, waited) stream names whose wait_stream is
    dropped, to show that the model notices a missing wait. Collectives issued by another
    thread than the one that made the model (a background save's writer, whose collectives
    run on the host over the checkpoints' own group) are the plain runtime's: the model
    follows the training thread's streams.
    """

    tracks = True  # callers build the arguments of reads/writes/allocated/freed

    def __init__(self, *, native: bool = True, skip_waits: tuple[tuple[str, str], ...] = ()) -> None:
        self.native = native
        self.skip_waits = set(skip_waits)
        self.compute = Stream("compute")
        self.host = Stream("host")
        self.side: dict[str, Stream] = {}
        self.comms: list[Stream] = []
        self.stack = [self.compute]
        self.buffers: dict[int, Buffer] = {}
        self.host_storages: set[int] = set()  # keys of the buffers in host memory
        self.keep: list[torch.UntypedStorage] = []  # every storage seen stays alive, so storage keys stay unique
        self.violations: list[str] = []
        self.host_syncs = 0
        self.sync_sites: Counter[str] = Counter()
        self.issued: list[tuple[str, str]] = []  # (stream, where) of every collective, in issue order
        self.counting = False  # scalar reads count as host syncs
        self.copying = False  # inside the model's own copies between host and device memory
        self.thread = threading.get_ident()  # the training thread, whose streams are modelled
        self.plain = Runtime()  # for other threads' collectives

    # ---- streams -------------------------------------------------------------------------

    def given(self, stream: Stream) -> None:
        """The host gives `stream` work now: after everything the host did so far."""
        if stream is not self.host:
            stream.seen[self.host] = self.host.clock

    def side_stream(self, device: torch.device, purpose: str) -> Stream:
        if purpose not in self.side:
            self.side[purpose] = Stream(purpose)
        return self.side[purpose]

    def current_stream(self, device: torch.device) -> Stream:
        return self.stack[-1]

    def wait_stream(self, waiter: Stream | None, waited: Stream | None) -> None:
        if waiter is None or waited is None or waiter is waited or (waiter.name, waited.name) in self.skip_waits:
            return
        waiter.join({**waited.seen, waited: waited.clock})

    @contextlib.contextmanager
    def use(self, stream: Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()

    def record_event(self, stream: Stream | None) -> dict | None:
        return None if stream is None else {**stream.seen, stream: stream.clock}

    def sync_event(self, event: dict | None, *, timeout: timedelta, what: str) -> None:
        if event is not None:
            self.host_syncs += 1
            self.sync_sites[f"sync_event at {caller_site()}"] += 1
            self.host.join(event)

    # ---- collectives -----------------------------------------------------------------------

    def backend(self, group: object, device: torch.device) -> str:
        return "nccl" if self.native else "gloo"  # a model of GPU memory: NCCL's collectives, or gloo's on it

    def host_memory(self, device: torch.device) -> bool:
        return False  # the model pretends to be a GPU (memory the code puts in host memory is marked so)

    def wait_host_works(self, works: list, *, timeout: timedelta, what: str) -> None:
        self.copying = True
        try:
            for work in works:  # gloo's headers in host memory (Note [named hangs]): no stream involved
                work.wait(timeout)
        finally:
            self.copying = False

    def launched(self, works: list, *, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> list:
        if threading.get_ident() != self.thread:
            return self.plain.launched(works, reads=reads, writes=writes)
        issuer = self.stack[-1]
        stream = Stream(f"collective #{len(self.comms)} (issued on {issuer.name} at {caller_site()})")
        self.comms.append(stream)
        self.issued.append((issuer.name, caller_site()))
        self.given(issuer)
        stream.join({**issuer.seen, issuer: issuer.clock})
        for tensor in [*reads, *writes]:
            if self.buffer(tensor).host:
                self.violations.append(f"a collective at {caller_site()} touches host memory "
                                       f"{self.buffer(tensor).label}: NCCL reads and writes device memory only")
        self.access(stream, reads, "read", copy=True)
        self.access(stream, writes, "write", copy=True)
        return [ModelWork(work, stream) for work in works]

    def wait_works(self, works: list, *, timeout: timedelta, what: str, on_device: bool) -> None:
        if threading.get_ident() != self.thread:
            return self.plain.wait_works(works, timeout=timeout, what=what, on_device=on_device)
        waiter = self.stack[-1]
        for work in works:
            self.copying = True  # what gloo copies inside wait() is the collective's own work
            try:
                work.work.wait(timeout)  # gloo really runs them; the model only orders the streams
            finally:
                self.copying = False
            waiter.join(work.seen)

    # ---- buffers ---------------------------------------------------------------------------

    def buffer(self, tensor: torch.Tensor, where: str | None = None) -> Buffer:
        tensor = local_values(tensor)
        key = tensor.untyped_storage()._cdata
        if key not in self.buffers:
            self.buffers[key] = Buffer(tensor, where or caller_site())
            self.keep.append(tensor.untyped_storage())  # the storage itself: `.data =` may move the tensor
        return self.buffers[key]

    def access(self, stream: Stream, tensors: list[torch.Tensor], kind: str, *, copy: bool = False,
               where: str | None = None) -> None:
        """`stream` reads or writes `tensors`; kernels on host memory run on the host, copies on `stream`.
        `where`: the caller's site, when the caller has found it already (finding it walks the stack)."""
        where = where or caller_site()
        for tensor in tensors:
            buffer = self.buffer(tensor, where)
            on = self.host if buffer.host and not copy else stream
            self.given(on)
            conflicts = ("write",) if kind == "read" else ("read", "write")
            for (other, other_kind), (clock, other_where) in buffer.last.items():
                if other is not on and other_kind in conflicts and not on.after(other, clock):
                    self.violations.append(
                        f"{kind} on {on.name} at {where} of {buffer.label} is not ordered after the "
                        f"{other_kind} on {other.name} at {other_where}")
            on.clock += 1
            buffer.last[(on, kind)] = (on.clock, where)

    def kernel(self, func, args: tuple, kwargs: dict, out) -> None:
        """An operation on the current stream (Tracking sees every one): it reads its tensor
        arguments, writes those its schema says it mutates, and allocates, then writes, what
        it returns in new memory. So no code of fullshard's needs to say what its kernels touch."""
        read, written = [], []
        names, writes = arguments_of(func)
        given = len(args)
        for i, is_write in enumerate(writes):
            value = args[i] if i < given else kwargs.get(names[i])
            if isinstance(value, torch.Tensor):
                (written if is_write else read).append(value)
            elif isinstance(value, (list, tuple)):
                (written if is_write else read).extend(t for t in value if isinstance(t, torch.Tensor))
        where = caller_site()  # once per operation
        known = {local_values(t).untyped_storage()._cdata for t in (*read, *written)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and local_values(t).untyped_storage()._cdata not in known:
                self._allocated_at(t, where)
        stream = self.stack[-1]
        # a copy that touches device memory runs on the stream (a copy engine); one from host memory to host
        # memory is the host's own memcpy, as any kernel on host memory is
        copy = func is torch.ops.aten.copy_.default and not (self.is_host(args[0]) and self.is_host(args[1]))
        self.access(stream, [t for t in read if t.numel()], "read", copy=copy, where=where)
        self.access(stream, [t for t in written if t.numel()], "write", copy=copy, where=where)
        blocking = copy and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if blocking and self.buffer(args[0], where).host and not self.buffer(args[1], where).host:  # the host waits
            self.host_syncs += 1
            self.sync_sites[f"a blocking copy to host memory at {where}"] += 1
            self.host.join({**stream.seen, stream: stream.clock})

    def reads(self, *tensors: torch.Tensor) -> None:
        self.access(self.stack[-1], list(tensors), "read")

    def writes(self, *tensors: torch.Tensor) -> None:
        self.access(self.stack[-1], list(tensors), "write")

    def allocated(self, tensor: torch.Tensor) -> None:
        """New memory for `tensor` on the current stream: a write there, at its clock (whatever
        another stream does with it must be ordered after)."""
        self._allocated_at(tensor, caller_site())

    def _allocated_at(self, tensor: torch.Tensor, where: str) -> None:
        buffer = self.buffer(tensor, where)
        buffer.allocated_on = self.host if buffer.host else self.stack[-1]
        buffer.last.clear()
        self.access(self.stack[-1], [tensor], "write", where=where)

    def freed(self, tensor: torch.Tensor) -> None:
        buffer = self.buffer(tensor)
        owner = buffer.allocated_on or self.stack[-1]
        for (other, kind), (clock, where) in buffer.last.items():
            if not owner.after(other, clock) and not buffer.host:
                self.violations.append(
                    f"{buffer.label}, allocated on {owner.name}, is freed at {caller_site()} while the {kind} on "
                    f"{other.name} at {where} may still run: the allocator may hand it out again")

    # ---- host and device memory --------------------------------------------------------------

    def mark_host(self, *tensors: torch.Tensor) -> None:
        """These tensors live in host memory (a model built on the CPU, offloaded shards)."""
        for tensor in tensors:
            buffer = self.buffer(tensor)
            if not buffer.host:  # what was done to it so far was done in host memory, by the host
                buffer.host, buffer.allocated_on = True, self.host
                buffer.last = {(self.host, kind): (self.host.clock, where) for (_, kind), (_, where) in buffer.last.items()}
            self.host_storages.add(local_values(tensor).untyped_storage()._cdata)

    def is_host(self, tensor: torch.Tensor) -> bool:
        return local_values(tensor).untyped_storage()._cdata in self.host_storages

    def elsewhere(self, tensor: torch.Tensor, device: torch.device) -> bool:
        return self.buffer(tensor).host or tensor.device != device

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copying = True
        try:
            dst.copy_(src)
        finally:
            self.copying = False
        self.access(self.stack[-1], [src], "read", copy=True)  # a copy engine on the current stream
        self.access(self.stack[-1], [dst], "write", copy=True)

    def copied(self, tensor: torch.Tensor, host: bool) -> torch.Tensor:
        self.copying = True
        try:
            out = tensor.clone()
        finally:
            self.copying = False
        buffer = self.buffer(out)
        buffer.allocated_on = self.stack[-1]
        if host:
            self.mark_host(out)
        self.copy_(out, tensor)
        return out

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return self.copied(tensor, host=False) if self.buffer(tensor).host else tensor

    def to_host(self, tensor: torch.Tensor, *, pin: bool) -> torch.Tensor:
        return tensor if self.buffer(tensor).host else self.copied(tensor, host=True)

    def host_buffer(self, shape: torch.Size, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        self.mark_host(buffer)
        return buffer

    def host_reads(self, *tensors: torch.Tensor) -> None:
        self.access(self.host, list(tensors), "read")

    def host_waits(self, device: torch.device, *, timeout: timedelta, what: str) -> None:
        self.host_syncs += 1
        self.sync_sites[f"host_waits at {caller_site()}"] += 1
        stream = self.stack[-1]
        self.host.join({**stream.seen, stream: stream.clock})

    def read_on_host(self, tensor: torch.Tensor, *, timeout: timedelta, what: str) -> list:
        if threading.get_ident() != self.thread:
            return self.plain.read_on_host(tensor, timeout=timeout, what=what)
        if not self.buffer(tensor).host:  # device memory: the host waits for the current stream first
            self.host_waits(tensor.device, timeout=timeout, what=what)
        self.access(self.host, [tensor], "read")
        return tensor.tolist()

    # ---- checks for the tests ----------------------------------------------------------------

    def check_joined(self, when: str) -> None:
        """The compute stream has waited for everything every other stream was given (end of backward)."""
        behind = [s.name for s in [*self.side.values(), *self.comms] if not self.compute.after(s, s.clock)]
        if behind:
            self.violations.append(f"{when}: the compute stream has not waited for {', '.join(behind)}")

    def tracking(self) -> Tracking:
        """A context in which every operation is seen (see Tracking)."""
        return Tracking(self)

    @contextlib.contextmanager
    def counting_scalars(self) -> Iterator[None]:
        """Count `.item()` and `bool()` of tensors inside the context as host syncs (inside `tracking()`)."""
        self.counting = True
        try:
            yield
        finally:
            self.counting = False
