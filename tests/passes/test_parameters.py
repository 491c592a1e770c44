"""Parameter counts equal sum(p.numel()) exactly, tied weights once, for Hugging Face models and ours."""
from __future__ import annotations

import torch

from conftest import HF_MODELS, hf_gpt2, token_batch
from examples.gpt import build_gpt
from xirang import analyze
from xirang.ir.meta_keys import MODULE_PARAMS


def distinct_numel(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def test_hf_parameter_counts_are_exact(hf_model_name):
    model = HF_MODELS[hf_model_name](layers=4)
    report = analyze(model, example_kwargs=token_batch())
    assert report.total_params == distinct_numel(model)
    assert sum(r.params for r in report.rows) == report.total_params


def test_in_repo_gpt_parameter_count_is_exact():
    model = build_gpt("tiny", device="meta")
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    report = analyze(model, example_kwargs={"input_ids": ids, "labels": ids})
    assert report.total_params == distinct_numel(model)


def test_per_module_counts_by_hand():
    # GPT-2 block, hidden h=64: ln_1, ln_2 (2h each), c_attn (h*3h + 3h), c_proj (h*h + h), mlp (h*4h+4h + 4h*h+h)
    h = 64
    block = 2 * (2 * h) + (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
    report = analyze(hf_gpt2(layers=2), example_kwargs=token_batch())
    per_module = MODULE_PARAMS.get(report.graph_module)
    assert per_module["transformer.h.0"] == block == per_module["transformer.h.1"]
    assert per_module["transformer.wte"] == 1000 * h  # the tied LM head is not counted again
    assert "lm_head" not in per_module
