"""The configurations the degree search may try: mesh degrees, micro-batch, schedule, recompute.

A candidate is one choice of (dp, tp, pp), micro-batch size b, pipeline schedule (with v model
chunks per device when interleaved) and recompute mode. The rules, so a reader can argue with them:

- dp·tp·pp = world size, and tp divides the devices of every node: tp is innermost in the mesh
  (``ir/mesh.py``), so its groups, whose all-reduces run in every layer, then ride NVLink
  (Narayanan et al. 2021, takeaway #1).
- pp ≤ units of the condensed block graph (a stage holds at least one unit), and pp·v ≤ units.
- b divides global_batch / dp; m = global_batch / (dp·b) micro-batches per step and dp rank.
  Unless b is pinned, b ≤ ``MAX_MICRO_BATCH``: larger micro-batches gain little once matmuls are
  big enough, and each distinct b costs one tensor-split solve.
- "interleaved" needs pp > 1 and m a multiple of pp (Megatron-LM's requirement). With one stage
  every schedule is plain gradient accumulation, so only "1f1b" is listed unless pinned.
- "zb-h1" (split backward, Qi et al. 2024) is offered with pp > 1. "zb-h2" only when pinned: with the
  backward's two halves priced equal its step equals ZB-H1's at more memory, so it cannot win.
- Recompute modes apply to blocks only; a model without blocks is offered "none" unless pinned.
- Activation offload ("blocks": each block's kept activations to host memory, prefetched back) is
  offered with recompute "none" or "selective" (full recompute keeps only block inputs already), on
  blocks only, and only where every device has a host link whose memory is not its own
  (``DeviceSpec.offload_frees_memory``: not on CPUs); it can be pinned anywhere it is priced.
- Context parallelism (``cp``, issue 36): dp·cp·tp·pp = world size, cp ranks sharing a dp rank's
  samples, each holding seq / cp tokens of every sequence. Offered only for a model whose attention the
  lowering can split (``ContextFacts.offered``), at a cp with seq a multiple of 2·cp (the load-balanced
  chunks) and, unless cp is pinned, at least ``MIN_CONTEXT_TOKENS`` tokens a rank (below that a ring
  step's attention, (S/cp)², is too small to hide its key/value transfer, a sequence so short fits at
  cp = 1 on the devices Xirang prices, and each cp is one more split ILP per (tp, micro-batch)),
  beside nothing the runtime refuses (``context_parallel_conflicts``: ep 1, ZeRO 0, no sequence
  parallelism, even dp shares, so not in a World of mixed device kinds), and at pp 1 where weights are
  tied (their sums across pipeline ranks are not built per cp rank). Each cp > 1 is offered by ring, by
  all-to-all where cp divides every attention's query heads per tp rank, and by USP ("usp:A", an
  all-to-all over A ranks x a ring over cp / A) for each A dividing cp and those heads
  (``context_method``, ir/context_method.py).
- Sequence parallelism (``sequence_parallel``: the split ILP may shard the residual stream along the
  sequence, Korthikanti et al. 2022) means something only where tp > 1. The space lists it only when
  pinned on; unpinned, the search (``plan_search``) prices it for its few best tp > 1 candidates,
  since each (tp, micro-batch) it needs is one more split ILP.

Any of these choices can be pinned; a pin no candidate satisfies fails with what was wrong and
the values that would work, given the other pins. No torch here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, reduce
from typing import Iterator, Optional

from xirang.ir.context_method import SPELLINGS, methods_at, usp_a2a
from xirang.ir.errors import XirangError
from xirang.ir.mesh import ORDERS, Mesh
from xirang.ir.plan import OFFLOAD_MODES, RECOMPUTE_MODES
from xirang.ir.schedules import SCHEDULES, schedule_spec
from xirang.ir.world import World
from xirang.passes.planning.context_parallel_cost import ContextFacts, context_parallel_conflicts, method_refusal

MAX_MICRO_BATCH = 16
MIN_CONTEXT_TOKENS = 1024  # tokens of each sequence a cp rank holds at least, unless cp is pinned
PIN_NAMES = ("tp", "pp", "dp", "micro_batch", "schedule", "virtual_stages", "recompute", "offload", "zero_stage",
             "sequence_parallel", "ep", "cp", "context_method")
# offered when dp > 1: 0 replicates the optimizer state over dp, 1 shards it, 3 shards the parameters too
ZERO_STAGES = (0, 1, 3)
# a Candidate's ``outermost`` -> its mesh's rank order: pp outermost (Megatron-Core's default) or dp outermost
ORDER_BY_OUTERMOST = {order[0]: order for order in ORDERS}
OFFLOAD_WITH = ("none", "selective")  # the recompute modes offload is offered with


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration to price. ``virtual_stages`` is 1 except for "interleaved"."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_micro_batches: int
    schedule: str
    virtual_stages: int
    recompute: str
    offload: str = "none"
    zero_stage: int = 0  # 1: ZeRO-1, optimizer state sharded over dp; 3: parameters too (offered when dp > 1)
    sequence_parallel: bool = False  # the split with sequence-sharded rows (only where tp > 1)
    outermost: str = "pp"  # the rank axis laid out outermost (ir/mesh.py ORDERS): "pp" or "dp"
    ep: int = 1  # expert parallelism folded over the dp ranks (a model with experts; ZeRO 0 beside it)
    cp: int = 1  # context parallelism: ranks sharing each sequence, seq / cp tokens each
    context_method: str = "ring"  # how cp > 1 attends: "ring", "all_to_all" or "usp:A" (ir/context_method.py)

    @property
    def mesh(self) -> Mesh:
        return Mesh(dp=self.dp, pp=self.pp, tp=self.tp, ep=self.ep, cp=self.cp,
                    order=ORDER_BY_OUTERMOST[self.outermost])

    @property
    def layout(self) -> tuple:
        """What places the ranks: the mesh's sizes and its order (a key for what depends on them alone)."""
        return (self.dp, self.pp, self.tp, self.outermost, self.ep, self.cp)

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp ranks times model chunks per rank."""
        return self.pp * self.virtual_stages

    def label(self) -> str:
        """'dp=16 pp=4 tp=8 b=2 m=16 interleaved v=2 recompute=full' (and ' offload=blocks', ' zero=1', ' sp')."""
        v = f" v={self.virtual_stages}" if self.schedule == "interleaved" else ""
        offload = f" offload={self.offload}" if self.offload != "none" else ""
        zero = f" zero={self.zero_stage}" if self.zero_stage else ""
        sp = " sp" if self.sequence_parallel else ""
        order = " dp-outermost" if self.outermost == "dp" else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp} {self.context_method}" if self.cp > 1 else ""
        return (f"dp={self.dp} pp={self.pp}{cp} tp={self.tp}{ep} b={self.micro_batch} m={self.num_micro_batches} "
                f"{self.schedule}{v} recompute={self.recompute}{offload}{zero}{sp}{order}")


def in_flight_by_rank(schedule: str, p: int, m: int, v: int = 1) -> tuple[float, ...]:
    """Micro-batches of activations pipeline rank r holds at its peak, for r = 0..p-1: the closed
    forms of ``ScheduleSpec.in_flight_by_rank`` (ir/schedules.py), as floats.

    - GPipe: all m forwards run before any backward (Huang et al. 2019).
    - 1F1B: rank r warms up p - r micro-batches (Narayanan et al. 2021, sec. 2.2.1).
    - Interleaved: Megatron-LM warms rank r up with 2(p-r-1) + (v-1)p chunks and holds one more in
      the steady state, each chunk 1/v of the rank's layers: p + (p-1-2r)/v micro-batches of all its
      layers, p + (p-1)/v on rank 0 (Korthikanti et al. 2022, sec. 4.2.3). Each chunk of a rank is
      charged that rank's figure, exact when its chunks keep equal activations.
    Never more than m: a rank cannot hold micro-batches the step does not have.
    """
    try:
        hash((schedule, p, m, v))
    except TypeError:  # not a name or not ints: let the spec's checks say which
        return tuple(float(x) for x in schedule_spec(schedule).in_flight_by_rank(p, m, v))
    return _in_flight_by_rank(schedule, p, m, v)


@lru_cache(maxsize=4096, typed=True)  # the search prices many candidates of few (schedule, p, m, v)
def _in_flight_by_rank(schedule: str, p: int, m: int, v: int) -> tuple[float, ...]:
    return tuple(float(x) for x in schedule_spec(schedule).in_flight_by_rank(p, m, v))


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, found in O(sqrt n) by pairing d with n // d, so a
    global batch of 1e9 samples costs 31,623 trials, not 1e9 (the search's time must not grow with
    the batch)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def tp_degrees(world: World) -> list[int]:
    """tp values whose groups stay inside a node: divisors of every node's device count."""
    return divisors(reduce(math.gcd, (node.devices for node in world.nodes)))


