"""The cost model reads a calibrated World: measured collective lines replace the link formulas (for
the kinds and group sizes measured, on one node), comm that does not overlap compute is all exposed,
and every dispatched op pays the device's fixed per-op cost in the split pricing."""
from __future__ import annotations

import functools

import pytest

from conftest import token_batch
from examples.gpt import GPTConfig, build_gpt
import xirang
from xirang.ir.calibration import Calibration, CollectiveFit
from xirang.ir.device import DeviceSpec
from xirang.ir.world import LinkSpec, NodeSpec, World
from xirang.passes.planning.cost_collectives import collective_cost
from xirang.passes.planning.plan_costs import CandidatePricer
from xirang.passes.planning.plan_search_space import Candidate
from xirang.passes.planning.plan_splits import SplitPricer
from xirang.passes.planning.unit_costs import TensorSplit, UnitCost

FITS = (CollectiveFit("all_reduce", 4, "gloo", 1e-3, 1e-8), CollectiveFit("send", 2, "gloo", 2e-4, 2e-9))
LINK = LinkSpec(5e8, 2e-4)


def _world(calibration=None, op_overhead_s=0.0, devices=4) -> World:
    device = DeviceSpec("cpu", {"fp32": 2e10}, 2**32, 1e10, op_overhead_s=op_overhead_s)
    return World((NodeSpec(devices, device),), LINK, LINK, calibration)


CALIBRATED = _world(Calibration(4, "gloo", "cpu", FITS, comm_overlaps_compute=False))


def test_a_measured_line_prices_its_kind_and_group_size():
    cost = collective_cost("all_reduce", 1e6, (0, 1, 2, 3), CALIBRATED)
    assert cost.algorithm == "measured" and cost.seconds == pytest.approx(1e-3 + 1e-8 * 1e6)
    formula = collective_cost("all_reduce", 1e6, (0, 1, 2, 3), _world())
    assert formula.algorithm != "measured" and formula.seconds != pytest.approx(cost.seconds)
    assert collective_cost("send", 1e6, (0, 1), CALIBRATED).seconds == pytest.approx(2e-4 + 2e-3)
    # not measured: group of 2 all-reduce, and all_gather, fall back to the formulas on the links
    assert collective_cost("all_reduce", 1e6, (0, 1), CALIBRATED).algorithm != "measured"
    assert collective_cost("all_gather", 1e6, (0, 1, 2, 3), CALIBRATED).algorithm == "ring"
    assert collective_cost("all_reduce", 0, (0, 1, 2, 3), CALIBRATED).seconds == 0.0


def test_measured_lines_apply_only_within_one_node():
    node = NodeSpec(2, CALIBRATED.nodes[0].device)
    two_nodes = World((node, node), LINK, LINK, CALIBRATED.calibration)
    assert collective_cost("all_reduce", 1e6, (0, 1, 2, 3), two_nodes).algorithm != "measured"


@functools.cache
def _gm():
    model = build_gpt(GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=2, layers=2), device="meta")
    return xirang.analyze(model, example_kwargs=token_batch()).graph_module


def test_every_dispatched_op_pays_the_fixed_per_op_cost():
    gm, overhead = _gm(), 1e-3
    plain = SplitPricer(gm, _world(), precision="fp32").price(1, (0,), 2, 16)
    taxed = SplitPricer(gm, _world(op_overhead_s=overhead), precision="fp32").price(1, (0,), 2, 16)
    added = sum(t.forward_seconds + t.backward_seconds - p.forward_seconds - p.backward_seconds
                for t, p in zip(taxed.units, plain.units))
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and "getitem" not in str(n.target)]
    # each op once forward, and an op on the gradient path at least once more in the backward
    assert len(ops) * overhead < added <= 4 * len(ops) * overhead


def _unit(name, seconds=1.0, params=0):
    return UnitCost(name, name.split(":")[0], forward_seconds=0.4 * seconds, backward_seconds=0.6 * seconds,
                    tp_comm_forward_seconds=0.0, tp_comm_backward_seconds=0.0, params_local=params,
                    saved_bytes=0.0, selective_saved_bytes=0.0, selective_recompute_seconds=0.0, input_bytes=0.0,
                    cut_bytes_after=0.0, model_flops=0.0, model_forward_flops=0.0)


