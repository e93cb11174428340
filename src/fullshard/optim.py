"""Optimizers that update each weight matrix as a whole (Muon; a user's own through
MatrixOptimizer) on a sharded model: each matrix transformed once, on one rank of its shard group.

# Note [matrix optimizers]: Muon, Shampoo, SOAP and Dion read a weight matrix whole (Muon
# orthogonalizes its momentum by Newton-Schulz iterations), while fullshard keeps each rank's
# rows of it. Stepped by torch.optim.Muon, DTensor gathers the matrix inside every matmul
# and every rank orthogonalizes every matrix. Here each matrix has an owner in its shard
# group, chosen at each step, alike on every rank, by longest-processing-time bin packing
# of the transforms' cost (the ranks' work differs by at most one matrix's). A step: every rank
# updates its rows of the elementwise state (Muon's momentum) and computes its rows of the
# matrix to transform; one all_to_all sends each owner the rows of its matrices (Muon: in
# bf16, which is what Newton-Schulz reads first, so nothing is lost); the owner transforms
# each whole matrix; a second all_to_all sends every rank its rows of the update (Muon: bf16,
# what Newton-Schulz returns), which it applies to its shard. Per step a rank sends its rows
# of the other ranks' matrices and receives its rows of their updates: in bf16, about one
# fp32 gradient's bytes in all. A state of another shape than the parameter (a Shampoo
# preconditioner) is kept as row shards too, a DTensor as the momentum is, and travels to
# the owner and back with the rows, so state dicts, checkpoints and full_tensor() see every
# state as torch's optimizers keep it. A 3-D parameter is a batch of matrices (stacked
# experts) split by whole matrices along dim 0: each rank transforms those it holds, with no
# exchange. A tensor-parallel matrix (2-D parallelism) is rebuilt by its owner as its TP
# part; the owners at every TP coordinate (one TP group) gather it whole over the TP mesh,
# each transforms it alike and keeps its TP part of the update. Under hybrid sharding each
# replica's shard group does the same work on the same values (the gradients were averaged
# across replicas), so replicas stay equal. Under CPU offload the rows travel and are
# transformed in device memory; the updates come back to the host in one wait per step.
#
# The other layout, each matrix whole on its owner between steps (the reduce-scatter
# delivering it, the all-gather reading it back), would save the two messages but changes
# what a shard is for every parameter, state dict and checkpoint. Measured, the messages are
# 6-15% of the optimizer step on the GPT presets at world 2 and 4 (docs/benchmarks.md): all
# that layout could save. Owners are chosen over every matrix of a group of ranks at once
# (one exchange for all units): Newton-Schulz FLOPs per rank max/mean 1.00-1.01 there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch.distributed.tensor import DTensor

from fullshard.collectives import Caller, all_to_all_bytes, full_tensor
from fullshard import runtime
from fullshard.errors import CollectiveError, collective_failed, fail
from fullshard.mesh import ShardGroup
from fullshard.param import ShardedParam, shard_rows
from fullshard.tags import UNITS

__all__ = ["MatrixOptimizer", "Muon", "muon_groups"]


@dataclass
class Matrix:
    """One parameter of a matrix optimizer: its shard's bookkeeping and its owner."""

    sharded: ShardedParam
    group: ShardGroup
    timeout: timedelta
    owner: int = 0  # the group rank that transforms it
    batched: bool = False  # a 3-D batch of whole matrices per rank: no exchange
    state_shapes: dict[str, torch.Size] = field(default_factory=dict)  # its whole-matrix state's, by name

    @property
    def held_whole(self) -> bool:
        return self.batched or self.group.shard_pg is None


