"""Degree search: choose (dp, tp, pp), micro-batch, schedule, recompute and activation offload with the
fastest predicted step that fits device memory, reading only per-unit costs (``TensorSplit``) from a
``price`` callable.

    price(tp, tp_group, micro_batch, seq, memory_limit_bytes=None) -> TensorSplit

is called once per (tp, micro-batch) the candidates need (``SplitPricer.price`` in the compiler; a
function returning hand-made costs in tests), on ``SPLIT_WORKERS`` threads: CBC solves each split in a
child process, so while one split's ILP solves there the next one is built here (the results, and so
the plan, do not depend on the order). Then, with no further solves:

1. every candidate gets a lower bound on its step (balanced stages, no sends, no dp sync) and a
   lower bound on its memory (the average pipeline rank);
2. candidates are priced in order of that bound with the fast cuts of ``plan_partition`` (exact up
   to a bisection tolerance when cut sends cost the same everywhere) and a closed-form dp sync,
   until the bound passes the ``alternatives + 1``-th best step found; the rest cannot enter the
   table and are never cut;
3. the best few (``exact_top``, and every one the plan will show) are re-cut with the exact
   ``solve_stage_cuts`` (ILP or DP: exact for GPipe and 1F1B; for interleaved, exact under a
   per-chunk share 1/v of device memory, so the fast cut is kept where that share is too strict)
   and their dp sync priced bucket by bucket; the winner is the fastest of them. A candidate the
   fast pass pruned is not revisited, though its exact price could differ from the estimate by
   the dp-sync approximation (small: the two agree when gradients arrive at an even rate).
4. sequence parallelism, unpinned (``sequence_parallel=None``): each of the ``SP_SEEDS`` best tp > 1
   candidates of step 3, and up to two faster ones that do not fit, is priced again on the split
   with sequence-sharded rows (one more ILP per (tp, micro-batch)), in every recompute mode its mesh
   was offered, and competes with the rest; only where nothing fits without it is the whole tp > 1
   space priced with it. Both layouts are real ILP solutions, so the winner is whichever costs less.
5. the rank order (ir/mesh.py ``ORDERS``): steps 1-4 lay ranks out pp outermost (Megatron-Core's
   default: a dp group's ranks close together, pipeline neighbours dp x tp ranks apart); each of the
   ``ORDER_SEEDS`` best with dp and pp > 1 is priced again dp outermost (pipeline neighbours tp ranks
   apart, often on one node; dp groups spread over nodes; on a mixed cluster, whole replicas on one
   kind of device, so uneven dp shares can follow the devices), fast then exact, and competes.

6. context parallelism (``cp``, given the model's attention calls: ``context``): candidates with cp > 1
   compete in steps 1-5 like any other mesh (each its split priced at seq / cp, re-priced for the
   quadratic attention and the ring's or all-to-all's transfers: ``context_parallel_cost``). Since they
   may fill the table, the cp = 1 candidates get a fast pass of their own; its best few are cut exactly
   and seed step 4 too (sequence parallelism runs beside cp = 1 only), with cp = 1's step as the bar.
   Where cp > 1 wins, the winner's other method, priced at its cuts, is shown beside it, and the plan
   says why (``context_reason``: how much slower the best cp = 1 configuration is, or what it needs).

Costs of each term are in ``plan_costs``; the candidate rules in ``plan_search_space``.
"""
from __future__ import annotations

import math
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from operator import attrgetter, itemgetter
from typing import Callable, Optional

from xirang.ir.errors import XirangError
from xirang.ir.world import World

from xirang.passes.planning.context_parallel_cost import NO_CONTEXT, ContextFacts, method_refusal
from xirang.passes.planning.device_speeds import mixed_kinds
from xirang.passes.planning.plan_costs import CandidatePricer, Priced
from xirang.passes.planning.plan_partition import fastest_cuts, fit_stages, least_memory_cuts
from xirang.passes.planning.plan_search_space import (ZERO_STAGES, Candidate, ContextSpace, candidates,
                                                       check_global_batch, tp_degrees)
