"""Probes of ``xirang train``'s surface: every wrong input refused before a rank starts, saying what, where and
what to do (xirang_compile/cli/train_prechecks.py), and the run's own errors said as what they are
(xirang_compile/cli/train_loop.py), so the launcher's summary gives advice that fits.

Classes: data (type, values against the vocabulary, length), disk (the checkpoint folder: a file, not
writable, too small), checkpoints and resume (another model's checkpoint named by its first tensor, a damaged
one), options (the non-finite policy by flag and config key), signals and peers (a lost peer, an error of
the step itself, SIGTERM). All in one process: the check functions are called as ``cmd_train`` calls them,
and the CLI's refusals happen in the parent before planning or launching. The numerics probes are
tests/codegen/test_nonfinite.py; the optimizer probes tests/codegen/test_zero_named_groups.py.
"""
from __future__ import annotations

import errno
import signal
from pathlib import Path

import numpy
import pytest
import torch

import xirang
from examples.gpt import GPTConfig, build_gpt
from xirang.cli import main
from xirang.cli import train_prechecks
from xirang.cli.train_loop import StopOnSigterm, vocabulary
from xirang.cli.train_prechecks import (CHECKPOINT_BYTES_PER_PARAMETER, check_checkpoint_folder, check_data,
                                        check_policy, check_resume)
from xirang.ir.errors import XirangError

REPO = Path(__file__).resolve().parents[1]
MODEL = "examples/catalog.py:gpt_tiny"
VOCAB, SEQ, BATCH = 512, 64, 8  # gpt_tiny's vocabulary and example; the in-repo GPT shifts its labels
ONE_BATCH = BATCH * (SEQ + 1)


def data(tmp_path, values, name="tokens.npy") -> str:
    path = tmp_path / name
    if name.endswith(".npy"):
        numpy.save(path, numpy.asarray(values))
    else:
        torch.save(values, path)
    return str(path)


def refused(call, *words) -> XirangError:
    with pytest.raises(XirangError) as caught:
        call()
    error = caught.value
    text = f"{error.what} | {error.where} | {error.hint}"
    assert error.what and error.where and error.hint, text
    for word in words:
        assert word in text, (word, text)
    return error


def check(path, steps=1, **overrides):
    options = dict(vocab=VOCAB, seq=SEQ, shift=True, global_batch=BATCH, steps=steps)
    options.update(overrides)
    return check_data(path, **options)


# --- data -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values, words", [
    (numpy.zeros(ONE_BATCH, dtype=numpy.float32), ("dtype float32", "not a flat array of token ids", "1-D integer")),
    (numpy.zeros((BATCH, SEQ + 1), dtype=numpy.int32), ("shape (8, 65)", "flatten")),
    (numpy.zeros(ONE_BATCH, dtype=bool), ("dtype bool",)),
    (numpy.zeros(ONE_BATCH, dtype=numpy.complex64), ("complex64",)),
])
def test_data_of_the_wrong_type_is_refused(tmp_path, values, words):
    refused(lambda: check(data(tmp_path, values)), *words)


@pytest.mark.parametrize("position, value", [(0, VOCAB), (ONE_BATCH - 1, VOCAB + 7), (100, -1), (37, 2 ** 20)])
def test_a_token_outside_the_vocabulary_is_named_with_its_position(tmp_path, position, value):
    values = numpy.arange(ONE_BATCH, dtype=numpy.int64) % VOCAB
    values[position] = value
    error = refused(lambda: check(data(tmp_path, values)), f"token id {value} at position {position}",
                    f"[0, {VOCAB})", f"token {position}", "tokenizer")
    assert "--data" in error.where


def test_the_first_bad_token_is_named_when_there_are_many(tmp_path):
    values = numpy.full(ONE_BATCH, VOCAB + 1, dtype=numpy.int32)
    values[:10] = 3
    refused(lambda: check(data(tmp_path, values)), "at position 10", f"ids seen: 3 to {VOCAB + 1}")


