"""State dicts and checkpoints of sharded models, under the unwrapped model's names.

# Note [checkpoint layout]: save(path) writes a new version directory path/v-<token>/: a
# torch.distributed.checkpoint (DCP) directory holding the model's and the optimizer's
# tensors (optimizer state in torch's name-keyed layout, so PyTorch's own FSDP loads it
# with dcp.load), fullshard.json (step, extra) and, written last, COMPLETE. Then rank 0
# atomically replaces path/LATEST, a one-line file naming the version. A crash at any
# point leaves LATEST naming a complete version; every other version is removed after
# the switch. fullshard.json also lists the CRC-32 and size of every data file. load(path)
# reads the version LATEST names, or a plain DCP directory (e.g. written by PyTorch's
# FSDP). Nothing in a checkpoint can run code: DCP's metadata is unpickled admitting only
# DCP's own classes (Note [metadata unpickling]), non-tensor items (optimizer
# hyperparameters) with torch.load(weights_only=True).
#
# Note [failed load]: a load that fails changes nothing. Before reading, every rank
# checks the files the metadata names (present, long enough) and, for fullshard's own
# checkpoints, their checksums (each rank a share of the files), and all ranks agree.
# Then DCP reads into new buffers, which its own collective makes all-or-nothing across
# ranks; only then are the optimizer's state and the model's shards replaced.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import shutil
import struct
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fullshard import runtime
from fullshard.collectives import all_gather_ints, barrier
from fullshard.errors import fail, require
from fullshard.hooks import units_under
from fullshard.mesh import compute_device, timed_group
from fullshard.param import ShardedParam
from fullshard.runtime import CollectiveError
from fullshard.unit import Unit
from fullshard.training import units_of

Entry = ShardedParam | tuple[nn.Module, str]
LATEST, COMPLETE, META = "LATEST", "COMPLETE", "fullshard.json"


def state_entries(model: nn.Module) -> dict[str, Entry]:
    """Every name of `model.state_dict()` (the unwrapped model's), with what it names: a
    sharded parameter, or (module, name) of a persistent buffer or unmanaged parameter.
    Tied parameters appear under each of their names."""
    sharded = {p.sharded: p for unit in units_under(model) for p in unit.params}
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
    """Between steps every unit is sharded; one kept full would hold stale or unsaved values."""
    for unit in units_of(model, "state dicts"):
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
        for p, tensor in unit.gather_whole():
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


def full_value(value: DTensor, device: torch.device) -> torch.Tensor:
    """`value` gathered whole, sent from `device`'s memory: NCCL cannot send the host memory
    that CPU offload keeps optimizer state in."""
    local = value.to_local()
    moved = runtime.active.to_device(local, device)
    if moved is not local:
        value = DTensor.from_local(moved, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                   stride=value.stride())
    return value.full_tensor()


def full_state_value(value: DTensor, unit: Unit, param: ShardedParam, what: str) -> torch.Tensor:
    """A DTensor laid out as `param` (its optimizer state), gathered whole by its unit."""
    local = value.to_local()
    if param.replicated:
        return local
    padded = torch.zeros(param.shard_numel, dtype=local.dtype, device=local.device)
    padded[: local.numel()].copy_(param.rows(local).reshape(-1))
    return param.whole(unit.gather_values([param], [padded], local.dtype, what)[0])


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, full: bool, cpu_offload: bool,
                    keep: bool) -> dict[str, Any]:
    """{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}; full gathers every
    DTensor state tensor, one at a time (all ranks take part; only `keep`ers hold the result)."""
    if optimizer is None:
        return {}
    names = param_names(model)
    owners = {p.sharded: (unit, p) for unit in units_of(model, "get_state_dict") for p in unit.params}
    state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            values = {}
            for key, value in optimizer.state.get(param, {}).items():
                if full and isinstance(value, DTensor):
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


def check_optimizer(optimizer: object) -> None:
    require(optimizer is None or isinstance(optimizer, torch.optim.Optimizer),
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}",
            "Pass the optimizer built from model.parameters().")


def check_path(path: object, what: str) -> None:
    require(isinstance(path, (str, os.PathLike)), f"{what} needs a path (str or os.PathLike), got {path!r}",
            "Pass e.g. 'checkpoints/run1'.")


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
    entries = state_entries(model)
    check_names_and_shapes(entries, {k: v.shape for k, v in model_sd.items()}, "state dict")
    done: set[int] = set()
    with torch.no_grad():
        for name, entry in entries.items():
            if name not in model_sd or id(entry) in done:
                continue
            done.add(id(entry))
            value = model_sd[name]
            if not isinstance(entry, ShardedParam):
                value_of(entry).copy_(value.full_tensor() if isinstance(value, DTensor) else value)
            else:
                entry.write_back(value)
    reshard_all(model)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, optim_sd: Mapping[str, Any]) -> None:
    """Load a name-keyed optimizer state dict, full (resharded here) or sharded, through
    the optimizer's own load_state_dict; values are copied, never kept, except the optimizer's
    own state tensors (load() fills them in place), which stay as they are."""
    names = param_names(model)
    by_name = {names[p]: p for group in optimizer.param_groups for p in group["params"]}
    sharded = {p.sharded: p for unit in units_of(model, "set_state_dict") for p in unit.params}
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
            any(len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, optimizer.param_groups)):
        raise fail(f"the optimizer state dict does not fit this optimizer (names the model lacks: {unknown}; "
                   f"param groups: {[len(g['params']) for g in groups]} saved, "
                   f"{[len(g['params']) for g in optimizer.param_groups]} here)",
                   "Build the optimizer with the same parameter groups as the one that was saved.")
    index = {name: i for i, name in enumerate(names[p] for g in optimizer.param_groups for p in g["params"])}
    state = {}
    for name, values in optim_sd.get("state", {}).items():
        param = by_name[name]
        own = optimizer.state.get(param, {})
        state[index[name]] = {key: value if value is own.get(key) else shard_like(param, sharded.get(param), value)
                              for key, value in values.items()}
    torch_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
                    for g in groups]
    for saved, mine in zip(torch_groups, optimizer.param_groups):  # JSON and DCP turn tuples into lists
        for key, value in saved.items():
            if isinstance(mine.get(key), tuple) and isinstance(value, list):
                saved[key] = tuple(value)
    optimizer.load_state_dict({"state": state, "param_groups": torch_groups})


def shard_like(param: nn.Parameter, sharded: ShardedParam | None, value: Any) -> Any:
    """An optimizer state value laid out as `param`: full tensors of its shape become its shard."""
    if not isinstance(value, torch.Tensor):
        return value
    if sharded is None or value.shape != param.shape or value.dim() == 0 and not sharded.replicated:
        return value.detach().clone()
    if isinstance(value, DTensor) and not sharded.laid_out_as_shard(value):
        value = full_value(value, compute_device(sharded.mesh.device_type))
    return sharded.as_dtensor(sharded.rows_of(value).detach().to(sharded.local_shard().device).clone())


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
        full: whether the dicts hold full tensors (``False``: DTensor shards).

    Raises:
        FullShardError: before anything is copied, on names or shapes that do not fit.
    """
    check_optimizer(optimizer)
    require(isinstance(model_sd, Mapping), f"model_sd must be a mapping of names to tensors, got {type(model_sd).__name__}",
            "Pass the model state dict from get_state_dict (or model.state_dict() of the unwrapped model).")
    require(optim_sd is None or isinstance(optim_sd, Mapping) and optimizer is not None,
            "optim_sd was given without an optimizer, or is not a mapping", "Pass both optimizer= and optim_sd=.")
    load_model_state(model, model_sd)
    if optimizer is not None and optim_sd:
        load_optimizer_state(model, optimizer, optim_sd)


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


# ---- checkpoints ------------------------------------------------------------------------------


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, unpickling non-tensor items with weights_only=True (no arbitrary objects)."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# Note [metadata unpickling]: DCP's .metadata is a pickle; a plain DCP directory (e.g. one
# written by PyTorch's FSDP) has nothing else, so load must read it. Its unpickler admits
# exactly these (module, name) pairs, the classes and helpers DCP's metadata is made of,
# and nothing else: no other name of those modules (they import os, sys, ...), no dotted
# name (protocol 4 would look "os.system" up in an admitted module), no builtins. Each
# admitted callable only builds a plain value (a dataclass, a path, a size, a dtype).
METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    *(("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)),
}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in METADATA_GLOBALS:  # Note [metadata unpickling]
            raise pickle.UnpicklingError(f"{module}.{name} has no place in checkpoint metadata")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, whose metadata unpickling cannot run code from the file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def unreadable(directory: Path, error: Exception) -> Exception:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return fail(f"checkpoint {directory} could not be read ({type(error).__name__}: {first[:300]}): a file is "
                f"corrupted, truncated or not a checkpoint's",
                "Load another checkpoint; each save is a directory of its own, so the others are unaffected.")


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """The DCP directory of the latest complete checkpoint at `path` (for dcp.load).

    Raises:
        FullShardError: when `path` holds no complete checkpoint.
    """
    path = Path(path)
    if (path / LATEST).is_file():
        version = path / (path / LATEST).read_text().strip()
        if not (version / COMPLETE).is_file():
            raise fail(f"checkpoint {path} names version {version.name}, which is incomplete",
                       "Its save was interrupted; load an earlier checkpoint or save again.")
        return version
    if (path / ".metadata").is_file():
        return path  # a plain DCP directory, e.g. written by PyTorch's FSDP
    raise fail(f"{path} is not a checkpoint (no {LATEST} file and no DCP .metadata)",
               "Pass the directory given to fullshard.save (or a torch.distributed.checkpoint directory).")


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int | None = None, extra: Any = None) -> None:
    """Save a sharded checkpoint (every rank writes its shards), atomically.

    Loads at any world size and under any strategy. A crash at any point leaves the
    previous checkpoint at `path` complete; saving to the same path again replaces it.
    See Note [checkpoint layout].

    Args:
        path: a directory (created if missing), on storage every rank can reach.
        model: the sharded model, between training steps (every rank must call this).
        optimizer: its optimizer, or None.
        step: the training step, returned by ``load``.
        extra: JSON-serializable user metadata (numbers, strings, lists, dicts), returned
            by ``load``.

    Raises:
        FullShardError: before anything is written, when ``extra`` is not JSON-serializable.
    """
    check_path(path, "save")
    check_optimizer(optimizer)
    require(step is None or isinstance(step, int), f"save(step={step!r}) must be an int or None", "Pass step=1000.")
    meta = {"format": 1, "step": step, "extra": extra}
    try:
        json.dumps(meta)  # refused now, before anything is written
    except (TypeError, ValueError) as e:
        raise fail(f"extra={extra!r} cannot be saved: {e}",
                   "Pass JSON-serializable values (numbers, strings, lists, dicts); checkpoints never "
                   "pickle arbitrary objects.") from None
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer, full=False)
    timeout = units_of(model, "save")[0].timeout
    token = every_rank(f"the start of the save to {path}", timeout, [secrets.randbits(48)])[0][0]  # rank 0's name
    version = path / f"v-{token:012x}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("v-*"):  # versions of saves that never finished
            if not (stale / COMPLETE).is_file():
                shutil.rmtree(stale, ignore_errors=True)
    checkpoint_barrier(timeout, f"save to {version}")
    state = {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(version), process_group=timed_group(timeout))
    checkpoint_barrier(timeout, f"save to {version}")
    files = file_checksums(version, timeout)
    if dist.get_rank() == 0:
        write_durably(version / META, json.dumps({**meta, "files": files}))
        write_durably(version / COMPLETE, "")
        write_durably(path / LATEST, version.name)  # the switch: atomic
        for old in path.glob("v-*"):  # the previous version, and any a kill left between switch and removal
            if old.name != version.name:
                shutil.rmtree(old, ignore_errors=True)
    checkpoint_barrier(timeout, f"save to {version}")


