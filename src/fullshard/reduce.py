"""ReducePlan: a unit's gradient reduction for one reduce dtype, made with its layout (and again
when the trainable parameters or FSDP2's reduction switches change): the rows, their format
on the wire, the route, the averaging and the all-reduce across replicas; and the landing
of the reduced row on the shards' gradients. Unit asks it to issue and to finish.

A row format is a class with Exact's methods (low_precision.py: rows sent in bf16 or int8
blocks, summed in float32 where they arrive), chosen by the unit's options
(register_row_format).

# Note [averaging]: gradients are averaged over the dp_size data-parallel ranks (divided by
# a unit's set_gradient_divide_factor instead, when set). fp16 rows are divided before the
# sum, whose fp16 range would overflow sooner. Otherwise NCCL averages inside the
# collectives (ReduceOp.AVG, no extra kernel or pass over the row; NCCL scales each addend
# by 1/n first); elsewhere the sum is divided afterwards. Each rank's rows are added in rank
# order. Where rows arrive to be summed (gloo's routes, a row format that sums in float32),
# bf16 rows are added in a float32 scratch row and divided there, so the row is rounded to
# the reduce dtype once. On gloo the all-reduce across replicas adds them in float32 too,
# rounding their sum once (Note [replica sums]). NCCL's collectives sum in the reduce dtype
# inside the backend.
#
# Note [no overflow]: a sum of n gradients can overflow where their average does not (two of
# 3e38). Multiplying every addend by 2^-k, the power of two with 2^k >= n, keeps every partial
# sum within the largest addend, and dividing the sum by the divisor times 2^-k gives bitwise
# the plain sum's quotient (a power of two scales without rounding), except that addends below
# 2^(k-126), float32 subnormals once scaled, lose their last bits. So: where rows are summed
# in host memory, the plain sum is checked (all_finite, read by the host) and only a row that
# overflowed (or holds an inf or NaN) is summed again, scaled; rows summed on a device are
# scaled first, as NCCL's own average scales them; so are the rows NCCL sums
# (ReduceOp.SUM), and a row before gloo's all-reduce across replicas, whose inputs are gone
# once it has summed. `Reducing.scale` is what the row was multiplied by, divided out at the
# end.
#
# Note [replica sums]: on gloo the all-reduce across replicas is no collective of gloo's own
# but rows over the routes of routes.py, each led by the unit's header (Note [named hangs]),
# so that a replica at another collective is named at once. With two replicas each sends its
# row to the other and both add the two (the same sum in either order): one round, the bytes
# of a ring all-reduce. With R > 2, a reduce-scatter of the row's R chunks (each replica
# sums one chunk, in replica order) then an all-gather of the sums: the ring's 2(R - 1)/R
# of the row, in two rounds. Either way every replica holds bitwise the same row; bf16
# rows are added in float32 and rounded once. NCCL's all-reduce is NCCL's own (it
# averages, Note [averaging]), with no header.
#
# Note [landing]: a reduced row becomes the shards' gradients on the compute stream as soon
# as it is waited for, unless the host must see it first: with CPU offload (the row is copied
# to pinned host memory without waiting) or when some rank had no gradient for one of the
# unit's parameters (the has-gradient flags decide which gradients stay None). Those rows
# wait in the unit's queue until the end of backward, when the host waits once for all of
# them (Note [host syncs]) and they land.
#
# Note [waited hooks]: an all-reduce hook (set_all_reduce_hook) that returns something with a
# wait() has started its own communication on the row, e.g. torchft's all-reduce across replica
# groups (fullshard.ft): the row is not touched until the end of backward, when it is waited
# for, checked for non-finite values and landed, so that communication overlaps the rest of
# backward as fullshard's own all-reduce across replicas does. Rows live in the unit's pool
# until then, as the queued rows above do.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from fullshard import runtime
from fullshard.checks import check_next_collective
from fullshard.collectives import redistribute
from fullshard.mesh import ShardGroup
from fullshard.param import ShardedParam, local_values
from fullshard.errors import CollectiveError
from fullshard.routes import BufferPool, Flight, Route, all_reduce, route_for, stream_runtime, wait_works
from fullshard.runtime import NOTHING, label, profiling
from fullshard.tags import ALL_REDUCE, ALL_REDUCE_GATHER, REDUCE

LOW_PRECISION = (torch.bfloat16, torch.float16)


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


class Exact:
    """Rows sent in the reduce dtype, as they are (Note [averaging])."""

    native = True  # the backend's own reduce-scatter may sum them

    def __init__(self, dtype: torch.dtype, segments: list[int], options=None, host: bool = True) -> None:
        """`segments`: the row's parts, each parameter's row then the has-gradient flags; `host`:
        the rows are in host memory."""
        self.dtype, self.wire_dtype, self.wire_numel = dtype, dtype, sum(segments)

    def pack_into(self, payload: torch.Tensor, pool: BufferPool) -> torch.Tensor:
        """Where the rows ([world, numel] of the reduce dtype) are packed: the send buffer's payload itself."""
        return payload

    def encode(self, rows: torch.Tensor, payload: torch.Tensor, pool: BufferPool) -> None:
        """Write the packed rows into the send buffer's payload as they go on the wire."""

    def add(self, total: torch.Tensor, row: torch.Tensor, alpha: float) -> None:
        """Add alpha times a peer's row as received to the running sum `total` ([numel])."""
        total.add_(row, alpha=alpha)


