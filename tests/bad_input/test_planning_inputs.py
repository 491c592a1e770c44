"""xirang.plan given bad numbers, pins, worlds and devices; the degree search at huge global batches
(its work must not grow with the batch: divisors are enumerated, not ranges), counted in divisions and
in the configurations the search prices, never timed."""
from __future__ import annotations

import math

import pytest

import xirang
from tests.bad_input import models
from tests.bad_input.probe import MODELS, assert_clear_cli, assert_clear_error, cli
from xirang.ir.errors import XirangError
from xirang.ir.world import parse_world
from xirang.passes.planning.plan_search_space import MAX_MICRO_BATCH, candidates, divisors


@pytest.fixture(scope="module")
def analysed():
    model, inputs = models.mlp()
    return model, inputs, xirang.analyze(model, example_kwargs=inputs)


BAD_CALLS = [  # (keyword arguments of xirang.plan, words of the refusal, where)
    ({"global_batch": 0}, "global_batch=0 must be a positive int", "global_batch="),
    ({"global_batch": -8}, "must be a positive int", "global_batch="),
    ({"global_batch": 8.0}, "must be a positive int", "global_batch="),
    ({"global_batch": True}, "must be a positive int", "global_batch="),
    ({"global_batch": "8"}, "must be a positive int", "global_batch="),
    ({"global_batch": 7, "world": 2, "dp": 2}, "dp=2", "dp=2"),
    ({"tp": 0}, "tp=0 must be a positive int", "tp="),
    ({"tp": 3}, "tp=3", "tp=3"),
    ({"pp": 2.5}, "pp=2.5 must be a positive int", "pp="),
    ({"dp": -1}, "dp=-1 must be a positive int", "dp="),
    ({"micro_batch": 3}, "micro_batch=3", "micro_batch=3"),
    ({"schedule": "zero-bubble"}, "is not a pipeline schedule", "schedule="),
    ({"recompute": "yes"}, "is not a recompute mode", "recompute="),
    ({"offload": "cpu"}, "is not an activation offload mode", "offload="),
    ({"precision": "fp8"}, "precision='fp8'", "precision="),
    ({"seq": 0}, "seq=0 must be a positive int", "seq="),
    ({"schedule": "interleaved", "virtual_stages": 1}, "plain 1F1B", "virtual_stages="),
    ({"schedule": "1f1b", "virtual_stages": 2}, "needs schedule 'interleaved'", "virtual_stages="),
    ({"world": 0}, "", "world=0"),
    ({"world": "2x"}, "", "world='2x'"),
    ({"world": -2}, "", "world=-2"),
    ({"world": "abc"}, "", "world='abc'"),
    ({"hardware": "tpu-v9"}, "unknown device", "hardware='tpu-v9'"),
]


@pytest.mark.parametrize("kwargs,needle,where", BAD_CALLS, ids=[str(c[0]) for c in BAD_CALLS])
def test_plan_call_with_a_bad_value_is_refused(analysed, kwargs, needle, where):
    model, inputs, report = analysed
    call = {"world": 4, "hardware": "cpu", "global_batch": 8, **kwargs}
    with pytest.raises(XirangError) as info:
        xirang.plan(model, example_kwargs=inputs, analysed=report, **call)
    assert_clear_error(info.value, needle, where=where)


@pytest.mark.parametrize("world", ["1x0", "0x8", "1x8x2", "", "8 gpus"])
def test_cli_world_that_is_not_a_device_count(world):
    assert_clear_cli(cli("plan", f"{MODELS}:mlp", "--global-batch", "8", "--world", world), f"world='{world}'")


def test_cli_unknown_device_lists_the_presets():
    assert_clear_cli(cli("plan", f"{MODELS}:mlp", "--global-batch", "8", "--hardware", "a100-800g"), "a100-80g",
                     "unknown device")


def test_divisors_are_exact():
    for n in list(range(1, 400)) + [2 ** 20, 10 ** 6, 999_983, 720_720]:
        assert divisors(n) == [d for d in range(1, min(n, 10 ** 6) + 1) if n % d == 0] + \
            ([n] if n > 10 ** 6 else [])


class _CountedInt(int):
    """An int that counts the divisions done with it (and with the quotients it hands out), and stops the
    enumeration once ``budget`` is spent: an enumeration of ranges up to the batch (1e12 trials) fails at
    the budget instead of never finishing, and no clock is read."""

    def __new__(cls, value: int, counter: list, budget: int):
        made = super().__new__(cls, value)
        made.counter, made.budget = counter, budget
        return made

    def _count(self) -> None:
        self.counter[0] += 1
        assert self.counter[0] <= self.budget, f"more than {self.budget} divisions: the search grows with the batch"

    def __mod__(self, other):
        self._count()
        return int(self) % other

    def __floordiv__(self, other):
        self._count()
        return _CountedInt(int(self) // other, self.counter, self.budget)


def _divisions_allowed(global_batch: int) -> int:
    # divisors(n) tries d up to sqrt(n) (two operations each); the 16x8 world has under 40 (tp, pp, dp)
    # meshes, each enumerating the divisors of global_batch / dp at most
    return 40 * 2 * (math.isqrt(global_batch) + 1)


@pytest.mark.parametrize("global_batch", [10 ** 9, 2 ** 30, 10 ** 12])
def test_search_space_of_a_huge_global_batch_costs_divisions_in_its_square_root(global_batch):
    world = parse_world("16x8", "h100-80g")
    counter = [0]
    counted = _CountedInt(global_batch, counter, _divisions_allowed(global_batch))
    found = candidates(world, units=8, global_batch=counted)
    assert found and 0 < counter[0]  # the batch was divided (a counter that saw nothing proves nothing)
    assert all(c.dp * c.micro_batch * c.num_micro_batches == global_batch for c in found)


def test_prime_global_batch_no_mesh_divides_is_refused_after_a_few_divisions():
    world = parse_world("16x8", "h100-80g")
    counter = [0]
    with pytest.raises(XirangError) as info:
        candidates(world, units=8, global_batch=_CountedInt(999_999_937, counter, _divisions_allowed(999_999_937)))
    assert 0 < counter[0]
    assert_clear_error(info.value, "not divisible by any data-parallel degree", hint="multiple of 2")


def _effort(plan) -> str:
    return next(note for note in plan.predicted.notes if note.startswith("searched "))


def test_plan_for_a_billion_samples_does_the_work_of_a_plan_for_12800(analysed):
    """The search's work depends on the micro-batch choices (divisors of a dp rank's share up to
    MAX_MICRO_BATCH), not on the batch's size: 12,800 = 2^9 x 5^2 and 10^9 = 2^9 x 5^9 give every dp
    of 1x8 the same micro-batches (1, 2, 4, 5, 8, 10, 16), so the plans enumerate, price and solve
    the same counts."""
    model, inputs, report = analysed
    assert MAX_MICRO_BATCH < 25  # else 25 = 5^2 would be a micro-batch of one and not the other
    effort = {}
    for global_batch in (12_800, 10 ** 9):
        plan = xirang.plan(model, world="1x8", hardware="h100-80g", example_kwargs=inputs, analysed=report,
                           global_batch=global_batch)
        assert plan.global_batch == global_batch
        effort[global_batch] = _effort(plan)
    assert effort[12_800] == effort[10 ** 9], effort
