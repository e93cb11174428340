"""Plan before you run: predict a sharding's memory and traffic per rank, and pick one for a budget.

# Note [planner]: the model is a meta-device model, so nothing is allocated. Its
# structure gives each candidate's units (wrap.choose_units, as shard_model would make
# them); one forward on fake tensors under saved_tensors_hooks gives the activation
# bytes autograd keeps for backward (per precision, with and without activation
# checkpointing). Memory per rank is then counted the way fullshard allocates: shards,
# optimizer state and sharded gradients, the full parameters in flight (root, the unit
# computing, the kept last unit, `limit_all_gathers` ahead), communication buffers, one
# unit's full gradients, and activations. Bytes sent per step are those fullshard.stats
# counts, exactly. Step time is compute (6 flops per parameter per token, 8 with
# recomputation) plus communication at the hardware's bandwidths, overlapped where the
# hardware overlaps them. With CPU offload (GPUs only) the shards, gradients and optimizer
# state leave device memory; each gather copies a shard in and each reduce-scatter a
# gradient shard out over the host link, and the optimizer step runs on the host.
# With tensor parallelism (tp > 1) each parameter counts as a TP rank's part, as the
# tp_plan splits it, sharded over the world_size // tp data-parallel ranks; activations
# are a TP rank's: sequence parallelism splits what a block saves, except the inputs
# TP gathers whole for its column-split projections and what follows a gathered output
# (a head's logits). TP's own traffic is not predicted (benchmarks/tensor_parallel.py
# measures it against the recipe's closed form).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import inspect
import itertools
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fullshard.collectives import broadcast_from_rank0
from fullshard.errors import fail, in_bytes, require
from fullshard.gpt import GPT, GPTConfig
from fullshard.low_precision import sent_bytes
from fullshard.optim import muon_groups, newton_schulz_flops
from fullshard.param import shard_numel
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy
from fullshard.strategies import STRATEGIES
from fullshard.blocks import BLOCK
from fullshard.quantize import quantized_bytes
from fullshard.accounting import process_memory, return_freed_memory
from fullshard.wrap import choose_units, recompute, shard_model


@dataclass(frozen=True)
class Hardware:
    """What one rank can do: sustained compute, link bandwidths, and whether comm overlaps compute."""

    name: str
    flops: dict[str, float]  # sustained FLOP/s per rank by compute precision
    intra_bw: float  # bytes/s a rank sends to ranks in its node
    cross_bw: float  # bytes/s a rank's network interface sends to other nodes
    latency: float  # seconds per step of a ring collective (a collective over n ranks takes n - 1 steps)
    overlap: bool  # communication hides behind compute (GPUs) or competes for the same cores (CPU ranks)
    ranks_per_node: int
    memory: float  # bytes per rank
    # bytes a rank's runtime holds besides tensors, by precision: on paper; measured instead
    # for a CPU (Note [runtime probe])
    runtime: dict[str, int]
    device: str = "cuda"  # activations are measured as this device's kernels would save them
    host_bw: float = 0.0  # bytes/s between host and device memory per rank (CPU offload; 0: no offload candidates)
    host_optimizer: float = 0.0  # parameters/s the host's optimizer step updates per rank (CPU offload)
    host_memory: float = 0.0  # bytes of host memory per rank that offloading may fill
    cores: int = 0  # the probed CPU's cores: its plan is for ranks on that machine, which share them


HARDWARE = {
    # this repository's CPU machine, fitted to measured steps (docs/planner.md): one core per rank, loopback TCP;
    # runtime and FLOP/s are always measured (Note [runtime probe]), these are that machine's
    "cpu": Hardware("cpu", {"fp32": 60e9, "bf16": 125e9}, intra_bw=0.8e9, cross_bw=0.8e9, latency=4e-4,
                    overlap=False, ranks_per_node=2, memory=12 * 2**30, runtime={"fp32": 48 << 20, "bf16": 59 << 20},
                    device="cpu"),
    # On paper (docs/planner.md): datasheet peaks x 0.6 (fp32 without TF32, PyTorch's default); NVLink
    # inside a node, one 200 (A100) or 400 (H100) Gb/s InfiniBand port per GPU; 3 us per ring step,
    # NVLink and network hops averaged 7:1
    "a100": Hardware("a100-80gb", {"fp32": 19.5e12 * 0.6, "bf16": 312e12 * 0.6}, intra_bw=240e9, cross_bw=23e9,
                     latency=3e-6, overlap=True, ranks_per_node=8, memory=80e9,
                     runtime={"fp32": 2 << 30, "bf16": 2 << 30},  # CUDA context, NCCL buffers, fragmentation
                     host_bw=20e9, host_optimizer=1e9, host_memory=1e12 / 8),  # PCIe 4; a fused CPU Adam; 1 TB/node
    "h100": Hardware("h100-80gb", {"fp32": 67e12 * 0.6, "bf16": 989e12 * 0.6}, intra_bw=360e9, cross_bw=46e9,
                     latency=3e-6, overlap=True, ranks_per_node=8, memory=80e9,
                     runtime={"fp32": 2 << 30, "bf16": 2 << 30}, host_bw=40e9, host_optimizer=1e9,
                     host_memory=2e12 / 8),  # PCIe 5; 2 TB per node
}


INT8_GAIN = 1.25
# Note [peak margin]: a CPU candidate fits a budget when its predicted peak and this share of
# it do: 10%, the planner's accuracy target (docs/planner.md), so a run planned for a budget
# peaks below it as `fullshard train` reports. 5% was too little: the tables' error is -0.3 ..
# -4.3% on two machines, and a test's ranks, which hold pytest (~6 MiB) and planned in the
# process, were -3.5 .. -6.2% under.
# GPU figures are on paper: a budget there is the allocator's peak plus the runtime stated apart.
PEAK_MARGIN = 0.10


def needed(c: Candidate, hw: Hardware) -> int:
    """The budget candidate `c` needs (Note [peak margin])."""
    return int(c.peak * (1 + PEAK_MARGIN)) if hw.device == "cpu" else c.peak + hw.runtime[c.precision]  # how much faster quantized gathers or reductions must make a step to be chosen over exact ones


@dataclass
class Candidate:
    """One way to shard the model, with what it is predicted to cost per rank and step."""

    wrap: str  # "blocks" (each instance of the model's repeated block class) or "none"
    strategy: str
    limit_all_gathers: int
    precision: str  # "fp32" or "bf16" (compute; masters stay fp32)
    checkpointing: bool  # activation checkpointing of each block
    offload: bool = False  # shards, gradients and optimizer state in host memory, the optimizer step on the host
    gather: str = "exact"  # "int8": block-quantized gathers (Note [int8 gathers]), which change numerics
    reduce: str = "exact"  # "bf16" or "int8": rows sent so, summed in fp32 (Note [low-precision reductions])
    memory: dict[str, int] = field(default_factory=dict)  # bytes per rank, by part, at the peak
    host: int = 0  # host memory per rank that offloading takes
    peak: int = 0
    sent_intra: int = 0  # bytes a rank sends per step inside its shard group
    sent_cross: int = 0  # across replicas
    sent_optimizer: int = 0  # by a matrix optimizer's exchange (Muon: Note [matrix optimizers]), inside the group
    sync_every: int = 0  # hybrid_shard's replicas under DiLoCo, syncing every this many steps (0: every step)
    collectives: int = 0
    compute_s: float = 0.0  # of the step, communication aside
    step_s: float = 0.0
    fits: bool = False

    def row(self) -> str:
        gather = "exact" if self.gather == "exact" else "int8 (changes numerics)"
        reduce = "exact" if self.reduce == "exact" else f"{self.reduce} (changes numerics)"
        strategy = self.strategy + (f" + DiLoCo (H={self.sync_every})" if self.sync_every else "")
        return (f"| {self.wrap} | {strategy} | {self.limit_all_gathers} | {self.precision} | "
                f"{'yes' if self.checkpointing else 'no'} | {'yes' if self.offload else 'no'} | {gather} | {reduce} | "
                f"{self.peak / 2**20:.0f} | {self.sent_intra / 2**20:.1f} | "
                f"{self.sent_cross / 2**20:.1f} | {self.step_s:.3f} | {'yes' if self.fits else 'no'} |")


@dataclass
class Plan:
    """The chosen candidate, every candidate considered, and why."""

    chosen: Candidate
    candidates: list[Candidate]
    world_size: int
    memory_budget: int
    hardware: Hardware
    block: type | None  # the repeated block class ("blocks" wraps its instances)
    tp: int = 1  # tensor-parallel ranks: fullshard shards over world_size // tp

    def table(self) -> str:
        head = ("| wrap | strategy | limit | precision | checkpointing | offload | gathers | reductions | "
                "peak MiB/rank | sent in group MiB | sent across MiB | step s | fits |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        return head + "\n" + "\n".join(c.row() for c in self.candidates)

    def explain(self) -> str:
        c = self.chosen
        parts = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in c.memory.items() if v)  # parts, not all at once
        return (f"chosen: wrap={c.wrap}, strategy={c.strategy}, limit_all_gathers={c.limit_all_gathers}, "
                f"precision={c.precision}, checkpointing={'on' if c.checkpointing else 'off'}, "
                f"offload={'on' if c.offload else 'off'}"
                f"{', int8 gathers (they change numerics: Note [int8 gathers])' if c.gather == 'int8' else ''}"
                f"{f', gradients sent in {c.reduce} (Note [low-precision reductions])' if c.reduce != 'exact' else ''}"
                f"{f', Muon exchanging {c.sent_optimizer / 2**20:.1f} MiB' if c.sent_optimizer else ''}"
                f"{diloco_words(c)}: "
                f"the fastest predicted "
                f"step ({c.step_s:.3f} s on {self.hardware.name}) of the {sum(x.fits for x in self.candidates)} "
                f"candidates within {self.memory_budget / 2**20:.0f} MiB per rank; peak {c.peak / 2**20:.0f} MiB ({parts})")


def diloco_words(c: Candidate) -> str:
    if not c.sync_every:
        return ""
    return (f", the replica groups under DiLoCo syncing every {c.sync_every} steps (it changes training: shard "
            f"over mesh['shard'] and wrap the optimizer in fullshard.DiLoCo, docs/diloco.md)")


# ---- measuring the model on meta ----------------------------------------------------------


def repeated_block(model: nn.Module) -> type | None:
    """The class of the model's repeated blocks (GPT's Block, Llama's decoder layer, T5's
    block): the one a transformers model names in `_no_split_modules`; else, of the repeated
    classes with submodules holding at least half as many parameters as the largest such
    class, the most repeated, then the largest (a block, not its MLP or attention)."""
    instances: dict[type, list[int]] = {}
    for module in model.modules():
        if module is not model and next(module.children(), None) is not None \
                and not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            instances.setdefault(type(module), []).append(sum(p.numel() for p in module.parameters()))
    repeated = {cls: (len(n), sum(n)) for cls, n in instances.items() if len(n) >= 2 and sum(n)}
    declared = {cls: key for cls, key in repeated.items()  # a transformers model names its blocks
                if cls.__name__ in (getattr(model, "_no_split_modules", None) or ())}
    if declared:
        return max(declared, key=declared.get)
    largest = max((total for _, total in repeated.values()), default=0)
    blocks = {cls: key for cls, key in repeated.items() if 2 * key[1] >= largest}
    return max(blocks, key=blocks.get) if blocks else None


def example_inputs(model: nn.Module, batch: int, seq: int, device: torch.device) -> tuple[tuple, dict]:
    """Token ids (and targets), as a causal language model takes them; or what the model's own
    `example_inputs(batch, seq, device)` says it takes (a pipeline stage: gpt.GPTStage)."""
    if hasattr(model, "example_inputs"):
        return model.example_inputs(batch, seq, device)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    params = inspect.signature(model.forward).parameters
    if "input_ids" in params:
        return (), {"input_ids": ids, "labels": ids}
    return (ids, ids), {}


def activation_bytes(model: nn.Module, batch: int, seq: int, dtype: torch.dtype, block: type | None,
                     checkpointing: bool, device: str, tp: int = 1, tp_plan: dict | None = None) -> int:
    """Bytes autograd saves for backward in one forward of one rank's micro-batch (with
    checkpointing of each `block`: only the blocks' inputs and what is outside them), on
    one of `tp` tensor-parallel ranks: sequence parallelism splits what is saved over them,
    except what TP gathers whole (Note [planner]).

    The forward runs on fake tensors that claim to be on `device` (nothing is allocated),
    so kernels are chosen as on that device: attention saves what a flash kernel saves
    (inputs, output, log-sum-exp), not the math path's probabilities that meta tensors
    would pick. Where `device` is not available here (CUDA on a machine without GPUs)
    fake CPU tensors stand in: CPU's flash attention saves the same tensors as CUDA's.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    probe = copy.deepcopy(model)
    if checkpointing:
        recompute(probe, (block,))
    usable = device == "cpu" or (device == "cuda" and torch.cuda.is_available())  # else autograd aborts
    with FakeTensorMode():
        saved, whole = _saved_bytes(probe, batch, seq, dtype, torch.device(device if usable else "cpu"),
                                    gathered_modules(probe, tp_plan) if tp > 1 else {})
    return whole + (saved - whole) // tp


