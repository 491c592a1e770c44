"""How the calibration times a call: the median over iterations, the device synchronised around each
timed region (``xirang calibrate``: ``calibrate``, ``collectives``)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_time(fn: Callable[[], None], device: str, iters: int, warmup: int = 1,
                 before: Callable[[], None] = lambda: None) -> float:
    """Median seconds of ``fn`` over ``iters`` calls (after ``warmup``), device synchronised; ``before``
    runs untimed ahead of every call."""
    for _ in range(warmup):
        before()
        fn()
    times = []
    for _ in range(iters):
        before()
        sync_device(device)
        start = time.perf_counter()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
