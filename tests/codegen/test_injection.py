"""Adaptive micro-batch injection (codegen/runtime/executor/injection.py): deeper 1F1B warm-ups chosen from
measured stage times, within the plan's memory, with the numbers of the plain 1F1B.

Fast: the deepened schedules are valid and keep what they claim in flight; the simulated gains the
module docstring quotes; the local search against an exhaustive one; the memory bounds. Matrix: a
(1,1,4) run whose stage times are set on purpose (sleeps; rank 0 1.5x the others) deepens
rank 0's warm-up after the first step, holds that many more micro-batches in flight, and trains
bit-for-bit as the plain 1F1B and within 1e-5 of one device.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.codegen.single_device import compiled_run, single_device_run, worst_differences
from xirang.codegen.runtime.executor.injection import best_extra_warmup, warmup_bounds
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.executor.schedule_check import check_schedule, max_in_flight
from xirang.codegen.runtime.executor.schedule_sim import simulate
from xirang.ir.errors import InvalidValue
from xirang.ir.schedules import build_schedule

SEQ, VOCAB_USED, STEPS, TOLERANCE = 16, 500, 3, 1e-5
# per pipeline rank, seconds each forward sleeps (each backward twice that): rank 0 is 1.5x slower,
# the module docstring's case (40.5 -> 36 time units with 3 extra forwards on rank 0)
STAGE_FORWARD_S = (0.03, 0.02, 0.02, 0.02)


def makespan(extra, forward, backward, p=4, m=8):
    return simulate(build_schedule("1f1b", p, m, 1, extra), forward=forward, backward=backward).makespan


def test_deeper_warmups_are_valid_schedules_holding_what_they_claim():
    for extra in ((1, 0, 0, 0), (2, 2, 1, 0), (3, 3, 3, 0), (9, 9, 9, 0)):
        schedule = build_schedule("1f1b", 4, 8, 1, extra)
        check_schedule(schedule)
        assert max_in_flight(schedule) == tuple(min(4 - r + e, 8) for r, e in enumerate(extra))
    assert build_schedule("1f1b", 4, 8, 1, (0, 0, 0, 0)) == build_schedule("1f1b", 4, 8)
    with pytest.raises(InvalidValue, match="rank 2 would warm up 4 forwards but rank 1 feeds it only 3"):
        build_schedule("1f1b", 4, 8, 1, (0, 0, 3, 0))
    with pytest.raises(InvalidValue, match="'1f1b' schedule only"):
        build_schedule("gpipe", 4, 8, 1, (1, 0, 0, 0))
    with pytest.raises(InvalidValue, match="one whole number >= 0 per pipeline rank"):
        build_schedule("1f1b", 4, 8, 1, (1, 0))


def test_a_slow_stage_is_fed_faster_with_deeper_warmups_and_equal_stages_are_left_alone():
    # F : B = 1 : 2; the module docstring's figures (exact, in time units)
    slow0 = ([1.5, 1, 1, 1], [3, 2, 2, 2])
    slow1 = ([1, 1.5, 1, 1], [2, 3, 2, 2])
    assert makespan((0, 0, 0, 0), *slow0) == 40.5 and makespan((3, 0, 0, 0), *slow0) == 36
    assert makespan((0, 0, 0, 0), *slow1) == 42 and makespan((2, 2, 0, 0), *slow1) == 39
    room = (5, 6, 7, 0)
    assert best_extra_warmup(4, 8, [1] * 4, [2] * 4, room) == ((0, 0, 0, 0), 33.0, 33.0)
    for forward, backward in (slow0, slow1, ([1, 1, 1.5, 1], [2, 2, 3, 2]), ([1, 2, 1, 1], [2, 4, 2, 2])):
        chosen, found, plain = best_extra_warmup(4, 8, forward, backward, room)
        exhaustive = min(makespan(e, forward, backward) for e in itertools.product(range(6), range(7), range(8), [0])
                         if all(e[r + 1] <= e[r] + 1 for r in range(3)))
        assert found == exhaustive == makespan(chosen, forward, backward) and found <= plain, (forward, chosen)
    # memory allows nothing: nothing changes
    assert best_extra_warmup(4, 8, *slow0, (0, 0, 0, 0))[0] == (0, 0, 0, 0)


def test_bounds_are_the_extra_micro_batches_whose_activations_fit_beside_the_predicted_peak():
    model = build_gpt("tiny")
    inputs = {"input_ids": torch.zeros(8, SEQ, dtype=torch.long), "labels": torch.zeros(8, SEQ, dtype=torch.long)}
    plan = xirang.plan(model, world=2, example_kwargs=inputs, global_batch=8, hardware="a100-80g", pp=2,
                       schedule="1f1b", micro_batch=1)
    memory = plan.world.device_of(0).memory_bytes
    parts = [dict(part) for part in plan.predicted.memory_parts]
    parts[0]["activations"] = 200  # rank 0 of p = 2 holds 2 micro-batches in flight: 100 bytes each
    predicted = dataclasses.replace(plan.predicted, memory_parts=tuple(parts),
                                    memory_bytes_per_device=(memory - 350, memory - 10))
    tight = dataclasses.replace(plan, predicted=predicted)
    assert warmup_bounds(tight, 2, 8) == (3, 0)  # floor(350 / 100); the last rank never deepens
    roomy = dataclasses.replace(tight, predicted=dataclasses.replace(predicted, memory_bytes_per_device=(0, 0)))
    assert warmup_bounds(roomy, 2, 8) == (7, 0)  # at most a warm-up of all 8 forwards
    assert warmup_bounds(dataclasses.replace(plan, schedule="gpipe"), 2, 8) == (0, 0)


# --- the run (matrix) ------------------------------------------------------------------------------

def batch(step: int, size: int = 8) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator)}


class _Sleepy:
    """A stage program whose forward and backward sleep a fixed time each (the backward's sleep is a
    hook on its outputs): stage times set on purpose, far above the tiny model's own compute."""

    def __init__(self, inner, forward_s, backward_s):
        self.inner, self.forward_s, self.backward_s = inner, forward_s, backward_s

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args):
        time.sleep(self.forward_s)
        outputs = self.inner(*args)
        first = next(t for t in (outputs if isinstance(outputs, (tuple, list)) else [outputs])
                     if isinstance(t, torch.Tensor) and t.requires_grad)
        first.register_hook(lambda grad: time.sleep(self.backward_s))  # returns None: the gradient as it is
        return outputs


