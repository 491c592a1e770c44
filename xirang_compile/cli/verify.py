"""``xirang run`` and ``xirang verify``: train a factory's model on N local CPU ranks, and check the
compiled program against single-device training of the same model.

Both plan once in this process (or load ``--plan``) and send the plan to the ranks, so the ranks
do not each search the same configurations again. Every rank and the single-device reference
build the model under the same seed and train on the same batches: random data shaped like the
factory's example inputs (integers below the model's smallest vocabulary, see ``int_bound``).

Randomness: ``verify`` compiles with ``rng="exact"`` and ``seed=VERIFY_SEED``, and the single-device
reference runs under ``ExactReference(VERIFY_SEED)`` (codegen/ops/random_ops.py), so a model with
dropout is checked exactly: every random op draws what the one-device model draws. ``run`` trains
with the default streams (correct in distribution, not equal to one device).
"""
from __future__ import annotations

import sys

import torch

from xirang.ir.errors import XirangError
from xirang.cli.args import WorldArg

MODEL_SEED, LR, VERIFY_SEED = 0, 1e-3, 0
# Adam's eps: some gradients are exactly zero in exact arithmetic (the bias of k in attention:
# softmax ignores a per-row constant), so both runs compute rounding noise there, in different
# summation orders; with eps 1e-8 Adam's first step is lr * sign(noise) and the parameters differ by
# up to 2 lr although every gradient agrees to 1e-7. A larger eps keeps the comparison about the
# program, not about noise (the same choice as tests/codegen/test_equivalence.py).
ADAM_EPS = 1e-3


def build_seeded(spec: str, batch):
    """The factory's model under a fixed seed (every rank and the reference get the same weights)."""
    from xirang.cli.model_files import build, load_factory
    torch.manual_seed(MODEL_SEED)
    return build(load_factory(spec), batch, None)


def int_bound(model) -> int:
    """Exclusive bound of random integer inputs: the smallest embedding table or output layer, so
    token ids and class labels are valid for every model in examples/ (GPT: vocab; MLP: classes)."""
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if linears:
        sizes.append(linears[-1].out_features)
    return max(1, min(sizes, default=2))


def random_batch(example_kwargs: dict, bound: int, step: int, global_batch: int) -> dict:
    """A batch of ``global_batch`` samples shaped like the examples, the same for a given step."""
    generator = torch.Generator().manual_seed(1000 + step)
    batch = {}
    for name, value in example_kwargs.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            batch[name] = value
            continue
        shape = (global_batch, *value.shape[1:])
        if value.dtype.is_floating_point:
            batch[name] = torch.randn(shape, generator=generator, dtype=value.dtype)
        elif value.dtype == torch.bool:
            batch[name] = value.new_ones(shape)
        else:
            batch[name] = torch.randint(0, bound, shape, generator=generator, dtype=value.dtype)
    return batch


