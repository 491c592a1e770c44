"""``xirang train``: a training run that survives -- data per rank, warm-up and cosine learning rate, clipping,
checkpoints every N steps, resume after a crash, and the measured step time beside the plan's.

    xirang train examples/catalog.py:gpt_tiny --world 8 --dp 2 --tp 2 --pp 2 --synthetic --steps 200 \\
        --lr 3e-4 --warmup 20 --clip 1.0 --checkpoint-dir ckpt --checkpoint-every 50 --loss-picture loss.png
    xirang train ... --resume          # after a crash: continues from the newest complete checkpoint
    xirang train --config run.toml --steps 50   # options from TOML (train_config.py), flags over the file

The parent plans once (``verify.prepare``: the same plan every rank would reach) and starts the
local ranks (codegen/runtime/launch/launcher.py: a rank that raises, dies or freezes fails the run naming it,
the others are stopped); ``--torchrun`` makes this process one rank of a torchrun world instead
(``--print-command`` prints that command, with every option of this one). Before planning, every input
is checked (train_prechecks.py: the model file, the plan, the data's type, values and length, the
checkpoint folder and its free space, resume compatibility, the World file), so a wrong input fails here,
named, and not inside the ranks. Each rank runs ``train_rank`` (train_loop.py): its dp share of each
global batch, ``train_step``, the global gradient norm (``--clip``), AdamW on finite numbers and
``--on-nonfinite``'s policy (stop, skip, rollback) otherwise, the schedule. Rank 0 logs the loss, tokens per
second and the measured step time against the plan's predicted ``step_seconds`` (a live bar on a terminal),
and draws the loss curve at the end (``--loss-picture``, matplotlib: the ``viz`` extra).

The run's folder (``--run-dir``, else ``--checkpoint-dir``) gets ``config.toml``, every option's value, which
``--config`` reads back to the same run, and ``metrics.jsonl`` (or ``--metrics FILE``): a line per step
written by rank 0 with loss, learning rate, gradient norm, tokens/s, MFU, every rank's memory and the step
against the plan's (train_metrics.py; TensorBoard scalars too with ``--tensorboard DIR``). The predicted step
is priced on this machine when ``xirang calibrate`` has kept a calibration of ``--world`` local ranks for this
host (calibrate.py: the plan is made on that World), and otherwise printed as the preset's figure.

Checkpoints (``xirang.save_checkpoint``, codegen/runtime/checkpoint/save_load.py: every rank its own shards,
complete once its marker is written) hold the model, the optimizer, the randomness and, in ``extra``,
the data position, the learning-rate schedule's state and the losses so far, so ``--resume``
continues exactly where the newest complete step left off; the run's last step is always saved.

After step N of the run (``--reprice-after N``; by default 3 when ``--steps`` is over 5) every rank
hands in what its steps since the first measured (``compiled.measured_costs()``) and rank 0 prints
``xirang.reprice``'s report once: the plan's step predicted, measured and re-priced, and whether another
plan would now win (xirang_compile/reprice.py). ``--world-file`` plans on a World that ``xirang calibrate``
wrote instead of the default CPU ranks. ``--tune`` chooses the plan by trial runs on the ranks first
(``xirang tune``, cli/tune.py: the planner's best few, each a few steps, the measured fastest trained).
"""
from __future__ import annotations

import os
import time


from xirang.ir.errors import XirangError
from xirang.cli.train_loop import metrics_path, run_folder, token_model, train_rank, watching


def write_loss_picture(path, losses: list, title: str):
    """The loss per step as a PNG (matplotlib, the ``viz`` extra)."""
    from xirang.codegen.viz.plotting import new_figure
    figure = new_figure(800, 450, "--loss-picture")
    axes = figure.add_subplot(1, 1, 1)
    axes.plot(range(1, len(losses) + 1), losses, color="#1f5fa8", linewidth=1.5)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.savefig(path)
    return path


