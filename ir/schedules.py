"""Pipeline schedules as data: the generators and the one vocabulary of schedule names.

An executor only interprets the action lists (docs/architecture.md: schedules are data); the actions,
the ``Schedule`` and the conventions for sends and receives are in ``ir/schedule_actions.py`` (re-exported
here); ``schedule_check`` proves a list is complete and cannot hang, ``schedule_sim`` times it,
``timeline`` prints and draws it.

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
from typing import Callable, Mapping
from xirang.ir.errors import InvalidValue
from xirang.ir.schedule_actions import (ACTIVATION, COMPUTE_TYPES, GRADIENT, KINDS, Action,  # noqa: F401
                                        Backward, BackwardInput, BackwardWeight, Compute, Forward, Recv,
                                        Schedule, Send, describe, input_recv, is_compute, matching_recv,
                                        output_send, with_communication)

def _check_sizes(name: str, p: int, m: int, v: int = 1) -> None:
    for label, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidValue(f"{name}: {label} must be a positive int (>= 1), got {value!r}")


def _check_multiple(name: str, p: int, m: int) -> None:
    if m % p:
        raise InvalidValue(f"{name}: m={m} micro-batches must be a multiple of p={p} pipeline ranks "
                         f"(Megatron-LM runs p micro-batches per chunk in turn); use m in {p}, {2 * p}, ...")


# --- generators ----------------------------------------------------------------------------------


def _finish(name: str, num_stages: int, m: int, order, communication: bool) -> Schedule:
    """The schedule of the per-rank compute ``order``: with its sends and receives (what the executor runs),
    or, ``communication`` False, the compute actions alone (what the planner's memory figures read, where
    placing the sends and receives would cost most of the building)."""
    if communication:
        return with_communication(name, num_stages, m, order)
    return Schedule(name, num_stages, m, tuple(tuple(actions) for actions in order))


def gpipe(p: int, m: int, *, communication: bool = True) -> Schedule:
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
    return _finish("gpipe", p, m, order, communication)


def one_f_one_b(p: int, m: int, extra_warmup: tuple = (), *, communication: bool = True) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021 sec. 2.2.1): same bubble as GPipe, but rank r
    keeps at most p - r micro-batches in flight instead of m.

    ``extra_warmup[r]`` more forwards in rank r's warm-up (adaptive micro-batch injection,
    codegen/runtime/executor/injection.py): the rank then keeps p - r + extra_warmup[r] in flight, and a slow
    or jittery downstream stage finds its inputs queued instead of waiting on this rank's backward.
    The backwards still run in micro-batch order, so the gradients are summed in the same order."""
    _check_sizes("1f1b", p, m)
    extra = check_extra_warmup(extra_warmup, p)
    warmups = [min(p - rank - 1 + extra[rank], m) for rank in range(p)]
    for rank in range(p - 1):
        # rank r + 1's warm-up forwards all come from rank r's warm-up and first steady forward
        if warmups[rank + 1] > warmups[rank]:
            raise InvalidValue(f"extra_warmup {extra}: rank {rank + 1} would warm up {warmups[rank + 1]} forwards "
                               f"but rank {rank} feeds it only {warmups[rank] + 1} before waiting on its "
                               f"first backward; give each rank at most one more extra than the rank before it")
    order = []
    for rank in range(p):
        warmup = min(p - rank - 1 + extra[rank], m)
        # Warm-up: forwards until micro-batch 0's gradient can come back from the last stage.
        computes: list[Compute] = [Forward(rank, mb) for mb in range(warmup)]
        # Steady: one forward, then the oldest backward; activations in flight stay at warmup + 1.
        for mb in range(m - warmup):
            computes += [Forward(rank, warmup + mb), Backward(rank, mb)]
        # Cool-down: drain the backwards of the warm-up micro-batches.
        computes += [Backward(rank, mb) for mb in range(m - warmup, m)]
        order.append(computes)
    return _finish("1f1b", p, m, order, communication)


def interleaved_one_f_one_b(p: int, m: int, v: int, *, communication: bool = True) -> Schedule:
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
    return _finish("interleaved", p * v, m, order, communication)


