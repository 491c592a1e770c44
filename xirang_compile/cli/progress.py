"""The progress display of ``xirang plan``: a live bar on a terminal, plain lines otherwise.

Planning a 70B model takes seconds, most of them in the trace and in the tensor-split problems the
search solves as it meets new (tp, micro-batch) pairs. On a terminal (stderr is a TTY) one line is
redrawn in place several times a second, so it moves even inside a long trace:

    [##..] splits  4.1 s  tensor split 7 solved: tp=8, micro-batch 2

and ends with one summary line per step. Anywhere else (pipes, CI logs, tests) only the summary
lines are printed, one per finished step, so logs stay short. Everything goes to stderr: stdout is
the plan, for scripts.
"""
from __future__ import annotations

import sys
import threading
import time

STEPS = ("analyse", "splits", "search", "assemble")
REDRAW_SECONDS = 0.2
# the search runs while the split problems are solved; the bar shows both as one running step
NEXT_STEP = {"analyse": "splits", "splits": "search", "search": "assemble", "assemble": "assemble"}


class PlanProgressDisplay:
    """Use as ``with PlanProgressDisplay() as show: xirang.plan(..., progress=show)``."""

    def __init__(self, stream=None, live: bool | None = None):
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.step, self.note, self.done = "analyse", "tracing and analysing the model", 0
        self.start = time.perf_counter()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._redraw_until_stopped, daemon=True) if self.live else None

    def __enter__(self):
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread:
            self._stop.set()
            self._thread.join()
            self._clear()

    def __call__(self, event) -> None:
        with self._lock:
            if not event.step_done:  # a split solved inside the search: update the live line only
                self.note = event.message
                return
            if event.stage in STEPS:
                self.done = STEPS.index(event.stage) + 1
                self.step = NEXT_STEP[event.stage]
            self.note = "working"
            self._clear()
            print(f"{self._bar()} {event.message}", file=self.stream, flush=True)

    def _bar(self) -> str:
        return f"[{'#' * self.done}{'.' * (len(STEPS) - self.done)}]"

    def _clear(self) -> None:
        if self.live:
            self.stream.write("\r\033[K")  # carriage return, erase to the end of the line

    def live_line(self) -> str:
        """The line a terminal shows now: steps done, the running step, seconds so far, the latest news."""
        elapsed = time.perf_counter() - self.start
        return f"{self._bar()} {self.step:<8} {elapsed:5.1f} s  {self.note}"[:160]

    def _redraw_until_stopped(self) -> None:
        while not self._stop.wait(REDRAW_SECONDS):
            with self._lock:
                self.stream.write("\r\033[K" + self.live_line())
                self.stream.flush()