def check_global_batch(global_batch) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise XirangError(f"global_batch={global_batch!r} must be a positive int (samples per optimizer step)",
                          where="global_batch=", hint="pass e.g. global_batch=1024")


def offload_offered(world: World) -> bool:
    """Whether the search tries activation offload unpinned: every device has a host link to memory
    of its own (``DeviceSpec.offload_frees_memory``)."""
    return all(node.device.offload_frees_memory for node in world.nodes)


def candidates(world: World, units: int, global_batch: int, *, has_blocks: bool = True,
               pins: Optional[dict] = None, experts: int = 0,
               context: Optional[ContextSpace] = None) -> list[Candidate]:
    """Every candidate satisfying the rules and the pins (``PIN_NAMES`` -> value, None = free).
    ``experts``: how many experts every experts call of the model can be split by (0: no experts);
    ep runs over the divisors of dp that divide it, with ZeRO 0 (the runtime runs ep beside no ZeRO).
    ``context``: where cp > 1 may be offered (None: nowhere, cp = 1 only).

    Raises XirangError when a pin is malformed or no candidate satisfies all the pins at once.
    """
    pins = {name: value for name, value in (pins or {}).items() if value is not None}
    _check_pin_values(pins)
    if pins.get("offload", "none") != "none":
        unlinked = sorted({node.device.name for node in world.nodes if node.device.host_link_bytes_per_s is None})
        if unlinked:
            raise XirangError(f"offload={pins['offload']!r} needs the host link of every device, and "
                              f"{', '.join(unlinked)} has none", where="offload=",
                              hint="give the DeviceSpec a host_link_bytes_per_s, or leave offload unset")
    if pins.get("ep", 1) > 1 and not experts:
        raise XirangError(f"ep={pins['ep']} was pinned, but the model has no experts modules to spread",
                          where="ep=", hint="leave ep unset (or 1) for a model without Mixture-of-Experts layers")
    context = context or ContextSpace()
    if pins.get("cp", 1) > 1 or pins.get("context_method", "ring") != "ring":
        refusal = context.refusal()
        if refusal:
            name = "cp" if pins.get("cp", 1) > 1 else "context_method"
            raise XirangError(f"{name}={pins[name]!r} was pinned, but {refusal}", where=f"{name}=",
                              hint="leave cp and context_method unset (or cp=1) for this model or World")
    found = list(_space(world, units, global_batch, has_blocks, pins, offload_offered(world), experts=experts,
                        context=context))
    if not found:
        raise _no_candidate_error(world, units, global_batch, has_blocks, pins, experts, context)
    return found


