"""torch.distributed.pipelining's schedules driving fullshard stages (Note [pipeline stages] in
fullshard/stage_state.py): every schedule torch ships, one and several stages per rank, with
fullshard's fully_shard and with torch's under replace_fsdp2(); dp, TP and HSDP inside the
stages; a Hugging Face Llama split the torchtitan way; clipping, Muon, low-precision
reductions, activation checkpointing, meta init and checkpoints across pipeline sizes. The
reference is one process training the whole model on the whole global batch; FSDP2 runs the
same script alongside where its own gradients are right, and the two must agree bitwise."""

from __future__ import annotations

import ast
import inspect
import math
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import fullshard
from fullshard import stage_state
from tests.models import SEQ, VOCAB, named_mesh
from tests.test_errors import raises
from tests.world import World

WIDTH, BLOCKS, MICROBATCHES, BATCH, STEPS = 16, 4, 4, 8, 3
LR, MUON_LR, ADAMW_LR, MAX_NORM = 0.1, 0.02, 3e-3, 0.2
# schedule -> where a rank's stages are: one per rank, "loop" (rank r: r, r + pp), "v" (r, 2 pp - 1 - r)
SCHEDULES = {"ScheduleGPipe": None, "Schedule1F1B": None, "ScheduleLoopedBFS": "loop",
             "ScheduleInterleaved1F1B": "loop", "ScheduleInterleavedZeroBubble": "loop",
             "ScheduleZBVZeroBubble": "v", "ScheduleDualPipeV": "v"}
# the schedules whose backward is split in two (inputs, then weights): with FSDP2 their weights'
# gradients come out wrong (it shows the shards where the weight pass looks for the weights,
# Note [shown parameters] in fullshard/unit.py), so there fullshard is compared with one process only
SPLIT_BACKWARD = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
# pp x the data-parallel dims inside a stage: (mesh shape, dim names, the dims fully_shard takes)
MESHES = {"dp": ((2, 2), ("pp", "dp"), ("dp",)), "tp": ((2, 1, 2), ("pp", "dp", "tp"), ("dp",)),
          "hsdp": ((2, 2, 2), ("pp", "replicate", "shard"), ("replicate", "shard"))}
# fp32: the pipeline sums each weight's gradient over 4 microbatches and the dp ranks where one
# process sums the rows at once, so the two differ by the rounding of a few regrouped
# additions (SGD_TOL's argument in tests/reference.py); 3 steps of lr 0.1 keep it within 1e-6
TOL = 1e-6


def block(index: int) -> nn.Sequential:
    torch.manual_seed(index)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())


class Chain(nn.Module):
    """BLOCKS blocks, block i seeded by i. A pipeline stage is a Chain of some of them, the
    torchtitan way: the others taken out, so the parameters keep the whole model's names."""

    def __init__(self, keep=range(BLOCKS), checkpointed: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): block(i) for i in keep})
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return x

    def initializer(self) -> Callable[[nn.Module], None]:
        """shard_model's param_init_fn for this Chain built on meta: each module's values as
        construction gives them (a block's first Linear seeds the block, as block() does)."""
        seeds = {layer[0]: int(name) for name, layer in self.layers.items()}

        def initialize(module: nn.Module) -> None:
            if module in seeds:
                torch.manual_seed(seeds[module])
            if isinstance(module, nn.Linear):
                module.reset_parameters()

        return initialize


