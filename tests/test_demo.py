"""`xirang demo`, the README's main job, run as a user runs it: the command's ``main`` (argparse included) in
this process, in a folder of its own; what is checked is the demo's output and files, not an interpreter's start
(tests/test_cli.py runs the real entry point as a subprocess).

It plans a 4-layer GPT for 8 local CPU ranks, prints the plan table and the 1F1B schedule, draws
the timeline, trains 3 steps on dp=2 x tp=2 x pp=2 gloo ranks and prints each step's loss beside
single-device training, and writes what the ranks measured as a Chrome trace. The test reads what it
printed and wrote and checks the numbers, not just the words.
"""
from __future__ import annotations

import json
import re

from tests.bad_input.probe import cli
from tests.codegen.png_reader import colours, read_png
from xirang.ir.schedules import build_schedule, is_compute


def test_demo_plans_shows_and_trains_8_ranks_like_one_device(tmp_path, monkeypatch):
    timeline = tmp_path / "timeline.png"
    monkeypatch.chdir(tmp_path)  # the demo writes its trace into the folder it runs in
    code, out, err = cli("demo", "--timeline", str(timeline))
    assert code == 0, out[-3000:] + err[-3000:]
    assert re.search(r"^\* dp=2 pp=2 tp=2 ", out, re.M), out[:3000]  # the plan table, chosen row marked
    assert "Pipeline schedule (1f1b, 2 stages" in out and "Why this plan" in out
    width, height, pixels = read_png(timeline.read_bytes())  # a PNG, wide and not blank
    assert width > 800 and height > 150 and len(colours(pixels)) > 20
    assert f"timeline picture: {timeline}" in out
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d\.\d+e[-+]\d+)$", out, re.M)
    assert [int(step) for step, *_ in rows] == [0, 1, 2], out[-2000:]
    for _, single, distributed, difference in rows:
        # fp32 on 8 ranks: the sums run in another order, so equal to rounding (1e-5 as the tests)
        assert abs(float(single) - float(distributed)) <= 1e-5 and float(difference) <= 1e-5
    assert all(abs(float(single) - 6.24) < 0.1 for _, single, _, _ in rows)  # ~ln(512): random tokens, 3 steps
    assert "every rank reports the same loss: True" in out
    # the measured trace, in the folder the demo ran in: a track per rank, each rank's scheduled
    # compute actions once a step, in the schedule's order
    assert f"trace: {(tmp_path / 'demo_trace.json').resolve()} (8 ranks, 3 steps" in out
    trace = json.loads((tmp_path / "demo_trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {rank: f"rank {rank}" for rank in range(8)}
    facts = trace["otherData"]
    assert (facts["schedule"], facts["pipeline_ranks"]) == ("1f1b", 2)
    schedule = build_schedule("1f1b", 2, facts["micro_batches"])
    for rank in range(8):
        for step in range(3):
            events = sorted((e for e in trace["traceEvents"]
                             if e["ph"] == "X" and e["pid"] == rank and e["args"]["step"] == step),
                            key=lambda e: e["ts"])
            pp_rank = events[0]["args"]["pp_rank"]
            want = [a for a in schedule.ranks[pp_rank] if is_compute(a)]
            assert [(e["args"]["stage"], e["args"]["micro_batch"], e["args"]["kind"]) for e in events] == \
                [(a.stage, a.micro_batch, type(a).__name__.lower()) for a in want], (rank, step)
