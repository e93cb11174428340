"""Saves that do not stop training: a copy of this rank's part of the state into reusable
host buffers, then the checkpoint written by a thread of its own (Note [background saves]).

# Note [background saves]: save(block=False) returns once the values it saves are copied
# into host buffers (pinned when they come from a GPU). On a GPU the copies run on a
# "stage" stream that waits for the compute stream (so they read what the last step
# wrote), and the compute stream waits for them in turn just before the next optimizer
# step, the first write to the shards (runtime.before_next_step, from the step pre-hook of
# hooks.py), so the next forward and backward run alongside the copies; a user's own
# in-place edit of the parameters in between must wait (handle.result()). The thread waits for their event before it
# reads a buffer. The thread then runs every phase of a blocking save (store.py:
# write this rank's records, agree, rank 0 commits and switches LATEST, agree) on the
# checkpoints' gloo group, which training never uses and which no save or load uses
# meanwhile (each waits for the save in flight first). LATEST switches
# only when every rank's part is on disk; a failure anywhere leaves the previous version
# as LATEST, exactly as a blocking save does. One save is in flight per process: the
# next save, a load, an export and the interpreter's exit wait for it first, and a failure it had
# is raised there (or by handle.result()) as the FullShardError a blocking save would
# have raised. The buffers stay with the model for the next save: the host memory this
# costs is the bytes this rank saves (its shards and their optimizer state), once.
# Whatever CPU time the write takes comes out of training where the host cores are busy
# (CPU training), so the writer keeps it small: small writes are gathered, and every 64
# MiB the file is synced and its pages handed back to the kernel (files.Writer.settle),
# so a save writes into pages just freed rather than into memory not touched yet.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from fullshard import runtime
from fullshard.errors import FullShardError, fail


class SaveHandle:
    """A save writing in the background; `result()` waits for it and raises what it failed with."""

    def __init__(self, what: str, write: Callable[[], None]) -> None:
        self.what = what
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(write,), name="fullshard save", daemon=True)

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # raised in the caller's thread by result(); a FullShardError says all,
            self.error = e.with_traceback(None) if isinstance(e, FullShardError) else e  # and frees the frames
            if not dist.is_initialized():  # the groups it writes over are gone
                self.error = fail(f"{self.what} failed: the process groups were destroyed "
                                  f"(torch.distributed.destroy_process_group) while it wrote in the background",
                                  "Wait for the save (its handle.result()) before "
                                  "destroy_process_group(); the previous checkpoint is still LATEST.")

    def done(self) -> bool:
        """Whether the write has ended (successfully or not)."""
        return not self.thread.is_alive()

    def result(self) -> None:
        """Wait for the write and raise the FullShardError it failed with (the previous
        checkpoint is then still LATEST). No deadline of its own, as a blocking save has none:
        each phase's agreement gives up after the model's timeout, and the writing itself
        takes what the disk takes (a deadline here would let ranks go on while their writes
        still use the checkpoints' group)."""
        self.thread.join()
        _in_flight.discard(self)
        if self.error is not None:
            if isinstance(self.error, FullShardError):
                raise self.error
            raise fail(f"{self.what} failed in the background ({type(self.error).__name__}: {self.error})",
                       "The previous checkpoint is still LATEST; save again.") from self.error


_in_flight: set[SaveHandle] = set()  # started and not yet waited for (at most one: each save waits first)


def wait_for_saves() -> None:
    """Wait for the save in flight, if any, raising its failure (before the next save or a load)."""
    for handle in list(_in_flight):
        handle.result()


def start(what: str, write: Callable[[], None]) -> SaveHandle:
    """Run `write` (the phases of a save, over staged values) in a thread of its own."""
    global _exit_registered
    if not _exit_registered:  # after mesh.py's release of the process groups, so it runs before that
        atexit.register(_wait_at_exit)
        _exit_registered = True
    handle = SaveHandle(what, write)
    _in_flight.add(handle)
    handle.thread.start()
    return handle


_exit_registered = False


def _wait_at_exit() -> None:
    """A script may end right after save(block=False): its checkpoint is written first. If that
    fails, the error is printed, and _exit_if_a_save_failed ends the process with status 1."""
    global _failed_at_exit
    for handle in list(_in_flight):
        try:
            handle.result()
        except FullShardError as e:
            print(f"fullshard: {e}", file=sys.stderr)
            _failed_at_exit = True


_failed_at_exit = False


def _exit_if_a_save_failed() -> None:
    """Registered when fullshard is imported, so it runs after the exit handlers registered since
    (the process groups' release among them): status 1 after a background save failed at exit, so
    that a scheduler does not take the run for a success. Handlers registered before fullshard's
    import are skipped but logging's, which is flushed here."""
    if _failed_at_exit:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


atexit.register(_exit_if_a_save_failed)


# ---- staging copies -----------------------------------------------------------------------------


class Staged:
    """Copies to host buffers in flight (by key); `wait` is the writer's, before it reads them."""

    def __init__(self, buffers: dict[str, torch.Tensor], event: object, device: torch.device) -> None:
        self.buffers, self.event, self.device, self.rt = buffers, event, device, runtime.active

    def wait(self, timeout: timedelta, what: str) -> None:
        if self.device.type == "cuda":  # a new thread's current GPU is 0: polling the event there makes a context
            torch.cuda.set_device(self.device)
        self.rt.sync_event(self.event, timeout=timeout, what=what)
        self.rt.host_reads(*self.buffers.values())


class Staging:
    """A model's host buffers, one per saved value, reused from save to save."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, values: dict[str, torch.Tensor]) -> Staged:
        """Start copying `values` (this rank's tensors, by key) into host buffers."""
        rt = runtime.active
        out: dict[str, torch.Tensor] = {}
        devices = {value.device for value in values.values()}
        device = next((d for d in devices if d.type == "cuda"), torch.device("cpu"))
        stream = rt.side_stream(device, "stage")
        compute = rt.current_stream(device)
        rt.wait_stream(stream, compute)  # after the step that wrote them
        with rt.use(stream):
            for key, value in values.items():
                buffer = self.buffers.get(key)
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = self.buffers[key] = rt.host_buffer(value.shape, value.dtype, pin=value.device.type == "cuda")
                rt.copy_(buffer, value.detach())
                out[key] = buffer
        event = rt.record_event(stream)
        runtime.before_next_step(device, stream)  # the next optimizer step writes them only after they are copied
        for key in set(self.buffers) - set(values):  # a value no longer saved
            del self.buffers[key]
        return Staged(out, event, device)

    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


_staging: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Staging


def staging_of(model: torch.nn.Module) -> Staging:
    if model not in _staging:
        _staging[model] = Staging()
    return _staging[model]
