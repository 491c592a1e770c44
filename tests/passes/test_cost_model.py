"""cost_model: roofline compute, pipeline bubbles and step times, dp overlap, memory per device and
the Megatron closed forms, each against arithmetic written out here; and a units check against the
published Megatron runs in benchmarks/published_configs.json (copied there with its source)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from xirang.ir.device import DEVICE_PRESETS
from xirang.ir.world import World
from xirang.passes.planning.cost_collectives import collective_cost
from xirang.passes.planning.cost_model import (
    Efficiency, activation_bytes_in_flight, activation_bytes_per_layer, bubble_fraction,
    bubble_share, compute_time, exposed_comm_time, exposed_gradient_sync, megatron_flops,
    megatron_params, memory_per_device, model_state_bytes, pipeline_step_time, tp_traffic_per_layer)

A100 = DEVICE_PRESETS["a100-80g"]
PUBLISHED = Path(__file__).resolve().parents[2] / "benchmarks" / "published_configs.json"


# --- compute -------------------------------------------------------------------------------------

def test_compute_time_roofline():
    half = Efficiency(matmul=0.5, memory=0.8)
    # compute-bound: 1 TFLOP at 312 TFLOP/s x 0.5 = 6.41 ms; 1 MB at 2.039 TB/s x 0.8 is ~0.6 us
    assert compute_time(1e12, 1e6, A100, "bf16", efficiency=half) == pytest.approx(1e12 / 156e12)
    # memory-bound: 1 GB at 2.039 TB/s x 0.8 = 0.613 ms; 1 MFLOP is nothing
    assert compute_time(1e6, 1e9, A100, "bfloat16", is_matmul=False, efficiency=half) == pytest.approx(
        1e9 / (2.039e12 * 0.8))
    # the defaults (fitted in benchmarks/fit_efficiency.py): 0.7 of peak, 0.35 of bandwidth
    assert compute_time(1e12, 1e6, A100, "bf16") == pytest.approx(1e12 / (312e12 * 0.7))
    assert compute_time(1e6, 1e9, A100, "bf16", is_matmul=False) == pytest.approx(1e9 / (2.039e12 * 0.35))
    exact = Efficiency(matmul=1.0, memory=1.0)
    assert compute_time(312e12, 0, A100, "bf16", efficiency=exact) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="fraction"):
        Efficiency(matmul=1.5)


# --- pipeline ------------------------------------------------------------------------------------

def test_bubble_fractions_p4_m8():
    # relative to the ideal step: (p-1)/m = 3/8; as a share of the real step: (p-1)/(m+p-1) = 3/11
    for schedule in ("gpipe", "1f1b"):
        assert bubble_fraction(schedule, 4, 8) == pytest.approx(3 / 8)
        assert bubble_share(schedule, 4, 8) == pytest.approx(3 / 11)
    # interleaved, v = 2: (p-1)/(v m) = 3/16; share 3/(16+3) = 3/19
    assert bubble_fraction("interleaved", 4, 8, v=2) == pytest.approx(3 / 16)
    assert bubble_share("interleaved", 4, 8, v=2) == pytest.approx(3 / 19)
    assert bubble_fraction("1f1b", 1, 8) == 0.0


def test_pipeline_step_time():
    # 1F1B: (m + p - 1) t = 11 t; interleaved v = 2: (m + (p-1)/v) t = 9.5 t
    assert pipeline_step_time("1f1b", 4, 8, 2.0) == pytest.approx(22.0)
    assert pipeline_step_time("gpipe", 4, 8, 2.0) == pytest.approx(22.0)
    assert pipeline_step_time("interleaved", 4, 8, 2.0, v=2) == pytest.approx(19.0)


def test_schedule_checks():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        bubble_fraction("zb", 4, 8)
    with pytest.raises(ValueError, match="zb-h2: m=6 micro-batches cannot fill its warm-up of 2p - 1 = 7"):
        bubble_fraction("zb-h2", 4, 6)
    # Zero bubble at F = B = W (ratio 2): a third of 1F1B's 3/8; at B = W = F/2 (ratio 1): 3/16.
    assert bubble_fraction("zb-h1", 4, 8) == pytest.approx(1 / 8)
    assert bubble_fraction("zb-h1", 4, 8, backward_ratio=1.0) == pytest.approx(3 / 16)
    with pytest.raises(ValueError, match="needs the 'interleaved'"):
        bubble_fraction("1f1b", 4, 8, v=2)
    with pytest.raises(ValueError, match="multiple of p=4"):
        bubble_fraction("interleaved", 4, 6, v=2)
    with pytest.raises(ValueError, match="positive int"):
        bubble_fraction("1f1b", 0, 8)


# --- data parallel overlap -----------------------------------------------------------------------

def test_exposed_comm_time():
    # comm 1 per bucket, backward 2 per bucket: bucket 0 ready at 2, done 3; bucket 1 ready 4,
    # done 5; bucket 2 ready 6 (end of backward), done 7: only the last bucket shows, 1
    assert exposed_comm_time([1, 1, 1], [2, 2, 2]) == pytest.approx(1.0)
    # comm 3, backward 1: done at 4, 7, 10; backward ends at 3: 7 exposed
    assert exposed_comm_time([3, 3, 3], [1, 1, 1]) == pytest.approx(7.0)
    assert exposed_comm_time([], []) == 0.0
    with pytest.raises(ValueError, match="one backward time per bucket"):
        exposed_comm_time([1, 1], [1])


def test_exposed_gradient_sync_prices_buckets():
    world, group = World.uniform(1, 8), tuple(range(8))
    buckets = [25e6, 25e6]
    # cheapest on one node at 25 MB: tree, 6 * 5 us + 2 * 25 MB / 230 GB/s = 0.247 ms
    # (the ring pays 14 * 5 us + 1.75 * 25 MB / 230 GB/s = 0.260 ms)
    one = collective_cost("all_reduce", 25e6, group, world)
    assert one.algorithm == "tree" and one.seconds == pytest.approx(30e-6 + 50e6 / 230e9)
    # backward 1 ms per bucket hides the first all-reduce; the last one is all exposed
    assert exposed_gradient_sync(buckets, [1e-3, 1e-3], group, world) == pytest.approx(one.seconds)


# --- memory --------------------------------------------------------------------------------------

def test_model_states_mixed_precision_adam():
    P = 1.7e9
    states = model_state_bytes(P)
    assert (states.params, states.grads, states.optimizer) == (2 * P, 2 * P, 12 * P)
    assert states.total == pytest.approx(16 * P)  # 27.2 GB
    # ZeRO over dp = 8: stage 1 2 + 2 + 12/8 = 5.5 bytes/param, stage 2 2 + 14/8, stage 3 16/8
    assert model_state_bytes(P, dp=8, zero_stage=1).total == pytest.approx(5.5 * P)
    assert model_state_bytes(P, dp=8, zero_stage=2).total == pytest.approx(3.75 * P)
    assert model_state_bytes(P, dp=8, zero_stage=3).total == pytest.approx(2 * P)


# s = 2048, b = 1, h = 4096, a = 32: s b h = 8,388,608 and 5 a s / h = 5 * 32 * 2048 / 4096 = 80
S, B, H, A = 2048, 1, 4096, 32
SBH = 8_388_608


@pytest.mark.parametrize("t, sp, recompute, per_sbh", [
    (1, False, "none", 34 + 80),                 # 114
    (8, False, "none", 10 + 24 / 8 + 80 / 8),    # 23
    (8, True, "none", 34 / 8 + 80 / 8),          # 14.25
    (8, False, "selective", 10 + 24 / 8),        # 13
    (8, True, "selective", 34 / 8),              # 4.25
    (1, False, "selective", 34),
    (8, False, "full", 2),
    (8, True, "full", 2 / 8),                    # the checkpointed input is the sequence shard
    (1, True, "none", 114),                      # sequence parallel is a no-op at t = 1
])
def test_korthikanti_activation_bytes(t, sp, recompute, per_sbh):
    got = activation_bytes_per_layer(S, B, H, A, t, sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(SBH * per_sbh)


def test_activations_in_flight_and_device_memory():
    layer = activation_bytes_per_layer(S, B, H, A, 8, sequence_parallel=True, recompute="selective")
    # 6 layers on the device, p = 4, m = 8: GPipe keeps 8 micro-batches, 1F1B 4,
    # interleaved v = 2 keeps p + (p-1)/v = 5.5
    assert activation_bytes_in_flight(layer, 6, "gpipe", 4, 8) == pytest.approx(layer * 6 * 8)
    assert activation_bytes_in_flight(layer, 6, "1f1b", 4, 8) == pytest.approx(layer * 6 * 4)
    assert activation_bytes_in_flight(layer, 6, "interleaved", 4, 8, 2) == pytest.approx(
        layer * 6 * 5.5)
    assert activation_bytes_in_flight(layer, 6, "1f1b", 4, 2) == pytest.approx(layer * 6 * 2)
    memory = memory_per_device(1e9, layer, 6, "1f1b", 4, 8)
    assert memory.total == pytest.approx(16e9 + layer * 6 * 4)
    with pytest.raises(ValueError, match="unknown recompute mode"):
        activation_bytes_per_layer(S, B, H, A, recompute="partial")


# --- Megatron closed forms -----------------------------------------------------------------------

def test_megatron_formulas_by_hand():
    # P = 12 l h^2 + 13 l h + (V + s) h
    assert megatron_params(2, 8, 100, 16) == pytest.approx(12 * 2 * 64 + 13 * 2 * 8 + 116 * 8)
    # with recompute 96 B s l h^2 (1 + s/6h + V/16lh), B=1, s=12, l=2, h=8, V=64: 1 + 1/4 + 1/4
    assert megatron_flops(1, 12, 2, 8, 64) == pytest.approx(96 * 12 * 2 * 64 * 1.5)
    # without: 72 B s l h^2 (1 + s/6h + V/12lh) = 72 * 1536 * (1 + 1/4 + 1/3)
    assert megatron_flops(1, 12, 2, 8, 64, recompute=False) == pytest.approx(
        72 * 1536 * (1 + 1 / 4 + 1 / 3))
    # 8 b s h (t-1)/t elements of 2 bytes: t = 8, b s h = SBH -> 7 * SBH * 2 bytes
    assert tp_traffic_per_layer(B, S, H, 8) == pytest.approx(14 * SBH)
    assert tp_traffic_per_layer(B, S, H, 1) == 0


def published_rows() -> list[dict]:
    data = json.loads(PUBLISHED.read_text())
    return [dict(zip(data["columns"], row)) for row in data["rows"]]


def test_published_parameter_counts():
    for row in published_rows():
        P = megatron_params(row["layers"], row["hidden"], 51200, 2048)
        assert P / 1e9 == pytest.approx(row["params_billion"], rel=0.05)


def test_published_row_1_iteration_time_units():
    row = published_rows()[0]  # 1.7B, 32 GPUs, dp = 32, B = 512
    assert (row["params_billion"], row["gpus"], row["tp"], row["pp"]) == (1.7, 32, 1, 1)
    flops = megatron_flops(row["global_batch"], 2048, row["layers"], row["hidden"], 51200)
    # 96 * 512 * 2048 * 24 * 2304^2 * (1 + 0.148 + 0.058) = 1.55e16 FLOPs per iteration
    assert flops == pytest.approx(1.5467e16, rel=1e-3)
    seconds = flops / (row["gpus"] * row["tflops_per_gpu"] * 1e12)  # the measured iteration: 3.528 s
    assert seconds == pytest.approx(1.5467e16 / (32 * 137e12), rel=1e-3)
    # the model against it: the preset's roofline of one GPU's share of those FLOPs, all as matmuls at
    # Efficiency.matmul, is a lower bound the measured iteration (communication, bubbles and slower ops
    # included) cannot beat, yet not so low that the roofline alone is off by more than 2x
    roofline = compute_time(flops / row["gpus"], 0, A100, "bf16")
    assert seconds / 2 < roofline < seconds, (roofline, seconds)
    # and 137 TFLOP/s is the 44% of the 312 TFLOP/s peak the paper quotes
    assert row["tflops_per_gpu"] * 1e12 / A100.peak("bf16") == pytest.approx(
        row["percent_of_peak"] / 100, abs=0.005)


# --- the analysis' liveness figure against Korthikanti et al. 2022, table 2 ---------------------------

def test_liveness_of_a_gpt_layer_is_korthikantis_figure_plus_what_it_leaves_out():
    """Activation bytes of one layer of the in-repo GPT as the paper ran it (eager attention, dropout
    0.1; GPT-1.7B's layer: hidden 2304, 24 heads, seq 2048; micro-batch 2, bf16), from the analysis
    (each saved storage once) through the tensor split, against ``activation_bytes_per_layer``:
    sbh(34 + 5as/h) at tp = 1, sbh(10 + 24/t + 5as/(ht)) at tp = 8.

    The analysis is the formula plus what the formula leaves out, exactly: the two LayerNorms' float32
    mean and rstd (8 bytes per token each, 16sb) and the causal mask the model builds per micro-batch
    (s² one-byte bools). Selective recompute also keeps the scaled q, a copy the model makes before
    q·kᵀ (Megatron folds the scale into its baddbmm) that the recompute starts from: 2sbh/t more.
    Full recompute keeps the layer input only, 2sbh, as the formula. At this shape the whole
    difference is +0.3% (none) and +7% (selective) at tp = 1."""
    import torch

    import xirang
    from examples.gpt import GPTConfig, build_gpt
    from xirang.passes.planning.plan_splits import SplitPricer
    s, b, h, a = 2048, 2, 2304, 24
    config = GPTConfig(vocab_size=51200, seq_len=s, hidden=h, heads=a, layers=2, dropout=0.1, attention="eager")
    tokens = {name: torch.zeros(2, s, dtype=torch.long, device="meta") for name in ("input_ids", "labels")}
    gm = xirang.analyze(build_gpt(config, device="meta"), example_kwargs=tokens).graph_module
    pricer = SplitPricer(gm, World.uniform(1, 8, "a100-80g"), precision="bf16")
    left_out = 16 * s * b + s * s  # LayerNorm statistics, causal mask
    for t in (1, 8):
        layer = next(u for u in pricer.price(t, tuple(range(t)), b, s).units if u.name.startswith("block:"))
        scaled_q = 2 * s * b * h / t
        expected = {"none": left_out, "selective": left_out + scaled_q, "full": 0.0}
        for mode, extra in expected.items():
            formula = activation_bytes_per_layer(s, b, h, a, t, recompute=mode)
            assert layer.activation_bytes(mode) == pytest.approx(formula + extra, rel=1e-9), (t, mode)
        ratio = layer.activation_bytes("none") / activation_bytes_per_layer(s, b, h, a, t)
        assert 1 < ratio < (1.004 if t == 1 else 1.02)


# --- per device generation (issue 14) --------------------------------------------------------------

def test_compute_time_uses_the_devices_own_efficiency():
    h100 = DEVICE_PRESETS["h100-80g"]
    assert h100.efficiency != A100.efficiency
    # memory-bound: 1 GB at 3.35 TB/s x the H100's 0.8 (fused kernels), not the A100's 0.35
    assert compute_time(1e6, 1e9, h100, "bf16", is_matmul=False) == pytest.approx(1e9 / (3.35e12 * 0.8))
    assert compute_time(1e6, 1e9, h100, "bf16", is_matmul=False, efficiency=Efficiency()) == pytest.approx(
        1e9 / (3.35e12 * 0.35))


def test_an_h100_world_syncs_gradients_faster_than_an_a100_world():
    # one rank per node (tp 8 fills each node): the dp ring runs on each GPU's own NIC, HDR 25 GB/s
    # on DGX A100, NDR 50 GB/s on DGX H100
    group = tuple(range(0, 64, 8))
    a100 = collective_cost("all_reduce", 1e9, group, World.uniform(8, 8, "a100"))
    h100 = collective_cost("all_reduce", 1e9, group, World.uniform(8, 8, "h100"))
    assert a100.seconds == pytest.approx(2 * 7 / 8 * 1e9 / 25e9 + 14 * 1e-5)
    assert h100.seconds == pytest.approx(2 * 7 / 8 * 1e9 / 50e9 + 14 * 1e-5)


def test_an_h100_world_is_faster_than_an_a100_world_at_the_same_plan():
    import xirang
    from examples.gpt import GPTConfig, build_gpt
    from conftest import token_batch
    model = build_gpt(GPTConfig(vocab_size=1024, seq_len=512, hidden=512, heads=8, layers=4), device="meta")
    report = xirang.analyze(model, example_kwargs=token_batch(seq=512))  # one trace for the three plans
    pins = dict(example_kwargs=token_batch(seq=512), analysed=report, global_batch=64, seq=512, tp=2, pp=2, dp=4,
                micro_batch=2, schedule="1f1b", recompute="none", offload="none")
    steps = {}
    for device in ("a100", "h100"):
        plan = xirang.plan(model, world=World.uniform(2, 8, device), **pins)
        steps[device] = plan.predicted.step_seconds
        assert plan.world.nodes[0].device.name.startswith(device)
    assert steps["h100"] < steps["a100"]
    # an explicit efficiency= still wins over the device's own
    slow = xirang.plan(model, world=World.uniform(2, 8, "h100"), efficiency=Efficiency(0.1, 0.1, 0.1), **pins)
    assert slow.predicted.step_seconds > steps["h100"]
