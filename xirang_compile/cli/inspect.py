"""``xirang inspect plan.json --rank R``: what one rank of a saved plan does.

Everything but the code is read from the plan alone: the rank's mesh coordinates, its pipeline
stages and their units, the layout chosen for every node, the collectives of its groups. The code
needs the model: it is traced here (the analysis passes) and lowered for rank R (the lowering
passes, xirang_compile/lower.py), without any process group, so no distributed launch is needed to
read the program of any rank of a large world. ``--passes`` lists the compiler's passes with what
each took for this rank; ``--dump DIR`` writes the graph after every one of them.
"""
from __future__ import annotations

import json
import sys

from xirang.ir.mesh import AXES
from xirang.ir.plan import Plan
from xirang.ir.plan_parts import Layout

from xirang.ir.errors import XirangError


def load_plan(path: str) -> Plan:
    """The saved plan, or an error saying what is wrong with the file and how to write one."""
    from xirang.cli.args import read_input_text
    read_input_text(path, "plan file", "write one with `xirang plan MODEL --global-batch N --json plan.json`")
    return Plan.load(path)


def check_rank(plan: Plan, rank: int) -> None:
    if not 0 <= rank < plan.mesh.size:
        raise XirangError(f"--rank {rank} is out of range: the plan has {plan.mesh.size} ranks ({plan.mesh})",
                          where="--rank", hint=f"give a rank from 0 to {plan.mesh.size - 1}")


def group_of(plan: Plan, rank: int, axis: str) -> list[int]:
    """The global ranks of ``rank``'s group along mesh axis ``axis`` (any named axis: ir/mesh.py)."""
    return list(plan.mesh.group(axis, rank))


def _replicated(strategy) -> bool:
    every = list(strategy.inputs) + list(strategy.outputs)
    return all(layout == Layout() for layout in every)


def _analysed(plan: Plan, model_spec: str, batch, seq, dump: str | None):
    """Trace and analyse the model; refuse a plan made for another one (Plan.check_matches names the field)."""
    from xirang.passes.analysis.fingerprint import check_plan_matches

    from xirang.analyze import analyze
    from xirang.cli.model_files import build, load_factory
    from xirang.model_checks import check_placements
    model, example_kwargs = build(load_factory(model_spec), batch, seq, strict=True)
    report = analyze(model, example_kwargs=example_kwargs, dump_dir=f"{dump}/analysis" if dump else None)
    check_plan_matches(plan, report.graph_module, plan.world)
    check_placements(plan, report.graph_module)  # a hand-edited layout, before the lowering trips on it
    return report


def pass_list() -> list[dict]:
    """The compiler's passes in order: stage, name, first docstring line, what each requires and provides."""
    from xirang.pipeline import ANALYSIS_PASSES, LOWERING_PASSES
    return [{"stage": stage, "name": p.name, "doc": p.doc, "requires": [k.name for k in p.requires],
             "provides": [k.name for k in p.provides]}
            for stage, passes in (("analysis", ANALYSIS_PASSES), ("lowering", LOWERING_PASSES)) for p in passes]


def inspect_rank(plan: Plan, rank: int, *, stage: int | None = None, every_node: bool = False,
                 model_spec: str | None = None, batch=None, seq=None, dump: str | None = None) -> dict:
    """What rank ``rank`` runs under ``plan``, as a JSON-ready dict (see the module docstring)."""
    check_rank(plan, rank)
    coords = plan.mesh.coords(rank)
    stages = plan.stages_of(coords["pp"])
    if stage is not None:
        if stage not in [s.index for s in stages]:
            raise XirangError(f"--stage {stage} does not run on rank {rank} (pipeline rank {coords['pp']})",
                              where="--stage", hint=f"rank {rank} runs stage(s) {[s.index for s in stages]}")
        stages = tuple(s for s in stages if s.index == stage)
    if dump and not model_spec:
        raise XirangError("--dump needs --model: the graphs are the model's", where="--dump",
                          hint="add --model path/to/file.py:factory (the model the plan was made for)")
    report = _analysed(plan, model_spec, batch, seq, dump) if model_spec else None
    gm = report.graph_module if report is not None else None
    nodes = list(plan.placements)
    if gm is not None and plan.mesh.pp > 1:
        # only the model can say which unit a node belongs to: the plan stores units per stage
        from xirang.ir.meta_keys import UNIT
        mine = {u for s in stages for u in s.units}
        unit_of = {n.name: UNIT.get(n, None) for n in gm.graph.nodes}
        nodes = [n for n in nodes if unit_of.get(n) in mine]
    placements = [{"node": name, "strategy": s.strategy, "inputs": [str(x) for x in s.inputs],
                   "outputs": [str(x) for x in s.outputs]}
                  for name, s in ((n, plan.placements[n]) for n in nodes) if every_node or not _replicated(s)]
    groups = {axis: group_of(plan, rank, axis) for axis in AXES if plan.mesh.axis_size(axis) > 1}
    collectives = [{"node": c.node, "axis": c.axis, "kind": c.kind, "algorithm": c.algorithm, "bytes": c.nbytes,
                    "group": groups[c.axis]} for c in plan.collectives if c.axis in groups]
    result = {"rank": rank, "mesh": str(plan.mesh), "axes": plan.mesh.to_json(), "layout": plan.mesh.describe(),
              "pp": plan.mesh.pp, "coords": {axis: plan.mesh.index(axis, rank) for axis in AXES}, "groups": groups,
              "stages": [{"index": s.index, "units": list(s.units)} for s in stages],
              "placements": placements, "placements_total": len(nodes),
              "collectives": collectives, "code": None, "passes": pass_list()}
    if gm is not None:
        from xirang.codegen.emit import program_source
        from xirang.lower import lower
        lowered = lower(gm, plan, rank=rank, dump_dir=f"{dump}/rank{rank}" if dump else None)
        result["code"] = program_source(lowered.program, plan, rank, tuple(s.index for s in stages))
        seconds = {t.name: t.seconds for t in report.timings + lowered.run.timings}
        for entry in result["passes"]:
            entry["seconds"] = seconds.get(entry["name"])
    return result