def _priced(world, candidate, units, bounds):
    split = TensorSplit(1, 1, 8, units)
    return CandidatePricer({(1, 1): split}, world, global_batch=8).price(candidate, bounds, exact=True)


def test_a_calibrated_world_with_no_overlap_exposes_the_whole_gradient_sync():
    # four units of one 40M-element bucket each on dp=4: overlapped, the backward hides all but the
    # last all-reduce; on CPU ranks (gloo threads on the computing cores) all four are exposed
    c = Candidate(tp=1, pp=1, dp=4, micro_batch=1, num_micro_batches=1, schedule="1f1b", virtual_stages=1,
                  recompute="none")
    units = [_unit(f"block:{i}", 10.0, params=40_000_000) for i in range(4)]
    hidden = _priced(_world(Calibration(4, "gloo", "cpu", FITS)), c, units, ((0, 4),))
    exposed = _priced(CALIBRATED, c, units, ((0, 4),))
    bucket = FITS[0].seconds(40_000_000 * 2)  # bf16 gradients
    assert hidden.breakdown["dp_exposed"] == pytest.approx(bucket)
    assert exposed.breakdown["dp_exposed"] == pytest.approx(4 * bucket)


def test_ranks_sharing_cores_fill_the_pipeline_bubble():
    # pp=4, 4 micro-batches of one unit per stage (1 s each): 1F1B takes (m + p - 1) = 7 s on 4
    # devices; on one core shared by the 4 ranks the idle ranks' time goes to the busy ones: the step
    # is the work, m = 4 s, and the critical path at one-rank-alone speed (7 s · 1/4) does not bind
    c = Candidate(tp=1, pp=4, dp=1, micro_batch=1, num_micro_batches=4, schedule="1f1b", virtual_stages=1,
                  recompute="none")
    units, bounds = [_unit(f"block:{i}") for i in range(4)], tuple((i, i + 1) for i in range(4))
    def pipeline(parallel_ranks):  # the step less its own collectives (the broadcast of the loss over pp)
        priced = _priced(_world(Calibration(4, "gloo", "cpu", FITS, parallel_ranks=parallel_ranks)), c, units, bounds)
        assert sum(priced.breakdown.values()) == pytest.approx(priced.step_seconds)
        return priced.step_seconds - priced.breakdown["step_sync"]
    assert pipeline(None) == pytest.approx(7.0) and pipeline(1.0) == pytest.approx(4.0)
    # two cores: the critical path, 7 s at twice the speed, binds
    assert pipeline(2.0) == pytest.approx(4.0)
    assert pipeline(3.0) == pytest.approx(7.0 * 3 / 4)


def test_the_backward_pays_an_autograd_node_per_gradient_op_and_per_trainable_parameter():
    from xirang.ir.meta_keys import REQUIRES_GRAD, ROLE
    gm, per_node = _gm(), 1e-3
    calibrated = lambda seconds: _world(calibration=Calibration(2, "gloo", "cpu", backward_op_overhead_s=seconds))  # noqa: E731
    plain = SplitPricer(gm, calibrated(0.0), precision="fp32").price(1, (0,), 2, 16)
    taxed = SplitPricer(gm, calibrated(per_node), precision="fp32").price(1, (0,), 2, 16)
    # a node's fixed costs are split between its forward and backward like its FLOPs: count both
    added = sum(t.forward_seconds + t.backward_seconds - p.forward_seconds - p.backward_seconds
                for t, p in zip(taxed.units, plain.units))
    nodes = list(gm.graph.nodes)
    gradient_ops = sum(max(1, sum(bool(REQUIRES_GRAD.get(i, False)) for i in n.all_input_nodes)) for n in nodes
                       if n.op == "call_function" and "getitem" not in str(n.target) and REQUIRES_GRAD.get(n, False))
    # autograd's AccumulateGrad: one node per trainable parameter, every micro-batch
    parameters = sum(1 for n in nodes if n.op == "placeholder" and ROLE.get(n, None) == "parameter"
                     and REQUIRES_GRAD.get(n, False))
    assert parameters >= 10
    assert added == pytest.approx((gradient_ops + parameters) * per_node)
