"""Does the calibrated cost model predict step times on this machine, and rank meshes as they run?

1. ``xirang calibrate`` on 8 local ranks (or ``--world-file`` a World it wrote).
2. For each mesh below, plan the same GPT pinned to that mesh on the calibrated World, compile it on 8
   local gloo ranks, train a few steps and take the median step (``train_step``: forward, backward and
   every collective; the optimizer step is not part of the planner's step time, so it is not timed).
3. Print predicted vs measured per mesh, their ratio, and whether the planner's order of the meshes
   equals the measured one; and which pairs were measured closer than either one's step-to-step
   spread (slowest - fastest step), whose measured order this machine's noise decides, and whether
   the order matches apart from those pairs (both verdicts are printed).
4. Re-priced: each mesh's plan re-priced from its own timed steps (``xirang.reprice`` on the medians of
   ``compiled.measured_costs()``, xirang_compile/reprice.py): its step under the corrected cost model,
   against the measured step, and the mesh that corrected model would pick instead.
5. ``--calibrate-each``: a fresh calibration just before each mesh is timed, its plan the one timed, so
   the prediction and the measurement are a minute apart rather than up to ten (a shared VM's speed
   drifts at that scale: ``codegen/runtime/calibration/calibrate._compute_pass``). The ratios are then each
   mesh's own; the order is still checked on the first calibration's predictions, all made at once.
6. ``--split-comm`` (a diagnostic, numerically wrong on purpose): each mesh is timed a second time with
   its collectives of more than ``SKIPPED_ABOVE`` elements not run (the tp activations, the gradient
   buckets, the tied sums; the step's own small agreement and loss collectives still run, and so do the
   pipeline's sends, which carry data the next stage waits for). The step without them against the
   predicted step less the priced collective causes says how far the compute price is off; the
   difference of the two measured steps against those causes, how far the collectives' is. A total
   within 15% can hide a compute price and a collective price off in opposite directions; this shows it.
7. Host drift (unless ``--no-drift``): just before each mesh is timed, the calibration's own training
   workload runs again on every rank (``calibration/sharing.training_probe``, 3-4 s), and its time alone
   and its CPU with every rank busy are printed over the calibration's: how much slower or faster the
   host runs that same work now. The prediction times the CPU drift over the measured step is printed
   beside the ratio as a diagnostic; the check stays on the prediction as made.

    python benchmarks/calibrated_prediction.py [--world-file world.json] [--steps 5] [--calibrate-each]
        [--split-comm] [--no-drift]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # examples/

import xirang  # noqa: E402
from examples.gpt import GPTConfig, build_gpt  # noqa: E402
from xirang.codegen.runtime.calibration.calibrate import calibrate  # noqa: E402
from xirang.codegen.runtime.calibration.sharing import training_probe  # noqa: E402
from xirang.codegen.runtime.launch.launcher import launch  # noqa: E402
from xirang.ir.world import World  # noqa: E402

RANKS = 8
CONFIG = GPTConfig(vocab_size=2048, seq_len=128, hidden=256, heads=8, layers=8)
GLOBAL_BATCH, SEQ = 16, 128
# name -> plan pins; micro_batch is per dp rank
MESHES = {
    "dp8": dict(dp=8, tp=1, pp=1, micro_batch=2),
    "tp8": dict(dp=1, tp=8, pp=1, micro_batch=4),
    "pp8": dict(dp=1, tp=1, pp=8, micro_batch=2, schedule="1f1b"),
    "3d 2x2x2": dict(dp=2, tp=2, pp=2, micro_batch=2, schedule="1f1b"),
    "pp4 interleaved": dict(dp=2, tp=1, pp=4, micro_batch=1, schedule="interleaved", virtual_stages=2),
    "dp4 pp2 full recompute": dict(dp=4, tp=1, pp=2, micro_batch=1, schedule="1f1b", recompute="full"),
}


def token_batch(size=GLOBAL_BATCH) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, CONFIG.vocab_size, (size, SEQ), generator=generator),
            "labels": torch.randint(0, CONFIG.vocab_size, (size, SEQ), generator=generator)}


def _plan(world: World, pins: dict):
    model = build_gpt(CONFIG)  # on CPU, as the ranks build it: the plan must match their trace
    return xirang.plan(model, world=world, example_kwargs=token_batch(2), global_batch=GLOBAL_BATCH,
                       precision="fp32", **pins)


# --split-comm: collectives over more elements than this are skipped; the batch agreement (1 + 64 per
# input) and the loss (one element) are smaller and still run
SKIPPED_ABOVE = 4096
COLLECTIVE_CAUSES = ("tp_comm", "dp_exposed", "tied_sum")  # what --split-comm takes away


class _NotRun:
    """The handle of a skipped asynchronous collective: already complete."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _skip_large_collectives() -> None:
    """Make this rank's large collectives return at once (``--split-comm``; timing only)."""
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        real = getattr(dist, name)

        def skipping(tensor, *args, _real=real, **kwargs):
            if tensor.numel() > SKIPPED_ABOVE:
                return _NotRun() if kwargs.get("async_op") else None
            return _real(tensor, *args, **kwargs)
        setattr(dist, name, skipping)