def format_passes(passes: list[dict]) -> str:
    """The pass list as a table: stage, name, time when measured, what the pass does."""
    width = max(len(p["name"]) for p in passes)
    timed = any(p.get("seconds") is not None for p in passes)
    lines = ["Passes (" + ("times for this rank" if timed else "pass --model to time them") + "):"]
    for p in passes:
        took = f"{p['seconds'] * 1000:8.1f} ms  " if p.get("seconds") is not None else ""
        lines.append(f"  {p['stage']:<8}  {p['name']:<{width}}  {took}{p['doc']}")
    if timed:
        total = sum(p["seconds"] for p in passes if p.get("seconds") is not None)
        lines.append(f"  {'':<8}  {'total':<{width}}  {total * 1000:8.1f} ms")
    return "\n".join(lines)


def format_inspection(info: dict, *, every_node: bool) -> str:
    c = info["coords"]
    lines = [f"Rank {info['rank']} of mesh {info['mesh']}: " + ", ".join(f"{axis} {c[axis]}" for axis in AXES),
             f"  mesh axes: {info['layout']}"]
    for axis, members in info["groups"].items():
        lines.append(f"  {axis} group: ranks {members}")
    lines.append("\nStages:")
    for s in info["stages"]:
        lines.append(f"  stage {s['index']}: {', '.join(s['units'])}")
    shown = "every node" if every_node else "nodes not fully replicated; --all shows every node"
    lines.append(f"\nPlacements ({len(info['placements'])} of {info['placements_total']} nodes: {shown}):")
    if info["placements"]:
        width = max(len(p["node"]) for p in info["placements"])
        swidth = max(len(p["strategy"]) for p in info["placements"])
        lines.append(f"  {'node':<{width}}  {'strategy':<{swidth}}  inputs -> outputs")
        for p in info["placements"]:
            lines.append(f"  {p['node']:<{width}}  {p['strategy']:<{swidth}}  "
                         f"{', '.join(p['inputs']) or '-'} -> {', '.join(p['outputs']) or '-'}")
    lines.append(f"\nCollectives ({len(info['collectives'])}):")
    for x in info["collectives"]:
        lines.append(f"  {x['kind']:<14} on {x['axis']} {x['group']} at {x['node']} ({x['algorithm']}, "
                     f"{x['bytes']:,} bytes)")
    if info["code"] is None:
        lines.append("\nCode: pass --model path.py:factory (the model the plan was made for) to see the program.")
    else:
        lines.append(f"\nCode (the rank's stage modules):\n{info['code']}")
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    if args.dump is not None and args.model:
        from xirang.cli.args import check_output_dir
        check_output_dir(args.dump, "--dump")
    plan = load_plan(args.plan)
    info = inspect_rank(plan, args.rank, stage=args.stage, every_node=args.all, model_spec=args.model,
                        batch=args.batch, seq=args.seq, dump=args.dump)
    if args.json:
        print(json.dumps(info, indent=2))
    elif args.passes:
        print(format_passes(info["passes"]))
    else:
        print(format_inspection(info, every_node=args.all))
    if args.dump:
        print(f"graphs after every pass: {args.dump}/analysis, {args.dump}/rank{args.rank}", file=sys.stderr)
    return 0
