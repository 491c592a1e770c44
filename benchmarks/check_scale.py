"""The full-scale check of the planner's own plans for the large setups: time per phase and peak RSS.

    python benchmarks/check_scale.py [--models llama2_70b gpt3_175b_hf llama3_405b qwen3_moe_30b_a3b] \
                                     [--pin tp=8 pp=16 ...] [--json OUT]

Each model is built on meta (examples/catalog.py), planned for its world (the setups of
benchmarks/plan_speed.py, and Qwen3-30B-A3B on 4x8 H100 as its Megatron-Bridge row runs), then
``xirang.check`` runs every class of ranks on fake tensors and proves the plan; printed: the plan, the
check's report (measured vs predicted memory per pipeline rank, violations), seconds per phase, the CPU
seconds of this process and its workers (on a shared machine the wall time is those over the cores its
load leaves) and the peak RSS of this process and of its largest worker.
``--pin KEY=VALUE`` pins
a choice (a published configuration: ``--pin tp=8 pp=16 micro_batch=1``) instead of the planner's;
``--json OUT`` writes every memory row, each with the check's seconds per phase (``phases``: trace, the
classes' wall time, lowering and running summed over the classes, each proof) and the peak RSS figures.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ is a folder of the repository

GIB = 1024 ** 3
SETUPS = {  # factory in examples/catalog.py, world, device, global batch (as benchmarks/plan_speed.py)
    "llama2_70b": ("128x8", "a100-80g", 1024),
    "gpt3_175b_hf": ("128x8", "a100-80g", 1536),
    "llama3_405b": ("2048x8", "h100-80g", 2048),
    "qwen3_moe_30b_a3b": ("4x8", "h100-80g", 256),  # an MoE (ep) plan, bf16 with fp32 islands (router, norms, loss)
}


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and its finished workers (a worker counts once it is reaped)."""
    here, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return here.ru_utime + here.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--pin", nargs="*", default=[], metavar="KEY=VALUE", help="plan pins, e.g. tp=8 pp=16")
    parser.add_argument("--json", metavar="OUT", help="write the memory rows as JSON")
    args = parser.parse_args()
    pins = {key: (int(value) if value.isdigit() else value) for key, value in (p.split("=", 1) for p in args.pin)}
    rows = []
    import xirang
    from examples import catalog
    for name in args.models:
        world, device, global_batch = SETUPS[name]
        started = time.perf_counter()
        model, example = getattr(catalog, name)()
        report = xirang.analyze(model, example_kwargs=example)
        plan = xirang.plan(model, world=world, hardware=device, example_kwargs=example, global_batch=global_batch,
                           analysed=report, **pins)
        planned = time.perf_counter() - started
        print(f"== {name}: {plan.mesh}, {plan.schedule}, micro-batch {plan.micro_batch} x {plan.num_micro_batches}, "
              f"recompute {plan.recompute}, zero {plan.zero_stage}; planned in {planned:.1f} s", flush=True)
        started, cpu_before = time.perf_counter(), _cpu_seconds()
        checked = xirang.check(plan, model, example_kwargs=example, analysed=report)
        seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_before
        print(checked.explain())
        rss = {"rss_gib_here": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
               "rss_gib_largest_worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20}
        print("per pipeline rank, GiB: part predicted / dry run")
        for row in checked.memory_rows():
            predicted = plan.predicted.memory_parts[row["pp_rank"]] if plan.predicted.memory_parts else {}
            parts = sorted(set(predicted) | set(row["parts"]))
            print(f"  pp {row['pp_rank']}: total {row['predicted_bytes'] / GIB:.2f} / {row['peak_bytes'] / GIB:.2f}; "
                  + ", ".join(f"{part} {predicted.get(part, 0) / GIB:.2f} / {row['parts'].get(part, 0) / GIB:.2f}"
                              for part in parts))
            rows.append({"model": name, "pins": pins, "mesh": str(plan.mesh), "schedule": plan.schedule,
                         "micro_batch": plan.micro_batch, "recompute": plan.recompute, "zero": plan.zero_stage,
                         **row, "predicted_parts": dict(predicted), "check_seconds": seconds, "ok": checked.ok,
                         "phases": dict(checked.seconds), "classes": len(checked.classes), "check_cpu_seconds": cpu,
                         **rss})
        print(f"check {seconds:.1f} s ({cpu:.1f} CPU s here and in the workers: the wall time over the cores this "
              f"machine's load leaves), peak RSS {rss['rss_gib_here']:.2f} GiB here, "
              f"{rss['rss_gib_largest_worker']:.2f} GiB in the largest worker\n", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2, default=str)


if __name__ == "__main__":
    main()
