"""Hugging Face models from small configs (nothing is downloaded), for the CLI and the examples:

    xirang verify examples/hf_models.py:gpt2_small --world 4
    xirang run examples/hf_models.py:llama_small --world 4 --steps 3
    xirang plan examples/hf_models.py:llama_small --world 2x4 --global-batch 64

Each factory returns (model on CPU with dropout 0, example keyword inputs with labels).
"""
from __future__ import annotations

import torch


def _tokens(batch: int, seq: int, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def gpt2_small(batch: int = 8, seq: int = 32):
    """GPT-2 (tied embeddings, fused QKV Conv1D) with 4 layers, hidden 64, 4 heads."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config), _tokens(batch, seq, config.vocab_size)


def llama_small(batch: int = 8, seq: int = 32):
    """Llama (RMSNorm, rotary, SwiGLU, grouped-query attention 4/2) with 4 layers, hidden 64."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=1000, use_cache=False)
    return LlamaForCausalLM(config), _tokens(batch, seq, config.vocab_size)
