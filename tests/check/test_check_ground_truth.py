"""The dry run against the real thing: for plans of every kind, the calls ``xirang.check`` records for each
of 8 ranks equal, call for call, what 8 real gloo ranks issue in the same step (recorded by the same
dispatch-level recorder on real tensors: kind, group, dtype, count, reduce op, root, peer, tag), and the
runtime's CommCounter records (kind, bytes, group size, label, algorithm, chunks) are equal too.
Each plan is made on meta at seq 4096 (tp shards weights there) and run at the example's seq 16."""
from __future__ import annotations

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from xirang.codegen.check.proofs import move_between
from xirang.codegen.check.rank_step import EXECUTOR_CODES
from xirang.codegen.check.recorder import Recorder
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.launch.launcher import launch

GLOBAL, SEQ = 8, 16
PLANS = {  # name -> plan pins (8 ranks)
    "3d-1f1b": dict(dp=2, tp=2, pp=2, schedule="1f1b"),
    "dp-zero1": dict(dp=8, tp=1, pp=1, zero_stage=1),
    "dp-tp-zero3": dict(dp=4, tp=2, pp=1, zero_stage=3),
    "tp-sequence-parallel": dict(dp=2, tp=4, pp=1, sequence_parallel=True),
    "pp-gpipe": dict(dp=2, tp=1, pp=4, schedule="gpipe"),
    "3d-recompute": dict(dp=2, tp=2, pp=2, schedule="1f1b", recompute="full"),
    "3d-zero-bubble": dict(dp=2, tp=2, pp=2, schedule="zb-h1"),
    "3d-interleaved": dict(dp=2, tp=2, pp=2, schedule="interleaved", virtual_stages=2),
}
DEFAULT_TIER = ("3d-1f1b",)


def batch_of(device="cpu"):
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 500, (GLOBAL, SEQ), generator=generator)
    return {"input_ids": ids.to(device), "labels": torch.roll(ids, 1, 1).to(device)}


def plan_for(pins):
    model = build_gpt("tiny", device="meta")
    return xirang.plan(model, world=8, hardware="cpu", example_kwargs=batch_of("meta"), global_batch=GLOBAL, seq=4096,
                       micro_batch=1, **pins)


def _real_rank(rank, world, plan):
    torch.manual_seed(0)
    counter = CommCounter()
    compiled = xirang.compile(build_gpt("tiny"), world=8, example_kwargs=batch_of(), plan=plan,
                              debug=xirang.DebugHooks(counter=counter))
    optimizer = torch.optim.AdamW(compiled.parameters())
    start = sum(compiled.dp_shares[:compiled.dp_rank])
    share = {name: value[start:start + compiled.dp_shares[compiled.dp_rank]] for name, value in batch_of().items()}
    compiled.train_step(**share, pre_sharded=True)  # the first step makes the optimizer's state
    optimizer.step()
    optimizer.zero_grad()
    counter.reset()
    recorder = Recorder(torch.device("cpu"), executor_code=EXECUTOR_CODES)
    with recorder:
        compiled.train_step(**share, pre_sharded=True)
        optimizer.step()
        optimizer.zero_grad()
    return {"calls": [call.fields for call in recorder.calls],
            "counter": [(r.kind, r.nbytes, r.group_size, r.label, r.algorithm, r.chunks) for r in counter.records]}


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in DEFAULT_TIER else pytest.mark.matrix)
                                  for name in PLANS])
def test_the_dry_run_issues_every_call_the_real_ranks_issue(name):
    plan = plan_for(PLANS[name])
    for axis in ("dp", "tp", "pp"):  # every pinned axis really splits
        assert getattr(plan.mesh, axis) == PLANS[name][axis]
    report = xirang.check(plan, build_gpt("tiny", device="meta"), example_kwargs=batch_of("meta"))
    assert report.ok, report.explain()
    real = launch(_real_rank, 8, (plan,), timeout_s=600, heartbeat_s=120)  # 8 ranks on 2 shared cores
    for klass in report.classes:
        for member in klass.members:
            move = move_between(plan.mesh, klass.log.rank, member)
            dry = [call.translated(move).fields for call in klass.log.calls]
            assert dry == real[member]["calls"], f"{name}: rank {member}'s calls differ"
            counted = [(r.kind, r.nbytes, r.group_size, r.label, r.algorithm, r.chunks)
                       for r in klass.log.counter_records]
            assert counted == real[member]["counter"], f"{name}: rank {member}'s counter records differ"
    assert sum(len(result["calls"]) for result in real) > 8  # the runs did communicate
