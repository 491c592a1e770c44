"""Pipeline schedule actions and the Schedule that lists them: one list of actions per pipeline rank.

Conventions (ir/schedules.py builds schedules by them; codegen/runtime/executor/schedule_check.py proves them)
- p pipeline ranks run ``num_stages = p * v`` stages; stage ``i`` runs on rank ``i % p`` (ir/plan.py),
  so with v chunks rank r holds stages r, r + p, r + 2p, ...
- Every action names a stage *this rank runs*, as torch.distributed.pipelining's ``_Action`` does:
  ``Send(ACTIVATION, stage=s)`` sends the output of local stage s to the rank of s + 1, which lists
  ``Recv(ACTIVATION, stage=s + 1)``; gradients flow the other way (``Send(GRADIENT, s)`` pairs with
  ``Recv(GRADIENT, s - 1)``). ``peer`` repeats the other rank so an executor needs no arithmetic.
- A ``Send`` is listed right after the compute that produced its tensor. A ``Recv`` is listed where
  the executor should *post* it: just before the compute action that precedes its consumer on this
  rank (at the very start for the first one). So every receive is a non-blocking irecv that overlaps
  one compute action, and at most two receive buffers per kind are live: double buffering.
- Stages that sit on the same rank (p = 1) hand tensors over locally: no Send/Recv is listed.
- ``Backward`` computes input and weight gradients together. Zero-bubble schedules (Qi et al.,
  "Zero Bubble Pipeline Parallelism", ICLR 2024) split it into ``BackwardInput`` (what the previous
  stage waits for; it is what a gradient ``Send`` follows) and a later ``BackwardWeight``; the
  checker and simulator accept either form for each (stage, micro-batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence, Union
from xirang.ir.errors import InvalidValue

ACTIVATION = "activation"  # forward: output of stage s -> input of stage s + 1
GRADIENT = "gradient"  # backward: gradient w.r.t. the input of stage s -> output of stage s - 1
KINDS = (ACTIVATION, GRADIENT)


def _non_negative_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidValue(f"{owner}.{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class _Compute:
    stage: int
    micro_batch: int

    def __post_init__(self):
        _non_negative_int(type(self).__name__, "stage", self.stage)
        _non_negative_int(type(self).__name__, "micro_batch", self.micro_batch)


@dataclass(frozen=True)
class Forward(_Compute):
    """Run stage ``stage`` forward on micro-batch ``micro_batch`` and keep its activations."""


@dataclass(frozen=True)
class Backward(_Compute):
    """Input and weight gradients of ``stage`` for ``micro_batch``; frees its activations."""


@dataclass(frozen=True)
class BackwardInput(_Compute):
    """Only the gradient w.r.t. the stage input (``torch.autograd.grad`` on the inputs)."""


@dataclass(frozen=True)
class BackwardWeight(_Compute):
    """Only the parameter gradients, run after ``BackwardInput`` of the same (stage, micro_batch)."""


@dataclass(frozen=True)
class _Transfer:
    kind: str
    stage: int
    micro_batch: int
    peer: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidValue(f"{type(self).__name__}.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("stage", "micro_batch", "peer"):
            _non_negative_int(type(self).__name__, name, getattr(self, name))


@dataclass(frozen=True)
class Send(_Transfer):
    """Post a non-blocking send of local ``stage``'s tensor of ``kind`` for ``micro_batch`` to ``peer``."""


@dataclass(frozen=True)
class Recv(_Transfer):
    """Post a non-blocking receive, from ``peer``, of the ``kind`` tensor local ``stage`` consumes."""


Compute = Union[Forward, Backward, BackwardInput, BackwardWeight]
Action = Union[Forward, Backward, BackwardInput, BackwardWeight, Send, Recv]
COMPUTE_TYPES = (Forward, Backward, BackwardInput, BackwardWeight)


def is_compute(action: Action) -> bool:
    return isinstance(action, COMPUTE_TYPES)


