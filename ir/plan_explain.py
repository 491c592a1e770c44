"""``plan.explain()``: the chosen configuration next to the ones it beat, and why, as plain text
(``explain_plan``) or JSON-ready data (``explain_data``, for ``xirang explain --json``).

Everything here reads the Plan's data only (its prediction and ``alternatives``), so a plan loaded
from JSON explains itself as well as a fresh one. ``why_lost`` writes the sentence stored with each
alternative when the plan is made. This module imports the plan's parts, not ``Plan`` (ir/plan.py
imports it for ``Plan.explain``): the ``plan`` arguments below are Plans.
"""
from __future__ import annotations

from xirang.ir.context_method import a2a_degree, context_subgroups, is_method_choice, recorded_method
from xirang.ir.plan_parts import Alternative
from xirang.ir.plan_trials import trial_lines

GiB, MiB = 1024**3, 1024**2
# explain's option lines call two figures 'the same' within this fraction of the larger (memory) or of
# the step (a cause's seconds): a difference the cost model cannot tell from zero is no difference
SAME = 0.005
CAUSES = (("compute", "compute"), ("tp_comm", "TP comm"), ("ep_comm", "EP a2a"), ("cp_comm", "CP comm"),
          ("pp_bubble", "bubble"),
          ("pp_p2p", "p2p"),
          ("dp_exposed", "DP exposed"), ("offload", "offload"), ("step_sync", "step sync"))
# the configuration fields that drive each cause; a sentence names those that differ
_DRIVERS = {"compute": ("recompute", "tp", "pp", "b", "m", "sp"), "tp_comm": ("tp", "pp", "b", "m", "sp"),
            "ep_comm": ("ep", "b", "m", "recompute"), "cp_comm": ("cp", "method", "tp", "b", "m", "recompute"),
            "pp_bubble": ("schedule", "pp", "m", "v"), "pp_p2p": ("stages", "b", "m"),
            "dp_exposed": ("dp", "pp", "tp", "zero"),
            "offload": ("offload", "recompute", "tp", "b"), "step_sync": ("dp", "pp", "tp")}
# Options the search prices as on/off or as stages at an otherwise equal configuration. Each: the
# field of ``_fields``, what a value is called, and the causes of the step it moves (with their
# words): explain() prints one line per option from the winner and the row differing in it alone.
OPTIONS = (
    ("zero", "ZeRO", lambda stage: f"zero-{stage}", (("dp_exposed", "exposed all-gather"),)),
    ("ep", "Expert parallelism", lambda ep: f"ep={ep}", (("ep_comm", "all-to-all"), ("compute", "compute"),
                                                          ("dp_exposed", "gradient all-reduce"))),
    ("method", "Context-parallel method", lambda method: method,
     (("cp_comm", "context-parallel transfers"), ("compute", "compute"))),
    ("sp", "Sequence parallelism", lambda on: "sp" if on else "no sp",
     (("tp_comm", "tensor-parallel collectives"), ("compute", "compute"), ("pp_p2p", "pipeline sends"),
      ("offload", "activation copies"))),
)
PART_TITLES = (("parameters", "params"), ("gradients", "grads"), ("optimizer", "optimizer"),
               ("activations", "activations"), ("working_set", "work set"), ("buffers", "buffers"))


def _fields(row: Alternative) -> dict:
    return {"recompute": row.recompute, "offload": row.offload, "tp": row.mesh.tp, "pp": row.mesh.pp,
            "dp": row.mesh.dp, "b": row.micro_batch, "m": row.num_micro_batches, "v": row.virtual_stages,
            "stages": row.mesh.pp * row.virtual_stages, "schedule": row.schedule, "zero": row.zero_stage,
            "sp": row.sequence_parallel, "ep": row.mesh.ep, "cp": row.mesh.cp,
            "method": row.context_method if row.mesh.cp > 1 else None}


