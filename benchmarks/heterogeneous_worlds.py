"""Plans for Worlds that mix device kinds, against planning as if every device were the slowest kind.

    python benchmarks/heterogeneous_worlds.py [--cases llama2_7b_a100_h100 ...]

Each case plans a Hugging Face Llama shape on meta (nothing allocated) twice with ``xirang.plan``:
on the mixed World (node groups "NxM:device+NxM:device", ``ir/world.parse_world``) and on a uniform
World of the same node count and the slowest (or smallest) kind. The gain is the second plan's
predicted step over the first's. The slowest-kind plan is what a planner that ignores the mix runs: its
cuts and dp shares are even, so on the mixed World the slow devices set its pace and the fast ones wait
(its predicted step is that of the uniform slow World). Both are the cost model's predictions: no
mixed cluster was available to measure either.

What the mixed plan may do that the other cannot (passes/planning/device_speeds.py): give faster pipeline
ranks more layers, give faster dp replicas more micro-batches (Plan.dp_shares; training stays equal to
one device: tests/codegen/test_dp_shares.py), and put more layers on devices with more memory.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=32000,
                         max_position_embeddings=seq, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": tokens, "labels": tokens.clone()}


LLAMA2_7B = (32, 4096, 32, 32, 11008)
LLAMA2_13B = (40, 5120, 40, 40, 13824)
LLAMA2_70B = (80, 8192, 64, 8, 28672)

# name: (shape, seq, global batch, mixed world, the same nodes all of the slowest/smallest kind)
CASES = {
    "llama2_7b_a100_h100": (LLAMA2_7B, 4096, 256, "2x8:a100-80g+2x8:h100-80g", "4x8:a100-80g"),
    "llama2_13b_h100_a100": (LLAMA2_13B, 4096, 512, "4x8:h100-80g+4x8:a100-80g", "8x8:a100-80g"),
    "llama2_70b_a100_h100": (LLAMA2_70B, 4096, 1024, "16x8:a100-80g+16x8:h100-80g", "32x8:a100-80g"),
    "llama2_70b_h100_h200": (LLAMA2_70B, 4096, 512, "4x8:h100-80g+4x8:h200", "8x8:h100-80g"),
    # memory-bound: 16 B per parameter nearly fill an 80 GB device at 32 devices; the H200s (141 GB) take more layers
    "llama2_70b_h100_h200_tight": (LLAMA2_70B, 4096, 128, "2x8:h100-80g+2x8:h200", "4x8:h100-80g"),
}


def describe(plan) -> str:
    mesh, shares = plan.mesh, plan.micro_batches_per_dp_rank
    layers = [sum(name.startswith("block:") for name in stage.units) for stage in plan.stages]
    uneven = f" m per dp rank {min(shares)}..{max(shares)}" if len(set(shares)) > 1 else f" m={plan.num_micro_batches}"
    zero = f" zero={plan.zero_stage}" if plan.zero_stage else ""
    return (f"dp={mesh.dp} pp={mesh.pp} tp={mesh.tp} b={plan.micro_batch}{uneven} {plan.schedule} "
            f"recompute={plan.recompute}{zero}; blocks per stage {layers}")


def run(name: str) -> dict:
    import xirang
    shape, seq, global_batch, mixed, slowest = CASES[name]
    model, kwargs = llama(*shape, seq)
    report = xirang.analyze(model, example_kwargs=kwargs)
    row = {"case": name}
    for label, world in (("mixed", mixed), ("slowest", slowest)):
        start = time.perf_counter()
        plan = xirang.plan(model, world=world, example_kwargs=kwargs, global_batch=global_batch, analysed=report)
        row[label] = (plan, time.perf_counter() - start, world)
    row["gain"] = row["slowest"][0].predicted.step_seconds / row["mixed"][0].predicted.step_seconds
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    args = parser.parse_args()
    print(f"# {platform.machine()}, torch {torch.__version__}; predictions of the cost model, not measurements")
    print("| case | world | plan | predicted step s | GiB/device (max) | plan s |")
    print("|---|---|---|---|---|---|")
    gains = []
    for name in args.cases:
        row = run(name)
        for label in ("mixed", "slowest"):
            plan, seconds, world = row[label]
            memory = max(plan.predicted.memory_bytes_per_device) / 2**30
            print(f"| {name} ({label}) | {world} | {describe(plan)} | {plan.predicted.step_seconds:.3f} | "
                  f"{memory:.1f} | {seconds:.1f} |")
        gains.append((name, row["gain"]))
    print()
    for name, gain in gains:
        print(f"{name}: planning for the mix is predicted {gain:.2f}x faster than planning as if all were the slowest")


if __name__ == "__main__":
    main()