def llama_stage(layers: range) -> nn.Module:
    """A stage of a Hugging Face Llama of BLOCKS decoder layers, the torchtitan way: the whole
    model built with one seed (so every stage's values are the whole model's), the layers and
    ends of the other stages taken out, its parameter names the whole model's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class LlamaStage(LlamaForCausalLM):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inner = self.model
            hidden = inner.embed_tokens(x) if inner.embed_tokens is not None else x
            positions = torch.arange(hidden.shape[1]).unsqueeze(0)
            rope = inner.rotary_emb(hidden, position_ids=positions)
            for layer in inner.layers.values():  # causal attention (no mask given)
                hidden = layer(hidden, attention_mask=None, position_embeddings=rope, position_ids=positions)
            return hidden if self.lm_head is None else self.lm_head(inner.norm(hidden))

    torch.manual_seed(0)
    stage = LlamaStage(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=BLOCKS,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False))
    inner = stage.model
    inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layers})
    if layers.start > 0:
        inner.embed_tokens = None
    if layers.stop < BLOCKS:
        inner.norm = stage.lm_head = None
    return stage


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def next_token(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


# model -> (a stage of the given blocks, its unit classes, its loss)
MODELS = {"chain": (lambda keep, checkpointed=False: Chain(keep, checkpointed), nn.Sequential, mse),
          "llama": (lambda keep, checkpointed=False: llama_stage(keep), "LlamaDecoderLayer", next_token)}


def batches(dp_index: int, dp_size: int, model: str = "chain") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A data-parallel rank's (inputs, targets) of each step: its slice of the global batch."""
    generator = torch.Generator().manual_seed(0)
    if model == "llama":
        tokens = [torch.randint(0, VOCAB, (BATCH * dp_size, SEQ + 1), generator=generator) for _ in range(STEPS)]
        # contiguous: torch 2.10's stages check each microbatch's strides against the shapes they expect
        whole = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    else:
        whole = [(torch.randn(BATCH * dp_size, WIDTH, generator=generator),
                  torch.randn(BATCH * dp_size, WIDTH, generator=generator)) for _ in range(STEPS)]
    return [(x.chunk(dp_size)[dp_index], y.chunk(dp_size)[dp_index]) for x, y in whole]


def stage_indices(layout: str | None, pp: int, pp_rank: int) -> list[int]:
    if layout is None:
        return [pp_rank]
    return [pp_rank, pp_rank + pp] if layout == "loop" else [pp_rank, 2 * pp - 1 - pp_rank]


def sharder(impl: str) -> Callable:
    """fully_shard as `impl` says: fullshard's, torch's under replace_fsdp2(), or torch's own."""
    if impl == "fullshard":
        return fullshard.fully_shard
    from torch.distributed.fsdp import fully_shard  # at call time: replace_fsdp2 may have rebound it

    return fully_shard