@dataclass
class Reducing:
    """A reduction in flight: its route's flight, the row it makes, and what is known of it."""

    flight: Flight
    shard: torch.Tensor  # [row_numel]: this rank's row, of the reduce dtype
    rows: torch.Tensor | None  # the packed rows, when the format encodes them elsewhere
    all_here: bool  # every parameter had a gradient on this rank
    replicated: bool  # the all-reduce across replicas is owed (issued at once, or once the row is summed)
    divide_after: float
    scale: float  # what the row was multiplied by, Note [no overflow]
    own: torch.Tensor | None  # this rank's packed row, when rows arrive to be summed here
    all_reduce: Flight | None = None  # the all-reduce across replicas, once issued
    traffic: list[tuple[str, int]] = field(default_factory=list)  # (collective, bytes this rank sent)


# (applies, row format class), the last registered first: what register_row_format adds
ROW_FORMATS: list[tuple] = []


def register_row_format(applies, cls: type) -> None:
    """Send the rows of units whose options satisfy `applies(options)` as `cls(dtype, segments,
    options, host)` says (Exact's methods)."""
    ROW_FORMATS.insert(0, (applies, cls))


class ReducePlan:
    """The reduction of the gradients of `params` (trainable, of one reduce dtype) over the
    unit's groups: made once for them and the unit's switches."""

    def __init__(self, params: list[ShardedParam], dtype: torch.dtype, group: ShardGroup, device: torch.device,
                 uid: int, *, divide_by: float, force_sum: bool, options) -> None:
        self.params, self.dtype, self.group, self.device = params, dtype, group, device
        self.numels = [p.shard_numel for p in params]
        self.row_numel = sum(self.numels) + len(params)  # [grad_shard_numel + n_flags]: a has-gradient flag each
        cls = next((cls for applies, cls in ROW_FORMATS if applies(options)), Exact)
        self.format = cls(dtype, [*self.numels, len(params)], options, runtime.active.host_memory(device))
        shard_pg, replicate_pg = group.shard_pg, group.replicate_pg
        self.route = route_for(shard_pg, device, self.format.wire_numel, self.format.wire_dtype, uid=uid, kind=REDUCE,
                               native=self.format.native)
        self.sums_here = self.route.name != "native" and shard_pg is not None  # rows arrive to be summed here
        backend = "gloo" if shard_pg is None and replicate_pg is None or self.sums_here else \
            runtime.active.backend(shard_pg or replicate_pg, device)  # the backend's own: only NCCL averages
        summed_over = group.world * (replicate_pg.size() if replicate_pg is not None else 1)
        self.averaging = averaging(backend, dtype, dp_size=group.dp_size, summed_over=summed_over,
                                   divide_by=divide_by, force_sum=force_sum)
        self.divide_by = divide_by
        self.replicate_pg = replicate_pg
        self.on_device = not runtime.active.host_memory(device)
        self.cpu = device.type == "cpu"  # routes.stream_runtime: Note [nothing per collective on a CPU]
        # Note [no overflow]: the powers of two the rows are scaled by before the sums
        sums = self.averaging.op == dist.ReduceOp.SUM and not self.averaging.divide_first
        shard_scale = below(group.world) if sums and shard_pg is not None else 1.0
        replica_scale = below(replicate_pg.size()) if sums and replicate_pg is not None else 1.0
        if self.sums_here:
            self.scale_first, self.scale_on_overflow = (1.0, shard_scale) if not self.on_device else (shard_scale, 1.0)
            self.replica_scale = replica_scale
        elif shard_pg is not None:  # the backend sums the rows, then the all-reduce: one scale for both
            self.scale_first, self.scale_on_overflow, self.replica_scale = shard_scale * replica_scale, 1.0, 1.0
        else:
            self.scale_first, self.scale_on_overflow, self.replica_scale = 1.0, 1.0, replica_scale
        self.replica_sum = ReplicaSum(replicate_pg, device, self.row_numel, dtype, uid, self.averaging.op) \
            if replicate_pg is not None else None
        self.grad_specs = [(p, p.spec_for(p.sharded.dtype)) for p in params]  # the sharded gradients' DTensors

    def issue(self, grads: list[torch.Tensor | None], pool: BufferPool, replicate: bool, what: str,
              timeout: timedelta) -> Reducing:
        """Start summing the full gradients' rows over the shard group into this rank's row,
        then (`replicate`) all-reducing it across replicas."""
        streams = stream_runtime(self.cpu)
        route, how = self.route, self.averaging
        world, rank = route.world, route.rank
        shard = torch.empty(self.row_numel, dtype=self.dtype, device=self.device)  # [row_numel]
        all_here = True  # then every reduced flag is set
        for g in grads:  # a loop, not all(): per reduction, kept free of calls
            all_here = all_here and g is not None
        stream = streams.side_stream(self.device, "reduce") if streams is not None else None
        rows, sent = None, None
        scale, own = self.scale_first, None  # Note [no overflow]
        if self.group.shard_pg is None:
            pack_rows(grads, self.numels, shard.view(1, -1))  # the only row is the result
        else:
            sent, payload = route.send_buffer(pool, world)
            rows = self.format.pack_into(payload, pool)  # [world, row_numel]
            pack_rows(grads, self.numels, rows)
            if self.sums_here:  # own row straight into the result, Note [collective choice]
                own = rows[rank]
                torch.mul(own, scale, out=shard) if scale != 1 else shard.copy_(own)
            elif scale != 1:  # the backend sums them
                rows.mul_(scale)
        if how.divide_first:
            for divided in (rows, shard if self.sums_here or self.group.shard_pg is None else None):
                if divided is not None:
                    divided.div_(self.divide_by)
        if streams is not None:  # Note [streams]: the rows were packed on the compute stream
            streams.wait_stream(stream, streams.current_stream(self.device))
        with streams.use(stream) if streams is not None else NOTHING:
            if sent is None:  # no shard group: the row is the shard itself, never the pool's to take back
                flight = Flight([], None, None, what, timeout)
            else:
                self.format.encode(rows, payload, pool)
                flight = route.reduce(sent, shard, how.op, pool, what, timeout)
        reducing = Reducing(flight, shard, rows if rows is not None and rows is not payload else None, all_here,
                            replicate and self.replicate_pg is not None, how.divide_after, scale, own)
        if self.group.shard_pg is not None:
            reducing.traffic.append(("reduce_scatter", (world - 1) * self.format.wire_numel
                                     * self.format.wire_dtype.itemsize))
        if reducing.replicated and not self.sums_here:  # at once, on its own stream, behind the reduce-scatter
            with streams.use(stream) if streams is not None else NOTHING:
                route.finish(flight)
            flight.works = []
            self.start_all_reduce(reducing, pool)
        return reducing

    def start_all_reduce(self, reducing: Reducing, pool: BufferPool) -> None:
        """Issue the all-reduce of the row across replicas on the all-reduce stream, after the
        reduce stream (Note [replica sums])."""
        streams, stream = stream_runtime(self.cpu), None
        shard, flight = reducing.shard, reducing.flight
        if streams is not None:
            stream = streams.side_stream(self.device, "all_reduce")
            streams.wait_stream(stream, streams.side_stream(self.device, "reduce"))
        with streams.use(stream) if streams is not None else NOTHING:
            if self.replica_scale != 1:  # Note [no overflow]
                shard.mul_(self.replica_scale)
                reducing.scale *= self.replica_scale
            reducing.all_reduce = self.replica_sum.issue(shard, pool, flight.what, flight.timeout)
        reducing.traffic.append(("all_reduce", self.replica_sum.sent_bytes(shard)))

    def finish(self, reducing: Reducing, pool: BufferPool) -> torch.Tensor:
        """Wait for the reduction; return this rank's row averaged over the data-parallel ranks,
        ready for the compute stream. Raises the route's CollectiveError."""
        streams = stream_runtime(self.cpu)
        shard, flight = reducing.shard, reducing.flight
        stream = streams.side_stream(self.device, "reduce") if streams is not None else None
        with streams.use(stream) if streams is not None else NOTHING:
            if flight.works or flight.first_works:
                before, after = self.route.finish(flight)
                if self.sums_here:  # own row first, then the peers' in rank order, Note [averaging]
                    total = shard
                    if shard.dtype in LOW_PRECISION:  # summed in float32, rounded once
                        total = pool.take((shard.numel(),), torch.float32, self.device)  # [row_numel]
                        total.copy_(shard)  # the own row, as scaled
                    peers = (*before, *after)
                    for row in peers:
                        self.format.add(total, row, reducing.scale)
                    if self.scale_on_overflow != 1 and not all_finite(total):  # Note [no overflow]: once more, scaled
                        reducing.scale = self.scale_on_overflow
                        torch.mul(reducing.own, reducing.scale, out=total)
                        for row in peers:
                            self.format.add(total, row, reducing.scale)
                    if total is not shard:
                        shard.copy_(total.div_(reducing.divide_after * reducing.scale))
                        reducing.divide_after = reducing.scale = 1
                        pool.give(total)
        if reducing.replicated and reducing.all_reduce is None:  # gloo: now the row is summed
            self.start_all_reduce(reducing, pool)
        last = streams.side_stream(self.device, "all_reduce") if reducing.all_reduce and streams is not None \
            else stream
        with streams.use(last) if streams is not None else NOTHING:
            if reducing.all_reduce is not None:
                self.replica_sum.finish(reducing.all_reduce, shard, pool, streams)
            if reducing.divide_after * reducing.scale != 1:
                shard.div_(reducing.divide_after * reducing.scale)
        if streams is not None:
            streams.wait_stream(streams.current_stream(self.device), last)
        self.route.give(flight, pool)
        if reducing.rows is not None:
            pool.give(reducing.rows)
        return shard

    def land(self, row: torch.Tensor, flags: list) -> None:
        """Add each parameter's part of a reduced row to its shard's gradient (where a flag says
        any rank had one), then run the shard's post-accumulate-grad hooks."""
        offset = 0
        for (p, spec), flag, numel in zip(self.grad_specs, flags, self.numels):
            if flag:
                local = row[offset : offset + p.local_shape.numel()].view(p.local_shape)
                accumulate(p, spec, local)
            offset += numel
        for p, flag in zip(self.params, flags):
            if flag:
                for hook in list((p.sharded._post_accumulate_grad_hooks or {}).values()):
                    hook(p.sharded)  # e.g. an optimizer step inside backward, on the shard and its gradient


