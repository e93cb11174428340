"""One rank of `fullshard train`, top-down: join the job, build the GPT on meta and shard
it, resume, train, sample, report.

Note [cli deadlines]: every collective this file issues itself (the metrics of each
step, validation, the sample, the closing barrier) goes through `share`, an all-reduce
whose wait is bounded by --timeout, and a rank that waits longer fails with a
FullShardError naming the collective and the step instead of hanging. The process group
has the same timeout, which bounds what runs inside torch (the rendezvous, checkpoint
I/O); on NCCL it is a minute longer, as NCCL's watchdog ends the process when it
passes, and our error naming the collective must come first.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fullshard
from fullshard import runtime
from fullshard.cli import pipeline
from fullshard.cli.config import (TrainConfig, fatal, gpt_dims, nonfinite_policy, parse_bytes, pipeline_problem,
                                    unused_problem)
from fullshard.cli.corpus import batch_offsets, batch_rows, corpus
from fullshard.cli.launcher import LAUNCHER_PID, STORE_FILE, die_with_launcher, hold_run_dir
from fullshard.cli.run_log import latest_rows, open_log, plot, read_rows, summary
from fullshard.collectives import all_gather_ints, all_reduce_
from fullshard.errors import CollectiveError, EveryRankError, FullShardError, collective_failed, fail
from fullshard.accounting import return_freed_memory
from fullshard.gpt import GPT, Block, GPTConfig
from fullshard.gpt_config import parameter_count

NCCL_WATCHDOG_GRACE = timedelta(seconds=60)  # Note [cli deadlines]


@dataclass
class Run:
    """What every part of a rank's run needs."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: fullshard.GradScaler | None
    train_data: torch.Tensor  # [training bytes] uint8
    val_data: torch.Tensor  # [validation bytes] uint8
    pipe: pipeline.Pipeline | None = None  # --pp: this rank's stage (`model`) and its schedules

    @property
    def data_ranks(self) -> tuple[int, int]:
        """(this rank's place, of how many) among the ranks that take separate data."""
        return (self.pipe.dp_rank, self.pipe.dp) if self.pipe is not None else (self.rank, self.world)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.cfg.timeout)


