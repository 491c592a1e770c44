"""explain()'s option lines say what a difference means: "the same" where the two sides tie (within
0.5% of the step or of the memory, or below what the figure shows), sizes in the unit that shows them."""
from __future__ import annotations

import dataclasses

from tests.ir.test_plan import make_plan
from xirang.ir.device import GiB
from xirang.ir.plan import Alternative
from xirang.ir.plan_explain import option_trades

MiB = 1024**2


def zero_line(memory_zero0: tuple, exposed_zero0: float, memory_zero1=(40 * GiB, 35 * GiB), step=0.3) -> str:
    """The ZeRO line of a zero-1 plan (dp=2 pp=2 tp=2) priced against zero-0 at its configuration,
    the two differing in memory and exposed all-gather as given."""
    base = make_plan().predicted
    plan = make_plan(zero_stage=1, predicted=dataclasses.replace(
        base, step_seconds=step, memory_bytes_per_device=memory_zero1,
        breakdown={**base.breakdown, "dp_exposed": 0.01}))
    zero0 = Alternative(mesh=plan.mesh, micro_batch=plan.micro_batch, num_micro_batches=plan.num_micro_batches,
                        schedule=plan.schedule, virtual_stages=plan.virtual_stages, recompute=plan.recompute,
                        zero_stage=0, step_seconds=step - 0.01 + exposed_zero0, tflops_per_device=1.0,
                        memory_bytes_per_device=memory_zero0,
                        breakdown={**base.breakdown, "dp_exposed": exposed_zero0})
    plan = dataclasses.replace(plan, alternatives=(zero0,))
    return dict(option_trades(plan))["ZeRO"]


def test_an_option_that_changes_nothing_says_the_same_not_zero_point_zero():
    line = zero_line((40 * GiB, 35 * GiB), 0.01 - 3.05e-20)
    assert line == "zero-1 and zero-0 are the same here: the same memory/device and exposed all-gather per step " \
                   "(both 0.3 s).", line


def test_differences_below_half_a_percent_are_the_same():
    line = zero_line((40 * GiB + 100 * MiB, 35 * GiB), 0.01 - 0.001)  # 0.24% of the memory, 0.33% of the step
    assert line.startswith("zero-1 and zero-0 are the same here"), line


def test_only_the_side_that_ties_is_called_the_same():
    assert zero_line((44 * GiB, 35 * GiB), 0.01).startswith(
        "zero-1 saves 4.0 GiB/device, the same exposed all-gather per step (both 0.3 s).")
    assert zero_line((40 * GiB, 35 * GiB), 0.04).startswith(
        "zero-1 needs the same memory/device, saves 0.03 s of exposed all-gather per step")


def test_small_sizes_are_shown_in_mib_not_as_zero_gib():
    line = zero_line((30 * MiB, 30 * MiB), 0.01, memory_zero1=(20 * MiB, 20 * MiB), step=0.003)
    assert line.startswith("zero-1 saves 10.0 MiB/device, the same exposed all-gather per step"), line


def test_a_plan_of_a_few_mib_shows_its_memory_in_mib():
    base = make_plan().predicted
    small = make_plan(predicted=dataclasses.replace(base, memory_bytes_per_device=(20 * MiB, 12 * MiB))).explain()
    assert "max MiB" in small and "Memory per device by pipeline rank (MiB): 20.0, 12.0; usable 80.0 GiB." in small
    assert "max GiB" in make_plan().explain()
