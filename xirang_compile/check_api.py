"""``xirang.check``: prove a plan's program on every rank before launch, on this machine, on fake tensors.

    report = xirang.check(plan, model_on_meta, example_kwargs=batch)   # or: xirang check plan.json --model F:fn
    print(report.explain()); assert report.ok

Ranks are grouped into classes whose programs are the same up to rank ids: the same pipeline rank and
the same number of micro-batches (dp ranks of uneven shares differ); tp and dp ranks of one pipeline
rank run one program on their own shards and groups. Each class's representative is lowered for the
plan's device (``cuda`` for GPU presets) and its training step run by the real runtime on fake tensors
(codegen/check/rank_step.py); the proofs (codegen/check/proofs.py) then cover every rank of the world:
collectives, sends, deadlock and memory, plus tensors on the wrong device for the backend.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from xirang.codegen.check.proofs import (ClassLog, Violation, prove_collectives, prove_devices, prove_memory,
                                         prove_no_deadlock, prove_sends)
from xirang.codegen.check.gpu_semantics import fuse_attention
from xirang.codegen.check.rank_step import run_rank
from xirang.ir.context_method import a2a_degree, recorded_method
from xirang.ir.errors import XirangError
from xirang.ir.plan import Plan
from xirang.passes.lowering.precision import COMPUTE_DTYPES

from .analyze import analyze
from .check_workers import run_jobs
from .lower import lower


MiB = 1024 ** 2


def device_type_of(plan: Plan) -> str:
    """What the plan's program runs on: ``cuda`` for a GPU preset, ``cpu`` for CPU ranks."""
    return "cpu" if plan.world.device_of(0).is_cpu else "cuda"


def fake_device(device_type: str) -> str:
    """The device the dry run's fake tensors live on. A CPU-only torch cannot fake CUDA tensors (a view of
    one asks the CUDA hooks for its device), so a GPU program runs on ``meta`` fakes: the same ops, shapes,
    dtypes and device checks (a CPU tensor met there is refused as it would be on a GPU), with the CUDA
    allocator's rounding applied to every allocation (codegen/check/recorder.py)."""
    return "cpu" if device_type == "cpu" else "meta"


def rank_classes(plan: Plan, own: tuple = ()) -> dict:
    """Representative rank -> member ranks, by (pipeline rank, micro-batches of the rank's dp share, its
    place on its node under a hierarchical dp all-reduce, its cp rank under USP attention, and its ep index
    where ep groups are blocks of the dp x cp places); ranks in ``own`` (mutated in tests) are classes of their
    own."""
    by_key: dict = {}
    on_node = _position_on_node(plan)
    # USP's all-to-all and ring sub-groups of a cp group are not moved onto each other by a shift along cp
    # (ir/context_method.py): each cp rank is then a class of its own (a shift along dp still maps them)
    cp = plan.mesh.cp
    own_cp = cp > 1 and 1 < a2a_degree(recorded_method(plan.collectives), cp) < cp
    # an ep group is a block of ep consecutive dp x cp places (ir/mesh.py): a shift along dp by other than a
    # multiple of ep moves it onto ranks of two groups (dp4 ep2: (0, 1) by one to (1, 2)), so ranks of one
    # class share their ep index; then every shift is a whole number of blocks
    by_ep = 1 < plan.mesh.ep < plan.mesh.dp * cp
    for rank in range(plan.mesh.size):
        coords = plan.mesh.coords(rank)
        key = ("own", rank) if rank in own else (coords["pp"], plan.micro_batches_per_dp_rank[coords["dp"]],
                                                 on_node.get(rank), coords["cp"] if own_cp else None,
                                                 plan.mesh.index("ep", rank) if by_ep else None)
        by_key.setdefault(key, []).append(rank)
    return {members[0]: tuple(members) for members in by_key.values()}


def _position_on_node(plan: Plan) -> dict:
    """Rank -> its place among its gradient group's members (dp, or dp x cp: ``Mesh.gradient_axis``) on its
    node, where a dp all-reduce is hierarchical (else empty). Its sub-groups are the members on one node and
    those at one place on every node: moving a log by a dp shift maps them onto each other only between ranks
    at the same place (process_groups.py ``build_two_level_groups``)."""
    if not any(c.axis == "dp" and c.algorithm == "hierarchical" for c in plan.collectives):
        return {}
    world = plan.world
    place = {}
    for members in plan.mesh.groups(plan.mesh.gradient_axis):
        by_node: dict = {}
        for member in sorted(members):
            by_node.setdefault(world.node_of(member), []).append(member)
        for ranks in by_node.values():
            place.update({rank: index for index, rank in enumerate(ranks)})
    return place


