"""Did a step's data-parallel gradient communication equal the plan's, collective by collective?

The plan lists one all-reduce per gradient bucket (``Plan.collectives``, node "bucket:<k>"): its
bytes (one rank's full buffer, padding included) and algorithm. The runtime records each bucket's
call on the ``CommCounter`` with the same label, the bytes it handed to the collective and the
algorithm it ran (``ENACTED_ALGORITHM``: "ring"/"tree" run as the backend's flat all-reduce,
"hierarchical" as Xirang's two levels). Comparing the two is a join on the label; every pipeline
rank runs the buckets of its own stages, so over the ranks of one (dp, tp) index every bucket of
the plan must appear exactly once per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from xirang.ir.plan_parts import ENACTED_ALGORITHM


@dataclass(frozen=True)
class BucketCall:
    """What one bucket's all-reduce was planned to be and what ran (``None``: did not run)."""

    label: str
    planned: tuple  # (kind, nbytes, enacted algorithm, group size)
    ran: Optional[tuple]
    rank: Optional[int]  # the global rank whose record this is

    @property
    def equal(self) -> bool:
        return self.ran == self.planned


def bucket_calls(plan, records_by_rank: Mapping[int, Sequence]) -> list:
    """One ``BucketCall`` per planned bucket, from one step's ``CommRecord``s of the ranks of one
    (dp, tp) index across the pipeline (``{global rank: records}``); a bucket that ran twice, or a
    bucket record the plan does not list, is reported as its own row with ``planned`` empty."""
    planned = {choice.node: (choice.kind, choice.nbytes, ENACTED_ALGORITHM[choice.algorithm], plan.mesh.dp)
               for choice in plan.collectives if choice.node.startswith("bucket:")}
    rows, seen = [], set()
    for rank, records in sorted(records_by_rank.items()):
        for record in records:
            if not record.label.startswith("bucket:"):
                continue
            ran = (record.kind, record.nbytes, record.algorithm, record.group_size)
            fresh = record.label not in seen
            seen.add(record.label)
            rows.append(BucketCall(record.label, planned.get(record.label, ()) if fresh else (), ran, rank))
    rows += [BucketCall(label, expected, None, None) for label, expected in planned.items() if label not in seen]
    return sorted(rows, key=lambda row: int(row.label.removeprefix("bucket:")))


def bucket_table(rows: Sequence[BucketCall]) -> str:
    """The rows as a table for people: planned vs ran, bytes and algorithm."""
    lines = [f"{'bucket':<10} {'rank':>4}  {'planned':<34} {'ran':<34} equal"]
    for row in rows:
        planned = f"{row.planned[0]} {row.planned[1]:,} B {row.planned[2]}" if row.planned else "(not planned)"
        ran = f"{row.ran[0]} {row.ran[1]:,} B {row.ran[2]}" if row.ran else "(did not run)"
        lines.append(f"{row.label:<10} {'' if row.rank is None else row.rank:>4}  {planned:<34} {ran:<34} "
                     f"{'yes' if row.equal else 'NO'}")
    return "\n".join(lines)
