"""Uneven data-parallel shares and dynamic rebalancing give the single-device results.

A dp rank with n_i of the N samples runs n_i / micro_batch micro-batches of the same program and
weighs its loss and gradient by n_i * dp / N before the dp average (codegen/runtime/compiled_model.py,
grad_sync.py), so any split of the global batch trains as one device does. Rebalancing
(codegen/runtime/data_parallel/dp_balance.py) changes the shares between steps from measured compute times.

Fast tests: the rebalancing rule and the plan's checks of ``dp_shares``. Matrix: equivalence (loss
every step, gathered gradients, parameters after 3 AdamW steps, 1e-5 fp32) at (3,1,1) with shares
(2, 4, 6) and at (2,2,2) with shares (3, 5), on the in-repo GPT and HF Llama, plans made on meta at
seq 4096 so tp shards (asserted); ``pre_sharded`` shares of different sizes; and a (2,2,2) run whose
dp rank 0 is slowed on purpose (a fixed 50 ms sleep before every forward of its stages), rebalanced
every step: its share must shrink, and training still equals one device.
"""
from __future__ import annotations

import time

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.codegen.single_device import compiled_run, single_device_run, worst_differences
from tests.conftest import hf_llama
from xirang.codegen.runtime.data_parallel.dp_balance import balanced_shares
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.errors import PlanError
from xirang.ir.placement import PlanShard

SEQ, VOCAB_USED, STEPS, TOLERANCE = 16, 500, 3, 1e-5
SLOW_FORWARD_S = 0.05  # the delay that makes dp rank 0 slow in the rebalancing run


# --- the rule --------------------------------------------------------------------------------------

def test_a_slow_replica_gives_micro_batches_to_fast_ones():
    # replica 0 takes 3x as long per sample: ideal shares 12 * (1/3, 1, 1) / (7/3) -> 1.7, 5.1, 5.1
    assert balanced_shares([3.0, 1.0, 1.0], [4, 4, 4], 1, max_move=8) == (2, 5, 5)
    # bounded: one micro-batch per decision
    assert balanced_shares([3.0, 1.0, 1.0], [4, 4, 4], 1, max_move=1) == (3, 5, 4)
    # whole micro-batches of 2 samples; at least one micro-batch each
    assert balanced_shares([100.0, 1.0], [4, 4], 2, max_move=8) == (2, 6)


def test_equal_replicas_never_move_and_nonsense_measurements_change_nothing():
    assert balanced_shares([1.0, 1.02, 0.99], [4, 4, 4], 1, max_move=4) == (4, 4, 4)  # below min_gain
    assert balanced_shares([1.0, 0.0], [4, 4], 1) == (4, 4)
    assert balanced_shares([float("nan"), 1.0], [4, 4], 1) == (4, 4)


def test_interleaved_shares_move_by_pp_micro_batches():
    # granule 2 (pp = 2, interleaved): shares stay multiples of 2 micro-batches
    assert balanced_shares([4.0, 1.0], [8, 8], 1, granule=2, max_move=2) == (4, 12)


def _tiny_plan(**pins):
    model, inputs = build_gpt("tiny"), {"input_ids": torch.zeros(12, SEQ, dtype=torch.long),
                                       "labels": torch.zeros(12, SEQ, dtype=torch.long)}
    return xirang.plan(model, world=3, example_kwargs=inputs, global_batch=12, hardware="cpu", dp=3, micro_batch=2,
                       **pins)


def test_plan_dp_shares_round_trip_and_bad_shares_name_the_field():
    plan = _tiny_plan().with_dp_shares((2, 4, 6))
    assert plan.micro_batches_per_dp_rank == (1, 2, 3) and plan.num_micro_batches == 3
    assert xirang.Plan.from_json(plan.to_json()) == plan
    assert plan.with_dp_shares(()) == _tiny_plan()
    for shares, words in (((2, 4), "2 shares for dp 3"), ((3, 3, 6), "whole micro-batches"),
                          ((2, 4, 4), "sum to 10, not global_batch 12"), ((0, 6, 6), "must be")):
        with pytest.raises(PlanError) as caught:
            plan.with_dp_shares(shares)
        assert words in str(caught.value) and "plan.dp_shares" in caught.value.where, str(caught.value)


