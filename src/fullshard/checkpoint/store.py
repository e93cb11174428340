"""Checkpoints: save and load, versioned and atomic, in torch.distributed.checkpoint's format.

# Note [checkpoint layout]: save(path) writes a new version directory path/v-<12 hex>/:
# every rank its own data file __<rank>_0.distcp of torch.save records (its chunks of the
# sharded state: a DTensor's local part once per set of replicas, every other value by
# the lowest rank holding it), then rank 0 DCP's .metadata (so dcp.load and PyTorch's FSDP
# read it), fullshard.json (Note [manifest]: everything load reads, with each file's size
# and CRC-32) and, last, COMPLETE. Then rank 0 atomically replaces path/LATEST, a line
# naming the version, and removes the other versions. A crash at any point leaves LATEST
# naming a complete version. load(path) reads the version LATEST names through its
# fullshard.json alone, or a plain DCP directory (one PyTorch wrote) through its
# .metadata read as data (Note [pickles as data]); it unpickles nothing, and every file
# it opens is one of the directory's own (Note [confined files]).
#
# Note [checkpoint phases]: every phase of a save or load ends in `agree`, one all-gather
# of every rank's outcome (an error message or what the phase found) within the model's
# timeout. So a failure on any rank (a full disk, a read-only directory, a damaged file)
# becomes the same FullShardError on every rank at the same point, and a rank that stopped
# or died is named by the phase its peers were in when they gave up on it. A save that
# fails leaves LATEST as it was (rank 0 removes the new version); a load that fails has
# changed nothing.
#
# Note [failed load]: a load that fails changes nothing. Before reading tensors, every
# rank checks that the checkpoint fits the model and optimizer, that the files the records
# name are there and long enough, and (fullshard's own checkpoints) the CRC-32 of a share
# of the files. Then each rank reads its part into new buffers; only when every rank has
# read all of its part are the optimizer's state and the model's shards replaced.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import secrets
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fullshard.checkpoint import background, dcp_format, manifest
from fullshard.checkpoint.background import SaveHandle
from fullshard.collectives import all_gather_json
from fullshard.errors import CollectiveError, EveryRankError, FullShardError, collective_failed, fail, require
from fullshard.checkpoint.files import Folder, View, Writer
from fullshard.hooks import normal_tensors, units_of
from fullshard.checkpoint.manifest import MAX_INT, Chunk, Contents, SavedTensor
from fullshard.mesh import ReplicaOf, replica_of, timed_group
from fullshard.state_dict import (LOADABLE, check_names_and_shapes, dtype_problem, check_optimizer, check_path, get_state_dict,
                                  hyperparameter_problems, load_model_state, load_optimizer_state, new_like,
                                  optimizer_state_problems, optimizer_template, param_names, reshard_all,
                                  state_entries, value_of)

LATEST, COMPLETE, MANIFEST, METADATA = "LATEST", "COMPLETE", "fullshard.json", ".metadata"
VERSION = re.compile(r"v-[0-9a-f]{12}")
MAX_MANIFEST = 1 << 30
DAMAGED_FIX = "Load another checkpoint; each save is a directory of its own, so the others are unaffected."


# ---- agreeing on each phase ---------------------------------------------------------------------


class Outcome:
    """What every rank reported at the end of a phase (Note [checkpoint phases])."""

    def __init__(self, reports: list[dict]) -> None:
        self.reports = reports

    def first_error(self) -> tuple[int, str] | None:
        return next(((r, report["error"]) for r, report in enumerate(self.reports) if report.get("error")), None)


def agree(what: str, phase: str, timeout: timedelta, report: dict, *, nothing_changed: str,
          fix: str | None = None, group: dist.ProcessGroup | None = None) -> Outcome:
    """Every rank's `report` for `phase` (over `group`: a background save's, else the
    checkpoints' timed group, once the save in flight on it has finished); a FullShardError
    on every rank when any reported an error (its message, then `fix` when given) or one did
    not take part within `timeout`."""
    if group is None:  # the group the background save uses: never two threads on it at once
        background.wait_for_saves()
        group = timed_group(timeout)
    try:
        outcome = Outcome(all_gather_json(report, device=torch.device("cpu"), timeout=timeout, group=group))
    except RuntimeError as e:  # CollectiveError, or a backend's error for a lost peer raised at the issue
        raise fail(f"rank {dist.get_rank()}: {what} did not finish {phase}: another rank did not take part within "
                   f"{timeout.total_seconds():g} s (it stopped, died or made another call; {str(e)[:200]}); "
                   f"{nothing_changed}",
                   "Every rank must make the same call. Restart the job (fullshard train --max-restarts N resumes "
                   "from the last checkpoint).") from None
    failed = outcome.first_error()
    if failed is not None:
        rank, message = failed
        message = message if message.startswith("rank ") else f"rank {rank}: {message}"
        raise EveryRankError(f"{message}. {fix}" if fix else message)
    return outcome


def os_problem(error: OSError) -> str:
    """An OSError in words: what the system said, and about which file."""
    file = f": {error.filename}" if error.filename else ""
    return f"{error.strerror or error}{file}"


def problem_of(error: Exception) -> str:
    """What went wrong in a rank's part of a phase, in words."""
    return os_problem(error) if isinstance(error, OSError) else f"{type(error).__name__}: {str(error)[:300]}"


