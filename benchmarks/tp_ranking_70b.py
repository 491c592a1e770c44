"""The planner's ranking of tensor-parallel degrees for a 70B model on 64 H100s, beside the published engine's.

Issue 40's acceptance check: for Llama 3 70B (80 layers, hidden 8192, 64 heads, 8 kv heads, FFN 28672,
vocab 128256) on 8 DGX H100 nodes (64 GPUs) at seq 8192 and global batch 128, each tp degree is pinned in
``xirang.plan`` and the search chooses the rest (pp, interleaving, micro-batch, recompute, ZeRO, sequence
parallelism); the degrees are ranked by predicted step time.

The published choice: NVIDIA NeMo / Megatron-Bridge performance summary, '25.09 NeMo Container' >
'System: DGX-H100', row LLAMA3_70B: 64 GPUs, GBS 128, MBS 1, seq 8192, TP 4, PP 8, CP 1, VP 5, 1619
tokens/s/GPU, 727 model TFLOP/s/GPU (NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md at
commit 067f987df03b8355b03192d88d70f1709fedf51a). That run is FP8 (Transformer Engine, current scaling:
the 25.11 table's 'FP8-CS' for the same configuration); Xirang prices bf16 (it has no fp8 training
precision), so the published step time is not compared here, only the choice of tp.

    PYTHONPATH=. python benchmarks/tp_ranking_70b.py [--tp 1,2,4,8]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import xirang  # noqa: E402
from benchmarks.published_runs import describe, model_of, world_of  # noqa: E402
from xirang.ir.errors import XirangError  # noqa: E402

PUBLISHED = {"tp": 4, "pp": 8, "virtual_stages": 5, "micro_batch": 1,
             "source": "Megatron-Bridge performance summary 25.09, DGX-H100, LLAMA3_70B (FP8)"}
ROW = {"id": "llama3-70b-h100-64", "device": "h100-80g", "gpus": 64, "seq": 8192, "global_batch": 128,
       "model": {"kind": "llama", "layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672,
                 "vocab": 128256}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="1,2,4,8", help="comma-separated tp degrees to rank")
    options = parser.parse_args(argv)
    model, tokens = model_of(ROW)
    report = xirang.analyze(model, example_kwargs=tokens)
    world = world_of(ROW)
    flops = float(report.flops_at(batch=ROW["global_batch"], seq=ROW["seq"]))
    rows = []
    for tp in (int(t) for t in options.tp.split(",")):
        started = time.process_time()
        try:
            plan = xirang.plan(model, world=world, example_kwargs=tokens, analysed=report,
                               global_batch=ROW["global_batch"], seq=ROW["seq"], tp=tp)
        except XirangError as error:  # a degree with no plan that fits is ranked last, with the reason
            reason = f"no plan: {str(error).splitlines()[0][:90]}"
            rows.append((float("inf"), tp, reason, 0.0, time.process_time() - started))
            continue
        step = plan.predicted.step_seconds
        rows.append((step, tp, describe(plan), flops / step / ROW["gpus"] / 1e12, time.process_time() - started))
    print(f"Llama 3 70B, {ROW['gpus']} x {ROW['device']}, seq {ROW['seq']}, global batch {ROW['global_batch']}, bf16; "
          f"model TFLOP/s per GPU (no recompute counted)")
    print(f"{'rank':>4} {'tp':>3} | {'plan (tp pinned, the rest searched)':<52} | "
          f"{'step s':>7} {'TFLOP/s':>8} | {'CPU s':>6}")
    for place, (step, tp, text, tflops, cpu) in enumerate(sorted(rows), 1):
        print(f"{place:>4} {tp:>3} | {text:<52} | {step:>7.2f} {tflops:>8.1f} | {cpu:>6.1f}")
    best = min(rows)[1]
    print(f"published choice: tp {PUBLISHED['tp']} pp {PUBLISHED['pp']} vp {PUBLISHED['virtual_stages']} "
          f"({PUBLISHED['source']}); planner's best tp: {best}; "
          f"{'same' if best == PUBLISHED['tp'] else 'differs'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
