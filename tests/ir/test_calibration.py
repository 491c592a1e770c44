"""ir/calibration: the least-squares line, the measured tables' JSON, and a calibrated World's round trip
(file included) beside older World JSON that has no calibration."""
from __future__ import annotations

import json
import pickle

import pytest

from xirang.ir.calibration import Calibration, CollectiveFit, fit_line
from xirang.ir.device import DeviceSpec
from xirang.ir.world import LinkSpec, NodeSpec, World


def test_fit_line_recovers_an_exact_line_and_reports_zero_residual():
    sizes = [1e3, 1e4, 1e5, 1e6]
    alpha, beta, residual = fit_line(sizes, [2e-5 + n / 1e9 for n in sizes])
    assert alpha == pytest.approx(2e-5) and beta == pytest.approx(1e-9) and residual < 1e-12


def test_fit_line_weighs_relative_error_and_keeps_both_terms_non_negative():
    # a flat latency-bound series: the unconstrained slope would be negative; it is clamped to 0
    alpha, beta, residual = fit_line([1e3, 1e4, 1e5], [3e-5, 2.9e-5, 2.8e-5])
    assert beta == 0.0 and alpha == pytest.approx(2.9e-5, rel=0.02) and residual < 0.05
    # a pure-bandwidth series through the origin: alpha clamped to 0
    alpha, beta, _ = fit_line([1e3, 1e6], [1e-6, 0.9e-3])
    assert alpha >= 0 and beta > 0
    with pytest.raises(ValueError, match="at least two"):
        fit_line([1.0], [1.0])


def _calibration() -> Calibration:
    fits = (CollectiveFit.fitted("all_reduce", 2, "gloo", [(1e3, 1.1e-4), (1e6, 2.1e-3)]),
            CollectiveFit("send", 2, "gloo", 5e-5, 1e-9, ((1e3, 5.1e-5),), 0.01))
    return Calibration(2, "gloo", "cpu", fits, backward_op_overhead_s=9e-6, comm_overlaps_compute=False,
                       raw={"threads_per_rank": 1, "matmul": [[1.0, 2.0]]}, parallel_ranks=1.5,
                       pipeline_message_s=(2e-3, 1.5e-9))


def test_calibrated_world_round_trips_json_a_file_and_pickle(tmp_path):
    device = DeviceSpec("cpu", {"fp32": 3e10}, 2**30, 2e10, op_overhead_s=4e-6)
    world = World((NodeSpec(2, device),), LinkSpec(1e9, 5e-5), LinkSpec(1e9, 5e-5), _calibration())
    data = json.loads(json.dumps(world.to_json()))
    assert data["calibration"]["collectives"][0]["samples"] == [[1e3, 1.1e-4], [1e6, 2.1e-3]]
    assert "residual" in data["calibration"]["collectives"][0] and data["calibration"]["raw"]["threads_per_rank"] == 1
    assert World.from_json(data) == world and hash(World.from_json(data)) == hash(world)
    world.save(tmp_path / "world.json")
    loaded = World.load(tmp_path / "world.json")
    assert loaded == world and loaded.nodes[0].device.op_overhead_s == 4e-6
    assert loaded.calibration.fit("all_reduce", 2).seconds(0) == pytest.approx(world.calibration.fit(
        "all_reduce", 2).alpha) and loaded.calibration.fit("all_reduce", 4) is None
    assert pickle.loads(pickle.dumps(world)) == world and loaded.calibration.parallel_ranks == 1.5
    assert loaded.calibration.pipeline_message_s == (2e-3, 1.5e-9)
    assert pickle.loads(pickle.dumps(world)).calibration.pipeline_message_s == (2e-3, 1.5e-9)
    assert "calibrated on 2 gloo ranks" in world.describe()
    plain = World.uniform(1, 8)
    assert "calibration" not in plain.to_json() and World.from_json(plain.to_json()) == plain


def test_bad_calibration_data_names_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="unknown"):
        CollectiveFit("gossip", 2, "gloo", 0.0, 0.0)
    with pytest.raises(ValueError, match="two fits"):
        Calibration(2, "gloo", "cpu", (CollectiveFit("send", 2, "gloo", 0, 0),) * 2)
    with pytest.raises(ValueError, match="xirang calibrate"):
        Calibration.from_json({"ranks": 2})
    with pytest.raises(ValueError, match="pipeline_message_s must be"):
        Calibration(2, "gloo", "cpu", pipeline_message_s=(1e-3,))
    with pytest.raises(ValueError, match="pipeline_message_s must be a non-negative"):
        Calibration(2, "gloo", "cpu", pipeline_message_s=(1e-3, -1.0))
    with pytest.raises(ValueError, match="does not exist"):
        World.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="op_overhead_s"):
        DeviceSpec("cpu", {"fp32": 1.0}, 1, 1.0, op_overhead_s=-1.0)
