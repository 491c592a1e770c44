"""Watching ``xirang train``: a metrics line per step (xirang_compile/cli/train_metrics.py) read back from a real
2-rank run with every field checked (planned and compiled on a cached calibration), the run's options saved
beside its checkpoints and read back by ``--config``, the metrics drawn; TensorBoard scalars with the extra
and a refusal naming the pip command without it; and the predicted step priced on this machine's cached
calibration (xirang_compile/cli/calibrate.py) or labelled as the preset's figure. The cache is each test's own folder
(tests/conftest.py sets XDG_CACHE_HOME).

The matrix test is the 4-rank run whose picture the acceptance asks for (``XIRANG_METRICS_PICTURE`` names
where it goes; a temporary folder otherwise)."""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import xirang
from xirang.cli import main
from xirang.cli.calibrate import cached_calibration, calibration_cache_path
from xirang.cli.train import parse_train_args, run_options
from xirang.ir.calibration import Calibration
from xirang.ir.device import DEVICE_PRESETS
from xirang.ir.world import NodeSpec, World
from xirang.cli.train_metrics import MetricsWriter, RunFacts, draw_metrics, read_metrics

REPO = Path(__file__).resolve().parents[1]
MODEL = "examples/catalog.py:gpt_tiny"
FIELDS = {"step", "loss", "lr", "grad_norm", "stepped", "tokens_per_s", "step_s", "predicted_step_s",
          "step_over_predicted", "predicted_by", "model_flops", "mfu", "peak_flops_per_s", "peak", "memory_bytes",
          "memory", "time", "note"}
GPT_TINY_PARAMS = 136_960  # examples/gpt.py "tiny": hidden 64, 2 layers, vocabulary 512, 64 positions, tied head


def _check_lines(lines: list, *, steps: int, ranks: int, tokens: int, lr: float):
    """Every field of every line present and sane against figures worked out by hand."""
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    for line in lines:
        assert set(line) == FIELDS, set(line) ^ FIELDS
        assert 0 < line["loss"] < 10 and 0 < line["grad_norm"] < 100 and line["stepped"] is True
        assert line["step_s"] > 0  # a measurement: its size is a benchmark's business, not a test's
        assert line["tokens_per_s"] == pytest.approx(tokens / line["step_s"])
        assert line["step_over_predicted"] == pytest.approx(line["step_s"] / line["predicted_step_s"])
        # the analysis's count: 6 FLOPs per parameter and token (2 forward, 4 backward) plus attention's
        assert 6 * GPT_TINY_PARAMS * tokens < line["model_flops"] < 1.5 * 6 * GPT_TINY_PARAMS * tokens
        assert line["mfu"] == pytest.approx(line["model_flops"] / (line["step_s"] * line["peak_flops_per_s"]))
        assert 0 < line["mfu"] < 1
        assert len(line["memory_bytes"]) == ranks and all(50 * 2**20 < m < 16 * 2**30 for m in line["memory_bytes"])
        assert "ru_maxrss" in line["memory"]
    assert lines[0]["lr"] == pytest.approx(lr) and all(a["lr"] > b["lr"] for a, b in zip(lines, lines[1:]))
    assert all(a["time"] < b["time"] for a, b in zip(lines, lines[1:]))
    for a, b in zip(lines, lines[1:]):  # a process's peak resident set never falls
        assert all(x <= y for x, y in zip(a["memory_bytes"], b["memory_bytes"]))