def _context(key: str, other: Alternative, winner: Alternative) -> str:
    """'pp=16 vs 8, m=64 vs 32': the fields behind cause ``key`` that differ between the two."""
    a, w = _fields(other), _fields(winner)
    diffs = [f"{name}={a[name]} vs {w[name]}" for name in _DRIVERS[key] if a[name] != w[name]]
    return ", ".join(diffs) or "a slower bottleneck stage"


def label(row: Alternative) -> str:
    """'dp=16 pp=4 tp=8 b=1 m=64 interleaved v=2 recompute=full' (and ' offload=blocks', ' zero=1', ' sp')."""
    v = f" v={row.virtual_stages}" if row.schedule == "interleaved" else ""
    offload = f" offload={row.offload}" if row.offload != "none" else ""
    zero = f" zero={row.zero_stage}" if row.zero_stage else ""
    sp = " sp" if row.sequence_parallel else ""
    # cp and ep only where a configuration has them (ir/mesh.py): ep where the model has experts
    cp = f" cp={row.mesh.cp} {row.context_method}" if row.mesh.cp > 1 else ""
    ep = f" ep={row.mesh.ep}" if row.mesh.ep > 1 else ""
    return (f"dp={row.mesh.dp} pp={row.mesh.pp}{cp} tp={row.mesh.tp}{ep} b={row.micro_batch} "
            f"m={row.num_micro_batches} {row.schedule}{v} recompute={row.recompute}{offload}{zero}{sp}"
            f"{' dp-outermost' if row.mesh.order[0] == 'dp' else ''}")


def as_row(plan) -> Alternative:
    """The plan's own configuration and prediction in the shape of an alternative."""
    p = plan.predicted
    return Alternative(mesh=plan.mesh, micro_batch=plan.micro_batch, num_micro_batches=plan.num_micro_batches,
                       schedule=plan.schedule, virtual_stages=plan.virtual_stages, recompute=plan.recompute,
                       offload=plan.offload, zero_stage=plan.zero_stage,
                       sequence_parallel=plan.sequence_parallel and plan.mesh.tp > 1,
                       context_method=plan_context_method(plan),
                       step_seconds=p.step_seconds, tflops_per_device=p.tflops_per_device,
                       memory_bytes_per_device=p.memory_bytes_per_device, breakdown=p.breakdown)


def _too_big(row: Alternative, usable_bytes: float) -> str:
    """'does not fit: needs at least 80.2 GiB on pipeline rank 0, 72.0 GiB usable'."""
    rank = max(range(len(row.memory_bytes_per_device)), key=row.memory_bytes_per_device.__getitem__)
    return (f"does not fit: needs at least {row.memory_bytes_per_device[rank] / GiB:.1f} GiB on pipeline rank {rank}, "
            f"{usable_bytes / GiB:.1f} GiB usable")


def why_lost(winner: Alternative, other: Alternative, usable_bytes: float) -> str:
    """One sentence: the memory ``other`` lacks, or how much slower it is and the causes that grew most."""
    if not other.fits:
        faster = winner.step_seconds - other.step_seconds
        speed = f"{faster / winner.step_seconds:.0%} faster, but " if faster > 0 else ""
        return speed + _too_big(other, usable_bytes)
    slower = other.step_seconds - winner.step_seconds
    if abs(slower) <= 1e-3 * winner.step_seconds:
        return "the same predicted step (within 0.1%); the planner's tie-break put the winner first"
    grew = sorted(((other.breakdown.get(key, 0.0) - winner.breakdown.get(key, 0.0), key) for key, _ in CAUSES),
                  reverse=True)
    names = dict(CAUSES)
    parts = [f"{names[key]} +{delta:.3g} s ({_context(key, other, winner)})"
             for delta, key in grew[:2] if delta > 0.1 * slower]
    return f"{slower / winner.step_seconds:.1%} slower: " + "; ".join(parts or ["small differences in every cause"])


def size_text(nbytes: float) -> str:
    """'34.0 GiB', or '12.5 MiB' below a tenth of a GiB (where one decimal of GiB would read 0.0)."""
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / MiB:.1f} MiB"