def describe(action: Action) -> str:
    """``Forward(stage=1, micro_batch=0)`` / ``Send(activation, stage=0, micro_batch=0, peer=1)``."""
    if isinstance(action, _Transfer):
        return (f"{type(action).__name__}({action.kind}, stage={action.stage}, "
                f"micro_batch={action.micro_batch}, peer={action.peer})")
    return f"{type(action).__name__}(stage={action.stage}, micro_batch={action.micro_batch})"


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``ranks[r]`` is pipeline rank r's actions in issue order."""

    name: str
    num_stages: int
    num_micro_batches: int
    ranks: tuple[tuple[Action, ...], ...]

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(tuple(actions) for actions in self.ranks))
        for name in ("num_stages", "num_micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidValue(f"Schedule {self.name!r}: {name} must be an int >= 1, got {value!r}")
        if not self.ranks or self.num_stages % len(self.ranks):
            raise InvalidValue(f"Schedule {self.name!r}: {self.num_stages} stages cannot be spread evenly "
                             f"over {len(self.ranks)} pipeline ranks; give one action list per rank and "
                             f"a multiple of that many stages")

    @property
    def pipeline_ranks(self) -> int:
        return len(self.ranks)

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.pipeline_ranks

    def rank_of(self, stage: int) -> int:
        return stage % self.pipeline_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(range(rank, self.num_stages, self.pipeline_ranks))

    def with_rank(self, rank: int, actions: Iterable[Action]) -> "Schedule":
        """A copy whose rank ``rank`` issues ``actions`` instead (for hand edits and tests)."""
        ranks = list(self.ranks)
        ranks[rank] = tuple(actions)
        return Schedule(self.name, self.num_stages, self.num_micro_batches, tuple(ranks))


# --- which tensor a compute action waits for, and which it sends ---------------------------------


def input_recv(schedule: Schedule, compute: Compute) -> Recv | None:
    """The Recv that ``compute`` consumes, or None when its input is local (stage 0's data, the
    last stage's loss, a neighbour stage on the same rank, or a weight gradient)."""
    rank = schedule.rank_of(compute.stage)
    if isinstance(compute, Forward):
        source = compute.stage - 1
        kind = ACTIVATION
    elif isinstance(compute, (Backward, BackwardInput)):
        source = compute.stage + 1
        kind = GRADIENT
    else:
        return None
    if not 0 <= source < schedule.num_stages or schedule.rank_of(source) == rank:
        return None
    return Recv(kind, compute.stage, compute.micro_batch, schedule.rank_of(source))


def output_send(schedule: Schedule, compute: Compute) -> Send | None:
    """The Send that follows ``compute``, or None when its result stays on this rank."""
    if isinstance(compute, Forward):
        target, kind = compute.stage + 1, ACTIVATION
    elif isinstance(compute, (Backward, BackwardInput)):
        target, kind = compute.stage - 1, GRADIENT
    else:
        return None
    if not 0 <= target < schedule.num_stages or schedule.rank_of(target) == schedule.rank_of(compute.stage):
        return None
    return Send(kind, compute.stage, compute.micro_batch, schedule.rank_of(target))


def matching_recv(send: Send, sender: int) -> Recv:
    """The Recv, on rank ``send.peer``, that pairs with ``send`` issued on rank ``sender``."""
    stage = send.stage + 1 if send.kind == ACTIVATION else send.stage - 1
    return Recv(send.kind, stage, send.micro_batch, sender)


def with_communication(name: str, num_stages: int, m: int,
                       compute_order: Sequence[Sequence[Compute]]) -> Schedule:
    """Insert Sends and Recvs into per-rank compute orders (``compute_order[r]`` for rank r) by the
    conventions of the module docstring."""
    bare = Schedule(name, num_stages, m, tuple(() for _ in compute_order))
    ranks = []
    for order in compute_order:
        actions: list[Action] = []
        # Recv for compute i is posted before compute i - 1, so the transfer overlaps that compute.
        recvs_before = [[] for _ in order]
        for i, compute in enumerate(order):
            recv = input_recv(bare, compute)
            if recv is not None:
                recvs_before[max(i - 1, 0)].append(recv)
        for i, compute in enumerate(order):
            actions.extend(recvs_before[i])
            actions.append(compute)
            send = output_send(bare, compute)
            if send is not None:
                actions.append(send)
        ranks.append(tuple(actions))
    return Schedule(name, bare.num_stages, m, tuple(ranks))
