"""A compiled model's checkpoint is collective: a one-rank program compiled with no process group is told
to run under a launcher, as a Xirang error (it was torch's bare ValueError about init_process_group)."""
from __future__ import annotations

import pytest
import torch

import xirang
from tests.bad_input import models
from tests.bad_input.probe import assert_clear_error
from xirang.ir.errors import XirangError


def test_checkpoint_of_a_one_rank_program_without_a_process_group_says_to_launch(tmp_path, monkeypatch):
    model, inputs = models.mlp()
    compiled = xirang.compile(model, world=1, hardware="cpu", example_kwargs=inputs, global_batch=8)
    optimizer = torch.optim.AdamW(compiled.parameters())
    # as in a script run with plain `python`: no process group, whatever other tests left in this process
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    for function, call in (("save_checkpoint", lambda: xirang.save_checkpoint(compiled, optimizer, tmp_path, step=1)),
                           ("load_checkpoint", lambda: xirang.load_checkpoint(compiled, optimizer, tmp_path))):
        with pytest.raises(XirangError) as info:
            call()
        assert_clear_error(info.value, "needs the process group", where=f"xirang.{function}",
                           hint="xirang launch --world 1")
    assert not any(tmp_path.iterdir())  # refused before anything was written
