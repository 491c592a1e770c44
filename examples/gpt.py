"""A GPT written from scratch in plain torch: the model Xirang's examples and cost checks use.

Pre-LayerNorm transformer blocks (Radford et al. 2019), a fused QKV projection with
``F.scaled_dot_product_attention(is_causal=True)``, a GELU MLP of width ``ffn_mult * hidden``, and an
LM head tied to the token embedding. ``gpt_config`` holds presets, including the shapes of the
Megatron-LM paper (Narayanan et al., SC'21, table 1) so FLOP and memory estimates can be checked
against its formulas.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int  # maximum positions (size of the learned position embedding)
    hidden: int
    heads: int
    layers: int
    ffn_mult: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    # "sdpa": F.scaled_dot_product_attention (a fused kernel that keeps no seq x seq tensor);
    # "eager": scores, causal mask, softmax, dropout and the product with V as separate ops, as
    # Megatron-LM ran in 2021 (Narayanan et al.), so its seq² memory traffic is priced.
    attention: str = "sdpa"

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"attention must be 'sdpa' or 'eager', got {self.attention!r}")


_PRESETS = {
    "tiny": GPTConfig(vocab_size=512, seq_len=64, hidden=64, heads=4, layers=2),
    # Narayanan et al. 2021, table 1: vocabulary 51,200 and sequence 2048 for every row.
    "gpt-1.7b": GPTConfig(vocab_size=51200, seq_len=2048, hidden=2304, heads=24, layers=24),
    "gpt-175b": GPTConfig(vocab_size=51200, seq_len=2048, hidden=12288, heads=96, layers=96),
}


def gpt_config(name: str) -> GPTConfig:
    """A preset configuration by name: 'tiny', 'gpt-1.7b', 'gpt-175b'."""
    try:
        return _PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown GPT preset {name!r}; known: {sorted(_PRESETS)}") from None


class Attention(nn.Module):
    """Multi-head causal self-attention: one Linear makes q, k and v, one Linear projects back."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.dropout = config.dropout
        self.eager = config.attention == "eager"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=-1)
        # (batch, seq, hidden) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.eager:
            y = self._eager_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, seq, hidden)
        return self.proj(y)

    def _eager_attention(self, q, k, v):
        """softmax(q kᵀ / sqrt(d) + causal mask) v with dropout on the probabilities; q is scaled
        first, which is exact and saves a pass over the seq x seq scores."""
        seq = q.shape[-2]
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return F.dropout(probs, self.dropout, self.training) @ v


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden, config.ffn_mult * config.hidden)
        self.down = nn.Linear(config.ffn_mult * config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)): the pre-LayerNorm residual block."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2's initialisation (Radford et al. 2019): weights N(0, 0.02), biases zero. PyTorch's
        default N(0, 1) embedding, tied to the head, would start the loss near 40 instead of ln(vocab)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab), or the mean cross-entropy when ``labels`` is given.

        ``labels`` are already aligned with the inputs: position t is trained to predict labels[t].
        """
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.dropout(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build_gpt(name_or_config: str | GPTConfig, device: torch.device | str | None = None) -> GPT:
    """A GPT from a preset name or a config; ``device="meta"`` allocates nothing."""
    config = gpt_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return GPT(config)