def train(cfg: TrainConfig) -> int:
    """This rank's whole run; its exit status (a FullShardError propagates: status 3)."""
    start_rank()
    out = Path(cfg.out)
    lock = None
    if os.environ.get("RANK") == "0" and LAUNCHER_PID not in os.environ:  # under torchrun
        try:
            lock = hold_run_dir(out)
        except FullShardError as e:
            return fatal(str(e))
    rank, world, device = join_job(cfg)
    shard_world = world if cfg.strategy != "hybrid_shard" else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    message = pipeline_problem(cfg, world) or unused_problem(cfg, world // cfg.pp, shard_world // cfg.pp) or (
        f"--global-batch {cfg.global_batch} must divide into {world // cfg.pp} data-parallel ranks x "
        f"{cfg.grad_accum} micro-batches" if cfg.global_batch % (world // cfg.pp * cfg.grad_accum) else None)
    if message is not None:  # what depends on the job's ranks: said once, as an argument's problem
        if rank == 0:
            fatal(message)
        dist.destroy_process_group()
        return 2
    run, description = build(cfg, rank, world, device)
    start = resume(run, out / "checkpoint")
    log = None
    if rank == 0:
        print(description, flush=True)
        log = open_log(out, start)
    train_loop(run, start, log, out / "checkpoint")
    text = sample(run)
    share(torch.zeros(1, device=device), timeout=run.timeout, what="the barrier at the end of the run")
    dist.destroy_process_group()
    if log is not None:  # after the last collective: no rank waits while rank 0 plots
        log.close()
        report(cfg, out, text)
    if lock is not None:  # held until here (Note [one run per directory])
        lock.close()
    return 0


def start_rank() -> None:
    """What every rank of the command does first: stop quietly (SIGINT, like SIGTERM, ends it
    without a traceback), return freed memory (the basis of the planner's peaks and of the peak
    reported), and die with its launcher (Note [orphans])."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return_freed_memory()
    die_with_launcher()


def join_job(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """Join the process group (rank, world, device): NCCL with one GPU per rank, else gloo on
    the CPU. Restarted ranks meet under a key prefix of their own attempt: the store outlives
    an attempt, and a rank must not connect to an address a dead peer left there."""
    cuda = torch.cuda.is_available()
    timeout = timedelta(seconds=cfg.timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda and device.index >= torch.cuda.device_count():
        raise FullShardError(f"rank {os.environ['RANK']} is local rank {device.index} of this machine, which has "
                             f"{torch.cuda.device_count()} GPUs: each rank takes a GPU of its own. Start at most "
                             f"{torch.cuda.device_count()} ranks per machine (torchrun --nproc_per_node)")
    try:
        if STORE_FILE in os.environ:  # a local run (Note [local launch])
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.FileStore(os.environ[STORE_FILE], world)
            store.set_timeout(timeout)
        else:
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                store=dist.PrefixStore(f"fullshard/attempt-{attempt}", store),
                                timeout=timeout + NCCL_WATCHDOG_GRACE if cuda else timeout,
                                device_id=device if cuda else None)  # NCCL's communicators now, not in step 1
    except RuntimeError as e:  # torch's store and backend errors: a rank that never came, an unreachable store
        raise FullShardError(f"rank {os.environ['RANK']}: joining the process group did not finish within --timeout "
                             f"{cfg.timeout:g} s ({str(e).splitlines()[0]}). Start every rank, or pass a longer "
                             f"--timeout") from None
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return dist.get_rank(), dist.get_world_size(), device


def build(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> tuple[Run, str]:
    """The data, and the GPT built on meta and sharded (each block materialized straight into
    its shards) with its optimizer; and a line describing them."""
    train_bytes, val_bytes, source = corpus(cfg.data)
    dims = gpt_dims(cfg)
    held = len(train_bytes) + len(val_bytes)
    pipe = None
    in_job = cfg.sync_every and not cfg.fault_tolerant  # DiLoCo's groups in this job (torchft: one each)
    if cfg.pp > 1:  # this rank's stage, the model it shards (its untied head: GPTStage)
        settings = []
        pipe = pipeline.build(cfg, dims, device, world, lambda stage, mesh: settings.append(
            shard(stage, cfg, world, rank, device, held, mesh)))
        model, setting = pipe.stage, f"{settings[0]}, stage {pipe.index + 1} of {cfg.pp} (1F1B)"
        n_params = parameter_count(GPTConfig(block_size=cfg.seq_len, vocab_size=256, **dims)) + 256 * dims["n_embd"]
    else:
        torch.manual_seed(cfg.seed)
        with torch.device("meta"):
            model = GPT(GPTConfig(block_size=cfg.seq_len, vocab_size=256, **dims))
        n_params = sum(p.numel() for p in model.parameters())
        mesh = init_device_mesh(device.type, (cfg.replicas, world // cfg.replicas),
                                mesh_dim_names=("replicate", "shard")) if in_job else None
        setting = shard(model, cfg, world, rank, device, held, None if mesh is None else mesh["shard"])
    model.set_timeout(cfg.timeout)
    model.set_debug_checks(cfg.debug_checks)
    model.set_nonfinite_grads(nonfinite_policy(cfg))
    optimizer = make_optimizer(model, cfg)
    if in_job:  # docs/diloco.md (over torchft: replica.py wraps it once the Manager is there)
        optimizer = diloco(model, optimizer, cfg, mesh["replicate"])
        setting += (f"; DiLoCo: {cfg.replicas} replica groups of {world // cfg.replicas} rank(s), " +
                    diloco_setting(cfg))
    run = Run(cfg, rank, world, device, model, optimizer,
              scaler=fullshard.GradScaler(device.type) if cfg.precision == "fp16" else None,
              train_data=torch.frombuffer(train_bytes, dtype=torch.uint8),
              val_data=torch.frombuffer(val_bytes, dtype=torch.uint8), pipe=pipe)
    description = (f"fullshard {fullshard.__version__}: GPT {cfg.preset} {dims}, {n_params / 1e6:.2f}M parameters, "
                   f"{world} ranks ({device.type}), {setting}; data: {source}, {len(train_bytes) / 1e6:.1f} MB "
                   f"train / {len(val_bytes) / 1e6:.1f} MB validation")
    return run, description


def diloco(model: torch.nn.Module, inner: torch.optim.Optimizer, cfg: TrainConfig, replicas) -> fullshard.DiLoCo:
    """DiLoCo over `replicas` with the outer options; with fragments each exchange overlaps the
    next step, except over torchft (Note [managed syncs])."""
    return fullshard.DiLoCo(
        model, inner, replicas, sync_every=cfg.sync_every, fragments=cfg.fragments,
        outer_optimizer=lambda params: torch.optim.SGD(params, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                                       nesterov=cfg.outer_momentum > 0),
        outer_dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[cfg.outer_dtype],
        overlap=cfg.fragments > 1 and not cfg.fault_tolerant, timeout=cfg.timeout)


def diloco_setting(cfg: TrainConfig) -> str:
    return (f"syncing every {cfg.sync_every} steps" + (f" in {cfg.fragments} fragments" if cfg.fragments > 1 else "")
            + f", outer gradients in {cfg.outer_dtype}; a checkpoint per replica group")


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, matrices decaying; or Muon for the blocks' matrices with AdamW groups for the rest
    (fullshard.optim.Muon). Each group keeps its peak learning rate, which the schedule scales."""
    params = list(model.parameters())
    decay = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay, "peak_lr": cfg.lr},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "peak_lr": cfg.lr}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(decay, lr=cfg.lr)
    matrices, rest = fullshard.optim.muon_groups(model)
    rest = [{"params": rest, "use_muon": False, "lr": cfg.lr, "weight_decay": 0.0, "peak_lr": cfg.lr}]
    return fullshard.optim.Muon([{"params": matrices, "peak_lr": cfg.muon_lr}, *rest], lr=cfg.muon_lr,
                                weight_decay=cfg.weight_decay)


