"""The ``xirang`` command. For now: ``xirang analyze path/to/file.py:factory`` prints the analysis."""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import logging
import sys
from pathlib import Path

from xirang.ir.plan import PlanError

from .errors import XirangError


def load_factory(spec: str):
    """'path/to/file.py:factory' -> the factory function, with errors that say what to fix."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise XirangError(f"model {spec!r} is not of the form path/to/file.py:factory",
                          hint="name a Python file and a function in it that builds the model, e.g. "
                               "examples/catalog.py:gpt_tiny")
    path = Path(path_text)
    if not path.is_file():
        raise XirangError(f"model file {path_text!r} does not exist", where=f"current directory {Path.cwd()}",
                          hint="give the path of a .py file, relative to the current directory or absolute")
    sys.path.insert(0, str(path.resolve().parent))
    sys.path.insert(0, str(Path.cwd()))
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        raise XirangError(f"{path_text} has no function {name!r}", hint=f"functions there: {', '.join(found)}")
    return factory


def build(factory, batch: int | None, seq: int | None):
    """Call the factory with the batch/seq it accepts; it returns a model or (model, example kwargs)."""
    accepted = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None and k in accepted}
    built = factory(**kwargs)
    return built if isinstance(built, tuple) else (built, {})


def cmd_analyze(args) -> int:
    from .analyze import analyze
    model, example_kwargs = build(load_factory(args.model), args.batch, args.seq)
    report = analyze(model, example_kwargs=example_kwargs, fold_repeats=not args.no_fold, dump_dir=args.dump)
    if args.json:
        print(json.dumps({
            "total_params": report.total_params, "symbols": report.symbols,
            "flops_per_step": report.flops, "flops_expression": str(report.total_flops),
            "kinds": [{"kind": k.kind, "type": k.module_type, "count": k.count} for k in report.kinds],
            "rows": [{"name": r.name, "kind": r.kind, "params": r.params, "flops": str(r.flops),
                      "activation_bytes": str(r.activation_bytes)} for r in report.rows],
            "trace": report.trace, "pass_seconds": {t.name: t.seconds for t in report.timings}}, indent=2))
    else:
        print(report)
        print("\npasses: " + ", ".join(f"{t.name} {t.seconds:.2f}s" for t in report.timings))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="xirang", description="Compile a PyTorch model for 3D-parallel training.")
    commands = parser.add_subparsers(dest="command", required=True)
    analyze = commands.add_parser("analyze", help="trace a model and report parameters, FLOPs and memory per block")
    analyze.add_argument("model", help="path/to/file.py:factory (returns a model, or (model, example kwargs))")
    analyze.add_argument("--batch", type=int, help="batch size passed to the factory")
    analyze.add_argument("--seq", type=int, help="sequence length passed to the factory")
    analyze.add_argument("--no-fold", action="store_true", help="trace every repeated layer (slower, same graph)")
    analyze.add_argument("--dump", metavar="DIR", help="write the graph after every pass into DIR")
    analyze.add_argument("--json", action="store_true", help="print the report as JSON")
    analyze.set_defaults(run=cmd_analyze)
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        return args.run(args)
    except (XirangError, PlanError) as exc:
        print(f"xirang: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
