"""A calibrated World prices each op class at what the machine measured: fused attention at its own
rate (``Efficiency.attention``), non-matmul FLOPs at the "other" rate, a fixed cost per call of each
class (``Calibration.op_fixed_s``), and on shared cores a pipeline message costs its receiver CPU too."""
from __future__ import annotations

import dataclasses
import functools

import pytest

from conftest import token_batch
from examples.gpt import GPTConfig, build_gpt
import xirang
from xirang.codegen.runtime.calibration.calibrated_world import calibrated_world
from xirang.ir.calibration import Calibration, CollectiveFit
from xirang.ir.device import DEVICE_PRESETS, DeviceSpec, Efficiency
from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import FLOPS
from xirang.ir.world import LinkSpec, NodeSpec, World
from xirang.passes.planning.cost_model import compute_time
from xirang.passes.planning.plan_costs import CandidatePricer
from xirang.passes.planning.plan_search_space import Candidate
from xirang.passes.planning.plan_splits import SplitPricer
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

A100 = DEVICE_PRESETS["a100-80g"]
LINK = LinkSpec(5e8, 2e-4)
SEND = CollectiveFit("send", 2, "gloo", 1e-3, 0.0)


def test_fused_attention_runs_at_its_own_rate_where_the_device_has_one():
    own = Efficiency(matmul=0.5, other=0.1, memory=0.5, attention=0.25)
    assert compute_time(1e12, 0, A100, "bf16", efficiency=own, is_attention=True) == pytest.approx(
        1e12 / (312e12 * 0.25))
    # no attention figure (every preset): as a matmul, whatever is_matmul says
    plain = Efficiency(matmul=0.5, other=0.1, memory=0.5)
    assert compute_time(1e12, 0, A100, "bf16", efficiency=plain, is_attention=True, is_matmul=False) == \
        pytest.approx(1e12 / (312e12 * 0.5))
    assert compute_time(1e12, 0, A100, "bf16", efficiency=own, is_matmul=False) == pytest.approx(
        1e12 / (312e12 * 0.1))


def test_efficiency_attention_round_trips_and_older_files_still_load():
    own = Efficiency(matmul=0.5, other=0.1, memory=0.5, attention=0.25)
    assert Efficiency.from_json(own.to_json()) == own
    assert Efficiency.from_json({"matmul": 0.5, "other": 0.1, "memory": 0.5}).attention is None
    assert "attention" not in Efficiency().to_json()
    with pytest.raises(XirangError, match="attention"):
        Efficiency(attention=0.0)
    with pytest.raises(XirangError, match="optionally attention"):
        Efficiency.from_json({"matmul": 0.5, "other": 0.1, "memory": 0.5, "tensor_cores": 1.0})


def test_calibration_op_fixed_costs_round_trip_and_unknown_classes_are_refused():
    calibration = Calibration(2, "gloo", "cpu", (SEND,), op_fixed_s={"matmul": 1e-4, "other": 2e-5})
    assert Calibration.from_json(calibration.to_json()) == calibration
    assert dict(Calibration.from_json({k: v for k, v in calibration.to_json().items()
                                       if k != "op_fixed_s"}).op_fixed_s) == {}
    with pytest.raises(XirangError, match="op_fixed_s keys"):
        Calibration(2, "gloo", "cpu", (SEND,), op_fixed_s={"conv": 1e-4})


def _world(calibration=None, devices=2) -> World:
    device = DeviceSpec("cpu", {"fp32": 2e10}, 2**32, 1e10)
    return World((NodeSpec(devices, device),), LINK, LINK, calibration)


@functools.cache
def _gm():
    model = build_gpt(GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=2, layers=2), device="meta")
    return xirang.analyze(model, example_kwargs=token_batch()).graph_module


def _total(split) -> float:
    return sum(u.forward_seconds + u.backward_seconds for u in split.units)


def test_each_op_class_pays_its_measured_fixed_cost_once_per_call():
    gm = _gm()
    plain = SplitPricer(gm, _world(Calibration(2, "gloo", "cpu", (SEND,))), precision="fp32").price(1, (0,), 2, 16)
    fixed = {"matmul": 1e-3, "attention": 1e-2, "other": 1e-5}
    taxed = SplitPricer(gm, _world(Calibration(2, "gloo", "cpu", (SEND,), op_fixed_s=fixed)),
                        precision="fp32").price(1, (0,), 2, 16)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    attention = sum("scaled_dot_product" in t for t in targets)
    matmuls = sum(any(op in t for op in ("aten.linear", "aten.mm", "aten.addmm", "aten.bmm")) for t in targets)
    assert attention == 2 and matmuls >= 9  # two blocks: q/k/v (or fused), proj, two MLP, and the head
    added = _total(taxed) - _total(plain)
    # every matmul and attention call on the gradient path pays its class's cost in full; the other
    # FLOP-counted ops (norms, gelu, adds, the loss) at most 1e-5 each
    others = len(targets) - attention - matmuls
    assert attention * 1e-2 + matmuls * 1e-3 <= added + 1e-12
    assert added <= attention * 1e-2 + matmuls * 1e-3 + others * 1e-5 + 1e-12


