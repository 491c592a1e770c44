"""``xirang train``: options refused before any rank starts, the schedule's shape, and (matrix) the crash
acceptance: a rank SIGKILLed in the middle of a run makes the whole run exit with an error naming it
within the collective timeout, and ``--resume`` then finishes the run with the parameters (and every
step's loss) of the uninterrupted run.

The matrix runs are real command lines (``python -m xirang train``) on 4 local CPU ranks, dp 2 x pp 2,
on a token file, clipping and a warm-up + cosine schedule, checkpoints every 2 of 8 steps. The kill
lands after rank 0 has logged step 5, i.e. while the ranks are inside step 6 (steps run back to back;
a kill during a save leaves that step incomplete, and resume skips it): the newest complete
checkpoint is then step 4, and the resumed run replays steps 5 to 8.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest
import torch

import xirang
from xirang.cli import main
from xirang.cli.train_loop import lr_factor
from xirang.ir.errors import XirangError

REPO = Path(__file__).resolve().parents[1]
MODEL = "examples/catalog.py:gpt_tiny"
COLLECTIVE_TIMEOUT_S = 60


def test_lr_factor_warms_up_then_follows_the_cosine():
    factors = [lr_factor(step, warmup=4, total=14, min_ratio=0.1) for step in range(15)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and math.isclose(factors[9], 0.55) and math.isclose(factors[14], 0.1)
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))


@pytest.mark.parametrize("argv, words", [
    ([MODEL, "--world", "1", "--steps", "2"], "--data FILE"),
    ([MODEL, "--world", "1", "--synthetic", "--data", "x.npy"], "--data FILE"),
    ([MODEL, "--world", "1", "--data", "missing.npy"], "does not exist"),
    ([MODEL, "--world", "1", "--synthetic", "--resume"], "need --checkpoint-dir"),
    ([MODEL, "--world", "1", "--synthetic", "--steps", "3", "--warmup", "3"], "not shorter than --steps"),
    (["tests/bad_input/models.py:mlp", "--world", "1", "--synthetic"], "must take input_ids and labels"),
])
def test_bad_options_are_refused_before_the_run(argv, words, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", *argv]) == 2
    assert words in capsys.readouterr().err


# --- the crash acceptance ---------------------------------------------------------------------------------

def _command(tokens: Path, checkpoints: Path, *extra) -> list:
    return [sys.executable, "-m", "xirang", "train", MODEL, "--world", "4", "--dp", "2", "--pp", "2",
            "--global-batch", "8", "--data", str(tokens), "--steps", "8", "--lr", "1e-3", "--warmup", "2",
            "--clip", "0.5", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2",
            "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), *extra]


def _run(command, *, kill_rank=None, after_step=None):
    """Run the command; with ``kill_rank``, SIGKILL that rank once rank 0 has logged ``after_step``.
    Returns (exit code, stdout, stderr, seconds from the kill to the exit)."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, pids, killed_at = [], {}, None
    for line in process.stdout:
        lines.append(line)
        if line.startswith("rank pids:"):
            pids = {int(r): int(p) for r, p in (entry.split(":") for entry in line.split()[2:])}
        if kill_rank is not None and killed_at is None and line.startswith(f"step {after_step}/"):
            os.kill(pids[kill_rank], signal.SIGKILL)
            killed_at = time.monotonic()
    stderr = process.stderr.read()
    code = process.wait(timeout=600)
    took = None if killed_at is None else time.monotonic() - killed_at
    return code, "".join(lines), stderr, took


