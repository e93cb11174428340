"""UnitLayout: how a unit keeps its parameters. Each parameter's rows per rank; the dtypes it
is kept in (its master's), computed in, reduced in and sent in; and the flat storage that
holds the shards and the full parameters. Made when fully_shard makes the unit and again
at Unit.relayout: a move to another device or dtype, set_reshard_after_forward, or a meta
unit's first real parameters assigned in place (taken at the start of the root's forward,
before any unit gathers), never while a collective of the unit is in flight.

# Note [bytes on the wire]: a unit's parameters may have several dtypes (a norm kept in
# float32 among bf16 weights, frozen int8 weights beside trainable adapters). Each keeps
# its own as its shard. With a param_dtype the floating ones are gathered and computed in
# it, the gather's staging copy casting. Otherwise each full parameter has its master's
# dtype, and when they differ the one gather moves bytes: every shard goes as the bytes of
# its full dtype (cast first where a param_dtype applies: an integer parameter keeps its
# own), and the full storage is bytes, each parameter's block aligned for its dtype.
# Gradients cannot be summed as bytes: the unit reduce-scatters once per reduce dtype.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

from fullshard import runtime
from fullshard.mesh import ShardGroup
from fullshard.options import UnitOptions


class UnitLayout:
    """A unit's parameters as numbers of elements, dtypes and storage (Note [bytes on the wire])."""

    def __init__(self, shard_numels: list[int], extended: list[bool], group: ShardGroup) -> None:
        self.shard_numels = shard_numels  # each parameter's padded rows per rank, in elements
        self.extended = extended  # each parameter's: an all-gather extension (Note [all-gather extensions])
        self.group = group
        self.shards: list[torch.Tensor] = []  # allocate's
        self.full_flat: torch.Tensor | None = None
        self.full_bytes = 0

    def set_dtypes(self, dtypes: list[torch.dtype], options: UnitOptions) -> None:
        """The shards' dtypes (each parameter's own) and what the policy makes of them: each full
        parameter's dtype (param_dtype, else its master's), each gradient's reduce dtype, and the
        dtype a gather moves (Note [bytes on the wire])."""
        self.master_dtypes = dtypes
        param_dtype = options.param_dtype  # for floating-point parameters: an integer one stays as it is
        self.full_dtypes = [param_dtype if param_dtype and dtype.is_floating_point else dtype for dtype in dtypes]
        self.reduce_dtypes = [options.reduce_dtype or dtype for dtype in self.full_dtypes]
        self.reduce_groups = list(dict.fromkeys(self.reduce_dtypes))  # one reduce-scatter each
        one = set(self.full_dtypes)
        # whether some parameter goes on the wire as something else than its full dtype (Note
        # [all-gather extensions], Note [int8 gathers]); then the gather moves bytes
        self.transformed = any(self.extended) or options.gather_dtype is not None
        self.wire_dtype = one.pop() if len(one) == 1 and not self.transformed else torch.uint8 if one else \
            torch.float32
        self.extension_policy = TorchMixedPrecisionPolicy(  # what FSDP2 gives fsdp_pre_all_gather
            param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype,
            output_dtype=options.output_dtype, cast_forward_inputs=options.input_dtype is not None)

    def allocate(self, device: torch.device, options: UnitOptions) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """New flat storage for the shards (the masters; on the host under CPU offload) and the
        full parameters on `device`, the compute device; returns each parameter's (shard
        segment, full segment)."""
        group = self.group
        meta = device.type == "meta"
        offloaded = options.offload and not meta
        shard_device = torch.device("cpu") if offloaded else device
        pin = options.pin_memory and device.type == "cuda"
        # offloaded shards are the seam's host buffers, so a stream model knows them as host memory
        self.shards = [runtime.active.host_buffer((0 if ext else numel,), dtype, pin=pin).zero_() if offloaded else
                       torch.zeros(0 if ext else numel, dtype=dtype, device=device)
                       for numel, dtype, ext in zip(self.shard_numels, self.master_dtypes, self.extended)]
        # each [shard_numel]; an extension parameter's shard is a tensor of its own (Note [all-gather extensions])
        # Note [stable full params]: one storage for every full parameter of the unit;
        # none when they can be the shards themselves (one rank, same dtype, same memory:
        # a CPU-offloaded shard is host memory, which a GPU does not compute with)
        same = (group.shard_pg is None and self.full_dtypes == self.master_dtypes and not any(self.extended)
                and shard_device == device and not (options.offload and not runtime.active.host_memory(device)))
        if same:
            self.full_flat, self.full_bytes = None, 0
            return [(shard, None) for shard in self.shards]
        starts, end = [], 0  # each parameter's block of bytes, [world * shard_numel] of its full dtype
        for numel, dtype, ext in zip(self.shard_numels, self.full_dtypes, self.extended):
            numel = 0 if ext else numel
            size = dtype.itemsize
            starts.append(-(-end // size) * size)  # aligned for its dtype (only mixed dtypes need it)
            end = starts[-1] + group.world * numel * size
        self.full_flat = torch.empty(end, dtype=torch.uint8, device=device)  # [unit full bytes]
        self.full_bytes = self.full_flat.untyped_storage().nbytes()
        return [(shard, None if ext else self.full_flat[start : start + group.world * numel * dtype.itemsize].view(dtype))
                for shard, start, numel, dtype, ext in zip(self.shards, starts, self.shard_numels, self.full_dtypes,
                                                          self.extended)]

    def release(self) -> None:
        """Free the full parameters' storage (the tensors stay, Note [stable full params])."""
        if self.full_flat is not None:
            if runtime.active.tracks:
                runtime.active.freed(self.full_flat)
            self.full_flat.untyped_storage().resize_(0)
