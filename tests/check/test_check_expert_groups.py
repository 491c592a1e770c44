"""``xirang check`` of a plan whose ep groups are blocks of the dp places (dp4 ep2: ranks (0, 1) and (2, 3)).

The check runs one representative per class of ranks and moves its log onto the other members by a shift of
coordinates. A shift along dp by one moved the ep group (0, 1) onto (1, 2), ranks of two groups, so every
dp > ep plan with experts failed the collectives proof ("1 member(s) of the group never call on it",
group (1, 2)) though it trains; now the ranks of a class share their ep index (check_api.rank_classes), and
with a capacity factor the dry run drops nothing (fake tensors: the balanced routing)."""
from __future__ import annotations

import xirang
from examples.hf_moe import qwen3_moe
from xirang.check_api import rank_classes


def test_a_dp4_ep2_plan_passes_the_check_with_classes_by_ep_index():
    model, inputs = qwen3_moe(2, 16, "meta", 0)
    report = xirang.analyze(model, example_kwargs=inputs)
    plan = xirang.plan(model, world=4, hardware="cpu", example_kwargs=inputs, global_batch=8, seq=64, dp=4, ep=2,
                       tp=1, pp=1, micro_batch=1, schedule="1f1b", zero_stage=0, precision="bf16",
                       capacity_factor=1.25, analysed=report)
    assert plan.mesh.ep == 2 and plan.mesh.dp == 4
    assert sorted(rank_classes(plan).values()) == [(0, 2), (1, 3)]  # one class per ep index
    checked = xirang.check(plan, model, example_kwargs=inputs, analysed=report, workers=1)
    assert checked.ok, [str(v)[:300] for v in checked.violations]