def _train(rank, world_size, plan, world, steps, warmup, skip_collectives=False):
    if skip_collectives:
        _skip_large_collectives()
    torch.manual_seed(0)
    compiled = xirang.compile(build_gpt(CONFIG), world=world, plan=plan, example_kwargs=token_batch(2))
    batch = token_batch()
    times, cpu, costs = [], [], []
    for _ in range(warmup + steps):
        for param in compiled.parameters():  # what optimizer.zero_grad does between steps (untimed)
            param.grad = None
        dist.barrier()  # every rank starts the step together: the job's step ends at its slowest rank
        start, cpu_start = time.perf_counter(), time.process_time()
        compiled.train_step(**batch)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)  # this rank's CPU seconds (gloo's threads included)
        costs.append(compiled.measured_costs())  # untimed: a gather of what the step recorded
    return times[warmup:], costs[warmup:], cpu[warmup:]


def measure(plan, world: World, steps: int, warmup: int, skip_collectives: bool = False) -> tuple:
    """(median over steps of the slowest rank's train_step seconds, the steps' median MeasuredCosts,
    median over steps of the CPU seconds summed over ranks, the steps' spread: slowest - fastest)."""
    # 8 ranks on a few busy cores: a rank can be starved for long stretches; it is not frozen
    per_rank = launch(_train, RANKS, (plan, world, steps, warmup, skip_collectives), timeout_s=1800,
                      heartbeat_s=300)
    steps_s = [max(step) for step in zip(*(times for times, _, _ in per_rank))]
    cpu = statistics.median(sum(step) for step in zip(*(cpu for _, _, cpu in per_rank)))
    return statistics.median(steps_s), xirang.MeasuredCosts.median(per_rank[0][1]), cpu, max(steps_s) - min(steps_s)


def noise_ties(measured: dict, spread: dict) -> list:
    """Pairs of meshes whose measured steps differ by less than either one's own step-to-step spread:
    their measured order is within this machine's noise, so no prediction can be said to get it wrong."""
    names = list(measured)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if abs(measured[a] - measured[b]) <= max(spread[a], spread[b])]


def order_matches_up_to_ties(predicted: dict, measured: dict, ties: list) -> bool:
    tied = {frozenset(pair) for pair in ties}
    return all((predicted[a] < predicted[b]) == (measured[a] < measured[b])
               for i, a in enumerate(predicted) for b in list(predicted)[i + 1:] if frozenset((a, b)) not in tied)


def split_comm_line(plan, world: World, args, measured_s: float, causes: dict) -> str:
    """The mesh timed again without its large collectives: compute and collectives, predicted vs measured."""
    without_s = measure(plan, world, args.steps, args.warmup, skip_collectives=True)[0]
    priced_comm = sum(causes.get(cause, 0.0) for cause in COLLECTIVE_CAUSES)
    priced_rest = plan.predicted.step_seconds - priced_comm
    measured_comm = measured_s - without_s
    comm_ratio = f"{priced_comm / measured_comm:5.2f}" if measured_comm > 0 else "  n/a"
    return (f"  without large collectives: predicted {priced_rest * 1e3:8.1f} ms  measured {without_s * 1e3:8.1f} ms  "
            f"ratio {priced_rest / without_s:5.2f};  collectives: predicted {priced_comm * 1e3:7.1f} ms  "
            f"measured {measured_comm * 1e3:7.1f} ms  ratio {comm_ratio}")


def _probe(rank, world_size):
    torch.set_num_threads(1)  # as the calibration's ranks ran it (1 thread each: 8 ranks on this box's cores)
    return training_probe("cpu", lambda: None)


def host_drift(world: World) -> dict | None:
    """The host's speed now against the calibration's: the calibration's training workload timed again
    on every rank (``calibration/sharing.training_probe``), its rank-alone seconds and its together CPU
    seconds each over what the calibration measured (above 1: the host now runs that work slower).
    None where the calibration holds no such figures."""
    calibrated = (world.calibration.raw.get("sharing") or {}).get("training") if world.calibration else None
    if not calibrated or not calibrated.get("alone_s") or not calibrated.get("together_cpu_s"):
        return None
    now = launch(_probe, RANKS, (), timeout_s=600)[0]
    return {"alone": now["alone_s"] / calibrated["alone_s"],
            "together_cpu": now["together_cpu_s"] / calibrated["together_cpu_s"]}


