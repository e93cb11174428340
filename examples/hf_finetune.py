"""Fine-tune a Hugging Face Llama with fullshard and save it for `from_pretrained`.

    torchrun --nproc_per_node 2 examples/hf_finetune.py                        # a small random Llama
    torchrun --nproc_per_node 2 examples/hf_finetune.py --model-dir path/to/llama

Each LlamaDecoderLayer is one unit; parameters are gathered in bf16 and gradients
reduced in fp32, while the optimizer steps fp32 masters. The text is fed as bytes
(token ids 0-255), which keeps the example free of downloads; with a real checkpoint
you would tokenize with its tokenizer instead.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import fullshard


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="a from_pretrained directory (default: a random small Llama)")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--n-layer", type=int, default=4, help="layers of the random Llama")
    parser.add_argument("--n-embd", type=int, default=128, help="hidden size of the random Llama")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads of the random Llama")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, over all ranks")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="out-llama", help="where save_pretrained writes")
    parser.add_argument("--data", default=None, help="a text file (default: Python's argparse.py)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def load_bytes(path: str | None) -> torch.Tensor:
    """The text as a uint8 tensor: one token per byte."""
    file = Path(path) if path else Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    return torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8)


def get_batch(data: torch.Tensor, step: int, args: argparse.Namespace, rank: int, world: int) -> torch.Tensor:
    """This rank's rows [B/world, T] of the global batch of `step` (the same offsets on every rank)."""
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(len(data) - args.block_size, (args.batch_size,), generator=generator)
    return torch.stack([data[s : s + args.block_size] for s in starts.view(world, -1)[rank]]).long().to(args.device)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    own_group = not dist.is_initialized()  # under torchrun; a test passes its own group
    if own_group:
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(args.device)
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must divide into {world} ranks")

    # model: the same seed on every rank, so random weights agree (pretrained ones do anyway)
    torch.manual_seed(1337)
    if args.model_dir:
        model = LlamaForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    else:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=args.n_embd, intermediate_size=4 * args.n_embd, num_hidden_layers=args.n_layer,
            num_attention_heads=args.n_head, num_key_value_heads=args.n_head, max_position_embeddings=args.block_size))
    model.to(args.device)
    fullshard.shard_model(model, wrap={LlamaDecoderLayer}, mp_policy=fullshard.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after sharding: it steps the shards

    # train: Hugging Face shifts the labels itself
    data = load_bytes(args.data)
    losses = []
    for step in range(args.steps):
        batch = get_batch(data, step, args, rank, world)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        fullshard.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().float()
        dist.all_reduce(total)  # the global batch's loss, the same on every rank
        losses.append(total.item() / world)
        if rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f}")

    # save: every rank helps gather the full weights; rank 0 writes them
    state_dict, _ = fullshard.get_state_dict(model, rank0_only=True)
    if rank == 0:
        model.save_pretrained(args.out, state_dict=state_dict)
    dist.barrier()

    if own_group:
        dist.destroy_process_group()
    return {"losses": losses, "save_dir": args.out, "model": model}


if __name__ == "__main__":
    main()
