"""benchmarks/published_moe_runs.py: each row of benchmarks/published_moe_configs.json is read into the pins
``xirang.plan`` takes or into the reasons it cannot be priced as published, the published step is converted
from the figure the source gives, and a tiny MoE (examples/hf_moe.py) goes through the pinned pricing and
Xirang's own plan. No big model is planned here (the benchmark does that)."""
from __future__ import annotations

import importlib.util

import pytest

from tests.docs.doc_blocks import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("published_moe_runs", REPO / "benchmarks" / "published_moe_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(bench, row_id):
    return next(row for row in bench.load_rows() if row["id"] == row_id)


def test_every_row_is_pinned_or_says_why(bench):
    rows = bench.load_rows()
    assert len({row["id"] for row in rows}) == len(rows) >= 13
    for row in rows:
        why = bench.unpriceable(row)
        if why:
            continue
        pins = bench.pins_of(row)
        assert pins["tp"] == row["tp"] and pins["pp"] == row["pp"] and pins["ep"] == row["ep"]
        assert pins["precision"] == row["precision"] and pins["zero_stage"] == 0
        assert row["gpus"] % (row["tp"] * row["pp"]) == 0
        dp = row["gpus"] // (row["tp"] * row["pp"])
        assert dp % row["ep"] == 0, row["id"]  # ep folded over dp
        assert row["global_batch"] % (dp * row["micro_batch"]) == 0, row["id"]


def test_the_reasons_name_what_xirang_does_not_model(bench):
    why = {row["id"]: " ".join(bench.unpriceable(row)) for row in bench.load_rows()}
    assert "h800" in why["dsv3-h800-2048"] and "dualpipe" in why["dsv3-h800-2048"]
    assert "fp8" in why["dsv3-h800-2048"] and "average over the whole pre-training" in why["dsv3-h800-2048"]
    for row_id in ("bridge-dsv3-h100-1024", "bridge-qwen3-235b-h100-256", "bridge-qwen3-30b-a3b-h100-16"):
        assert "fp8" in why[row_id], row_id
    for row_id in ("modelzoo-qwen3-235b-h100-256", "modelzoo-mixtral-8x22b-h100-128"):
        assert "etp 1 != tp 2" in why[row_id], row_id
    assert why["bridge-gpt-oss-120b-h100-64"] == ""
    assert "etp 1 != tp 2" in why["bridge-card-dsv3-h100-1024"] and "fp8" not in why["bridge-card-dsv3-h100-1024"]
    assert "inconsistent" in why["bridge-2511-gpt-oss-120b-h100"]
    assert why["automodel-qwen3-30b-h100-8"].startswith("FSDP over 8 ranks (parameters sharded) beside ep 8")
    for row_id in ("bridge-card-qwen3-30b-h100-perf", "bridge-card-qwen3-30b-h100", "bridge-card-moonlight-h100-16"):
        assert why[row_id] == "", row_id  # BF16 on H100, tp 1 (no expert tensor parallelism), cp 1, a step figure


def test_the_verification_card_rows_read_as_published(bench):
    """The Megatron-Bridge verification-card rows: degrees pinned as the cards state them, the published step from
    their tokens/s/GPU equal to their step time (both are published: 1024 x 4096 tokens a step)."""
    perf, natural = _row(bench, "bridge-card-qwen3-30b-h100-perf"), _row(bench, "bridge-card-qwen3-30b-h100")
    moonlight = _row(bench, "bridge-card-moonlight-h100-16")
    for row, overlap in ((perf, True), (natural, False)):  # the performance recipe overlaps the all-to-alls
        assert bench.pins_of(row) == {"tp": 1, "pp": 1, "ep": 16, "cp": 1, "micro_batch": 1, "schedule": "1f1b",
                                      "precision": "bf16", "recompute": "none", "offload": "none", "zero_stage": 0,
                                      "routing_imbalance": 1.0, "ep_overlap": overlap}
    pins = bench.pins_of(moonlight)
    assert pins["ep_overlap"] is True  # its card: expert-parallel communication overlapped
    assert (pins["ep"], pins["micro_batch"], moonlight["model"]["factory"]) == (
        8, 2, "examples/catalog.py:moonlight_16b_a3b")
    for row in (perf, natural, moonlight):
        step, source = bench.published_step(row, None)
        assert source == "tokens/s/GPU" and step == pytest.approx(row["published"]["step_seconds"], rel=1e-4)


def test_pins_of_gpt_oss_row(bench):
    row = _row(bench, "bridge-gpt-oss-120b-h100-64")
    assert bench.pins_of(row) == {"tp": 1, "pp": 4, "ep": 8, "cp": 1, "micro_batch": 1, "schedule": "1f1b",
                                  "precision": "bf16", "recompute": "none", "offload": "none", "zero_stage": 0,
                                  "routing_imbalance": 1.0, "ep_overlap": False}
    interleaved = dict(row, schedule="interleaved", virtual_stages=3, recompute="full (uniform)")
    pins = bench.pins_of(interleaved)
    assert pins["virtual_stages"] == 3 and pins["recompute"] == "full"


def test_published_step_conversions(bench):
    row = _row(bench, "bridge-gpt-oss-120b-h100-64")
    step, source = bench.published_step(row, None)  # 1280 x 4096 tokens at 5824 tokens/s/GPU on 64 GPUs
    assert source == "tokens/s/GPU" and step == pytest.approx(1280 * 4096 / (5824 * 64))
    zoo = _row(bench, "modelzoo-qwen3-235b-h100-256")
    assert bench.published_step(zoo, None) == (19.7, "step time")
    mixtral = _row(bench, "modelzoo-mixtral-8x22b-h100-128")
    with pytest.raises(ValueError):
        bench.published_step(mixtral, None)  # TFLOP/s alone need the model FLOPs
    step, source = bench.published_step(mixtral, 445e12 * 128 * 2.0)
    assert step == pytest.approx(2.0) and "FLOP" in source
    assert bench.published_text(mixtral) == "~445 TFLOP/s/GPU"
    assert bench.published_text(row) == "5824 tok/s/GPU" and bench.published_text(zoo) == "19.7 s/step"
    deepseek = _row(bench, "dsv3-h800-2048")
    assert bench.published_text(deepseek) == "180K GPU-h/T tokens"
    with pytest.raises(ValueError):
        bench.published_step(deepseek, 1e21)  # an average over pre-training: no step


def test_a_tiny_moe_priced_pinned_and_planned_free(bench):
    row = {"id": "tiny", "source": "test", "device": "h100-80g", "gpus": 8, "seq": 16, "global_batch": 16,
           "model": {"kind": "catalog", "factory": "examples/hf_moe.py:mixtral"}, "tp": 1, "pp": 1, "ep": 2,
           "etp": None, "cp": 1, "micro_batch": 1, "schedule": None, "virtual_stages": None, "recompute": None,
           "precision": "bf16", "published": {"tokens_per_sec_per_gpu": 1000.0}, "flops": "model"}
    outcome = bench.run_row(row, {})
    assert outcome["why_not_priced"] == []
    priced = outcome["priced"]
    assert priced["plan"].startswith("dp8 tp1 pp1 ep2 b1 ")
    assert priced["published_step_s"] == pytest.approx(16 * 16 / (1000.0 * 8))
    assert priced["ratio"] == pytest.approx(priced["predicted_step_s"] / priced["published_step_s"])
    assert priced["breakdown"].get("ep_comm", 0) > 0
    assert 0 < priced["expert_matmul_share"] < 1
    assert outcome["free"]["fits"] and outcome["free"]["step_s"] > 0