# ---- save -----------------------------------------------------------------------------------------


@normal_tensors
def save(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int | None = None, extra: Any = None, block: bool = True) -> SaveHandle | None:
    """Save a sharded checkpoint (every rank writes its shards), atomically.

    Loads at any world size and under any strategy, with fullshard or with
    ``torch.distributed.checkpoint.load``. A crash or failure at any point leaves the
    previous checkpoint at `path` as it was; saving to the same path again replaces it.
    See Note [checkpoint layout].

    Args:
        path: a directory (created if missing), on storage every rank can reach.
        model: the sharded model, between training steps (every rank must call this).
        optimizer: its optimizer, or None.
        step: the training step (a non-negative int), returned by ``load``.
        extra: JSON-serializable user metadata (numbers, strings, lists, dicts), returned
            by ``load``.
        block: False: return once this rank's values are copied to host memory and write
            them in the background (Note [background saves]); training may change the
            model and optimizer meanwhile, the copy is what is saved.

    Returns:
        With ``block=False`` a handle whose ``result()`` waits for the write (the next save,
        a load, an export and the interpreter's exit wait for it too); else None.

    Raises:
        FullShardError: before anything is written, on bad arguments; on every rank, with the
            previous checkpoint kept, when any rank cannot write (a full or read-only disk)
            or stops taking part (with ``block=False``: from ``result()`` or the next wait).
    """
    check_path(path, "save")
    check_optimizer(optimizer)
    require(step is None or type(step) is int and 0 <= step <= MAX_INT,
            f"save(step={step!r}) must be a non-negative int or None", "Pass step=1000.")
    require(type(block) is bool, f"save(block={block!r}) must be True or False", "Pass block=False to write in "
            "the background.")
    check_json(extra, f"extra={extra!r}"[:200])
    background.wait_for_saves()  # one save at a time: the one in flight first (its failure raises here)
    model_sd, optim_sd = get_state_dict(model, optimizer, full=False)
    timeout = units_of(model, "save")[0].timeout
    replica = replica_of(model)
    if replica is not None:
        check_own_path(Path(path), replica, timeout)
    if optimizer is not None and pipeline_stage(model):
        name_every_stage(optim_sd, timeout)
    flat, mapping = flatten_state_dict({"model": model_sd, "optim": optim_sd} if optimizer is not None
                                       else {"model": model_sd})
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            check_json(value, f"the optimizer's {key[len('optim.'):]} ({type(value).__name__})")
        elif value.dtype not in LOADABLE.values():
            raise fail(f"{key} is of dtype {value.dtype}, which fullshard's checkpoints do not hold",
                       f"Keep the state in one of {', '.join(LOADABLE)} (Note [loaded dtypes]).")
    path = Path(path)
    optimizer_name = type(optimizer).__name__ if optimizer is not None else None
    group = timed_group(timeout) if replica is None else replica.own  # timed_group: made here if new (collective)
    if block:
        write_version(path, flat, mapping, optimizer_name, step, extra, timeout, group)
        return None
    staged, copies = stage(model, flat)
    extra, what = copy.deepcopy(extra), f"the save to {path}"

    def write() -> None:  # no other thread uses `group` meanwhile: every other agreement waits for this first
        copies.wait(timeout, f"the copies to host memory of {what}")
        write_version(path, staged, mapping, optimizer_name, step, extra, timeout, group)

    return background.start(what, write)


# Note [stage checkpoints]: every rank of a pipeline saves its own stage, built the torchtitan
# way (the whole model's module tree, other stages' layers taken out), so the checkpoint holds
# every stage's entries under the whole model's names. A stage's optimizer holds its own
# stage's parameters, so each parameter group is saved naming every stage's (in rank order),
# with the hyperparameters all stages share. A load by a pipeline stage reads its own entries
# and refuses only what no rank's stage holds: a checkpoint of a pipeline loads at any other
# number of stages, without a pipeline, and into a plain model (dcp.load).


def pipeline_stage(model: nn.Module) -> bool:
    """Whether `model` shards over some of the ranks only: a pipeline stage's (or, with tensor
    parallelism, a data-parallel sub-mesh's), whose checkpoint other ranks' stages share; not
    a replica group's, whose checkpoint is its own (Note [replica checkpoints])."""
    return units_of(model, "checkpoints")[0].group.mesh.size() < dist.get_world_size() and replica_of(model) is None


