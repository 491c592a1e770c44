"""The measured timeline as Chrome-trace JSON (Perfetto, chrome://tracing): the file loads as JSON,
has one named track per rank and one complete event per scheduled compute action, in the order and
at the times the records give; and ``xirang run --trace`` writes such a file from real ranks."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from xirang.codegen.runtime.executor.schedule_sim import simulate
from xirang.codegen.viz.chrome_trace import chrome_trace, event_name, with_rank, write_chrome_trace
from xirang.ir.errors import XirangError
from xirang.ir.schedules import Backward, BackwardInput, Forward, Send, build_schedule, is_compute

REPO = Path(__file__).resolve().parents[2]


def tracks(trace: dict) -> dict:
    """pid -> the name its "process_name" metadata event gives."""
    names = [(e["pid"], e["args"]["name"]) for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(names) == len({pid for pid, _ in names}), "a process named twice"
    return dict(names)


def actions_by_track(trace: dict) -> dict:
    """(pid, step) -> event names in time order."""
    found = defaultdict(list)
    for event in sorted((e for e in trace["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"]):
        found[(event["pid"], event["args"]["step"])].append(event["name"])
    return dict(found)


def scheduled(schedule, pp_rank: int) -> list[str]:
    return [event_name(a) for a in schedule.ranks[pp_rank] if is_compute(a)]


def simulated_steps(schedule, world: int, steps: int, pp_of) -> list[list]:
    """What the ranks of a run would record: the simulated timeline, in seconds (1 unit = 1 ms)."""
    timeline = simulate(schedule)
    return [[entry for rank in range(world)
             for entry in with_rank(rank, [(e.rank, e.action, float(e.start) / 1000, float(e.end) / 1000)
                                           for e in timeline.entries if e.rank == pp_of(rank)])]
            for _ in range(steps)]


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 2, 4, 1), ("gpipe", 3, 3, 1), ("interleaved", 2, 4, 2)])
def test_one_track_per_rank_and_one_event_per_scheduled_compute_action(tmp_path, name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    world = 2 * p  # dp = 2: two ranks run each pipeline rank's actions

    def pp_of(rank):
        return rank % p

    path = write_chrome_trace(simulated_steps(schedule, world, 2, pp_of), tmp_path / "trace.json",
                              ranks=range(world), other_data={"schedule": name})
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"] == {"schedule": name}
    assert tracks(trace) == {rank: f"rank {rank}" for rank in range(world)}
    threads = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {rank: f"rank {rank} (pp rank {pp_of(rank)})" for rank in range(world)}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    compute = sum(is_compute(a) for actions in schedule.ranks for a in actions)
    assert len(events) == 2 * 2 * compute  # two steps, two ranks per pipeline rank
    assert actions_by_track(trace) == {(rank, step): scheduled(schedule, pp_of(rank))
                                       for rank in range(world) for step in range(2)}
    for event in events:
        action = {"forward": Forward, "backward": Backward}[event["args"]["kind"]](
            event["args"]["stage"], event["args"]["micro_batch"])
        assert event["name"] == event_name(action) and event["cat"] == event["args"]["kind"]
        assert event["tid"] == 0 and event["args"]["pp_rank"] == pp_of(event["pid"])


def test_times_are_microseconds_and_steps_follow_one_another():
    schedule = build_schedule("1f1b", 2, 2)
    steps = simulated_steps(schedule, 2, 2, lambda rank: rank)
    trace = chrome_trace(steps)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    first = next(e for e in events if e["name"] == "F0 s0" and e["args"]["step"] == 0)
    assert (first["ts"], first["dur"]) == (0.0, 1000.0)  # 1 ms forward
    backward = next(e for e in events if e["name"] == "B0 s1" and e["args"]["step"] == 0)
    assert (backward["ts"], backward["dur"]) == (2000.0, 2000.0)  # rank 1 waits 1 ms, then its forward
    span = max(e["ts"] + e["dur"] for e in events if e["args"]["step"] == 0)
    assert span == 1000 * float(simulate(schedule).makespan)
    later = [e["ts"] for e in events if e["args"]["step"] == 1]
    assert min(later) > span  # step 1 after step 0, with a gap
    assert sorted(e["ts"] - min(later) for e in events if e["args"]["step"] == 1) == \
        sorted(e["ts"] for e in events if e["args"]["step"] == 0)


def test_a_rank_without_records_still_gets_its_track_and_bad_records_are_refused(tmp_path):
    trace = chrome_trace([[(1, 0, Forward(0, 0), 0.0, 0.001)]], ranks=range(3))
    assert tracks(trace) == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    assert [e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"] == [1]
    assert chrome_trace([[(0, 0, BackwardInput(1, 2), 0.0, 0.001)]])["traceEvents"][-1]["name"] == "BI2 s1"
    with pytest.raises(XirangError, match="not a compute action"):
        chrome_trace([[(0, 0, Send("activation", 0, 0, 1), 0.0, 0.001)]])
    with pytest.raises(XirangError, match="does not exist"):
        write_chrome_trace([], tmp_path / "missing" / "trace.json")


@pytest.mark.matrix  # slower end-to-end run: the -m matrix tier
def test_xirang_run_trace_has_one_track_per_rank_and_one_event_per_scheduled_action(tmp_path):
    path = tmp_path / "trace.json"
    result = subprocess.run([sys.executable, "-m", "xirang", "run", "examples/catalog.py:gpt_tiny", "--world", "4",
                             "--pp", "2", "--steps", "2", "--trace", str(path)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"trace: {path}" in result.stdout
    trace = json.loads(path.read_text())
    facts = trace["otherData"]
    assert (facts["world"], facts["pipeline_ranks"], facts["steps"]) == (4, 2, 2)
    schedule = build_schedule(facts["schedule"], facts["pipeline_ranks"], facts["micro_batches"],
                              facts["virtual_stages"])
    assert tracks(trace) == {rank: f"rank {rank}" for rank in range(4)}
    pp_of = {e["pid"]: e["args"]["pp_rank"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert sorted(pp_of) == [0, 1, 2, 3] and sorted(pp_of.values()) == [0, 0, 1, 1]  # dp = 2
    # every rank ran its pipeline rank's compute actions, each once, in the schedule's order, every step
    assert actions_by_track(trace) == {(rank, step): scheduled(schedule, pp_of[rank])
                                       for rank in range(4) for step in range(2)}
    assert all(e["dur"] > 0 for e in trace["traceEvents"] if e["ph"] == "X")