def planned(model: torch.nn.Module, cfg: TrainConfig, world: int, budget: int, held: int, hardware: str):
    """fullshard.plan's choice for --memory-budget less the text each rank holds (`budget`)."""
    if budget <= 0:
        raise fail(f"--memory-budget {cfg.memory_budget} is less than the {held / 2**20:.0f} MiB of text each rank "
                   f"holds, before any model", "Give each rank more memory, or train on less text (--data).")
    return fullshard.plan(model, world_size=world, memory_budget=budget, batch=cfg.global_batch // world // cfg.grad_accum,
                          seq=cfg.seq_len, hardware=hardware, optimizer=cfg.optimizer)


def shard(model: torch.nn.Module, cfg: TrainConfig, world: int, rank: int, device: torch.device, held: int,
          mesh=None) -> str:
    """Shard `model` as the options say (over `mesh`: a pipeline stage's data-parallel ranks; None:
    every rank), or as fullshard.plan chooses (--plan auto: for the budget less the `held` bytes
    of text each rank keeps in host memory on a CPU, which the planner's peak, the rest of the
    process's, does not count); how, in words."""
    if cfg.plan == "auto":
        held = held if device.type == "cpu" else 0
        try:
            plan = planned(model, cfg, world, parse_bytes(cfg.memory_budget) - held, held,
                           "a100" if device.type == "cuda" else "cpu")
        except EveryRankError:
            raise
        except FullShardError as e:  # the same inputs on every rank: the same refusal, said once
            raise EveryRankError(str(e)) from None
        fullshard.apply_plan(model, plan)
        if rank == 0:
            print(plan.explain() + (f"; with the {held / 2**20:.0f} MiB of text each rank holds: "
                                    f"{(plan.chosen.peak + held) / 2**20:.0f} MiB" if held else ""), flush=True)
        return f"planned: {plan.chosen.strategy}, {plan.chosen.precision}"
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    gather = {"int8": torch.int8, "float8": torch.float8_e4m3fn}.get(cfg.gather)
    send = {"bf16": torch.bfloat16, "int8": torch.int8}.get(cfg.reduce)
    fullshard.shard_model(
        model, wrap={Block} if cfg.wrap == "block" else None if cfg.wrap == "none" else int(cfg.wrap),
        strategy=cfg.strategy, mp_policy=fullshard.MixedPrecisionPolicy(
            param_dtype=low, gather_dtype=gather, reduce_send_dtype=send) if low or gather or send else None,
        offload_policy=fullshard.CPUOffloadPolicy() if cfg.cpu_offload else None,
        backward_prefetch=None if cfg.backward_prefetch == "none" else cfg.backward_prefetch,
        forward_prefetch=cfg.forward_prefetch, limit_all_gathers=cfg.limit_all_gathers or None, mesh=mesh)
    return f"{cfg.strategy}, {cfg.precision}" + (f", {cfg.gather} gathers" if gather else "") + \
        (f", gradients sent in {cfg.reduce}" if send else "")


