"""Training helpers that need the whole sharded model: clipping, accumulation, full parameters."""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from fullshard import runtime
from fullshard.collectives import all_reduce_
from fullshard.errors import CollectiveError, collective_failed, fail, require
from fullshard.gather import gather_masters
from fullshard.hooks import Phase, hooks_for, ordinary_tensors, unit_hooks, units_of
from fullshard.mesh import counted_copy, replica_dims, replica_of
from fullshard.options import DEFAULT_TIMEOUT
from fullshard.param import local_values
from fullshard.accounting import Stats
from fullshard.units import unit_of
from fullshard.unit import ShardState, Unit


def stats(model: nn.Module) -> Stats:
    """The live communication and memory counters of a sharded model, on this rank.

    Use as a context manager to count a stretch of training from zero::

        with fullshard.stats(model) as s:
            loss = model(x, y); loss.backward()
        s.gather_bytes, s.sent_bytes, s.wait_s, s.peak_full_param_bytes, s.per_step()

    Args:
        model: the sharded model (its outermost unit's counters cover every unit below).

    Returns:
        The :class:`Stats` object the units update; ``reset()`` zeroes it.
    """
    return unit_hooks(units_of(model, "stats")[0].module).lazy_init().stats


def counts_once(grad: torch.Tensor, dp_mesh: DeviceMesh, copies: dict[DeviceMesh, set[int]]) -> bool:
    """Whether this rank's piece of `grad` is the copy counted in a global norm: of the
    ranks holding the same rows, the one at coordinate 0 of every replicated mesh dim, on a
    counted copy of a sub-mesh (mesh.counted_copy over the model's `copies`); a plain tensor
    once per copy of the model on `dp_mesh`'s root (once per pipeline stage)."""
    if not isinstance(grad, DTensor):
        return counted_copy(dp_mesh, copies, spans=False)
    mesh = grad.device_mesh
    if any(c != 0 for c, placement in zip(mesh.get_coordinate(), grad.placements) if isinstance(placement, Replicate)):
        return False
    return counted_copy(mesh, copies)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most `max_norm`.

    The norm is over the whole model, every rank's shards together, so it equals the
    norm single-process training would compute, and every rank returns the same value.
    Where groups of ranks shard different models (pipeline stages, each on a mesh of its
    own ranks), it is over all of them: every rank calls it. Under fullshard.DiLoCo each
    replica group's norm is its own model's.

    Args:
        model: a sharded model (every rank must call this).
        max_norm: the largest allowed norm.
        norm_type: the p of the p-norm; ``float("inf")`` for the largest absolute value.

    Returns:
        The global norm before clipping, as a plain 0-d tensor.
    """
    units = units_of(model, "clip_grad_norm_")
    root = units[0]
    device = root.compute_device  # where the process group communicates
    if not (isinstance(max_norm, (int, float, torch.Tensor)) and float(max_norm) >= 0):  # messages only on failure
        raise fail(f"clip_grad_norm_(max_norm={max_norm!r}): max_norm must be a non-negative number", "Pass e.g. 1.0.")
    if not (isinstance(norm_type, (int, float)) and float(norm_type) > 0):
        raise fail(f"clip_grad_norm_(norm_type={norm_type!r}): norm_type must be a positive number or float('inf')",
                   "Pass 2.0 (the default) or float('inf').")
    norm_type = float(norm_type)
    rt = runtime.active
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # tied parameters once
    locals_ = [local_values(g) for g in grads]
    copies = replica_dims([unit.group.mesh for unit in units] +
                          [p.tp_mesh for unit in units for p in unit.params if p.tp_mesh is not None])
    counted = [t for g, t in zip(grads, locals_) if counts_once(g, root.group.mesh, copies) and t.numel()]
    # CPU offload: gradients in host memory are summed on the host, the total goes to the
    # device, whose memory is all NCCL reads, and the coefficient comes back (a host sync)
    partials = []
    for host in (False, True):  # device memory, then host memory
        part = [t for t in counted if rt.elsewhere(t, device) == host]
        if part:
            partials.append(rt.to_device(torch.nn.utils.get_total_norm(part, norm_type).to(torch.float32), device))
    inf = math.isinf(norm_type)
    if not partials:
        total = torch.zeros((), device=device)
    elif inf:
        total = torch.stack(partials).max() if len(partials) > 1 else partials[0]
    else:  # the p-th powers of the ranks' (and memories') norms add up to the global one's
        total = sum(partial ** norm_type for partial in partials)
    replica = replica_of(model)
    for group in [None] if replica is None else replica.norm_groups:  # DiLoCo: the replica group's own ranks
        agree(root, total, "max" if inf else "sum", "the gradient norm", group)
    if not inf:
        total = total ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    in_host = [t for t in locals_ if rt.elsewhere(t, device)]
    in_device = [t for t in locals_ if not rt.elsewhere(t, device)]
    if in_device:
        torch._foreach_mul_(in_device, clip_coef)
    if in_host:
        host_coef = rt.to_host(clip_coef, pin=True)
        try:
            rt.host_waits(device, timeout=root.timeout, what=f"the clip coefficient at step {root.step}")
        except CollectiveError as e:
            raise root.failed("clip_grad_norm_", e) from None
        torch._foreach_mul_(in_host, host_coef)
    return total


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip gradient reduction inside: full gradients accumulate locally on every rank.

    The first backward after the context reduces everything accumulated. This trades
    memory (one full gradient per parameter on every rank) for communication; plain
    accumulation without this context keeps gradients sharded and reduces every step.
    """
    units = units_of(model, "no_sync")
    before = [unit.switches.sync_grads for unit in units]
    for unit in units:
        unit.switch(sync_grads=False)
    try:
        yield
    finally:
        for unit, sync in zip(units, before):
            unit.switch(sync_grads=sync)