@dataclass(frozen=True)
class ContextSpace:
    """Where cp > 1 may be offered: the model's attention (``ContextFacts``), the sequence planned for and
    whether the World mixes device kinds (dp shares may then be uneven, which cp does not run beside)."""

    facts: ContextFacts = ContextFacts()
    seq: int = 1
    mixed: bool = False

    def refusal(self) -> Optional[str]:
        """Why no cp > 1 is offered at all, or None."""
        if self.facts.refusal:
            return self.facts.refusal
        if not self.facts.calls:
            return "the model has no scaled_dot_product_attention call for context parallelism to split"
        if self.mixed:
            return ("context parallelism does not run beside uneven dp shares, which a World of mixed device "
                    "kinds deals")
        return None

    def degrees(self, ranks: int, pp: int, pinned: Optional[int] = None) -> list[int]:
        """cp values for ``ranks`` = world / (tp·pp): 1, and the divisors with seq a multiple of 2·cp and
        ``MIN_CONTEXT_TOKENS`` a rank (any cp when pinned; pp 1 only where weights are tied)."""
        if self.refusal() or (self.facts.tied_weights and pp > 1):
            return [1]
        return [cp for cp in divisors(ranks) if cp == 1 or self.seq % (2 * cp) == 0
                and (pinned == cp or self.seq // cp >= MIN_CONTEXT_TOKENS)]

    def methods(self, tp: int, cp: int) -> list[str]:
        """The attention methods offered at (tp, cp) (ir/context_method.py): ring always; all-to-all,
        and USP's all-to-all over each A dividing cp x ring over cp / A, where every call's heads allow it."""
        return [method for method in methods_at(cp)
                if not any(method_refusal(call, tp, cp, method) for call in self.facts.calls)]


def _meshes(world: World, units: int, pins: dict,
            context: Optional[ContextSpace] = None) -> Iterator[tuple[int, int, int, int]]:
    """(tp, pp, dp, cp) the world allows, before the batch is considered."""
    context = context or ContextSpace()
    for tp in tp_degrees(world):
        if world.size % tp or pins.get("tp", tp) != tp:
            continue
        for pp in divisors(world.size // tp):
            if pp > units or pins.get("pp", pp) != pp:
                continue
            for cp in context.degrees(world.size // (tp * pp), pp, pins.get("cp")):
                dp = world.size // (tp * pp * cp)
                if pins.get("cp", cp) == cp and pins.get("dp", dp) == dp:
                    yield tp, pp, dp, cp


def _modes(has_blocks: bool, pins: dict, offload: bool) -> list[tuple[str, str]]:
    """(recompute, offload) pairs to try (see the module docstring)."""
    pinned_rc, pinned_off = pins.get("recompute"), pins.get("offload")
    recompute = (pinned_rc,) if pinned_rc else RECOMPUTE_MODES if has_blocks else ("none",)
    pairs = []
    for rc in recompute:
        for off in OFFLOAD_MODES:
            if pinned_off is not None and off != pinned_off:
                continue
            if off != "none" and pinned_off is None and not (offload and has_blocks and rc in OFFLOAD_WITH):
                continue
            pairs.append((rc, off))
    return pairs


def expert_degrees(dp: int, experts: int, pinned: Optional[int] = None) -> list[int]:
    """ep values for a dp degree: divisors of dp that divide the expert count (1 alone without experts)."""
    found = [ep for ep in divisors(dp) if experts and experts % ep == 0] or [1]
    return [ep for ep in found if pinned in (None, ep)]


def _space(world: World, units: int, global_batch: int, has_blocks: bool, pins: dict,
           offload: bool = False, cap_micro_batch: bool = True, experts: int = 0,
           context: Optional[ContextSpace] = None) -> Iterator[Candidate]:
    pinned_b = pins.get("micro_batch")
    modes = _modes(has_blocks, pins, offload)
    context = context or ContextSpace()
    for tp, pp, dp, cp in _meshes(world, units, pins, context):
        sp = bool(pins.get("sequence_parallel")) and tp > 1  # at tp 1 there is nothing to shard
        if global_batch % dp:
            continue
        methods = [method for method in context.methods(tp, cp) if pins.get("context_method", method) == method]
        per_rank = global_batch // dp
        limit = per_rank if pinned_b is not None or not cap_micro_batch else MAX_MICRO_BATCH
        for b in divisors(per_rank):
            if b > limit or pins.get("micro_batch", b) != b:
                continue
            m = per_rank // b
            for schedule, v in _schedules(pp, m, units, pins):
                for recompute, offload_mode in modes:
                    # cp > 1 runs beside ep 1 only: a pinned ep > 1 rules those meshes out, not the pin
                    for ep in expert_degrees(dp, experts, pins.get("ep")) if cp == 1 else \
                            [1] if pins.get("ep", 1) == 1 else []:
                        for zero in ZERO_STAGES if dp > 1 and ep == 1 else (0,):
                            if pins.get("zero_stage", zero) != zero or context_parallel_conflicts(
                                    cp=cp, ep=ep, zero_stage=zero, sequence_parallel=sp):
                                continue
                            for method in methods:
                                yield Candidate(tp, pp, dp, b, m, schedule, v, recompute, offload_mode, zero, sp,
                                                ep=ep, cp=cp, context_method=method)


def _schedules(pp: int, m: int, units: int, pins: dict) -> Iterator[tuple[str, int]]:
    wanted, v_pin = pins.get("schedule"), pins.get("virtual_stages")
    if wanted is None and v_pin is not None and v_pin > 1:
        wanted = "interleaved"
    plain = ("1f1b", "gpipe", "zb-h1", "zb-h2") if pp > 1 or wanted is not None else ("1f1b",)
    for schedule in plain:
        if schedule == "zb-h2" and (wanted != schedule or m < 2 * pp - 1):
            continue
        if wanted in (None, schedule) and v_pin in (None, 1):
            yield schedule, 1
    if wanted in (None, "interleaved") and pp > 1 and m % pp == 0:
        for v in range(2, units // pp + 1):
            if v_pin in (None, v):
                yield "interleaved", v


def _check_pin_values(pins: dict) -> None:
    for name, value in pins.items():
        if name not in PIN_NAMES:
            raise XirangError(f"unknown planning choice {name!r}", hint=f"pin one of: {', '.join(PIN_NAMES)}")
        if name == "schedule":
            if value not in SCHEDULES:
                raise XirangError(f"schedule={value!r} is not a pipeline schedule Xirang knows",
                                  where="schedule=", hint=f"use one of: {', '.join(SCHEDULES)}")
        elif name == "recompute":
            if value not in RECOMPUTE_MODES:
                raise XirangError(f"recompute={value!r} is not a recompute mode", where="recompute=",
                                  hint=f"use one of: {', '.join(RECOMPUTE_MODES)}")
        elif name == "offload":
            if value not in OFFLOAD_MODES:
                raise XirangError(f"offload={value!r} is not an activation offload mode", where="offload=",
                                  hint=f"use one of: {', '.join(OFFLOAD_MODES)}")
        elif name == "zero_stage":
            if type(value) is not int or value not in ZERO_STAGES:
                raise XirangError(f"zero_stage={value!r} is not a ZeRO stage Xirang runs", where="zero_stage=",
                                  hint="use 0 (optimizer state replicated over dp), 1 (sharded over dp) or 3 "
                                       "(parameters sharded too)")
        elif name == "ep":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise XirangError(f"ep={value!r} must be a positive int (the expert-parallel degree, folded over dp)",
                                  where="ep=", hint="pin a divisor of dp that divides the number of experts")
        elif name == "context_method":
            try:
                usp_a2a(value)
            except XirangError:
                raise XirangError(f"context_method={value!r} is not a context-parallel attention method",
                                  where="context_method=", hint=f"use {SPELLINGS}") from None
        elif name == "sequence_parallel":
            if not isinstance(value, bool):
                raise XirangError(f"sequence_parallel={value!r} must be True or False", where="sequence_parallel=",
                                  hint="pass True or False, or leave it unset to let the planner choose")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise XirangError(f"{name}={value!r} must be a positive int", where=f"{name}=",
                              hint=f"pass a positive int, or leave {name} unset to let the planner choose")
    if pins.get("schedule") == "interleaved" and pins.get("virtual_stages") == 1:
        raise XirangError("schedule='interleaved' with virtual_stages=1 is plain 1F1B",
                          where="virtual_stages=", hint="use virtual_stages >= 2, or schedule='1f1b'")
    if pins.get("schedule") in SCHEDULES and pins.get("schedule") != "interleaved" \
            and pins.get("virtual_stages", 1) != 1:
        raise XirangError(f"virtual_stages={pins['virtual_stages']} needs schedule 'interleaved', not "
                          f"{pins['schedule']!r}", where="virtual_stages=",
                          hint="set schedule='interleaved', or drop virtual_stages")


def _no_candidate_error(world: World, units: int, global_batch: int, has_blocks: bool,
                        pins: dict, experts: int = 0, context: Optional[ContextSpace] = None) -> XirangError:
    """Name the pins no candidate satisfies, with the values each could take given the others."""
    dps = sorted({dp for _, _, dp, _ in _meshes(world, units, pins, context)})
    if dps and not any(global_batch % dp == 0 for dp in dps):
        return XirangError(
            f"global_batch {global_batch} is not divisible by any data-parallel degree this world allows: "
            f"dp in {{{', '.join(map(str, dps))}}} (dp = {world.size} devices / (tp x pp), tp within a node, "
            f"pp at most {units} units)", where=f"global_batch={global_batch}" + (f", {_fmt(pins)}" if pins else ""),
            hint=f"use a global_batch that is a multiple of {dps[0]}, e.g. {dps[0] * max(1, global_batch // dps[0])}")
    reasons, hints = [], []
    for name, value in pins.items():
        if name == "sequence_parallel":
            continue  # it never excludes a candidate: at tp 1 it is simply off
        others = {k: v for k, v in pins.items() if k != name}
        valid = sorted({getattr(c, name) for c in _space(world, units, global_batch, has_blocks, others,
                                                         offload_offered(world), cap_micro_batch=False,
                                                         experts=experts, context=context)},
                       key=_order)
        if value not in valid:
            reasons.append(f"{name}={value!r}" + _why(name, value, world, units, global_batch))
            shown = ", ".join(str(v) for v in valid[:24]) + (", ..." if len(valid) > 24 else "")
            given = f" given {_fmt(others)}" if others else ""
            hints.append(f"{name} in {{{shown or 'none'}}}{given}")
    if not reasons:  # each pin is possible alone but not together (cannot happen with these rules)
        reasons.append(f"the pins {_fmt(pins)} exclude each other")
    return XirangError(f"no configuration of {world.size} devices and global batch {global_batch} satisfies "
                       + "; ".join(reasons), where=_fmt(pins) or "the planner's rules",
                       hint="use " + "; ".join(hints) if hints else "unpin some choices")


def _why(name: str, value, world: World, units: int, global_batch: int) -> str:
    per_node = reduce(math.gcd, (node.devices for node in world.nodes))
    if name == "tp" and per_node % value:
        return f" (tp groups must stay inside a node and {value} does not divide {per_node} devices per node)"
    if name in ("tp", "pp", "dp") and world.size % value:
        return f" (does not divide the {world.size} devices)"
    if name == "pp" and value > units:
        return f" (more stages than the {units} units of the model: every stage needs one)"
    if name == "dp" and global_batch % value:
        return f" (does not divide global_batch {global_batch})"
    if name == "micro_batch":
        return f" (must divide global_batch / dp = {global_batch} / dp)"
    if name == "ep":
        return " (ep must divide dp and the number of experts, and runs with zero_stage 0)"
    if name == "cp":
        return (" (cp must divide the devices over tp x pp, seq must be a multiple of 2·cp, and cp runs beside "
                "ep 1, zero_stage 0, no sequence parallelism, pp 1 where weights are tied)")
    if name == "context_method" and value != "ring":
        return (" (all-to-all needs cp, and usp:A needs A, to divide every attention's query heads per tp rank; "
                "usp:A needs A to divide cp, 1 < A < cp)")
    if name == "zero_stage" and value:
        return " (shards over dp: needs dp > 1)"
    if name == "virtual_stages":
        return f" (needs pp > 1, pp·v <= {units} units, and micro-batches a multiple of pp)"
    if name == "schedule" and value == "interleaved":
        return " (needs pp > 1 and micro-batches per step a multiple of pp)"
    if name == "schedule" and value == "zb-h2":
        return " (needs at least 2·pp - 1 micro-batches per step)"
    return ""


def _order(value):
    return (0, value, "") if isinstance(value, int) else (1, 0, str(value))


def _fmt(pins: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in pins.items())
