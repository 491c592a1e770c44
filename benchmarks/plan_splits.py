"""Time the split ILP on a Llama-2-70B-shaped model: SplitPricer construction and price() per (tp, micro_batch).

    python benchmarks/plan_splits.py [--layers 80] [--seq 4096] [--world 1x8] [--device a100-80g]

The model (examples/catalog.py:llama2_70b) is built on the meta device and analysed with layer folding;
the analysis time is printed apart. Each price() call is a fresh solve (no cache hit): the first at a tp
also builds that tp's candidate strategies and links. The planning budget this serves is 10 s for the
whole degree search (tp in 1, 2, 4, 8 and about six micro-batch sizes).
"""
from __future__ import annotations

import argparse
import logging
import platform
import time

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--device", default="a100-80g")
    parser.add_argument("--micro-batches", default="1,2,4")
    parser.add_argument("--tps", default="1,2,4,8")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import xirang
    from transformers import LlamaConfig, LlamaForCausalLM

    from xirang.ir.world import World
    from xirang.passes.planning.plan_splits import SplitPricer

    config = LlamaConfig(num_hidden_layers=args.layers, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                         intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
    start = time.perf_counter()
    report = xirang.analyze(model, example_kwargs={"input_ids": ids, "labels": ids})
    analysed = time.perf_counter()
    world = World.uniform(args.nodes, args.devices_per_node, args.device)
    pricer = SplitPricer(report.graph_module, world)
    built = time.perf_counter()
    print(f"Llama-2-70B shape, {args.layers} layers, {len(report.graph_module.graph.nodes)} graph nodes; "
          f"world {world.describe()}")
    print(f"analyze {analysed - start:.2f} s; SplitPricer(...) {built - analysed:.3f} s")
    print()
    header = f"{'tp':>3} {'micro_batch':>11} {'price s':>8} {'step ms/mb':>11} {'tp comm ms':>11} " \
             f"{'params/rank':>12} {'collectives':>11}"
    print(header)
    print("-" * len(header))
    total = 0.0
    for tp in (int(t) for t in args.tps.split(",")):
        for micro_batch in (int(b) for b in args.micro_batches.split(",")):
            begin = time.perf_counter()
            split = pricer.price(tp, tuple(range(tp)), micro_batch, args.seq)
            seconds = time.perf_counter() - begin
            total += seconds
            step = sum(u.seconds("none") for u in split.units)
            comm = sum(u.tp_comm_forward_seconds + u.tp_comm_backward_seconds for u in split.units)
            params = sum(u.params_local for u in split.units)
            print(f"{tp:>3} {micro_batch:>11} {seconds:>8.3f} {step * 1e3:>11.1f} {comm * 1e3:>11.1f} "
                  f"{params / 1e9:>11.2f}B {len(split.collectives):>11}")
    print("-" * len(header))
    print(f"all price() calls: {total:.2f} s; machine: {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
