"""The collectives outside a unit's gathers and reductions (those are its plans':
gather.py, reduce.py, routes.py): the all-gathers of integers and JSON that cross-rank
agreements use, broadcasts, barriers, the all-reduces of the gradient norm and of found_inf,
and DTensor's own collectives for tensor parallelism and state dicts. Each takes a timeout
and says what it is, so a rank that does not take part becomes a named error (Note [named
hangs]). Blocking: each waits for its collective before it returns."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from fullshard import runtime
from fullshard.errors import CollectiveError
from fullshard.options import DEFAULT_TIMEOUT
from fullshard.runtime import MismatchedCall, launched

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

@dataclass(frozen=True)
class Caller:
    """Who issues a collective: what to call it when it does not finish, and how long its waits may take."""

    what: str = "a collective"
    timeout: timedelta = DEFAULT_TIMEOUT


def wait_all(works: list, caller: Caller, *, on_device: bool) -> None:
    """The current stream waits for `works`; only on the CPU does the host wait (Note [host syncs])."""
    runtime.active.wait_works(works, timeout=caller.timeout, what=caller.what, on_device=on_device)


# the int64s of every all-gather of integers' frame: its call site, its length, then up to 6 values
FRAME = 8
SITES: dict[int, str] = {}  # the call sites of all_gather_ints, by code, for messages


def site(what: str) -> str:
    """Register a call site of all_gather_ints at import, so that every process can name it."""
    SITES[zlib.crc32(what.encode())] = what
    return what


INTEGERS, JSON_LENGTHS = site("an all-gather of integers"), site("the lengths of an all-gather of JSON")


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
    works = launched([_all_gather_single(out, row, group=group, async_op=True)], reads=[row], writes=[out])
    wait_all(works, caller, on_device=row.device.type == "cuda")
    return rt.read_on_host(out.view(-1, row.numel()), timeout=caller.timeout, what=caller.what)


def all_gather_json(obj: object, *, device: torch.device, timeout: timedelta,
                    group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's `obj` (JSON-serializable), rank by rank, as JSON: nothing another process
    sends is unpickled. An all-gather of the lengths, then one of the bytes."""
    mine = json.dumps(obj).encode()
    longest = max(n for (n,) in all_gather_ints([len(mine)], device=device, timeout=timeout, group=group,
                                                 what=JSON_LENGTHS))
    sent = torch.zeros(longest, dtype=torch.uint8, device=device)  # [longest]
    sent[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else sent[:0]
    out = torch.empty(dist.get_world_size(group) * longest, dtype=torch.uint8, device=device)  # [world * longest]
    works = launched([_all_gather_single(out, sent, group=group, async_op=True)], reads=[sent], writes=[out])
    wait_all(works, Caller("an all-gather of JSON", timeout), on_device=device.type == "cuda")
    rows = out.view(-1, longest).cpu()
    return [json.loads(bytes(row.numpy().tobytes()).rstrip(b"\0")) for row in rows]


def all_reduce_(tensor: torch.Tensor, op: str, *, timeout: timedelta, what: str,
                group: dist.ProcessGroup | None = None) -> None:
    """Reduce `tensor` in place over every rank of `group` (default: all): op "sum" or "max". It
    must be in the memory of the process group's device (a GPU's for NCCL, never pinned host
    memory). Raises CollectiveError naming `what` when it does not finish within `timeout`."""
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    works = launched([dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True)], reads=[tensor],
                     writes=[tensor])
    wait_all(works, Caller(what, timeout), on_device=tensor.device.type == "cuda")


def broadcast_from_rank0(tensors: list[torch.Tensor], *, device: torch.device | None = None,
                         timeout: timedelta = DEFAULT_TIMEOUT, group: dist.ProcessGroup | None = None) -> None:
    """Rank 0's (of `group`, default: all) values of `tensors` on every rank of it, sent from
    `device`'s memory (tensors elsewhere, e.g. a model built on the CPU for GPUs, go there and
    back); None: as they are. Raises CollectiveError when one does not arrive within `timeout`."""
    rt = runtime.active
    for t in tensors:
        sent = t if device is None else rt.to_device(t, device)
        works = launched([dist.broadcast(sent, group=group, group_src=0, async_op=True)], reads=[sent],
                            writes=[sent])
        wait_all(works, Caller("a broadcast from rank 0", timeout), on_device=sent.device.type == "cuda")
        if sent is not t:
            t.copy_(sent)