def own_checkpoint(run: Run, ckpt: Path) -> Path:
    """Where this rank's checkpoint goes: `ckpt`, or with --sync-every its replica group's own
    directory in it (Note [replica checkpoints] in fullshard/checkpoint/store.py)."""
    return ckpt / f"replica_{dist.get_rank(run.optimizer.replicas.group)}" if run.cfg.sync_every else ckpt


def resume(run: Run, ckpt: Path) -> int:
    """Load the newest complete checkpoint (--resume); the step to continue from (0: none). With
    --sync-every, each replica group its own, all of one step."""
    start = load_newest(run, own_checkpoint(run, ckpt))
    if run.cfg.sync_every:
        starts = [s for (s,) in all_gather_ints([start], device=run.device, timeout=run.timeout,
                                                what="the replica groups' resumed steps")]
        if len(set(starts)) > 1:
            raise EveryRankError(f"the replica groups' newest checkpoints in {ckpt} are of steps {sorted(set(starts))}: "
                                 f"a save of the last of them failed in some group. Delete the newer versions, or "
                                 f"pass --no-resume")
    return start


def load_newest(run: Run, ckpt: Path) -> int:
    if not (run.cfg.resume and (ckpt / "LATEST").is_file()):
        return 0
    start = fullshard.load(ckpt, run.model, run.optimizer)["step"]
    if start is None:
        raise FullShardError(f"the checkpoint in {ckpt} records no step (it was not saved by fullshard train), so "
                             f"the run cannot know where to resume. Pass --no-resume, or another --out")
    if run.rank == 0:
        print(f"resumed from {fullshard.checkpoint_dir(ckpt)} at step {start}", flush=True)
    return start


def train_loop(run: Run, start: int, log: TextIO | None, ckpt: Path) -> None:
    """Steps `start` to --steps: a metrics.jsonl row each (rank 0 writes `log`), validation
    before the first and every --eval-interval steps, a checkpoint every --ckpt-interval."""
    cfg = run.cfg
    progress = None
    if log is not None:
        from tqdm import tqdm

        progress = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    if start == 0:
        write_row(log, progress, {"step": 0, "val_loss": evaluate(run)})
    comm_stats = fullshard.stats(run.model)
    saving = None  # the checkpoint writing in the background
    last = time.perf_counter()
    for step in range(start, cfg.steps):
        record = train_step(run, step, comm_stats)
        done = step + 1
        if done % cfg.eval_interval == 0 or done == cfg.steps:
            record["val_loss"] = evaluate(run)
        now = time.perf_counter()
        record["step_s"] = round(now - last, 4)  # since the previous row: a save's stall shows in the next step
        write_row(log, progress, record)
        if (cfg.ckpt_interval and done % cfg.ckpt_interval == 0) or done == cfg.steps:
            saving = fullshard.save(own_checkpoint(run, ckpt), run.model, run.optimizer, step=done,
                                    block=not cfg.background_saves, extra={"preset": cfg.preset, "dims": gpt_dims(cfg)})
        last = now
    if cfg.sync_every:
        run.optimizer.finish()  # with fragments: the last step's sync
    if saving is not None:
        saving.result()  # the last checkpoint is on disk before the run ends
    if progress is not None:
        progress.close()


