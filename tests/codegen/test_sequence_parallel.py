"""Sequence-parallel layouts (Korthikanti et al. 2022) train as one device, on CPU gloo ranks.

The split ILP takes a sequence shard of the residual stream only where it costs less than the
all-reduce layout (sharding_rules_sequence), which on these tiny models at A100 planning sizes it
may not. So that the runtime is tested on every layout the rules can produce, each plan here is made with
``sequence_parallel=True`` and then every op that has a sequence-sharded row is moved onto it: the
adds, norms, dropouts and pointwise ops run on 1/tp of the tokens, and the lowering enacts
Partial -> S(seq) as a reduce-scatter, S(seq) -> R as an all-gather, R -> S(seq) as a local slice
and S(seq) <-> S(heads) as an all-to-all, with their backward duals. Plans are made on the CPU
model at seq 4096 on A100s (tp really shards, asserted) and run at seq 16 (tp divides it).
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest

import xirang
from tests.codegen.single_device import compiled_run, worst_differences
from tests.codegen.test_3d import GLOBAL_BATCH, STEPS, TOLERANCE, batch, build, reference
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.ir.plan_parts import Layout, NodeStrategy
from xirang.ir.placement import PlanShard
from xirang.lower import lower
from xirang.passes.planning.plan_splits import SplitPricer
from xirang.passes.planning.sharding_rules import strategies_for


def sequence_plan(name: str, dp: int, tp: int, pp: int, schedule: str, v: int = 1, seq: int = 4096,
                  device: str = "a100-80g", force: bool = True):
    """A plan with every op that has a sequence-sharded row on it (see the module docstring); with
    ``force`` False, the ILP's own choice."""
    model = build(name)
    report = xirang.analyze(model, example_kwargs=batch(0, 2))
    plan = xirang.plan(model, world=dp * tp * pp, example_kwargs=batch(0, 2), global_batch=GLOBAL_BATCH, seq=seq,
                       hardware=device, precision="fp32", dp=dp, tp=tp, pp=pp, schedule=schedule,
                       virtual_stages=v, micro_batch=1, sequence_parallel=True, analysed=report)
    assert plan.sequence_parallel and any(isinstance(s.outputs[0].tp, PlanShard) for n, s in plan.placements.items()
                                          if n.startswith("p_") and s.outputs), f"{name}: tp shards nothing"
    placements = dict(plan.placements)
    for node in report.graph_module.graph.nodes if force else ():
        rows = [s for s in strategies_for(node, tp, True) if s.name.startswith("seq")] \
            if node.op == "call_function" else []
        if rows and node.name in placements:
            placements[node.name] = NodeStrategy(rows[0].name, tuple(Layout(tp=p) for p in rows[0].inputs),
                                                 (Layout(tp=rows[0].output),))
    moved = sum(1 for n, s in placements.items() if s.strategy.startswith("seq"))
    assert moved >= 4, f"{name}: only {moved} ops took a sequence shard"
    return dataclasses.replace(plan, placements=placements)


def tp_records(counter, tp: int) -> list:
    """The tp collectives a counter saw (the dp buckets and tied sums are comm_check's)."""
    return [record for record in counter.records
            if record.group_size == tp and not record.label.startswith(("bucket:", "tied:"))]


def run_lowered(rank: int, jobs, measure) -> dict:
    """Each (label, model name, plan) of ``jobs`` lowered for ``rank`` and trained ``STEPS`` steps:
    ``compiled_run``'s results, the program's code, and ``measure(counter, plan)``'s entries."""
    results, traced = {}, {}
    for label, name, plan in jobs:
        if name not in traced:
            traced[name] = xirang.analyze(build(name), example_kwargs=batch(0, 2)).graph_module
        program = lower(traced[name], plan, rank=rank).program
        counter = CommCounter()
        compiled = CompiledModel(build(name), plan, program, groups=build_mesh_groups(plan.mesh), counter=counter)
        results[label] = compiled_run(compiled, batch, STEPS)
        results[label]["code"] = compiled.code()
        results[label].update(measure(counter, plan))
    return results


def _tp_bytes_per_step(counter, plan) -> dict:
    tp_bytes = Counter()
    for record in tp_records(counter, plan.mesh.tp):
        tp_bytes[record.kind] += record.nbytes
    return {"tp_bytes_per_step": {kind: total / STEPS for kind, total in tp_bytes.items()}}


def _rank_main(rank, world, jobs):
    return run_lowered(rank, jobs, _tp_bytes_per_step)


