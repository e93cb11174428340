"""A small nanoGPT-shaped language model: the model of the examples, tests and CLI.

Initialization lives in each module's reset_parameters() (N(0, 0.02) weights, zero
biases, residual projections scaled by 1/sqrt(2 * n_layer) as in GPT-2), so a model
built on the meta device and materialized module by module gets the same values as one
built eagerly. The output head reuses the token embedding (weight tying) through
F.linear, so there is no second module that would initialize the tied weight again.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from fullshard.gpt_config import PRESETS, GPTConfig  # noqa: F401  (PRESETS: this model's sizes, by name)


class Linear(nn.Linear):
    """nn.Linear with GPT-2's initialization: N(0, std) weight, zero bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float = 0.02) -> None:
        self.std = std
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding with GPT-2's N(0, 0.02) initialization."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, cfg.bias)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, cfg.bias, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # [B, nh, T, hs]
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # [B, T, C]
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, cfg.bias)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, cfg.bias, std=0.02 / math.sqrt(2 * cfg.n_layer))
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, n_layer Blocks, a final LayerNorm and a tied output head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] for `idx` [B, T]; with `targets`, the mean cross-entropy instead."""
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [B, T, C]
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # [B, T, vocab]
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class GPTStage(nn.Module):
    """Blocks `layers` of a GPT as one stage of a pipeline (`fullshard train --pp`), the
    torchtitan way: the parameters keep the whole model's names (h.<i>. ...), the first stage
    embeds, the last normalizes and predicts. The last stage's output head is a weight of its
    own: tying it to the first stage's embedding would span two stages."""

    def __init__(self, cfg: GPTConfig, layers: range) -> None:
        super().__init__()
        first, last = layers.start == 0, layers.stop == cfg.n_layer
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd) if first else None
        self.wpe = Embedding(cfg.block_size, cfg.n_embd) if first else None
        self.h = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias) if last else None
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False) if last else None

    def example_inputs(self, batch: int, seq: int, device: torch.device) -> tuple[tuple, dict]:
        """What this stage takes (fullshard.plan runs it on fake tensors): token ids into the
        first, activations into the others."""
        if self.wte is not None:
            return (torch.zeros(batch, seq, dtype=torch.long, device=device),), {}
        width = next(iter(self.h.values())).ln_1.normalized_shape[0]
        return (torch.zeros(batch, seq, width, device=device),), {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] into the first stage, activations [B, T, C] between stages, logits
        [B, T, vocab] out of the last."""
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.h.values():
            x = block(x)
        return x if self.lm_head is None else self.lm_head(self.ln_f(x))