class Reductions:
    """A unit's gradient side: its reduce plans (one set per set of trainable parameters), the
    reductions in flight, the rows waiting to land (Note [landing]), the all-reduce owed across
    replicas, whether every reduced gradient was finite, and the full gradient bytes on the
    memory meter. Made with what it reads (the unit's parameters, layout and group) and given,
    per call, the switches, options and device that hold for that call."""

    def __init__(self, params: list[ShardedParam], layout, group: ShardGroup, uid: int, counts: dict,
                 shared, naming) -> None:
        self.params, self.layout, self.group, self.uid = params, layout, group, uid
        self.counts = counts  # the unit's counters (accounting.Stats)
        self.shared, self.naming = shared, naming  # shared.Shared (the root's after lazy init), shared.Naming
        self.plans: dict[tuple[bool, ...], list[ReducePlan]] = {}
        self.in_flight: list[tuple[ReducePlan, Reducing, object, object]] = []  # one per reduce dtype, with its switches and options
        self.unlanded: list[tuple[ReducePlan, torch.Tensor, torch.Tensor, timedelta]] = []  # Note [landing]
        self.hooked: list[tuple[ReducePlan, Reducing, torch.Tensor, object, object, object]] = []  # Note [waited hooks]
        self.finite: torch.Tensor | None = None  # 0-d bool on the device: every reduced gradient so far was finite
        self.owes_all_reduce = False  # reduced within the group only (all_reduce_grads off)
        self.reduced = False  # a reduction finished in this backward (the root settles the all-reduce once)
        self.counted_grad_bytes = 0  # full gradient bytes already on the meter

    def reset(self) -> None:
        """Drop the backward in flight (it raised): nothing pending, no full gradient."""
        self.finish()
        for hooked in self.hooked:  # the hook's communication still writes into its row
            hooked[3].wait()
        self.hooked.clear()
        self.unlanded.clear()
        self.finite = None
        self.reduced = False
        for p in self.params:
            p.drop_full_grad()
        self.count_full_grads(0)

    def count_full_grads(self, held: int | None = None) -> None:
        """Bring the meter's full gradient bytes up to what this unit holds now (`held` when the caller knows)."""
        if held is None:
            held = full_grad_bytes(self.params)
        meter = self.shared.meter  # the root's: full gradient bytes (at 2) and their peak (at 3)
        meter[2] += held - self.counted_grad_bytes
        if meter[2] > meter[3]:
            meter[3] = meter[2]
        self.counted_grad_bytes = held

    def has_full_grads(self) -> bool:
        for p in self.params:  # a loop, not any(): once per unit per backward, kept free of calls
            if p.unsharded.grad is not None or p.accumulated is not None:
                return True
        return False

    def hold(self, timeout: timedelta) -> None:
        """A backward without gradient sync: the full gradients keep accumulating, in the reduce dtype."""
        try:
            for p, dtype in zip(self.params, self.layout.reduce_dtypes):
                hold_grad(p, dtype)
        except CollectiveError as e:
            raise self.naming.failed("sum of tensor-parallel gradients", e) from None
        self.count_full_grads()

    def plans_for(self, trainable: tuple[bool, ...], switches, options, device: torch.device) -> list[ReducePlan]:
        """The reduce plans of these trainable parameters: one per reduce dtype (Note [bytes on the wire])."""
        plans = self.plans.get(trainable)
        if plans is None:
            layout = self.layout
            params = [(p, dtype) for p, dtype, on in zip(self.params, layout.reduce_dtypes, trainable) if on]
            one = len(layout.reduce_groups) == 1
            plans = self.plans[trainable] = [
                ReducePlan([p for p, d in params if one or d == dtype], dtype, self.group, device, self.uid,
                           divide_by=switches.divide_factor or self.group.dp_size, force_sum=switches.force_sum,
                           options=options)
                for dtype in layout.reduce_groups if any(one or d == dtype for _, d in params)]
        return plans

    def issue(self, switches, options, device: torch.device) -> None:
        """Start averaging the full gradients over the data-parallel ranks (`finish` lands them)."""
        self.finish()  # a unit reduced twice in one backward (used twice in forward)
        trainable = tuple([p.sharded.requires_grad for p in self.params])
        if True not in trainable:
            return
        self.count_full_grads()
        naming, timeout = self.naming, switches.timeout
        try:  # DTensor's sum, for a TP partial sum
            full_grads = {p: take_full_grad(p) for p, on in zip(self.params, trainable) if on}
        except CollectiveError as e:
            raise naming.failed("sum of tensor-parallel gradients", e) from None
        if switches.debug:  # every rank about to reduce this unit, with gradients for the same parameters
            mask = sum(1 << i for i, g in enumerate(full_grads.values()) if g is not None) % (1 << 62)
            check_next_collective(self.group, timeout, naming,
                                  [self.uid, REDUCE, self.shared.step, mask, self.shared.evaluating])
        replicate = switches.all_reduce_grads and not self.owes_all_reduce
        for plan in self.plans_for(trainable, switches, options, device):
            what = naming.what("reduce-scatter") if stream_runtime(plan.cpu) is not None else ""  # for a stream model, the hang watch
            with label(f"fullshard::reduce_scatter {naming.fqn}") if profiling() else NOTHING:
                try:  # no_shard on gloo: its all-reduce checks the replicas' headers at once
                    reducing = plan.issue([full_grads.pop(p) for p in plan.params], self.shared.pool, replicate,
                                          what, timeout)
                except CollectiveError as e:
                    raise naming.failed("reduce-scatter", e) from None
            self.in_flight.append((plan, reducing, switches, options))
        self.count_full_grads(full_grad_bytes(self.params, frozen_only=True))

    def finish(self) -> None:
        """Wait for the reductions in flight and land them on the shards' gradients, or queue them
        for the end of backward (Note [landing]). A parameter no rank computed a gradient for
        keeps the gradient it had."""
        taken, self.in_flight = self.in_flight, []
        for plan, reducing, switches, options in taken:
            start = time.perf_counter()
            with label(f"fullshard::wait reduce {self.naming.fqn}") if profiling() else NOTHING:
                try:
                    row = plan.finish(reducing, self.shared.pool)  # [grad_shard_numel + n_flags], on the compute stream
                except CollectiveError as e:
                    raise self.naming.failed("reduce-scatter", e) from None
            self.counts["wait_s"] += time.perf_counter() - start
            if switches.all_reduce_hook is not None:  # the user's, on the gradients (not the has-gradient flags)
                pending = switches.all_reduce_hook(row[: row.numel() - len(plan.params)])
                if callable(getattr(pending, "wait", None)):  # Note [waited hooks]
                    self.hooked.append((plan, reducing, row, pending, switches, options))
                    continue
            self.land_row(plan, reducing, row, switches, options)

    def land_hooked(self) -> None:
        """Land the rows whose all-reduce hook is still communicating (Note [waited hooks])."""
        hooked, self.hooked = self.hooked, []
        for plan, reducing, row, pending, switches, options in hooked:
            pending.wait()
            self.land_row(plan, reducing, row, switches, options)

    def land_row(self, plan: ReducePlan, reducing: Reducing, row: torch.Tensor, switches, options) -> None:
        """The rest of `finish` for one row, once it holds its final values."""
        flags_at = row.numel() - len(plan.params)
        counts = self.counts
        if switches.nonfinite is not None:  # on the device: the root reads every unit's at once
            finite = all_finite(row)
            self.finite = finite if self.finite is None else self.finite & finite
        for kind, nbytes in reducing.traffic:
            counts[kind + "s"] += 1
            counts[kind + "_bytes"] += nbytes
        self.reduced = True
        if self.group.replicate_pg is not None and not switches.all_reduce_grads:
            self.owes_all_reduce = True
        rt = runtime.active
        if options.offload:
            masters = {p.sharded.dtype for p in plan.params}  # land on the host in the masters' dtype if one
            row = row.to(*masters) if len(masters) == 1 and row.dtype not in masters else row
            host = rt.to_host(row, pin=options.pin_memory)  # [grad_shard_numel + n_flags]
            self.unlanded.append((plan, host[flags_at:], host, switches.timeout))
        elif not reducing.all_here:
            self.unlanded.append((plan, rt.to_host(row[flags_at:], pin=True), row, switches.timeout))
        else:
            plan.land(row, [True] * len(plan.params))

    def land_queued(self) -> None:
        """Land the rows queued in `unlanded`, once the host has waited for the GPU (Note [landing])."""
        for plan, flags, row, timeout in self.unlanded:
            plan.land(row, runtime.active.read_on_host(flags, timeout=timeout,
                                                       what=self.naming.what("reduce-scatter's has-gradient flags")))
        self.unlanded.clear()

    def settle_all_reduce(self, all_reduce_grads: bool, timeout: timedelta, device: torch.device) -> bool:
        """With the all-reduce across replicas off, owe it; once back on, pay it on the
        gradients accumulated since (all of them in one all-reduce). Runs at the end of a
        backward that reduced, after landing, in unit order on every rank. Returns whether
        it copied gradients back to host memory (CPU offload): the host must wait for them
        (the root waits once for every unit, Note [host syncs])."""
        reduced, self.reduced = self.reduced, False
        if not (reduced and self.owes_all_reduce and all_reduce_grads):
            return False
        self.owes_all_reduce = False
        collective = "all-reduce across replicas"
        try:
            nbytes, back = owed_all_reduce([p for p in self.params if p.sharded.requires_grad], self.group, device,
                                           self.uid, self.shared.pool, self.naming.what(collective), timeout)
        except CollectiveError as e:
            raise self.naming.failed(collective, e) from None
        self.counts["all_reduces"] += 1
        self.counts["all_reduce_bytes"] += nbytes
        return back


