"""xirang.plan given bad numbers, pins, worlds and devices; the degree search at huge global batches
(its time must not grow with the batch: divisors are enumerated, not ranges)."""
from __future__ import annotations

import time

import pytest

import xirang
from tests.bad_input import models
from tests.bad_input.probe import MODELS, assert_clear_cli, assert_clear_error, cli
from xirang.ir.errors import XirangError
from xirang.ir.world import parse_world
from xirang.passes.planning.plan_search_space import candidates, divisors


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
    ({"device": "tpu-v9"}, "unknown device", "device='tpu-v9'"),
]


@pytest.mark.parametrize("kwargs,needle,where", BAD_CALLS, ids=[str(c[0]) for c in BAD_CALLS])
def test_plan_call_with_a_bad_value_is_refused(analysed, kwargs, needle, where):
    model, inputs, report = analysed
    call = {"world": 4, "device": "cpu", "global_batch": 8, **kwargs}
    with pytest.raises(XirangError) as info:
        xirang.plan(model, example_kwargs=inputs, analysed=report, **call)
    assert_clear_error(info.value, needle, where=where)


@pytest.mark.parametrize("world", ["1x0", "0x8", "1x8x2", "", "8 gpus"])
def test_cli_world_that_is_not_a_device_count(world):
    assert_clear_cli(cli("plan", f"{MODELS}:mlp", "--global-batch", "8", "--world", world), f"world='{world}'")


def test_cli_unknown_device_lists_the_presets():
    assert_clear_cli(cli("plan", f"{MODELS}:mlp", "--global-batch", "8", "--device", "a100-800g"), "a100-80g",
                     "unknown device")


def test_divisors_are_exact():
    for n in list(range(1, 400)) + [2 ** 20, 10 ** 6, 999_983, 720_720]:
        assert divisors(n) == [d for d in range(1, min(n, 10 ** 6) + 1) if n % d == 0] + \
            ([n] if n > 10 ** 6 else [])


@pytest.mark.parametrize("global_batch", [10 ** 9, 2 ** 30, 10 ** 12])
def test_search_space_of_a_huge_global_batch_is_enumerated_quickly(global_batch):
    world = parse_world("16x8", "h100-80g")
    began = time.perf_counter()
    found = candidates(world, units=8, global_batch=global_batch)
    assert found and time.perf_counter() - began < 5.0  # ranges up to 1e12 would never finish
    assert all(c.dp * c.micro_batch * c.num_micro_batches == global_batch for c in found)


def test_prime_global_batch_no_mesh_divides_is_refused_quickly():
    world = parse_world("16x8", "h100-80g")
    began = time.perf_counter()
    with pytest.raises(XirangError) as info:
        candidates(world, units=8, global_batch=999_999_937)
    assert time.perf_counter() - began < 5.0
    assert_clear_error(info.value, "not divisible by any data-parallel degree", hint="multiple of 2")


def test_plan_for_a_billion_samples_is_as_fast_as_for_eight(analysed):
    model, inputs, report = analysed
    times = {}
    for global_batch in (8, 10 ** 9):
        began = time.perf_counter()
        plan = xirang.plan(model, world="1x8", device="h100-80g", example_kwargs=inputs, analysed=report,
                           global_batch=global_batch)
        times[global_batch] = time.perf_counter() - began
        assert plan.global_batch == global_batch
    # the splits solved and candidates priced do not depend on the batch: allow noise, not growth
    assert times[10 ** 9] < 3 * times[8] + 2.0, times
