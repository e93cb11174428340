"""`fullshard train`: train a byte-level GPT with fullshard, end to end; `fullshard bench`.

With no arguments it trains the "small" GPT on Python's own standard library (read as
bytes: nothing to download) on 2 local ranks for a few minutes, and writes to
runs/gpt: metrics.jsonl (a line per step), loss.png (loss curves and memory per rank)
and checkpoint/ (resumed automatically when the same command runs again). Launched
by torchrun it is one rank of the job; otherwise it starts the ranks itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


def opt(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class TrainConfig:
    # model
    preset: str = opt("small", "model size: tiny, small, 15m or 100m (fullshard.gpt.PRESETS)")
    n_layer: int | None = opt(None, "override the preset's number of blocks")
    n_embd: int | None = opt(None, "override the preset's width")
    n_head: int | None = opt(None, "override the preset's attention heads")
    # data
    data: str | None = opt(None, "a text file or a directory of them (default: Python's standard library source)")
    seq_len: int = opt(128, "tokens (bytes) per sequence")
    # optimization
    steps: int = opt(400, "optimizer steps")
    global_batch: int = opt(16, "sequences per step, over all ranks and accumulation micro-batches")
    grad_accum: int = opt(1, "micro-batches per step on each rank")
    lr: float = opt(3e-3, "peak learning rate")
    min_lr: float = opt(3e-4, "learning rate at the end of the cosine decay")
    warmup: int = opt(40, "linear warm-up steps")
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only)")
    clip: float = opt(1.0, "clip gradients to this global norm (0: off)")
    # sharding
    strategy: str = opt("full_shard", "full_shard, shard_grad_op, hybrid_shard or no_shard")
    wrap: str = opt("block", "units: 'block' (each GPT block), 'none' (one unit) or a parameter count")
    precision: str = opt("fp32", "fp32, bf16 or fp16 (fp32 masters; fp16 with loss scaling)")
    cpu_offload: bool = opt(False, "keep shards, gradients and the optimizer step on the CPU")
    backward_prefetch: str = opt("pre", "pre, post or none")
    forward_prefetch: bool = opt(True, "gather the next unit before it runs in forward")
    limit_all_gathers: int = opt(2, "at most this many units gathered ahead of use (0: no limit)")
    # run
    nproc: int = opt(0, "ranks to start (0: 1 per GPU, else 2); ignored under torchrun")
    max_restarts: int = opt(0, "restart all ranks this many times when one fails; they resume from the checkpoint")
    timeout: float = opt(300.0, "seconds a collective may wait before failing with an error naming the unit")
    nonfinite: str = opt("raise", "an inf/NaN gradient: 'raise' (stop, naming the unit and step), 'skip' the step, "
                                  "'off' (with --precision fp16 the loss scaler decides)")
    debug_checks: bool = opt(False, "check before every collective that all ranks run the same one (slower)")
    plan: str = opt("off", "'auto': let fullshard.plan choose wrap, strategy, limit, precision and checkpointing "
                           "for --memory-budget (overrides those options)")
    memory_budget: str = opt("", "bytes per rank for --plan auto, e.g. 2GiB or 500MB")
    oversubscribe: bool = opt(False, "allow more ranks than CPU cores")
    seed: int = opt(0, "seed for initialization and data order")
    out: str = opt("runs/gpt", "directory for metrics.jsonl, loss.png and checkpoint/")
    ckpt_interval: int = opt(200, "save a checkpoint every this many steps (0: only at the end)")
    resume: bool = opt(True, "continue from the newest complete checkpoint in <out>/checkpoint")
    eval_interval: int = opt(100, "validation loss every this many steps")
    eval_batches: int = opt(8, "batches per validation")
    sample_bytes: int = opt(300, "bytes to generate at the end")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """A --flag for every TrainConfig field (annotations are strings: "int | None" -> int)."""
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            convert = {"int": int, "float": float, "str": str}[f.type.split(" | ")[0]]
            parser.add_argument(flag, dest=f.name, type=convert, default=f.default, help=f.metadata["help"])


def problem(cfg: TrainConfig) -> str | None:
    """What is wrong with the configuration, in one line; None when nothing is."""
    from fullshard.gpt import PRESETS
    from fullshard.policy import STRATEGIES

    if cfg.preset not in PRESETS:
        return f"unknown --preset {cfg.preset!r}; choose one of {', '.join(PRESETS)}"
    if cfg.strategy not in STRATEGIES:
        return f"unknown --strategy {cfg.strategy!r}; choose one of {', '.join(STRATEGIES)}"
    if cfg.precision not in ("fp32", "bf16", "fp16"):
        return f"unknown --precision {cfg.precision!r}; choose fp32, bf16 or fp16"
    if cfg.nonfinite not in ("raise", "skip", "off"):
        return f"unknown --nonfinite {cfg.nonfinite!r}; choose raise, skip or off"
    if cfg.timeout <= 0:
        return f"--timeout must be positive, got {cfg.timeout}"
    if cfg.backward_prefetch not in ("pre", "post", "none"):
        return f"unknown --backward-prefetch {cfg.backward_prefetch!r}; choose pre, post or none"
    if cfg.wrap not in ("block", "none") and not cfg.wrap.isdigit():
        return f"--wrap must be 'block', 'none' or a parameter count, not {cfg.wrap!r}"
    for name in ("steps", "global_batch", "grad_accum", "seq_len", "eval_batches"):
        if getattr(cfg, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}"
    for name in ("nproc", "ckpt_interval", "eval_interval", "limit_all_gathers", "warmup", "sample_bytes", "max_restarts"):
        if getattr(cfg, name) < 0:
            return f"--{name.replace('_', '-')} must not be negative, got {getattr(cfg, name)}"
    if cfg.lr <= 0 or cfg.min_lr < 0 or cfg.clip < 0 or cfg.weight_decay < 0:
        return "--lr must be positive; --min-lr, --clip and --weight-decay must not be negative"
    if cfg.plan not in ("off", "auto"):
        return f"unknown --plan {cfg.plan!r}; choose off or auto"
    if cfg.plan == "auto" and parse_bytes(cfg.memory_budget) is None:
        return f"--plan auto needs --memory-budget as a size like 2GiB or 500MB, got {cfg.memory_budget!r}"
    if cfg.data is not None and not Path(cfg.data).exists():
        return f"--data {cfg.data}: no such file or directory"
    return None


def nonfinite_policy(cfg: TrainConfig) -> str | None:
    """What a non-finite reduced gradient does (model.set_nonfinite_grads). Under fp16 the
    loss scaler's overflow steps are ordinary: fullshard.GradScaler skips them and lowers
    the scale on every rank; raising would stop training and skipping first would hide
    the overflow from the scaler, whose scale would then never come down."""
    if cfg.nonfinite == "off" or cfg.precision == "fp16":
        return None
    return cfg.nonfinite


def parse_bytes(text: str) -> int | None:
    """'2GiB', '1.5G', '500MB', '4096' -> bytes; None if it is not a size."""
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
             "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}
    number = text.strip().upper()
    digits = number.rstrip("KMGTIB")
    try:
        value = float(digits)
    except ValueError:
        return None
    unit = number[len(digits):].strip()
    return int(value * units[unit]) if unit in units and value > 0 else None


def gpt_dims(options: TrainConfig | argparse.Namespace) -> dict[str, int]:
    """The preset's GPT dimensions, with any of --n-layer, --n-embd, --n-head given instead."""
    from fullshard.gpt import PRESETS

    return {**PRESETS[options.preset], **{k: v for k in ("n_layer", "n_embd", "n_head") if (v := getattr(options, k))}}