from xirang.passes.planning.solve_stage_cuts import StageCutProblem, solve_stage_cuts
from xirang.passes.planning.unit_costs import TensorSplit

PriceFn = Callable[..., TensorSplit]
GiB = 1024**3
SPLIT_WORKERS = 2  # splits priced at once: one builds its ILP while another's CBC process solves
ZERO1_MARGIN = 0.01  # ZeRO-1 wins a tie with zero 0 only when 1% faster (``_rank``)
ORDER_SEEDS = 3  # best candidates with dp, pp > 1 priced again laid out dp outermost (step 5)
SP_SEEDS = 3  # best fitting tp > 1 candidates priced again with sequence parallelism (step 4)


@dataclass(frozen=True)
class SearchResult:
    """The winner, its tensor split, the candidates worth showing next to it, and the effort spent."""

    best: Priced
    split: TensorSplit
    alternatives: tuple[Priced, ...]  # fastest others that fit, then faster ones that do not
    candidates: int  # configurations enumerated
    priced: int  # configurations cut and priced (the rest were pruned by their lower bound)
    splits_priced: int  # (tp, micro-batch, sequence parallel) the price callable solved
    price_seconds: float  # wall time spent in the price callable
    search_seconds: float  # the rest of the search
    price_cpu_seconds: float = 0.0  # CPU time of the price calls (this process and its CBC processes)
    context_reason: str = ""  # why the winner's cp (> 1), in words; "" at cp 1
    context_calls: tuple = ()  # the model's attention calls (ContextFacts.calls), which list cp's transfers


