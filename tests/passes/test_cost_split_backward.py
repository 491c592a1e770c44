"""A split backward (ZB-H1 / ZB-H2's BackwardInput then BackwardWeight) is priced at what it measured
beside the fused one: ``xirang calibrate`` times both on a transformer stage
(``calibration/op_classes.split_backward_sample``), ``calibrated_world`` keeps the extra as a fraction
of the fused backward (``Calibration.split_backward_extra``), and the planner adds it to the backward
of schedules that split it; without it (presets, GPUs, older files) nothing changes."""
from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input

from xirang.codegen.runtime.calibration.op_classes import split_backward_sample
from xirang.codegen.runtime.calibration.calibrated_world import calibrated_world, split_backward_extra
from xirang.codegen.runtime.executor.pipeline_executor import backward_weights
from xirang.ir.calibration import Calibration
from xirang.ir.device import DeviceSpec
from xirang.ir.world import LinkSpec, NodeSpec, World
from xirang.passes.planning.cost_model import pipeline_step_time
from xirang.passes.planning.plan_costs import CandidatePricer
from xirang.passes.planning.plan_search_space import Candidate
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

LINK = LinkSpec(5e8, 0.0)


def _results(split: dict | None) -> list:
    """What calibrate_rank returns, made up (as tests/passes/test_cost_op_classes.py), with ``split``
    as its split-backward sample (or none)."""
    recompute = {"plain_s": 0.02, "checkpointed_s": 0.03, "forward_s": 0.006, "saved_tensors": 40}
    compute = {"matmul": {"float32": [[1e9, 1e-3 + 0.1], [2e9, 1e-3 + 0.2]]}, "elementwise": [[1e6, 1e-3], [2e6, 2e-3]],
               "op_forward_s": 1e-5, "op_backward_s": 2e-5, "recompute": recompute}
    if split is not None:
        compute["split_backward"] = split
    return [{"threads": 1, "compute": compute, "sharing": None, "collectives": {}}] * 2


def test_calibrated_world_keeps_the_split_backwards_extra_over_the_fused_one():
    # forward 10 ms; forward + fused backward 30 ms; forward + B + W 35 ms: the split costs 5 / 20 more
    sample = {"forward_s": 0.010, "fused_s": 0.030, "split_s": 0.035}
    calibration = calibrated_world(_results(sample), backend="gloo", device="cpu").calibration
    assert calibration.split_backward_extra == pytest.approx(0.25)
    assert calibration.raw["split_backward"]["split_s"] == 0.035
    assert Calibration.from_json(calibration.to_json()).split_backward_extra == pytest.approx(0.25)
    assert pickle.loads(pickle.dumps(calibration)).split_backward_extra == pytest.approx(0.25)
    assert Calibration.from_json(calibration.to_json()) == calibration
    # not measured (files and results from before): 0, the split priced as the fused backward
    assert calibrated_world(_results(None), backend="gloo", device="cpu").calibration.split_backward_extra == 0.0
    data = calibration.to_json()
    del data["split_backward_extra"]
    assert Calibration.from_json(data).split_backward_extra == 0.0
    # a split measured faster than the fused backward (noise) costs nothing extra, never less
    assert split_backward_extra({"forward_s": 0.01, "fused_s": 0.03, "split_s": 0.029}) == 0.0
    assert split_backward_extra({"forward_s": 0.03, "fused_s": 0.03, "split_s": 0.04}) is None
    with pytest.raises(ValueError, match="split_backward_extra must be a non-negative"):
        Calibration(2, "gloo", "cpu", split_backward_extra=-0.1)


