"""How fast each device of a mixed World computes, relative to the device the unit costs were priced on.

The tensor splits price every unit on one reference device (the device of global rank 0). A World that
mixes device kinds (nodes of A100s and of H100s, say) runs some ranks faster than that. Two facts of
each kind set its pace, from the same roofline the unit costs come from (``cost_model.compute_time``):
its sustained matmul rate (peak FLOP/s of the plan's precision times ``Efficiency.matmul``) and its
sustained memory bandwidth (datasheet bandwidth times ``Efficiency.memory``).

Speed of a kind, for one (tp, micro-batch, recompute): the units' local compute time on the reference,
T, is split into a matmul-bound part, the local FLOPs at the reference's sustained matmul rate (at most
T), and the rest, memory-bound. On kind k each part scales by the reference's rate over k's:

    T_k = T_mm · R_ref / R_k + (T - T_mm) · B_ref / B_k,      speed_k = T / T_k.

The model's units are priced together (one speed per kind, not per unit): the blocks of a transformer
share one mix of matmul and memory-bound work, so the per-unit speeds differ only in the embedding and
head. Tensor-parallel collectives, pipeline sends and offload copies are not scaled: links are priced
on their own (``cost_collectives``).

A rank group runs at its slowest member: a tp group waits for its slowest rank at every collective, so
the speed of pipeline rank r of data-parallel replica d is the least over its tp ranks.

Data-parallel shares follow speed (the seed's load balancing for heterogeneous devices): replica d's
pace is that of its slowest pipeline rank, and the global batch's micro-batches are dealt to replicas in
proportion to it, by largest remainder, each replica at least one (``shares_by_speed``); the runtime
weights each replica's gradient by its share (``Plan.dp_shares``), so training stays equal to one device.
No torch here.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from xirang.ir.device import DeviceSpec
from xirang.ir.errors import InvalidValue
from xirang.ir.world import World

from xirang.passes.planning.cost_model import pipeline_step_time


def sustained_rates(device: DeviceSpec, precision: str) -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s) the device's kernels reach at training sizes."""
    return (device.peak(precision) * device.efficiency.matmul,
            device.memory_bandwidth * device.efficiency.memory)


def kind_speed(device: DeviceSpec, reference: DeviceSpec, precision: str, *, compute_seconds: float,
               local_flops: float) -> float:
    """Speed of ``device`` relative to ``reference`` for work that took ``compute_seconds`` there,
    ``local_flops`` of it matmul FLOPs (module doc)."""
    if device == reference:
        return 1.0
    if not compute_seconds > 0:
        return 1.0  # no compute to scale: a unit of only communication runs at its links' pace
    (mm_ref, bw_ref), (mm, bw) = sustained_rates(reference, precision), sustained_rates(device, precision)
    matmul = min(compute_seconds, local_flops / mm_ref)
    on_device = matmul * mm_ref / mm + (compute_seconds - matmul) * bw_ref / bw
    return compute_seconds / on_device


def mixed_kinds(world: World) -> bool:
    """Whether the World's nodes hold more than one kind of device."""
    first = world.nodes[0].device
    return any(node.device != first for node in world.nodes)


def rank_speeds(world: World, mesh, speed_of_kind) -> tuple[tuple[float, ...], ...]:
    """speeds[d][r]: the pace of pipeline rank r of dp replica d, the slowest of its tp ranks
    (``speed_of_kind(device)``, relative to the reference). Ranks are numbered pp outermost, tp
    innermost (``Mesh.rank_of``)."""
    return tuple(tuple(min(speed_of_kind(world.device_of(mesh.rank_of(dp=d, pp=r, tp=t)))
                           for t in range(mesh.tp)) for r in range(mesh.pp)) for d in range(mesh.dp))