def _unit(name, cut_bytes):
    return UnitCost(name, name.split(":")[0], forward_seconds=0.4, backward_seconds=0.6,
                    tp_comm_forward_seconds=0.0, tp_comm_backward_seconds=0.0, params_local=0,
                    saved_bytes=0.0, selective_saved_bytes=0.0, selective_recompute_seconds=0.0, input_bytes=0.0,
                    cut_bytes_after=cut_bytes, model_flops=0.0, model_forward_flops=0.0)


def test_on_shared_cores_a_pipeline_message_costs_its_measured_cpu_else_twice_its_wall_time():
    c = Candidate(tp=1, pp=2, dp=1, micro_batch=1, num_micro_batches=1, schedule="1f1b", virtual_stages=1,
                  recompute="none")
    split = TensorSplit(1, 1, 8, (_unit("block:0", 1e6), _unit("block:1", 0.0)))

    def cuts(calibration):
        return CandidatePricer({(1, 1): split}, _world(calibration), global_batch=1).table(c).cut_seconds

    # 1 ms a message: an activation forward and a gradient backward cross the cut
    assert cuts(Calibration(2, "gloo", "cpu", (SEND,)))[0] == pytest.approx(2e-3)
    # shared cores, no CPU measured: the receiver taken to spend what the sender does
    assert cuts(Calibration(2, "gloo", "cpu", (SEND,), parallel_ranks=1.0))[0] == pytest.approx(4e-3)
    # measured: 0.5 ms + 1 ns a byte of CPU per message at every rank busy, for each of the two messages
    message = (5e-4, 1e-9)
    assert cuts(Calibration(2, "gloo", "cpu", (SEND,), parallel_ranks=1.0,
                            pipeline_message_s=message))[0] == pytest.approx(2 * (5e-4 + 1e-3))
    # ranks on their own devices: a message costs its time on the link, whatever its CPU
    assert cuts(Calibration(2, "gloo", "cpu", (SEND,), pipeline_message_s=message))[0] == pytest.approx(2e-3)


def _results(ranks: int = 2) -> list:
    """What calibrate_rank returns, made up: every line exact, so the fitted figures are hand-worked."""
    compute = {
        "matmul": {"float32": [[1e9, 1e-3 + 0.1], [2e9, 1e-3 + 0.2]]},  # 10 GFLOP/s, 1 ms a training product
        "elementwise": [[1e6, 1e-3], [2e6, 2e-3]],  # 1 GB/s
        "other": [[1e7, 6e-4 + 0.02], [2e7, 6e-4 + 0.04]],  # 0.5 GFLOP/s, 0.6 ms per three ops
        "attention": [[1e9, 2e-3 + 0.4], [2e9, 2e-3 + 0.8]],  # 2.5 GFLOP/s, 2 ms a call
        "op_forward_s": 1e-5, "op_backward_s": 2e-5}
    collectives = {"send/2": [[1e3, 1e-4], [1e6, 1e-3]]}
    return [{"threads": 1, "compute": compute, "sharing": None, "collectives": collectives}] * ranks


def test_calibrated_world_takes_each_class_rate_and_fixed_cost_from_its_line():
    world = calibrated_world(_results(), backend="gloo", device="cpu")
    device = world.nodes[0].device
    assert device.peak("fp32") == pytest.approx(1e10)
    assert device.efficiency.other == pytest.approx(0.05) and device.efficiency.attention == pytest.approx(0.25)
    fixed = world.calibration.op_fixed_s
    assert fixed["matmul"] == pytest.approx(1e-3 - 1e-5 - 3 * 2e-5)  # less the linear's dispatch and its 3 gradients
    assert fixed["other"] == pytest.approx(2e-4 - 1e-5 - 2e-5)  # a third of it, less one op forward and backward
    assert fixed["attention"] == pytest.approx(2e-3 - 1e-5 - 3 * 2e-5)