def tensor_parallel(stage: Chain, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in stage.layers.values():
        parallelize_module(layer, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def optimizer_for(name: str, params: list[nn.Parameter], muon) -> list[torch.optim.Optimizer]:
    """SGD, or Muon for the matrices and AdamW for the rest (`muon`: fullshard's or torch's)."""
    if name == "sgd":
        return [torch.optim.SGD(params, lr=LR)]
    matrices, rest = [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]
    if muon is fullshard.optim.Muon:
        return [muon([{"params": matrices}, {"params": rest, "use_muon": False, "lr": ADAMW_LR,
                                             "weight_decay": 0.0}], lr=MUON_LR)]
    return [muon(matrices, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.0)]


def pipeline_job(schedule: str = "Schedule1F1B", impl: str = "fullshard", mesh: str = "dp", optimizer: str = "sgd",
                 clip: bool = False, reduce: str = "exact", checkpointed: bool = False, meta: bool = False,
                 model: str = "chain", poison: bool = False) -> dict:
    """STEPS steps of `model` in a pipeline of 2 ranks times the data-parallel (and TP) ranks
    of `mesh` under `schedule`, each block and each stage a unit: the last stage's losses, the
    norm clipping saw, and every stage's full parameters by name. `poison`: one gradient of
    stage 0 on one rank becomes NaN after each schedule step."""
    from torch.distributed.pipelining import PipelineStage, schedules

    shape, names, dp_names = MESHES[mesh]
    device_mesh = named_mesh(shape, names)
    dp_mesh = device_mesh[dp_names] if len(dp_names) > 1 else device_mesh[dp_names[0]]
    dp_size = dp_mesh.size()
    dp_index = dp_mesh.get_local_rank() if dp_mesh.ndim == 1 else \
        dp_mesh.get_local_rank(0) * dp_mesh.size(1) + dp_mesh.get_local_rank(1)
    make_stage, unit_class, loss_fn = MODELS[model]
    layout = SCHEDULES[schedule]
    indices = stage_indices(layout, 2, device_mesh["pp"].get_local_rank())
    n_stages = 2 * len(indices)
    per_stage = BLOCKS // n_stages
    mp = fullshard.MixedPrecisionPolicy(reduce_send_dtype=torch.bfloat16) if reduce == "bf16" else None
    replacing = fullshard.replace_fsdp2() if impl == "replace_fsdp2" else None
    try:
        shard = sharder(impl)
        stages, runners = [], []
        for index in indices:
            keep = range(index * per_stage, (index + 1) * per_stage)
            with torch.device("meta" if meta else "cpu"):
                stage = make_stage(keep, checkpointed)
            if mesh == "tp":
                tensor_parallel(stage, device_mesh["tp"])
            options = {"mesh": dp_mesh, **({"mp_policy": mp} if mp is not None else {})}
            if meta:  # materialized block by block while sharding, each block's values as built eagerly
                fullshard.shard_model(stage, wrap={nn.Sequential}, param_init_fn=stage.initializer(), **options)
            else:
                for layer in [m for m in stage.modules() if type(m).__name__ == unit_class or type(m) is unit_class]:
                    shard(layer, **options)
                shard(stage, **options)
            stages.append(stage)
            runners.append(PipelineStage(stage, index, n_stages, torch.device("cpu"),
                                         group=device_mesh["pp"].get_group()))
        runner = getattr(schedules, schedule)(runners if layout else runners[0], n_microbatches=MICROBATCHES,
                                              loss_fn=loss_fn)
        params = [p for stage in stages for p in stage.parameters()]
        optimizers = optimizer_for(optimizer, params, fullshard.optim.Muon)
        losses, norms = [], []
        for step, (inputs, targets) in enumerate(batches(dp_index, dp_size, model)):
            step_losses: list[torch.Tensor] = []
            last = {"target": targets, "losses": step_losses} if n_stages - 1 in indices else {}
            runner.step(inputs, **last) if 0 in indices else runner.step(**last)
            if poison and indices[0] == 0 and dp_index == 0:
                next(stages[0].parameters()).grad.to_local().view(-1)[0] = float("nan")
            if clip:  # one norm over every stage of every rank
                norms.append(fullshard.clip_grad_norm_(nn.ModuleList(stages), MAX_NORM).item())
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
            if step_losses:
                losses.append(torch.stack(step_losses).mean().item())
            if step == 0 and impl != "fsdp2":  # the first step's shape inference (torch's) runs a
                for stage in stages:  # forward and backward of its own: count from the second
                    fullshard.stats(stage).reset()
    finally:
        if replacing is not None:
            replacing.restore()
    reductions = {name: counts.get("reduce_scatters", 0) for stage in stages if impl != "fsdp2"
                  for name, counts in fullshard.stats(stage).per_unit.items()}
    return {"losses": losses, "norms": norms, "dp_index": dp_index, "reductions": reductions,
            "params": {name: p.full_tensor().detach() for stage in stages for name, p in stage.named_parameters()}}


def reference(optimizer: str = "sgd", clip: bool = False, dp_size: int = 2, microbatched: bool = False,
              model: str = "chain") -> dict:
    """One process, the whole Chain on the whole global batch: each data-parallel rank's loss,
    the norm clipping saw, and the parameters after STEPS steps. `microbatched`: the gradient
    summed as the pipeline sums it (each rank's microbatches in turn, then the ranks, then
    divided by the ranks and the microbatches), for optimizers whose steps amplify roundings."""
    make_stage, _, loss_fn = MODELS[model]
    whole = make_stage(range(BLOCKS))
    params = list(whole.parameters())
    optimizers = optimizer_for(optimizer, params, torch.optim.Muon)
    losses, norms = [], []
    for parts in zip(*(batches(i, dp_size, model) for i in range(dp_size))):
        per_rank = [loss_fn(whole(x), y) for x, y in parts]
        if microbatched:
            sums, per_rank = [], []
            for x, y in parts:
                grads, microbatch_losses = None, []
                for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
                    microbatch_losses.append(loss_fn(whole(xm), ym))
                    got = torch.autograd.grad(microbatch_losses[-1], params)
                    grads = list(got) if grads is None else [a.add_(b) for a, b in zip(grads, got)]
                sums.append(grads)
                per_rank.append(torch.stack(microbatch_losses).mean())  # as the pipeline's losses are reported
            for p, *ranks in zip(params, *sums):
                p.grad = sum(ranks[1:], ranks[0]).div_(dp_size).div_(MICROBATCHES)
        else:
            (sum(per_rank) / dp_size).backward()  # the mean of equal-sized slices: the global batch's mean
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append([t.item() for t in per_rank])
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in whole.named_parameters()}}


