"""The full-scale check of the planner's own plans for the large setups: time per phase and peak RSS.

    python benchmarks/check_scale.py [--models llama2_70b gpt3_175b_hf llama3_405b]

Each model is built on meta (examples/catalog.py), planned for its world (the setups of
benchmarks/plan_speed.py), then ``xirang.check`` runs every class of ranks on fake tensors and proves the
plan; printed: the plan, the check's report (measured vs predicted memory per pipeline rank, violations),
seconds per phase and this process's peak RSS.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ is a folder of the repository

SETUPS = {  # factory in examples/catalog.py, world, device, global batch (as benchmarks/plan_speed.py)
    "llama2_70b": ("128x8", "a100-80g", 1024),
    "gpt3_175b_hf": ("128x8", "a100-80g", 1536),
    "llama3_405b": ("2048x8", "h100-80g", 2048),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    args = parser.parse_args()
    import xirang
    from examples import catalog
    for name in args.models:
        world, device, global_batch = SETUPS[name]
        started = time.perf_counter()
        model, example = getattr(catalog, name)()
        report = xirang.analyze(model, example_kwargs=example)
        plan = xirang.plan(model, world=world, device=device, example_kwargs=example, global_batch=global_batch,
                           analysed=report)
        planned = time.perf_counter() - started
        print(f"== {name}: {plan.mesh}, {plan.schedule}, micro-batch {plan.micro_batch} x {plan.num_micro_batches}, "
              f"recompute {plan.recompute}, zero {plan.zero_stage}; planned in {planned:.1f} s", flush=True)
        started = time.perf_counter()
        checked = xirang.check(plan, model, example_kwargs=example, analysed=report)
        print(checked.explain())
        print(f"check {time.perf_counter() - started:.1f} s, peak RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB\n", flush=True)


if __name__ == "__main__":
    main()
