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
#
# Note [matrix identity]: ranks may list the same parameters in other orders (a set, a list built
# from a dict): each matrix is named by its unit's id, agreed by every rank at fully_shard, and
# its place in the unit, and every step orders matrices, assigns owners and packs rows by that
# name, never by the user's list, so any order gives the same bits. What a rank expects of a step
# (which matrices have gradients, their owners and shapes, the hyperparameters that shape the
# update) is hashed into the tag of every message of the exchange (and the first 8 bytes of
# each): ranks that differ (a matrix in another param group, a gradient None on one rank) never
# match each other's messages, and every rank raises a FullShardError naming the exchange when
# the unit's timeout (set_timeout) runs out, where rows of other sizes would make gloo abort the
# process and rows of other matrices would be read as these. NCCL has no tags: there debug
# checks (set_debug_checks) compare the hash first.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from fullshard import runtime
from fullshard.collectives import Caller, all_gather_ints, exchange_bytes, full_tensor, site
from fullshard.errors import CollectiveError, collective_failed, fail
from fullshard.param import ShardedParam, shard_rows
from fullshard.tags import p2p_tag
from fullshard.units import unit_of

__all__ = ["MatrixOptimizer", "Muon", "muon_groups"]

VIEWS = site("the comparison of the matrices a step exchanges")
DIFFERENT_STEPS = ("Every rank must step the same matrices with the same hyperparameters: build the optimizer "
                   "alike on every rank (the same param groups; their order does not matter) and give every "
                   "rank's matrices gradients, or none (zero_grad on every rank).")


@dataclass
class Matrix:
    """One parameter of a matrix optimizer: its shard's bookkeeping, its unit and its owner."""

    sharded: ShardedParam
    unit: object  # the Unit that holds it (unit.py): its group, timeout and debug switch as they are now
    key: tuple[int, int]  # (unit id, place in the unit): its name on every rank, Note [matrix identity]
    owner: int = 0  # the group rank that transforms it
    batched: bool = False  # a 3-D batch of whole matrices per rank: no exchange
    state_shapes: dict[str, torch.Size] = field(default_factory=dict)  # its whole-matrix state's, by name

    @property
    def group(self):
        return self.unit.group

    @property
    def held_whole(self) -> bool:
        return self.batched or self.group.shard_pg is None


