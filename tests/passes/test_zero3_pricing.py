"""ZeRO-3 in the degree search (passes/planning/plan_costs.py, cost_model.exposed_prefetched_gathers):
the variant the runtime runs keeps each bucket's gathered parameters until the step's last backward,
so its peak is zero-1's; its gathers are prefetched one bucket ahead in the forward, so only the first
one and what the others outlast a bucket's forward are exposed.

Hand-made costs as tests/passes/test_zero_pricing.py: one unit of P = 1e9 parameters, forward 0.4 s,
backward 0.6 s, on 4 devices (dp 4), bf16: 25 buckets of 40M elements, each gathered in fp32.
"""
from __future__ import annotations

import pytest

from tests.passes.test_zero_pricing import P, search, world_of
from xirang.ir.errors import XirangError
from xirang.passes.planning.cost_collectives import collective_cost
from xirang.passes.planning.cost_model import exposed_prefetched_gathers
from xirang.passes.planning.dp_sync_costs import bucket_elements


def test_prefetched_gathers_expose_the_first_and_what_outlasts_a_bucket_forward():
    assert exposed_prefetched_gathers([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]) == 1.0  # the others hide behind compute
    # gathers of 3 s behind computes of 1 s: the gathers run back to back (9 s), the last compute after them
    assert exposed_prefetched_gathers([3.0, 3.0, 3.0], [1.0, 1.0, 1.0]) == 10.0 - 3.0
    assert exposed_prefetched_gathers([], []) == 0.0
    with pytest.raises(XirangError, match="one forward time per bucket"):
        exposed_prefetched_gathers([1.0], [])


def test_zero3_holds_zero1s_peak_and_pays_only_the_gathers_prefetch_leaves_exposed():
    result = search(15e9, zero_stage=3)  # 15 GB: zero 0 does not fit, zero 1 and 3 do
    zero3, zero1 = result.best, next(a for a in result.alternatives if a.candidate.zero_stage == 1)
    assert zero3.candidate.zero_stage == 3 and zero3.fits
    assert zero3.memory_parts == zero1.memory_parts and zero3.memory_per_rank == zero1.memory_per_rank
    assert zero3.memory_per_rank[0] == pytest.approx(13.25 * P)  # 4 + 5/4 (slice, mask) + 4 + 2 (bf16 copy) + 8/4 B
    cap = bucket_elements(4)
    gather = collective_cost("all_gather", cap * 4, (0, 1, 2, 3), world_of(15e9)).seconds
    buckets = P // cap
    exposed = exposed_prefetched_gathers([gather] * buckets, [0.4 / buckets] * buckets)
    assert 0 < exposed < buckets * gather
    assert zero1.breakdown["dp_exposed"] - zero3.breakdown["dp_exposed"] == pytest.approx(buckets * gather - exposed)


def test_the_search_offers_zero3_where_dp_is_above_1():
    result = search(100e9)
    assert {a.candidate.zero_stage for a in (result.best, *result.alternatives)} >= {0, 1, 3}
    with pytest.raises(XirangError, match="zero_stage=2 is not a ZeRO stage"):
        search(100e9, zero_stage=2)
