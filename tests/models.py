"""Small models for parity tests, each with the situation it exercises, and its data.

Every model is a factory taking no arguments (seeded by the caller) and has a loss
function `(model, batch) -> scalar` that is a mean over the batch's first dimension, so
the mean of the ranks' losses on equal slices is the loss on the whole batch.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from fullshard.gpt import GPT, Block, GPTConfig

VOCAB = 61  # prime: uneven shards of the embedding at every world size
SEQ = 8


def tiny_gpt() -> GPT:
    # n_embd 30 splits 8/8/8/6 over 4 ranks; 61 vocab rows split 16/16/16/13
    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=30))


def token_batch(generator: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    return x, torch.roll(x, -1, dims=1)


def overfit(model: nn.Module, steps: int) -> list[float]:
    """AdamW (lr 1e-2) on one batch per rank of a sharded GPT: the losses, falling."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = token_batch(torch.Generator().manual_seed(torch.distributed.get_rank()), 2)
    losses = []
    for _ in range(steps):
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(*batch)


class TwiceGPT(nn.Module):
    """One block applied twice per forward (weight sharing across depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny_gpt()
        self.shared = Block(self.gpt.cfg)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.size(1)))
        x = self.shared(self.shared(x))
        for block in g.h:
            x = block(x)
        logits = F.linear(g.ln_f(x), g.wte.weight)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


@dataclass
class Features:
    hidden: torch.Tensor
    gate: torch.Tensor


class Structured(nn.Module):
    """A unit whose output is a `kind` of structure: tuple, dict or dataclass."""

    def __init__(self, dim: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor):
        hidden, gate = torch.tanh(self.proj(x)), torch.sigmoid(self.gate(x))
        if self.kind == "tuple":
            return hidden, gate
        if self.kind == "dict":
            return {"hidden": hidden, "gate": gate}
        return Features(hidden, gate)


def unpack(out) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(out, tuple):
        return out
    if isinstance(out, dict):
        return out["hidden"], out["gate"]
    return out.hidden, out.gate


class Situations(nn.Module):
    """Many awkward cases in one model (dims prime, so shards are uneven everywhere).

    - structured outputs (tuple, dict, dataclass) of which the loss uses only a part;
    - a branch never called, and a unit whose gate output is unused on odd steps;
    - a frozen parameter (requires_grad=False) inside a trained unit;
    - 0-d and 1-d parameters, and a parameter with fewer rows than ranks (empty shards).
    """

    def __init__(self) -> None:
        super().__init__()
        d = 13
        self.embed = nn.Linear(5, d)
        self.blocks = nn.ModuleList(Structured(d, kind) for kind in ("tuple", "dict", "dataclass"))
        self.unused = nn.Linear(d, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.weight.requires_grad_(False)
        self.temperature = nn.Parameter(torch.tensor(1.5))  # 0-d
        self.offset = nn.Parameter(torch.randn(3))  # 1-d, 3 rows: empty shard on rank 3 of 4
        self.head = nn.Linear(d, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.embed(x)
        for block in self.blocks:
            hidden, gate = unpack(block(h))
            h = hidden * gate if self.calls % 2 == 0 else hidden  # gate unused on odd calls
        h = self.frozen(h)
        logits = self.head(h) / self.temperature + self.offset
        return F.cross_entropy(logits, y)


def situations_batch(generator: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 5, generator=generator), torch.randint(0, 3, (batch,), generator=generator)


class CheckpointedGPT(GPT):
    """GPT whose blocks run under torch.utils.checkpoint (forward recomputed in backward)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__(tiny_gpt().cfg)
        self.reentrant = reentrant

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class InnerCheckpointBlock(Block):
    """A block that checkpoints only its MLP: part of a unit recomputed in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + checkpoint(lambda t: self.mlp(self.ln_2(t)), x, use_reentrant=False)


def inner_checkpoint_gpt() -> GPT:
    model = tiny_gpt()
    for i in range(len(model.h)):
        block = InnerCheckpointBlock(model.cfg)
        block.load_state_dict(model.h[i].state_dict())
        model.h[i] = block
    return model


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=24, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)  # lm_head.weight is tied to transformer.wte.weight


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def hf_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, _ = batch
    return model(input_ids=x, labels=x).loss


# name -> (factory, batch maker, loss, unit classes for fully_shard / shard_model)
MODELS = {
    "gpt": (tiny_gpt, token_batch, gpt_loss, {Block}),
    "twice": (TwiceGPT, token_batch, gpt_loss, {Block}),
    "situations": (Situations, situations_batch, gpt_loss, {Structured, nn.Linear}),
    "checkpoint_reentrant": (lambda: CheckpointedGPT(True), token_batch, gpt_loss, {Block}),
    "checkpoint_nonreentrant": (lambda: CheckpointedGPT(False), token_batch, gpt_loss, {Block}),
    "checkpoint_inner": (inner_checkpoint_gpt, token_batch, gpt_loss, {Block}),
}


def hf_units(name: str) -> set[type]:
    if name == "hf_gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        return {GPT2Block}
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return {LlamaDecoderLayer}


def model_spec(name: str):
    if name in MODELS:
        return MODELS[name]
    factory = {"hf_gpt2": hf_gpt2, "hf_llama": hf_llama}[name]
    return factory, token_batch, hf_loss, hf_units(name)


# ---- stream-model runs (tests/test_streams.py, tests/test_gpu_paths.py) ---------------------

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
SENT = {"bf16": torch.bfloat16, "int8": torch.int8}  # reduce_send_dtype, Note [low-precision reductions]


@functools.cache
def named_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """One mesh per shape and dim names per rank process: building one creates process groups."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def hybrid_mesh(replicas: int, shard: int):
    return named_mesh((replicas, shard), ("replicate", "shard"))


