"""Unit: the parameters of one fully_shard call, communicated together.

A training step moves every unit through the same cycle (hooks.py decides when):

    SHARDED --unshard()--> GATHERING --wait_unshard()--> FULL     before the unit's forward
    FULL    --reshard()-->                               SHARDED  after forward if it frees then
    SHARDED --unshard()--> GATHERING --wait_unshard()--> FULL     before the unit's backward
    FULL    --reduce_grads(), reshard()-->               SHARDED  after the unit's backward,
                                                                  its reduction in flight
    finish_reduce() lands that reduction on the shards' gradients a little later.

(A unit whose shards are its full parameters, one rank in the same dtype, goes from
SHARDED to FULL at wait_unshard without gathering.) Every transition checks the state
it starts from (`move`).

# Note [smaller world after forward]: with reshard_after_forward=k (an int), freeing after
# forward first keeps this rank's 1/k of the full parameters: the shards of a block of
# world/k ranks. Its group of k consecutive ranks (mesh.smaller_group) then holds every
# row, so the gather before backward runs inside that group (within a node when k is
# the ranks per node), with the same code as a normal gather over k ranks whose shards
# are world/k times longer. The copy is dropped once used, or at the next forward.

Between steps every unit is SHARDED with no collective in flight: the modules hold
the DTensor shards, which is all the optimizer sees. While FULL, the modules hold the
full parameters (plain tensors, or DTensors on a tensor-parallel or SPMD mesh), views of
one storage per unit that exists only while needed.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum, auto

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from fullshard import runtime
from fullshard.collectives import (BufferPool, Caller, PendingGather, PendingReduce, all_gather_ints,
                                   all_reduce_tensors, finish_gather, finish_reduce, gather_full, redistribute,
                                   reduce_scatter_grads, site)
from fullshard.errors import DIVERGED, FullShardError, collective_failed, fail
from fullshard.mesh import ShardGroup, smaller_group
from fullshard.options import UnitOptions, UnitSwitches
from fullshard.extension import has_extension
from fullshard.layout import UnitLayout
from fullshard.quantize import BlockQuantized
from fullshard.param import ShardedParam, local_values, rows_first, shard_numel
from fullshard.runtime import CollectiveError, MismatchedRows, labelled
from fullshard.stats import Stats
from fullshard.tags import KINDS

DEBUG_CHECK = site("the debug check")


class ShardState(Enum):
    SHARDED = auto()  # the modules hold the shards; no gather in flight
    GATHERING = auto()  # a gather into the full storage is in flight (`pending`)
    FULL = auto()  # the modules hold the full parameters


@dataclass(frozen=True)
class OwnedParam:
    """A parameter a unit will manage, with every place it is registered (made by fully_shard's
    init steps, each a new record)."""

    param: nn.Parameter
    fqn: str  # relative to the unit's module
    slots: tuple[tuple[nn.Module, str], ...]
    dim: int = 0  # the dim it is split along (FSDP2's shard_placement_fn, Note [another dim])
    view: tuple[DTensorSpec, frozenset[int]] | None = None  # Note [SPMD meshes]: its spec there, the dp dims
    mesh: object = None  # a DeviceMesh of its own (FSDP2's ShardPlacementResult, Note [meshes of one call]); None: the call's


LIVE_UNITS: weakref.WeakSet[Unit] = weakref.WeakSet()  # every Unit adds itself (no weakrefs to parameters:
# materialize swaps them)


def unit_of(param: nn.Parameter) -> Unit | None:
    """The live unit that manages `param` (a sharded parameter), if any (a scan: for checks, not steps)."""
    return next((unit for unit in list(LIVE_UNITS) if any(p.sharded is param for p in unit.params)), None)


def next_uid(after: int = -1) -> int:
    """An id above every live unit's (and `after`): what this rank proposes for a new unit
    (Note [named hangs]; check_ranks_agree takes the largest any rank proposes)."""
    return max([after, *(unit.uid for unit in list(LIVE_UNITS))]) + 1


def described(uid: int, whole_model: bool = False) -> str:
    """The live unit of id `uid` in words, for messages: "unit 'h.1' of model 12 (GPT)" (the
    model alone: "model 12 (GPT)")."""
    unit = next((unit for unit in list(LIVE_UNITS) if unit.uid == uid), None)
    if unit is None:
        return f"the {'model' if whole_model else 'unit'} of id {uid}, which this rank does not have"
    return unit.model if whole_model else unit.described


def sharded_params(units: Iterable[Unit]) -> dict[nn.Parameter, ShardedParam]:
    """The parameter each ShardedParam of `units` puts in the modules between steps (its
    shard, a DTensor), mapped to it: how state dicts, checkpoints and deferred init find
    what a parameter of the model is."""
    return {p.sharded: p for unit in units for p in unit.params}


class Unit:
    """The shards of one unit, their all-gather into full parameters, and their gradient reduction."""

    def __init__(self, modules: list[nn.Module], owned: list[OwnedParam], group: ShardGroup,
                 options: UnitOptions, uid: int) -> None:
        self.uid = uid  # agreed by every rank of its groups, Note [named hangs]
        self.modules = modules  # one, or FSDP2's group of modules sharded together (Note [module groups])
        self.module = modules[0]
        self.group = group
        self.options = options
        self.switches = UnitSwitches()
        self.fqn = ""  # set by the root at lazy init (join), for messages and profiler labels
        self.class_name = type(self.module).__name__  # before fully_shard swaps the class, for messages
        self.model = f"model {uid} ({self.class_name})"  # the root's (join), for messages
        self.index = 0  # position among the root's units (lazy init), for the non-finite check
        self.names = [""]  # every unit's fqn by index (lazy init), for messages
        self.step = 0  # the root's step count, for messages
        self.evaluating = False  # in a forward without gradients, for the debug checks
        self.finite: torch.Tensor | None = None  # 0-d bool on the device: every reduced gradient so far was finite
        self.unlanded: list[tuple[list[ShardedParam], torch.Tensor, torch.Tensor]] = []  # Note [landing]
        self.pool = BufferPool()  # the root's pool after lazy init, shared by its units
        self.stats = Stats()  # likewise the root's
        self.layout = UnitLayout([shard_numel(rows_first(local_values(o.param).shape, o.dim), group.world)
                                  for o in owned], [has_extension(local_values(o.param)) for o in owned], group)
        self.layout.set_dtypes([o.param.dtype for o in owned], options)
        self.compute_device = torch.device("meta") if any(o.param.is_meta for o in owned) else group.device
        segments = self.layout.allocate(self.compute_device, options)
        self.params = [ShardedParam(o.param, o.slots, o.fqn, group, *segment, o.dim, o.view)
                       for o, segment in zip(owned, segments)]
        self.make_quantizers()
        self.release_storage()
        for p in self.params:
            p.to_sharded()
        self.state = ShardState.SHARDED
        LIVE_UNITS.add(self)
        self.pending: PendingGather | None = None  # while GATHERING
        self.pending_reduce: list[tuple[list[ShardedParam], bool, PendingReduce]] = []  # one per reduce dtype
        self.small_group = smaller_group(group, options.post_forward_world) if self.layout.full_flat is not None else None
        self.small: torch.Tensor | None = None  # Note [smaller world after forward]
        self.gathering_small = False
        self.unset: set[str] = set()  # parameters of a meta-built unit that assign=True loads have not reached
        self.owes_all_reduce = False  # reduced within the group only (all_reduce_grads off)
        self.reduced = False  # a reduction finished in this backward (hooks settle the all-reduce once)
        self.counted_grad_bytes = 0  # full gradient bytes already in stats.full_grad_bytes
        self.callers: dict[tuple[int, str, int], Caller] = {}  # caller()'s, for the current step

    # ---- what configures it ----------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        return self.switches.timeout

    def switch(self, **fields: object) -> None:
        """Change switches (FSDP2's setters): a new UnitSwitches with these fields."""
        self.switches = dataclasses.replace(self.switches, **fields)
        self.callers.clear()

    def relayout(self, *, options: UnitOptions | None = None, device: torch.device | None = None,
                 dtypes: list[torch.dtype] | None = None) -> None:
        """The one entry point for what the unit derives from its options, device and dtypes
        (set_reshard_after_forward's new options; Module.to_empty / .to / .double(), deferred
        init and a first assign-load giving a meta-built unit storage on `device`, in `dtypes`).
        Storage is remade only for a new device: the shards keep the values they hold (none for
        meta). Which parameters are trainable is read at each reduction, not kept."""
        if options is not None:
            self.options = options
            if self.state is not ShardState.GATHERING:  # a gather may be reading the 1/k copy
                self.drop_small()
        if device is not None:
            assert self.state is ShardState.SHARDED, f"relayout(device=...) in state {self.state.name}"
            self.compute_device = device
            self.unset = set()
            if dtypes is not None:
                self.layout.set_dtypes(dtypes, self.options)
            for p, segment in zip(self.params, self.layout.allocate(device, self.options)):
                p.rebind(*segment)
            self.make_quantizers()
            self.release_storage()
        self.small_group = smaller_group(self.group, self.options.post_forward_world) \
            if self.layout.full_flat is not None else None

    def join(self, fqn: str, index: int, names: list[str], model: str, pool: BufferPool, stats: Stats) -> None:
        """Lazy init: the root names the unit and its model and shares its buffers and statistics with it."""
        self.fqn, self.index, self.names, self.model, self.pool, self.stats = fqn, index, names, model, pool, stats
        self.callers.clear()

    @property
    def described(self) -> str:
        return f"unit {self.fqn or self.class_name!r} of {self.model}"

    def begin_forward(self, step: int, evaluating: bool) -> None:
        """The root starts a forward: the step counts on, and a copy a forward without backward left goes."""
        self.drop_small()
        self.step, self.evaluating = step, evaluating
        self.callers.clear()

    def begin_backward(self) -> None:
        self.evaluating = False

    def clear_finite(self) -> None:
        """The non-finite flag was read (hooks' settle_nonfinite)."""
        self.finite = None

    def reset(self) -> None:
        """Drop the step in flight (a backward that raised): sharded, nothing pending, no full gradient."""
        self.finish_reduce()
        self.unlanded.clear()
        self.finite = None
        self.reduced = False
        self.reshard()
        for p in self.params:
            p.drop_full_grad()
        self.count_full_grads(0)

    def move(self, to: ShardState, *starts: ShardState) -> None:
        """Change state, checking the transition starts from one of `starts`."""
        assert self.state in starts, f"unit {self.fqn!r}: {self.state.name} -> {to.name}, expected from " \
                                     f"{'/'.join(s.name for s in starts)}"
        self.state = to

    # ---- storage -----------------------------------------------------------------

    def make_quantizers(self) -> None:
        """Note [int8 gathers]: a quantizer for each floating-point parameter of more than 0 dims
        (None for the others), when the options ask for int8 gathers."""
        block = self.options.gather_block
        self.quantized = [BlockQuantized(numel, block, self.compute_device)
                          if block is not None and dtype.is_floating_point and not p.replicated and p.extension is None
                          else None for p, numel, dtype in zip(self.params, self.layout.shard_numels, self.layout.master_dtypes)]

    def release_storage(self) -> None:
        for p, quantizer in zip(self.params, self.quantized):
            if p.extension is not None:
                p.extension.free()
            if quantizer is not None:
                quantizer.free()
        self.layout.release()

    # ---- all-gather -------------------------------------------------------------

    def unshard(self, adopt: bool = True) -> None:
        """Start gathering the full parameters; a no-op when full or already gathering.
        `adopt`: first take parameters assigned in the shards' place (the hooks scan for them
        once per step instead, at the root's forward: Note [replaced parameters])."""
        if self.state is not ShardState.SHARDED:
            return
        if adopt:
            self.adopt_replaced()  # before the gather reads the shards
        if self.unset or self.compute_device.type == "meta":
            self.check_has_values()
        if self.layout.full_flat is None:
            return
        if self.switches.debug:
            self.check_agreement(0)
        self.gathering_small = self.small is not None
        source, group = ([self.small], self.small_group) if self.gathering_small else (self.layout.shards, self.group.shard_pg)
        as_bytes = self.layout.wire_dtype == torch.uint8 and not self.gathering_small  # `small` is bytes already
        kinds = self.layout.full_dtypes
        if self.layout.transformed and not self.gathering_small:
            source, kinds = self.wire_inputs()
        with labelled(f"fullshard::gather {self.fqn}"):
            self.layout.full_flat.untyped_storage().resize_(self.layout.full_bytes)  # on the compute stream, Note [streams]
            runtime.active.allocated(self.layout.full_flat)
            self.stats.full_params(self.layout.full_bytes)
            self.pending = gather_full(source, group=group, dtype=self.layout.wire_dtype, device=self.compute_device,
                                       pool=self.pool, caller=self.caller(0, "all-gather"),
                                       bytes_of=kinds if as_bytes else None)
        self.move(ShardState.GATHERING, ShardState.SHARDED)
        if group is not None:
            self.stats.count(self.fqn, "gather", self.pending.sent_bytes)

    def wait_unshard(self, adopt: bool = True) -> None:
        """Finish the gather and register the full parameters on the modules (`adopt`: as unshard's)."""
        if self.state is ShardState.FULL:
            replaced = next((p for p in self.params if p.replacement(full=True) is not None), None)
            if replaced is not None:
                raise fail(f"parameter {replaced.fqn!r} was replaced after sharding, while its unit held its full "
                           f"parameters (e.g. after a forward without backward); fullshard would silently put its "
                           f"own back", "Make such changes before sharding (e.g. crop_block_size or "
                           "resize_token_embeddings before shard_model), between training steps (load_state_dict("
                           "assign=True) of a sharded or full state dict), or in place inside `with "
                           "fullshard.full_params(model):`.")
            return
        if adopt and self.state is ShardState.GATHERING:  # a prefetch: replaced parameters drop what it gathered
            self.adopt_replaced()
        self.unshard(adopt)  # adopts replaced parameters unless already gathering (a prefetch: scanned above)
        if self.layout.full_flat is not None:
            start = time.perf_counter()
            with labelled(f"fullshard::wait gather {self.fqn}"):
                self.finish_gather()
            self.stats.waited(time.perf_counter() - start)
            runtime.active.reads(self.layout.full_flat)  # forward and backward compute with it
            with torch.no_grad():
                for p, dtype in zip(self.params, self.layout.full_dtypes):
                    if p.replicated and p.sharded.dtype == dtype:  # every rank's copy equal to
                        # the one used, Note [shard layout]; offload: to the host, no wait
                        runtime.active.copy_(p.local_shard(), local_values(p.unsharded))
                for p, dtype, quantizer in zip(self.params, self.layout.full_dtypes, self.quantized):
                    if p.extension is not None:  # Note [all-gather extensions]
                        p.rebuild_full(dtype)
                    elif quantizer is not None and quantizer.outputs and not self.gathering_small:
                        quantizer.dequantize(p.full_padded, self.group.world)  # Note [int8 gathers]
        for p in self.params:  # ShardedParam.to_full, inline: once per parameter per gather
            full, shard = p.unsharded, p.sharded
            if full.requires_grad != shard.requires_grad:
                full.requires_grad_(shard.requires_grad)
            for module, name in p.slots:
                module._parameters[name] = full
        self.move(ShardState.FULL, ShardState.SHARDED)  # finish_gather left GATHERING

    def check_has_values(self) -> None:
        """Refuse to gather a unit still on the meta device, or one that assign=True loads gave
        only some of its values (a forward would compute with zeros)."""
        if self.compute_device.type == "meta" or self.unset:
            what = "its parameters are on the meta device" if self.compute_device.type == "meta" else \
                f"parameters {sorted(self.unset)} were given no values by load_state_dict(assign=True)"
            raise fail(f"unit {self.fqn or type(self.module).__name__!r} cannot run: {what}",
                       "Give every parameter values first: model.to_empty(device=...) then initialize (e.g. "
                       "reset_parameters()), or load_state_dict(..., assign=True) of every parameter.")

    # Note [replaced parameters]: load_state_dict(assign=True), or a user's assignment, may put
    # another tensor in a shard's place between steps; the unit takes it as the shard
    # (adopt_replaced). Looking costs a check of every slot of every parameter, so the root
    # looks once per step, at the start of its forward, for every unit under it; unshard()
    # called by a user looks again (a load may have happened since). A replacement while a
    # unit is FULL (after a forward without backward) is refused by wait_unshard, which the
    # hooks run before every use of a full unit.

    def adopt_replaced(self) -> None:
        """Take parameters assigned in the shards' place between steps (load_state_dict(assign=True))
        as the shards (ShardedParam.adopt); a unit still on the meta device gets storage first,
        its other parameters waiting for theirs (a checkpoint loaded file by file), and a gather
        in flight (a prefetch of the old values) is dropped."""
        moved = False  # the usual answer, found without a call per parameter
        for p in self.params:
            for module, name in p.slots:
                moved |= module._parameters.get(name) is not p.sharded
        if not moved:
            return
        replaced = [(p, new) for p in self.params if (new := p.replacement(full=False)) is not None]
        if self.compute_device.type == "meta" and not replaced[0][1].is_meta:
            self.relayout(device=self.group.device if self.options.offload else replaced[0][1].device)
            self.unset = {p.fqn for p in self.params}
        self.unset -= {p.fqn for p, _ in replaced}
        if self.state is ShardState.GATHERING:
            self.finish_gather()
            self.release_storage()
            self.stats.full_params(-self.layout.full_bytes)
        for p, new in replaced:
            p.adopt(new)

    def caller(self, kind: int, collective: str) -> Caller:
        """Note [named hangs]: this unit's name, timeout and id for its collective of `kind`
        (an index into tags.KINDS); made once per step."""
        key = (kind, collective, self.step)
        caller = self.callers.get(key)
        if caller is None:
            caller = self.callers[key] = Caller(f"the {collective} of {self.described} at step {self.step}",
                                                self.switches.timeout, self.uid, kind)
        return caller

    def wire_inputs(self) -> tuple[list[torch.Tensor], list[torch.dtype]]:
        """What a unit sends when some parameters go on the wire transformed: the others'
        shards, each extension parameter's fsdp_pre_all_gather tensors, each quantized one's
        int8 blocks and scales; and the dtype each goes as (its bytes)."""
        sources, kinds = [], []
        for p, shard, dtype, quantizer in zip(self.params, self.layout.shards, self.layout.full_dtypes, self.quantized):
            if quantizer is not None:
                q, scales = quantizer.inputs(shard)
                sources += [q, scales]
                kinds += [torch.int8, torch.float32]
                continue
            if p.extension is None:
                sources.append(shard)
                kinds.append(dtype)
                continue
            local = p.sharded._local_tensor
            if self.options.offload:
                local = local.to(self.compute_device)
            inputs = p.extension.inputs(local, p.rows_per_shard, mesh=self.group.shard_mesh, outer=p.global_shape,
                                        module=self.module, mp_policy=self.layout.extension_policy)
            sources += inputs
            kinds += [t.dtype for t in inputs]
        return sources, kinds

    def finish_gather(self) -> None:
        """Wait for the gather in flight into the full parameters; drop the copy it gathered from."""
        fulls = self.gather_targets(self.gathering_small)
        ranks = self.small_group.size() if self.gathering_small else self.group.world
        numels = [full.numel() // ranks for full in fulls]  # of the wire dtype, per rank of the gathering group
        try:
            finish_gather(self.pending, fulls, numels, self.pool)
        except CollectiveError as e:
            raise self.failed("all-gather", e) from None
        self.pending = None
        self.move(ShardState.SHARDED, ShardState.GATHERING)  # gathered into storage the modules do not hold yet
        if self.gathering_small:
            self.drop_small()

    def failed(self, collective: str, error: Exception) -> FullShardError:
        """Note [named hangs]: the error a rank raises when a collective of this unit does not
        finish, when a wait of this unit finds another collective overdue (it names that one),
        or when a peer sent another unit's rows (it names that unit)."""
        if isinstance(error, MismatchedRows):  # named by its header: the reduction may fail in its all-reduce
            collective = KINDS[error.mine[1]]
        what = f"the {collective} of {self.described} at step {self.step}"
        if isinstance(error, MismatchedRows):
            uid, kind, nbytes = error.header or (-1, -1, 0)
            theirs = (f"the {KINDS[kind]} of {described(uid)} ({nbytes} bytes from each rank)"
                      if 0 <= kind < len(KINDS) else "rows that are no fullshard collective's")
            return fail(f"rank {dist.get_rank()}: {what} received {theirs} from group rank {error.peer}", DIVERGED)
        return collective_failed(what, error, DIVERGED)

    def check_agreement(self, kind: int, mask: int = 0) -> None:
        """Debug checks: every rank is about to run the same collective (0: all-gather, 1: reduce-scatter,
        with `mask` a hash of which parameters have gradients) of the same unit at the same step."""
        mine = [self.uid, kind, self.step, mask, self.evaluating]
        for group in self.group.process_groups:  # the ranks this unit communicates with
            self.compare_next(mine, group)

    def compare_next(self, mine: list[int], group: dist.ProcessGroup) -> None:
        """check_agreement within one of the unit's groups."""
        try:
            everyone = all_gather_ints(mine, device=self.group.device, timeout=self.switches.timeout, group=group,
                                       what=DEBUG_CHECK)
        except CollectiveError as e:
            raise self.failed("debug check", e) from None
        if any(theirs != mine for theirs in everyone):
            what, ranks = ["all-gather", "reduce-scatter"], dist.get_process_group_ranks(group)
            seen = "; ".join(f"rank {ranks[r]}: {what[k]} of {described(i)} at step {s}" +
                             (f" (gradient mask {m:#x})" if k else "") +
                             (" in a forward without gradients" if e else "")
                             for r, (i, k, s, m, e) in enumerate(everyone))
            raise fail(f"ranks disagree on the next collective ({seen})",
                       "Every rank must run the same units in the same order and compute gradients for the same "
                       "parameters while debug checks are on; make the model's control flow the same on every rank.")

    def gather_targets(self, small: bool) -> list[torch.Tensor]:
        """Where a gather puts every rank's part, in order, each [world * part] of the wire dtype:
        each parameter's full storage, or, for a parameter that goes on the wire transformed,
        its own output buffers (Note [all-gather extensions], Note [int8 gathers]); `small`:
        for the gather inside the smaller group, where a quantized parameter's rows come as
        the full values kept after forward (Note [smaller world after forward])."""
        if not self.layout.transformed:
            return self.layout.on_wire([p.full_padded for p in self.params])
        out = []
        for p, quantizer in zip(self.params, self.quantized):
            if p.extension is not None:
                out += [buffer.view(torch.uint8) for buffer in p.extension.output_buffers(self.group.world)]
            elif quantizer is not None and not small:
                out += [buffer.view(torch.uint8) for buffer in quantizer.output_buffers(self.group.world)]
            else:
                out.append(p.full_padded.view(torch.uint8))
        return out

    def free_after_forward(self) -> None:
        """reshard() after forward, keeping this rank's 1/k first (Note [smaller world after forward])."""
        if self.small_group is not None and self.state is ShardState.FULL:
            block = self.group.world // self.options.post_forward_world  # ranks whose shards this rank keeps
            first = self.small_group.rank() * block
            self.small = torch.cat([full.view(self.group.world, -1)[first : first + block].reshape(-1)
                                    for full in self.gather_targets(small=True)])
            runtime.active.reads(self.layout.full_flat)
            runtime.active.allocated(self.small)
            runtime.active.writes(self.small)
            self.stats.full_params(self.small.nbytes)
        self.reshard(keep_small=True)

    def drop_small(self) -> None:
        if self.small is not None:
            runtime.active.freed(self.small)
            self.stats.full_params(-self.small.nbytes)
            self.small = None

    def reshard(self, keep_small: bool = False) -> None:
        """Drop the full parameters and put the shards back on the modules; a no-op when sharded."""
        if not keep_small:
            self.drop_small()
        if self.state is ShardState.GATHERING:  # a prefetch nobody used: finish it, then drop it
            self.finish_gather()
            self.release_storage()
            self.stats.full_params(-self.layout.full_bytes)
            return
        if self.state is ShardState.SHARDED:
            return
        for p in self.params:  # ShardedParam.to_sharded, inline
            shard = p.sharded
            for module, name in p.slots:
                module._parameters[name] = shard
        if self.layout.full_flat is not None:
            self.release_storage()
            self.stats.full_params(-self.layout.full_bytes)
        self.move(ShardState.SHARDED, ShardState.FULL)

    def gather_masters(self) -> list[torch.Tensor]:
        """The full parameters in the master dtype, gathered into new tensors on the compute
        device (to read or edit whole weights; the unit's own state does not change)."""
        extended = next((p.fqn for p in self.params if p.extension is not None), None)
        if extended is not None:
            raise fail(f"parameter {extended!r} defines FSDP2's all-gather extensions, whose whole value only "
                       f"the subclass knows how to rebuild", "Use the sharded state dict (get_state_dict(model, "
                       "full=False)), or gather inside a forward (the subclass's own fsdp_post_all_gather).")
        if self.unset:
            self.check_has_values()
        fulls = {}
        for dtype in dict.fromkeys(self.layout.master_dtypes):  # one gather per master dtype
            mine = [i for i, d in enumerate(self.layout.master_dtypes) if d == dtype]
            values = self.gather_values([self.params[i] for i in mine], [self.layout.shards[i] for i in mine], dtype,
                                        "full parameters")
            fulls.update(zip(mine, values))
        return [fulls[i] for i in range(len(self.params))]

    def gather_whole(self) -> Iterator[tuple[ShardedParam, torch.Tensor]]:
        """Each parameter with its whole value (gather_masters, then gathered over TP, one
        parameter at a time: Note [tensor parallel parameters])."""
        for p, tensor in zip(self.params, self.gather_masters()):
            yield p, p.whole(tensor)

    def gather_values(self, params: list[ShardedParam], shards: list[torch.Tensor], dtype: torch.dtype,
                      what: str) -> list[torch.Tensor]:
        """Full tensors of values of `dtype` laid out as these parameters' padded shards (e.g.
        their optimizer state), gathered into new tensors on the compute device, within the
        unit's timeout (Note [named hangs])."""
        fulls = [torch.empty(p.padded_shape, dtype=dtype, device=self.compute_device) for p in params]
        for full in fulls:
            runtime.active.allocated(full)
        caller = self.caller(0, f"all-gather (of {what})")
        pending = gather_full(shards, group=self.group.shard_pg, dtype=dtype, device=self.compute_device,
                              pool=self.pool, caller=caller)
        try:
            finish_gather(pending, fulls, [p.shard_numel for p in params], self.pool)
        except CollectiveError as e:
            raise self.failed(f"all-gather (of {what})", e) from None
        return [p.unpad(full) for p, full in zip(params, fulls)]

    # ---- gradients ----------------------------------------------------------------

    def count_full_grads(self, held: int | None = None) -> None:
        """Bring stats.full_grad_bytes up to the full gradients this unit holds now (`held`
        bytes when the caller knows)."""
        if held is None:
            held = sum(p.full_grad_bytes() for p in self.params)
        self.stats.full_grads(held - self.counted_grad_bytes)
        self.counted_grad_bytes = held

    def has_full_grads(self) -> bool:
        for p in self.params:  # a loop, not any(): once per unit per backward, kept free of calls
            if p.unsharded.grad is not None or p.accumulated is not None:
                return True
        return False

    def post_backward(self) -> None:
        """Start reducing (unless gradient sync is off: full gradients then keep accumulating) and reshard."""
        if self.switches.sync_grads:
            self.reduce_grads()
        else:
            for p, dtype in zip(self.params, self.layout.reduce_dtypes):
                p.hold_grad(dtype, redistribute)
            self.count_full_grads()
        if self.switches.reshard_after_backward:
            self.reshard()

    def reduce_grads(self) -> None:
        """Start averaging the full gradients over the data-parallel ranks (finish_reduce lands them).

        One reduce-scatter (plus one all-reduce across replicas) for the whole unit, or one per
        reduce dtype when its gradients have several (Note [bytes on the wire]).
        """
        self.finish_reduce()  # a unit reduced twice in one backward (used twice in forward)
        trainable = [(p, dtype) for p, dtype in zip(self.params, self.layout.reduce_dtypes) if p.sharded.requires_grad]
        if not trainable:
            return
        group = self.group
        self.count_full_grads()
        full_grads = {p: p.full_grad(redistribute) for p, _ in trainable}
        rt = runtime.active
        one = len(self.layout.reduce_groups) == 1
        if self.switches.debug:
            self.check_agreement(1, sum(1 << i for i, g in enumerate(full_grads.values()) if g is not None) % (1 << 62))
        replicate = group.replicate_pg if self.switches.all_reduce_grads and not self.owes_all_reduce else None
        for dtype in self.layout.reduce_groups:
            grad_params = [p for p, _ in trainable] if one else [p for p, d in trainable if d == dtype]
            if not grad_params:
                continue
            grads = [full_grads.pop(p) for p in grad_params]  # full_grad() took them
            all_here = True  # then every reduced flag is set
            for g in grads:
                all_here = all_here and g is not None
            numels = [p.shard_numel for p in grad_params]
            shard = torch.empty(sum(numels) + len(numels), dtype=dtype,
                                device=self.compute_device)  # [grad_shard_numel + n_flags]
            if rt.tracks:
                rt.allocated(shard)
            with labelled(f"fullshard::reduce_scatter {self.fqn}"):
                try:  # no_shard on gloo: its all-reduce checks the replicas' headers at once
                    pending = reduce_scatter_grads(grads, numels, groups=(group.shard_pg, replicate),
                                                   dp_size=group.dp_size,
                                                   divide_by=self.switches.divide_factor or group.dp_size,
                                                   force_sum=self.switches.force_sum, shard=shard, pool=self.pool,
                                                   caller=self.caller(1, "reduce-scatter"))
                except CollectiveError as e:
                    raise self.failed("reduce-scatter", e) from None
            del grads
            self.pending_reduce.append((grad_params, all_here, pending))
        self.count_full_grads(sum(p.full_grad_bytes() for p in self.params if not p.sharded.requires_grad))

    def finish_reduce(self) -> None:
        """Wait for the reduction in flight and land it on the shards' gradients, or queue it
        for the end of backward (Note [landing]).

        A parameter no rank computed a gradient for keeps the gradient it had.
        """
        taken, self.pending_reduce = self.pending_reduce, []
        for grad_params, all_here, pending in taken:
            self.land_reduced(grad_params, all_here, pending)

    def land_reduced(self, grad_params: list[ShardedParam], all_here: bool, pending: PendingReduce) -> None:
        """finish_reduce for one reduce-scatter's row."""
        start = time.perf_counter()
        with labelled(f"fullshard::wait reduce {self.fqn}"):
            try:
                shard = finish_reduce(pending, self.pool)  # [grad_shard_numel + n_flags], on the compute stream
            except CollectiveError as e:
                raise self.failed("reduce-scatter", e) from None
        self.stats.waited(time.perf_counter() - start)
        rt = runtime.active
        rt.reads(shard)
        if self.switches.all_reduce_hook is not None:  # the user's, on the gradients (not the has-gradient flags)
            self.switches.all_reduce_hook(shard[: shard.numel() - len(grad_params)])
            rt.writes(shard)
        if self.switches.nonfinite is not None:  # on the device: hooks read every unit's at once, Note [host syncs]
            finite = torch.isfinite(shard).all()
            self.finite = finite if self.finite is None else self.finite & finite
        for kind, nbytes in pending.traffic:
            self.stats.count(self.fqn, kind, nbytes)
        self.reduced = True
        if self.group.replicate_pg is not None and not self.switches.all_reduce_grads:
            self.owes_all_reduce = True
        flags_at = shard.numel() - len(grad_params)
        if self.options.offload:
            masters = {p.sharded.dtype for p in grad_params}  # land on the host in the masters' dtype if one
            row = shard.to(*masters) if len(masters) == 1 and shard.dtype not in masters else shard
            host = rt.to_host(row, pin=self.options.pin_memory)  # [grad_shard_numel + n_flags]
            self.unlanded.append((grad_params, host[flags_at:], host))
        elif not all_here:
            self.unlanded.append((grad_params, rt.to_host(shard[flags_at:], pin=True), shard))
        else:
            self.land(grad_params, [True] * len(grad_params), shard)

    # Note [landing]: a reduced row becomes the shards' gradients on the compute stream
    # as soon as it is waited for, unless the host must see it first: with CPU offload (the
    # row is copied to pinned host memory without waiting) or when some rank had no
    # gradient for one of the unit's parameters (the has-gradient flags decide which
    # gradients stay None). Those rows wait in `unlanded` until the end of backward, when
    # the host waits once for all of them (Note [host syncs]) and `land_queued` lands them.

    def land(self, grad_params: list[ShardedParam], flags: list, row: torch.Tensor) -> None:
        """Add each parameter's part of a reduced row to its shard's gradient (where a flag says any rank had one)."""
        offset = 0
        for p, flag in zip(grad_params, flags):
            if flag:
                p.accumulate_grad(row[offset : offset + p.local_shape.numel()].view(p.local_shape))
            offset += p.shard_numel
        if runtime.active.tracks:
            runtime.active.writes(*[p.local_grad() for p in grad_params if p.sharded.grad is not None])
        for p, flag in zip(grad_params, flags):
            if flag:
                p.run_post_accumulate_hooks()

    def land_queued(self) -> None:
        """Land the rows queued in `unlanded`, once the host has waited for the GPU."""
        for grad_params, flags, row in self.unlanded:
            self.land(grad_params, runtime.active.read_on_host(flags, timeout=self.switches.timeout, what=self.caller(
                1, "has-gradient flags").what), row)
        self.unlanded.clear()

    def settle_all_reduce(self) -> bool:
        """With the all-reduce across replicas off, owe it; once back on, pay it on the
        gradients accumulated since (all of them in one all-reduce). Runs at the end of a
        backward that reduced, after landing, in unit order on every rank. Returns whether
        it copied gradients back to host memory (CPU offload): the host must wait for them
        (hooks wait once for every unit, Note [host syncs])."""
        reduced, self.reduced = self.reduced, False
        if not (reduced and self.owes_all_reduce and self.switches.all_reduce_grads):
            return False
        self.owes_all_reduce = False
        grad_params = [p for p in self.params if p.sharded.requires_grad]
        for p in grad_params:  # every replica sends the same layout; a missing gradient is zero
            if p.sharded.grad is None:
                p.accumulate_grad(torch.zeros(p.local_shape, dtype=p.sharded.dtype, device=p.local_shard().device))
        grads = [p.local_grad() for p in grad_params]
        moved = [runtime.active.to_device(g, self.compute_device) for g in grads]  # offload: NCCL reads device memory
        try:
            nbytes = sum(all_reduce_tensors([t for t in moved if t.dtype == dtype], group=self.group.replicate_pg,
                                            caller=self.caller(2, "all-reduce across replicas"))
                         for dtype in dict.fromkeys(t.dtype for t in moved))  # one per master dtype
        except CollectiveError as e:
            raise self.failed("all-reduce across replicas", e) from None
        back = [(grad, device_grad) for grad, device_grad in zip(grads, moved) if device_grad is not grad]
        for grad, device_grad in back:
            runtime.active.copy_(grad, device_grad)
        self.stats.count(self.fqn, "all_reduce", nbytes)
        return bool(back)  # the optimizer reads them on the host
