"""``xirang tune`` on 2 local ranks (xirang_compile/cli/tune.py): two plans of the tiny GPT tried for two
steps each, the measured faster one saved with its trial table, which ``xirang explain`` prints. Default
tier: one 2-rank launch."""
from __future__ import annotations

from xirang.cli import main
from xirang.ir.plan import Plan


def test_tune_on_two_ranks_saves_the_measured_faster_plan_with_its_trials(tmp_path, capsys):
    out = tmp_path / "tuned.json"
    assert main(["tune", "examples/catalog.py:gpt_tiny", "--world", "2", "--global-batch", "4", "--seq", "16",
                 "--top-k", "2", "--steps", "2", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tuning 2 plans on 2 ranks, 1 + 2 steps each: estimated" in printed
    tuned = Plan.load(out)
    assert len(tuned.trials) == 2 and tuned.trials[0].planner_choice
    assert len({(t.mesh.pp, t.schedule, t.micro_batch, t.mesh.tp, t.recompute) for t in tuned.trials}) == 2
    fastest = min(tuned.trials, key=lambda t: t.measured_step_seconds)
    assert fastest.chosen and sum(t.chosen for t in tuned.trials) == 1
    assert (tuned.mesh, tuned.micro_batch, tuned.schedule) == (fastest.mesh, fastest.micro_batch, fastest.schedule)
    assert all(t.steps == 2 and t.measured_step_seconds > 0 and len(t.peak_memory_bytes) == 2 for t in tuned.trials)
    assert main(["explain", str(out)]) == 0
    assert "Tuned by trial runs (2 measured steps each" in capsys.readouterr().out


def test_train_tune_with_a_plan_is_refused_before_any_rank(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    assert main(["train", "examples/catalog.py:gpt_tiny", "--world", "2", "--synthetic", "--steps", "2", "--tune",
                 "--plan", str(plan)]) == 2
    error = capsys.readouterr().err
    assert "--tune runs trials on local ranks and chooses the plan itself" in error and "drop --plan" in error
