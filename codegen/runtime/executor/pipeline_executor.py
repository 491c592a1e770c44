"""Run one pipeline rank's action list (ir/schedules.py) for one training step.

The executor only interprets the schedule (docs/architecture.md: schedules are data): it never decides an order.
- ``Forward(s, mb)``: stage s's inputs are micro-batch mb's user inputs plus the tensors crossing
  into s -- from a receive posted earlier, or handed over by the neighbour stage on this rank. Each
  crossing input becomes a fresh leaf (``detach().requires_grad_()``) so the backward can stop at
  the cut and hand its gradient to the previous stage. What the backward needs is kept in
  ``held[(s, mb)]``; the last stage's loss is scaled by 1/m there, so gradients accumulated over the
  m micro-batches are those of the mean loss (and the dp average makes it the global-batch mean).
- ``Backward(s, mb)``: ``torch.autograd.backward`` on the stage outputs with their received
  gradients; parameter gradients accumulate in ``.grad`` across micro-batches, the crossing
  inputs' gradients go to the previous stage. ``BackwardInput`` then ``BackwardWeight`` split it
  (zero-bubble schedules, Qi et al. 2024) per op, as torch.distributed.pipelining does
  (codegen/runtime/executor/split_backward.py: B the inputs' gradients, keeping the gradient that reaches each
  op using a weight; W those kept gradients into the weights only). A stage whose inputs take no
  gradient (stage 0) has nothing to send: its B does nothing and its W is the whole backward.
- ``Send``/``Recv``: non-blocking (codegen/runtime/executor/p2p.py). A receive is waited on by its consumer only,
  so it overlaps whatever this rank computes in between; sends are waited on at the end of the step.
- Activation offload (plan.offload): the forward of (stage, mb) runs inside ``offload.forward``, so
  its offloaded blocks know whose activations they send to host memory; each backward first asks
  ``offload.begin_backward`` to prefetch the stage's last block, and the last one of (stage, mb)
  (Backward, or BackwardWeight after BackwardInput) ends with ``offload.end_backward``
  (codegen/runtime/memory/offload.py). Recompute needs nothing here: the stage modules checkpoint it.
- Weight copies: a stage's forward runs under ``weight_casts.saved_tensors``, so the half-precision
  copy of a weight that an op saves for its backward is a recipe, remade in the backward, instead of
  one copy per micro-batch in flight (codegen/runtime/memory/weight_casts.py).
- Randomness: before every compute action the program's ``RngContext`` is told its micro-batch,
  so random ops draw per micro-batch, and a backward that recomputes a forward draws the same.
- Data parallelism: each local stage's ``GradientBuckets`` runs under ``no_sync()`` except in that
  stage's last backward of the step, whose hooks launch the bucket all-reduces during the backward.

It records, per compute action, (pp rank, action, start, end) in ``time.perf_counter()`` seconds --
start taken once the inputs are there, so waiting counts as idle for ``schedule_sim.idle_fractions``
-- and the largest number of micro-batches whose activations each stage held.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from xirang.ir.errors import InvalidValue, XirangError

from xirang.codegen.runtime.memory import weight_casts
from xirang.codegen.runtime.executor.p2p import ReceiveBuffers, Transfer, message_tag, post_recv, post_send
from xirang.codegen.runtime.executor.split_backward import backward_input, backward_weights, ungrouped_weights
from xirang.ir.schedules import (ACTIVATION, GRADIENT, Backward, BackwardInput, BackwardWeight, Forward, Recv, Schedule,
                                 Send)
from xirang.passes.lowering.split_stages import StageModule


@dataclass
class LocalStage:
    """A stage this rank runs: its module and its parameter tensors, in the module's call order."""

    program: StageModule
    parameters: list

    def __post_init__(self):
        if len(self.parameters) != len(self.program.parameters):
            raise InvalidValue(f"stage {self.program.index} takes {len(self.program.parameters)} parameters, "
                             f"got {len(self.parameters)}")


