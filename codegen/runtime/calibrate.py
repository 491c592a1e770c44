"""Microbenchmarks that calibrate the cost model on the machine at hand (``xirang calibrate``).

Collectives run on all N local ranks at once, as training runs them, so what ranks sharing cores
(or a PCIe switch, or a NIC) take from each other is in their figures. Compute is timed by rank 0
alone on its device, the others waiting (on shared cores in three passes, at the start, middle and end
of the calibration, each sample the median of the three: ``_compute_pass``); where the ranks share
the host's cores, ``calibrate_sharing`` times what training ranks take of each other for
``calibrated_world`` to scale it by:

- compute: matmuls at training-like shapes (fp32 and bf16), each as training runs it (the linear op
  the emitted program calls, forward and backward through autograd: the forward product, both
  gradient products and the bias gradient, with the composite op's own dispatches), an elementwise add
  (memory-bound) and the non-matmul FLOPs of a transformer (gelu, layer norm and log-softmax, each kind
  apart, forward and backward: the roofline's ``Efficiency.other`` and each kind's own rate, at the
  FLOPs the analysis counts for them), these three timed cold (``cache_flush``: inputs out of cache, as
  training meets them, not hot in cache as back-to-back calls leave them; a small matmul's weights and
  activations hot in cache ran 20-50% faster on the development box, 1 thread, than after a flush,
  the large ones alike), fused attention forward and backward (``Efficiency.attention`` and a cost
  per attention score, ``calibrate_op_classes.attention_samples``), a tiny
  op's dispatch (the fixed per-op cost: eager dispatch on CPU, a kernel launch on GPU) and the
  backward's per-op cost (an autograd node and its gradient op on a tiny tensor), and a block stack
  with and without ``torch.utils.checkpoint`` (what a recomputed region costs beyond its forward). Each op is called
  the way emitted programs call it (``torch.ops.aten``).
- collectives: every kind the runtime issues, on every group size 2, 4, ... N that divides N (all
  groups of that size running at once, as the dp or tp groups of a mesh do), with the calls the
  runtime makes (all_gather/reduce_scatter as ``codegen/ops/collectives.py`` runs them, send as the
  pipeline's isend/irecv), over a few message sizes. On ranks that share cores each call follows a
  chunk of work, as in training (``_in_context_time``: a matmul before a collective, tiny ops before
  a send): back-to-back calls on idle ranks answer at once, while in training a peer must first get a
  core behind the busy ranks and finish its own work. There a pipeline message's CPU, both sides
  with gloo's threads, is timed as well (``_message_cpu_samples``): what it takes from the other ranks.

A sample's time is the median over iterations on each rank, then the slowest rank (a collective
ends when its last rank does). ``calibrated_world`` (its own module) fits the lines
(``ir/calibration.fit_line``) and builds the World the planner reads. The same code runs on GPUs
with device "cuda" and nccl; the timings synchronise the device around each timed region.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from xirang.codegen.runtime.calibrate_op_classes import (attention_samples, other_samples, recompute_sample,
                                                         split_backward_sample)
from xirang.codegen.runtime.calibrate_sharing import measure_sharing
from xirang.codegen.runtime.calibrated_world import calibrated_world
from xirang.ir.calibration import COLLECTIVE_KINDS
from xirang.ir.errors import XirangError
from xirang.ir.world import World

# (m, k, n) of the timed matmuls: activations (micro-batch x seq rows) times weight shards of hidden
# 256..1024 models, the sizes CPU development runs train at; --quick keeps two small ones.
MATMUL_SHAPES = ((128, 256, 256), (128, 256, 768), (128, 1024, 256), (256, 256, 1024), (512, 256, 1024),
                 (1024, 1024, 256), (2048, 256, 768))
QUICK_MATMUL_SHAPES = ((128, 128, 128), (256, 256, 256))
ELEMENTWISE_SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)  # float32 elements
QUICK_ELEMENTWISE_SIZES = (1 << 14, 1 << 17)
MESSAGE_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)  # bytes; dp buckets are up to 25 MiB
QUICK_MESSAGE_SIZES = (1 << 10, 16 << 10)
TINY_OPS = 200  # ops per timed chain of the per-op overhead measurements


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_time(fn: Callable[[], None], device: str, iters: int, warmup: int = 1,
                 before: Callable[[], None] = lambda: None) -> float:
    """Median seconds of ``fn`` over ``iters`` calls (after ``warmup``), device synchronised; ``before``
    runs untimed ahead of every call."""
    for _ in range(warmup):
        before()
        fn()
    times = []
    for _ in range(iters):
        before()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Bytes read and written between two calls of a memory-bound op timed cold (``cache_flush``): several
# times a server core's L2 (1-4 MiB), about what a transformer block's weights and activations at
# hidden 256 take between an activation's producer and the op that reads it in training
FLUSH_BYTES = 16 << 20


def cache_flush(device: str) -> Callable[[], None]:
    """A call that reads and writes ``FLUSH_BYTES``, leaving the inputs of the next op out of cache.

    Why: timed back to back, an add's inputs and its output (the allocator hands back the block it
    just freed) stay in cache. On the development box, 1 thread, a 786 KB add took 8 us back to back
    (96 GB/s) and 53-68 us after 8-32 MB were written (12-15 GB/s); the GPT's adds of that size ran at
    about 14 GB/s in a training profile (2 threads: 10 us hot, 40 us cold, 52 us in training), where
    other ops' data pass through the caches between an activation's producer and its reader. The hot
    figure priced the adds 3-5x too fast, and mixing hot small samples with cold large ones (past the
    caches) bent the line the rate is fitted from: relative residual 0.35 hot, 0.08-0.16 cold."""
    nbytes = FLUSH_BYTES
    if device.startswith("cuda"):  # a GPU's L2 (40-50 MB on A100/H100) is flushed by twice its size
        nbytes = max(nbytes, 2 * getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    buffer = torch.zeros(nbytes // 4, device=device)
    return lambda: buffer.add_(1.0)


def usable_cores() -> int:
    """Cores this process may run on (its affinity where the OS tells, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _compute_samples(device: str, quick: bool) -> dict:
    """Compute measurements of one rank on its own (its device, or the host's cores with the other
    ranks waiting): median seconds of single calls."""
    aten, iters, timed = torch.ops.aten, 3 if quick else 7, _median_time
    out: dict = {"matmul": {}, "elementwise": [], "other": [], "attention": [], "op_forward_s": 0.0,
                 "op_backward_s": 0.0}
    flush = cache_flush(device)

    def cold(fn, device, iters):  # each call with its inputs out of cache, as training meets them
        return _median_time(fn, device, iters, before=flush)
    for dtype in (torch.float32, torch.bfloat16):
        rows = []
        shapes = QUICK_MATMUL_SHAPES if quick else MATMUL_SHAPES
        # bf16 matmuls on CPUs without AMX run 10-30x slower than fp32: the small shapes suffice
        for m, k, n in (shapes if dtype == torch.float32 or device.startswith("cuda") else QUICK_MATMUL_SHAPES):
            x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
            weight = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
            bias = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn(m, n, device=device, dtype=dtype)

            def linear_forward_and_backward(x=x, weight=weight, bias=bias, dy=dy):
                # as the emitted program runs a linear node: the composite op with its views and
                # transposes, its autograd node and the three gradients (dX = dY·W, dW = dYᵀ·X, db),
                # each stored afresh as in a step's first micro-batch
                x.grad = weight.grad = bias.grad = None
                torch.autograd.backward(aten.linear.default(x, weight, bias), dy)
            rows.append([3 * 2.0 * m * k * n, cold(linear_forward_and_backward, device, iters)])
        out["matmul"][str(dtype).removeprefix("torch.")] = rows
    for count in (QUICK_ELEMENTWISE_SIZES if quick else ELEMENTWISE_SIZES):
        x, y = torch.randn(count, device=device), torch.randn(count, device=device)
        # an add reads two tensors and writes one (a fresh output): 3 x 4 bytes per element
        out["elementwise"].append([12.0 * count, cold(lambda x=x, y=y: aten.add.Tensor(x, y), device, iters)])
    out["other"] = other_samples(device, quick, cold, iters)
    out["attention"] = attention_samples(device, quick, timed, iters)
    out["recompute"] = recompute_sample(device, quick, timed, iters)
    out["split_backward"] = split_backward_sample(device, quick, timed, iters)
    tiny = torch.ones(8, device=device)

    def forward_chain():
        z = tiny
        for _ in range(TINY_OPS):
            z = aten.mul.Tensor(z, 1.0001)
    out["op_forward_s"] = timed(forward_chain, device, iters) / TINY_OPS
    leaf = torch.ones(8, device=device, requires_grad=True)

    def graph():
        z = leaf
        for _ in range(TINY_OPS):
            z = aten.mul.Tensor(z, 1.0001)
        return z.sum()

    def forward_and_backward():  # the backward of a chain of one-input ops: one autograd node, one gradient op each
        graph().backward()
    # forward with autograd recording plus backward, less the plain forward: the backward's per-op cost
    # (recording the graph is part of what an op costs in training, so it counts with the backward)
    out["op_backward_s"] = max(0.0, timed(forward_and_backward, device, iters) / TINY_OPS - out["op_forward_s"])
    return out


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


def _collective_call(kind: str, nbytes: int, group, size: int, group_ranks: Sequence[int], device: str):
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
    raise XirangError(f"no microbenchmark for collective {kind!r}", where="codegen/runtime/calibrate.py",
                      hint=f"known kinds: {', '.join(COLLECTIVE_KINDS)}")


CONTEXT_OPS = 40  # tiny ops every rank runs before each send measured in context
# (m, k, n) of the matmul every rank runs before each collective measured in context: about what a
# tp rank computes between two collectives at the sizes CPU development runs train at (a block's
# projection at hidden 256, 256 rows), so the peers are as busy as in training when the call starts
CONTEXT_MATMUL = (256, 256, 1024)


def _in_context_time(call: Callable[[], None], device: str, iters: int, *, kind: str) -> float:
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
    return _median_time(call, device, iters, before=ops if kind == "send" else matmul)


def _collective_samples(device: str, quick: bool, in_context: bool = False) -> dict:
    """{"kind/size": [[nbytes, median seconds on this rank], ...]} for every kind and group size;
    ``in_context``: each call after a chunk of work (``_in_context_time``), else back to back."""
    world, rank = dist.get_world_size(), dist.get_rank()
    iters = 3 if quick else 7
    out: dict = {}
    for size in group_sizes(world):
        blocks = [list(range(start, start + size)) for start in range(0, world, size)]
        groups = [dist.new_group(block) for block in blocks]  # every rank creates every group
        mine = rank // size
        group, ranks = groups[mine], blocks[mine]
        for kind in COLLECTIVE_KINDS:
            rows = []
            for nbytes in (QUICK_MESSAGE_SIZES if quick else MESSAGE_SIZES):
                call = _collective_call(kind, nbytes, group, size, ranks, device)
                if call is None:
                    break
                dist.barrier()  # every group starts together: they contend as in training
                if in_context:
                    seconds = _in_context_time(call, device, iters, kind=kind)
                else:
                    seconds = _median_time(call, device, iters)
                rows.append([float(nbytes), seconds / (2 if kind == "send" else 1)])
            if rows:
                out[f"{kind}/{size}"] = rows
    return out


MESSAGE_ROUNDS = 20  # rounds of (work, message) per size in ``_message_cpu_samples``


def _message_cpu_samples(device: str, quick: bool) -> list:
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
        message = _collective_call("send", nbytes, None, 2, pair, device)  # one each way, as the send line's
        cpu = []
        for with_message in (True, False, True, False):  # interleaved: a drift falls on both alike
            dist.barrier()
            start = time.process_time()
            for _ in range(rounds):
                torch.ops.aten.mm.default(a, b)
                _sync(device)
                if with_message:
                    message()
            cpu.append(time.process_time() - start)
        rows.append([float(nbytes), max(0.0, (cpu[0] + cpu[2] - cpu[1] - cpu[3]) / (2 * rounds))])
    return rows


def _compute_pass(rank: int, device: str, quick: bool, shared: bool) -> list:
    """One more pass of rank 0's compute samples where ranks share the host's cores (not --quick), the
    others waiting in a barrier. Why: a shared machine's speed drifts while the calibration runs. On
    the 2-core development VM the median of 7 calls of a 50 MFLOP linear, forward and backward, ranged
    672-1753 us from one half second to the next over a minute, its level rising 25% in mid-minute;
    five calibrations within an hour put the matmul's fixed cost (``Calibration.op_fixed_s``, every
    rank busy) at 0.7-2.8 ms and every mesh's predicted step 15-18% apart. The three passes (start,
    middle and end of the calibration) cover its whole window."""
    if not shared or quick:
        return []
    samples = [_compute_samples(device, quick)] if rank == 0 else []
    dist.barrier()
    return samples


def median_of_passes(passes: Sequence):
    """Each number the median of its values over the passes, lists and dicts matched item by item
    (every pass has the same shapes, sizes and keys: only the timed seconds differ)."""
    first = passes[0]
    if isinstance(first, dict):
        return {key: median_of_passes([p[key] for p in passes]) for key in first}
    if isinstance(first, (list, tuple)):
        return [median_of_passes(items) for items in zip(*passes)]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(passes)
    return first


def calibrate_rank(rank: int, world_size: int, device: str = "cpu", quick: bool = False) -> dict:
    """What one rank measures (run by ``launch`` on every rank at once)."""
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    dist.barrier()
    # rank 0 times the ops while the others wait in a barrier (only its figures are fitted); on ranks
    # sharing cores ``measure_sharing`` then times what training ranks take of each other, and
    # ``calibrated_world`` scales the one by the other. Timed in lock-step instead, a hot loop of one
    # small op ran 10-30% under its time alone on the development box, while training's mixed ops ran
    # 20-80% over it.
    shared = world_size > 1 and not device.startswith("cuda")
    passes = [_compute_samples(device, quick)] if rank == 0 else []
    dist.barrier()
    sharing = measure_sharing(device, quick, lambda: _sync(device)) if shared else None
    passes += _compute_pass(rank, device, quick, shared)
    # on shared cores (CPU ranks) a collective costs what it costs between ops; GPUs: back to back
    collectives = _collective_samples(device, quick, in_context=sharing is not None) if world_size > 1 else {}
    messages = _message_cpu_samples(device, quick) if shared else []
    passes += _compute_pass(rank, device, quick, shared)
    compute = median_of_passes(passes) if passes else None
    return {"rank": rank, "threads": torch.get_num_threads(), "cores": usable_cores(), "compute": compute,
            "sharing": sharing, "collectives": collectives, "message_cpu": messages}


def calibrate(nprocs: int, *, device: str = "cpu", backend: str | None = None, quick: bool = False,
              timeout_s: float = 900.0) -> World:
    """Run the microbenchmarks on ``nprocs`` local ranks and return the measured World."""
    from xirang.codegen.runtime.launch import launch
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    # ranks sharing busy cores can be starved for long stretches without being frozen
    results = launch(calibrate_rank, nprocs, (device, quick), backend=backend, timeout_s=timeout_s,
                     heartbeat_s=120.0)
    return calibrated_world(results, backend=backend, device=device)  # codegen/runtime/calibrated_world.py