def rows_of(shape: torch.Size, world: int) -> list[int]:
    """The rows (dim 0) each group rank holds of a tensor of `shape` split as shards are (Note [shard layout])."""
    return [shard_rows(shape[0], world, r)[1] for r in range(world)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def sharded_of(p: torch.Tensor) -> tuple[ShardedParam, object, int] | None:
    """The fullshard bookkeeping of a parameter: (its ShardedParam, its unit, its place there)."""
    unit = unit_of(p)
    if unit is None:
        return None
    index = next(i for i, sp in enumerate(unit.params) if sp.sharded is p)
    return unit.params[index], unit, index


def name_of(p: torch.Tensor) -> str:
    """A parameter in words, for messages: its name in its unit, or its shape when not sharded."""
    found = sharded_of(p)
    if found is None:
        return f"a parameter of shape {tuple(p.shape)}"
    sp, unit, _ = found
    where = f"unit {unit.fqn!r}" if unit.fqn else f"a {unit.class_name} unit"
    return f"parameter {sp.fqn!r} of {where} (shape {tuple(sp.global_shape)})"


def param_list(params, optimizer: str) -> list:
    """An optimizer's params argument (tensors or param groups) as a list, refusing a set, whose
    order changes from run to run (as torch's optimizers refuse it)."""
    if isinstance(params, (set, frozenset)) or isinstance(params, dict) and isinstance(params.get("params"), set):
        raise fail(f"{optimizer} was given a set of parameters, whose order changes between runs",
                   "Pass a list, e.g. list(model.parameters()) or the lists fullshard.optim.muon_groups returns.")
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


class MatrixOptimizer(torch.optim.Optimizer):
    """Base class of optimizers that update each parameter's matrix as a whole (Note [matrix
    optimizers]). For each parameter of a fullshard model a subclass says:

    - ``rows(p, grad, state, group)``: on every rank, from its rows of p's gradient (and of
      its elementwise state in ``state``, DTensors shaped as p, whose rows ``self.local(p,
      value)`` gives), its rows of the matrix to transform, leaving ``state`` as it was (the
      exchange may still fail);
    - ``commit(p, state, group)``: write the elementwise state ``rows`` computed, once every
      rank's exchange succeeded;
    - ``matrix_state(shape, group)``: the whole-matrix state the transform keeps, name ->
      (shape, dtype): created as zeros, kept as row shards between steps;
    - ``transform(matrix, state, group)``: on the owner, the whole matrix (and that state,
      whole, to update in place) -> the whole update, of ``update_dtype``;
    - ``apply(rows, update, group, shape)``: on every rank, its rows of the update applied to
      its rows of the parameter (``shape``: the whole parameter's);
    - ``transforms(group)``: whether a param group's parameters are transformed (else the
      subclass steps them itself).

    ``send_dtype`` is the dtype the matrix's rows go to the owner in (None: as they are);
    ``update_dtype`` the dtype of the update (None: the rows' as sent).
    """

    send_dtype: torch.dtype | None = None
    update_dtype: torch.dtype | None = None

    def __init__(self, params, defaults: dict) -> None:
        super().__init__(param_list(params, type(self).__name__), defaults)

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

    def commit(self, p: torch.Tensor, state: dict, group: dict) -> None:
        pass

    def transforms(self, group: dict) -> bool:
        return True

    def cost(self, shape: torch.Size) -> float:
        """The transform's work on a matrix of `shape`, what owners are balanced by (Muon: its FLOPs)."""
        m, n = sorted(shape[-2:])
        return float(m * m * n) * math.prod(shape[:-2])

    def add_param_group(self, param_group: dict) -> None:
        """torch's, refusing a set of parameters (Note [matrix identity]) and a parameter already
        in another group (by name)."""
        param_group = dict(param_group)
        param_group["params"] = param_list(param_group["params"], type(self).__name__)
        self.check_unique(param_group["params"])
        super().add_param_group(param_group)

    def check_unique(self, params: list) -> None:
        """Refuse a parameter that is in another group already, or twice in these."""
        held = {p for group in self.param_groups for p in group["params"]}
        seen = set()
        for p in params:
            if p in held or p in seen:
                raise fail(f"{type(self).__name__} was given {name_of(p)} in two parameter groups",
                           "Give each parameter to one group (muon_groups splits a model's parameters into two "
                           "lists that do not overlap).")
            seen.add(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        by_group: dict[object, list] = {}
        for group in self.param_groups:
            if not self.transforms(group):
                continue
            for p in group["params"]:
                if p.grad is not None:
                    m = self.matrix_of(p)
                    by_group.setdefault(m.group.shard_pg, []).append((p, m, group))  # one exchange per group of ranks
        for items in sorted(by_group.values(), key=lambda items: min(m.key for _, m, _ in items)):
            self.step_group(sorted(items, key=lambda item: item[1].key))  # Note [matrix identity]
        return loss

    def matrix_of(self, p: torch.Tensor) -> Matrix:
        """The fullshard bookkeeping of `p`, found among the live units once."""
        matrices = self.__dict__.setdefault("matrices", {})
        if p in matrices:
            return matrices[p]
        found = sharded_of(p)
        if found is None:
            raise fail(f"{type(self).__name__} steps {name_of(p)}, which belongs to no fullshard model",
                       f"Shard the model first (fullshard.shard_model or fully_shard), then build "
                       f"{type(self).__name__} from the sharded model's parameters.")
        sp, unit, index = found
        own_state = type(self).matrix_state is not MatrixOptimizer.matrix_state
        check_matrix(sp, name_of(p), type(self).__name__, own_state)
        matrices[p] = Matrix(sp, unit, (unit.uid, index), batched=p.dim() == 3)
        return matrices[p]

    def view_digest(self, items: list) -> int:
        """A hash of what this rank expects of a step's exchange (Note [matrix identity]): which
        matrices, their owners and shapes, and their groups' hyperparameters."""
        view = [(m.key, m.owner, tuple(m.sharded.global_shape), sorted(m.state_shapes.items()),
                 sorted((k, float(v) if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"))
                for _, m, group in items]
        return zlib.crc32(repr(view).encode())

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
            rt.host_waits(device, timeout=items[0][1].unit.timeout,
                          what=f"{type(self).__name__}'s updates to the host")
        for i, (p, m, group) in enumerate(items):  # every exchange done: the state changes now
            update, *states = results[i]
            self.commit(p, self.state[p], group)
            for mine, new in zip(kept[i][1:], states):
                if mine is not new:
                    mine.copy_(new)
            self.apply(m.sharded.local_shard(), update, group, m.sharded.global_shape)

    def exchange(self, items: list, sent: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Per item, this rank's rows of its update and of its new whole-matrix state: its rows
        sent to the owners, transformed there, sent back. Every message starts with the 8 bytes
        of the step's digest and goes under tags made of it (Note [matrix identity])."""
        m0 = items[0][1]
        world, rank, device = m0.group.world, m0.group.rank, m0.group.device
        digest = self.view_digest(items)
        if m0.unit.switches.debug:  # where tags cannot (NCCL) or before anything waits: a host sync
            self.compare_views(m0, digest)
        lead = torch.tensor([digest], dtype=torch.int64, device=device).view(torch.uint8)  # [8]
        wholes = [[m.sharded.shape, *m.state_shapes.values()] for _, m, _ in items]  # rows first
        # 1. every rank's rows of each matrix (and its state) to the matrix's owner
        send = [[lead] if r != rank else [] for r in range(world)]
        sizes = [lead.numel() if r != rank else 0 for r in range(world)]
        for (_, m, _), tensors, shapes in zip(items, sent, wholes):
            if m.owner != rank:
                send[m.owner] += [as_bytes(t) for t in tensors]
            else:
                for r in range(world):
                    if r != rank:
                        sizes[r] += sum(rows_of(s, world)[r] * math.prod(s[1:]) * t.element_size()
                                        for t, s in zip(tensors, shapes))
        received = self.send_rows(send, sizes, device, m0, digest, 0, "the rows of the matrices to their owners")
        taken = [lead.numel()] * world
        # 2. the owners transform; each rank's rows of the update (and of the new state) go back
        back, results = [[lead] if r != rank else [] for r in range(world)], {}
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
        sizes = [lead.numel() if r != rank else 0 for r in range(world)]
        for (_, m, _), tensors in zip(items, sent):
            if m.owner != rank:
                sizes[m.owner] += tensors[0].numel() * (self.update_dtype or tensors[0].dtype).itemsize + \
                    sum(t.numel() * t.element_size() for t in tensors[1:])
        returned = self.send_rows(back, sizes, device, m0, digest, 1, "the rows of the updates back from their owners")
        # 3. the others' rows of the updates (and of the new state) as they came back
        taken = [lead.numel()] * world
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

    def compare_views(self, m: Matrix, digest: int) -> None:
        """Debug checks: every rank of m's group expects the same exchange, the digests all-gathered."""
        name = f"{type(self).__name__}'s comparison of the matrices its step exchanges"
        try:
            everyone = all_gather_ints([digest], device=m.group.device, timeout=m.unit.timeout,
                                       group=m.group.shard_pg, what=VIEWS)
        except CollectiveError as e:
            raise collective_failed(name, e, DIFFERENT_STEPS) from None
        if len({d for (d,) in everyone}) > 1:
            raise fail(f"ranks would exchange the rows of different matrices in {type(self).__name__}'s step "
                       f"(digests by group rank: {[d for (d,) in everyone]})", DIFFERENT_STEPS)

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
                  digest: int, leg: int, what: str) -> list[torch.Tensor]:
        """send[r] to group rank r, sizes[r] bytes from it, over m's shard group, within its unit's
        timeout, under the tag of this step's digest and leg (Note [matrix identity])."""
        name = f"{type(self).__name__}'s exchange of {what}"
        try:
            received = exchange_bytes(send, sizes, device, m.group.shard_pg, Caller(name, m.unit.timeout),
                                      p2p_tag(digest, leg, 0))
        except CollectiveError as e:
            raise collective_failed(name, e, DIFFERENT_STEPS) from None
        rank = m.group.shard_pg.rank()  # what this rank sent, for fullshard.stats (and train's "sent per step")
        m.unit.counts["exchanges"] += 1
        m.unit.counts["exchange_bytes"] += sum(t.numel() for r, to_rank in enumerate(send) if r != rank for t in to_rank)
        return received


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
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        if problems := muon_group_problems(defaults):
            raise fail(f"Muon: {', '.join(problems)}", MUON_FIX)
        self.adamw = None  # steps the use_muon=False groups, over this optimizer's state
        self.next_buffers: dict[torch.Tensor, torch.Tensor] = {}  # this step's momentum rows, until commit
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """A group of matrices, or with ``use_muon=False`` one that AdamW steps (AdamW's defaults
        fill what it does not say); each checked by its kind's rules before it is added."""
        param_group = dict(param_group)
        if param_group.get("use_muon", True) is not False:
            super().add_param_group(param_group)  # torch fills Muon's defaults
            group = self.param_groups[-1]
            if problems := muon_group_problems(group):
                self.param_groups.pop()
                raise fail(f"Muon's param group {len(self.param_groups)}: {', '.join(problems)}", MUON_FIX)
            for p in group["params"]:
                if p.dim() not in (2, 3):
                    self.param_groups.pop()
                    raise fail(f"Muon steps {name_of(p)}, not a matrix", MATRICES_FIX)
            return
        param_group["params"] = param_list(param_group["params"], "Muon")
        self.check_unique(param_group["params"])
        for key, value in ADAMW_DEFAULTS.items():
            param_group.setdefault(key, value)
        if problems := adamw_group_problems(param_group):
            raise fail(f"Muon's AdamW param group {len(self.param_groups)}: {', '.join(problems)}", ADAMW_FIX)
        for p in param_group["params"]:
            if not isinstance(p, torch.Tensor) or not p.is_leaf:
                raise fail(f"Muon's AdamW param group holds {type(p).__name__}, not a leaf tensor",
                           "Pass the model's parameters.")
        self.param_groups.append(param_group)

    def transforms(self, group: dict) -> bool:
        return group.get("use_muon", True) is not False

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)  # the matrices
        aux = [group for group in self.param_groups if not self.transforms(group)]
        if aux:  # AdamW's step over this optimizer's groups and state, as they are now
            if self.adamw is None:
                self.adamw = torch.optim.AdamW(aux)
            self.adamw.param_groups, self.adamw.state = aux, self.state
            self.adamw.step()
        return loss

    def group_problems(self, saved: dict, own: dict) -> list[str]:
        """Why a saved param group cannot stand where this one has `own`: another kind (a key
        of own's missing, or use_muon otherwise), or a hyperparameter its kind's rules refuse."""
        if saved.get("use_muon", True) is not own.get("use_muon", True):
            return [f"use_muon is {saved.get('use_muon', True)!r}, not {own.get('use_muon', True)!r}"]
        missing = sorted(set(own) - set(saved) - {"params", "initial_lr"})
        if missing:
            return [f"lacks {', '.join(map(repr, missing))}: a group of another kind of optimizer"]
        return (muon_group_problems if self.transforms(own) else adamw_group_problems)(saved)

    def state_problem(self, group: dict, shape: tuple, key: str, value) -> str | None:
        """Why a saved state value (a tensor, or (dtype, shape) for one) cannot be the state `key`
        of a parameter of `shape` in `group`: a key the kind does not keep, or a tensor of another
        shape or kind."""
        return (muon_state_problem if self.transforms(group) else adamw_state_problem)(tuple(shape), key, value)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, after every group and state value is checked by its kind's rules (nothing
        changes when one is refused); full tensors of a parameter's shape (a one-process
        optimizer's state) become its shards."""
        groups, state = state_dict.get("param_groups", []), state_dict.get("state", {})
        problems = [f"group {i}: {problem}" for i, (saved, own) in enumerate(zip(groups, self.param_groups))
                    for problem in self.group_problems(saved, own)]
        if len(groups) != len(self.param_groups):
            problems.append(f"{len(groups)} param groups, not {len(self.param_groups)}")
        params = {index: (p, own) for index, (p, own) in
                  enumerate((p, own) for own in self.param_groups for p in own["params"])}
        for index, values in state.items():
            if index not in params:
                problems.append(f"state of parameter {index}, which this optimizer does not have")
                continue
            p, own = params[index]
            problems += [f"{name_of(p)}: {problem}" for key, value in values.items()
                         if (problem := self.state_problem(own, p.shape, key, value))]
        if problems:
            raise fail(f"Muon.load_state_dict: the state does not fit this optimizer ({'; '.join(problems[:8])})",
                       "Load the state_dict() of a Muon with the same param groups (or of torch.optim.Muon and "
                       "AdamW, group by group).")
        super().load_state_dict(state_dict)
        for p, values in self.state.items():
            found = sharded_of(p)
            for key, value in values.items():
                if found is not None and isinstance(value, torch.Tensor) and value.dim() and \
                        value.shape == p.shape and not found[0].laid_out_as_shard(value):
                    values[key] = found[0].as_dtensor(found[0].rows_of(value).detach().clone())

    def rows(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        momentum = group["momentum"]
        old = self.local(p, state["momentum_buffer"]) if "momentum_buffer" in state else torch.zeros_like(grad)
        new = self.next_buffers[p] = old.lerp(grad, 1 - momentum)  # kept by commit, once every rank exchanged
        return grad.lerp(new, momentum) if group["nesterov"] else new

    def commit(self, p: torch.Tensor, state: dict, group: dict) -> None:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        self.local(p, state["momentum_buffer"]).copy_(self.next_buffers.pop(p))

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


MUON_FIX = "Pass Muon's arguments within torch.optim.Muon's ranges (its defaults: lr=1e-3, momentum=0.95, ns_steps=5)."
ADAMW_FIX = "Pass AdamW's arguments within its ranges: lr >= 0, betas in [0, 1), eps > 0, weight_decay >= 0."
MATRICES_FIX = ("Give Muon the 2-D hidden weights (and 3-D stacked experts) and AdamW the rest: "
                "fullshard.optim.muon_groups(model) splits them.")
ADAMW_DEFAULTS = {key: value for key, value in
                  torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults.items()}
MAX_NS_STEPS = 100  # torch.optim.Muon's bound: each step is three matrix products per matrix
MAX_COEFFICIENT = 1e4  # Newton-Schulz's coefficients are of order 1; bf16 overflows near 3e38


def is_number(value) -> bool:
    return type(value) in (int, float)


def finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int of hundreds of digits
        return False


def tensor_like(value) -> bool:
    """A tensor, or a saved one described as (dtype, shape)."""
    return isinstance(value, torch.Tensor) or isinstance(value, tuple) and len(value) == 2 and \
        isinstance(value[0], torch.dtype)


def number_problem(name: str, value, low: float, high: float = math.inf, *, above: bool = False,
                   below: bool = False) -> str | None:
    """`value` a finite number (not a bool) from `low` to `high` (`above`/`below`: not equal to
    them); lr may be a one-element floating-point tensor."""
    if name == "lr" and tensor_like(value):
        if not isinstance(value, torch.Tensor):  # a saved tensor: its value comes with the load
            dtype, shape = value
            return None if dtype.is_floating_point and math.prod(shape) == 1 else \
                "lr, a tensor, must be one floating-point element"
        if value.numel() != 1 or not value.is_floating_point():
            return "lr, a tensor, must be one floating-point element"
        value = float(value)
    if not is_number(value) or not finite(value):
        return f"{name}={str(value)[:40]} is not a finite number"
    if value < low or above and value == low:
        return f"{name}={value} must be {'above' if above else 'at least'} {low:g}"
    if value > high or below and value == high:
        return f"{name}={value} must be {'below' if below else 'at most'} {high:g}"
    return None


def muon_group_problems(group: dict) -> list[str]:
    """Muon's rules for a param group's (or the defaults') hyperparameters, in words; [] when they hold."""
    problems = [number_problem("lr", group.get("lr"), 0), number_problem("weight_decay", group.get("weight_decay"), 0),
                number_problem("momentum", group.get("momentum"), 0, 1),
                number_problem("eps", group.get("eps"), 0, above=True)]
    if type(group.get("nesterov")) is not bool:
        problems.append(f"nesterov={group.get('nesterov')!r} is not a bool")
    steps = group.get("ns_steps")
    if type(steps) is not int or not 0 <= steps < MAX_NS_STEPS:
        problems.append(f"ns_steps={str(steps)[:40]} is not an int from 0 to {MAX_NS_STEPS - 1}")
    coefficients = group.get("ns_coefficients")
    if not (isinstance(coefficients, (tuple, list)) and len(coefficients) == 3 and
            all(is_number(c) and finite(c) and abs(c) <= MAX_COEFFICIENT for c in coefficients)):
        problems.append(f"ns_coefficients={str(coefficients)[:80]} are not three finite numbers of magnitude at "
                        f"most {MAX_COEFFICIENT:g}")
    if group.get("adjust_lr_fn") not in (None, "original", "match_rms_adamw"):
        problems.append(f"adjust_lr_fn={group.get('adjust_lr_fn')!r} is not None, 'original' or 'match_rms_adamw'")
    return [problem for problem in problems if problem]


def adamw_group_problems(group: dict) -> list[str]:
    """AdamW's rules for a param group's hyperparameters (Muon's use_muon=False groups), in words."""
    problems = [number_problem("lr", group.get("lr"), 0), number_problem("weight_decay", group.get("weight_decay"), 0),
                number_problem("eps", group.get("eps"), 0, above=True)]
    betas = group.get("betas")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        problems.append(f"betas={str(betas)[:80]} are not two numbers")
    else:
        problems += [number_problem(f"betas[{i}]", beta, 0, 1, below=True) for i, beta in enumerate(betas)]
    for key in ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay"):
        if key in group and type(group[key]) is not bool:
            problems.append(f"{key}={group[key]!r} is not a bool")
    for key in ("foreach", "fused"):
        if group.get(key) is not None and type(group[key]) is not bool:
            problems.append(f"{key}={group[key]!r} is not None or a bool")
    return [problem for problem in problems if problem]


def described(value) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """A state value as (dtype, shape), None for a plain value."""
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape)
    return (value[0], tuple(value[1])) if tensor_like(value) else None


def muon_state_problem(shape: tuple, key: str, value) -> str | None:
    """Muon keeps one momentum_buffer per matrix: a floating-point tensor of its shape."""
    if key != "momentum_buffer":
        return f"state {key!r} is not Muon's (it keeps 'momentum_buffer')"
    return tensor_problem(key, described(value), shape)


def adamw_state_problem(shape: tuple, key: str, value) -> str | None:
    """AdamW keeps step (a number, or a one-element tensor) and exp_avg, exp_avg_sq (and with
    amsgrad max_exp_avg_sq): floating-point tensors of the parameter's shape."""
    if key == "step":
        found = described(value)
        if found is None:
            return None if is_number(value) and finite(value) and value >= 0 else \
                f"step={str(value)[:40]} is not a count"
        dtype, size = found
        return None if math.prod(size) == 1 and not dtype.is_complex and dtype != torch.bool else \
            f"step is a tensor of shape {list(size)} and {dtype}, not one real number"
    if key not in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        return f"state {key!r} is not AdamW's (it keeps 'step', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq')"
    return tensor_problem(key, described(value), shape)


def tensor_problem(key: str, found, shape: tuple) -> str | None:
    if found is None:
        return f"{key} is a plain value, not a tensor"
    dtype, size = found
    if not dtype.is_floating_point:
        return f"{key} is {dtype}, not a floating-point tensor"
    return None if tuple(size) == tuple(shape) else f"{key} has shape {list(size)}, not the parameter's {list(shape)}"


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
    # made from the shard (host memory under CPU offload), so a stream model knows where it lives
    local = m.sharded.local_shard().new_zeros((rows_of(shape, group.world)[group.rank], *shape[1:]), dtype=dtype)
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
    for m in sorted(matrices, key=lambda m: (-cost(m.sharded.global_shape), m.key)):  # Note [matrix identity]
        m.owner = min(range(world), key=lambda r: (load[r], r))
        load[m.owner] += cost(m.sharded.global_shape)


def check_matrix(sp: ShardedParam, name: str, optimizer: str, matrix_state: bool) -> None:
    if sp.view is not None:
        raise fail(f"{optimizer} steps {name}, a DTensor of a mesh with data-parallel dims (Note [SPMD meshes])",
                   "Give fully_shard the data-parallel mesh and parallelize_module the tensor-parallel one (2-D "
                   "parallelism), or step such weights with AdamW.")
    if sp.tp_mesh is not None and (len(sp.global_shape) != 2 or matrix_state):
        raise fail(f"{optimizer} steps tensor-parallel {name}: only 2-D tensor-parallel matrices, with no "
                   f"whole-matrix state, are transformed", "Step it with AdamW, or shard the model without tensor "
                   "parallelism.")
    if len(sp.global_shape) not in (2, 3) or len(sp.global_shape) == 3 and sp.dim != 0:
        raise fail(f"{optimizer} steps {name}, not a matrix (or a batch of matrices split along dim 0)",
                   MATRICES_FIX)
