"""Generation a token at a time: the plain model, the sharded model, and the sharded model
inside full_params (the fast path: no communication per token).

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/generation.py [rounds]

A small Llama from `transformers` (random weights), greedy decoding of 32 tokens from a
16-token prompt, batch 1, on every rank. The three ways alternate (A B C A B C ...) and
each is reported as its median time and its ratio to the plain model's; ranks run with
one thread each. The sharded model gathers every unit at every token; inside
`full_params(model, writeback=False)` it computes with the full parameters it gathered
once, as the plain model does.
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import fullshard

dist.init_process_group("gloo")
torch.set_num_threads(1)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
torch.manual_seed(0)
plain = LlamaForCausalLM(cfg).eval()
sharded = LlamaForCausalLM(cfg).eval()
sharded.load_state_dict(plain.state_dict())
fullshard.shard_model(sharded, wrap={LlamaDecoderLayer})
prompt = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))


def generate(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)


def in_full_params() -> torch.Tensor:
    with fullshard.full_params(sharded, writeback=False):
        return generate(sharded)


ways = {"plain model": lambda: generate(plain), "sharded": lambda: generate(sharded),
        "sharded, inside full_params": in_full_params}
times: dict[str, list[float]] = {name: [] for name in ways}
outputs = {}
for _ in range(rounds + 1):  # the first round warms up
    for name, run in ways.items():
        dist.barrier()
        start = time.perf_counter()
        outputs[name] = run()
        times[name].append(time.perf_counter() - start)
assert all(torch.equal(out, outputs["plain model"]) for out in outputs.values())  # the same tokens
if dist.get_rank() == 0:
    base = statistics.median(times["plain model"][1:])
    print(f"world {dist.get_world_size()}, {rounds} rounds, 32 tokens each\n")
    print("| way | median s | ratio to plain |\n|---|---|---|")
    for name, measured in times.items():
        median = statistics.median(measured[1:])
        print(f"| {name} | {median:.3f} | {median / base:.2f} |")
dist.destroy_process_group()
