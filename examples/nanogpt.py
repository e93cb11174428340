"""Train a byte-level GPT with fullshard, written the way nanoGPT's train.py is.

    torchrun --nproc_per_node 2 examples/nanogpt.py --steps 200     # 2 ranks (gloo on CPU, NCCL on GPUs)
    python examples/nanogpt.py --steps 50                            # 1 process
    python examples/nanogpt.py --data input.txt                      # your own text

Every rank builds the same model (same seed), shards it, and trains on its slice of
each global batch; the result equals single-process training on the whole batch.
Running the same command again resumes from <out>/ckpt.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

import fullshard
from fullshard.gpt import GPT, Block, GPTConfig

# Python's own source: text to train on that every machine already has
STDLIB_FILES = ("argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "typing.py")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to train to")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128, help="context length in bytes")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-step, over all ranks")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-steps per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    parser.add_argument("--lr-decay-steps", type=int, default=None, help="cosine decay length (default: --steps)")
    parser.add_argument("--eval-interval", type=int, default=100, help="evaluate and save every this many steps")
    parser.add_argument("--eval-iters", type=int, default=10, help="batches per split in each evaluation")
    parser.add_argument("--sample-len", type=int, default=200, help="bytes to generate at the end")
    parser.add_argument("--out", default="out-nanogpt", help="directory for the checkpoint")
    parser.add_argument("--data", default=None, help="a text file (default: a few stdlib modules)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def load_bytes(path: str | None) -> torch.Tensor:
    """The text as a uint8 tensor: one token per byte, so no tokenizer is needed."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [Path(path)] if path else [stdlib / name for name in STDLIB_FILES]
    return torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)


def get_batch(data: torch.Tensor, seed: int, args: argparse.Namespace, rank: int, world: int):
    """This rank's rows of the global batch drawn with `seed`. Every rank draws the same
    offsets and keeps its own slice, so together they see exactly one process's batch."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - args.block_size - 1, (args.batch_size,), generator=generator)
    rows = torch.stack([data[s : s + args.block_size + 1] for s in starts.view(world, -1)[rank]]).long()
    return rows[:, :-1].to(args.device), rows[:, 1:].to(args.device)  # [B/world, T] each


def get_lr(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    decay_steps = args.lr_decay_steps or args.steps
    progress = min(1.0, (step - args.warmup) / max(1, decay_steps - args.warmup))
    return args.lr / 10 + 0.5 * (args.lr - args.lr / 10) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8) -> torch.Tensor:
    """Append `new_tokens` sampled bytes to `idx` [1, T]; the seed makes it repeatable."""
    generator = torch.Generator(idx.device).manual_seed(1337)
    for _ in range(new_tokens):
        logits = model(idx[:, -model.cfg.block_size :])[:, -1] / temperature  # [1, vocab]
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)], dim=1)
    return idx


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    # process group: torchrun's, a test's, or a group of one for a plain `python` run
    own_group = not dist.is_initialized()
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    if own_group and "RANK" in os.environ:
        dist.init_process_group(backend)
    elif own_group:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
        torch.cuda.set_device(args.device)
    master = rank == 0
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must divide into {world} ranks")

    data = load_bytes(args.data)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]

    # model: the same seed on every rank, so every rank starts from the same weights
    torch.manual_seed(1337)
    cfg = GPTConfig(block_size=args.block_size, vocab_size=256, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    model = GPT(cfg).to(args.device)
    fullshard.shard_model(model, wrap={Block})  # each Block one unit, the rest the root's
    # the optimizer after sharding: it must hold the sharded parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    ckpt = Path(args.out) / "ckpt"
    iter_num, val_loss = 0, float("nan")
    if (ckpt / "LATEST").is_file():
        meta = fullshard.load(ckpt, model, optimizer)
        iter_num, val_loss = meta["step"], meta["extra"]["val_loss"]
        if master:
            print(f"resumed at step {iter_num} (val loss {val_loss:.4f})")
    resumed_from = iter_num

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        """Mean loss per split over the same batches each time; every rank runs the
        sharded forward on its slice, and the ranks' means are averaged."""
        model.eval()
        out = {}
        for name, split_data in (("train", train_data), ("val", val_data)):
            total = torch.zeros((), device=args.device)
            for k in range(args.eval_iters):
                total += model(*get_batch(split_data, -1 - k, args, rank, world))
            dist.all_reduce(total)
            out[name] = total.item() / (args.eval_iters * world)
        model.train()
        return out

    # train
    losses = []
    while iter_num < args.steps:
        lr = get_lr(iter_num, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = torch.zeros((), device=args.device)
        for micro_step in range(args.grad_accum):
            # reduce gradients only after the last micro-step, as with DDP
            model.require_backward_grad_sync = micro_step == args.grad_accum - 1
            x, y = get_batch(train_data, iter_num * args.grad_accum + micro_step, args, rank, world)
            loss = model(x, y) / args.grad_accum
            loss.backward()
            step_loss += loss.detach()
        grad_norm = fullshard.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        dist.all_reduce(step_loss)  # the loss of the whole global batch, the same on every rank
        losses.append(step_loss.item() / world)
        if master:
            print(f"step {iter_num}: loss {losses[-1]:.4f}, lr {lr:.2e}, grad norm {grad_norm.item():.3f}")
        if iter_num % args.eval_interval == 0 or iter_num == args.steps:
            split_losses = estimate_loss()
            val_loss = split_losses["val"]
            if master:
                print(f"step {iter_num}: train {split_losses['train']:.4f}, val {val_loss:.4f}")
            fullshard.save(ckpt, model, optimizer, step=iter_num,
                           extra={"val_loss": val_loss, "config": dataclasses.asdict(cfg)})

    # sample: every rank enters the context; only rank 0 holds the full weights and generates
    sample = ""
    model.eval()
    with fullshard.full_params(model, rank0_only=True, writeback=False):
        if master:
            prompt = torch.tensor([list(b"def ")], device=args.device)
            sample = bytes(generate(model, prompt, args.sample_len)[0].tolist()).decode(errors="replace")
            print(sample)
    model.train()

    if own_group:
        dist.barrier()
        dist.destroy_process_group()
    return {"losses": losses, "val_loss": val_loss, "sample": sample, "resumed_from": resumed_from}


if __name__ == "__main__":
    main()
