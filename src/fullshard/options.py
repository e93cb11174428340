"""What configures a unit: the options fully_shard resolves, the switches FSDP2's setters
flip, and the prefetch schedule of a root. Each is a frozen value: a setter makes a new
one (Unit.relayout, Unit.switch) instead of writing a field."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from fullshard.blocks import BLOCK
from fullshard.errors import fail

DEFAULT_TIMEOUT = timedelta(seconds=300)  # of every collective until set_timeout, Note [named hangs]


@dataclass(frozen=True)
class UnitOptions:
    """Resolved by fully_shard (set_reshard_after_forward makes new ones)."""

    free_after_forward: bool
    keep_last: bool = True  # keep the unit that ran last in forward full for backward, Note [kept after forward]
    post_forward_world: int = 1  # >1: after forward keep 1/this of the unit, Note [smaller world after forward]
    param_dtype: torch.dtype | None = None  # of the full parameters (gather and compute); None: the master's
    reduce_dtype: torch.dtype | None = None  # of the gradient reduction; None: the compute dtype
    input_dtype: torch.dtype | None = None  # floating forward inputs are cast to it
    output_dtype: torch.dtype | None = None  # floating forward outputs are cast to it
    offload: bool = False  # shards and their gradients live on the CPU
    pin_memory: bool = False
    gather_dtype: torch.dtype | None = None  # int8 or float8: block-quantized gathers (Note [int8 gathers])
    gather_block: int = BLOCK  # values per scale of a quantized gather
    reduce_send_dtype: torch.dtype | None = None  # Note [low-precision reductions]


def after_forward(reshard_after_forward: bool | int | None, world: int, whole_world: bool,
                  setter: bool = False) -> dict:
    """The options fields for fully_shard's `reshard_after_forward` (or, with `setter`,
    set_reshard_after_forward's bool, which frees even the unit that ran last, as FSDP2 does)
    of a unit sharded over `world` ranks of a mesh that spans all ranks if `whole_world`."""
    if setter and type(reshard_after_forward) is not bool:
        raise fail(f"set_reshard_after_forward({reshard_after_forward!r}) takes a bool",
                   "Pass True or False (an int k is given to fully_shard).")
    if reshard_after_forward is None:  # FSDP2's default: free, except the root's (which fullshard always keeps)
        reshard_after_forward = True
    if type(reshard_after_forward) not in (bool, int):
        raise fail(f"reshard_after_forward={reshard_after_forward!r} is not a bool or an int",
                   "Pass True (free after forward), False (keep until after backward) or an int k (keep "
                   "1/k after forward, gathered in backward inside groups of k ranks).")
    if type(reshard_after_forward) is bool:
        return dict(free_after_forward=reshard_after_forward, post_forward_world=1,
                    keep_last=not (setter and reshard_after_forward))
    k = reshard_after_forward
    if k not in (1, world) and not whole_world:
        raise fail(f"reshard_after_forward={k} on a data-parallel mesh of part of the ranks",
                   "Pass True or False with a sub-mesh (e.g. with tensor parallelism).")
    if not 1 <= k <= world or world % k:
        raise fail(f"reshard_after_forward={k} does not divide the {world} ranks parameters are "
                   f"sharded over", f"Pass a divisor of {world}, e.g. the ranks per node.")
    # k = world is True; k = 1 keeps everything; between, Note [smaller world after forward]
    return dict(free_after_forward=k > 1, post_forward_world=1 if k == world else k, keep_last=True)


@dataclass(frozen=True)
class UnitSwitches:
    """What FSDP2's FSDPModule setters change on a unit: a field per setter, except
    set_requires_gradient_sync, which sets both sync fields (as FSDP2's sets both of its)."""

    sync_grads: bool = True  # set_requires_gradient_sync: off, full gradients accumulate unreduced
    all_reduce_grads: bool = True  # set_requires_all_reduce: off, reduce within the group, owe the rest
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True  # False: backward needs none of the unit's parameters (e.g. embeddings)
    divide_factor: float | None = None  # gradients are divided by this, not the data-parallel size
    force_sum: bool = False  # reduce with sums and divide after, never NCCL's average
    all_reduce_hook: Callable | None = None  # called on each reduced gradient row (FSDP2's set_all_reduce_hook)
    timeout: timedelta = DEFAULT_TIMEOUT  # Note [named hangs]
    debug: bool = False  # check before each collective that every rank runs the same one
    nonfinite: str | None = None  # None, "raise" or "skip": what a non-finite reduced gradient does


@dataclass(frozen=True)
class Schedule:
    """When units gather ahead of use, Note [prefetch]; the root's applies to every unit under it."""

    prefetch_before_backward: bool = True  # "pre": before the current unit's gradient computation
    prefetch_after_backward: bool = False  # "post": after it
    forward_prefetch: bool = False
    limit: int | None = 1  # units gathered ahead of use at once (FSDP2's one; shard_model's limit_all_gathers
    # sets it, 2 unless told); None: no limit