def merged(results: list[dict]) -> dict:
    """Every parameter (the same on every rank holding its stage: checked), each data-parallel
    rank's losses, and the norms (the same on every rank: checked)."""
    params, losses, norms = {}, {}, results[0]["norms"]
    for got in results:
        for name, tensor in got["params"].items():
            assert name not in params or torch.equal(params[name], tensor), name
            params[name] = tensor
        if got["losses"]:
            losses[got["dp_index"]] = got["losses"]
        assert got["norms"] == norms
    return {"params": params, "losses": losses, "norms": norms}


def assert_like_one_process(got: dict, want: dict, tol: float) -> None:
    assert got["params"].keys() == want["params"].keys()
    for name, expected in want["params"].items():
        torch.testing.assert_close(got["params"][name], expected, rtol=0, atol=tol, msg=name)
    assert got["losses"]
    for dp_index, losses in got["losses"].items():
        for loss, expected in zip(losses, want["losses"]):
            assert abs(loss - expected[dp_index]) <= tol, (dp_index, losses, want["losses"])
    for norm, expected in zip(got["norms"], want["norms"]):
        assert abs(norm - expected) <= tol * max(1.0, expected), (got["norms"], want["norms"])


def assert_bitwise(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][name], b["params"][name]) for name in a["params"])


# torch 2.10's V-shaped schedules fail over gloo in torch's own code, with FSDP2's stages too: the
# first step's warm-up of a rank's neighbours sends from one of its stages to the other, and gloo
# has no connection to the rank itself ("Pair is not connected"), or waits for the group's
# timeout; 2.12 and 2.13 run them (2.11 not tried)
OLD_V = torch.__version__ < (2, 12)  # TorchVersion compares with tuples


@pytest.mark.parametrize("schedule", [pytest.param(s, marks=pytest.mark.skipif(
    OLD_V and SCHEDULES[s] == "v", reason=f"torch {torch.__version__}'s V-shaped schedules fail over gloo before any "
                                          "fullshard code runs (docs/composition.md)")) for s in SCHEDULES])
def test_every_schedule_runs_fullshard_stages_like_one_process(world4, schedule):
    want = reference()
    results = world4.run(pipeline_job, schedule=schedule)
    for got in results:  # the microbatches' gradients stay unreduced: each block reduces once a step
        assert {count for name, count in got["reductions"].items() if name != "<root>"} == {STEPS - 1}, got
        assert got["reductions"]["<root>"] == 0  # a stage's root owns no parameter here
    ours = merged(results)
    assert_like_one_process(ours, want, TOL)
    # torch's fully_shard under replace_fsdp2 is fullshard's: the same bits
    assert_bitwise(merged(world4.run(pipeline_job, schedule=schedule, impl="replace_fsdp2")), ours)
    if schedule not in SPLIT_BACKWARD:  # FSDP2's order of operations on 2 dp ranks
        assert_bitwise(merged(world4.run(pipeline_job, schedule=schedule, impl="fsdp2")), ours)