def owed_all_reduce(params: list[ShardedParam], group: ShardGroup, device: torch.device, uid: int,
                    pool: BufferPool, what: str, timeout: timedelta) -> tuple[int, bool]:
    """Sum the sharded gradients of `params` over the replicas (the all-reduce owed since
    set_requires_all_reduce(False)): one all-reduce per master dtype, in device memory (NCCL
    reads nothing else). Returns the bytes this rank sent and whether gradients were copied
    back to host memory (CPU offload: the host must wait for them)."""
    rt = runtime.active
    for p in params:  # every replica sends the same layout; a missing gradient is zero
        if p.sharded.grad is None:
            accumulate(p, p.spec_for(p.sharded.dtype), p.local_shard().new_zeros(p.local_shape, dtype=p.sharded.dtype))
    grads = [p.local_grad() for p in params]
    moved = [rt.to_device(g, device) for g in grads]
    group_pg = group.replicate_pg
    nbytes = 0
    for dtype in dict.fromkeys(t.dtype for t in moved):
        tensors = [t for t in moved if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in tensors])  # [sum of numels]
        replicas = ReplicaSum(group_pg, device, flat.numel(), dtype, uid, dist.ReduceOp.SUM)
        replicas.finish(replicas.issue(flat, pool, what, timeout), flat, pool, runtime.active)
        torch.split_with_sizes_copy(flat, [t.numel() for t in tensors], out=[t.view(-1) for t in tensors])
        nbytes += replicas.sent_bytes(flat)
    back = [(grad, device_grad) for grad, device_grad in zip(grads, moved) if device_grad is not grad]
    for grad, device_grad in back:
        rt.copy_(grad, device_grad)
    return nbytes, bool(back)


