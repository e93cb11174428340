"""The options of `fullshard train` (a TrainConfig field per --flag) and their checks, and
the checks of `fullshard plan`'s.

The checks run in the command's own process before any rank starts, so a bad argument
ends in one line on stderr and exit status 2 instead of a traceback from every rank.
Every number has a range, sizes included: a run whose model, gradients, optimizer state
and activations cannot fit in the memory there is is refused before it starts
(`memory_problem`), and `plan` refuses a model whose parameters alone exceed the budget,
so no value makes a command build or allocate without bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass, field

from fullshard.cli.corpus import corpus_sizes
from fullshard.errors import FullShardError, in_bytes

# the longest --timeout: far below where timedelta and the backends' millisecond
# clocks overflow (about 1e13 s), far above any real wait
MAX_TIMEOUT_S = 1e9
MAX_COUNT = 2**40  # steps, batches, intervals: far above any run, far below int64 and the data seed's range
MAX_SEED = 2**32 - 1  # the data seed is seed * 1e6 + step, a 64-bit generator seed
MAX_LAYERS, MAX_WIDTH, MAX_VOCAB, MAX_SEQ = 1024, 1 << 17, 1 << 24, 1 << 24
MAX_WORLD = 1 << 20
MAX_LR = 10.0  # AdamW moves each weight by about lr per step: far beyond this a model only diverges
MAX_SAMPLE = 1_000_000  # --sample-bytes: one forward each, and the sample is held whole
RUNTIME_BYTES = 150 * 2**20  # what a rank holds before its first tensor (torch, gloo, Python: 250-400 MB here)


def opt(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class TrainConfig:
    # model
    preset: str = opt("small", "model size: tiny, small, 15m or 100m (fullshard.gpt_config.PRESETS)")
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
    optimizer: str = opt("adamw", "'adamw', or 'muon': fullshard.optim.Muon for the blocks' matrices, AdamW for "
                                  "the rest (embeddings, head, norms, biases)")
    muon_lr: float = opt(0.02, "Muon's peak learning rate (--optimizer muon; the schedule scales it as --lr)")
    clip: float = opt(1.0, "clip gradients to this global norm (0: off)")
    # sharding
    strategy: str = opt("full_shard", "full_shard, shard_grad_op, hybrid_shard or no_shard")
    wrap: str = opt("block", "units: 'block' (each GPT block), 'none' (one unit) or a parameter count")
    precision: str = opt("fp32", "fp32, bf16 or fp16 (fp32 masters; fp16 with loss scaling)")
    gather: str = opt("exact", "'exact' (parameters gathered in the compute dtype), 'int8' or 'float8' (block-"
                               "quantized, about half of bf16's bytes; changes forward's weights slightly: "
                               "docs/precision.md)")
    reduce: str = opt("exact", "'exact' (gradients reduced in the compute dtype), 'bf16' or 'int8' (sent in that "
                               "format, summed in fp32: 0.5x or 0.26x of fp32's bytes; docs/precision.md)")
    cpu_offload: bool = opt(False, "keep shards, gradients and the optimizer step on the CPU")
    backward_prefetch: str = opt("pre", "pre, post or none")
    forward_prefetch: bool = opt(True, "gather the next unit before it runs in forward")
    limit_all_gathers: int = opt(2, "at most this many units gathered ahead of use (0: no limit)")
    pp: int = opt(1, "pipeline stages (torch.distributed.pipelining's 1F1B over --grad-accum microbatches), each "
                     "sharded over nproc / pp ranks")
    # run
    nproc: int = opt(0, "ranks to start (0: 1 per GPU, else 2); ignored under torchrun")
    replicas: int = opt(1, "replica groups of nproc/replicas ranks each, with --fault-tolerant (torchft across them) "
                           "or --sync-every (DiLoCo across them)")
    sync_every: int = opt(0, "with --replicas: DiLoCo, each replica group training alone and syncing every this "
                             "many steps (0: off; docs/diloco.md)")
    fragments: int = opt(1, "DiLoCo: fragments of consecutive units synced at staggered steps, each exchange "
                            "overlapping the next step (1: the whole model at once)")
    outer_lr: float = opt(0.7, "DiLoCo's outer learning rate (SGD)")
    outer_momentum: float = opt(0.9, "DiLoCo's outer Nesterov momentum (0: none)")
    outer_dtype: str = opt("fp32", "DiLoCo's outer gradients on the wire: fp32, bf16 or int8 (summed in fp32)")
    fault_tolerant: bool = opt(False, "keep training when a replica group dies; restart it and let it heal from a "
                                      "live one (fullshard.ft on torchft: docs/fault-tolerance.md)")
    ft_bind: str = opt("127.0.0.1", "the IP address every fault-tolerance listener binds (lighthouse, stores, "
                                    "Manager servers, gloo)")
    max_restarts: int = opt(0, "restart all ranks this many times when one fails; they resume from the checkpoint")
    timeout: float = opt(300.0, "seconds any collective may wait before failing with an error naming it")
    nonfinite: str = opt("raise", "an inf/NaN gradient: 'raise' (stop, naming the unit and step), 'skip' the step, "
                                  "'off' (with --precision fp16 the loss scaler decides)")
    debug_checks: bool = opt(False, "check before every collective that all ranks run the same one (slower)")
    plan: str = opt("off", "'auto': let fullshard.plan choose wrap, strategy, limit, precision and checkpointing "
                           "for --memory-budget (overrides those options)")
    memory_budget: str | None = opt(None, "bytes per rank for --plan auto, e.g. 2GiB or 500MB")
    oversubscribe: bool = opt(False, "allow more ranks than CPU cores")
    seed: int = opt(0, "seed for initialization and data order")
    out: str = opt("runs/gpt", "directory for metrics.jsonl, loss.png and checkpoint/ (one live run at a time)")
    ckpt_interval: int = opt(200, "save a checkpoint every this many steps (0: only at the end)")
    background_saves: bool = opt(True, "write each checkpoint in a thread while training goes on; "
                                       "--no-background-saves: training waits until it is on disk")
    resume: bool = opt(True, "continue from the newest complete checkpoint in <out>/checkpoint")
    eval_interval: int = opt(100, "validation loss every this many steps (and after the last)")
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


def fatal(message: str) -> int:
    """A bad argument: one line on stderr, and the exit status 2 to return."""
    print(f"fullshard: error: {message}", file=sys.stderr)
    return 2


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def problem(cfg: TrainConfig) -> str | None:
    """What is wrong with the configuration, in one line; None when nothing is."""
    return choice_problem(cfg) or number_problem(cfg) or dims_problem(gpt_dims(cfg)) or data_problem(cfg) or \
        replica_problem(cfg) or pipeline_problem(cfg) or unused_problem(cfg, world=2, shard_world=2)  # the ranks
    # when they are known


def diloco_problem(cfg: TrainConfig) -> str | None:
    """--sync-every and the outer options: what DiLoCo needs, and what it does not take."""
    outer = [name for name in ("fragments", "outer_lr", "outer_momentum", "outer_dtype")
             if getattr(cfg, name) != getattr(TrainConfig, name)]
    if not cfg.sync_every:
        return f"{flag(outer[0])} is DiLoCo's; add --sync-every H (or leave it out)" if outer else None
    if cfg.replicas < 2:
        return f"--sync-every {cfg.sync_every} syncs replica groups: add --replicas 2 or more"
    units = gpt_dims(cfg)["n_layer"] + 1 if cfg.wrap == "block" else 1 if cfg.wrap == "none" else None
    if units is not None and cfg.fragments > units:
        return f"--fragments {cfg.fragments}: the model has {units} units (--wrap {cfg.wrap})"
    if cfg.fragments > cfg.sync_every:
        return f"--fragments {cfg.fragments} take turns within --sync-every {cfg.sync_every} steps, one a step at most"
    for name, value, why in (("strategy", "hybrid_shard", "the replica groups are the replicas; shard inside each "
                                                          "with full_shard"),
                             ("precision", "fp16", "the loss scaler's skipped steps would differ by group; use bf16"),
                             ("plan", "auto", "the planner does not price DiLoCo yet"),
                             ("pp", cfg.pp if cfg.pp > 1 else None, "a replica group is not a pipeline yet")):
        if getattr(cfg, name) == value:
            return f"--sync-every does not take {flag(name)}" + (f" {value}" if value is not True else "") + f": {why}"
    return None


def pipeline_problem(cfg: TrainConfig, world: int | None = None) -> str | None:
    """--pp: what a pipeline needs (enough blocks, microbatches and ranks; `world`, once known),
    and what it does not take."""
    if cfg.pp == 1:
        return None
    layers = gpt_dims(cfg)["n_layer"]
    if cfg.pp > layers:
        return f"--pp {cfg.pp} needs a block a stage at least; the GPT has {layers} (--n-layer)"
    if cfg.grad_accum < cfg.pp:
        return f"--pp {cfg.pp} needs at least as many microbatches a step: pass --grad-accum {cfg.pp} or more"
    if world is not None and world % cfg.pp:
        return f"--pp {cfg.pp} must divide the {world} ranks into stages of equal size (--nproc)"
    for name, value, why in (("plan", "auto", "the planner prices a pipeline with `fullshard plan --pp`"),
                             ("strategy", "hybrid_shard", "each stage's ranks are one shard group"),
                             ("precision", "fp16", "the loss scaler's step would span the stages; use bf16"),
                             ("optimizer", "muon", "train it with AdamW")):
        if getattr(cfg, name) == value:
            return f"--pp does not take {flag(name)} {value}: {why}"
    if cfg.fault_tolerant:
        return "--pp does not take --fault-tolerant: a replica group is one pipeline"
    return None


def replica_problem(cfg: TrainConfig) -> str | None:
    """--replicas, --fault-tolerant, --ft-bind and DiLoCo's options: what they need, and torchft
    installed."""
    if (problem := diloco_problem(cfg)) is not None:
        return problem
    if cfg.replicas > 1 and not cfg.fault_tolerant and not cfg.sync_every:
        return f"--replicas {cfg.replicas} is for --fault-tolerant (replica groups on torchft) or --sync-every " \
               f"(DiLoCo); for replicas that all-reduce every step use --strategy hybrid_shard"
    if not cfg.fault_tolerant:
        return None if cfg.ft_bind == TrainConfig.ft_bind else "--ft-bind is the address of --fault-tolerant's " \
            "listeners; add --fault-tolerant (or leave --ft-bind out)"
    for name, value in (("strategy", cfg.strategy == "hybrid_shard"), ("precision", cfg.precision == "fp16")):
        if value:
            return f"--fault-tolerant does not take {flag(name)} {getattr(cfg, name)}: " + (
                "the replica groups are the replicas; shard inside each with full_shard" if name == "strategy" else
                "fp16's loss scaler would skip steps another group commits; use bf16")
    try:
        from fullshard.ft.network import check_torchft, host_of
        check_torchft()
        host_of(cfg.ft_bind)
    except FullShardError as e:
        return f"--fault-tolerant: {e}"
    return None


def choice_problem(cfg: TrainConfig) -> str | None:
    """An option that names something unknown."""
    from fullshard.gpt_config import PRESETS
    from fullshard.strategies import STRATEGIES

    choices = {"preset": tuple(PRESETS), "strategy": tuple(STRATEGIES), "precision": ("fp32", "bf16", "fp16"),
               "nonfinite": ("raise", "skip", "off"), "backward_prefetch": ("pre", "post", "none"),
               "plan": ("off", "auto"), "gather": ("exact", "int8", "float8"),
               "reduce": ("exact", "bf16", "int8"), "optimizer": ("adamw", "muon"),
               "outer_dtype": ("fp32", "bf16", "int8")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            return f"unknown {flag(name)} {getattr(cfg, name)!r}; choose one of {', '.join(allowed)}"
    if cfg.wrap not in ("block", "none") and not (cfg.wrap.isdigit() and 1 <= int(cfg.wrap) <= MAX_COUNT):
        return f"--wrap must be 'block', 'none' or a parameter count from 1 to {MAX_COUNT}, not {cfg.wrap!r}"
    for name in ("data", "out"):
        if getattr(cfg, name) is not None and not getattr(cfg, name).strip():
            return f"{flag(name)} is empty; pass a path (or leave the option out for its default)"
    if cfg.memory_budget is not None and parse_bytes(cfg.memory_budget) is None:
        return f"--memory-budget must be a size like 2GiB or 500MB, got {cfg.memory_budget!r}"
    if cfg.plan == "auto" and cfg.memory_budget is None:
        return "--plan auto needs --memory-budget, the bytes each rank may use, e.g. 2GiB or 500MB"
    if cfg.plan != "auto" and cfg.memory_budget is not None:
        return "--memory-budget is the budget --plan auto plans for; add --plan auto (or leave the budget out)"
    if cfg.optimizer != "muon" and cfg.muon_lr != TrainConfig.muon_lr:
        return f"--muon-lr is Muon's learning rate, and --optimizer is {cfg.optimizer}; add --optimizer muon (or " \
               f"leave --muon-lr out)"
    return None


def unused_problem(cfg: TrainConfig, world: int, shard_world: int) -> str | None:
    """--gather or --reduce where nothing is gathered or reduce-scattered: one rank, no_shard (whose
    gradients go by the all-reduce across replicas, in the reduce dtype), or shard groups of one
    rank (`shard_world`); they would be announced and do nothing."""
    used = [name for name in ("gather", "reduce") if getattr(cfg, name) != "exact"]
    if not used or cfg.plan == "auto":
        return None
    why = "one rank has nothing to exchange" if world == 1 else \
        "no_shard gathers nothing and reduces gradients by an all-reduce across replicas" \
        if cfg.strategy == "no_shard" else "each shard group has one rank" if shard_world == 1 else None
    if why is None:
        return None
    flags = " and ".join(f"{flag(name)} {getattr(cfg, name)}" for name in used)
    return f"{flags} would change nothing here: {why}. Leave {'them' if len(used) > 1 else 'it'} out, or shard " \
           f"over more ranks (--nproc, --strategy full_shard)"


def number_problem(cfg: TrainConfig) -> str | None:
    """A number out of its range; NaN and infinity are out of every range."""
    for name in ("steps", "global_batch", "grad_accum", "eval_batches", "eval_interval", "pp"):
        if (problem := range_problem(name, getattr(cfg, name), 1, MAX_COUNT)) is not None:
            return problem
    for name, low in (("replicas", 1), ("sync_every", 0), ("fragments", 1)):
        if (problem := range_problem(name, getattr(cfg, name), low, MAX_COUNT)) is not None:
            return problem
    if not (math.isfinite(cfg.outer_lr) and 0 < cfg.outer_lr <= 10):
        return f"--outer-lr must be a number above 0 and at most 10, got {cfg.outer_lr}"
    if not (math.isfinite(cfg.outer_momentum) and 0 <= cfg.outer_momentum < 1):
        return f"--outer-momentum must be at least 0 and below 1, got {cfg.outer_momentum}"
    for name in ("nproc", "ckpt_interval", "limit_all_gathers", "warmup", "max_restarts"):
        if (problem := range_problem(name, getattr(cfg, name), 0, MAX_COUNT)) is not None:
            return problem
    for name, low, high in (("seq_len", 1, MAX_SEQ), ("sample_bytes", 0, MAX_SAMPLE), ("seed", 0, MAX_SEED)):
        if (problem := range_problem(name, getattr(cfg, name), low, high)) is not None:
            return problem
    for name in ("lr", "min_lr", "weight_decay", "clip", "timeout", "muon_lr"):
        if not math.isfinite(getattr(cfg, name)):
            return f"{flag(name)} must be a finite number, got {getattr(cfg, name)}"
    if not 0 < cfg.timeout <= MAX_TIMEOUT_S:
        return f"--timeout must be a positive number of seconds up to {MAX_TIMEOUT_S:g}, got {cfg.timeout}"
    if cfg.lr <= 0 or cfg.min_lr < 0 or cfg.clip < 0 or cfg.weight_decay < 0 or cfg.muon_lr <= 0:
        return "--lr and --muon-lr must be positive; --min-lr, --clip and --weight-decay must not be negative"
    for name in ("lr", "min_lr", "weight_decay", "muon_lr"):
        if getattr(cfg, name) > MAX_LR:
            return f"{flag(name)} must be at most {MAX_LR:g} (each step moves a weight by about lr), got " \
                   f"{getattr(cfg, name):g}"
    return None


def range_problem(name: str, value: int, low: int, high: int) -> str | None:
    if value < low:
        return f"{flag(name)} must be at least {low}, got {value}" if low else \
            f"{flag(name)} must not be negative, got {value}"
    if value > high:
        return f"{flag(name)} must be at most {high}, got {value}"
    return None


def dims_problem(dims: dict[str, int]) -> str | None:
    """GPT dimensions that cannot build a model, or not one this command builds (beyond the
    largest published models' depth and width)."""
    for name, high in (("n_layer", MAX_LAYERS), ("n_embd", MAX_WIDTH), ("n_head", MAX_WIDTH)):
        if (problem := range_problem(name, dims[name], 1, high)) is not None:
            return problem
    if dims["n_embd"] % dims["n_head"]:
        return f"--n-head {dims['n_head']} must divide the width (--n-embd {dims['n_embd']}) into equal heads"
    return None


def data_problem(cfg: TrainConfig) -> str | None:
    """--data that is missing, or too short for one sequence in each of its two parts."""
    from pathlib import Path

    try:
        if cfg.data is not None and not Path(cfg.data).exists():
            return f"--data {cfg.data}: no such file or directory"
        train, val = corpus_sizes(cfg.data)
    except OSError as e:
        return f"--data {cfg.data[:200]}: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}; pass a " \
               f"text file or a directory of them"
    if min(train, val) < cfg.seq_len + 2:
        return (f"--data {cfg.data}: {train + val} bytes is too little text: its training and validation parts "
                f"({train} and {val} bytes) must each hold a sequence of --seq-len {cfg.seq_len} and one byte more. "
                f"Pass more text or a smaller --seq-len")
    return None


def memory_problem(cfg: TrainConfig, world: int, available: int, where: str) -> str | None:
    """A run that cannot fit in `available` bytes (for `world` ranks): its parameters' shards,
    gradients and AdamW state (16 bytes a parameter over the ranks), the activations of one
    micro-batch (at least 8 floats per token per block, and the logits) and each rank's
    runtime; a lower bound, so a run refused here could not have run."""
    from fullshard.gpt_config import GPTConfig, parameter_count

    dims = gpt_dims(cfg)
    params = parameter_count(GPTConfig(block_size=cfg.seq_len, vocab_size=256, **dims))
    tokens = max(1, cfg.global_batch // (world * cfg.grad_accum)) * cfg.seq_len
    per_rank = RUNTIME_BYTES + 16 * params // world + 4 * tokens * (8 * dims["n_embd"] * dims["n_layer"] + 2 * 256)
    if per_rank * world <= available:
        return None
    return (f"this run needs at least {in_bytes(per_rank)} per rank, {in_bytes(per_rank * world)} for "
            f"{world} ranks ({params / 1e6:,.1f}M parameters at 16 bytes each over the ranks for weights, gradients "
            f"and AdamW state, activations of {tokens} tokens per micro-batch, {RUNTIME_BYTES >> 20} MB of runtime "
            f"per rank), more than the {in_bytes(available)} {where}. Train a smaller model (--preset, "
            f"--n-layer, --n-embd), on fewer tokens per micro-batch (--global-batch, --seq-len, --grad-accum), or "
            f"with fewer ranks here")


def plan_problem(args: argparse.Namespace, budget: int | None) -> str | None:
    """What is wrong with `fullshard plan`'s arguments, in one line; None when nothing is."""
    from fullshard.gpt_config import PRESETS, GPTConfig, parameter_count

    if args.preset not in PRESETS:
        return f"unknown --preset {args.preset!r}; choose one of {', '.join(PRESETS)}"
    if budget is None:
        return f"--memory-budget must be a size like 2GiB or 500MB, got {args.memory_budget!r}"
    for name, high in (("vocab", MAX_VOCAB), ("seq_len", MAX_SEQ), ("batch", MAX_COUNT), ("world_size", MAX_WORLD)):
        if (problem := range_problem(name, getattr(args, name), 1, high)) is not None:
            return problem
    dims = gpt_dims(args)
    if (problem := dims_problem(dims)) is not None:
        return problem
    params = parameter_count(GPTConfig(block_size=args.seq_len, vocab_size=args.vocab, **dims))
    if 2 * params > 1000 * budget * args.world_size:  # beyond any plan (which says how far over a near miss is)
        return (f"a GPT of {params / 1e6:,.1f}M parameters cannot fit in {args.world_size} ranks of --memory-budget "
                f"{args.memory_budget}: its parameters alone, in bf16 and sharded over every rank, take "
                f"{in_bytes(2 * params / args.world_size)} per rank. Pass a larger budget or --world-size, or "
                f"a smaller model")
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
    return int(value * units[unit]) if unit in units and math.isfinite(value) and value > 0 else None


def gpt_dims(options: TrainConfig | argparse.Namespace) -> dict[str, int]:
    """The preset's GPT dimensions, with any of --n-layer, --n-embd, --n-head given instead."""
    from fullshard.gpt_config import PRESETS

    given = {k: v for k in ("n_layer", "n_embd", "n_head") if (v := getattr(options, k)) is not None}
    return {**PRESETS[options.preset], **given}
