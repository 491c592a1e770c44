"""Warnings a run prints once: the analysis's "no rule for aten.topk" comes out of rank 0 only, once,
however many ranks and analyses (plan, then compile) the run has."""
from __future__ import annotations

import contextlib
import io
import logging

import torch

import xirang
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.run_log import on_rank_zero, once_per_run


class TopK(torch.nn.Module):
    """A model with an op the FLOP and byte counters have no rule for."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.topk(self.linear(x), 2).values.sum()


def analyse_twice(rank, world):
    """What this rank printed to stderr while analysing the model twice, as `xirang.plan` and then
    `xirang.compile` do (logging's last-resort handler writes to sys.stderr as it is then)."""
    with contextlib.redirect_stderr(io.StringIO()) as printed:
        for _ in range(2):
            xirang.analyze(TopK(), torch.zeros(4, 8))
    return printed.getvalue()


def test_two_ranks_analysing_twice_print_each_warning_once():
    printed = "".join(launch(analyse_twice, 2, timeout_s=120))
    assert printed.count("count_flops: no rule for aten.topk") == 1, printed
    assert printed.count("count_bytes: no rule for aten.topk") == 1, printed


def test_the_filter_passes_each_text_once_and_nothing_off_rank_zero(monkeypatch, caplog):
    logger = once_per_run(logging.getLogger("xirang.test_run_log"))
    assert once_per_run(logger) is logger and len(logger.filters) == 1  # attached once
    monkeypatch.delenv("RANK", raising=False)
    assert on_rank_zero()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for text in ("a", "b", "a"):
            logger.warning("warning %s", text)
        monkeypatch.setenv("RANK", "1")
        assert not on_rank_zero()
        logger.warning("warning c")
    assert [r.getMessage() for r in caplog.records] == ["warning a", "warning b"]
