"""A plan whose mesh has cp > 1 or ep > 1 is valid data (JSON round trip, explain) but is refused by
``xirang.compile`` and by the runtime until the context- and expert-parallel runtimes land: run, it
would train wrong. The planner itself keeps cp = ep = 1."""
from __future__ import annotations

from dataclasses import replace

import pytest

import xirang
from examples.catalog import gpt_tiny
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.ir.errors import XirangError
from xirang.ir.mesh import Mesh
from xirang.ir.plan import Plan


@pytest.fixture(scope="module")
def dp2_plan():
    model, batch = gpt_tiny(batch=4, seq=16)
    plan = xirang.plan(model, world=2, example_kwargs=batch, global_batch=4, dp=2, tp=1, pp=1)
    assert (plan.mesh.cp, plan.mesh.ep) == (1, 1)  # the planner never chooses them yet
    return plan


def _with_cp(plan):
    # the same 2 ranks as one context-parallel pair: dp 1, so the batch is one dp rank's
    return replace(plan, mesh=Mesh(dp=1, pp=1, tp=1, cp=2), global_batch=plan.micro_batch * plan.num_micro_batches,
                   collectives=tuple(c for c in plan.collectives if c.axis != "dp"), buckets=())


def _with_ep(plan):
    return replace(plan, mesh=Mesh(dp=2, pp=1, tp=1, ep=2))  # experts folded over the 2 dp ranks


@pytest.mark.parametrize("make,needle", [(_with_cp, "context parallelism (cp=2) is planned but not yet enacted by "
                                                    "the runtime"),
                                         (_with_ep, "expert parallelism (ep=2) is planned but not yet enacted by "
                                                    "the runtime")], ids=["cp", "ep"])
def test_compile_and_the_runtime_refuse_a_plan_with_cp_or_ep(dp2_plan, make, needle):
    plan = make(dp2_plan)
    again = Plan.from_json(plan.to_json())  # valid data: it round-trips with every named axis
    assert again == plan and again.mesh == plan.mesh
    assert f"Mesh axes: {plan.mesh.describe()}" in plan.explain()
    model, batch = gpt_tiny(batch=4, seq=16)
    with pytest.raises(XirangError, match=needle.replace("(", r"\(").replace(")", r"\)")) as error:
        xirang.compile(model, world=2, example_kwargs=batch, plan=plan)
    assert error.value.where == "plan.mesh" and "re-plan" in error.value.hint
    with pytest.raises(XirangError, match="not yet enacted") as error:
        CompiledModel(model, plan, program=None)  # before any process group or program is touched
    assert error.value.where == "CompiledModel(plan=...)"
