"""Dynamic data-parallel rebalancing with one slow rank: throughput with rebalancing off, on, and
with the shares fixed at their end point, in one run, each with its loss against one device.

    python benchmarks/dp_rebalance.py [--dp 4] [--steps 12] [--every 2] [--delay-ms 20]

A GPT (examples/gpt.py, 4 layers, hidden 128) is planned for (dp, 1, 1) and run on dp local gloo
ranks. Rank 0 is made slow on purpose: its stage program sleeps ``--delay-ms`` before every forward
(one per micro-batch), which stands for a slower device (documented as the issue asks: a fixed delay
per forward). With micro-batches of one sample, rebalancing (``xirang.compile(rebalance_every=N)``,
codegen/runtime/data_parallel/dp_balance.py) moves one micro-batch per rank per decision from the slow rank to the
fast ones. Throughput is samples per second over the steps after the first (warm-up), measured on
rank 0 as wall time of ``train_step`` + optimizer step. Every mode's losses are compared with the
same steps on one device (the largest difference is printed; fp32, 1e-5 expected).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ is a folder of the repository

SEQ, VOCAB_USED = 64, 500


def build():
    from examples.gpt import GPTConfig, build_gpt
    torch.manual_seed(0)
    return build_gpt(GPTConfig(vocab_size=512, seq_len=SEQ, hidden=128, heads=4, layers=4))


def batch(step: int, size: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator)}


class SlowForward:
    """A stage program that sleeps before every forward (the slow rank's stand-in for a slow device)."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args):
        time.sleep(self.delay_s)
        return self.inner(*args)


def _rank_main(rank, world, plan, global_batch, steps, every, delay_s, shares):
    import xirang
    compiled = xirang.compile(build(), world=world, example_kwargs=batch(0, 2), plan=plan,
                              runtime=xirang.RuntimeOptions(dp_shares=shares, rebalance_every=every))
    if compiled.dp_rank == 0:
        for stage in compiled.executor.stages.values():
            stage.program = SlowForward(stage.program, delay_s)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3, eps=1e-3)
    losses, began = [], None
    for step in range(steps):
        if step == 1:
            began = time.perf_counter()
        losses.append(compiled.train_step(**batch(step, global_batch)).item())
        optimizer.step()
        optimizer.zero_grad()
    seconds = time.perf_counter() - began
    return {"losses": losses, "samples_per_s": global_batch * (steps - 1) / seconds,
            "shares": compiled.dp_shares,
            "decisions": [d.after for d in compiled.rebalancer.decisions] if compiled.rebalancer else []}


def reference_losses(global_batch: int, steps: int) -> list:
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    found = []
    for step in range(steps):
        loss = model(**batch(step, global_batch))
        loss.backward()
        found.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    args = parser.parse_args()
    import xirang
    from xirang.codegen.runtime.launch.launcher import launch

    plan = xirang.plan(build(), world=args.dp, example_kwargs=batch(0, 2), global_batch=args.global_batch,
                       hardware="cpu", dp=args.dp, tp=1, pp=1, micro_batch=1)
    want = reference_losses(args.global_batch, args.steps)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; load average "
          f"{open('/proc/loadavg').read().split()[0]}; dp={args.dp} gloo ranks, global batch {args.global_batch} "
          f"(micro-batches of 1), rank 0 sleeps {args.delay_ms:g} ms before every forward")
    runs = {"off": (None, None)}
    runs["on"] = (args.every, None)
    results = {}
    for mode, (every, shares) in runs.items():
        out = launch(_rank_main, args.dp, args=(plan, args.global_batch, args.steps, every, args.delay_ms / 1e3,
                                                shares), timeout_s=900, heartbeat_s=120)[0]
        results[mode] = out
    # the shares rebalancing ended at, fixed from the first step: what a planner that knew the speeds would give
    fixed = results["on"]["shares"]
    results["fixed at end shares"] = launch(_rank_main, args.dp, args=(plan, args.global_batch, args.steps, None,
                                                                      args.delay_ms / 1e3, fixed),
                                            timeout_s=900, heartbeat_s=120)[0]
    base = results["off"]["samples_per_s"]
    for mode, out in results.items():
        worst = max(abs(a - b) for a, b in zip(out["losses"], want))
        print(f"  rebalancing {mode:>20}: {out['samples_per_s']:7.1f} samples/s ({out['samples_per_s'] / base:.2f}x "
              f"off), final shares {list(out['shares'])}, worst loss difference vs one device {worst:.1e}")
        if out["decisions"]:
            print(f"  {'':>33}shares after each decision: {[list(d) for d in out['decisions']]}")


if __name__ == "__main__":
    main()