def checkpoint_barrier(timeout: timedelta, what: str) -> None:
    try:
        barrier(timeout, f"the barrier of the {what}")
    except CollectiveError as e:
        raise not_every_rank(str(e)) from None


def every_rank(what: str, timeout: timedelta, values: list[int]) -> list[list[int]]:
    """Every rank's `values` (all_gather_ints on the group with the checkpoint's deadline)."""
    try:
        return all_gather_ints(values, device=torch.device("cpu"), timeout=timeout, group=timed_group(timeout))
    except CollectiveError as e:
        raise not_every_rank(f"{what} did not finish ({e})") from None


def not_every_rank(what: str) -> Exception:
    return fail(f"rank {dist.get_rank()}: {what}",
                "Every rank must make the same call (save, load, state dict); another rank did not, or died. "
                "Restart the job (fullshard train --max-restarts N resumes from the last checkpoint).")


def file_checksums(directory: Path, timeout: timedelta) -> dict[str, list[int]]:
    """{data file: [CRC-32, size]} of a DCP directory; each rank reads a share of the files."""
    names = sorted(f.name for f in directory.glob("*.distcp"))
    mine = [0, 0] * len(names)
    for i in range(dist.get_rank(), len(names), dist.get_world_size()):
        mine[2 * i : 2 * i + 2] = [crc32_of(directory / names[i]), (directory / names[i]).stat().st_size]
    everyone = every_rank(f"the checksums of {directory}", timeout, mine)
    return {name: [sum(r[2 * i] for r in everyone), sum(r[2 * i + 1] for r in everyone)]
            for i, name in enumerate(names)}


