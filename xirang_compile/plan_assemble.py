"""Turn the degree search's answer into a Plan: stages, gradient buckets, collectives, prediction.

The search knows units only by their costs; here the traced graph supplies the names: which
parameters each unit owns (placeholders' ``xr_unit`` and ``xr_param_name``), so gradient buckets
can list them, and the fingerprint that ties the plan to this graph.
"""
from __future__ import annotations

import math
from dataclasses import replace

from xirang.ir.meta_keys import (MODULE_PATH, MODULE_TYPE, PARAM_COUNT, PARAM_NAME, REQUIRES_GRAD, ROLE, SOURCE, TENSOR,
                                 TRACE_INFO, UNIT)
from xirang.ir.placement import PlanShard, local_shape
from xirang.ir.plan import Alternative, CollectiveChoice, Plan, Prediction, StagePlan
from xirang.ir.plan_explain import why_lost
from xirang.ir.world import World
from xirang.passes.planning.cost_collectives import ALGORITHMS, collective_cost, group_topology
from xirang.passes.analysis.expert_ops import expert_calls
from xirang.passes.analysis.fingerprint import graph_fingerprint, model_summary
from xirang.passes.lowering.context_parallel import with_context_method
from xirang.passes.planning.context_parallel_cost import layer_parts
from xirang.passes.planning.dp_sync_costs import bucket_elements
from xirang.passes.planning.plan_costs import CAUSES, GRAD_BYTES, Priced
from xirang.passes.planning.plan_search import SearchResult
from xirang.passes.planning.sharding_report import replicated_notes


def _where(node) -> str:
    """' (in module 'a.b' (Class), file.py:12)': where a node came from, for a note."""
    source = SOURCE.get(node, None)
    line = f", {source.file.rsplit('/', 1)[-1]}:{source.line}" if source is not None else ""
    return f" (in '{MODULE_PATH.get(node, '')}' ({MODULE_TYPE.get(node, '')}){line})"


