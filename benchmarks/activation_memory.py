"""Activation memory measured against the plan, per recompute / offload mode, on CPU ranks.

    python benchmarks/activation_memory.py [--layers 4] [--hidden 512] [--seq 512] [--steps 2] [--json out.json]

The in-repo GPT (examples/gpt.py) with eager attention and dropout 0.1, sized so activations
dominate (hidden 512, seq 512, 8 heads, 4 layers, vocabulary 1024), on 2 local CPU ranks under a
(dp=1, pp=2, tp=1) 1F1B plan with micro-batch 1 and 4 micro-batches (rank 0 holds 2 in flight, rank 1
one). For each mode -- recompute none / selective / full, and offload of the blocks (recompute none) --
the plan is made with that mode pinned, each rank trains ``--steps`` timed steps after a warm-up and
one more step under ``MemoryProbe`` (codegen/runtime/memory/memory_probe.py), and the script prints per rank:

- measured: the peak of saved activation bytes alive at once (unique storages autograd keeps), and
  the plan's ``activations`` part for that pipeline rank (Prediction.memory_parts), with their ratio
  (the aim: within 10%). The plan's ``working_set`` (what recompute rebuilds during a block's
  backward, the blocks offload holds on the device) is printed beside it: the probe does not see it
  (torch's checkpoint and the offload keep those tensors under their own saved-tensor hooks).
- time: the step's wall time (slowest rank, median of the timed steps) and its extra over mode
  "none", beside the cost model's predicted extra (step_seconds of the plan over the plan of mode
  "none"; the cpu preset's absolute seconds are not this machine's, the ratio is what is compared).
- offload: the saved bytes the probe no longer sees on each rank against the plan's predicted
  reduction, and the bytes the offload engine copied out per step. On CPU ranks host and device
  are one memory: the copies run, but nothing is freed physically.

Caveat: the 2 ranks share this machine's cores, so step times are noisy; the memory figures are not.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import xirang  # noqa: E402
from examples.gpt import GPTConfig, build_gpt  # noqa: E402

MODES = (("none", "none"), ("selective", "none"), ("full", "none"), ("none", "blocks"))
WORLD, PP, MICRO_BATCH, GLOBAL_BATCH = 2, 2, 1, 4


def config(args) -> GPTConfig:
    return GPTConfig(vocab_size=1024, seq_len=args.seq, hidden=args.hidden, heads=8, layers=args.layers,
                     dropout=0.1, attention="eager")


def batch(cfg: GPTConfig, step: int, device="cpu") -> dict:
    generator = torch.Generator().manual_seed(step)
    return {name: torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.seq_len), generator=generator).to(device)
            for name in ("input_ids", "labels")}


def make_plan(cfg: GPTConfig, recompute: str, offload: str):
    example = {name: torch.zeros(2, cfg.seq_len, dtype=torch.long, device="meta") for name in ("input_ids", "labels")}
    return xirang.plan(build_gpt(cfg, device="meta"), world=WORLD, hardware="cpu", example_kwargs=example,
                       global_batch=GLOBAL_BATCH, pp=PP, tp=1, micro_batch=MICRO_BATCH, schedule="1f1b",
                       recompute=recompute, offload=offload)


def _rank(rank, world, cfg, plan, steps):
    from xirang.codegen.runtime.memory.memory_probe import measure_step
    torch.manual_seed(0)
    compiled = xirang.compile(build_gpt(cfg), world=world, example_kwargs=batch(cfg, 0), plan=plan)
    optimizer = torch.optim.SGD(compiled.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 1):  # the first step warms up allocators and gloo connections
        started = time.perf_counter()
        compiled.train_step(**batch(cfg, step))
        times.append(time.perf_counter() - started)
        optimizer.step()
        optimizer.zero_grad()
    offload = compiled.activation_offload
    if offload is not None:
        offload.stats.reset()
    _, measured = measure_step(compiled, **batch(cfg, steps + 1))
    copied = offload.stats.packed_bytes if offload is not None else 0
    return {"times": times[1:], "memory": measured, "offloaded_bytes": copied}


def run_mode(cfg, recompute, offload, steps) -> dict:
    from xirang.codegen.runtime.launch.launcher import launch
    plan = make_plan(cfg, recompute, offload)
    results = launch(_rank, WORLD, (cfg, plan, steps), timeout_s=1800)
    per_step = [max(r["times"][i] for r in results) for i in range(steps)]
    return {"recompute": recompute, "offload": offload, "plan": plan, "step_seconds": statistics.median(per_step),
            "predicted_step_seconds": plan.predicted.step_seconds,
            "memory": [r["memory"] for r in results], "offloaded_bytes": [r["offloaded_bytes"] for r in results]}


def mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.1f}"


def report(rows: list) -> str:
    base = rows[0]
    lines = [f"{'mode':<18} {'rank':>4} {'measured MiB':>13} {'predicted MiB':>14} {'ratio':>6} "
             f"{'work set MiB':>13} | {'step s':>7} {'extra':>7} {'predicted extra':>15}"]
    for row in rows:
        name = f"recompute={row['recompute']}" if row["offload"] == "none" else f"offload={row['offload']}"
        extra = row["step_seconds"] / base["step_seconds"] - 1
        predicted = row["predicted_step_seconds"] / base["predicted_step_seconds"] - 1
        for m in row["memory"]:
            timing = (f"{row['step_seconds']:>7.2f} {extra:>+7.1%} {predicted:>+15.1%}" if m.rank == 0 else "")
            lines.append(f"{name if m.rank == 0 else '':<18} {m.rank:>4} {mib(m.saved_peak_bytes):>13} "
                         f"{mib(m.predicted_activation_bytes):>14} {m.ratio:>6.3f} "
                         f"{mib(m.predicted_working_set_bytes):>13} | {timing}")
    offloaded = [row for row in rows if row["offload"] != "none"]
    for row in offloaded:
        lines.append(f"\noffload={row['offload']}: saved activations the probe no longer sees on the device, "
                     f"measured vs predicted (recompute none as the base):")
        for m, before, copied in zip(row["memory"], base["memory"], row["offloaded_bytes"]):
            measured = before.saved_peak_bytes - m.saved_peak_bytes
            predicted = before.predicted_activation_bytes - m.predicted_activation_bytes
            lines.append(f"  rank {m.rank}: {mib(measured)} MiB vs {mib(predicted)} MiB predicted "
                         f"({measured / predicted:.3f}); copied to host in the step: {mib(copied)} MiB; "
                         f"working set the plan holds on the device: {mib(m.predicted_working_set_bytes)} MiB")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--modes", help="comma-separated subset, e.g. none,selective,full,offload")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    cfg = config(args)
    wanted = None if not args.modes else set(args.modes.split(","))
    modes = [m for m in MODES if wanted is None or (m[1] != "none" and "offload" in wanted) or
             (m[1] == "none" and m[0] in wanted)]
    print(f"GPT hidden {cfg.hidden}, seq {cfg.seq_len}, {cfg.layers} layers, heads {cfg.heads}, eager attention, "
          f"dropout {cfg.dropout}; {WORLD} CPU ranks, pp={PP}, 1f1b, micro-batch {MICRO_BATCH} x "
          f"{GLOBAL_BATCH // MICRO_BATCH}; torch {torch.__version__}", flush=True)
    rows = []
    for recompute, offload in modes:
        started = time.perf_counter()
        rows.append(run_mode(cfg, recompute, offload, args.steps))
        print(f"  ran recompute={recompute} offload={offload} in {time.perf_counter() - started:.0f} s", flush=True)
    print(report(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"recompute": r["recompute"], "offload": r["offload"], "step_seconds": r["step_seconds"],
             "predicted_step_seconds": r["predicted_step_seconds"], "offloaded_bytes": r["offloaded_bytes"],
             "memory": [m.to_json() for m in r["memory"]]} for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
