"""What planning does to be fast changes no result: splits priced two at a time give the search what
one at a time gives, each (tp, micro-batch) priced once, the first failure in order raised; the
analysis lints its graph once unless asked after every pass. (Timings: benchmarks/plan_speed.py.)"""
from __future__ import annotations

import importlib
from collections import Counter

import pytest
from test_plan_search import pricer, tiny_device, unit

from examples.catalog import gpt_tiny
from xirang.ir.device import GiB
from xirang.ir.errors import XirangError
from xirang.ir.world import World
from xirang.passes.planning import plan_search
from xirang.pipeline import ANALYSIS_PASSES

analyze_module = importlib.import_module("xirang.analyze")  # the module: ``xirang.analyze`` is also the function


def _units(tp, b):
    return [unit("segment:0", 0.3 * b / tp, params=10_000_000 // tp, cut=1e6 * b)] + \
           [unit(f"block:{i}", (1.0 + 0.1 * i) * b / tp + 0.01, params=50_000_000 // tp, saved=3e9 * b / tp,
                 inputs=1e8 * b, cut=1e6 * b) for i in range(6)]


def _search(price):
    return plan_search.search_plan(price, World.uniform(2, 4, tiny_device(40 * GiB)), global_batch=32, seq=8)


def test_splits_priced_on_threads_give_the_sequential_search(monkeypatch):
    threaded = pricer(_units)
    together = _search(threaded)
    monkeypatch.setattr(plan_search, "SPLIT_WORKERS", 1)
    alone = _search(pricer(_units))
    assert plan_search.SPLIT_WORKERS == 1 and together.splits_priced > 2
    assert set(Counter(threaded.calls).values()) == {1}  # every (tp, micro-batch) once
    assert together.best == alone.best and together.alternatives == alone.alternatives
    assert (together.candidates, together.priced, together.splits_priced) == \
        (alone.candidates, alone.priced, alone.splits_priced)
    assert together.price_cpu_seconds > 0


def test_the_first_failing_split_in_order_is_raised():
    def price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None):
        if (tp, micro_batch) in ((2, 1), (4, 2)):
            raise XirangError(f"cannot split tp={tp} b={micro_batch}")
        return pricer(_units)(tp, tp_group, micro_batch, seq)
    with pytest.raises(XirangError, match="tp=2 b=1"):
        _search(price)


def test_analysis_lints_once_unless_asked_after_each_pass(monkeypatch):
    linted = []
    monkeypatch.setattr(analyze_module, "lint_graph", lambda gm, done_pass, done: linted.append(done_pass.name))
    model, batch = gpt_tiny()
    analyze_module.analyze(model, example_kwargs=batch)
    assert linted == [ANALYSIS_PASSES[-1].name]  # the pass manager itself linted nothing
    pass_manager = importlib.import_module("xirang.pass_manager")
    monkeypatch.setattr(pass_manager, "lint_graph", lambda gm, done_pass, done: linted.append(done_pass.name))
    linted.clear()
    analyze_module.analyze(model, example_kwargs=batch, lint_each_pass=True)
    assert linted == [p.name for p in ANALYSIS_PASSES]