def train_step(run: Run, step: int, comm_stats, manager=None, part: tuple[int, int] = (0, 1)) -> dict:
    """One optimizer step on the global batch of `step`, or on `part` of it (its place, of how
    many); its metrics row. With a replica group's fullshard.ft `manager`: on the group's part
    (its place in the quorum, of --replicas), the optimizer stepping only if the step commits."""
    cfg, model = run.cfg, run.model
    place, parts = part if manager is None else (manager.participating_rank() or 0, cfg.replicas)
    begin = time.perf_counter()
    lr = lr_at(step, cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr * group.get("peak_lr", cfg.lr) / cfg.lr  # a checkpoint from before peak_lr: --lr
    loss_sum = torch.zeros((), device=run.device)
    data_rank, data_ranks = run.data_ranks
    between_stages = 0  # bytes this rank sent to other stages
    to_replicas = getattr(run.optimizer, "bytes_sent", 0)  # DiLoCo's to the other replica groups (in comm's too)
    with comm_stats as comm:
        offsets = batch_offsets(len(run.train_data), step, seed=cfg.seed, seq_len=cfg.seq_len, batch=cfg.global_batch)
        if run.pipe is not None:  # the schedule takes the rank's micro-batches at once
            x, y = batch_rows(run.train_data, offsets.chunk(data_ranks)[data_rank], cfg.seq_len, run.device)
            mean, between_stages = pipeline.train_step(run.pipe, x, y, step + 1)
            loss_sum += mean.to(run.device)
        for micro_offsets in offsets.chunk(cfg.grad_accum) if run.pipe is None else ():
            mine = micro_offsets.chunk(parts)[place].chunk(run.world)[run.rank]
            x, y = batch_rows(run.train_data, mine, cfg.seq_len, run.device)
            loss = model(x, y) / cfg.grad_accum
            (run.scaler.scale(loss) if run.scaler else loss).backward()
            loss_sum += loss.detach().float()
        grad_norm = optimizer_step(run, manager)
    to_replicas = getattr(run.optimizer, "bytes_sent", 0) - to_replicas
    ranks = exchange_metrics([loss_sum, grad_norm, peak_memory_mb(run.device)], step=step + 1, device=run.device,
                             timeout=run.timeout)
    seconds = time.perf_counter() - begin
    return {"step": step + 1, "loss": sum(r[0] for r in ranks) / data_ranks, "lr": lr,
            "grad_norm": ranks[run.rank][1], "tokens_per_s": cfg.global_batch // parts * cfg.seq_len / seconds,
            "peak_mem_mb": [round(r[2], 1) for r in ranks],
            "sent_bytes": comm.sent_bytes + between_stages, "wait_s": round(comm.wait_s, 4),
            **({"replica_bytes": to_replicas} if cfg.sync_every else {})}


def optimizer_step(run: Run, manager=None) -> torch.Tensor:
    """Clip (--clip; 0: only measure), step and zero the gradients; the global gradient norm.
    With a fullshard.ft `manager`, the step only if every replica group's step commits."""
    if run.scaler:
        run.scaler.unscale_(run.optimizer)
    grad_norm = fullshard.clip_grad_norm_(run.model, run.cfg.clip if run.cfg.clip else float("inf"))
    if run.scaler:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    elif manager is None or manager.should_commit():
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def write_row(log: TextIO | None, progress, record: dict) -> None:
    """Rank 0: a metrics.jsonl line, written whole and flushed, and the progress bar."""
    if log is None:
        return
    log.write(json.dumps(record) + "\n")
    log.flush()
    if "loss" in record:
        progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                             mem_mb="/".join(f"{m:.0f}" for m in record["peak_mem_mb"]))
        progress.update(1)
    if "val_loss" in record and record["step"]:
        progress.write(f"step {record['step']}: validation loss {record['val_loss']:.4f}")


