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