def below(n: int) -> float:
    """2^-k for the smallest k with 2^k >= n (Note [no overflow])."""
    return 2.0 ** -math.ceil(math.log2(n)) if n > 1 else 1.0


def all_finite(row: torch.Tensor) -> torch.Tensor:
    """Whether `row` holds no inf or NaN, as a bool on its device (read by the host only where
    it must be). Its least and greatest values, one pass with no copy (a NaN reaches both):
    a float64 sum, which cannot overflow either, makes a float64 copy of the row on a CPU
    first, and torch.isfinite(row).all() a bool copy."""
    if not row.numel():
        return torch.ones((), dtype=torch.bool, device=row.device)
    return torch.isfinite(torch.stack(torch.aminmax(row))).all()


def all_reduce_bytes(numel: int, element_size: int, size: int) -> int:
    """What a rank sends in a bandwidth-optimal all-reduce over `size` ranks."""
    return 2 * (size - 1) * numel * element_size // size


class ReplicaSum:
    """The all-reduce of a row of `numel` elements of `dtype` across the replicas of `group`
    (Note [replica sums]): NCCL's own (`op`), or on gloo the rows over fullshard's routes."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, numel: int, dtype: torch.dtype, uid: int,
                 op: dist.ReduceOp) -> None:
        self.group, self.op, self.numel = group, op, numel
        self.size, self.rank = group.size(), group.rank()
        self.route: Route = route_for(group, device, numel, dtype, uid=uid, kind=ALL_REDUCE)
        self.native = self.route.name == "native"
        self.chunk = math.ceil(numel / self.size)  # R > 2: the elements each replica sums
        if not self.native and self.size > 2:
            self.route = route_for(group, device, self.chunk, dtype, uid=uid, kind=ALL_REDUCE)
            self.second = route_for(group, device, self.chunk, dtype, uid=uid, kind=ALL_REDUCE_GATHER)

    def issue(self, row: torch.Tensor, pool: BufferPool, what: str, timeout: timedelta) -> Flight:
        """Start the all-reduce of `row` ([numel]); `finish` sums into it."""
        route = self.route
        if self.native:
            return Flight(all_reduce(row, self.op, self.group), None, None, what, timeout)
        if self.size == 2:
            sent, payload = route.send_buffer(pool, 1) if route.staged else (None, row)
            if sent is not None:
                payload.copy_(row)
            return route.gather(payload, sent, pool, what, timeout)
        sent, chunks = route.send_buffer(pool, self.size)  # [R, chunk]
        whole, rest = divmod(self.numel, self.chunk)  # chunks all of the row's, then one part of it
        chunks[:whole].copy_(row[: whole * self.chunk].view(whole, self.chunk))
        if whole < self.size:
            chunks[whole, :rest].copy_(row[whole * self.chunk :])
            chunks[whole, rest:].zero_()
            chunks[whole + 1 :].zero_()
        return route.reduce(sent, None, self.op, pool, what, timeout)

    def finish(self, flight: Flight, row: torch.Tensor, pool: BufferPool, streams) -> None:
        """Wait for the all-reduce and leave the sum in `row` (`streams`: routes.stream_runtime's)."""
        route = self.route
        if self.native:
            wait_works(streams, flight.works, flight, on_device=route.on_device)
            return
        before, after = route.finish(flight)
        if self.size == 2:  # one addition: the same in either order, rounded once in any dtype
            row.add_(before[0] if before.size(0) else after[0])
            route.give(flight, pool)
            return
        own = flight.sent[self.rank, route.lead :]  # [chunk]
        sent, payload = self.second.send_buffer(pool, 1)
        add_in_order([*before, own, *after], payload, pool)  # this replica's chunk
        route.give(flight, pool)
        gathered = self.second.gather(payload, sent, pool, flight.what, flight.timeout)
        before, after = self.second.finish(gathered)
        offset = 0
        for chunk in (*before, payload, *after):  # in replica order
            n = min(self.chunk, self.numel - offset)
            if n > 0:
                row[offset : offset + n].copy_(chunk[:n])
            offset += n
        self.second.give(gathered, pool)

    def sent_bytes(self, row: torch.Tensor) -> int:
        """The bytes this rank sends in the all-reduce of `row` (headers apart)."""
        if self.native:
            return all_reduce_bytes(row.numel(), row.element_size(), self.size)
        if self.size == 2:
            return row.nbytes
        return 2 * (self.size - 1) * self.chunk * row.element_size()


def add_in_order(rows: list[torch.Tensor], out: torch.Tensor, pool: BufferPool) -> None:
    """out = rows[0] + rows[1] + ... in this order (bf16 and fp16 rows added in float32, rounded once)."""
    if out.dtype not in LOW_PRECISION:
        out.copy_(rows[0])
        for row in rows[1:]:
            out.add_(row)
        return
    total = pool.take((out.numel(),), torch.float32, out.device)
    total.copy_(rows[0])
    for row in rows[1:]:
        total.add_(row)
    out.copy_(total)
    pool.give(total)


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
        return
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


# ---- one parameter's gradients --------------------------------------------------------------


def take_full_grad(p: ShardedParam) -> torch.Tensor | None:
    """The full parameter's gradient, taken: a plain tensor of the local part, rows first (a
    strided view for Note [another dim]), added to what `hold_grad` kept. A TP gradient still
    a partial sum over the TP ranks (a replicated weight applied to sequence-parallel
    activations) is summed over them first (collectives.redistribute)."""
    grad = p.unsharded.grad
    if isinstance(grad, DTensor):
        want = p.tp_placements  # e.g. from Partial()
        if p.view is not None:  # the data-parallel dims as they are, Note [SPMD meshes]
            spec, dp_dims = p.view
            want = tuple(grad.placements[i] if i in dp_dims else q for i, q in enumerate(spec.placements))
        if tuple(grad.placements) != want:
            grad = redistribute(grad, want, p.caller)
        grad = grad.to_local()
    if grad is not None and p.dim:
        grad = grad.movedim(p.dim, 0)
    if p.accumulated is not None:
        if grad is not None:
            p.accumulated.add_(grad)
        grad, p.accumulated = p.accumulated, None
    p.unsharded.grad = None
    return grad


def hold_grad(p: ShardedParam, dtype: torch.dtype) -> None:
    """After a backward without gradient sync: keep the full gradient summed in `dtype`, the
    reduce dtype, as the reduction would sum it; autograd would accumulate micro-batches in the
    compute dtype (bf16 rounds each sum to 8 bits). A no-op when the two dtypes agree."""
    grad = p.unsharded.grad
    if grad is None or local_values(grad).dtype == dtype:
        return
    grad = take_full_grad(p)
    p.accumulated = grad if grad.dtype == dtype else grad.to(dtype)


def full_grad_bytes(params: list[ShardedParam], frozen_only: bool = False) -> int:
    """Bytes of full gradient this rank holds for `params` (`frozen_only`: for those that take no
    gradient); one call per unit."""
    held = 0
    for p in params:
        if frozen_only and p.sharded.requires_grad:
            continue
        grad = p.unsharded.grad
        if grad is not None:
            held += (grad._local_tensor if isinstance(grad, DTensor) else grad).nbytes
        if p.accumulated is not None:
            held += p.accumulated.nbytes
    return held


def accumulate(p: ShardedParam, spec: DTensorSpec, local_grad: torch.Tensor) -> None:
    """Add this rank's reduced rows (rows first) to the shard's gradient, creating it on first use."""
    shard = p.sharded
    local_grad = local_grad.to(shard._local_tensor.device, shard.dtype)  # offload; the master dtype
    if shard.grad is None:
        shard.grad = DTensor(local_grad.movedim(0, p.dim) if p.dim else local_grad, spec, requires_grad=False)
    else:
        with torch.no_grad():
            grad = shard.grad._local_tensor
            (grad.movedim(p.dim, 0) if p.dim else grad).add_(local_grad)
