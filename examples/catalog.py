"""Models the CLI can name as ``examples/catalog.py:<factory>``: each factory returns the model (on the
meta device for the big ones: nothing is allocated) and its example keyword inputs."""
from __future__ import annotations

import torch

from examples.gpt import GPTConfig, build_gpt


def _tokens(batch: int, seq: int, device="meta") -> dict:
    # Two tensors: export treats one tensor passed twice as one input.
    return {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device=device),
            "labels": torch.zeros(batch, seq, dtype=torch.long, device=device)}


def gpt_tiny(batch: int = 8, seq: int = 64):
    """The in-repo GPT, 2 layers, hidden 64 (real CPU tensors)."""
    return build_gpt("tiny"), _tokens(batch, seq, device="cpu")


def gpt_tiny_dropout(batch: int = 8, seq: int = 64):
    """The in-repo GPT tiny with dropout 0.1 (embeddings, attention, residuals): ``xirang verify``
    checks it exactly (rng="exact": every rank draws what one device draws)."""
    config = GPTConfig(vocab_size=512, seq_len=64, hidden=64, heads=4, layers=2, dropout=0.1)
    return build_gpt(config), _tokens(batch, seq, device="cpu")


def gpt_175b(batch: int = 1, seq: int = 2048):
    """The in-repo GPT at GPT-3 175B's shape (96 layers, hidden 12288, vocab 51200) on meta."""
    return build_gpt("gpt-175b", device="meta"), _tokens(batch, seq)


def llama2_70b(batch: int = 1, seq: int = 4096):
    """Hugging Face Llama at Llama-2-70B's shape (80 layers, hidden 8192, GQA 64/8 heads) on meta."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                         intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config), _tokens(batch, seq)


def gpt3_175b_hf(batch: int = 1, seq: int = 2048):
    """Hugging Face GPT-2 class at GPT-3 175B's shape (96 layers, hidden 12288, 96 heads, 2048 positions,
    vocab 50257) on meta."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=96, n_embd=12288, n_head=96, n_positions=2048, vocab_size=50257, use_cache=False)
    with torch.device("meta"):
        return GPT2LMHeadModel(config), _tokens(batch, seq)


def llama3_405b(batch: int = 1, seq: int = 8192):
    """Hugging Face Llama at Llama-3-405B's shape (126 layers, hidden 16384, GQA 128/8 heads, FFN 53248,
    vocab 128256) on meta."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=126, hidden_size=16384, num_attention_heads=128, num_key_value_heads=8,
                         intermediate_size=53248, vocab_size=128256, max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config), _tokens(batch, seq)
