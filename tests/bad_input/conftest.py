"""Fixtures of the bad-input battery: a plan saved once per session for the tiny MLP."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def saved_plan(tmp_path_factory) -> str:
    """plan.json of tests/bad_input/models.py:mlp on 1 cpu rank (global batch 8)."""
    import xirang
    from tests.bad_input.models import mlp
    model, inputs = mlp()
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    xirang.plan(model, world=1, device="cpu", example_kwargs=inputs, global_batch=8).save(path)
    return str(path)