def _shared(training: dict | None, ranks: int = 8) -> list:
    """Made-up results of 8 ranks sharing 2 cores (each gets a quarter of a core with every rank busy);
    the micro workload takes the same CPU together as alone."""
    micro = {"alone_s": 0.1, "together_s": 0.4, "beside_waiters_s": 0.1, "barrier_s": 0.01,
             "alone_cpu_s": 0.1, "together_cpu_s": 0.1}
    sharing = {**micro, "training": training} if training is not None else micro
    return [{**result, "sharing": sharing, "cores": 2} for result in _results(ranks)]


def _training(together_cpu_s: float) -> dict:
    return {"alone_s": 0.2, "together_s": 0.9, "beside_waiters_s": 0.2, "alone_cpu_s": 0.2,
            "together_cpu_s": together_cpu_s}


def _assert_scaled(world, flops: float, fixed: float) -> None:
    """Every figure of ``_results`` timed alone: FLOP rates and bandwidth ``flops`` times slower, per-op
    fixed costs ``fixed`` times dearer; the classes' rate ratios unchanged."""
    device, calibration = world.nodes[0].device, world.calibration
    assert device.peak("fp32") == pytest.approx(1e10 / flops)
    assert device.memory_bandwidth == pytest.approx(1e9 / flops)
    assert device.op_overhead_s == pytest.approx(1e-5 * fixed)
    assert calibration.backward_op_overhead_s == pytest.approx(2e-5 * fixed)
    assert calibration.op_fixed_s["matmul"] == pytest.approx((1e-3 - 1e-5 - 3 * 2e-5) * fixed)
    assert device.efficiency.other == pytest.approx(0.05)


def test_ranks_that_train_share_cores_worse_and_every_compute_figure_follows():
    # the training work takes 1.25x the CPU beside the other ranks: k = 2 / 1.25 = 1.6, and every
    # figure timed alone is 4 (8 ranks on 2 cores) x 1.25 slower with every rank busy
    world = calibrated_world(_shared(_training(0.25)), backend="gloo", device="cpu")
    assert world.calibration.parallel_ranks == pytest.approx(1.6)
    assert world.calibration.raw["training_slowdown"] == pytest.approx(1.25)
    _assert_scaled(world, 4 * 1.25, 4 * 1.25)
    assert world.calibration.waiting_share == pytest.approx(0.0)


def test_training_that_takes_less_cpu_together_never_speeds_the_rates_up():
    world = calibrated_world(_shared(_training(0.18)), backend="gloo", device="cpu")
    assert world.calibration.parallel_ranks == pytest.approx(2.0)
    assert world.calibration.raw["training_slowdown"] == pytest.approx(1.0)
    assert world.nodes[0].device.peak("fp32") == pytest.approx(1e10 / 4)


def test_a_calibration_without_the_training_workload_shares_the_cores_evenly():
    world = calibrated_world(_shared(None), backend="gloo", device="cpu")
    assert world.calibration.parallel_ranks == pytest.approx(2.0)
    assert "training_slowdown" not in world.calibration.raw
    assert world.nodes[0].device.peak("fp32") == pytest.approx(1e10 / 4)


def test_a_pipeline_message_is_its_mean_rank_cpu_line_at_every_rank_busy():
    # 8 ranks on 2 cores: a message's CPU (both sides) takes 4x its CPU seconds of wall with every rank
    # busy; the ranks' samples are averaged, then fitted (0.2 ms + 1 ns a byte, and 0.4 ms on rank 1)
    results = _shared(None)
    lines = {0: (2e-4, 1e-9), 1: (4e-4, 1e-9)}
    results = [{**r, "message_cpu": [[n, lines[i % 2][0] + lines[i % 2][1] * n] for n in (1e3, 1e6)]}
               for i, r in enumerate(results)]
    calibration = calibrated_world(results, backend="gloo", device="cpu").calibration
    assert calibration.pipeline_message_s == pytest.approx((4 * 3e-4, 4 * 1e-9))
    assert calibration.pipeline_message_seconds(1e6) == pytest.approx(4 * (3e-4 + 1e-3))
    assert calibration.raw["pipeline_message"]["ranks_per_core"] == 4
    # ranks on their own devices (no sharing measured): not a cost the cores pay
    assert calibrated_world(_results(), backend="gloo", device="cpu").calibration.pipeline_message_s is None



