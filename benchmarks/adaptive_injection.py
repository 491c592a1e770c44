"""Adaptive micro-batch injection with uneven stages: throughput with injection off and on, in one run,
each with its loss against one device.

    python benchmarks/adaptive_injection.py [--steps 8] [--every 2] [--stage-ms 30,20,20,20] [--jitter 0]

A GPT (examples/gpt.py, 4 layers, hidden 128) is planned for (1, 1, 4) with 1F1B and 8 micro-batches
and run on 4 local gloo ranks. The stage times are set on purpose: each pipeline rank's forward
sleeps ``--stage-ms`` (one figure per rank) and its backward twice that (a hook on the stage's
output), standing for devices or stages of different speed; ``--jitter S`` multiplies every sleep by
a log-normal factor exp(N(0, S)) drawn from a fixed seed (the same draws in both modes). With
injection on (``xirang.compile(inject_every=N)``, codegen/runtime/executor/injection.py) the first decision
comes after N steps; throughput is samples per second over the steps after it, measured on rank 0
as wall time of ``train_step`` + optimizer step. Every mode's losses are compared with the same steps
on one device (fp32; 1e-5 expected).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ is a folder of the repository

SEQ, VOCAB_USED, GLOBAL_BATCH, PP = 64, 500, 8, 4


def build():
    from examples.gpt import GPTConfig, build_gpt
    torch.manual_seed(0)
    return build_gpt(GPTConfig(vocab_size=512, seq_len=SEQ, hidden=128, heads=4, layers=4))


def batch(step: int, size: int = GLOBAL_BATCH) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator)}


class Sleepy:
    """A stage program whose forward sleeps ``forward_s`` and whose backward sleeps twice that, each
    times a seeded log-normal factor when ``jitter`` > 0."""

    def __init__(self, inner, forward_s: float, jitter: float, seed: int):
        self.inner, self.forward_s, self.jitter = inner, forward_s, jitter
        self.draws = random.Random(seed)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _factor(self) -> float:
        return math.exp(self.draws.gauss(0.0, self.jitter)) if self.jitter else 1.0

    def __call__(self, *args):
        time.sleep(self.forward_s * self._factor())
        outputs = self.inner(*args)
        first = next(t for t in (outputs if isinstance(outputs, (tuple, list)) else [outputs])
                     if isinstance(t, torch.Tensor) and t.requires_grad)
        backward_s = 2 * self.forward_s * self._factor()
        first.register_hook(lambda grad: time.sleep(backward_s))
        return outputs


def _rank_main(rank, world, plan, steps, every, stage_s, jitter):
    import xirang
    compiled = xirang.compile(build(), world=world, example_kwargs=batch(0, 2), plan=plan,
                              runtime=xirang.RuntimeOptions(inject_every=every))
    for stage in compiled.executor.stages.values():
        stage.program = Sleepy(stage.program, stage_s[compiled.pp_rank], jitter, seed=compiled.pp_rank)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3, eps=1e-3)
    losses, began = [], None
    first_timed = every or 1  # after the first decision (or the warm-up step without injection)
    for step in range(steps):
        if step == first_timed:
            began = time.perf_counter()
        losses.append(compiled.train_step(**batch(step)).item())
        optimizer.step()
        optimizer.zero_grad()
    seconds = time.perf_counter() - began
    decisions = compiled.injection.decisions if compiled.injection else []
    return {"losses": losses, "samples_per_s": GLOBAL_BATCH * (steps - first_timed) / seconds,
            "extra": compiled.extra_warmup, "in_flight": dict(compiled.last_step.most_in_flight),
            "decisions": [(d.after, round(d.simulated_before * 1e3), round(d.simulated_after * 1e3))
                          for d in decisions]}


def reference_losses(steps: int) -> list:
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    found = []
    for step in range(steps):
        loss = model(**batch(step))
        loss.backward()
        found.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--stage-ms", default="30,20,20,20", help="forward sleep per pipeline rank, ms")
    parser.add_argument("--jitter", type=float, default=0.0)
    args = parser.parse_args()
    stage_s = tuple(float(x) / 1e3 for x in args.stage_ms.split(","))
    if len(stage_s) != PP:
        parser.error(f"--stage-ms needs {PP} figures, one per pipeline rank")
    import xirang
    from xirang.codegen.runtime.launch.launcher import launch

    plan = xirang.plan(build(), world=PP, example_kwargs=batch(0, 2), global_batch=GLOBAL_BATCH, hardware="a100-80g",
                       dp=1, tp=1, pp=PP, schedule="1f1b", micro_batch=1, precision="fp32")
    want = reference_losses(args.steps)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; load average "
          f"{open('/proc/loadavg').read().split()[0]}; (1,1,{PP}) 1F1B, {GLOBAL_BATCH} micro-batches of 1; forward "
          f"sleeps {args.stage_ms} ms per stage, backward twice; jitter {args.jitter:g}")
    results = {}
    for mode, every in (("off", None), ("on", args.every)):
        results[mode] = launch(_rank_main, PP, args=(plan, args.steps, every, stage_s, args.jitter),
                               timeout_s=900, heartbeat_s=120)[0]
    base = results["off"]["samples_per_s"]
    for mode, out in results.items():
        worst = max(abs(a - b) for a, b in zip(out["losses"], want))
        print(f"  injection {mode:>3}: {out['samples_per_s']:6.2f} samples/s ({out['samples_per_s'] / base:.2f}x off), "
              f"extra warm-up {list(out['extra']) or [0] * PP}, rank 0 in flight {out['in_flight']}, "
              f"worst loss difference vs one device {worst:.1e}")
        for after, before_ms, after_ms in out["decisions"]:
            print(f"      decision: extra {list(after)}, simulated step {before_ms} -> {after_ms} ms")


if __name__ == "__main__":
    main()
