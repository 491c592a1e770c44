"""The compute samples of a calibration on shared cores are the median of passes spread over its window."""
from __future__ import annotations

from xirang.codegen.runtime.calibration.calibrate import median_of_passes


def test_each_timed_number_is_the_median_of_its_passes_and_the_sizes_stay():
    passes = [
        {"matmul": {"float32": [[1e6, 0.010], [2e6, 0.030]]}, "op_forward_s": 3e-6,
         "recompute": {"saved_tensors": 6, "plain_s": 0.5}, "note": "a", "flag": True},
        {"matmul": {"float32": [[1e6, 0.020], [2e6, 0.010]]}, "op_forward_s": 9e-6,
         "recompute": {"saved_tensors": 6, "plain_s": 0.7}, "note": "b", "flag": False},
        {"matmul": {"float32": [[1e6, 0.015], [2e6, 0.020]]}, "op_forward_s": 4e-6,
         "recompute": {"saved_tensors": 6, "plain_s": 0.6}, "note": "c", "flag": False},
    ]
    merged = median_of_passes(passes)
    # each sample's seconds are the median of its three passes, taken sample by sample (a slow pass
    # at one size does not move the other sizes), and the sizes are those every pass timed
    assert merged["matmul"]["float32"] == [[1e6, 0.015], [2e6, 0.020]]
    assert merged["op_forward_s"] == 4e-6
    assert merged["recompute"] == {"saved_tensors": 6, "plain_s": 0.6}
    assert merged["note"] == "a" and merged["flag"] is True  # not numbers: the first pass's


def test_one_pass_is_itself():
    sample = {"elementwise": [[12.0, 1e-5], [48.0, 3e-5]], "op_backward_s": 5e-6, "attention": []}
    assert median_of_passes([sample]) == sample
