"""GatherPlan: one of a unit's all-gathers, made with its layout (fully_shard, relayout): the
parameters' formats (what each sends and where every rank's rows go), the route, and the
order of its steps on the streams. Unit asks it to issue and to finish.

A format is a class with Plain's methods, registered with `register_format` by the file
that defines it: quantize.py (int8 blocks), extension.py (FSDP2's all-gather extensions).

# Note [gather streams]: a gather runs in this order, so that no buffer changes hands
# between streams unordered (Note [streams]):
# 1. on the compute stream: every buffer the gather writes into (the full parameters'
#    storage, a format's output buffers) gets its memory, and a format that needs the
#    shard as the compute stream leaves it (an all-gather extension's fsdp_pre_all_gather)
#    makes what it sends; those inputs stay referenced until the compute stream has waited
#    for the gather;
# 2. the gather stream waits for the compute stream (the optimizer may have just written
#    the shards), then copies the shards to the device (CPU offload, from pinned memory,
#    without blocking the host), quantizes them there (int8), stages them, cast, into one
#    send buffer, and issues the collective;
# 3. at the wait: on the gather stream, the rows are moved into the outputs; the compute
#    stream waits for the gather stream, then a format rebuilds the full parameters from its
#    outputs (dequantize, fsdp_post_all_gather) and the gather's buffers are dropped.
#
# Note [smaller world after forward]: with reshard_after_forward=k (an int), freeing after
# forward first keeps this rank's 1/k of the full parameters: the shards of a block of
# world/k ranks. Its group of k consecutive ranks (mesh.smaller_group) then holds every
# row, so the gather before backward runs inside that group (within a node when k is
# the ranks per node), with the same code as a normal gather over k ranks whose shards
# are world/k times longer. The copy is dropped once used, or at the next forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable

import torch

from fullshard import runtime
from fullshard.errors import CollectiveError, fail
from fullshard.options import UnitOptions
from fullshard.param import ShardedParam, local_values
from fullshard.routes import BufferPool, Flight, Route, route_for, stream_runtime
from fullshard.runtime import NOTHING
from fullshard.tags import GATHER


@dataclass(frozen=True)
class Context:
    """What a format may need of its unit: its options, compute device and world, and what
    FSDP2's all-gather extensions are given (the shard mesh, the module, FSDP2's policy)."""

    options: UnitOptions
    device: torch.device
    world: int
    mesh: object = None
    module: object = None
    mp_policy: object = None


class Plain:
    """A parameter gathered in its full dtype (the staging copy casts: Note [bytes on the wire])."""

    # a format whose methods do what Plain's do (the shard goes as it is, into the full storage,
    # nothing to allocate or free): the plan calls none of them, per gather and per parameter
    static = True

    def __init__(self, p: ShardedParam, full_dtype: torch.dtype, context: Context) -> None:
        self.p, self.dtypes = p, [full_dtype]  # each input's dtype on the wire
        self.numels = [p.shard_numel]  # each input's elements per rank
        # only a 0-d parameter has something to do after the gather (a static format's `after`)
        self.needs_after = p.replicated and p.sharded.dtype == full_dtype

    def allocate(self, small: bool) -> None:
        """On the compute stream, before the gather (`small`: inside the smaller group): this
        format's output buffers get memory."""

    def prepare(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """On the compute stream, before the gather: what must be made there; returns tensors
        the gather reads, kept until it is waited for."""
        return []

    def inputs(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """On the gather stream: what this rank sends, flat (cast to `dtypes` by the staging copy)."""
        return [shard]

    def outputs(self, small: bool) -> list[torch.Tensor]:
        """Where every rank's rows of each input go, [world * numel] each; `small`: of the gather
        inside the smaller group, whose rows are the 1/k kept after forward (Note [smaller
        world after forward])."""
        return [self.p.full_padded.view(-1)]

    def after(self, small: bool) -> None:
        """On the compute stream, once the rows are in: the full parameter from the outputs. A
        0-d parameter's copy on every rank becomes the one used (Note [shard layout])."""
        p = self.p
        if p.replicated and p.sharded.dtype == self.dtypes[0]:
            runtime.active.copy_(p.local_shard(), local_values(p.unsharded))

    def free(self) -> None:
        """Drop this format's output buffers' memory (the full storage is the plan's)."""


# (applies, format class), the last registered first: what register_format adds
FORMATS: list[tuple[Callable[[ShardedParam, UnitOptions], bool], type]] = []


def register_format(applies: Callable[[ShardedParam, UnitOptions], bool], cls: type) -> None:
    """Gather the parameters for which `applies(param, options)` holds as `cls(param,
    full_dtype, context)` says (Plain's methods)."""
    FORMATS.insert(0, (applies, cls))


def format_for(p: ShardedParam, full_dtype: torch.dtype, context: Context) -> Plain:
    for applies, cls in FORMATS:
        if applies(p, context.options):
            return cls(p, full_dtype, context)
    return Plain(p, full_dtype, context)


@dataclass
class Gathering:
    """A gather in flight: its route's flight, this rank's rows as sent, and what must live
    until the compute stream has waited for it."""

    flight: Flight
    payload: torch.Tensor
    kept: list[torch.Tensor]


class GatherPlan:
    """A unit's gather over `group` (its shard group, or with `small` the smaller group of Note
    [smaller world after forward], gathering the 1/k copy) into `storage` (the full
    parameters', of `storage_bytes`) and the formats' outputs."""

    def __init__(self, formats: list[Plain], group, device: torch.device, wire_dtype: torch.dtype, uid: int, *,
                 storage: torch.Tensor | None, storage_bytes: int = 0, offload: bool = False,
                 small: bool = False) -> None:
        self.formats, self.group, self.device, self.wire_dtype, self.uid = formats, group, device, wire_dtype, uid
        self.storage, self.storage_bytes = storage, storage_bytes
        self.as_bytes = wire_dtype == torch.uint8  # each input goes as the bytes of its dtype
        self.offload = offload and not small  # shards in host memory, moved on the gather stream
        self.small = small
        self.world = group.size() if group is not None else 1
        self.cpu = device.type == "cpu"  # routes.stream_runtime: Note [nothing per collective on a CPU]
        self.routes: dict[int, Route] = {}  # by elements per rank (an extension's are known at its first gather)
        self.dynamic = [(i, f) for i, f in enumerate(formats) if not f.static]  # with buffers and transforms of their own
        self.kept: torch.Tensor | None = None  # `small`: the 1/k copy kept after forward (`keep`)
        self.after = [f for f in formats if not f.static or f.needs_after]
        self.fixed_outputs = None
        self.fixed_outputs = None if self.dynamic else self.outputs()  # views of the storage: they stay valid
        self.fixed_rows = None  # of fixed outputs: made at the first gather (a view needs the storage's memory)

    def route(self, numel: int) -> Route:
        route = self.routes.get(numel)
        if route is None:
            route = self.routes[numel] = route_for(self.group, self.device, numel, self.wire_dtype, uid=self.uid,
                                                   kind=GATHER)
        return route

    def outputs(self) -> list[torch.Tensor]:
        """Every output, as the wire dtype: [world * size] each."""
        if self.fixed_outputs is not None:
            return self.fixed_outputs
        return [out.view(torch.uint8) if self.as_bytes else out for f in self.formats for out in f.outputs(self.small)]

    def rows(self) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Where a gather puts each output's rows ([world, size] each): the sizes, and the rows of the
        ranks before this one, of those after it, and this rank's own (kept, as fixed_outputs are)."""
        if self.fixed_rows is not None:
            return self.fixed_rows
        outs = [out.view(self.world, -1) for out in self.outputs()]
        rank = self.group.rank() if self.group is not None else 0
        rows = [out.size(1) for out in outs], [out[:rank] for out in outs], [out[rank + 1 :] for out in outs], \
            [out[rank] for out in outs]
        if not self.dynamic:
            self.fixed_rows = rows
        return rows

    def issue(self, shards: list[torch.Tensor], pool: BufferPool, what: str, timeout) -> Gathering:
        """Start gathering this rank's `shards` (one per format; the 1/k copy alone for `small`),
        Note [gather streams] 1-2."""
        rt = runtime.active
        if self.storage is not None:
            self.storage.untyped_storage().resize_(self.storage_bytes)
            if rt.tracks:
                rt.allocated(self.storage)
        kept = []
        for i, f in self.dynamic:
            f.allocate(self.small)
            if not self.small:
                kept += f.prepare(shards[i])
        streams, stream = stream_runtime(self.cpu), None
        if streams is not None:
            stream = streams.side_stream(self.device, "gather")
            streams.wait_stream(stream, streams.current_stream(self.device))  # the optimizer may have just written the shards
        with streams.use(stream) if streams is not None else NOTHING:
            if self.small:
                sources, dtypes = [self.kept], [self.wire_dtype]
            elif not self.dynamic and not self.offload:
                sources, dtypes = shards, [f.dtypes[0] for f in self.formats]
            else:
                sources = [t for f, shard in zip(self.formats, shards)
                           for t in f.inputs(rt.to_device(shard, self.device) if self.offload else shard)]
                dtypes = [dtype for f in self.formats for dtype in f.dtypes]
            sizes = [t.numel() * (dtype.itemsize if self.as_bytes and not self.small else 1)
                     for t, dtype in zip(sources, dtypes)]
            route = self.route(sum(sizes))
            one = sources[0] if len(sources) == 1 else None
            if route.staged or one is None or one.dtype != self.wire_dtype or \
                    streams is not None and streams.elsewhere(one, self.device):  # in host memory, for a GPU
                sent, payload = route.send_buffer(pool, 1)
                self.stage(sources, dtypes, sizes, payload, pool, streams)
            else:
                sent, payload = None, one  # the shard itself goes
            flight = route.gather(payload, sent, pool, what, timeout)
        return Gathering(flight, payload, kept)

    def stage(self, sources: list[torch.Tensor], dtypes: list[torch.dtype], sizes: list[int], payload: torch.Tensor,
              pool: BufferPool, streams) -> None:
        """Copy the inputs into the send buffer's payload: cast (mixed precision), or as the bytes of each dtype."""
        rt = runtime.active
        if sources and not self.as_bytes and not (streams is not None and streams.elsewhere(sources[0], self.device)):
            torch.cat(sources, out=payload)  # one kernel that also casts
            return
        offset = 0
        for source, dtype, size in zip(sources, dtypes, sizes):  # from pinned host memory: overlaps compute
            part = payload[offset : offset + size]
            offset += size
            if not self.as_bytes or source.dtype == torch.uint8:
                rt.copy_(part, source)
            elif source.dtype == dtype:
                rt.copy_(part, source.view(torch.uint8))
            else:  # cast on this stream, then its bytes
                converted = pool.take((source.numel(),), dtype, self.device)
                rt.copy_(converted, source)
                rt.copy_(part, converted.view(torch.uint8))
                pool.give(converted)

    def finish(self, gathering: Gathering, pool: BufferPool) -> None:
        """Wait for the gather and rebuild the full parameters, Note [gather streams] 3. Raises
        the route's CollectiveError (a timeout, another collective's rows)."""
        sizes, befores, afters, owns = self.rows()
        route = self.route(sum(sizes))
        streams = stream_runtime(self.cpu)
        stream = streams.side_stream(self.device, "gather") if streams is not None else None
        with streams.use(stream) if streams is not None else NOTHING, torch.no_grad():
            before, after = route.finish(gathering.flight)
            for rows, outs in ((before, befores), (after, afters)):
                if rows.size(0):
                    torch.split_with_sizes_copy(rows, sizes, dim=1, out=outs)
            torch.split_with_sizes_copy(gathering.payload, sizes, out=owns)
        if streams is not None:
            streams.wait_stream(streams.current_stream(self.device), stream)
        with torch.no_grad():
            for f in self.after:
                f.after(self.small)
        route.give(gathering.flight, pool)
        self.release(gathering.kept)

    def release(self, kept: list[torch.Tensor]) -> None:
        """Drop what the gather read that was made on the compute stream (Note [gather streams] 1):
        only once the compute stream has waited for the gather (a stream model checks it)."""
        rt = runtime.active
        if rt.tracks:
            for tensor in kept:
                rt.freed(tensor)
        kept.clear()

    def keep(self, block: int) -> int:
        """`small`, while the unit is full: keep this rank's rows of the outputs of the `block` ranks
        whose shards its part of the smaller group holds; returns the bytes kept."""
        world = block * self.world  # of the whole shard group
        first = self.group.rank() * block
        self.kept = torch.cat([out.view(world, -1)[first : first + block].reshape(-1) for out in self.outputs()])
        return self.kept.nbytes

    def drop(self) -> int:
        """`small`: forget the copy kept after forward; returns its bytes (0 when none, or it was gathered)."""
        kept, self.kept = self.kept, None
        return 0 if kept is None else kept.nbytes

    def free(self) -> None:
        """Drop the full parameters' storage and the formats' buffers (the tensors stay: Note [stable full params])."""
        rt = runtime.active
        if self.storage is not None:
            if rt.tracks:
                rt.freed(self.storage)
            self.storage.untyped_storage().resize_(0)
        for _, f in self.dynamic:
            f.free()


class Values(Plain):
    """Values laid out as a parameter's padded shard (its masters, its optimizer state), gathered
    into a new tensor of `dtype` (gather_values)."""

    needs_after = False

    def __init__(self, p: ShardedParam, dtype: torch.dtype, device: torch.device) -> None:
        self.p, self.dtypes, self.numels = p, [dtype], [p.shard_numel]
        self.full = torch.empty(p.padded_shape, dtype=dtype, device=device)

    def outputs(self, small: bool) -> list[torch.Tensor]:
        return [self.full.view(-1)]

    def after(self, small: bool) -> None:
        pass


def gather_values(params: list[ShardedParam], shards: list[torch.Tensor], dtype: torch.dtype, group,
                  device: torch.device, uid: int, pool: BufferPool, what: str, timeout) -> list[torch.Tensor]:
    """Full tensors of `dtype` laid out as `params`' padded shards (`shards`: this rank's, e.g. of
    their optimizer state), gathered over `group` into new tensors on `device` (each of the
    parameter's own shape): whole values for state dicts, outside the steps. Raises the
    route's CollectiveError."""
    formats = [Values(p, dtype, device) for p in params]
    plan = GatherPlan(formats, group, device, dtype, uid, storage=None)
    plan.finish(plan.issue(shards, pool, what, timeout), pool)
    return [p.unpad(f.full) for p, f in zip(params, formats)]


def gather_masters(unit) -> list[torch.Tensor]:
    """A unit's full parameters in the master dtype, gathered into new tensors on the compute
    device (to read or edit whole weights; the unit's own state does not change)."""
    extended = next((p.fqn for p in unit.params if p.extension), None)
    if extended is not None:
        raise fail(f"parameter {extended!r} defines FSDP2's all-gather extensions, whose whole value only "
                   f"the subclass knows how to rebuild", "Use the sharded state dict (get_state_dict(model, "
                   "full=False)), or gather inside a forward (the subclass's own fsdp_post_all_gather).")
    if unit.unset:
        unit.check_has_values()
    fulls = {}
    for dtype in dict.fromkeys(unit.layout.master_dtypes):  # one gather per master dtype
        mine = [i for i, d in enumerate(unit.layout.master_dtypes) if d == dtype]
        values = gather_state(unit, [unit.params[i] for i in mine], [unit.layout.shards[i] for i in mine], dtype,
                              "full parameters")
        fulls.update(zip(mine, values))
    return [fulls[i] for i in range(len(unit.params))]


def gather_whole(unit) -> Iterator[tuple[ShardedParam, torch.Tensor]]:
    """Each parameter of a unit with its whole value (gather_masters, then gathered over TP, one
    parameter at a time: Note [tensor parallel parameters])."""
    for p, tensor in zip(unit.params, gather_masters(unit)):
        yield p, p.whole(tensor)


def gather_state(unit, params: list[ShardedParam], shards: list[torch.Tensor], dtype: torch.dtype,
                 what: str) -> list[torch.Tensor]:
    """gather_values over a unit's shard group, within its timeout; its error if it fails."""
    collective = f"all-gather (of {what})"
    try:
        return gather_values(params, shards, dtype, unit.group.shard_pg, unit.compute_device, unit.uid,
                             unit.shared.pool, unit.naming.what(collective), unit.timeout)
    except CollectiveError as e:
        raise unit.naming.failed(collective, e) from None