def search_plan(price: PriceFn, world: World, *, global_batch: int, seq: int, precision: str = "bf16",
                memory_fraction: float = 0.9, alternatives: int = 5, exact_top: int = 6,
                sequence_parallel: Optional[bool] = False, batch_inputs: int = 1, experts: int = 0,
                routing_imbalance: float = 1.0, context: ContextFacts = NO_CONTEXT, ep_overlap: bool = False,
                capacity_factor: Optional[float] = None, **pins) -> SearchResult:
    """The fastest candidate that fits, with ``alternatives`` others to compare (see module doc).

    ``pins`` (tp, pp, dp, micro_batch, schedule, virtual_stages, recompute, offload, zero_stage) fix a choice. Device
    memory usable by the plan is ``memory_fraction`` of each device's: the rest is headroom for
    what the cost model leaves out (CUDA context and kernels' workspace, NCCL buffers, allocator
    fragmentation), about 8 GiB of an 80 GiB device at the default 0.9.

    ``sequence_parallel``: False (default) prices splits without sequence-sharded rows, so a ``price``
    of hand-made costs need not know them; True with them wherever tp > 1; None both (step 4),
    calling ``price(..., sequence_parallel=True)`` for the splits with them. ``batch_inputs``: tensors the
    step takes, which size the batch agreement each step runs (``step_sync_costs.agreement_bytes``).
    ``experts``: how many experts every experts call can be split by (0: none; ``expert_ops.expert_count``):
    ep is searched over the divisors of dp that divide it, each priced at ``routing_imbalance``
    (``expert_costs``), its all-to-alls under another micro-batch's compute where ``ep_overlap``, its
    most-loaded rank bounded by ``capacity_factor`` (None: dropless).
    ``context``: the model's attention calls and what refuses cp (``ContextFacts``):
    cp is searched over the divisors of world / (tp·pp) the rules allow (plan_search_space), each with
    ``price(..., seq / cp)``.
    """
    check_global_batch(global_batch)
    if not 0 < memory_fraction <= 1:
        raise XirangError(f"memory_fraction={memory_fraction!r} must be in (0, 1]", where="memory_fraction=",
                          hint="0.9 leaves 10% of device memory as headroom")
    started, clock = time.perf_counter(), _Clock(price, seq)
    tp = _first_tp(world, pins.get("tp"))
    first = clock.split(tp, pins.get("micro_batch") or 1, bool(sequence_parallel) and tp > 1)
    has_blocks = any(u.name.startswith("block:") for u in first.units)
    space = ContextSpace(context, seq, mixed_kinds(world))
    todo = candidates(world, len(first.units), global_batch, has_blocks=has_blocks,
                      pins={**pins, "sequence_parallel": sequence_parallel}, experts=experts, context=space)
    clock.split_all([_split_key(c) for c in todo])
    pricer = _ByLayout(lambda sp, cp: CandidatePricer(
        clock.layout(sp, cp), world, global_batch=global_batch, precision=precision, memory_fraction=memory_fraction,
        batch_inputs=batch_inputs, routing_imbalance=routing_imbalance, context=context, seq=seq,
        ep_overlap=ep_overlap, capacity_factor=capacity_factor))
    fitting, failing, skipped, everything, priced = _fast_pass(pricer, todo, alternatives + 1)
    # step 4 still to do: tp must divide the sequence (the lowering refuses a sequence shard it does not)
    shardable = [c for c in todo if c.tp > 1 and c.cp == 1 and seq % c.tp == 0] if sequence_parallel is None else []
    both = bool(shardable)
    if not fitting and both:  # activations may fit only sharded along the sequence: price them all so
        both = False
        twins = [replace(c, sequence_parallel=True) for c in shardable]
        clock.split_all([_split_key(c) for c in twins])
        fitting, failing, skipped, everything, more = _fast_pass(pricer, twins, alternatives + 1)
        todo, priced = todo + twins, priced + more
    if not fitting:
        raise _nothing_fits(pricer, todo, world, memory_fraction)
    # the table shows the best per mesh and schedule; with few of those (pins), other b, v, recompute
    keyed = {p.candidate for p in fitting}
    extra = [p for p in everything if p.candidate not in keyed][:max(alternatives + 1 - len(fitting), 0)]
    top = sorted((_exact(pricer, p) for p in fitting[:max(exact_top, alternatives + 1)] + extra), key=_rank)
    # step 6: cp > 1 candidates may fill the table; the cp = 1 ones' own best few seed step 4 (sequence
    # parallelism runs beside cp = 1 only) and say what cp gains (``context_reason``)
    plain = [c for c in todo if c.cp == 1]
    plain_top, plain_failing, plain_skipped = [], [], []
    if len(plain) < len(todo):
        plain_fitting, plain_failing, plain_skipped, _, more = _fast_pass(pricer, plain, alternatives + 1)
        plain_top, priced = [_exact(pricer, p) for p in plain_fitting[:SP_SEEDS]], priced + more
    if both:  # seeded by the best of all, and by the best cp = 1 (the same rule, with cp = 1's step)
        twins = _sequence_parallel_twins(clock, pricer, top, failing, skipped, shardable)
        if plain_top:
            twins += _sequence_parallel_twins(clock, pricer, sorted(plain_top, key=_rank), plain_failing,
                                              plain_skipped, shardable)
        top = sorted({p.candidate: p for p in top + twins}.values(), key=_rank)
    top = sorted(top + _order_twins(pricer, top), key=_rank)
    best = top[0]
    shown_failing = _faster_but_too_big(pricer, failing, skipped, best.step_seconds)
    shown = top[1:max(alternatives - len(shown_failing), 0) + 1] + shown_failing
    # explain() says what each option saved and cost against the winner without it
    listed = {p.candidate for p in shown[:alternatives]}
    shown = [p for p in _option_counterparts(pricer, best) if p.candidate not in listed] + shown
    reason = context_reason(pricer, best, [p for p in top + plain_top if p.candidate.cp == 1],
                            plain) if best.candidate.cp > 1 else ""
    return SearchResult(best, pricer.of(best.candidate).split_of(best.candidate),
                        tuple(shown[:alternatives]), len(todo), priced, clock.solved, clock.seconds,
                        time.perf_counter() - started - clock.seconds, clock.cpu, reason, context.calls)