def option_trades(plan) -> list[tuple[str, str]]:
    """(title, line) per option of ``OPTIONS`` priced both ways: the winner against each alternative
    that differs from it in that option alone, from the option's higher value's side, e.g. ('ZeRO',
    'zero-1 saves 34.0 GiB/device, costs 0.4 s of exposed all-gather per step (zero-1 9.58 s vs
    zero-0 9.48 s; zero-0 does not fit).'). A difference within ``SAME`` of the memory or of the
    step is "the same" (an option that changes neither: 'zero-1 and zero-0 are the same here: ...')."""
    winner = as_row(plan)
    mine = _fields(winner)
    found = []
    for key, title, name, causes in OPTIONS:
        for other in plan.alternatives:
            theirs = _fields(other)
            if theirs[key] == mine[key] or any(theirs[k] != mine[k] for k in mine if k != key):
                continue
            high, low = (winner, other) if mine[key] > theirs[key] else (other, winner)
            high_name, low_name = name(_fields(high)[key]), name(_fields(low)[key])
            high_bytes, low_bytes = max(high.memory_bytes_per_device), max(low.memory_bytes_per_device)
            saved, step = low_bytes - high_bytes, max(high.step_seconds, low.step_seconds)
            same_memory = abs(saved) <= SAME * max(high_bytes, low_bytes)
            memory = ("needs the same memory/device" if same_memory else f"saves {size_text(saved)}/device" if saved > 0
                      else f"needs {size_text(-saved)}/device more")
            moved = [(high.breakdown.get(cause, 0.0) - low.breakdown.get(cause, 0.0), words) for cause, words in causes]
            main = moved[0][1]  # the option's own cause, named even where it ties
            moves = [f"{'costs' if delta > 0 else 'saves'} {abs(delta):.3g} s of {words}" if abs(delta) > SAME * step
                     else f"the same {words}" for delta, words in moved if abs(delta) > SAME * step or words == main]
            steps = (f"both {high.step_seconds:.4g} s" if f"{high.step_seconds:.4g}" == f"{low.step_seconds:.4g}"
                     else f"{high_name} {high.step_seconds:.4g} s vs {low_name} {low.step_seconds:.4g} s")
            fits = "".join(f"; {name(_fields(row)[key])} does not fit" for row in (high, low) if not row.fits)
            trade = (f"{high_name} and {low_name} are the same here: the same memory/device and {main}"
                     if same_memory and moves == [f"the same {main}"] else f"{high_name} {memory}, {', '.join(moves)}")
            found.append((title, f"{trade} per step ({steps}{fits})."))
    return found


def runners_up(plan) -> list[tuple[Alternative, str]]:
    """The alternatives with why each lost, those that fit first, each group fastest first. The sentence
    is written from the plan's figures now, not read from ``Alternative.why``: that was written when the
    search ended, and the winner's step can move after it (the tp overlap chosen, shares, a re-price)."""
    winner, usable = as_row(plan), min(stage.memory_limit_bytes for stage in plan.stages)
    ordered = sorted(plan.alternatives, key=lambda row: (not row.fits, row.step_seconds))
    return [(row, why_lost(winner, row, usable)) for row in ordered]


def why_won(plan) -> str:
    """Why the plan's configuration was chosen, read from the alternatives it carries."""
    if not plan.alternatives:
        return "it was the only configuration priced (every choice pinned, or no other fits the rules)."
    usable = min(stage.memory_limit_bytes for stage in plan.stages)
    fitting = [(row, why) for row, why in runners_up(plan) if row.fits]
    faster = [row for row, _ in fitting if row.step_seconds < plan.predicted.step_seconds * (1 - SAME)]
    slower = [(row, why) for row, why in fitting if row not in faster]
    if faster:  # only where a choice was pinned: the search never keeps a slower winner
        parts = [f"it is the fastest of the configurations that fit with the choices given; "
                 f"{label(faster[0])}, {faster[0].step_seconds:.4g} s against {plan.predicted.step_seconds:.4g} s, "
                 f"differs in a choice that was pinned (priced at the winner's cuts for comparison)."]
    else:
        parts = [f"it has the shortest predicted step of the configurations that fit; the next best, "
                 f"{label(slower[0][0])}, is {slower[0][1]}." if slower else
                 "no other configuration priced fits device memory."]
    parts += [f"{label(a)} would be faster but {_too_big(a, usable)}." for a in plan.alternatives
              if not a.fits and a.step_seconds < plan.predicted.step_seconds]
    return " ".join(parts)