# Note [replica checkpoints]: fullshard.DiLoCo's replica groups in one job hold different
# parameters and inner optimizer states between syncs, so each saves a checkpoint of its own,
# at a path of its own: a save's and a load's agreements run over the group's own ranks
# (ReplicaOf.own), which are numbered within it, and a save first compares the paths across
# the replicas (one path for two groups would put one group's shards over the other's). Each
# loads its own; the run resumes when every group's newest checkpoint is of the same step
# (DiLoCo's headers refuse replicas at different steps at the first sync).


def check_own_path(path: Path, replica: ReplicaOf, timeout: timedelta) -> None:
    """Refuse, on every rank, a save of replica groups to one path (Note [replica checkpoints])."""
    where = os.path.realpath(path)
    try:
        paths = all_gather_json(where, device=torch.device("cpu"), timeout=timeout, group=replica.replicas)
    except CollectiveError as e:
        raise collective_failed("comparing the replica groups' checkpoint paths", e, "Every replica group must "
                                "save at the same step.", timeout) from None
    if len(set(paths)) < len(paths):
        raise fail(f"replica groups save to one path ({where}): DiLoCo's groups hold different parameters between "
                   f"syncs, and one checkpoint would hold one group's shards over another's",
                   "Give each replica group a path of its own, e.g. f'checkpoint/replica_{r}'.")


def name_every_stage(optim_sd: dict, timeout: timedelta) -> None:
    """Each parameter group of a pipeline stage's optimizer state dict, naming every stage's
    parameters (Note [stage checkpoints])."""
    groups = optim_sd["param_groups"]
    mine = [{key: value for key, value in group.items() if key != "params"} for group in groups]
    everyone = all_gather_json([[group["params"] for group in groups], mine], device=torch.device("cpu"),
                               timeout=timeout)
    mine = json.loads(json.dumps(mine))  # as JSON carries them: tuples become lists
    if any(theirs != mine for _, theirs in everyone):
        raise fail(f"the ranks' optimizers have other parameter groups (rank 0: {everyone[0][1]}; this rank: {mine})",
                   "Build every pipeline stage's optimizer with the same parameter groups and hyperparameters: a "
                   "checkpoint keeps one set for the whole model.")
    for i, group in enumerate(groups):
        group["params"] = list(dict.fromkeys(name for names, _ in everyone for name in names[i]))


def stage(model: nn.Module, flat: dict[str, Any]) -> tuple[dict[str, Any], background.Staged]:
    """What a background save writes: this rank's parts of `flat` copied to the model's host
    buffers (each DTensor's local part where this rank saves it, Note [checkpoint layout];
    every plain tensor, since which rank writes one is agreed later; plain values as
    copies), and the copies in flight."""
    rank = dist.get_rank()
    locals_ = {key: value.to_local() if isinstance(value, DTensor) else value for key, value in flat.items()
               if isinstance(value, torch.Tensor) and (not isinstance(value, DTensor) or saved_here(value, None, rank))}
    copies = background.staging_of(model).copy(locals_)
    buffers = copies.buffers
    staged: dict[str, Any] = {}
    for key, value in flat.items():
        if key in buffers:
            staged[key] = DTensor(buffers[key], value._spec, requires_grad=False) if isinstance(value, DTensor) \
                else buffers[key]
        elif not isinstance(value, torch.Tensor):
            staged[key] = copy.deepcopy(value)
    return staged, copies


def write_version(path: Path, flat: dict[str, Any], mapping: dict[str, tuple], optimizer_name: str | None,
                  step: int | None, extra: Any, timeout: timedelta, group: dist.ProcessGroup) -> None:
    """The phases of a save (Note [checkpoint phases]), each ending in an agreement on `group`."""
    what = f"the save to {path}"
    kept = f"the previous checkpoint at {path} is unchanged"
    rank = dist.get_rank(group)  # the world's, but in a replica group's own (Note [replica checkpoints])
    # phase 1: rank 0 makes the version directory; every rank says which plain values it holds
    token, error = secrets.token_hex(6), None
    if rank == 0:
        try:
            prepare(path, f"v-{token}")
        except Exception as e:
            error = f"{what} could not create its directory ({problem_of(e)})"
    plain = sorted(key for key, value in flat.items() if not isinstance(value, DTensor))
    fix = f"Free space on, or give write access to, the checkpoint's disk, or save to another path; {kept}"
    start = agree(what, "creating its version directory", timeout, {"error": error, "token": token, "plain": plain},
                  nothing_changed=kept, fix=fix, group=group)
    version = f"v-{start.reports[0]['token']}"
    owners: dict[str, int] = {}
    for r, report in reversed(list(enumerate(start.reports))):
        owners.update(dict.fromkeys(report["plain"], r))
    # phase 2: every rank writes its records
    written, error = {}, None
    try:
        with Folder.open(path) as root, root.sub(version) as folder:
            written = write_records(folder, flat, mapping, owners, rank)
    except Exception as e:  # every rank learns of it at the agreement, none waits for this one in vain
        error = f"{what} could not write this rank's shards ({problem_of(e)})"
    try:
        wrote = agree(what, "writing the shards", timeout, {"error": error, **written}, nothing_changed=kept, fix=fix,
                      group=group)
    except FullShardError:
        abandon(path, version, rank)
        raise
    # phase 3: rank 0 writes the manifest and the metadata, then switches LATEST
    error = None
    if rank == 0:
        try:
            commit(path, version, wrote.reports, optimizer_name, step, extra)
        except Exception as e:
            error = f"{what} could not write its metadata or switch LATEST ({problem_of(e)})"
            if latest_of(path) != version:
                abandon(path, version, rank)
    agree(what, "switching LATEST to the new version", timeout, {"error": error}, nothing_changed=kept, fix=fix,
          group=group)


