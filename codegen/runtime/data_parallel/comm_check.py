"""Did a step's gradient communication equal the plan's, collective by collective?

The plan lists one all-reduce per gradient bucket (``Plan.collectives``, node "bucket:<k>", over dp)
and one per weight tied across pipeline ranks (node "tied:<name>", over the ranks holding a copy):
bytes (one rank's full buffer, padding included) and algorithm. The runtime records each call on the
``CommCounter`` with the same label, the bytes it handed to the collective and the algorithm it ran
(``ENACTED_ALGORITHM``: "ring"/"tree" run as the backend's flat all-reduce, "hierarchical" as
Xirang's two levels). Comparing the two is a join on the label and the kind. Over the ranks of one
(dp, tp) index across the pipeline, each bucket runs on exactly one rank (the one holding its stage)
and each tied sum on every holder.

Under ZeRO-1 (``plan.zero_stage`` 1) a bucket is two calls with one label: the reduce-scatter of its
gradients and the all-gather of its updated parameters, which runs at the start of the next step
(codegen/runtime/data_parallel/dist_optimizer.py), so a step's records hold the previous step's all-gathers. ZeRO-3
lists the same two calls; its all-gather runs at the bucket's first use in the step
(codegen/runtime/data_parallel/param_shards.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from xirang.ir.plan_parts import ENACTED_ALGORITHM

CHECKED = ("bucket:", "tied:")  # the labels the plan and the runtime share


@dataclass(frozen=True)
class PlannedCall:
    """What one labelled collective was planned to be and what ran on ``rank`` (``ran`` None: it
    did not run anywhere; ``planned`` empty: the plan does not list it, or a bucket ran twice)."""

    label: str
    planned: tuple  # (kind, nbytes, enacted algorithm)
    ran: Optional[tuple]
    rank: Optional[int]

    @property
    def equal(self) -> bool:
        return self.ran == self.planned


def planned_calls(plan, records_by_rank: Mapping[int, Sequence]) -> list:
    """One ``PlannedCall`` per bucket and tied sum the ranks ran, from one step's ``CommRecord``s of
    the ranks of one (dp, tp) index across the pipeline (``{global rank: records}``), plus one per
    planned call that ran nowhere."""
    planned = {(choice.node, choice.kind): (choice.kind, choice.nbytes, ENACTED_ALGORITHM[choice.algorithm])
               for choice in plan.collectives if choice.node.startswith(CHECKED)}
    rows, seen = [], set()
    for rank, records in sorted(records_by_rank.items()):
        for record in records:
            if not record.label.startswith(CHECKED):
                continue
            key = (record.label, record.kind)
            twice = record.label.startswith("bucket:") and key in seen
            seen.add(key)
            rows.append(PlannedCall(record.label, () if twice else planned.get(key, ()),
                                    (record.kind, record.nbytes, record.algorithm), rank))
    rows += [PlannedCall(key[0], expected, None, None) for key, expected in planned.items() if key not in seen]
    return sorted(rows, key=lambda row: (row.label.split(":")[0], _order(row.label), (row.planned or row.ran)[0],
                                         row.rank or 0))


def _order(label: str):
    index = label.split(":", 1)[1]
    return (0, int(index), "") if index.isdigit() else (1, 0, index)


def calls_table(rows: Sequence[PlannedCall]) -> str:
    """The rows as a table for people: planned vs ran, bytes and algorithm."""
    lines = [f"{'collective':<24} {'rank':>4}  {'planned':<34} {'ran':<34} equal"]
    for row in rows:
        planned = f"{row.planned[0]} {row.planned[1]:,} B {row.planned[2]}" if row.planned else "(not planned)"
        ran = f"{row.ran[0]} {row.ran[1]:,} B {row.ran[2]}" if row.ran else "(did not run)"
        lines.append(f"{row.label:<24} {'' if row.rank is None else row.rank:>4}  {planned:<34} {ran:<34} "
                     f"{'yes' if row.equal else 'NO'}")
    return "\n".join(lines)
