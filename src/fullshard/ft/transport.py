"""Healing a replica group: the state of the model's shards and the optimizer's, sent by a live
group to a joining one over torchft's managed process group, as torchft's CheckpointTransport
plug-in (Note [heal format]). Nothing is pickled, nothing listens: the bytes travel on the
process group the Manager already configured.

Note [heal format]: each rank of the source group sends its peer of the same group rank
1. the header's length, one int64;
2. the header, UTF-8 JSON of a closed schema (HEADER_KEYS): the step, torchft's counters, each
   tensor's key, dtype (one of state_dict.LOADABLE), global and local shape and byte count in
   the order the bytes follow, the optimizer's non-tensor state and parameter groups as JSON,
   and the JSON values of any other state the user registered with the Manager;
3. each tensor's bytes (this rank's local shard), received straight into a buffer laid out as
   the joiner's own.
The joiner checks before anything is received that it can be: the source's `metadata()` (a
digest of the layout of its model shards, optimizer kind and parameter groups) equals its own,
the header's length is under the cap, its schema is closed, and every tensor has the dtype,
shapes and byte count the joiner's own model and optimizer give it (optimizer state is checked
by the rules a checkpoint's is, and is no larger than its parameter). A refusal is a
FullShardError, final for the joiner (manager.py): it never retries into a livelock.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchft.checkpointing.transport import CheckpointTransport

from fullshard.errors import FullShardError, fail
from fullshard.hooks import units_of
from fullshard.state_dict import (LOADABLE, dtype_name, hyperparameter_problems, new_like, optimizer_state,
                                  optimizer_state_problems, optimizer_template, state_entries, value_of)

FORMAT, VERSION = "fullshard-heal", 1
HEADER_KEYS = frozenset({"format", "version", "layout", "step", "torchft", "tensors", "values", "groups", "user"})
TENSOR_KEYS = frozenset({"key", "dtype", "shape", "local", "nbytes"})
METADATA_CAP = 4096  # bytes of the source's metadata() the joiner reads
HEADER_BASE, HEADER_PER_ENTRY = 1 << 20, 1 << 10  # the header cap: 1 MiB + 1 KiB per own model or optimizer entry
REFUSED = "The joining group stops here: restart it with the same model, sharding and optimizer as the live groups"


@dataclass
class Shards:
    """What one rank sends: its tensors by flat key, in order, and the JSON of the rest."""
    tensors: dict[str, torch.Tensor]  # "model.<name>", "optim.state.<name>.<key>": DTensor or plain
    values: dict[str, Any]  # "optim.state.<name>.<key>": non-tensor optimizer state
    groups: list[dict]  # the optimizer's parameter groups, "params" as names


@dataclass
class Healed:
    """What a joiner received, in buffers of its own layout: loaded by manager.attach's load."""
    model_sd: dict[str, torch.Tensor]
    optim_sd: dict[str, Any]


def unique_entries(model: nn.Module) -> dict[str, Any]:
    """The model's state entries under their first names (a tied tensor once)."""
    first: dict[int, tuple[str, Any]] = {}
    for name, entry in state_entries(model).items():
        first.setdefault(id(entry), (name, entry))
    return dict(first.values())


