"""The parity oracle: single-process training on the whole global batch.

A parity job builds a model with a fixed seed, deep-copies it (before sharding), trains
the copy in one process on the whole global batch and the sharded model on each
rank's slice, and reports how far losses, parameters and gradients drift apart.

Tolerances, used by the tests (fp32 on CPU). Why they hold on any CPU: the sharded run
computes the same terms as the reference and sums some of them in another grouping
(a rank's partial sum, then the reduction over ranks). A CPU's instruction set (AVX-512,
AVX2, none: ATEN_CPU_CAPABILITY) changes the grouping inside every kernel, on both sides
alike, so it changes which last bits differ, not how many. The bounds are therefore in
units of fp32 rounding: u = 2**-24 ~ 6e-8 relative, an ulp of x at most 2u|x|.
- LOSS_TOL: the losses here are below 8 (ln 256 = 5.5 at the start), where an ulp is
  4.8e-7. A rank's loss is a mean over its slice and the global loss the mean of those:
  the same sum regrouped, so the two differ by the rounding of the few additions that
  changed place: 2 ulps (1e-6). Measured: at most 4.8e-7 at every capability level.
- SGD_TOL: SGD moves a parameter by lr x gradient; a regrouped gradient sum differs by a
  few u of its terms, so the updates differ far below an ulp of the parameters, and the
  parameters by at most one rounding of the update on either side: 1 ulp of the largest
  parameters (LayerNorm weights near 1, up to just above it: 2.4e-7). Measured: 3e-8.
- ADAMW_TOL: AdamW divides a gradient element by its running RMS, so it turns a relative
  difference of the gradient into the same relative difference of a step of size ~lr
  (1e-3): parameters drift by lr x steps x (relative rounding of the gradient). A
  gradient element is a sum over the batch's n = 256 positions; its relative rounding is
  at most n u kappa, where kappa = sum|terms| / |sum| is how much the element cancels, a
  property of the model and data, not of the CPU. Sequential summation (a CPU without
  vector units, ATEN_CPU_CAPABILITY=default) reaches that bound's growth in n; vector
  lanes sum in a tree and stay ~sqrt(n) u kappa. 2e-5 = lr x 3 steps x n u x kappa for
  kappa ~ 400. Measured at world 4: 1.5e-6 with AVX-512 and AVX2, 5.2e-6 with none.
At world 1 every comparison is exact (0.0).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from torch.utils._python_dispatch import TorchDispatchMode

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.tags import HEADER_BYTES

LOSS_TOL = 1e-6
SGD_TOL = 2.5e-7
ADAMW_TOL = 2e-5


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups, as users build them: matrices decay, vectors and scalars do not."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-3)


def global_batches(batch_fn: Callable, steps: int, global_batch: int, seed: int = 1) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    return [batch_fn(generator, global_batch) for _ in range(steps)]


def local_slice(batch: Any, rank: int, world: int) -> Any:
    """This rank's equal share of a global batch (dim 0 of every tensor)."""
    return tuple(t.chunk(world)[rank] for t in batch)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    loss_fn: Callable,
    *,
    world: int = 1,
    clip: Callable | None = None,
) -> list[float]:
    """Train step by step; return the global loss of each step (mean over ranks)."""
    rank = dist.get_rank() if world > 1 else 0
    losses = []
    for batch in batches:
        loss = loss_fn(model, local_slice(batch, rank, world))
        loss.backward()
        if clip is not None:
            clip(model)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name as a full plain tensor (gathers shards: all ranks must call)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"names differ: {sorted(a.keys() ^ b.keys())}"
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].numel()), default=0.0)


def parity(
    model: nn.Module,
    shard: Callable[[nn.Module], Any],
    batch_fn: Callable,
    loss_fn: Callable,
    *,
    optimizer: str = "adamw",
    steps: int = 3,
    global_batch: int = 8,
    clip: tuple[Callable, Callable] | None = None,
) -> dict[str, float]:
    """Train `model` sharded by `shard` and a copy in one process; report the largest drifts."""
    world = dist.get_world_size()
    reference = copy.deepcopy(model)
    shard(model)
    batches = global_batches(batch_fn, steps, global_batch)
    got = train(model, make_optimizer(optimizer, model), batches, loss_fn, world=world,
                clip=clip[0] if clip else None)
    want = train(reference, make_optimizer(optimizer, reference), batches, loss_fn,
                 clip=clip[1] if clip else None)
    return {
        "loss": max(abs(g - w) for g, w in zip(got, want)),
        "param": max_diff(full_state(model), full_state(reference)),
        "losses": got,
    }


def assert_parity(results: list[dict[str, float]], optimizer: str) -> None:
    """Every rank saw losses and parameters within the documented tolerances."""
    tol = SGD_TOL if optimizer == "sgd" else ADAMW_TOL
    for rank, r in enumerate(results):
        assert r["loss"] <= LOSS_TOL, f"rank {rank}: losses differ by {r['loss']:.3g}"
        assert r["param"] <= tol, f"rank {rank}: parameters differ by {r['param']:.3g}"


class CollectiveLog(TorchDispatchMode):
    """Records every c10d collective this process issues: (name, elements sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            sent = args[1] if func.__name__.startswith(("_allgather_base", "_reduce_scatter_base", "alltoall_base")) \
                else args[0]
            tensors = sent if isinstance(sent, (list, tuple)) else [sent]
            self.calls.append((func.__name__.split(".")[0], sum(t.numel() for t in tensors)))
        return func(*args, **(kwargs or {}))

    def sizes(self, prefix: str) -> list[int]:
        return sorted(numel for name, numel in self.calls if name.startswith(prefix))

    def messages(self, world: int, itemsize: int) -> list[int]:
        """The elements of each peer's row of every all_to_all (which moves the rows' bytes:
        `itemsize` bytes an element) less the header leading it (Note [named hangs] in
        fullshard.tags), sorted: the messages of collectives small enough for that route."""
        assert not any(name.startswith("send") for name, _ in self.calls), "a collective took the point-to-point route"
        lead = HEADER_BYTES // itemsize
        rows = [numel // itemsize // world - lead for name, numel in self.calls if name.startswith("alltoall")]
        return sorted(rows * (world - 1))