def _final_parameters(folder: Path) -> dict:
    from examples.gpt import build_gpt
    torch.manual_seed(0)
    model = build_gpt("tiny")
    found = xirang.load_checkpoint(model, None, folder)
    return {"step": found["step"], "losses": found["extra"]["losses"],
            "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


@pytest.mark.matrix
def test_a_killed_rank_fails_the_run_and_resume_finishes_it_exactly(tmp_path):
    tokens = tmp_path / "tokens.npy"
    numpy.save(tokens, numpy.random.default_rng(0).integers(0, 512, 8 * 65 * 12).astype(numpy.int32))
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"

    code, out, err, _ = _run(_command(tokens, whole))
    assert code == 0, err[-3000:]

    code, out, err, took = _run(_command(tokens, crashed), kill_rank=3, after_step=5)
    print(f"killed rank 3 after step 5: exit {code} {took:.1f} s after the kill")
    assert code != 0 and took is not None, (code, took, err[-3000:])  # liveness: _run's wait(timeout=)
    assert "rank 3 of 4 failed" in err and "SIGKILL" in err, err[-3000:]
    assert "step 8/8" not in out

    code, out, err, _ = _run(_command(tokens, crashed, "--resume"))
    assert code == 0, err[-3000:]
    resumed = int(out.split("resume: step ")[1].split()[0])  # the newest complete checkpoint: 4 or 6
    print(f"resumed from step {resumed}")
    assert resumed in (4, 6) and f"step {resumed + 1}/8" in out and f"step {resumed}/8" not in out, out

    want, got = _final_parameters(whole / "step-00000008"), _final_parameters(crashed / "step-00000008")
    assert got["step"] == want["step"] == 8
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) <= 1e-6, (got["losses"], want["losses"])
    worst = max((got["params"][n] - p).abs().max().item() for n, p in want["params"].items())
    print(f"resumed vs uninterrupted: max |param difference| {worst:.1e}")
    assert worst <= 1e-6


def test_print_command_spells_the_torchrun_run(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", MODEL, "--world", "2", "--tp", "2", "--synthetic", "--steps", "2", "--clip", "1",
                 "--print-command"]) == 0
    words = capsys.readouterr().out.split()
    assert words[words.index("--nproc-per-node") + 1] == "2" and "-m xirang train" in " ".join(words)
    for flag, value in (("--tp", "2"), ("--steps", "2"), ("--clip", "1.0"), ("--world", "2")):
        assert words[words.index(flag) + 1] == value
    assert "--torchrun" in words and "--synthetic" in words and "--print-command" not in words


@pytest.mark.matrix
def test_the_printed_command_trains_under_torchrun_and_fails_on_a_killed_rank(tmp_path):
    def printed(*extra):
        return subprocess.run([sys.executable, "-m", "xirang", "train", MODEL, "--world", "2", "--pp", "2",
                               "--global-batch", "4", "--synthetic", "--checkpoint-dir", str(tmp_path / "ckpt"),
                               "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), *extra, "--print-command"],
                              cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    run = subprocess.run(printed("--steps", "2"), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 2/2" in run.stdout and (tmp_path / "ckpt" / "step-00000002" / "COMPLETE").is_file()
    # under torchrun the survivor says what stopped it: either its own collective lost the peer, or
    # torchrun's SIGTERM (sent to every survivor once a rank fails) came first; which one wins is a race
    code, out, err, took = _run(printed("--steps", "40"), kill_rank=1, after_step=3)
    print(f"torchrun: killed rank 1 after step 3: exit {code} {took:.1f} s after the kill")
    assert code != 0, (code, took, err[-3000:])
    said = ("rank 0 lost a peer in step" in err) or ("rank 0 was stopped by its launcher (SIGTERM) in step" in err)
    assert said and "--resume" in err, err[-3000:]
    assert "local_rank: 1" in err and "SIGKILL" in err, err[-3000:]


def test_sigterm_during_training_says_which_rank_and_step_and_how_to_resume():
    from xirang.cli.train_loop import StopOnSigterm
    before = signal.getsignal(signal.SIGTERM)
    stop = StopOnSigterm(3, lambda: 4)
    try:
        with pytest.raises(XirangError, match=r"rank 3 was stopped by its launcher \(SIGTERM\) in step 5") as caught:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode; the sleep is never finished
        assert "--resume" in str(caught.value)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before