def evaluate(run: Run) -> float:
    """The validation loss: the mean over --eval-batches batches, the same ones every time."""
    cfg = run.cfg
    data_rank, data_ranks = run.data_ranks
    run.model.eval()
    total = torch.zeros((), device=run.device)
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            offsets = batch_offsets(len(run.val_data), -1 - i, seed=cfg.seed, seq_len=cfg.seq_len,
                                    batch=cfg.global_batch).chunk(data_ranks)[data_rank]
            batch = batch_rows(run.val_data, offsets, cfg.seq_len, run.device)
            total += (run.model(*batch) if run.pipe is None else pipeline.evaluate(run.pipe, *batch).to(total)).float()
    run.model.train()
    total_sum = share(total, timeout=run.timeout, what="the all-reduce of the validation loss")
    return total_sum / (cfg.eval_batches * data_ranks)  # --pp: the last stage's ranks hold the losses


def sample(run: Run) -> str:
    """--sample-bytes bytes generated after "def ": every rank runs the sharded forward; rank 0
    draws each byte and every rank takes it."""
    from torch.nn import functional as F

    cfg = run.cfg
    generated = torch.tensor([list(b"def ")], device=run.device)
    generator = torch.Generator().manual_seed(cfg.seed)
    run.model.eval()
    with torch.no_grad():
        for i in range(cfg.sample_bytes):
            context = generated[:, -cfg.seq_len:]
            logits = run.model(context)[:, -1].float() if run.pipe is None else \
                pipeline.next_logits(run.pipe, context, cfg.seq_len)  # --pp: on the last stage only
            token = torch.zeros((1, 1), dtype=generated.dtype, device=run.device)
            drawing = run.rank == 0 if run.pipe is None else logits is not None and run.pipe.dp_rank == 0
            if drawing:  # the others add nothing to the sum that shares it
                token = torch.multinomial(F.softmax(logits.cpu() / 0.8, dim=-1), 1, generator=generator).to(run.device)
            share(token, timeout=run.timeout, what=f"the all-reduce of byte {i + 1} of the sample")
            generated = torch.cat([generated, token], dim=1)
    return bytes(generated[0].tolist()).decode("utf-8", errors="replace")


def report(cfg: TrainConfig, out: Path, text: str) -> None:
    """Rank 0, at the end: the sample, loss.png and the summary table."""
    rows = read_rows(out / "metrics.jsonl")
    if cfg.fault_tolerant:  # Note [replica rows]
        rows = latest_rows(rows)
    print(f"\nsample:\n{text}\n", flush=True)
    saves = [r["step"] for r in rows if "loss" in r and cfg.ckpt_interval and r["step"] % cfg.ckpt_interval == 0]
    plot(rows, out / "loss.png", saves)
    print(summary(cfg.steps, rows, out), flush=True)


def exchange_metrics(figures: list, *, step: int, device: torch.device, timeout: timedelta) -> list[list[float]]:
    """Every rank's `figures` (numbers or 0-d tensors), rank by rank, within `timeout`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    table = torch.zeros(world, len(figures), dtype=torch.float64, device=device)  # [world, figures]
    table[rank] = torch.stack([torch.as_tensor(f, dtype=torch.float64).to(device) for f in figures])
    return share(table, timeout=timeout, what=f"the all-gather of step {step}'s metrics")


def share(tensor: torch.Tensor, *, timeout: timedelta, what: str):
    """Sum `tensor` over the ranks, in place, and read it on the host (Note [cli deadlines]):
    a FullShardError naming `what` when that takes longer than `timeout`. An all-gather and a
    broadcast are this sum over rows that all ranks but one leave at zero."""
    try:
        all_reduce_(tensor, "sum", timeout=timeout, what=what)
        return runtime.active.read_on_host(tensor, timeout=timeout, what=what)
    except CollectiveError as e:
        raise collective_failed(what, e, "Every rank must reach it; another rank is stopped, hung or died. Restart "
                                "the job (fullshard train --max-restarts N resumes from the last checkpoint).",
                                timeout) from None


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to --min-lr."""
    import math

    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def peak_memory_mb(device: torch.device) -> float:
    """This rank's peak memory: the device's allocator peak on GPUs, resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if Path("/proc/self/status").is_file():
        from fullshard.accounting import process_memory

        return process_memory("VmHWM") / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