def local_ranks(cfg: TrainConfig) -> int:
    import torch

    return cfg.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (and exit status 2) instead of usage text."""

    def error(self, message: str) -> None:
        sys.exit(fatal(message))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its arguments are its own
        from fullshard.bench import main as bench

        bench(argv[1:])
        return 0
    parser = Parser(prog="fullshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"fullshard {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="train a GPT with fullshard (try --help)",
                                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(train_parser)
    commands.add_parser("bench", help="fullshard vs torch FSDP2, FSDP1, DDP (arguments: fullshard bench --help)",
                        add_help=False)
    plan_parser = commands.add_parser("plan", help="predict memory, traffic and step time of every sharding of a "
                                      "GPT and choose one for a memory budget",
                                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    plan_parser.add_argument("--preset", default="small", help="model size: tiny, small, 15m, 100m")
    plan_parser.add_argument("--n-layer", type=int, help="override the preset's number of blocks")
    plan_parser.add_argument("--n-embd", type=int, help="override the preset's width")
    plan_parser.add_argument("--n-head", type=int, help="override the preset's heads")
    plan_parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    plan_parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    plan_parser.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    plan_parser.add_argument("--world-size", type=int, default=2, help="ranks")
    plan_parser.add_argument("--memory-budget", default="2GiB", help="bytes per rank, e.g. 2GiB")
    plan_parser.add_argument("--hardware", default="cpu", help="cpu, a100 or h100 (fullshard.planner.HARDWARE)")
    plan_parser.add_argument("--optimizer", default="adamw", help="adamw, sgd or none")
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_command(args)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if (message := problem(cfg)) is not None:
        return fatal(message)
    if all(var in os.environ for var in TORCHRUN_VARS):
        from fullshard.errors import FullShardError

        try:
            return train(cfg)
        except FullShardError as e:  # what went wrong and how to fix it, in one line
            print(f"fullshard: error: {e}", file=sys.stderr, flush=True)
            return 3
    nproc = local_ranks(cfg)
    cores = os.cpu_count() or 1
    import torch

    if not torch.cuda.is_available() and nproc > cores and not cfg.oversubscribe:
        return fatal(f"--nproc {nproc} is more than the {cores} CPU cores here; pass --oversubscribe to run anyway")
    if cfg.global_batch % (nproc * cfg.grad_accum):
        return fatal(f"--global-batch {cfg.global_batch} must divide into {nproc} ranks x {cfg.grad_accum} micro-batches")
    return launch(nproc, cfg.max_restarts, argv)


def plan_command(args: argparse.Namespace) -> int:
    """`fullshard plan`: the candidates as a table, and the chosen one."""
    import torch

    import fullshard
    from fullshard.errors import FullShardError
    from fullshard.gpt import GPT, PRESETS, GPTConfig

    if args.preset not in PRESETS:
        return fatal(f"unknown --preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    budget = parse_bytes(args.memory_budget)
    if budget is None:
        return fatal(f"--memory-budget must be a size like 2GiB or 500MB, got {args.memory_budget!r}")
    dims = gpt_dims(args)
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=args.seq_len, vocab_size=args.vocab, **dims))
    try:
        plan = fullshard.plan(model, world_size=args.world_size, memory_budget=budget, batch=args.batch,
                              seq=args.seq_len, hardware=args.hardware, optimizer=args.optimizer)
    except FullShardError as e:
        return fatal(str(e))
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {dims}, {params / 1e6:.1f}M parameters; world {args.world_size}, batch {args.batch} x {args.seq_len} "
          f"per rank; {plan.hardware.name}; budget {budget / 2**20:.0f} MB per rank\n")
    print(plan.table())
    print("\n" + plan.explain())
    return 0


def fatal(message: str) -> int:
    print(f"fullshard: error: {message}", file=sys.stderr)
    return 2


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("fullshard")
    except PackageNotFoundError:
        return "unknown"


def launch(nproc: int, max_restarts: int, argv: list[str]) -> int:
    """Start `nproc` ranks of this same command with torch's elastic launcher, as
    `torchrun --standalone` would: one node, the rendezvous and gloo on 127.0.0.1 only.
    When a rank dies all are restarted (up to `max_restarts` times) and resume from the
    newest complete checkpoint."""
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: ranks meet on loopback
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=max_restarts,
                          start_method="spawn")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "fullshard.cli", *argv)
    except ChildFailedError as e:
        failure = next(iter(e.failures.values()))
        return fatal(f"rank {failure.local_rank} failed with exit code {failure.exitcode}; its output is above")
    except KeyboardInterrupt:
        return 130
    return 0


# ---- one rank --------------------------------------------------------------------------


def corpus(cfg: TrainConfig) -> tuple[bytes, bytes, str]:
    """(train bytes, validation bytes, description). Files are split deterministically by a
    hash of their path: about one in 20 is validation."""
    root = Path(cfg.data) if cfg.data else Path(sysconfig.get_paths()["stdlib"])
    files = [root] if root.is_file() else sorted(files_under(root, "*.py" if cfg.data is None else "*"))
    train_parts, val_parts = [], []
    for path in files:
        data = path.read_bytes()
        rel = str(path.relative_to(root)) if path != root else path.name
        (val_parts if zlib.crc32(rel.encode()) % 20 == 0 else train_parts).append(data)
    if root.is_file() or not val_parts:  # one file: its last 5% validates
        whole = b"".join(train_parts + val_parts)
        cut = len(whole) * 19 // 20
        train_parts, val_parts = [whole[:cut]], [whole[cut:]]
    return b"".join(train_parts), b"".join(val_parts), f"{root} ({len(files)} files)"


def files_under(root: Path, pattern: str) -> Iterator[Path]:
    """The files below `root` whose names match `pattern`, except in site-packages folders:
    installed packages are not the standard library, and walking them costs more than
    reading the standard library does."""
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name != "site-packages"]
        for name in fnmatch.filter(names, pattern):
            if (path := Path(folder, name)).is_file():
                yield path


def batch_offsets(data_len: int, step: int, cfg: TrainConfig):
    """Where the global batch of `step` starts in the data: the same whatever the world size."""
    import torch

    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    return torch.randint(0, data_len - cfg.seq_len - 1, (cfg.global_batch,), generator=generator)


def batch_rows(data, offsets, seq_len: int, device):
    """(inputs, targets) [len(offsets), seq_len] from byte offsets."""
    import torch

    rows = torch.stack([data[o : o + seq_len + 1] for o in offsets]).long().to(device)
    return rows[:, :-1], rows[:, 1:]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def peak_memory_mb(device) -> float:
    """This rank's peak memory: the device's allocator peak on GPUs, resident set on CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if Path("/proc/self/status").is_file():
        from fullshard.stats import process_memory

        return process_memory("VmHWM") / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(cfg: TrainConfig) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    import fullshard
    from fullshard.gpt import GPT, Block, GPTConfig

    # set up the process group: NCCL with one GPU per rank, else gloo on the CPU. Restarted
    # ranks meet under a key prefix of their own attempt: the launcher's store outlives an
    # attempt, and a rank must not connect to an address a dead peer left there
    cuda = torch.cuda.is_available()
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore(f"fullshard/attempt-{attempt}", store),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.timeout + 60))  # NCCL's watchdog after our error
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main_rank = rank == 0
    if cfg.global_batch % (world * cfg.grad_accum):
        if main_rank:
            fatal(f"--global-batch {cfg.global_batch} must divide into {world} ranks x {cfg.grad_accum} micro-batches")
        dist.destroy_process_group()
        return 2
    out = Path(cfg.out)
    if main_rank:
        out.mkdir(parents=True, exist_ok=True)

    # data: the same bytes on every rank
    train_bytes, val_bytes, source = corpus(cfg)
    train_data = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
    val_data = torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8)

    # build the model on meta, then shard it: each block materialized straight into its shards
    dims = gpt_dims(cfg)
    torch.manual_seed(cfg.seed)
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=cfg.seq_len, vocab_size=256, **dims))
    n_params = sum(p.numel() for p in model.parameters())
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    setting = f"{cfg.strategy}, {cfg.precision}"
    if cfg.plan == "auto":  # let the planner choose, for this world and budget
        plan = fullshard.plan(model, world_size=world, memory_budget=parse_bytes(cfg.memory_budget),
                              batch=cfg.global_batch // world // cfg.grad_accum, seq=cfg.seq_len,
                              hardware="a100" if cuda else "cpu")
        fullshard.apply_plan(model, plan)
        setting = f"planned: {plan.chosen.strategy}, {plan.chosen.precision}"
        if main_rank:
            print(plan.explain(), flush=True)
    else:
        fullshard.shard_model(
            model, wrap={Block} if cfg.wrap == "block" else None if cfg.wrap == "none" else int(cfg.wrap),
            strategy=cfg.strategy, mp_policy=fullshard.MixedPrecisionPolicy(param_dtype=low) if low else None,
            offload_policy=fullshard.CPUOffloadPolicy() if cfg.cpu_offload else None,
            backward_prefetch=None if cfg.backward_prefetch == "none" else cfg.backward_prefetch,
            forward_prefetch=cfg.forward_prefetch, limit_all_gathers=cfg.limit_all_gathers or None)
    model.set_timeout(cfg.timeout)
    model.set_debug_checks(cfg.debug_checks)
    model.set_nonfinite_grads(nonfinite_policy(cfg))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=cfg.lr)
    scaler = fullshard.GradScaler(device.type) if cfg.precision == "fp16" else None

    # resume from the newest complete checkpoint
    ckpt = out / "checkpoint"
    start = 0
    if cfg.resume and (ckpt / "LATEST").is_file():
        start = fullshard.load(ckpt, model, optimizer)["step"]
        if main_rank:
            print(f"resumed from {fullshard.checkpoint_dir(ckpt)} at step {start}", flush=True)
    if main_rank:
        print(f"fullshard {version()}: GPT {cfg.preset} {dims}, {n_params / 1e6:.2f}M parameters, {world} ranks "
              f"({device.type}), {setting}; data: {source}, {len(train_bytes) / 1e6:.1f} MB "
              f"train / {len(val_bytes) / 1e6:.1f} MB validation", flush=True)

    def evaluate() -> float:
        model.eval()
        total = torch.zeros((), device=device)
        with torch.no_grad():
            for i in range(cfg.eval_batches):  # the same batches at every evaluation
                offsets = batch_offsets(len(val_data), -1 - i, cfg).chunk(world)[rank]
                total += model(*batch_rows(val_data, offsets, cfg.seq_len, device)).float()
        dist.all_reduce(total)
        model.train()
        return total.item() / (cfg.eval_batches * world)

    # train (metrics.jsonl: a line per step; on resume, the lines after the checkpoint go)
    metrics = None
    if main_rank:
        log = out / "metrics.jsonl"
        kept = [line for line in (log.read_text().splitlines() if start and log.is_file() else [])
                if json.loads(line)["step"] <= start]
        log.write_text("".join(line + "\n" for line in kept))
        metrics = open(log, "a")
    tokens_per_step = cfg.global_batch * cfg.seq_len
    progress = None
    if main_rank:
        from tqdm import tqdm

        progress = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    first_val = evaluate() if start == 0 else None
    if main_rank and first_val is not None:
        metrics.write(json.dumps({"step": 0, "val_loss": first_val}) + "\n")
    comm_stats = fullshard.stats(model)
    for step in range(start, cfg.steps):
        begin = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        with comm_stats as comm:
            for micro_offsets in batch_offsets(len(train_data), step, cfg).chunk(cfg.grad_accum):
                x, y = batch_rows(train_data, micro_offsets.chunk(world)[rank], cfg.seq_len, device)
                loss = model(x, y) / cfg.grad_accum
                (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.detach().float()
            if scaler:
                scaler.unscale_(optimizer)
            grad_norm = fullshard.clip_grad_norm_(model, cfg.clip if cfg.clip else float("inf"))
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        figures = torch.tensor([loss_sum.item(), peak_memory_mb(device)], dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(figures) for _ in range(world)]
        dist.all_gather(gathered, figures)
        seconds = time.perf_counter() - begin
        record = {"step": step + 1, "loss": sum(g[0].item() for g in gathered) / world, "lr": lr,
                  "grad_norm": grad_norm.item(), "tokens_per_s": tokens_per_step / seconds,
                  "peak_mem_mb": [round(g[1].item(), 1) for g in gathered], "sent_bytes": comm.sent_bytes,
                  "wait_s": round(comm.wait_s, 4)}
        done = step + 1
        if done % cfg.eval_interval == 0 or done == cfg.steps:
            record["val_loss"] = evaluate()
        if main_rank:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                 mem_mb="/".join(f"{m:.0f}" for m in record["peak_mem_mb"]))
            progress.update(1)
            if "val_loss" in record:
                progress.write(f"step {done}: validation loss {record['val_loss']:.4f}")
        if (cfg.ckpt_interval and done % cfg.ckpt_interval == 0) or done == cfg.steps:
            fullshard.save(ckpt, model, optimizer, step=done, extra={"preset": cfg.preset, "dims": dims})
    if progress:
        progress.close()

    # sample: every rank runs the sharded forward; rank 0 draws each byte and shares it
    prompt = b"def "
    generated = torch.tensor([list(prompt)], device=device)
    generator = torch.Generator().manual_seed(cfg.seed)
    model.eval()
    with torch.no_grad():
        for _ in range(cfg.sample_bytes):
            logits = model(generated[:, -cfg.seq_len:])[:, -1].float()
            token = torch.multinomial(F.softmax(logits.cpu() / 0.8, dim=-1), 1, generator=generator).to(device)
            dist.broadcast(token, src=0)
            generated = torch.cat([generated, token], dim=1)

    # report: summary, plot
    if main_rank:
        metrics.close()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        vals = [r["val_loss"] for r in rows if "val_loss" in r]
        text = bytes(generated[0].tolist()).decode("utf-8", errors="replace")
        print(f"\nsample:\n{text}\n", flush=True)
        plot(rows, out / "loss.png")
        steps_run = [r for r in rows if "loss" in r]
        print(summary(cfg, vals, steps_run, out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def summary(cfg: TrainConfig, vals: list[float], rows: list[dict], out: Path) -> str:
    tok_s = sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2] if rows else 0.0
    peak = max((max(r["peak_mem_mb"]) for r in rows), default=0.0)
    sent = sorted(r["sent_bytes"] for r in rows)[len(rows) // 2] if rows else 0
    lines = [
        "| | |", "|---|---|",
        f"| validation loss | {vals[0]:.4f} -> {vals[-1]:.4f} |" if vals else "| validation loss | - |",
        f"| training loss (last step) | {rows[-1]['loss']:.4f} |" if rows else "| training loss | - |",
        f"| steps | {rows[-1]['step'] if rows else 0} of {cfg.steps} |",
        f"| tokens/s (median) | {tok_s:.0f} |",
        f"| peak memory per rank | {peak:.0f} MB |",
        f"| sent per step per rank (median) | {sent / 2**20:.1f} MB |",
        f"| metrics | {out / 'metrics.jsonl'} |",
        f"| plot | {out / 'loss.png'} |",
        f"| checkpoint | {out / 'checkpoint'} (resumed by running the same command again) |",
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Training and validation loss, and each rank's peak memory, over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (losses, memory) = plt.subplots(1, 2, figsize=(11, 4))
    train_rows = [r for r in rows if "loss" in r]
    losses.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="training", linewidth=0.8)
    val_rows = [r for r in rows if "val_loss" in r]
    losses.plot([r["step"] for r in val_rows], [r["val_loss"] for r in val_rows], "o-", label="validation")
    losses.set(xlabel="step", ylabel="loss (nats per byte)", title="loss")
    losses.legend()
    for rank in range(len(train_rows[0]["peak_mem_mb"]) if train_rows else 0):
        memory.plot([r["step"] for r in train_rows], [r["peak_mem_mb"][rank] for r in train_rows], label=f"rank {rank}")
    memory.set(xlabel="step", ylabel="MB", title="peak memory per rank")
    memory.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
