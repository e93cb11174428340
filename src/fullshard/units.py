"""The live units of this process, by id and by sharded parameter: how an error message names a
peer's unit from its header, how fully_shard proposes a new unit's id, and how a parameter an
optimizer or scaler holds finds its unit in one lookup (never a scan on a training step)."""

from __future__ import annotations

import weakref

BY_ID: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # every live unit by its id
# id() of a sharded parameter (the DTensor the modules hold) -> a weakref of its unit. Keyed by
# id, not by a weakref of the parameter: a tensor with a weakref cannot be swapped in place
# (torch.utils.swap_tensors, which Module.to uses); a unit's entries go when it does.
BY_PARAM: dict[int, weakref.ref] = {}


def register(unit) -> None:
    """A new unit, or one whose shards are other tensors now (assign=True loads swap them in)."""
    BY_ID[unit.uid] = unit
    ref = weakref.ref(unit, forget)
    for p in unit.params:
        BY_PARAM[id(p.sharded)] = ref


def forget(ref: weakref.ref) -> None:
    """A unit was collected: its parameters' entries go."""
    for key in [key for key, value in BY_PARAM.items() if value is ref]:
        del BY_PARAM[key]


def next_uid(after: int = -1) -> int:
    """An id above every live unit's (and `after`): what this rank proposes for a new unit
    (check_ranks_agree takes the largest any rank proposes)."""
    return max([after, *BY_ID.keys()]) + 1


def unit_of(param) -> object | None:
    """The live unit that manages `param` (a sharded parameter), if any."""
    ref = BY_PARAM.get(id(param))
    unit = ref() if ref is not None else None
    return unit if unit is not None and any(p.sharded is param for p in unit.params) else None  # not a reused id


def described(uid: int, whole_model: bool = False) -> str:
    """The live unit of id `uid` in words, for messages: "unit 'h.1' of model 12 (GPT)" (the
    model alone: "model 12 (GPT)")."""
    unit = BY_ID.get(uid)
    if unit is None:
        return f"the {'model' if whole_model else 'unit'} of id {uid}, which this rank does not have"
    if whole_model and unit.shared.model != f"model {uid} ({unit.class_name})":  # a unit of a model here, run alone there
        return f"{unit.described} alone"
    return unit.shared.model if whole_model else unit.described
