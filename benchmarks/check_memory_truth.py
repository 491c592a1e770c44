"""The dry run's peak memory per rank against torch's own memory profiler on real CPU ranks.

    python benchmarks/check_memory_truth.py [--plans 3d-1f1b dp-zero1 ...] [--json OUT]

For each plan of tests/check/test_check_ground_truth.py (the in-repo GPT tiny on 8 ranks, planned on meta
at seq 4096, run at seq 16), ``xirang.check`` runs every class of ranks on fake tensors, and 8 real gloo
ranks run the same step (after AdamW's first) under ``torch.profiler.profile(profile_memory=True)``; the
real peak is the most bytes live at once in the profiler's memory timeline (``MemoryProfileTimeline``,
what ``export_memory_timeline`` draws), an instrument independent of the dry run's recorder. Printed per
rank: dry-run peak, profiled peak, their ratio, and both breakdowns.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ and tests/ are folders of the repository

import torch  # noqa: E402

import xirang  # noqa: E402
from examples.gpt import build_gpt  # noqa: E402
from tests.check.test_check_ground_truth import PLANS, batch_of, plan_for  # noqa: E402
from xirang.codegen.runtime.launch.launcher import launch  # noqa: E402


def _profiled_rank(rank, world, plan):
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline
    torch.manual_seed(0)
    compiled = xirang.compile(build_gpt("tiny"), world=8, example_kwargs=batch_of(), plan=plan)
    optimizer = torch.optim.AdamW(compiled.parameters())
    start = sum(compiled.dp_shares[:compiled.dp_rank])
    share = {name: value[start:start + compiled.dp_shares[compiled.dp_rank]] for name, value in batch_of().items()}
    compiled.train_step(**share, pre_sharded=True)  # AdamW's state exists from the first step on, as in the dry run
    optimizer.step()
    optimizer.zero_grad()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        compiled.train_step(**share, pre_sharded=True)
        optimizer.step()
        optimizer.zero_grad()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    return max(sum(row) for row in sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--json", metavar="OUT", help="write the rows as JSON")
    args = parser.parse_args()
    rows = []
    for name in args.plans:
        plan = plan_for(PLANS[name])
        report = xirang.check(plan, build_gpt("tiny", device="meta"), example_kwargs=batch_of("meta"))
        try:
            profiled = launch(_profiled_rank, 8, (plan,), timeout_s=900, heartbeat_s=120)
        except xirang.XirangError as error:  # torch's profiler, not the step: e.g. ZeRO-3's freed storages
            print(f"{name:22s} the profiler failed: {str(error).splitlines()[0]}", flush=True)
            rows.append({"plan": name, "profiler_failed": str(error)})
            continue
        for klass in report.classes:
            for member in klass.members:
                dry = klass.log.memory.peak
                rows.append({"plan": name, "rank": member, "dry_run_bytes": dry, "profiled_bytes": profiled[member],
                             "ratio": dry / profiled[member], "parts": dict(klass.log.memory.parts)})
                print(f"{name:22s} rank {member}: dry run {dry / 1024:8.1f} KiB, profiled "
                      f"{profiled[member] / 1024:8.1f} KiB, ratio {dry / profiled[member]:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
