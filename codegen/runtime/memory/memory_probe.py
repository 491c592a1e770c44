"""Memory measured against the plan: the peak of saved activations a rank holds during a step, and
the refusal of a plan whose predicted memory does not fit the device it runs on.

``MemoryProbe`` (a context manager around a step) installs ``torch.autograd.graph.saved_tensors_hooks``
and counts the storages autograd keeps for the backward: each storage once (by its untyped
storage's data pointer, at its ``nbytes``), from the forward that saves it until the last saved
tensor viewing it is freed with its graph (after that micro-batch's backward). Its peak is the
measured counterpart of the plan's ``activations`` part (``Prediction.memory_parts``). Not counted:
parameters and buffers (resident anyway, passed as ``exclude``), and what other saved-tensor hooks
keep inside the step, since only the innermost hooks of PyTorch's stack see a tensor: the tensors a
recompute region rebuilds in its backward (torch's checkpoint) and those an offloaded block sends
to the host (codegen/runtime/memory/offload.py) -- the plan's ``working_set`` part, which the probe does
not measure. On a CUDA device the allocator's own peak (``torch.cuda.max_memory_allocated``, every
tensor: states, activations, working sets, temporaries) is reported beside it.

``measure_step(compiled, ...)`` runs one ``CompiledModel.train_step`` under a probe and returns the
loss and a ``MemoryMeasurement`` with the plan's prediction for this rank beside it.

``check_plan_fits(plan, rank, device)`` refuses, before anything is built, a plan whose predicted
peak memory is more than the device it runs on can hold (``torch.cuda.get_device_properties`` on
CUDA; on CPU ranks the machine's memory from ``os.sysconf``, shared by the ranks of one node of the
plan's World), at the same fraction of it the planner allowed itself.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from xirang.ir.errors import XirangError

GiB = 1024**3


def _key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (tensor.device.type, tensor.device.index, storage.data_ptr())


class _Packed:
    """A saved tensor the probe counts while autograd holds it (released when autograd drops it)."""

    __slots__ = ("tensor", "key", "probe")

    def __init__(self, probe: "MemoryProbe", tensor: torch.Tensor, key: tuple):
        self.tensor, self.key, self.probe = tensor, key, probe

    def __del__(self):
        self.probe._release(self.key)


class MemoryProbe:
    """Counts the storages autograd saves for the backward while it is entered (module docstring).

    ``device``: where the rank's tensors live (its allocator peak is read on CUDA). ``exclude``:
    tensors whose storages are not activations (the rank's parameters and buffers).
    """

    def __init__(self, device="cpu", exclude: Iterable[torch.Tensor] = ()):
        self.device = torch.device(device)
        self._excluded = {_key(t) for t in exclude if isinstance(t, torch.Tensor) and t.numel()}
        self._lock = threading.Lock()
        self._live: dict[tuple, list] = {}  # storage key -> [bytes, holders]
        self.live_bytes = 0
        self.peak_bytes = 0  # saved activation bytes alive at once, the largest seen
        self.peak_storages = 0  # storages alive at that peak
        self.saved_tensors = 0  # tensors packed (a storage saved by two ops counts twice here)
        self.allocated_peak: Optional[int] = None  # torch.cuda.max_memory_allocated, CUDA only
        self._hooks = None

    # --- the hooks -------------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided or tensor.numel() == 0:
            return tensor
        key = _key(tensor)
        if key in self._excluded:
            return tensor
        with self._lock:
            self.saved_tensors += 1
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [tensor.untyped_storage().nbytes(), 0]
                self.live_bytes += entry[0]
                if self.live_bytes > self.peak_bytes:
                    self.peak_bytes, self.peak_storages = self.live_bytes, len(self._live)
            entry[1] += 1
        # Detached: a saved output holding itself would tie its grad_fn to this record in a cycle the
        # garbage collector cannot see, and a node no backward releases (a split backward's
        # input-gradient-only ops) would then never free it.
        return _Packed(self, tensor.detach(), key)

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Packed) else packed

    def _release(self, key: tuple) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._live[key]
                self.live_bytes -= entry[0]

    # --- use ---------------------------------------------------------------------------------
    def __enter__(self) -> "MemoryProbe":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.allocated_peak = int(torch.cuda.max_memory_allocated(self.device))


@dataclass(frozen=True)
class MemoryMeasurement:
    """One rank's step: measured against predicted (bytes; ``predicted_*`` None for a plan saved
    before the prediction was split by part)."""

    rank: int
    pp_rank: int
    device: str
    saved_peak_bytes: int  # saved activations alive at once, measured (MemoryProbe)
    saved_tensors: int
    allocated_peak_bytes: Optional[int]  # the CUDA allocator's peak over the step; None on CPU
    predicted_activation_bytes: Optional[int]  # the plan's activations part for this pipeline rank
    predicted_working_set_bytes: Optional[int]  # what recompute rebuilds / offload holds (not probed)
    predicted_total_bytes: int  # the plan's whole prediction for a device of this pipeline rank

    @property
    def ratio(self) -> Optional[float]:
        """measured / predicted saved activations."""
        if not self.predicted_activation_bytes:
            return None
        return self.saved_peak_bytes / self.predicted_activation_bytes

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {"ratio": self.ratio}


def predicted_for(plan, pp_rank: int) -> tuple[Optional[int], Optional[int], int]:
    """(activations, working set, total) the plan predicts for a device of ``pp_rank``."""
    total = int(plan.predicted.memory_bytes_per_device[pp_rank])
    parts = plan.predicted.memory_parts
    if not parts:
        return None, None, total
    return int(parts[pp_rank]["activations"]), int(parts[pp_rank]["working_set"]), total


def measure_step(compiled, *args, **kwargs) -> tuple[torch.Tensor, MemoryMeasurement]:
    """``compiled.train_step(*args, **kwargs)`` under a ``MemoryProbe`` (the rank's parameters and
    buffers excluded); returns the loss and this rank's measurement beside the plan's prediction."""
    state = [t for stage in compiled.executor.stages.values() for t in stage.parameters]  # parameters, buffers
    probe = MemoryProbe(compiled.device, exclude=[*compiled.parameters(), *state])
    compiled.executor.saved_observer = probe  # the stage forwards' own hooks pass what they save on to it
    try:
        with probe:
            loss = compiled.train_step(*args, **kwargs)
    finally:
        compiled.executor.saved_observer = None
    activations, working, total = predicted_for(compiled.plan, compiled.pp_rank)
    return loss, MemoryMeasurement(
        rank=compiled.rank, pp_rank=compiled.pp_rank, device=str(compiled.device),
        saved_peak_bytes=probe.peak_bytes, saved_tensors=probe.saved_tensors,
        allocated_peak_bytes=probe.allocated_peak, predicted_activation_bytes=activations,
        predicted_working_set_bytes=working, predicted_total_bytes=total)


def format_measurements(measurements: list) -> str:
    """A table: per rank, measured and predicted saved activations, and the allocator's peak."""
    lines = [f"{'rank':>4} {'pp':>3} {'measured saved':>15} {'predicted':>12} {'ratio':>6} "
             f"{'+ work set':>11} {'plan total':>11} {'allocator peak':>15}"]
    for m in sorted(measurements, key=lambda m: m.rank):
        predicted = "-" if m.predicted_activation_bytes is None else _mib(m.predicted_activation_bytes)
        working = "-" if m.predicted_working_set_bytes is None else _mib(m.predicted_working_set_bytes)
        ratio = "-" if m.ratio is None else f"{m.ratio:.3f}"
        allocated = "(CPU: none)" if m.allocated_peak_bytes is None else _mib(m.allocated_peak_bytes)
        lines.append(f"{m.rank:>4} {m.pp_rank:>3} {_mib(m.saved_peak_bytes):>15} {predicted:>12} {ratio:>6} "
                     f"{working:>11} {_mib(m.predicted_total_bytes):>11} {allocated:>15}")
    lines.append("MiB. measured saved: storages autograd keeps for the backward at once (each once), peak over "
                 "the step; predicted: the plan's activations for that pipeline rank (in flight at the "
                 "schedule's peak); work set: what recompute rebuilds and offload holds on the device (not "
                 "probed: their own saved-tensor hooks keep those).")
    return "\n".join(lines)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f}"


