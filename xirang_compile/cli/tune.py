"""``xirang tune``: the plan chosen by measurement (``xirang.tune``, xirang_compile/tune.py) for a model file,
on N local ranks; ``xirang train --tune`` runs the same before training.

    xirang tune examples/catalog.py:gpt_tiny --world 8 --global-batch 16 --top-k 4 --steps 5 -o tuned.json
    xirang explain tuned.json      # the plan, and the trial table it was chosen by

The model file as ``xirang plan`` takes it (``path/to/file.py:factory``); the model is built under a fixed
seed with real weights (a factory on the meta device is refused: the trials run it), and the trials
cycle through a few random batches shaped like its example inputs, the same for every trial. The
plans are priced on ``--world-file`` when given, else on this host's cached calibration of ``--world``
ranks (``xirang calibrate`` keeps one), else on the CPU preset.
"""
from __future__ import annotations

from xirang.ir.errors import XirangError

BATCHES = 2  # distinct random batches the trials' steps cycle through


def add_tune_parser(commands) -> None:
    """The ``tune`` subcommand and its options."""
    from xirang.cli.args import positive_float, positive_int, nonnegative_int, world_arg
    tune = commands.add_parser("tune", help="run the planner's best few plans for a few steps on N local ranks "
                                            "and keep the measured fastest (a plan with its trial table)")
    tune.add_argument("model", help="path/to/file.py:factory (returns a model, or (model, example kwargs))")
    tune.add_argument("--world", type=world_arg, required=True, help="local ranks: N, or NxM")
    tune.add_argument("--world-file", metavar="JSON", help="price the plans on this World (`xirang calibrate`) "
                                                          "instead of the cached calibration or the CPU preset")
    tune.add_argument("--global-batch", type=positive_int, help="samples per step (default: the example inputs')")
    tune.add_argument("--seq", type=positive_int, help="sequence length passed to the factory")
    add_tune_options(tune)
    for axis, text in (("tp", "tensor-parallel degree"), ("pp", "pipeline stages"), ("dp", "data-parallel degree")):
        tune.add_argument(f"--{axis}", type=positive_int, help=f"pin the {text} in every trial (default: searched)")
    tune.add_argument("--within", type=positive_float, default=2.0,
                      help="try runners-up predicted at most this many times the winner's step (default 2)")
    tune.add_argument("--budget", type=positive_float, metavar="SECONDS",
                      help="drop the trials estimated slowest until the estimate fits (default: no bound)")
    tune.add_argument("--warmup", type=nonnegative_int, default=1, help="steps of each trial left out (default 1)")
    tune.add_argument("--sequential", action="store_true",
                      help="compile and run one trial at a time (default: all compiled, stepped in rounds)")
    tune.add_argument("--timeout", type=positive_float, help="seconds the trials may take (default: no limit)")
    tune.add_argument("-o", "--out", metavar="FILE", help="save the tuned plan (with its trial table) as JSON")
    tune.set_defaults(run=cmd_tune)


def add_tune_options(parser, prefix: str = "") -> None:
    """--top-k and --steps (``xirang train`` takes them as --tune-top-k, --tune-steps)."""
    from xirang.cli.args import positive_int
    parser.add_argument(f"--{prefix}top-k", type=positive_int, default=4, help="plans tried at most (default 4)")
    parser.add_argument(f"--{prefix}steps", type=positive_int, default=5,
                        help="measured steps of each trial, median taken (default 5)")


def tuned_plan(spec: str, world, global_batch, world_spec=None, *, seq=None, pins=None, top_k: int = 4,
               steps: int = 5, warmup: int = 1, within: float = 2.0, budget_s=None, interleave: bool = True,
               timeout_s=None):
    """``xirang.tune``'s result for the model file ``spec`` on ``world`` local ranks (module docstring)."""
    import xirang
    from xirang.cli.verify import global_batch_of, int_bound, random_batch
    model, example_kwargs = seeded_model(spec, global_batch, seq)
    if any(p.is_meta for p in model.parameters()):
        raise XirangError(f"{spec} builds its model on the meta device, and the trials run it",
                          where=spec, hint="tune a factory that builds real weights (e.g. a smaller size), or "
                                           "plan this one with xirang plan")
    global_batch = global_batch_of(example_kwargs, global_batch)
    bound = int_bound(model)
    batches = [random_batch(example_kwargs, bound, step, global_batch) for step in range(BATCHES)]
    planning = world_spec or cached_world(int(world))
    if planning is None:  # "2x4": the nodes the plan prices, on the CPU preset
        planning = world.world() if hasattr(world, "world") else world
    # the model goes to the ranks pickled as built: every rank and trial starts from these weights
    return xirang.tune(model, world=planning,
                       global_batch=global_batch, example_kwargs=batches[0], batches=batches, top_k=top_k,
                       steps=steps, warmup=warmup, within=within, budget_s=budget_s, interleave=interleave,
                       timeout_s=timeout_s, **{k: v for k, v in (pins or {}).items() if v is not None})


def seeded_model(spec: str, batch, seq=None):
    """The factory's model and example inputs under verify's fixed seed (``seq``, when given, passed on)."""
    import torch

    from xirang.cli.model_files import build, load_factory
    from xirang.cli.verify import MODEL_SEED
    torch.manual_seed(MODEL_SEED)
    return build(load_factory(spec), batch, seq, strict=seq is not None)


def cached_world(ranks: int):
    """This host's cached calibration of ``ranks`` CPU ranks as a World (calibrate.py), or None."""
    from xirang.cli.calibrate import cached_calibration
    from xirang.ir.world import World
    path, _ = cached_calibration(ranks, "cpu")
    return World.load(path) if path is not None else None


def cmd_tune(args) -> int:
    from xirang.cli.args import check_output_file
    from xirang.cli.model_files import load_factory
    if args.out is not None:
        check_output_file(args.out, "--out")  # before the trials, so the tuned plan is not lost at the end
    load_factory(args.model)
    world_spec = None
    if args.world_file:
        from xirang.ir.world import World
        world_spec = World.load(args.world_file)
        if world_spec.size != args.world:
            raise XirangError(f"{args.world_file} describes {world_spec.size} ranks, not --world {args.world}",
                              where="--world-file", hint=f"pass --world {world_spec.size}")
    result = tuned_plan(args.model, args.world, args.global_batch, world_spec, seq=args.seq,
                        pins={k: getattr(args, k) for k in ("tp", "pp", "dp")}, top_k=args.top_k, steps=args.steps,
                        warmup=args.warmup, within=args.within, budget_s=args.budget,
                        interleave=not args.sequential, timeout_s=args.timeout)
    if args.out:
        result.plan.save(args.out)
        print(f"\ntuned plan written to {args.out} (xirang explain {args.out} shows it with its trials)")
    return 0
