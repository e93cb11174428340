"""ShardedParam: one parameter's Shard(0) DTensor master and the full tensor used for compute.

# Note [shard layout]: a parameter of d rows is split as torch.chunk splits it (and so
# as DTensor's Shard(0) places it): every rank stores ceil(d / world) rows, the real rows
# first and zero padding after, so the last ranks may hold fewer real rows or none.
# Each parameter's padded shard is a tensor of its own, so its DTensor starts at offset
# 0 of its own storage and behaves like any other tensor for torch.save, safetensors and
# Hugging Face (which take tensors sharing a storage for tied weights). A gather first
# copies a unit's shards back to back into one send buffer, the copy that also casts
# (mixed precision) and moves to the device (CPU offload). A 0-d parameter cannot be split: it
# takes one slot in every rank's shard, is a Replicate() DTensor, and every rank computes
# with rank 0's copy.
#
# Note [another dim]: FSDP2's shard_placement_fn may ask to split a parameter along dim
# d > 0 (Shard(d), e.g. experts' weights when experts are fewer than ranks). The unit
# stores such a parameter rows-first, dim d moved to the front (`rows`), so its shard,
# gather and reduction are those of a dim-0 split of that layout. What modules and
# users see is that storage viewed back in the parameter's own order (`unrows`): the
# shard is a Shard(d) DTensor over a strided view, the full parameter a strided view of
# the gathered storage, and a full gradient is laid rows-first as it is packed.
#
# Note [tensor parallel parameters]: a parameter that is already a DTensor on a tensor-
# parallel mesh (parallelize_module) is sharded from its local part: the rows this rank's
# TP position holds are what the unit splits, gathers over the data-parallel ranks only
# and reduces gradients of over them only. The shard is a DTensor on the mesh of both,
# (dp dims..., tp dim): placements (Shard(0), tp's), where a TP Shard(0) makes the dp
# placement _StridedShard(0, split_factor=tp size), since rows are split by TP first and
# by dp within (DTensor's own Shard(0), Shard(0) would mean the other order). While full,
# the modules hold a DTensor on the TP mesh over the gathered local rows, as before
# sharding, so tensor parallelism's forward runs unchanged. Shapes below (`shape`, rows)
# are of the local part; `global_shape` is the parameter's.
#
# Note [SPMD meshes]: FSDP2's dp_mesh_dims (torch 2.13) passes the full mesh (e.g. (dp, tp))
# with every parameter a DTensor on it, replicated over the data-parallel dims. fully_shard
# takes the data-parallel dims as the unit's mesh and each parameter as the DTensor of its
# other dim (tensor parallelism, Note [tensor parallel parameters]) or as its plain local
# part, so it shards as a sub-mesh would. What forward sees is as the user made it: while
# full, a parameter is a DTensor on the full mesh again (`view`), and of its gradient only
# the other dim is redistributed; the data-parallel dims stay as they are (a partial sum
# over them is what this rank's row of the reduce-scatter is), as FSDP2 does.
#
# Note [stable full params]: autograd saves the full parameter in forward and reads it
# in backward, possibly after a reshard and a new gather in between. So the full
# Parameter objects are made once, as views of one storage per unit; freeing them
# resizes that storage to zero and gathering refills the same storage. The gathered
# bytes are written through other tensors over that storage (`full_padded`), which do
# not share the Parameters' version counters: the refill puts back the very values
# autograd saved and must not look like an in-place edit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fullshard.collectives import Caller, full_tensor
from fullshard.errors import fail
from fullshard.mesh import ShardGroup, spmd_layout


def has_extension(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (a parameter's local tensor) takes part in Note [all-gather extensions]
    (extension.py)."""
    pre, post = hasattr(tensor, "fsdp_pre_all_gather"), hasattr(tensor, "fsdp_post_all_gather")
    if pre != post:
        raise fail(f"a {type(tensor).__name__} parameter defines only one of fsdp_pre_all_gather and "
                   f"fsdp_post_all_gather", "Define both (FSDP2's all-gather extension protocol), or neither.")
    return pre


