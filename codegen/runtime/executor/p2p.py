"""Non-blocking point-to-point transfers of a pipeline cut's tensors, into reusable receive buffers.

A cut carries several tensors (a hidden state, and in HF models the attention mask and rotary
tables that later layers read too). ``post_send``/``post_recv`` post one ``isend``/``irecv`` per
tensor and return a ``Transfer`` to ``wait()`` on where the data is needed, so a receive posted
ahead (where the schedule lists its ``Recv``) overlaps the compute before its consumer.

Matching: every message carries a tag made of (kind, receiving stage, micro-batch, tensor index).
gloo matches by tag, so a transfer can never land in another micro-batch's buffer; NCCL ignores
tags and matches per pair of ranks in posting order, which ``schedule_check`` proves the schedule
keeps. NCCL also runs a communicator's sends and receives between two ranks in order, each blocking
until its peer's call runs, so the executor sends messages to a lower pipeline rank on a group of their
own (``MeshGroups.pp_down``) and those to a higher one on the default group: one direction per channel
(interleaved schedules at pp = 2 send activations both ways between the same two ranks), so a receive
posted ahead never waits behind the other direction's send (``xirang check`` proves it,
codegen/check/proofs.py). Sizes are known statically (passes/lowering/split_stages.py), so nothing but the
payload is sent.

``ReceiveBuffers`` keeps, per (kind, stage), the buffer sets of finished receives for reuse: with
the schedules' rule that a receive is posted one compute ahead, two sets per kind are live at most
(double buffering); a set is allocated only when none is free, and ``allocated`` says how many.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from xirang.ir.schedules import ACTIVATION, KINDS

# gloo sends no bool tensors; a bool is one byte, so it travels as its uint8 view.
_WIRE_DTYPES = {torch.bool: torch.uint8}


def message_tag(kind: str, receiving_stage: int, micro_batch: int, tensor_index: int, *,
                num_stages: int, tensors_per_cut: int) -> int:
    """A tag unique to one tensor of one transfer in a step, equal on the sender and receiver."""
    transfer = (micro_batch * num_stages + receiving_stage) * len(KINDS) + KINDS.index(kind)
    return transfer * tensors_per_cut + tensor_index


@dataclass
class Transfer:
    """Posted sends or receives of one cut; ``wait()`` returns the tensors once they are complete."""

    tensors: list
    works: list = field(default_factory=list)

    def done(self) -> bool:
        """True once every message completed (a finished send no longer needs its tensors)."""
        return all(work.is_completed() for work in self.works)

    def wait(self) -> list:
        for work in self.works:
            work.wait()
        self.works = []
        return self.tensors


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().contiguous()
    wire_dtype = _WIRE_DTYPES.get(tensor.dtype)
    return tensor.view(wire_dtype) if wire_dtype is not None else tensor


def post_send(tensors, peer: int, tags, group=None) -> Transfer:
    """isend each of ``tensors`` to global rank ``peer`` on ``group`` (None: the default group); the Transfer
    keeps them alive until sent."""
    wired = [_wire(tensor) for tensor in tensors]
    return Transfer(wired, [dist.isend(tensor, dst=peer, tag=tag, group=group) for tensor, tag in zip(wired, tags)])


def post_recv(buffers, peer: int, tags, group=None) -> Transfer:
    """irecv into each of ``buffers`` (from ``ReceiveBuffers.acquire``) from global rank ``peer`` on ``group``."""
    works = [dist.irecv(_wire_view(buffer), src=peer, tag=tag, group=group) for buffer, tag in zip(buffers, tags)]
    return Transfer(list(buffers), works)


def _wire_view(buffer: torch.Tensor) -> torch.Tensor:
    wire_dtype = _WIRE_DTYPES.get(buffer.dtype)
    return buffer.view(wire_dtype) if wire_dtype is not None else buffer


class ReceiveBuffers:
    """Pre-allocated receive buffers, reused across micro-batches, stages and steps.

    ``specs[(kind, stage)]``: the ``(shape, dtype)`` of each tensor a receive of that kind for that
    stage fills (activations: the stage's crossing inputs; gradients: its crossing outputs that
    take a gradient). Stages whose receives fill the same shapes share one pool of buffer sets (an
    interleaved schedule's chunks all do): a set is made only when none is free, so a rank holds as many
    sets as it has receives outstanding at once, not two per stage (41 chunks of Llama-2-70B at pp 2 held
    23 GiB of receive buffers that way; ``xirang check`` measured it).
    """

    def __init__(self, specs: dict, device="cpu", prefill: int = 2):
        self.specs, self.device = dict(specs), torch.device(device)
        self._pool = {key: (key[0], tuple(shapes)) for key, shapes in self.specs.items()}  # (kind, stage) -> pool
        self._free: dict = {pool: [self._allocate(pool) for _ in range(prefill)] for pool in set(self._pool.values())}
        self.allocated = {pool: prefill for pool in self._free}  # buffer sets made per pool

    def _allocate(self, pool) -> list:
        return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in pool[1]]

    def acquire(self, kind: str, stage: int) -> list:
        """A free buffer set for a receive of ``kind`` into ``stage`` (allocated if none is free)."""
        pool = self._pool[(kind, stage)]
        free = self._free[pool]
        if free:
            return free.pop()
        self.allocated[pool] += 1
        return self._allocate(pool)

    def release(self, kind: str, stage: int, buffers: list) -> None:
        """Give a set back once its contents were consumed (activations: copied out first)."""
        self._free[self._pool[(kind, stage)]].append(buffers)

    def tensors(self) -> list:
        """Every buffer tensor free for reuse now (between steps: all of them)."""
        return [tensor for sets in self._free.values() for buffers in sets for tensor in buffers]

    def most_allocated(self, kind: str = ACTIVATION) -> int:
        """The largest number of buffer sets any pool of ``kind`` needed (2 = double buffering)."""
        return max((count for (k, _), count in self.allocated.items() if k == kind), default=0)