def barrier(timeout: timedelta, what: str) -> None:
    """Every rank gets here, within `timeout` (a CollectiveError naming `what` otherwise)."""
    wait_all(launched([dist.barrier(async_op=True)], reads=[], writes=[]), Caller(what, timeout),
             on_device=False)


def exchange_bytes(send: list[list[torch.Tensor]], sizes: list[int], device: torch.device,
                   group: dist.ProcessGroup, caller: Caller, tag: int) -> list[torch.Tensor]:
    """The uint8 tensors send[r] to group rank r and sizes[r] bytes from it, returned per rank (a
    matrix optimizer's rows to their owners and back); nothing to or from this rank itself. On
    gloo each peer's bytes go point-to-point under `tag`, a hash of what both sides expect (Note
    [matrix identity]): a peer that expects other bytes never matches, and the wait ends in the
    caller's CollectiveError, where gloo would abort the process on a message longer than the
    receive posted. Elsewhere (NCCL, which has no tags) one all_to_all."""
    rank = dist.get_rank(group)
    out = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    received = list(out.split(sizes))
    if runtime.active.backend(group, device) != "gloo":
        parts = [t for to_rank in send for t in to_rank]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        works = launched([dist.all_to_all_single(out, flat, sizes, [sum(t.numel() for t in to_rank) for to_rank in send],
                                                 group=group, async_op=True)], reads=[flat], writes=[out])
        wait_all(works, caller, on_device=flat.device.type == "cuda")
        return received
    flats = [torch.cat(to_rank) if to_rank else None for to_rank in send]
    works = [dist.irecv(part, group=group, group_src=r, tag=tag) for r, part in enumerate(received)
             if r != rank and part.numel()]
    works += [dist.isend(flat, group=group, group_dst=r, tag=tag) for r, flat in enumerate(flats)
              if r != rank and flat is not None and flat.numel()]
    wait_all(launched(works, reads=[f for f in flats if f is not None], writes=[out]), caller, on_device=False)
    return received


def redistribute(value, placements: tuple, caller: Caller):
    """A DTensor gradient (a tensor-parallel partial sum) in `placements`: DTensor's own
    collective over its mesh's groups, bounded as `caller` says (dtensor_collective)."""
    return dtensor_collective(value, lambda v: v.redistribute(placements=placements), caller)


def full_tensor(value, caller: Caller):
    """A DTensor whole on every rank of its mesh (every rank of it must call): DTensor's own
    all-gather, bounded as `caller` says (dtensor_collective)."""
    return dtensor_collective(value, lambda v: v.full_tensor(), caller)


def dtensor_collective(value, run: Callable, caller: Caller):
    """`run(value)`, whose collectives are DTensor's own over the groups of value's mesh, which
    take no timeout: each group gives up after the caller's for the call (its own timeout put
    back after), and a failure is a CollectiveError naming the caller (Note [named hangs])."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    groups = value.device_mesh.get_all_groups()
    saved = [(group, pg_timeout(group)) for group in groups]
    bounded = [(group, old) for group, old in saved if old is not None]  # a backend whose timeout can be put back
    for group, _ in bounded:
        dist.distributed_c10d._set_pg_timeout(caller.timeout, group)
    try:
        out = run(value)
        return out.wait() if isinstance(out, AsyncCollectiveTensor) else out  # issued within the window
    except RuntimeError as e:  # the backends raise RuntimeError subclasses for timeouts and lost peers
        error = CollectiveError(f"{caller.what} did not finish within {caller.timeout.total_seconds():g} s "
                                f"({str(e).splitlines()[0] if str(e) else type(e).__name__})")
        error.names_the_collective = True  # said as it is (errors.collective_failed)
        raise error from e
    finally:
        for group, old in bounded:
            dist.distributed_c10d._set_pg_timeout(old, group)


def pg_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout of `group`'s backend for its device, where torch says it (gloo's and NCCL's options)."""
    device = torch.device("cuda") if torch.device("cuda") in group._device_types else torch.device("cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
