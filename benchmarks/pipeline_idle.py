"""Measured pipeline bubble of the executor beside the schedule simulator's, for 1F1B on CPU ranks.

    python benchmarks/pipeline_idle.py [--p 4] [--m 8] [--steps 3] [--hidden 256]

Runs a GPT (examples/gpt.py) of p blocks under a (dp=1, pp=p) plan with the 1F1B schedule and m
micro-batches on p local gloo ranks, and reads each step's compute timestamps (start taken once a
compute's inputs have arrived, so waiting is idle) with ``schedule_sim.idle_fractions``. Printed
beside them: the simulated idle fraction at forward : backward = 1 : 2 on equal stages
((p - 1) / (m + p - 1) = 3/11 for p = 4, m = 8), and the simulation fed with the measured mean
forward and backward time of each stage, which accounts for unequal stages.

Caveat: the ranks share this machine's cores (``launch`` gives each cores // p threads); with fewer
cores than ranks they also compete for them, which stretches computes that overlap in time.
"""
from __future__ import annotations

import argparse
import sys
from fractions import Fraction
from pathlib import Path
from statistics import mean

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ is a folder of the repository


def _rank_main(rank, world, plan, program, state, global_batch, seq, steps):
    from xirang.codegen.runtime.compiled_model import CompiledModel
    runtime = CompiledModel(state, plan, program)
    optimizer = torch.optim.SGD(runtime.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 500, (global_batch, seq), generator=generator),
             "labels": torch.randint(0, 500, (global_batch, seq), generator=generator)}
    timelines = []
    for _ in range(steps + 1):  # the first step warms up allocators and gloo connections
        runtime.train_step(**batch)
        optimizer.step()
        optimizer.zero_grad()
        timelines.append(runtime.gather_timestamps())
    return timelines[1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    import xirang
    from examples.gpt import GPTConfig, build_gpt
    from xirang.codegen.runtime.launch import launch
    from xirang.lower import lower
    from xirang.codegen.runtime.schedule_sim import idle_fractions, simulated_bubble
    from xirang.ir.schedules import Forward, one_f_one_b

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, seq_len=args.seq, hidden=args.hidden, heads=4, layers=args.p)
    model = build_gpt(config, device="cpu")
    example = {"input_ids": torch.zeros(2, args.seq, dtype=torch.long),
               "labels": torch.zeros(2, args.seq, dtype=torch.long)}
    global_batch = args.m * args.micro_batch
    plan = xirang.plan(model, world=args.p, example_kwargs=example, global_batch=global_batch, device="cpu",
                       dp=1, pp=args.p, tp=1, schedule="1f1b", micro_batch=args.micro_batch)
    # every rank's program is the same at tp = 1: lowered once here and sent to the ranks
    program = lower(xirang.analyze(model, example_kwargs=example).graph_module, plan, rank=0).program
    state = {fqn: t.detach() for fqn, t in model.state_dict(keep_vars=True).items()}
    print(f"GPT hidden {args.hidden}, seq {args.seq}, {args.p} blocks; 1F1B p={args.p} m={args.m}, "
          f"micro-batch {args.micro_batch}; stages: {[list(s.units) for s in plan.stages]}")

    timelines = launch(_rank_main, args.p, (plan, program, state, global_batch, args.seq, args.steps),
                       timeout_s=900)[0]
    schedule = one_f_one_b(args.p, args.m)
    ideal = simulated_bubble(schedule)
    print(f"simulated, equal stages, F:B = 1:2: overall {ideal.overall} = {float(ideal.overall):.3f}; per rank "
          + ", ".join(f"{Fraction(x)}" for x in ideal.per_rank))
    for step, records in enumerate(timelines):
        measured = idle_fractions(records, pipeline_ranks=args.p)
        forward = [mean(e - s for r, a, s, e in records if isinstance(a, Forward) and a.stage == st)
                   for st in range(args.p)]
        backward = [mean(e - s for r, a, s, e in records if not isinstance(a, Forward) and a.stage == st)
                    for st in range(args.p)]
        fitted = simulated_bubble(schedule, forward=forward, backward=backward)
        print(f"step {step}: window {measured.window * 1e3:.1f} ms; measured idle overall "
              f"{measured.overall:.3f}, per stage " + ", ".join(f"{x:.3f}" for x in measured.per_rank))
        print(f"        simulated with the measured stage times: overall {fitted.overall:.3f}, per stage "
              + ", ".join(f"{x:.3f}" for x in fitted.per_rank) + "; mean F/B ms per stage "
              + ", ".join(f"{f * 1e3:.1f}/{b * 1e3:.1f}" for f, b in zip(forward, backward)))


if __name__ == "__main__":
    main()