def global_batch_of(example_kwargs: dict, given) -> int:
    if given is not None:
        return given
    sizes = [v.shape[0] for v in example_kwargs.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not sizes:
        raise XirangError("the factory's example inputs have no tensor with a batch dimension",
                          where="example inputs", hint="pass --global-batch")
    return sizes[0]


def prepare(spec: str, world: int, global_batch, plan_path, pins: dict | None = None, world_spec=None) -> tuple:
    """(plan, global batch) for ``world`` ranks: loaded from ``plan_path`` or planned here with ``pins``
    (tp=, pp=, dp= the user fixed), on ``world_spec`` (a World of ``world`` ranks, from ``--world-file``)
    when given, else on ``world`` CPU ranks."""
    import xirang
    from xirang.cli.inspect import load_plan
    if world < 1:
        raise XirangError(f"--world {world}: the number of ranks must be at least 1", where="--world",
                          hint="e.g. --world 2")
    pins = {k: v for k, v in (pins or {}).items() if v is not None}
    if plan_path and pins:
        raise XirangError(f"--plan fixes the mesh; it cannot be combined with {sorted('--' + k for k in pins)}",
                          where="--plan", hint="drop the pins, or drop --plan to plan with them")
    if plan_path:
        plan = load_plan(plan_path)
        if plan.world.size != world:
            raise XirangError(f"{plan_path} was made for {plan.world.size} ranks, not --world {world}",
                              where="--world", hint=f"pass --world {plan.world.size}, or re-plan for {world}")
        global_batch = global_batch or plan.global_batch
        if global_batch != plan.global_batch:
            raise XirangError(f"--global-batch {global_batch} differs from the plan's {plan.global_batch}",
                              where="--global-batch", hint="drop --global-batch to use the plan's")
        # every rank would refuse a plan for another model (or one it cannot run): say so once, here
        from xirang.compile_api import check_plan_for_graph
        from xirang.model_checks import check_trainable
        model, example_kwargs = build_seeded(spec, global_batch)
        example = random_batch(example_kwargs, int_bound(model), 0, global_batch)
        gm = xirang.analyze(model, example_kwargs=example).graph_module
        check_trainable(gm)
        check_plan_for_graph(plan, gm, plan.world)
        return plan, global_batch
    model, example_kwargs = build_seeded(spec, global_batch)
    global_batch = global_batch_of(example_kwargs, global_batch)
    example = random_batch(example_kwargs, int_bound(model), 0, global_batch)
    spelt = world.world() if isinstance(world, WorldArg) else world  # "2x4": nodes the plan prices
    plan = xirang.plan(model, world=world_spec or spelt, hardware=None if world_spec else "cpu", example_kwargs=example,
                       global_batch=global_batch, **pins)
    return plan, global_batch


def _train_rank(rank: int, world: int, spec: str, plan, global_batch: int, steps: int, gather: bool, say: bool,
                trace: bool = False, rng: str = "streams", memory: bool = False):
    """One rank: compile, train ``steps`` AdamW steps; with ``gather`` return losses, gradients of the
    last step and final parameters (full tensors; the gathers are collectives, so every rank runs them);
    with ``trace`` each step's executor timestamps, the rank in front (``chrome_trace.with_rank``); with
    ``memory`` the last step runs under a ``MemoryProbe`` (codegen/runtime/memory/memory_probe.py) and its
    ``MemoryMeasurement`` is returned."""
    from xirang.codegen.runtime.memory.memory_probe import measure_step
    import xirang
    from xirang.codegen.viz.chrome_trace import with_rank
    model, example_kwargs = build_seeded(spec, global_batch)
    bound = int_bound(model)
    compiled = xirang.compile(model, world=plan.world, plan=plan,
                              example_kwargs=random_batch(example_kwargs, bound, 0, global_batch),
                              runtime=xirang.RuntimeOptions(rng=rng, seed=VERIFY_SEED if rng == "exact" else None))
    optimizer, losses, grads, records = torch.optim.AdamW(compiled.parameters(), lr=LR, eps=ADAM_EPS), [], {}, []
    measured = None
    for step in range(steps):
        batch = random_batch(example_kwargs, bound, step, global_batch)
        if memory and step == steps - 1:
            loss, measured = measure_step(compiled, **batch)
            loss = loss.item()
        else:
            loss = compiled.train_step(**batch).item()
        losses.append(loss)
        if trace:  # a runtime without a step record (none yet for pp = 1) contributes no events
            last = getattr(compiled, "last_step", None)
            records.append(with_rank(rank, last.timestamps) if last is not None else [])
        if say and rank == 0:
            print(f"step {step}: loss {loss:.6f}", flush=True)
        if gather and step == steps - 1:
            grads = {k: v.detach().clone() for k, v in compiled.full_gradients().items()}
        optimizer.step()
        optimizer.zero_grad()
    params = {k: v.detach().clone() for k, v in compiled.full_state_dict().items()} if gather else {}
    return {"losses": losses, "grads": grads, "params": params, "trace": records,
            "random_sites": compiled.program.random_sites, "memory": measured}


def _train_single(spec: str, global_batch: int, steps: int, reference=None) -> dict:
    """The model on one device; ``reference`` (an ``ExactReference``) draws its random numbers."""
    from contextlib import nullcontext
    model, example_kwargs = build_seeded(spec, global_batch)
    bound = int_bound(model)
    optimizer, losses, grads = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS), [], {}
    for step in range(steps):
        inputs = random_batch(example_kwargs, bound, step, global_batch)
        with reference.forward(step) if reference is not None else nullcontext():
            loss = loss_of(model(**inputs))
        loss.backward()
        losses.append(loss.item())
        if step == steps - 1:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "params": {k: v.detach() for k, v in model.state_dict().items()}}


