"""Small Hugging Face models of many families, built from config classes (nothing is downloaded), for
the family matrix (tests/models/test_family_matrix.py) and the CLI:

    xirang verify examples/hf_families.py:falcon --world 4

Every factory is ``factory(batch=2, seq=16, device="cpu") -> (model, example keyword inputs)``: the
model in training mode with dropout 0, built on ``device`` (``"meta"`` for planning: no memory) after
``torch.manual_seed(0)``, so the same call gives the same weights; the inputs carry labels, so the
model returns its loss. ``seq`` is the token count of the batch (positions tables hold POSITIONS, so a
plan priced at a longer sequence fits the same model); for the vision transformer it is the patch
count (a square), which sets the image size. Token ids are drawn below ``VOCAB_USED`` from a generator
seeded by ``step``.

``FAMILIES`` maps each family name to its factory and the features it covers.
"""
from __future__ import annotations

import math

import torch

VOCAB, VOCAB_USED, HIDDEN, HEADS, LAYERS, FFN, POSITIONS = 512, 500, 64, 4, 2, 128, 128


def token_batch(batch: int, seq: int, device="cpu", *, step: int = 0, names=("input_ids", "labels")) -> dict:
    """Random token ids for every name (different draws), below VOCAB_USED."""
    generator = torch.Generator().manual_seed(step)
    return {name: torch.randint(0, VOCAB_USED, (batch, seq), generator=generator).to(device) for name in names}


def build_from_config(config_class, model_class, device, **options):
    torch.manual_seed(0)
    config = config_class(**options)
    with torch.device(device):
        model = model_class(config)
    return model.train()


def _decoder(config_name, model_name, batch, seq, device, step=0, **options):
    import transformers
    model = build_from_config(getattr(transformers, config_name), getattr(transformers, model_name), device, **options)
    return model, token_batch(batch, seq, device, step=step)


def gpt2(batch=2, seq=16, device="cpu", step=0):
    """GPT-2: learned positions, fused qkv (Conv1D), tied head."""
    return _decoder("GPT2Config", "GPT2LMHeadModel", batch, seq, device, step, n_layer=LAYERS, n_embd=HIDDEN,
                    n_head=HEADS, vocab_size=VOCAB, n_positions=POSITIONS, use_cache=False, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def llama(batch=2, seq=16, device="cpu", step=0):
    """Llama: rotary, RMSNorm, SwiGLU, grouped-query attention (4 heads, 2 kv heads), untied head."""
    return _decoder("LlamaConfig", "LlamaForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FFN,
                    vocab_size=VOCAB, max_position_embeddings=POSITIONS, use_cache=False)


def mistral(batch=2, seq=16, device="cpu", step=0):
    """Mistral: Llama's block with grouped-query attention (4/2), rotary, untied head."""
    return _decoder("MistralConfig", "MistralForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FFN,
                    vocab_size=VOCAB, max_position_embeddings=POSITIONS, sliding_window=None, use_cache=False)


def qwen2(batch=2, seq=16, device="cpu", step=0):
    """Qwen2: grouped-query attention (4/2) with q/k/v biases, rotary, tied head."""
    return _decoder("Qwen2Config", "Qwen2ForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FFN,
                    vocab_size=VOCAB, max_position_embeddings=POSITIONS, tie_word_embeddings=True, use_cache=False)


def gemma(batch=2, seq=16, device="cpu", step=0):
    """Gemma: multi-query attention (4 heads, 1 kv head), GeGLU, scaled embedding, tied head."""
    return _decoder("GemmaConfig", "GemmaForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=1, head_dim=16,
                    intermediate_size=FFN, vocab_size=VOCAB, max_position_embeddings=POSITIONS, use_cache=False)


def falcon(batch=2, seq=16, device="cpu", step=0):
    """Falcon-7B style: multi-query attention, parallel attention + MLP, rotary, tied head."""
    return _decoder("FalconConfig", "FalconForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, multi_query=True, parallel_attn=True,
                    new_decoder_architecture=False, alibi=False, bias=False, vocab_size=VOCAB,
                    max_position_embeddings=POSITIONS, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)


def gpt_bigcode(batch=2, seq=16, device="cpu", step=0, multi_query=True):
    """GPTBigCode (StarCoder): multi-query attention (or, multi_query=False, all heads), learned positions,
    tied head."""
    return _decoder("GPTBigCodeConfig", "GPTBigCodeForCausalLM", batch, seq, device, step, n_layer=LAYERS,
                    n_embd=HIDDEN, n_head=HEADS, multi_query=multi_query, vocab_size=VOCAB, n_positions=POSITIONS,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                    eos_token_id=0)


def bloom(batch=2, seq=16, device="cpu", step=0):
    """Bloom: ALiBi positions, embedding LayerNorm, fused qkv, tied head."""
    return _decoder("BloomConfig", "BloomForCausalLM", batch, seq, device, step, n_layer=LAYERS,
                    hidden_size=HIDDEN, n_head=HEADS, vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                    use_cache=False)


def gptj(batch=2, seq=16, device="cpu", step=0):
    """GPT-J: parallel attention + MLP, partial rotary (interleaved), untied head with bias."""
    return _decoder("GPTJConfig", "GPTJForCausalLM", batch, seq, device, step, n_layer=LAYERS, n_embd=HIDDEN,
                    n_head=HEADS, rotary_dim=8, vocab_size=VOCAB, n_positions=POSITIONS, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)


def gpt_neox(batch=2, seq=16, device="cpu", step=0):
    """GPT-NeoX (Pythia): parallel attention + MLP, partial rotary, fused qkv, untied head."""
    return _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=FFN, rotary_pct=0.5,
                    vocab_size=VOCAB, max_position_embeddings=POSITIONS, hidden_dropout=0.0, attention_dropout=0.0,
                    use_parallel_residual=True, tie_word_embeddings=False, use_cache=False)


