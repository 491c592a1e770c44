"""Measured pipeline bubble of the executor beside the schedule simulator's: 1F1B, ZB-H1 and ZB-H2 side
by side on CPU ranks.

    python benchmarks/pipeline_idle.py [--p 4] [--m 8] [--steps 3] [--hidden 256] [--schedules 1f1b,zb-h1,zb-h2]
                                       [--world-file world.json]

Runs a GPT (examples/gpt.py) of p blocks under a (dp=1, pp=p) plan per schedule, m micro-batches, on
p local gloo ranks, all schedules in one launch: each step runs every schedule once, in turn, so a
change of load on the machine falls on all of them alike. Each step's compute timestamps (start
taken once a compute's inputs have arrived, so waiting is idle) are read with
``schedule_sim.idle_fractions``. Printed beside them: the simulated idle fraction on equal stages
with T_F = T_B = T_W (1F1B's fused backward = 2 T_F: (p - 1)/(m + p - 1) = 3/11 for p = 4, m = 8;
ZB-H1 and ZB-H2 (p - 1)/(3m + p - 1) = 1/9), and the simulation fed with the measured mean forward,
backward (or B and W) times of each stage, which accounts for unequal stages and for what the
split costs on this runtime. The step window (first compute start to last end) is printed too:
a lower idle fraction is only a faster step if the split backward costs no more than the fused one.
With 1f1b in the run, the last column is that cost: each split schedule's B + W over 1F1B's fused
backward, summed over the stages that send an input gradient (stage 0's B does nothing and its W is
the whole backward), for ``Calibration.split_backward_extra`` (the planner's price of it) to be
checked against. ``--world-file`` plans on a World ``xirang calibrate --world p`` wrote (else the
"cpu" preset) and prints each schedule's predicted step beside its measured window.

Caveat: the ranks share this machine's cores (``launch`` gives each cores // p threads); with fewer
cores than ranks they also compete for them, which stretches computes that overlap in time, and
other work on the machine adds noise: figures from a loaded machine are indicative only.
"""
from __future__ import annotations

import argparse
import sys
from fractions import Fraction
from pathlib import Path
from statistics import mean

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ is a folder of the repository


def _rank_main(rank, world, configs, state, global_batch, seq, steps):
    from xirang.codegen.runtime.compiled_model import CompiledModel
    runtimes = {}
    for label, plan, program in configs:
        runtime = CompiledModel(state, plan, program)
        runtimes[label] = (runtime, torch.optim.SGD(runtime.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 500, (global_batch, seq), generator=generator),
             "labels": torch.randint(0, 500, (global_batch, seq), generator=generator)}
    timelines = {label: [] for label in runtimes}
    for _ in range(steps + 1):  # the first step warms up allocators and gloo connections
        for label, (runtime, optimizer) in runtimes.items():  # schedules in turn, every step
            runtime.train_step(**batch)
            optimizer.step()
            optimizer.zero_grad()
            timelines[label].append(runtime.gather_timestamps())
    return {label: records[1:] for label, records in timelines.items()}