def _rank_main(rank, world, plan):
    found = {}
    for label, every in (("plain", None), ("adaptive", 1)):
        torch.manual_seed(0)
        compiled = xirang.compile(build_gpt("tiny"), world=world, example_kwargs=batch(0, 2), plan=plan,
                                  runtime=xirang.RuntimeOptions(inject_every=every), hardware="a100-80g")
        for stage in compiled.executor.stages.values():
            forward_s = STAGE_FORWARD_S[compiled.pp_rank]
            stage.program = _Sleepy(stage.program, forward_s, 2 * forward_s)
        found[label] = compiled_run(compiled, batch, STEPS)
        found[label]["extra"] = compiled.extra_warmup
        found[label]["in_flight"] = dict(compiled.last_step.most_in_flight)
        if every:
            found[label]["decisions"] = [(d.before, d.after, d.simulated_before, d.simulated_after)
                                         for d in compiled.injection.decisions]
    return found


@pytest.mark.matrix
def test_a_slowed_first_stage_gets_a_deeper_warmup_and_trains_exactly_as_plain_1f1b():
    torch.manual_seed(0)
    plan = xirang.plan(build_gpt("tiny"), world=4, example_kwargs=batch(0, 2), global_batch=8, seq=4096,
                       hardware="a100-80g", precision="fp32", pp=4, schedule="1f1b", micro_batch=1)
    results = launch(_rank_main, 4, args=(plan,), timeout_s=600, heartbeat_s=60)
    torch.manual_seed(0)
    want = single_device_run(build_gpt("tiny"), batch, STEPS, keep_duplicates=True)
    for label in ("plain", "adaptive"):
        worst = worst_differences(label, results, want)
        assert max(worst.values()) < TOLERANCE, (label, worst)
    extras = {r["adaptive"]["extra"] for r in results}
    assert len(extras) == 1, extras  # every pp rank took the same decision
    print(f"decisions: {results[0]['adaptive']['decisions']}")
    (extra,) = extras
    assert extra[0] > 0 and extra[-1] == 0, extra
    assert results[0]["adaptive"]["in_flight"][0] == min(4 + extra[0], 8)  # what the deeper warm-up holds
    assert results[0]["plain"]["in_flight"][0] == 4
    for rank_result in results:  # the same order of every sum: bit for bit the plain 1F1B
        for (loss, grads), (plain_loss, plain_grads) in zip(rank_result["adaptive"]["steps"],
                                                            rank_result["plain"]["steps"]):
            assert loss == plain_loss and all(torch.equal(grads[k], plain_grads[k]) for k in plain_grads)