def crc32_of(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_durably(path: Path, text: str) -> None:
    """Write a file by atomic replacement, flushed to disk with its directory entry."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint written by ``save`` (at any world size, under any strategy) or a
    plain DCP directory with "model" (and "optim") entries.

    Args:
        path: the directory given to ``save``.
        model: the sharded model to load into (every rank must call this).
        optimizer: its optimizer, or None to load the model only.

    Returns:
        ``{"step": ..., "extra": ...}`` as saved (``None`` for a plain DCP directory).

    Raises:
        FullShardError: before anything is loaded, when `path` is not a (complete)
            checkpoint or its names or shapes do not fit the model (all listed).
    """
    check_path(path, "load")
    check_optimizer(optimizer)
    directory = checkpoint_dir(path)
    reader = SafeReader(directory)
    try:
        metadata = reader.read_metadata()
        saved = metadata.state_dict_metadata
        meta_file = directory / META
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        needed = bytes_needed(metadata)
    except (OSError, EOFError, ValueError, AttributeError, TypeError, pickle.UnpicklingError) as e:
        raise unreadable(directory, e) from None
    shapes = {k[len("model."):]: getattr(v, "size", ()) for k, v in saved.items() if k.startswith("model.")}
    entries = state_entries(model)
    check_names_and_shapes(entries, shapes, "checkpoint")
    timeout = units_of(model, "load")[0].timeout
    check_files(directory, needed, meta.get("files", {}), timeout)
    reshard_all(model)
    fresh: dict[int, torch.Tensor] = {}  # Note [failed load]: DCP reads into these, one per tied entry
    model_sd = {name: fresh.setdefault(id(entry), new_like(value_of(entry)))
                for name, entry in entries.items() if name in shapes}
    state: dict[str, Any] = {"model": model_sd}
    with_optimizer = optimizer is not None and any(k.startswith("optim.state.") for k in saved)
    if with_optimizer:
        state["optim"] = optimizer_template(model, optimizer, saved)
    try:
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), process_group=timed_group(timeout))
    except (Exception, CheckpointException) as e:  # DCP gathers every rank's read failure, raised on all
        raise unreadable(directory, e) from None
    if with_optimizer:
        load_optimizer_state(model, optimizer, state["optim"])  # checks it fits, then replaces it at once
    load_model_state(model, model_sd)
    return {"step": meta.get("step"), "extra": meta.get("extra")}