# --- bad input: a plan that does not fit the device it runs on ------------------------------------

def device_memory_bytes(device) -> tuple[int, str]:
    """(bytes, how they were found) of the memory ``device`` has: the CUDA device's total memory, or
    for a CPU the machine's physical memory (``os.sysconf``)."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"{props.name} (torch.cuda.get_device_properties)"
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return int(pages * size), "this machine's memory (os.sysconf)"


def check_plan_fits(plan, rank: int, device, available: Optional[int] = None) -> None:
    """Refuse ``plan`` on global ``rank`` when what it predicts for the device exceeds what the
    device has, at the fraction of device memory the planner allowed (each stage's
    ``memory_limit_bytes`` over the plan's device). On a CPU the machine's memory is shared by the
    ranks of this rank's node of the plan's World, so their predictions are summed. ``available``
    overrides the measured bytes (tests)."""
    device = torch.device(device)
    have, found = (available, "given") if available is not None else device_memory_bytes(device)
    pp_rank = plan.mesh.coords(rank)["pp"]
    per_device = plan.predicted.memory_bytes_per_device
    if device.type == "cuda":
        ranks, need = [rank], per_device[pp_rank]
    else:
        node = plan.world.node_of(rank)
        ranks = [r for r in range(plan.world.size) if plan.world.node_of(r) == node]
        need = sum(per_device[plan.mesh.coords(r)["pp"]] for r in ranks)
    planned = plan.world.device_of(rank)
    fraction = min(stage.memory_limit_bytes for stage in plan.stages) / planned.memory_bytes
    usable = fraction * have
    if need <= usable:
        return
    shared = f" summed over the {len(ranks)} ranks sharing it" if len(ranks) > 1 else ""
    raise XirangError(
        f"the plan predicts {need / GiB:.2f} GiB of memory for rank {rank}'s device{shared} (pipeline rank "
        f"{pp_rank}: {per_device[pp_rank] / GiB:.2f} GiB), but {device} has {have / GiB:.2f} GiB ({found}), of "
        f"which the plan may use {fraction:.0%}, {usable / GiB:.2f} GiB; the plan was made for a "
        f"{planned.name} of {planned.memory_bytes / GiB:.1f} GiB",
        where=f"plan.predicted.memory_bytes_per_device[{pp_rank}] (plan.world: {plan.world.describe()})",
        hint="re-plan for the devices this runs on (xirang.plan(..., device=<preset>, or a World of DeviceSpecs "
             "with their memory_bytes)), or with more pipeline stages, recompute or offload to fit")
