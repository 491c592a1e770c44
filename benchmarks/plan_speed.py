"""Plan Llama-2-70B and GPT-3 175B (Hugging Face classes) for 128 nodes x 8 A100-80GB, Llama-3-405B for
2048 x 8 H100-80GB and DeepSeek-V3 (671B, Mixture-of-Experts) for 256 x 8 H100-80GB end to end: wall and CPU
time by step, and the plan.

    python benchmarks/plan_speed.py [--models llama2_70b gpt3_175b_hf llama3_405b gpt_175b deepseek_v3_671b]
                                    [--repeat N]

Each model is built on the meta device (nothing is allocated), then ``xirang.analyze`` traces and
analyses it and ``xirang.plan(..., analysed=report)`` solves the tensor split for every (tp,
micro-batch) the candidates need, searches the degrees and assembles the Plan: the same work as one
``xirang.plan`` call, timed per step. Steps: trace (the ``trace_model`` pass: export of three of each
run of identical layers, stamping, canonical names), analysis (the other analysis passes and their
checks), split ILPs, search, assemble. Wall seconds count waiting on a shared machine, so each step
also shows its CPU seconds (this process and the CBC processes it ran) and each model the load
average (``/proc/loadavg``, 1 minute) before and after. ``--repeat N`` plans each model N times (a
fresh model and trace each time) and shows the run of least total CPU, with every run's totals.
"""
from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ is a folder of the repository

SETUPS = {  # factory in examples/catalog.py: sequence length, global batch, world, device
    "llama2_70b": (4096, 1024, "128x8", "a100-80g"),
    "gpt3_175b_hf": (2048, 1536, "128x8", "a100-80g"),
    "llama3_405b": (8192, 2048, "2048x8", "h100-80g"),
    "gpt_175b": (2048, 1536, "128x8", "a100-80g"),  # the in-repo GPT at GPT-3 175B's shape
    # DeepSeek-V3's shape on 2048 GPUs at its pretraining sequence and final batch (arXiv:2412.19437 sec. 3.1
    # and 4.2: 2048 H800, seq 4096, batch 15360); H100s here, Xirang has no H800 preset
    "deepseek_v3_671b": (4096, 15360, "256x8", "h100-80g"),
}
STEPS = ("trace", "analysis", "splits", "search", "assemble")


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:  # not Linux
        return "?"


def plan_timed(name: str):
    """(plan, {step: (wall, cpu)}, (wall, cpu) of the whole) for one setup."""
    import xirang
    from examples import catalog
    from xirang.passes.planning.plan_search import cpu_seconds

    seq, global_batch, world, device = SETUPS[name]
    model, example_kwargs = getattr(catalog, name)(batch=1, seq=seq)
    events = {}
    start, cpu_start = time.perf_counter(), cpu_seconds()
    report = xirang.analyze(model, example_kwargs=example_kwargs)
    analysed = (time.perf_counter() - start, cpu_seconds() - cpu_start)
    plan = xirang.plan(model, world=world, hardware=device, example_kwargs=example_kwargs, global_batch=global_batch,
                       analysed=report, progress=lambda e: events.__setitem__(e.stage, e) if e.step_done else None)
    total = (time.perf_counter() - start, cpu_seconds() - cpu_start)
    trace = (next(t.seconds for t in report.timings if t.name == "trace_model"), report.trace["cpu_seconds"])
    checks = events["analyse"]  # xirang.plan's checks of the analysed graph
    steps = {"trace": trace,
             "analysis": (analysed[0] - trace[0] + checks.seconds, analysed[1] - trace[1] + checks.cpu_seconds)}
    steps.update({stage: (events[stage].seconds, events[stage].cpu_seconds) for stage in STEPS[2:]})
    return plan, steps, total, events


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--explain", action="store_true", help="print plan.explain() for each model")
    parser.add_argument("--repeat", type=int, default=1, help="plan each model N times; show the least CPU")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, python {platform.python_version()}")
    for name in args.models:
        seq, global_batch, world, device = SETUPS[name]
        load_before = load_average()
        runs = [plan_timed(name) for _ in range(max(args.repeat, 1))]
        plan, steps, total, events = min(runs, key=lambda run: run[2][1])
        print(f"\n{name}: seq {seq}, global batch {global_batch}, world {world} {device}; load average "
              f"{load_before} before, {load_average()} after")
        if len(runs) > 1:
            print(f"  {len(runs)} runs, total wall / CPU s: "
                  + ", ".join(f"{run[2][0]:.2f} / {run[2][1]:.2f}" for run in runs) + "; the least CPU:")
        print(f"  {'step':<10} {'wall s':>8} {'CPU s':>8}")
        for step in STEPS:
            print(f"  {step:<10} {steps[step][0]:>8.2f} {steps[step][1]:>8.2f}")
        print(f"  {'total':<10} {total[0]:>8.2f} {total[1]:>8.2f}")
        for stage in ("splits", "search"):
            print(f"    {events[stage].message}")
        p = plan.predicted
        stages = [len(s.units) for s in plan.stages]
        print(f"  plan: {plan.mesh}, micro-batch {plan.micro_batch} x {plan.num_micro_batches}, {plan.schedule}"
              f"{f' v={plan.virtual_stages}' if plan.schedule == 'interleaved' else ''}, recompute {plan.recompute}, "
              f"units per stage {stages}")
        print(f"  predicted: step {p.step_seconds:.2f} s, {p.tflops_per_device:.1f} TFLOP/s per device, peak memory "
              f"{max(p.memory_bytes_per_device) / 2**30:.1f} GiB; breakdown "
              + ", ".join(f"{k} {v:.2f} s" for k, v in p.breakdown.items()))
        if args.explain:
            print(plan.explain())


if __name__ == "__main__":
    main()
