"""Replica groups on torchft for the fault-tolerance tests: each rank a process forked from the
test's forkserver (Note [forked ranks] in world.py), its group's gloo group and TCPStore on the
bind address, torchft's Manager across groups, the lighthouse in the test process.

A rank trains a tiny GPT until `steps` steps have committed and reports, per iteration: the
step it started at, whether it committed, the participants, the loss and a digest of its
parameter shards after it. The batch of a step is a function of the committed step and the
replica group's place in the quorum, so a replay knows every replica group's batch. A rank
can be told to SIGKILL itself at a step, in a given place of it.
"""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from tests.world import FORK_PRELOAD, free_port

TIMEOUT_S = 10  # torchft's timeout for collectives and RPCs: a dead peer is noticed by its socket closing, at once
BATCH = 4  # per replica group
QUIET = {"RUST_LOG": os.environ.get("FULLSHARD_TEST_RUST_LOG", "warn")}  # torchft's servers log every quorum and commit at INFO


def batch_of(step: int, replica_rank: int, group_rank: int, group_size: int, seq: int | None = None):
    """The batch slice of one rank: the committed step's, for the replica group's place in the quorum
    (`seq`: tokens per sequence, for a model of another block size than the tiny GPT's)."""
    import torch

    from tests.models import VOCAB, token_batch
    generator = torch.Generator().manual_seed(1000 * step + replica_rank)
    if seq is None:
        x, y = token_batch(generator, BATCH)
    else:
        x = torch.randint(0, VOCAB, (BATCH, seq), generator=generator)
        y = torch.roll(x, -1, dims=1)
    rows = BATCH // group_size
    return x[group_rank * rows:(group_rank + 1) * rows], y[group_rank * rows:(group_rank + 1) * rows]


def digest(model, optimizer) -> str:
    """Every local shard's bytes and the optimizer state's, hashed (equal digests: bitwise equal)."""
    import torch
    from torch.distributed.tensor import DTensor
    h = hashlib.sha256()
    with torch.no_grad():
        for _, p in model.named_parameters():
            tensors = [p, *(v for _, v in sorted(optimizer.state.get(p, {}).items()) if isinstance(v, torch.Tensor))]
            for t in tensors:
                local = t.to_local() if isinstance(t, DTensor) else t
                h.update(local.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def make_optimizer(name: str, model):
    import torch

    import fullshard
    if name == "muon":
        matrices, rest = fullshard.optim.muon_groups(model)
        return fullshard.optim.Muon([{"params": matrices}, {"params": rest, "use_muon": False, "lr": 1e-2}], lr=0.02)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def build_model(cfg: dict[str, Any]):
    """The tiny GPT; one of another width ("other_model"), or of a fullshard.gpt preset ("preset", "seq")."""
    from fullshard.gpt import GPT, PRESETS, GPTConfig
    from tests.models import SEQ, VOCAB, tiny_gpt
    if cfg.get("preset"):
        return GPT(GPTConfig(block_size=cfg["seq"], vocab_size=VOCAB, **PRESETS[cfg["preset"]]))
    if cfg.get("other_model"):
        return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32))
    return tiny_gpt()


def shard(model, kind: str):
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import fully_shard
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    return model


