"""State dicts of sharded models, under the unwrapped model's names: names <-> shards, full
(gathered unit by unit) or sharded (DTensors), optimizer state keyed by parameter name.
Checkpoints on disk are the checkpoint package's.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard import runtime
from fullshard.collectives import Caller, full_tensor
from fullshard.errors import fail, require
from fullshard.gather import gather_state, gather_whole
from fullshard.hooks import normal_tensors, units_of, units_under
from fullshard.mesh import compute_device
from fullshard.param import ShardedParam, sharded_params
from fullshard.unit import Unit

# Note [loaded dtypes]: a dtype a file names is one of LOADABLE (the plain numeric dtypes and
# float8; not the quantized, sub-byte or bit dtypes, which torch cannot copy, or not without
# crashing), and it must be the dtype of what the value lands in: the model's tensor, or the
# optimizer state the optimizer holds. Where the optimizer holds none yet, it is what torch's
# Optimizer.load_state_dict makes of it: a state value of a floating-point parameter is cast to
# the parameter's dtype, so it must be floating-point; "step" stays as it is, so it must be a
# real number type. Floating-point values may land in another floating-point dtype of
# FLOAT_CASTS (a bf16 checkpoint into fp32 masters); nothing else is cast, so no value is ever
# read as another type's bytes.
LOADABLE = {name_: getattr(torch, name_) for name_ in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16", "float32",
    "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu") if isinstance(getattr(torch, name_, None), torch.dtype)}  # Note [loaded dtypes]
FLOAT_CASTS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
REAL = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, *FLOAT_CASTS})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_problem(saved: torch.dtype, target: torch.dtype) -> str | None:
    """Why a value saved as `saved` cannot land in a tensor of `target` (Note [loaded dtypes])."""
    if saved == target or saved in FLOAT_CASTS and target in FLOAT_CASTS:
        return None
    return f"saved as {dtype_name(saved)}, lands in {dtype_name(target)}"


Entry = ShardedParam | tuple[nn.Module, str]


def state_entries(model: nn.Module) -> dict[str, Entry]:
    """Every name of `model.state_dict()` (the unwrapped model's), with what it names: a
    sharded parameter, or (module, name) of a persistent buffer or unmanaged parameter.
    Tied parameters appear under each of their names."""
    sharded = sharded_params(units_under(model))
    entries: dict[str, Entry] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, param in module._parameters.items():
            if param is not None:
                entries[dot + key] = sharded.get(param, (module, key))
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                entries[dot + key] = (module, key)
    return entries


def value_of(entry: Entry) -> torch.Tensor:
    return entry.sharded if isinstance(entry, ShardedParam) else getattr(entry[0], entry[1])


def check_names_and_shapes(entries: Mapping[str, Entry], shapes: Mapping[str, torch.Size], what: str) -> None:
    """Refuse, listing every problem, tensors that do not fit the model's names and shapes.

    A tied parameter is satisfied by any one of its names.
    """
    covered = {id(entry) for name, entry in entries.items() if name in shapes}
    missing = sorted(name for name, entry in entries.items() if id(entry) not in covered)
    unexpected = sorted(set(shapes) - set(entries))
    wrong = sorted(f"{name}: {what} {tuple(shapes[name])}, model {tuple(value_of(entry).shape)}"
                   for name, entry in entries.items()
                   if name in shapes and tuple(shapes[name]) != tuple(value_of(entry).shape))
    if missing or unexpected or wrong:
        problems = "; ".join(f"{label}: {items}" for label, items in
                             (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items)
        raise fail(f"the {what} does not fit the model ({problems})",
                   "Use one of the same architecture, with the unwrapped model's names "
                   "(model.state_dict() of the model built without fullshard).")


def reshard_all(model: nn.Module) -> None:
    """Between steps every unit is sharded; one kept full would hold stale or unsaved values.
    A gather still in flight (unshard(async_op=True) not yet waited for) is refused first."""
    units = units_of(model, "state dicts")
    pending = [unit.fqn or type(unit.module).__name__ for unit in units if unit.gathering is not None]
    if pending:
        raise fail(f"units {pending} have an unshard(async_op=True) in flight, which state dicts, save and load "
                   f"cannot run beside", "Call handle.wait() on what unshard(async_op=True) returned (or "
                   "model.reshard()) first.")
    for unit in units:
        unit.reshard()
        unit.adopt_replaced()


# ---- model and optimizer state dicts ------------------------------------------------------


def param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's first name in the unwrapped model (tied ones have several)."""
    return {param: name for name, param in reversed(list(model.named_parameters(remove_duplicate=False)))}


def full_model_state(model: nn.Module, *, cpu_offload: bool, keep: bool) -> dict[str, torch.Tensor]:
    """Full tensors, gathered unit by unit and (cpu_offload) moved to the CPU as they come."""
    entries = state_entries(model)
    full: dict[int, torch.Tensor] = {}
    for unit in units_of(model, "get_state_dict"):
        for p, tensor in gather_whole(unit):
            if keep:
                full[id(p)] = tensor.cpu() if cpu_offload else tensor
    if not keep:
        return {}
    out = {}
    for name, entry in entries.items():
        if isinstance(entry, ShardedParam):
            out[name] = full[id(entry)]
        else:
            tensor = value_of(entry).detach()
            out[name] = tensor.cpu() if cpu_offload else tensor.clone()
    return out


def full_value(value: DTensor, device: torch.device, caller: Caller) -> torch.Tensor:
    """`value` gathered whole, sent from `device`'s memory: NCCL cannot send the host memory
    that CPU offload keeps optimizer state in."""
    local = value.to_local()
    moved = runtime.active.to_device(local, device)
    if moved is not local:
        value = DTensor.from_local(moved, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                   stride=value.stride())
    return full_tensor(value, caller)


def full_state_value(value: DTensor, unit: Unit, param: ShardedParam, what: str) -> torch.Tensor:
    """A DTensor laid out as `param` (its optimizer state), gathered whole by its unit."""
    local = value.to_local()
    if param.replicated:
        return local
    padded = local.new_zeros(param.shard_numel)
    padded[: local.numel()].copy_(param.rows(local).reshape(-1))
    return param.whole(gather_state(unit, [param], [padded], local.dtype, what)[0])


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, full: bool, cpu_offload: bool,
                    keep: bool) -> dict[str, Any]:
    """{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}; full gathers every
    DTensor state tensor, one at a time (all ranks take part; only `keep`ers hold the result)."""
    if optimizer is None:
        return {}
    names = param_names(model)
    check_steps_model(names, optimizer)
    owners = {p.sharded: (unit, p) for unit in units_of(model, "get_state_dict") for p in unit.params}
    state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            values = {}
            for key, value in optimizer.state.get(param, {}).items():
                if full and isinstance(value, DTensor) and value.shape != param.shape:  # a matrix optimizer's
                    value = full_tensor(value, owners[param][1].caller)  # row shards of another shape
                elif full and isinstance(value, DTensor):
                    value = full_state_value(value, *owners[param], f"optimizer state {names[param]}.{key}")
                if isinstance(value, torch.Tensor) and full and keep:
                    value = value.cpu() if cpu_offload else value.clone()
                values[key] = value
            if values and keep:
                state[names[param]] = values
    if not keep:
        return {}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in group["params"]]}
              for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def check_steps_model(names: Mapping[nn.Parameter, str], optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that steps parameters the model does not have (most often one built
    before sharding replaced them)."""
    foreign = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"] if p not in names]
    if foreign:
        raise fail(f"the optimizer steps {len(foreign)} parameters that are not the model's (shapes "
                   f"{foreign[:5]}{' ...' if len(foreign) > 5 else ''}): it was built before shard_model / "
                   f"fully_shard replaced them, or for another model", "Build the optimizer after sharding, "
                   "from model.parameters() of the sharded model.")


def check_optimizer(optimizer: object) -> None:
    require(optimizer is None or isinstance(optimizer, torch.optim.Optimizer),
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}",
            "Pass the optimizer built from model.parameters().")


def check_path(path: object, what: str) -> None:
    require(isinstance(path, (str, os.PathLike)), f"{what} needs a path (str or os.PathLike), got {path!r}",
            "Pass e.g. 'checkpoints/run1'.")


@normal_tensors
def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, full: bool = True,
                   cpu_offload: bool = True, rank0_only: bool = False) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts, under the unwrapped model's names.

    Args:
        model: a sharded model, between training steps (every rank must call this).
        optimizer: its optimizer, or None (the optimizer state dict is then ``{}``).
        full: plain full tensors (gathered unit by unit, so the extra memory is about one
            unit's full parameters beyond the result), or ``False`` for the ``DTensor``
            shards themselves (no communication).
        cpu_offload: with ``full``, move each tensor to the CPU as it is gathered.
        rank0_only: with ``full``, only rank 0 gets the dicts; the others get ``{}``.

    Returns:
        (model_sd, optim_sd); optim_sd is ``{"state": {name: {...}}, "param_groups":
        [{..., "params": [name, ...]}]}``.
    """
    check_optimizer(optimizer)
    for name, flag in (("full", full), ("cpu_offload", cpu_offload), ("rank0_only", rank0_only)):
        require(isinstance(flag, bool), f"get_state_dict({name}={flag!r}) must be True or False", f"Pass {name}=True.")
    require(full or not rank0_only, "get_state_dict(full=False, rank0_only=True): sharded state dicts live on every rank",
            "Pass rank0_only=False, or full=True.")
    reshard_all(model)
    keep = not rank0_only or dist.get_rank() == 0
    if not full:
        model_sd = {name: value_of(entry) for name, entry in state_entries(model).items()}
        return model_sd, optimizer_state(model, optimizer, full=False, cpu_offload=False, keep=True)
    model_sd = full_model_state(model, cpu_offload=cpu_offload, keep=keep)
    return model_sd, optimizer_state(model, optimizer, full=True, cpu_offload=cpu_offload, keep=keep)


def load_model_state(model: nn.Module, model_sd: Mapping[str, torch.Tensor]) -> None:
    """Copy full or sharded tensors into the shards (each rank its own rows) and buffers."""
    reshard_all(model)
    entries = state_entries(model)
    check_names_and_shapes(entries, {k: v.shape for k, v in model_sd.items()}, "state dict")
    timeout = units_under(model)[0].timeout  # of DTensor's collectives (a buffer given as a DTensor)
    done: set[int] = set()
    with torch.no_grad():
        for name, entry in entries.items():
            if name not in model_sd or id(entry) in done:
                continue
            done.add(id(entry))
            value = model_sd[name]
            if not isinstance(entry, ShardedParam):
                value_of(entry).copy_(full_tensor(value, Caller(f"the all-gather of {name!r} of a state dict", timeout))
                                      if isinstance(value, DTensor) else value)
            else:
                entry.write_back(value)
    reshard_all(model)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, optim_sd: Mapping[str, Any]) -> None:
    """Load a name-keyed optimizer state dict, full (resharded here) or sharded, through
    the optimizer's own load_state_dict; values are copied, never kept, except the optimizer's
    own state tensors (load() fills them in place), which stay as they are."""
    optimizer.load_state_dict(torch_optimizer_state(model, optimizer, optim_sd))