def zero_bubble_h1(p: int, m: int, *, communication: bool = True) -> Schedule:
    """ZB-H1 (Qi et al. 2024 sec. 2.1): 1F1B with the backward split into BackwardInput (B), what the
    previous stage waits for, and BackwardWeight (W), run later to fill the bubble. Rank r warms up
    like 1F1B (p - r - 1 forwards) and then holds back its first r W's, so every rank keeps at most
    min(p, m) micro-batches (1F1B's rank-0 peak) and the W's it owes fill the cool-down. With equal
    F, B and W times the bubble is a third of 1F1B's: (p - 1)·T_F per rank instead of (p - 1)·3·T_F."""
    _check_sizes("zb-h1", p, m)
    order = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        # Warm-up: as 1F1B.
        computes: list[Compute] = [Forward(rank, mb) for mb in range(warmup)]
        weights = iter(range(m))  # W's run in micro-batch order, each after its B
        # Steady: F, B, and a W only after the first `rank` rounds (that delay is what fills the tail).
        for mb in range(m - warmup):
            computes += [Forward(rank, warmup + mb), BackwardInput(rank, mb)]
            if mb >= rank:
                computes.append(BackwardWeight(rank, next(weights)))
        # Cool-down: each B followed by one owed W, then the W's still owed.
        for mb in range(m - warmup, m):
            computes += [BackwardInput(rank, mb), BackwardWeight(rank, next(weights))]
        computes += [BackwardWeight(rank, mb) for mb in weights]
        order.append(computes)
    return _finish("zb-h1", p, m, order, communication)


def zero_bubble_h2(p: int, m: int, *, communication: bool = True) -> Schedule:
    """ZB-H2 (Qi et al. 2024 sec. 2.2): more forwards in the warm-up fill the wait for the first
    gradient, and W's fill the cool-down, at up to 2p - 1 micro-batches in flight on every rank.
    Rank r warms up 2(p - r) - 1 forwards, then runs B then F (deferring W's) until it holds 2p - 1,
    then B, W, F; in the cool-down each B is followed by the oldest W but one, so a W is always at
    hand while the next gradient travels. Needs m >= 2p - 1. Within one synchronous step the last
    rank still waits (p - 1)·T_F for its first input; the paper's zero bubble also overlaps that with
    the previous step's tail, bypassing the optimizer's synchronisation (its sec. 4), which Xirang
    does not do."""
    _check_sizes("zb-h2", p, m)
    _check_enough_for_h2(p, m)
    order = []
    cap = 2 * p - 1
    for rank in range(p):
        warmup = 2 * (p - rank) - 1
        computes: list[Compute] = [Forward(rank, mb) for mb in range(warmup)]
        held, weighed = warmup, 0  # micro-batches holding activations; W's done
        # Steady: B, (W once at the cap), F.
        for mb in range(m - warmup):
            computes.append(BackwardInput(rank, mb))
            if held == cap:
                computes.append(BackwardWeight(rank, weighed))
                weighed, held = weighed + 1, held - 1
            computes.append(Forward(rank, warmup + mb))
            held += 1
        # Cool-down: each B, then a W that keeps one behind it; then the W's still owed.
        for mb in range(m - warmup, m):
            computes.append(BackwardInput(rank, mb))
            if weighed < mb:
                computes.append(BackwardWeight(rank, weighed))
                weighed += 1
        computes += [BackwardWeight(rank, mb) for mb in range(weighed, m)]
        order.append(computes)
    return _finish("zb-h2", p, m, order, communication)


def _check_enough_for_h2(p: int, m: int) -> None:
    if m < 2 * p - 1:
        raise InvalidValue(f"zb-h2: m={m} micro-batches cannot fill its warm-up of 2p - 1 = {2 * p - 1} "
                           f"forwards on p={p} pipeline ranks; use m >= {2 * p - 1}, or schedule 'zb-h1'")


def check_extra_warmup(extra_warmup, p: int) -> tuple:
    """``extra_warmup`` as a tuple of p ints >= 0 (() means none); InvalidValue naming the entry otherwise."""
    extra = tuple(extra_warmup) if extra_warmup else (0,) * p
    if len(extra) != p or any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in extra):
        raise InvalidValue(f"extra_warmup must give one whole number >= 0 per pipeline rank (p={p}), "
                           f"got {tuple(extra_warmup)!r}")
    return extra