def check_train_args(args) -> None:
    """Everything about the options that can be said before planning or starting a rank."""
    if bool(args.data) == bool(args.synthetic):
        raise XirangError("give the data: --data FILE (token ids: .npy or a torch-saved tensor) or --synthetic",
                          where="xirang train", hint="e.g. --synthetic to try it, --data tokens.npy to train")
    if args.data and not os.path.isfile(args.data):
        raise XirangError(f"--data {args.data!r} does not exist", where="--data",
                          hint="write the token ids with numpy.save('tokens.npy', ids)")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        raise XirangError("--checkpoint-every and --resume need --checkpoint-dir", where="--checkpoint-dir",
                          hint="name the folder checkpoints go to (and are resumed from)")
    if args.tune and (args.plan or args.torchrun):
        raise XirangError("--tune runs trials on local ranks and chooses the plan itself", where="--tune",
                          hint="drop --plan (or tune first: xirang tune ... -o plan.json, then --plan plan.json); "
                               "under torchrun, tune on one host and pass the tuned plan")
    if args.world_file and args.plan:
        raise XirangError("--world-file and --plan both say what the plan runs on", where="--world-file",
                          hint="drop --world-file: the plan carries its World")
    if args.warmup >= args.steps and args.warmup:
        raise XirangError(f"--warmup {args.warmup} is not shorter than --steps {args.steps}", where="--warmup",
                          hint="warm up over a small part of the run, e.g. a tenth")
    if args.loss_picture:
        from xirang.cli.args import check_output_file
        from xirang.codegen.viz.plotting import require_matplotlib
        check_output_file(args.loss_picture, "--loss-picture")
        require_matplotlib("--loss-picture")
    if args.tensorboard:
        from xirang.cli.train_metrics import require_tensorboard
        require_tensorboard("--tensorboard")
    if not args.print_command:  # the run's folder and files: created or refused before planning
        from xirang.cli.args import check_output_dir, check_output_file
        if run_folder(args):
            check_output_dir(run_folder(args), "--run-dir" if args.run_dir else "--checkpoint-dir")
        if args.metrics:
            check_output_file(args.metrics, "--metrics")
        if args.tensorboard:
            check_output_dir(args.tensorboard, "--tensorboard")


def world_spec(args):
    """The World of ``--world-file`` (None without it), refused unless it has ``--world`` ranks."""
    if not args.world_file:
        return None
    from xirang.ir.world import World
    world = World.load(args.world_file)
    if world.size != args.world:
        raise XirangError(f"{args.world_file} describes {world.size} ranks, not --world {args.world}",
                          where="--world-file", hint=f"pass --world {world.size}, or calibrate {args.world} ranks")
    return world


def torchrun_command(args) -> list:
    """The torchrun command that runs this training with one ``xirang train ... --torchrun`` per rank."""
    from xirang.codegen.runtime.launch.launcher import launch_command
    rank_args = ["xirang", "train", args.model, "--torchrun"]
    for option, value in sorted(vars(args).items()):
        if option in ("model", "command", "torchrun", "print_command", "config") or value is None or value is False \
                or not isinstance(value, (bool, int, float, str)):
            continue
        flag = "--" + option.replace("_", "-")
        rank_args += [flag] if value is True else [flag, str(value)]
    return launch_command("-m", args.world, rank_args)


# --- options: --config, the run's folder ------------------------------------------------------------------

NOT_SAVED = ("config", "resume", "torchrun", "print_command")  # this invocation's switches, not the run's options


def train_actions() -> dict:
    """The argparse actions of every ``xirang train`` option, by dest."""
    import argparse
    parser = argparse.ArgumentParser(prog="xirang train", add_help=False)
    add_train_arguments(parser)
    return {action.dest: action for action in parser._actions}


def parse_train_args(argv) -> "argparse.Namespace":  # noqa: F821
    """The options ``xirang train ARGV`` runs with: ``--config``'s file under the flags given."""
    import argparse

    from xirang.cli.train_config import track_given
    parser = argparse.ArgumentParser(prog="xirang train")
    track_given(parser)
    add_train_arguments(parser)
    return effective_options(parser.parse_args(argv))