def cpu_seconds() -> float:
    """CPU time of this process and of the child processes it waited for (CBC solves split ILPs in one)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _split_key(c: Candidate) -> tuple[int, int, bool, int]:
    return c.tp, c.micro_batch, c.sequence_parallel, c.cp


class _Clock:
    """Calls ``price`` once per (tp, micro-batch, sequence parallel, cp), timing it (wall and CPU), at seq / cp
    tokens. ``layout(sp, cp)`` maps (tp, micro-batch) to the split of that layout."""

    def __init__(self, price: PriceFn, seq: int):
        self.price, self.seq, self.seconds, self.cpu = price, seq, 0.0, 0.0
        self.splits: dict[tuple[bool, int], dict[tuple[int, int], TensorSplit]] = {}

    def layout(self, sequence_parallel: bool, cp: int = 1) -> dict[tuple[int, int], TensorSplit]:
        return self.splits.setdefault((sequence_parallel, cp), {})

    @property
    def solved(self) -> int:
        return sum(map(len, self.splits.values()))

    def split(self, tp: int, micro_batch: int, sequence_parallel: bool = False) -> TensorSplit:
        self.split_all([(tp, micro_batch, sequence_parallel, 1)])
        return self.layout(sequence_parallel)[(tp, micro_batch)]

    def split_all(self, keys) -> None:
        """Price every (tp, micro-batch, sequence parallel, cp) of ``keys`` not priced yet, ``SPLIT_WORKERS``
        at once; the first failure in ``keys`` order is raised, as one by one."""
        fresh = [key for key in dict.fromkeys(keys) if key[:2] not in self.layout(*key[2:])]
        if not fresh:
            return
        start, cpu_start = time.perf_counter(), cpu_seconds()
        with ThreadPoolExecutor(max_workers=min(SPLIT_WORKERS, len(fresh))) as pool:
            # only the splits with sequence-sharded rows pass the keyword: hand-made prices need not know it
            solving = [pool.submit(self.price, tp, tuple(range(tp)), micro_batch, self.seq // cp,
                                   **({"sequence_parallel": True} if sp else {}))
                       for tp, micro_batch, sp, cp in fresh]
            try:
                for (tp, micro_batch, sp, cp), future in zip(fresh, solving):
                    self.layout(sp, cp)[(tp, micro_batch)] = future.result()
            finally:  # nothing else runs meanwhile: the time is the price calls'
                for future in solving:
                    future.cancel()
                self.seconds += time.perf_counter() - start
                self.cpu += cpu_seconds() - cpu_start


class _ByLayout:
    """The CandidatePricer of each candidate's split layout: (sequence-sharded rows or not, cp), each made
    by ``make(sp, cp)`` when first asked for. Every pricing method takes the candidate first and goes to its
    layout's."""

    def __init__(self, make: Callable[[bool, int], CandidatePricer]):
        self.make, self.pricers = make, {}

    def of(self, c: Candidate) -> CandidatePricer:
        key = (c.sequence_parallel, c.cp)
        if key not in self.pricers:
            self.pricers[key] = self.make(*key)
        return self.pricers[key]

    def has_split(self, c: Candidate) -> bool:
        return (c.tp, c.micro_batch) in self.of(c).splits

    def __getattr__(self, name: str):
        if name in ("make", "pricers"):
            raise AttributeError(name)

        def method(c, *args, **kwargs):
            return getattr(self.of(c), name)(c, *args, **kwargs)
        setattr(self, name, method)  # made once per name: the fast pass calls these ~10^5 times
        return method