def rows_of(shape: torch.Size, world: int) -> list[int]:
    """The rows (dim 0) each group rank holds of a tensor of `shape` split as shards are (Note [shard layout])."""
    return [shard_rows(shape[0], world, r)[1] for r in range(world)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class MatrixOptimizer(torch.optim.Optimizer):
    """Base class of optimizers that update each parameter's matrix as a whole (Note [matrix
    optimizers]). For each parameter of a fullshard model a subclass says:

    - ``rows(p, grad, state, group)``: on every rank, from its rows of p's gradient (and of
      its elementwise state in ``state``, DTensors shaped as p, whose rows ``self.local(p,
      value)`` gives), its rows of the matrix to transform;
    - ``matrix_state(shape, group)``: the whole-matrix state the transform keeps, name ->
      (shape, dtype): created as zeros, kept as row shards between steps;
    - ``transform(matrix, state, group)``: on the owner, the whole matrix (and that state,
      whole, to update in place) -> the whole update, of ``update_dtype``;
    - ``apply(rows, update, group, shape)``: on every rank, its rows of the update applied to
      its rows of the parameter (``shape``: the whole parameter's).

    ``send_dtype`` is the dtype the matrix's rows go to the owner in (None: as they are);
    ``update_dtype`` the dtype of the update (None: the rows' as sent).
    """

    send_dtype: torch.dtype | None = None
    update_dtype: torch.dtype | None = None

    def rows(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        return grad

    def local(self, p: torch.Tensor, value: DTensor) -> torch.Tensor:
        """This rank's rows of a value laid out as p (its gradient, an elementwise state), rows first."""
        return self.matrix_of(p).sharded.rows(value._local_tensor)

    def matrix_state(self, shape: torch.Size, group: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {}

    def transform(self, matrix: torch.Tensor, state: dict[str, torch.Tensor], group: dict) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, rows: torch.Tensor, update: torch.Tensor, group: dict, shape: torch.Size) -> None:
        rows.add_(update, alpha=-group["lr"])

    def cost(self, shape: torch.Size) -> float:
        """The transform's work on a matrix of `shape`, what owners are balanced by (Muon: its FLOPs)."""
        m, n = sorted(shape[-2:])
        return float(m * m * n) * math.prod(shape[:-2])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        by_group: dict[object, list] = {}
        for group in self.param_groups:
            if group.get("use_muon", True) is False:  # Muon's AdamW groups
                continue
            for p in group["params"]:
                if p.grad is not None:
                    m = self.matrix_of(p)
                    by_group.setdefault(m.group.shard_pg, []).append((p, m, group))  # one exchange per group of ranks
        for items in by_group.values():
            self.step_group(items)
        if getattr(self, "adamw", None) is not None:
            self.adamw.step()
        return loss

    def matrix_of(self, p: torch.Tensor) -> Matrix:
        """The fullshard bookkeeping of `p`, found among the live units once."""
        matrices = self.__dict__.setdefault("matrices", {})
        if p in matrices:
            return matrices[p]
        for unit in list(UNITS.values()):
            for sp in unit.params:
                if sp.sharded is p:
                    own_state = type(self).matrix_state is not MatrixOptimizer.matrix_state
                    check_matrix(sp, type(self).__name__, own_state)
                    matrices[p] = Matrix(sp, unit.group, unit.timeout, batched=p.dim() == 3)
                    return matrices[p]
        raise fail(f"{type(self).__name__} steps a parameter of shape {tuple(p.shape)} that belongs to no fullshard "
                   f"model", f"Shard the model first (fullshard.shard_model or fully_shard), then build "
                   f"{type(self).__name__} from the sharded model's parameters.")

    def step_group(self, items: list) -> None:
        """One group of ranks' matrices: each rank's rows to the owners, the transforms, the
        updates' rows back, applied (Note [matrix optimizers]). Under CPU offload the rows
        travel and are transformed in the device's memory, and come back to the host's in one
        wait."""
        rt, device = runtime.active, items[0][1].group.device
        kept = []  # per item: this rank's rows of the matrix, then of its whole-matrix state, where they live
        for p, m, group in items:
            state = self.state[p]
            for name, (shape, dtype) in self.matrix_state(m.sharded.global_shape, group).items():
                if name not in state:
                    state[name] = zeros_like_rows(m, torch.Size(shape), dtype)
                elif not is_row_shards(m, state[name]):  # loaded whole, or as another world's shards
                    state[name] = as_row_shards(m, state[name])
                m.state_shapes[name] = state[name].shape
            rows = self.rows(p, m.sharded.local_grad(), state, group)
            if self.send_dtype is not None:
                rows = rows.to(self.send_dtype)
            kept.append([rows, *(state[name]._local_tensor for name in m.state_shapes)])
        sent = [[rt.to_device(t, device) for t in tensors] for tensors in kept]
        exchanged = [i for i, (_, m, _) in enumerate(items) if not m.held_whole]
        assign_owners([items[i][1] for i in exchanged], items[0][1].group.world, self.cost)
        results = {}  # per item: this rank's rows of the update, then of the new state
        for i, ((p, m, group), tensors) in enumerate(zip(items, sent)):
            if m.held_whole:
                results[i] = [self.transformed(m, tensors[0], dict(zip(m.state_shapes, tensors[1:])), group),
                              *tensors[1:]]
        if exchanged:
            got = self.exchange([items[i] for i in exchanged], [sent[i] for i in exchanged])
            results.update(zip(exchanged, got))
        if rt.elsewhere(kept[0][0], device):  # CPU offload: the shards step on the host
            results = {i: [rt.to_host(t, pin=True) for t in values] for i, values in results.items()}
            rt.host_waits(device, timeout=items[0][1].timeout, what=f"{type(self).__name__}'s updates to the host")
        for i, (p, m, group) in enumerate(items):
            update, *states = results[i]
            for mine, new in zip(kept[i][1:], states):
                if mine is not new:
                    mine.copy_(new)
            self.apply(m.sharded.local_shard(), update, group, m.sharded.global_shape)

    def exchange(self, items: list, sent: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Per item, this rank's rows of its update and of its new whole-matrix state: its rows
        sent to the owners, transformed there, sent back."""
        group0 = items[0][1].group
        world, rank, device = group0.world, group0.rank, group0.device
        wholes = [[m.sharded.shape, *m.state_shapes.values()] for _, m, _ in items]  # rows first
        # 1. every rank's rows of each matrix (and its state) to the matrix's owner
        send, sizes = [[] for _ in range(world)], [0] * world
        for (_, m, _), tensors, shapes in zip(items, sent, wholes):
            if m.owner != rank:
                send[m.owner] += [as_bytes(t) for t in tensors]
            else:
                for r in range(world):
                    if r != rank:
                        sizes[r] += sum(rows_of(s, world)[r] * math.prod(s[1:]) * t.element_size()
                                        for t, s in zip(tensors, shapes))
        received = self.send_rows(send, sizes, device, items[0][1], "the rows of the matrices to their owners")
        # 2. the owners transform; each rank's rows of the update (and of the new state) go back
        back, results, taken = [[] for _ in range(world)], {}, [0] * world
        for index, ((_, m, group), tensors, shapes) in enumerate(zip(items, sent, wholes)):
            if m.owner != rank:
                continue
            wholes_here = []
            for t, s in zip(tensors, shapes):
                parts = []
                for r in range(world):
                    n = rows_of(s, world)[r] * math.prod(s[1:]) * t.element_size()
                    parts.append(t if r == rank else received[r][taken[r] : taken[r] + n].view(t.dtype))
                    taken[r] += 0 if r == rank else n
                wholes_here.append(torch.cat([part.reshape(-1) for part in parts]).view(s))
            update = self.transformed(m, wholes_here.pop(0), dict(zip(m.state_shapes, wholes_here)), group)
            outs = [update.to(self.update_dtype or tensors[0].dtype), *wholes_here]
            for r in range(world):
                mine = [o.narrow(0, sum(rows_of(o.shape, world)[:r]), rows_of(o.shape, world)[r]) for o in outs]
                if r == rank:
                    results[index] = mine
                else:
                    back[r] += [as_bytes(t) for t in mine]
        del received, send  # what came in is whole on its owner now
        sizes = [0] * world
        for (_, m, _), tensors in zip(items, sent):
            if m.owner != rank:
                sizes[m.owner] += tensors[0].numel() * (self.update_dtype or tensors[0].dtype).itemsize + \
                    sum(t.numel() * t.element_size() for t in tensors[1:])
        returned = self.send_rows(back, sizes, device, items[0][1], "the rows of the updates back from their owners")
        # 3. the others' rows of the updates (and of the new state) as they came back
        taken = [0] * world
        for index, ((_, m, _), tensors) in enumerate(zip(items, sent)):
            if m.owner == rank:
                continue
            kinds = [(self.update_dtype or tensors[0].dtype, tensors[0].shape)] + \
                [(t.dtype, t.shape) for t in tensors[1:]]
            results[index] = []
            for dtype, shape in kinds:
                n = math.prod(shape) * dtype.itemsize
                results[index].append(returned[m.owner][taken[m.owner] : taken[m.owner] + n].view(dtype).view(shape))
                taken[m.owner] += n
        return [results[index] for index in range(len(items))]

    def transformed(self, m: Matrix, matrix: torch.Tensor, state: dict[str, torch.Tensor], group: dict) -> torch.Tensor:
        """The update of m's matrix (as its shard group stores it, rows first), rows first. A
        tensor-parallel matrix is this rank's TP part: gathered whole over the TP mesh first (the
        owners at every TP coordinate take part, in the same order), its TP part of the update
        kept after."""
        sp = m.sharded
        if sp.tp_mesh is None:
            return sp.rows(self.transform(sp.unrows(matrix), state, group))
        return sp.rows(sp.tp_part(self.transform(sp.whole(sp.unrows(matrix)), state, group)))

    def send_rows(self, send: list[list[torch.Tensor]], sizes: list[int], device: torch.device, m: Matrix,
                   what: str) -> list[torch.Tensor]:
        """send[r] to group rank r, sizes[r] bytes from it, over m's shard group, within its unit's timeout."""
        name = f"{type(self).__name__}'s all_to_all of {what}"
        try:
            return all_to_all_bytes(send, sizes, device, m.group.shard_pg, Caller(name, m.timeout))
        except CollectiveError as e:
            raise collective_failed(name, e) from None


class Muon(MatrixOptimizer):
    """torch.optim.Muon on a fullshard model: the same constructor, update and state (a
    ``momentum_buffer`` per parameter), each matrix orthogonalized once, by its owner (Note
    [matrix optimizers]). Given the same gradients, each update is bitwise torch.optim.Muon's
    on the whole matrix. A 3-D parameter is a batch of matrices (stacked experts), each
    orthogonalized alone, its learning rate adjusted by the shape of one matrix.

    Muon is for hidden 2-D weights; embeddings, the head, norms and biases go to AdamW:
    ``muon_groups`` splits a model's parameters so, and a param group with ``use_muon=False``
    is stepped by torch.optim.AdamW with that group's ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` (Keller Jordan's MuonWithAuxAdam), so one optimizer, one state dict and
    one checkpoint hold both.
    """

    send_dtype = torch.bfloat16  # Newton-Schulz starts by casting to bf16
    update_dtype = torch.bfloat16  # and computes in bf16

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise fail("Muon's lr, a tensor, must have one element", "Pass a float or a 1-element tensor.")
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not 0.0 <= value:
                raise fail(f"Muon({name}={value}) must be at least 0", f"Pass a non-negative {name}.")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise fail(f"Muon(adjust_lr_fn={adjust_lr_fn!r}) is not offered", "Pass None, 'original' or "
                       "'match_rms_adamw'.")
        if not ns_steps < 100 or len(ns_coefficients) != 3:
            raise fail(f"Muon(ns_steps={ns_steps}, ns_coefficients={ns_coefficients}) is not offered",
                       "Pass fewer than 100 steps and three coefficients.")
        groups = list(params)
        aux = [g for g in groups if isinstance(g, dict) and g.get("use_muon", True) is False]
        super().__init__([g for g in groups if not any(g is a for a in aux)],
                         dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                              ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn))
        self.adamw = None
        if aux:  # its groups are this optimizer's too, and its state is this one's
            self.adamw = torch.optim.AdamW([{k: v for k, v in g.items() if k != "use_muon"} for g in aux])
            for group in self.adamw.param_groups:
                group["use_muon"] = False
            self.param_groups += self.adamw.param_groups
            self.adamw.state = self.state
        for group in self.param_groups:
            if group.get("use_muon", True) is False:
                continue
            for p in group["params"]:
                if p.dim() not in (2, 3):
                    raise fail(f"Muon steps a parameter of shape {tuple(p.shape)}, not a matrix",
                               "Give Muon the 2-D hidden weights (and 3-D stacked experts) and AdamW the rest: "
                               "fullshard.optim.muon_groups(model) splits them.")

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self.adamw is not None:  # the loaded groups and state are new objects
            self.adamw.param_groups = [g for g in self.param_groups if g.get("use_muon", True) is False]
            self.adamw.state = self.state

    def rows(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        momentum = group["momentum"]
        buffer = self.local(p, state["momentum_buffer"])
        buffer.lerp_(grad, 1 - momentum)
        return grad.lerp(buffer, momentum) if group["nesterov"] else buffer

    def transform(self, matrix: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        if matrix.dim() == 3:
            return torch.stack([orthogonalize(one, *args) for one in matrix]) if len(matrix) else \
                matrix.to(torch.bfloat16)
        return orthogonalize(matrix, *args)

    def apply(self, rows: torch.Tensor, update: torch.Tensor, group: dict, shape: torch.Size) -> None:
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        rows.mul_(1 - lr * group["weight_decay"])
        rows.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape[-2:]))

    def cost(self, shape: torch.Size) -> float:
        return newton_schulz_flops(shape)


def newton_schulz_flops(shape: torch.Size) -> float:
    """One Newton-Schulz iteration's FLOPs on a matrix (or batch of matrices) of `shape` (m x n,
    m <= n): X X^T (2 m^2 n), then A^2 (2 m^3) and the product with X (2 m^2 n)."""
    m, n = sorted(shape[-2:])
    return float(4 * m * m * n + 2 * m * m * m) * math.prod(shape[:-2])


def orthogonalize(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on one matrix, in bf16, as torch.optim.Muon computes
    it (the same operations in the same order, so the same bits): scaled to spectral norm at most
    1 by its Frobenius norm, then `steps` times X <- aX + (bA + cA^2)X with A = X X^T, on the
    wide orientation."""
    a, b, c = coefficients
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, how: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning rate for a matrix of `shape` (A x B): sqrt(max(1, A/B)) times
    it ("original", the default), 0.2 sqrt(max(A, B)) times ("match_rms_adamw")."""
    rows, cols = shape
    if how is None or how == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def muon_groups(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the hidden matrices, everything else) of a model's trainable parameters: 2-D and 3-D
    parameters for Muon, except embeddings and the output head (by module type and by the
    weight an embedding shares with the head); the rest for AdamW."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        embedded.add(id(head.weight))
    matrices, rest = [], []
    for p in model.parameters():
        if p.requires_grad:
            (matrices if p.dim() in (2, 3) and id(p) not in embedded else rest).append(p)
    return matrices, rest


def zeros_like_rows(m: Matrix, shape: torch.Size, dtype: torch.dtype) -> DTensor:
    """A whole-matrix state of `shape`, zeros, kept as row shards of m's group: a DTensor as the
    parameter's shards are, so state dicts and checkpoints carry it."""
    group = m.group
    local = torch.zeros((rows_of(shape, group.world)[group.rank], *shape[1:]), dtype=dtype,
                        device=m.sharded.local_shard().device)
    return DTensor.from_local(local, group.mesh, group.sharded_placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def is_row_shards(m: Matrix, value: torch.Tensor) -> bool:
    return isinstance(value, DTensor) and value.device_mesh == m.group.mesh and \
        tuple(value.placements) == tuple(m.group.sharded_placements)


def as_row_shards(m: Matrix, value: torch.Tensor) -> DTensor:
    """A whole-matrix state loaded whole (a full state dict) or laid out for another mesh, as m's
    group's row shards (this rank's rows copied)."""
    whole = full_tensor(value, m.sharded.caller) if isinstance(value, DTensor) else value
    shards = zeros_like_rows(m, whole.shape, whole.dtype)
    group = m.group
    start = sum(rows_of(whole.shape, group.world)[: group.rank])
    shards._local_tensor.copy_(whole.narrow(0, start, shards._local_tensor.shape[0]))
    return shards


def assign_owners(matrices: list[Matrix], world: int, cost) -> None:
    """Longest processing time first: each matrix, costliest first, to the rank with the least
    work so far (ties: the lower rank), alike on every rank."""
    load = [0.0] * world
    for m in sorted(matrices, key=lambda m: -cost(m.sharded.global_shape)):  # stable: optimizer order on ties
        m.owner = min(range(world), key=lambda r: (load[r], r))
        load[m.owner] += cost(m.sharded.global_shape)


def check_matrix(sp: ShardedParam, optimizer: str, matrix_state: bool) -> None:
    if sp.view is not None:
        raise fail(f"{optimizer} steps parameter {sp.fqn!r}, a DTensor of a mesh with data-parallel dims (Note "
                   f"[SPMD meshes])", "Give fully_shard the data-parallel mesh and parallelize_module the "
                   "tensor-parallel one (2-D parallelism), or step such weights with AdamW.")
    if sp.tp_mesh is not None and (len(sp.global_shape) != 2 or matrix_state):
        raise fail(f"{optimizer} steps tensor-parallel parameter {sp.fqn!r} of shape {tuple(sp.global_shape)}: "
                   f"only 2-D tensor-parallel matrices, with no whole-matrix state, are transformed",
                   "Step it with AdamW, or shard the model without tensor parallelism.")
    if len(sp.global_shape) not in (2, 3) or len(sp.global_shape) == 3 and sp.dim != 0:
        raise fail(f"{optimizer} steps parameter {sp.fqn!r} of shape {tuple(sp.global_shape)}, not a matrix (or "
                   f"a batch of matrices split along dim 0)", "Give it the 2-D hidden weights (and 3-D stacked "
                   "experts) and AdamW the rest: fullshard.optim.muon_groups(model) splits them.")
