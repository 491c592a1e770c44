"""Pricing of the chunked tp collective matmuls (passes/planning/tp_overlap_cost.py), by hand."""
from __future__ import annotations

import math

from xirang.ir.world import World
from xirang.passes.planning.cost_collectives import collective_cost
from xirang.passes.planning.tp_overlap_cost import FusedPair, exposed_seconds, overlaps_compute

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