def phi(batch=2, seq=16, device="cpu", step=0):
    """Phi-2: parallel attention + MLP sharing one LayerNorm, partial rotary, untied head with bias."""
    return _decoder("PhiConfig", "PhiForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=FFN, partial_rotary_factor=0.5,
                    vocab_size=VOCAB, max_position_embeddings=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0,
                    attention_dropout=0.0, use_cache=False)


def opt(batch=2, seq=16, device="cpu", step=0):
    """OPT: learned positions (offset 2), pre-LayerNorm, ReLU MLP, tied head."""
    return _decoder("OPTConfig", "OPTForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_dim=FFN, word_embed_proj_dim=HIDDEN,
                    vocab_size=VOCAB, max_position_embeddings=POSITIONS, dropout=0.0, attention_dropout=0.0,
                    layerdrop=0.0, use_cache=False)


def mixtral(batch=2, seq=16, device="cpu", step=0):
    """Mixtral: mixture of experts (4 experts, top 2) with grouped-query attention (4/2), rotary.

    The experts run as HF's "batched_mm" implementation (each token's experts' weights gathered by
    index): its default loops over the experts a batch routes to, which is data-dependent control flow
    torch.export cannot capture on fake tensors."""
    return _decoder("MixtralConfig", "MixtralForCausalLM", batch, seq, device, step, num_hidden_layers=LAYERS,
                    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FFN,
                    num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0, vocab_size=VOCAB,
                    max_position_embeddings=POSITIONS, sliding_window=None, use_cache=False,
                    experts_implementation="batched_mm")


def bert(batch=2, seq=16, device="cpu", step=0):
    """BERT with its masked-LM head: encoder-only, bidirectional attention, learned positions, tied head."""
    import transformers
    model = build_from_config(transformers.BertConfig, transformers.BertForMaskedLM, device, num_hidden_layers=LAYERS,
                   hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=FFN, vocab_size=VOCAB,
                   max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return model, token_batch(batch, seq, device, step=step)


def t5(batch=2, seq=16, device="cpu", step=0):
    """T5: encoder-decoder, relative position buckets, RMSNorm, cross-attention, untied head."""
    import transformers
    model = build_from_config(transformers.T5Config, transformers.T5ForConditionalGeneration, device, num_layers=LAYERS,
                   num_decoder_layers=LAYERS, d_model=HIDDEN, d_kv=HIDDEN // HEADS, num_heads=HEADS, d_ff=FFN,
                   vocab_size=VOCAB, dropout_rate=0.0, tie_word_embeddings=False, decoder_start_token_id=0,
                   pad_token_id=0, use_cache=False)
    return model, token_batch(batch, seq, device, step=step)


def bart(batch=2, seq=16, device="cpu", step=0):
    """BART: encoder-decoder, learned positions (offset 2), post-LayerNorm, tied head."""
    import transformers
    model = build_from_config(transformers.BartConfig, transformers.BartForConditionalGeneration, device,
                   encoder_layers=LAYERS, decoder_layers=LAYERS, d_model=HIDDEN, encoder_attention_heads=HEADS,
                   decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, vocab_size=VOCAB,
                   max_position_embeddings=POSITIONS, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                   decoder_start_token_id=2, pad_token_id=1, use_cache=False)
    return model, token_batch(batch, seq, device, step=step)


def vit(batch=2, seq=16, device="cpu", step=0):
    """ViTForImageClassification: patch embedding (a convolution), class token, learned positions,
    encoder blocks, classifier on the class token; pixel inputs and class labels. ``seq`` patches."""
    import transformers
    side = math.isqrt(seq)
    if side * side != seq:
        raise ValueError(f"vit: seq={seq} patches must be a square number")
    patch = 4
    model = build_from_config(transformers.ViTConfig, transformers.ViTForImageClassification, device,
                   num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=FFN,
                   image_size=side * patch, patch_size=patch, num_channels=3, num_labels=10,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    generator = torch.Generator().manual_seed(step)
    inputs = {"pixel_values": torch.randn(batch, 3, side * patch, side * patch, generator=generator),
              "labels": torch.randint(0, 10, (batch,), generator=generator)}
    return model, {name: value.to(device) for name, value in inputs.items()}


FAMILIES = {  # name: (factory, features covered)
    "gpt2": (gpt2, "learned positions, fused qkv, tied head"),
    "llama": (llama, "GQA, rotary, SwiGLU, untied head"),
    "mistral": (mistral, "GQA, rotary, untied head"),
    "qwen2": (qwen2, "GQA with qkv bias, rotary, tied head"),
    "gemma": (gemma, "MQA, rotary, GeGLU, tied head"),
    "falcon": (falcon, "MQA, parallel attn+MLP, rotary, tied head"),
    "gpt_bigcode": (gpt_bigcode, "MQA, learned positions, tied head"),
    "bloom": (bloom, "ALiBi, fused qkv, tied head"),
    "gptj": (gptj, "parallel attn+MLP, partial rotary, untied head"),
    "gpt_neox": (gpt_neox, "parallel attn+MLP, partial rotary, untied head"),
    "phi": (phi, "parallel attn+MLP, partial rotary, untied head"),
    "opt": (opt, "learned positions, ReLU MLP, tied head"),
    "mixtral": (mixtral, "MoE (4 experts, top 2), GQA, rotary"),
    "bert": (bert, "encoder-only, MLM head, learned positions"),
    "t5": (t5, "encoder-decoder, relative position bias, untied head"),
    "bart": (bart, "encoder-decoder, learned positions, tied head"),
    "vit": (vit, "vision: patch conv, class token, pixel inputs"),
}
