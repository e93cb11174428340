"""A pool of gloo ranks on 127.0.0.1 that stays alive across test cases.

Spawning a rank costs a torch import (seconds on 2 cores), a job costs about a
millisecond, so each world is started once per session and fed jobs: module-level
functions called with keyword arguments on every rank, whose return values come back
as a list indexed by rank. Every collective has a timeout, so a rank stuck in a
collective fails instead of hanging; after any failure the pool is replaced, since the
other ranks may still be blocked in the collective the failed one never joined.

Note [forked ranks]: a world started with `forked=True` forks its ranks from one
server process that has imported torch, fullshard and the Hugging Face models once
for the session, so a new world costs a fork, not seconds of imports per rank. The
server only imports (no torch.cuda call), so its ranks may still use GPUs; but they
inherit its memory and environment, so a test that measures a new process's memory,
or sets environment variables for the ranks to read at start, uses a spawned world
(the default).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import queue
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

import fullshard

# generous: on 2 cores shared with other work a rank can wait tens of seconds for a
# descheduled peer; a collective that never completes still fails within the minute
COLLECTIVE_TIMEOUT_S = 60
# a job takes seconds, the longest about a minute on 2 cores shared with other work;
# one still running after this is hung
JOB_TIMEOUT_S = 300
# imported once by the server that forks the ranks of forked worlds (Note [forked ranks]):
# the library by the module of each public name (`import fullshard` alone loads none of
# them), and fullshard.ft where torchft, fullshard[ft]'s, is installed; torch._dynamo is
# imported lazily by the first DTensor a job builds, and costs a second; a job's test file is
# imported by each new rank that runs it, pytest and the tests' helpers with it (half a
# second a rank)
FORK_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", *sorted(set(fullshard.HOME.values())),
                *(["fullshard.ft"] if importlib.util.find_spec("torchft") else []),
                "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
                "pytest", "tests.models", "tests.reference", "tests.test_errors"]


def child_pythonpath() -> str:
    """PYTHONPATH for a child process: the repository (the tests package) and its src/ (fullshard,
    installed or not) before whatever the caller had."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(p for p in (root, os.path.join(root, "src"), os.environ.get("PYTHONPATH")) if p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, size: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size),
        "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
    }


def loopback_store(rank: int, size: int, port: int):
    """The world's TCPStore, rank 0 serving it on 127.0.0.1 alone (torch's own listens on every
    interface): a socket bound here, handed to the store."""
    import torch.distributed as dist

    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    return dist.TCPStore("127.0.0.1", port, size, True, timeout=timeout, master_listen_fd=listener.detach())