def effective_options(args):
    """``args`` with ``--config``'s values where the command line did not give the option (train_config.py);
    the model and --world required of one or the other."""
    import argparse

    from xirang.cli.train_config import GIVEN, merge_config, read_config
    if args.config:
        actions = {dest: action for dest, action in train_actions().items() if dest != "config"}
        args = merge_config(args, read_config(args.config), actions, where=f"--config {args.config}")
    else:
        args = argparse.Namespace(**{key: value for key, value in vars(args).items() if key != GIVEN})
    if not args.model:
        raise XirangError("give the model to train: path/to/file.py:factory", where="xirang train",
                          hint='e.g. xirang train examples/catalog.py:gpt_tiny --world 2 --synthetic, or '
                               'model = "..." in the --config file')
    if args.world is None:
        raise XirangError("give the number of ranks: --world N", where="--world",
                          hint="e.g. --world 4, or world = 4 in the --config file")
    return args


def run_options(args) -> dict:
    """Every option's value for the run's config.toml (None: not set), without NOT_SAVED."""
    return {dest: getattr(args, dest) for dest in train_actions() if dest not in NOT_SAVED}


def save_run_config(args):
    """config.toml in the run's folder: ``xirang train --config`` of it runs the same options again."""
    import socket
    from pathlib import Path

    from xirang.cli.train_config import write_config
    if run_folder(args) is None:
        return None
    path = Path(run_folder(args)) / "config.toml"
    header = (f"the options of xirang train run on {socket.gethostname()} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
              f"xirang train --config {path} runs them again (flags given beside --config override it)")
    return write_config(path, run_options(args), header)


# --- what the prediction is priced on -----------------------------------------------------------------------

def planning_world(args) -> tuple:
    """(World to plan on or None for --world CPU ranks of the preset, what it was calibrated by): --world-file,
    else for local ranks this host's cached calibration of --world ranks (``xirang calibrate`` keeps one,
    calibrate.py). Under torchrun each rank plans alone, so a host's cache, which may differ between
    hosts, is not read there."""
    if args.world_file:
        return world_spec(args), f"--world-file {args.world_file}"
    if args.plan or args.torchrun:
        return None, None
    from xirang.cli.calibrate import cached_calibration
    from xirang.ir.world import World
    path, quick = cached_calibration(args.world, "cpu")
    if path is None:
        return None, None
    try:
        world = World.load(path)
    except XirangError as error:
        print(f"warning: the cached calibration {path} cannot be read ({error.what}); planning on the preset: "
              f"run `xirang calibrate --world {args.world}` again", flush=True)
        return None, None
    return world, f"cached calibration {path}" + (" (--quick: rough)" if quick else "")


def priced_on(plan, calibrated_by, torchrun: bool = False) -> str:
    """What the plan's predicted step is priced on, with what to do when it is a preset's figure."""
    if plan.world.calibration is not None:
        return f"priced on this machine: {calibrated_by or 'the calibration the plan was made with'}"
    kinds = ", ".join(sorted({node.device.name for node in plan.world.nodes}))
    todo = ("plan on a World `xirang calibrate` wrote, with --world-file, to price this machine" if torchrun else
            f"run `xirang calibrate --world {plan.world.size}` to price this machine")
    return f"preset {kinds}, uncalibrated: {todo}"


def run_facts(args, plan, global_batch: int, calibrated_by):
    """What every metrics line repeats (train_metrics.RunFacts): the model's FLOPs per step (one more trace
    of the model), the peak the MFU divides by, the prediction and what it is priced on."""
    from xirang.cli.train_metrics import RunFacts, model_flops, peak_of
    model, example = token_model(args, global_batch)
    peak, peak_text = peak_of(plan.world, plan.precision)
    return RunFacts(model_flops=model_flops(model, example, global_batch), peak_flops_per_s=peak, peak=peak_text,
                    predicted_step_s=plan.predicted.step_seconds,
                    predicted_by=priced_on(plan, calibrated_by, args.torchrun),
                    tokens_per_step=global_batch * example["input_ids"].shape[1])


