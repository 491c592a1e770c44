"""The ``xirang`` command: ``analyze`` a model, ``plan`` it for a world, ``explain`` a saved plan (and draw its
memory), ``inspect`` one rank of a plan, ``run`` or ``verify`` a model on local CPU ranks, ``launch`` a
training script on local CPU ranks through torch's own launcher."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path

from xirang.ir.errors import DEBUG_ENV, XirangError, tracebacks_wanted

from xirang.cli.args import (add_renamed_flag, check_output_dir, check_output_file, nonnegative_float,
                             nonnegative_int, positive_float, positive_int, world_arg)
from xirang.cli.model_files import build, load_factory


def cmd_analyze(args) -> int:
    from xirang.analyze import analyze
    from xirang.model_checks import check_positions
    if args.dump is not None:
        check_output_dir(args.dump, "--dump")  # before the trace, not after it
    model, example_kwargs = build(load_factory(args.model), args.batch, args.seq, strict=True)
    report = analyze(model, example_kwargs=example_kwargs, fold_repeats=not args.no_fold, dump_dir=args.dump)
    check_positions(report.graph_module)  # --seq past the position table traces fine on fake tensors
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


def cmd_plan(args) -> int:
    from xirang.plan_api import plan as make_plan
    if args.out is not None:  # "" too: refused as no file name, not taken for "no --out"
        check_output_file(args.out, "--out")  # before planning, so the plan is not lost at the end
    model, example_kwargs = build(load_factory(args.model), args.batch, args.seq, strict=True)
    pins = {name: getattr(args, name) for name in ("tp", "pp", "dp", "micro_batch", "schedule",
                                                   "virtual_stages", "recompute", "offload", "precision", "ep", "cp",
                                                   "context_method", "routing_imbalance", "ep_overlap",
                                                   "capacity_factor")}
    from xirang.cli.progress import PlanProgressDisplay
    with PlanProgressDisplay() as progress:  # a live bar on a terminal, a line per step elsewhere
        world = args.world.world()
        if args.world_file:  # a measured World (`xirang calibrate`) replaces --world and --hardware
            from xirang.ir.world import World
            world = World.load(args.world_file)
        plan = make_plan(model, world=world, example_kwargs=example_kwargs, global_batch=args.global_batch,
                         hardware=args.hardware, progress=progress, **{k: v for k, v in pins.items() if v is not None})
    if args.out:
        plan.save(args.out)
    print(plan.explain())
    if args.out:
        print(f"\nplan written to {args.out}")
    if args.check:
        from xirang.cli.check import run_check
        print()
        return run_check(plan, model, example_kwargs)
    return 0


def cmd_explain(args) -> int:
    from xirang.cli.inspect import load_plan
    if args.picture is not None:
        check_output_file(args.picture, "--picture")
    plan = load_plan(args.plan)
    if args.json:  # for scripts: the same table as data, nothing else on stdout
        from xirang.ir.plan_explain import explain_data
        print(json.dumps(explain_data(plan), indent=2))
    else:
        print(plan.explain())
    if args.picture:
        from xirang.codegen.viz.memory_picture import write_memory_png
        path = write_memory_png(plan, args.picture)
        print(f"\nmemory picture: {path} (a bar per pipeline rank, red line: usable memory)",
              file=sys.stderr if args.json else sys.stdout)  # stdout stays parseable JSON
    return 0


def cmd_launch(args) -> int:
    import subprocess
    from xirang.codegen.runtime.launch.launcher import launch_command
    if not Path(args.script).is_file():
        raise XirangError(f"script {args.script!r} does not exist", where=f"current directory {Path.cwd()}",
                          hint="give the path of a training script, e.g. examples/train_gpt.py")
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    command = launch_command(args.script, args.world, script_args)
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    return subprocess.run(command).returncode


def cmd_demo(args) -> int:
    from xirang.cli.demo import parse_mesh, run_demo
    sizes = parse_mesh(args.mesh)
    dp, tp, pp = sizes["dp"], sizes["tp"], sizes["pp"]
    for option, path, skip in (("--timeline", args.timeline, args.no_picture), ("--trace", args.trace, args.no_trace)):
        if not skip:
            check_output_file(path, option)  # before the 8-rank run
    result = run_demo(world=dp * tp * pp, dp=dp, tp=tp, pp=pp, schedule=args.schedule,
                      timeline=None if args.no_picture else args.timeline, trace=None if args.no_trace else args.trace)
    return 0 if result["ranks_agree"] and result["worst"] < 1e-4 else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``xirang`` command's parser, every subcommand registered (the docs' CLI reference is generated
    from it: docs/hooks/reference_pages.py)."""
    parser = argparse.ArgumentParser(prog="xirang", description="Compile a PyTorch model for 3D-parallel training.")
    parser.add_argument("--debug", action="store_true",
                        help="print the Python traceback of Xirang's errors too, a launched rank's included "
                             "(also XIRANG_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True)
    analyze = commands.add_parser("analyze", help="trace a model and report parameters, FLOPs and memory per block")
    analyze.add_argument("model", help="path/to/file.py:factory (returns a model, or (model, example kwargs))")
    analyze.add_argument("--batch", type=positive_int, help="batch size passed to the factory")
    analyze.add_argument("--seq", type=positive_int, help="sequence length passed to the factory")
    analyze.add_argument("--no-fold", action="store_true", help="trace every repeated layer (slower, same graph)")
    analyze.add_argument("--dump", metavar="DIR", help="write the graph after every pass into DIR")
    analyze.add_argument("--json", action="store_true", help="print the report as JSON")
    analyze.set_defaults(run=cmd_analyze)

    plan = commands.add_parser("plan", help="choose dp x tp x pp, micro-batching, schedule and recompute for a world")
    plan.add_argument("model", help="path/to/file.py:factory (returns a model, or (model, example kwargs))")
    plan.add_argument("--world", type=world_arg, default=world_arg("1x8"),
                      help="devices: N, or NODESxDEVICES_PER_NODE such as 128x8 (default 1x8)")
    plan.add_argument("--hardware", default=None, help="the device preset the planner prices (a100-80g, h100-80g, "
                                                       "h200, b200, cpu; default a100-80g)")
    add_renamed_flag(plan, "--device", "--hardware")
    plan.add_argument("--world-file", metavar="JSON", help="a World JSON (written by `xirang calibrate`) instead "
                                                          "of --world/--hardware")
    plan.add_argument("--global-batch", type=positive_int, required=True, help="samples per optimizer step")
    plan.add_argument("--batch", type=positive_int, help="batch size of the example inputs passed to the factory")
    plan.add_argument("--seq", type=positive_int, help="sequence length passed to the factory")
    for name, kind, text in (("tp", positive_int, "tensor-parallel degree"), ("pp", positive_int, "pipeline stages"),
                             ("dp", positive_int, "data-parallel degree"),
                             ("micro-batch", positive_int, "samples per micro-batch"),
                             ("schedule", str, "gpipe, 1f1b, interleaved, zb-h1 or zb-h2"),
                             ("virtual-stages", positive_int, "model chunks per pipeline rank (interleaved)"),
                             ("recompute", str, "none, selective or full"),
                             ("offload", str, "activation offload: none, or blocks (to host memory)"),
                             ("precision", str, "fp32, bf16 or fp16"),
                             ("ep", positive_int, "expert-parallel degree (ranks sharing each layer's experts)"),
                             ("cp", positive_int, "context-parallel degree (ranks sharing each sequence)"),
                             ("context-method", str, "context-parallel attention: ring, all_to_all, or usp:A "
                                                     "(all-to-all over A ranks x ring over cp/A)")):
        plan.add_argument(f"--{name}", type=kind, help=f"pin the {text} (default: searched)")
    plan.add_argument("--routing-imbalance", type=positive_float, metavar="RATIO",
                      help="the most-loaded expert-parallel rank's rows over the mean, which the plan prices "
                           "(default 1.0: balanced routing)")
    plan.add_argument("--ep-overlap", action="store_true", default=None,
                      help="price the expert all-to-alls as run under another micro-batch's compute (Megatron-Core's "
                           "batch-level overlap; Xirang's runtime runs them exposed)")
    plan.add_argument("--capacity-factor", type=positive_float, metavar="F",
                      help="each expert computes at most ceil(rows / experts x F) of the rows a rank routes it per "
                           "micro-batch, the rest dropped (default: dropless)")
    plan.add_argument("-o", "--out", metavar="FILE", help="save the plan as JSON to FILE (replaced if it exists; "
                                                          "its folder must exist)")
    add_renamed_flag(plan, "--json", "--out",
                     note="--json means print as JSON, in analyze, explain and inspect")
    plan.add_argument("--check", action="store_true", help="then run the full-scale check on the plan (xirang check)")
    plan.set_defaults(run=cmd_plan)

    explain = commands.add_parser("explain", help="print a saved plan: the winner, the runners-up and why")
    explain.add_argument("plan", help="plan.json written by `xirang plan --out`")
    explain.add_argument("--json", action="store_true", help="print the table and reasons as JSON")
    explain.add_argument("--picture", metavar="PNG", help="draw the predicted memory per pipeline rank against "
                                                          "the usable limit into PNG")
    explain.set_defaults(run=cmd_explain)

    from xirang.cli.check import add_check_command
    add_check_command(commands)

    from xirang.cli.inspect import cmd_inspect
    inspect_ = commands.add_parser("inspect", help="one rank of a saved plan: mesh place, stages, placements, "
                                                   "collectives and (with --model) its program")
    inspect_.add_argument("plan", help="plan.json written by `xirang plan --out`")
    inspect_.add_argument("--rank", type=nonnegative_int, required=True, help="global rank to show")
    inspect_.add_argument("--stage", type=nonnegative_int, help="show only this pipeline stage of the rank")
    inspect_.add_argument("--model", help="path/to/file.py:factory the plan was made for (to emit the code)")
    inspect_.add_argument("--batch", type=positive_int, help="batch size passed to the factory")
    inspect_.add_argument("--seq", type=positive_int, help="sequence length passed to the factory")
    inspect_.add_argument("--all", action="store_true", help="list every node, replicated ones too")
    inspect_.add_argument("--json", action="store_true", help="print as JSON")
    inspect_.add_argument("--passes", action="store_true", help="list the compiler's passes (with --model: each "
                                                                "pass's time for this rank)")
    inspect_.add_argument("--dump", metavar="DIR", help="with --model: write the graph after every analysis pass "
                                                        "(DIR/analysis) and every lowering pass of the rank "
                                                        "(DIR/rank<R>)")
    inspect_.set_defaults(run=cmd_inspect)

    from xirang.cli.verify import cmd_run, cmd_verify
    for name, text, function in (
            ("run", "train a model on N local CPU ranks (random batches shaped like its example inputs)", cmd_run),
            ("verify", "train on N local ranks and on one device; compare loss, gradients and parameters",
             cmd_verify)):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("model", help="path/to/file.py:factory (returns a model, or (model, example kwargs))")
        sub.add_argument("--world", type=world_arg, required=True, help="local ranks: N, or NxM (N nodes of M "
                                                                          "ranks, as the plan prices them)")
        sub.add_argument("--global-batch", type=positive_int, help="samples per step (default: the plan's, or the "
                                                          "example inputs')")
        sub.add_argument("--steps", type=positive_int, default=3 if name == "run" else 2, help="optimizer steps")
        sub.add_argument("--plan", help="plan.json to use (default: planned here for --world cpu ranks)")
        for axis, text in (("tp", "tensor-parallel degree"), ("pp", "pipeline stages"), ("dp", "data-parallel degree")):
            sub.add_argument(f"--{axis}", type=positive_int, help=f"pin the {text} when planning (default: searched)")
        sub.add_argument("--timeout", type=positive_float, default=None,
                         help="seconds the whole run may take (default: no limit; a frozen rank is caught by its "
                              "heartbeat)")
        if name == "run":
            sub.add_argument("--print-command", action="store_true",
                             help="print the torchrun command that trains MODEL this way on a cluster, instead "
                                  "of running")
            sub.add_argument("--torchrun", action="store_true",
                             help="this process is one rank started by torchrun (the command --print-command "
                                  "prints)")
            sub.add_argument("--trace", metavar="JSON", help="write every rank's measured pipeline actions as a "
                                                             "Chrome trace (open in ui.perfetto.dev)")
            sub.add_argument("--memory", action="store_true",
                             help="measure the last step's peak of saved activations per rank (and the CUDA "
                                  "allocator's peak) and print it beside the plan's prediction")
            sub.add_argument("--memory-picture", metavar="PNG", help="with --memory: draw the predicted memory per "
                                                                      "pipeline rank with the measured figures")
        else:
            sub.add_argument("--tolerance", type=nonnegative_float, default=1e-5,
                             help="largest |difference| that passes (default 1e-5, fp32)")
        sub.set_defaults(run=function)

    demo = commands.add_parser("demo", help="the main job: plan a small GPT for 8 local CPU ranks, show the plan and "
                                            "schedule, train on a dp x tp x pp plan, compare with one device")
    demo.add_argument("--mesh", default="dp=2,pp=2,tp=2", help="the named mesh axes, e.g. dp=2,pp=2,tp=2 (the "
                                                                "default: 8 ranks; an axis left out is 1)")
    demo.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, zb-h1 or zb-h2 (default 1f1b)")
    demo.add_argument("--timeline", default="demo_timeline.png", help="where to draw the pipeline timeline (PNG)")
    demo.add_argument("--no-picture", action="store_true", help="do not write the timeline picture")
    demo.add_argument("--trace", default="demo_trace.json", help="where to write what every rank measured, as a "
                                                                  "Chrome trace (JSON; open in ui.perfetto.dev)")
    demo.add_argument("--no-trace", action="store_true", help="do not write the trace")
    demo.set_defaults(run=cmd_demo)

    launch = commands.add_parser("launch", help="run a training script on N local ranks (torch.distributed.run; "
                                                "gloo on CPU)")
    launch.add_argument("-n", "--world", type=world_arg, required=True, help="ranks: N, or NxM (N * M local ranks)")
    add_renamed_flag(launch, "--nprocs", "--world")
    launch.add_argument("script", help="the training script, e.g. examples/train_gpt.py")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    launch.set_defaults(run=cmd_launch)
    from xirang.cli.calibrate import add_calibrate_parser
    add_calibrate_parser(commands)
    from xirang.cli.checkpoint import add_checkpoint_parser
    add_checkpoint_parser(commands)
    from xirang.cli.train import add_train_parser
    add_train_parser(commands)
    from xirang.cli.tune import add_tune_parser
    add_tune_parser(commands)
    return parser


def rank_label() -> str:
    """' (rank 3 of 8)' in a rank torchrun started (``xirang run/train --torchrun``), where every rank that
    fails prints its own error: the label says which rank said it; '' in a single process."""
    rank, size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "1")
    return f" (rank {rank} of {size})" if rank is not None and size.isdigit() and int(size) > 1 else ""


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except XirangError as exc:  # a renamed flag (cli/args.py add_renamed_flag), refused naming the new one
        print(f"xirang: error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # --debug goes into the environment, so the ranks this command launches (torchrun's too) and their
    # report see it; off the namespace, so commands that spell their ranks' arguments from it do not
    debug, before = vars(args).pop("debug"), os.environ.get(DEBUG_ENV)
    if debug:
        os.environ[DEBUG_ENV] = "1"
    try:
        return args.run(args)
    except XirangError as exc:  # the one error root: plan and schedule errors included
        if tracebacks_wanted():
            traceback.print_exc()
        print(f"xirang: error{rank_label()}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 -- not one of ours: a bug; one paragraph, the traceback on request
        if tracebacks_wanted() or os.environ.get("XIRANG_TRACEBACK"):
            raise
        print(f"xirang: internal error{rank_label()}: {type(exc).__name__}: {exc}\n  where: xirang {args.command}\n"
              f"  what to do: this is a bug in xirang (every error it expects says what, where and what to do); "
              f"rerun with --debug for the traceback and report it", file=sys.stderr)
        return 3
    finally:
        if debug and before is None:
            del os.environ[DEBUG_ENV]
        elif debug:
            os.environ[DEBUG_ENV] = before


if __name__ == "__main__":
    sys.exit(main())
