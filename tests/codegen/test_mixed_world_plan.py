"""A plan made for a World of mixed device kinds runs its priced dp shares and equals one device.

The planner deals micro-batches to dp replicas by device speed (passes/planning/device_speeds.py) and
writes them as ``Plan.dp_shares``; the runtime weighs each replica's gradient by its share. Here GPT
tiny is planned at seq 4096 (so tp shards; asserted) for one node of four A100s and one of four H100s
at (dp, tp, pp) = (2, 4, 1): replica 0 on the A100 node, replica 1 on the H100 node, which gets the
larger share. (With pp > 1 the replicas would not split by node: the mesh numbers ranks pp outermost,
ir/mesh.py, so each node would hold a pipeline stage of every replica.) Then it runs small on 8 CPU
ranks (matrix tier) with the plan's own shares.
"""
from __future__ import annotations

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.codegen.single_device import compiled_run, single_device_run, worst_differences
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.placement import PlanShard

SEQ, VOCAB_USED, STEPS, TOLERANCE, GLOBAL_BATCH = 16, 500, 3, 1e-5, 8
WORLD = "1x4:a100-80g+1x4:h100-80g"


def build():
    torch.manual_seed(0)
    return build_gpt("tiny", device="cpu")


def batch(step: int, size: int = GLOBAL_BATCH) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator)}


def mixed_plan():
    return xirang.plan(build(), world=WORLD, example_kwargs=batch(0, 2), global_batch=GLOBAL_BATCH, seq=4096,
                       precision="fp32", dp=2, tp=4, pp=1, schedule="1f1b", micro_batch=1)


def test_the_plan_for_a_mixed_world_gives_the_faster_replica_the_larger_share():
    plan = mixed_plan()
    assert plan.world.device_of(0).name == "a100-80g" and plan.world.device_of(4).name == "h100-80g"
    assert sum(plan.dp_shares) == GLOBAL_BATCH and plan.dp_shares[0] < plan.dp_shares[1], plan.dp_shares
    assert any("dp shares follow device speed" in note for note in plan.predicted.notes)
    assert not any("set after planning" in note for note in plan.predicted.notes)
    assert xirang.Plan.from_json(plan.to_json()) == plan


def _rank_main(rank, world, plan):
    compiled = xirang.compile(build(), world=plan.world, example_kwargs=batch(0, 2), plan=plan)
    found = compiled_run(compiled, batch, STEPS)
    found["shares"] = compiled.dp_shares
    return {"mixed": found}


@pytest.mark.matrix
def test_a_mixed_world_plan_equals_one_device_with_its_own_shares():
    plan = mixed_plan()
    assert any(n.startswith("p_") and isinstance(s.outputs[0].tp, PlanShard) for n, s in plan.placements.items())
    results = launch(_rank_main, 8, args=(plan,), timeout_s=900, heartbeat_s=60)
    want = single_device_run(build(), batch, STEPS, keep_duplicates=True)
    worst = worst_differences("mixed", results, want)
    assert max(worst.values()) < TOLERANCE, worst
    assert all(tuple(r["mixed"]["shares"]) == plan.dp_shares for r in results)
