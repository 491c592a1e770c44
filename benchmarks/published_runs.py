"""The cost model against published runs it was not fitted to: benchmarks/published_runs.json.

Each row is a training run as published (model shape, GPU kind and count, tp, pp, micro-batch, global
batch, schedule, recompute; the source, table and page in the JSON). This script pins that
configuration in ``xirang.plan`` on a World of the row's device (8 per node, links of that device's
node: ir/world.py ``NODE_LINKS``), with the device's own efficiencies (ir/device.py ``DEVICE_PRESETS``),
and compares the predicted step time with the published one.

TFLOP/s per GPU are counted the way the source counts them (the JSON's "flops"), from the same FLOP
count for the published and the predicted figure, so the error is the step-time ratio:
error = predicted TFLOP/s / published - 1 = published step / predicted step - 1 (negative: predicted
too slow). Nothing here is fitted: the A100 efficiencies were fitted to the five runs of
benchmarks/published_configs.json (benchmarks/fit_efficiency.py), none of which is a row
here; the H100's are set from the reasons written beside them, not from these rows. So no
leave-one-out errors are due: no row's figure enters any other row's price.

Pins: a row's ``sequence_parallel`` and ``zero_stage`` (absent: left to the search) say what the run
had, and ``tp_overlap`` 0 a run whose tp collectives did not overlap its matmuls (the 2021-22
Megatron-LM and MT-NLG runs). MT-NLG had neither sequence parallelism (Korthikanti et al. 2022's)
nor ZeRO. The Megatron-LM rows leave sequence parallelism and ZeRO to the search: its
sequence-parallel choice shards the activations sent between stages over tp,
standing in for Megatron-LM's scatter/gather of them (Narayanan et al. 2021 sec. 4.1), which neither
Xirang's runtime nor the cost model's no-sequence-parallel layout has.

Framework: the planner prices Xirang's own runtime (non-blocking isend/irecv between stages, gradient
buckets all-reduced while the backward runs). A row with ``"framework": "deepspeed_pipe"`` ran
DeepSpeed's PipelineEngine instead, which does neither: its step is priced from the plan's own stage
times by ``deepspeed_pipe_step`` (module below): the engine's schedule with blocking, one-after-the-
other sends (``cost_model.blocking_1f1b_stage_ends``) and the tp all-gathers (with their copies) of what
crosses a cut, then on each stage the tied-embedding sum and the dp all-reduce of its gradients
(DeepSpeed's buckets of 5e8 elements, after the last backward, with the bucket's copies), then on every
stage together the Adam step (``cost_model.optimizer_step_seconds``, the pass-by-pass bytes of
DeepSpeed's FP16_Optimizer), which the planner does not price for any row. Read from the code of the
time (microsoft/DeepSpeed 0457bb1c, September 2021: runtime/pipe/engine.py, fp16/fused_optimizer.py,
utils.py; microsoft/Megatron-DeepSpeed ec166f1c: GPTModelPipe).

    python benchmarks/published_runs.py [--rows ID,ID] [--json out.json] [--pin NAME=VALUE ...] [--own]

``--pin`` replaces one of a row's pins for every row priced (``micro_batch=2``, ``zero_stage=1``): what a
configuration the sources leave unstated would change, printed beside the published figures, never
written back to the JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import xirang  # noqa: E402
from examples.gpt import GPTConfig, build_gpt  # noqa: E402
from xirang.ir.device import Efficiency, device_spec  # noqa: E402
from xirang.ir.world import World  # noqa: E402
from xirang.passes.planning.cost_collectives import collective_cost  # noqa: E402
from xirang.passes.planning.cost_model import (blocking_1f1b_stage_ends, compute_time,  # noqa: E402
                                               gradient_accumulation_seconds, megatron_flops,
                                               optimizer_step_seconds)
from xirang.passes.planning.plan_splits import SplitPricer  # noqa: E402
from xirang.reprice import stage_predictions  # noqa: E402

RUNS = Path(__file__).with_name("published_runs.json")
GPUS_PER_NODE = 8  # DGX A100, DGX H100 and Grand Teton nodes alike
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # gradient elements per all-reduce (DeepSpeed MEMORY_OPT_ALLREDUCE_SIZE)
GRAD_BYTES = 2  # 16-bit gradients all-reduced (DeepSpeed's default: allreduce_always_fp32 off)
# allreduce_bucket's passes over each 16-bit gradient element besides the all-reduce: flattened into one
# buffer (read + write), divided by dp in place (read + write), copied back to the gradients (read + write)
DEEPSPEED_BUCKET_COPY_BYTES = 3 * 2 * GRAD_BYTES
# Bytes through memory per byte PartitionedTensor.full() gathers, besides the all-gather: the flat buffer
# zero-filled (1), the collective's flat output copied into the list of views it was given (read + write:
# torch's NCCL all_gather of a tensor list), the result cloned (read + write)
DEEPSPEED_FULL_COPY_FACTOR = 1 + 2 + 2


def load_rows(path: Path = RUNS) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def _tokens(seq: int) -> dict:
    # batch 2 in the example: a size-1 dim would be traced as a constant (passes/analysis/trace_inputs.py)
    return {"input_ids": torch.zeros(2, seq, dtype=torch.long, device="meta"),
            "labels": torch.zeros(2, seq, dtype=torch.long, device="meta")}


def model_of(row: dict):
    """The row's model on the meta device, and example inputs."""
    shape = row["model"]
    if shape["kind"] == "gpt":
        # Megatron-LM's GPT as those papers ran it: attention unfused (its seq² scores written, masked,
        # softmaxed and dropped out in memory), dropout 0.1, GELU MLP of 4h.
        # The 2024 H100 rows (megatron_lm_2024) give their own: fused attention, untied embeddings.
        config = GPTConfig(vocab_size=shape["vocab"], seq_len=row["seq"], hidden=shape["hidden"],
                           heads=shape["heads"], layers=shape["layers"], dropout=shape.get("dropout", 0.1),
                           attention=shape.get("attention", "eager"),
                           tie_embeddings=shape.get("tie_embeddings", True))
        return build_gpt(config, device="meta"), _tokens(row["seq"])
    if shape["kind"] == "llama":
        # Hugging Face Llama (RMSNorm, SwiGLU, rotary, grouped-query attention) with torch's fused
        # attention (sdpa: no seq x seq tensor), as Llama 3 was trained with a flash-attention kernel.
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(num_hidden_layers=shape["layers"], hidden_size=shape["hidden"],
                             num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                             intermediate_size=shape["ffn"], vocab_size=shape["vocab"],
                             max_position_embeddings=row["seq"], use_cache=False, tie_word_embeddings=False,
                             attn_implementation="sdpa")
        with torch.device("meta"):
            return LlamaForCausalLM(config), _tokens(row["seq"])
    raise ValueError(f"row {row['id']}: unknown model kind {shape['kind']!r}")


