"""Small Hugging Face Mixture-of-Experts models of five families, built from their config classes
(nothing is downloaded), for the expert-parallel tests (tests/models/test_moe_families.py) and the CLI:

    xirang verify examples/hf_moe.py:qwen3_moe --world 4

Same contract as ``examples/hf_families.py``: ``factory(batch=2, seq=16, device="cpu", step=0) ->
(model, example keyword inputs with labels)``, built after ``torch.manual_seed(0)`` in training mode.
The experts keep the implementation their config defaults to (``experts_implementation`` unset: the
loop over the experts a batch routes to), as a user's model has it; Xirang captures every experts
implementation as the same graph (passes/analysis/experts.py). ``experts=`` picks another one
("batched_mm", "grouped_mm") for the tests that prove it.

Each family has 8 experts (so ep = 2 and 4 hold 4 and 2 each), top 2, two layers, and the auxiliary
load-balancing loss on where the family has one (``output_router_logits=True``), so the router's
gradient through it is checked too.
"""
from __future__ import annotations

from examples.hf_families import FFN, HEADS, HIDDEN, LAYERS, POSITIONS, VOCAB, build_from_config, token_batch

EXPERTS, TOP_K, EXPERT_FFN = 8, 2, 32


def _moe(config_name: str, model_name: str, batch, seq, device, step, experts, **options):
    import transformers
    if experts is not None:
        options["experts_implementation"] = experts
    model = build_from_config(getattr(transformers, config_name), getattr(transformers, model_name), device,
                   num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                   max_position_embeddings=POSITIONS, use_cache=False, **options)
    return model, token_batch(batch, seq, device, step=step)


def mixtral(batch=2, seq=16, device="cpu", step=0, experts=None):
    """Mixtral: 8 experts, top 2, softmax router renormalised over the top k, GQA (4/2), rotary."""
    return _moe("MixtralConfig", "MixtralForCausalLM", batch, seq, device, step, experts, num_key_value_heads=2,
                intermediate_size=EXPERT_FFN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                output_router_logits=True, router_aux_loss_coef=0.02, sliding_window=None)


def qwen3_moe(batch=2, seq=16, device="cpu", step=0, experts=None):
    """Qwen3-MoE: 8 experts, top 2, no renormalisation (norm_topk_prob False), q/k RMSNorm, GQA."""
    return _moe("Qwen3MoeConfig", "Qwen3MoeForCausalLM", batch, seq, device, step, experts, num_key_value_heads=2,
                head_dim=HIDDEN // HEADS, intermediate_size=FFN, moe_intermediate_size=EXPERT_FFN,
                num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=False, output_router_logits=True,
                router_aux_loss_coef=0.02)


def olmoe(batch=2, seq=16, device="cpu", step=0, experts=None):
    """OLMoE: 8 experts, top 2, q/k norm over the whole projection, MHA."""
    return _moe("OlmoeConfig", "OlmoeForCausalLM", batch, seq, device, step, experts, intermediate_size=EXPERT_FFN,
                num_experts=EXPERTS, num_experts_per_tok=TOP_K, output_router_logits=True, router_aux_loss_coef=0.02)


def deepseek_v3(batch=2, seq=16, device="cpu", step=0, experts=None):
    """DeepSeek-V3: multi-head latent attention, a shared expert beside 8 routed ones, sigmoid scores with a
    correction bias, group-limited routing (4 groups, top 2 groups), scaled weights; the first layer dense."""
    return _moe("DeepseekV3Config", "DeepseekV3ForCausalLM", batch, seq, device, step, experts,
                num_key_value_heads=HEADS, intermediate_size=FFN, moe_intermediate_size=EXPERT_FFN,
                n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=TOP_K, n_group=4, topk_group=2,
                first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32,
                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8)


def gpt_oss(batch=2, seq=16, device="cpu", step=0, experts=None):
    """GPT-OSS: 8 experts with biases, top 2, interleaved clamped SwiGLU, attention sinks, sliding and full
    attention layers alternating."""
    return _moe("GptOssConfig", "GptOssForCausalLM", batch, seq, device, step, experts, num_key_value_heads=2,
                head_dim=HIDDEN // HEADS, intermediate_size=EXPERT_FFN, num_local_experts=EXPERTS,
                num_experts_per_tok=TOP_K, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                output_router_logits=True, router_aux_loss_coef=0.02)


FAMILIES = {
    "mixtral": (mixtral, "8 experts top 2, renormalised softmax router, GQA"),
    "qwen3_moe": (qwen3_moe, "8 experts top 2, unnormalised top-k, q/k norm"),
    "olmoe": (olmoe, "8 experts top 2, MHA, q/k norm"),
    "deepseek_v3": (deepseek_v3, "MLA, shared expert, group-limited sigmoid routing, a dense first layer"),
    "gpt_oss": (gpt_oss, "expert biases, clamped interleaved SwiGLU, attention sinks, sliding layers"),
}