def _first_tp(world: World, pinned) -> int:
    """The tp of the first split (priced to learn the units): the pinned one when it is valid."""
    return pinned if pinned in tp_degrees(world) and world.size % pinned == 0 else 1


def _key(p: Priced) -> tuple:
    """Candidates shown side by side differ in mesh or schedule, not only in b, v or recompute."""
    c = p.candidate
    return (*c.layout, c.schedule)


def _rank(p: Priced) -> tuple:
    """Fastest first; at equal speed no offload (its copies are hidden, not free: they load the host
    link and host memory), then the default rank order (pp outermost: another order must be faster to be
    chosen), then the candidates' order. ZeRO-1 must be faster by more than
    ``ZERO1_MARGIN``: where nothing overlaps, a ring's reduce-scatter + all-gather prices exactly its
    all-reduce, and neither rounding nor a measured line's noise should pick a collective more per
    step (and a lazily gathered parameter copy); where memory forces it, it wins alone."""
    return (p.step_seconds * (1 + ZERO1_MARGIN * p.candidate.zero_stage), p.candidate.offload != "none",
            p.candidate.outermost != "pp", p.candidate)


def _fast_pass(pricer: CandidatePricer, todo: list[Candidate], keep: int):
    """Price candidates by increasing lower bound until none left can enter the best ``keep``
    (distinct by ``_key``). Returns the fitting and the failing best per key, the candidates the
    memory bound ruled out unpriced (with their step bounds), every fitting candidate priced, and
    how many were priced."""
    bests: dict[tuple, Priced] = {}
    failing: dict[tuple, Priced] = {}
    skipped: list[tuple[float, Candidate]] = []
    everything: list[Priced] = []  # every fitting candidate priced
    threshold, priced = math.inf, 0
    # by bound, ties in the candidates' order (their fields compared as one tuple, in C)
    for bound, _, c in sorted(((pricer.lower_bound(c), _FIELDS(c), c) for c in todo), key=itemgetter(0, 1)):
        if bound >= threshold:
            break
        if pricer.memory_lower_bound(c) > max(pricer.usable(c)):
            skipped.append((bound, c))  # the average pipeline rank already overflows: no cut fits
            continue
        priced += 1
        p = _fast_price(pricer, c)
        if p.fits:
            everything.append(p)
        table, key = (bests, _key(p)) if p.fits else (failing, (_key(p), c.recompute, c.offload))
        if key not in table or _rank(p) < _rank(table[key]):
            table[key] = p
        if p.fits and len(bests) >= keep:
            threshold = sorted(q.step_seconds for q in bests.values())[keep - 1]
    return (sorted(bests.values(), key=_rank), sorted(failing.values(), key=_rank), skipped,
            sorted(everything, key=_rank), priced)


def _faster_but_too_big(pricer: CandidatePricer, failing: list[Priced], skipped, step: float,
                        count: int = 2) -> list[Priced]:
    """Up to ``count`` configurations faster than ``step`` that do not fit, those closest to fitting
    first: they show what the memory limit cost. Each keeps the step of its fastest cut and the
    memory of its leanest (what it needs at least). The same mesh with less recompute is the
    clearest such case, so recompute modes are told apart here. Of the candidates the memory bound
    skipped, the few closest to fitting by that bound are cut for time alone."""
    def overflow(p: Priced) -> float:
        return max(need / have for need, have in zip(p.memory_per_rank, p.usable_per_rank))

    def leanest(p: Priced) -> Priced:
        c = p.candidate
        lean = pricer.price(c, least_memory_cuts(pricer.table(c), c.stages, pricer.in_flight(c)))
        return p if lean.fits else replace(p, memory_per_rank=lean.memory_per_rank)

    near = sorted((pricer.memory_lower_bound(c) / max(pricer.usable(c)), c) for bound, c in skipped if bound < step)
    pool = failing + [pricer.price(c, _time_cuts(pricer, c)) for _, c in near[:4 * count]]
    pool = sorted((p for p in pool if p.step_seconds < step), key=lambda p: (overflow(p), _rank(p)))
    found: dict[tuple, Priced] = {}
    for p in sorted(map(leanest, pool[:4 * count]), key=lambda p: (overflow(p), _rank(p))):
        same = (p.step_seconds, p.memory_per_rank)  # a recompute mode that changes nothing says nothing new
        if all((q.step_seconds, q.memory_per_rank) != same for q in found.values()):
            found.setdefault((_key(p), p.candidate.recompute, p.candidate.offload), p)
    return list(found.values())[:count]