def _order(times: dict) -> list:
    return sorted(times, key=times.__getitem__)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-file", help="a World JSON written by `xirang calibrate` (default: calibrate now)")
    parser.add_argument("--out", default="world_calibrated.json", help="where to write the calibration")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="mesh names to run (default all)")
    parser.add_argument("--predict-only", action="store_true", help="plan and print the predictions, train nothing")
    parser.add_argument("--details", action="store_true", help="print each mesh's re-pricing report (stages, scales)")
    parser.add_argument("--calibrate-each", action="store_true",
                        help="calibrate again just before each mesh is timed; its ratio from that calibration")
    parser.add_argument("--no-drift", action="store_true",
                        help="skip timing the calibration's training workload again before each mesh")
    parser.add_argument("--split-comm", action="store_true",
                        help="time each mesh again without its large collectives: compute and collectives apart")
    args = parser.parse_args(argv)
    if args.world_file:
        world = World.load(args.world_file)
    else:
        start = time.perf_counter()
        world = calibrate(RANKS)
        world.save(args.out)
        print(f"calibrated in {time.perf_counter() - start:.0f} s -> {args.out}")
    from xirang.cli.calibrate import describe_calibration
    print(describe_calibration(world))
    print(f"\nGPT {CONFIG.layers} layers, hidden {CONFIG.hidden}, seq {SEQ}, vocab {CONFIG.vocab_size}, "
          f"global batch {GLOBAL_BATCH}, fp32, {RANKS} gloo ranks on {os.cpu_count()} cores")
    predicted, measured, causes, repriced, picks, spread, drift = {}, {}, {}, {}, {}, {}, {}
    at_once = {}  # every mesh's prediction on the first calibration: the order is checked on these
    for name, pins in MESHES.items():
        if args.only and name not in args.only:
            continue
        plan = _plan(world, pins)
        at_once[name] = plan.predicted.step_seconds
        mesh_world = world
        if args.calibrate_each and not args.predict_only:
            mesh_world = calibrate(RANKS)
            plan = _plan(mesh_world, pins)
            print(f"{name:24s} first calibration's prediction {at_once[name] * 1e3:8.1f} ms; calibrated again:")
        predicted[name] = plan.predicted.step_seconds
        causes[name] = dict(plan.predicted.breakdown)
        if args.predict_only:
            parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in causes[name].items() if v)
            print(f"{name:24s} predicted {predicted[name] * 1e3:8.1f} ms  ({parts} ms)", flush=True)
            continue
        drift[name] = host_drift(mesh_world) if not args.no_drift else None
        measured[name], costs, cpu, spread[name] = measure(plan, mesh_world, args.steps, args.warmup)
        report = xirang.reprice(plan, costs, model=build_gpt(CONFIG), example_kwargs=token_batch(2))
        repriced[name], picks[name] = report.repriced_current, report.best if report.another_wins else "itself"
        parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in causes[name].items() if v)
        print(f"{name:24s} predicted {predicted[name] * 1e3:8.1f} ms  measured {measured[name] * 1e3:8.1f} ms  "
              f"ratio {predicted[name] / measured[name]:5.2f}  re-priced {repriced[name] * 1e3:8.1f} ms "
              f"(ratio {repriced[name] / measured[name]:5.2f}; picks {picks[name]})   ({parts} ms)", flush=True)
        if drift[name] is not None:
            print(f"  host just before: the calibration's training workload x{drift[name]['alone']:.2f} its "
                  f"calibrated time alone, x{drift[name]['together_cpu']:.2f} its CPU with every rank busy; "
                  f"predicted x that / measured {predicted[name] * drift[name]['together_cpu'] / measured[name]:.2f}",
                  flush=True)
        if args.split_comm:
            print(split_comm_line(plan, mesh_world, args, measured[name], causes[name]), flush=True)
        if args.details:
            cores = mesh_world.calibration.parallel_ranks or RANKS
            print(f"  CPU seconds per step summed over ranks {cpu:.3f}: {cpu / measured[name]:.2f} cores busy "
                  f"on average (the calibration: {cores:.2f} of {os.cpu_count()} cores at full speed)")
            print(report, flush=True)
    if args.predict_only:
        print(f"predicted order: {_order(predicted)}")
        return 0
    worst = max(abs(predicted[n] / measured[n] - 1) for n in predicted)
    print(f"\nworst |predicted/measured - 1|: {worst:.1%}")
    print(f"worst |re-priced/measured - 1|: {max(abs(repriced[n] / measured[n] - 1) for n in repriced):.1%}")
    drifted = {n: predicted[n] * drift[n]["together_cpu"] / measured[n] for n in measured if drift.get(n)}
    if drifted:
        cpu_drift = [drift[n]["together_cpu"] for n in drifted]
        print(f"worst |predicted x host drift/measured - 1| (a diagnostic, not the check): "
              f"{max(abs(r - 1) for r in drifted.values()):.1%}; host drift over the meshes "
              f"x{min(cpu_drift):.2f}-x{max(cpu_drift):.2f}")
    if args.calibrate_each:
        once = max(abs(at_once[n] / measured[n] - 1) for n in measured)
        print(f"worst |first calibration's prediction/measured - 1|: {once:.1%}")
    print(f"predicted order: {_order(at_once)}")
    print(f"measured order:  {_order(measured)}")
    print(f"ranking matches: {_order(at_once) == _order(measured)}")
    ties = noise_ties(measured, spread)
    close = ", ".join(f"{a} / {b} ({measured[a] * 1e3:.0f} vs {measured[b] * 1e3:.0f} ms)" for a, b in ties)
    print(f"measured within each other's step-to-step spread: {close or 'none'}")
    print(f"ranking matches apart from those: {order_matches_up_to_ties(at_once, measured, ties)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
