"""How N local ranks share the machine's cores (``xirang calibrate`` on CPU ranks): each workload timed
on rank 0 alone (the others blocked in a barrier), then on every rank at once, then on rank 0 again
beside ranks waiting in an ``irecv`` as a pipeline rank waits for its input.

Three workloads, because they share cores differently:

- **micro**: a few matmuls and a chain of tiny ops on small tensors, one op repeated in a hot loop.
  Kept in the file's raw figures, to compare with the training workload (nothing is priced from it).
- **training**, at two sizes: a stack of transformer-like blocks (layer norm, the MLP's two matmuls,
  gelu, a residual add) forward and backward through autograd, once with 1024 rows (its CPU mostly
  FLOPs) and once with 16 rows, repeated (its CPU mostly the per-op cost: dispatch, autograd nodes,
  allocation). Ranks that train evict each other's caches and predictors at every switch, and that
  costs the small ops' fixed costs far more than the FLOPs: on the 2-core development box (Intel
  Xeon, 8 processes) the 16-row stack took 1.5x the CPU together that it took alone, the 1024-row one
  1.12x, while the micro workload, repeating one hot op, showed 1.05x.

Each workload's CPU seconds are timed too (``time.process_time`` around the work alone, and on every
rank around its own share of the together-window, before it waits for the others): together / alone
CPU is how much more CPU the same work takes beside the other ranks, free of scheduling waits and
the barriers' latency. ``calibrated_world`` splits each training size's CPU into a per-call part
and a per-row part (two sizes, two unknowns), and brings the compute figures rank 0 timed alone to
every rank busy: N / C times the per-row part's together / alone CPU for the FLOP rates, N / C times
the per-call part's for the per-op fixed costs; ``parallel_ranks`` = C over the per-row part's.
Each together-window is measured less the median latency of an empty pair of barriers: on ranks
sharing cores a barrier's own latency is tens of milliseconds and varies from round to round, so
left in, it reads as ranks running slower together. CPU seconds do not see other processes loading
the machine: a calibration taken beside them prices the job as if it had the C cores to itself.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

MICRO_TINY_OPS = 200  # ops of the micro workload's chain of tiny ops
MICRO_MATMUL = (256, 256, 1024)
# (rows, hidden, blocks, repeats) of the training workload at its two sizes: rows of tokens through
# four blocks of a hidden-256 model (~20 MB of weights, gradients and activations per rank at 1024
# rows); the small one repeated so that its window holds as much work as a scheduler slice or more
TRAINING_SHAPES = {"training": (1024, 256, 4, 1), "training_small": (16, 256, 4, 16)}
QUICK_TRAINING_SHAPES = {"training": (64, 64, 2, 1), "training_small": (4, 64, 2, 2)}


def _micro_workload(device: str, quick: bool) -> Callable[[], None]:
    aten = torch.ops.aten
    m, k, n = (128, 128, 128) if quick else MICRO_MATMUL
    a, b, tiny = torch.randn(m, k, device=device), torch.randn(k, n, device=device), torch.ones(8, device=device)

    def work():
        for _ in range(2 if quick else 16):
            aten.mm.default(a, b)
        z = tiny
        for _ in range(MICRO_TINY_OPS):
            z = aten.mul.Tensor(z, 1.0001)
    return work


def _training_workload(device: str, shape: tuple) -> Callable[[], None]:
    rows, hidden, blocks, repeats = shape
    weights = [(torch.randn(4 * hidden, hidden, device=device) * hidden ** -0.5,
                torch.randn(hidden, 4 * hidden, device=device) * (4 * hidden) ** -0.5) for _ in range(blocks)]
    for up, down in weights:
        up.requires_grad_(True)
        down.requires_grad_(True)
    x = torch.randn(rows, hidden, device=device)

    def work():
        for _ in range(repeats):
            for up, down in weights:  # a fresh gradient each time, as after optimizer.zero_grad
                up.grad = down.grad = None
            h = x
            for up, down in weights:
                h = h + F.linear(F.gelu(F.linear(F.layer_norm(h, (hidden,)), up)), down)
            h.sum().backward()
    return work


def _alone_together(work: Callable[[], None], sync: Callable[[], None], rounds: int, empty_s: float,
                    token: torch.Tensor) -> dict:
    rank = dist.get_rank()
    work()  # warm-up
    sync()
    alone, together, beside_waiters, alone_cpu, together_cpu = [], [], [], [], []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            start, cpu = time.perf_counter(), time.process_time()
            work()
            sync()
            alone.append(time.perf_counter() - start)
            alone_cpu.append(time.process_time() - cpu)
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        work()
        sync()
        together_cpu.append(time.process_time() - cpu)  # this rank's own CPU, before it waits for the others
        dist.barrier()  # the last rank to finish ends the round
        together.append(time.perf_counter() - start)
        # rank 0 alone again, the others waiting in an irecv as a pipeline rank waits for its input
        # (p2p.py): if waiting costs CPU, rank 0 is slowed (``waiting_share``)
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            work()
            sync()
            beside_waiters.append(time.perf_counter() - start)
            for peer in range(1, dist.get_world_size()):
                dist.isend(token, dst=peer).wait()
        else:
            dist.irecv(token, src=0).wait()
    mean_together_cpu = torch.tensor([statistics.median(together_cpu)], dtype=torch.float64, device=token.device)
    dist.all_reduce(mean_together_cpu)  # gloo: a CPU tensor; the mean rank's CPU seconds of the work together
    return {"alone_s": statistics.median(alone) if alone else 0.0,
            "together_s": max(statistics.median(together) - empty_s, 1e-9),
            "beside_waiters_s": statistics.median(beside_waiters) if beside_waiters else 0.0,
            "alone_cpu_s": statistics.median(alone_cpu) if alone_cpu else 0.0,
            "together_cpu_s": mean_together_cpu.item() / dist.get_world_size()}


def _empty_barrier_s(pairs: int) -> float:
    """Median latency of an empty pair of barriers (what a together-window is measured less)."""
    empty = []
    for _ in range(pairs):
        dist.barrier()
        start = time.perf_counter()
        dist.barrier()
        empty.append(time.perf_counter() - start)
    return statistics.median(empty)


def training_probe(device: str, sync: Callable[[], None], rounds: int = 5) -> dict:
    """The training workload at its large size (``TRAINING_SHAPES["training"]``) timed alone and together
    exactly as ``measure_sharing`` times it, for a later comparison with a calibration's figures
    (``raw["sharing"]["training"]``): how far the host's speed has moved since. Why: on the 2-core
    development VM one pp8 step's CPU, summed over its ranks, went from 1.06 to 1.18 s within four
    minutes for the same work, and every prediction moves with it. Run on every rank at once."""
    empty_s = _empty_barrier_s(6)
    token = torch.zeros(1, device=device)
    return _alone_together(_training_workload(device, TRAINING_SHAPES["training"]), sync, rounds, empty_s, token)


def measure_sharing(device: str, quick: bool, sync: Callable[[], None]) -> dict:
    """Alone / together / beside-waiters seconds of the micro workload (top level, as files written
    before had them) and of the training workload at each size (``"training"``, ``"training_small"``,
    each with its ``rows`` and ``repeats``), and the empty barrier pair's."""
    empty_s, rounds = _empty_barrier_s(2 if quick else 6), 2 if quick else 10
    token = torch.zeros(1, device=device)
    micro = _alone_together(_micro_workload(device, quick), sync, rounds, empty_s, token)
    timed = {"barrier_s": empty_s}
    for name, shape in (QUICK_TRAINING_SHAPES if quick else TRAINING_SHAPES).items():
        timed[name] = {**_alone_together(_training_workload(device, shape), sync, rounds, empty_s, token),
                       "rows": shape[0], "repeats": shape[3]}
    return {**micro, **timed}
