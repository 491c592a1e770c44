"""Classes of ranks under a hierarchical dp all-reduce (xirang_compile/check_api.py ``rank_classes``): its
sub-groups are a node's members and the members at one place on every node, so only ranks at the same place
on their nodes share a class; the check of such a plan proves every rank (it named 8 groups whose members
"never call on it" when ranks at other places were moved onto them)."""
from __future__ import annotations

import torch

import xirang
from examples.gpt import build_gpt
from xirang.check_api import rank_classes


def test_a_hierarchical_dp_all_reduce_is_proven_on_every_rank():
    model = build_gpt("tiny", device="meta")
    ids = torch.zeros(64, 64, dtype=torch.long, device="meta")
    example = {"input_ids": ids, "labels": ids.clone()}
    plan = xirang.plan(model, world="2x4", hardware="cpu", example_kwargs=example, global_batch=64, dp=8, tp=1, pp=1)
    assert any(c.algorithm == "hierarchical" for c in plan.collectives)
    classes = rank_classes(plan)
    assert sorted(classes.values()) == [(0, 4), (1, 5), (2, 6), (3, 7)]  # one per place on a node of 4
    report = xirang.check(plan, model, example_kwargs=example)
    assert report.ok, report.explain()


def test_under_cp_the_hierarchical_buckets_sum_over_dp_and_cp():
    """cp ranks hold replicas as dp ranks do, so a bucket's all-reduce sums over dp x cp (``Mesh.gradient_axis``);
    its two-level sub-groups were built over dp alone, which summed half the ranks' gradients and divided by dp:
    silently wrong, and the check passed since every dp group agreed with itself."""
    from tests.models.test_context_parallel import PLAN_SEQ, build
    model, inputs = build("llama", "meta", batch=2)
    plan = xirang.plan(model, world="2x4", example_kwargs=inputs, global_batch=8, seq=PLAN_SEQ, hardware="cpu",
                       dp=4, cp=2, tp=1, pp=1, micro_batch=1, zero_stage=0)
    assert (plan.mesh.dp, plan.mesh.cp) == (4, 2)
    assert any(c.axis == "dp" and c.algorithm == "hierarchical" for c in plan.collectives)
    report = xirang.check(plan, model, example_kwargs=inputs, device="cpu", workers=1)
    assert report.ok, report.explain()
    for klass in report.classes:  # a bucket: reduce-scatter on the node's members, all-reduce across nodes
        calls = klass.log.calls
        first = next(i for i, call in enumerate(calls) if call.label == "bucket:0")
        intra = calls[first].group
        inter = next(call.group for call in calls[first + 1:] if call.kind == "all_reduce")
        summed = set(plan.mesh.group("edp", klass.log.rank))
        assert calls[first].kind == "reduce_scatter" and len(intra) * len(inter) == len(summed) == 8
        assert set(intra) | set(inter) <= summed, (klass.log.rank, intra, inter)