def cmd_train(args) -> int:
    import shlex

    import xirang
    from xirang.cli.verify import prepare
    from xirang.cli.model_files import load_factory
    from xirang.cli.train_prechecks import check_before_ranks
    args = effective_options(args)
    load_factory(args.model)
    check_train_args(args)
    model, example = token_model(args, args.global_batch)  # one that does not take token ids: refused before planning
    if args.print_command:
        print(shlex.join(torchrun_command(args)))
        return 0
    pins = {k: getattr(args, k) for k in ("tp", "pp", "dp")}
    if args.torchrun:
        from xirang.codegen.runtime.launch.launcher import ensure_distributed
        rank, _ = ensure_distributed(args.world, script="-m xirang train", script_args=[args.model],
                                     timeout_s=args.collective_timeout)
        plan, global_batch = prepare(args.model, args.world, args.global_batch, args.plan, pins, world_spec(args))
        check_before_ranks(args, model, example, global_batch, say=rank == 0)
        calibrated_by = f"--world-file {args.world_file}" if args.world_file else None
        facts = None
        if rank == 0:
            print(f"predicted step {plan.predicted.step_seconds * 1e3:.3g} ms ({priced_on(plan, calibrated_by, True)})",
                  flush=True)
            saved = save_run_config(args)
            if saved:
                print(f"options: {saved}", flush=True)
            facts = run_facts(args, plan, global_batch, calibrated_by) if watching(args) else None
        losses = train_rank(rank, args.world, args, plan, global_batch, facts)["losses"]
        if rank == 0 and args.loss_picture:
            print(f"loss curve: {write_loss_picture(args.loss_picture, losses, f'{args.model}: {plan.mesh}')}")
        return 0
    world, calibrated_by = planning_world(args)
    if args.tune:  # the plan chosen by trial runs on these ranks (cli/tune.py, xirang_compile/tune.py)
        from xirang.cli.tune import tuned_plan
        plan = tuned_plan(args.model, args.world, args.global_batch, world, pins=pins, top_k=args.tune_top_k,
                          steps=args.tune_steps).plan
        global_batch = plan.global_batch
    else:
        plan, global_batch = prepare(args.model, args.world, args.global_batch, args.plan, pins, world)
    check_before_ranks(args, model, example, global_batch)  # every input, before a rank starts (train_prechecks.py)
    print(f"plan: {plan.mesh}, micro-batch {plan.micro_batch} x {plan.num_micro_batches}, {plan.schedule}; "
          f"global batch {global_batch}; predicted step {plan.predicted.step_seconds * 1e3:.3g} ms "
          f"({priced_on(plan, calibrated_by)}); {args.steps} steps on {args.world} local CPU ranks", flush=True)
    saved = save_run_config(args)
    if saved:
        print(f"options: {saved} (xirang train --config {saved} runs them again)", flush=True)
    facts = run_facts(args, plan, global_batch, calibrated_by) if watching(args) else None
    results = xirang.launch(train_rank, args.world, args=(args, plan, global_batch, facts), timeout_s=args.timeout,
                            pg_timeout_s=args.collective_timeout)
    losses = results[0]["losses"]
    print(f"done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if facts is not None and metrics_path(args):
        print(f"metrics: {metrics_path(args)}", flush=True)
    if args.loss_picture:
        path = write_loss_picture(args.loss_picture, losses, f"{args.model}: {plan.mesh}, global batch {global_batch}")
        print(f"loss curve: {path}")
    return 0


def add_train_parser(commands) -> None:
    from xirang.cli.train_config import track_given
    train = commands.add_parser("train", help="train a model on N local ranks with per-rank data, a warm-up + "
                                              "cosine schedule, clipping, checkpoints and --resume")
    track_given(train)  # which options the command line gave, so they override --config's
    add_train_arguments(train)
    train.set_defaults(run=cmd_train)


def add_train_arguments(train) -> None:
    """Every option of ``xirang train`` (each may also come from --config's TOML file)."""
    from xirang.cli.args import nonnegative_float, nonnegative_int, positive_float, positive_int, world_arg
    train.add_argument("model", nargs="?", help="path/to/file.py:factory (returns a model, or (model, example "
                                                "kwargs)); or model = \"...\" in --config")
    train.add_argument("--config", metavar="TOML", help="read the options from this TOML file (keys: the option "
                                                        "names with underscores, e.g. global_batch = 8); options "
                                                        "given here override it. The run's folder gets the "
                                                        "effective options as config.toml")
    train.add_argument("--world", type=world_arg, help="ranks: N or NxM (required, here or in --config)")
    for axis, text in (("tp", "tensor-parallel degree"), ("pp", "pipeline stages"), ("dp", "data-parallel degree")):
        train.add_argument(f"--{axis}", type=positive_int, help=f"pin the {text} when planning (default: searched)")
    train.add_argument("--plan", help="plan.json to use (default: planned here)")
    train.add_argument("--tune", action="store_true", help="first run the planner's best few plans for a few steps "
                                                            "on these ranks and train the measured fastest (xirang "
                                                            "tune)")
    from xirang.cli.tune import add_tune_options
    add_tune_options(train, prefix="tune-")
    train.add_argument("--world-file", metavar="JSON", help="plan on this World (written by `xirang calibrate`) "
                                                           "instead of --world CPU ranks")
    train.add_argument("--reprice-after", type=nonnegative_int, metavar="N",
                       help="after step N, re-price the plan from the measured steps and say whether another "
                            "plan would now win (default: 3 when --steps > 5; 0: never). Rank 0 plans again "
                            "meanwhile and the others wait in their next collective: for a model that takes "
                            "long to plan, raise --collective-timeout")
    train.add_argument("--global-batch", type=positive_int, help="samples per step (default: the example inputs')")
    train.add_argument("--data", help="token ids, one flat array: a .npy file or a tensor saved with torch.save")
    train.add_argument("--synthetic", action="store_true", help="made-up tokens instead of --data")
    train.add_argument("--seed", type=nonnegative_int, default=0, help="data order and synthetic tokens (default 0)")
    train.add_argument("--steps", type=positive_int, default=100, help="optimizer steps (default 100)")
    train.add_argument("--lr", type=positive_float, default=3e-4, help="peak learning rate (default 3e-4)")
    train.add_argument("--warmup", type=nonnegative_int, default=0, help="linear warm-up steps (default 0)")
    train.add_argument("--min-lr-ratio", type=nonnegative_float, default=0.1,
                       help="the cosine ends at this fraction of the peak (default 0.1)")
    train.add_argument("--weight-decay", type=nonnegative_float, default=0.0, help="AdamW weight decay (default 0)")
    train.add_argument("--clip", type=positive_float, help="clip the global gradient norm to this (default: none)")
    train.add_argument("--on-nonfinite", choices=("stop", "skip", "rollback"), default="stop",
                       help="a step whose loss or global gradient norm is NaN or inf: stop naming where it appeared "
                            "(default), skip its optimizer step, or roll back to the newest checkpoint and go on with "
                            "the next batches (needs --checkpoint-dir)")
    train.add_argument("--checkpoint-dir", help="folder of checkpoints (step-<n>/); the last step is always saved")
    train.add_argument("--checkpoint-every", type=positive_int, help="save every N steps")
    train.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    train.add_argument("--loss-picture", metavar="PNG", help="draw the loss per step into PNG at the end")
    train.add_argument("--run-dir", metavar="DIR", help="the run's folder: config.toml (the effective options) and "
                                                        "metrics.jsonl (default: --checkpoint-dir)")
    train.add_argument("--metrics", metavar="JSONL", help="write one JSON line of metrics per step (loss, lr, "
                                                          "tokens/s, MFU, memory per rank, gradient norm, step vs "
                                                          "the plan's) to JSONL (default: metrics.jsonl in the run's "
                                                          "folder)")
    train.add_argument("--tensorboard", metavar="DIR", help="also write the metrics as TensorBoard scalars into DIR "
                                                            "(needs the tensorboard extra)")
    train.add_argument("--timeout", type=positive_float, help="seconds the whole run may take (default: no limit)")
    train.add_argument("--collective-timeout", type=positive_float, default=120.0,
                       help="seconds a rank waits in a collective for a peer before failing (default 120)")
    train.add_argument("--torchrun", action="store_true", help="this process is one rank started by torchrun")
    train.add_argument("--print-command", action="store_true",
                       help="print the torchrun command that runs this training on a cluster, instead of running")