def listening(pid: int) -> list[str]:
    """The listening TCP sockets of process `pid` (from /proc: its socket inodes, the kernel's tables)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)
                    if width == 8:
                        host = socket.inet_ntop(socket.AF_INET, raw[::-1])
                    else:  # four little-endian 32-bit words
                        host = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                    found.append(f"{host}:{int(port, 16)}")
    return found


def kill_here(cfg: dict[str, Any]) -> None:
    cfg["killed_at"].value = time.time()
    os.kill(os.getpid(), signal.SIGKILL)


def rank_main(cfg: dict[str, Any], reports: mp.Queue) -> None:
    """One rank of one replica group (run in a forked process)."""
    os.environ.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **QUIET})
    import torch
    import torch.distributed as dist
    from torchft.optim import OptimizerWrapper

    import fullshard
    from fullshard import ft

    torch.set_num_threads(1)
    timeout = timedelta(seconds=TIMEOUT_S)
    rank, size, bind = cfg["group_rank"], cfg["group_size"], cfg["bind"]
    store = ft.replica_store(bind, cfg["store_port"], is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("group", store), rank=rank, world_size=size,
                            timeout=timeout)
    torch.manual_seed(0)
    model = shard(build_model(cfg), cfg["kind"])
    optimizer = make_optimizer(cfg.get("optimizer", "adamw"), model)
    transport = None
    if cfg["kind"] == "fsdp2":  # torch's FSDP2 with torchft, as torchft's own examples run it
        from torchft.checkpointing.pg_transport import PGTransport
        pg = ft.ProcessGroupGloo(bind, timeout)
        transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
    manager = ft.Manager(bind=bind, pg=pg if transport else None, checkpoint_transport=transport,
                         replica_id=f"replica_{cfg['replica']}", lighthouse_addr=cfg["lighthouse"], rank=rank,
                         world_size=size, store_addr=bind, store_port=store.port, timeout=timeout,
                         quorum_timeout=timedelta(seconds=cfg.get("quorum_timeout_s", TIMEOUT_S)),
                         connect_timeout=timeout, init_sync=False, min_replica_size=cfg.get("min_replica_size", 1),
                         max_retries=cfg.get("max_retries", 10),
                         heartbeat_interval=timedelta(milliseconds=100))
    if cfg["kind"] == "fsdp2":
        from torch.distributed.fsdp import FSDPModule
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(lambda row: manager.allreduce(row).wait())
        manager.register_state_dict_fn("model", lambda sd: None, lambda: {})
    else:
        model.set_nonfinite_grads("raise")  # a step that cannot commit must not trip it (Note [uncommitted steps])
        ft.attach(manager, model, optimizer)
    wrapped = OptimizerWrapper(manager, optimizer)
    saved = cfg.get("checkpoint") and f"{cfg['checkpoint']}/replica_{cfg['replica']}"
    if saved and os.path.exists(saved):  # a restart resumes from its group's last checkpoint, then heals if behind
        info = fullshard.load(saved, model, optimizer)
        manager.load_state_dict({"step": info["step"], "batches_committed": info["extra"]["batches_committed"]})
        reports.put(("resumed", cfg["replica"], rank, {"step": info["step"], "digest": digest(model, optimizer)}))
    kill = cfg.get("kill")  # {"where": "forward" | "backward" | "allreduce" | "optimizer"[, "at": step]}
    first: list[int] = []  # the step this rank ran first (a joiner's is the step it healed to)

    def armed(where: str) -> bool:
        return kill is not None and kill["where"] == where and manager.current_step() == kill.get("at", first[0] + 2)

    model.h[1].register_forward_pre_hook(lambda *_: kill_here(cfg) if armed("forward") else None)
    model.h[0].register_full_backward_pre_hook(lambda *_: kill_here(cfg) if armed("backward") else None)
    step_optimizer = optimizer.step
    optimizer.step = lambda *a, **k: kill_here(cfg) if armed("optimizer") else step_optimizer(*a, **k)
    spent = {"quorum_s": 0.0, "reduce_s": 0.0, "commit_s": 0.0}  # this step's seconds in torchft's parts
    reduce, commit = manager.allreduce, manager.should_commit

    def timed(key: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start

    class TimedWork:  # the hook waits on what manager.allreduce returns
        def __init__(self, work) -> None:
            self.work = work

        def wait(self, *args):
            return timed("reduce_s", self.work.wait, *args)

    manager.allreduce = lambda row, *a, **k: kill_here(cfg) if armed("allreduce") else TimedWork(
        timed("reduce_s", reduce, row, *a, **k))
    manager.should_commit = lambda *a, **k: timed("commit_s", commit, *a, **k)
    rows = []
    saving = None
    try:
        for _ in range(cfg["iterations"]):
            if manager.current_step() >= min(cfg["steps"], cfg["stop"].value):
                break
            spent.update(dict.fromkeys(spent, 0.0))
            timed("quorum_s", wrapped.zero_grad)
            timed("quorum_s", manager.wait_quorum)
            start = manager.current_step()
            first = first or [start]
            x, y = batch_of(start, manager.participating_rank() or 0, rank, size, cfg.get("seq"))
            loss = model(x, y)
            loss.backward()
            norm = fullshard.clip_grad_norm_(model, 1.0) if cfg["clip"] else None
            wrapped.step()
            rows.append({"step": start, "committed": manager.current_step() > start, "t": time.time(), **spent,
                         "participants": manager.num_participants(), "replica_rank": manager.participating_rank(),
                         "loss": loss.item(), "norm": None if norm is None else norm.item(),
                         "digest": digest(model, optimizer) if cfg.get("digests", True) else None})
            reports.put(("row", cfg["replica"], rank, rows[-1]))
            if saved and rows[-1]["committed"]:  # every committed step, in the background
                saving = fullshard.save(saved, model, optimizer, step=manager.current_step(),
                                        extra={"batches_committed": manager.batches_committed()}, block=False)
    except fullshard.FullShardError as e:  # the test reads what a refusing or failing rank said
        reports.put(("error", cfg["replica"], rank, str(e)))
        raise
    if saving is not None:
        saving.result()  # the last committed step is on disk before the rank says it is done
    reports.put(("done", cfg["replica"], rank, None))
    deadline = time.monotonic() + 60
    while not cfg["release"].value and time.monotonic() < deadline:  # listening until the test has looked
        time.sleep(0.05)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def lighthouse_main(bind: str, min_replicas: int, address: mp.Queue) -> None:
    """The lighthouse, in a process of its own (a test kills it: torchft's shutdown() keeps listening)."""
    os.environ.update(QUIET)
    from fullshard import ft
    lighthouse = ft.Lighthouse(bind, min_replicas=min_replicas, join_timeout_ms=200, heartbeat_timeout_ms=1000)
    address.put(lighthouse.address())
    signal.pause()


class Replicas:
    """Replica groups of `group_size` ranks each, on `bind`, around a lighthouse in this process."""

    def __init__(self, kind: str = "fullshard", replicas: int = 2, group_size: int = 1, steps: int = 8,
                 bind: str = "127.0.0.1", min_replicas: int = 1, **options: Any) -> None:
        """`options`: "optimizer" ("adamw" or "muon"), "clip" (clip_grad_norm_ to 1 each step),
        "checkpoint" (a directory: each group saves there after every committed step, in the
        background, and a started group resumes from its last save), "quorum_timeout_s",
        "min_replica_size" and "max_retries" (the Manager's), "preset" and "seq" (build_model),
        "binds" ({replica: address}: a group's own, as a host of its own would have; else `bind`),
        "digests" (False: rows without the digest of every shard, whose hashing a benchmark would time)."""
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORK_PRELOAD)
        self.ctx, self.kind, self.group_size, self.steps, self.bind = ctx, kind, group_size, steps, bind
        self.target = options.pop("target", rank_main)  # tests/diloco_replicas.py's diloco_rank for DiLoCo
        self.options = {"optimizer": "adamw", "clip": False, **options}
        address = ctx.Queue()
        self.lighthouse = ctx.Process(target=lighthouse_main, args=(bind, min_replicas, address), daemon=True)
        self.lighthouse.start()
        self.address = address.get(timeout=60)
        # Note [killed ranks]: a rank is SIGKILLed at any point, so nothing it shares may hold a lock
        # another process waits for: each rank reports on a queue of its own, and the flags are
        # lock-free shared ints (a multiprocessing Event's condition deadlocks its setter once a
        # waiter is killed)
        self.queues: list[mp.Queue] = []
        self.stop = ctx.Value("q", 2**62, lock=False)  # the committed step every rank ends at (stop_soon sets it)
        self.release = ctx.Value("b", 0, lock=False)  # 1: finished ranks exit
        self.killed_at = ctx.Value("d", 0.0, lock=False)  # time.time() of the last kill
        self.gate = ctx.Value("b", 0, lock=False)  # 1: a rank told to hold at a step goes on
        self.go = ctx.Value("b", 0, lock=False)  # 1: a DiLoCo rank takes its first step (after every group is ready)
        self.rows: dict[tuple[int, int], list] = {}
        self.finished: set[tuple[int, int]] = set()
        self.errors: dict[tuple[int, int], str] = {}
        self.resumed: dict[tuple[int, int], dict] = {}
        self.other: dict[str, dict[tuple[int, int], Any]] = {}  # any other report, by kind
        self.started_at: dict[int, float] = {}  # time.time() of each group's last start
        self.procs: dict[tuple[int, int], Any] = {}
        for replica in range(replicas):
            self.start(replica)

    def start(self, replica: int, kill: dict | None = None, kill_rank: int = 0, **only: Any) -> None:
        """Start (or restart) a replica group, `only` added to its ranks' options; its rows so far
        are kept under (replica, rank, n)."""
        for rank in range(self.group_size):
            if (replica, rank) in self.procs:  # a restart: the group's previous ranks are gone first
                self.procs[replica, rank].kill()
                self.procs[replica, rank].join(timeout=10)
            if (replica, rank) in self.rows:
                self.rows[replica, rank, len(self.rows)] = self.rows.pop((replica, rank))
            self.finished.discard((replica, rank))
        port = free_port()
        self.started_at[replica] = time.time()
        for rank in range(self.group_size):
            cfg = {"kind": self.kind, "replica": replica, "group_rank": rank, "group_size": self.group_size,
                   "bind": self.options.get("binds", {}).get(replica, self.bind), "store_port": port,
                   "lighthouse": self.address,
                   "steps": self.steps, "iterations": 4 * self.steps, "stop": self.stop, "release": self.release,
                   "killed_at": self.killed_at, "gate": self.gate, "go": self.go,
                   **self.options, **only,
                   "kill": kill if rank == kill_rank else None}
            self.queues.append(self.ctx.Queue())
            proc = self.ctx.Process(target=self.target, args=(cfg, self.queues[-1]), daemon=True)
            proc.start()
            self.procs[replica, rank] = proc

    def results(self, expected: set[tuple[int, int]], deadline_s: float = 90) -> dict[tuple[int, int], list]:
        """The rows of the ranks `expected` to finish, once they all have."""
        got: dict[tuple[int, int], list] = {}
        deadline = time.monotonic() + deadline_s
        while set(got) < expected:
            if not self.poll(0.5):
                dead = [key for key in expected - set(got) if not self.procs[key].is_alive()]
                # a dead rank's last reports may be unread yet: read them before calling it silent
                if dead and not self.poll(0) or time.monotonic() > deadline:
                    raise AssertionError(f"ranks {sorted(expected - set(got))} did not finish (dead: {dead})")
            got.update({key: self.rows[key] for key in self.finished if key in expected})
        return got

    def poll(self, wait_s: float) -> bool:
        """Take one report into `rows` (or `finished`); False if none came within `wait_s`."""
        deadline = time.monotonic() + wait_s
        while (report := self.next_report()) is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        kind, replica, rank, payload = report
        if kind == "row":
            self.rows.setdefault((replica, rank), []).append(payload)
        elif kind == "resumed":
            self.resumed[replica, rank] = payload
        elif kind == "error":
            self.errors[replica, rank] = payload
        elif kind == "done":
            self.finished.add((replica, rank))
        else:
            self.other.setdefault(kind, {})[replica, rank] = payload
        return True

    def next_report(self) -> tuple | None:
        for reports in self.queues:
            try:
                return reports.get_nowait()
            except queue.Empty:
                pass
        return None

    def wait_until(self, done, what: str, deadline_s: float = 60) -> None:
        """Take reports until `done()`, then every report already sent (a rank's last words are
        in its queue before it ends, but `done()` may see it ended first); fail naming `what`
        after `deadline_s`."""
        deadline = time.monotonic() + deadline_s
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {deadline_s} s; rows so far: "
                                     f"{ {k: len(v) for k, v in self.rows.items()} }")
            self.poll(0.2)
        while self.poll(0):
            pass

    def lose_and_heal(self, where: str) -> None:
        """Group 0 trains; group 1 joins, is SIGKILLed in its third step (`where`), is restarted,
        heals and commits 3 steps; then both end at one step."""
        self.start(0)
        self.wait_until(lambda: self.rows.get((0, 0)), "group 0's first step")
        self.start(1, kill={"where": where})
        self.wait_until(lambda: not self.procs[1, 0].is_alive(), f"group 1 dying in the {where}")
        self.start(1)
        self.wait_until(lambda: len([r for r in self.rows.get((1, 0), []) if r["committed"]]) >= 3,
                        "group 1 rejoining")
        self.stop_soon()
        self.results({(0, 0), (1, 0)})

    def stop_soon(self, after: int = 2) -> None:
        """Every rank ends once `after` more steps than the furthest have committed: all at the same step."""
        self.stop.value = max(row["step"] for rows in self.rows.values() for row in rows) + 1 + after

    def listeners(self) -> dict[str, list[str]]:
        """Every listening TCP socket of the lighthouse and of each live rank, as "address:port"."""
        procs = {"lighthouse": self.lighthouse, **{f"replica {r} rank {k}": p for (r, k), p in self.procs.items()
                                                  if p.is_alive()}}
        return {name: listening(proc.pid) for name, proc in procs.items()}

    def close(self) -> None:
        self.release.value = 1
        for proc in self.procs.values():
            proc.kill()
            proc.join(timeout=10)
        self.lighthouse.kill()
        self.lighthouse.join(timeout=10)
