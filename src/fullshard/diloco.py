"""DiLoCo across replica groups: each group trains alone for H inner steps, then the groups
average how far each moved (the outer gradient) and take one outer optimizer step from where
they last agreed.

# Note [outer steps]: `DiLoCo` wraps the inner optimizer of a model that fullshard shards inside
# one replica group (its mesh holds no rank of another group) and owns, on each rank, a float32
# host copy of every trainable local shard as it was at the last sync: the anchor. Fragment f
# (a list of units; the whole model by default) syncs after inner step t when t % H equals
# (f + 1) * H // K % H, so the K fragments take turns, each once every H steps. A sync of a
# fragment:
# - outer gradient = anchor - local shard, of each of its parameters, as one float32 row;
# - sent as float32, bfloat16 or int8 blocks (Note [block codes] in blocks.py: one scale per
#   block of 256 values of one parameter), after a header of five int64s: a digest of the
#   fragment's layout and the settings, its index, the inner step, a digest of the fragment's
#   anchors' bits, and whether the replica takes part (1; 0: a replica that healed in this
#   sync, its row zeros). One all-gather over the replica group;
# - every replica decodes the rows that take part and adds them in replica order into a float32
#   sum, divided by their number: the same bits on every replica. A header that differs (another
#   model, fragment or step, or anchors that are not bitwise the same: replicas that drifted
#   apart) or a row holding an inf or a NaN raises a FullShardError on every replica before
#   anything changes;
# - the outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9 by default, DiLoCo's) steps the
#   anchors with that average as their gradient, and the fragment's parameters take the anchors'
#   values: right after a sync every replica holds bitwise the same fragment.
# With overlap, a sync's all-gather is started at its step and finished in the next step's
# call, after that inner step ran (Streaming DiLoCo's overlap of one step): the fragment then
# takes the outer step's result, and that one inner step's change to it is dropped (their
# mixing factor alpha = 0), which keeps the replicas bitwise equal.
# The inner optimizer's state stays each replica's own. Outer state (anchors, the outer
# optimizer's per-parameter state) is laid out as the parameters' shards, so it is part of this
# optimizer's state dict, saved and resharded by fullshard.save/load like any optimizer's
# ("outer_anchor", "outer_<key>", "diloco_step" entries next to the inner optimizer's).
# We wrote our own outer step rather than use torchft's DiLoCo: torchft's all-reduces the
# outer gradients, so a backend sums them in the wire's dtype (no int8 blocks summed in
# float32), and its quantization needs Triton on a GPU. Over torchft, the same outer step runs
# on torchft's Manager (Note [managed syncs] in fullshard/ft/diloco.py): its quorum, its process
# group and its heal.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fullshard.blocks import BLOCK, Codes, blocks_of, decode, encode_, flagged
from fullshard.checks import dp_groups
from fullshard.collectives import Caller, _all_gather_single, all_gather_ints, all_gather_json, site, wait_all
from fullshard.errors import CollectiveError, collective_failed, fail, require
from fullshard.hooks import units_of
from fullshard.mesh import REPLICA_OF, ReplicaOf
from fullshard.param import ShardedParam
from fullshard import runtime
from fullshard.runtime import launched
from fullshard.state_dict import param_names

OUTER_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}
HEADER = 40  # bytes: the layout's and settings' digest, the fragment, the inner step, the anchors' digest, taking part
INT8 = Codes(torch.int8)
LAYOUT = site("DiLoCo's comparison of the replicas' parameters")
NONFINITE = site("DiLoCo's agreement on a non-finite outer gradient")


def nesterov(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum 0.9 at learning rate 0.7."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class Wire:
    """A fragment's outer gradient on the wire in one dtype (Note [outer steps]): float32 and
    bfloat16 as they are, int8 as blocks of one parameter each (their scales first, then the
    codes, each parameter's codes as many as its values)."""

    def __init__(self, dtype: torch.dtype, numels: list[int], device: torch.device) -> None:
        self.dtype, self.numel = dtype, sum(numels)
        self.blocks = sum(blocks_of(n) for n in numels)
        if dtype == torch.int8:  # where each code sits in the blocks, padded to BLOCK values each
            starts, block = [], 0
            for n in numels:
                starts.append(torch.arange(n, device=device) + block * BLOCK)
                block += blocks_of(n)
            self.slots = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.int64, device=device)
            values = 4 * self.blocks + self.numel
        else:
            values = self.numel * dtype.itemsize
        self.nbytes = -(-values // 8) * 8  # rows stay 8-byte aligned in the all-gather's output

    def encode(self, delta: torch.Tensor, out: torch.Tensor) -> None:
        """Write float32 `delta` ([numel]) into `out` ([nbytes] uint8)."""
        if self.dtype != torch.int8:
            out[: self.numel * self.dtype.itemsize].view(self.dtype).copy_(delta)
            return
        padded = torch.zeros(self.blocks * BLOCK, dtype=torch.float32, device=delta.device)
        padded[self.slots] = delta
        scales = encode_(padded.view(self.blocks, BLOCK), INT8, host=delta.device.type == "cpu")
        out[: 4 * self.blocks].view(torch.float32).copy_(scales)
        out[4 * self.blocks : 4 * self.blocks + self.numel].view(torch.int8).copy_(padded[self.slots])

    def add_decoded(self, row: torch.Tensor, total: torch.Tensor) -> None:
        """total ([numel] float32) += the values `row` ([nbytes] uint8) carries."""
        if self.dtype != torch.int8:
            total.add_(row[: self.numel * self.dtype.itemsize].view(self.dtype).float())
            return
        scales = row[: 4 * self.blocks].view(torch.float32)
        codes = torch.zeros(self.blocks * BLOCK, dtype=torch.float32, device=row.device)
        codes[self.slots] = row[4 * self.blocks : 4 * self.blocks + self.numel].view(torch.int8).float()
        values = torch.empty_like(codes)
        decode(codes.view(self.blocks, BLOCK), scales[:, None], values.view(self.blocks, BLOCK), INT8,
               full=flagged(scales, row.device.type == "cpu"))
        total.add_(values[self.slots])


@dataclass
class Fragment:
    """Units synced together, their trainable parameters and anchors (Note [outer steps])."""

    index: int
    names: list[str]
    params: list[ShardedParam]
    anchors: list[nn.Parameter]
    phase: int  # it syncs after inner step t when t % sync_every == phase
    counts: dict  # its first unit's counters (fullshard.stats): its syncs count as traffic across replicas
    digest: int = 0
    wire: Wire | None = None


@dataclass
class InFlight:
    """A fragment's all-gather, started, not yet waited for."""

    fragment: Fragment
    works: list
    rows: torch.Tensor
    step: int
    anchors: int  # the digest of the fragment's anchors' bits, as this replica sent it
    sent: torch.Tensor = field(repr=False, default=None)


class Replicas:
    """The other replica groups DiLoCo exchanges with: here the ranks holding the same shards in
    the other groups of this job, one all-gather over their process group, every sync taken by
    all of them. (fullshard.ft.ManagedReplicas: the groups torchft's quorum of the sync holds.)"""

    managed = False  # whether a sync may fail, and is then redone

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def size(self) -> int:
        """How many rows this sync's all-gather brings."""
        return dist.get_world_size(self.group)

    def begin(self, layout: int) -> bool:
        """Ready for a sync of replicas of the `layout` digest (checked once, when DiLoCo is built);
        whether this replica's outer gradient takes part in it."""
        return True

    def exchange(self, rows: torch.Tensor, sent: torch.Tensor) -> list:
        return [_all_gather_single(rows, sent, group=self.group, async_op=True)]

    def wait(self, works: list, what: str, timeout: timedelta, device: torch.device) -> bool:
        """Whether the all-gather arrived (here it does, or a FullShardError says why not)."""
        try:
            wait_all(works, Caller(what, timeout), on_device=device.type == "cuda")
        except CollectiveError as e:
            raise collective_failed(what, e, timeout=timeout) from None
        return True

    def commit(self) -> bool:
        """Whether every rank of this replica group takes the sync's outer step."""
        return True


class DiLoCo(torch.optim.Optimizer):
    """DiLoCo (Douillard et al., 2023) and its streaming form over replica groups, as an
    optimizer wrapping the inner one (Note [outer steps] in fullshard/diloco.py).

    Args:
        model: the sharded model of this replica group: sharded over the group's own ranks, none
            of `replicas` but this one among them.
        inner: its optimizer (AdamW, Muon, ...), stepped by ``step()``.
        replicas: the process group (or 1-D DeviceMesh) of the ranks holding the same shards in
            the other replica groups, this rank among them.
        sync_every: H, inner steps between two syncs of a fragment (at least 1).
        fragments: K, how many fragments of consecutive units (balanced by parameters), or the
            fragments as lists of units (modules fully_shard sharded), each unit in exactly one.
        outer_optimizer: builds the outer optimizer from the anchors; Nesterov SGD (lr 0.7,
            momentum 0.9) by default.
        outer_dtype: what the outer gradients are sent as: torch.float32, torch.bfloat16 or
            torch.int8 (blocks with a float32 scale each); summed in float32 either way.
        overlap: finish each sync's exchange in the next step's call, overlapping it with that
            inner step.
        timeout: seconds an exchange may take; the model's timeout by default.
    """

    def __init__(self, model: nn.Module, inner: torch.optim.Optimizer, replicas: dist.ProcessGroup | DeviceMesh, *,
                 sync_every: int, fragments: int | list[list[nn.Module]] = 1,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = nesterov,
                 outer_dtype: torch.dtype = torch.float32, overlap: bool = False,
                 timeout: float | None = None) -> None:
        require(isinstance(inner, torch.optim.Optimizer), f"DiLoCo's inner optimizer must be a torch.optim.Optimizer, "
                f"got {type(inner).__name__}", "Pass the optimizer built from the sharded model's parameters.")
        require(type(sync_every) is int and sync_every >= 1, f"DiLoCo(sync_every={sync_every!r}) must be an int of "
                f"at least 1", "Pass how many inner steps go between two syncs, e.g. sync_every=50.")
        require(outer_dtype in OUTER_DTYPES, f"DiLoCo(outer_dtype={outer_dtype!r}) is not offered",
                "Pass torch.float32, torch.bfloat16 or torch.int8.")
        require(type(overlap) is bool, f"DiLoCo(overlap={overlap!r}) must be True or False", "Pass overlap=True.")
        units = units_of(model, "DiLoCo")
        if isinstance(replicas, (dist.ProcessGroup, DeviceMesh)):
            replicas = Replicas(replicas.get_group() if isinstance(replicas, DeviceMesh) else replicas)
        require(isinstance(replicas, Replicas), f"DiLoCo's replicas must be a process group, a 1-D DeviceMesh or "
                f"fullshard.ft.ManagedReplicas, got {type(replicas).__name__}", "Pass mesh['replicate'] of a "
                "(replicate, shard) mesh, or fullshard.ft.ManagedReplicas(manager) over torchft.")
        require(not (overlap and replicas.managed), "DiLoCo(overlap=True) over torchft is not offered: a sync "
                "commits, or is redone, before the next inner step (Note [managed syncs] in fullshard/ft/diloco.py)",
                "Pass overlap=False with fullshard.ft.ManagedReplicas.")
        self.replicas = replicas
        self.inner, self.sync_every, self.outer_dtype, self.overlap = inner, sync_every, outer_dtype, overlap
        self.timeout = timedelta(seconds=timeout) if timeout is not None else units[0].timeout
        self.device = units[0].group.device
        self.model_groups = [g for g in dp_groups(units[0].group) if dist.get_world_size(g) > 1]
        if not replicas.managed:  # torchft's groups are jobs of their own: their world is their own ranks
            check_apart(units, replicas.group)
            setattr(model, REPLICA_OF, ReplicaOf(self.model_groups, own_group(units[0], self.timeout), replicas.group))
        self.fragments = split(model, units, fragments, sync_every)
        self.describe()
        if not replicas.managed:  # torchft's: each sync's headers compare the replicas that take part
            self.check_replicas()
        anchors = [a for f in self.fragments for a in f.anchors]
        self.outer = outer_optimizer(anchors)
        require(isinstance(self.outer, torch.optim.Optimizer), "DiLoCo's outer_optimizer must build a "
                "torch.optim.Optimizer", "Pass e.g. lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, "
                "nesterov=True).")
        self.steps, self.bytes_sent, self.participants = 0, 0, 0  # participants: of the last sync taken
        self.in_flight: list[InFlight] = []
        self.pending: list[tuple[Fragment, torch.Tensor]] = []  # averages received, their outer steps not taken
        self.owner = {p.sharded: (f, i) for f in self.fragments for i, p in enumerate(f.params)}
        super().__init__([p for group in inner.param_groups for p in group["params"]], {})
        self.param_groups = inner.param_groups  # the inner optimizer's: a scheduler changes them there
        self.state = OuterState(self)
        if replicas.managed:
            replicas.bind(model, self)

    def describe(self) -> None:
        """Each fragment's digest of its parameters (by name, shape, dtype) and the settings, and its wire."""
        self.described = [[f.index, name, list(p.local_shape), list(p.global_shape), str(p.sharded.dtype)]
                          for f in self.fragments for name, p in zip(f.names, f.params)]
        self.described.append(["sync_every", self.sync_every, "outer_dtype", OUTER_DTYPES[self.outer_dtype],
                               "overlap", self.overlap])
        self.layout = zlib.crc32(repr(self.described).encode())
        for f in self.fragments:
            f.digest = zlib.crc32(repr([d for d in self.described if d[0] in (f.index, "sync_every")]).encode()) \
                & 0x7FFFFFFF
            f.wire = Wire(self.outer_dtype, [p.sharded.to_local().numel() for p in f.params], self.device)

    def check_replicas(self) -> None:
        """Every replica holds the same fragments of the same parameters (by name, shape, dtype) and
        starts from the same values: a FullShardError on every replica otherwise."""
        described, group = self.described, self.replicas.group
        mine = [self.layout, zlib.crc32(repr([anchor_bits(f) for f in self.fragments]).encode())]
        try:
            everyone = all_gather_ints(mine, device=self.device, timeout=self.timeout, group=group, what=LAYOUT)
            if len({tuple(d[:1]) for d in everyone}) > 1:
                theirs = all_gather_json(described, device=self.device, timeout=self.timeout, group=group)
                differ = [f"replica {r}: {[tuple(d) for d in t if d not in described][:4]}"
                          for r, t in enumerate(theirs) if t != described]
                raise fail(f"DiLoCo's replicas hold other parameters, fragments or settings ((fragment, name, "
                           f"local shape, shape, dtype), or the settings, this replica lacks: {'; '.join(differ)})",
                           "Build the same model on every replica group, shard it alike over a group of the same "
                           "size, and pass the same fragments, sync_every, outer_dtype and overlap.")
            if len({tuple(d[1:]) for d in everyone}) > 1:
                raise fail("DiLoCo's replicas start from different parameter values",
                           "Seed every replica group alike before building the model, or load the same checkpoint "
                           "into each, before building DiLoCo.")
        except CollectiveError as e:
            raise collective_failed("comparing DiLoCo's replicas", e, "Every replica must build DiLoCo at the same "
                                    "time; another did not, or died.", self.timeout) from None

    @torch.no_grad()
    def step(self, closure=None):
        """One inner step; then the syncs that are due (Note [outer steps]). Returns the inner
        step's loss (what its closure returned)."""
        loss = self.inner.step(closure)
        self.steps += 1
        if self.replicas.managed:
            if self.due():
                self.sync_managed()
            return loss
        self.finish()  # with overlap: the syncs started a step ago
        self.in_flight = [self.start(f) for f in self.due()]
        if not self.overlap:
            self.finish()
        return loss

    def due(self) -> list[Fragment]:
        """The fragments that sync after the inner step just taken."""
        return [f for f in self.fragments if self.steps % self.sync_every == f.phase]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the syncs in flight and take their outer steps (with overlap, call it after
        the last step)."""
        self.receive()
        pending, self.pending = self.pending, []
        for f, average in pending:
            self.apply(f, average)

    def receive(self) -> None:
        """Wait for the syncs in flight and keep their averages, to apply at the next finish()."""
        flights, self.in_flight = self.in_flight, []
        self.pending += [(flight.fragment, self.average(flight)) for flight in flights]

    @torch.no_grad()
    def sync_managed(self) -> None:
        """The sync due now over torchft (Note [managed syncs] in fullshard/ft/diloco.py): taken
        when this group's step commits; otherwise nothing changed, and it is redone in a new quorum."""
        while True:
            taking_part = self.replicas.begin(self.layout)  # a heal here replaces this replica's state by a live one's
            due = self.due()
            require(len(due) == 1, f"DiLoCo healed to inner step {self.steps}, at which no sync is due",
                    "Give every replica group the same fragments and sync_every.")
            average = self.average(self.start(due[0], taking_part))
            if self.replicas.commit() and average is not None:
                self.apply(due[0], average)
                return

    def start(self, f: Fragment, taking_part: bool = True) -> InFlight:
        """The fragment's outer gradient (zeros if it does not take part) on its way to every replica."""
        delta = torch.cat([anchor.to(self.device) - p.sharded.to_local().float().reshape(-1)
                           for anchor, p in zip(f.anchors, f.params)])
        if not taking_part:
            delta.zero_()
        count, anchors = self.replicas.size(), anchor_bits(f)
        sent = torch.zeros(HEADER + f.wire.nbytes, dtype=torch.uint8, device=self.device)
        sent[:HEADER].view(torch.int64).copy_(torch.tensor([f.digest, f.index, self.steps, anchors, int(taking_part)]))
        f.wire.encode(delta, sent[HEADER:])
        rows = torch.empty(count * sent.numel(), dtype=torch.uint8, device=self.device)
        self.bytes_sent += (count - 1) * sent.numel()
        f.counts["all_reduces"] += 1
        f.counts["all_reduce_bytes"] += (count - 1) * sent.numel()
        works = self.replicas.exchange(rows, sent)
        return InFlight(f, launched(works, reads=[sent], writes=[rows]), rows.view(count, -1), self.steps, anchors,
                        sent)

    def average(self, flight: InFlight) -> torch.Tensor | None:
        """The outer gradients of the replicas that take part, checked and averaged in float32 in
        replica order (the same bits on every replica); None if the all-gather failed over torchft
        (the sync is then redone); a FullShardError, with nothing changed, if a replica sent another
        fragment, step or anchors, or an inf or NaN."""
        f = flight.fragment
        what = f"DiLoCo's all-gather of fragment {f.index}'s outer gradient after inner step {flight.step}"
        if not self.replicas.wait(flight.works, what, self.timeout, self.device):
            return None
        count = flight.rows.shape[0]
        total = torch.zeros(f.wire.numel, dtype=torch.float32, device=self.device)
        finite = torch.empty(count, dtype=torch.int64, device=self.device)
        header = flight.rows[:, :HEADER].contiguous().view(torch.int64)  # [R, 5]
        for r in range(count):  # in replica order: the same sum on every replica
            value = torch.zeros_like(total)
            f.wire.add_decoded(flight.rows[r, HEADER:], value)
            finite[r] = torch.isfinite(value).all()
            total.add_(torch.where(header[r, 4] == 1, value, 0.0))  # a row that does not take part counts 0
        seen = runtime.active.read_on_host(torch.cat([header, finite[:, None]], dim=1), timeout=self.timeout,
                                           what=what)  # [R, 6]: the sync's one host read
        mine = (f.digest, f.index, flight.step, flight.anchors)
        for r, (*theirs, part, _) in enumerate(seen):
            if part and tuple(theirs) != mine:
                raise fail(f"{what}: replica {r} sent fragment {theirs[1]} after its inner step {theirs[2]} (layout "
                           f"{theirs[0]}, anchors {theirs[3]}), this replica fragment {f.index} after step "
                           f"{flight.step} (layout {f.digest}, anchors {flight.anchors})",
                           "Give every replica group the same model, fragments, sync_every and outer_dtype, start "
                           "them from the same values, and step them alike (resume every group from checkpoints "
                           "of the same step).")
        taking_part = sum(part for *_, part, _ in seen)
        bad = sum((1 - ok) << r for r, (*_, part, ok) in enumerate(seen) if part)  # a bit per replica with an inf or NaN
        try:  # the other shards of this replica's model decide alike, or they would go on without it
            for group in self.model_groups:
                for (code,) in all_gather_ints([bad], device=self.device, timeout=self.timeout, group=group,
                                               what=NONFINITE):
                    bad |= code
        except CollectiveError as e:
            raise collective_failed(what, e, timeout=self.timeout) from None
        if bad:
            replicas = [r for r in range(count) if bad >> r & 1]
            raise fail(f"{what}: the outer gradient of replica {', '.join(map(str, replicas))} is not finite (inf or NaN); "
                       f"the outer step was not taken and the parameters are as they were",
                       "Lower the inner learning rate or clip the inner gradients (fullshard.clip_grad_norm_), "
                       "then resume from the last checkpoint.")
        self.participants = taking_part
        return total.div_(taking_part)

    def apply(self, f: Fragment, average: torch.Tensor) -> None:
        """The outer step of one fragment: its anchors step with `average` as their gradient, and
        its parameters take their values."""
        for anchor in (a for other in self.fragments for a in other.anchors):
            anchor.grad = None
        for anchor, piece in zip(f.anchors, average.split([a.numel() for a in f.anchors])):
            anchor.grad = piece.to(anchor.device)
        self.outer.step()
        for anchor, p in zip(f.anchors, f.params):
            anchor.grad = None
            local = p.sharded.to_local()
            local.copy_(anchor.view_as(local))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """The inner optimizer's entries to it; "outer_anchor", "outer_pending", "outer_<key>"
        and "diloco_step" to the anchors, the averages not yet applied, the outer optimizer and
        the step count (what a sync in flight would have brought is replaced)."""
        self.receive()
        params = [p for group in self.param_groups for p in group["params"]]
        inner_state, outer_state, anchors, pending, steps = {}, {}, {}, {}, None
        for index, values in state_dict["state"].items():
            mine = {k: v for k, v in values.items() if k.startswith(("outer_", "diloco_"))}
            inner_state[index] = {k: v for k, v in values.items() if k not in mine}
            if params[index] not in self.owner:
                continue
            f, i = self.owner[params[index]]
            position = sum(len(other.anchors) for other in self.fragments[: f.index]) + i
            anchors[position] = local_part(mine.get("outer_anchor"))
            if "outer_pending" in mine:
                pending.setdefault(f.index, {})[i] = local_part(mine["outer_pending"])
            outer_state[position] = {k[len("outer_"):]: flat_like(local_part(v), f.anchors[i]) for k, v in mine.items()
                                     if k.startswith("outer_") and k not in ("outer_anchor", "outer_pending")}
            if "diloco_step" in mine:
                steps = step_of(mine["diloco_step"])
        self.inner.load_state_dict({"state": inner_state, "param_groups": state_dict["param_groups"]})
        self.param_groups = self.inner.param_groups  # torch's load made new groups: a scheduler changes those
        self.pending = []  # what the state holds replaces what was received
        flat = [a for f in self.fragments for a in f.anchors]
        for position, value in anchors.items():
            if value is not None:
                flat[position].detach().copy_(value.reshape(-1))
        groups = self.outer.state_dict()["param_groups"]
        self.outer.load_state_dict({"state": {k: v for k, v in outer_state.items() if v}, "param_groups": groups})
        for index, pieces in sorted(pending.items()):
            f = self.fragments[index]
            self.pending.append((f, torch.cat([pieces[i].reshape(-1).float() for i in range(len(f.params))])))
        if steps is not None:
            self.steps = steps


class OuterState(Mapping):
    """The state of each parameter as a checkpoint sees it: the inner optimizer's, and this
    rank's outer state laid out as the parameter's shards (Note [outer steps])."""

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco

    def __getitem__(self, param: torch.Tensor) -> dict:
        d = self.diloco
        d.receive()  # a sync in flight arrives: its average is kept, as state, until the next step applies it
        values = dict(d.inner.state.get(param, {}))
        if param not in d.owner:
            return values
        f, i = d.owner[param]
        p, anchor = f.params[i], f.anchors[i]
        values["outer_anchor"] = p.as_dtensor(anchor.detach().view(p.local_shape))
        for fragment, average in d.pending:
            if fragment is f:
                start = sum(a.numel() for a in f.anchors[:i])
                values["outer_pending"] = p.as_dtensor(average[start : start + anchor.numel()].view(p.local_shape))
        for key, value in d.outer.state.get(anchor, {}).items():
            shaped = isinstance(value, torch.Tensor) and value.shape == anchor.shape
            values[f"outer_{key}"] = p.as_dtensor(value.view(p.local_shape)) if shaped else value
        values["diloco_step"] = torch.tensor(float(d.steps))
        return values

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([p for group in self.diloco.param_groups for p in group["params"]])

    def __len__(self) -> int:
        return sum(len(group["params"]) for group in self.diloco.param_groups)


def anchor_bits(f: Fragment) -> int:
    """A digest of the fragment's anchors' bits: replicas that are bitwise alike agree on it."""
    return int(sum(int(a.detach().view(torch.int32).sum(dtype=torch.int64)) for a in f.anchors) % (1 << 62))


def own_group(unit, timeout: timedelta) -> dist.ProcessGroup:
    """A process group of the ranks this rank's replica group shards its model over (a group of
    one rank included): every rank of the job learns every replica group's and makes them all,
    in one order, as making a group takes."""
    mine = sorted(unit.group.mesh.mesh.flatten().tolist())
    try:
        everyone = all_gather_json(mine, device=unit.group.device, timeout=timeout)
    except CollectiveError as e:
        raise collective_failed("DiLoCo's exchange of the replica groups' ranks", e, "Every rank of the job must "
                                "build DiLoCo at the same time; another did not, or died.", timeout) from None
    groups = sorted({tuple(ranks) for ranks in everyone})
    require(sum(len(g) for g in groups) == dist.get_world_size() and len(set().union(*groups)) ==
            dist.get_world_size(), f"DiLoCo's replica groups overlap or leave ranks out ({groups})",
            "Shard each replica group's model over its own ranks, every rank of the job in one group.")
    own, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups], backend="gloo", timeout=timeout)
    return own