def bytes_needed(metadata: Metadata) -> dict[str, int]:
    """{data file: how many of its bytes the metadata reads}."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed


def check_files(directory: Path, needed: Mapping[str, int], listed: Mapping[str, list[int]], timeout: timedelta) -> None:
    """Note [failed load]: refuse, on every rank and before anything is read, a checkpoint whose
    data files are missing, shorter than the metadata says, of another size than saved, or
    (each rank checking a share) whose CRC-32 differs from the one saved."""
    names = sorted(set(needed) | set(listed))
    bad = [0] * len(names)  # 1: missing or of the wrong size, 2: checksum
    for i, name in enumerate(names):
        file = directory / name
        size = file.stat().st_size if file.is_file() else -1
        if size < needed.get(name, 0) or (name in listed and size != listed[name][1]):
            bad[i] = 1
        elif name in listed and i % dist.get_world_size() == dist.get_rank() and crc32_of(file) != listed[name][0]:
            bad[i] = 2
    everyone = every_rank(f"the check of {directory}", timeout, bad)
    problems = [f"{name}: {'missing, truncated or resized' if max(r[i] for r in everyone) == 1 else 'checksum differs'}"
                for i, name in enumerate(names) if any(r[i] for r in everyone)]
    if problems:
        raise fail(f"checkpoint {directory} is damaged ({'; '.join(problems)}); nothing was loaded",
                   "Load another checkpoint; each save is a directory of its own, so the others are unaffected.")


def new_like(value: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor laid out as `value` (a DTensor: on the same mesh, placements and rows)."""
    if isinstance(value, DTensor):
        return DTensor.from_local(torch.empty_like(value.to_local()), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    return torch.empty_like(value)


def optimizer_template(model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> dict:
    """New buffers for the optimizer state a checkpoint holds (Note [failed load]), laid out as
    this optimizer would hold it, read from the checkpoint's metadata: the optimizer itself
    is not touched."""
    names = param_names(model)
    sharded = {p.sharded: p for unit in units_under(model) for p in unit.params}
    by_name = {names[p]: p for group in optimizer.param_groups for p in group["params"]}
    state: dict[str, dict[str, Any]] = {}
    for key, item in saved.items():
        if not key.startswith("optim.state."):
            continue
        name, value_key = key[len("optim.state."):].rsplit(".", 1)
        param = by_name.get(name)
        if param is None:
            raise fail(f"the checkpoint holds optimizer state of {name!r}, which this optimizer does not step",
                       "Build the optimizer with the same parameter groups as the one that was saved.")
        state.setdefault(name, {})[value_key] = state_buffer(item, param, sharded.get(param))
    groups = [{**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"},
               "params": [names[p] for p in group["params"]]} for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def state_buffer(item: Any, param: nn.Parameter, sharded: ShardedParam | None) -> torch.Tensor | None:
    """A new buffer for one saved optimizer state value: its shard when it has the parameter's
    shape (as shard_like lays it out), else a plain tensor; None for a non-tensor value."""
    if not isinstance(item, TensorStorageMetadata):
        return None
    size, dtype = tuple(item.size), item.properties.dtype
    if sharded is not None and size == tuple(param.shape) and (size or sharded.replicated):
        return sharded.as_dtensor(torch.empty(sharded.local_shape, dtype=dtype, device=sharded.local_shard().device))
    return torch.empty(size, dtype=dtype)


def export(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the full weights (the unwrapped model's state dict) as one safetensors file.

    Every rank takes part in gathering, unit by unit; rank 0 streams each unit's tensors
    to the file as they come, so no rank holds more than one unit's full parameters. The
    file loads with plain ``safetensors.torch.load_file`` and ``model.load_state_dict``.

    Args:
        model: the sharded model.
        path: the file to write (rank 0); replaced atomically.
    """
    check_path(path, "export")
    reshard_all(model)
    entries = state_entries(model)
    units = units_of(model, "export")
    names_of: dict[int, list[str]] = {}
    for name, entry in entries.items():
        names_of.setdefault(id(entry), []).append(name)
    # tensors in the order they become available: buffers and unmanaged parameters, then unit by unit
    plain = [(name, value_of(entry).detach()) for name, entry in entries.items() if not isinstance(entry, ShardedParam)]
    gathered = [(name, p) for unit in units for p in unit.params for name in names_of[id(p)]]
    header, offset = {}, 0
    for name, value in plain + [(name, p.sharded) for name, p in gathered]:
        nbytes = value.numel() * value.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[value.dtype], "shape": list(value.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank0 = dist.get_rank() == 0
    out = open(tmp, "wb") if rank0 else None
    try:
        if out:
            out.write(struct.pack("<Q", len(blob)) + blob)
            for _, tensor in plain:
                out.write(tensor_bytes(tensor))
        for unit in units:
            for p, tensor in unit.gather_whole():
                for _ in names_of[id(p)] if out else ():
                    out.write(tensor_bytes(tensor))
        if out:
            out.flush()
            os.fsync(out.fileno())
    finally:
        if out:
            out.close()
    if rank0:
        os.replace(tmp, path)
    checkpoint_barrier(units[0].timeout, f"export to {path}")


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