def check_json(value: Any, what: str) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise fail(f"{what} cannot be saved: {e}", "Pass JSON-serializable values (numbers, strings, lists, "
                   "dicts); checkpoints never pickle arbitrary objects.") from None


def prepare(path: Path, version: str) -> None:
    """Rank 0: the checkpoint directory, cleared of versions whose save never finished, and the new version's."""
    with Folder.open(path, create=True) as root:
        for entry in root.entries():
            if VERSION.fullmatch(entry) and root.kind(entry) == "dir":
                with root.sub(entry) as old:
                    complete = old.kind(COMPLETE) == "file"
                if not complete:
                    root.remove_tree(entry)
        root.sub(version, create=True).close()


def latest_of(path: Path) -> str | None:
    """The version LATEST names now, if it can be read."""
    try:
        with Folder.open(path) as root:
            return root.read(LATEST, 64, math.inf).decode("ascii", "replace").strip()
    except OSError:
        return None


def abandon(path: Path, version: str, rank: int) -> None:
    """Rank 0: remove the version of a save that failed (best effort: the next save collects it too)."""
    if rank == 0:
        try:
            with Folder.open(path) as root:
                root.remove_tree(version)
        except OSError:
            pass


def saved_here(value: Any, owner: int | None, rank: int) -> bool:
    """Whether this rank writes `value` (Note [checkpoint layout]): a DTensor's local part once per
    set of replicas, anything else by its owner (the lowest rank holding it)."""
    if not isinstance(value, DTensor):
        return owner == rank
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in its mesh
        return False
    if value.to_local().numel() == 0 and value.numel() > 0:
        return False
    return all(c == 0 for c, p in zip(coordinate, value.placements) if isinstance(p, Replicate))


