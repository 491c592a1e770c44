"""Where a rank's tensors live: the device that follows the launcher and the process group's backend.

``runtime_device_for`` is the choice itself, pure (the backend's name, the environment and the number
of CUDA devices are its arguments), so it is tested without a GPU; ``resolve_runtime_device`` reads
them from this process (``torch.distributed``, ``os.environ``, ``torch.cuda``) and is what
``xirang.compile(device=...)`` calls once the world is joined.

    NCCL  (``dist.get_backend()`` names nccl)  -> cuda:LOCAL_RANK (torchrun and ``launch`` set it)
    gloo, or no process group                  -> cpu
    an explicit device                         -> that device, unless the backend cannot move it

NCCL moves only CUDA tensors and gloo's CPU tensors are what the CPU ranks run, so a program whose
tensors are on another device than its backend's fails at its first collective; the mismatches are
refused here, before anything is built, naming the backend and the device.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from xirang.ir.errors import XirangError

NO_GROUP = "no process group"


def backend_names(backend: Optional[str]) -> frozenset:
    """The collective libraries a backend string names: ``"nccl"`` -> {nccl}; torch's per-device form
    ``"cpu:gloo,cuda:nccl"`` -> {gloo, nccl}; None (no process group) -> the empty set."""
    if not backend:
        return frozenset()
    return frozenset(part.rsplit(":", 1)[-1].strip().lower() for part in str(backend).split(",") if part.strip())


def runtime_device_for(backend: Optional[str], environ: Mapping[str, str], *, cuda_devices: int,
                       requested=None, where: str = "xirang.compile(device=...)") -> torch.device:
    """The device this rank's tensors live on (module docstring).

    ``backend``: the default process group's backend as ``torch.distributed.get_backend()`` spells
    it, None when there is no process group (a one-rank program); ``environ``: the environment the
    launcher set (``LOCAL_RANK``); ``cuda_devices``: how many CUDA devices this process sees (0
    without CUDA); ``requested``: an explicit device (anything ``torch.device`` takes), which
    always wins when the backend can move its tensors.

    Under NCCL the device is ``cuda:LOCAL_RANK``, the GPU torchrun (and ``launch``) gives the rank.
    Without ``LOCAL_RANK`` it is refused, not guessed: ``rank % device_count()`` holds only when
    every node sees the same number of GPUs and ranks are numbered node by node, and where each
    process sees only its own GPU (``CUDA_VISIBLE_DEVICES`` per task, as Slurm's
    ``--gpus-per-task`` sets) it names a device that does not exist; ``torch.cuda.current_device()``
    is 0 unless the script chose one, which puts every rank of a node on the same GPU. Either way
    the run would fail later and less clearly (or share a GPU silently), so such a launch is told to
    set ``LOCAL_RANK`` (Slurm: from ``SLURM_LOCALID``) or to pass ``device=``.

    Refused (``XirangError``): an NCCL-only process group with a non-CUDA device; a CUDA device when
    this process sees no CUDA device (gloo or no process group on a CPU machine) or fewer than its
    index; a ``LOCAL_RANK`` that is not a device of this process; a backend other than gloo and
    NCCL without an explicit device (which device its collectives take is not Xirang's to guess).
    """
    names = backend_names(backend)
    under = f"backend {backend!r}" if backend else NO_GROUP
    if requested is not None:
        try:
            device = torch.device(requested)
        except (RuntimeError, TypeError, ValueError) as error:
            raise XirangError(f"device={requested!r} is not a device: {error}", where=where,
                              hint="pass a torch.device or a string such as 'cpu' or 'cuda:0', or leave it "
                                   "out to follow the launcher") from None
        if names == {"nccl"} and device.type != "cuda":
            raise XirangError(f"device={str(device)!r} under {under}: NCCL moves only CUDA tensors, "
                              f"so the first collective would fail", where=where,
                              hint="leave device= out (NCCL ranks run on cuda:LOCAL_RANK), pass a "
                                   "'cuda:N' device, or start CPU ranks with the gloo backend")
        if device.type == "cuda":
            what = f"device={str(device)!r} under {under}"
            _check_cuda_index(device.index, cuda_devices, environ, what, where)
        return device
    if "nccl" in names:
        local = environ.get("LOCAL_RANK")
        if local is None:
            raise XirangError(f"{under} but LOCAL_RANK is not set, so which GPU is this rank's is unknown",
                              where=where,
                              hint="start the ranks with torchrun (it sets LOCAL_RANK), export LOCAL_RANK "
                                   "(under Slurm: LOCAL_RANK=$SLURM_LOCALID), or pass device='cuda:N'")
        try:
            index = int(local)
        except ValueError:
            index = -1
        if index < 0:
            raise XirangError(f"{under} with LOCAL_RANK={local!r}, which is not a GPU index", where=where,
                              hint="LOCAL_RANK must be this rank's position on its node (0, 1, ...), as torchrun "
                                   "sets it, or pass device='cuda:N'")
        _check_cuda_index(index, cuda_devices, environ, f"{under} with LOCAL_RANK={local}", where)
        return torch.device("cuda", index)
    if names <= {"gloo"}:
        return torch.device("cpu")
    raise XirangError(f"{under}: xirang places a rank's tensors for gloo (CPU) and NCCL (CUDA) process groups, "
                      f"not for {', '.join(sorted(names - {'gloo', 'nccl'}))}", where=where,
                      hint="pass device= the device this backend's collectives take")


def _check_cuda_index(index: Optional[int], cuda_devices: int, environ: Mapping[str, str], what: str,
                      where: str) -> None:
    if cuda_devices <= 0:
        raise XirangError(f"{what}: torch.cuda is unavailable in this process (no CUDA device, or a CPU build "
                          f"of torch)", where=where,
                          hint="run on a machine with GPUs and a CUDA build of torch, or use device='cpu' "
                               "with the gloo backend")
    if index is not None and index >= cuda_devices:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise XirangError(f"{what}: this process sees {cuda_devices} CUDA device(s){shown}, numbered from 0",
                          where=where,
                          hint="when each process sees only its own GPU pass device='cuda:0'; otherwise "
                               "start at most as many ranks per node as it has GPUs")


def process_group_backend() -> Optional[str]:
    """The default process group's backend as ``torch.distributed`` names it, None without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return str(dist.get_backend())


def visible_cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without CUDA or on a CPU build of torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_runtime_device(requested=None, *, where: str = "xirang.compile(device=...)") -> torch.device:
    """``runtime_device_for`` with this process's backend, environment and CUDA devices: call it after the
    world is joined (``launch.ensure_distributed``)."""
    return runtime_device_for(process_group_backend(), os.environ, cuda_devices=visible_cuda_devices(),
                              requested=requested, where=where)