@pytest.mark.parametrize("count", [0, 1, ONE_BATCH - 1])
def test_too_few_tokens_for_one_global_batch_are_refused(tmp_path, count):
    words = ("holds no tokens",) if count == 0 else (f"holds {count} tokens", "fewer than one global batch of 8",
                                                      f"at least {ONE_BATCH} tokens", "--global-batch")
    refused(lambda: check(data(tmp_path, numpy.zeros(count, dtype=numpy.int32))), *words)


def test_rows_are_counted_without_the_extra_label_token_for_models_that_shift_themselves(tmp_path):
    path = data(tmp_path, numpy.zeros(BATCH * SEQ, dtype=numpy.int32))
    assert check(path, shift=False) == []
    refused(lambda: check(path, shift=True), "rows of 65 tokens", "+ 1 for the shifted labels")


def test_exactly_one_global_batch_is_enough_for_one_step(tmp_path):
    assert check(data(tmp_path, numpy.zeros(ONE_BATCH, dtype=numpy.uint16))) == []


def test_steps_past_the_data_say_how_often_it_is_read(tmp_path):
    notes = check(data(tmp_path, numpy.zeros(3 * ONE_BATCH, dtype=numpy.int32)), steps=10)
    assert notes == [f"data: {tmp_path / 'tokens.npy'} holds 3 global batches; 10 steps read it 4 times "
                     f"(reshuffled each epoch)"]


def test_a_torch_saved_integer_tensor_is_read_and_checked(tmp_path):
    good = data(tmp_path, torch.arange(ONE_BATCH) % VOCAB, "tokens.pt")
    assert check(good) == []
    bad = torch.arange(ONE_BATCH) % VOCAB
    bad[5] = VOCAB
    refused(lambda: check(data(tmp_path, bad, "bad.pt")), "token id 512 at position 5")


@pytest.mark.parametrize("value, words", [(torch.zeros(ONE_BATCH), ("torch.float32",)),
                                          ({"ids": torch.zeros(3, dtype=torch.long)}, ("dict",))])
def test_a_torch_file_that_is_not_token_ids_is_refused(tmp_path, value, words):
    refused(lambda: check(data(tmp_path, value, "tokens.pt")), *words)


@pytest.mark.parametrize("name, content", [("tokens.npy", b"not numpy at all"), ("tokens.pt", b"\x00garbage")])
def test_a_damaged_file_is_refused_without_a_raw_error(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    refused(lambda: check(str(tmp_path / name)), name, "numpy.save")


def test_a_folder_given_as_data_is_named_as_a_folder(tmp_path):
    refused(lambda: check(str(tmp_path)), "is a folder, not a file", "inside it")


def test_the_vocabulary_is_the_input_embeddings_rows():
    assert vocabulary(build_gpt(GPTConfig(vocab_size=100, seq_len=8, hidden=16, heads=2, layers=1))) == 100


def test_the_cli_refuses_out_of_vocabulary_data_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    values = numpy.arange(4 * ONE_BATCH, dtype=numpy.int32) % VOCAB
    values[999] = 70000
    path = data(tmp_path, values)
    monkeypatch.chdir(REPO)
    assert main(["train", MODEL, "--world", "1", "--data", path, "--steps", "1", "--reprice-after", "0"]) == 2
    captured = capsys.readouterr()
    assert "token id 70000 at position 999" in captured.err and "rank pids" not in captured.out, captured


# --- disk: the checkpoint folder ---------------------------------------------------------------------------------

def test_a_checkpoint_folder_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "ckpt").write_text("x")
    refused(lambda: check_checkpoint_folder(tmp_path / "ckpt", 1), "is a file, not a folder", "--checkpoint-dir")


def test_a_checkpoint_folder_under_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    refused(lambda: check_checkpoint_folder(tmp_path / "f" / "ckpt", 1), "cannot be written", "permissions")


def test_an_unwritable_checkpoint_folder_is_refused(tmp_path, monkeypatch):
    def read_only(self, data):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(Path, "write_bytes", read_only)
    refused(lambda: check_checkpoint_folder(tmp_path / "ckpt", 1), "cannot be written: Read-only file system")


