"""Pipeline schedules as data: one list of actions per pipeline rank, in the order that rank issues them.

An executor only interprets these lists (docs/architecture.md: schedules are data); ``schedule_check`` proves a list is
complete and cannot hang, ``schedule_sim`` times it, ``timeline`` prints and draws it.

Conventions
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

The vocabulary (end of this file): ``SCHEDULES`` names every schedule a Plan, the planner, the CLI
and the pictures accept, and ``SCHEDULE_SPECS[name]`` gives its title, whether it runs v > 1 model
chunks per rank, its generator and the closed forms the planner prices it with: the bubble and the
activations each rank keeps in flight. tests/codegen/test_schedule_formulas.py proves the closed
forms equal what the generated schedules do (``max_in_flight``, ``simulated_bubble``).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Sequence, Union
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


def _check_sizes(name: str, p: int, m: int, v: int = 1) -> None:
    for label, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidValue(f"{name}: {label} must be a positive int (>= 1), got {value!r}")


def _check_multiple(name: str, p: int, m: int) -> None:
    if m % p:
        raise InvalidValue(f"{name}: m={m} micro-batches must be a multiple of p={p} pipeline ranks "
                         f"(Megatron-LM runs p micro-batches per chunk in turn); use m in {p}, {2 * p}, ...")


# --- generators ----------------------------------------------------------------------------------


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): all forwards, then all backwards; every rank keeps m activations."""
    _check_sizes("gpipe", p, m)
    order = []
    for rank in range(p):
        # Warm-up: the whole step's forwards, filling the pipeline micro-batch by micro-batch.
        forwards = [Forward(rank, mb) for mb in range(m)]
        # Steady: none; GPipe never mixes forwards and backwards.
        # Cool-down: the backwards, in micro-batch order (as torch.distributed.pipelining's GPipe).
        backwards = [Backward(rank, mb) for mb in range(m)]
        order.append(forwards + backwards)
    return with_communication("gpipe", p, m, order)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021 sec. 2.2.1): same bubble as GPipe, but rank r
    keeps at most p - r micro-batches in flight instead of m."""
    _check_sizes("1f1b", p, m)
    order = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        # Warm-up: forwards until micro-batch 0's gradient can come back from the last stage.
        computes: list[Compute] = [Forward(rank, mb) for mb in range(warmup)]
        # Steady: one forward, then the oldest backward; activations in flight stay at warmup + 1.
        for mb in range(m - warmup):
            computes += [Forward(rank, warmup + mb), Backward(rank, mb)]
        # Cool-down: drain the backwards of the warm-up micro-batches.
        computes += [Backward(rank, mb) for mb in range(m - warmup, m)]
        order.append(computes)
    return with_communication("1f1b", p, m, order)


def interleaved_one_f_one_b(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021 sec. 2.2.2): rank r holds v chunks,
    stages r, r + p, ..., and the bubble shrinks by v at the price of v times the p2p traffic.

    Work items run p micro-batches per chunk in turn: item k is micro-batch
    (k // (p·v))·p + k % p on chunk (k // p) % v forward, chunk v - 1 - (k // p) % v backward;
    this is why m must be a multiple of p (Megatron-LM's ``get_model_chunk_id``)."""
    _check_sizes("interleaved", p, m, v)
    _check_multiple("interleaved", p, m)
    items = m * v

    def item(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    order = []
    for rank in range(p):
        # Warm-up (Megatron-LM): 2(p - r - 1) items to fill the pipeline both ways, plus (v - 1)·p
        # so the first backward (of the last chunk) has its forward done.
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, items)
        computes: list[Compute] = []
        for k in range(warmup):
            chunk, mb = item(k, forward=True)
            computes.append(Forward(chunk * p + rank, mb))
        # Steady: one forward item, then one backward item.
        for k in range(items - warmup):
            chunk, mb = item(k + warmup, forward=True)
            computes.append(Forward(chunk * p + rank, mb))
            chunk, mb = item(k, forward=False)
            computes.append(Backward(chunk * p + rank, mb))
        # Cool-down: the backwards of the warm-up items.
        for k in range(items - warmup, items):
            chunk, mb = item(k, forward=False)
            computes.append(Backward(chunk * p + rank, mb))
        order.append(computes)
    return with_communication("interleaved", p * v, m, order)


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule a Plan names (``plan.schedule``, ``mesh.pp``, ``num_micro_batches``, ``virtual_stages``):
    what the executor runs."""
    return schedule_spec(name).build(p, m, v)


# --- the vocabulary: names, titles and the closed forms the planner uses -------------------------
# Units: a rank's activations in flight are counted in micro-batches of *all* its layers, so a
# (stage, micro-batch) pair of an interleaved rank, which holds 1/v of its layers, counts 1/v:
# in_flight_by_rank(...)[r] == max_in_flight(schedule)[r] / v. The bubble is the idle time of a
# step over its ideal (bubble-free) time, with balanced stages and free point-to-point:
# (p - 1) / (v·m) for every schedule here (v = 1 unless interleaved; Narayanan et al. 2021, eq. 1
# and sec. 2.2.2). ``bubble_share`` is the idle part of the actual step, what ``simulated_bubble``
# measures: (p - 1) / (v·m + p - 1).


def _gpipe_in_flight(p: int, r: int, m: int, v: int) -> Fraction:
    return Fraction(m)  # all m forwards run before any backward


def _one_f_one_b_in_flight(p: int, r: int, m: int, v: int) -> Fraction:
    return Fraction(min(p - r, m))  # p - r - 1 warm-up forwards, then one more in the steady state


def _interleaved_in_flight(p: int, r: int, m: int, v: int) -> Fraction:
    # Warm-up 2(p - r - 1) + (v - 1)p chunk forwards plus one in the steady state, each 1/v of the
    # rank's layers: p + (p - 1 - 2r)/v micro-batches (Korthikanti et al. 2022, sec. 4.2.3);
    # all m·v chunk forwards, m micro-batches, when the warm-up is the whole step.
    return min(Fraction(m), p + Fraction(p - 1 - 2 * r, v))


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule by name: how to show it, how to build it and how the planner prices it."""

    name: str
    title: str  # for timelines and tables
    chunked: bool  # runs v model chunks per rank (v = virtual_stages); every other schedule needs v = 1
    builder: Callable[..., Schedule]  # (p, m) or, chunked, (p, m, v)
    rank_in_flight: Callable[[int, int, int, int], Fraction]  # (p, r, m, v) -> see in_flight_by_rank
    source: str

    def check(self, p: int, m: int, v: int = 1) -> None:
        """Raise ValueError unless (p, m, v) suit this schedule (the rules ``build`` enforces)."""
        _check_sizes(self.name, p, m, v)
        if not self.chunked and v != 1:
            raise InvalidValue(f"{self.name}: v={v} model chunks per rank needs the 'interleaved' schedule")
        if self.chunked:
            _check_multiple(self.name, p, m)

    def build(self, p: int, m: int, v: int = 1) -> Schedule:
        """The action lists the executor runs for p pipeline ranks, m micro-batches, v chunks."""
        self.check(p, m, v)
        return self.builder(p, m, v) if self.chunked else self.builder(p, m)

    def bubble_fraction(self, p: int, m: int, v: int = 1) -> Fraction:
        """Idle time over the ideal step time: (p - 1)/(v·m). p=4, m=8: 3/8; interleaved v=2: 3/16."""
        self.check(p, m, v)
        return Fraction(p - 1, v * m)

    def bubble_share(self, p: int, m: int, v: int = 1) -> Fraction:
        """Idle part of the actual step, b/(1 + b): (p - 1)/(v·m + p - 1). p=4, m=8: 3/11."""
        self.check(p, m, v)
        return Fraction(p - 1, v * m + p - 1)

    def in_flight_by_rank(self, p: int, m: int, v: int = 1) -> tuple[Fraction, ...]:
        """Activations pipeline rank r holds at its peak, r = 0..p-1, in micro-batches of all the
        rank's layers: m GPipe, min(p - r, m) 1F1B, min(m, p + (p - 1 - 2r)/v) interleaved."""
        self.check(p, m, v)
        return tuple(self.rank_in_flight(p, r, m, v) for r in range(p))

    def in_flight(self, p: int, m: int, v: int = 1) -> Fraction:
        """The fullest rank's figure (rank 0's): m, min(p, m), min(m, p + (p - 1)/v)."""
        return max(self.in_flight_by_rank(p, m, v))


SCHEDULE_SPECS: Mapping[str, ScheduleSpec] = MappingProxyType({spec.name: spec for spec in (
    ScheduleSpec("gpipe", "GPipe", False, gpipe, _gpipe_in_flight,
                 "Huang et al. 2019: all m forwards run before any backward, so every activation is kept"),
    ScheduleSpec("1f1b", "1F1B", False, one_f_one_b, _one_f_one_b_in_flight,
                 "Narayanan et al. 2021 sec. 2.2.1 (PipeDream-Flush): rank r warms up p - r micro-batches"),
    ScheduleSpec("interleaved", "interleaved 1F1B", True, interleaved_one_f_one_b, _interleaved_in_flight,
                 "Narayanan et al. 2021 sec. 2.2.2; in flight per Korthikanti et al. 2022 sec. 4.2.3 "
                 "(Megatron-LM's warm-up of 2(p-r-1) + (v-1)p + 1 chunks of 1/v of the layers)"),
)})
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_SPECS)  # ("gpipe", "1f1b", "interleaved")


def schedule_spec(name: str) -> ScheduleSpec:
    """The ScheduleSpec of ``name``; ValueError naming the known schedules otherwise."""
    spec = SCHEDULE_SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise InvalidValue(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return spec
