"""Korthikanti et al. 2022, Table 2, for one GPT-3 175B layer (s=2048, h=12288, a=96, t=8, b=1).

The expected figures are worked by hand here from the paper's per-tensor counts (11·sbh attention,
19·sbh MLP, 4·sbh norms, 5·a·s²·b attention core; 10·sbh outside the tp regions), not by calling the
formulas under test, so a wrong coefficient in ``activation_memory`` fails.
"""
import pytest

from xirang.ir.errors import XirangError
from xirang.passes.planning.activation_memory import LAYOUTS, layer_activation_bytes

GPT3 = dict(s=2048, b=1, h=12288, a=96, t=8)
SBH = 2048 * 12288  # 25,165,824
CORE = 5 * 96 * 2048 * 2048  # 5·a·s²·b bytes: softmax, its mask, its dropout output


def test_gpt3_175b_layer_equals_table_2():
    attention, mlp, norms, outside_tp = 11 * SBH, 19 * SBH, 4 * SBH, 10 * SBH
    expected = {
        "none": attention + mlp + norms + CORE,  # 2,868,903,936
        "tp": outside_tp + (attention + mlp + norms - outside_tp) / 8 + CORE / 8,  # 578,813,952
        "tp+sp": (attention + mlp + norms) / 8 + CORE / 8,
        "tp+selective": outside_tp + (attention + mlp + norms - outside_tp) / 8,
        "tp+sp+selective": (attention + mlp + norms) / 8,
        "full": 2 * SBH,
    }
    assert expected["none"] == 2_868_903_936 and expected["tp"] == 578_813_952
    for layout in LAYOUTS:
        assert layer_activation_bytes(layout, **GPT3) == pytest.approx(expected[layout], rel=1e-12), layout
    # the paper's headline: sequence parallelism with selective recompute keeps ~5x less than tp alone
    assert layer_activation_bytes("tp", **GPT3) / layer_activation_bytes("tp+sp+selective", **GPT3) \
        == pytest.approx(578_813_952 / 106_954_752)


def test_sequence_parallel_splits_the_part_tp_left_whole():
    for t in (1, 2, 4, 8):
        args = dict(GPT3, t=t)
        saved = layer_activation_bytes("tp", **args) - layer_activation_bytes("tp+sp", **args)
        assert saved == pytest.approx(10 * SBH * (1 - 1 / t))
    assert layer_activation_bytes("tp+sp", **dict(GPT3, t=1)) == layer_activation_bytes("none", **GPT3)


def test_bad_arguments_say_which():
    with pytest.raises(XirangError, match="unknown layout 'sp'"):
        layer_activation_bytes("sp", **GPT3)
    with pytest.raises(XirangError, match="t must be a positive int"):
        layer_activation_bytes("tp", **dict(GPT3, t=0))


def test_planner_estimate_for_a_gpt3_175b_layer_against_table_2():
    """The split's kept bytes of one block of the in-repo GPT-175B (bf16, tp=8, s=2048, b=1), in s·b·h.

    That model has no dropout (no masks: Table 2 counts two, 1 byte each) and fused attention (no
    a·s² tensor, so selective recompute changes nothing). Without sp the estimate is Table 2's
    tp + selective row less the masks: 10 + 24/t - 2 = 11. With sp the ILP puts the norms and adds
    on the sequence shard (34/t - 2/t = 4 in Table 2), but each column-parallel linear keeps the
    whole gathered input it multiplied (2·s·b·h, twice per layer) where Megatron keeps its shard and
    gathers it again in the backward: 4 + 2·2·(1 - 1/t) = 7.5.
    """
    import torch
    import xirang
    from examples.gpt import build_gpt
    from xirang.ir.world import parse_world
    from xirang.passes.planning.plan_splits import SplitPricer

    tokens = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    gm = xirang.analyze(build_gpt("gpt-175b", device="meta"), example_kwargs={"input_ids": tokens,
                                                                            "labels": tokens.clone()}).graph_module
    pricer = SplitPricer(gm, parse_world(8, "a100-80g"), precision="bf16")
    per_sbh = {}
    for sp in (False, True):
        block = next(u for u in pricer.price(8, tuple(range(8)), 1, 2048, sequence_parallel=sp).units
                     if u.name.startswith("block:"))
        assert block.selective_saved_bytes == block.saved_bytes  # fused attention: no core to drop
        per_sbh[sp] = block.saved_bytes / SBH
    t = 8
    assert per_sbh[False] == pytest.approx(10 + 24 / t - 2, rel=1e-3)  # measured 11.005: norm statistics
    assert per_sbh[True] == pytest.approx(34 / t - 2 / t + 2 * 2 * (1 - 1 / t), rel=1e-3)  # measured 7.504
    assert layer_activation_bytes("tp+selective", **GPT3) / SBH - 2 == pytest.approx(per_sbh[False], rel=1e-3)
