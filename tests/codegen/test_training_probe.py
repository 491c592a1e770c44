"""The calibration's training workload timed again later (``calibration/sharing.training_probe``), whose
figures a benchmark sets beside the calibration's to see how far the host's speed has moved."""
from __future__ import annotations

import torch

from xirang.codegen.runtime.calibration.sharing import training_probe
from xirang.codegen.runtime.launch.launcher import launch


def _probe(rank, world_size):
    torch.set_num_threads(1)
    return training_probe("cpu", lambda: None, rounds=2)


def test_the_probe_times_the_workload_alone_and_together_as_the_calibration_does():
    results = launch(_probe, 2, (), timeout_s=300)
    figures = results[0]
    # the same keys as the calibration's raw["sharing"]["training"] (what a benchmark divides by)
    assert {"alone_s", "together_s", "alone_cpu_s", "together_cpu_s", "beside_waiters_s"} <= set(figures)
    assert figures["alone_s"] > 0 and figures["alone_cpu_s"] > 0 and figures["together_cpu_s"] > 0
    # the together CPU is every rank's mean, the same figure on both ranks (one all-reduce)
    assert results[1]["together_cpu_s"] == figures["together_cpu_s"]