def build_schedule(name: str, p: int, m: int, v: int = 1, extra_warmup: tuple = (), *,
                   communication: bool = True) -> Schedule:
    """The schedule a Plan names (``plan.schedule``, ``mesh.pp``, ``num_micro_batches``, ``virtual_stages``):
    what the executor runs. ``extra_warmup`` (1F1B only) deepens each rank's warm-up, see ``one_f_one_b``;
    ``communication`` False: the compute actions alone (``_finish``)."""
    if any(check_extra_warmup(extra_warmup, p)):
        if name != "1f1b":
            raise InvalidValue(f"extra warm-up (adaptive micro-batch injection) is built for the '1f1b' "
                               f"schedule only, not {name!r}")
        schedule_spec(name).check(p, m, v)
        return one_f_one_b(p, m, tuple(extra_warmup), communication=communication)
    return schedule_spec(name).build(p, m, v, communication=communication)


# --- the vocabulary: names, titles and the closed forms the planner uses -------------------------
# Units: a rank's activations in flight are counted in micro-batches of *all* its layers, so a
# (stage, micro-batch) pair of an interleaved rank, which holds 1/v of its layers, counts 1/v:
# in_flight_by_rank(...)[r] == max_in_flight(schedule)[r] / v. The bubble is the idle time of a
# step over its ideal (bubble-free) time, with balanced stages and free point-to-point:
# (p - 1) / (v·m) for GPipe and 1F1B (v = 1) and interleaved (Narayanan et al. 2021, eq. 1 and
# sec. 2.2.2). ``bubble_share`` is the idle part of the actual step, what ``simulated_bubble``
# measures: (p - 1) / (v·m + p - 1). The zero-bubble schedules' bubble depends on how the backward
# time compares with the forward's: ``backward_ratio`` r = (T_B + T_W) / T_F with T_B = T_W
# (Qi et al. 2024 take the three equal: r = 2, the default; the planner passes its units' ratio).
# ``_idle`` gives each rank's idle time in forward times of one micro-batch (all v chunks).


def _classic_idle(p: int, m: int, v: int, r: Fraction) -> Fraction:
    return (p - 1) * (1 + r) / v  # (p - 1) forward + backward times of one chunk (Narayanan et al. 2021)


def _zb_h1_idle(p: int, m: int, v: int, r: Fraction) -> Fraction:
    # (p - 1)(T_F + T_B - T_W) (Qi et al. 2024, sec. 2.1) = (p - 1)·T_F for T_B = T_W; with m < p
    # fewer W's than the cool-down's gaps: each of the p - m missing ones leaves T_W idle.
    return (p - 1) + max(0, p - m) * r / 2


def _zb_h2_idle(p: int, m: int, v: int, r: Fraction) -> Fraction:
    return Fraction(p - 1)  # the first input's trip to the last rank; the W's fill every other gap


def _zb_h1_in_flight(p: int, r: int, m: int, v: int) -> Fraction:
    return Fraction(min(p, m))  # every rank: its 1F1B warm-up plus the r W's it holds back