def torch_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                          optim_sd: Mapping[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state dict as the optimizer's own load_state_dict takes it (by
    position, laid out as its parameters), every refusal raised first: nothing changes."""
    names = param_names(model)
    by_name = {names[p]: p for group in optimizer.param_groups for p in group["params"]}
    sharded = sharded_params(units_of(model, "set_state_dict"))
    keys = [*optim_sd.get("state", {}), *(p for g in optim_sd.get("param_groups", []) for p in g.get("params", []))]
    if any(not isinstance(key, str) for key in keys):
        raise fail("the optimizer state dict names parameters by position (torch's optimizer.state_dict() "
                   "layout); fullshard's name them, as the unwrapped model does",
                   "Pass the dict from fullshard.get_state_dict, or convert yours: with "
                   "names = [n for n, _ in model.named_parameters()] (the order the optimizer was built in), "
                   "{'state': {names[i]: s for i, s in sd['state'].items()}, 'param_groups': [{**g, 'params': "
                   "[names[i] for i in g['params']]} for g in sd['param_groups']]}.")
    unknown = sorted(set(optim_sd.get("state", {})) - set(by_name))
    groups = optim_sd.get("param_groups", [])
    if unknown or len(groups) != len(optimizer.param_groups) or \
            any(sorted(g["params"]) != sorted(names[p] for p in mine["params"])
                for g, mine in zip(groups, optimizer.param_groups)):
        raise fail(f"the optimizer state dict does not fit this optimizer (names the model lacks: {unknown}; "
                   f"param groups: {[len(g['params']) for g in groups]} saved, "
                   f"{[len(g['params']) for g in optimizer.param_groups]} here, each of the same names)",
                   "Build the optimizer with the same parameter groups as the one that was saved.")
    if problems := hyperparameter_problems(groups, optimizer):
        raise fail(f"the optimizer state dict's hyperparameters do not fit this {type(optimizer).__name__} "
                   f"({'; '.join(problems)})", "Load the state of an optimizer of this kind, as its state_dict() "
                   "holds it.")
    group_of = {p: mine for mine in optimizer.param_groups for p in mine["params"]}
    state_problem = getattr(optimizer, "state_problem", None)  # the optimizer's own rules (fullshard.optim)
    if state_problem is not None and (problems := [
            f"{name}.{key}: {problem}" for name, values in optim_sd.get("state", {}).items() for key, value in
            values.items() if (problem := state_problem(group_of[by_name[name]], by_name[name].shape, key, value))]):
        raise fail(f"the optimizer state dict's state does not fit this {type(optimizer).__name__} "
                   f"({'; '.join(problems[:8])})", "Load the state of an optimizer of this kind, as its state_dict() "
                   "holds it.")
    index = {name: i for i, name in enumerate(names[p] for g in optimizer.param_groups for p in g["params"])}
    state = {}
    for name, values in optim_sd.get("state", {}).items():
        param = by_name[name]
        own = optimizer.state.get(param, {})
        state[index[name]] = {key: value if value is own.get(key) else shard_like(param, sharded.get(param), value)
                              for key, value in values.items()}
    torch_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[names[p]] for p in mine["params"]]}
                    for g, mine in zip(groups, optimizer.param_groups)]  # state is by name: the order is this one's
    for saved, mine in zip(torch_groups, optimizer.param_groups):  # JSON and DCP turn tuples into lists
        for key, value in saved.items():
            if isinstance(mine.get(key), tuple) and isinstance(value, list):
                saved[key] = tuple(value)
    return {"state": state, "param_groups": torch_groups}


def shard_like(param: nn.Parameter, sharded: ShardedParam | None, value: Any) -> Any:
    """An optimizer state value laid out as `param`: full tensors of its shape become its shard."""
    if not isinstance(value, torch.Tensor):
        return value
    if sharded is None or value.shape != param.shape or value.dim() == 0 and not sharded.replicated:
        return value.detach().clone()
    if isinstance(value, DTensor) and not sharded.laid_out_as_shard(value):
        value = full_value(value, compute_device(sharded.mesh.device_type), sharded.caller)
    return sharded.as_dtensor(sharded.rows_of(value).detach().to(sharded.local_shard().device).clone())


@normal_tensors
def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   model_sd: Mapping[str, torch.Tensor], optim_sd: Mapping[str, Any] | None = None,
                   full: bool = True) -> None:
    """Load state dicts from get_state_dict (or the unwrapped model's, for full ones).

    Full tensors are resharded: each rank copies its own rows, with no communication.
    Values are copied; no reference to the given dicts is kept.

    Args:
        model: the sharded model.
        optimizer: its optimizer, or None.
        model_sd: under the unwrapped model's names; full tensors or DTensors.
        optim_sd: ``{"state": {name: {...}}, "param_groups": [...]}``, or None.
        full: what `model_sd` holds, as get_state_dict's `full` made it: full tensors
            (``True``) or the parameters' DTensor shards (``False``). Optimizer state loads
            from either.

    Raises:
        FullShardError: before anything is copied, on names or shapes that do not fit, or
            values of the other kind than `full` says.
    """
    check_optimizer(optimizer)
    require(type(full) is bool, f"set_state_dict(full={full!r}) must be True or False", "Pass full=True.")
    require(isinstance(model_sd, Mapping), f"model_sd must be a mapping of names to tensors, got {type(model_sd).__name__}",
            "Pass the model state dict from get_state_dict (or model.state_dict() of the unwrapped model).")
    check_kind(model, model_sd, full)
    require(optim_sd is None or isinstance(optim_sd, Mapping) and optimizer is not None,
            "optim_sd was given without an optimizer, or is not a mapping", "Pass both optimizer= and optim_sd=.")
    loaded = torch_optimizer_state(model, optimizer, optim_sd) if optimizer is not None and optim_sd else None
    load_model_state(model, model_sd)
    if loaded is not None:
        optimizer.load_state_dict(loaded)


def check_kind(model: nn.Module, model_sd: Mapping[str, Any], full: bool) -> None:
    """set_state_dict's `full` against the values: no DTensor in a full state dict, a DTensor
    for every sharded parameter in a sharded one."""
    if full:
        name = next((name for name, value in model_sd.items() if isinstance(value, DTensor)), None)
        require(name is None, f"set_state_dict(full=True) got a DTensor for {name!r}, a sharded state dict's value",
                "For get_state_dict(full=False)'s dicts pass full=False.")
        return
    entries = state_entries(model)
    name = next((name for name, value in model_sd.items()
                 if isinstance(entries.get(name), ShardedParam) and not isinstance(value, DTensor)), None)
    require(name is None, f"set_state_dict(full=False) got a plain tensor for parameter {name!r}, a full state "
            "dict's value", "For full state dicts (get_state_dict(full=True), or the unwrapped model's) pass full=True.")


@normal_tensors
def init_weights_from(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict, e.g. pretrained weights, into a sharded model.

    Each rank copies only its own rows of each tensor into its shards, one tensor at a
    time and without communication, so no rank builds a full parameter; with a lazily
    loaded state dict (``safetensors.safe_open`` or ``torch.load(..., mmap=True)``) a rank
    reads little more than its shards.

    Args:
        model: a model sharded by fullshard, e.g. built on the meta device and
            materialized by ``shard_model``.
        state_dict: full tensors under the unwrapped model's names; tied parameters need
            one of their names. Non-persistent buffers are not part of state dicts and
            keep the values initialization gave them.

    Raises:
        FullShardError: before anything is copied, listing missing and unexpected names
            and wrong shapes.
    """
    units_of(model, "init_weights_from")
    require(isinstance(state_dict, Mapping), f"init_weights_from needs a mapping of names to tensors, got "
            f"{type(state_dict).__name__}", "Pass e.g. safetensors.torch.load_file(path) or torch.load(path, mmap=True).")
    load_model_state(model, state_dict)


def new_like(value: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor laid out as `value` (a DTensor: on the same mesh, placements and rows)."""
    if isinstance(value, DTensor):
        return DTensor.from_local(torch.empty_like(value.to_local()), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    return torch.empty_like(value)


def optimizer_template(model: nn.Module, optimizer: torch.optim.Optimizer,
                       saved: Mapping[str, tuple[torch.dtype, tuple[int, ...]] | None]) -> dict:
    """New buffers for the optimizer state a checkpoint holds (`saved`: each flattened item's
    dtype and shape, None for a non-tensor), laid out as this optimizer would hold it; the
    optimizer itself is not touched."""
    names = param_names(model)
    sharded = sharded_params(units_under(model))
    state: dict[str, dict[str, Any]] = {}
    for name, value_key, param, item in saved_state(model, optimizer, saved):
        state.setdefault(name, {})[value_key] = state_buffer(item, param, sharded.get(param))
    groups = [{**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"},
               "params": [names[p] for p in group["params"]]} for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def saved_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                saved: Mapping[str, Any]) -> Iterator[tuple[str, str, nn.Parameter, Any]]:
    """(parameter name, state key, parameter, saved item) of each saved optimizer state item
    ("optim.state.<name>.<key>"); a parameter the optimizer does not step is refused."""
    names = param_names(model)
    by_name = {names[p]: p for group in optimizer.param_groups for p in group["params"]}
    for key, item in saved.items():
        if key.startswith("optim.state."):
            name, value_key = key[len("optim.state."):].rsplit(".", 1)
            if name not in by_name:
                raise fail(f"the checkpoint holds optimizer state of {name!r}, which this optimizer does not step",
                           "Build the optimizer with the same parameter groups as the one that was saved.")
            yield name, value_key, by_name[name], item


def state_buffer(item: Any, param: nn.Parameter, sharded: ShardedParam | None) -> torch.Tensor | None:
    """A new buffer for one saved optimizer state value (a tensor's dtype and shape, None for a
    non-tensor): its shard when it has the parameter's shape (as shard_like lays it out), else a
    plain tensor."""
    if item is None:
        return None
    dtype, size = item
    if sharded is not None and size == tuple(param.shape) and (size or sharded.replicated):
        return sharded.as_dtensor(sharded.local_shard().new_empty(sharded.local_shape, dtype=dtype))
    return torch.empty(size, dtype=dtype)


# Note [loaded hyperparameters]: an optimizer's hyperparameters come back from a state dict or a
# checkpoint as plain values (JSON), and torch's load_state_dict takes whatever it is given, to
# fail at the next step (lr "x") or never (lr -1, betas of three). So each must be of the kind
# the optimizer's own value is (a number for a number, finite where it is; a list of as many for
# a tuple; a bool, a string, a tensor of its dtype and shape; None, a bool or a number for an
# optional flag that is None), a key it lacks a plain scalar; and
# the optimizer's own constructor, where it can be called with its current values, must accept
# the loaded ones (its range checks: a learning rate of -1 is refused by Adam's own words).


def value_problem(saved: Any, own: Any) -> str | None:
    """Why `saved` cannot stand where the optimizer has `own` (Note [loaded hyperparameters]); a
    saved tensor is given as (dtype, shape)."""
    def kind(value: Any) -> str:
        return "a number" if is_number(value) else type(value).__name__

    if isinstance(own, torch.Tensor):
        if not (isinstance(saved, tuple) and len(saved) == 2 and isinstance(saved[0], torch.dtype)):
            return f"is {kind(saved)}, not a tensor"
        dtype, shape = saved
        problem = dtype_problem(dtype, own.dtype)
        return problem or (None if tuple(shape) == tuple(own.shape) else f"has shape {list(shape)}, not {list(own.shape)}")
    if isinstance(saved, tuple) and saved and isinstance(saved[0], torch.dtype):
        return f"is a tensor, not {kind(own)}"
    if own is None:  # an optional flag or number (foreach, fused)
        return None if saved is None or isinstance(saved, bool) or is_number(saved) and finite(saved) else \
            f"is {kind(saved)}, not None, a bool or a number"
    if own is MISSING:  # a key the optimizer does not have (a scheduler's initial_lr): a plain scalar
        return None if saved is None or isinstance(saved, (bool, str)) or is_number(saved) else \
            f"is {kind(saved)}, not a plain value"
    if isinstance(own, bool) or isinstance(own, str):
        return None if type(saved) is type(own) else f"is {kind(saved)}, not {kind(own)}"
    if is_number(own):
        if not is_number(saved):
            return f"is {kind(saved)}, not a number"
        return None if finite(saved) or not finite(own) else f"is {str(saved)[:40]}, not a finite number"
    if isinstance(own, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(own):
            return f"is {str(saved)[:80]}, not {len(own)} values"
        return next((f"[{i}] {p}" for i, (a, b) in enumerate(zip(saved, own)) if (p := value_problem(a, b))), None)
    return None if saved == own else f"is {str(saved)[:80]}, not {str(own)[:80]}"


MISSING = object()  # a key the optimizer's group lacks


def is_number(value: Any) -> bool:
    return type(value) in (int, float)


def finite(number: int | float) -> bool:
    """Whether a number is finite as a float (an int of 400 digits is not)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def hyperparameter_problems(groups: list[Mapping], optimizer: torch.optim.Optimizer) -> list[str]:
    """What is wrong with saved parameter groups' hyperparameters for `optimizer` (Note [loaded
    hyperparameters]): each as "group i: key problem"."""
    problems = []
    own_rules = getattr(optimizer, "group_problems", None)  # fullshard.optim's: each group by its kind's rules
    for i, (saved, own) in enumerate(zip(groups, optimizer.param_groups)):
        found = [f"group {i}: {key} {problem}" for key, value in saved.items() if key != "params"
                 if (problem := value_problem(value, own.get(key, MISSING)))]
        if not found and own_rules is not None:
            found += [f"group {i}: {problem}" for problem in own_rules(as_own_kinds(saved, own), own)]
        elif not found and (refused := refused_by_constructor(optimizer, own, saved)):
            found.append(f"group {i}: {refused}")
        problems += found
    return problems


def as_own_kinds(saved: Mapping, own: Mapping) -> dict:
    """A saved group's values with lists as tuples where the optimizer's are (JSON and DCP make
    tuples lists)."""
    return {key: tuple(value) if isinstance(own.get(key), tuple) and isinstance(value, list) else value
            for key, value in saved.items()}


def refused_by_constructor(optimizer: torch.optim.Optimizer, own: Mapping, saved: Mapping) -> str | None:
    """The optimizer's own constructor's objection to `saved`'s hyperparameters, where it takes
    the group's current ones (on a small stand-in parameter)."""
    try:
        takes = set(inspect.signature(type(optimizer)).parameters) - {"params"}
    except (TypeError, ValueError):  # no signature to read
        return None

    def build(values: Mapping) -> None:
        type(optimizer)([torch.zeros(2, 2, requires_grad=True)], **{key: values[key] for key in takes if key in values})

    try:
        build(own)
    except Exception:  # it takes other arguments too: nothing to compare with
        return None
    loaded = {key: own[key] if isinstance(own.get(key), torch.Tensor) else  # a tensor's values come later
              tuple(value) if isinstance(own.get(key), tuple) and isinstance(value, list) else value
              for key, value in saved.items()}
    try:
        build(loaded)
    except Exception as e:
        return f"{type(optimizer).__name__} refuses them ({type(e).__name__}: {str(e)[:200]})"
    return None


def state_dtype_problem(param: nn.Parameter, own: Any, key: str, dtype: torch.dtype) -> str | None:
    """Why a saved optimizer state tensor of `dtype` cannot land in `param`'s state `key` (the
    optimizer's `own` value, None before its first step): Note [loaded dtypes]."""
    if isinstance(own, torch.Tensor):
        return dtype_problem(dtype, own.dtype)
    if key == "step":
        return None if dtype in REAL else f"saved as {dtype_name(dtype)}, not a real number type"
    if param.is_floating_point() and dtype not in FLOAT_CASTS:
        return f"saved as {dtype_name(dtype)}, which torch would cast to the parameter's {dtype_name(param.dtype)}"
    return None


def optimizer_state_problems(model: nn.Module, optimizer: torch.optim.Optimizer,
                             saved: Mapping[str, tuple[torch.dtype, tuple[int, ...]] | None]) -> list[str]:
    """Saved optimizer state items (as optimizer_template takes them) that cannot land in this
    optimizer's state: a tensor of a dtype Note [loaded dtypes] refuses, a plain value of another
    kind than the optimizer's own (Note [loaded hyperparameters])."""
    problems = []
    own_rule = getattr(optimizer, "state_problem", None)  # fullshard.optim's: each state by its kind's rules
    group_of = {p: group for group in optimizer.param_groups for p in group["params"]}
    for name, value_key, param, item in saved_state(model, optimizer, saved):
        own = optimizer.state.get(param, {}).get(value_key)
        if item is not None:
            problem = state_dtype_problem(param, own, value_key, item[0])
            if problem is None and own_rule is not None:
                problem = own_rule(group_of[param], param.shape, value_key, (item[0], tuple(item[1])))
        elif isinstance(own, torch.Tensor):
            problem = "is a plain value, not a tensor"
        else:
            problem = None
        if problem:
            problems.append(f"{name}.{value_key} {problem}")
    return problems
