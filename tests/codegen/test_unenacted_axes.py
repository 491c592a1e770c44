"""Plans whose mesh has cp > 1 or ep > 1 are valid data (JSON round trip, explain) and run
(tests/models/test_context_parallel.py, tests/models/test_moe_families.py), except beside what their
runtimes do not run with yet (cp beside tp; ep beside ZeRO or uneven dp shares), which ``xirang.compile``
and the runtime refuse before any rank builds anything."""
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


def test_compile_and_the_runtime_refuse_cp_beside_sequence_parallelism(dp2_plan):
    plan = _with_cp(dp2_plan)
    again = Plan.from_json(plan.to_json())  # valid data: it round-trips with every named axis
    assert again == plan and again.mesh == plan.mesh
    assert f"Mesh axes: {plan.mesh.describe()}" in plan.explain()
    plan = replace(plan, sequence_parallel=True)
    model, batch = gpt_tiny(batch=4, seq=16)
    needle = r"context parallelism \(cp=2\) with sequence parallelism is not run yet"
    with pytest.raises(XirangError, match=needle) as error:
        xirang.compile(model, world=2, example_kwargs=batch, plan=plan)
    assert error.value.where == "plan.sequence_parallel" and "cp=1" in error.value.hint
    with pytest.raises(XirangError, match=needle) as error:
        CompiledModel(model, plan, program=None)  # before any process group or program is touched
    assert error.value.where == "plan.sequence_parallel"


@pytest.mark.parametrize("change,field,needle", [
    (lambda plan: replace(plan, zero_stage=1), "plan.zero_stage",
     "expert parallelism (ep=2) with ZeRO-1 is not run yet"),
    (lambda plan: replace(plan, global_batch=8, num_micro_batches=2).with_dp_shares((2, 6)), "plan.dp_shares",
     "expert parallelism (ep=2) with uneven dp shares [2, 6]")], ids=["zero", "uneven-shares"])
def test_expert_parallel_plans_refuse_what_they_do_not_run_with(dp2_plan, change, field, needle):
    plan = change(_with_ep(dp2_plan))
    model, batch = gpt_tiny(batch=4, seq=16)
    with pytest.raises(XirangError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as error:
        xirang.compile(model, world=2, example_kwargs=batch, plan=plan)
    assert error.value.where == field and "ep=1" in error.value.hint
