"""Communication as planned, on a World of two "nodes" of four CPU ranks.

The plan is made for links where crossing nodes is slow (so the planner picks the hierarchical
all-reduce for the dp gradient buckets); the runtime follows ``plan.buckets`` stage by stage (the tied
token embedding has a bucket in the first and in the last stage) and runs each bucket's algorithm;
every step, every bucket's bytes and algorithm on the counter equal the plan's, and training
equals one device within 1e-5.
"""
from __future__ import annotations

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.data_parallel.comm_check import calls_table, planned_calls
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.world import LinkSpec, NodeSpec, World

from tests.codegen.single_device import compiled_run, single_device_run, worst_differences

pytestmark = pytest.mark.matrix  # eight ranks on two cores: about a minute

STEPS, SEQ, GLOBAL = 3, 32, 8
# In-node links fast, the node-to-node link slow and far: the hierarchical all-reduce sends 1/k of a
# flat ring's bytes across it, in fewer latency terms.
TWO_NODES = World((NodeSpec(4, "cpu"), NodeSpec(4, "cpu")), intra_node=LinkSpec(50e9, 2e-6),
                  inter_node=LinkSpec(1e9, 1e-3))


def _model():
    torch.manual_seed(0)
    return build_gpt("tiny")


def _batch(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 512, (GLOBAL, SEQ), generator=g)
    return {"input_ids": ids, "labels": torch.randint(0, 512, (GLOBAL, SEQ), generator=g)}


def _plan():
    meta = {k: v.to("meta") for k, v in _batch(0).items()}
    return xirang.plan(build_gpt("tiny", device="meta"), world=TWO_NODES, example_kwargs=meta, global_batch=GLOBAL,
                       dp=4, tp=1, pp=2, schedule="1f1b", micro_batch=1)


def _rank(rank, world, plan):
    counter = CommCounter()
    compiled = xirang.compile(_model(), world=TWO_NODES, example_kwargs=_batch(0), plan=plan,
                              debug=xirang.DebugHooks(counter=counter))
    steps = []

    def batch(step):  # called before each train_step: what the counter holds is the previous step's
        if step:
            steps.append(list(counter.records))
        counter.reset()
        return _batch(step)

    run = compiled_run(compiled, batch, STEPS)
    steps.append(list(counter.records))
    return {"run": run, "steps": steps, "rank": rank}


@pytest.fixture(scope="module")
def plan():
    return _plan()


@pytest.fixture(scope="module")
def ranks(plan):
    return launch(_rank, 8, (plan,), timeout_s=600, heartbeat_s=120)  # 8 ranks on 2 shared cores


def test_plan_picks_hierarchical_for_every_bucket_and_lists_tied_copies(plan):
    buckets = [c for c in plan.collectives if c.node.startswith("bucket:")]
    assert buckets and {c.algorithm for c in buckets} == {"hierarchical"}
    holders = [k for k, bucket in enumerate(plan.buckets) if "tok_emb.weight" in bucket]
    assert len(holders) == 2  # the embedding's stage and the LM head's
    assert [c.node for c in plan.collectives if c.node.startswith("tied:")] == ["tied:tok_emb.weight"]


def test_every_bucket_and_tied_sum_ran_as_planned(plan, ranks):
    for step in range(STEPS):
        for dp_index in range(4):
            pipeline = plan.mesh.group("pp", plan.mesh.rank_of(dp=dp_index, pp=0, tp=0))
            rows = planned_calls(plan, {r["rank"]: r["steps"][step] for r in ranks if r["rank"] in pipeline})
            if step == 0 and dp_index == 0:
                print("\n" + calls_table(rows))
            # every bucket once, the tied embedding's sum on both of its holders
            assert len(rows) == len(plan.buckets) + 2 and all(row.equal for row in rows), calls_table(rows)


def test_training_equals_one_device(ranks):
    want = single_device_run(_model(), _batch, STEPS, keep_duplicates=True)
    worst = worst_differences("run", ranks, want)
    assert max(worst.values()) < 1e-5, worst
