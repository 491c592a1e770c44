"""Fit the cost model's efficiency terms to the published runs, and say how well they hold out.

The roofline prices matmuls at ``Efficiency.matmul`` of the datasheet peak and memory-bound ops at
``Efficiency.memory`` of the datasheet bandwidth (passes/planning/cost_model.py ``compute_time``). The
fractions are a device's (ir/device.py: ``DeviceSpec.efficiency``, one per preset and generation); this
script fits the A100 preset's, what a calibration would measure; with no A100 here, to the five rows of
benchmarks/published_configs.json: each row's published configuration is priced (pinned, as
in benchmarks/published_configs.py) on a grid of (matmul, memory) and the pair with the smallest
worst-case |log(predicted / published TFLOP/s)| wins. Leave-one-out: each row is also predicted with
the pair fitted to the other four, which is the honest figure for a configuration not in the table.
benchmarks/published_runs.py then prices runs none of these five rows is (other sizes, other papers,
H100s) with the presets as they are.

    python benchmarks/fit_efficiency.py
"""
from __future__ import annotations

import itertools
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import xirang  # noqa: E402
from published_configs import GPUS_PER_NODE, DEVICE, SEQ, load_rows, model_of  # noqa: E402
from xirang.ir.world import World  # noqa: E402
from xirang.ir.device import Efficiency  # noqa: E402
from xirang.passes.planning.plan_search import search_plan  # noqa: E402
from xirang.passes.planning.plan_splits import SplitPricer  # noqa: E402

MATMUL = [0.50, 0.55, 0.60, 0.65, 0.70, 0.75, 0.80, 0.85]
MEMORY = [0.25, 0.30, 0.35, 0.40, 0.50, 0.60, 0.70, 0.80, 0.90]


def priced_tflops(gm, row: dict, efficiency: Efficiency) -> float:
    world = World.uniform(row["gpus"] // GPUS_PER_NODE, GPUS_PER_NODE, DEVICE)
    pricer = SplitPricer(gm, world, efficiency=efficiency, precision="bf16")
    result = search_plan(pricer.price, world, global_batch=row["global_batch"], seq=SEQ, precision="bf16",
                         tp=row["tp"], pp=row["pp"], micro_batch=row["micro_batch"],
                         schedule="interleaved" if row["pp"] > 1 else "1f1b", recompute="full")
    return result.best.tflops_per_device


def best_pair(errors: dict, rows: list[int]) -> tuple:
    """The grid point whose worst |log error| over ``rows`` is smallest."""
    return min(errors, key=lambda pair: max(abs(errors[pair][i]) for i in rows))


def main() -> int:
    rows = load_rows()
    started = time.perf_counter()
    graphs = []
    for row in rows:
        model, tokens = model_of(row)
        graphs.append(xirang.analyze(model, example_kwargs=tokens).graph_module)
    errors = {}
    for matmul, memory in itertools.product(MATMUL, MEMORY):
        efficiency = Efficiency(matmul=matmul, memory=memory)
        errors[(matmul, memory)] = [math.log(priced_tflops(gm, row, efficiency) / row["tflops_per_gpu"])
                                    for gm, row in zip(graphs, rows)]
    everyone = list(range(len(rows)))
    fitted = best_pair(errors, everyone)
    print(f"grid matmul {MATMUL} x memory {MEMORY}; {time.perf_counter() - started:.0f} s")
    print(f"fitted on all rows: Efficiency(matmul={fitted[0]}, memory={fitted[1]})")
    print(f"{'row':>4} {'params':>7} {'paper':>6} {'fit all':>8} {'leave-one-out':>14} {'(pair)':>12}")
    for i, row in enumerate(rows):
        held_out = best_pair(errors, [j for j in everyone if j != i])
        print(f"{i:>4} {row['params_billion']:>6}B {row['tflops_per_gpu']:>6} "
              f"{math.expm1(errors[fitted][i]):>+8.1%} {math.expm1(errors[held_out][i]):>+14.1%} "
              f"{str(held_out):>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