def piece(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's values, their offsets and sizes in the whole tensor)."""
    if not isinstance(value, DTensor):
        return value, (0,) * value.dim(), tuple(value.shape)
    sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return value.to_local(), tuple(offsets), tuple(sizes)


def write_records(folder: Folder, flat: dict[str, Any], mapping: dict[str, tuple], owners: dict[str, int],
                  rank: int) -> dict:
    """This rank's data file, with the records it owns; what it wrote, for the manifest."""
    mine = [(key, value) for key, value in flat.items() if saved_here(value, owners.get(key), rank)]
    if not mine:
        return {"file": None, "tensors": {}, "values": {}, "paths": {}}
    file = f"__{rank}_0.distcp"
    tensors: dict[str, dict] = {}
    values: dict[str, list] = {}
    layouts: dict[tuple, tuple[int, manifest.Layout]] = {}  # torch.save lays out alike tensors alike
    with folder.create(file) as out:
        for key, value in mine:
            begin = out.tell()
            if isinstance(value, torch.Tensor):
                local, offsets, sizes = piece(value)
                local = local.detach().cpu()
                save_record(local, out)
                alike = (local.dtype, tuple(local.shape), local.stride(), local.storage_offset(),
                         local.untyped_storage().nbytes())
                length, layout = layouts.get(alike, (None, None))
                if length != out.tell() - begin:  # the first of its kind: read where torch.save put the values
                    out.flush()
                    layout = dcp_format.record_layout(View(out.fd, begin, out.tell() - begin, math.inf),
                                                      local.dtype, sizes)
                    layouts[alike] = (out.tell() - begin, layout)
                tensors[key] = {"dtype": manifest.dtype_name(value.dtype), "shape": list(value.shape),
                                "chunk": [list(offsets), list(sizes), begin, out.tell() - begin, layout.data_offset,
                                          layout.storage_numel, layout.storage_offset, list(layout.stride)]}
            else:
                save_record(value, out)
                values[key] = [begin, out.tell() - begin, value]
        out.commit()
    return {"file": [file, out.size, out.crc], "tensors": tensors, "values": values,
            "paths": {key: list(mapping[key]) for key, _ in mine}}


def save_record(value: Any, out: Writer) -> None:
    """torch.save `value` into `out`; a write that failed raises as itself (torch.save reports it
    as a RuntimeError of its own)."""
    try:
        torch.save(value, out)
        return
    except RuntimeError:
        if out.failure is None:
            raise
    raise out.failure  # outside the except: no context holding torch.save's frames


def commit(path: Path, version: str, reports: list[dict], optimizer_name: str | None, step: int | None,
           extra: Any) -> None:
    """Rank 0: the manifest and DCP's metadata from every rank's records, COMPLETE, then LATEST."""
    contents = Contents(step=step, extra=extra, fullshard=True, optimizer=optimizer_name)
    kinds: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    chunks: dict[str, list[Chunk]] = {}
    paths: dict[str, tuple] = {}
    for report in reports:
        if report["file"] is None:
            continue
        file, size, crc = report["file"]
        contents.files[file] = (size, crc)
        for key, entry in report["tensors"].items():
            offsets, sizes, begin, length, data_offset, numel, storage_offset, stride = entry["chunk"]
            layout = manifest.Layout(data_offset, numel, storage_offset, tuple(stride))
            chunks.setdefault(key, []).append(Chunk(tuple(offsets), tuple(sizes), file, begin, length, layout))
            kinds[key] = (manifest.LOADABLE[entry["dtype"]], tuple(entry["shape"]))
        for key, (begin, length, value) in report["values"].items():
            contents.values[key] = manifest.SavedValue(value, file, begin, length)
        paths.update({key: tuple(p) for key, p in report["paths"].items()})
    contents.tensors = {key: SavedTensor(*kinds[key], tuple(sorted(chunks[key], key=lambda c: c.offsets)))
                        for key in kinds}
    with Folder.open(path) as root:
        with root.sub(version) as folder:
            folder.write_durably(METADATA, dcp_format.metadata_bytes(contents, paths, str(path / version), version))
            folder.write_durably(MANIFEST, manifest.to_json(contents).encode())
            folder.write_durably(COMPLETE, b"")
        root.write_durably(LATEST, version.encode())  # the switch: atomic
        for entry in root.entries():  # the previous version, and any a kill left between switch and removal
            if VERSION.fullmatch(entry) and entry != version:
                root.remove_tree(entry)


# ---- load -----------------------------------------------------------------------------------------


def open_version(path: Path, deadline: float) -> tuple[Folder, Contents]:
    """The directory a load reads and what it holds: the version LATEST names (through its
    fullshard.json), or a plain DCP directory (its .metadata, read as data)."""
    try:
        root = Folder.open(path)
    except (FileNotFoundError, NotADirectoryError):
        raise not_a_checkpoint(path) from None
    if root.kind(LATEST) is None:
        try:
            return root, plain_contents(root, path, deadline)
        except BaseException:
            root.close()
            raise
    try:
        folder = root.sub(latest_version(root, path, deadline))
    finally:
        root.close()
    try:
        if folder.kind(COMPLETE) != "file":
            raise fail(f"checkpoint {path} names version {folder.path.name}, which is incomplete",
                       "Its save was interrupted; load an earlier checkpoint or save again.")
        kind = folder.kind(MANIFEST)
        if kind != "file":
            what = f"has no {MANIFEST}" if kind is None else f"has a {MANIFEST} that is not a regular file (a link?)"
            raise fail(f"checkpoint {path}: version {folder.path.name} {what}, which lists what it holds and the "
                       f"checksums of its files", DAMAGED_FIX)
        text = folder.read(MANIFEST, MAX_MANIFEST, deadline).decode("utf-8", "replace")
        return folder, manifest.read(text, f"{folder.path / MANIFEST}", deadline)
    except BaseException:
        folder.close()
        raise


def plain_contents(root: Folder, path: Path, deadline: float) -> Contents:
    """What a plain DCP directory holds, from its .metadata read as data."""
    if root.kind(METADATA) != "file":
        raise not_a_checkpoint(path)
    try:
        return dcp_format.read_metadata(root.read(METADATA, MAX_MANIFEST, deadline), f"{path}", deadline)
    except dcp_format.FormatError as e:
        raise fail(f"checkpoint {path} could not be read: its {METADATA} is not DCP metadata fullshard reads ({e})",
                   DAMAGED_FIX) from None


def latest_version(root: Folder, path: Path, deadline: float) -> str:
    """The version directory LATEST names, checked to be one."""
    version = root.read(LATEST, 64, deadline).decode("ascii", "replace").strip() if root.kind(LATEST) == "file" else ""
    if not VERSION.fullmatch(version) or root.kind(version) != "dir":
        raise fail(f"checkpoint {path}: its {LATEST} names {version[:64]!r}, which is not a version directory of it",
                   DAMAGED_FIX)
    return version


def not_a_checkpoint(path: Path) -> FullShardError:
    return fail(f"{path} is not a checkpoint (no {LATEST} file and no DCP {METADATA})",
                "Pass the directory given to fullshard.save (or a torch.distributed.checkpoint directory).")


def checkpoint_dir(path: str | Path) -> Path:
    """The DCP directory of the latest complete checkpoint at `path` (for dcp.load).

    Raises:
        FullShardError: when `path` holds no complete checkpoint.
    """
    check_path(path, "checkpoint_dir")
    folder, _ = open_version(Path(path), time.monotonic() + 300)
    with folder:
        return folder.path


@normal_tensors
def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint written by ``save`` (at any world size, under any strategy) or a
    plain DCP directory with "model" (and "optim") entries.

    Args:
        path: the directory given to ``save``.
        model: the sharded model to load into (every rank must call this).
        optimizer: its optimizer, or None to load the model only.

    Returns:
        ``{"step": ..., "extra": ...}`` as saved (``None`` for a plain DCP directory).

    Raises:
        FullShardError: on every rank, with nothing loaded: when `path` is not a (complete,
            undamaged) checkpoint, its names or shapes do not fit the model (all listed), it
            holds no optimizer state or another optimizer's when `optimizer` is given, or a
            rank stops taking part.
    """
    check_path(path, "load")
    check_optimizer(optimizer)
    background.wait_for_saves()  # a save in flight (to this path or not) ends first
    units = units_of(model, "load")
    reshard_all(model)  # refuses a pending unshard before anything is read
    timeout = units[0].timeout
    deadline = time.monotonic() + timeout.total_seconds()
    path = Path(path)
    what, untouched = f"the load of {path}", "nothing was loaded"
    replica = replica_of(model)
    group = None if replica is None else replica.own  # None: the checkpoints' timed group
    folder, contents, report = None, None, {"error": None, "version": "", "damaged": [], "elsewhere": []}
    try:
        folder, contents = open_version(path, deadline)
        report["version"] = folder.path.name
        report["elsewhere"] = check_fits(folder, contents, model, optimizer, deadline, pipeline_stage(model))
        report["damaged"] = damaged_files(folder, contents, deadline, group)
    except FullShardError as e:
        report["error"] = str(e)
    except Exception as e:  # OSError, FormatError, ...: whatever a file made this rank raise, every rank says
        report["error"] = str(unreadable(path, e))
    try:
        checked = agree(what, "checking the checkpoint", timeout, report, nothing_changed=untouched, group=group)
        if len({r["version"] for r in checked.reports}) > 1:
            raise fail(f"{what}: ranks found different versions ({sorted({r['version'] for r in checked.reports})}; "
                       f"a save to it ran meanwhile); {untouched}", "Load again once the save has finished.")
        problems = sorted({p for r in checked.reports for p in r["damaged"]})
        if problems:
            raise fail(f"checkpoint {path} is damaged ({'; '.join(problems)}); {untouched}", DAMAGED_FIX)
        unloaded = sorted(set.intersection(*(set(r["elsewhere"]) for r in checked.reports)))
        if unloaded:  # Note [stage checkpoints]: entries no rank's stage holds
            raise fail(f"the checkpoint does not fit the model (unexpected: {unloaded[:8]}"
                       f"{' ...' if len(unloaded) > 8 else ''}, on every rank's stage); {untouched}",
                       "Use one of the same architecture, with the unwrapped model's names, every entry in some "
                       "rank's pipeline stage.")
        model_sd, state = read_state(folder, contents, model, optimizer, deadline, what, timeout,
                                     pipeline_stage(model), group)
    finally:
        if folder is not None:
            folder.close()
    if "optim" in state:
        load_optimizer_state(model, optimizer, state["optim"])  # checks it fits, then replaces it at once
    load_model_state(model, model_sd)
    return {"step": contents.step, "extra": contents.extra}


def unreadable(path: Path, error: Exception) -> FullShardError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return fail(f"checkpoint {path} could not be read ({type(error).__name__}: {first[:300]}): a file is "
                f"corrupted, truncated or not a checkpoint's", DAMAGED_FIX)


def optimizer_keys(contents: Contents) -> list[str]:
    return [key for key in (*contents.tensors, *contents.values) if key.startswith("optim.")]


def check_fits(folder: Folder, contents: Contents, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               deadline: float, stage: bool) -> list[str]:
    """Refuse a checkpoint whose tensors do not fit the model, or whose optimizer state (or its lack) does not
    fit `optimizer`. A pipeline stage (`stage`) holds some of the checkpoint's entries: the others are
    returned, for the ranks to check that some stage holds each (Note [stage checkpoints])."""
    shapes = {key[len("model."):]: torch.Size(t.shape) for key, t in contents.tensors.items()
              if key.startswith("model.")}
    entries = state_entries(model)
    elsewhere = sorted(set(shapes) - set(entries)) if stage else []
    check_names_and_shapes(entries, {name: shape for name, shape in shapes.items() if name not in elsewhere},
                           "checkpoint")
    wrong = [f"{name}: {problem}" for name in shapes if name in entries
             if (problem := dtype_problem(contents.tensors[f"model.{name}"].dtype, value_of(entries[name]).dtype))]
    for key, saved in contents.values.items():
        if key.startswith("model."):  # a model entry that is no tensor: nothing a model holds
            wrong.append(f"{key[len('model.'):]}: a plain value, where the model holds a tensor")
    if wrong:
        raise fail(f"checkpoint {folder.path} holds model tensors that cannot land in the model's "
                   f"({'; '.join(sorted(wrong)[:8])}{' ...' if len(wrong) > 8 else ''})", "Load a checkpoint "
                   "of this model in its own dtypes (or another floating-point one: Note [loaded dtypes]).")
    if optimizer is None:
        return elsewhere
    if not optimizer_keys(contents):
        raise fail(f"checkpoint {folder.path} holds no optimizer state (it was saved with optimizer=None), and an "
                   f"optimizer was given to load into", "Pass optimizer=None to load the model only (the optimizer "
                   "then starts afresh), or load a checkpoint saved with its optimizer.")
    mine = type(optimizer).__name__
    if contents.optimizer is not None and contents.optimizer != mine:
        raise fail(f"checkpoint {folder.path} holds the state of a {contents.optimizer} optimizer, not of a {mine}",
                   f"Build a {contents.optimizer} with the same parameter groups, or pass optimizer=None to load "
                   f"the model only.")
    groups = saved_groups(folder, contents, deadline)
    sizes = [len(g["params"]) if isinstance(g.get("params"), list) else None for g in groups]
    if any(size is None for size in sizes):
        raise fail(f"checkpoint {folder.path}'s optimizer has a parameter group without a list of parameters",
                   DAMAGED_FIX)
    if len(sizes) != len(optimizer.param_groups) or not stage and sizes != [len(g["params"]) for g in
                                                                            optimizer.param_groups]:
        raise fail(f"checkpoint {folder.path}'s optimizer has parameter groups of {sizes} parameters, this one "
                   f"{[len(g['params']) for g in optimizer.param_groups]}",
                   "Build the optimizer with the same parameter groups as the one that was saved, or pass "
                   "optimizer=None to load the model only.")
    names = param_names(model)
    for i, (saved, group) in enumerate(zip(groups, optimizer.param_groups)):
        missing = sorted(set(group) - set(saved) - {"params"})
        if missing:
            raise fail(f"checkpoint {folder.path}'s optimizer state has no {', '.join(map(repr, missing))} in "
                       f"parameter group {i} (it has {sorted(set(saved) - {'params'})}): it was saved from another "
                       f"kind of optimizer than this {mine}", "Build the optimizer of the saved run, or pass "
                       "optimizer=None to load the model only.")
        mine = {names[p] for p in group["params"]}
        if not (isinstance(saved["params"], list) and all(isinstance(n, str) for n in saved["params"])
                and (set(saved["params"]) >= mine if stage else sorted(saved["params"]) == sorted(mine))):
            raise fail(f"checkpoint {folder.path}'s optimizer steps other parameters in group {i} than this one",
                       "Build the optimizer with the same parameter groups as the one that was saved, or pass "
                       "optimizer=None to load the model only.")
    saved_state = saved_items(contents, model, optimizer, stage)
    if problems := hyperparameter_problems(groups, optimizer) + optimizer_state_problems(model, optimizer, saved_state):
        raise fail(f"checkpoint {folder.path}'s optimizer state does not fit this {mine} "
                   f"({'; '.join(problems[:8])}{' ...' if len(problems) > 8 else ''})",
                   "Load a checkpoint saved with an optimizer of this kind and these parameters, or pass "
                   "optimizer=None to load the model only.")
    return elsewhere


def saved_groups(folder: Folder, contents: Contents, deadline: float) -> list[dict]:
    """The saved optimizer's parameter groups, from their flattened items ("optim.param_groups.<i>.<key>";
    a tensor hyperparameter stands as its dtype and shape)."""
    groups: dict[int, dict] = {}
    for key in optimizer_keys(contents):
        parts = key.split(".", 3)
        if len(parts) == 4 and parts[1] == "param_groups" and parts[2].isdigit():
            saved = contents.values.get(key)
            value = value_of_record(folder, saved, deadline) if saved is not None else \
                (contents.tensors[key].dtype, contents.tensors[key].shape)
            groups.setdefault(int(parts[2]), {})[parts[3]] = value
    return [groups[i] for i in sorted(groups)]


def value_of_record(folder: Folder, saved: manifest.SavedValue, deadline: float) -> Any:
    """A non-tensor item's value: as the manifest holds it, or read from its record as data."""
    if saved.file is None:  # the manifest's own value
        return saved.value
    fd = folder.open_read(saved.file)
    try:
        return dcp_format.record_value(View(fd, saved.start, saved.length, deadline))
    finally:
        os.close(fd)