def gathered_modules(model: nn.Module, tp_plan: dict | None) -> dict[nn.Module, bool]:
    """The modules whose input tensor parallelism gathers whole (ColwiseParallel), each with
    whether it gathers its output whole too (output_layouts Replicate, e.g. a head's logits)."""
    from torch.distributed.tensor import Replicate  # noqa: PLC0415
    from torch.distributed.tensor.parallel import ColwiseParallel  # noqa: PLC0415

    styles = {module: style for module, style in tp_styles(model, tp_plan) if isinstance(style, ColwiseParallel)}
    return {module: isinstance(style.output_layouts[0], Replicate) for module, style in styles.items()}


def tp_styles(model: nn.Module, tp_plan: dict | None) -> list[tuple[nn.Module, object]]:
    """Each module of `model` a parallelize_module plan names (``*`` matches one name), with its style."""
    out = []
    for name, module in model.named_modules():
        parts = name.split(".")
        for pattern, style in (tp_plan or {}).items():
            keys = pattern.split(".")
            if len(keys) == len(parts) and all(fnmatch.fnmatchcase(n, k) for n, k in zip(parts, keys)):
                out.append((module, style))
                break
    return out


def _saved_bytes(probe: nn.Module, batch: int, seq: int, dtype: torch.dtype, device: torch.device,
                 gathered: dict[nn.Module, bool]) -> tuple[int, int]:
    """Run `probe`'s forward on empty tensors on `device`, counting the storages autograd saves;
    returns (all of them, those that TP keeps whole: inputs of `gathered` modules, and anything
    saved after one that gathers its output)."""
    for module in probe.modules():
        for key, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is None:
                continue
            kind = dtype if t.is_floating_point() else t.dtype
            new = torch.empty(t.shape, dtype=kind, device=device)
            if key in module._parameters:
                module._parameters[key] = nn.Parameter(new, requires_grad=t.requires_grad)
            else:
                module._buffers[key] = new
    params = {p.untyped_storage()._cdata for p in probe.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = storage.nbytes()
            if after_gathered_output:
                whole.add(storage._cdata)
        return t

    whole: set[int] = set()
    after_gathered_output = False  # e.g. the loss on a head's gathered logits: whole on every TP rank

    def note(module: nn.Module, inputs: tuple, output: object) -> None:
        nonlocal after_gathered_output
        after_gathered_output |= gathered[module]
        if isinstance(inputs[0], torch.Tensor):
            whole.add(inputs[0].untyped_storage()._cdata)

    hooks = [module.register_forward_hook(note) for module in gathered]
    args, kwargs = example_inputs(probe, batch, seq, device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        probe(*args, **kwargs)
    for hook in hooks:
        hook.remove()
    return sum(saved.values()), sum(nbytes for storage, nbytes in saved.items() if storage in whole)


# ---- the cost of a candidate ------------------------------------------------------------------


@dataclass(frozen=True)
class UnitShape:
    numel: int  # real parameter elements
    shards: list[torch.Size]  # each parameter's shape
    trainable: int  # parameters with requires_grad (each has a has-gradient flag)


def units_of_plan(model: nn.Module, wrap: str, block: type | None,
                  tp_shapes: dict[nn.Parameter, torch.Size]) -> list[UnitShape]:
    """The units shard_model would make, in forward order (the root first): each owns the
    parameters under it that no unit below it owns (tied ones go to the common ancestor).
    Shapes are a TP rank's parts where `tp_shapes` has them (Note [tensor parallel parameters])."""
    chosen = choose_units(model, {block} if wrap == "blocks" and block is not None else None)  # bottom-up
    shapes = [[tp_shapes.get(p, p.shape) for p in own] for _, _, own in reversed(chosen)]
    return [UnitShape(sum(math.prod(s) for s in shape), shape, sum(p.requires_grad for p in own))
            for shape, (_, _, own) in zip(shapes, reversed(chosen))]


def tp_local_shapes(model: nn.Module, tp: int, tp_plan: dict | None) -> dict[nn.Parameter, torch.Size]:
    """Each parameter's part on the first TP rank (which holds the most) under `tp_plan`, a
    parallelize_module plan over the whole model (``*`` matches one name): ColwiseParallel splits
    a Linear's output features (weight and bias) or an Embedding's features, RowwiseParallel a
    Linear's input features or an Embedding's rows; other styles split nothing."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: PLC0415

    if tp == 1 or not tp_plan:
        return {}
    out = {}
    for module, style in tp_styles(model, tp_plan):
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        colwise, embedding = isinstance(style, ColwiseParallel), isinstance(module, nn.Embedding)
        for key, param in module.named_parameters(recurse=False):
            dim = None if key == "bias" and not colwise else (1 if colwise == embedding else 0)
            if dim is not None and param.dim() > dim:
                shape = list(param.shape)
                shape[dim] = -(-shape[dim] // tp)
                out[param] = torch.Size(shape)
    return out


def cost(c: Candidate, units: list[UnitShape], *, world: int, acts: int, optimizer_states: float,
         hardware: Hardware, tokens: int, matrices: tuple[tuple[torch.Size, torch.Size], ...] = ()) -> Candidate:
    """Fill in `c`'s predicted memory, traffic and step time (Note [planner]). `matrices`:
    the (TP-local, whole) shapes of what Muon steps (Note [matrix optimizers]), whose exchange
    and Newton-Schulz iterations the optimizer step adds."""
    ranks_per_node = hardware.ranks_per_node
    F = {"full_shard": world, "shard_grad_op": world, "no_shard": 1,
         "hybrid_shard": math.gcd(world, ranks_per_node)}[c.strategy]
    R = world // F
    master, compute = 4, (2 if c.precision == "bf16" else 4)
    reduce_ = compute  # gradients are reduced in the compute dtype
    param_count = sum(u.numel for u in units)
    shard = [sum(shard_numel(s, F) for s in u.shards) for u in units]  # elements per rank
    rows = [n + u.trainable for n, u in zip(shard, units)]  # + has-gradient flags
    full = [F * n * compute for n in shard]  # a unit's full storage
    if c.gather == "int8":  # what a rank's shard of each unit takes on the wire, Note [int8 gathers]
        wire = [sum(quantized_bytes(shard_numel(s, F), BLOCK) if len(s) else compute for s in u.shards)
                for u in units]
    else:
        wire = [n * compute for n in shard]
    if c.reduce == "exact":  # what a rank sends each peer of each unit's reduce-scatter
        sent_rows = [r * reduce_ for r in rows]
    else:  # Note [low-precision reductions]
        send = torch.int8 if c.reduce == "int8" else torch.bfloat16
        sent_rows = [sent_bytes([shard_numel(s, F) for s in u.shards] + [u.trainable], send) for u in units]
    blocks = full[1:]  # the units below the root (none when the root is the only unit)
    big = max(blocks, default=0)
    S = sum(shard) * master
    separate_full = F > 1 or compute != master  # else the full parameters are the shards themselves
    keep_all = not STRATEGIES[c.strategy]["reshard_after_forward"]
    kept = (sum(full) if keep_all else full[0] + big) if separate_full else 0  # from forward to backward
    in_flight = min(len(blocks), c.limit_all_gathers)  # gathers issued ahead of the unit computing
    ahead = 0 if keep_all or not separate_full else in_flight * big
    staged = big // F if compute != master or c.offload else 0  # the shard cast or copied to the device
    # gathers in flight: the peers' rows and the staged shard
    pending = in_flight * (big * (F - 1) // F + staged) if separate_full and not keep_all else 0
    unit_grads = max(u.numel for u in units) * compute  # the first unit's full gradients in backward
    runtime = hardware.runtime[c.precision]
    # the peak is where backward starts (activations all alive) or where it ends (all gradients);
    # offloaded, shards, gradients and optimizer state are in host memory instead
    on_device = 0 if c.offload else 1
    backward_start = acts + kept + ahead + pending + unit_grads
    # Muon: a rank's bf16 rows of every matrix sent, its owned matrices received and whole
    # (the largest one's Newton-Schulz temporaries besides), their updates' rows sent back
    exchanged = sum(s.numel() for s, _ in matrices if len(s) == 2) if F > 1 else 0
    owned = sum(s.numel() for _, s in matrices) // F
    largest = max((s[-2:].numel() for _, s in matrices), default=0)
    step_buffers = 2 * 2 * exchanged // F + 2 * 2 * owned + 4 * 2 * largest if matrices else 0
    backward_end = on_device * S + kept + step_buffers
    c.memory = {"runtime": runtime, "shards": on_device * S, "optimizer": on_device * int(optimizer_states * S),
                "activations": acts, "full parameters": kept + ahead, "buffers": pending + unit_grads,
                "gradients": on_device * S, "optimizer step": step_buffers}
    # Note [peak margin]: on a CPU the process's peak resident memory, as `fullshard train`
    # reports it; on a GPU the allocator's peak (torch.cuda.max_memory_allocated), the runtime apart
    c.peak = (runtime if hardware.device == "cpu" else 0) + on_device * int((1 + optimizer_states) * S) + \
        max(backward_start, backward_end)
    c.host = (1 - on_device) * (2 + optimizer_states) * S
    # traffic: what fullshard.stats counts
    gathers = [1] + [1 if keep_all or i == len(units) - 1 else 2 for i in range(1, len(units))] \
        if len(units) > 1 else [1]
    c.sent_intra = sum(g * (F - 1) * w for g, w in zip(gathers, wire)) + \
        sum((F - 1) * r for r in sent_rows) if F > 1 else 0
    c.sent_cross = sum(2 * (R - 1) * r * reduce_ // R for r in rows) if R > 1 else 0
    c.collectives = (sum(gathers) + len(units) if F > 1 else 0) + (len(units) if R > 1 else 0)
    if c.sync_every:  # DiLoCo (docs/diloco.md): an all-gather of the fp32 outer gradients every H steps,
        # its anchors and outer momentum (fp32, as the shards) beside the model
        c.sent_cross = (R - 1) * (40 + 4 * sum(shard)) // c.sync_every  # a 40-byte header a sync
        c.collectives -= len(units)
        outer = 2 * S
        if hardware.device == "cpu":
            c.memory["outer state"] = outer
            c.peak += outer
        else:
            c.host += outer
    # each rank sends its rows of the other ranks' matrices and gets its rows of their updates, both bf16,
    # each of the two messages to a peer led by the step's 8-byte digest (Note [matrix identity])
    c.sent_optimizer = 2 * 2 * exchanged * (F - 1) // (F * F) + (2 * 8 * (F - 1) if exchanged else 0)
    flops = (8 if c.checkpointing else 6) * param_count * tokens
    # a probed CPU's plan is for ranks on that machine (as `fullshard train` starts them): more
    # ranks than its cores share them, each computing that much slower
    shared = max(1.0, world / hardware.cores) if hardware.cores else 1.0
    c.compute_s = compute_s = flops / hardware.flops[c.precision] * shared
    # a ring spanning nodes leaves each node once per ring, and there are as many rings as the
    # node has interfaces: a rank's bytes move at the node's network bandwidth, or NVLink's if
    # lower. Replicas of a hybrid shard group are a ring of one rank per node: every hop leaves.
    spanning_bw = min(hardware.intra_bw, ranks_per_node * hardware.cross_bw)
    group_bw = hardware.intra_bw if F <= ranks_per_node else spanning_bw
    replica_bw = hardware.intra_bw if world <= ranks_per_node else spanning_bw if F == 1 else hardware.cross_bw
    comm_s = (c.sent_intra / group_bw + (sum(gathers) + len(units)) * (F - 1) * hardware.latency if F > 1 else 0) + \
        (c.sent_cross / replica_bw + (R - 1) * hardware.latency * (len(units) * 2 if not c.sync_every else
                                                                   1 / c.sync_every) if R > 1 else 0)
    # Muon's step follows backward, overlapping nothing: Newton-Schulz in bf16 (5 iterations,
    # the matrices shared by the group's ranks) and the two all_to_alls
    muon_s = 5 * sum(newton_schulz_flops(s) for _, s in matrices) / F / \
        hardware.flops.get("bf16", hardware.flops[c.precision]) + \
        (c.sent_optimizer / group_bw + 2 * (F - 1) * hardware.latency if exchanged else 0)
    host_s, optimizer_s = 0.0, muon_s
    if c.offload:  # each gather copies a shard in, each reduce-scatter a gradient shard out; the host steps
        host_s = (sum(g * n * master for g, n in zip(gathers, shard)) + sum(r * reduce_ for r in rows)) / hardware.host_bw
        optimizer_s += sum(shard) / hardware.host_optimizer
    if hardware.overlap:  # all but the first gather and the last reduction hide behind compute
        c.step_s = max(compute_s, comm_s, host_s) + 2 * max(comm_s, host_s) / max(c.collectives, 1) + optimizer_s
    else:
        c.step_s = compute_s + comm_s + host_s + optimizer_s
    return c


# ---- measuring this machine, Note [runtime probe] ------------------------------------------

# Note [runtime probe]: besides tensors, a process holds memory that depends on the
# machine, not the model: Python, torch's and fullshard's code and data, library code paged
# in as kernels first run, oneDNN's JIT kernels and caches, allocator and autograd state. It
# differs by instruction set (on a CPU without AVX-512 bf16, oneDNN runs bf16 matmuls
# another way and a process holds ~14 MB less), so it is measured, not tabled: a fresh
# process trains a tiny GPT for 3 steps, and its peak resident memory (the whole process's,
# as the OS counts it, with freed memory returned as stats.return_freed_memory makes
# `fullshard train`'s ranks return it) minus what this planner counts for that GPT's tensors
# is the runtime term. So a CPU plan's peak is the peak `fullshard train` reports for the
# same run, less what the CLI holds beside (the text it trains on, which it adds itself). Compute differs likewise (bf16 matmuls run ~100x slower without
# AVX-512 bf16), so the same process times one large matmul, and a step's FLOP/s are a
# fixed share of that rate. The probe runs once per process and precision, on rank 0 when
# a process group is up (every rank must plan alike), in ~3-5 s. GPU figures stay on
# paper: a GPU's runtime is mostly its CUDA context and NCCL's buffers, which no
# allocator statistic of a probe process shows.

PROBE_CONFIG = GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=64)
PROBE_BATCH = 2
# A CPU training step sustains this share of one large matmul's rate, by precision (fitted
# on the machine of docs/planner.md's table: a bf16 step spends more of its time outside
# the matmuls, in casts and elementwise kernels that bf16 does not speed up), so the probe's
# matmul times give the step's FLOP/s on any CPU
CPU_STEP_EFFICIENCY = {"fp32": 0.57, "bf16": 0.27}


@dataclass(frozen=True)
class Probe:
    """What one precision costs on this machine besides the planner's tensors."""

    runtime: int  # bytes
    flops: float  # one large matmul's FLOP/s, one thread


def probe(precision: str) -> str:
    """In a fresh process: the peak resident memory of 3 AdamW steps of the probe GPT sharded
    per block in `precision`, the whole process's (Python, torch and fullshard included, freed
    memory returned as `fullshard train` returns it), then the rate of one large matmul; as
    "bytes flops"."""
    return_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # nothing listens
    x = torch.randint(0, PROBE_CONFIG.vocab_size, (PROBE_BATCH, PROBE_CONFIG.block_size + 1))
    with torch.device("meta"):
        model = GPT(PROBE_CONFIG)
    # a process that plans keeps the code planning paged in (fake tensors' kernels: ~11 MiB in
    # a fresh process, of which the probe's training pages in all but ~3): `fullshard train
    # --plan auto` and apply_plan's scripts plan where they train
    plan(model, world_size=1, memory_budget=2**60, batch=PROBE_BATCH, seq=PROBE_CONFIG.block_size, hardware="a100")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else None
    shard_model(model, wrap={type(model.h[0])}, mp_policy=mp, forward_prefetch=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        model(x[:, :-1], x[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    peak = process_memory("VmHWM")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = torch.randn(512, 384, dtype=dtype), torch.randn(384, 1536, dtype=dtype)
    seconds: list[float] = []
    while len(seconds) < 3 or len(seconds) < 10 and sum(seconds) < 0.3:  # the fastest of a few: the rate the
        start = time.perf_counter()                                      # kernel sustains, not a preemption
        a @ b
        seconds.append(time.perf_counter() - start)
    return f"{peak} {2 * a.size(0) * a.size(1) * b.size(1) / min(seconds[1:])}"


_probed: dict[str, Probe] = {}  # precision -> its probe, for this process


def measured(precisions: tuple[str, ...]) -> list[Probe]:
    """This machine's probe of each precision (Note [runtime probe]), run once per process."""
    missing = tuple(prec for prec in precisions if prec not in _probed)
    if missing:
        _probed.update(zip(missing, _run_probes(missing)))
    return [_probed[prec] for prec in precisions]


def _run_probes(precisions: tuple[str, ...]) -> list[Probe]:
    """Probe each precision in its own fresh process (at once); subtract the probe GPT's tensors."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", f"from fullshard.planner import probe; print(probe({prec!r}))"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for prec in precisions]
    with torch.device("meta"):
        model = GPT(PROBE_CONFIG)
    units = units_of_plan(model, "blocks", type(model.h[0]), {})
    probes = []
    for prec, run in zip(precisions, runs):
        stdout, stderr = run.communicate(timeout=600)
        if run.returncode != 0:
            raise fail(f"the planner's probe of this machine ({prec}) failed: "
                       f"{(stderr.strip().splitlines() or ['no output'])[-1]}",
                       "Plan for hardware that is not this machine (hardware='a100', 'h100' or a Hardware of "
                       "another device), or report this as a bug.")
        peak, flops = stdout.split()[-2:]
        tensors = Candidate("blocks", "full_shard", 2, prec, False)
        acts = activation_bytes(model, PROBE_BATCH, PROBE_CONFIG.block_size,
                                torch.bfloat16 if prec == "bf16" else torch.float32, None, False, "cpu")
        cost(tensors, units, world=1, acts=acts, optimizer_states=2, tokens=0,
             hardware=dataclasses.replace(HARDWARE["cpu"], runtime={prec: 0}))
        probes.append(Probe(max(0, int(peak) - tensors.peak), float(flops)))
    return probes


def calibrated(hw: Hardware, precisions: tuple[str, ...]) -> Hardware:
    """`hw` with the runtime bytes and FLOP/s the probe measures here, when it is a CPU; every
    rank of a process group takes rank 0's figures, so that all plan alike (Note [runtime probe])."""
    if hw.device != "cpu":
        return hw
    ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    probes = measured(precisions) if not ranks or dist.get_rank() == 0 else [Probe(0, 0.0)] * len(precisions)
    figures = [(float(p.runtime), p.flops) for p in probes]
    if ranks:
        nccl = dist.get_backend() == "nccl"
        agreed = torch.tensor(figures, dtype=torch.float64,  # [precision, (bytes, flops)]; bytes < 2**53: exact
                              device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
        broadcast_from_rank0([agreed])
        figures = agreed.tolist()
    runtime = {prec: int(nbytes) for prec, (nbytes, _) in zip(precisions, figures)}
    flops = {prec: rate * CPU_STEP_EFFICIENCY[prec] for prec, (_, rate) in zip(precisions, figures)}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return dataclasses.replace(hw, runtime={**hw.runtime, **runtime}, flops={**hw.flops, **flops}, cores=cores)

def plan(model: nn.Module, *, world_size: int, memory_budget: int | float, batch: int, seq: int,
         optimizer: str = "adamw", hardware: str | Hardware = "cpu", precisions: tuple[str, ...] = ("fp32", "bf16"),
         strategies: tuple[str, ...] | None = None, tp: int = 1, tp_plan: dict | None = None,
         sync_every: int | None = None) -> Plan:
    """Predict, for every candidate sharding, the per-rank peak memory, the bytes sent per step
    and the step time, and choose the fastest that fits `memory_budget`.

    Nothing is allocated: `model` must be built on the meta device. Candidates combine wrap
    granularity (each repeated block or the whole model), strategy, ``limit_all_gathers``
    (1 or 2), compute precision, activation checkpointing of each block and, on GPUs, CPU
    offload (``memory_budget`` is then device memory; ``Candidate.host`` the host memory).

    Args:
        model: a meta-device model (``with torch.device("meta"): model = Net()``).
        world_size: ranks the job will run on.
        memory_budget: bytes per rank the peak must stay within. The peak is the one `fullshard
            train` reports: on a CPU the process's peak resident memory as the OS counts it
            (Python, torch and fullshard included, freed memory returned as
            ``return_freed_memory`` (fullshard/accounting.py) makes train's ranks return it; the text
            train holds beside is the CLI's to add), which must fit with a 10% margin (Note
            [peak margin]); on a GPU the allocator's peak (``torch.cuda.max_memory_allocated``),
            which must fit with the hardware's runtime (CUDA context, NCCL) added.
        batch: sequences per rank per micro-batch.
        seq: tokens per sequence.
        optimizer: ``"adamw"`` (2 states per parameter), ``"sgd"`` (momentum: 1), ``"muon"``
            (fullshard.optim.Muon on ``muon_groups``' matrices, 1 state, AdamW's 2 for the rest;
            its exchange's bytes in ``Candidate.sent_optimizer``, its Newton-Schulz FLOPs and
            buffers in the step and the peak) or ``"none"``.
        hardware: ``"cpu"``, ``"a100"``, ``"h100"`` or a :class:`Hardware`.
        precisions: compute precisions to consider.
        strategies: strategies to consider (default: all that apply to the world size).
        tp: tensor-parallel ranks (2-D parallelism, docs/composition.md): fullshard shards over
            the ``world_size // tp`` data-parallel ranks, whose groups sit inside nodes of
            ``ranks_per_node // tp`` of them; memory and bytes are a TP rank's.
        tp_plan: with ``tp`` > 1, the ``parallelize_module`` plan, keyed by names in `model`
            (``"layers.*.attention.wq"``), that says which parameters TP splits.
        sync_every: also price hybrid sharding's replica groups under fullshard.DiLoCo, syncing
            every this many steps (docs/diloco.md): chosen, as it changes training, only when
            its step is at least INT8_GAIN times faster than every synchronous one's (a step
            bound by the link between nodes).

    Returns:
        A :class:`Plan`: ``chosen``, ``candidates`` (``table()``), ``explain()``.

    Raises:
        FullShardError: on a model that is not on meta, bad arguments, or a budget nothing
            fits (saying the smallest peak any candidate needs).
    """
    require(all(p.is_meta for p in model.parameters()), "plan() needs a model built on the meta device",
            "Build it under `with torch.device('meta'):`; nothing is allocated while planning.")
    require(isinstance(world_size, int) and world_size >= 1, f"world_size={world_size!r} must be a positive int",
            "Pass the number of ranks, e.g. 8.")
    require(isinstance(memory_budget, (int, float)) and memory_budget > 0,
            f"memory_budget={memory_budget!r} must be a positive number of bytes", "Pass e.g. 2 * 2**30.")
    require(optimizer in ("adamw", "sgd", "muon", "none"), f"optimizer={optimizer!r} is not one of adamw, sgd, "
            "muon, none",
            "Pass the optimizer kind whose state you will keep.")
    hw = HARDWARE.get(hardware) if isinstance(hardware, str) else hardware
    require(isinstance(hw, Hardware), f"hardware={hardware!r} is unknown", f"Pass one of {sorted(HARDWARE)}.")
    require(all(prec in ("fp32", "bf16") for prec in precisions), f"precisions={precisions!r}: the planner "
            "considers fp32 and bf16", "Pass a subset of ('fp32', 'bf16').")
    require(isinstance(tp, int) and tp >= 1 and world_size % tp == 0, f"tp={tp!r} must be a positive int that "
            f"divides world_size={world_size}", "Pass the tensor-parallel degree, e.g. 2 or 8.")
    require(tp == 1 or isinstance(tp_plan, dict) and tp_plan, f"tp={tp} needs tp_plan, the parallelize_module "
            "plan over the model", 'Pass e.g. {"layers.*.attention.wq": ColwiseParallel(), ...}.')
    require(sync_every is None or type(sync_every) is int and sync_every >= 1, f"sync_every={sync_every!r} must be "
            "an int of at least 1", "Pass how many steps DiLoCo's replica groups train between syncs, e.g. 50.")
    hw = calibrated(hw, tuple(precisions))
    if tp > 1:  # TP stays inside a node; each data-parallel group has ranks_per_node // tp ranks there
        hw = dataclasses.replace(hw, ranks_per_node=max(1, hw.ranks_per_node // tp))
    dp_world = world_size // tp
    require(strategies is None or all(s in STRATEGIES for s in strategies), f"strategies={strategies!r} names "
            "an unknown strategy", f"Pass a subset of {tuple(STRATEGIES)}.")
    block = repeated_block(model)
    if strategies is None:
        strategies = ("full_shard", "shard_grad_op", "no_shard") + (
            ("hybrid_shard",) if 1 < hw.ranks_per_node < dp_world and dp_world % hw.ranks_per_node == 0 else ())
    wraps = ("blocks", "none") if block is not None else ("none",)
    tp_shapes = tp_local_shapes(model, tp, tp_plan)
    shapes = {wrap: units_of_plan(model, wrap, block, tp_shapes) for wrap in wraps}
    acts: dict[tuple[str, bool], int] = {}
    for prec in precisions:
        dtype = torch.bfloat16 if prec == "bf16" else torch.float32
        acts[(prec, False)] = activation_bytes(model, batch, seq, dtype, block, False, hw.device, tp, tp_plan)
        if block is not None:  # backward recomputes one block at a time: its activations, and the
            # gradients flowing back through them (as large), come on top of the blocks' inputs
            kept = activation_bytes(model, batch, seq, dtype, block, True, hw.device, tp, tp_plan)
            blocks = sum(type(m) is block for m in model.modules())
            acts[(prec, True)] = kept + 2 * (acts[(prec, False)] - kept) // blocks
    states, matrices = {"adamw": 2, "sgd": 1, "none": 0}.get(optimizer, 2), ()
    if optimizer == "muon":  # one momentum buffer per matrix element, AdamW's two for the rest (muon_groups)
        hidden, rest = muon_groups(model)
        matrices = tuple((tp_shapes.get(p, p.shape), p.shape) for p in hidden)
        counts = sum(p.numel() for p in hidden), sum(p.numel() for p in rest)
        states = (counts[0] + 2 * counts[1]) / max(sum(counts), 1)
    offloads = (False, True) if hw.host_bw else (False,)  # a CPU rank's memory is host memory already
    candidates = []
    syncs = (0,) if sync_every is None else (0, sync_every)
    for wrap, strategy, limit, (prec, ck), offload, gather, reduce, every in itertools.product(
            wraps, strategies, (1, 2), acts, offloads, ("exact", "int8"), ("exact", "bf16", "int8"), syncs):
        if reduce == "bf16" and prec == "bf16" or reduce != "exact" and strategy == "no_shard":
            continue  # sends what an exact reduction sends (no_shard's all-reduce sends the reduce dtype)
        if every and (strategy != "hybrid_shard" or reduce != "exact"):
            continue  # DiLoCo's replica groups are hybrid sharding's; nothing crosses them each step
        c = Candidate(wrap, strategy, limit, prec, ck, offload, gather, reduce, sync_every=every)
        cost(c, shapes[wrap], world=dp_world, acts=acts[(prec, ck)], optimizer_states=states, hardware=hw,
             tokens=batch * seq, matrices=matrices)
        c.fits = needed(c, hw) <= memory_budget and c.host <= hw.host_memory
        candidates.append(c)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = min((c for c in candidates if c.host <= hw.host_memory), key=lambda c: c.peak)
        raise fail(f"no sharding of this model fits {in_bytes(memory_budget)} per rank at world size "
                   f"{world_size} (batch {batch} x {seq}); the smallest peak is {in_bytes(least.peak)} "
                   f"(wrap={least.wrap}, {least.strategy}, {least.precision}, checkpointing "
                   f"{'on' if least.checkpointing else 'off'}, offload {'on' if least.offload else 'off'})",
                   f"Give each rank at least {in_bytes(needed(least, hw))}, use more ranks, or a smaller batch.")
    # quantized gathers and reductions, and DiLoCo, change numerics: chosen only when nothing exact
    # fits, or when they make the step at least INT8_GAIN times faster (a step bound by the network)
    fastest = min(fitting, key=lambda c: (c.step_s, c.peak))
    exact = [c for c in fitting if c.gather == c.reduce == "exact" and not c.sync_every]
    chosen = fastest if not exact or fastest.step_s * INT8_GAIN <= min(c.step_s for c in exact) else \
        min(exact, key=lambda c: (c.step_s, c.peak))
    return Plan(chosen, candidates, world_size, int(memory_budget), hw, block, tp)


def apply_plan(model: nn.Module, plan: Plan, *, mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard `model` (built like the planned one) as the plan chose: activation checkpointing of
    each block if chosen, then shard_model with its wrap, strategy, limit and precision.
    `mesh`: as shard_model's; a plan with ``tp`` > 1 needs the data-parallel dims of the mesh
    whose TP dim the model was parallelized over."""
    c = plan.chosen
    require(not c.sync_every, f"this plan trains replica groups under DiLoCo (sync_every={c.sync_every}), which "
            "apply_plan cannot set up: the optimizer is yours", "Shard the model over mesh['shard'] of a (replicate, "
            "shard) mesh with the plan's settings and wrap your optimizer: fullshard.DiLoCo(model, optimizer, "
            "mesh['replicate'], sync_every=...) (docs/diloco.md).")
    require(plan.tp == 1 or mesh is not None, f"this plan is for {plan.tp} tensor-parallel ranks; apply_plan "
            "needs the data-parallel mesh", 'Pass mesh=mesh_2d["dp"] (after parallelize_module(model, '
            'mesh_2d["tp"], plan)).')
    low = torch.bfloat16 if c.precision == "bf16" else None
    gather = torch.int8 if c.gather == "int8" else None
    send = {"bf16": torch.bfloat16, "int8": torch.int8}.get(c.reduce)
    mp = MixedPrecisionPolicy(param_dtype=low, gather_dtype=gather, reduce_send_dtype=send) \
        if low or gather or send else None
    return shard_model(model, wrap={plan.block} if c.wrap == "blocks" else None, strategy=c.strategy,
                       mp_policy=mp, offload_policy=CPUOffloadPolicy() if c.offload else None,
                       limit_all_gathers=c.limit_all_gathers, forward_prefetch=True, mesh=mesh,
                       checkpoint={plan.block} if c.checkpointing and plan.block is not None else False)
