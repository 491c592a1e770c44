"""``xirang check PLAN --model FILE:FACTORY``: the full-scale check of a saved plan from the command line
(xirang_compile/check_api.py); ``xirang plan --check`` runs it on the plan it just made."""
from __future__ import annotations

import json

from xirang.check_api import check


def report_data(report) -> dict:
    """The check as data: per class its memory row, and every violation."""
    return {"ok": report.ok, "mesh": str(report.plan.mesh), "device": report.device, "seconds": report.seconds,
            "classes": report.memory_rows(),
            "violations": [{"proof": v.proof, "what": v.what, "ranks": list(v.ranks), "group": list(v.group),
                            "calls": list(v.calls), "hint": v.hint} for v in report.violations]}


def run_check(plan, model, example_kwargs, *, json_out=None, analysed=None) -> int:
    """Check ``plan``, print the report (and write it as JSON to ``json_out``); 0 when every proof holds."""
    report = check(plan, model, example_kwargs=example_kwargs, analysed=analysed)
    print(report.explain())
    if json_out:
        with open(json_out, "w") as handle:
            json.dump(report_data(report), handle, indent=2)
        print(f"\ncheck written to {json_out}")
    return 0 if report.ok else 1


def cmd_check(args) -> int:
    from xirang.cli.args import check_output_file
    from xirang.cli.inspect import load_plan
    from xirang.cli.model_files import build, load_factory
    if args.out is not None:
        check_output_file(args.out, "--out")  # before the check's minutes, so its result is not lost
    plan = load_plan(args.plan)
    model, example_kwargs = build(load_factory(args.model), args.batch, args.seq, strict=True)
    return run_check(plan, model, example_kwargs, json_out=args.out)


def add_check_command(commands) -> None:
    sub = commands.add_parser("check", help="prove a saved plan before launch: every rank's step run on fake "
                                            "tensors; collectives, sends, deadlock and memory checked on all ranks")
    from xirang.cli.args import add_renamed_flag
    sub.add_argument("plan", help="plan.json written by `xirang plan --out`")
    sub.add_argument("--model", required=True, help="path/to/file.py:factory the plan was made for (build it on "
                                                    "meta: nothing is allocated)")
    sub.add_argument("--batch", type=_positive, help="batch size passed to the factory")
    sub.add_argument("--seq", type=_positive, help="sequence length passed to the factory")
    sub.add_argument("-o", "--out", metavar="FILE", help="also write the check as JSON to FILE")
    add_renamed_flag(sub, "--json", "--out",
                     note="--json means print as JSON, in analyze, explain and inspect")
    sub.set_defaults(run=cmd_check)


def _positive(text: str) -> int:
    from xirang.cli.args import positive_int
    return positive_int(text)
