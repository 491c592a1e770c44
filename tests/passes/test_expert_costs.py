"""Expert parallelism in the cost model (passes/planning/expert_costs.py) and the search space: what ep
changes in a unit's price, where ep is offered, and that the search takes it where the experts do
not fit otherwise."""
from __future__ import annotations

from dataclasses import replace

import pytest

from xirang.ir.device import GiB
from xirang.ir.errors import XirangError
from xirang.ir.world import World
from xirang.passes.planning.expert_costs import COUNT_BYTES, with_expert_parallel
from xirang.passes.planning.plan_search import search_plan
from xirang.passes.planning.plan_search_space import candidates, expert_degrees
from xirang.passes.planning.unit_costs import TensorSplit
from tests.passes.test_plan_search import pricer, tiny_device, unit

ROWS = 3 * 2**20  # bytes one rank's experts call dispatches


def moe_unit(name, *, params=1_000_000, expert_params=800_000, calls=1, expert_seconds=0.3):
    return replace(unit(name, params=params), expert_params=expert_params, expert_rows_bytes=ROWS * calls,
                   expert_calls=calls, expert_seconds=expert_seconds)


def test_ep_one_or_no_experts_leaves_the_split_as_it_is():
    split = TensorSplit(1, 1, 8, (moe_unit("block:a"),))
    assert with_expert_parallel(split, 1, lambda n: 1.0) is split
    dense = TensorSplit(1, 1, 8, (unit("block:a", params=10),))
    assert with_expert_parallel(dense, 4, lambda n: 1.0) is dense


def test_ep_holds_a_share_of_the_experts_and_pays_four_exchanges_per_call():
    sizes = []

    def all_to_all(nbytes):
        sizes.append(nbytes)
        return nbytes / 1e9  # one second per GB: the exchange's bytes read back from its price

    split = TensorSplit(1, 1, 8, (unit("segment:0", params=5), moe_unit("block:a", calls=2)))
    priced = with_expert_parallel(split, 4, all_to_all)
    dense, moe = priced.units
    assert dense == split.units[0]
    assert moe.params_local == 1_000_000 - 800_000 + 200_000 and moe.expert_params == 200_000
    # per call: dispatch and combine forward (+ the count exchange), the two gradients backward
    assert moe.ep_comm_forward_seconds == pytest.approx(2 * (2 * ROWS + COUNT_BYTES * 4) / 1e9)
    assert moe.ep_comm_backward_seconds == pytest.approx(2 * 2 * ROWS / 1e9)
    assert set(sizes) == {ROWS, COUNT_BYTES * 4}
    assert moe.seconds("none") == pytest.approx(split.units[1].seconds("none") + moe.ep_comm_forward_seconds
                                                + moe.ep_comm_backward_seconds)


def test_routing_imbalance_prices_the_most_loaded_rank():
    split = TensorSplit(1, 1, 8, (moe_unit("block:a", expert_seconds=0.3),))
    balanced = with_expert_parallel(split, 2, lambda n: n / 1e9).units[0]
    skewed = with_expert_parallel(split, 2, lambda n: n / 1e9, imbalance=1.5).units[0]
    assert skewed.forward_seconds + skewed.backward_seconds == pytest.approx(
        balanced.forward_seconds + balanced.backward_seconds + 0.3 * 0.5)
    assert skewed.ep_comm_backward_seconds == pytest.approx(1.5 * balanced.ep_comm_backward_seconds)


def test_ep_is_offered_over_the_divisors_of_dp_that_divide_the_experts_without_zero():
    assert expert_degrees(8, 0) == [1]
    assert expert_degrees(8, 12) == [1, 2, 4]
    assert expert_degrees(8, 12, pinned=4) == [4]
    world = World.uniform(1, 8, tiny_device(16 * GiB))
    found = candidates(world, 4, 8, pins={"pp": 1, "tp": 1}, experts=4)
    assert {c.ep for c in found} == {1, 2, 4}
    assert all(c.zero_stage == 0 for c in found if c.ep > 1)
    assert {c.zero_stage for c in found if c.ep == 1} == {0, 1, 3}


def test_a_pinned_ep_is_refused_with_the_reason():
    world = World.uniform(1, 8, tiny_device(16 * GiB))
    with pytest.raises(XirangError, match="no experts modules"):
        candidates(world, 4, 8, pins={"ep": 2}, experts=0)
    with pytest.raises(XirangError) as error:
        candidates(world, 4, 8, pins={"ep": 3, "pp": 1, "tp": 1}, experts=6)
    assert "ep=3" in error.value.what and "ep in {1, 2}" in error.value.hint


def test_a_pinned_ep_keeps_the_meshes_where_cp_could_run_out():
    """Where cp > 1 was offered, a pinned ep was read as ep 1 on those meshes: the search then returned
    dp 8 ep 1 for a pin of ep 16 (a published Qwen3-30B-A3B run priced with its memory check lifted)."""
    from xirang.passes.planning.context_parallel_cost import AttentionCall, ContextFacts
    from xirang.passes.planning.plan_search_space import ContextSpace
    world = World.uniform(1, 8, tiny_device(16 * GiB))
    space = ContextSpace(ContextFacts(calls=(AttentionCall(unit="block:a", q_heads=8, kv_heads=2, head_dim=64),)),
                         seq=8192)
    free = candidates(world, 4, 8, pins={"tp": 1, "pp": 1}, experts=8, context=space)
    assert any(c.cp > 1 for c in free)  # cp is offered here: the pin below is what rules it out
    pinned = candidates(world, 4, 8, pins={"tp": 1, "pp": 1, "ep": 4}, experts=8, context=space)
    assert pinned and all(c.ep == 4 and c.cp == 1 for c in pinned)


