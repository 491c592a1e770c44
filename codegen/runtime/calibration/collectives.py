"""The collective microbenchmarks of ``xirang calibrate`` (``calibrate.py``): every kind the runtime issues
on every group size, as the runtime calls it, back to back or, on ranks sharing cores, each after a chunk
of work (``in_context_time``); and on shared cores a pipeline message's CPU (``message_cpu_samples``).
Each rank returns its own medians; ``calibrated_world`` fits the lines.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from xirang.codegen.runtime.calibration.timing import median_time, sync_device
from xirang.ir.calibration import COLLECTIVE_KINDS
from xirang.ir.errors import XirangError

MESSAGE_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)  # bytes; dp buckets are up to 25 MiB
QUICK_MESSAGE_SIZES = (1 << 10, 16 << 10)


def group_sizes(world_size: int) -> list[int]:
    """Group sizes measured: 2, 4, 8, ... dividing ``world_size``, and ``world_size`` itself."""
    sizes, size = [], 2
    while size <= world_size:
        if world_size % size == 0:
            sizes.append(size)
        size *= 2
    if world_size > 1 and world_size not in sizes:
        sizes.append(world_size)
    return sizes


def collective_call(kind: str, nbytes: int, group, size: int, group_ranks: Sequence[int], device: str):
    """A no-argument call running ``kind`` on ``nbytes`` (the cost model's nbytes convention) the way
    the runtime runs it; None where the kind does not apply to this group."""
    elements = max(size, nbytes // 4 // size * size)  # float32, divisible by the group
    rank = dist.get_rank()
    if kind == "all_reduce":
        buffer = torch.ones(elements, device=device)
        return lambda: dist.all_reduce(buffer, group=group)
    if kind == "all_gather":  # nbytes: each rank's output (codegen/ops/collectives._all_gather)
        out, local = torch.empty(elements, device=device), torch.ones(elements // size, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, local, group=group)
    if kind == "reduce_scatter":  # nbytes: each rank's input; the runtime's all-reduce fallback too
        full, out = torch.ones(elements, device=device), torch.empty(elements // size, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def reduce_scatter():
            try:
                scatter(out, full, group=group)
            except (RuntimeError, NotImplementedError):
                dist.all_reduce(full.clone(), group=group)
        return reduce_scatter
    if kind == "all_to_all":
        send, recv = torch.ones(elements, device=device), torch.empty(elements, device=device)
        return lambda: dist.all_to_all_single(recv, send, group=group)
    if kind == "broadcast":
        buffer = torch.ones(elements, device=device)
        return lambda: dist.broadcast(buffer, src=group_ranks[0], group=group)
    if kind == "send":  # the pipeline's isend/irecv between neighbours; timed as half a round trip
        if size != 2:
            return None
        buffer = torch.ones(elements, device=device)
        peer = group_ranks[1] if rank == group_ranks[0] else group_ranks[0]
        first = rank == group_ranks[0]

        def ping_pong():
            for sending in ((True, False) if first else (False, True)):
                work = dist.isend(buffer, dst=peer) if sending else dist.irecv(buffer, src=peer)
                work.wait()
        return ping_pong
    raise XirangError(f"no microbenchmark for collective {kind!r}", where="codegen/runtime/calibration/collectives.py",
                      hint=f"known kinds: {', '.join(COLLECTIVE_KINDS)}")


CONTEXT_OPS = 40  # tiny ops every rank runs before each send measured in context
# (m, k, n) of the matmul every rank runs before each collective measured in context: about what a
# tp rank computes between two collectives at the sizes CPU development runs train at (a block's
# projection at hidden 256, 256 rows), so the peers are as busy as in training when the call starts
CONTEXT_MATMUL = (256, 256, 1024)


def in_context_time(call: Callable[[], None], device: str, iters: int, *, kind: str) -> float:
    """Median seconds from the end of this rank's own work to the end of ``call``, each call preceded
    by a chunk of work on every rank, as training issues collectives between ops. On ranks sharing
    cores this holds what back-to-back calls hide: a rank that must be scheduled again behind the busy
    ones before it answers, and the ranks' skew in finishing their work. Before a collective the chunk
    is a matmul (``CONTEXT_MATMUL``): its peers are then computing as in training, and how long the
    group's last rank takes to get a core and finish is part of what the call costs, priced nowhere
    else. Before a pipeline send it is a chain of tiny ops: waiting for the neighbour's stage is the
    schedule's (the pipeline formula prices it), so only the transfer and a wake-up belong here."""
    aten, tiny = torch.ops.aten, torch.ones(8, device=device)
    m, k, n = CONTEXT_MATMUL
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)

    def ops():
        z = tiny
        for _ in range(CONTEXT_OPS):
            z = aten.mul.Tensor(z, 1.0001)

    def matmul():
        aten.mm.default(a, b)
    return median_time(call, device, iters, before=ops if kind == "send" else matmul)