def damaged_files(folder: Folder, contents: Contents, deadline: float, group: dist.ProcessGroup | None) -> list[str]:
    """Data files missing, shorter than the records reach, of another size than saved or (a share of
    them per rank of `group`, default all, fullshard's checkpoints) of another CRC-32 (Note [failed load])."""
    needed = contents.needed()
    names = sorted(set(needed) | set(contents.files))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problems = []
    for i, file in enumerate(names):
        listed = contents.files.get(file)
        try:
            size = folder.size(file)
        except FileNotFoundError:
            size = -1
        if size < needed.get(file, 0) or listed is not None and size != listed[0]:
            problems.append(f"{file}: missing, truncated or resized")
        elif listed is not None and i % world == rank and folder.crc32(file, deadline)[0] != listed[1]:
            problems.append(f"{file}: checksum differs")
    return problems


def saved_items(contents: Contents, model: nn.Module, optimizer: torch.optim.Optimizer, stage: bool) -> dict:
    """The checkpoint's items, tensors as (dtype, shape): of a pipeline stage, without the optimizer
    state of parameters other stages hold (Note [stage checkpoints])."""
    saved = {**{key: (t.dtype, t.shape) for key, t in contents.tensors.items()}, **dict.fromkeys(contents.values)}
    if not stage:
        return saved
    names = param_names(model)
    mine = {names[p] for group in optimizer.param_groups for p in group["params"]}
    return {key: item for key, item in saved.items()
            if not key.startswith("optim.state.") or key[len("optim.state."):].rsplit(".", 1)[0] in mine}