def assemble_plan(gm, world: World, result: SearchResult, *, global_batch: int, precision: str,
                  memory_fraction: float) -> Plan:
    """The frozen Plan of ``result.best`` for the traced graph ``gm``. Each stage may use the
    memory the search allowed its pipeline rank (all of it: an interleaved rank's stages share it)."""
    best, split = result.best, result.split
    c, mesh = best.candidate, best.candidate.mesh
    names = [u.name for u in split.units]
    stages = tuple(StagePlan(i, tuple(names[a:b]), int(best.usable_per_rank[i % c.pp]))
                   for i, (a, b) in enumerate(best.bounds))
    buckets, bucket_sizes = gradient_buckets(gm, best, names, split.placements, precision)
    collectives = list(split.collectives)
    if c.dp > 1:  # one all-reduce per bucket on the dp group of its pipeline rank (tp index 0 shown; dp x cp under cp)
        topology = {r: group_topology(mesh.group(mesh.gradient_axis, mesh.rank_of(dp=0, pp=r, tp=0, cp=0)), world)
                    for r in {rank for _, rank in bucket_sizes}}
        for k, (nbytes, rank) in enumerate(bucket_sizes):
            algorithm = _cheapest_all_reduce(nbytes, topology[rank])
            if algorithm == "hierarchical":  # the runtime pads the buffer to k equal shards, and sends them
                per_node, item = topology[rank].uniform_ranks_per_node, GRAD_BYTES[precision]
                nbytes = -(-nbytes // (per_node * item)) * per_node * item
            collectives.append(CollectiveChoice(f"bucket:{k}", "dp", "all_reduce", algorithm, int(nbytes)))
    collectives += tied_sums(gm, best, names, split.placements, world)
    collectives += expert_exchanges(gm, split, c, world)
    collectives += context_transfers(result.context_calls, c, split.seq, precision)
    for i, (_, stop) in enumerate(best.bounds[:-1]):
        pair = (mesh.rank_of(dp=0, pp=i % c.pp, tp=0, cp=0), mesh.rank_of(dp=0, pp=(i + 1) % c.pp, tp=0, cp=0))
        nbytes = split.units[stop - 1].cut_bytes_after
        collectives.append(CollectiveChoice(names[stop - 1], "pp", "send",
                                            collective_cost("send", nbytes, pair, world).algorithm, int(round(nbytes))))
    fallbacks = tuple(dict.fromkeys(split.fallbacks))
    notes = [*split.notes, *best.notes, *TRACE_INFO.get(gm, {}).get("unsupported", ())]
    if fallbacks:
        where = {n.name: _where(n) for n in gm.graph.nodes if n.name in fallbacks[:8]}
        notes.append(f"{len(fallbacks)} op(s) have no sharding rule and run replicated: "
                     f"{', '.join(name + where[name] for name in fallbacks[:8])}"
                     + (", ..." if len(fallbacks) > 8 else ""))
    notes += replicated_notes(gm, split.placements, c.tp)  # what tp keeps whole and why; a tp that splits nothing
    notes.append(f"the plan may use {memory_fraction:.0%} of device memory; the rest is headroom for "
                 f"CUDA context, NCCL buffers and fragmentation")
    notes.append(f"searched {result.candidates} configurations, priced {result.priced}, "
                 f"{result.splits_priced} tensor splits")
    if result.context_reason:
        notes.append(f"context parallelism: {result.context_reason}")
    if best.micro_batch_shares:  # a World of mixed device kinds: each dp replica's share follows its pace
        notes.append(f"dp shares follow device speed: micro-batches per dp rank "
                     f"{', '.join(map(str, best.micro_batch_shares))} of {c.micro_batch} samples")
    # the tied sums run after the dp sync, exposed: each row pays its own (the winner's layout of the weight)
    rows = [_row(p, tied_sum_seconds(gm, p, names, split.placements, world)) for p in (best, *result.alternatives)]
    winner, usable = rows[0], min(best.usable_per_rank)
    alternatives = tuple(replace(row, why=why_lost(winner, row, usable)) for row in rows[1:])
    predicted = Prediction(step_seconds=winner.step_seconds, tflops_per_device=winner.tflops_per_device,
                           memory_bytes_per_device=winner.memory_bytes_per_device, breakdown=winner.breakdown,
                           notes=tuple(notes), memory_parts=memory_parts(best))
    made = Plan(fingerprint=graph_fingerprint(gm), world=world, mesh=mesh, micro_batch=c.micro_batch,
                num_micro_batches=c.num_micro_batches, global_batch=global_batch, schedule=c.schedule,
                virtual_stages=c.virtual_stages, recompute=c.recompute, offload=c.offload, precision=precision,
                grad_reduce_dtype=precision, placements=split.placements, stages=stages, buckets=buckets,
                fallbacks=fallbacks, collectives=tuple(collectives), predicted=predicted, alternatives=alternatives,
                model_summary=model_summary(gm))
    if c.cp > 1:  # the method, as the lowering reads it (a collective choice at node context:attention)
        made = with_context_method(made, c.context_method)
    if best.micro_batch_shares:  # priced with these shares: the note with_dp_shares adds does not apply
        made = replace(made.with_dp_shares(tuple(m * c.micro_batch for m in best.micro_batch_shares)),
                       predicted=predicted)
    if not c.zero_stage:
        return made
    if c.zero_stage == 3:
        predicted = replace(predicted, notes=predicted.notes + (zero3_note(best, c.dp),))
    # ZeRO-1 and 3: each bucket's all-reduce listed as the reduce-scatter and all-gather the runtime runs
    return replace(made.with_zero_stage(c.zero_stage), predicted=predicted)  # priced: no note


def expert_exchanges(gm, split, c, world: World) -> list:
    """Expert parallelism's all-to-alls (ep > 1), two per experts call: the rank's row buffer the dispatch
    sends (named by the call's first expert_linear; its gradient comes back the same size) and the
    buffer its combine takes back (by the last; its gradient goes out the same size), at the plan's
    micro-batch and sequence; codegen/ops/expert_dispatch.py records each under that size."""
    if c.ep == 1:
        return []
    by_unit = {u.name: u for u in split.units}
    group = c.mesh.group("ep", 0)
    found = []
    for calls in expert_calls(gm.graph).values():
        unit = by_unit.get(UNIT.get(calls[0], None))
        if unit is None or not unit.expert_calls:
            continue
        sent = unit.expert_rows_bytes / unit.expert_calls
        back = (unit.expert_combine_bytes or unit.expert_rows_bytes) / unit.expert_calls
        for name, nbytes in ((f"{calls[0].name}.dispatch", sent), (f"{calls[-1].name}.combine", back)):
            algorithm = collective_cost("all_to_all", nbytes, group, world).algorithm
            found.append(CollectiveChoice(name, "ep", "all_to_all", algorithm, int(round(nbytes))))
    return found


def context_transfers(calls, c, local_seq: int, precision: str) -> list:
    """Context parallelism's transfers (cp > 1), per attention call on axis cp one row per kind the method runs:
    "send" (a ring's, node ``context:<k>:<unit>``) and "all_to_all" (node ``context:<k>:<unit>`` for the
    all-to-all method, ``context:<k>:<unit>:all_to_all`` beside USP's ring), bytes what one rank's call moves
    forward per micro-batch as the CommCounter records it (a ring's key/value blocks; the all-to-alls' four send
    buffers), at the heads of one tp rank (context_parallel_cost.py ``layer_parts``; the backward moves about
    twice the ring's, the same all-to-alls')."""
    if c.cp == 1:
        return []
    algorithms = {"send": "direct", "all_to_all": "pairwise"}
    found = []
    for k, call in enumerate(calls):
        parts = layer_parts(call, seq=local_seq * c.cp, batch=c.micro_batch, tp=c.tp, cp=c.cp,
                            method=c.context_method, dtype_bytes=GRAD_BYTES[precision])
        for kind, traffic in parts.items():
            suffix = f":{kind}" if len(parts) > 1 and kind != "send" else ""
            found.append(CollectiveChoice(f"context:{k}:{call.unit}{suffix}", "cp", kind, algorithms[kind],
                                          int(round(traffic.forward))))
    return found


def zero3_note(best: Priced, dp: int) -> str:
    """What ZeRO-3's variant holds when (codegen/runtime/data_parallel/param_shards.py), in the plan's words."""
    fullest = max(range(len(best.memory_parts)), key=lambda r: best.memory_per_rank[r])
    held = best.memory_parts[fullest]["parameters"]
    return (f"zero-3, kept until the backward: each gradient bucket's parameters are all-gathered over dp "
            f"just before their first use in a step (the next bucket's gather prefetched) and freed after the "
            f"step's last backward (torchtitan's choice under pipelining), so the peak is zero-1's; between "
            f"steps a rank holds 1/{dp} of its parameters ({held * (1 - 1 / dp) / 2**30:.2f} GiB less on pp rank "
            f"{fullest})")


def _row(p: Priced, tied_seconds: float = 0.0) -> Alternative:
    """A priced candidate as the Plan records it (bytes rounded up to ints), with ``tied_seconds`` of
    tied-weight sums added to its step (cause "tied_sum", present only where there are any)."""
    c = p.candidate
    breakdown = {key: p.breakdown[key] for key in CAUSES}
    step, tflops = p.step_seconds, p.tflops_per_device
    if tied_seconds > 0:
        breakdown["tied_sum"] = tied_seconds
        step, tflops = step + tied_seconds, tflops * step / (step + tied_seconds)
    return Alternative(mesh=c.mesh, micro_batch=c.micro_batch, num_micro_batches=c.num_micro_batches,
                       schedule=c.schedule, virtual_stages=c.virtual_stages, recompute=c.recompute, offload=c.offload,
                       step_seconds=step, tflops_per_device=tflops,
                       memory_bytes_per_device=tuple(int(math.ceil(b)) for b in p.memory_per_rank),
                       breakdown=breakdown, fits=p.fits, zero_stage=c.zero_stage,
                       sequence_parallel=c.sequence_parallel, context_method=c.context_method)


def memory_parts(p: Priced) -> tuple[dict[str, int], ...]:
    """Each pipeline rank's memory by part, in whole bytes that sum to its ``memory_bytes_per_device``
    (each part rounded up, the rounding given to the activations so the sum stays exact)."""
    found = []
    for parts, total in zip(p.memory_parts, p.memory_per_rank):
        whole = {key: int(math.ceil(value)) for key, value in parts.items()}
        whole["activations"] += int(math.ceil(total)) - sum(whole.values())
        found.append({key: max(0, value) for key, value in whole.items()})
    return tuple(found)


def _cheapest_all_reduce(nbytes: float, topology) -> str:
    """``collective_cost``'s choice of algorithm, on a topology built once per group rather than
    once per bucket (a dp group of hundreds of ranks takes milliseconds to place on nodes)."""
    priced = [(fn(nbytes, topology), i, name) for i, (name, fn) in enumerate(ALGORITHMS["all_reduce"])]
    return min(entry for entry in priced if entry[0] is not None)[2]


def stages_reading(gm, best: Priced, names: list[str]) -> dict:
    """``{parameter placeholder: {stage index: position of the earliest unit of that stage reading it}}``."""
    stage_of = {names[position]: (index, position)
                for index, (start, stop) in enumerate(best.bounds) for position in range(start, stop)}
    found = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or ROLE.get(node) != "parameter":
            continue
        readers = {UNIT.get(user) for user in node.users if UNIT.has(user)}
        if not readers and UNIT.has(node):
            readers = {UNIT.get(node)}
        earliest: dict[int, int] = {}
        for unit in readers & stage_of.keys():
            index, position = stage_of[unit]
            earliest[index] = min(earliest.get(index, position), position)
        found[node] = earliest
    return found


def gradient_buckets(gm, best: Priced, names: list[str], placements, precision: str):
    """Parameter names per gradient bucket in launch order (last layers first), and each bucket's
    bytes and pipeline rank. A bucket closes once it holds ``bucket_elements(dp)`` gradient
    elements of this rank, and at every stage boundary (each stage is its own model chunk).

    A parameter is in the bucket of every stage that reads it (a tied embedding and LM head on two
    pipeline ranks are a copy on each, each copy all-reduced with its stage), at the earliest unit of
    that stage that reads it: its gradient is complete once that unit's backward is done."""
    c = best.candidate
    tp, grad_bytes = c.tp, GRAD_BYTES[precision]
    cap = bucket_elements(c.dp)
    params_at: dict[int, list] = {}  # unit position -> parameters first read there (per stage)
    for node, earliest in stages_reading(gm, best, names).items():
        for position in earliest.values():
            params_at.setdefault(position, []).append(node)
    buckets, sizes = [], []
    for index in reversed(range(len(best.bounds))):
        start, stop = best.bounds[index]
        current, elements = [], 0
        for position in reversed(range(start, stop)):
            for node in reversed(params_at.get(position, [])):
                current.append(PARAM_NAME.get(node))
                elements += local_elements(node, placements, tp)
                if elements >= cap:
                    buckets.append(tuple(current))
                    sizes.append((elements * grad_bytes, index % c.pp))
                    current, elements = [], 0
        if current:
            buckets.append(tuple(current))
            sizes.append((elements * grad_bytes, index % c.pp))
    return tuple(buckets), sizes


def _tied_copies(gm, best: Priced, names: list[str], placements):
    """(parameter node, bytes of one rank's gradient, group of the ranks holding a copy) of each weight
    read on several pipeline ranks (a tied embedding and LM head)."""
    c = best.candidate
    for node, earliest in stages_reading(gm, best, names).items():
        holders = sorted({index % c.pp for index in earliest})
        if len(holders) < 2 or not REQUIRES_GRAD.get(node, True):
            continue
        nbytes = local_elements(node, placements, c.tp) * TENSOR.get(node).itemsize
        yield node, nbytes, tuple(c.mesh.rank_of(dp=0, pp=r, tp=0, cp=0) for r in holders)


def tied_sums(gm, best: Priced, names: list[str], placements, world: World) -> list:
    """The all-reduce that sums the copies of each weight read on several pipeline ranks (a tied
    embedding and LM head), over the ranks holding a copy: one rank's gradient, in the parameter's
    dtype (the runtime sums ``param.grad`` after the dp average), as a ``CollectiveChoice``."""
    return [CollectiveChoice(f"tied:{PARAM_NAME.get(node)}", "pp", "all_reduce",
                             collective_cost("all_reduce", nbytes, group, world).algorithm, int(nbytes))
            for node, nbytes, group in _tied_copies(gm, best, names, placements)]


def tied_sum_seconds(gm, best: Priced, names: list[str], placements, world: World) -> float:
    """Seconds of the tied sums of ``best`` per step: the runtime runs them one after another once the
    step's dp sync is done (``CompiledModel.train_step``), so nothing hides them and they add to the step."""
    return math.fsum(collective_cost("all_reduce", nbytes, group, world).seconds
                     for _, nbytes, group in _tied_copies(gm, best, names, placements))


def local_elements(node, placements, tp: int) -> int:
    """Elements of a parameter one tp rank holds: its local shape under the tp shard, which pads an
    uneven dim at the end (``local_shape``: 1001 rows on 4 ranks are 251 each, padding included)."""
    count = PARAM_COUNT.get(node)
    strategy = placements.get(node.name)
    if strategy is not None and strategy.outputs and isinstance(strategy.outputs[0].tp, PlanShard):
        shape = TENSOR.get(node).shape
        return math.prod(int(size) for size in local_shape(shape, strategy.outputs[0].tp, tp))
    return count
