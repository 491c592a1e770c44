"""Analyse a Llama-2-70B-shaped model built on the meta device: wall time, peak memory, block kinds.

    python benchmarks/analyze_llama70b.py [--layers 80] [--no-fold]

Reports the time of each pass, the process's peak resident memory (ru_maxrss, which includes the
Python interpreter and torch, ~0.3 GiB before any work), and the analysis table.
"""
from __future__ import annotations

import argparse
import logging
import platform
import resource
import time

import torch


def llama2_70b(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                         intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--no-fold", action="store_true", help="trace every layer (slower; same graph)")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import xirang

    start = time.perf_counter()
    model = llama2_70b(args.layers)
    built = time.perf_counter()
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    report = xirang.analyze(model, example_kwargs={"input_ids": ids, "labels": ids}, fold_repeats=not args.no_fold)
    done = time.perf_counter()
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # ru_maxrss is KiB on Linux

    print(report)
    print()
    print("pass timings:")
    print("\n".join("  " + line for line in _timing_lines(report)))
    print()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}")
    print(f"model: Llama-2-70B shape, {args.layers} layers, {report.total_params / 1e9:.2f} B parameters "
          f"(sum of numel: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B)")
    kinds = ", ".join(f"{k.module_type} x{k.count}" for k in report.kinds)
    print(f"distinct block kinds: {len(report.kinds)} ({kinds})")
    print(f"wall time: build {built - start:.2f} s, analyze {done - built:.2f} s; peak RSS {peak_gib:.2f} GiB")


def _timing_lines(report):
    return [f"{t.name:<20} {t.seconds:7.2f} s" for t in report.timings]


if __name__ == "__main__":
    main()