def _zb_h2_in_flight(p: int, r: int, m: int, v: int) -> Fraction:
    return Fraction(2 * p - 1)  # every rank fills up to 2p - 1 before it runs a W (m >= 2p - 1)


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
    builder: Callable[..., Schedule]  # (p, m) or, chunked, (p, m, v); keyword communication
    rank_in_flight: Callable[[int, int, int, int], Fraction]  # (p, r, m, v) -> see in_flight_by_rank
    source: str
    idle: Callable[[int, int, int, Fraction], Fraction] = _classic_idle  # (p, m, v, r) -> per rank, in T_F
    split_backward: bool = False  # runs BackwardInput and BackwardWeight instead of Backward
    more_rules: Callable[[int, int], None] | None = None  # (p, m): raises for sizes it cannot build

    def check(self, p: int, m: int, v: int = 1) -> None:
        """Raise ValueError unless (p, m, v) suit this schedule (the rules ``build`` enforces)."""
        _check_sizes(self.name, p, m, v)
        if not self.chunked and v != 1:
            raise InvalidValue(f"{self.name}: v={v} model chunks per rank needs the 'interleaved' schedule")
        if self.chunked:
            _check_multiple(self.name, p, m)
        if self.more_rules is not None:
            self.more_rules(p, m)

    def build(self, p: int, m: int, v: int = 1, *, communication: bool = True) -> Schedule:
        """The action lists the executor runs for p pipeline ranks, m micro-batches, v chunks (``communication``
        False: the compute actions alone)."""
        self.check(p, m, v)
        sizes = (p, m, v) if self.chunked else (p, m)
        return self.builder(*sizes, communication=communication)

    def bubble_fraction(self, p: int, m: int, v: int = 1, backward_ratio=2) -> Fraction:
        """Idle time over the ideal step time m·(T_F + T_B + T_W). (p - 1)/(v·m) for GPipe, 1F1B and
        interleaved, whatever the ratio (p=4, m=8: 3/8; interleaved v=2: 3/16). ZB-H1
        ((p - 1) + max(0, p - m)·r/2)/(m(1 + r)), ZB-H2 (p - 1)/(m(1 + r)) for r = backward_ratio
        (p=4, m=8, r=2: 1/8 both)."""
        self.check(p, m, v)
        r = _ratio(backward_ratio)
        return self.idle(p, m, v, r) / (m * (1 + r))

    def bubble_share(self, p: int, m: int, v: int = 1, backward_ratio=2) -> Fraction:
        """Idle part of the actual step, b/(1 + b) for b = ``bubble_fraction``: (p - 1)/(v·m + p - 1)
        for 1F1B (p=4, m=8: 3/11); ZB-H1 and ZB-H2 at r = 2: (p - 1)/(3m + p - 1) (3/27 = 1/9)."""
        bubble = self.bubble_fraction(p, m, v, backward_ratio)
        return bubble / (1 + bubble)

    def in_flight_by_rank(self, p: int, m: int, v: int = 1) -> tuple[Fraction, ...]:
        """Activations pipeline rank r holds at its peak, r = 0..p-1, in micro-batches of all the
        rank's layers: m GPipe, min(p - r, m) 1F1B, min(m, p + (p - 1 - 2r)/v) interleaved, min(p, m)
        ZB-H1, 2p - 1 ZB-H2. A split backward frees them at its W, which still reads them: the
        executor's BackwardInput keeps the stage's whole autograd graph for it."""
        self.check(p, m, v)
        return tuple(self.rank_in_flight(p, r, m, v) for r in range(p))

    def in_flight(self, p: int, m: int, v: int = 1) -> Fraction:
        """The fullest rank's figure (rank 0's): m, min(p, m), min(m, p + (p - 1)/v), min(p, m), 2p - 1."""
        return max(self.in_flight_by_rank(p, m, v))


SCHEDULE_SPECS: Mapping[str, ScheduleSpec] = MappingProxyType({spec.name: spec for spec in (
    ScheduleSpec("gpipe", "GPipe", False, gpipe, _gpipe_in_flight,
                 "Huang et al. 2019: all m forwards run before any backward, so every activation is kept"),
    ScheduleSpec("1f1b", "1F1B", False, one_f_one_b, _one_f_one_b_in_flight,
                 "Narayanan et al. 2021 sec. 2.2.1 (PipeDream-Flush): rank r warms up p - r micro-batches"),
    ScheduleSpec("interleaved", "interleaved 1F1B", True, interleaved_one_f_one_b, _interleaved_in_flight,
                 "Narayanan et al. 2021 sec. 2.2.2; in flight per Korthikanti et al. 2022 sec. 4.2.3 "
                 "(Megatron-LM's warm-up of 2(p-r-1) + (v-1)p + 1 chunks of 1/v of the layers)"),
    ScheduleSpec("zb-h1", "ZB-H1", False, zero_bubble_h1, _zb_h1_in_flight,
                 "Qi et al. 2024 sec. 2.1: 1F1B's memory, a third of its bubble at T_F = T_B = T_W",
                 _zb_h1_idle, True),
    ScheduleSpec("zb-h2", "ZB-H2", False, zero_bubble_h2, _zb_h2_in_flight,
                 "Qi et al. 2024 sec. 2.2: 2p - 1 in flight; in one synchronous step only the (p-1)·T_F "
                 "ramp is left, which ZB-H1 also reaches when T_B = T_W", _zb_h2_idle, True, _check_enough_for_h2),
)})
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_SPECS)  # ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")


def _ratio(value) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)) or not value >= 0:
        raise InvalidValue(f"backward_ratio must be a number >= 0 (backward time over forward time), "
                           f"got {value!r}")
    return Fraction(value)


def schedule_spec(name: str) -> ScheduleSpec:
    """The ScheduleSpec of ``name``; ValueError naming the known schedules otherwise."""
    spec = SCHEDULE_SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise InvalidValue(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return spec