def read_state(folder: Folder, contents: Contents, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               deadline: float, what: str, timeout: timedelta, stage: bool,
               group: dist.ProcessGroup | None) -> tuple[dict, dict]:
    """New buffers holding this rank's part of the checkpoint (Note [failed load]): the model's
    (one per tied entry) and, with `optimizer`, its state; agreed on by every rank of `group`
    (default: all)."""
    entries = state_entries(model)
    fresh: dict[int, torch.Tensor] = {}
    model_sd = {name: fresh.setdefault(id(entry), new_like(value_of(entry)))
                for name, entry in entries.items() if f"model.{name}" in contents.tensors}
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optimizer_template(model, optimizer, saved_items(contents, model, optimizer, stage))
    error = None
    try:
        flat, mapping = flatten_state_dict(state)
        for key, target in flat.items():
            if isinstance(target, torch.Tensor):
                read_tensor(folder, key, contents.tensors[key], target, deadline)
            elif key in contents.values and not (stage and key.startswith("optim.param_groups.")
                                                 and key.endswith(".params")):  # a stage's own names stay
                set_element(state, mapping[key], value_of_record(folder, contents.values[key], deadline))
    except FullShardError as e:
        error = str(e)
    except Exception as e:  # OSError, FormatError, ...: every rank says what this one found
        error = str(unreadable(folder.path, e))
    agree(what, "reading the tensors", timeout, {"error": error}, nothing_changed="nothing was loaded", group=group)
    return model_sd, state


