"""Pricing of the chunked tp collective matmuls (passes/planning/tp_overlap_cost.py), by hand."""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest

import torch

import xirang
from examples.gpt import GPTConfig, build_gpt
from xirang.ir.errors import PlanError
from xirang.ir.world import World
from xirang.passes.planning.cost_collectives import collective_cost
from xirang.passes.planning.tp_overlap_cost import (CHUNK_CHOICES, MIN_SAVING, FusedPair, choose_tp_overlap,
                                                    exposed_seconds, overlaps_compute, tp_overlap_saving)

A100S = World.uniform(1, 8, "a100-80g")
GROUP = tuple(range(8))


def test_a_long_matmul_hides_all_but_the_first_chunk():
    # 64 MiB all-gather on 8 NVLink A100s, forward matmul far longer than any chunk's collective
    pair = FusedPair("linear", "all_gather", 64 * 2**20, matmul_seconds=1.0)
    plain, hidden = exposed_seconds(pair, 4, GROUP, A100S)
    gather = collective_cost("all_gather", 64 * 2**20, GROUP, A100S).seconds
    scatter = collective_cost("reduce_scatter", 64 * 2**20, GROUP, A100S).seconds
    assert math.isclose(plain, gather + scatter)
    first_chunks = (collective_cost("all_gather", 16 * 2**20, GROUP, A100S).seconds
                    + collective_cost("reduce_scatter", 16 * 2**20, GROUP, A100S).seconds)
    assert math.isclose(hidden, first_chunks)  # g_0 + 3 * max(0, g - f) with f >> g
    assert hidden < plain / 2  # 2 x 99 us of 2 x 290 us on DGX A100 links (alpha ~35 us a call)


def test_no_matmul_to_hide_behind_costs_the_extra_latencies():
    pair = FusedPair("linear", "reduce_scatter", 1e3, matmul_seconds=0.0)
    plain, hidden = exposed_seconds(pair, 4, GROUP, A100S)
    assert hidden > plain  # four alphas instead of one: chunking small collectives never pays


def test_cpu_worlds_never_count_on_overlap():
    assert overlaps_compute(A100S)
    assert not overlaps_compute(World.uniform(1, 4, "cpu"))


@functools.lru_cache(maxsize=1)
def _planned_on_a100s():
    with torch.device("meta"):
        model = build_gpt(GPTConfig(vocab_size=32000, seq_len=4096, hidden=4096, heads=32, layers=2))
    tokens = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    report = xirang.analyze(model, example_kwargs={"input_ids": tokens, "labels": tokens})
    plan = xirang.plan(model, world=8, example_kwargs={"input_ids": tokens, "labels": tokens}, global_batch=8,
                       seq=4096, hardware="a100-80g", dp=1, tp=8, pp=1, micro_batch=1, sequence_parallel=True,
                       analysed=report)
    return report, plan


def _plan_of_8():
    return _planned_on_a100s()[1]


def test_the_planner_picks_it_on_a100s_and_not_on_cpus():
    """A 2-layer GPT at hidden 4096, seq 4096 on 8 A100s at tp 8 with sp (planned on meta): chunking hides
    part of the sequence collectives behind the matmuls, so xirang.plan sets tp_overlap and lowers its
    prediction by it; the same plan on CPU devices (gloo shares their cores) is left without it."""
    report, plan = _planned_on_a100s()
    assert plan.tp_overlap in CHUNK_CHOICES, plan.predicted.notes
    note = next(n for n in plan.predicted.notes if n.startswith("tp_overlap"))
    saving = tp_overlap_saving(report.graph_module, plan, 4096, plan.tp_overlap)
    assert saving > MIN_SAVING * plan.predicted.step_seconds and f"hide {saving:.4g} s" in note
    off = dataclasses.replace(plan, tp_overlap=0, world=World.uniform(1, 8, "cpu"))
    assert choose_tp_overlap(report.graph_module, off, 4096).tp_overlap == 0
    assert choose_tp_overlap(report.graph_module, off, 4096, pinned=2).tp_overlap == 2  # a pin is obeyed
    assert type(plan).from_json(plan.to_json()) == plan  # the field round-trips


def test_tp_overlap_needs_chunks_sequence_parallel_and_tp():
    plan = dataclasses.replace(_plan_of_8(), tp_overlap=0)
    with pytest.raises(PlanError, match="tp_overlap"):
        dataclasses.replace(plan, tp_overlap=1)
    with pytest.raises(PlanError, match="sequence_parallel"):
        dataclasses.replace(plan, sequence_parallel=False, tp_overlap=2)
