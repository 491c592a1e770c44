"""xirang.check on a real 3D plan of the in-repo GPT (dp 2 x tp 2 x pp 2, made on meta at a sequence
length where every axis splits): the unmodified program is proven on all 8 ranks, and each fault
injected into one rank's built program is named with its ranks, group and call."""
from __future__ import annotations

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from xirang.ir.placement import PlanShard

GLOBAL, SEQ = 8, 16


def _example():
    ids = torch.zeros(GLOBAL, SEQ, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module")
def setup():
    model = build_gpt("tiny", device="meta")
    example = _example()
    report = xirang.analyze(model, example_kwargs=example)
    plan = xirang.plan(model, world=8, hardware="cpu", example_kwargs=example, global_batch=GLOBAL, dp=2, tp=2, pp=2,
                       schedule="1f1b", micro_batch=1, seq=4096, analysed=report)  # at seq 4096 tp shards weights
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (2, 2, 2)
    assert any(c.node.startswith("bucket:") for c in plan.collectives)  # dp really reduces
    sharded = [n for n, s in plan.placements.items() if n.startswith("p_") and isinstance(s.outputs[0].tp, PlanShard)]
    assert sharded, "the plan shards no parameter, so tp would be vacuous"
    return model, example, report, plan


def _check(setup, **kwargs):
    model, example, report, plan = setup
    return xirang.check(plan, model, example_kwargs=example, analysed=report, **kwargs)


def test_unmodified_plan_is_proven_on_every_rank(setup):
    report = _check(setup)
    assert report.ok, report.explain()
    assert sorted(r for klass in report.classes for r in klass.members) == list(range(8))
    assert len(report.classes) == 2  # one per pipeline rank
    kinds = {call.kind for klass in report.classes for call in klass.log.calls}
    assert {"all_reduce", "send", "recv", "broadcast"} <= kinds
    labels = {call.label for klass in report.classes for call in klass.log.calls}
    planned = {c.node for c in setup[3].collectives if c.node.startswith(("bucket:", "tied:"))}
    assert planned <= labels  # every planned bucket and tied sum was issued by the runtime
    assert all(klass.log.memory.peak > 0 for klass in report.classes)
    assert "proven on all 8 ranks" in report.explain()


def _only(report, proof):
    found = [v for v in report.violations if v.proof == proof]
    assert found, report.explain()
    return found


def test_a_rank_that_skips_its_tied_sum_is_named_with_the_group(setup):
    def skip_tied(compiled):
        compiled._tied = []  # the fault: this rank never joins the tied embedding's sum
    report = _check(setup, mutate={0: skip_tied})
    violation = _only(report, "collectives")[0]
    assert 0 in violation.ranks and set(violation.group) == set(setup[3].mesh.group("pp", 0))  # first and last stage
    assert "tied:tok_emb.weight" in " ".join(violation.calls)


def test_a_collective_in_another_dtype_is_named(setup):
    def bf16_buckets(compiled):
        for buckets in compiled.grad_buckets.values():
            buckets.reduce_dtype = torch.bfloat16  # the fault: this dp rank reduces in bf16, its peer in fp32
    report = _check(setup, mutate={1: bf16_buckets})
    violation = _only(report, "collectives")[0]
    dp_group = set(setup[3].mesh.group("dp", 1))
    assert set(violation.group) == dp_group == set(violation.ranks)
    assert "bfloat16" in " ".join(violation.calls) and "float32" in " ".join(violation.calls)
    assert "bucket:" in " ".join(violation.calls)


def test_a_send_to_the_wrong_peer_is_named(setup):
    def wrong_peer(compiled):
        executor = compiled.executor
        executor.peers = (executor.peers[0], executor.peers[1] + 1)  # the next stage's tp neighbour instead
    report = _check(setup, mutate={0: wrong_peer})
    # the activation reaches the next stage's tp neighbour, which never posts its receive; the gradient's
    # receive from it on the pipeline's downward group (rank 0 and its next stage) is refused by torch at
    # once: both are named with rank 0
    wrong = setup[3].mesh.rank_of(dp=0, pp=1, tp=0) + 1
    named = [v for v in report.violations if v.proof in ("sends", "step") and 0 in v.ranks]
    assert named, report.explain()
    assert any(str(wrong) in v.what or any(f"rank {wrong}" in call for call in v.calls) for v in named)


def test_two_swapped_schedule_actions_are_named(setup):
    def swap(compiled):
        actions = list(compiled.executor.actions)
        forwards = [i for i, a in enumerate(actions) if type(a).__name__ == "Forward"][:2]
        sends = [i for i, a in enumerate(actions) if type(a).__name__ == "Send"][:2]
        for pair in (forwards, sends):  # the fault: micro-batches 0 and 1 run and sent in the other order
            actions[pair[0]], actions[pair[1]] = actions[pair[1]], actions[pair[0]]
        compiled.executor.actions = actions
    report = _check(setup, mutate={0: swap})
    violation = _only(report, "sends")[0]
    assert set(violation.ranks) == set(setup[3].mesh.group("pp", 0))  # rank 0 and its next stage
    assert "Send(" in " ".join(violation.calls)  # the schedule action is named


def test_a_smaller_device_is_named_per_pipeline_rank(setup):
    report = _check(setup, memory_bytes=1024 ** 2)  # 1 MiB devices
    violations = _only(report, "memory")
    assert {v.ranks for v in violations} == {klass.members for klass in report.classes
                                            if klass.log.memory.peak > 0.9 * 1024 ** 2}
    assert "pipeline rank" in violations[0].what and "GiB" in violations[0].what


def test_gpu_pipeline_sends_each_direction_on_its_own_channel(setup):
    """Under NCCL a communicator runs a pair's sends and receives in order, each blocking until its peer's
    call runs; a stage posts the next activation's receive before its gradient send. On one channel the two
    pipeline ranks would wait on each other; the runtime sends each direction on a group of its own."""
    model, example, report, _ = setup
    plan = xirang.plan(model, world=8, hardware="a100-80g", example_kwargs=example, global_batch=GLOBAL, dp=2, tp=2,
                       pp=2, schedule="1f1b", micro_batch=1, seq=4096, analysed=report)
    proven = xirang.check(plan, model, example_kwargs=example, analysed=report)
    assert proven.ok, proven.explain()
    assert proven.device == "cuda"

    def one_channel(compiled):
        compiled.executor.down_group = None  # both directions on the default group, as before
    broken = xirang.check(plan, model, example_kwargs=example, analysed=report,
                          mutate={rank: one_channel for rank in range(8)})
    deadlock = _only(broken, "deadlock")[0]
    assert "NCCL" in deadlock.what and "recv" in " ".join(deadlock.calls) and "send" in " ".join(deadlock.calls)


def test_offloaded_activations_leave_the_gpu_for_host_memory(setup):
    """A GPU copies an offloaded block's saved tensors to host memory; the dry run does the same on fakes."""
    model, example, report, _ = setup
    common = dict(world=8, hardware="a100-80g", example_kwargs=example, global_batch=GLOBAL, dp=2, tp=2, pp=2,
                  schedule="1f1b", micro_batch=1, seq=4096, recompute="none", analysed=report)
    kept = xirang.check(xirang.plan(model, offload="none", **common), model, example_kwargs=example, analysed=report)
    moved = xirang.check(xirang.plan(model, offload="blocks", **common), model, example_kwargs=example,
                         analysed=report)
    assert kept.ok and moved.ok, moved.explain()
    for stay, away in zip(kept.classes, moved.classes):  # every pipeline rank holds blocks here
        # the blocks' saved activations (30-60 KiB at seq 16; weight copies are remade, not offloaded) on the
        # host, beyond a few host scalars either way
        assert away.log.memory.host_peak > stay.log.memory.host_peak + 20_000, moved.explain()
        # (the device's peak is the optimizer step's at this size, so it does not move)
        assert away.log.memory.peak <= stay.log.memory.peak


def test_a_cpu_tensor_handed_to_nccl_on_a_gpu_rank_is_named(setup):
    """Code that makes a tensor without the rank's device works on CPU ranks and fails on a GPU's first NCCL
    call; the dry run of a GPU plan names it (here: one rank's receive buffers made on the CPU)."""
    from xirang.codegen.runtime.executor.p2p import ReceiveBuffers
    model, example, report, _ = setup
    plan = xirang.plan(model, world=8, hardware="a100-80g", example_kwargs=example, global_batch=GLOBAL, dp=2, tp=2,
                       pp=2, schedule="1f1b", micro_batch=1, seq=4096, analysed=report)

    def cpu_buffers(compiled):
        executor = compiled.executor
        executor.buffers = ReceiveBuffers(executor.buffers.specs, device="cpu")
    report_ = xirang.check(plan, model, example_kwargs=example, analysed=report, mutate={2: cpu_buffers})
    named = _only(report_, "device")
    assert 2 in named[0].ranks and "recv on a cpu tensor" in named[0].what and "p2p.py" in named[0].what


def test_a_ranks_program_depends_only_on_its_tp_coordinate(setup):
    """What lets the check's workers share one lowering per tp coordinate (xirang_compile/check_api.py)."""
    from xirang.lower import lower
    _, _, report, plan = setup
    for tp_rank in range(plan.mesh.tp):
        ranks = [r for r in range(plan.mesh.size) if plan.mesh.coords(r)["tp"] == tp_rank]
        programs = [lower(report.graph_module, plan, rank=r, device="meta").program for r in ranks]
        codes = [[stage.module.code for stage in program.stages] for program in programs]
        assert all(code == codes[0] for code in codes), f"tp rank {tp_rank}: ranks {ranks} lower differently"
        assert all(p.shards == programs[0].shards and p.batch_dims == programs[0].batch_dims for p in programs)
