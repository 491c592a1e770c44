"""No checkpoint is written with a non-finite weight or optimizer state: the save is refused before any file.

A checkpoint is what ``--resume`` and a rollback continue from; one holding a NaN or inf continues a run
that is already lost, and the files give no sign of it. So ``save_checkpoint`` checks every tensor it is
about to write (this rank's pieces of the parameters and of the optimizer's state) and the ranks agree in
one all-reduce of a flag (the save is collective anyway), so every rank refuses together, before the step
folder is touched, naming the first rank and tensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from xirang.ir.errors import XirangError


def first_nonfinite(state: dict):
    """The first key of ``state`` (a checkpoint's entries: TensorPieces, tensors or plain values) holding a
    non-finite float, or None."""
    for key, value in state.items():
        tensor = getattr(value, "local", value)
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            return key
    return None


def refuse_nonfinite(state: dict, *, step: int, folder, rank: int, distributed: bool, device="cpu") -> None:
    """Raise on every rank if any rank's ``state`` holds a non-finite value (collective when ``distributed``)."""
    mine = first_nonfinite(state)
    where_found = [(rank, mine)] if mine is not None else []
    if distributed:
        flag = torch.tensor([0.0 if mine is None else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (rank, mine))
        where_found = [(r, key) for r, key in everyone if key is not None]
    if not where_found:
        return
    first_rank, key = where_found[0]
    more = f" (and on {len(where_found) - 1} more ranks)" if len(where_found) > 1 else ""
    raise XirangError(f"checkpoint step {step} not written: {key!r} holds non-finite values (NaN or inf) on rank "
                      f"{first_rank}{more}",
                      where=f"save_checkpoint, {folder}, rank {first_rank}",
                      hint="the run diverged before this save: resume from the newest checkpoint in the folder "
                           "with a lower learning rate or clipping; xirang train stops on a non-finite step "
                           "before it can reach a save (--on-nonfinite)")
