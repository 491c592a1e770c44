"""The big Mixture-of-Experts shapes of examples/catalog.py (issue 35) build on meta, hold the published
total parameter count within 1%, and match the expert layout recorded for them in
benchmarks/published_moe_configs.json. Meta only: nothing is allocated or downloaded (every parameter and
buffer is on meta; the build time is printed, not asserted: speed is a benchmark's business, issue 38).

Run ``python -m pytest -q tests/models/test_catalog_moe.py -s`` to see the table."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from examples import catalog

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED_RUNS = ROOT / "benchmarks" / "published_moe_configs.json"

# name -> (published total parameters, where it is published)
PUBLISHED_TOTALS = {
    "mixtral_8x22b": (141e9, "mistral.ai/news/mixtral-8x22b: '39B active parameters out of 141B'"),
    "deepseek_v3_671b": (671e9, "arXiv:2412.19437 abstract: 671B total (MTP module excluded)"),
    "qwen3_moe_235b": (235e9, "Qwen/Qwen3-235B-A22B model card: '235B in total and 22B activated'"),
    "qwen3_moe_30b_a3b": (30.5e9, "Qwen/Qwen3-30B-A3B model card: '30.5B in total and 3.3B activated'"),
    "moonlight_16b_a3b": (16e9, "github.com/MoonshotAI/Moonlight README, model table: '#Total Params 16B'"),
    "olmoe_1b_7b": (6.9e9, "OLMoE arXiv:2409.02060 Table 1 (as quoted by labindex.ai): 6.9B total"),
    "gpt_oss_120b": (116.83e9, "gpt-oss model card arXiv:2508.10925 Table 1: 116.83B total"),
}

_built: dict = {}


def _build(name: str):
    if name not in _built:
        started = time.perf_counter()
        model, inputs = getattr(catalog, name)()
        _built[name] = (model, inputs, time.perf_counter() - started)
    return _built[name]


def _experts(model) -> tuple[int, int, int]:
    """(experts, top-k, expert FFN width) read from the model's config, whatever the family calls them."""
    c = model.config
    experts = getattr(c, "n_routed_experts", None) or getattr(c, "num_local_experts", None) or c.num_experts
    width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    return experts, c.num_experts_per_tok, width


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_builds_on_meta_with_the_published_parameter_count(name):
    model, inputs, seconds = _build(name)
    counted = sum(p.numel() for p in model.parameters())
    published, where = PUBLISHED_TOTALS[name]
    print(f"\n{name:<20} {counted / 1e9:10.3f}B counted  {published / 1e9:8.2f}B published  "
          f"{(counted - published) / published:+.2%}  built in {seconds:.1f}s  ({where})")
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    assert abs(counted - published) <= 0.01 * published, (name, counted, published)
    assert set(inputs) == {"input_ids", "labels"}
    assert inputs["input_ids"].device.type == "meta" and inputs["input_ids"].dtype == torch.long
    assert inputs["input_ids"].shape == inputs["labels"].shape


def test_deepseek_v3_shape_details():
    model, _, _ = _build("deepseek_v3_671b")
    c = model.config
    assert (c.n_shared_experts, c.n_routed_experts, c.num_experts_per_tok) == (1, 256, 8)
    assert (c.n_group, c.topk_group, c.first_k_dense_replace) == (8, 4, 3)
    assert (c.q_lora_rank, c.kv_lora_rank) == (1536, 512)
    layers = model.model.layers
    assert not hasattr(layers[2].mlp, "experts") and hasattr(layers[3].mlp, "experts")


def test_moonlight_without_embeddings_holds_the_published_count():
    """The Moonlight README's comparison table gives 15.29B total parameters, its footnote saying the counts
    exclude the embedding parameters: the input embedding and the untied output head (163840 x 2048 each)."""
    model, _, _ = _build("moonlight_16b_a3b")
    counted = sum(p.numel() for p in model.parameters())
    counted -= model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    assert abs(counted - 15.29e9) <= 0.001 * 15.29e9, counted
    c = model.config
    assert (c.n_shared_experts, c.n_routed_experts, c.num_experts_per_tok, c.first_k_dense_replace) == (2, 64, 6, 1)
    assert c.q_lora_rank is None and c.kv_lora_rank == 512
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "experts") and hasattr(layers[1].mlp, "experts")


def test_published_runs_name_catalog_factories_with_their_expert_layout():
    rows = json.loads(PUBLISHED_RUNS.read_text())["rows"]
    assert len(rows) >= 4
    for row in rows:
        path, name = row["model"]["factory"].split(":")
        assert path == "examples/catalog.py" and hasattr(catalog, name), row["id"]
        model, _, _ = _build(name)
        moe = row["moe"]
        assert _experts(model) == (moe["num_experts"], moe["top_k"], moe["expert_intermediate"]), row["id"]
        assert getattr(model.config, "n_shared_experts", 0) == moe["shared_experts"], row["id"]
        assert row["published"], row["id"]
        for degree in ("tp", "pp", "ep"):
            assert row[degree] is None or row["gpus"] % row[degree] == 0, (row["id"], degree)
