"""Sequence parallelism in the split ILP: offered only when asked, priced against the all-reduce layout.

With ``sequence_parallel`` the rules add a sequence-sharded row to the residual stream's ops
(sharding_rules_sequence); the ILP takes them where they cost less. On a CPU world (slow compute,
cheap collectives relative to it) it does: the norms and adds run on 1/tp of the tokens, the
row-parallel outputs are reduce-scattered, and the step is predicted faster; on A100s at seq 4096 it
does not (with Replicate block boundaries a block pays one more all-gather than it saves), and the
plan is the one sequence parallelism off gives.
"""
import copy

import pytest
import sympy

import xirang
from conftest import token_batch
from examples.gpt import build_gpt
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanReplicate, PlanShard
from xirang.ir.world import parse_world
from xirang.passes.planning.plan_splits import SplitPricer
from xirang.passes.planning.sharding_rules import strategies_for
from xirang.passes.planning.sharding_rules_sequence import sequence_dims

TP = 4


@pytest.fixture(scope="module")
def gpt_graph():
    return xirang.analyze(build_gpt("tiny", device="meta"), example_kwargs=token_batch()).graph_module


def _seq_choices(split) -> dict:
    return {name: s for name, s in split.placements.items() if s.strategy.startswith("seq ")}


def test_sequence_dims_are_multiples_of_seq_alone():
    seq, batch = sympy.Symbol("seq", integer=True, positive=True), sympy.Symbol("batch", integer=True, positive=True)
    assert sequence_dims((batch, seq, 64)) == [1]
    assert sequence_dims((batch, 2 * seq, 64)) == [1]
    assert sequence_dims((batch * seq, 64)) == []  # flattened with the batch: not a sequence shard
    assert sequence_dims((batch, 4, seq, seq)) == [2, 3]  # attention scores: the rules leave them alone


def test_rows_only_when_asked(gpt_graph):
    norms = [n for n in gpt_graph.graph.nodes if n.op == "call_function" and "layer_norm" in str(n.target)]
    assert norms
    for node in norms:
        assert not any(s.name.startswith("seq ") for s in strategies_for(node, TP))
        rows = [s for s in strategies_for(node, TP, True) if s.name.startswith("seq ")]
        assert [(s.inputs[0], s.output, s.compute_fraction) for s in rows] == [(PlanShard(1), PlanShard(1), 1 / TP)]
        assert all(p == PlanReplicate() for p in rows[0].inputs[1:])  # weight and bias whole


def test_ilp_takes_sequence_shards_where_cheaper(gpt_graph):
    group = tuple(range(TP))
    cpu = SplitPricer(gpt_graph, parse_world(TP, "cpu"), precision="fp32")
    off, on = cpu.price(TP, group, 1, 4096), cpu.price(TP, group, 1, 4096, sequence_parallel=True)
    assert not _seq_choices(off)
    chosen = _seq_choices(on)
    assert any("layer_norm" in name for name in chosen) and any(name.startswith("add") for name in chosen), chosen
    assert sum(u.forward_seconds + u.backward_seconds for u in on.units) < \
        sum(u.forward_seconds + u.backward_seconds for u in off.units)
    # the activations the split ops keep are priced at their sequence shard (1/tp): less per block
    blocks_off = {u.name: u.saved_bytes for u in off.units if u.name.startswith("block:")}
    blocks_on = {u.name: u.saved_bytes for u in on.units if u.name.startswith("block:")}
    assert blocks_on and all(blocks_on[name] < blocks_off[name] for name in blocks_on), (blocks_on, blocks_off)
    kinds = {c.kind for c in on.collectives}
    assert "reduce_scatter" in kinds or "all_gather" in kinds, kinds
    # where it is not cheaper the ILP keeps today's layout exactly
    gpu = SplitPricer(gpt_graph, parse_world(TP, "a100-80g"), precision="fp32")
    assert gpu.price(TP, group, 1, 4096, sequence_parallel=True).placements == gpu.price(TP, group, 1, 4096).placements


def test_price_refuses_a_non_bool(gpt_graph):
    pricer = SplitPricer(gpt_graph, parse_world(TP, "cpu"), precision="fp32")
    with pytest.raises(XirangError, match="sequence_parallel must be True or False"):
        pricer.price(TP, tuple(range(TP)), 1, 4096, sequence_parallel="yes")


def test_lowering_refuses_a_sequence_shard_tp_does_not_divide(gpt_graph):
    from xirang.ir.meta_keys import LAYOUT, SYMBOLS
    from xirang.ir.plan_parts import Layout, NodeStrategy
    from xirang.passes.lowering.rewrite_tp import check_sequence_shards
    gm = copy.deepcopy(gpt_graph)  # the analysed graph is never written to; lowering works on a copy
    norm = next(n for n in gm.graph.nodes if n.op == "call_function" and "layer_norm" in str(n.target))
    row = next(s for s in strategies_for(norm, 3, True) if s.name.startswith("seq "))
    LAYOUT.set(norm, NodeStrategy(row.name, tuple(Layout(tp=p) for p in row.inputs), (Layout(tp=row.output),)))
    assert SYMBOLS.get(gm)["seq"] == 16
    check_sequence_shards(gm, 4)  # 4 divides 16
    with pytest.raises(XirangError, match=f"{norm.name} is sharded along the sequence on tp=3, but the program is "
                                          "built for seq 16"):
        check_sequence_shards(gm, 3)