def build(strategy: str, precision: str, offload: bool, mode: str, n_layer: int = 2) -> GPT:
    """A GPT (no biases: fewer parameters, the same code paths) of `n_layer` block units
    and a root, sharded by `strategy` ("full_shard", "shard_grad_op", "no_shard",
    "hybrid_f1"/"hybrid_f2": shard groups of 1/2, "reshard_to_2": reshard_after_forward=2),
    in `precision` ("fp32", "bf16", "fp16"; "+bf16"/"+int8" after it: gradients sent so), with
    prefetch unless `mode` is "no_prefetch"."""
    import fullshard
    from fullshard.init import shard_unit  # fully_shard with shard_model's prefetch schedule
    from fullshard.options import Schedule

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=n_layer, n_head=2, n_embd=30, bias=False))
    compute, _, send = precision.partition("+")  # "bf16+int8": bf16 compute, gradients sent as int8
    mp = fullshard.MixedPrecisionPolicy(param_dtype=LOW.get(compute), reduce_send_dtype=SENT.get(send)) \
        if compute in LOW or send else None
    policy = fullshard.CPUOffloadPolicy() if offload else None
    prefetch = mode != "no_prefetch"
    options = dict(mp_policy=mp, offload_policy=policy)
    if strategy == "reshard_to_2":
        schedule = Schedule(prefetch_before_backward=prefetch, forward_prefetch=prefetch, limit=2)
        for module, k in [*((block, 2) for block in model.h), (model, True)]:
            shard_unit([module], type(module).__name__, mesh=None, reshard_after_forward=k, shard_placement_fn=None,
                       ignored=(), dp_mesh_dims=None, exclude=(), schedule=schedule, **options)
    else:
        world = dist.get_world_size()
        mesh = {"hybrid_f1": hybrid_mesh(world, 1), "hybrid_f2": hybrid_mesh(world // 2, 2)}.get(strategy)
        fullshard.shard_model(model, wrap={Block}, mesh=mesh,
                              strategy="hybrid_shard" if strategy.startswith("hybrid") else strategy,
                              backward_prefetch="pre" if prefetch else None, forward_prefetch=prefetch, **options)
    # as the CLI sets it: fp16's overflow steps are the GradScaler's to skip
    model.set_nonfinite_grads(None if precision == "fp16" else "raise")
    return model


def train_modelled(model: GPT, model_rt, precision: str, mode: str, steps: int) -> list[int]:
    """Train `steps` steps (SGD) under `model_rt`, a fullshard.testing.stream_model.StreamModel;
    return the host syncs of each step. `mode`: "prefetch"/"no_prefetch" (one backward
    per step), "accumulate" (two), "no_sync" (two, the first under fullshard.no_sync)."""
    import fullshard
    from tests.reference import global_batches, local_slice

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    scaler = fullshard.GradScaler("cpu", init_scale=2.0**8) if precision == "fp16" else None
    micro = 1 if mode in ("prefetch", "no_prefetch") else 2
    rank, world = dist.get_rank(), dist.get_world_size()
    syncs = []
    for step, batch in enumerate(global_batches(token_batch, steps, 4 * micro)):
        before = model_rt.host_syncs
        with model_rt.counting_scalars():
            for i in range(micro):
                part = tuple(t.chunk(micro)[i] for t in batch)
                quiet = fullshard.no_sync(model) if mode == "no_sync" and i == 0 else contextlib.nullcontext()
                with quiet:
                    loss = model(*local_slice(part, rank, world)) / micro
                    (scaler.scale(loss) if scaler else loss).backward()
                model_rt.check_joined(f"step {step}, end of backward {i}")
            if scaler:
                scaler.unscale_(optimizer)
            fullshard.clip_grad_norm_(model, 1.0)
        syncs.append(model_rt.host_syncs - before)
        for p in model.parameters():  # the optimizer reads gradients and writes shards (the host with offload)
            if p.grad is not None:
                model_rt.reads(p.grad)
            model_rt.writes(p)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    return syncs


# ---- a Llama-style model for tensor parallelism (test_tensor_parallel.py) ----------------------
# Sizes divide by 4 TP ranks: 4 heads of 8, 64 vocabulary rows, 48 hidden MLP features.
TP_VOCAB, TP_DIM, TP_HEADS, TP_HIDDEN = 64, 32, 4, 48


class TPAttention(nn.Module):
    """Causal attention with separate q/k/v/o projections, so TP splits it by heads: each rank
    sees its heads' columns of wq/wk/wv (the head count comes from the local width)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(TP_DIM, TP_DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, TP_DIM // TP_HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, local heads, T, head dim]
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class TPFeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(TP_DIM, TP_HIDDEN, bias=False), nn.Linear(TP_DIM, TP_HIDDEN, bias=False)
        self.w2 = nn.Linear(TP_HIDDEN, TP_DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TPNorm(nn.RMSNorm):
    def __init__(self) -> None:
        super().__init__(TP_DIM)

    def reset_parameters(self) -> None:  # weights away from 1, so that their gradients matter
        nn.init.uniform_(self.weight, 0.5, 1.5)


class TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = TPNorm(), TPNorm()
        self.attention, self.feed_forward = TPAttention(), TPFeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TPLlama(nn.Module):
    def __init__(self, n_layer: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(TP_VOCAB, TP_DIM)
        self.layers = nn.ModuleList(TPBlock() for _ in range(n_layer))
        self.norm, self.output = TPNorm(), nn.Linear(TP_DIM, TP_VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, TP_VOCAB), targets.reshape(-1))


def tp_token_batch(generator: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, TP_VOCAB, (batch, SEQ), generator=generator)
    return x, torch.roll(x, -1, dims=1)


def tp_plan() -> dict:
    """PyTorch's Llama recipe as one parallelize_module plan: heads and MLP features split
    (colwise in, rowwise out), norms and the residual stream sequence-parallel, the
    vocabulary split in the embedding and head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    gathered = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(), "layers.*.attention": gathered,
        **{f"layers.*.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(), "layers.*.feed_forward": gathered,
        "layers.*.feed_forward.w1": ColwiseParallel(), "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def tensor_parallel(model: TPLlama, tp_mesh) -> TPLlama:
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, tp_mesh, tp_plan())
