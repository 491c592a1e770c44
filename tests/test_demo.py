"""`xirang demo`, the README's main job, run as a user runs it: a subprocess of the real entry point.

It plans a 4-layer GPT for 8 local CPU ranks, prints the plan table and the 1F1B schedule, draws
the timeline, trains 3 steps on dp=2 x tp=2 x pp=2 gloo ranks and prints each step's loss beside
single-device training. The test reads what it printed and checks the numbers, not just the words.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_demo_plans_shows_and_trains_8_ranks_like_one_device(tmp_path):
    timeline = tmp_path / "timeline.png"
    result = subprocess.run([sys.executable, "-m", "xirang", "demo", "--timeline", str(timeline)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"^\* dp=2 pp=2 tp=2 ", out, re.M), out[:3000]  # the plan table, chosen row marked
    assert "Pipeline schedule (1f1b, 2 stages" in out and "Why this plan" in out
    assert timeline.read_bytes().startswith(PNG_SIGNATURE)
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d\.\d+e[-+]\d+)$", out, re.M)
    assert [int(step) for step, *_ in rows] == [0, 1, 2], out[-2000:]
    for _, single, distributed, difference in rows:
        # fp32 on 8 ranks: the sums run in another order, so equal to rounding (1e-5 as the tests)
        assert abs(float(single) - float(distributed)) <= 1e-5 and float(difference) <= 1e-5
    assert all(abs(float(single) - 6.24) < 0.1 for _, single, _, _ in rows)  # ~ln(512): random tokens, 3 steps
    assert "every rank reports the same loss: True" in out