def explain_data(plan) -> dict:
    """What ``explain_plan`` shows, as JSON-ready data (``xirang explain plan.json --json``): one
    row per configuration (the chosen one first), seconds per step by cause, memory per pipeline
    rank in bytes, fits, and the reasons in words."""
    def row(item: Alternative, chosen: bool, why: str) -> dict:
        return {"configuration": label(item), "chosen": chosen,
                **item.mesh.to_json(), "micro_batch": item.micro_batch,
                "num_micro_batches": item.num_micro_batches, "schedule": item.schedule,
                "virtual_stages": item.virtual_stages, "recompute": item.recompute, "offload": item.offload,
                "zero_stage": item.zero_stage, "sequence_parallel": item.sequence_parallel,
                "context_method": item.context_method if item.mesh.cp > 1 else None,
                "step_seconds": item.step_seconds, "tflops_per_device": item.tflops_per_device,
                "seconds_by_cause": {key: item.breakdown.get(key, 0.0) for key, _ in CAUSES},
                "memory_bytes_per_pipeline_rank": list(item.memory_bytes_per_device),
                "fits": item.fits, "why": why}
    return {"world": plan.world.describe(), "mesh": plan.mesh.describe(), "global_batch": plan.global_batch,
            "precision": plan.precision,
            "usable_bytes_per_device": min(stage.memory_limit_bytes for stage in plan.stages),
            "memory_parts_per_pipeline_rank": [dict(part) for part in plan.predicted.memory_parts],
            "rows": [row(as_row(plan), True, why_won(plan))] + [row(a, False, why) for a, why in runners_up(plan)],
            "options": [{"option": title, "trade": line} for title, line in option_trades(plan)],
            "context": context_lines(plan), "notes": list(plan.predicted.notes),
            "trials": [trial.to_json() for trial in plan.trials]}


def memory_unit(plan) -> tuple[str, int]:
    """('GiB', GiB), or ('MiB', MiB) for a plan whose every configuration needs under a tenth of a GiB
    (a small model on CPU ranks), whose memory would read 0.0 GiB throughout."""
    rows = [plan.predicted, *plan.alternatives]
    largest = max((b for row in rows for b in row.memory_bytes_per_device), default=0)
    return ("GiB", GiB) if largest >= 0.1 * GiB else ("MiB", MiB)


def _memory_table(plan) -> list[str]:
    """Each pipeline rank's predicted memory by part, when the plan records the parts."""
    parts = plan.predicted.memory_parts
    if not parts:
        return []
    unit, scale = memory_unit(plan)
    mode = f"recompute {plan.recompute}" + (f", offload {plan.offload}" if plan.offload != "none" else "")
    lines = [f"  by part ({unit}; activations: kept for the backward by the micro-batches in flight at the "
             f"schedule's peak, {mode}; work set: what recompute rebuilds, offload holds on the device):",
             f"  {'pp rank':>7} " + " ".join(f"{title:>11}" for _, title in PART_TITLES) + f" {'total':>9}"]
    for rank, part in enumerate(parts):
        lines.append(f"  {rank:>7} " + " ".join(f"{part[key] / scale:>11.2f}" for key, _ in PART_TITLES)
                     + f" {sum(part.values()) / scale:>9.2f}")
    return lines


