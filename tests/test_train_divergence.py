"""A divergent run stops, skips or rolls back as configured, and no checkpoint file ever holds a NaN or inf.

The issue's observation: on CPU ranks with a learning rate that diverges, the loss became NaN and training
went on to the end, its last checkpoint -- the one ``--resume`` continues from -- holding NaN weights. Here
``xirang train`` at ``--lr 1e5`` (NaN gradients from step 2) on two ranks: by default it stops naming step 2,
the rank, parameter and optimizer group, and its folder holds only step 1; with ``--on-nonfinite skip`` it
runs to the end with every step after the first skipped. Every checkpoint's files are read back whole
(``dcp_to_torch_save``: every tensor of every rank's file) and checked finite. From Python, two ranks with
a NaN put into rank 1's gradient only at step 5: both ranks roll back to step 4 together, the report names
rank 1, and training continues to the end with finite checkpoints.

Matrix tier: multi-rank launches (15-40 s each on two loaded cores).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import xirang
from tests.codegen.test_zero import batch
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.numerics.nonfinite import NonFiniteGuard

REPO = Path(__file__).resolve().parents[1]
MODEL = "examples/catalog.py:gpt_tiny"


def non_finite_tensors(folder: Path, tmp_path: Path) -> list:
    """Every tensor of a DCP step folder, read from its files, that holds a NaN or inf: (key, step folder)."""
    out = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    found = []

    def walk(key, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            found.append((key, folder.name))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{key}[{i}]", v)
    walk("", torch.load(out, weights_only=False))
    return found


def train(folder: Path, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xirang", "train", MODEL, "--world", "2", "--synthetic",
                           "--steps", "5", "--lr", "1e5", "--checkpoint-dir", str(folder), "--checkpoint-every", "1",
                           "--reprice-after", "0", "--collective-timeout", "60", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.matrix
def test_a_divergent_run_stops_naming_where_and_checkpoints_only_finite_weights(tmp_path):
    run = train(tmp_path / "ckpt")
    assert run.returncode != 0, run.stdout[-2000:]
    assert "step 2: the loss is" in run.stderr and "first non-finite gradient 'tok_emb.weight' on rank 0 (dp 0, " \
        "pp 0, tp 0), optimizer param group 0" in run.stderr, run.stderr[-3000:]
    assert "--on-nonfinite skip" in run.stderr and "step 2/5" not in run.stdout
    steps = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))
    assert steps == ["step-00000001"], steps
    assert non_finite_tensors(tmp_path / "ckpt" / steps[0], tmp_path) == []


@pytest.mark.matrix
def test_skip_runs_to_the_end_and_every_checkpoint_is_finite(tmp_path):
    run = train(tmp_path / "ckpt", "--on-nonfinite", "skip")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("(non-finite: step skipped)") == 4, run.stdout
    steps = sorted((tmp_path / "ckpt").glob("step-*"))
    assert len(steps) == 5
    assert [bad for folder in steps for bad in non_finite_tensors(folder, tmp_path)] == []


def _rollback_rank(rank, world, folder):
    torch.manual_seed(0)
    from examples.gpt import build_gpt
    compiled = xirang.compile(build_gpt("tiny", device="cpu"), world=2, example_kwargs=batch(0, 2), global_batch=8,
                              dp=2, tp=1, pp=1)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    guard = NonFiniteGuard("rollback", checkpoint_dir=folder)
    step, position, events = 0, 0, []
    while step < 8:
        loss = compiled.train_step(**batch(position))
        position += 1  # the data position: never rolled back
        if position == 5 and rank == 1:  # a NaN on one replica only, where replicas should agree
            next(iter(compiled.parameters())).grad.view(-1)[0] = float("nan")
        outcome = guard.step(compiled, optimizer, loss, step=step + 1)
        if outcome.rolled_back_to is not None:
            events.append((outcome.step, outcome.rolled_back_to, outcome.found, outcome.extra))
            step = outcome.rolled_back_to
            continue
        step += 1
        if step % 2 == 0:
            xirang.save_checkpoint(compiled, optimizer, folder, step=step, extra={"position": position})
    finite = all(torch.isfinite(p).all().item() for p in compiled.full_state_dict().values())
    return {"events": events, "position": position, "finite": finite}


@pytest.mark.matrix
def test_rollback_returns_every_rank_to_the_last_checkpoint_and_the_data_goes_on(tmp_path):
    results = launch(_rollback_rank, 2, (str(tmp_path / "ckpt"),), timeout_s=600, heartbeat_s=60)
    for result in results:
        assert [(s, back) for s, back, _, _ in result["events"]] == [(5, 4)], result["events"]
        found, extra = result["events"][0][2], result["events"][0][3]
        assert "on rank 1 (dp 1, pp 0, tp 0)" in found and extra == {"position": 4}, (found, extra)
        assert result["position"] == 9 and result["finite"]  # 8 steps took 9 batches: the bad one not replayed
    steps = sorted((tmp_path / "ckpt").glob("step-*"))
    assert [p.name for p in steps] == ["step-00000002", "step-00000004", "step-00000006", "step-00000008"]
    assert [bad for folder in steps for bad in non_finite_tensors(folder, tmp_path)] == []


@pytest.mark.matrix
def test_resume_continues_across_world_sizes_and_meshes_through_the_prechecks(tmp_path):
    """Saved on 2 ranks at dp = 2, resumed on 1 rank, then on 2 ranks at tp = 2: the prechecks pass a checkpoint
    of the same model whatever its mesh, and each run continues from the newest step."""
    def run(*extra):
        done = subprocess.run([sys.executable, "-m", "xirang", "train", MODEL, "--synthetic", "--lr", "1e-3",
                               "--global-batch", "4", "--checkpoint-dir", str(tmp_path / "ckpt"),
                               "--checkpoint-every", "1", "--reprice-after", "0", "--collective-timeout", "60", *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    run("--world", "2", "--dp", "2", "--steps", "2")
    assert "resume: step 2" in run("--world", "1", "--steps", "3", "--resume")
    out = run("--world", "2", "--tp", "2", "--steps", "4", "--resume")
    assert "resume: step 3" in out and "step 4/4" in out and "step 3/4" not in out, out
    assert [bad for folder in sorted((tmp_path / "ckpt").glob("step-*"))
            for bad in non_finite_tensors(folder, tmp_path)] == []
