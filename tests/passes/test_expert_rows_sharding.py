"""The routed rows of an experts call (expert_ops.routed_rows) are never sharded over tp by their rows dim.

Traced, that dim is tokens x top_k, which tp divides; under expert parallelism a rank holds as many rows
as the routing sent it, which tp need not divide. Before the rule, a CPU-priced Qwen3-MoE plan reduce-
scattered a row-parallel first expert matmul's Partial output over its rows for the gate and gathered it
back, so rows were lost and the combine's all-to-all failed on 4 gloo ranks (dp2 tp2 ep2; the multi-rank
run is tests/models/test_moe_families.py's expert tensor parallelism test)."""
from __future__ import annotations

import xirang
from examples.hf_moe import FAMILIES
from xirang.ir.placement import PlanShard
from xirang.passes.analysis.expert_ops import EXPERT_LINEAR, expert_calls, routed_rows
from xirang.passes.planning.sharding_rules import strategies_for
from xirang.passes.planning.sharding_rules_views import divides, shape


def _graph(name):
    model, inputs = FAMILIES[name][0](2, 16, "meta", 0, experts=None)
    return xirang.analyze(model, example_kwargs=inputs).graph_module.graph


def _splits_rows(node, strategy, routed):
    outputs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    reads = [p for value, p in zip(node.all_input_nodes, strategy.inputs) if value in routed]
    return any(isinstance(p, PlanShard) and p.dim == 0 for p in list(outputs) + reads)


def test_routed_rows_are_the_expert_matmuls_and_the_gate_between():
    graph = _graph("qwen3_moe")
    routed = routed_rows(graph)
    calls = expert_calls(graph)
    assert len(calls) == 2  # two MoE layers
    linears = {n for group in calls.values() for n in group}
    gate = sorted(getattr(n.target, "__name__", str(n.target)) for n in routed - linears)
    # Qwen3-MoE's gate, per layer: gate, up = chunk(gate_up); silu(gate) * up
    assert gate == sorted(["chunk.default", "getitem", "getitem", "silu.default", "mul.Tensor"] * 2), gate
    for first, last in calls.values():
        assert first in routed and last in routed
        assert not any(user in routed for user in last.users)  # combined back in token order
        assert first.args[0] not in routed  # the rows before the dispatch


def test_no_tp_strategy_shards_the_routed_rows_dim():
    graph = _graph("qwen3_moe")
    routed = routed_rows(graph)
    gate = [n for n in routed if n.target != EXPERT_LINEAR]
    assert gate and all(divides(2, shape(n)[0]) for n in gate if shape(n))  # the trace's rows dim tp divides
    for node in routed:
        strategies = strategies_for(node, 2)
        assert not any(_splits_rows(node, s, routed) for s in strategies), (node, [str(s) for s in strategies])
    # the gate still splits by features (the expert matmuls' tensor parallelism)
    assert all(any(isinstance(s.output, PlanShard) and s.output.dim == 1 for s in strategies_for(n, 2))
               for n in gate if n.op == "call_function" and len(shape(n)) == 2)