def measured_groups() -> list[tuple[int, object, list[int]]]:
    """(size, this rank's group, its ranks) for every group size measured: the world cut into blocks of
    that size, as the dp or tp groups of a mesh are. A collective: every rank creates every group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    found = []
    for size in group_sizes(world):
        blocks = [list(range(start, start + size)) for start in range(0, world, size)]
        groups = [dist.new_group(block) for block in blocks]
        found.append((size, groups[rank // size], blocks[rank // size]))
    return found


def collective_samples(device: str, quick: bool, groups: Sequence, in_context: bool = False) -> dict:
    """{"kind/size": [[nbytes, median seconds on this rank], ...]} for every kind on each of ``groups``
    (``measured_groups``, made once for every pass); ``in_context``: each call after a chunk of work
    (``in_context_time``), else back to back."""
    iters = 3 if quick else 7
    out: dict = {}
    for size, group, ranks in groups:
        for kind in COLLECTIVE_KINDS:
            rows = []
            for nbytes in (QUICK_MESSAGE_SIZES if quick else MESSAGE_SIZES):
                call = collective_call(kind, nbytes, group, size, ranks, device)
                if call is None:
                    break
                dist.barrier()  # every group starts together: they contend as in training
                if in_context:
                    seconds = in_context_time(call, device, iters, kind=kind)
                else:
                    seconds = median_time(call, device, iters)
                rows.append([float(nbytes), seconds / (2 if kind == "send" else 1)])
            if rows:
                out[f"{kind}/{size}"] = rows
    return out


MESSAGE_ROUNDS = 20  # rounds of (work, message) per size in ``message_cpu_samples``


def message_cpu_samples(device: str, quick: bool) -> list:
    """[[nbytes, CPU seconds of one pipeline message, both sides]] on this rank, every rank in a pair
    with its neighbour and all pairs at once. Each round is the context matmul (``CONTEXT_MATMUL``) and
    then one message each way (this rank sends one and receives one: both sides of one message); the
    same rounds without the messages are timed too, and the difference in process CPU (every thread:
    gloo's loop thread does the copying) over the rounds is the messages'. Timed by CPU, not wall: on
    shared cores a message's CPU is what the other ranks lose, and its wall time alone leaves it out.
    The matmul before each message is there because caches matter: back to back after tiny ops a
    128 KB message took 0.4 ms of CPU on the development box, after a training-sized matmul 0.9 ms, and
    in a pipeline's training steps about 0.7 ms on gloo's threads alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % 2:
        return []
    pair = [rank - rank % 2, rank - rank % 2 + 1]
    m, k, n = CONTEXT_MATMUL
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    rounds, rows = 5 if quick else MESSAGE_ROUNDS, []
    for nbytes in (QUICK_MESSAGE_SIZES if quick else MESSAGE_SIZES):
        message = collective_call("send", nbytes, None, 2, pair, device)  # one each way, as the send line's
        cpu = []
        for with_message in (True, False, True, False):  # interleaved: a drift falls on both alike
            dist.barrier()
            start = time.process_time()
            for _ in range(rounds):
                torch.ops.aten.mm.default(a, b)
                sync_device(device)
                if with_message:
                    message()
            cpu.append(time.process_time() - start)
        # the raw difference, negative where noise outweighed the message: clamping each rank's to 0
        # would bias the mean over ranks upward; the fit drops a size whose mean is not positive
        rows.append([float(nbytes), (cpu[0] + cpu[2] - cpu[1] - cpu[3]) / (2 * rounds)])
    return rows
