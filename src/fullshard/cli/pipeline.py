"""`fullshard train --pp P`: the CLI's GPT in P stages (fullshard.gpt.GPTStage), each sharded
over the data-parallel ranks that hold it and driven by torch.distributed.pipelining's 1F1B
schedule (Note [pipeline stages]): the pieces of a step, an evaluation and a sample that
differ from one stage's run (trainer.py).

Rank r holds stage r // dp of the P stages, as data-parallel rank r % dp of dp = world / P.
The schedule's microbatches are --grad-accum's. Its sends and receives between stages run on
groups of their own with --timeout (the mesh's wait torch's default, 30 minutes), and what a
schedule raises becomes a FullShardError naming the stage and the step on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn import functional as F

from fullshard.errors import FullShardError
from fullshard.gpt import GPTConfig, GPTStage


@dataclass
class Pipeline:
    """This rank's stage, its schedules and its place."""

    stage: GPTStage
    index: int  # of the stages
    stages: int
    dp_rank: int
    dp: int
    schedule: object  # 1F1B over --grad-accum microbatches: training
    # forward only, each on a PipelineStage of its own: a stage that ran without gradients first
    # sends none back in training (torch 2.10 infers that once)
    evaluator: object  # over --grad-accum microbatches: the validation loss
    sampler: object  # one sequence (a copy per stage: a microbatch each, as torch 2.10 asks): the sample
    microbatches: int
    activation_bytes: int  # of one microbatch's activations between stages


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build(cfg, dims: dict, device: torch.device, world: int, shard) -> Pipeline:
    """This rank's stage, built on meta, sharded by `shard(stage, dp_mesh)` and materialized
    block by block; its schedules."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stages, dp = cfg.pp, world // cfg.pp
    mesh = init_device_mesh(device.type, (stages, dp), mesh_dim_names=("pp", "dp"))
    index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    timeout = timedelta(seconds=cfg.timeout)
    groups = [dist.new_group([s * dp + d for s in range(stages)], timeout=timeout) for d in range(dp)]
    per_stage = -(-dims["n_layer"] // stages)  # the last stage may hold fewer blocks
    layers = range(index * per_stage, min(dims["n_layer"], (index + 1) * per_stage))
    torch.manual_seed(cfg.seed + index)
    gpt = GPTConfig(block_size=cfg.seq_len, vocab_size=256, **dims)
    with torch.device("meta"):
        stage = GPTStage(gpt, layers)
    shard(stage, mesh["dp"])

    def pipeline_stage() -> PipelineStage:
        return PipelineStage(stage, index, stages, device, group=groups[dp_rank])

    rows = cfg.global_batch // dp // cfg.grad_accum
    bytes_per = {"bf16": 2, "fp16": 2}.get(cfg.precision, 4)
    return Pipeline(stage, index, stages, dp_rank, dp,
                    schedule=Schedule1F1B(pipeline_stage(), n_microbatches=cfg.grad_accum, loss_fn=loss),
                    evaluator=ScheduleGPipe(pipeline_stage(), n_microbatches=cfg.grad_accum, loss_fn=loss),
                    sampler=ScheduleGPipe(pipeline_stage(), n_microbatches=stages), microbatches=cfg.grad_accum,
                    activation_bytes=rows * cfg.seq_len * dims["n_embd"] * bytes_per)


def run_schedule(pipe: Pipeline, what: str, run, x: torch.Tensor, y: torch.Tensor | None):
    """One pass of `run` (a schedule's step or eval) through this rank's stage: the inputs into
    the first stage, the targets into the last; the last stage's microbatch losses (and output).
    What it raises is a FullShardError naming the stage and `what` (Note [pipeline stages])."""
    losses: list[torch.Tensor] = []
    last = {"target": y, "losses": losses} if pipe.index == pipe.stages - 1 and y is not None else {}
    try:
        # contiguous: torch 2.10's first stage refuses inputs whose strides differ from those it expects
        output = run(x.contiguous(), **last) if pipe.index == 0 else run(**last)
    except FullShardError:
        raise
    except Exception as e:  # torch's stage wraps what fullshard raised; its sends and receives raise their own
        cause = e
        while cause.__cause__ is not None and not isinstance(cause, FullShardError):
            cause = cause.__cause__
        if isinstance(cause, FullShardError):
            raise cause from None
        words = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
        raise FullShardError(f"rank {dist.get_rank()}: stage {pipe.index} of {pipe.stages} could not finish {what} "
                             f"({words}). Every rank of every stage runs each step: another stopped, hung or died. "
                             f"Restart the job (fullshard train --max-restarts N resumes from the last "
                             f"checkpoint)") from None
    return losses, output


def train_step(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor, step: int) -> tuple[torch.Tensor, int]:
    """The schedule's forward and backward of this rank's batch: the mean microbatch loss (0 off
    the last stage) and the bytes this rank sent between stages (activations forward, their
    gradients back)."""
    losses, _ = run_schedule(pipe, f"step {step}", pipe.schedule.step, x, y)
    mean = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=x.device)
    sent = pipe.microbatches * pipe.activation_bytes * ((pipe.index < pipe.stages - 1) + (pipe.index > 0))
    return mean, sent


def evaluate(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean validation loss of this rank's batch (0 off the last stage)."""
    losses, _ = run_schedule(pipe, "the validation", pipe.evaluator.eval, x, y)
    return torch.stack(losses).mean().detach() if losses else torch.zeros((), device=x.device)


def next_logits(pipe: Pipeline, context: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    """The logits of the byte after `context` ([1, n]), on the last stage (None elsewhere): the
    context padded to seq_len (attention is causal, so the padding changes nothing before it)."""
    padded = torch.zeros((pipe.stages, seq_len), dtype=context.dtype, device=context.device)
    padded[:, : context.size(1)] = context
    _, output = run_schedule(pipe, "the sample", pipe.sampler.eval, padded, None)
    return None if output is None else output[:1, context.size(1) - 1].float()
