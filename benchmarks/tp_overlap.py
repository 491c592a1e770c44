"""Sequence-parallel tp collectives overlapped with their linears (``Plan.tp_overlap``) on CPU ranks:
step time and CPU seconds with overlap off and on, in one launch.

    python benchmarks/tp_overlap.py [--tp 4] [--steps 6] [--seq 256] [--hidden 256] [--chunks 2 4]

A GPT (examples/gpt.py, 4 layers) is planned for (1, tp, 1) on CPU devices at seq 4096 with
sequence parallelism, so the split ILP takes Megatron's sequence shards (all-gather before the
column-parallel linears, reduce-scatter after the row-parallel ones); the planner itself leaves
``tp_overlap`` off there (CPU worlds: gloo's threads share the cores the ranks compute on). The same
plan then runs at ``--seq`` with ``tp_overlap`` 0 and each of ``--chunks`` on tp local gloo ranks.
Per mode: the median over the steps after the first of rank 0's wall seconds per step (train_step +
AdamW step) and the mean over ranks of CPU seconds per step (``time.process_time``, every thread of
the rank: gloo's included), the tp bytes per step and calls by kind, and the largest loss difference
to overlap off (fp32). The load average is printed before and after: on a machine with fewer cores
than ranks (plus gloo's threads) a collective in flight competes with the matmul for the same cores,
so CPU ranks cannot show what overlap does on GPUs, where the collective runs on the interconnect.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ is a folder of the repository

VOCAB, LAYERS, GLOBAL_BATCH = 512, 4, 4


def build(seq: int, hidden: int):
    from examples.gpt import GPTConfig, build_gpt
    torch.manual_seed(0)
    return build_gpt(GPTConfig(vocab_size=VOCAB, seq_len=seq, hidden=hidden, heads=4, layers=LAYERS))


def batch(step: int, size: int, seq: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB, (size, seq), generator=generator),
            "labels": torch.randint(0, VOCAB, (size, seq), generator=generator)}


def rank_main(rank, world, plans, seq, hidden, steps):
    import xirang
    from xirang.codegen.ops.comm_counter import CommCounter
    from xirang.codegen.runtime.compiled_model import CompiledModel
    from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
    from xirang.lower import lower
    gm = xirang.analyze(build(seq, hidden), example_kwargs=batch(0, 2, seq)).graph_module
    results = {}
    for chunks, plan in plans:
        counter = CommCounter()
        compiled = CompiledModel(build(seq, hidden), plan, lower(gm, plan, rank=rank).program,
                                 groups=build_mesh_groups(plan.mesh), counter=counter)
        optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
        walls, cpus, losses = [], [], []
        for step in range(steps):
            counter.reset()
            wall, cpu = time.perf_counter(), time.process_time()
            loss = compiled.train_step(**batch(step, GLOBAL_BATCH, seq))
            optimizer.step()
            optimizer.zero_grad()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            losses.append(loss.item())
        nbytes, calls = Counter(), Counter()
        for record in counter.records:
            if not record.label.startswith(("bucket:", "tied:")):
                nbytes[record.kind] += record.nbytes
                calls[record.kind] += 1
        results[chunks] = {"wall": walls[1:], "cpu": cpus[1:], "losses": losses, "bytes": dict(nbytes),
                           "calls": dict(calls)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    import xirang
    from xirang.codegen.runtime.launch.launcher import launch
    from xirang.passes.planning.tp_overlap_cost import fused_pairs

    model = build(args.seq, args.hidden)
    report = xirang.analyze(model, example_kwargs=batch(0, 2, args.seq))
    plan = xirang.plan(model, world=args.tp, example_kwargs=batch(0, 2, args.seq), global_batch=GLOBAL_BATCH,
                       seq=4096, hardware="cpu", precision="fp32", dp=1, tp=args.tp, pp=1, micro_batch=1,
                       sequence_parallel=True, analysed=report)
    pairs = fused_pairs(report.graph_module, plan, 4096)
    print(f"GPT {LAYERS} layers hidden {args.hidden}, (1, {args.tp}, 1) planned at seq 4096 on cpu, run at seq "
          f"{args.seq}, {GLOBAL_BATCH} micro-batches of 1; the planner chose tp_overlap={plan.tp_overlap}; "
          f"{len(pairs)} (linear, collective) pairs to fuse")
    plans = [(0, plan)] + [(c, dataclasses.replace(plan, tp_overlap=c)) for c in args.chunks]
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average before {os.getloadavg()}")
    results = launch(rank_main, args.tp, (plans, args.seq, args.hidden, args.steps), timeout_s=1800,
                     heartbeat_s=120)
    print(f"load average after {os.getloadavg()}")
    base = results[0][0]["losses"]
    for chunks, _ in plans:
        wall = statistics.median(results[0][chunks]["wall"])
        cpu = statistics.mean(statistics.mean(r[chunks]["cpu"]) for r in results)
        loss = max(abs(a - b) for a, b in zip(results[0][chunks]["losses"], base))
        print(f"tp_overlap={chunks}: step {wall * 1e3:8.1f} ms wall (median, rank 0), {cpu * 1e3:8.1f} ms CPU "
              f"per rank; tp bytes/step {results[0][chunks]['bytes']}, calls {results[0][chunks]['calls']}; "
              f"max |loss - off| {loss:.1e}")


if __name__ == "__main__":
    main()
