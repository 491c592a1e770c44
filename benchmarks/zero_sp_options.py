"""What ZeRO and sequence parallelism buy, as the planner predicts it (issue 17's planner acceptance).

    python benchmarks/zero_sp_options.py [--setups llama2_70b@64 llama2_70b@1024 llama2_7b@8 llama2_7b@64]

For a Llama-2-70B shape on 64 and 1024 A100-80GB and a Llama-2-7B shape on 8 and 64 (Hugging Face
LlamaForCausalLM on the meta device, seq 4096, global batch 1024 sequences: Llama 2's 4M tokens), each
model is traced and analysed once, then planned twice: with the options off (``zero_stage=0`` and
``sequence_parallel=False`` pinned) and with them left to the search (every ZeRO stage of
``plan_search_space.ZERO_STAGES`` where dp > 1, sequence parallelism for the best tp > 1
configurations). It prints a markdown table of both plans (configuration, predicted step, TFLOP/s
per device, peak memory per device) with the predicted gain, then what ``plan.explain()`` says each
option saved and cost. Every figure is the cost model's prediction, not a measurement.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/ is a folder of the repository

SEQ, GLOBAL_BATCH, DEVICE = 4096, 1024, "a100-80g"
SETUPS = {  # name -> (model, world: nodes x devices)
    "llama2_70b@64": ("llama2_70b", "8x8"),
    "llama2_70b@1024": ("llama2_70b", "128x8"),
    "llama2_7b@8": ("llama2_7b", "1x8"),
    "llama2_7b@64": ("llama2_7b", "8x8"),
}
GiB = 1024**3


def llama2_7b(batch: int = 1, seq: int = SEQ):
    """Hugging Face Llama at Llama-2-7B's shape (32 layers, hidden 4096, 32 heads, MLP 11008) on meta."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                         intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def build(name: str):
    from examples import catalog
    return llama2_7b() if name == "llama2_7b" else getattr(catalog, name)(batch=1, seq=SEQ)


def plan_both(model, example_kwargs, report, world: str) -> dict:
    """{"off": plan or error text, "on": plan, "seconds": planning wall seconds of each}."""
    import xirang
    from xirang.ir.errors import XirangError
    found, seconds = {}, {}
    for key, pins in (("off", {"zero_stage": 0, "sequence_parallel": False}), ("on", {})):
        start = time.perf_counter()
        try:
            found[key] = xirang.plan(model, world=world, hardware=DEVICE, example_kwargs=example_kwargs,
                                     global_batch=GLOBAL_BATCH, seq=SEQ, analysed=report, **pins)
        except XirangError as error:  # e.g. nothing fits without the options
            found[key] = f"no plan: {error.what}"
        seconds[key] = time.perf_counter() - start
    found["seconds"] = seconds
    return found


def row(setup: str, options: str, plan) -> str:
    from xirang.ir.plan_explain import as_row, label
    if isinstance(plan, str):
        return f"| {setup} | {options} | {plan} | - | - | - |"
    p = plan.predicted
    return (f"| {setup} | {options} | `{label(as_row(plan))}` | {p.step_seconds:.3f} | {p.tflops_per_device:.1f} "
            f"| {max(p.memory_bytes_per_device) / GiB:.1f} |")


def gain(off, on) -> str:
    if isinstance(on, str):
        return "no plan with the options"
    if isinstance(off, str):
        return "fits only with the options"
    faster = off.predicted.step_seconds / on.predicted.step_seconds - 1
    memory = (max(off.predicted.memory_bytes_per_device) - max(on.predicted.memory_bytes_per_device)) / GiB
    return f"{faster:+.1%} step speed, {memory:+.1f} GiB/device freed"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # torch.export's notes on HF models are not this benchmark's output
    import xirang
    from xirang.ir.plan_explain import option_trades
    from xirang.passes.planning.plan_search_space import ZERO_STAGES

    results, analysed = {}, {}
    for setup in args.setups:
        name, world = SETUPS[setup]
        if name not in analysed:
            model, example_kwargs = build(name)
            analysed[name] = (model, example_kwargs, xirang.analyze(model, example_kwargs=example_kwargs))
        results[setup] = plan_both(*analysed[name], world)
        print(f"planned {setup} ({world} {DEVICE}) in {results[setup]['seconds']['off']:.1f} s (options off) "
              f"and {results[setup]['seconds']['on']:.1f} s (options free)", file=sys.stderr, flush=True)

    free = f"zero {'/'.join(map(str, ZERO_STAGES))}, sp searched"
    print(f"Seq {SEQ}, global batch {GLOBAL_BATCH} sequences, bf16, {DEVICE}; predicted by the cost model.\n")
    print("| setup | options | best plan | step s | TFLOP/s/device | max GiB/device |")
    print("|---|---|---|---|---|---|")
    for setup, found in results.items():
        print(row(setup, "zero 0, sp off (pinned)", found["off"]))
        print(row(setup, free, found["on"]))
    print("\n| setup | predicted gain of the options |")
    print("|---|---|")
    for setup, found in results.items():
        print(f"| {setup} | {gain(found['off'], found['on'])} |")
    print()
    for setup, found in results.items():
        if not isinstance(found["on"], str):
            for title, line in option_trades(found["on"]):
                print(f"- {setup}, {title}: {line}")


if __name__ == "__main__":
    main()