def expert_lines(plan) -> list[str]:
    """The expert-parallel section (ep > 1): the groups, what moves per step and the routing assumed."""
    exchanges = [c for c in plan.collectives if c.axis == "ep"]
    if plan.mesh.ep == 1 or not exchanges:
        return []
    mesh = plan.mesh
    calls = [c for c in exchanges if c.node.endswith(".dispatch")] or exchanges
    per_call = calls[0].nbytes
    micro_batches = plan.num_micro_batches
    total = sum(c.nbytes for c in exchanges) * 2 * micro_batches  # each dispatch and combine, forward and backward
    again = " (and again in each recomputed forward)" if plan.recompute == "full" else ""
    return [f"Experts: ep={mesh.ep} over the dp x cp ranks of each (pp, tp) place: each rank holds 1/{mesh.ep} of "
            f"every experts layer's experts; their gradients are reduced over edp={mesh.edp} ranks "
            f"(divided by dp={mesh.dp}).",
            f"  all-to-all per step and rank: {len(calls)} experts calls x 4 exchanges (dispatch and combine, "
            f"forward and backward) x {micro_batches} micro-batches x {size_text(per_call)} of rows"
            f"{' (the first call; others differ)' if len({c.nbytes for c in exchanges}) > 1 else ''} = "
            f"{size_text(total)}{again}, "
            f"plus a count exchange before each dispatch;",
            f"  routing imbalance assumed {plan.routing_imbalance:g} (the most-loaded rank's rows over the mean, "
            f"which prices its all-to-alls and expert matmuls; PlanChoices(routing_imbalance=...) to change it)."] + \
        ([f"  capacity factor {plan.capacity_factor:g}: each expert computes at most ceil(rows / experts x "
          f"{plan.capacity_factor:g}) of a rank's rows per micro-batch, the rest dropped; the most-loaded rank is "
          f"priced at {min(plan.routing_imbalance, plan.capacity_factor):g} times the mean."]
         if plan.capacity_factor is not None else []) + \
        (["  all-to-alls priced as overlapped with another micro-batch's compute (ep_overlap: Megatron-Core's "
          "batch-level overlap); Xirang's runtime runs them exposed."] if plan.ep_overlap else [])


def plan_context_method(plan) -> str:
    """The method the plan's collectives record for cp's attention (ir/context_method.py ``recorded_method``:
    passes/lowering/context_parallel.py ``with_context_method`` writes it)."""
    return recorded_method(plan.collectives)


def context_lines(plan) -> list[str]:
    """The context-parallel section (cp > 1): the degree and method, the groups, what each attention layer
    moves and why the planner took cp > 1 (its note)."""
    mesh = plan.mesh
    if mesh.cp == 1:
        return []
    method = plan_context_method(plan)
    calls = [c for c in plan.collectives if c.axis == "cp" and not is_method_choice(c)]
    groups = mesh.groups("cp")
    shown = ", ".join(str(list(g)) for g in groups[:4]) + (f", ... ({len(groups)} groups)" if len(groups) > 4 else "")
    a2a = a2a_degree(method, mesh.cp)
    ring = ("ring: each rank passes its key/value block around the group, cp - 1 sends forward (about "
            "2·S·B·Hkv·d·b per layer whatever cp), hidden where a block's attention outlasts its transfer; backward "
            "the blocks again and their gradients home")
    exchange = ("all-to-all (Ulysses): q, k, v and the output from sequence to heads and back, "
                "(S/cp)·B·(2Hq + 2Hkv)·d·b per layer each way, on the critical path")
    if 1 < a2a < mesh.cp:
        a2a_groups, ring_groups = context_subgroups(groups[0], a2a)
        how = (f"USP: an all-to-all over heads inside groups of {a2a} ({', '.join(map(str, map(list, a2a_groups)))} "
               f"in the first cp group), (S/cp)·B·(2Hq + 2Hkv)·d·b per layer each way, then a ring over "
               f"{mesh.cp // a2a} such groups ({', '.join(map(str, map(list, ring_groups)))}) with Hkv/{a2a} kv "
               f"heads of S/{mesh.cp // a2a} tokens a rank")
    else:
        how = ring if a2a == 1 else exchange
    lines = [f"Context: cp={mesh.cp} by {method} over the cp groups {shown}: each rank holds seq/{mesh.cp} tokens of "
             f"every sequence (chunks r and 2cp-1-r), and gradients are summed over dp x cp = "
             f"{mesh.dp * mesh.cp} ranks.",
             f"  {how};"]
    if calls:
        layers: dict = {}  # rows "context:<k>:<unit>[:kind]": a layer's ring and all-to-all together
        for c in calls:
            layers[c.node.split(":")[1]] = layers.get(c.node.split(":")[1], 0) + c.nbytes
        per = next(iter(layers.values()))
        total = sum(layers.values()) * plan.num_micro_batches
        same = "" if len(set(layers.values())) == 1 else " (the first; others differ)"
        lines.append(f"  forward per attention layer and micro-batch on one rank: {size_text(per)}{same}; "
                     f"{len(layers)} layers x {plan.num_micro_batches} micro-batches = {size_text(total)} forward "
                     f"per step (backward: about twice the ring's, the same all-to-alls')")
    why = [note.split(": ", 1)[1] for note in plan.predicted.notes if note.startswith("context parallelism: ")]
    lines.extend(f"  why: {reason}" for reason in why)
    return lines


