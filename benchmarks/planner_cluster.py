"""The planner on paper: predicted memory and step time of large models on A100/H100 clusters.

    .venv/bin/python benchmarks/planner_cluster.py

Nothing is run on a cluster: each model is built on the meta device and given to
fullshard.plan with the "a100"/"h100" hardware figures (fullshard/planner.py). Printed, as
markdown for docs/planner.md:
1. the paper's settings (full shard, bf16, activation checkpointing, per-block units,
   rate limit 2): GPT-175B at batch 1 and 2 per GPU on 128-512 A100s, and T5-11B on
   8-512 A100s, as TFLOPS per GPU;
2. what the planner chooses for GPT 7B/70B/175B shapes on 8-1024 GPUs within 80 GB.
"""

import torch

import fullshard
from fullshard.errors import FullShardError
from fullshard.gpt import GPT, GPTConfig

GPTS = {  # GPT-3-like shapes (4x MLP, learned positions, tied head)
    "GPT-7B": dict(n_layer=32, n_embd=4096, n_head=32, vocab_size=32000),
    "GPT-70B": dict(n_layer=80, n_embd=8192, n_head=64, vocab_size=32000),
    "GPT-175B": dict(n_layer=96, n_embd=12288, n_head=96, vocab_size=50257),
}


def gpt(name: str, seq: int) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(block_size=seq, bias=False, **GPTS[name]))


def t5_11b() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=1024, d_ff=65536, d_kv=128, num_heads=128, num_layers=24, vocab_size=32128,
                      decoder_start_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        return T5ForConditionalGeneration(config)


def paper_setting(model: torch.nn.Module, world: int, batch: int, seq: int, hardware: str) -> fullshard.planner.Candidate:
    """The candidate the paper ran: full shard, bf16, checkpointing, per-block units, limit 2."""
    plan = fullshard.plan(model, world_size=world, memory_budget=1e15, batch=batch, seq=seq, hardware=hardware,
                          precisions=("bf16",), strategies=("full_shard",))
    return next(c for c in plan.candidates
                if c.wrap == "blocks" and c.limit_all_gathers == 2 and c.checkpointing and not c.offload)


def tflops(c: fullshard.planner.Candidate, params: int, tokens: int) -> tuple[float, float]:
    """Per GPU: model FLOPs (6 per parameter per token) and hardware FLOPs (8 with recomputation)."""
    return 6 * params * tokens / c.step_s / 1e12, (8 if c.checkpointing else 6) * params * tokens / c.step_s / 1e12


def main() -> None:
    print("## Paper settings on A100-80GB (full shard, bf16, checkpointing, limit 2)\n")
    print("| model | GPUs | batch/GPU x seq | peak GB/GPU | step s | comm s (unhidden) | TFLOPS/GPU model | "
          "TFLOPS/GPU hardware |")
    print("|---|---|---|---|---|---|---|---|")
    gpt_175b = gpt("GPT-175B", 2048)
    rows = [("GPT-175B", gpt_175b, world, batch, 2048) for batch in (1, 2) for world in (128, 256, 512)]
    t5 = t5_11b()
    rows += [("T5-11B", t5, world, 8, 512) for world in (8, 16, 64, 128, 256, 512)]
    for name, model, world, batch, seq in rows:
        params = sum(p.numel() for p in model.parameters())
        c = paper_setting(model, world, batch, seq, "a100")
        model_tf, hardware_tf = tflops(c, params, batch * seq)
        print(f"| {name} | {world} | {batch} x {seq} | {c.peak / 1e9:.1f} | {c.step_s:.2f} | "
              f"{c.step_s - c.compute_s:.3f} | {model_tf:.0f} | {hardware_tf:.0f} |", flush=True)

    print("\n## What the planner chooses within 80 GB per GPU (batch 1 x 2048 per GPU)\n")
    print("| model | hardware | GPUs | chosen | peak GB/GPU | host GB/GPU | step s | TFLOPS/GPU model |")
    print("|---|---|---|---|---|---|---|---|")
    for name in GPTS:
        model = gpt(name, 2048)
        params = sum(p.numel() for p in model.parameters())
        for hardware in ("a100", "h100"):
            for world in (8, 64, 256, 1024):
                try:
                    plan = fullshard.plan(model, world_size=world, memory_budget=80e9, batch=1, seq=2048,
                                          hardware=hardware, precisions=("bf16",))
                except FullShardError as e:
                    print(f"| {name} | {hardware} | {world} | nothing fits: {str(e).split(';')[1].split('(')[0].strip()} "
                          f"| | | | |", flush=True)
                    continue
                c = plan.chosen
                chosen = (f"{c.strategy}, limit {c.limit_all_gathers}, checkpointing {'on' if c.checkpointing else 'off'}"
                          f"{', offload' if c.offload else ''}")
                print(f"| {name} | {hardware} | {world} | {chosen} | {c.peak / 1e9:.1f} | {c.host / 1e9:.0f} | "
                      f"{c.step_s:.2f} | {tflops(c, params, 2048)[0]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
