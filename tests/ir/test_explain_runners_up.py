"""explain's runners-up: listed fastest first (those that fit before those that do not), each with why it
lost written from the plan's figures as they are, so a runner-up 3.6% slower is never called "as fast"
(the sentence stored when the search ended goes stale once the winner's step moves)."""
from __future__ import annotations

import dataclasses

import pytest

import xirang
from tests.bad_input import models
from xirang.ir.plan_explain import explain_data, label

STALE = "as fast within 0.1%; listed after the winner by the planner's tie-break"


@pytest.fixture(scope="module")
def plan():
    model, inputs = models.mlp()
    made = xirang.plan(model, world=2, hardware="cpu", example_kwargs=inputs, global_batch=8)
    assert len(made.alternatives) >= 2 and all(row.fits for row in made.alternatives[:2])
    return made


def test_runners_up_are_sorted_and_their_reasons_follow_the_figures(plan):
    step = plan.predicted.step_seconds
    slow = dataclasses.replace(plan.alternatives[0], step_seconds=step * 1.036, why=STALE)
    close = dataclasses.replace(plan.alternatives[1], step_seconds=step * 1.01)
    shown = dataclasses.replace(plan, alternatives=(slow, close))  # stored out of order, one reason stale
    text = shown.explain()
    assert STALE not in text and "as fast" not in text
    assert f"  - {label(slow)}: 3.6% slower" in text and f"  - {label(close)}: 1.0% slower" in text
    assert text.index(f"  - {label(close)}:") < text.index(f"  - {label(slow)}:")
    assert f"the next best, {label(close)}, is 1.0% slower" in text
    rows = explain_data(shown)["rows"]
    assert [row["configuration"] for row in rows] == [rows[0]["configuration"], label(close), label(slow)]
    assert rows[2]["why"].startswith("3.6% slower")


def test_a_true_tie_says_the_same_step(plan):
    tie = dataclasses.replace(plan.alternatives[0], step_seconds=plan.predicted.step_seconds)
    text = dataclasses.replace(plan, alternatives=(tie,)).explain()
    assert f"  - {label(tie)}: the same predicted step (within 0.1%)" in text
