"""Data-parallel scaling of GPT-3 175B as the cost model prices it: tp 8 and pp 8 fixed, dp from 1 to 64,
so the world grows from 64 to 4,096 devices (8 per node, the links of the device's node), the global
batch fixed (1536 sequences of 2048, GPT-3's batch, as in Narayanan et al. 2021 sec. 5.2).

Each row is the pinned configuration priced by xirang.plan: the step time and its terms (compute,
tensor-parallel collectives, pipeline bubble, pipeline sends, the data-parallel gradient all-reduce
left exposed after the last backward), TFLOP/s per device (hardware FLOPs, the recomputed forward
included), and, for reference, what the gradient all-reduce of one pipeline rank would take if
none of it overlapped the backward (all its bytes at once on the dp group, cheapest algorithm).

    python benchmarks/dp_scaling.py [--device a100-80g] [--dp 1,2,4,8,16,32,64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import xirang  # noqa: E402
from examples.catalog import gpt_175b  # noqa: E402
from xirang.ir.world import World  # noqa: E402
from xirang.passes.planning.cost_collectives import collective_cost  # noqa: E402

TP, PP, GLOBAL_BATCH, SEQ, GPUS_PER_NODE = 8, 8, 1536, 2048, 8
TERMS = ("compute", "tp_comm", "pp_bubble", "pp_p2p", "dp_exposed", "offload", "step_sync")


def price(dp: int, report, device: str, *, recompute: str = "full") -> dict:
    model, tokens = gpt_175b(batch=2)
    world = World.uniform(TP * PP * dp // GPUS_PER_NODE, GPUS_PER_NODE, device)
    plan = xirang.plan(model, world=world, example_kwargs=tokens, analysed=report, global_batch=GLOBAL_BATCH,
                       seq=SEQ, tp=TP, pp=PP, dp=dp, micro_batch=1, schedule="interleaved", recompute=recompute)
    # one pipeline rank's gradients (bf16, its share of the parameters), all-reduced at once on its dp group
    grad_bytes = 2 * report.total_params / (TP * PP)
    whole = collective_cost("all_reduce", grad_bytes, plan.mesh.group("dp", 0), world)
    return {"dp": dp, "gpus": world.size, "world": world.describe(), "micro_batches": GLOBAL_BATCH // dp,
            "virtual_stages": plan.virtual_stages, "step_s": plan.predicted.step_seconds,
            "terms_s": {term: plan.predicted.breakdown.get(term, 0.0) for term in TERMS},
            "tflops_per_device": plan.predicted.tflops_per_device,
            "dp_all_reduce_unoverlapped_s": whole.seconds, "dp_all_reduce_algorithm": whole.algorithm}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="a100-80g")
    parser.add_argument("--dp", default="1,2,4,8,16,32,64", help="comma-separated dp degrees")
    parser.add_argument("--json", help="write the rows to this file")
    options = parser.parse_args(argv)
    model, tokens = gpt_175b(batch=2)
    report = xirang.analyze(model, example_kwargs=tokens)
    print(f"GPT-3 175B ({report.total_params / 1e9:.1f}B parameters), tp {TP}, pp {PP}, micro-batch 1, interleaved, "
          f"full recompute, global batch {GLOBAL_BATCH} x {SEQ}, {options.device}; seconds per step")
    header = (f"{'dp':>3} {'gpus':>5} {'m':>5} {'v':>2} | {'step':>7} | {'compute':>7} {'tp':>6} {'bubble':>6} "
              f"{'p2p':>6} {'dp exp':>6} | {'TFLOP/s':>7} | {'dp AR whole':>11}")
    print(header)
    print("-" * len(header))
    rows = []
    for dp in (int(d) for d in options.dp.split(",")):
        row = price(dp, report, options.device)
        t = row["terms_s"]
        print(f"{dp:>3} {row['gpus']:>5} {row['micro_batches']:>5} {row['virtual_stages']:>2} | "
              f"{row['step_s']:>7.2f} | "
              f"{t['compute']:>7.2f} {t['tp_comm']:>6.2f} {t['pp_bubble']:>6.2f} {t['pp_p2p']:>6.2f} "
              f"{t['dp_exposed']:>6.3f} | {row['tflops_per_device']:>7.1f} | "
              f"{row['dp_all_reduce_unoverlapped_s']:>7.3f} {row['dp_all_reduce_algorithm'][:4]}", flush=True)
        rows.append(row)
    if options.json:
        Path(options.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
