"""The collectives of a unit, as pure functions over tensors and process groups.

This is the only module that calls torch.distributed collectives. It knows the row
layout of Note [shard layout] (param.py) but nothing of units or modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class PendingGather:
    """An all-gather in flight; `wait()` returns every rank's shard, rank after rank."""

    work: dist.Work | None
    gathered: torch.Tensor  # [world * unit_shard_numel]

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.gathered


def gather_full(local_flat: torch.Tensor, *, group: dist.ProcessGroup, async_op: bool) -> PendingGather:
    """Start the all-gather of a unit's flat shard over `group`."""
    gathered = local_flat.new_empty(group.size() * local_flat.numel())  # [world * unit_shard_numel]
    work = _all_gather_single(gathered, local_flat, group=group, async_op=async_op)
    return PendingGather(work, gathered)


def copy_out(gathered: torch.Tensor, fulls: list[torch.Tensor], shard_numels: list[int], *, world: int) -> None:
    """Move each parameter's rows out of the gathered buffer into its padded full tensor."""
    rows = gathered.view(world, -1)  # [world, unit_shard_numel]
    outs = [full.view(world, -1) for full in fulls]  # each [world, shard_numel]
    with torch.no_grad():
        torch.split_with_sizes_copy(rows, shard_numels, dim=1, out=outs)


def pack_grads(
    grads: list[torch.Tensor | None], shard_numels: list[int], *, world: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Lay out full gradients in the rows a reduce-scatter sends, then one flag per gradient.

    Row r holds rank r's rows of every gradient (zero where a gradient is missing or
    padded) followed by flags that are 1 where this rank has the gradient, so after the
    reduction each rank knows whether any rank had one (a missing gradient stays None,
    as in plain PyTorch). A 0-d gradient is put in every row.
    """
    total = sum(shard_numels)
    packed = torch.empty(world, total + len(grads), dtype=dtype, device=device)  # [world, grad_shard_numel + n_flags]
    packed[:, total:] = torch.tensor([grad is not None for grad in grads], dtype=dtype)
    offset = 0
    for grad, numel in zip(grads, shard_numels):
        dst = packed[:, offset : offset + numel]  # [world, shard_numel]
        offset += numel
        if grad is None:
            dst.zero_()
        elif grad.dim() == 0:
            dst.copy_(grad.expand(world, 1))
        elif numel:
            flat = grad.reshape(-1)
            whole = flat.numel() // numel  # ranks whose rows are all real
            dst[:whole].copy_(flat[: whole * numel].view(whole, numel))
            if whole < world:
                rest = flat.numel() - whole * numel
                dst[whole, :rest].copy_(flat[whole * numel :])
                dst[whole, rest:].zero_()
                dst[whole + 1 :].zero_()
    return packed


def reduce_scatter_grads(
    packed: torch.Tensor,
    *,
    shard_group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
    dp_size: int,
) -> torch.Tensor:
    """Average `packed` over every data-parallel rank; return this rank's row.

    Inside the shard group one reduce-scatter sums the rows; across replicas one
    all-reduce sums the result (hybrid sharding, eq. 1 of the paper).
    """
    if shard_group is None:
        shard = packed[0]  # [grad_shard_numel + n_flags]: one rank holds every row
    else:
        shard = packed.new_empty(packed.size(1))  # [grad_shard_numel + n_flags]
        _reduce_scatter_single(shard, packed.view(-1), op=dist.ReduceOp.SUM, group=shard_group)
    if replicate_group is not None:
        dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=replicate_group)
    if dp_size > 1:
        shard.div_(dp_size)
    return shard
