"""Price one candidate configuration from the per-unit costs of its tensor split (no graph, no torch).

Terms, each with its source:
- Stage time: its units' ``UnitCost.seconds(recompute)`` plus, at its outgoing cut, one forward
  activation and one backward gradient of ``cut_bytes_after`` sent point to point. Both sends are
  charged to the stage before the cut so the cut problem stays linear (``solve_stage_cuts``); every
  cut is priced on the slowest link between neighbouring pipeline ranks, so the fast cuts and the
  exact solver see the same problem.
- Step time: ``pipeline_step_time`` (Narayanan et al. 2021, eq. 1 and sec. 2.2.2) of the slowest
  device (the sum of its v chunks when interleaved; the zero-bubble schedules' bubble at the model's
  backward : forward time ratio, its B and W halves taken equal, Qi et al. 2024), plus the
  data-parallel gradient sync left after the last micro-batch's backward, and the pass that stages the
  gradients into their buckets (``dp_sync_costs``; counted as compute).
- Split backward (schedules that run B and W apart, ``ScheduleSpec.split_backward``): each unit's
  backward compute costs ``Calibration.split_backward_extra`` more than the fused one (measured by
  ``xirang calibrate``: 0.2-0.3 on CPU ranks, one autograd call per weight group after B); 0 without
  a calibration that measured it, where B + W are priced as the fused backward. A recomputed block
  runs its recompute twice there, whatever the World: B's pass over the graph recomputes it, and so
  does W's (the checkpoint's recomputed tensors do not outlive B's pass; tests/codegen/test_recompute.py).
- Ranks sharing cores (``Calibration.parallel_ranks`` k < N ranks, CPU ranks): the calibrated times
  are those of every rank busy; a rank idle in the pipeline's bubble leaves its core to the busy
  ones, which then run up to N/k times faster. The step is then the larger of the two classic
  bounds of a schedule on k processors (Brent 1974; Graham 1969): the work over the cores, which is
  m times the mean pipeline rank's busy time (every rank's work at the all-busy rate times k/N,
  over k), and the critical path at the one-rank-alone speed, the pipeline formula times k/N. With
  k << N the bubble all but vanishes; with k = N it is the pipeline formula. Where a waiting rank
  still burns CPU (``Calibration.waiting_share`` w: 0 blocks, 1 spins like compute), the bubble gives
  back only 1 - w of its time: the work bound becomes work + w · (pipeline formula - work).
- The step's own collectives (``step_sync``: the batch agreement, the loss over dp and pp), which every
  step runs besides the plan's: ``step_sync_costs``.
- Memory per device: ``plan_memory.RankMemory`` (its docstring states the parts and where each comes
  from).
- Recompute applies to blocks only; segments (embedding, head, loss) keep their activations, as
  Megatron-LM checkpoints transformer layers only.
- Activation offload ("blocks", blocks only): each block's kept activations are copied to host
  memory after its forward and back before its backward, prefetched one block ahead, over the
  device's host link (``DeviceSpec.host_link_bytes_per_s``; PCIe is full duplex, so the copy out of
  one block and the copy back of another run at once). Resident: the segments' activations times
  the micro-batches in flight, plus two blocks' (the one computing, and the one on the link) as a
  working set, whatever the number in flight. Time: a copy overlaps the neighbouring block's
  compute; what is exposed per block and micro-batch is max(0, copy - forward) going out plus
  max(0, copy - backward) coming back (the "offload" cause). Host memory is not checked.
- ZeRO (``Candidate.zero_stage`` 1 and 3): its memory in ``plan_memory``; its reduce-scatters and
  all-gathers in the dp sync (``dp_sync_costs``).
- A World mixing device kinds (``device_speeds``): compute / speed per rank, micro-batches dealt to dp
  replicas by pace (``Priced.micro_batch_shares``), the step the slowest replica's pipeline with its
  share, activations in flight those of the replica with the most micro-batches; dp sync as uniform.
- TFLOP/s per device counts hardware FLOPs as Megatron-LM does: model FLOPs plus the forward run
  again by full recompute (Narayanan et al. 2021, sec. 5.1).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Mapping

from xirang.ir.schedules import schedule_spec
from xirang.ir.world import World

from xirang.passes.planning.context_parallel_cost import NO_CONTEXT, ContextFacts, with_context_parallel
from xirang.passes.planning.cost_collectives import collective_cost
from xirang.passes.planning.cost_model import compute_time, pipeline_step_time
from xirang.passes.planning.device_speeds import WorldSpeeds, mixed_kinds
from xirang.passes.planning.dp_sync_costs import DpSyncPricer
from xirang.passes.planning.expert_costs import DEFAULT_ROUTING_IMBALANCE, with_expert_parallel
from xirang.passes.planning.plan_memory import STATE_BYTES_PER_PARAM, RankMemory
from xirang.passes.planning.plan_partition import Bounds, UnitTable
from xirang.passes.planning.plan_search_space import Candidate
from xirang.passes.planning.step_sync_costs import step_sync_seconds
from xirang.passes.planning.unit_costs import TensorSplit
from xirang.ir.errors import InvalidValue

GRAD_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # a gradient in the dtype dp reduces it in (plan.grad_reduce_dtype)
CAUSES = ("compute", "tp_comm", "ep_comm", "cp_comm", "pp_bubble", "pp_p2p", "dp_exposed", "offload", "step_sync")
MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "working_set", "buffers")  # ir/plan_parts


@dataclass(frozen=True)
class Priced:
    """A candidate with its stage cuts and what the cost model predicts for it."""

    candidate: Candidate
    bounds: Bounds  # units of each stage (half-open), pp·v stages; stage i runs on pp rank i % pp
    step_seconds: float
    breakdown: Mapping[str, float]  # seconds per step by cause, summing to step_seconds
    memory_per_rank: tuple[float, ...]  # peak bytes on a device of each pp rank
    usable_per_rank: tuple[float, ...]  # bytes the plan may use there (memory_fraction of it)
    tflops_per_device: float
    exact: bool = False  # cuts and gradient buckets priced exactly (else the search's fast estimate)
    notes: tuple[str, ...] = field(default=())
    memory_parts: tuple[Mapping[str, float], ...] = field(default=())  # per pp rank, by MEMORY_PARTS
    micro_batch_shares: tuple[int, ...] = ()  # per dp replica in a mixed World when uneven (else even)

    @property
    def fits(self) -> bool:
        return all(need <= have for need, have in zip(self.memory_per_rank, self.usable_per_rank))


@dataclass(frozen=True)
class _Units:
    """Numbers of one (tp, micro-batch, recompute), independent of the mesh, with prefix sums."""

    names: tuple[str, ...]
    seconds: tuple[float, ...]
    compute: tuple[float, ...]  # local compute, recompute included
    tp_comm: tuple[float, ...]  # tensor-parallel collectives, recompute's included
    ep_comm: tuple[float, ...]  # expert parallelism's all-to-alls, recompute's included (expert_costs.py)
    cp_comm: tuple[float, ...]  # context parallelism's exposed transfers, recompute's included
    backward: tuple[float, ...]  # what the last micro-batch's backward takes, recompute included
    static: tuple[float, ...]
    activation: tuple[float, ...]  # per micro-batch in flight (0 for an offloaded block)
    cut_bytes: tuple[float, ...]
    grads: list  # prefix sums of local parameter elements
    backward_prefix: list
    transient: float  # working set: a backward's gradients, recompute's rebuilt block, offload's two blocks
    flops: float  # hardware FLOPs of one micro-batch, the whole model
    offload: tuple[float, ...] = ()  # seconds of offload copies left exposed per micro-batch
    buffers: tuple[float, ...] = ()  # model buffer bytes (part of static)
    weight_outputs: tuple[float, ...] = ()  # bytes of weight-op outputs (their gradients wait for W)
    rebuilt: tuple[float, ...] = ()  # bytes a recompute rebuilds of each unit (0 where it keeps its activations)
    freed_by_b: tuple[float, ...] = ()  # of ``activation``, what a split backward's B frees (saved past the weights)
    backward_ratio: float = 2.0  # backward over forward time of the whole model (zero-bubble bubbles)
    recompute: str = "none"
    crossing: tuple = ()  # TensorSplit.crossing: what a stage's executor holds per micro-batch (plan_memory.py)

    def __post_init__(self):  # totals the search reads once per candidate
        object.__setattr__(self, "totals", (math.fsum(self.seconds), max(self.seconds),
                                            math.fsum(self.static), math.fsum(self.activation)))


def _unit_numbers(split: TensorSplit, recompute: str, offload: str = "none",
                  host_link: float | None = None, split_extra: float | None = None) -> _Units:
    """``split_extra``: None where the schedule fuses the backward; else the split backward's extra
    compute over the fused one, a fraction of it (0 where not measured)."""
    units = split.units
    modes = [recompute if u.name.startswith("block:") else "none" for u in units]
    # B + W beyond the fused backward: the measured extra, and W's pass recomputing the block again
    more = [0.0] * len(units) if split_extra is None else [
        split_extra * u.backward_seconds + u.recompute_seconds(mode) for u, mode in zip(units, modes)]
    again = [0.0 if split_extra is None or mode != "full" else u.tp_comm_forward_seconds  # its collectives too
             for u, mode in zip(units, modes)]
    moved = [offload != "none" and u.name.startswith("block:") for u in units]
    if any(moved) and not host_link:
        raise InvalidValue(f"offload={offload!r} needs the devices' host link (DeviceSpec.host_link_bytes_per_s)")
    compute = [u.forward_seconds + u.backward_seconds + u.recompute_seconds(mode) + x
               for u, mode, x in zip(units, modes, more)]
    tp_comm = [u.tp_comm_forward_seconds * (2 if mode == "full" else 1) + u.tp_comm_backward_seconds + a
               for u, mode, a in zip(units, modes, again)]
    ep_comm = [u.ep_comm_forward_seconds * (2 if mode == "full" else 1) + u.ep_comm_backward_seconds
               + (u.ep_comm_forward_seconds if split_extra is not None and mode == "full" else 0.0)
               for u, mode in zip(units, modes)]
    cp_comm = [u.cp_comm_forward_seconds * (2 if mode == "full" else 1) + u.cp_comm_backward_seconds
               + (u.cp_comm_forward_seconds if split_extra is not None and mode == "full" else 0.0)
               for u, mode in zip(units, modes)]
    kept = [u.activation_bytes(m) for u, m in zip(units, modes)]
    forward = [u.forward_seconds + u.tp_comm_forward_seconds for u in units]
    backward = [u.seconds(mode) - f + x + a for u, mode, f, x, a in zip(units, modes, forward, more, again)]
    copy = [k / host_link if off else 0.0 for k, off in zip(kept, moved)]
    out = [max(0.0, c - f) for c, f in zip(copy, forward)]  # the copy out of one block vs the next's forward
    back = [max(0.0, c - b) for c, b in zip(copy, backward)]  # the prefetch vs the backward before it
    backward = [b + e for b, e in zip(backward, back)]
    rebuilt_by_unit = [u.saved_bytes - u.activation_bytes(mode) if mode != "none" else 0.0
                       for u, mode in zip(units, modes)]
    rebuilt = max(rebuilt_by_unit, default=0.0)
    held = 2 * max((k for k, off in zip(kept, moved) if off), default=0.0)
    # a unit's backward turns what it saved into gradients of the same size, alive at once with them
    gradients = max((u.saved_bytes for u in units), default=0.0)
    prefix = lambda xs: list(itertools.accumulate(xs, initial=0.0))  # noqa: E731
    return _Units(
        names=tuple(u.name for u in units),
        seconds=tuple(u.seconds(m) + o + b + x + a for u, m, o, b, x, a in zip(units, modes, out, back, more, again)),
        compute=tuple(compute), tp_comm=tuple(tp_comm), ep_comm=tuple(ep_comm), cp_comm=tuple(cp_comm),
        backward=tuple(backward),
        static=tuple(u.params_local * STATE_BYTES_PER_PARAM + u.buffer_bytes for u in units),
        activation=tuple(0.0 if off else k for k, off in zip(kept, moved)),
        cut_bytes=tuple(u.cut_bytes_after for u in units[:-1]),
        grads=prefix(u.params_local for u in units), backward_prefix=prefix(backward),
        transient=rebuilt + held + gradients,
        flops=math.fsum(u.model_flops + (u.model_forward_flops if m == "full" else 0.0)
                        for u, m in zip(units, modes)),
        offload=tuple(o + b for o, b in zip(out, back)), buffers=tuple(u.buffer_bytes for u in units),
        weight_outputs=tuple(u.weight_output_bytes for u in units), rebuilt=tuple(rebuilt_by_unit),
        freed_by_b=tuple(u.saved_past_weights_bytes if mode == "none" and not off else 0.0
                         for u, mode, off in zip(units, modes, moved)),
        backward_ratio=math.fsum(backward) / math.fsum(forward) if math.fsum(forward) > 0 else 2.0,
        recompute=recompute, crossing=split.crossing)


class CandidatePricer(RankMemory):
    """Prices candidates of one model on one World; caches everything shared between candidates."""

    def __init__(self, splits: Mapping[tuple[int, int], TensorSplit], world: World, *, global_batch: int,
                 precision: str = "bf16", memory_fraction: float = 0.9, batch_inputs: int = 1,
                 routing_imbalance: float = DEFAULT_ROUTING_IMBALANCE, context: ContextFacts = NO_CONTEXT,
                 seq: int = 1, ep_overlap: bool = False, capacity_factor: float | None = None):
        """``batch_inputs``: tensors the step takes (the model's inputs), which size the batch agreement;
        ``routing_imbalance``: the most-loaded expert-parallel rank's rows over the mean (expert_costs.py);
        ``ep_overlap``: the all-to-alls priced as run under another micro-batch's compute (expert_costs.py);
        ``capacity_factor``: the experts' rows per micro-batch bounded (token dropping; None: dropless);
        ``context``: the model's attention calls, which price cp > 1 at the whole sequence ``seq``
        (``splits`` are then priced at seq / cp: context_parallel_cost.py)."""
        self.splits, self.world, self.global_batch = splits, world, global_batch
        self.context, self.seq, self.precision = context, seq, precision
        self.routing_imbalance, self.ep_overlap = routing_imbalance, ep_overlap
        self.capacity_factor = capacity_factor
        self.batch_inputs = batch_inputs
        self.grad_bytes, self.memory_fraction = GRAD_BYTES[precision], memory_fraction
        # dp buckets in a half-precision reduce dtype are a copy beside the fp32 gradients (grad_sync.py)
        self.reduce_copy_bytes = GRAD_BYTES[precision] if GRAD_BYTES[precision] < 4 else 0.0
        links = [node.device.host_link_bytes_per_s for node in world.nodes]
        self.host_link = None if None in links else min(links)  # the slowest device's link sets the pace
        self.overlap = world.calibration is None or world.calibration.comm_overlaps_compute
        parallel = world.calibration.parallel_ranks if world.calibration is not None else None
        self.shared = parallel / world.size if parallel is not None and parallel < world.size else None
        self.waiting = world.calibration.waiting_share if world.calibration is not None else 0.0
        self.split_extra = world.calibration.split_backward_extra if world.calibration is not None else 0.0
        self.uniform = world.uniform_nodes  # once: it compares every node (2048 of them for a 16k-GPU world)
        self.on_gpus = not any(node.device.is_cpu for node in world.nodes)  # AdamW's foreach step (plan_memory)
        self.devices = WorldSpeeds(world, precision) if mixed_kinds(world) else None
        self._units, self._tables, self._pairs, self._costs, self._usable = {}, {}, {}, {}, {}
        self.sync = DpSyncPricer(self)

    # --- cached pieces ---------------------------------------------------------------------------
    def _units_key(self, c: Candidate) -> tuple:
        split = self.split_extra if schedule_spec(c.schedule).split_backward else None
        experts = self.ep_group(c) if c.ep > 1 else None  # the ep group's ranks price its all-to-alls
        context = (c.cp, c.context_method, self.cp_group(c)) if c.cp > 1 else None
        return c.tp, c.micro_batch, c.recompute, c.offload, split, experts, context

    def split_of(self, c: Candidate) -> TensorSplit:
        """The tensor split of ``c``'s (tp, micro-batch), re-priced for its ep (expert_costs.py)."""
        split = self.splits[(c.tp, c.micro_batch)]
        if c.cp > 1:
            return self._context_split(c, split)
        if c.ep == 1:
            return split
        group = self.ep_group(c)
        key = ("experts", c.tp, c.micro_batch, group)  # one re-pricing whatever the recompute, offload, schedule
        if key not in self._pairs:
            self._pairs[key] = with_expert_parallel(split, c.ep, lambda nbytes: self.cost("all_to_all", nbytes, group),
                                                    self.routing_imbalance, overlap=self.ep_overlap,
                                                    capacity_factor=self.capacity_factor)
        return self._pairs[key]

    def _context_split(self, c: Candidate, split: TensorSplit) -> TensorSplit:
        """The split at seq / cp re-priced for one rank of ``c``'s cp group (context_parallel_cost.py)."""
        group = self.cp_group(c)
        key = ("context", c.tp, c.micro_batch, c.cp, c.context_method, group)
        if key not in self._pairs:
            self._pairs[key] = with_context_parallel(
                split, cp=c.cp, method=c.context_method, calls=self.context.calls, seq=self.seq,
                dtype_bytes=self.grad_bytes, group=group, cost=self.cost,
                attention_seconds=lambda flops: compute_time(flops, 0.0, self.world.nodes[0].device,
                                                             self.precision, is_attention=True))
        return self._pairs[key]

    def cp_group(self, c: Candidate) -> tuple[int, ...]:
        """Rank 0's cp group, which prices every cp group's transfers (their shapes are alike)."""
        key = ("cp", c.layout)
        if key not in self._pairs:
            self._pairs[key] = c.mesh.group("cp", 0)
        return self._pairs[key]

    def ep_group(self, c: Candidate) -> tuple[int, ...]:
        """Rank 0's ep group, which prices every ep group's all-to-alls (in a World of one kind of node,
        all have its shape); many meshes share it, and so their units' prices."""
        key = ("ep", c.layout)
        if key not in self._pairs:
            self._pairs[key] = c.mesh.group("ep", 0)
        return self._pairs[key]

    def units(self, c: Candidate) -> _Units:
        key = self._units_key(c)
        if key not in self._units:
            self._units[key] = _unit_numbers(self.split_of(c), c.recompute, c.offload, self.host_link, key[4])
        return self._units[key]

    def table(self, c: Candidate) -> UnitTable:
        pair = self._slowest_pair(c)
        saved = self.state_saving_per_param(c)
        key = (*self._units_key(c), pair, saved)
        if key not in self._tables:
            n = self.units(c)
            # a forward activation and a backward gradient cross each cut. On shared cores what a message
            # costs is its CPU, both sides, taken from the cores the others compute on: measured
            # (Calibration.pipeline_message_s), else taken as the receiver spending about what the sender
            # does, twice its wall time (gloo over loopback: 0.2-0.4 ms a side for 4 KB-1 MB on the
            # 2-core box, back to back)
            calibration = self.world.calibration  # there is one wherever ranks share cores
            if self.shared is not None and calibration.pipeline_message_s is not None:
                cuts = tuple(2 * calibration.pipeline_message_seconds(nbytes) for nbytes in n.cut_bytes)
            else:
                transfers = 2 if self.shared is None else 4
                cuts = tuple(transfers * self.cost("send", nbytes, pair) for nbytes in n.cut_bytes)
            static = n.static if not saved else tuple(
                s - saved * (n.grads[i + 1] - n.grads[i]) for i, s in enumerate(n.static))
            self._tables[key] = UnitTable(n.seconds, static, n.activation, cuts)
        return self._tables[key]

    def _slowest_pair(self, c: Candidate) -> tuple[int, ...]:
        """Global ranks of the neighbouring pipeline ranks joined by the slowest link."""
        key = (c.layout, c.virtual_stages > 1)  # chunks wrap from the last rank to rank 0
        if key not in self._pairs:
            mesh = c.mesh
            ranks = [mesh.rank_of(dp=0, pp=r, tp=0, cp=0) for r in range(c.pp)]
            pairs = list(zip(ranks, ranks[1:])) + ([(ranks[-1], ranks[0])] if key[1] else [])
            crossing = [pair for pair in pairs if not self.world.same_node(*pair)]
            self._pairs[key] = (crossing or pairs or [(0,)])[0]
        return self._pairs[key]

    def cost(self, kind: str, nbytes: float, group: tuple[int, ...]) -> float:
        key = (kind, nbytes, group)
        if key not in self._costs:
            self._costs[key] = collective_cost(kind, nbytes, group, self.world).seconds
        return self._costs[key]

    def dp_group(self, c: Candidate, rank: int) -> tuple[int, ...]:
        """The dp group of pipeline rank ``rank`` (tp index 0); in a world of identical nodes every
        pipeline rank's group has the same shape, so rank 0's stands for all."""
        rank = 0 if self.uniform else rank
        key = ("dp", c.layout, rank)
        if key not in self._pairs:  # under cp the gradients are summed over dp x cp: edp at ep 1 (ir/mesh.py)
            self._pairs[key] = c.mesh.group("edp" if c.cp > 1 else "dp", c.mesh.rank_of(dp=0, pp=rank, tp=0, cp=0))
        return self._pairs[key]

    def step_sync(self, c: Candidate) -> float:
        """Seconds of the step's own collectives (``step_sync_costs``), once per mesh."""
        key = ("step_sync", c.layout)
        if key not in self._costs:
            self._costs[key] = step_sync_seconds(c, self.batch_inputs, self.cost)
        return self._costs[key]

    # --- a World of mixed device kinds (``device_speeds.WorldSpeeds``) ---------------------------
    def speeds(self, c: Candidate):
        """speeds[d][r] of pipeline rank r of dp replica d, or None in a World of one device kind."""
        return self.devices.speeds(c, self.units(c)) if self.devices else None

    def micro_batch_shares(self, c: Candidate) -> tuple[int, ...]:
        """Micro-batches of each dp replica per step: by pace in a mixed World, else even."""
        return self.devices.shares(c, self.units(c)) if self.devices else (c.num_micro_batches,) * c.dp

    def cut_speeds(self, c: Candidate):
        """Speed of each of the pp·v stages for the cut solvers, or None when all are 1."""
        return self.devices.cut_speeds(c, self.units(c)) if self.devices else None

    def _most_micro_batches(self, c: Candidate) -> int:
        return max(self.micro_batch_shares(c)) if self.devices else c.num_micro_batches

    def _slowest_replica(self, c: Candidate, table: UnitTable, ranks) -> tuple[tuple[float, ...], int, list]:
        """(speed of each pipeline rank, micro-batches, each rank's time per micro-batch) of the dp
        replica whose pipeline ends last (a uniform World's one answer)."""
        if not self.devices:
            return (1.0,) * c.pp, c.num_micro_batches, [math.fsum(table.stage_time(a, b) for a, b in stages)
                                                         for stages in ranks]
        return self.devices.slowest_replica(c, self.units(c), table, ranks)

    # --- estimates -----------------------------------------------------------------------------
    def lower_bound(self, c: Candidate) -> float:
        """A step time no cut can beat: perfectly balanced stages, no sends, no exposed dp sync."""
        total, longest, _, _ = self.units(c).totals
        m = c.num_micro_batches
        if self.devices:  # no rank beats the fastest device; the replica with the most micro-batches ends no sooner
            fastest = max(map(max, self.speeds(c)))
            total, longest, m = total / fastest, longest / fastest, max(self.micro_batch_shares(c))
        device = max(longest, total / c.pp)  # the busiest device holds at least the mean share
        bound = pipeline_step_time(c.schedule, c.pp, m, device, c.virtual_stages, self.units(c).backward_ratio)
        if self.shared is not None:  # the two bounds of ``price`` on shared cores, at their least
            return max(c.num_micro_batches * total / c.pp, bound * self.shared)
        return bound

    def price(self, c: Candidate, bounds: Bounds, *, exact: bool = False, notes=()) -> Priced:
        """Step time, breakdown, memory and TFLOP/s of ``c`` cut at ``bounds``. ``exact`` prices the
        dp sync bucket by bucket; otherwise by a closed form for gradients produced at an even rate."""
        n, table = self.units(c), self.table(c)
        v = c.virtual_stages
        ranks = [[bounds[i] for i in range(r, c.stages, c.pp)] for r in range(c.pp)]
        # A device runs all its chunks for every micro-batch, so the busiest device (the sum of its
        # v chunks, not v times the slowest chunk) sets the pace of the pipeline.
        speed, m, rank_times = self._slowest_replica(c, table, ranks)
        worst = max(range(c.pp), key=rank_times.__getitem__)
        compute = math.fsum(math.fsum(n.compute[a:b]) for a, b in ranks[worst]) / speed[worst]
        tp_comm = math.fsum(math.fsum(n.tp_comm[a:b]) for a, b in ranks[worst])
        ep_comm = math.fsum(math.fsum(n.ep_comm[a:b]) for a, b in ranks[worst])
        cp_comm = math.fsum(math.fsum(n.cp_comm[a:b]) for a, b in ranks[worst])
        offload = math.fsum(math.fsum(n.offload[a:b]) for a, b in ranks[worst])
        send = math.fsum(table.cut_seconds[b - 1] for a, b in ranks[worst] if b < table.units)
        t_device = rank_times[worst]
        pipeline = pipeline_step_time(c.schedule, c.pp, m, t_device, v, n.backward_ratio)
        busy = 1.0  # share of the busiest rank's own time the step shows (below 1 only on shared cores)
        if self.shared is not None:  # ranks share cores: Brent's bounds (module docstring)
            work = m * math.fsum(rank_times) / c.pp
            pipeline = max(work + self.waiting * max(0.0, pipeline - work), pipeline * self.shared)
            busy = min(1.0, pipeline / (m * t_device)) if t_device else 1.0
        sync = self.sync.exact if exact else self.sync.estimate
        dp_exposed = max(sync(c, r, stages) for r, stages in enumerate(ranks)) if c.dp * c.cp > 1 else 0.0
        staging = max(self.sync.staging(c, stages) for stages in ranks)  # gradients into their buckets, once
        breakdown = {"compute": busy * m * compute + staging, "tp_comm": busy * m * tp_comm,
                     "ep_comm": busy * m * ep_comm, "cp_comm": busy * m * cp_comm,
                     "pp_bubble": max(0.0, pipeline - m * t_device), "pp_p2p": busy * m * send,
                     "dp_exposed": dp_exposed, "offload": busy * m * offload, "step_sync": self.step_sync(c)}
        step = pipeline + staging + dp_exposed + breakdown["step_sync"]
        in_flight = self.in_flight_by_rank(c, self._most_micro_batches(c))
        waiting = self.waiting_for_w(c)
        parts = tuple(self._parts(c, stages, in_flight[r], waiting[r], r) for r, stages in enumerate(ranks))
        memory = tuple(math.fsum(rank.values()) for rank in parts)  # the parts are the rank's whole peak
        flops = n.flops * self.global_batch / c.micro_batch * c.cp  # each rank of a cp group computes 1/cp of it
        return Priced(c, tuple(bounds), step, breakdown, memory, self.usable(c),
                      flops / step / self.world.size / 1e12 if step else 0.0, exact, tuple(notes),
                      parts,
                      self._uneven_shares(c))

    def _uneven_shares(self, c: Candidate) -> tuple[int, ...]:
        shares = self.micro_batch_shares(c)
        return shares if len(set(shares)) > 1 else ()

