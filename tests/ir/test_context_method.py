"""The context-parallel method's names, its all-to-all x ring split and sub-groups, and its plan record
(ir/context_method.py), by hand."""
from __future__ import annotations

import pytest

from xirang.ir.context_method import (a2a_degree, context_subgroups, method_choice, methods_at, recorded_method,
                                      usp_a2a)
from xirang.ir.errors import InvalidValue
from xirang.ir.plan_parts import CollectiveChoice


def test_each_method_is_one_all_to_all_degree():
    assert [a2a_degree(method, 8) for method in methods_at(8)] == [1, 8, 2, 4]
    assert methods_at(8) == ["ring", "all_to_all", "usp:2", "usp:4"]
    assert methods_at(2) == ["ring", "all_to_all"] and methods_at(1) == ["ring"]


@pytest.mark.parametrize("method, cp, needle", [("usp:3", 4, "does not split cp = 4"), ("usp:4", 4, "does not split"),
                                                ("usp:1", 4, "usp:A"), ("ulysses", 4, "'ring', 'all_to_all'")])
def test_a_split_cp_cannot_run_or_a_misspelt_method_is_refused(method, cp, needle):
    with pytest.raises(InvalidValue, match=needle):
        a2a_degree(method, cp)


def test_the_all_to_all_groups_are_consecutive_and_the_ring_groups_strided():
    """cp group (8, 9, 10, 11, 12, 13) at all-to-all degree 3: member g·3 + j is rank j of all-to-all group g and
    rank g of ring group j."""
    a2a, ring = context_subgroups((8, 9, 10, 11, 12, 13), 3)
    assert a2a == ((8, 9, 10), (11, 12, 13)) and ring == ((8, 11), (9, 12), (10, 13))
    with pytest.raises(InvalidValue):
        context_subgroups((0, 1, 2, 3), 3)


def test_a_plan_records_each_method_and_reads_it_back():
    kept = CollectiveChoice("context:0:block:0", "cp", "send", "direct", 1024)  # a call's bytes: not a method
    for method in ("ring", "all_to_all", "usp:2"):
        assert recorded_method((kept, method_choice(method))) == method
    assert method_choice("usp:2").node == "context:attention:usp:2" and usp_a2a("usp:2") == 2
    assert recorded_method((kept,)) == "ring"  # none recorded: the ring