def _run(configs, wanted_kinds=("gather", "scatter_to_group")):
    jobs = [(f"{name} {dp}x{tp}x{pp} {schedule}", name, sequence_plan(name, dp, tp, pp, schedule, v, seq, *rest))
            for name, dp, tp, pp, schedule, v, seq, *rest in configs]
    world = {plan.mesh.size for _, _, plan in jobs}
    assert len(world) == 1, "one launch runs configurations of one world size"
    results = launch(_rank_main, world.pop(), (jobs,), timeout_s=900, heartbeat_s=60)
    wants = {}
    for label, name, _ in jobs:
        wants.setdefault(name, reference(name))
        worst = worst_differences(label, results, wants[name])
        print(f"{label}: max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} param {worst['param']:.1e}")
        assert all(value <= TOLERANCE for value in worst.values()), (label, worst)
        kinds = Counter(re.findall(r"xirang_codegen_ops_collectives_(\w+?)\(", results[0][label]["code"]))
        print(f"{label}: tp collectives in rank 0's program {dict(kinds)}")
        for kind in wanted_kinds:  # "gather": either all-gather (its backward a slice or a reduce-scatter)
            found = kinds["gather_from_group"] + kinds["gather_summing_grad"] if kind == "gather" else kinds[kind]
            assert found, (label, kind, dict(kinds))
    return results, jobs[0]


def test_sequence_parallel_on_two_tp_ranks_equals_single_device():
    """The default tier's sequence-parallel run: the in-repo GPT at (1, 2, 1), one launch of 2 ranks, every
    sequence row taken, the all-gathers, slices and reduce-scatters in its program."""
    _run([("gpt", 1, 2, 1, "1f1b", 1, 65536)], ("gather", "scatter_to_group", "reduce_scatter_to_group"))


# Planned at seq 65536 the ILP makes the MLPs row-parallel, so a Partial meets a sequence shard
# (reduce-scatter); each test is one launch (~40 s on 2 loaded cores), hence the matrix tier.
@pytest.mark.matrix
@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama"])
def test_sequence_parallel_1x4x1_equals_single_device(name):
    # GPT-2's row-parallel Conv1D output is Partial on [b*s, h]; the view back to [b, s, h] stays R in
    # the plan, so it is all-reduced there and sliced: no reduce-scatter in that program
    kinds = ("gather", "scatter_to_group") + (() if name == "gpt2" else ("reduce_scatter_to_group",))
    _run([(name, 1, 4, 1, "1f1b", 1, 65536)], kinds)


@pytest.mark.matrix
@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama"])
def test_sequence_parallel_2x2x2_equals_single_device(name):
    _run([(name, 2, 2, 2, "1f1b", 1, 65536), (name, 2, 2, 2, "interleaved", 2, 65536)])


@pytest.mark.matrix
def test_sequence_parallel_plan_the_ilp_chose_equals_single_device_and_moves_its_bytes():
    """On a CPU world the ILP itself takes sequence shards (tests/passes/test_sequence_parallel_rules.py);
    every tp collective's bytes per step, by kind, equal the split's analytic count at the run's sizes,
    block boundaries included (the residual stream crosses them as a sequence shard on both sides)."""
    # the stream crosses blocks as a sequence shard: reduce-scattered after the row-parallel linears,
    # gathered before the column-parallel ones, never sliced from a replicated copy (Megatron's layout)
    results, (_, _, plan) = _run([("gpt", 1, 4, 1, "1f1b", 1, 4096, "cpu", False)],
                                 ("gather", "reduce_scatter_to_group"))
    gm = xirang.analyze(build("gpt"), example_kwargs=batch(0, 2)).graph_module
    pricer = SplitPricer(gm, plan.world, precision="fp32")
    group = tuple(range(plan.mesh.tp))
    split = pricer.price(plan.mesh.tp, group, 1, 4096, sequence_parallel=True)
    assert {n: s for n, s in split.placements.items() if s.strategy.startswith("seq ")} == \
        {n: s for n, s in plan.placements.items() if s.strategy.startswith("seq ")}  # the plan's own split
    per_micro_batch = pricer.tp_bytes_per_micro_batch(plan.mesh.tp, group, 1, 4096, run_micro_batch=1,
                                                      run_seq=batch(0)["input_ids"].shape[1],
                                                      sequence_parallel=True)
    planned = {kind: nbytes * plan.num_micro_batches for kind, nbytes in per_micro_batch.items() if nbytes}
    for rank, result in enumerate(results):
        measured = result["gpt 1x4x1 1f1b"]["tp_bytes_per_step"]
        print(f"rank {rank}: tp bytes per step measured {measured}, planned {planned}")
        assert measured == planned, (rank, measured, planned)