def test_tensor_parallel_inside_a_stage_is_fsdp2_bitwise(world4):
    # pp 2 x dp 1 x tp 2: Colwise then Rowwise in each block, on each stage's tp ranks
    ours = merged(world4.run(pipeline_job, mesh="tp"))
    assert_like_one_process(ours, reference(dp_size=1), TOL)
    assert_bitwise(merged(world4.run(pipeline_job, mesh="tp", impl="fsdp2")), ours)


def test_a_hugging_face_llama_in_two_stages_trains_like_one_process_and_fsdp2(world4):
    # each stage keeps its decoder layers (and the embedding or the norm and head), the torchtitan way
    ours = merged(world4.run(pipeline_job, model="llama"))
    assert_like_one_process(ours, reference(model="llama"), TOL)
    assert_bitwise(merged(world4.run(pipeline_job, model="llama", impl="fsdp2")), ours)


def test_hybrid_sharding_inside_a_stage_trains_like_one_process():
    # pp 2 x (2 replicas x 2 shards): 8 ranks, each stage's 4 data-parallel ranks on its 2-D mesh
    with World(8, forked=True) as world:
        ours = merged(world.run(pipeline_job, mesh="hsdp"))
        theirs = merged(world.run(pipeline_job, mesh="hsdp", impl="fsdp2"))
    assert_like_one_process(ours, reference(dp_size=4), TOL)
    # 4 data-parallel ranks: FSDP2 sums each reduce-scatter and all-reduce in gloo's order,
    # fullshard in rank order (Note [replica sums]), so the last bits may differ
    assert_like_one_process(theirs, reference(dp_size=4), TOL)


def test_clipping_muon_low_precision_checkpointing_and_meta_init_compose(world4):
    # clip_grad_norm_ over every stage: one norm, the same on every rank, the whole model's
    clipped = merged(world4.run(pipeline_job, schedule="ScheduleInterleaved1F1B", clip=True))
    assert_like_one_process(clipped, reference(clip=True), TOL)
    assert len(clipped["norms"]) == STEPS and clipped["norms"][0] > MAX_NORM  # it clipped
    # a NaN in one stage's gradient on one rank: every rank's norm says so (docs/composition.md's
    # way to skip a whole pipeline step)
    for got in world4.run(pipeline_job, clip=True, poison=True):
        assert len(got["norms"]) == STEPS and all(math.isnan(norm) for norm in got["norms"]), got["norms"]
    # fullshard.optim.Muon over a rank's stages (AdamW for the biases): torch.optim.Muon's steps
    # on the gradients the pipeline sums, bitwise (Newton-Schulz in bf16 would turn a regrouped
    # sum's last bits into bf16 roundings of the step)
    assert_like_one_process(merged(world4.run(pipeline_job, optimizer="muon")),
                            reference("muon", microbatched=True), 0.0)
    # activation checkpointing and a meta-built stage: the same bits as the plain run
    plain = merged(world4.run(pipeline_job))
    assert_bitwise(merged(world4.run(pipeline_job, checkpointed=True)), plain)
    assert_bitwise(merged(world4.run(pipeline_job, meta=True)), plain)
    # rows sent in bf16, summed in fp32 (docs/precision.md): each gradient element is rounded
    # once to 8 bits (relative 2^-9), so 3 SGD steps of lr 0.1 move parameters by at most
    # ~3 x 0.1 x |grad| x 2^-9: within 1e-4 here
    assert_like_one_process(merged(world4.run(pipeline_job, reduce="bf16")), reference(), 1e-4)


