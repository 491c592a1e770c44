"""The options of ``xirang.plan`` and ``xirang.compile``, grouped as torchtitan groups its job config:
``PlanChoices`` (what the planner would otherwise search), ``RuntimeOptions`` (how the compiled
program runs) and ``DebugHooks`` (what it records for a person or a test).

The one-line call stays one line: ``xirang.compile(model, world=8)``. A planning choice may be given
directly as a keyword (``tp=2`` is ``choices=PlanChoices(tp=2)``): pins are what people write most,
and both spellings use the field's one name. Runtime options and debugging hooks are only given in
their dataclass, so the functions' signatures stay short enough to read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from xirang.ir.errors import XirangError


@dataclass(frozen=True, kw_only=True)
class PlanChoices:
    """Choices that pin what the planner would otherwise search (None: searched). ``tp``, ``pp``,
    ``dp``: the degrees; ``micro_batch``: samples per micro-batch; ``schedule``: "1f1b", "gpipe",
    "interleaved", "zb-h1", "zb-h2"; ``virtual_stages``: model chunks per pipeline rank (interleaved);
    ``recompute``: "none", "selective", "full"; ``offload``: "none", or "blocks" (each block's
    activations to host memory, prefetched back for its backward); ``precision``: "fp32", "bf16",
    "fp16" (default bf16 on GPUs, fp32 on "cpu"); ``sequence_parallel``: True offers the residual
    stream sharded along the sequence on tp (taken op by op where it costs less), False never;
    ``zero_stage``: 0, 1 or 3; ``tp_overlap``: 0 off, or the chunks the sequence-parallel tp
    collectives are overlapped with their linears in; ``ep``: the expert-parallel degree (a model with
    Mixture-of-Experts layers: a divisor of dp that divides the experts), searched where unset;
    ``cp``: the context-parallel degree (ranks sharing each sequence) and ``context_method`` how its
    attention runs, "ring", "all_to_all" or "usp:A" (all-to-all over A ranks x ring over cp / A;
    ir/context_method.py), searched where unset (passes/planning/plan_search_space.py);
    ``routing_imbalance``: not a choice but a planning input, the most-loaded expert-parallel rank's
    routed rows over the mean (default 1.0: balanced; passes/planning/expert_costs.py); ``ep_overlap``:
    price the expert all-to-alls as run under another micro-batch's compute, as Megatron-Core's
    batch-level overlap runs them (default False: exposed, as Xirang's runtime runs them);
    ``capacity_factor``: each expert computes at most ceil(rows / experts x factor) of the rows a rank
    routes it per micro-batch and the rest are dropped (default None: dropless; codegen/ops/expert_capacity.py)."""

    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    micro_batch: Optional[int] = None
    schedule: Optional[str] = None
    virtual_stages: Optional[int] = None
    recompute: Optional[str] = None
    offload: Optional[str] = None
    precision: Optional[str] = None
    sequence_parallel: Optional[bool] = None
    zero_stage: Optional[int] = None
    tp_overlap: Optional[int] = None
    ep: Optional[int] = None
    cp: Optional[int] = None
    context_method: Optional[str] = None
    routing_imbalance: Optional[float] = None
    ep_overlap: Optional[bool] = None
    capacity_factor: Optional[float] = None

    def pinned(self) -> dict:
        """The choices given, by name (those left to the search omitted)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if getattr(self, field.name) is not None}


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """How ``xirang.compile``'s program runs. ``seed`` (default: rank 0's ``torch.initial_seed()``,
    given to every rank) and ``rng`` ("streams": independent draws per dp rank, micro-batch and tp
    shard; "exact": what one device would draw for the global batch, for verification) fix the
    randomness; ``bucket_bytes`` re-buckets the dp gradients by this size instead of the plan's
    buckets; ``dp_shares`` (samples per step of each dp rank, whole micro-batches) overrides the plan's
    even split; ``rebalance_every=N`` moves micro-batches from slow dp ranks to fast ones every N steps;
    ``inject_every=N`` (1F1B, pp >= 2) re-chooses every N steps the extra warm-up forwards per
    pipeline rank from the stages' measured times."""

    seed: Optional[int] = None
    rng: str = "streams"
    bucket_bytes: Optional[int] = None
    dp_shares: Optional[Any] = None
    rebalance_every: Optional[int] = None
    inject_every: Optional[int] = None


@dataclass(frozen=True, kw_only=True)
class DebugHooks:
    """What ``xirang.compile``'s program records: ``counter`` (a ``CommCounter``) every collective;
    ``event_log`` (a list) the gradient buckets' launch and wait events; ``dump_dir`` the graph after
    every pass (the analysis passes' in ``DIR/analysis``, by rank 0; this rank's lowering passes' in
    ``DIR/rank<R>``), as ``xirang inspect --dump`` does."""

    counter: Optional[Any] = None
    event_log: Optional[list] = None
    dump_dir: Optional[Any] = None


CHOICE_NAMES = tuple(field.name for field in dataclasses.fields(PlanChoices))


def merged_choices(choices: Optional[PlanChoices], pins: dict, where: str) -> PlanChoices:
    """``choices`` with the choices given directly as keywords (``tp=2``) added; a keyword that is no
    choice, a wrong type for ``choices``, or one choice given both ways is refused naming it."""
    if choices is not None and not isinstance(choices, PlanChoices):
        raise XirangError(f"choices= must be a xirang.PlanChoices, got {type(choices).__name__}",
                          where=f"{where}(choices=...)", hint="pass choices=xirang.PlanChoices(tp=2, ...)")
    unknown = sorted(set(pins) - set(CHOICE_NAMES))
    if unknown:
        raise XirangError(f"{where} got unknown keyword(s) {', '.join(f'{name}=' for name in unknown)}",
                          where=f"{where}({unknown[0]}=...)",
                          hint=f"planning choices are {', '.join(CHOICE_NAMES)}; see help({where})")
    choices = choices or PlanChoices()
    twice = sorted(name for name in pins if getattr(choices, name) is not None)
    if twice:
        raise XirangError(f"{where} got {', '.join(twice)} both directly and in choices=", where=f"{where}",
                          hint="give each planning choice once")
    return dataclasses.replace(choices, **pins)


def checked_option(value, kind: type, name: str, where: str):
    """``value`` (None: the defaults of ``kind``) when it is a ``kind``, else a XirangError naming it."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise XirangError(f"{name}= must be a xirang.{kind.__name__}, got {type(value).__name__}",
                          where=f"{where}({name}=...)", hint=f"pass {name}=xirang.{kind.__name__}(...)")
    return value
