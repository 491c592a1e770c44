"""Activation offload with prefetch: what an offloaded block saves for its backward lives in host
memory between its forward and its backward (plan.offload = "blocks"; the blocks are the
``OffloadedBlock`` modules passes/lowering/offload.py and regions.py put in the stage modules).

Mechanism (the one ``torch.autograd.graph.save_on_cpu`` uses, plus a prefetch):

- Forward: the executor runs each stage forward inside ``forward(stage, mb)``; each offloaded block
  runs under ``torch.autograd.graph.saved_tensors_hooks``. The pack hook starts a copy of every
  saved tensor to a host buffer (pinned memory, on a side CUDA stream, on a GPU; a separate CPU
  tensor, by a background copy thread, on a CPU rank) and keeps no device reference once the copy
  is done. A tensor saved twice in a block is copied once. Parameters and the stage's received
  inputs (leaves, resident anyway) and views of them are not copied.
- Backward: the executor calls ``begin_backward(stage, mb)`` before a backward, which prefetches
  the stage's last block; the backward of each block (a hook on its outputs' gradients) prefetches
  the block before it: the copy back runs while this block's backward computes. The unpack hook
  waits for its block's copy only; a tensor whose prefetch did not start is fetched on demand. One
  copy back serves every op that saved the tensor and is dropped once the last has it.
- The host copies are kept until ``end_backward`` (after Backward, or after BackwardWeight when the
  schedule splits the backward: its second pass over the graph fetches them again).

``stats`` counts what moved: tensors and bytes packed, bytes fetched back, copies back the prefetch
started and those a backward had to start itself. On CPU ranks "host" and "device"
are one memory, so the bytes held do not fall there; the mechanism (copies, threads, order) is the
same code a GPU runs, and the tests check it restores every tensor exactly.
"""
from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from xirang.codegen.ops.activations import OffloadedBlock
from xirang.codegen.runtime.memory.storage_identity import storage_key
from xirang.codegen.runtime.memory import weight_casts


@dataclass
class OffloadStats:
    """What offload moved since the runtime was built (or ``reset``)."""

    packed_tensors: int = 0
    packed_bytes: int = 0  # device -> host
    fetched_bytes: int = 0  # host -> device (twice per tensor under a split backward)
    prefetched: int = 0  # copies back the prefetch had started before a slot asked
    waited: int = 0  # copies back a slot had to start itself (no prefetch reached it)
    kept: int = 0  # saved tensors left in place (parameters, received inputs)

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


def attach_offload(program, device) -> "ActivationOffload | None":
    """Point every ``OffloadedBlock`` of ``program``'s stages at one new ``ActivationOffload`` on
    ``device``; ``None`` (and nothing attached) when the program offloads no block."""
    blocks = [module for stage in program.stages for module in stage.module.modules()
              if isinstance(module, OffloadedBlock)]
    if not blocks:
        return None
    offload = ActivationOffload(device)
    for block in blocks:
        block.activation_offload = offload
    return offload


class ActivationOffload:
    """One process's offload engine (module docstring). Not thread-safe for two executors at once."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.stats = OffloadStats()
        self._lock = threading.Lock()
        self._copier = None  # made on first use: a forked rank starts its own thread
        self._scope = None  # (stage, micro-batch) of the forward running now
        self._blocks: dict = {}  # (stage, micro-batch) -> [_Block] in forward order

    @property
    def copier(self):
        if self._copier is None:
            self._copier = _StreamCopier(self.device) if self.device.type == "cuda" else _ThreadCopier()
        return self._copier

    def use_copier(self, copier) -> None:
        """Copy with ``copier`` (``to_host(tensor)`` and ``to_device(host, device)``, each returning something
        to ``wait()`` on) instead of the device's own: the dry run's GPU copies to host memory on fake tensors
        (codegen/check/gpu_semantics.py)."""
        self._copier = copier

    # --- called by the executor -------------------------------------------------------------

    @contextmanager
    def forward(self, stage: int, micro_batch: int):
        """Blocks run inside belong to (stage, micro_batch)."""
        self._scope = (stage, micro_batch)
        self._blocks[self._scope] = []
        try:
            yield
        finally:
            self._scope = None

    def begin_backward(self, stage: int, micro_batch: int) -> None:
        """Prefetch the last block of (stage, micro_batch): the first whose backward runs."""
        blocks = self._blocks.get((stage, micro_batch))
        for block in blocks or ():
            block.reset()  # a second pass (BackwardWeight after BackwardInput) fetches anew
        if blocks:
            blocks[-1].prefetch()

    def end_backward(self, stage: int, micro_batch: int) -> None:
        """Forget (stage, micro_batch)'s blocks: their host copies go with the freed graph."""
        for block in self._blocks.pop((stage, micro_batch), ()):
            block.reset()

    def blocks(self, stage: int, micro_batch: int) -> list:
        """The offloaded block runs of (stage, micro_batch) held now, in forward order."""
        return list(self._blocks.get((stage, micro_batch), ()))

    def held(self) -> list:
        """(stage, micro-batch) whose offloaded activations are still held."""
        return sorted(self._blocks)

    # --- called by OffloadedBlock -------------------------------------------------------------

    def run_block(self, name: str, fn, inputs: tuple):
        """Run ``fn(*inputs)`` with its saved tensors offloaded (outside an executor forward: as is)."""
        if self._scope is None:
            return fn(*inputs)
        blocks = self._blocks[self._scope]
        resident = {_storage(t) for t in inputs if isinstance(t, torch.Tensor) and t.is_leaf}
        block = _Block(self, name, resident)
        blocks.append(block)
        with torch.autograd.graph.saved_tensors_hooks(block.pack, block.unpack):
            outputs = fn(*inputs)
        position = len(blocks) - 1

        def started(_grad):  # this block's backward begins: bring back the one before it (and this one)
            block.prefetch()
            if position > 0:
                blocks[position - 1].prefetch()

        for out in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(started)
        return outputs

    def count(self, **deltas) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)


