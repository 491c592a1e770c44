"""``plan.explain()``: the chosen configuration next to the ones it beat, and why, as plain text
(``explain_plan``) or JSON-ready data (``explain_data``, for ``xirang explain --json``).

Everything here reads the Plan's data only (its prediction and ``alternatives``), so a plan loaded
from JSON explains itself as well as a fresh one. ``why_lost`` writes the sentence stored with each
alternative when the plan is made. This module imports the plan's parts, not ``Plan`` (ir/plan.py
imports it for ``Plan.explain``): the ``plan`` arguments below are Plans.
"""
from __future__ import annotations

from xirang.ir.plan_parts import Alternative

GiB, MiB = 1024**3, 1024**2
# explain's option lines call two figures 'the same' within this fraction of the larger (memory) or of
# the step (a cause's seconds): a difference the cost model cannot tell from zero is no difference
SAME = 0.005
CAUSES = (("compute", "compute"), ("tp_comm", "TP comm"), ("pp_bubble", "bubble"), ("pp_p2p", "p2p"),
          ("dp_exposed", "DP exposed"), ("offload", "offload"), ("step_sync", "step sync"))
# the configuration fields that drive each cause; a sentence names those that differ
_DRIVERS = {"compute": ("recompute", "tp", "pp", "b", "m", "sp"), "tp_comm": ("tp", "pp", "b", "m", "sp"),
            "pp_bubble": ("schedule", "pp", "m", "v"), "pp_p2p": ("stages", "b", "m"),
            "dp_exposed": ("dp", "pp", "tp", "zero"),
            "offload": ("offload", "recompute", "tp", "b"), "step_sync": ("dp", "pp", "tp")}
# Options the search prices as on/off or as stages at an otherwise equal configuration. Each: the
# field of ``_fields``, what a value is called, and the causes of the step it moves (with their
# words): explain() prints one line per option from the winner and the row differing in it alone.
OPTIONS = (
    ("zero", "ZeRO", lambda stage: f"zero-{stage}", (("dp_exposed", "exposed all-gather"),)),
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
            "sp": row.sequence_parallel}


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
    # cp and ep only where a configuration has them (ir/mesh.py): the planner keeps both at 1 today
    cp = f" cp={row.mesh.cp}" if row.mesh.cp > 1 else ""
    ep = f" ep={row.mesh.ep}" if row.mesh.ep > 1 else ""
    return (f"dp={row.mesh.dp} pp={row.mesh.pp}{cp} tp={row.mesh.tp}{ep} b={row.micro_batch} "
            f"m={row.num_micro_batches} {row.schedule}{v} recompute={row.recompute}{offload}{zero}{sp}")


def as_row(plan) -> Alternative:
    """The plan's own configuration and prediction in the shape of an alternative."""
    p = plan.predicted
    return Alternative(mesh=plan.mesh, micro_batch=plan.micro_batch, num_micro_batches=plan.num_micro_batches,
                       schedule=plan.schedule, virtual_stages=plan.virtual_stages, recompute=plan.recompute,
                       offload=plan.offload, zero_stage=plan.zero_stage,
                       sequence_parallel=plan.sequence_parallel and plan.mesh.tp > 1,
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
    parts = [f"it has the shortest predicted step of the configurations that fit; the next best, "
             f"{label(fitting[0][0])}, is {fitting[0][1]}." if fitting else
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
            "notes": list(plan.predicted.notes)}


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


def explain_plan(plan) -> str:
    """The text table ``Plan.explain()`` returns."""
    winner, ranked = as_row(plan), runners_up(plan)
    rows = [winner, *(row for row, _ in ranked)]
    # the offload column only where some configuration offloads
    causes = [(key, title) for key, title in CAUSES
              if key != "offload" or any(row.breakdown.get(key, 0.0) for row in rows)]
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
    lines.append("* chosen. Seconds per step by cause: compute (recompute included), tensor-parallel "
                 "collectives, pipeline bubble, pipeline sends, data-parallel all-reduce left after the backward"
                 + (", activation copies to and from the host not hidden behind compute." if len(causes) > 5 else "."))
    usable = min(stage.memory_limit_bytes for stage in plan.stages)
    per_rank = ", ".join(f"{b / scale:.1f}" for b in plan.predicted.memory_bytes_per_device)
    lines.append(f"Memory per device by pipeline rank ({unit}): {per_rank}; usable {size_text(usable)}.")
    lines.extend(_memory_table(plan))
    lines.append("")
    lines.append(f"Why this plan: {why_won(plan)}")
    lines.extend(f"{title}: {line}" for title, line in option_trades(plan))
    for row, why in ranked:
        lines.append(f"  - {label(row)}: {why}")
    if plan.predicted.notes:
        lines.append("Notes:")
        lines.extend(f"  - {note}" for note in plan.predicted.notes)
    return "\n".join(lines)