def shard_rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """(rows every rank stores, padding included; rows this rank really holds)."""
    rows_per_shard = -(-dim0 // world)
    return rows_per_shard, max(0, min(rows_per_shard, dim0 - rank * rows_per_shard))


def rows_first(shape: torch.Size, dim: int) -> torch.Size:
    """A parameter's shape as the unit stores it: split dim first (Note [another dim])."""
    return torch.Size((shape[dim], *shape[:dim], *shape[dim + 1 :])) if shape else shape


def shard_numel(shape: torch.Size, world: int) -> int:
    """Elements one rank stores for a parameter of `shape` (rows first), padding included."""
    if len(shape) == 0:
        return 1
    return shard_rows(shape[0], world, 0)[0] * math.prod(shape[1:])


def local_values(param: torch.Tensor) -> torch.Tensor:
    """What fullshard splits of a parameter: a tensor-parallel DTensor's local part, or the parameter
    itself (Note [tensor parallel parameters])."""
    return param._local_tensor if isinstance(param, DTensor) else param


def alias(storage_of: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A new tensor over the first elements of `storage_of`'s storage, with its own version counter."""
    out = torch.empty(0, dtype=storage_of.dtype, device=storage_of.device)
    return out.set_(storage_of.untyped_storage(), storage_of.storage_offset(), shape)


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



class ShardedParam:
    """One managed parameter: its shard (what the optimizer sees) and its full form (what forward sees)."""

    def __init__(
        self,
        original: nn.Parameter,
        slots: tuple[tuple[nn.Module, str], ...],
        fqn: str,
        group: ShardGroup,
        segment: torch.Tensor,
        full_segment: torch.Tensor | None,
        dim: int = 0,
        view: tuple[DTensorSpec, frozenset[int]] | None = None,
    ) -> None:
        """`segment` is this parameter's part of the unit's flat shard; `full_segment` its
        part of the unit's full storage (None when one rank holds every row); `dim` the
        dim it is split along (Note [another dim]); `view` its DTensor spec on a full SPMD mesh
        and that mesh's data-parallel dims (Note [SPMD meshes])."""
        self.fqn = fqn
        self.dim = dim
        self.view = view
        self.caller = Caller(f"the tensor-parallel collective of parameter {fqn!r}")  # its unit's timeout: Unit.switch
        self.slots = slots  # every (module, attribute) the parameter is registered under
        tp = original._spec if isinstance(original, DTensor) else None  # Note [tensor parallel parameters]
        self.tp_mesh = tp.mesh if tp else None
        self.tp_placements = tuple(tp.placements) if tp else ()
        values = self.rows(local_values(original).detach())
        self.shape = values.shape  # what the unit splits: the TP-local part, rows first
        self.global_shape = original.shape
        self.global_stride = torch.empty(self.global_shape, device="meta").stride()
        self.replicated = original.dim() == 0
        self.mesh, self.placements = spmd_layout(group, tp, self.replicated, dim)
        if self.replicated:
            rows_per_shard, local_rows, first_row = 1, 1, 0
        else:
            rows_per_shard, local_rows = shard_rows(self.shape[0], group.world, group.rank)
            first_row = group.rank * rows_per_shard
        self.first_row = first_row
        self.rows_per_shard = rows_per_shard
        self.shard_numel = rows_per_shard * self.shape[1:].numel()  # see Note [shard layout]
        self.local_shape = torch.Size((local_rows, *self.shape[1:])) if not self.replicated else self.shape
        self.padded_shape = (group.world,) if self.replicated else (group.world * rows_per_shard, *self.shape[1:])
        self.accumulated: torch.Tensor | None = None  # full gradients held by hold_grad
        self.specs: dict[torch.dtype, DTensorSpec] = {}  # the shard's DTensor spec, per dtype (as_dtensor)
        self.extension = False  # Note [all-gather extensions]: its gathers are extension.py's
        if has_extension(values):
            local = self.extended(values, fqn)
        else:
            local = self.bind(segment, full_segment, original.requires_grad)
            with torch.no_grad():
                local.copy_(values if self.replicated else values[first_row : first_row + local_rows])
        self.sharded = nn.Parameter(self.as_dtensor(local), requires_grad=original.requires_grad)

    def extended(self, values: torch.Tensor, fqn: str) -> torch.Tensor:
        """The shard of a parameter of Note [all-gather extensions]: the subclass's own rows,
        padded, in a tensor of its own (not the unit's storage); its full form exists after
        the first gather. Returns the local rows."""
        if self.tp_mesh is not None or self.view is not None or self.dim or self.replicated:
            raise fail(f"parameter {fqn!r} defines FSDP2's all-gather extensions and is "
                       f"{'a 0-d tensor' if self.replicated else 'split along another dim or mesh'}",
                       "Shard such parameters along dim 0 of a data-parallel mesh (FSDP2's default).")
        with torch.no_grad():
            padded = values.new_zeros((self.rows_per_shard, *self.shape[1:]))
            rows = self.local_shape[0]
            padded[:rows].copy_(values[self.first_row : self.first_row + rows])
        self.extension = True
        self.padded_shard = padded
        self.full_padded = None
        self.unsharded = nn.Parameter(torch.empty(0, dtype=values.dtype, device=values.device),
                                      requires_grad=values.requires_grad)  # until the first gather
        return padded[:rows]

    def bind(self, segment: torch.Tensor, full_segment: torch.Tensor | None, requires_grad: bool) -> torch.Tensor:
        """Lay this parameter over the unit's storage; return its local rows in `segment`."""
        # Note [stable full params]
        if full_segment is None:
            self.full_padded = segment  # one rank holds every row, in the master dtype: full and shard are one
        else:
            self.full_padded = full_segment.view(self.padded_shape)  # [world * rows_per_shard, *shape[1:]]
        full = self.unrows(alias(self.full_padded, self.shape))
        self.unsharded = nn.Parameter(self.on_tp_mesh(full), requires_grad=requires_grad)
        return segment[: self.local_shape.numel()].view(self.local_shape)

    def rows(self, value: torch.Tensor) -> torch.Tensor:
        """A value of the parameter's layout (or its shard's) viewed as the unit stores it,
        split dim first (Note [another dim])."""
        return value if self.dim == 0 else value.movedim(self.dim, 0)

    def unrows(self, value: torch.Tensor) -> torch.Tensor:
        """The inverse of `rows`: a stored value viewed in the parameter's own dim order."""
        return value if self.dim == 0 else value.movedim(0, self.dim)

    def rebind(self, segment: torch.Tensor, full_segment: torch.Tensor | None) -> None:
        """Move onto new storage (deferred init, Module.to_empty), keeping the values the shard
        has (none on meta) and the Parameter object the user and optimizer hold."""
        if self.extension:
            raise fail(f"parameter {self.fqn!r} defines FSDP2's all-gather extensions and was moved or built on "
                       f"the meta device", "Give the model its device and values first, then convert its "
                       "parameters (e.g. torchao's convert_to_float8_training), then shard it.")
        values = self.local_shard()
        local = self.bind(segment, full_segment, self.sharded.requires_grad)
        if not values.is_meta:
            with torch.no_grad():
                local.copy_(values)
        torch.utils.swap_tensors(self.sharded, nn.Parameter(self.as_dtensor(local),
                                                            requires_grad=self.sharded.requires_grad))

    def spec_for(self, dtype: torch.dtype) -> DTensorSpec:
        """The DTensor spec of the shard's layout (of the parameter or its gradient) in `dtype`."""
        spec = self.specs.get(dtype)
        if spec is None:
            spec = self.specs[dtype] = DTensorSpec(
                self.mesh, self.placements, tensor_meta=TensorMeta(self.global_shape, self.global_stride, dtype))
        return spec

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap this rank's rows (of the parameter or of its gradient, stored rows first) as a
        DTensor, made directly from its spec: DTensor.from_local is an autograd Function that
        checks its arguments, a cost paid per gradient per step, and neither is needed here."""
        return DTensor(self.unrows(local), self.spec_for(local.dtype), requires_grad=local.requires_grad)

    def on_tp_mesh(self, full_local: torch.Tensor) -> torch.Tensor:
        """The full parameter as forward sees it: a DTensor on the TP mesh over the gathered
        local part (Note [tensor parallel parameters]), on the full SPMD mesh (Note [SPMD
        meshes]), or the plain tensor."""
        mesh, placements = self.forward_layout()
        if mesh is None:
            return full_local
        return DTensor.from_local(full_local, mesh, placements, run_check=False,
                                  shape=self.global_shape, stride=self.global_stride)

    def forward_layout(self) -> tuple[object, tuple]:
        """The mesh and placements of the full parameter as forward sees it (None: a plain tensor)."""
        return (self.view[0].mesh, tuple(self.view[0].placements)) if self.view else (self.tp_mesh, self.tp_placements)

    def laid_out_as_shard(self, value: torch.Tensor) -> bool:
        """Whether `value` is a DTensor laid out as the shard: the same placements over the same
        ranks, whatever the mesh's dim names (a sharded state dict's value, this rank's rows)."""
        return isinstance(value, DTensor) and value.device_mesh.device_type == self.mesh.device_type and \
            torch.equal(value.device_mesh.mesh, self.mesh.mesh) and tuple(value.placements) == self.placements \
            and value.shape == self.global_shape

    def whole(self, full_local: torch.Tensor) -> torch.Tensor:
        """A full value (of the parameter or its optimizer state) as a plain tensor of the
        parameter's shape: gathered over the TP mesh (every rank of it must call), within its
        unit's timeout (`caller`)."""
        return full_tensor(self.on_tp_mesh(full_local), self.caller) if self.tp_mesh is not None else full_local

    def tp_part(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's TP part of a value of the parameter's whole shape (no communication)."""
        for dim, placement in enumerate(self.tp_placements):
            if placement.is_shard():
                d = placement.dim
                size, coordinate = self.tp_mesh.size(dim), self.tp_mesh.get_local_rank(dim)
                per, rows = shard_rows(value.shape[d], size, coordinate)
                value = value.narrow(d, min(coordinate * per, value.shape[d]), rows)
        return value

    def drop_full_grad(self) -> None:
        """Forget the full gradient of a step that will not be reduced (a backward that raised)."""
        self.unsharded.grad = self.accumulated = None

    def drop_grad(self) -> None:
        """Forget the sharded gradient (a step skipped for non-finite gradients)."""
        self.sharded.grad = None

    def local_shard(self) -> torch.Tensor:
        """This rank's rows of the shard, rows first (a view of the unit's storage)."""
        return self.rows(self.sharded._local_tensor)  # not to_local(), an autograd Function

    def local_grad(self) -> torch.Tensor:
        """This rank's rows of the shard's gradient, rows first."""
        return self.rows(self.sharded.grad._local_tensor)

    def replacement(self, full: bool) -> torch.Tensor | None:
        """What a module holds in place of this parameter's shard (`full`: its full parameter),
        if anything: an assignment or load_state_dict(assign=True) after sharding."""
        for module, name in self.slots:
            held = module._parameters.get(name)
            if held is not self.unsharded and (full or held is not self.sharded):  # Note [shown parameters]
                return held
        return None

    def adopt(self, new: torch.Tensor) -> None:
        """Make `new`, assigned in the shard's place, the shard, as FSDP2 does: a DTensor laid out
        as the shard (a sharded state dict's) keeps its object, now over the unit's storage with
        its values, so an optimizer built from model.parameters() afterwards steps what forward
        uses; a tensor of the parameter's whole shape gives its rows to the shard, which stays."""
        same = self.laid_out_as_shard(new)
        if not (same or not isinstance(new, DTensor) and new.shape == self.global_shape) or new.is_meta:
            what = (f"a DTensor placed {tuple(new.placements)} on {new.device_mesh}" if isinstance(new, DTensor)
                    else f"a tensor of shape {tuple(new.shape)}") + (" on the meta device" if new.is_meta else "")
            raise fail(f"parameter {self.fqn!r} was replaced after sharding by {what}; fullshard takes a "
                       f"DTensor placed {tuple(self.placements)} or a tensor of shape {tuple(self.global_shape)} "
                       f"with values", "Load a state dict of the same sharding (model.state_dict() of a model "
                       "sharded alike) or of full tensors, or change values in place inside `with "
                       "fullshard.full_params(model):`.")
        self.write_back(new)
        if same and isinstance(new, nn.Parameter):
            torch.utils.swap_tensors(new, nn.Parameter(self.as_dtensor(self.local_shard()),
                                                       requires_grad=new.requires_grad))
            self.sharded = new
        self.to_sharded()

    def to_full(self) -> None:
        """Register the full parameter on the modules, mirroring the shard's requires_grad (set only
        when it differs: inside a torch.func transform, setting it on a captured tensor raises)."""
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        for module, name in self.slots:
            module._parameters[name] = self.unsharded

    def to_sharded(self) -> None:
        for module, name in self.slots:
            module._parameters[name] = self.sharded

    def show(self, full: nn.Parameter) -> None:
        """Register another full value on the modules (full_params' gathered copy); to_sharded undoes it."""
        for module, name in self.slots:
            module._parameters[name] = full

    def unpad(self, full_padded: torch.Tensor) -> torch.Tensor:
        """The parameter's own elements of a padded full tensor (stored rows first), in its own layout."""
        return full_padded[0] if self.replicated else self.unrows(full_padded[: self.shape[0]])

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows (rows first) of a value: a plain tensor of the parameter's shape, a
        DTensor as forward sees the parameter (on the TP or SPMD mesh) or any other DTensor of
        it, or one laid out as the shard (already this rank's rows)."""
        if self.laid_out_as_shard(full):
            return self.rows(full.to_local())
        if isinstance(full, DTensor):
            mesh, placements = self.forward_layout()
            same = full.device_mesh == mesh and tuple(full.placements) == placements
            full = full.to_local() if same else self.tp_part(full_tensor(full, self.caller))
        elif self.tp_mesh is not None:
            full = self.tp_part(full)
        return full if self.replicated else self.rows(full)[self.first_row : self.first_row + self.local_shape[0]]

    def write_back(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of a value (see rows_of) into the shard."""
        with torch.no_grad():
            self.local_shard().copy_(self.rows_of(full))



def sharded_params(units) -> dict[nn.Parameter, ShardedParam]:
    """The parameter each ShardedParam of `units` puts in the modules between steps (its
    shard, a DTensor), mapped to it: how state dicts, checkpoints and deferred init find
    what a parameter of the model is."""
    return {p.sharded: p for unit in units for p in unit.params}