@dataclass
class CheckReport:
    """The check's result: one log per class, the violations found, and the seconds of each phase."""

    plan: Plan
    classes: list
    violations: list
    seconds: dict = field(default_factory=dict)
    device: str = "cpu"

    @property
    def ok(self) -> bool:
        return not self.violations

    def memory_rows(self) -> list:
        """Per class: pipeline rank, ranks, measured peak and its parts, the plan's predicted bytes."""
        predicted = self.plan.predicted.memory_bytes_per_device
        rows = []
        for klass in self.classes:
            pp = klass.log.coords["pp"]
            rows.append({"pp_rank": pp, "representative": klass.log.rank, "ranks": len(klass.members),
                         "peak_bytes": klass.log.memory.peak, "parts": dict(klass.log.memory.parts),
                         "host_peak_bytes": klass.log.memory.host_peak,
                         "largest": [{"bytes": size, "part": part, "site": site}
                                     for size, part, site in klass.log.memory.largest],
                         "predicted_bytes": predicted[pp] if pp < len(predicted) else None,
                         "calls": len(klass.log.calls), "host_reads": len(klass.log.host_reads),
                         "seconds": klass.log.seconds})
        return rows

    def explain(self) -> str:
        plan = self.plan
        lines = [f"xirang check: {plan.mesh} on {plan.world.describe()}, {len(self.classes)} class(es) of ranks run "
                 f"on fake {self.device} tensors; " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()),
                 "  pp rank  ranks  calls  host reads  peak MiB  predicted MiB  measured/predicted  at peak (MiB)"]
        for row in self.memory_rows():
            predicted = row["predicted_bytes"]
            ratio = f"{row['peak_bytes'] / predicted:.2f}" if predicted else "-"
            parts = " ".join(f"{name} {size / MiB:.1f}" for name, size in row["parts"].items() if size)
            if row["host_peak_bytes"]:
                parts += f"; host memory {row['host_peak_bytes'] / MiB:.1f}"
            lines.append(f"  {row['pp_rank']:>7}  {row['ranks']:>5}  {row['calls']:>5}  {row['host_reads']:>10}  "
                         f"{row['peak_bytes'] / MiB:>8.1f}  {(predicted or 0) / MiB:>13.1f}  {ratio:>18}  {parts}")
        reads = {(read.op, read.where) for klass in self.classes for read in klass.log.host_reads}
        if reads:
            lines.append("host reads of device values per step (each a GPU synchronisation): " +
                         "; ".join(f"{op} at {where}" for op, where in sorted(reads)))
        if self.ok:
            lines.append(f"proven on all {plan.mesh.size} ranks: every group's collectives agree, every send meets "
                         f"its receive, no deadlock, every rank's peak fits its device")
        else:
            lines.append(f"{len(self.violations)} violation(s):")
            lines += [violation.describe() for violation in self.violations]
        return "\n".join(lines)


def _specs(named) -> dict:
    return {name: (tuple(t.shape), t.dtype) for name, t in named}


