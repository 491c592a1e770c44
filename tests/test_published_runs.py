"""benchmarks/published_runs.json and the helpers of benchmarks/published_runs.py: every row names a source the
file cites and a mesh that covers its GPUs; each FLOP convention is the formula its source states; the 2024
Megatron-LM H100 GPTs build with their untied embeddings. No big model is planned here (the benchmark does)."""
from __future__ import annotations

import importlib.util

import pytest

from tests.docs.doc_blocks import REPO
from xirang.passes.planning.cost_model import megatron_flops


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("published_runs", REPO / "benchmarks" / "published_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_row_cites_a_source_and_fills_its_gpus(bench):
    import json
    sources = json.loads(bench.RUNS.read_text())["sources"]
    rows = bench.load_rows()
    assert len({row["id"] for row in rows}) == len(rows) >= 29
    for row in rows:
        assert row["source"] in sources, row["id"]
        assert row["gpus"] % (row["tp"] * row["pp"]) == 0, row["id"]
        dp = row["gpus"] // (row["tp"] * row["pp"])
        if row["micro_batch"] is not None:
            assert row["global_batch"] % (dp * row["micro_batch"]) == 0, row["id"]
        assert row["flops"] in {"megatron_hardware", "megatron_model", "model"}, row["id"]


def test_megatron_model_flops_are_megatron_lms_own_count(bench):
    """Megatron-LM's num_floating_point_operations (2024) for a GPT: 12·B·s·l·h²·(2 + s/h + 4 + V/(2lh)),
    worked by hand for the 1.7B row: 72·192·4096·24·2048²·(1 + 1/3 + 131072/(12·24·2048))."""
    row = next(row for row in bench.load_rows() if row["id"] == "mlm24-1.7b")
    flops = bench.source_flops(row, report=None)
    assert flops == megatron_flops(192, 4096, 24, 2048, 131072, recompute=False)
    assert flops == pytest.approx(72 * 192 * 4096 * 24 * 2048**2 * (1 + 1 / 3 + 131072 / (12 * 24 * 2048)))
    # published 408.8 TFLOP/s on 48 GPUs is then a 0.452 s step
    assert flops / (408.8e12 * 48) == pytest.approx(0.4522, rel=1e-3)


def test_megatron_lm_2024_gpts_have_untied_embeddings(bench):
    """1.7B = 12·l·h² + 2·V·h only with the output layer apart from the input embedding."""
    row = next(row for row in bench.load_rows() if row["id"] == "mlm24-1.7b")
    small = dict(row, seq=64, model=dict(row["model"], layers=2, hidden=64, heads=4, vocab=512))
    model, _ = bench.model_of(small)
    params = sum(p.numel() for p in model.parameters())
    tied = dict(small, model=dict(small["model"], tie_embeddings=True))
    assert params - sum(p.numel() for p in bench.model_of(tied)[0].parameters()) == 512 * 64
