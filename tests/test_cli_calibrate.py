"""`xirang calibrate --quick` on 2 local ranks writes a World JSON that measures every collective kind
the runtime issues and that `xirang plan --world-file` reads, and keeps it in the user's cache folder for
`xirang train` (here the test's own: tests/conftest.py sets XDG_CACHE_HOME)."""
from __future__ import annotations

import os

from xirang.cli import main
from xirang.cli.calibrate import cached_calibration, calibration_cache_path
from xirang.ir.calibration import COLLECTIVE_KINDS, OTHER_KINDS
from xirang.ir.world import World


def test_calibrate_quick_on_two_ranks_writes_a_world_the_planner_reads(tmp_path, capsys):
    out = tmp_path / "world.json"
    assert main(["calibrate", "--world", "2", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "all_reduce" in printed and f"world written to {out}" in printed
    world = World.load(out)
    assert world.size == 2 and world.calibration.ranks == 2 and world.calibration.backend == "gloo"
    kept = calibration_cache_path(2, "cpu", quick=True)
    assert str(kept).startswith(os.environ["XDG_CACHE_HOME"]) and f"on this host: {kept}" in printed
    assert World.load(kept) == world and cached_calibration(2, "cpu") == (kept, True)
    device = world.nodes[0].device
    assert device.op_overhead_s > 0 and device.peak("fp32") > 0 and device.memory_bandwidth > 0
    assert not world.calibration.comm_overlaps_compute  # gloo on CPU cores
    for kind in COLLECTIVE_KINDS:
        fit = world.calibration.fit(kind, 2)
        assert fit is not None and len(fit.samples) >= 2 and fit.seconds(1024) > 0, kind
    assert world.calibration.raw["matmul_float32"]["samples"]
    # the op classes priced apart: measured rates as fractions of the matmul's, fixed costs per call
    assert 0 < device.efficiency.other <= 1 and 0 < device.efficiency.attention <= 1
    assert world.calibration.raw["other_flops"]["samples"] and world.calibration.raw["attention"]["samples"]
    assert set(world.calibration.op_fixed_s) == {"matmul", "other", "attention", *OTHER_KINDS}
    # each non-matmul kind its own rate, its fit kept beside the add's (residual reported)
    assert set(world.calibration.other_kind_efficiency) == set(OTHER_KINDS)
    assert all(0 < fraction <= 1 for fraction in world.calibration.other_kind_efficiency.values())
    assert world.calibration.raw["other_gelu"]["samples"] and "residual" in world.calibration.raw["elementwise"]
    assert "kinds   gelu" in printed and "fit residual" in printed
    # CPU ranks share cores: both workloads were timed alone and together (codegen/runtime/calibration/sharing.py)
    sharing = world.calibration.raw["sharing"]
    for timed in (sharing, sharing["training"]):
        assert timed["alone_s"] > 0 and timed["together_s"] > 0
    assert 0 < world.calibration.parallel_ranks <= 2