@contextmanager
def full_params(
    model: nn.Module, *, writeback: bool = True, rank0_only: bool = False, offload_to_cpu: bool = False
) -> Iterator[None]:
    """Make the model's parameters plain full tensors inside the context.

    They are gathered unit by unit in the master dtype (whatever the mixed precision
    policy), as new tensors: training state is untouched. A forward inside runs on them
    like the unsharded model, with no communication (Note [forward inside full_params]):
    the fast path for evaluation and generation, at the memory of the full model on
    every rank that sees it. Gradients computed inside are not kept.

    Args:
        model: a sharded model, between training steps (every rank must call this).
        writeback: copy edits of the full parameters back into the shards on exit.
        rank0_only: only rank 0 sees full parameters; the others keep their shards.
        offload_to_cpu: the full parameters are CPU tensors (saves device memory).

    Raises:
        FullShardError: for ``writeback=True`` with ``rank0_only=True`` (the other ranks
            would have nothing to write back), or when called during forward or backward.
    """
    for name, flag in (("writeback", writeback), ("rank0_only", rank0_only), ("offload_to_cpu", offload_to_cpu)):
        require(isinstance(flag, bool), f"full_params({name}={flag!r}) must be True or False", f"Pass {name}=True.")
    if writeback and rank0_only:
        raise fail("full_params(writeback=True, rank0_only=True) cannot write back on ranks that see no "
                   "full parameters", "Pass writeback=False with rank0_only=True.")
    units = units_of(model, "full_params")
    if any(unit.phase is not Phase.IDLE for unit in units):
        raise fail("full_params was entered during a forward or backward",
                   "Use it between training steps.")
    if (rank0_only or offload_to_cpu) and any(p.tp_mesh is not None for unit in units for p in unit.params):
        raise fail(f"full_params({'rank0_only' if rank0_only else 'offload_to_cpu'}=True) on a tensor-parallel "
                   f"model: its forward communicates over the TP ranks, which needs every TP rank and the "
                   f"device's memory", "Pass rank0_only=False and offload_to_cpu=False: every rank then sees its "
                   "TP part of the full parameters, and a forward inside runs tensor parallelism as usual.")
    visible = not rank0_only or dist.get_rank() == 0
    shown: list[list[nn.Parameter]] = []
    with ordinary_tensors():  # Note [inference mode]
        for unit in units:
            unit.adopt_replaced()  # parameters assigned since the last step are what it shows
        for unit in units:  # one unit at a time, so offloading bounds device memory
            fulls = gather_masters(unit)
            if visible:
                fulls = [nn.Parameter(p.on_tp_mesh(full.cpu() if offload_to_cpu else full),
                                      requires_grad=p.sharded.requires_grad) for p, full in zip(unit.params, fulls)]
                for p, full in zip(unit.params, fulls):
                    p.show(full)
            shown.append(fulls if visible else [])
    for unit in units:
        hooks_for(unit).show(visible)
    try:
        yield
    finally:
        for unit in units:
            hooks_for(unit).show(None)
        with ordinary_tensors():
            for unit, fulls in zip(units, shown):
                for p, full in zip(unit.params, fulls):
                    if writeback:
                        p.write_back(full)
                    p.to_sharded()
                if writeback:
                    unit.reshard()  # a unit kept full would compute with the old values
                elif unit.state is ShardState.FULL:
                    for p in unit.params:
                        p.to_full()


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded gradients (fp16 training); a drop-in.

    Each rank unscales and checks its own shards; then the ranks agree, so an inf or NaN
    on any rank skips the step and lowers the scale on every rank, and the ranks' shards
    and scales never drift apart. Construct it like torch's, e.g. ``GradScaler("cuda")``.
    """

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = local_values(param.grad)
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                grads[(grad.device, grad.dtype)].append(grad)
        with torch.no_grad():
            for (device, _), tensors in grads.items():
                found = found_inf.to(device)  # found_inf itself when on `device`
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale.to(device))
                if found is not found_inf:
                    found_inf.add_(found.to(found_inf.device))
            unit = unit_of(optimizer.param_groups[0]["params"][0]) if optimizer.param_groups[0]["params"] else None
            if unit is None:  # nothing sharded: torch's defaults
                all_reduce_(found_inf, "max", timeout=DEFAULT_TIMEOUT, what="the all-reduce of found_inf")
            else:
                agree(unit, found_inf, "max", "the loss scaler's inf/NaN flag")
        return {found_inf.device: found_inf}


def agree(unit: Unit, tensor: torch.Tensor, op: str, what: str, group=None) -> None:
    """All-reduce `tensor` in place over `group` (default: every rank) within `unit`'s timeout
    (set_timeout); a hang or failure raises a FullShardError naming `what` and the step (Note
    [named hangs])."""
    collective = f"the all-reduce of {what} at step {unit.step}"
    try:
        all_reduce_(tensor, op, timeout=unit.timeout, what=collective, group=group)
    except CollectiveError as e:
        raise collective_failed(collective, e) from None