def _time_cuts(pricer: CandidatePricer, c: Candidate):
    """The fastest cuts with memory ignored."""
    return fastest_cuts(pricer.table(c), c.stages, pricer.cut_speeds(c))


def _fast_price(pricer: CandidatePricer, c: Candidate) -> Priced:
    """Fast cuts: within memory for GPipe/1F1B; interleaved first for time alone, then, if a rank
    overflows, within a per-chunk share of memory. Cuts for time alone when nothing fits."""
    interleaved = c.schedule == "interleaved"
    if interleaved:
        p = pricer.price(c, _time_cuts(pricer, c))
        if p.fits:
            return p
    bounds = fit_stages(pricer.table(c), c.stages, pricer.stage_caps(c, per_chunk=interleaved), pricer.in_flight(c),
                        pricer.cut_speeds(c))
    if bounds is None:
        return p if interleaved else pricer.price(c, _time_cuts(pricer, c))
    return pricer.price(c, bounds)


def _option_counterparts(pricer: _ByLayout, best: Priced) -> list[Priced]:
    """The winner with one option changed, at the winner's cuts: every other ZeRO stage (dp > 1, ep 1),
    the other split layout (tp > 1, where that split was solved) and, under expert parallelism, the
    experts held whole (ep 1). explain() compares each with it."""
    c = best.candidate
    others = [replace(c, zero_stage=stage) for stage in ZERO_STAGES
              if stage != c.zero_stage and c.dp > 1 and c.ep == 1 and c.cp == 1]  # cp runs beside no ZeRO
    others += [replace(c, ep=1)] if c.ep > 1 else []
    flipped = replace(c, sequence_parallel=not c.sequence_parallel)
    others += [flipped] if c.tp > 1 and c.cp == 1 and pricer.has_split(flipped) else []
    # the winner's other context-parallel method, where the runtime runs it (context_parallel_cost.py)
    space = ContextSpace(pricer.of(c).context)
    others += [replace(c, context_method=method) for method in space.methods(c.tp, c.cp) if method != c.context_method]
    return [pricer.price(other, best.bounds, exact=True, notes=("the winner's cuts with one option changed",))
            for other in others]


def _order_twins(pricer: _ByLayout, top: list[Priced]) -> list[Priced]:
    """Step 5: the ``ORDER_SEEDS`` best with dp and pp > 1, laid out dp outermost: fast cuts, then exact
    where they fit."""
    twins = [replace(p.candidate, outermost="dp") for p in top
             if p.candidate.dp > 1 and p.candidate.pp > 1 and p.candidate.outermost == "pp"][:ORDER_SEEDS]
    fast = [_fast_price(pricer.of(c), c) for c in twins]
    return [_exact(pricer.of(p.candidate), p) for p in fast if p.fits]