def local_of(value: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return value.to_local() if isinstance(value, DTensor) else value


def tensor_record(key: str, value: torch.Tensor) -> dict:
    local = local_of(value)
    return {"key": key, "dtype": dtype_name(value.dtype), "shape": list(value.shape), "local": list(local.shape),
            "nbytes": local.numel() * local.element_size()}


def shards_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Shards:
    """This rank's state, read without a collective or a change (torchft asks from its quorum
    thread while the next forward runs: Note [heal timing] in manager.py)."""
    tensors = {f"model.{name}": value_of(entry) for name, entry in unique_entries(model).items()}
    values: dict[str, Any] = {}
    groups: list[dict] = []
    if optimizer is not None:
        sd = optimizer_state(model, optimizer, full=False, cpu_offload=False, keep=True)
        params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
        for name, state in sd["state"].items():
            for key, value in state.items():
                flat = f"optim.state.{name}.{key}"
                if not isinstance(value, torch.Tensor):
                    values[flat] = value
                elif tuple(value.shape) != tuple(params[name].shape) and value.numel() > 1:
                    raise fail(f"healing carries optimizer state shaped as its parameter or scalars; "
                               f"{type(optimizer).__name__} keeps {flat} of shape {tuple(value.shape)} for a parameter "
                               f"of {tuple(params[name].shape)}", "Use an optimizer whose state is elementwise or "
                               "scalar (AdamW, SGD, fullshard.optim.Muon) with fault tolerance.")
                else:
                    tensors[flat] = value
        groups = sd["param_groups"]
    return Shards(tensors, values, groups)


def layout_digest(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> str:
    """A digest of what must match between a source and a joiner of the same group rank."""
    own = [(name, tensor_record(name, value_of(entry))) for name, entry in unique_entries(model).items()]
    groups = [] if optimizer is None else [g["params"] for g in optimizer_state(
        model, optimizer, full=False, cpu_offload=False, keep=True)["param_groups"]]
    text = json.dumps({"model": own, "optimizer": type(optimizer).__name__, "groups": groups}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def as_json(value: Any, what: str) -> Any:
    """`value` as JSON (tuples become lists), or a named refusal."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise fail(f"healing sends {what} as JSON, and it is not JSON ({e})", "Keep plain numbers, strings, lists "
                   "and dicts in it (a tensor hyperparameter: a float instead).") from None


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class HealTransport(CheckpointTransport):
    """torchft's CheckpointTransport over its own managed process group `pg`: Note [heal format].
    `attach` gives it the model and optimizer it sends and checks against."""

    def __init__(self, pg, timeout: timedelta) -> None:
        self.pg = pg
        self.timeout = timeout
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.digest = "unattached"

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        units_of(model, "fault tolerance")
        self.model, self.optimizer = model, optimizer
        self.digest = layout_digest(model, optimizer)

    def metadata(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "layout": self.digest})

    def disallow_checkpoint(self) -> None:
        """Nothing is served between quorums: the state is read and sent inside send_checkpoint."""

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to stop: no thread, no socket."""

    # ---- the source ---------------------------------------------------------------------------

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        header, tensors = self.header(step, state_dict)
        self.send_parts(dst_ranks, json.dumps(header).encode(), tensors, timeout)

    def header(self, step: int, state_dict: dict) -> tuple[dict, list[torch.Tensor]]:
        """The header of Note [heal format] for torchft's `state_dict` ({"user": ..., "torchft":
        ...}), and the tensors whose bytes follow it."""
        if self.model is None:
            raise fail("the Manager was asked for its state before fullshard.ft.attach(manager, model, optimizer)",
                       "Call attach before the first step.")
        shards: Shards = state_dict["user"]["fullshard"]
        header = {
            "format": FORMAT, "version": VERSION, "layout": self.digest, "step": step,
            "torchft": as_json(state_dict["torchft"], "torchft's counters"),
            "tensors": [tensor_record(key, value) for key, value in shards.tensors.items()],
            "values": as_json(shards.values, "the optimizer's non-tensor state"),
            "groups": as_json(shards.groups, "the optimizer's parameter groups"),
            "user": {key: as_json(value, f"the state registered as {key!r}")
                     for key, value in state_dict["user"].items() if key != "fullshard"},
        }
        return header, [local_of(value) for value in shards.tensors.values()]

    def send_parts(self, dst_ranks: list[int], text: bytes, tensors: list[torch.Tensor], timeout: timedelta) -> None:
        """The header's length, the header, each tensor's bytes: to every rank of `dst_ranks`."""
        device = self.device()
        parts = [torch.tensor([len(text)], dtype=torch.int64, device=device),
                 torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device)]
        parts += [as_bytes(tensor.contiguous()) for tensor in tensors]
        for part in parts:
            if part.numel():
                works = [self.pg.send([part], dst, 0) for dst in dst_ranks]
                for work in works:
                    work.wait(timeout)

    def device(self) -> torch.device:
        first = next(iter(state_entries(self.model).values()))
        return local_of(value_of(first)).device

    # ---- the joiner ---------------------------------------------------------------------------

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        if self.model is None:
            raise fail("a heal began before fullshard.ft.attach(manager, model, optimizer)", "Call attach before the "
                       "first step.")
        refuse_metadata(metadata, self.metadata())
        device = self.device()
        length = torch.zeros(1, dtype=torch.int64, device=device)
        self.pg.recv([length], src_rank, 0).wait(timeout)
        cap = HEADER_BASE + HEADER_PER_ENTRY * (len(state_entries(self.model)) + 8 * sum(
            len(g["params"]) for g in (self.optimizer.param_groups if self.optimizer is not None else [])))
        size = int(length.item())
        if not 0 < size <= cap:
            raise refused(f"its header would be {size} bytes, and this model's is at most {cap}")
        raw = torch.empty(size, dtype=torch.uint8, device=device)
        self.pg.recv([raw], src_rank, 0).wait(timeout)
        header = parse_header(bytes(raw.cpu().numpy()), step, self.digest)
        healed, targets = self.buffers_for(header)
        for target in targets:
            if target.numel():
                self.pg.recv([as_bytes(target)], src_rank, 0).wait(timeout)
        return {"user": {"fullshard": healed, **header["user"]}, "torchft": header["torchft"]}

    def buffers_for(self, header: dict) -> tuple[Healed, list[torch.Tensor]]:
        """New buffers, laid out as this rank's own state, for every tensor the header lists, in
        its order; every mismatch refused before one is made."""
        model, optimizer = self.model, self.optimizer
        records = {r["key"]: r for r in header["tensors"]}
        if len(records) != len(header["tensors"]):
            raise refused("its header lists a tensor twice")
        entries = unique_entries(model)
        model_keys = [r["key"] for r in header["tensors"] if r["key"].startswith("model.")]
        if model_keys != [f"model.{name}" for name in entries]:
            raise refused("its model tensors are not this model's (other names or order)")
        optim_keys = [key for key in records if key.startswith("optim.state.")]
        if len(model_keys) + len(optim_keys) != len(records):
            raise refused(f"its header lists tensors that are neither model nor optimizer state: "
                          f"{sorted(set(records) - set(model_keys) - set(optim_keys))[:4]}")
        saved = {**{key: (LOADABLE[records[key]["dtype"]], tuple(records[key]["shape"])) for key in optim_keys},
                 **dict.fromkeys(header["values"])}
        if optimizer is None:
            if saved or header["groups"]:
                raise refused("it sends optimizer state, and this group attached no optimizer")
            optim_sd: dict[str, Any] = {}
        else:
            optim_sd = self.optimizer_buffers(header, saved)
        fresh = {f"model.{name}": new_like(value_of(entry)) for name, entry in entries.items()}
        by_key = {**fresh, **{f"optim.state.{name}.{key}": value for name, state in optim_sd.get("state", {}).items()
                              for key, value in state.items() if isinstance(value, torch.Tensor)}}
        targets = []
        for record in header["tensors"]:
            target = by_key[record["key"]]
            expected = tensor_record(record["key"], target)
            if {k: record[k] for k in ("dtype", "shape", "local")} != {k: expected[k] for k in ("dtype", "shape", "local")}:
                raise refused(f"it sends {record['key']} as {record['dtype']} {record['shape']} (local "
                              f"{record['local']}), where this rank holds {expected['dtype']} {expected['shape']} "
                              f"(local {expected['local']})")
            if record["nbytes"] != expected["nbytes"]:
                raise refused(f"it says {record['key']} is {record['nbytes']} bytes, and {expected['dtype']} "
                              f"{expected['local']} is {expected['nbytes']}")
            targets.append(local_of(target))
        first_of = {id(entry): name for name, entry in entries.items()}
        model_sd = {name: fresh[f"model.{first_of[id(entry)]}"] for name, entry in state_entries(model).items()}
        return Healed(model_sd, optim_sd), targets

    def optimizer_buffers(self, header: dict, saved: dict) -> dict:
        model, optimizer = self.model, self.optimizer
        groups = header["groups"]
        if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups) or not all(
                isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
            raise refused(f"it sends {len(groups) if isinstance(groups, list) else 'no'} parameter groups, this "
                          f"{type(optimizer).__name__} has {len(optimizer.param_groups)}")
        names = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
        for key, (dtype, shape) in ((k, v) for k, v in saved.items() if v is not None):
            name = key[len("optim.state."):].rsplit(".", 1)[0]
            if name in names and math.prod(shape) > max(1, names[name].numel()):
                raise refused(f"it sends {key} of shape {list(shape)}, larger than its parameter "
                              f"{list(names[name].shape)}")
        try:
            problems = hyperparameter_problems(groups, optimizer) + optimizer_state_problems(model, optimizer, saved)
            template = optimizer_template(model, optimizer, saved)
        except FullShardError as e:
            raise refused(str(e)) from None
        if problems:
            raise refused(f"its optimizer state does not fit this {type(optimizer).__name__} "
                          f"({'; '.join(problems[:8])})")
        for key, value in header["values"].items():
            name, value_key = key[len("optim.state."):].rsplit(".", 1)
            template["state"].setdefault(name, {})[value_key] = value
        template["param_groups"] = groups
        return template


def refused(why: str) -> FullShardError:
    return fail(f"fault tolerance: this group refused the state a live group sent to heal it: {why}", REFUSED)


def refuse_metadata(theirs: str, own: str) -> None:
    """The source's metadata() against this rank's, before any byte of state moves."""
    if not isinstance(theirs, str) or len(theirs) > METADATA_CAP:
        raise refused("its metadata is not a short string")
    try:
        parsed = json.loads(theirs)
    except ValueError:
        raise refused(f"its metadata is not fullshard's ({theirs[:80]!r})") from None
    mine = json.loads(own)
    if not isinstance(parsed, dict) or parsed.get("format") != FORMAT or parsed.get("version") != VERSION:
        raise refused(f"its metadata is not fullshard's {FORMAT} version {VERSION} ({theirs[:80]!r})")
    if parsed.get("layout") != mine["layout"]:
        raise refused("its model shards, optimizer or parameter groups are laid out otherwise than this group's "
                      "(another model, sharding, world size or optimizer)")


def parse_header(text: bytes, step: int, digest: str) -> dict:
    """The header, checked against the closed schema of Note [heal format]."""
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise refused(f"its header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict) or set(header) != HEADER_KEYS:
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise refused(f"its header has the keys {got}, not {sorted(HEADER_KEYS)}")
    if header["format"] != FORMAT or header["version"] != VERSION or header["layout"] != digest:
        raise refused("its header is of another format, version or layout than its metadata said")
    if header["step"] != step:
        raise refused(f"it sends the state of step {header['step']!r}, and the quorum healed to step {step}")
    counters = header["torchft"]
    if not (isinstance(counters, dict) and set(counters) == {"step", "batches_committed"} and all(
            type(v) is int and v >= 0 for v in counters.values())):
        raise refused("its torchft counters are not two non-negative ints (step, batches_committed)")
    for name in ("values", "user"):
        if not isinstance(header[name], dict) or not all(isinstance(k, str) for k in header[name]):
            raise refused(f"its header's {name!r} is not an object")
    if any(not k.startswith("optim.state.") or k.count(".") < 3 for k in header["values"]):
        raise refused("its non-tensor values are not optimizer state")
    tensors = header["tensors"]
    if not isinstance(tensors, list):
        raise refused("its header's 'tensors' is not a list")
    for record in tensors:
        if not (isinstance(record, dict) and set(record) == TENSOR_KEYS and isinstance(record["key"], str)
                and record["dtype"] in LOADABLE and type(record["nbytes"]) is int
                and all(isinstance(record[s], list) and all(type(n) is int and n >= 0 for n in record[s])
                        for s in ("shape", "local"))):
            dtype = record.get("dtype") if isinstance(record, dict) else None
            raise refused(f"its tensor record {str(record)[:120]} is malformed" + (
                f" (dtype {dtype!r} is none of fullshard's: {sorted(LOADABLE)})"
                if isinstance(record, dict) and dtype not in LOADABLE else ""))
    return header