def check(plan: Plan, model, *, example_inputs=(), example_kwargs=None, device: Optional[str] = None,
          mutate: Optional[dict] = None, memory_bytes: Optional[int] = None, workers: Optional[int] = None,
          analysed=None) -> CheckReport:
    """Dry-run every rank's program of ``plan`` for ``model`` (best built on ``meta``) and prove it (module
    docstring). ``device``: "cuda" or "cpu" (default: the plan's devices'). ``mutate``: {rank: fn(compiled)}
    changes those ranks' built programs before their step (tests: a fault the proofs must name).
    ``memory_bytes``: prove memory against devices of this size instead of the plan's (what if they were
    smaller). ``workers``: classes run side by side in forked processes (default: one per core; 1: here)."""
    from .compile_api import check_plan_for_graph  # the same refusals compile makes

    if not isinstance(model, torch.nn.Module):
        raise XirangError(f"xirang.check needs the model as a torch.nn.Module, got {type(model).__name__}",
                          where="xirang.check(model=)", hint="pass the model the plan was made for, built on meta")
    seconds = {}
    started = time.perf_counter()
    report = analysed or analyze(model, example_inputs, example_kwargs)
    check_plan_for_graph(plan, report.graph_module, plan.world)
    seconds["trace"] = time.perf_counter() - started
    device = device or device_type_of(plan)
    runs_on = fake_device(device)
    tensors = _specs(list(model.named_parameters(remove_duplicate=False)) +
                     list(model.named_buffers(remove_duplicate=False)))
    inputs = _specs((name, value) for name, value in (example_kwargs or {}).items() if isinstance(value, torch.Tensor))
    mutate = dict(mutate or {})
    shared: dict = {}  # what every rank's lowering derives alike (the run-time dtypes), derived once, here
    if plan.precision != "fp32":  # the same dtypes the planner priced the saved activations at
        shared[("run_dtypes", COMPUTE_DTYPES[plan.precision])] = report.run_dtypes(plan.precision).of

    workers = workers if workers is not None else (os.cpu_count() or 1)
    # A rank's program depends on the rank only through its tp coordinate (the lowering passes read no other),
    # so forked workers share one lowering per tp coordinate, made here before they fork.
    programs: dict = {}
    if workers > 1:
        for representative in rank_classes(plan, tuple(mutate)):
            tp_rank = plan.mesh.coords(representative)["tp"]
            if tp_rank not in programs:
                began = time.perf_counter()
                program = lower(report.graph_module, plan, rank=representative, device=runs_on, shared=shared).program
                if device == "cuda":  # the GPU's attention kernel, rewritten once here, not in every child:
                    fuse_attention(program)  # run_rank's own call then finds nothing left to rewrite
                programs[tp_rank] = (program, time.perf_counter() - began)

    def job(representative):
        def run():
            began = time.perf_counter()
            if plan.mesh.coords(representative)["tp"] in programs:  # a forked copy of the shared lowering
                program, lowered = programs[plan.mesh.coords(representative)["tp"]][0], 0.0
            else:
                program = lower(report.graph_module, plan, rank=representative, device=runs_on,
                                shared=shared).program
                lowered = time.perf_counter() - began
            log = run_rank(program, plan, representative, tensors=tensors, inputs=inputs, device=runs_on,
                           allocator=device, mutate=mutate.get(representative))
            return log, lowered
        return run

    classes_of = rank_classes(plan, tuple(mutate))
    began = time.perf_counter()
    results = run_jobs([job(rep) for rep in classes_of], workers)
    seconds["classes"] = time.perf_counter() - began
    classes, failed, running = [], [], 0.0
    lowering = sum(seconds for _, seconds in programs.values())
    for (representative, members), result in zip(classes_of.items(), results):
        if result[0] != "ok":  # the step itself failing is the finding, named with its ranks
            failed.append(Violation("step", f"the step of rank {representative} failed: {result[1]}", ranks=members,
                                    hint="run this rank's program on CPU ranks (xirang run) to see it fail"))
            continue
        log, lowered = result[1]
        lowering, running = lowering + lowered, running + log.seconds
        if log.failure:  # named, with what it found before failing; its partial calls prove nothing
            during = f" during {log.failed_in}" if log.failed_in else ""
            failed.append(Violation("step", f"the step of rank {representative} failed{during}: {log.failure}",
                                    ranks=members, hint="the violations above it may say why; run this rank's "
                                                        "program on CPU ranks (xirang run) to see it fail"))
            failed += prove_devices([ClassLog(log, members)])
            continue
        classes.append(ClassLog(log, members))
    seconds["lower (summed)"], seconds["run (summed)"] = lowering, running
    violations = failed + prove_devices(classes)
    for name, prove in (("collectives", lambda: prove_collectives(plan.mesh, classes)),
                        ("sends", lambda: prove_sends(plan.mesh, classes)),
                        ("deadlock", lambda: prove_no_deadlock(plan.mesh, classes,
                                                               ordered_pairs=device == "cuda")),
                        ("memory", lambda: prove_memory(plan, classes, memory_bytes=memory_bytes))):
        began = time.perf_counter()
        violations += prove()
        seconds[f"prove {name}"] = time.perf_counter() - began
    return CheckReport(plan, classes, violations, seconds, device)

