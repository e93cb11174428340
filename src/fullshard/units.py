"""The live units of this process, by id and by sharded parameter: how an error message names a
peer's unit from its header, how fully_shard proposes a new unit's id, and how a parameter an
optimizer or scaler holds finds its unit in one lookup (never a scan on a training step)."""

from __future__ import annotations

import weakref

from torch.utils.weak import WeakIdKeyDictionary

BY_ID: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # every live unit by its id
BY_PARAM = WeakIdKeyDictionary()  # a sharded parameter (the DTensor the modules hold) -> weakref of its unit


def register(unit) -> None:
    """A new unit, or one whose shards are other tensors now (assign=True loads swap them in)."""
    BY_ID[unit.uid] = unit
    ref = weakref.ref(unit)  # a weak value: the unit holds the key, a strong one would keep both alive
    for p in unit.params:
        BY_PARAM[p.sharded] = ref


def next_uid(after: int = -1) -> int:
    """An id above every live unit's (and `after`): what this rank proposes for a new unit
    (check_ranks_agree takes the largest any rank proposes)."""
    return max([after, *BY_ID.keys()]) + 1


def unit_of(param) -> object | None:
    """The live unit that manages `param` (a sharded parameter), if any."""
    ref = BY_PARAM.get(param)
    unit = ref() if ref is not None else None
    return unit if unit is not None and any(p.sharded is param for p in unit.params) else None


def described(uid: int, whole_model: bool = False) -> str:
    """The live unit of id `uid` in words, for messages: "unit 'h.1' of model 12 (GPT)" (the
    model alone: "model 12 (GPT)")."""
    unit = BY_ID.get(uid)
    if unit is None:
        return f"the {'model' if whole_model else 'unit'} of id {uid}, which this rank does not have"
    if whole_model and unit.shared.model != f"model {uid} ({unit.class_name})":  # a unit of a model here, run alone there
        return f"{unit.described} alone"
    return unit.shared.model if whole_model else unit.described