def test_the_search_spreads_experts_that_fit_no_other_way():
    """Two blocks of 1e9 parameters, 90% of them expert weights, on 8 devices of 16 GiB: whole, a block
    needs 16e9 B of model states; with ep 8 a rank holds 1/8 of the experts."""
    price = pricer(lambda tp, b: [moe_unit("block:a", params=10**9 // tp, expert_params=9 * 10**8 // tp),
                                  moe_unit("block:b", params=10**9 // tp, expert_params=9 * 10**8 // tp)])
    world = World.uniform(1, 8, tiny_device(16 * GiB))
    best = search_plan(price, world, global_batch=8, seq=8, experts=8, zero_stage=0, tp=1, pp=1).best
    assert best.candidate.ep == 8 and best.fits
    assert best.breakdown["ep_comm"] > 0


def test_the_experts_grouped_matmul_is_priced_as_a_matmul():
    """expert_linear was priced at the 'other ops' efficiency (a tenth of a100's) and its output's gradient,
    which a split backward keeps from B until W, was left out of the zero-bubble memory."""
    import xirang
    from examples.hf_moe import FAMILIES
    from xirang.passes.analysis.expert_ops import EXPERT_LINEAR
    from xirang.passes.planning.plan_splits import SplitPricer
    from xirang.passes.planning.plan_splits_costs import node_facts

    model, inputs = FAMILIES["mixtral"][0](2, 16, "meta", 0)
    gm = xirang.analyze(model, example_kwargs=inputs).graph_module
    pricer = SplitPricer(gm, World.uniform(1, 1, "a100-80g"), precision="bf16")
    experts = [node for node in gm.graph.nodes if node.op == "call_function" and node.target == EXPERT_LINEAR]
    assert len(experts) == 2 * model.config.num_hidden_layers
    for node in experts:
        facts = node_facts(node, pricer.table, pricer.float_bytes, seq_known=True)
        assert facts.matmul and facts.expert and facts.weight_output is not None, node.name


def test_overlapped_all_to_alls_expose_only_what_the_other_micro_batch_does_not_cover():
    """Megatron's batch-level overlap: a unit takes max(compute, all-to-alls) per micro-batch, not their sum."""
    split = TensorSplit(1, 1, 8, (moe_unit("block:a"),))
    compute = split.units[0].forward_seconds + split.units[0].backward_seconds
    exposed = with_expert_parallel(split, 4, lambda n: n / 1e9).units[0]
    comm = exposed.ep_comm_forward_seconds + exposed.ep_comm_backward_seconds
    slow = with_expert_parallel(split, 4, lambda n: 10 * compute * n / 1e9 / (comm or 1), overlap=True).units[0]
    # the all-to-alls ten times the compute: all but the compute's length stays exposed, split as they are
    assert slow.ep_comm_forward_seconds + slow.ep_comm_backward_seconds == pytest.approx(9 * compute)
    assert slow.ep_comm_forward_seconds / slow.ep_comm_backward_seconds == pytest.approx(
        exposed.ep_comm_forward_seconds / exposed.ep_comm_backward_seconds)
    assert slow.seconds("none") == pytest.approx(10 * compute)
    fast = with_expert_parallel(split, 4, lambda n: 0.5 * compute * n / 1e9 / comm, overlap=True).units[0]
    assert fast.ep_comm_forward_seconds == fast.ep_comm_backward_seconds == 0.0  # hidden under the compute
    assert fast.seconds("none") == pytest.approx(compute)


def test_a_pinned_ep_overlap_is_recorded_and_prices_the_step_faster():
    import xirang
    from examples.hf_moe import FAMILIES
    model, inputs = FAMILIES["qwen3_moe"][0](2, 16, "meta", 0, experts=None)
    plans = [xirang.plan(model, world="1x4", hardware="h100-80g", example_kwargs=inputs, global_batch=8, seq=4096,
                         dp=4, tp=1, pp=1, ep=4, micro_batch=1, schedule="1f1b", zero_stage=0, recompute="none",
                         ep_overlap=overlap)
             for overlap in (False, True)]
    exposed, overlapped = plans
    assert (exposed.ep_overlap, overlapped.ep_overlap) == (False, True)
    assert type(overlapped).from_json(overlapped.to_json()).ep_overlap is True
    assert overlapped.predicted.breakdown["ep_comm"] < exposed.predicted.breakdown["ep_comm"]
    assert overlapped.predicted.step_seconds < exposed.predicted.step_seconds


def test_a_capacity_factor_bounds_the_most_loaded_rank():
    """Each expert takes at most ceil(S / E x f) of a rank's S rows, so an ep rank receives at most f times the
    balanced rows: a router skewed 2x with capacity 1.25 is priced at 1.25x, one within capacity as it is."""
    split = TensorSplit(1, 1, 8, (moe_unit("block:a", expert_seconds=0.3),))

    def priced(imbalance, factor):
        return with_expert_parallel(split, 2, lambda n: n / 1e9, imbalance=imbalance, capacity_factor=factor).units[0]
    assert priced(2.0, 1.25) == priced(1.25, None)
    assert priced(1.1, 1.25) == priced(1.1, None)
    bounded, skewed = priced(2.0, 1.25), priced(2.0, None)
    assert bounded.ep_comm_backward_seconds == pytest.approx(skewed.ep_comm_backward_seconds * 1.25 / 2.0)
    # below 1 every expert is full even when balanced: fewer rows sent and computed than dropless
    assert priced(1.0, 0.5).ep_comm_backward_seconds == pytest.approx(priced(1.0, None).ep_comm_backward_seconds / 2)
    assert priced(1.0, 0.5).forward_seconds < priced(1.0, None).forward_seconds