def test_too_little_free_space_for_one_checkpoint_is_refused_with_both_sizes(tmp_path, monkeypatch):
    monkeypatch.setattr(train_prechecks.shutil, "disk_usage", lambda path: type("U", (), {"free": 5 << 20})())
    refused(lambda: check_checkpoint_folder(tmp_path / "ckpt", 3 << 30), "5.0 MiB free",
            "one checkpoint of this model (3.0 GiB", "larger disk")


def test_a_good_checkpoint_folder_is_made_and_left_clean(tmp_path):
    check_checkpoint_folder(tmp_path / "a" / "b", CHECKPOINT_BYTES_PER_PARAMETER)
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


def test_the_cli_refuses_a_checkpoint_folder_that_is_a_file_before_planning(tmp_path, capsys, monkeypatch):
    (tmp_path / "ckpt").write_text("x")
    monkeypatch.chdir(REPO)
    assert main(["train", MODEL, "--world", "1", "--synthetic", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 2
    assert "ckpt" in capsys.readouterr().err


# --- checkpoints and resume ------------------------------------------------------------------------------------

def saved(tmp_path, config: GPTConfig, step: int = 2) -> Path:
    torch.manual_seed(0)
    model = build_gpt(config)
    xirang.save_checkpoint(model, torch.optim.AdamW(model.parameters()), tmp_path / "ckpt", step=step)
    return tmp_path / "ckpt"


TINY = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=64, heads=4, layers=2)


def test_resume_of_the_same_model_passes(tmp_path):
    assert check_resume(saved(tmp_path, TINY), build_gpt(TINY)) == []


def test_resume_with_no_checkpoint_yet_says_it_starts_at_step_0(tmp_path):
    assert check_resume(tmp_path, build_gpt(TINY)) == [f"resume: no complete checkpoint in {tmp_path} yet; the run "
                                                       f"starts at step 0"]


@pytest.mark.parametrize("other, words", [
    (GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=2), ("'tok_emb.weight' has shape (512, 32)",
                                                                               "(512, 64) in the model")),
    (GPTConfig(vocab_size=1024, seq_len=SEQ, hidden=64, heads=4, layers=2), ("(1024, 64)",)),
    (GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=64, heads=4, layers=1), ("is not in it", "layers.1")),
    (GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=64, heads=4, layers=3), ("which the model does not have",
                                                                               "layers.2")),
])
def test_a_checkpoint_of_another_model_is_refused_naming_the_first_tensor(tmp_path, other, words):
    folder = saved(tmp_path, other)
    refused(lambda: check_resume(folder, build_gpt(TINY)), "is for another model", "step-00000002",
            "new folder", *words)


def test_a_damaged_checkpoint_is_passed_over_and_said(tmp_path):
    folder = saved(tmp_path, TINY)
    (folder / "step-00000002" / ".metadata").write_bytes(b"damaged")
    assert check_resume(folder, build_gpt(TINY)) == [f"resume: no complete checkpoint in {folder} yet; the run "
                                                     f"starts at step 0"]


def test_an_incomplete_newest_step_is_passed_over_for_the_complete_one(tmp_path):
    folder = saved(tmp_path, TINY, step=2)
    torch.manual_seed(0)
    other = build_gpt(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=2))
    xirang.save_checkpoint(other, None, folder, step=4)
    from xirang.codegen.runtime.checkpoint.store import MARKER
    (folder / "step-00000004" / MARKER).unlink()  # killed before its marker: not a checkpoint
    assert check_resume(folder, build_gpt(TINY)) == []


POSITION = {"seed": 0, "rows": 100, "row_tokens": SEQ + 1, "global_batch": BATCH, "shuffle": True}


@pytest.mark.parametrize("change, words", [({}, ()), ({"global_batch": 16}, ("global_batch 8 there, 16 now",)),
                                           ({"seed": 3}, ("seed 0 there, 3 now",)),
                                           ({"rows": 7, "row_tokens": SEQ}, ("row_tokens 65 there, 64 now",
                                                                            "rows 100 there, 7 now"))])