def shares_by_speed(paces: Sequence[float], micro_batches: int, quantum: int = 1) -> tuple[int, ...]:
    """``micro_batches`` dealt in proportion to ``paces`` in whole ``quantum``s (each replica at least
    one; the interleaved schedule runs micro-batches in groups of p), by largest remainder; ties go to
    the lower index so the answer is deterministic."""
    count = len(paces)
    if count < 1 or any(not p > 0 for p in paces):
        raise InvalidValue(f"shares_by_speed: paces must be positive, got {list(paces)}")
    if micro_batches % quantum:
        raise InvalidValue(f"shares_by_speed: {micro_batches} micro-batches are not whole groups of {quantum}")
    if quantum > 1:
        return tuple(quantum * share for share in shares_by_speed(paces, micro_batches // quantum))
    if micro_batches < count:
        raise InvalidValue(f"shares_by_speed: {micro_batches} micro-batches cannot give each of {count} "
                           f"replicas one")
    total = math.fsum(paces)
    spare = micro_batches - count  # one each first, the rest by pace
    exact = [spare * p / total for p in paces]
    shares = [1 + int(math.floor(x)) for x in exact]
    left = micro_batches - sum(shares)
    order = sorted(range(count), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in order[:left]:
        shares[i] += 1
    return tuple(shares)


def replica_paces(speeds: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Each dp replica's pace: its slowest pipeline rank's (the cuts are shared by all replicas, so
    the rank that is slowest on the reference is slowest everywhere up to its speed)."""
    return tuple(min(row) for row in speeds)


def cut_speeds(speeds: Sequence[Sequence[float]], shares: Sequence[int]) -> Optional[tuple[float, ...]]:
    """The speed per pipeline rank the stage-cut solvers see: with replica d running shares[d] of the
    micro-batches, pipeline rank r's busiest replica takes shares[d] / speeds[d][r] of the mean
    replica's time per unit of work; the cut balances that. None when every rank gets the same speed:
    a common factor does not move the cuts, so that is the homogeneous problem."""
    mean = math.fsum(shares) / len(shares)
    per_rank = tuple(min(row[r] * mean / m for row, m in zip(speeds, shares)) for r in range(len(speeds[0])))
    return None if max(per_rank) - min(per_rank) <= 1e-12 * max(per_rank) else per_rank


class WorldSpeeds:
    """The speeds, shares and slowest replica of candidates on one mixed World (``CandidatePricer``
    asks; ``units`` are its per-unit numbers of the candidate: ``compute`` per unit and ``flops`` of
    the whole model per micro-batch)."""

    def __init__(self, world: World, precision: str):
        self.world, self.precision, self.reference = world, precision, world.device_of(0)
        self._speeds, self._shares = {}, {}

    def speeds(self, c, units) -> tuple[tuple[float, ...], ...]:
        key = (c.layout, c.micro_batch, c.recompute, c.offload)
        if key not in self._speeds:
            work, flops, by_kind = math.fsum(units.compute), units.flops / c.tp, {}

            def speed_of(device: DeviceSpec) -> float:
                if device not in by_kind:
                    by_kind[device] = kind_speed(device, self.reference, self.precision,
                                                 compute_seconds=work, local_flops=flops)
                return by_kind[device]
            self._speeds[key] = rank_speeds(self.world, c.mesh, speed_of)
        return self._speeds[key]

    def shares(self, c, units) -> tuple[int, ...]:
        key = (c, id(units))
        if key not in self._shares:
            speeds = self.speeds(c, units)
            self._shares[key] = (c.num_micro_batches,) if c.dp == 1 else \
                shares_by_speed(replica_paces(speeds), c.dp * c.num_micro_batches,
                                c.pp if c.schedule == "interleaved" else 1)
        return self._shares[key]

    def cut_speeds(self, c, units) -> Optional[tuple[float, ...]]:
        per_rank = cut_speeds(self.speeds(c, units), self.shares(c, units))
        return None if per_rank is None else tuple(per_rank[i % c.pp] for i in range(c.stages))

    def slowest_replica(self, c, units, table, ranks) -> tuple[tuple[float, ...], int, list]:
        """(speed of each pipeline rank, micro-batches, each rank's time per micro-batch) of the dp
        replica whose pipeline ends last: a rank's units take their reference time less the compute
        its speed saves."""
        found = None
        for row, m in sorted(set(zip(self.speeds(c, units), self.shares(c, units)))):
            times = [math.fsum(table.stage_time(a, b) - math.fsum(units.compute[a:b]) * (1 - 1 / row[r])
                               for a, b in stages) for r, stages in enumerate(ranks)]
            end = pipeline_step_time(c.schedule, c.pp, m, max(times), c.virtual_stages, units.backward_ratio)
            if found is None or end > found[0]:
                found = (end, row, m, times)
        return found[1:]