def step_of(value: Any) -> int:
    """A saved "diloco_step": a whole number of inner steps, else a FullShardError (before anything loads)."""
    number = float(value) if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1) \
        else float("nan")
    require(number == number and 0 <= number < 2**62 and number == int(number), f"DiLoCo's saved diloco_step is "
            f"{value!r}, not a count of inner steps", "Load a state dict or checkpoint that DiLoCo saved.")
    return int(number)


def local_part(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def flat_like(value: Any, anchor: torch.Tensor) -> Any:
    """An outer state value laid out as the parameter's shard, as its anchor holds it: flat."""
    shaped = isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == anchor.numel()
    return value.reshape(-1) if shaped else value


def check_apart(units: list, group: dist.ProcessGroup) -> None:
    """The replica group holds no rank the model is sharded or replicated over but this one:
    otherwise the model's own all-reduce would already average what DiLoCo averages."""
    replicas = set(dist.get_process_group_ranks(group))
    for unit in units:
        shared = replicas & set(unit.group.mesh.mesh.flatten().tolist())
        if shared != {dist.get_rank()}:
            raise fail(f"DiLoCo's replica group holds ranks {sorted(shared)} that unit {unit.fqn or 'the root'!r} "
                       f"is sharded over", "Shard the model over each replica group's own ranks (mesh['shard'] of a "
                       "(replicate, shard) mesh) and pass the other dim, mesh['replicate'], to DiLoCo.")


def consecutive_parts(sizes: list[int], k: int) -> list[list[int]]:
    """`k` runs of consecutive indices of `sizes` whose largest total is the smallest possible."""
    def pack(limit: int) -> list[list[int]]:
        parts: list[list[int]] = [[]]
        for i, size in enumerate(sizes):
            if parts[-1] and sum(sizes[j] for j in parts[-1]) + size > limit:
                parts.append([])
            parts[-1].append(i)
        return parts

    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if len(pack(middle)) <= k else (middle + 1, high)
    parts = pack(low)
    while len(parts) < k:  # split a run in two: no run grows
        at = next(i for i, part in enumerate(parts) if len(part) > 1)
        parts[at : at + 1] = [parts[at][:-1], parts[at][-1:]]
    return parts


def split(model: nn.Module, units: list, fragments: int | list[list[nn.Module]], sync_every: int) -> list[Fragment]:
    """The fragments, each with its trainable parameters, a float32 host copy of each (the
    anchors) and its phase among the syncs (Note [outer steps])."""
    trainable = [u for u in units if any(p.sharded.requires_grad for p in u.params)]
    if isinstance(fragments, bool) or not isinstance(fragments, (int, list)):
        raise fail(f"DiLoCo(fragments={fragments!r}) must be a count or lists of units",
                   "Pass fragments=4, or [[model.layers[0], model.layers[1]], [model.layers[2], model]].")
    if isinstance(fragments, int):
        require(1 <= fragments <= len(trainable), f"DiLoCo(fragments={fragments}) must be from 1 to the "
                f"{len(trainable)} units with trainable parameters", "Pass fewer fragments.")
        sizes = [sum(p.sharded.numel() for p in u.params if p.sharded.requires_grad) for u in trainable]
        groups = [[trainable[i] for i in part] for part in consecutive_parts(sizes, fragments)]
    else:
        by_module = {m: u for u in units for m in u.modules}
        groups, seen = [], {}
        for k, modules in enumerate(fragments):
            if not isinstance(modules, (list, tuple)) or not modules:
                raise fail(f"DiLoCo's fragment {k} is {modules!r}, not a non-empty list of units",
                           "Pass each fragment as a list of modules fully_shard sharded.")
            group = []
            for m in modules:
                unit = by_module.get(m)
                if unit is None:
                    raise fail(f"DiLoCo's fragment {k} holds a {type(m).__name__} that is not one of the model's "
                               f"units", "List modules that fully_shard (or shard_model) sharded.")
                if unit in seen:
                    raise fail(f"DiLoCo: unit {unit.fqn or 'the root'!r} is in fragments {seen[unit]} and {k}",
                               "Put each unit in exactly one fragment.")
                seen[unit] = k
                group.append(unit)
            groups.append(group)
        missing = [u.fqn or "the root" for u in trainable if u not in seen]
        if missing:
            raise fail(f"DiLoCo's fragments leave out units {missing[:6]}: their parameters would never sync",
                       "Put every unit with trainable parameters in a fragment.")
    require(len(groups) <= sync_every, f"DiLoCo: {len(groups)} fragments take turns within sync_every="
            f"{sync_every} steps, one a step at most", f"Pass sync_every of at least {len(groups)}, or fewer fragments.")
    names, out = param_names(model), []
    for k, group in enumerate(groups):
        params = [p for u in group for p in u.params if p.sharded.requires_grad]
        anchors = [nn.Parameter(p.sharded.to_local().detach().to("cpu", torch.float32, copy=True).reshape(-1),
                                requires_grad=False) for p in params]
        out.append(Fragment(k, [names[p.sharded] for p in params], params, anchors,
                            (k + 1) * sync_every // len(groups) % sync_every, group[0].counts))
    return out