def _stage_means(records, kind, p: int) -> list:
    """Mean seconds of the actions of type ``kind`` per stage (0 where a stage ran none)."""
    return [mean([e - s for r, a, s, e in records if isinstance(a, kind) and a.stage == st] or [0.0])
            for st in range(p)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--schedules", default="1f1b,zb-h1,zb-h2")
    parser.add_argument("--world-file", help="plan on this calibrated World (p ranks) and print its predictions")
    args = parser.parse_args()
    import xirang
    from examples.gpt import GPTConfig, build_gpt
    from xirang.codegen.runtime.launch.launcher import launch
    from xirang.lower import lower
    from xirang.codegen.runtime.executor.schedule_sim import idle_fractions, simulated_bubble
    from xirang.ir.schedules import Backward, BackwardInput, BackwardWeight, Forward, build_schedule
    from xirang.ir.world import World

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, seq_len=args.seq, hidden=args.hidden, heads=4, layers=args.p)
    model = build_gpt(config, device="cpu")
    example = {"input_ids": torch.zeros(2, args.seq, dtype=torch.long),
               "labels": torch.zeros(2, args.seq, dtype=torch.long)}
    global_batch = args.m * args.micro_batch
    graph = xirang.analyze(model, example_kwargs=example).graph_module
    configs, predicted = [], {}
    world = dict(world=World.load(args.world_file)) if args.world_file else dict(world=args.p, hardware="cpu")
    for name in args.schedules.split(","):
        plan = xirang.plan(model, example_kwargs=example, global_batch=global_batch, **world,
                           dp=1, pp=args.p, tp=1, schedule=name, micro_batch=args.micro_batch)
        predicted[name] = plan.predicted.step_seconds
        # every rank's program is the same at tp = 1: lowered once here and sent to the ranks
        configs.append((name, plan, lower(graph, plan, rank=0).program))
    state = {fqn: t.detach() for fqn, t in model.state_dict(keep_vars=True).items()}
    print(f"GPT hidden {args.hidden}, seq {args.seq}, {args.p} blocks; p={args.p} m={args.m}, micro-batch "
          f"{args.micro_batch}; stages: {[list(s.units) for s in configs[0][1].stages]}")

    timelines = launch(_rank_main, args.p, (configs, state, global_batch, args.seq, args.steps),
                       timeout_s=1800)[0]
    summary = []
    for name, _, _ in configs:
        schedule = build_schedule(name, args.p, args.m)
        ideal = simulated_bubble(schedule, forward=1, backward=2)  # T_F = T_B = T_W; fused backward 2 T_F
        print(f"\n{name}: simulated, equal stages, F = B = W: overall {ideal.overall} = {float(ideal.overall):.3f}")
        idles, windows, backwards = [], [], []
        for step, records in enumerate(timelines[name]):
            measured = idle_fractions(records, pipeline_ranks=args.p)
            forward = _stage_means(records, Forward, args.p)
            if any(isinstance(a, BackwardInput) for _, a, _, _ in records):
                b, w = _stage_means(records, BackwardInput, args.p), _stage_means(records, BackwardWeight, args.p)
                fitted = simulated_bubble(schedule, forward=forward, backward_input=b, backward_weight=w)
                backwards.append(sum(b[1:]) + sum(w[1:]))
                times = ", ".join(f"{f * 1e3:.1f}/{x * 1e3:.1f}/{y * 1e3:.1f}" for f, x, y in zip(forward, b, w))
                shown = "F/B/W"
            else:
                backward = _stage_means(records, Backward, args.p)
                fitted = simulated_bubble(schedule, forward=forward, backward=backward)
                backwards.append(sum(backward[1:]))
                times = ", ".join(f"{f * 1e3:.1f}/{x * 1e3:.1f}" for f, x in zip(forward, backward))
                shown = "F/B"
            idles.append(measured.overall)
            windows.append(measured.window)
            print(f"  step {step}: window {measured.window * 1e3:.1f} ms; measured idle overall "
                  f"{measured.overall:.3f}, per rank " + ", ".join(f"{x:.3f}" for x in measured.per_rank))
            print(f"          simulated with the measured stage times: overall {fitted.overall:.3f}; mean {shown} ms "
                  f"per stage {times}")
        summary.append((name, ideal.overall, mean(idles), mean(windows), mean(backwards)))
    fused = next((backward for name, _, _, _, backward in summary if name == "1f1b"), None)
    print("\nschedule  simulated idle (F=B=W)  measured idle (mean)  step window ms (mean)  backward / 1f1b's  "
          "predicted step ms")
    for name, ideal, idle, window, backward in summary:
        ratio = f"{backward / fused:.2f}" if fused else "-"
        print(f"{name:8}  {str(Fraction(ideal)):>6} = {float(ideal):.3f}         {idle:.3f}                 "
              f"{window * 1e3:.1f}                  {ratio}               {predicted[name] * 1e3:.1f}")


if __name__ == "__main__":
    main()