def _sequence_parallel_twins(clock: _Clock, pricer: _ByLayout, top: list[Priced], failing: list[Priced],
                             skipped: list, shardable: list[Candidate]) -> list[Priced]:
    """Step 4: the best fitting tp > 1 candidates and up to two faster ones that did not fit, in every
    recompute mode their configuration was offered (1/tp of the norms' activations may let less
    recompute fit), priced with sequence-sharded rows: fast cuts, then exact where they fit.
    ``shardable``: the candidates whose tp divides the sequence."""
    step = top[0].step_seconds
    seeds = [p.candidate for p in top if p.candidate.tp > 1][:SP_SEEDS]
    seeds += [p.candidate for p in failing if p.candidate.tp > 1 and p.step_seconds < step][:2]
    seeds += [c for bound, c in sorted(skipped, key=lambda s: pricer.memory_lower_bound(s[1]))
              if c.tp > 1 and bound < step][:2]
    wanted = {same_but_recompute(c) for c in seeds}
    twins = [replace(c, sequence_parallel=True) for c in shardable if same_but_recompute(c) in wanted]
    clock.split_all([_split_key(c) for c in twins])
    fast = [_fast_price(pricer.of(c), c) for c in twins]
    return [_exact(pricer.of(p.candidate), p) for p in fast if p.fits]


_FIELDS = attrgetter(*(f.name for f in fields(Candidate)))  # the tuple Candidate's order compares
# every field of a Candidate but these two, read in one C call: ``same_but_recompute`` runs once per
# tp > 1 candidate (tens of thousands), where building a Candidate with ``replace`` cost ~0.1 s
_ALL_BUT_RECOMPUTE_AND_LAYOUT = attrgetter(*(f.name for f in fields(Candidate)
                                             if f.name not in ("recompute", "sequence_parallel")))


def same_but_recompute(c: Candidate) -> tuple:
    """What ``c`` is, recompute mode and split layout aside: candidates equal here are twins in step 4."""
    return _ALL_BUT_RECOMPUTE_AND_LAYOUT(c)


SOLVERS = {"cbc": "an ILP (CBC)", "dp": "dynamic programming", "single-stage": "no cut: one stage"}


def _exact(pricer: CandidatePricer, fast: Priced) -> Priced:
    """Re-cut with ``solve_stage_cuts`` and price the dp sync bucket by bucket; keep the fast cut
    when the exact one is no faster (or, interleaved, when its per-chunk memory share is too strict)."""
    c, table = fast.candidate, pricer.table(fast.candidate)
    interleaved = c.schedule == "interleaved"
    problem = StageCutProblem(
        compute=table.seconds, memory=table.static_bytes, boundary_comm=table.cut_seconds, stages=c.stages,
        capacities=[max(cap, 0.0) for cap in pricer.stage_caps(c, per_chunk=interleaved)],
        activation_memory=table.activation_bytes, in_flight=pricer.in_flight(c),
        unit_names=pricer.units(c).names, speeds=pricer.cut_speeds(c))
    kept = pricer.price(c, fast.bounds, exact=True, notes=(
        "stage cuts by bisection with a greedy check (fast path; the exact solver gave none faster that fits)",))
    try:
        solution = solve_stage_cuts(problem)
    except ValueError:  # interleaved only: the per-chunk share rejects what per-device memory allows
        return pricer.price(c, fast.bounds, exact=True, notes=(
            "stage cuts by bisection: the exact solver's per-chunk memory share (1/v of the device) is "
            "stricter than the per-device check the fast cuts passed",))
    exact = pricer.price(c, solution.bounds, exact=True,
                         notes=(f"stage cuts exact: solve_stage_cuts by {SOLVERS[solution.solver]}",))
    # the cut problem's memory leaves out what the pricer adds (working sets): an exact cut that does not
    # fit replaces a fast one only where that one does not fit either
    return exact if exact.step_seconds <= kept.step_seconds and (exact.fits or not kept.fits) else kept


def _leanest(pricer: CandidatePricer, todo: list[Candidate]) -> tuple[Candidate, float, int]:
    """(candidate, bytes, pipeline rank): the candidate of ``todo`` needing the least memory on its fullest rank."""
    leanest, need, rank = None, math.inf, 0
    # the least memory a candidate needs is at least its average rank's: stop once that is too much
    for floor, c in sorted((pricer.memory_lower_bound(c), c) for c in todo):
        if floor >= need:
            break
        memory = pricer.price(c, least_memory_cuts(pricer.table(c), c.stages, pricer.in_flight(c))).memory_per_rank
        worst = max(range(c.pp), key=memory.__getitem__)
        if memory[worst] < need:
            leanest, need, rank = c, memory[worst], worst
    return leanest, need, rank


