"""CommCounter on its own; the distributed byte counts are checked in test_collectives/grad_sync."""
from __future__ import annotations

import pytest

from xirang.codegen.ops.comm_counter import CommCounter, CommRecord


def test_sums_by_kind_and_reset():
    counter = CommCounter()
    counter.record("all_reduce", 96, 2, "a")
    counter.record("all_gather", 72, 2, "b")
    counter.record("all_reduce", 4, 4, "c", emulated=True)
    assert counter.total_bytes() == 172
    assert counter.total_bytes("all_reduce") == 100
    assert counter.by_kind() == {"all_reduce": 100, "all_gather": 72}
    assert counter.calls("all_reduce") == 2
    assert counter.records[-1] == CommRecord("all_reduce", 4, 4, "c", True)
    counter.reset()
    assert counter.records == [] and counter.total_bytes() == 0


def test_unknown_kind_names_the_caller():
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast' .from my op."):
        CommCounter().record("broadcast", 8, 2, "my op")
