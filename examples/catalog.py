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


# --- Mixture-of-Experts shapes (issue 35). Each is the Hugging Face class built from the numbers of the model's
# published config.json (cited in each docstring; nothing is downloaded) on meta. Parameter counts against the
# published totals are checked in tests/models/test_catalog_moe.py. Sequence lengths default to those of the
# published training runs in benchmarks/published_moe_configs.json (4096).

def mixtral_8x22b(batch: int = 1, seq: int = 4096):
    """Hugging Face Mixtral at Mixtral-8x22B's shape on meta: 56 layers, hidden 6144, GQA 48/8 heads, 8 experts
    of FFN 16384, top 2, vocab 32000, untied embeddings. Numbers from
    https://huggingface.co/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json (141B total parameters, 39B active:
    https://mistral.ai/news/mixtral-8x22b, "uses only 39B active parameters out of 141B")."""
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(num_hidden_layers=56, hidden_size=6144, intermediate_size=16384, num_attention_heads=48,
                           num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                           max_position_embeddings=65536, rope_theta=1e6, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        return MixtralForCausalLM(config), _tokens(batch, seq)


def deepseek_v3_671b(batch: int = 1, seq: int = 4096):
    """Hugging Face DeepSeek-V3 at DeepSeek-V3's shape on meta: 61 layers, hidden 7168, multi-head latent
    attention (128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128), the first 3
    layers dense (FFN 18432), then 1 shared + 256 routed experts of FFN 2048, top 8 with group-limited routing
    (8 groups, top 4 groups, sigmoid scores with a correction bias, normalised, scaled 2.5), vocab 129280, untied.
    Numbers from https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json. The multi-token-prediction
    module (num_nextn_predict_layers 1) is not built: Hugging Face's class has none, and the report's 671B total
    excludes it (DeepSeek-V3 Technical Report, arXiv:2412.19437, abstract: 671B total, 37B activated; the
    Hugging Face checkpoint's 685B = 671B main model + 14B MTP module: github.com/deepseek-ai/DeepSeek-V3 README)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    config = DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096},
        tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(config), _tokens(batch, seq)


def qwen3_moe_235b(batch: int = 1, seq: int = 4096):
    """Hugging Face Qwen3-MoE at Qwen3-235B-A22B's shape on meta: 94 layers, hidden 4096, GQA 64/4 heads of
    dim 128 with q/k norms, every layer MoE with 128 experts of FFN 1536, top 8 (normalised), vocab 151936,
    untied. Numbers from https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json (235B total, 22B
    activated: that model card)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(num_hidden_layers=94, hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(config), _tokens(batch, seq)


def qwen3_moe_30b_a3b(batch: int = 1, seq: int = 4096):
    """Hugging Face Qwen3-MoE at Qwen3-30B-A3B's shape on meta: 48 layers, hidden 2048, GQA 32/4 heads of dim
    128, 128 experts of FFN 768, top 8 (normalised), vocab 151936, untied. Numbers from
    https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (30.5B total, 3.3B activated: that model
    card). Used by the Megatron-Bridge H100 row of benchmarks/published_moe_configs.json."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(num_hidden_layers=48, hidden_size=2048, intermediate_size=6144,
                            moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(config), _tokens(batch, seq)


def moonlight_16b_a3b(batch: int = 1, seq: int = 4096):
    """Hugging Face DeepSeek-V3 at Moonlight-16B-A3B's shape on meta: 27 layers, hidden 2048, multi-head latent
    attention without a query down-projection (16 heads, q_lora_rank null, kv_lora_rank 512, qk_nope 128 +
    qk_rope 64, v 128), the first layer dense (FFN 11264), then 2 shared + 64 routed experts of FFN 1408, top 6
    (sigmoid scores with a correction bias, one group, normalised, scaled 2.446), vocab 163840, untied, rope theta
    50000, no multi-token prediction. Numbers from
    https://huggingface.co/moonshotai/Moonlight-16B-A3B/blob/main/config.json (read from a verbatim copy in a
    public repository's test; the Hub itself is not reachable here). Published size: 16B total, 3B activated
    (github.com/MoonshotAI/Moonlight README, model table), and 15.29B total excluding the embedding parameters
    (same README, comparison table, footnote: counts exclude the embedding parameters). Used by the
    Megatron-Bridge H100 row of benchmarks/published_moe_configs.json."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    config = DeepseekV3Config(
        vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1, routed_scaling_factor=2.446,
        norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, tie_word_embeddings=False,
        use_cache=False)
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(config), _tokens(batch, seq)


def olmoe_1b_7b(batch: int = 1, seq: int = 4096):
    """Hugging Face OLMoE at OLMoE-1B-7B's shape on meta: 16 layers, hidden 2048, 16 heads with q/k norms,
    64 experts of FFN 1024, top 8 (not renormalised), vocab 50304, untied. Numbers from
    https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json (7B total, 1B active per token: OLMoE paper,
    Muennighoff et al. 2024, arXiv:2409.02060, abstract; 6.9B total, 1.3B active: its Table 1 as quoted by
    https://labindex.ai/outputs/ai2/olmoe, the table itself not read here)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM
    config = OlmoeConfig(num_hidden_layers=16, hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
                         num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                         vocab_size=50304, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        return OlmoeForCausalLM(config), _tokens(batch, seq)


def gpt_oss_120b(batch: int = 1, seq: int = 4096):
    """Hugging Face GPT-OSS at gpt-oss-120b's shape on meta: 36 layers alternating sliding-window (128) and full
    attention, hidden 2880, GQA 64/8 heads of dim 64 with attention sinks, 128 experts of FFN 2880, top 4, vocab
    201088, untied. Numbers from https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json (116.83B total
    parameters, 5.13B active: gpt-oss-120b & gpt-oss-20b Model Card, OpenAI 2025, arXiv:2508.10925, Table 1)."""
    from transformers import GptOssConfig, GptOssForCausalLM
    config = GptOssConfig(num_hidden_layers=36, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
                          vocab_size=201088, sliding_window=128,
                          layer_types=["sliding_attention", "full_attention"] * 18, max_position_embeddings=131072,
                          rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        return GptOssForCausalLM(config), _tokens(batch, seq)