def _nothing_fits(pricer: CandidatePricer, todo: list[Candidate], world: World,
                  memory_fraction: float) -> XirangError:
    """The error when no candidate fits: the least memory any of them needs, and what was tried."""
    leanest, need, rank = _leanest(pricer, todo)
    device = world.device_of(leanest.mesh.rank_of(dp=0, pp=rank, tp=0, cp=0))
    tried = {name: sorted({getattr(c, name) for c in todo}, key=str)
             for name in ("micro_batch", "schedule", "recompute", "offload")}
    meshes = [f"({dp}, {pp}, {tp})" + (f" cp={cp}" if cp > 1 else "")
              for dp, pp, tp, cp in sorted({(c.dp, c.pp, c.tp, c.cp) for c in todo})]
    return XirangError(
        f"no plan fits device memory: the leanest configuration tried, {leanest.label()}, needs "
        f"{need / GiB:.1f} GiB on a device of pipeline rank {rank} (model states: fp32 weights, gradients and "
        f"AdamW moments, activations in flight, working set), but a {device.name} has {device.memory_bytes / GiB:.1f} "
        f"GiB, of which the plan may use {memory_fraction:.0%} ({memory_fraction * device.memory_bytes / GiB:.1f} GiB)",
        where=f"{world.describe()}; tried {len(todo)} configurations: meshes (dp, pp, tp) "
              f"{', '.join(meshes[:12])}{', ...' if len(meshes) > 12 else ''}; micro-batches "
              f"{tried['micro_batch']}; schedules {tried['schedule']}; recompute {tried['recompute']}; "
              f"offload {tried['offload']}",
        hint=f"use devices with at least {need / memory_fraction / GiB:.1f} GiB each, more devices "
             f"(more pipeline or tensor parallelism), or a smaller model or sequence")


def context_reason(pricer: _ByLayout, best: Priced, priced: list[Priced], plain: list[Candidate]) -> str:
    """Why the winner's cp > 1, in words: the best cp = 1 configuration of ``priced`` (step 6's, and their
    sequence-parallel twins) and how much slower it is, or, where none fits, the least memory a cp = 1
    configuration needs (``plain``: the cp = 1 candidates)."""
    c, own = best.candidate, pricer.of(best.candidate)
    offered = ContextSpace(own.context).methods(c.tp, c.cp)
    refused = [why for call in own.context.calls for why in [method_refusal(call, c.tp, c.cp, "all_to_all")] if why]
    method = (f"; ring, as all-to-all is not offered here ({refused[0]})" if offered == ["ring"] else
              f"; {c.context_method} priced fastest of {', '.join(offered)} (the others shown beside it)")
    if not plain:
        return f"cp={c.cp} was pinned{method}"
    fitting = sorted((p for p in priced if p.fits), key=_rank)
    if fitting:
        other = fitting[0]
        return (f"cp={c.cp} by {c.context_method} is faster: {best.step_seconds:.4g} s per step against "
                f"{other.step_seconds:.4g} s for the best cp=1 configuration, {other.candidate.label()} (both before "
                f"the tp overlap chosen for the winner after the search){method}")
    lean, need, rank = _leanest(pricer, plain)
    usable = pricer.usable(lean)[rank]
    return (f"the activations do not fit at cp=1 at seq {own.seq}: the leanest cp=1 configuration, {lean.label()}, "
            f"needs {need / 2**20:,.1f} MiB on pipeline rank {rank}, of {usable / 2**20:,.1f} MiB usable{method}")