def torchrun_command(args) -> list:
    """The torchrun command that trains ``args.model`` as this ``xirang run`` would: each rank runs
    ``xirang run ... --torchrun`` (torch.distributed.run's ``-m``: run a module, here ``xirang``)."""
    from xirang.codegen.runtime.launch.launcher import launch_command
    rank_args = ["xirang", "run", args.model, "--world", str(args.world), "--steps", str(args.steps), "--torchrun"]
    for option in ("global_batch", "tp", "pp", "dp", "plan"):
        if getattr(args, option) is not None:
            rank_args += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    # launch_command(script, ...) puts the script first: "-m" then makes torchrun run the xirang module
    return launch_command("-m", args.world, rank_args)


def _run_under_torchrun(args) -> int:
    """One rank of the printed command: join torchrun's world, plan (every rank deterministically
    reaches the same plan, as xirang.compile does) and train."""
    from xirang.codegen.runtime.launch.launcher import ensure_distributed
    rank, _ = ensure_distributed(args.world, script="-m xirang run", script_args=[args.model])
    plan, global_batch = prepare(args.model, args.world, args.global_batch, args.plan,
                                 {k: getattr(args, k) for k in ("tp", "pp", "dp")})
    _train_rank(rank, args.world, args.model, plan, global_batch, args.steps, False, True)
    return 0


def cmd_run(args) -> int:
    import shlex

    import xirang
    from xirang.cli.args import check_output_file
    from xirang.cli.model_files import load_factory
    load_factory(args.model)  # a missing or broken model file is the first thing to say, whatever the mode
    if args.plan:
        from xirang.cli.inspect import load_plan
        load_plan(args.plan)
    if args.print_command:
        print(shlex.join(torchrun_command(args)))
        print("# on several nodes: replace --standalone with --nnodes N --node-rank I --rdzv-endpoint HOST:PORT "
              "and --nproc-per-node with the ranks per node; every rank runs this model file, so copy it (and the "
              "plan) to every node")
        return 0
    if args.torchrun:
        return _run_under_torchrun(args)
    if args.trace is not None:
        check_output_file(args.trace, "--trace")  # before the run, not after it
    memory = bool(args.memory or args.memory_picture is not None)
    if args.memory_picture is not None:
        check_output_file(args.memory_picture, "--memory-picture")
        from xirang.codegen.viz.plotting import require_matplotlib
        require_matplotlib("--memory-picture")  # before the run, not after it
    plan, global_batch = prepare(args.model, args.world, args.global_batch, args.plan,
                                 {k: getattr(args, k) for k in ("tp", "pp", "dp")})
    print(f"plan: {plan.mesh}, micro-batch {plan.micro_batch} x {plan.num_micro_batches}, {plan.schedule}; "
          f"global batch {global_batch}; training {args.steps} steps on {args.world} local CPU ranks", flush=True)
    results = xirang.launch(_train_rank, args.world, timeout_s=args.timeout,
                            args=(args.model, plan, global_batch, args.steps, False, True, bool(args.trace),
                                  "streams", memory))
    if args.trace:
        write_trace(args.trace, [result["trace"] for result in results], plan, args.world)
    if memory:
        report_memory(plan, [result["memory"] for result in results], args.memory_picture)
    return 0


def report_memory(plan, measurements: list, picture=None, out=print):
    """Print predicted vs measured memory per rank; with ``picture``, draw the plan's bars with the
    measured figures: per pipeline rank its fullest rank's CUDA allocator peak, or on CPU ranks the
    plan's states, buffers and working set plus the saved activations measured."""
    from xirang.codegen.runtime.memory.memory_probe import format_measurements
    out(f"\nmemory, last step (plan: recompute {plan.recompute}, offload {plan.offload}):")
    out(format_measurements(measurements))
    if not picture:
        return
    from xirang.codegen.viz.memory_picture import write_memory_png
    cuda = all(m.allocated_peak_bytes is not None for m in measurements)
    per_rank = [None] * plan.mesh.pp
    for m in measurements:
        if cuda:
            figure = m.allocated_peak_bytes
        else:
            figure = m.predicted_total_bytes - (m.predicted_activation_bytes or 0) + m.saved_peak_bytes
        per_rank[m.pp_rank] = max(per_rank[m.pp_rank] or 0, figure)
    what = ("CUDA allocator peak" if cuda else
            "predicted states, buffers and working set + saved activations measured")
    path = write_memory_png(plan, picture, per_rank, what, option="--memory-picture")
    out(f"memory picture: {path} (bars: predicted; purple markers: {what})")