def test_a_message_size_the_noise_swallowed_is_dropped_and_under_two_sizes_messages_go_unpriced():
    # rank 0 measured one size below its rounds without messages, rank 1 a little above: the mean over
    # ranks is negative there (not clamped per rank to 0, which would bias it up), so that size is dropped
    results = _shared(None)
    rows = {0: [[1e3, -3e-4], [1e5, 3e-4], [1e6, 1.2e-3]], 1: [[1e3, 1e-4], [1e5, 3e-4], [1e6, 1.2e-3]]}
    fitted = calibrated_world([{**r, "message_cpu": rows[i % 2]} for i, r in enumerate(results)],
                              backend="gloo", device="cpu").calibration
    assert fitted.pipeline_message_s == pytest.approx((4 * 2e-4, 4 * 1e-9))
    assert fitted.raw["pipeline_message"]["cpu_samples"][0] == pytest.approx([1e3, -1e-4])
    # only one size above the noise: no line can be fitted, and the file says why instead of failing
    rows = {0: [[1e3, -3e-4], [1e6, 0.0]], 1: [[1e3, 1e-4], [1e6, 2e-4]]}
    unpriced = calibrated_world([{**r, "message_cpu": rows[i % 2]} for i, r in enumerate(results)],
                                backend="gloo", device="cpu").calibration
    assert unpriced.pipeline_message_s is None
    assert unpriced.raw["pipeline_message"]["note"].startswith("not priced: 1 of 2 sizes")

def test_two_training_sizes_slow_the_flop_rates_and_the_fixed_costs_apart():
    # 8 ranks on 2 cores: each gets a quarter of a core; beside the others the training work's
    # per-row CPU grows 1.1x and its per-call CPU 1.5x (per pass: 2 ms + 0.1 ms a row alone)
    def timed(rows, repeats):
        return {"alone_s": 1.0, "together_s": 4.0, "beside_waiters_s": 1.0, "rows": rows, "repeats": repeats,
                "alone_cpu_s": repeats * (2e-3 + rows * 1e-4), "together_cpu_s": repeats * (3e-3 + rows * 1.1e-4)}
    results = _shared(timed(1024, 1))
    sharing = {**results[0]["sharing"], "training_small": timed(16, 4)}
    world = calibrated_world([{**r, "sharing": sharing} for r in results], backend="gloo", device="cpu")
    assert world.calibration.raw["training_slowdown"] == pytest.approx(1.1)
    assert world.calibration.raw["fixed_cost_slowdown"] == pytest.approx(1.5)
    assert world.calibration.parallel_ranks == pytest.approx(2 / 1.1)
    _assert_scaled(world, 4 * 1.1, 4 * 1.5)


def test_a_checkpointed_block_stack_prices_recompute_per_saved_tensor_and_full_recompute_pays_it():
    # checkpointed 30 ms = plain 20 ms + one more forward 6 ms + 4 ms of hooks over 40 saved tensors
    results = _results()
    sample = {"plain_s": 0.020, "checkpointed_s": 0.030, "forward_s": 0.006, "saved_tensors": 40}
    results = [{**r, "compute": {**r["compute"], "recompute": sample}} for r in results]
    calibration = calibrated_world(results, backend="gloo", device="cpu").calibration
    assert calibration.recompute_saved_s == pytest.approx(1e-4)
    assert Calibration.from_json(calibration.to_json()).recompute_saved_s == pytest.approx(1e-4)
    # a unit whose forward saves 10 tensors: full recompute adds its forward and 10 hooks
    unit = UnitCost("block:a", "block", forward_seconds=0.4, backward_seconds=0.6, tp_comm_forward_seconds=0.1,
                    tp_comm_backward_seconds=0.0, params_local=1, saved_bytes=1.0, selective_saved_bytes=1.0,
                    selective_recompute_seconds=0.05, input_bytes=1.0, cut_bytes_after=0.0, model_flops=1.0,
                    model_forward_flops=1.0, full_recompute_seconds=0.4 + 10 * 1e-4)
    assert unit.seconds("none") == pytest.approx(1.1)
    assert unit.seconds("selective") == pytest.approx(1.15)
    assert unit.seconds("full") == pytest.approx(1.1 + 0.4 + 1e-3 + 0.1)  # its tp collectives run again too
    preset = UnitCost("block:a", "block", forward_seconds=0.4, backward_seconds=0.6, tp_comm_forward_seconds=0.0,
                      tp_comm_backward_seconds=0.0, params_local=1, saved_bytes=1.0, selective_saved_bytes=1.0,
                      selective_recompute_seconds=0.0, input_bytes=1.0, cut_bytes_after=0.0, model_flops=1.0,
                      model_forward_flops=1.0)
    assert preset.seconds("full") == pytest.approx(1.4)  # uncalibrated: one more forward