def source_flops(row: dict, report) -> float:
    """FLOPs of one step as the source counts them."""
    shape, batch, seq = row["model"], row["global_batch"], row["seq"]
    if row["flops"] == "megatron_hardware":  # Narayanan et al. 2021 sec. 5.1, the recomputed forward included
        return megatron_flops(batch, seq, shape["layers"], shape["hidden"], shape["vocab"], recompute=True)
    if row["flops"] == "megatron_model":  # Megatron-LM's num_floating_point_operations (2024): no recompute
        return megatron_flops(batch, seq, shape["layers"], shape["hidden"], shape["vocab"], recompute=False)
    if row["flops"] == "model":  # forward + backward of the model, from the analysed graph (no recompute)
        return float(report.flops_at(batch=batch, seq=seq))
    raise ValueError(f"row {row['id']}: unknown FLOP count {row['flops']!r}")


def world_of(row: dict, efficiency: Efficiency | None = None) -> World:
    """The row's cluster: 8 devices per node, the links of that device's node (ir/world.py NODE_LINKS).
    A row with ``"memory_check": false`` ran with memory savings Xirang does not model (Llama 3: optimizer
    state sharded over dp, sequence parallelism): its devices are given 16x their memory so the search
    prices the published configuration's time instead of refusing it; nothing else changes."""
    device = device_spec(row["device"])
    if not row.get("memory_check", True):
        device = replace(device, memory_bytes=16 * device.memory_bytes)
    if efficiency is not None:
        device = replace(device, efficiency=efficiency)
    return World.uniform(row["gpus"] // GPUS_PER_NODE, GPUS_PER_NODE, device)


def parse_pin(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` of ``--pin``: the value as JSON where it parses (2, false, null), else the text ("full")."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--pin takes NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def price_row(row: dict, report, *, world: World | None = None, **overrides) -> dict:
    """Pin the row's configuration (``overrides`` replace pins) and compare with the published figures."""
    model, tokens = model_of(row)
    world = world or world_of(row)
    pins = {name: row.get(name) for name in ("tp", "pp", "micro_batch", "schedule", "virtual_stages", "recompute",
                                             "offload", "sequence_parallel", "zero_stage", "tp_overlap")}
    pins.update(overrides)
    started = time.perf_counter()
    plan = xirang.plan(model, world=world, example_kwargs=tokens, analysed=report,
                       global_batch=row["global_batch"], seq=row["seq"], **pins)
    flops = source_flops(row, report)
    published = row["published"]
    published_step = published.get("step_seconds") or flops / (published["tflops_per_gpu"] * 1e12 * row["gpus"])
    published_tflops = published.get("tflops_per_gpu") or flops / published_step / row["gpus"] / 1e12
    breakdown = dict(plan.predicted.breakdown)
    if row.get("framework", "xirang") == "deepspeed_pipe":
        breakdown = deepspeed_pipe_step(plan, report, world, row["seq"])
    elif row.get("framework", "xirang") != "xirang":
        raise ValueError(f"row {row['id']}: unknown framework {row['framework']!r}")
    predicted_step = breakdown.pop("step") if "step" in breakdown else plan.predicted.step_seconds
    predicted_tflops = flops / predicted_step / row["gpus"] / 1e12
    return {"id": row["id"], "device": row["device"], "gpus": row["gpus"], "plan": describe(plan),
            "published_tflops": published_tflops, "predicted_tflops": predicted_tflops,
            "published_step_s": published_step, "predicted_step_s": predicted_step,
            "error": predicted_tflops / published_tflops - 1,
            "breakdown": breakdown, "plan_seconds": time.perf_counter() - started,
            "memory_gib": max(plan.predicted.memory_bytes_per_device) / 2**30}


def own_plan(row: dict, report, world: World) -> dict:
    """The planner's own plan for the row's model, cluster, global batch and sequence (nothing pinned), its
    step and TFLOP/s counted as the row's source counts them."""
    model, tokens = model_of(row)
    plan = xirang.plan(model, world=world, example_kwargs=tokens, analysed=report,
                       global_batch=row["global_batch"], seq=row["seq"])
    step = plan.predicted.step_seconds
    return {"plan": describe(plan), "step_s": step,
            "tflops": source_flops(row, report) / step / row["gpus"] / 1e12}


def deepspeed_pipe_step(plan, report, world: World, seq: int) -> dict:
    """The step of ``plan`` run by DeepSpeed's PipelineEngine (1F1B ``TrainSchedule``), in seconds by cause.

    Stage forward and backward per micro-batch are the plan's own (``reprice.stage_predictions``: its
    units' compute and tp collectives, the backward with recompute). With tp > 1 the engine partitions
    what crosses a cut over the tp group (its ``is_pipe_partitioned`` / ``is_grad_partitioned``,
    PartitionedTensor): each tp rank sends 1/tp of the activation or gradient to its peer on the other
    stage, and the receiver all-gathers it on its tp group before the forward or backward that reads it;
    the sender keeps only its 1/tp of the output it sent and all-gathers it back before that output's
    backward (``_exec_backward_pass``: ``part_output.full()``). Each gather (``PartitionedTensor.full``)
    also copies what it gathers ``DEEPSPEED_FULL_COPY_FACTOR`` times through memory; it is priced into
    the forward or backward that waits for it. Every backward also adds the stage's weight gradients into
    their 16-bit ``.grad`` (``cost_model.gradient_accumulation_seconds``; the first micro-batch's backward,
    which only stores them, is priced the same: one addition per stage, 16 ms on an MT-NLG stage).
    ``blocking_1f1b_stage_ends`` gives when each stage ends its last backward; after it, one after
    another on that stage: the tied-embedding sum (the plan's ``tied_sum``;
    DeepSpeed's ReduceTiedGrads) and ReduceGrads: its 16-bit gradients in buckets of
    ``DEEPSPEED_BUCKET_ELEMENTS``, each flattened into one buffer, divided by dp, all-reduced on the dp
    group and copied back (``allreduce_bucket``: ``DEEPSPEED_BUCKET_COPY_BYTES`` per element through
    memory). OptimizerStep then starts on every stage together: its overflow check and gradient norm
    all-reduce one scalar each on the dp group and on the whole pipeline's model-parallel group (every
    stage and tp rank of the replica: ``ds_model_proc_group``), so the slowest stage's ReduceGrads sets
    their start; then the Adam step over the stage's parameters (``cost_model.optimizer_step_seconds``).
    Terms: compute and tp as the plan's; p2p the schedule's end with transfers and gathers less without;
    dp the tail after the latest stage's last backward; bubble the rest."""
    mesh, m = plan.mesh, plan.num_micro_batches
    split = SplitPricer(report.graph_module, world, precision=plan.precision).price(
        mesh.tp, tuple(range(mesh.tp)), plan.micro_batch, seq, sequence_parallel=bool(plan.sequence_parallel))
    bounds, forward, backward, _ = stage_predictions(plan, split)
    leads = [mesh.rank_of(dp=0, pp=s, tp=0) for s in range(mesh.pp)]  # tp rank 0 of each stage of replica 0
    cut = [split.units[stop - 1].cut_bytes_after for _, stop in bounds[:-1]]
    transfer = [collective_cost("send", nbytes / mesh.tp, (leads[s], leads[s + 1]), world).seconds
                for s, nbytes in enumerate(cut)]
    device = world.nodes[0].device
    params = [sum(u.params_local for u in split.units[start:stop]) for start, stop in bounds]
    # the engine leaves the 16-bit gradients in .grad until ReduceGrads: each backward adds into them
    accumulate = [gradient_accumulation_seconds(count, GRAD_BYTES, device) for count in params]
    backward = [b + a for b, a in zip(backward, accumulate)]
    quiet = max(blocking_1f1b_stage_ends(forward, backward, [0.0] * len(transfer), m))

    def full(nbytes: float, stage: int) -> float:  # PartitionedTensor.full(): the gather and its copies
        return (collective_cost("all_gather", nbytes, mesh.group("tp", leads[stage]), world).seconds
                + compute_time(0.0, nbytes * DEEPSPEED_FULL_COPY_FACTOR, device, "fp32", is_matmul=False))
    for s, nbytes in enumerate(cut):  # the activation gathered by its receiver; the output and gradient by s
        forward[s + 1] += full(nbytes, s + 1)
        backward[s] += 2 * full(nbytes, s)
    ends = blocking_1f1b_stage_ends(forward, backward, transfer, m)
    tied = plan.predicted.breakdown.get("tied_sum", 0.0)
    reduced, steps = [], []
    for s, count in enumerate(params):
        buckets, rest = divmod(count, DEEPSPEED_BUCKET_ELEMENTS)
        group = mesh.group("dp", leads[s])
        sync = buckets * collective_cost("all_reduce", DEEPSPEED_BUCKET_ELEMENTS * GRAD_BYTES, group, world).seconds + (
            collective_cost("all_reduce", rest * GRAD_BYTES, group, world).seconds if rest else 0.0)
        copies = compute_time(0.0, count * DEEPSPEED_BUCKET_COPY_BYTES, device, "fp32", is_matmul=False)
        reduced.append(ends[s] + (tied if s in (0, mesh.pp - 1) else 0.0) + sync + copies)
        steps.append(optimizer_step_seconds(count, device))
    replica = tuple(mesh.rank_of(dp=0, pp=s, tp=t) for s in range(mesh.pp) for t in range(mesh.tp))
    scalars = 2 * (collective_cost("all_reduce", 4, mesh.group("dp", leads[0]), world).seconds
                   + collective_cost("all_reduce", 4, replica, world).seconds)
    step = max(reduced) + scalars + max(steps)
    planned = plan.predicted.breakdown
    compute, tp = planned["compute"] + m * max(accumulate), planned["tp_comm"]
    p2p, tail = max(ends) - quiet, step - max(ends)
    return {"step": step, "compute": compute, "tp_comm": tp, "pp_p2p": p2p, "dp_exposed": tail,
            "pp_bubble": step - compute - tp - p2p - tail, "offload": 0.0}


def describe(plan) -> str:
    mesh = plan.mesh
    schedule = plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    extras = (" sp" if plan.sequence_parallel else "") + (f" z{plan.zero_stage}" if plan.zero_stage else "") \
        + (f" ov{plan.tp_overlap}" if plan.tp_overlap else "")  # tp collectives overlapped, in that many chunks
    return f"dp{mesh.dp} tp{mesh.tp} pp{mesh.pp} b{plan.micro_batch} {schedule} rc={plan.recompute}{extras}"


def analyse(row: dict, cache: dict):
    key = json.dumps([row["model"], row["seq"]], sort_keys=True)
    if key not in cache:
        model, tokens = model_of(row)
        cache[key] = xirang.analyze(model, example_kwargs=tokens)
    return cache[key]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row ids (default: all)")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--efficiency", help="matmul,other,memory for every device instead of each preset's own "
                                             "(e.g. 0.7,0.1,0.35: the A100's, fitted to 2021 runs)")
    parser.add_argument("--own", action="store_true",
                        help="also plan each row with nothing pinned: the planner's own choice beside the published")
    parser.add_argument("--pin", action="append", type=parse_pin, default=[], metavar="NAME=VALUE",
                        help="replace this pin in every row priced (e.g. micro_batch=2); repeatable")
    options = parser.parse_args(argv)
    overrides = dict(options.pin)
    efficiency = Efficiency(*map(float, options.efficiency.split(","))) if options.efficiency else None
    rows = load_rows()
    if options.rows:
        wanted = options.rows.split(",")
        rows = [row for row in rows if row["id"] in wanted]
    header = (f"{'run':<16} {'device':<9} {'gpus':>5} | {'plan (published config pinned)':<44} | "
              f"{'paper':>6} {'priced':>7} {'err':>7} | {'step s':>7} {'priced':>7} | "
              f"{'compute':>7} {'tp':>6} {'bubble':>6} {'p2p':>6} {'dp':>6}")
    print("TFLOP/s per GPU as each source counts them; err = priced / paper - 1; terms: seconds per step")
    if overrides:
        print("not the published configurations: pins replaced in every row: "
              + ", ".join(f"{name}={value!r}" for name, value in overrides.items()))
    print(header)
    print("-" * len(header))
    cache, results = {}, []
    for row in rows:
        outcome = price_row(row, analyse(row, cache), world=world_of(row, efficiency), **overrides)
        b = outcome["breakdown"]
        plan_text = outcome["plan"] + (" ds" if row.get("framework") == "deepspeed_pipe" else "")
        print(f"{row['id']:<16} {row['device']:<9} {row['gpus']:>5} | {plan_text:<44} | "
              f"{outcome['published_tflops']:>6.0f} {outcome['predicted_tflops']:>7.1f} {outcome['error']:>+7.1%} | "
              f"{outcome['published_step_s']:>7.2f} {outcome['predicted_step_s']:>7.2f} | "
              f"{b['compute']:>7.2f} {b['tp_comm']:>6.2f} {b['pp_bubble']:>6.2f} {b['pp_p2p']:>6.2f} "
              f"{b['dp_exposed']:>6.2f}", flush=True)
        if options.own:
            world = world_of(row, efficiency)
            outcome["own"] = own_plan(row, analyse(row, cache), world)
            own = outcome["own"]
            print(f"{'':<16} {'':<9} {'':>5} | own: {own['plan']:<39} | {'':>6} {own['tflops']:>7.1f} "
                  f"{outcome['predicted_step_s'] / own['step_s']:>6.2f}x| {'':>7} {own['step_s']:>7.2f} |", flush=True)
        results.append(outcome)
    errors = [abs(r["error"]) for r in results]
    by_device = {}
    for r in results:
        by_device.setdefault(r["device"], []).append(abs(r["error"]))
    print(f"worst |err| {max(errors):.1%} (target 15%), median {statistics.median(errors):.1%} (target 7%), "
          f"{sum(e <= 0.15 for e in errors)} of {len(errors)} within 15%; " + "; ".join(
              f"{device}: worst {max(errs):.1%}, median {statistics.median(errs):.1%}, "
              f"{sum(e <= 0.15 for e in errs)} of {len(errs)} within 15%" for device, errs in by_device.items()))
    if options.own:
        print("own: the planner's plan with nothing pinned; its TFLOP/s; the published configuration's priced step "
              "over the own plan's (>1: the planner finds a faster plan)")
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