@dataclass
class StepRecord:
    """What one step did on this rank: loss per micro-batch (last stage only), compute timestamps,
    and the most micro-batches each local stage held activations for at once."""

    losses: list = field(default_factory=list)
    timestamps: list = field(default_factory=list)  # (pp_rank, action, start, end)
    most_in_flight: dict = field(default_factory=dict)  # stage -> micro-batches
    # seconds from the step's start until its gradients are final (dp waits, tied sums; set by the
    # CompiledModel): what follows the last compute is the exposed sync (codegen/runtime/calibration/step_costs.py)
    finished: float | None = None
    # seconds of the step outside that window (set by the CompiledModel): the batch agreement before it,
    # and after it the loss's collectives (and ZeRO's slices): what the cost model's step_sync prices
    outside: float = 0.0


@dataclass
class _Held:
    """What a forward keeps for its backward."""

    inputs: list  # crossing-in leaves (None where no gradient flows)
    outputs: list  # stage outputs that take a gradient (the scaled loss on the last stage)
    output_grads: list | None = None  # set by BackwardInput for the later BackwardWeight
    weight_groups: list | None = None  # per weight-using op, the gradient BackwardInput left for W


class PipelineExecutor:
    """Interprets ``schedule.ranks[pp_rank]`` with the local ``stages`` ({stage index: LocalStage}).

    ``peers[r]``: the global rank of pipeline rank r in this rank's pp group. ``grad_buckets``:
    {stage index: GradientBuckets} when dp > 1. ``tensors_per_cut``: the most tensors any cut
    carries (for message tags; the same on every rank). ``offload``: the ``ActivationOffload`` the
    stages' offloaded blocks use (told which (stage, micro-batch) runs, and when its backward starts
    and ends), or None. ``rng``: the programs' ``RngContext`` (codegen/ops/random_ops.py), or None.
    ``down_group``: the process group of messages to a lower pipeline rank (``MeshGroups.pp_down``; p2p.py
    says why); messages to a higher one use the default group. ``recast_weights``: the program reads its
    weights through half-precision casts (codegen/runtime/memory/weight_casts.py).
    """

    def __init__(self, schedule: Schedule, pp_rank: int, stages: dict, *, peers, tensors_per_cut: int,
                 device="cpu", grad_buckets: dict | None = None, offload=None, rng=None, down_group=None,
                 recast_weights: bool = False):
        self.schedule, self.pp_rank, self.stages = schedule, pp_rank, dict(stages)
        self.offload = offload  # codegen/runtime/memory/offload.ActivationOffload when blocks offload, else None
        self.saved_observer = None  # sees every tensor a stage's forward saves but weight copies (memory_probe)
        self.recast_weights = recast_weights  # a half-precision program: its saved weight copies are remade
        self.rng = rng  # codegen/ops/random_ops.RngContext: told the micro-batch of every compute
        self.actions = schedule.ranks[pp_rank]
        self.peers, self.tensors_per_cut, self.grad_buckets = tuple(peers), tensors_per_cut, grad_buckets or {}
        self.down_group = down_group  # messages to a lower pipeline rank; to a higher one: the default group
        missing = sorted(set(schedule.stages_of(pp_rank)) - set(self.stages))
        if missing:
            raise XirangError(f"pipeline rank {pp_rank} runs stages {missing} of schedule {schedule.name!r} but "
                              f"was given only stages {sorted(self.stages)}", where="PipelineExecutor",
                              hint="pass a LocalStage for every stage of schedule.stages_of(pp_rank)")
        self.device = torch.device(device)  # this rank's: what it receives and what it sends are made there
        self.buffers = ReceiveBuffers(self._receive_specs(), device=self.device)
        # The last backward of each stage in the step is the one that synchronises dp gradients.
        self._last_backward = {}
        for position, action in enumerate(self.actions):
            if isinstance(action, (Backward, BackwardWeight)):
                self._last_backward[action.stage] = position

    def _receive_specs(self) -> dict:
        specs = {}
        for index, stage in self.stages.items():
            if index > 0:
                specs[(ACTIVATION, index)] = [(c.shape, c.dtype) for c in stage.program.crossing_in]
            grads = [(c.shape, c.dtype) for c in stage.program.crossing_out if c.requires_grad]
            if grads:
                specs[(GRADIENT, index)] = grads
        return specs

    # --- one step ------------------------------------------------------------------------------

    def run(self, micro_batches: list) -> StepRecord:
        """Run the step; ``micro_batches[mb]`` maps each user input name to micro-batch mb's tensor."""
        if len(micro_batches) != self.schedule.num_micro_batches:
            raise XirangError(f"got {len(micro_batches)} micro-batches, schedule {self.schedule.name!r} runs "
                              f"{self.schedule.num_micro_batches}", where="PipelineExecutor.run",
                              hint="split the batch into the plan's num_micro_batches")
        self._micro_batches = micro_batches
        self._pending: dict = {}  # (kind, stage, mb) -> (Transfer, buffers): posted receives
        self._local: dict = {}  # (kind, consuming stage, mb) -> tensors handed over on this rank
        self._outbox: dict = {}  # (kind, stage, mb) -> tensors a following Send sends
        self._sends: list[Transfer] = []
        self._held: dict = {}
        record = StepRecord(most_in_flight={index: 0 for index in self.stages})
        self._record = record
        for position, action in enumerate(self.actions):
            if isinstance(action, Recv):
                self._post_recv(action)
            elif isinstance(action, Send):
                self._post_send(action)
            else:
                self._compute(action, position)
        for transfer in self._sends:
            transfer.wait()
        for index in sorted(self.grad_buckets):
            self.grad_buckets[index].wait()
        if self._held:
            raise XirangError(f"the step ended with activations still held for (stage, micro-batch) "
                              f"{sorted(self._held)}",
                              where=f"schedule {self.schedule.name!r}, pp rank {self.pp_rank}",
                              hint="every Forward needs a Backward in the schedule; run check_schedule on it")
        return record

    def _compute(self, action, position: int) -> None:
        if isinstance(action, Forward):
            run = self._forward
        elif isinstance(action, Backward):
            run = self._backward
        elif isinstance(action, BackwardInput):
            run = self._backward_input
        elif isinstance(action, BackwardWeight):
            run = self._backward_weight
        else:
            raise XirangError(f"unknown action {action!r}", where=f"pp rank {self.pp_rank}",
                              hint="schedules hold Forward, Backward(Input/Weight), Send and Recv only")
        inputs = self._inputs_of(action)  # may wait on a receive: idle, before the clock starts
        if self.rng is not None:  # random ops draw per micro-batch, in a recompute too
            self.rng.micro_batch = action.micro_batch
        start = time.perf_counter()
        with self._sync_context(action, position):
            run(action, inputs)
        self._record.timestamps.append((self.pp_rank, action, start, time.perf_counter()))

    def _sync_context(self, action, position: int):
        buckets = self.grad_buckets.get(action.stage)
        if buckets is None or not isinstance(action, (Backward, BackwardWeight)):
            return nullcontext()
        return nullcontext() if self._last_backward[action.stage] == position else buckets.no_sync()

    # --- where a compute's inputs come from ----------------------------------------------------

    def _inputs_of(self, action):
        if isinstance(action, Forward):
            if action.stage == 0:
                return []
            return self._take(ACTIVATION, action.stage, action.micro_batch, copy=True)
        if isinstance(action, (Backward, BackwardInput)) and not self.stages[action.stage].program.returns_loss:
            return self._take(GRADIENT, action.stage, action.micro_batch, copy=False)
        return None

    def _take(self, kind, stage, mb, *, copy: bool):
        local = self._local.pop((kind, stage, mb), None)
        if local is not None:
            return local if copy else _Borrowed(local, lambda: None)
        if (kind, stage, mb) not in self._pending:
            raise XirangError(f"{kind} for stage {stage}, micro-batch {mb} is needed but neither received "
                              f"nor produced on this rank", where=f"schedule {self.schedule.name!r}, pp rank "
                              f"{self.pp_rank}", hint="list its Recv before the compute; run check_schedule")
        transfer, buffers = self._pending.pop((kind, stage, mb))
        tensors = transfer.wait()
        if not copy:
            return _Borrowed(tensors, lambda: self.buffers.release(kind, stage, buffers))
        # Activations live until the backward, so they leave the buffer for it to take the next receive.
        owned = [tensor.clone() for tensor in tensors]
        self.buffers.release(kind, stage, buffers)
        return owned

    def _post_recv(self, action: Recv) -> None:
        buffers = self.buffers.acquire(action.kind, action.stage)
        tags = [self._tag(action.kind, action.stage, action.micro_batch, i) for i in range(len(buffers))]
        transfer = post_recv(buffers, self.peers[action.peer], tags, self._channel(receiver=self.pp_rank,
                                                                                  sender=action.peer))
        self._pending[(action.kind, action.stage, action.micro_batch)] = (transfer, buffers)

    def _post_send(self, action: Send) -> None:
        tensors = self._outbox.pop((action.kind, action.stage, action.micro_batch))
        receiver = action.stage + 1 if action.kind == ACTIVATION else action.stage - 1
        tags = [self._tag(action.kind, receiver, action.micro_batch, i) for i in range(len(tensors))]
        # Drop finished sends first: holding their tensors to the end of the step would keep every
        # micro-batch's outputs alive and break 1F1B's memory bound.
        self._sends = [transfer for transfer in self._sends if not transfer.done()]
        self._sends.append(post_send(tensors, self.peers[action.peer], tags,
                                     self._channel(sender=self.pp_rank, receiver=action.peer)))

    def _channel(self, *, sender: int, receiver: int):
        """The group a message between two pipeline ranks travels on: one per direction (p2p.py)."""
        return self.down_group if receiver < sender else None

    def _tag(self, kind, receiving_stage, mb, index) -> int:
        return message_tag(kind, receiving_stage, mb, index, num_stages=self.schedule.num_stages,
                           tensors_per_cut=self.tensors_per_cut)

    def _hand_over(self, kind: str, stage: int, mb: int, tensors: list) -> None:
        """Give a result to the neighbour stage: locally, or to the Send the schedule lists next."""
        target = stage + 1 if kind == ACTIVATION else stage - 1
        if self.schedule.rank_of(target) == self.pp_rank:
            self._local[(kind, target, mb)] = tensors
        else:
            self._outbox[(kind, stage, mb)] = tensors

    # --- compute -------------------------------------------------------------------------------

    def _forward(self, action: Forward, received) -> None:
        stage, mb = self.stages[action.stage], action.micro_batch
        program = stage.program
        leaves = [tensor.detach().requires_grad_(spec.requires_grad)
                  for tensor, spec in zip(received, program.crossing_in)]
        user = [self._micro_batches[mb][name] for name in program.user_inputs]
        # Saved weight copies are recipes, remade in the backward (weight_casts.py); an fp32 program makes none
        with weight_casts.saved_tensors(self.saved_observer) if self.recast_weights else nullcontext(), \
                self.offload.forward(action.stage, mb) if self.offload else nullcontext():
            outputs = stage.program(stage.parameters, leaves, user)
        if program.returns_loss:
            loss = outputs[0]
            self._record.losses.append(loss.detach())
            m = self.schedule.num_micro_batches
            held_outputs = [loss / m if m > 1 else loss]  # loss / 1 is loss, bit for bit: one op less each way
        else:
            held_outputs = [out for out, spec in zip(outputs, program.crossing_out) if spec.requires_grad]
            if action.stage + 1 < self.schedule.num_stages:
                self._hand_over(ACTIVATION, action.stage, mb, [out.detach() for out in outputs])
        inputs = [leaf if spec.requires_grad else None for leaf, spec in zip(leaves, program.crossing_in)]
        self._held[(action.stage, mb)] = _Held(inputs, held_outputs)
        self._count_in_flight(action.stage)

    def _count_in_flight(self, stage: int) -> None:
        held = sum(1 for (s, _) in self._held if s == stage)
        self._record.most_in_flight[stage] = max(self._record.most_in_flight[stage], held)

    @staticmethod
    def _differentiable(held: _Held, grads) -> tuple[list, list | None]:
        """The outputs that carry a gradient at run time, with theirs (None for the loss: ones)."""
        keep = [i for i, out in enumerate(held.outputs) if out.requires_grad]
        outputs = [held.outputs[i] for i in keep]
        return outputs, None if grads is None else [grads[i] for i in keep]

    def _backward(self, action: Backward, received) -> None:
        held = self._held.pop((action.stage, action.micro_batch))
        self._begin_backward(action)
        with received or nullcontext():
            outputs, grads = self._differentiable(held, received.tensors if received else None)
            if outputs:
                torch.autograd.backward(outputs, grads)
        self._end_backward(action)
        self._send_input_grads(action, [leaf.grad if leaf is not None else None for leaf in held.inputs], held)

    def _backward_input(self, action: BackwardInput, received) -> None:
        held = self._held[(action.stage, action.micro_batch)]
        with received or nullcontext():
            # Copied out of the receive buffer: BackwardWeight needs them after it was reused.
            grads = [grad.clone() for grad in received.tensors] if received else None
        held.output_grads = grads
        outputs, grads = self._differentiable(held, grads)
        leaves = [leaf for leaf in held.inputs if leaf is not None]
        found = iter([None] * len(leaves))
        if leaves and outputs:
            self._begin_backward(action)
            weights = self._weights(action)
            dinputs, held.weight_groups = backward_input(outputs, grads, leaves, weights)
            self._check_weight_groups(action, held.weight_groups)
            found = iter(dinputs)
        self._send_input_grads(action, [next(found) if leaf is not None else None for leaf in held.inputs], held)

    def _backward_weight(self, action: BackwardWeight, _received) -> None:
        held = self._held.pop((action.stage, action.micro_batch))
        weights = self._weights(action)
        if held.weight_groups is None:  # B had nothing to do: the whole backward, into the weights
            outputs, grads = self._differentiable(held, held.output_grads)
            if weights and outputs:
                self._begin_backward(action)
                torch.autograd.backward(outputs, grads, inputs=weights)
        else:
            backward_weights(held.weight_groups, weights)
        self._end_backward(action)

    def _weights(self, action) -> list:
        return [p for p in self.stages[action.stage].parameters if p.requires_grad]

    def _check_weight_groups(self, action, groups: list) -> None:
        """A weight the stage's inputs never reach (read only on a path of its own) is in no group,
        so the split W would leave its gradient out: refuse rather than train it wrongly."""
        stage = self.stages[action.stage]
        named = [(fqn, weight) for (_, fqn), weight in zip(stage.program.parameters, stage.parameters)
                 if weight.requires_grad]
        missing = [named[i][0] for i in ungrouped_weights(groups, [weight for _, weight in named])]
        if missing:
            shown = ", ".join(missing[:4])
            raise XirangError(f"stage {action.stage} reads weight(s) {shown} on no path from its inputs, so a "
                              f"split backward cannot give them a gradient",
                              where=f"schedule {self.schedule.name!r}, pp rank {self.pp_rank}, {action}",
                              hint="use a schedule without a split backward ('1f1b'), or cut the stages "
                                   "elsewhere")

    def _begin_backward(self, action) -> None:
        if self.offload is not None:
            self.offload.begin_backward(action.stage, action.micro_batch)

    def _end_backward(self, action) -> None:
        if self.offload is not None:
            self.offload.end_backward(action.stage, action.micro_batch)

    def _send_input_grads(self, action, grads: list, held: _Held) -> None:
        if action.stage == 0:
            return
        program = self.stages[action.stage].program
        # A crossing input the loss does not depend on differentiably still gets a (zero) gradient:
        # the receiver posted a buffer for it.
        sent = [grad if grad is not None else torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
                for grad, leaf, spec in zip(grads, held.inputs, program.crossing_in) if spec.requires_grad]
        self._hand_over(GRADIENT, action.stage, action.micro_batch, sent)


class _Borrowed:
    """Received gradient buffers lent to one backward, given back to the pool when it is done."""

    def __init__(self, tensors, release):
        self.tensors, self._release = tensors, release

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._release()
        return False