def stages_at(pp_size: int) -> tuple[list[Chain], torch.optim.Optimizer]:
    """This rank's stage of the Chain in a pipeline of `pp_size` stages (the data-parallel ranks
    the rest), each block and the stage a unit, with an AdamW over it."""
    mesh = named_mesh((pp_size, dist.get_world_size() // pp_size), ("pp", "dp"))
    per_stage, index = BLOCKS // pp_size, mesh["pp"].get_local_rank()
    stage = Chain(range(index * per_stage, (index + 1) * per_stage))
    for layer in stage.layers.values():
        fullshard.fully_shard(layer, mesh=mesh["dp"])
    fullshard.fully_shard(stage, mesh=mesh["dp"])
    return stage, torch.optim.AdamW(stage.parameters(), lr=1e-2)


def saved_values(stage: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor of a rank's stage, full, by name."""
    model_sd, optim_sd = fullshard.get_state_dict(stage, optimizer)
    return {**model_sd, **{f"{name}.{key}": value for name, values in optim_sd["state"].items()
                           for key, value in values.items() if isinstance(value, torch.Tensor)}}


def save_pipeline_job(path: str) -> dict:
    """Two 1F1B steps of the Chain as pp 2 x dp 2, then a save of each rank's stage."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage, optimizer = stages_at(2)
    mesh = named_mesh((2, 2), ("pp", "dp"))
    index = mesh["pp"].get_local_rank()
    runner = Schedule1F1B(PipelineStage(stage, index, 2, torch.device("cpu"), group=mesh["pp"].get_group()),
                          n_microbatches=MICROBATCHES, loss_fn=mse)
    for inputs, targets in batches(mesh["dp"].get_local_rank(), 2)[:2]:
        runner.step(inputs) if index == 0 else runner.step(target=targets)
        optimizer.step()
        optimizer.zero_grad()
    fullshard.save(path, stage, optimizer, step=2)
    return saved_values(stage, optimizer)


def load_pipeline_job(path: str, pp_size: int) -> dict:
    stage, optimizer = stages_at(pp_size)
    meta = fullshard.load(path, stage, optimizer)
    return {"meta": meta, "values": saved_values(stage, optimizer)}


def test_a_pipelined_checkpoint_loads_at_other_pipeline_and_data_parallel_sizes(world4, tmp_path):
    """Note [stage checkpoints]: saved as 2 stages x 2 dp ranks, loaded as 1 x 4 (no pipeline)
    and 4 x 1 (a block a stage), optimizer state included, and into a plain model by dcp.load."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "pipeline")
    saved = {}
    for values in world4.run(save_pipeline_job, path=path):
        saved.update(values)
    assert {name.split(".")[1] for name in saved} == {"0", "1", "2", "3"}  # every stage's entries
    for pp_size in (1, 4):
        for got in world4.run(load_pipeline_job, path=path, pp_size=pp_size):
            assert got["meta"] == {"step": 2, "extra": None}
            assert got["values"] and all(torch.equal(value, saved[name]) for name, value in got["values"].items())
    plain = {"model": Chain().state_dict()}
    dcp.load(plain, checkpoint_id=fullshard.checkpoint_dir(path))
    assert plain["model"].keys() == Chain().state_dict().keys()
    assert all(torch.equal(value, saved[name]) for name, value in plain["model"].items())


def causes(error: BaseException | None) -> list[BaseException]:
    """An exception and what caused it, outermost first (torch's stages wrap what a backward raises)."""
    chain = []
    while error is not None:
        chain.append(error)
        error = error.__cause__
    return chain


def killed_stage_job(out: str) -> None:
    """pp 2 x dp 2, 1F1B, units that time out after 3 s; rank 3 (the last stage's second dp rank)
    dies at its sixth block forward, in the second step. Each survivor writes what it raised
    (each exception of the chain) and when."""
    import json
    import os
    import time
    from datetime import timedelta
    from pathlib import Path

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage, optimizer = stages_at(2)
    stage.set_timeout(3)
    mesh = named_mesh((2, 2), ("pp", "dp"))
    index = mesh["pp"].get_local_rank()
    # the stages' sends and receives are torch's, on the group given to the stage: one with the
    # units' timeout (the mesh's groups wait the default, 30 minutes outside these tests)
    pp_groups = [dist.new_group([0, 2], timeout=timedelta(seconds=3)), dist.new_group([1, 3], timeout=timedelta(seconds=3))]
    runner = Schedule1F1B(PipelineStage(stage, index, 2, torch.device("cpu"), group=pp_groups[dist.get_rank() % 2]),
                          n_microbatches=MICROBATCHES, loss_fn=mse)
    if dist.get_rank() == 3:
        forwards = iter(range(100))

        def die_at_the_sixth(module: nn.Module, args: tuple) -> None:
            if next(forwards) == 5:
                os._exit(1)

        stage.layers["3"].register_forward_pre_hook(die_at_the_sixth)
    start, raised = time.monotonic(), None
    try:
        for inputs, targets in batches(mesh["dp"].get_local_rank(), 2):
            runner.step(inputs) if index == 0 else runner.step(target=targets)
            optimizer.step()
            optimizer.zero_grad()
    except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
        raised = e
    chain = [{"type": type(e).__name__, "message": str(e)[:2000]} for e in causes(raised)]
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps({"chain": chain,
                                                                    "seconds": time.monotonic() - start}))


def test_a_stage_rank_killed_mid_schedule_fails_every_rank_within_the_timeout(tmp_path):
    """Its data-parallel peer's collective names the unit (torch's stage wraps it in its own
    RuntimeError, the FullShardError its cause); the rank of the other stage that exchanges
    activations with it gets gloo's "connection closed" from torch's send or receive; the
    fourth, whose peers failed, its unit's timeout. Nobody waits past the 3 s timeout (and
    the margin a busy machine needs), nobody hangs."""
    import json
    import time

    files = [tmp_path / f"rank{r}.json" for r in range(3)]
    with World(4, forked=True) as world:
        world.submit(killed_stage_job, out=str(tmp_path))
        deadline = time.monotonic() + 60
        while not all(f.exists() for f in files) and time.monotonic() < deadline:  # each survivor's report
            time.sleep(0.05)
        world.kill()  # the survivors' group lost a rank: their next barrier would wait it out
    reports = {r: json.loads(f.read_text()) for r, f in enumerate(files)}
    for rank, report in reports.items():
        assert report["chain"], (rank, report)  # it raised
        assert report["seconds"] < 3 + 10, (rank, report)  # the timeout, and the 1 s step before the kill
    named = [e for e in reports[2]["chain"] if e["type"] in ("FullShardError", "EveryRankError")]
    assert named and "of unit 'layers." in named[0]["message"] and "did not finish" in named[0]["message"], reports[2]
    for rank in (0, 1):  # torch's own words for its sends and receives: a peer gone, or the group's timeout
        messages = " ".join(e["message"] for e in reports[rank]["chain"])
        assert any(words in messages for words in ("did not finish", "Connection closed by peer",
                                                    "Connection reset by peer", "Timed out")), (rank, reports[rank])


def mixed_job(inner: str) -> str:
    """A stage whose blocks one library shards and whose root the other: the error, or ''."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = named_mesh((2, 2), ("pp", "dp"))
    index = mesh["pp"].get_local_rank()
    stage = Chain(range(2 * index, 2 * index + 2))
    inner_shard, outer_shard = (torch_fully_shard, fullshard.fully_shard) if inner == "torch" else \
        (fullshard.fully_shard, torch_fully_shard)
    for layer in stage.layers.values():
        inner_shard(layer, mesh=mesh["dp"])
    try:
        outer_shard(stage, mesh=mesh["dp"])
    except fullshard.FullShardError as e:
        return str(e)
    except RuntimeError as e:  # torch's fully_shard over fullshard's units: torch's own error
        return f"torch: {e}"
    return ""


def differing_units_job() -> str:
    """The first dp rank of each stage makes a unit of each block, the second of its first block only."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = named_mesh((2, 2), ("pp", "dp"))
    index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stage = Chain(range(2 * index, 2 * index + 2))
    try:  # the sharding itself compares what the ranks shard
        for layer in list(stage.layers.values())[: 2 - dp_rank]:
            fullshard.fully_shard(layer, mesh=mesh["dp"])
        fullshard.fully_shard(stage, mesh=mesh["dp"])
        runner = Schedule1F1B(PipelineStage(stage, index, 2, torch.device("cpu"), group=mesh["pp"].get_group()),
                              n_microbatches=MICROBATCHES, loss_fn=mse)
        inputs, targets = batches(dp_rank, 2)[0]
        runner.step(inputs) if index == 0 else runner.step(target=targets)
    except Exception as e:  # noqa: BLE001 (torch's stage may wrap fullshard's error)
        named = [c for c in causes(e) if isinstance(c, fullshard.FullShardError)]
        return str(named[0]) if named else f"unnamed: {e}"
    return ""


def test_mixed_libraries_and_stages_whose_units_differ_are_named_errors(world4):
    # fullshard's root over FSDP2's blocks: refused by name before anything changes
    for message in world4.run(mixed_job, inner="torch"):
        assert "holds modules that torch's own fully_shard (FSDP2) shards" in message and "layers." in message
    # ranks of one stage whose units differ: refused as they shard, naming what each holds
    for message in world4.run(differing_units_job):
        assert "ranks would shard different parameters" in message, message
    # torch's fully_shard.state(unit) is fullshard's StageState: anything asked of it beyond what
    # the schedules reach for (REACHED) is a FullShardError naming it
    for message in world4.run(state_job):
        assert "'_lazy_init', which only torch's FSDP2 has" in message, message


def state_job() -> str:
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    state = torch_fully_shard.state(fullshard.fully_shard(nn.Linear(2, 2)))
    assert isinstance(state, stage_state.StageState)
    return raises(lambda: state._lazy_init())


def reached_by_schedules() -> dict[str, set[str]]:
    """What torch.distributed.pipelining's source reads from `fully_shard.state(stage)`, its
    context, states and param groups (stage.perform_reduce_grad), by the names it uses."""
    from torch.distributed.pipelining import stage

    tree = ast.parse(inspect.getsource(stage))
    chains: dict[str, set[str]] = {"state": set(), "context": set(), "unit state": set(), "param group": set()}
    loops = {}  # loop variable -> what it iterates over
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            loops[node.target.id] = ast.unparse(node.iter)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.value, (ast.Name, ast.Attribute)):
            continue
        owner = ast.unparse(node.value)
        if owner == "distributed_state":
            chains["state"].add(node.attr)
        elif owner.endswith("._state_ctx"):
            chains["context"].add(node.attr)
        elif owner in loops and loops[owner].endswith(".all_states"):
            chains["unit state"].add(node.attr)
        elif (owner in loops and "_fsdp_param_group" in loops[owner]) or owner.endswith("._fsdp_param_group"):
            chains["param group"].add(node.attr)  # torch 2.13 loops over a state's groups, 2.10 reads its one
    return chains


def test_what_the_schedules_reach_for_is_what_fullshard_offers():
    """A torch release whose schedules reach for more of FSDP2's state fails here, naming it."""
    for kind, names in reached_by_schedules().items():
        assert names, f"torch's pipelining no longer reads a {kind} the way stage_state.REACHED says"
        assert names <= set(stage_state.REACHED[kind]), (kind, names - set(stage_state.REACHED[kind]))
    assert stage_state.KEY is not None, "torch's fully_shard.state no longer reads a module's composable state"
