"""Memory per pipeline rank of one candidate: what the runtime holds at the step's peak, part by part.

The formulation (each part measured by name on the real program by ``xirang check``, codegen/check/):
- Model state (``state_bytes``, ``cost_model.runtime_state_bytes``): fp32 weights 4, fp32 gradients 4 and
  AdamW's two moments 8 bytes per local parameter; ZeRO-1/3 keep the moments of their 1/dp slice and the
  slice itself with its norm mask (5/dp). Where dp > 1 reduces in half precision, the buckets' copy of the
  gradients (2 bytes) is made after the last backward, when activations and working set are gone, so it
  adds only what it exceeds them by (``reduce_copy_excess``). Under interleaving each of the v chunks is
  reduced after its own last backward, while the chunks after it still run theirs: each chunk's copy is
  counted from that moment on, beside what the other chunks then hold (``chunk_peaks``; the dry run of
  Llama-3-405B's interleaved v=4 plan held 4.4 of its 6.0 GiB at the peak, while Llama-2-70B's planned
  plan peaks in its steady state, before any chunk's last backward, and held none there).
- Activations: each unit's saved bytes times the micro-batches in flight on that rank
  (``in_flight_by_rank``, the schedule's closed form), plus what each stage's executor keeps per micro-batch
  beyond them (``stage_held``): the outputs it sends that take a gradient (held for the backward) and, under
  full recompute, what it receives that no block of it counts as its input (a rotary table every block
  reads, counted once in the model's first reader; sent and kept in fp32 in a bf16 program). The dry run of
  Llama-3-405B's interleaved full-recompute plan held 104 MiB per micro-batch of a two-layer chunk where its
  blocks' inputs are 64 (1.53 GiB per rank against 1.00 priced). Under interleaving the rank's chunks do
  not hold equal numbers at its peak (the last stage, head and loss, runs each backward right after its forward:
  one micro-batch, while the rank's other chunks hold p each), so its activations are the most, over the
  moments of its own actions (``chunk_peaks``), of each chunk's bytes times what that chunk holds then
  (the closed form's total when the chunks keep equal bytes; the dry run of Llama-3-405B's planned
  interleaved plan held 1.5 GiB of activations on its last rank where the closed form priced 10.5). A
  chunk's fp32 gradients are counted from its first backward on (``chunk_peaks``' middle flags: ``.grad`` is
  made there and freed by the step's ``zero_grad``): with as many micro-batches as pipeline ranks an
  interleaved rank runs every forward first, its activations' most before any gradient exists.
  Under a split backward a micro-batch past its B keeps all but what the ops past its stage's last weight op
  save (a loss after the head's matmul: ``freed_by_b``), so a rank whose last stage holds such bytes is priced
  at the most, over the moments of its actions (``split_moments``), of (micro-batches before their B) x the
  stage's bytes + (micro-batches between B and W) x the rest: Qwen3-30B-A3B's last pipeline rank at dp8 pp4
  ep8 zb-h1 held 0.9 GiB of activations at its peak in the dry run, where four micro-batches priced whole,
  their loss's logits among them, gave 10.2.
- Working set: the largest unit's saved activations (its backward's gradients of the same size), the
  largest block that recompute rebuilds, offload's two blocks; and under a split backward the gradients
  of the weight-op outputs (``UnitCost.weight_output_bytes``) of every micro-batch whose B has run and
  whose W has not, counted on the schedule's own actions (``waiting_for_w``: r + 1 on rank r of ZB-H1;
  none on the first stage, whose B makes no input gradient); with full recompute, every block of the
  chunk rebuilt at once during W, not one (``_w_rebuilt``).
- Half-precision weight gradients at the end of a whole backward: a half-precision program casts each
  weight at the top of its stage (passes/lowering/precision.py), so the casts' backward nodes have the
  stage's lowest autograd sequence numbers and the engine runs them last; until then every weight's
  half-precision gradient of the stage is held (``cast_gradients``: ``grad_bytes`` per local parameter of
  the chunk, measured by ``xirang check`` as the working set "backward" on GPT-3 175B's first stage). By
  then the micro-batch's own activations of the chunk are freed, so only what the gradients exceed them
  by counts. A split backward's W goes one weight at a time: only the first stage, whose W is its whole
  backward, holds them.
- Buffers: the model's, whole.
- A forward's start in a half-precision program: the precision pass casts every weight of the stage at its top
  (passes/lowering/precision.py), so a forward begins holding the half-precision copy of all of them, beside the
  other micro-batches' activations and the output gradients waiting for W, though not beside a backward's
  working set; where that moment holds more, the excess is counted in "working_set" (``forward_cast_excess``;
  the dry run names it "weight_casts"): Llama-2-70B at dp8 pp16 cp4 tp2 zb-h1 held 3.9 GiB of them at the
  peak of pipeline ranks 1-15, 5-8% above the price that left them out.
- The optimizer step, after the backwards: the model state and, on a GPU, one temporary the size of one AdamW
  moment (torch's foreach path takes the square root of every second moment at once; a CPU's per-tensor path
  one weight's at a time, nothing to count). Where that moment is more than the backward's peak, the excess is
  counted in "optimizer" (``step_excess``): a bf16 Llama at seq 8 and pp 2 peaks in the step on pipeline rank 1
  in the dry run (2,103 KiB, priced 2,086; its backward's peak, what was priced before, is 1,803).
``RankMemory`` is a part of ``plan_costs.CandidatePricer`` (which gives it ``units``, ``_costs``,
``_usable``, ``world``, ``on_gpus``, ``memory_fraction``, ``reduce_copy_bytes`` and ``_most_micro_batches``).
"""
from __future__ import annotations

