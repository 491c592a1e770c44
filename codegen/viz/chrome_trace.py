"""A measured timeline as Chrome-trace JSON: what each rank's pipeline executor really ran, step by
step, in the format chrome://tracing, Perfetto (https://ui.perfetto.dev) and torch.profiler use.

Input: one list per training step of ``(global rank, pp rank, action, start, end)``, the records of
``StepRecord.timestamps`` (``PipelineRuntime.last_step``) with the global rank put in front; times
are ``perf_counter`` seconds from the step's start. The pp ranks of a pipeline meet at a barrier
before each step and take their clock from there, so one step's records share one origin.

Output: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`` with
- one track per global rank: process ``pid = rank`` with one thread ``tid = 0``, named by "M"
  metadata events ``"rank r"`` (the thread also gives the pp rank), sorted by rank;
- one "X" (complete) event per compute action a rank ran: name ``"F3 s1"`` (forward of micro-batch
  3 on stage 1; ``B``, ``BI``, ``BW`` for the backward and its input/weight parts), ``ts``/``dur``
  in microseconds, category and ``args.kind`` the kind in words, ``args`` also the stage,
  micro-batch, step and pp rank;
- steps laid one after another: step k starts where step k - 1's last action ended, plus a gap of
  ``STEP_GAP`` of that step's span (what ran between steps, the optimizer, is not recorded).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from xirang.ir.errors import XirangError
from xirang.ir.schedules import Backward, BackwardInput, BackwardWeight, Forward

LETTERS = {Forward: "F", Backward: "B", BackwardInput: "BI", BackwardWeight: "BW"}
KINDS = {Forward: "forward", Backward: "backward", BackwardInput: "backward-input",
         BackwardWeight: "backward-weight"}
STEP_GAP = 0.05  # between two steps, this share of the earlier step's span
MICROSECONDS = 1e6


def event_name(action) -> str:
    """``"F3 s1"``: the kind's letter, the micro-batch, the stage."""
    return f"{LETTERS[type(action)]}{action.micro_batch} s{action.stage}"


def with_rank(global_rank: int, timestamps: Iterable) -> list[tuple]:
    """``StepRecord.timestamps`` entries ``(pp rank, action, start, end)`` with ``global_rank`` in front."""
    return [(global_rank, *entry) for entry in timestamps]


def chrome_trace(steps: Sequence[Iterable], *, ranks: Iterable[int] | None = None,
                 other_data: dict | None = None) -> dict:
    """The trace (see the module docstring) of ``steps``: each a list of (global rank, pp rank,
    action, start s, end s). ``ranks``: the global ranks that get a track even without events
    (default: those in the records). ``other_data``: facts about the run kept under "otherData"."""
    steps = [sorted(records, key=lambda r: (r[0], r[3])) for records in steps]
    pp_of = {}
    for records in steps:
        for rank, pp_rank, *_ in records:
            pp_of.setdefault(rank, pp_rank)
    tracks = sorted(set(ranks if ranks is not None else ()) | set(pp_of))
    events = []
    for rank in tracks:
        thread = f"rank {rank}" + (f" (pp rank {pp_of[rank]})" if rank in pp_of else "")
        events += [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
                   {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
                   {"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": thread}}]
    offset = 0.0  # seconds: where the current step starts on the trace's clock
    for step, records in enumerate(steps):
        for rank, pp_rank, action, start, end in records:
            if type(action) not in LETTERS:
                raise XirangError(f"record of rank {rank} has {action!r}, not a compute action",
                                  where=f"step {step}", hint="pass StepRecord.timestamps: compute actions only")
            kind = KINDS[type(action)]
            events.append({"name": event_name(action), "cat": kind, "ph": "X", "pid": rank, "tid": 0,
                           "ts": round((offset + float(start)) * MICROSECONDS, 3),
                           "dur": round((float(end) - float(start)) * MICROSECONDS, 3),
                           "args": {"stage": action.stage, "micro_batch": action.micro_batch, "kind": kind,
                                    "step": step, "pp_rank": pp_rank}})
        span = max((float(end) for *_, end in records), default=0.0)
        offset += span * (1 + STEP_GAP)
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if other_data:
        trace["otherData"] = dict(other_data)
    return trace


def write_chrome_trace(steps: Sequence[Iterable], path, *, ranks: Iterable[int] | None = None,
                       other_data: dict | None = None, option: str = "--trace") -> Path:
    """Write ``chrome_trace(...)`` to ``path`` as JSON; returns the resolved path."""
    path = Path(path)
    check_writable(path, option)
    path.write_text(json.dumps(chrome_trace(steps, ranks=ranks, other_data=other_data)))
    return path.resolve()


def check_writable(path, option: str = "--trace") -> None:
    """A XirangError naming ``option`` when ``path``'s folder does not exist (check before a long run)."""
    folder = Path(path).parent
    if not folder.exists():
        raise XirangError(f"cannot write {path}: folder {folder} does not exist", where=option,
                          hint="create the folder first or give another path")
