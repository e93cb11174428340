"""State dicts of sharded models under the unwrapped model's names."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from fullshard.errors import fail
from fullshard.hooks import unit_hooks
from fullshard.param import ShardedParam
from fullshard.training import units_of


def state_entries(model: nn.Module) -> dict[str, ShardedParam | tuple[nn.Module, str]]:
    """Every name of `model.state_dict()` (the unwrapped model's), with what it names: a
    sharded parameter, or (module, name) of a persistent buffer or unmanaged parameter.
    Tied parameters appear under each of their names."""
    sharded = {p.sharded: p for m in model.modules() if (hooks := unit_hooks(m)) is not None for p in hooks.unit.params}
    entries: dict[str, ShardedParam | tuple[nn.Module, str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, param in module._parameters.items():
            if param is not None:
                entries[dot + key] = sharded.get(param, (module, key))
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                entries[dot + key] = (module, key)
    return entries


def check_names_and_shapes(entries: dict[str, object], state_dict: Mapping[str, torch.Tensor], what: str) -> None:
    """Refuse, listing every problem, a state dict that does not fit the model's names and shapes.

    A tied parameter is satisfied by any one of its names.
    """
    def shape_of(entry: object) -> torch.Size:
        return entry.shape if isinstance(entry, ShardedParam) else getattr(entry[0], entry[1]).shape

    provided = set(state_dict)
    covered = {id(entry) for name, entry in entries.items() if name in provided}
    missing = sorted(name for name, entry in entries.items() if id(entry) not in covered)
    unexpected = sorted(provided - set(entries))
    wrong = sorted(f"{name}: checkpoint {tuple(state_dict[name].shape)}, model {tuple(shape_of(entry))}"
                   for name, entry in entries.items() if name in provided
                   and tuple(state_dict[name].shape) != tuple(shape_of(entry)))
    if missing or unexpected or wrong:
        problems = "; ".join(f"{label}: {items}" for label, items in
                             (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items)
        raise fail(f"{what} does not fit the model ({problems})",
                   "Use a state dict of the same architecture, with the unwrapped model's names "
                   "(model.state_dict() of the model built without fullshard).")


def init_weights_from(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict, e.g. pretrained weights, into a sharded model.

    Each rank copies only its own rows of each tensor into its shards, one tensor at a
    time and without communication, so no rank builds a full parameter; with a lazily
    loaded state dict (e.g. ``safetensors.safe_open`` tensors or a memory-mapped
    ``torch.load(..., mmap=True)``) a rank reads little more than its shards.

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
    entries = state_entries(model)
    check_names_and_shapes(entries, state_dict, "the state dict")
    loaded: set[int] = set()
    with torch.no_grad():
        for name, entry in entries.items():
            if name not in state_dict or id(entry) in loaded:
                continue
            loaded.add(id(entry))
            if isinstance(entry, ShardedParam):
                entry.write_back(state_dict[name])
            else:
                getattr(entry[0], entry[1]).copy_(state_dict[name])
    for m in model.modules():
        if (hooks := unit_hooks(m)) is not None:
            hooks.unit.reshard()  # a unit kept full would still compute with the old values