# --- equivalence (matrix) --------------------------------------------------------------------------

def build(name: str):
    torch.manual_seed(0)
    return build_gpt("tiny", device="cpu") if name == "gpt" else hf_llama(device="cpu")


def batch(step: int, size: int = 12) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator)}


def make_plan(name: str, dp: int, tp: int, pp: int, global_batch: int, micro_batch: int):
    plan = xirang.plan(build(name), world=dp * tp * pp, example_kwargs=batch(0, 2), global_batch=global_batch,
                       seq=4096, hardware="a100-80g", precision="fp32", dp=dp, tp=tp, pp=pp, schedule="1f1b",
                       micro_batch=micro_batch)
    if tp > 1:
        assert any(n.startswith("p_") and isinstance(s.outputs[0].tp, PlanShard) for n, s in plan.placements.items())
    return plan


class _SlowForward:
    """A stage program that sleeps before every forward: a slow device, on purpose."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args):
        time.sleep(SLOW_FORWARD_S)
        return self.inner(*args)


def _rank_main(rank, world, jobs):
    found = {}
    for label, name, plan, shares, rebalance in jobs:
        size = plan.global_batch
        compiled = xirang.compile(build(name), world=world, example_kwargs=batch(0, 2), plan=plan,
                                  runtime=xirang.RuntimeOptions(dp_shares=shares,
                                                                rebalance_every=1 if rebalance else None),
                                  hardware="a100-80g")
        if rebalance and compiled.dp_rank == 0:
            for stage in compiled.executor.stages.values():
                stage.program = _SlowForward(stage.program)
        found[label] = compiled_run(compiled, lambda step, size=size: batch(step, size), STEPS)
        found[label]["shares"] = compiled.dp_shares
        if not rebalance:  # this dp rank's share, pre-sharded: the same loss as the global batch
            start = sum(compiled.dp_shares[:compiled.dp_rank])
            mine = {k: v[start:start + compiled.dp_shares[compiled.dp_rank]] for k, v in batch(7, size).items()}
            whole = compiled.train_step(**batch(7, size)).item()
            for param in compiled.parameters():
                param.grad = None
            found[label]["pre_sharded"] = abs(compiled.train_step(pre_sharded=True, **mine).item() - whole)
    return found


@pytest.mark.matrix
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_uneven_shares_equal_one_device_at_3_1_1(name):
    plan = make_plan(name, 3, 1, 1, global_batch=12, micro_batch=2)
    results = launch(_rank_main, 3, args=([("3,1,1", name, plan, (2, 4, 6), False)],), timeout_s=600)
    want = single_device_run(build(name), lambda step: batch(step, 12), STEPS, keep_duplicates=True)
    worst = worst_differences("3,1,1", results, want)
    assert max(worst.values()) < TOLERANCE, worst
    assert all(r["3,1,1"]["pre_sharded"] < TOLERANCE for r in results)


@pytest.mark.matrix
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_uneven_and_rebalanced_shares_equal_one_device_at_2_2_2(name):
    plan = make_plan(name, 2, 2, 2, global_batch=8, micro_batch=1)
    jobs = [("uneven", name, plan, (3, 5), False), ("rebalanced", name, plan, None, True)]
    results = launch(_rank_main, 8, args=(jobs,), timeout_s=900, heartbeat_s=60)
    want = single_device_run(build(name), lambda step: batch(step, 8), STEPS, keep_duplicates=True)
    for label in ("uneven", "rebalanced"):
        worst = worst_differences(label, results, want)
        assert max(worst.values()) < TOLERANCE, (label, worst)
    assert all(r["uneven"]["pre_sharded"] < TOLERANCE for r in results)
    shares = {tuple(r["rebalanced"]["shares"]) for r in results}
    assert len(shares) == 1, shares  # every rank took the same decision
    (moved,) = shares
    assert moved[0] < moved[1] and sum(moved) == 8, moved  # the slowed dp rank 0 gave samples away
