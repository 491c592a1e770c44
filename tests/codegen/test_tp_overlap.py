"""Tensor-parallel collectives overlapped with their linears (``plan.tp_overlap``) train as one device
and move the planned bytes, on CPU gloo ranks.

Plans come from tests/codegen/test_sequence_parallel.py's ``sequence_plan`` (made on the CPU model at
seq 4096 or 65536 so tp really shards, asserted there), with ``tp_overlap`` pinned on; they run at the
test batch's seq 16. The lowering must then have fused every sequence all-gather before a linear and
every reduce-scatter after one (passes/lowering/overlap_tp.py): rank 0's program holds collective
matmuls and no unfused ``gather_summing_grad`` or ``reduce_scatter_to_group`` is left where a linear
reads or writes it. Loss, gathered gradients and parameters after 3 AdamW steps equal one device within
1e-5; each tp collective's bytes per step, by kind, equal the split's analytic count; every chunked call
says its chunk count and the calls are the plain program's times the chunks.
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest

import xirang
from tests.codegen.single_device import worst_differences
from tests.codegen.test_3d import STEPS, TOLERANCE, batch, build, reference
from tests.codegen.test_sequence_parallel import run_lowered, sequence_plan, tp_records
from xirang.codegen.runtime.launch.launcher import launch
from xirang.passes.planning.plan_splits import SplitPricer

FUSED = ("gather_linear", "linear_reduce_scatter")


def _tp_calls(counter, plan) -> dict:
    """{kind: bytes}, {kind: calls}, {chunks seen} of the tp collectives (not dp buckets, tied sums)."""
    nbytes, calls, chunks = Counter(), Counter(), set()
    for record in tp_records(counter, plan.mesh.tp):
        nbytes[record.kind] += record.nbytes
        calls[record.kind] += 1
        chunks.add(record.chunks)
    return {"tp_calls": (dict(nbytes), dict(calls), chunks)}


def _rank_main(rank, world, jobs):
    return run_lowered(rank, jobs, _tp_calls)


def _run(jobs, fused_kinds=FUSED):
    world = {plan.mesh.size for _, _, plan in jobs}
    assert len(world) == 1, "one launch runs configurations of one world size"
    results = launch(_rank_main, world.pop(), (jobs,), timeout_s=900, heartbeat_s=60)
    wants = {}
    for label, name, plan in jobs:
        wants.setdefault(name, reference(name))
        worst = worst_differences(label, results, wants[name])
        print(f"{label}: max |diff| loss {worst['loss']:.1e} grad {worst['grad']:.1e} param {worst['param']:.1e}")
        assert all(value <= TOLERANCE for value in worst.values()), (label, worst)
        if not plan.tp_overlap:
            continue
        code = results[0][label]["code"]
        fused = Counter(re.findall(r"xirang_codegen_ops_collective_matmul_(\w+?)\(", code))
        print(f"{label}: fused {dict(fused)}")
        assert all(fused[kind] for kind in fused_kinds[name]), (label, dict(fused))
        # every linear beside a sequence all-gather or reduce-scatter in the same unit is fused
        assert not re.search(r"collectives_reduce_scatter_to_group\(linear", code), label
        assert not re.search(r"aten\.linear\.default\(gather_summing_grad", code), label
        _, _, chunks = results[0][label]["tp_calls"]
        assert plan.tp_overlap in chunks, (label, chunks)
    return results


def _overlapped(plan, chunks):
    return dataclasses.replace(plan, tp_overlap=chunks)


@pytest.mark.matrix
def test_tp_overlap_plan_the_ilp_chose_equals_single_device_and_moves_its_bytes():
    """gpt at (1, 4, 1), the split ILP's own sequence shards (planned on CPU ranks at seq 4096, as
    test_sequence_parallel), run once with overlap off and once with 3 chunks in one launch."""
    plan = sequence_plan("gpt", 1, 4, 1, "1f1b", 1, 4096, "cpu", False)
    results = _run([("plain", "gpt", plan), ("overlap", "gpt", _overlapped(plan, 3))], {"gpt": FUSED})
    gm = xirang.analyze(build("gpt"), example_kwargs=batch(0, 2)).graph_module
    pricer = SplitPricer(gm, plan.world, precision="fp32")
    pricer.price(plan.mesh.tp, tuple(range(plan.mesh.tp)), 1, 4096, sequence_parallel=True)
    per_micro_batch = pricer.tp_bytes_per_micro_batch(plan.mesh.tp, tuple(range(plan.mesh.tp)), 1, 4096,
                                                      run_micro_batch=1, run_seq=batch(0)["input_ids"].shape[1],
                                                      sequence_parallel=True)
    planned = {kind: nbytes * plan.num_micro_batches * STEPS for kind, nbytes in per_micro_batch.items() if nbytes}
    for rank, result in enumerate(results):
        plain_bytes, plain_calls, _ = result["plain"]["tp_calls"]
        nbytes, calls, chunks = result["overlap"]["tp_calls"]
        print(f"rank {rank}: tp bytes over {STEPS} steps {nbytes}, planned {planned}; calls {calls} "
              f"(plain {plain_calls}), chunks {sorted(chunks)}")
        assert nbytes == planned == plain_bytes, (rank, nbytes, planned, plain_bytes)
        # every sequence all-gather and reduce-scatter is now 3 calls; the vocabulary all-reduces stay one
        for kind in ("all_gather", "reduce_scatter"):
            assert calls[kind] == 3 * plain_calls[kind], (rank, kind, calls, plain_calls)
        assert calls.get("all_reduce") == plain_calls.get("all_reduce")


@pytest.mark.matrix
def test_tp_overlap_2x2x2_equals_single_device():
    """gpt and llama at (2, 2, 2), every op with a sequence row on it (planned at seq 65536 on A100s so
    the MLPs are row-parallel), 1F1B and interleaved, 2 chunks; one launch of 8 ranks. Llama's column-
    parallel linears share one gathered input (q, k, v; gate, up): ``gather_linears``."""
    jobs = []
    for name in ("gpt", "llama"):
        for schedule, v in (("1f1b", 1), ("interleaved", 2)):
            plan = sequence_plan(name, 2, 2, 2, schedule, v, 65536)
            jobs.append((f"{name} 2x2x2 {schedule}", name, _overlapped(plan, 2)))
    _run(jobs, {"gpt": FUSED, "llama": ("gather_linears", "linear_reduce_scatter")})