def test_a_two_rank_run_writes_a_metrics_line_per_step_and_its_options_beside_the_checkpoints(tmp_path, capsys,
                                                                                                monkeypatch):
    monkeypatch.chdir(REPO)
    cached = calibration_cache_path(2, "cpu")  # what `xirang calibrate --world 2` keeps: the run plans on it
    cached.parent.mkdir(parents=True)
    _calibrated_world(2, 5e10).save(cached)
    run = tmp_path / "run.toml"
    run.write_text(f'model = "{MODEL}"\nworld = 2\npp = 2\nglobal_batch = 4\nsynthetic = true\nsteps = 2\n'
                   f'checkpoint_dir = "{tmp_path / "ckpt"}"\nlr = 0.5\n')
    argv = ["--config", str(run), "--lr", "1e-3"]
    assert main(["train", *argv]) == 0
    out = capsys.readouterr().out
    label = f"priced on this machine: cached calibration {cached}"
    assert f"({label})" in out, out

    lines = read_metrics(tmp_path / "ckpt" / "metrics.jsonl")
    _check_lines(lines, steps=2, ranks=2, tokens=4 * 64, lr=1e-3)
    for line in lines:
        assert line["predicted_by"] == label
        assert f"predicted step {line['predicted_step_s'] * 1e3:.3g} ms ({label})" in out
        assert line["peak_flops_per_s"] == 2 * 5e10  # the calibrated World's matmul rate, x 2 ranks
        assert line["peak"] == "cpu 0.05 TFLOP/s per rank at fp32 x 2 ranks: the calibration's measured matmul rate"
    print(json.dumps(lines[-1]))

    saved = tmp_path / "ckpt" / "config.toml"
    assert f"options: {saved}" in out
    assert run_options(parse_train_args(["--config", str(saved)])) == run_options(parse_train_args(argv))

    picture = draw_metrics(lines, tmp_path / "metrics.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_launch(seen: list):
    def launch(fn, nprocs, args=(), **options):
        seen.append(args)
        return [{"losses": [6.0], "start": 0}] * nprocs
    return launch


def _calibrated_world(ranks: int, fp32: float) -> World:
    device = replace(DEVICE_PRESETS["cpu"], peak_flops={"fp32": fp32, "bf16": fp32, "fp16": fp32})
    return World((NodeSpec(ranks, device),), calibration=Calibration(ranks, "gloo", "cpu"))


def test_the_predicted_step_is_priced_on_the_cached_calibration_or_labelled_as_the_presets(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    seen = []
    monkeypatch.setattr(xirang, "launch", _fake_launch(seen))  # the planning and the printing, not the ranks
    argv = ["train", MODEL, "--world", "2", "--pp", "2", "--global-batch", "4", "--synthetic", "--steps", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    preset = seen[-1][1]
    assert preset.world.calibration is None
    assert (f"predicted step {preset.predicted.step_seconds * 1e3:.3g} ms (preset cpu, uncalibrated: run "
            f"`xirang calibrate --world 2` to price this machine)") in out, out

    quick = calibration_cache_path(2, "cpu", quick=True)  # what `xirang calibrate --world 2 --quick` keeps
    quick.parent.mkdir(parents=True)
    _calibrated_world(2, 5e9).save(quick)  # a hundredth of the preset's FLOP rate
    assert main(argv) == 0
    out = capsys.readouterr().out
    priced = seen[-1][1]
    assert priced.world == World.load(quick)  # planned on this machine's figures
    assert priced.predicted.step_seconds > 2 * preset.predicted.step_seconds
    assert (f"predicted step {priced.predicted.step_seconds * 1e3:.3g} ms (priced on this machine: cached "
            f"calibration {quick} (--quick: rough))") in out, out


def test_a_full_calibration_is_preferred_to_a_quick_one_and_each_is_kept_per_rank_count():
    assert cached_calibration(2, "cpu") == (None, False)
    full, quick = calibration_cache_path(2, "cpu"), calibration_cache_path(2, "cpu", quick=True)
    assert full != quick and full.parent == quick.parent
    assert calibration_cache_path(4, "cpu") != full and calibration_cache_path(2, "cuda") != full
    assert str(full).startswith(os.environ["XDG_CACHE_HOME"])  # never the user's real cache in a test
    full.parent.mkdir(parents=True)
    _calibrated_world(2, 5e9).save(quick)
    assert cached_calibration(2, "cpu") == (quick, True)
    _calibrated_world(2, 5e9).save(full)
    assert cached_calibration(2, "cpu") == (full, False) and cached_calibration(4, "cpu") == (None, False)


def test_tensorboard_without_the_package_is_refused_before_training_with_the_pip_command(tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now raises ImportError
    monkeypatch.setattr(xirang, "launch", lambda *a, **k: pytest.fail("launched"))
    assert main(["train", MODEL, "--world", "1", "--synthetic", "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert "--tensorboard" in err and 'pip install "xirang[tensorboard]"' in err, err


FACTS = RunFacts(model_flops=1e9, peak_flops_per_s=1e12, peak="test peak", predicted_step_s=0.01,
                 predicted_by="test", tokens_per_step=256)


def _record(writer, step):
    return writer.record(step=step, loss=6.0 - step / 10, lr=1e-3, step_s=0.02, grad_norm=1.5, stepped=True,
                         memory=[100 * 2**20, 120 * 2**20])


def test_tensorboard_scalars_are_written_with_the_extra(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    writer = MetricsWriter(None, FACTS, device="cpu", tensorboard=tmp_path / "tb")
    for step in (1, 2, 3):
        _record(writer, step)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/mfu", "train/step_s", "train/grad_norm", "memory_mib/rank1"} <= tags, tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert events.Scalars("train/mfu")[0].value == pytest.approx(1e9 / (0.02 * 1e12))
    assert events.Scalars("memory_mib/rank1")[0].value == pytest.approx(120)


def test_a_resumed_run_keeps_the_lines_up_to_its_checkpoint_and_writes_null_for_a_non_finite_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path, FACTS, device="cpu")
    for step in (1, 2, 3, 4):
        _record(writer, step)
    writer.close()
    writer = MetricsWriter(path, FACTS, device="cpu", resume_at=2)  # steps 3 and 4 are run again
    _record(writer, 3)
    line = writer.record(step=4, loss=math.nan, lr=1e-3, step_s=0.02, grad_norm=math.inf, stepped=False,
                         memory=[1, 2])
    writer.close()
    lines = read_metrics(path)  # strict JSON: json.loads of each line
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and lines[-1] == line
    assert lines[-1]["loss"] is None and lines[-1]["grad_norm"] is None and lines[-1]["stepped"] is False
    assert all(json.loads(text) for text in path.read_text().splitlines())


@pytest.mark.matrix
def test_a_four_rank_run_reads_back_and_draws_its_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    metrics = tmp_path / "metrics.jsonl"
    assert main(["train", MODEL, "--world", "4", "--dp", "2", "--pp", "2", "--global-batch", "8", "--synthetic",
                 "--steps", "3", "--lr", "1e-3", "--clip", "1.0", "--metrics", str(metrics)]) == 0
    lines = read_metrics(metrics)
    _check_lines(lines, steps=3, ranks=4, tokens=8 * 64, lr=1e-3)
    assert lines[0]["predicted_by"] == ("preset cpu, uncalibrated: run `xirang calibrate --world 4` to price this "
                                        "machine")
    assert lines[0]["peak"] == "cpu 0.5 TFLOP/s per rank at fp32 x 4 ranks: the preset's datasheet peak"
    picture = os.environ.get("XIRANG_METRICS_PICTURE") or str(tmp_path / "metrics_4rank.png")
    draw_metrics(lines, picture, title=f"xirang train {MODEL}: dp 2 x pp 2 on 4 CPU ranks, global batch 8")
    print(f"metrics picture: {picture}")
    assert Path(picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
