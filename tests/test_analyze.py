"""xirang.analyze: the report's totals, its re-pricing at other shapes, its table, and a 70B-shaped
model analysed as one decoder-block kind x80."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from conftest import hf_llama, token_batch
from xirang import analyze

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from analyze_llama70b import llama2_70b  # noqa: E402


def test_flops_at_another_shape_equals_a_retrace_there():
    model = hf_llama(layers=2)
    small = analyze(model, example_kwargs=token_batch(batch=2, seq=16))
    other = analyze(model, example_kwargs=token_batch(batch=3, seq=40))
    assert small.flops_at(batch=3, seq=40) == other.flops
    assert small.flops != other.flops


def test_report_table_lists_blocks_and_totals():
    report = analyze(hf_llama(layers=4), example_kwargs=token_batch())
    text = str(report)
    assert "model.layers.0 .. 3" in text and "LlamaDecoderLayer x4" in text
    assert f"total parameters {report.total_params:,}" in text
    assert "batch=2, seq=16" in text


def test_llama2_70b_shape_on_meta_is_one_block_kind_times_80():
    model = llama2_70b(layers=80)
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    report = analyze(model, example_kwargs={"input_ids": ids, "labels": ids})
    assert [(k.module_type, k.count) for k in report.kinds] == [("LlamaDecoderLayer", 80)]
    assert report.total_params == sum(p.numel() for p in model.parameters())
    assert 68.9e9 < report.total_params < 69.1e9  # Llama-2-70B has 68.98 B parameters