def read_tensor(folder: Folder, key: str, saved: SavedTensor, target: torch.Tensor, deadline: float) -> None:
    """Fill this rank's part of `target` from the saved chunks that overlap it."""
    local, offsets, sizes = piece(target)
    covered = 0
    with torch.no_grad():
        for chunk in saved.chunks:
            low = [max(a, b) for a, b in zip(offsets, chunk.offsets)]
            high = [min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(h <= lo for lo, h in zip(low, high)):
                continue
            values = chunk_values(folder, chunk, saved.dtype, deadline)
            source = values[tuple(slice(lo - c, h - c) for lo, h, c in zip(low, high, chunk.offsets))]
            local[tuple(slice(lo - o, h - o) for lo, h, o in zip(low, high, offsets))].copy_(source)
            covered += math.prod(h - lo for lo, h in zip(low, high))
    if covered != math.prod(sizes):
        raise fail(f"checkpoint {folder.path} does not hold all of {key} (this rank needs {math.prod(sizes)} of its "
                   f"elements, the saved chunks give {covered})", DAMAGED_FIX)


def chunk_values(folder: Folder, chunk: Chunk, dtype: torch.dtype, deadline: float) -> torch.Tensor:
    """A saved chunk's values, read from its record (only the bytes its view spans)."""
    fd = folder.open_read(chunk.file)
    try:
        view = View(fd, chunk.start, chunk.length, deadline)
        layout = dcp_format.record_layout(view, dtype, chunk.sizes)  # the record's own header: the values' place
        if chunk.layout is not None and chunk.layout != layout:
            raise fail(f"checkpoint {folder.path}'s manifest places a chunk of {chunk.file} at {tuple(chunk.layout)} "
                       f"(data offset, storage size, offset, strides), its record at {tuple(layout)}", DAMAGED_FIX)
        if not math.prod(chunk.sizes):
            return torch.empty(chunk.sizes, dtype=dtype)
        span = 1 + sum((s - 1) * d for s, d in zip(chunk.sizes, layout.stride))
        first = layout.data_offset + layout.storage_offset * dtype.itemsize
        raw = bytearray(view.read_range(first, span * dtype.itemsize))
    finally:
        os.close(fd)
    return torch.frombuffer(raw, dtype=dtype).as_strided(chunk.sizes, layout.stride)