def explain_plan(plan) -> str:
    """The text table ``Plan.explain()`` returns."""
    winner, ranked = as_row(plan), runners_up(plan)
    rows = [winner, *(row for row, _ in ranked)]
    # the offload column only where some configuration offloads
    causes = [(key, title) for key, title in CAUSES
              if key not in ("offload", "ep_comm", "cp_comm") or any(row.breakdown.get(key, 0.0) for row in rows)]
    unit, scale = memory_unit(plan)
    header = (f"{'':2}{'configuration':<56} {'step s':>8} {'TFLOP/s':>8} "
              + " ".join(f"{title:>10}" for _, title in causes) + f" {'max ' + unit:>8}  fits")
    lines = [f"Plan for {plan.world.describe()}, global batch {plan.global_batch}, precision {plan.precision}",
             f"Mesh axes: {plan.mesh.describe()}", "", header, "-" * len(header)]
    for mark, row in [("* ", winner)] + [("  ", row) for row, _ in ranked]:
        seconds = " ".join(f"{row.breakdown.get(key, 0.0):>10.4g}" for key, _ in causes)
        memory = max(row.memory_bytes_per_device, default=0) / scale
        lines.append(f"{mark}{label(row):<56} {row.step_seconds:>8.4g} {row.tflops_per_device:>8.1f} {seconds} "
                     f"{memory:>8.1f}  {'yes' if row.fits else 'NO'}")
    lines.append("-" * len(header))
    shown = {key for key, _ in causes}
    lines.append("* chosen. Seconds per step by cause: compute (recompute included), tensor-parallel "
                 "collectives" + (", expert parallelism's all-to-alls" if "ep_comm" in shown else "")
                 + (", context parallelism's attention transfers left exposed" if "cp_comm" in shown else "")
                 + ", pipeline bubble, pipeline sends, data-parallel all-reduce left after the backward"
                 + (", activation copies to and from the host not hidden behind compute." if "offload" in shown
                    else "."))
    usable = min(stage.memory_limit_bytes for stage in plan.stages)
    per_rank = ", ".join(f"{b / scale:.1f}" for b in plan.predicted.memory_bytes_per_device)
    lines.append(f"Memory per device by pipeline rank ({unit}): {per_rank}; usable {size_text(usable)}.")
    lines.extend(_memory_table(plan))
    lines.extend(expert_lines(plan))
    lines.extend(context_lines(plan))
    lines.append("")
    lines.append(f"Why this plan: {why_won(plan)}")
    lines.extend(f"{title}: {line}" for title, line in option_trades(plan))
    for row, why in ranked:
        lines.append(f"  - {label(row)}: {why}")
    lines.extend(trial_lines(plan.trials))
    if plan.predicted.notes:
        lines.append("Notes:")
        lines.extend(f"  - {note}" for note in plan.predicted.notes)
    return "\n".join(lines)