def _storage(tensor: torch.Tensor) -> int:
    return storage_key(tensor)


class _Block:
    """One run of one offloaded block: its saved tensors."""

    def __init__(self, owner: ActivationOffload, name: str, resident: set):
        self.owner, self.name, self.resident = owner, name, resident
        self.saved: list[_Saved] = []
        self._seen: dict = {}  # id(tensor) -> (weakref to it, its _Saved): one copy per tensor

    def pack(self, tensor: torch.Tensor):
        recast = weight_casts.recipe_of(tensor)  # a weight copy is made again, not copied out and back
        if recast is not None:
            return recast
        if tensor.layout != torch.strided or tensor.device.type != self.owner.device.type or tensor.numel() == 0 \
                or _storage(tensor) in self.resident:  # parameters, received inputs (and views of them) stay
            self.owner.count(kept=1)
            return tensor
        seen = self._seen.get(id(tensor))
        if seen is not None and seen[0]() is tensor:
            seen[1].refs += 1
            return seen[1]
        saved = _Saved(self.owner, tensor)
        self._seen[id(tensor)] = (weakref.ref(tensor), saved)
        self.saved.append(saved)
        self.owner.count(packed_tensors=1, packed_bytes=tensor.numel() * tensor.element_size())
        return saved

    @staticmethod
    def unpack(packed):
        return packed if isinstance(packed, torch.Tensor) else packed.fetch()

    def prefetch(self) -> None:
        for saved in self.saved:
            saved.prefetch()

    def reset(self) -> None:
        for saved in self.saved:
            saved.reset()


class _Saved:
    """A saved tensor in host memory, and its way back. ``refs``: how many saved-tensor slots of the
    graph hold it (one tensor saved by several ops is copied once); the copy back serves them all
    in one pass over the graph and is dropped after the last (``reset`` starts a new pass)."""

    def __init__(self, owner: ActivationOffload, tensor: torch.Tensor):
        self.owner, self.device = owner, tensor.device
        self.host = owner.copier.to_host(tensor)  # a pending copy; holds the device tensor until done
        self.refs, self.unpacked = 1, 0
        self.incoming = None  # a started copy back
        self.back = None  # the copy back, until every slot of this pass has it
        self.lock = threading.Lock()

    def prefetch(self) -> None:
        with self.lock:
            if self.incoming is None and self.back is None:
                self.incoming = self.owner.copier.to_device(self.host, self.device)

    def fetch(self) -> torch.Tensor:
        with self.lock:
            tensor = self.back
            if tensor is None:
                incoming, self.incoming = self.incoming, None
                self.owner.count(**({"prefetched": 1} if incoming is not None else {"waited": 1}))
                if incoming is None:
                    incoming = self.owner.copier.to_device(self.host, self.device)
                tensor = self.back = incoming.wait()
                self.owner.count(fetched_bytes=tensor.numel() * tensor.element_size())
            self.unpacked += 1
            if self.unpacked >= self.refs:  # every slot has it: the graph holds it as long as it needs
                self.back, self.unpacked = None, 0
        return tensor

    def reset(self) -> None:
        """A new pass over the graph (or none): forget the copy back of the last one."""
        with self.lock:
            self.back, self.unpacked = None, 0


# --- the copy engines ----------------------------------------------------------------------------

class _ThreadCopier:
    """CPU ranks: copies run on one background thread, in order (a copy back after its copy out)."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xirang-offload")

    def to_host(self, tensor):
        return _Future(self.pool.submit(_host_copy, tensor))

    def to_device(self, host, device):
        return _Future(self.pool.submit(lambda: host.wait().clone(memory_format=torch.preserve_format)))


def _host_copy(tensor):
    return tensor.detach().clone(memory_format=torch.preserve_format)


class _Future:
    def __init__(self, future):
        self.future = future

    def wait(self):
        return self.future.result()


class _StreamCopier:
    """CUDA: copies run on a side stream into pinned host memory and back; the compute stream waits
    for a copy back only where a tensor is used (``wait``), never for a copy out."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)

    def to_host(self, tensor):
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is computed
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # its memory is not reused before the copy is done
        return Ready(host)

    def to_device(self, host, device):
        with torch.cuda.stream(self.stream):  # after the copy out: one stream, in order
            tensor = host.wait().to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return _Arriving(tensor, done)


class Ready:
    """A copy already made: ``wait()`` returns it (the copiers' common answer)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self):
        return self.tensor


class _Arriving:
    def __init__(self, tensor, done):
        self.tensor, self.done = tensor, done

    def wait(self):
        stream = torch.cuda.current_stream(self.tensor.device)
        stream.wait_event(self.done)  # the compute stream waits for this copy, nothing else
        self.tensor.record_stream(stream)
        return self.tensor
