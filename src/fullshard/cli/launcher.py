"""Starting, watching and stopping the ranks of `fullshard train` on one machine, and the
lock that keeps a second run out of a run directory.

Note [local launch]: without torchrun the command is its own launcher. Its ranks meet
in a FileStore: a file in a fresh directory only this user can enter (mode 0700, made
by mkdtemp), a new file for each attempt, so no other local user can read the job's
keys or write into them (torch's TCPStore takes any local connection: a garbage key
there broke a restart), and nothing of a local run listens on a port for it (but with
--fault-tolerant: Note [replica groups]); gloo
binds to the loopback interface. The launcher starts one process per rank, each in a
session of its own (a Ctrl-C reaches the launcher alone, which then ends the ranks),
restarts them all when one fails, as often as --max-restarts allows (they resume from
the newest checkpoint), and ends them when it is stopped or killed (Note [orphans]).

Note [rendezvous directory]: the directory never outlives its run. The launcher removes it
when it ends; a small remover process it starts removes it when the launcher is killed (it
waits for the end of a pipe only the launcher holds, which the kernel closes however the
launcher ends, SIGKILL included). Run directories live in one parent of this user's,
$TMPDIR/fullshard-rendezvous-<uid> (mode 0700, checked to be this user's own directory),
named by the launcher's pid and start time, and each run removes the entries of launchers
that are gone (both processes killed at once). A parent that is not this user's own
directory is never used or entered: the run then makes its directory beside it.

Note [replica groups]: with --fault-tolerant the launcher hosts torchft's lighthouse on
--ft-bind and starts --replicas groups of ranks, each a job of its own (its FileStore, its
process group); fullshard.ft's Manager runs the all-reduce across them. torchft needs its
listeners (the lighthouse, each group's TCPStore and Manager server, gloo across groups), all
on --ft-bind, where a local user can stop or stall the run, never run code in it (nothing
that arrives is unpickled: docs/fault-tolerance.md). A group whose rank
dies is ended and started again while another group is alive: it heals from a live group and
rejoins (docs/fault-tolerance.md; Note [rejoining first] in replica.py). When no other group is alive, that counts against
--max-restarts, and the restarted groups resume from their own checkpoints. Only a rank killed
by a signal (SIGKILL, the OOM killer, a crash in native code) is restarted: one that exits
with 2 or 3 said why (a bad argument, a refused heal), one that exits with 1 raised an
exception, and a restart would do the same again: the run ends with it. Groups in step finish
together (Note [late groups]).

Note [late groups]: a group restarted while another was alive heals from it before it trains
(Note [rejoining first] in replica.py); its ranks then create <their store file>.healed, in the
run's own directory (as they do when they stop waiting and go on alone). Once one group has
finished --steps, a restarted group without that file never will heal (there is no step left
to heal into): it is ended at once, with a line saying so, and the run ends well. A group that
healed finishes the last step with the others; one still running LATE_GROUP_S after another
finished is ended all the same.

Note [exit status]: 0 when every rank ended well; a rank's own status when it failed
with one (2: bad arguments, 3: a FullShardError while training; the rank printed the
one-line error); 128 + N when the launcher was stopped by signal N (130 for SIGINT, 143
for SIGTERM, 129 for SIGHUP); 1 when a rank crashed or was killed, with a line naming it.

Note [orphans]: a rank must not outlive its launcher: an orphan keeps training, writes
metrics and deletes checkpoint versions under a rerun of the same command. On Linux each
rank asks the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG) and then
checks that the parent is still the launcher (it may have died before the request);
elsewhere a thread polls the parent's pid.

Note [one run per directory]: two live runs in one --out would interleave metrics.jsonl
and delete each other's checkpoint versions. The launcher (under torchrun: rank 0)
holds an exclusive flock on <out>/.lock for its life; the kernel drops it when the
process ends, however it ends, so a killed run leaves no stale lock. The file names its
holder (pid, host, start time) for the error of a second run.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

from fullshard.errors import FullShardError
from fullshard.checkpoint.files import Folder

LAUNCHER_PID = "FULLSHARD_LAUNCHER_PID"  # set for the ranks: whom they must die with
STORE_FILE = "FULLSHARD_STORE_FILE"  # set for the ranks: the FileStore they meet in (Note [local launch])
REPLICA = "FULLSHARD_REPLICA"  # set for a replica group's ranks: the group's index (Note [replica groups])
REJOINING = "FULLSHARD_REJOINING"  # set for a group restarted while another is alive: it heals before it trains
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
END_GRACE_S = 10  # a rank told to end (SIGTERM) that is still there after this is killed
LATE_GROUP_S = 5  # a healed replica group not done this long after another finished --steps is ended
HEALED = ".healed"  # after a rejoining group's store file: it healed (Note [late groups])
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launch(command: list[str], nproc: int, max_restarts: int) -> int:
    """Run `command` as ranks 0..nproc-1 of one job on this machine (Note [local launch]);
    its exit status (Note [exit status])."""
    rendezvous = rendezvous_dir()
    remover = start_remover(rendezvous)
    stops: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stops.append(signum)) for sig in STOP_SIGNALS}
    try:
        for attempt in range(max_restarts + 1):
            ranks: list[subprocess.Popen] = []
            try:
                for rank in range(nproc):
                    store = os.path.join(rendezvous, f"attempt-{attempt}")
                    ranks.append(subprocess.Popen(command, env=rank_env(rank, nproc, store, attempt),
                                                  start_new_session=True))
                failed = wait_for_ranks(ranks, stops)
            finally:
                end(ranks)
            if stops:
                print(f"fullshard: stopped by {signal.Signals(stops[0]).name}; the same command resumes from the "
                      f"newest checkpoint", file=sys.stderr, flush=True)
                return 128 + stops[0]
            if failed is None:
                return 0
            if attempt < max_restarts:
                print(f"fullshard: {failure(*failed)}; restarting every rank (restart {attempt + 1} of "
                      f"{max_restarts})", file=sys.stderr, flush=True)
        rank, status = failed
        if status in (2, 3):  # the rank said why in one line
            return status
        print(f"fullshard: error: {failure(rank, status)}; its output is above", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(rendezvous, ignore_errors=True)
        os.close(remover)  # the remover finds nothing left, and ends


def launch_replicas(command: list[str], nproc: int, replicas: int, bind: str, max_restarts: int) -> int:
    """Note [replica groups]: run `command` as `replicas` groups of nproc/replicas ranks around a
    lighthouse on `bind`; its exit status (Note [exit status])."""
    from fullshard.ft import Lighthouse, replica_env

    lighthouse = Lighthouse(bind, min_replicas=1)
    size = nproc // replicas
    rendezvous = rendezvous_dir()
    remover = start_remover(rendezvous)
    stops: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stops.append(signum)) for sig in STOP_SIGNALS}

    unhealed: dict[int, str] = {}  # a rejoining group's healed file, until it is there (Note [late groups])

    def start(group: int, attempt: int, rejoining: bool = False) -> list[subprocess.Popen]:
        store = os.path.join(rendezvous, f"replica-{group}-attempt-{attempt}")
        env = {**replica_env(bind), REPLICA: str(group), REJOINING: "1" if rejoining else "0",
               "TORCHFT_LIGHTHOUSE": lighthouse.address()}
        unhealed.pop(group, None)
        if rejoining:
            unhealed[group] = store + HEALED
        return [subprocess.Popen(command, env={**rank_env(rank, size, store, attempt), **env}, start_new_session=True)
                for rank in range(size)]

    attempts = [0] * replicas
    groups = [start(group, 0) for group in range(replicas)]
    whole_restarts, finished_at = 0, None
    try:
        while not stops:
            statuses = [[rank.poll() for rank in ranks] for ranks in groups]
            if all(status == 0 for group in statuses for status in group):
                return 0
            if finished_at is None and any(all(s == 0 for s in group) for group in statuses):
                finished_at = time.monotonic()
            if finished_at is not None:  # Note [late groups]
                for group, healed in list(unhealed.items()):
                    if os.path.exists(healed):
                        del unhealed[group]
                running = [group for group, each in enumerate(statuses) if any(s is None for s in each)]
                late = time.monotonic() > finished_at + LATE_GROUP_S
                if running and (late or all(group in unhealed for group in running)):
                    for group in running:
                        why = "was restarted too late to heal: another group finished --steps first" \
                            if group in unhealed else f"was not done {LATE_GROUP_S} s after another finished --steps"
                        print(f"fullshard: replica group {group} {why}; ending it", file=sys.stderr, flush=True)
                    return 0  # the run is done without them (finally: ended)
            for group, ranks in enumerate(groups):
                ended = [(k, s) for k, s in enumerate(statuses[group]) if s not in (None, 0)]
                if not ended:
                    continue
                killed = [(k, s) for k, s in ended if s < 0]  # a killed rank fails its peers (3)
                if not killed:  # it said why (2, 3) or crashed (1): a restart would do it again
                    if ended[0][1] not in (2, 3):
                        print(f"fullshard: error: replica group {group}: {failure(*ended[0])}; its output is above",
                              file=sys.stderr, flush=True)
                    return ended[0][1] if ended[0][1] in (2, 3) else 1
                failed = killed[0]
                end(ranks)
                alive = any(s is None for other, each in enumerate(statuses) if other != group for s in each)
                if not alive:
                    if whole_restarts >= max_restarts:
                        print(f"fullshard: error: replica group {group}: {failure(*failed)}, and no other group is "
                              f"alive to go on; its output is above", file=sys.stderr, flush=True)
                        return 1
                    whole_restarts += 1
                attempts[group] += 1
                print(f"fullshard: replica group {group}: {failure(*failed)}; restarting it (it heals from a live "
                      f"group, or resumes from its checkpoint)", file=sys.stderr, flush=True)
                groups[group] = start(group, attempts[group], rejoining=alive)
            time.sleep(0.05)
        print(f"fullshard: stopped by {signal.Signals(stops[0]).name}; the same command resumes from the newest "
              f"checkpoint", file=sys.stderr, flush=True)
        return 128 + stops[0]
    finally:
        for ranks in groups:
            end(ranks)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(rendezvous, ignore_errors=True)
        os.close(remover)


# what the remover runs: wait for the launcher's end of the pipe to close, then remove the directory
REMOVER = "import shutil, sys; sys.stdin.buffer.read(); shutil.rmtree(sys.argv[1], ignore_errors=True)"


def start_remover(path: str) -> int:
    """Note [rendezvous directory]: a process that removes `path` once the launcher is gone;
    returns the pipe's end to keep open (non-inheritable: the ranks do not hold it)."""
    read, write = os.pipe()
    try:
        subprocess.Popen([sys.executable, "-c", REMOVER, path], stdin=read, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    finally:
        os.close(read)
    return write


def rendezvous_dir() -> str:
    """A new directory, mode 0700, for this run's FileStore (Note [rendezvous directory])."""
    parent = Path(tempfile.gettempdir()) / f"fullshard-rendezvous-{os.getuid()}"
    try:
        os.mkdir(parent, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return tempfile.mkdtemp(prefix="fullshard-rendezvous-")
    info = os.lstat(parent)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return tempfile.mkdtemp(prefix="fullshard-rendezvous-")  # not ours: never entered
    for entry in os.listdir(parent):
        pid, _, started = entry.partition("-")
        started = started.rpartition("-")[0]
        if pid.isdigit() and started and started != process_start(int(pid)):  # its launcher is gone
            shutil.rmtree(parent / entry, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{os.getpid()}-{process_start(os.getpid())}-", dir=parent)


def process_start(pid: int) -> str:
    """When process `pid` started (its start time in clock ticks since boot, on Linux), or "gone";
    with its pid this names one process, whatever later process reuses the pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass
    return "alive"


def report_healed() -> None:
    """In a rank of a rejoining group, once it healed: tell the launcher (Note [late groups])."""
    os.close(os.open(os.environ[STORE_FILE] + HEALED, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))


def rank_env(rank: int, nproc: int, store: str, attempt: int) -> dict[str, str]:
    """A rank's environment: torchrun's rank variables, the attempt's store file (Note [local
    launch]); gloo on the loopback interface and the cores shared out, unless the user says otherwise."""
    defaults = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    return {**defaults, **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": str(attempt), STORE_FILE: store,
            LAUNCHER_PID: str(os.getpid())}


def wait_for_ranks(ranks: list[subprocess.Popen], stops: list[int]) -> tuple[int, int] | None:
    """Wait until every rank ended well (None), one failed ((rank, status)), or a stop signal came."""
    while not stops:
        statuses = [rank.poll() for rank in ranks]
        for rank, status in enumerate(statuses):
            if status not in (None, 0):
                return rank, status
        if all(status == 0 for status in statuses):
            return None
        time.sleep(0.05)
    return None


def end(ranks: list[subprocess.Popen]) -> None:
    """End the ranks still running and whatever they started: SIGTERM, then SIGKILL after END_GRACE_S."""
    for rank in ranks:
        signal_session(rank, signal.SIGTERM)
    deadline = time.monotonic() + END_GRACE_S
    for rank in ranks:
        try:
            rank.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_session(rank, signal.SIGKILL)
            rank.wait()


def signal_session(rank: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process group a rank leads (its own session: start_new_session)."""
    try:
        os.killpg(rank.pid, sig)
    except ProcessLookupError:  # the rank and all it started have ended
        pass


def failure(rank: int, status: int) -> str:
    if status < 0:
        return f"rank {rank} was killed by {signal.Signals(-status).name}"
    return f"rank {rank} exited with status {status}"


def die_with_launcher() -> None:
    """Note [orphans]: end this rank (SIGKILL) when its parent process ends."""
    parent = int(os.environ.get(LAUNCHER_PID, os.getppid()))
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=watch_parent, args=(parent,), daemon=True, name="fullshard-parent-watch").start()
    if os.getppid() != parent:  # the launcher ended before the request
        os.kill(os.getpid(), signal.SIGKILL)


def watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def hold_run_dir(out: Path) -> TextIO:
    """Create the run directory `out` and lock it for this process's life (Note [one run per
    directory]): the returned file holds the lock. Raises FullShardError naming the run that
    holds it, or saying why `out` cannot be a run directory (a .lock that is a link or not a
    regular file is refused, never followed: Note [confined files])."""
    try:
        if out.exists() and not out.is_dir():
            raise FullShardError(f"--out {out} is a file. Pass a directory (it is created if missing)")
        with Folder.open(out, create=True) as folder:
            lock = os.fdopen(folder.open_regular(".lock", os.O_RDWR | os.O_CREAT), "r+")
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        why = f"{e.strerror}: {e.filename}" if getattr(e, "strerror", None) else str(e)
        raise FullShardError(f"--out {str(out)[:200]} cannot hold a run ({why[:300]}; a .lock there must be a regular "
                             f"file, not a link). Pass a directory you can write to") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read(500).strip() or "a process that is starting"
        lock.close()
        raise FullShardError(f"--out {out} is in use by another run ({holder}). Wait for it to end, stop it, or pass "
                             f"another --out") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    return lock