def test_the_timed_split_backward_gives_the_fused_gradients_and_times_both():
    torch.manual_seed(0)
    weights = [torch.randn(*shape, requires_grad=True) for shape in ((8, 8), (8,), (8, 8), (8,))]
    x, grad = torch.randn(4, 8), torch.randn(4, 8)

    def stage():
        leaf = x.clone().requires_grad_()
        inner = torch.tanh(torch.nn.functional.linear(leaf, weights[0], weights[1]))
        return leaf, torch.nn.functional.linear(inner, weights[2], weights[3])
    leaf, out = stage()
    torch.autograd.backward([out], [grad])
    fused = [leaf.grad] + [w.grad.clone() for w in weights]
    for w in weights:
        w.grad = None
    leaf, out = stage()
    dinputs, groups = stage_backward_input([out], [grad], [leaf], iter(weights))
    backward_weights(groups, weights)
    for want, got in zip(fused, [dinputs[0]] + [w.grad for w in weights]):
        torch.testing.assert_close(got, want)
    calls = []

    def timed(fn, device, iters):
        calls.append(fn.__name__)
        fn()
        return {"forward": 1.0, "fused": 3.0, "split": 4.0}[fn.__name__]
    sample = split_backward_sample("cpu", True, timed, 1)
    assert calls == ["forward", "fused", "split"] * 3 and split_backward_extra(sample) == pytest.approx(0.5)


def _split() -> TensorSplit:
    def unit(i):  # full recompute: the forward again, 0.4 s
        return UnitCost(f"block:{i}", "block", forward_seconds=0.4, backward_seconds=0.6, tp_comm_forward_seconds=0.0,
                        tp_comm_backward_seconds=0.0, params_local=1, saved_bytes=0.0, selective_saved_bytes=0.0,
                        selective_recompute_seconds=0.0, input_bytes=0.0, cut_bytes_after=0.0, model_flops=1.0,
                        model_forward_flops=1.0)
    return TensorSplit(1, 1, 8, (unit(0), unit(1)))


def _step(schedule: str, calibration: Calibration | None, recompute: str = "none") -> float:
    device = DeviceSpec("cpu", {"fp32": 2e10}, 2**32, 1e10)
    world = World((NodeSpec(2, device),), LINK, LINK, calibration)
    c = Candidate(tp=1, pp=2, dp=1, micro_batch=1, num_micro_batches=4, schedule=schedule, virtual_stages=1,
                  recompute=recompute)
    return CandidatePricer({(1, 1): _split()}, world, global_batch=4).price(c, ((0, 1), (1, 2))).step_seconds


def test_schedules_that_split_the_backward_pay_its_measured_extra():
    plain, measured = Calibration(2, "gloo", "cpu"), Calibration(2, "gloo", "cpu", split_backward_extra=0.3)
    # each rank: forward 0.4 s, backward 0.6 s a micro-batch; the zero-bubble bubble at backward / forward
    assert _step("zb-h1", plain) == pytest.approx(pipeline_step_time("zb-h1", 2, 4, 1.0, 1, 1.5))
    assert _step("zb-h1", None) == _step("zb-h1", plain)
    # measured 30 % dearer: each backward 0.78 s, and the bubble at the ratio 0.78 / 0.4
    assert _step("zb-h1", measured) == pytest.approx(pipeline_step_time("zb-h1", 2, 4, 1.18, 1, 0.78 / 0.4))
    assert _step("zb-h2", measured) == pytest.approx(pipeline_step_time("zb-h2", 2, 4, 1.18, 1, 0.78 / 0.4))
    # 1F1B runs the fused backward: the split's cost is none of its business
    assert _step("1f1b", measured) == _step("1f1b", plain) == pytest.approx(pipeline_step_time("1f1b", 2, 4, 1.0))
    # priced as fused, ZB-H1's smaller bubble wins; at its measured cost, 1F1B does
    assert _step("zb-h1", plain) < _step("1f1b", plain)
    assert _step("1f1b", measured) < _step("zb-h1", measured)


def test_a_split_backward_recomputes_a_block_twice_whatever_the_world():
    # B's pass over the graph recomputes each checkpointed block and W's does again (the executor's
    # split; tests/codegen/test_recompute.py): 1F1B's backward is 0.6 + 0.4, ZB-H1's 0.6 + 2 x 0.4
    assert _step("1f1b", None, "full") == pytest.approx(pipeline_step_time("1f1b", 2, 4, 1.4))
    assert _step("zb-h1", None, "full") == pytest.approx(pipeline_step_time("zb-h1", 2, 4, 1.8, 1, 1.4 / 0.4))
    measured = Calibration(2, "gloo", "cpu", split_backward_extra=0.3)  # and the measured extra on top
    assert _step("zb-h1", measured, "full") == pytest.approx(pipeline_step_time("zb-h1", 2, 4, 1.98, 1, 1.58 / 0.4))
