"""The GPT's dimensions (its config, the named sizes, its parameter count), apart from the
model and without torch: `fullshard train` checks and sizes a run from them in its launcher,
which starts the ranks without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


# Named sizes (vocabulary 256: bytes), for the CLI and the benchmark.
PRESETS = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64},  # ~0.1M parameters: tests
    "small": {"n_layer": 6, "n_head": 6, "n_embd": 192},  # ~2.7M: the default `fullshard train`
    "15m": {"n_layer": 8, "n_head": 6, "n_embd": 384},  # ~14M
    "100m": {"n_layer": 15, "n_head": 12, "n_embd": 768},  # ~106M
}


def parameter_count(cfg: GPTConfig) -> int:
    """The parameters of GPT(cfg), from its dimensions alone (the CLI sizes a run before building it)."""
    d, bias = cfg.n_embd, int(cfg.bias)
    block = 12 * d * d + (11 * bias + 2) * d  # c_attn, c_proj, c_fc, c_proj, 2 LayerNorms
    return (cfg.vocab_size + cfg.block_size) * d + cfg.n_layer * block + (1 + bias) * d
