"""Activation memory per rank under context parallelism, measured on CPU ranks at cp = 1, 2, 4 against the plan.

    python benchmarks/context_memory.py [--seq 2048] [--hidden 256] [--layers 2] [--json out.json]

A Hugging Face Llama (grouped-query: 8 query heads, 2 kv heads; SDPA attention, so activations grow with the
sequence, not its square, as a long-context run's fused kernel keeps them) at ``--seq`` tokens, planned for
cp CPU ranks with cp pinned (dp 1, tp 1, pp 1, micro-batch 1 of a global batch of 2, no recompute, fp32,
ring attention), compiled and stepped on cp gloo ranks; one step under ``MemoryProbe``
(codegen/runtime/memory/memory_probe.py) gives each rank's peak of saved activations, set beside the plan's
``activations`` part (Prediction.memory_parts: the split priced at seq / cp, passes/planning/
context_parallel_cost.py). Printed per cp: the worst rank's measured and predicted MiB, their ratio (the aim:
within 10%), and how much each shrank from cp = 1 (the split's promise: about 1/cp).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import xirang  # noqa: E402
from examples.hf_families import build_from_config, token_batch  # noqa: E402

HEADS, KV_HEADS, VOCAB, GLOBAL_BATCH = 8, 2, 512, 2
DEGREES = (1, 2, 4)


def build(args, device="cpu", step=0):
    import transformers
    model = build_from_config(transformers.LlamaConfig, transformers.LlamaForCausalLM, device,
                              num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=HEADS,
                              num_key_value_heads=KV_HEADS, intermediate_size=2 * args.hidden, vocab_size=VOCAB,
                              max_position_embeddings=args.seq, use_cache=False)
    return model, token_batch(GLOBAL_BATCH, args.seq, device, step=step)


def make_plan(args, cp: int):
    model, inputs = build(args, "meta")
    return xirang.plan(model, world=cp, hardware="cpu", example_kwargs=inputs, global_batch=GLOBAL_BATCH,
                       precision="fp32", cp=cp, dp=1, tp=1, pp=1, micro_batch=1, schedule="1f1b", recompute="none",
                       **({"context_method": "ring"} if cp > 1 else {}))


def _rank(rank, world, args, plan):
    from xirang.codegen.runtime.memory.memory_probe import measure_step
    torch.manual_seed(0)
    model, inputs = build(args)
    compiled = xirang.compile(model, world=world, example_kwargs=inputs, plan=plan)
    compiled.train_step(**build(args, step=1)[1])  # warm-up: allocators and gloo connections
    _, measured = measure_step(compiled, **build(args, step=2)[1])
    return measured.to_json()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    from xirang.codegen.runtime.launch.launcher import launch
    print(f"HF Llama hidden {args.hidden}, {args.layers} layers, {HEADS} heads ({KV_HEADS} kv), seq {args.seq}, SDPA; "
          f"micro-batch 1 x {GLOBAL_BATCH}, fp32, recompute none; torch {torch.__version__}", flush=True)
    rows = []
    for cp in DEGREES:
        started = time.perf_counter()
        plan = make_plan(args, cp)
        ranks = launch(_rank, cp, (args, plan), timeout_s=1800)
        worst = max(ranks, key=lambda r: r["saved_peak_bytes"])
        rows.append({"cp": cp, "ranks": ranks, "measured": worst["saved_peak_bytes"],
                     "predicted": worst["predicted_activation_bytes"], "seconds": time.perf_counter() - started})
    base = rows[0]
    print(f"{'cp':>3} {'measured MiB':>13} {'predicted MiB':>14} {'ratio':>6} {'measured x cp=1':>16} "
          f"{'predicted x cp=1':>17} {'s':>5}")
    for row in rows:
        print(f"{row['cp']:>3} {row['measured'] / 2**20:>13.2f} {row['predicted'] / 2**20:>14.2f} "
              f"{row['measured'] / row['predicted']:>6.3f} {row['measured'] / base['measured']:>16.3f} "
              f"{row['predicted'] / base['predicted']:>17.3f} {row['seconds']:>5.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