def test_a_checkpoint_saved_reading_other_data_is_refused_naming_what_differs(tmp_path, change, words):
    torch.manual_seed(0)
    model = build_gpt(TINY)
    xirang.save_checkpoint(model, None, tmp_path / "ckpt", step=3, extra={"data": dict(POSITION, step=3)})
    now = dict(POSITION, **change)
    if not words:
        assert check_resume(tmp_path / "ckpt", model, data=now) == []
        return
    refused(lambda: check_resume(tmp_path / "ckpt", model, data=now), "was saved reading other data",
            "extra['data']", "--global-batch and --seed", *words)


def test_the_cli_refuses_resuming_another_models_checkpoint_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    folder = saved(tmp_path, GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=2))
    monkeypatch.chdir(REPO)
    assert main(["train", MODEL, "--world", "1", "--synthetic", "--checkpoint-dir", str(folder), "--resume",
                 "--reprice-after", "0"]) == 2
    captured = capsys.readouterr()
    assert "is for another model" in captured.err and "rank pids" not in captured.out


# --- the World file, the plan and the model file: read before planning -------------------------------------------

def test_a_missing_world_file_is_refused_before_planning(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", MODEL, "--world", "2", "--synthetic", "--world-file", str(tmp_path / "w.json")]) == 2
    err = capsys.readouterr().err
    assert "w.json" in err and "xirang calibrate" in err, err


def test_a_world_file_of_another_size_is_refused_naming_both(tmp_path, capsys, monkeypatch):
    from xirang.ir.world import parse_world
    parse_world(4, "cpu").save(tmp_path / "w.json")
    monkeypatch.chdir(REPO)
    assert main(["train", MODEL, "--world", "2", "--synthetic", "--world-file", str(tmp_path / "w.json")]) == 2
    assert "describes 4 ranks, not --world 2" in capsys.readouterr().err


def test_a_missing_plan_file_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", MODEL, "--world", "1", "--synthetic", "--plan", str(tmp_path / "plan.json")]) == 2
    captured = capsys.readouterr()
    assert "plan.json" in captured.err and "rank pids" not in captured.out, captured


def test_a_missing_model_file_is_refused_naming_it(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", "no_such_model.py:build", "--world", "1", "--synthetic"]) == 2
    assert "no_such_model.py" in capsys.readouterr().err


# --- options: the non-finite policy ------------------------------------------------------------------------------

def test_rollback_without_a_checkpoint_folder_is_refused():
    from argparse import Namespace
    refused(lambda: check_policy(Namespace(on_nonfinite="rollback", checkpoint_dir=None)), "--on-nonfinite",
            "--checkpoint-every", "skip")


def test_an_unknown_policy_flag_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["train", MODEL, "--world", "1", "--synthetic", "--on-nonfinite", "retry"])
    assert "retry" in capsys.readouterr().err


def test_an_unknown_policy_in_the_config_file_is_refused_naming_the_key(tmp_path, capsys, monkeypatch):
    (tmp_path / "run.toml").write_text('on_nonfinite = "retry"\n')
    monkeypatch.chdir(REPO)
    assert main(["train", MODEL, "--world", "1", "--synthetic", "--config", str(tmp_path / "run.toml")]) == 2
    err = capsys.readouterr().err
    assert "on_nonfinite = 'retry' is not one of" in err and "rollback" in err, err


def test_the_policy_from_the_config_file_is_the_runs_and_the_flag_wins(tmp_path):
    from xirang.cli.train import parse_train_args, run_options
    (tmp_path / "run.toml").write_text(f'model = "{MODEL}"\nworld = 1\non_nonfinite = "skip"\n')
    assert parse_train_args(["--config", str(tmp_path / "run.toml")]).on_nonfinite == "skip"
    args = parse_train_args(["--config", str(tmp_path / "run.toml"), "--on-nonfinite", "rollback"])
    assert args.on_nonfinite == "rollback" and run_options(args)["on_nonfinite"] == "rollback"
    assert parse_train_args([MODEL, "--world", "1"]).on_nonfinite == "stop"


# --- signals and peers: the error says what kind it is ----------------------------------------------------------

def test_a_lost_peer_points_at_the_rank_that_failed_first_then_resume():
    from xirang.cli.train_loop import step_error
    error = step_error(RuntimeError("[gloo] Connection closed by peer"), rank=2, step=4)
    assert error.what.startswith("rank 2 lost a peer in step 5") and "rank 2, step 5" in error.where
    assert "lists it first" in error.hint and "then rerun the same command with --resume" in error.hint


@pytest.mark.parametrize("error", [IndexError("index out of range in self"), ValueError("bad shape"),
                                   RuntimeError("mat1 and mat2 shapes cannot be multiplied")])
def test_an_error_of_the_step_itself_is_not_sent_to_resume(error):
    from xirang.cli.train_loop import step_error
    said = step_error(error, rank=1, step=0)
    assert said.what.startswith(f"step 1 failed on rank 1: {type(error).__name__}")
    assert "--resume would fail the same way" in said.hint and "not a crash" in said.hint


def test_sigterm_names_the_rank_and_step_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopOnSigterm(3, lambda: 6)
    with pytest.raises(XirangError) as caught:
        signal.raise_signal(signal.SIGTERM)
    stop.restore()
    assert "rank 3 was stopped by its launcher (SIGTERM) in step 7" in caught.value.what
    assert "fix what that rank's error says" in caught.value.hint and "not a wrong input" in caught.value.hint
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_loss_spike_is_written_into_the_metrics_line(tmp_path):
    from xirang.cli.train_metrics import MetricsWriter, RunFacts, read_metrics
    facts = RunFacts(model_flops=1.0, peak_flops_per_s=1.0, peak="cpu", predicted_step_s=0.1, predicted_by="preset",
                     tokens_per_step=8)
    writer = MetricsWriter(tmp_path / "m.jsonl", facts, device=torch.device("cpu"))
    writer.record(step=1, loss=2.0, lr=1e-3, step_s=0.1, grad_norm=1.0, stepped=True, memory=[0])
    writer.record(step=2, loss=9.0, lr=1e-3, step_s=0.1, grad_norm=1.0, stepped=True, memory=[0],
                  note="loss spike at step 2: 9")
    writer.close()
    assert [line["note"] for line in read_metrics(tmp_path / "m.jsonl")] == [None, "loss spike at step 2: 9"]


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, ("No space left on device", "free space there")),
                                         (errno.EACCES, ("Permission denied", "writable from every rank"))])