def test_the_split_counts_the_tensors_a_block_saves_into_its_full_recompute():
    import torch
    config = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=2, layers=2)
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": torch.zeros(2, 16, dtype=torch.long)}
    plain = _world(Calibration(1, "gloo", "cpu"), devices=1)
    hooked = _world(Calibration(1, "gloo", "cpu", recompute_saved_s=1e-3), devices=1)
    prices = {}
    for name, world in (("plain", plain), ("hooked", hooked)):
        plan = xirang.plan(build_gpt(config), world=world, example_kwargs=batch, global_batch=2, precision="fp32",
                           dp=1, tp=1, pp=1, micro_batch=2, recompute="full")
        prices[name] = plan.predicted.step_seconds
    # each block's forward saves tens of tensors, each priced 1 ms more under full recompute
    assert prices["hooked"] - prices["plain"] > 2 * 10 * 1e-3


def test_attention_timed_per_sequence_length_gets_a_line_per_sequence_length():
    results = _results()
    compute = {**results[0]["compute"],  # 2.5 GFLOP/s, 2 ms a call at seq 128; 5 GFLOP/s, 1 ms at 512
               "attention": [[1e9, 2e-3 + 0.4, 128], [2e9, 2e-3 + 0.8, 128], [1e9, 1e-3 + 0.2, 512],
                             [2e9, 1e-3 + 0.4, 512], [4e9, 1e-3 + 0.8, 512]]}
    world = calibrated_world([{**r, "compute": compute} for r in results], backend="gloo", device="cpu")
    lines = world.calibration.attention_by_seq
    assert set(lines) == {128, 512}
    assert lines[128] == pytest.approx((0.25, 2e-3 - 1e-5 - 3 * 2e-5))  # of the 10 GFLOP/s matmul peak
    assert lines[512] == pytest.approx((0.5, 1e-3 - 1e-5 - 3 * 2e-5))
    line = world.calibration.attention_line
    assert line(4096) == lines[512] and line(16) == lines[128]
    assert line(256) == lines[128] and line(257) == lines[512]  # nearest by ratio; a tie to the shorter
    again = Calibration.from_json(world.calibration.to_json())  # JSON keys are strings
    assert again.attention_by_seq == lines and again == world.calibration
    assert calibrated_world(_results(), backend="gloo", device="cpu").calibration.attention_by_seq == {}
    with pytest.raises(XirangError, match="attention_by_seq"):
        Calibration(2, "gloo", "cpu", attention_by_seq={0: (0.5, 1e-3)})
    with pytest.raises(XirangError, match="fraction"):
        Calibration(2, "gloo", "cpu", attention_by_seq={128: (1.5, 1e-3)})


def test_an_attention_node_is_priced_at_the_line_of_its_sequence_length():
    gm = _gm()
    heads = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    base = Calibration(2, "gloo", "cpu", (SEND,), op_fixed_s={"attention": 1e-2})
    device = DeviceSpec("cpu", {"fp32": 2e10}, 2**32, 1e10, efficiency=Efficiency(attention=0.5))

    def total(calibration, seq=16):
        world = World((NodeSpec(2, device),), LINK, LINK, calibration)
        return _total(SplitPricer(gm, world, precision="fp32").price(1, (0,), 2, seq))

    def attention_flops(seq):
        total_flops = sum(FLOPS.get(n).total for n in heads)
        return float(total_flops.subs({s: {"batch": 2, "seq": seq}[s.name] for s in total_flops.free_symbols}))
    by_seq = {16: (0.25, 2e-2), 64: (1.0, 0.0)}
    slow = dataclasses.replace(base, attention_by_seq=by_seq)
    # at seq 16 its line: half the rate (twice the FLOP seconds) and 1e-2 more per call
    assert total(slow) - total(base) == pytest.approx(attention_flops(16) / (2e10 * 0.5) + len(heads) * 1e-2,
                                                      rel=1e-6)
    # at seq 64 the other line: twice the rate, no fixed cost
    assert total(slow, 64) - total(base, 64) == pytest.approx(
        attention_flops(64) / (2e10 * 1.0) - attention_flops(64) / (2e10 * 0.5) - len(heads) * 1e-2, rel=1e-6)
    far = dataclasses.replace(base, attention_by_seq={4096: (0.25, 2e-2)})  # the nearest, however far
    assert total(far) == pytest.approx(total(slow))
