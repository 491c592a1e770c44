"""One rank alone: does a world-1 calibration price the same GPT as ``calibrated_prediction.py`` at
each micro-batch size? (Separates the compute prices from what ranks sharing cores add.)

1. ``calibrate(1)`` (or ``--world-file`` a World of one rank); training then uses the threads it measured with.
2. For micro-batch 1, 2, 4 and 16 (16 samples per step, so 16, 8, 4 and 1 micro-batches), plan the GPT
   pinned to dp=tp=pp=1 on that World, compile it, train a few steps, and print predicted vs the
   median measured step (wall and this process's CPU seconds).

    python benchmarks/calibrated_world1.py [--world-file world1.json] [--out world1.json] [--steps 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))  # calibrated_prediction: the same model and batches

import xirang  # noqa: E402
from calibrated_prediction import CONFIG, build_gpt, token_batch  # noqa: E402
from xirang.codegen.runtime.calibration.calibrate import calibrate  # noqa: E402
from xirang.ir.world import World  # noqa: E402

SAMPLES = 16


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-file", help="a World JSON of one rank (this script's or `xirang calibrate --world 1`)")
    parser.add_argument("--out", default="world1_calibrated.json")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    if args.world_file:
        world = World.load(args.world_file)
    else:
        world = calibrate(1)
        world.save(args.out)
    torch.set_num_threads(world.calibration.raw["threads_per_rank"])  # train as the calibration measured
    batch = token_batch(SAMPLES)
    for micro_batch in (1, 2, 4, 16):
        plan = xirang.plan(build_gpt(CONFIG), world=world, example_kwargs=token_batch(2), global_batch=SAMPLES,
                           precision="fp32", dp=1, tp=1, pp=1, micro_batch=micro_batch)
        torch.manual_seed(0)
        compiled = xirang.compile(build_gpt(CONFIG), world=world, plan=plan, example_kwargs=token_batch(2))
        walls, cpus = [], []
        for _ in range(2 + args.steps):
            for param in compiled.parameters():
                param.grad = None
            start, cpu = time.perf_counter(), time.process_time()
            compiled.train_step(**batch)
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        wall, cpu = statistics.median(walls[2:]), statistics.median(cpus[2:])
        print(f"micro-batch {micro_batch:2d} ({SAMPLES // micro_batch:2d} micro-batches): predicted "
              f"{plan.predicted.step_seconds * 1e3:7.1f} ms, measured {wall * 1e3:7.1f} ms wall, "
              f"{cpu * 1e3:7.1f} ms CPU, predicted / measured {plan.predicted.step_seconds / wall:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
