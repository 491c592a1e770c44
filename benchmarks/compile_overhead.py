"""What compiling costs at run time, on this machine's CPU.

1. world=1: the compiled program's step (forward + backward) over the eager model's, tiny and
   medium GPT. The program is the traced aten graph run by Python, so the ratio is the price of
   the FX interpreter-free but op-by-op execution versus nn.Module's.
2. dp=4 on local gloo ranks: compiled steps per second over torch DistributedDataParallel's, same
   model, batch and bucket size (25 MiB both), the two steps alternated (medians).

    python benchmarks/compile_overhead.py
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # examples/

import xirang  # noqa: E402
from examples.gpt import GPTConfig, build_gpt  # noqa: E402
from xirang.codegen.runtime.launch.launcher import launch  # noqa: E402

MODELS = {"tiny": GPTConfig(vocab_size=512, seq_len=64, hidden=64, heads=4, layers=2),
          "medium": GPTConfig(vocab_size=4096, seq_len=128, hidden=256, heads=8, layers=4)}
BATCH, SEQ, STEPS, WARMUP = 8, 64, 10, 2


def _batch(vocab: int, size=BATCH) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, vocab, (size, SEQ), generator=generator),
            "labels": torch.randint(0, vocab, (size, SEQ), generator=generator)}


def _model(name: str):
    torch.manual_seed(0)
    return build_gpt(MODELS[name], device="cpu")


def single_rank(name: str) -> tuple[float, float]:
    batch = _batch(MODELS[name].vocab_size)
    eager = _model(name)

    def eager_step():
        eager.zero_grad(set_to_none=True)
        eager(**batch).backward()
    compiled = xirang.compile(_model(name), world=1, example_kwargs=batch, global_batch=BATCH, hardware="cpu")
    return _alternated(eager_step, lambda: _fresh_step(compiled, batch))


def _alternated(step_a, step_b, rounds: int = 5 * STEPS) -> tuple[float, float]:
    """Median seconds of each of two steps run alternately (a, b, a, b, ...): a drift of the machine's
    speed during the run (other load, frequency) falls on both alike, which two back-to-back means
    do not give on a shared box (world=1 ratios of one model swung 1.01-1.13 between runs)."""
    for _ in range(WARMUP):
        step_a()
        step_b()
    times_a, times_b = [], []
    for _ in range(rounds):
        for step, times in ((step_a, times_a), (step_b, times_b)):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def _fresh_step(compiled, batch):
    """train_step accumulates gradients as backward does: clear them first, as the eager step does."""
    for param in compiled.parameters():
        param.grad = None
    compiled.train_step(**batch)


def _dp_rank(rank, world, name):
    torch.set_num_threads(1)
    batch = _batch(MODELS[name].vocab_size, BATCH * world)
    compiled = xirang.compile(_model(name), world=world, example_kwargs=batch, global_batch=BATCH * world,
                              hardware="cpu", dp=world, tp=1, pp=1, micro_batch=BATCH)
    ddp = torch.nn.parallel.DistributedDataParallel(_model(name))
    share = {k: v.chunk(world)[rank] for k, v in batch.items()}

    def ddp_step():
        ddp.zero_grad(set_to_none=True)
        ddp(**share).backward()
    # alternated as at world=1: every rank runs the same sequence, so the collectives pair up
    return _alternated(lambda: _fresh_step(compiled, batch), ddp_step, rounds=2 * STEPS)


def main():
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"batch {BATCH} x seq {SEQ}; world=1: medians of {5 * STEPS} eager and compiled steps run alternately "
          f"after {WARMUP} warm-up each; dp=4: medians of {2 * STEPS} steps of each, alternated")
    for name in MODELS:
        eager_s, compiled_s = single_rank(name)
        print(f"world=1 {name:7s} eager {eager_s * 1e3:8.1f} ms  compiled {compiled_s * 1e3:8.1f} ms  "
              f"ratio {compiled_s / eager_s:.2f}")
    results = launch(_dp_rank, 4, ("medium",), timeout_s=900)
    xirang_s = max(r[0] for r in results)
    ddp_s = max(r[1] for r in results)
    print(f"dp=4 medium (gloo, 1 thread per rank): xirang {xirang_s * 1e3:.1f} ms/step, DDP {ddp_s * 1e3:.1f} "
          f"ms/step; throughput xirang / DDP = {ddp_s / xirang_s:.2f}")


if __name__ == "__main__":
    main()
