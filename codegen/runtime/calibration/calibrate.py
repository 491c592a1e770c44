"""Microbenchmarks that calibrate the cost model on the machine at hand (``xirang calibrate``).

Collectives run on all N local ranks at once, as training runs them, so what ranks sharing cores
(or a PCIe switch, or a NIC) take from each other is in their figures. Compute is timed by rank 0
alone on its device, the others waiting. Where the ranks share the host's cores, both are timed in
three passes, at the start, middle and end of the calibration, each sample the median of the three
(``_compute_pass``, ``_collective_pass``: the machine's speed drifts over a calibration), and
``sharing`` times what training ranks take of each other for ``calibrated_world`` to scale
the compute by:

- compute: matmuls at training-like shapes (fp32 and bf16), each as training runs it (the linear op
  the emitted program calls, forward and backward through autograd: the forward product, both
  gradient products and the bias gradient, with the composite op's own dispatches), an elementwise add
  (memory-bound) and the non-matmul FLOPs of a transformer (gelu, layer norm, log-softmax and
  cross-entropy, each kind apart, forward and backward, at sizes up to 8 M elements: the roofline's
  ``Efficiency.other``, each kind's own rate and its bands by size, at the FLOPs the analysis counts
  for them), these three timed cold (``cache_flush``: inputs out of cache, as
  training meets them, not hot in cache as back-to-back calls leave them: on the development box, 1
  thread, a 50-100 MFLOP linear ran 20-50% faster hot than after a flush, the large ones the same),
  fused attention forward and backward at sequence lengths 128, 256 and 512 (``Efficiency.attention``
  and a line per sequence length, at the analysis's attention FLOPs), a tiny op's dispatch (the fixed per-op cost: eager
  dispatch on CPU, a kernel launch on GPU) and the backward's per-op cost (an autograd node and its
  gradient op on a tiny tensor), and a block stack with and without ``torch.utils.checkpoint`` (what a
  recomputed region costs beyond its forward). Each op is called the way emitted programs call it
  (``torch.ops.aten``).
- collectives: every kind the runtime issues, on every group size 2, 4, ... N that divides N (all
  groups of that size running at once, as the dp or tp groups of a mesh do), with the calls the
  runtime makes (all_gather/reduce_scatter as ``codegen/ops/collectives.py`` runs them, send as the
  pipeline's isend/irecv), over a few message sizes. On ranks that share cores each call follows a
  chunk of work, as in training (``collectives.in_context_time``: a matmul before a
  collective, tiny ops before a send): back-to-back calls on idle ranks answer at once, while in
  training a peer must first get a core behind the busy ranks and finish its own work. There a
  pipeline message's CPU, both sides with gloo's threads, is timed as well
  (``collectives.message_cpu_samples``): what it takes from the other ranks.

A sample's time is the median over iterations on each rank, then the slowest rank (a collective
ends when its last rank does). ``calibrated_world`` (its own module) fits the lines
(``ir/calibration.fit_line``) and builds the World the planner reads. The same code runs on GPUs
with device "cuda" and nccl; the timings synchronise the device around each timed region.
"""
from __future__ import annotations

import os
import statistics
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from xirang.codegen.runtime.calibration.collectives import collective_samples, measured_groups, message_cpu_samples
from xirang.codegen.runtime.calibration.op_classes import (attention_samples, other_samples, recompute_sample,
                                                           split_backward_sample)
from xirang.codegen.runtime.calibration.sharing import measure_sharing
from xirang.codegen.runtime.calibration.timing import median_time, sync_device
from xirang.codegen.runtime.calibration.calibrated_world import calibrated_world
from xirang.ir.world import World

# (m, k, n) of the timed matmuls: activations (micro-batch x seq rows) times weight shards of hidden
# 256..1024 models, the sizes CPU development runs train at; --quick keeps two small ones.
MATMUL_SHAPES = ((128, 256, 256), (128, 256, 768), (128, 1024, 256), (256, 256, 1024), (512, 256, 1024),
                 (1024, 1024, 256), (2048, 256, 768))
QUICK_MATMUL_SHAPES = ((128, 128, 128), (256, 256, 256))
ELEMENTWISE_SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)  # float32 elements
QUICK_ELEMENTWISE_SIZES = (1 << 14, 1 << 17)
TINY_OPS = 200  # ops per timed chain of the per-op overhead measurements


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
    aten, iters, timed = torch.ops.aten, 3 if quick else 7, median_time
    out: dict = {"matmul": {}, "elementwise": [], "other": [], "attention": [], "op_forward_s": 0.0,
                 "op_backward_s": 0.0}
    flush = cache_flush(device)

    def cold(fn, device, iters):  # each call with its inputs out of cache, as training meets them
        return median_time(fn, device, iters, before=flush)
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


def _collective_pass(device: str, quick: bool, shared: bool, groups: Sequence) -> list:
    """One more pass of every rank's collective samples where ranks share the host's cores (not
    --quick). Why: in context on shared cores one sample is a draw from a wide spread. On the 2-core
    development VM, 8 ranks, the median of 7 all-reduces of 512 KB after a matmul came out at 15.5-24.6
    ms in three passes a minute apart, and seven calibrations' lines at 512 KB 16.3-21.9 ms, while the
    same all-reduce cost 20.6-22.5 ms a call in tp8's training steps (their step with and without it)."""
    if not shared or quick:
        return []
    return [collective_samples(device, quick, groups, in_context=True)]


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
    groups = measured_groups() if world_size > 1 else []
    calls = _collective_pass(device, quick, shared, groups)
    sharing = measure_sharing(device, quick, lambda: sync_device(device)) if shared else None
    passes += _compute_pass(rank, device, quick, shared)
    # on shared cores (CPU ranks) a collective costs what it costs between ops; GPUs: back to back
    if world_size > 1:
        calls.append(collective_samples(device, quick, groups, in_context=shared))
    messages = message_cpu_samples(device, quick) if shared else []
    passes += _compute_pass(rank, device, quick, shared)
    calls += _collective_pass(device, quick, shared, groups)
    compute = median_of_passes(passes) if passes else None
    collectives = median_of_passes(calls) if calls else {}
    return {"rank": rank, "threads": torch.get_num_threads(), "cores": usable_cores(), "compute": compute,
            "sharing": sharing, "collectives": collectives, "message_cpu": messages}


def calibrate(nprocs: int, *, device: str = "cpu", backend: str | None = None, quick: bool = False,
              timeout_s: float = 900.0) -> World:
    """Run the microbenchmarks on ``nprocs`` local ranks and return the measured World."""
    from xirang.codegen.runtime.launch.launcher import launch
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    # ranks sharing busy cores can be starved for long stretches without being frozen
    results = launch(calibrate_rank, nprocs, (device, quick), backend=backend, timeout_s=timeout_s,
                     heartbeat_s=120.0)
    return calibrated_world(results, backend=backend, device=device)  # codegen/runtime/calibration/calibrated_world.py
