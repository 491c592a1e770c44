"""Small Hugging Face models whose projections are fused or whose layers are not attention, built from
config classes (nothing is downloaded), for the sharded-fraction benchmark
(benchmarks/tp_sharded_fraction.py) and the fused-projection tests (tests/models/test_fused_qkv.py):

    xirang verify examples/hf_fused.py:falcon_gqa --world 2

Same contract as ``examples/hf_families.py``: ``factory(batch=2, seq=16, device="cpu", step=0) ->
(model, example keyword inputs with labels)``, built after ``torch.manual_seed(0)`` in training mode.
"""
from __future__ import annotations

from examples.hf_families import (FFN, HEADS, HIDDEN, LAYERS, POSITIONS, VOCAB, build_from_config, gpt_bigcode,
                                  token_batch)


def _decoder(config_name, model_name, batch, seq, device, step=0, **options):
    import transformers
    model = build_from_config(getattr(transformers, config_name), getattr(transformers, model_name), device, **options)
    return model, token_batch(batch, seq, device, step=step)


def falcon_mha(batch=2, seq=16, device="cpu", step=0):
    """Falcon with one kv head per query head: qkv fused per head ([heads, 3, head_dim]), parallel block."""
    return _decoder("FalconConfig", "FalconForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, multi_query=False, parallel_attn=True,
                    new_decoder_architecture=False, alibi=False, bias=False, vocab_size=VOCAB,
                    max_position_embeddings=POSITIONS, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)


def falcon_gqa(batch=2, seq=16, device="cpu", step=0):
    """Falcon-40B style ("new decoder architecture"): grouped-query qkv fused per kv group
    ([groups, heads/groups + 2, head_dim]), two LayerNorms, parallel block; 8 heads, 2 kv heads."""
    return _decoder("FalconConfig", "FalconForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=2 * HEADS, num_kv_heads=2, new_decoder_architecture=True,
                    parallel_attn=True, alibi=False, bias=False, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                    hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)


def phi3(batch=2, seq=16, device="cpu", step=0):
    """Phi-3: fused qkv_proj ([q | k | v], grouped-query 4/2) and fused gate_up_proj, rotary, untied head."""
    return _decoder("Phi3Config", "Phi3ForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FFN,
                    vocab_size=VOCAB, max_position_embeddings=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0,
                    attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                    use_cache=False)


def gpt_bigcode_mha(batch=2, seq=16, device="cpu", step=0):
    """GPTBigCode without multi-query: c_attn fused as [q | k | v] over all heads."""
    return gpt_bigcode(batch, seq, device, step, multi_query=False)


def mamba(batch=2, seq=16, device="cpu", step=0):
    """Mamba (the slow path, no CUDA kernels): fused in_proj [x | z], depthwise conv, selective scan."""
    return _decoder("MambaConfig", "MambaForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, state_size=8, expand=2, conv_kernel=4, vocab_size=VOCAB, use_cache=False)


def jamba(batch=2, seq=16, device="cpu", step=0):
    """Jamba, a hybrid: a Mamba layer (its PyTorch path: fused in_proj [x | z], depthwise conv, selective scan,
    dt/B/C norms) then an attention layer (4 heads, 2 kv heads), dense SwiGLU MLPs (one expert)."""
    return _decoder("JambaConfig", "JambaForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FFN,
                    vocab_size=VOCAB, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                    expert_layer_offset=1, num_experts=1, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
                    mamba_expand=2, mamba_dt_rank=8, use_cache=False)


def llama_uneven(batch=2, seq=16, device="cpu", step=0):
    """Llama whose head counts and MLP width tp 3 and 4 do not all divide: 6 heads of 16, 3 kv heads, an
    MLP of 110 (11 x 10), so tp pads them (passes/planning/sharding_rules_padded.py)."""
    return _decoder("LlamaConfig", "LlamaForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=110,
                    vocab_size=VOCAB, max_position_embeddings=POSITIONS, use_cache=False)


FAMILIES = {  # name: (factory, what is fused)
    "falcon_mha": (falcon_mha, "qkv fused per head"),
    "falcon_gqa": (falcon_gqa, "qkv fused per kv group (8 heads, 2 kv heads)"),
    "phi3": (phi3, "fused [q | k | v] (4/2) and [gate | up]"),
    "gpt_bigcode_mha": (gpt_bigcode_mha, "fused [q | k | v], all heads"),
    "mamba": (mamba, "fused in_proj [x | z], depthwise conv, selective scan"),
    "jamba": (jamba, "hybrid: a Mamba layer's fused in_proj, an attention layer's q, k, v"),
    "llama_uneven": (llama_uneven, "not fused: 6 heads, 3 kv heads, an MLP of 110 (uneven at tp 2, 3, 4)"),
}