def test_a_checkpoint_write_that_fails_is_said_and_the_previous_step_still_counts(tmp_path, monkeypatch, code, words):
    from torch.distributed.checkpoint import FileSystemWriter
    folder = saved(tmp_path, TINY, step=2)

    def failing(self, plan, planner):
        raise OSError(code, {errno.ENOSPC: "No space left on device", errno.EACCES: "Permission denied"}[code])
    monkeypatch.setattr(FileSystemWriter, "write_data", failing)
    torch.manual_seed(0)
    error = refused(lambda: xirang.save_checkpoint(build_gpt(TINY), None, folder, step=4),
                    "checkpoint step 4 could not be written", "rank 0 failed with", "does not count",
                    "previous complete checkpoint", *words)
    assert "Traceback" not in error.what
    assert xirang.latest_checkpoint(folder, quiet=True).name == "step-00000002"


def test_a_background_checkpoint_write_that_fails_is_said_at_wait(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    torch.manual_seed(0)
    pending = xirang.save_checkpoint(build_gpt(TINY), None, tmp_path / "ckpt", step=1, async_save=True)
    refused(pending.wait, "checkpoint step 1 could not be written", "No space left on device", "does not count")
    assert xirang.latest_checkpoint(tmp_path / "ckpt", quiet=True) is None
