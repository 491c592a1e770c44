"""Plan Llama-2-70B and GPT-3 175B for 128 nodes x 8 A100-80GB end to end: wall time by step, and the plan.

    python benchmarks/plan_speed.py [--models llama2_70b gpt_175b] [--world 128x8] [--device a100-80g]

Each model is built on the meta device (nothing is allocated), then ``xirang.plan`` traces and analyses it,
solves the tensor split for every (tp, micro-batch) the candidates need, searches the degrees and
assembles the Plan. The step times come from ``plan(progress=...)``; "total" is the wall time of the call.
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

SETUPS = {  # factory in examples/catalog.py, sequence length, global batch
    "llama2_70b": (4096, 1024),
    "gpt_175b": (2048, 1536),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--world", default="128x8")
    parser.add_argument("--device", default="a100-80g")
    parser.add_argument("--explain", action="store_true", help="print plan.explain() for each model")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import xirang
    from examples import catalog

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, python {platform.python_version()}")
    for name in args.models:
        seq, global_batch = SETUPS[name]
        model, example_kwargs = getattr(catalog, name)(batch=1, seq=seq)
        steps = {}
        start = time.perf_counter()
        plan = xirang.plan(model, world=args.world, device=args.device, example_kwargs=example_kwargs,
                           global_batch=global_batch,
                           progress=lambda event, steps=steps: steps.__setitem__(event.stage, event))
        total = time.perf_counter() - start
        print(f"\n{name}: seq {seq}, global batch {global_batch}, world {args.world} {args.device}")
        print(f"  wall {total:.2f} s = trace+analyse {steps['analyse'].seconds:.2f} s + split ILP "
              f"{steps['splits'].seconds:.2f} s + search {steps['search'].seconds:.2f} s + assemble "
              f"{steps['assemble'].seconds:.2f} s")
        for event in steps.values():
            print(f"    {event.message}")
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