import math
import operator

from xirang.ir.schedules import Backward, BackwardInput, BackwardWeight, Forward, build_schedule, schedule_spec
from xirang.passes.planning.cost_model import runtime_state_bytes
from xirang.passes.planning.plan_search_space import Candidate, in_flight_by_rank

STATE_BYTES_PER_PARAM = runtime_state_bytes(1).total  # 16 without ZeRO: fp32 weight, gradient, AdamW's two moments


def most_waiting_for_w(actions) -> int:
    """The most micro-batches at once in one rank's ``actions`` whose BackwardInput ran and whose
    BackwardWeight has not."""
    done_b: set = set()
    done_w: set = set()
    most = 0
    for action in actions:
        if isinstance(action, BackwardInput):
            done_b.add((action.stage, action.micro_batch))
        elif isinstance(action, BackwardWeight):
            done_w.add((action.stage, action.micro_batch))
        most = max(most, len(done_b) - len(done_w))
    return most


def split_moments(actions) -> tuple[tuple[int, int], ...]:
    """The moments of one rank's ``actions`` (one stage) at which its activations can peak under a split backward:
    each (micro-batches whose Forward ran and whose BackwardInput has not ended, micro-batches whose
    BackwardInput ran and whose BackwardWeight has not ended), taken after every forward and during every
    backward, the pareto front of them (``pareto_front``)."""
    before_b = after_b = 0
    moments = set()
    for action in actions:
        if isinstance(action, Forward):
            before_b += 1
        elif isinstance(action, BackwardInput):
            moments.add((before_b, after_b))  # during it: its micro-batch still whole
            before_b, after_b = before_b - 1, after_b + 1
        elif isinstance(action, BackwardWeight):
            moments.add((before_b, after_b))
            after_b -= 1
        elif isinstance(action, Backward):
            moments.add((before_b, after_b))
            before_b -= 1
        else:
            continue
        moments.add((before_b, after_b))
    return pareto_front(moments)


def chunk_peaks(actions) -> tuple[tuple[int, ...], ...]:
    """The moments of one rank's ``actions`` at which its memory can peak, over its v stages (in increasing
    order): each a vector of the micro-batches in flight on each stage, then 1 for each stage whose first
    backward has run (its weights' gradients made), then 1 for each stage whose last backward has run (its
    gradients' reduce copy made), else 0. Taken after every forward and during every backward (its own
    micro-batch still in flight, its gradients made), and after every stage's last backward, keeping only the
    moments no other moment matches or exceeds everywhere: whatever bytes each stage keeps per micro-batch,
    holds in gradients and copies, the rank's peak is at one of them. A micro-batch is in flight on a stage
    from its Forward until the action ending its backward (Backward, or W of a split one)."""
    stages = sorted({action.stage for action in actions if isinstance(action, Forward)})
    remaining = {stage: sum(1 for a in actions if isinstance(a, Forward) and a.stage == stage) for stage in stages}
    live = dict.fromkeys(stages, 0)
    started = dict.fromkeys(stages, 0)
    moments = set()

    def moment():
        return (tuple(live[stage] for stage in stages) + tuple(started[stage] for stage in stages)
                + tuple(int(not remaining[stage]) for stage in stages))

    for action in actions:
        if isinstance(action, Forward):
            live[action.stage] += 1
        elif isinstance(action, (Backward, BackwardInput, BackwardWeight)):
            started[action.stage] = 1
            moments.add(moment())  # during it: its micro-batch's activations beside the gradients it makes
            if isinstance(action, BackwardInput):
                continue
            live[action.stage] -= 1
            remaining[action.stage] -= 1
            if remaining[action.stage]:
                continue
        else:
            continue
        moments.add(moment())
    return pareto_front(moments)