def serve(rank: int, size: int, port: int, jobs: mp.Queue, results: mp.Queue, log: str, timeout_s: float) -> None:
    """A rank's life: join the gloo group, then run jobs until told to stop. What it writes to
    stderr (a C++ abort's last words, a fatal signal's Python stacks) goes to `log`, which the
    test reads when the rank dies."""
    stderr = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(stderr, 2)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)  # a hung rank's stacks, when the test gives up on it
    os.environ.update(rank_env(rank, size, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # the groups a DeviceMesh makes (new_group without a timeout) take torch's default, 30 minutes;
    # a DTensor collective of a test's own (full_tensor) on them must fail within the minute too
    dist.distributed_c10d.default_pg_timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=loopback_store(rank, size, port), rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    while (job := jobs.get()) is not None:
        fn, kwargs = job
        try:
            results.put((rank, True, fn(**kwargs)))
        except BaseException:  # the job's failure is the test's result, not the rank's end
            results.put((rank, False, traceback.format_exc()))
    dist.barrier()
    dist.destroy_process_group()


STACKS = "most recent call first"  # faulthandler's line before each thread's stack
FENCE = 0x6E6F6E65  # a job's after-check: a number no job's collective sends


def fence(job: int) -> bool:
    """After a job every rank answered: one small all-gather on the default group. A rank that
    left a collective there unmatched (a job that raised on one rank and was caught on another)
    pairs it with this one's rows, which then differ, or waits: the job that left the world
    unusable is named, rather than the next job failing in gloo (or gloo aborting a rank)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([FENCE, job], dtype=torch.int64)
    everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(t.tolist() == [FENCE, job] for t in everyone)


def extra_groups() -> int:
    """A job: how many process groups this rank holds besides the default one."""
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map) - 1


class World:
    """`size` ranks that run jobs; `run(fn, **kwargs)` returns each rank's return value.
    `forked`: fork the ranks from a server that has imported torch (Note [forked ranks]);
    `job_timeout_s`: when a rank that has not answered is taken as hung; `collective_timeout_s`: of
    the ranks' process groups."""

    def __init__(self, size: int, forked: bool = False, job_timeout_s: float = JOB_TIMEOUT_S,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.size = size
        self.forked = forked
        self.job_timeout_s, self.collective_timeout_s = job_timeout_s, collective_timeout_s
        self.jobs_run = 0
        self.procs: list[mp.Process] = []
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("forkserver" if self.forked else "spawn")
        if self.forked:
            ctx.set_forkserver_preload(FORK_PRELOAD)  # read once, when the first forked world starts the server
        port = free_port()
        self.jobs = [ctx.Queue() for _ in range(self.size)]
        self.results = ctx.Queue()
        self.logs = tempfile.TemporaryDirectory(prefix="world-")
        self.procs = [ctx.Process(target=serve, args=(rank, self.size, port, self.jobs[rank], self.results,
                                                      self.log_path(rank), self.collective_timeout_s), daemon=True)
                      for rank in range(self.size)]
        for proc in self.procs:
            proc.start()

    def submit(self, fn: Callable[..., Any], **kwargs: Any) -> None:
        """Start `fn(**kwargs)` on every rank without waiting for it (`run` waits)."""
        for jobs in self.jobs:
            jobs.put((fn, kwargs))

    def run(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        results = self.collect(fn, **kwargs)
        self.jobs_run += 1
        left = f"{fn.__name__} left a collective unmatched on the default group: the ranks' check after it"
        try:
            fenced = self.collect(fence, job=self.jobs_run)
        except AssertionError as e:
            raise AssertionError(f"{left} failed: {e}") from None
        if not all(fenced):
            self.restart()
            raise AssertionError(f"{left} received other rows")
        return results

    def run_unmatched(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """`run` for a job that leaves a collective unmatched by design (what a rank whose peer
        skipped one is told): no check after it; the world starts afresh."""
        try:
            return self.collect(fn, **kwargs)
        finally:
            self.restart()

    def collect(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """Run `fn` on every rank; each rank's return value, or an AssertionError with each failure."""
        self.submit(fn, **kwargs)
        return self.answers(fn)

    def answers(self, fn: Callable[..., Any]) -> list[Any]:
        """Each rank's return value of the `fn` submitted, or an AssertionError with each failure."""
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + self.job_timeout_s
        while len(got) < self.size:
            failed = any(not ok for ok, _ in got.values())
            # once a rank failed, the others get one collective timeout to report
            wait = min(deadline, time.monotonic() + self.collective_timeout_s + 5) if failed else deadline
            try:
                rank, ok, value = self.results.get(timeout=max(0.1, min(1.0, wait - time.monotonic())))
                got[rank] = (ok, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
                if dead and not self.results.empty():  # what it sent just before it ended comes first
                    continue
                if dead or time.monotonic() > wait:
                    missing = sorted(set(range(self.size)) - set(got))
                    ends = self.ends(missing)
                    self.restart()
                    raise AssertionError(f"{fn.__name__}: ranks {missing} did not answer "
                                         f"(dead: {dead}); reports: {self.report(got)}{ends}")
        if any(not ok for ok, _ in got.values()):
            self.restart()
            raise AssertionError(f"{fn.__name__} failed:\n{self.report(got)}")
        return [got[rank][1] for rank in range(self.size)]

    @staticmethod
    def report(got: dict[int, tuple[bool, Any]]) -> str:
        return "\n".join(f"--- rank {r}:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok)

    def ends(self, ranks: list[int]) -> str:
        """Where each of `ranks` (that did not answer) is: dead, with its exit code or signal, or
        stuck, with its Python stacks; and the end of its stderr."""
        stuck = [r for r in ranks if self.procs[r].is_alive()]
        dumps = {r: self.log(r).count(STACKS) for r in stuck}
        for rank in stuck:
            os.kill(self.procs[rank].pid, signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while any(self.log(r).count(STACKS) == n for r, n in dumps.items()) and time.monotonic() < deadline:
            time.sleep(0.02)  # the rank's signal handler writes its stacks to its log
        said = []
        for rank in ranks:
            code = self.procs[rank].exitcode
            how = ("stuck (its stacks are below)" if code is None else
                   f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
            last = self.log(rank)[-3000:] if os.path.exists(self.log_path(rank)) else "(nothing: it never started)"
            said.append(f"\n--- rank {rank}: {how}; its stderr ends:\n{last}")
        return "".join(said)

    def log_path(self, rank: int) -> str:
        return os.path.join(self.logs.name, f"rank{rank}.log")

    def log(self, rank: int) -> str:
        """What `rank` has written to its stderr so far."""
        path = self.log_path(rank)
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    def restart(self) -> None:
        self.kill()
        self.start()

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        self.logs.cleanup()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for jobs in self.jobs:
            jobs.put(None)
        for proc in self.procs:
            proc.join(timeout=self.collective_timeout_s)
        self.kill()
