"""A checkpoint that cannot be written (a full disk, a folder gone, permissions) said as such, on every rank.

DCP reports a failed write as ``CheckpointException``, a ``BaseException`` (so ``except Exception`` in a
training loop does not see it) whose text is every failing rank's traceback. What the user needs is the
first failure's own words, the folder and the step, and the fact that matters for what to do next: the
step has no completion marker (codegen/runtime/checkpoint/store.py), so it does not count and ``--resume``
continues from the previous complete one.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch.distributed.checkpoint.api import CheckpointException

from xirang.ir.errors import XirangError


@contextmanager
def said_as_checkpoint_errors(folder, step: int, rank: int):
    """Inside: a failed DCP write (or an OSError on the way) becomes a XirangError naming the folder, step and
    the first failing rank's error."""
    try:
        yield
    except CheckpointException as error:
        failing, (cause, _) = sorted(error.failures.items())[0]
        raise _refusal(folder, step, failing, cause) from None
    except OSError as error:
        raise _refusal(folder, step, rank, error) from None


def _refusal(folder, step: int, rank: int, cause: BaseException) -> XirangError:
    words = f"{type(cause).__name__}: {cause}".splitlines()[0][:300]
    full = getattr(cause, "errno", None) == 28  # ENOSPC
    return XirangError(f"checkpoint step {step} could not be written to {folder}: rank {rank} failed with {words}",
                       where=f"save_checkpoint, {folder}, rank {rank}",
                       hint=("free space there or point the checkpoints at a larger disk" if full else
                             "check that the folder exists and is writable from every rank") +
                            "; the step has no completion marker, so it does not count: resuming continues from "
                            "the previous complete checkpoint")