def pareto_front(moments) -> tuple:
    """The vectors of ``moments`` (distinct, of one length) that no other one matches or exceeds everywhere, in
    increasing order. Taken by decreasing sum, a vector can be dominated only by one kept before it."""
    kept: list = []
    for vector in sorted(moments, key=sum, reverse=True):
        if not any(all(map(operator.ge, other, vector)) for other in kept):
            kept.append(vector)
    return tuple(sorted(kept))


class RankMemory:
    """The memory half of ``CandidatePricer`` (module docstring)."""

    def state_saving_per_param(self, c: Candidate) -> float:
        """Bytes per local parameter below the 16 of ``STATE_BYTES_PER_PARAM`` at the peak
        (``runtime_state_bytes``): ZeRO's other dp ranks' optimizer state, less the fp32 slice the optimizer
        steps, less the half-precision copy of the gradients dp reduces (negative where that is more)."""
        return STATE_BYTES_PER_PARAM - self.state_bytes(1, c).total

    def state_bytes(self, params: float, c: Candidate):
        """``runtime_state_bytes`` of ``params`` local parameters under ``c``, through the forwards and
        backwards (the dp buckets' copy of the gradients comes after them: ``reduce_copy_excess``)."""
        return runtime_state_bytes(params, dp=c.dp, zero_stage=c.zero_stage)

    def reduce_copy(self, c: Candidate, params: float) -> float:
        """Bytes of the dp buckets' half-precision copy of ``params`` local parameters' gradients (0 without
        one: fp32 reduction, or no dp)."""
        with_copy = runtime_state_bytes(params, reduce_copy_bytes=self.reduce_copy_bytes if c.dp * c.cp > 1 else 0.0)
        return with_copy.grads - runtime_state_bytes(params).grads

    def reduce_copy_excess(self, c: Candidate, params: float, during: float) -> float:
        """What the dp buckets' half-precision copy of one chunk's gradients adds to a rank's peak: it is made
        once its last backward staged them, when the activations and working set (``during``) are gone, so
        only what it exceeds them by (interleaved ranks: ``chunk_peaks``)."""
        return max(0.0, self.reduce_copy(c, params) - during)

    def usable(self, c: Candidate) -> tuple[float, ...]:
        """Bytes the plan may use on the devices of each pipeline rank (the smallest of them)."""
        key = c.layout
        if key not in self._usable:
            if self.uniform:
                least = [self.world.nodes[0].device.memory_bytes] * c.pp
            else:
                mesh = c.mesh
                least = [min(self.world.device_of(mesh.rank_of(dp=d, pp=r, tp=t, cp=k)).memory_bytes
                             for d in range(c.dp) for t in range(c.tp) for k in range(c.cp)) for r in range(c.pp)]
            self._usable[key] = tuple(self.memory_fraction * b for b in least)
        return self._usable[key]

    def in_flight(self, c: Candidate) -> list[float]:
        """Micro-batches in flight of each of the pp·v stages (stage i runs on pp rank i % pp)."""
        by_rank = self.in_flight_by_rank(c, self._most_micro_batches(c))
        return [by_rank[i % c.pp] for i in range(c.stages)]

    @staticmethod
    def in_flight_by_rank(c: Candidate, m: int) -> tuple[float, ...]:
        """Micro-batches of activations each pipeline rank holds at its peak (the schedule's figure)."""
        return in_flight_by_rank(c.schedule, c.pp, m, c.virtual_stages)

    def waiting_for_w(self, c: Candidate) -> tuple[int, ...]:
        """Per pipeline rank, the most micro-batches whose B has run and whose W has not, read off the
        schedule's own actions (0 where the backward is not split): the runtime keeps, for each, the
        gradients of its stage's weight-op outputs (codegen/runtime/executor/split_backward.py)."""
        if not schedule_spec(c.schedule).split_backward:
            return (0,) * c.pp
        return self._per_pipeline_rank(c, most_waiting_for_w)

    def chunk_peaks(self, c: Candidate) -> tuple:
        """Per pipeline rank, ``chunk_peaks`` of its actions in the schedule of ``c`` (None without
        interleaving, where the closed form is the schedule's figure)."""
        if c.virtual_stages == 1:
            return (None,) * c.pp
        return self._per_pipeline_rank(c, chunk_peaks)

    def _per_pipeline_rank(self, c: Candidate, figure) -> tuple:
        """``figure(actions)`` of each pipeline rank's actions in the schedule of ``c``, remembered per
        schedule shape (the schedule itself built once for every figure read off it)."""
        m = self._most_micro_batches(c)
        shape = (c.schedule, c.pp, m, c.virtual_stages)
        key = (figure.__name__, *shape)
        if key not in self._costs:
            if ("schedule", *shape) not in self._costs:
                self._costs[("schedule", *shape)] = build_schedule(*shape, communication=False)
            self._costs[key] = tuple(figure(actions) for actions in self._costs[("schedule", *shape)].ranks)
        return self._costs[key]

    def stage_held(self, c: Candidate, a: int, b: int) -> float:
        """Bytes one micro-batch in flight on the stage of units [a, b) keeps beyond its units' own activations
        (module docstring): the outputs it sends that take a gradient (the executor holds them for the
        backward), and under full recompute the tensors it receives that no block of it counts as its input
        (a rotary table or mask every block reads, counted once in the model's first reader)."""
        n = self.units(c)
        key = ("stage_held", self._units_key(c), a, b)
        if key not in self._costs:
            full = n.recompute == "full"
            held = []
            for nbytes, first, last, readers, grad in n.crossing:
                inside = [r for r in readers if a <= r < b and r != first]
                if a <= first < b <= last:  # made here and sent on
                    counted = full and any(n.names[r].startswith("block:") for r in inside)
                    if grad and not counted:
                        held.append(nbytes)
                elif full and first < a <= last and (grad or inside):  # received and kept
                    entering = min((r for r in readers if r != first), default=None)
                    if entering is None or not (a <= entering < b and n.names[entering].startswith("block:")):
                        held.append(nbytes)
            self._costs[key] = math.fsum(held)
        return self._costs[key]

    def _w_gradients(self, c: Candidate, stages) -> float:
        """Bytes of weight-op output gradients one micro-batch keeps from B to W on a rank's ``stages`` (the
        first stage keeps none: its B has no input gradient to make, W is its whole backward)."""
        n = self.units(c)
        return math.fsum(math.fsum(n.weight_outputs[a:b]) for a, b in stages if a > 0)

    def freed_by_b(self, c: Candidate, stages) -> float:
        """Bytes of one micro-batch's activations on a rank's (single) stage that a split backward's B frees: what
        the ops past the stage's last weight op save (the loss after the head's matmul), which W never reads
        (torch's stage_backward_input detaches the stage's outputs). Counted for the stage's last unit only: an
        earlier unit's are read by the weight ops after it. 0 for an interleaved rank (``chunk_peaks``)."""
        n = self.units(c)
        if len(stages) != 1 or not n.freed_by_b or not schedule_spec(c.schedule).split_backward:
            return 0.0
        (_, b), = stages
        return n.freed_by_b[b - 1]

    def _w_rebuilt(self, c: Candidate, stages) -> float:
        """What a split backward's W rebuilds beyond the one block the working set holds already: W's calls share
        one recompute of each block of the chunk (codegen/runtime/executor/split_backward.py), and each block's
        rebuilt tensors that W never reads (all but the weight ops' inputs) stay until W ends, so the chunk's
        blocks are held at once, not one after the other. Counted where B runs before W; the first stage's W
        is its whole backward. (Qwen3-30B-A3B at dp8 pp4 ep8 zb-h1 on H100, pipeline ranks 1 and 2: the dry
        run's working set 18.1 and 20.9 GiB, priced 10.3 and 13.0 with one block rebuilt.)"""
        n = self.units(c)
        if n.recompute != "full" or not n.rebuilt:
            return 0.0
        most = max(n.rebuilt)  # in ``transient`` already
        return max([math.fsum(n.rebuilt[a:b]) - most for a, b in stages if a > 0] + [0.0])

    def cast_gradients(self, c: Candidate, stages) -> float:
        """What the half-precision weight gradients held at the end of a whole backward add to a rank's
        working set: the most, over its chunks that run one, by which they exceed that chunk's activations of
        one micro-batch (module docstring)."""
        if self.grad_bytes >= 4:
            return 0.0
        n = self.units(c)
        split = schedule_spec(c.schedule).split_backward
        return max([self.grad_bytes * (n.grads[b] - n.grads[a]) - math.fsum(n.activation[a:b])
                    for a, b in stages if not split or a == 0] + [0.0])

    def stage_caps(self, c: Candidate, per_chunk: bool) -> list[float]:
        """Memory caps of the pp·v stages: the rank's usable bytes less the recompute working set,
        divided among its chunks when ``per_chunk`` (a conservative split for interleaving)."""
        usable, transient = self.usable(c), self.units(c).transient
        share = c.virtual_stages if per_chunk else 1
        return [(usable[i % c.pp] - transient) / share for i in range(c.stages)]

    def memory_lower_bound(self, c: Candidate) -> float:
        """Bytes the average pipeline rank needs at least, so the fullest one too."""
        n = self.units(c)
        _, _, static, activation = n.totals
        fewest = min(self.in_flight_by_rank(c, c.num_micro_batches))
        static -= self.state_saving_per_param(c) * n.grads[-1]
        return (static + activation * fewest) / c.pp + n.transient

    def _parts(self, c: Candidate, stages, in_flight: float, waiting: int = 0,
               rank: int | None = None) -> dict[str, float]:
        """One pipeline rank's memory by ``MEMORY_PARTS`` (summing to its ``memory_per_rank``); ``rank``: its
        pipeline rank, where interleaving prices each chunk at what it holds (module docstring)."""
        n = self.units(c)
        params = math.fsum(n.grads[b] - n.grads[a] for a, b in stages)
        buffers = math.fsum(math.fsum(n.buffers[a:b]) for a, b in stages)
        chunks = [math.fsum(n.activation[a:b]) + self.stage_held(c, a, b) for a, b in stages]
        state = self.state_bytes(params, c)
        working = n.transient + waiting * self._w_gradients(c, stages) + self.cast_gradients(c, stages) \
            + (self._w_rebuilt(c, stages) if waiting else 0.0)
        peaks = self.chunk_peaks(c)[rank] if rank is not None else None
        if peaks and all(len(peak) == 3 * len(chunks) for peak in peaks):
            # each chunk's activations at what it holds, its gradients from its first backward on, its reduce
            # copy from its last backward on (module docstring)
            v = len(chunks)
            made = [self.state_bytes(n.grads[b] - n.grads[a], c).grads for a, b in stages]
            copies = [self.reduce_copy(c, n.grads[b] - n.grads[a]) for a, b in stages]
            during = [m for m in peaks if not all(m[2 * v:])] or peaks  # the end (every copy made): the last term
            peak = max(during, key=lambda m: math.fsum(k * x for k, x in zip(m, chunks + made + copies)))
            activations = math.fsum(k * x for k, x in zip(peak[:v], chunks))
            held = math.fsum(k * x for k, x in zip(peak[v:], made + copies))
            gradients = held + max(0.0, math.fsum(made + copies) - held - activations - working)
        else:
            activations = math.fsum(chunks) * in_flight
            freed = self.freed_by_b(c, stages)
            if freed > 0 and rank is not None:  # a micro-batch past its B keeps all but that (module docstring)
                activations = min(activations, max(
                    before * chunks[0] + after * (chunks[0] - freed)
                    for before, after in self._per_pipeline_rank(c, split_moments)[rank]))
            gradients = state.grads + self.reduce_copy_excess(c, params, activations + working)
        parts = {"parameters": state.params, "gradients": gradients, "optimizer": state.optimizer,
                 "activations": activations, "working_set": working, "buffers": buffers}
        parts["working_set"] += self.forward_cast_excess(c, stages, parts, max(chunks),
                                                         waiting * self._w_gradients(c, stages))
        parts["optimizer"] += self.step_excess(state, buffers, math.fsum(parts.values()))
        return parts

    def forward_cast_excess(self, c: Candidate, stages, parts: dict, one: float, waiting_gradients: float) -> float:
        """What a forward's start holds beyond the rank's backward peak (``parts``) in a half-precision program: the
        half-precision copy of every weight of its largest chunk, made at the top of the stage (module docstring),
        beside the model state, the other micro-batches' activations (all but ``one`` micro-batch's bytes) and the
        output gradients waiting for W (``waiting_gradients``), not beside a backward's working set."""
        if self.grad_bytes >= 4:
            return 0.0
        n = self.units(c)
        casts = self.grad_bytes * max(n.grads[b] - n.grads[a] for a, b in stages)
        forward = (parts["parameters"] + parts["gradients"] + parts["optimizer"] + parts["buffers"]
                   + max(0.0, parts["activations"] - one) + waiting_gradients + casts)
        return max(0.0, forward - math.fsum(parts.values()))

    def step_excess(self, state, buffers: float, backward_peak: float) -> float:
        """What the optimizer step's moment holds beyond ``backward_peak`` (module docstring): the model state
        (``state``: runtime_state_bytes of the rank), its buffers and, on a GPU, a temporary of one AdamW moment."""
        step = state.params + state.grads + state.optimizer * (1.5 if self.on_gpus else 1.0) + buffers
        return max(0.0, step - backward_peak)
