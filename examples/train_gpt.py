"""Train the in-repo GPT with Xirang on several ranks: run it under torchrun or `xirang launch`.

    xirang launch -n 4 examples/train_gpt.py -- --tp 2 --steps 3
    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/train_gpt.py --tp 2

Every rank builds the same model (same seed), compiles it for the world torchrun set up, and trains
a few steps on the same global batch; rank 0 prints the plan and the loss of every step. On GPUs
use the same torchrun command: where CUDA is available the ranks join with NCCL and xirang.compile's
runtime device follows the launcher (rank on cuda:LOCAL_RANK; under gloo, or run as one process, the
CPU), and the script moves its batch to ``compiled.device``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` importable from anywhere

import xirang  # noqa: E402
from examples.gpt import GPTConfig, build_gpt  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, help="tensor-parallel degree (default: planned)")
    parser.add_argument("--pp", type=int, help="pipeline stages (default: planned)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    options = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = build_gpt(GPTConfig(vocab_size=512, seq_len=64, hidden=64, heads=4, layers=4))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (options.global_batch, options.seq), generator=generator)

    def batch():  # one batch, learned by heart: the loss must fall step after step
        return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}
    pins = {name: value for name, value in (("tp", options.tp), ("pp", options.pp)) if value}
    # plan at a long sequence so splitting pays off even for this small model; run at --seq
    compiled = xirang.compile(model, world=world, example_kwargs=batch(), global_batch=options.global_batch,
                              hardware="a100-80g", seq=2048, precision="fp32", **pins)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        print("\n".join(compiled.plan.explain().splitlines()[:8]), flush=True)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    for step in range(options.steps):
        loss = compiled.train_step(**{name: value.to(compiled.device) for name, value in batch().items()})
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.5f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
