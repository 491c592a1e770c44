"""The planning progress display: what a terminal sees while planning, and the lines a log gets."""
from __future__ import annotations

import io

from xirang.cli.progress import PlanProgressDisplay
from xirang.plan_api import PlanProgress


def events():
    return [PlanProgress("analyse", 3.4, "traced and analysed 69B parameters"),
            PlanProgress("splits", 0.1, "tensor split 1 solved: tp=2, micro-batch 1", step_done=False),
            PlanProgress("splits", 0.2, "tensor split 2 solved: tp=4, micro-batch 1", step_done=False),
            PlanProgress("splits", 0.3, "solved 2 tensor splits"),
            PlanProgress("search", 0.4, "searched 10 configurations"),
            PlanProgress("assemble", 0.1, "assembled the plan")]


def test_a_log_gets_one_line_per_finished_step_and_nothing_else():
    stream = io.StringIO()
    with PlanProgressDisplay(stream, live=False) as show:
        for event in events():
            show(event)
    assert stream.getvalue().splitlines() == ["[#...] traced and analysed 69B parameters",
                                              "[##..] solved 2 tensor splits", "[###.] searched 10 configurations",
                                              "[####] assembled the plan"]


def test_the_live_line_follows_the_splits_solved_inside_the_search():
    stream = io.StringIO()
    show = PlanProgressDisplay(stream, live=True)  # not entered: no redraw thread, lines drawn on demand
    assert show.live_line().startswith("[....] analyse ") and "tracing" in show.live_line()
    first, split, _, *_ = events()
    show(first)
    show(split)
    line = show.live_line()
    assert line.startswith("[#...] splits ") and line.endswith("tensor split 1 solved: tp=2, micro-batch 1")
    # the finished step's line erased the live line first (carriage return, erase to end of line)
    assert stream.getvalue() == "\r\033[K[#...] traced and analysed 69B parameters\n"
