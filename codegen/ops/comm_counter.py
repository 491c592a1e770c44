"""Count the bytes this rank hands to collectives, one record per call.

The runtime's collectives (``collectives.py``) and the data-parallel gradient buckets
(``grad_sync.py``) take an optional ``counter``; when given, every call that actually moves data
appends a ``CommRecord``. Nothing patches ``torch.distributed``: a counter is an ordinary object
passed explicitly, so two counters (say, one per pipeline stage) never see each other's calls.

``nbytes`` follows the convention of the cost model (``xirang.passes.planning.cost_collectives``, after
nccl-tests): the size of one rank's *full* buffer, i.e.
- all_reduce: the buffer every rank reduces;
- reduce_scatter: each rank's input (it keeps nbytes / group_size);
- all_gather: each rank's output (it contributes nbytes / group_size);
- all_to_all: each rank's send buffer (nbytes / group_size to each peer);
- send: one point-to-point message this rank sends (group_size: the group it travels in, e.g. the cp ring).
Padding added for uneven dims is counted, because it is sent. So a test can compare a step's
records with a plan's analytic count term by term, without modelling ring algorithms here.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional
from xirang.ir.errors import InvalidValue

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")


@dataclass(frozen=True)
class CommRecord:
    """One collective call on this rank.

    ``label`` says who issued it ("reduce_from_group.forward", "grad bucket 2"), ``emulated`` is
    True when the call ran as a different collective than its kind (reduce_scatter done as an
    all_reduce where the backend lacks it): the logical kind and bytes are what a plan counts,
    the wire traffic was the emulation's. ``algorithm`` is what ran (``xirang.ir.plan_parts.ENACTED_ALGORITHM``):
    "flat" (the backend's own) or "hierarchical" (two levels on sub-groups, recorded once, as the
    one logical collective the plan lists). ``chunks`` > 1: this call is one of that many pieces of
    one logical collective cut to overlap a matmul (``collective_matmul.py``); the pieces' bytes add up
    to the whole collective's, so sums by kind are unchanged.
    """

    kind: str
    nbytes: int
    group_size: int
    label: str = ""
    emulated: bool = False
    algorithm: str = "flat"
    chunks: int = 1


@dataclass
class CommCounter:
    """An append-only list of ``CommRecord`` with a few sums; ``reset()`` between steps."""

    records: list = field(default_factory=list)

    def record(self, kind: str, nbytes: int, group_size: int, label: str = "",
               emulated: bool = False, algorithm: str = "flat", chunks: int = 1) -> None:
        if kind not in KINDS:
            raise InvalidValue(f"CommCounter.record: unknown collective kind {kind!r} "
                             f"(from {label or 'an unlabelled call'}); valid kinds are "
                             f"{', '.join(KINDS)}")
        self.records.append(CommRecord(kind, int(nbytes), int(group_size), label, emulated, algorithm, int(chunks)))

    def total_bytes(self, kind: Optional[str] = None) -> int:
        """Sum of ``nbytes`` over all records, or over the records of one kind."""
        return sum(r.nbytes for r in self.records if kind is None or r.kind == kind)

    def by_kind(self) -> dict:
        """``{kind: total nbytes}`` for the kinds seen, in first-seen order."""
        totals: dict = defaultdict(int)
        for r in self.records:
            totals[r.kind] += r.nbytes
        return dict(totals)

    def calls(self, kind: Optional[str] = None) -> int:
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def reset(self) -> None:
        self.records.clear()


def record_call(counter: Optional[CommCounter], kind: str, nbytes: int, group_size: int,
                label: str, emulated: bool = False, algorithm: str = "flat", *, chunks: int = 1) -> None:
    """Record on ``counter`` if one was passed; the call sites stay one line."""
    if isinstance(counter, CommCounter):  # None: nothing counts; an unattached program fails on its group
        counter.record(kind, nbytes, group_size, label, emulated, algorithm, chunks)
