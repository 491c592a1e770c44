"""Warnings a run prints once: on rank 0 only, and each text once per process.

Every rank of a run analyses the same model (``xirang.plan`` and ``xirang.compile`` each do), so a
warning about the model ("count_flops: no rule for aten.topk") would come out once per rank and
analysis: 16 copies for 8 ranks. A logger passed through ``once_per_run`` lets each text through
once, on rank 0 (of torch.distributed when it is initialised, else of the ``RANK`` a launcher set).
For warnings about the model, not for events that may recur (a skipped optimizer step)."""
from __future__ import annotations

import logging
import os


def on_rank_zero() -> bool:
    """Whether this process is rank 0 of its run (or no rank of any run)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


class OncePerRun(logging.Filter):
    """Passes a record on rank 0 the first time its text is seen in this process."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not on_rank_zero():
            return False
        text = record.getMessage()
        if text in self.seen:
            return False
        self.seen.add(text)
        return True


def once_per_run(logger: logging.Logger) -> logging.Logger:
    """``logger`` with a ``OncePerRun`` filter (attached once)."""
    if not any(isinstance(f, OncePerRun) for f in logger.filters):
        logger.addFilter(OncePerRun())
    return logger