def write_trace(path, per_rank: list, plan, world: int, out=print):
    """Write the ranks' step records (``per_rank[r][step]``) as a Chrome trace and say where it is."""
    from xirang.codegen.viz.chrome_trace import write_chrome_trace
    steps = [[entry for records in per_rank for entry in records[step]] for step in range(len(per_rank[0]))]
    facts = {"mesh": str(plan.mesh), "schedule": plan.schedule, "pipeline_ranks": plan.mesh.pp,
             "micro_batches": plan.num_micro_batches, "virtual_stages": plan.virtual_stages, "steps": len(steps),
             "world": world}
    written = write_chrome_trace(steps, path, ranks=range(world), other_data=facts)
    events = sum(len(records) for records in steps)
    note = "" if events else " (no events: this runtime records no step timestamps)"
    out(f"trace: {written} ({world} ranks, {len(steps)} steps, {events} compute events{note}); "
        f"open it in https://ui.perfetto.dev or chrome://tracing")
    return written


def _max_diff(got: dict, want: dict) -> tuple[float, list]:
    common = sorted(set(got) & set(want))
    worst = max((float((got[k].float() - want[k].float()).abs().max()) for k in common), default=0.0)
    return worst, sorted(set(want) - set(got))


def cmd_verify(args) -> int:
    import xirang
    plan, global_batch = prepare(args.model, args.world, args.global_batch, args.plan,
                                 {k: getattr(args, k) for k in ("tp", "pp", "dp")})
    print(f"plan: {plan.mesh}, micro-batch {plan.micro_batch} x {plan.num_micro_batches}, {plan.schedule}; "
          f"{args.steps} AdamW steps (lr {LR}, eps {ADAM_EPS}) on {args.world} ranks against one device", flush=True)
    results = xirang.launch(_train_rank, args.world, args=(args.model, plan, global_batch, args.steps, True, False,
                                                         False, "exact"), timeout_s=args.timeout)
    reference = xirang.ExactReference(VERIFY_SEED)
    single = _train_single(args.model, global_batch, args.steps, reference)
    sites = [site for result in results for site in result["random_sites"]]
    if sites:
        from xirang.codegen.ops.random_ops import check_replay
        check_replay(reference.seen, sites)  # the one device drew what the program drew, op by op
        print(f"random ops: {len({site.index for site in sites})} drawn as one device draws them "
              f"(rng='exact', seed {VERIFY_SEED})")
    grads, params = {}, {}
    for result in results:  # with pp > 1 each pipeline rank holds only its stages' tensors
        grads.update({k: v for k, v in result["grads"].items() if k not in grads})
        params.update({k: v for k, v in result["params"].items() if k not in params})
    losses = results[0]["losses"]
    print(f"\n{'step':>4} {'single device':>14} {'xirang':>14} {'|difference|':>13}")
    for step, (want, got) in enumerate(zip(single["losses"], losses)):
        print(f"{step:>4} {want:>14.6f} {got:>14.6f} {abs(want - got):>13.2e}")
    loss_diff = max(abs(a - b) for a, b in zip(single["losses"], losses))
    grad_diff, grad_missing = _max_diff(grads, single["grads"])
    param_diff, param_missing = _max_diff(params, single["params"])
    ok = True
    for what, diff, missing in (("loss", loss_diff, []), ("gradients", grad_diff, grad_missing),
                                ("parameters", param_diff, param_missing)):
        passed = diff <= args.tolerance and not missing
        ok &= passed
        extra = f"; missing from the compiled model: {missing[:5]}" if missing else ""
        print(f"{what:<11} max |difference| {diff:.2e}  {'PASS' if passed else 'FAIL'} "
              f"(tolerance {args.tolerance:g}){extra}")
    print("verify: " + ("PASS" if ok else "FAIL"))
    sys.stdout.flush()
    return 0 if ok else 1


def loss_of(output):
    """The loss a model returns: a tensor, the first element of a tuple, or ``.loss`` of a Hugging
    Face output object (the compiled step returns that same loss)."""
    if hasattr(output, "loss") and output.loss is not None:
        return output.loss
    if isinstance(output, (tuple, list)):
        return output[0]
    return output
