"""Published Mixture-of-Experts training runs priced with their configuration pinned, beside Xirang's own plan.

Each row of benchmarks/published_moe_configs.json is a cited MoE training run (model, GPU kind and count,
tp, pp, ep, etp, micro-batch, global batch, schedule, precision; sources inside the JSON). A row that Xirang
can price as published has its configuration pinned in ``xirang.plan`` (tp, pp, ep, cp, micro-batch,
schedule, virtual stages, precision, and ``ep_overlap`` where the source overlaps the expert all-to-alls
with compute (Megatron's batch-level overlap: passes/planning/expert_costs.py); no activation offload,
which none of the sources uses; ZeRO 0, which
ep > 1 requires; routing imbalance 1.0: balanced, what the Megatron-Bridge benchmark rows force, and
Xirang's default, also used for the rows whose run routed naturally, the source giving no measured
imbalance) on a World of the row's device (8 a node, ir/world.py's links), and its
predicted step is set beside the published one. The same model, world and batch is then planned with
nothing pinned: Xirang's own plan, its predicted step, mesh and whether it fits.

A row is not priced, and the table says why, where Xirang cannot run it as published: a precision Xirang
does not price (``xirang.ir.plan.PRECISIONS``: FP8 runs), a device with no preset (H800), a schedule that is
not Xirang's (DualPipe), expert tensor parallelism different from tp (Xirang's experts follow tp), FSDP
beside ep (Xirang shards parameters or optimizer state by ZeRO only at ep 1), a source
whose degrees contradict each other (``conflict``: which configuration ran is not known), or a published figure
that is an average over a whole pre-training rather than a step.

Published step: from tokens/s/GPU where the source gives it (global batch x seq / (tokens/s/GPU x GPUs):
no FLOP count needed), else the stated step time, else TFLOP/s per GPU converted with the model FLOPs
Xirang counts on the analysed graph (``flops_at``: forward + backward, no recompute, attention included).
ratio = predicted step / published step (> 1: predicted too slow). Predicted TFLOP/s per GPU use the same
model FLOPs; beside them, published TFLOP/s over those implied by the published step and Xirang's count
show how the source's FLOP count compares with Xirang's.

Attention: each model is priced as its Hugging Face class builds it. GPT-OSS has no SDPA path there (its
attention sinks run in the eager softmax, 64 x seq x seq logits written per layer), where the published
runs use a fused kernel (Megatron-Bridge builds GPT-OSS with Transformer Engine attention,
``softmax_type = "learnable"``: src/megatron/bridge/models/gpt_oss/gpt_oss_bridge.py:86 at 067f987d).
``--fused-attention`` prices such a model with torch's SDPA instead (the sinks, one logit per head and
query, left out; sliding-window layers priced as full attention with a mask): a variant of the model, not
of the cost model, recorded as its own run.

Memory: Megatron runs shard the optimizer state over dp (distributed optimizer), which Xirang refuses
beside ep > 1; a pinned configuration that does not fit 90% of the device as Xirang holds it is priced
with the memory check lifted (device memory x16, time unchanged) and marked so.

    python benchmarks/published_moe_runs.py [--rows ID,ID] [--no-free] [--fused-attention] [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import xirang  # noqa: E402
from xirang.ir.device import DEVICE_PRESETS, device_spec  # noqa: E402
from xirang.ir.errors import XirangError  # noqa: E402
from xirang.ir.plan import PRECISIONS, SCHEDULES  # noqa: E402
from xirang.ir.world import World  # noqa: E402
from xirang.passes.planning.plan_splits import SplitPricer  # noqa: E402

RUNS = Path(__file__).with_name("published_moe_configs.json")
GPUS_PER_NODE = 8  # DGX H100 and the DeepSeek-V3 cluster alike (sec. 3.1 of its report)
TARGET = 0.15
MEMORY_LIFT = 16  # device memory multiplied by this where the pinned configuration does not fit as Xirang holds it


def load_rows(path: Path = RUNS) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def unpriceable(row: dict) -> list[str]:
    """Why ``row`` cannot be priced as published (empty: it can)."""
    why = []
    if row["device"] not in DEVICE_PRESETS:
        why.append(f"device {row['device']} has no preset in ir/device.py")
    if row["precision"] not in PRECISIONS:
        why.append(f"{row['precision']} matmuls (Xirang prices {'/'.join(PRECISIONS)})")
    if row.get("schedule") is not None and row["schedule"] not in SCHEDULES:
        why.append(f"schedule {row['schedule']} is not one of Xirang's ({', '.join(SCHEDULES)})")
    etp = row.get("etp")
    if etp is not None and etp != row.get("tp"):
        why.append(f"expert tensor parallelism etp {etp} != tp {row.get('tp')} (Xirang's experts follow tp)")
    if (row.get("fsdp") or 0) > 1 and (row.get("ep") or 1) > 1:
        why.append(f"FSDP over {row['fsdp']} ranks (parameters sharded) beside ep {row['ep']} (Xirang plans ZeRO only "
                   "at ep 1)")
    if (row.get("cp") or 1) > 1:
        why.append(f"cp {row['cp']} beside ep (refused by Xirang)")
    if row.get("conflict"):
        why.append("the source's configuration is inconsistent: " + row["conflict"])
    published = row["published"]
    if not any(key in published for key in ("tokens_per_sec_per_gpu", "step_seconds", "tflops_per_gpu")):
        why.append("the published figure (" + ", ".join(published) + ") is an average over the whole "
                   "pre-training, not a step")
    return why


def recompute_pin(row: dict) -> str:
    """Xirang's recompute mode for the row: 'full' where the source recomputes whole layers, else 'none'.
    A selective recompute of norms and activations (Megatron's 'layernorm', 'moe_act' modules) is cheap
    memory-bound work that Xirang's 'selective' (attention core) is not: priced as 'none'."""
    text = (row.get("recompute") or "").lower()
    return "full" if text.startswith("full") else "none"


def pins_of(row: dict) -> dict:
    """The published configuration as ``xirang.plan`` pins."""
    pp = row["pp"]
    schedule = row.get("schedule") or "1f1b"
    pins = {"tp": row["tp"], "pp": pp, "ep": row["ep"], "cp": row.get("cp") or 1, "micro_batch": row["micro_batch"],
            "schedule": schedule, "precision": row["precision"], "recompute": recompute_pin(row), "offload": "none",
            "zero_stage": 0, "routing_imbalance": 1.0, "ep_overlap": bool(row.get("ep_overlap"))}
    if schedule == "interleaved":
        pins["virtual_stages"] = row["virtual_stages"]
    return {name: value for name, value in pins.items() if value is not None}


def published_step(row: dict, flops: float | None) -> tuple[float, str]:
    """The published step in seconds and what it was read from (``flops``: the step's model FLOPs as Xirang
    counts them, needed only where the source gives TFLOP/s alone)."""
    published, gpus = row["published"], row["gpus"]
    tokens = row["global_batch"] * row["seq"]
    if "tokens_per_sec_per_gpu" in published:
        return tokens / (published["tokens_per_sec_per_gpu"] * gpus), "tokens/s/GPU"
    if "step_seconds" in published:
        return float(published["step_seconds"]), "step time"
    if "tflops_per_gpu" in published and flops:
        return flops / (published["tflops_per_gpu"] * 1e12 * gpus), "TFLOP/s/GPU (Xirang's model FLOPs)"
    raise ValueError(f"row {row['id']}: no step figure in {sorted(published)}")


def published_text(row: dict) -> str:
    """The row's figure as the source states it, short."""
    published = row["published"]
    if "tokens_per_sec_per_gpu" in published:
        text = f"{published['tokens_per_sec_per_gpu']:g} tok/s/GPU"
    elif "step_seconds" in published:
        text = f"{published['step_seconds']:g} s/step"
    elif "tflops_per_gpu" in published:
        text = f"{published['tflops_per_gpu']:g} TFLOP/s/GPU"
    elif "gpu_hours_per_trillion_tokens" in published:
        text = f"{published['gpu_hours_per_trillion_tokens'] / 1e3:g}K GPU-h/T tokens"
    else:
        text = ", ".join(published)
    return ("~" if published.get("approximate") else "") + text


def model_of(row: dict, batch: int = 2, fused_attention: bool = False):
    """The row's model on meta and example inputs (batch 2: a size-1 dim would be traced as a constant).
    ``fused_attention``: a model whose class runs eager attention is switched to torch's SDPA (see the
    module docstring); returns whether it was."""
    shape = row["model"]
    if shape["kind"] != "catalog":
        raise ValueError(f"row {row['id']}: unknown model kind {shape['kind']!r}")
    module, _, factory = shape["factory"].partition(":")
    model, tokens = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), factory)(
        batch=batch, seq=row["seq"])
    switched = False
    config = getattr(model, "config", None)
    if fused_attention and config is not None and getattr(config, "_attn_implementation", None) == "eager":
        config._attn_implementation = "sdpa"
        switched = True
    return model, tokens, switched


def world_of(row: dict, memory_lift: int = 1) -> World:
    device = device_spec(row["device"])
    if memory_lift != 1:
        device = replace(device, memory_bytes=memory_lift * device.memory_bytes)
    return World.uniform(row["gpus"] // GPUS_PER_NODE, GPUS_PER_NODE, device)


def describe(plan) -> str:
    mesh = plan.mesh
    schedule = plan.schedule + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    extras = (" sp" if plan.sequence_parallel else "") + (f" z{plan.zero_stage}" if plan.zero_stage else "")
    return (f"dp{mesh.dp} tp{mesh.tp} pp{mesh.pp} ep{getattr(mesh, 'ep', 1)} b{plan.micro_batch} {schedule} "
            f"rc={plan.recompute}{extras}")


def _plan(model, tokens, report, row, world, pins):
    return xirang.plan(model, world=world, example_kwargs=tokens, analysed=report,
                       global_batch=row["global_batch"], seq=row["seq"], **pins)


def price_row(row: dict, model, tokens, report) -> dict:
    """The published configuration pinned: predicted step against the published one."""
    pins = pins_of(row)
    flops = float(report.flops_at(batch=row["global_batch"], seq=row["seq"]))
    step, read_from = published_step(row, flops)
    started, lifted = time.perf_counter(), False
    plan_world = world_of(row)
    try:
        plan = _plan(model, tokens, report, row, plan_world, pins)
    except XirangError as error:
        if "fits device memory" not in str(error):
            raise
        plan_world, lifted = world_of(row, MEMORY_LIFT), True
        plan = _plan(model, tokens, report, row, plan_world, pins)
    predicted = plan.predicted.step_seconds
    published_tflops = row["published"].get("tflops_per_gpu")
    # the experts' matmuls' share of one micro-batch's priced compute, all units (forward + backward)
    split = SplitPricer(report.graph_module, plan_world, precision=plan.precision).price(
        plan.mesh.tp, tuple(range(plan.mesh.tp)), plan.micro_batch, row["seq"],
        sequence_parallel=bool(plan.sequence_parallel))
    expert_share = (sum(u.expert_seconds for u in split.units)
                    / sum(u.forward_seconds + u.backward_seconds for u in split.units))
    return {"pins": pins, "plan": describe(plan), "published_step_s": step, "published_from": read_from,
            "predicted_step_s": predicted, "ratio": predicted / step,
            "predicted_tflops": flops / predicted / row["gpus"] / 1e12,
            "published_tflops": published_tflops,
            "flop_count_ratio": (published_tflops * 1e12 * row["gpus"] * step / flops) if published_tflops else None,
            "model_flops": flops, "memory_check_lifted": lifted, "expert_matmul_share": expert_share,
            "memory_gib": max(plan.predicted.memory_bytes_per_device) / 2**30,
            "breakdown": dict(plan.predicted.breakdown), "plan_seconds": time.perf_counter() - started}


def free_plan(row: dict, model, tokens, report) -> dict:
    """Xirang's own plan for the row's model, world and batch: nothing pinned."""
    started = time.perf_counter()
    try:
        plan = _plan(model, tokens, report, row, world_of(row), {})
    except XirangError as error:
        return {"fits": False, "why": str(error).splitlines()[0], "plan_seconds": time.perf_counter() - started}
    return {"fits": True, "plan": describe(plan), "precision": plan.precision,
            "step_s": plan.predicted.step_seconds, "memory_gib": max(plan.predicted.memory_bytes_per_device) / 2**30,
            "breakdown": dict(plan.predicted.breakdown), "plan_seconds": time.perf_counter() - started}


def run_row(row: dict, cache: dict, with_free: bool = True, fused_attention: bool = False) -> dict:
    out = {"id": row["id"], "source": row["source"], "device": row["device"], "gpus": row["gpus"],
           "published": row["published"], "why_not_priced": unpriceable(row)}
    if row["device"] not in DEVICE_PRESETS:
        return out  # neither the published configuration nor a plan of Xirang's: no device to price on
    key = (row["model"]["factory"], row["seq"])
    if key not in cache:
        model, tokens, switched = model_of(row, fused_attention=fused_attention)
        started = time.perf_counter()
        cache.clear()  # one big model in memory at a time
        cache[key] = (model, tokens, switched, xirang.analyze(model, example_kwargs=tokens),
                      time.perf_counter() - started)
    model, tokens, switched, report, analyse_s = cache[key]
    out["analyse_seconds"], out["attention_switched_to_sdpa"] = analyse_s, switched
    out["model_flops"] = float(report.flops_at(batch=row["global_batch"], seq=row["seq"]))
    try:
        out["published_step_s"], out["published_from"] = published_step(row, out["model_flops"])
    except ValueError:
        pass
    if not out["why_not_priced"]:
        try:
            out["priced"] = price_row(row, model, tokens, report)
        except XirangError as error:
            out["why_not_priced"] = ["pinned configuration refused: " + str(error).splitlines()[0]]
    if with_free:
        out["free"] = free_plan(row, model, tokens, report)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row ids (default: all)")
    parser.add_argument("--no-free", action="store_true", help="skip Xirang's own (unpinned) plans")
    parser.add_argument("--fused-attention", action="store_true",
                        help="price models whose class runs eager attention (GPT-OSS) with SDPA instead")
    parser.add_argument("--json", help="write the figures to this file")
    options = parser.parse_args(argv)
    rows = load_rows()
    if options.rows:
        wanted = options.rows.split(",")
        rows = [row for row in rows if row["id"] in wanted]
    print("Published MoE runs: the published configuration pinned (routing balanced, ZeRO 0) against the published "
          "step (from tokens/s/GPU, else the step time, else TFLOP/s/GPU with Xirang's model FLOPs); ratio = predicted "
          "/ published step; TF: TFLOP/s per GPU with Xirang's model FLOPs (forward + backward, no recompute), and "
          "flops = the source's TFLOP/s over those (its FLOP count / Xirang's); own plan: Xirang's plan with nothing "
          "pinned (bf16) for the same model, world and batch")
    header = (f"{'run':<32} {'gpus':>5} {'published':>22} {'step s':>7} | {'pinned plan':<44} {'step s':>7} "
              f"{'ratio':>6} | {'TF':>5} {'flops':>5} | {'own plan':<46} {'step s':>7} {'fits':>4}")
    print(header)
    print("-" * len(header))
    cache, results = {}, []
    for row in rows:
        outcome = run_row(row, cache, with_free=not options.no_free, fused_attention=options.fused_attention)
        results.append(outcome)
        free = outcome.get("free")
        own = ("-", "-", "-") if free is None else (
            (free["plan"], f"{free['step_s']:.2f}", "yes") if free["fits"] else ("no plan fits", "-", "no"))
        step = outcome.get("published_step_s")
        lead = f"{row['id']:<32} {row['gpus']:>5} {published_text(row):>22} {f'{step:.2f}' if step else '-':>7}"
        priced = outcome.get("priced")
        if priced:
            flops = f"{priced['flop_count_ratio']:.2f}" if priced["flop_count_ratio"] else "-"
            plan_text = priced["plan"] + (" mem*" if priced["memory_check_lifted"] else "") + (
                " sdpa" if outcome["attention_switched_to_sdpa"] else "")
            print(f"{lead} | {plan_text:<44} {priced['predicted_step_s']:>7.2f} {priced['ratio']:>6.3f} | "
                  f"{priced['predicted_tflops']:>5.0f} {flops:>5} | {own[0]:<46} {own[1]:>7} {own[2]:>4}", flush=True)
            print(f"{'':<32}   pinned plan's step by cause (s): " + ", ".join(
                f"{name} {seconds:.2f}" for name, seconds in priced["breakdown"].items() if seconds >= 0.005)
                + f"; the experts' matmuls are {priced['expert_matmul_share']:.0%} of a micro-batch's priced compute")
        else:
            print(f"{lead} | {'not priced (below)':<44} {'':>7} {'':>6} | {'':>5} {'':>5} | "
                  f"{own[0]:<46} {own[1]:>7} {own[2]:>4}", flush=True)
            for reason in outcome["why_not_priced"]:
                print(f"{'':<32}   not priced: {reason}")
        if free and not free["fits"]:
            print(f"{'':<32}   own plan: {free['why']}")
        if free is None and row["device"] not in DEVICE_PRESETS:
            print(f"{'':<32}   own plan: none (no {row['device']} preset to plan on)")
    priced = [r["priced"] for r in results if r.get("priced")]
    within = sum(abs(p["ratio"] - 1) <= TARGET for p in priced)
    print(f"priced {len(priced)} of {len(results)} rows; within {TARGET:.0%}: {within}"
          + ("; ratios " + ", ".join(f"{p['ratio']:.3f}" for p in priced) if priced else ""))
    if any(p["memory_check_lifted"] for p in priced):
        print(f"mem*: the pinned configuration does not fit 90% of the device as Xirang holds it (no optimizer "
              f"sharding beside ep); priced with {MEMORY_LIFT}x device memory, time unchanged")
    if any(r.get("attention_switched_to_sdpa") for r in results):
        print("sdpa: the model's eager attention (attention sinks) priced as torch's SDPA (--fused-attention): "
              "sinks left out, sliding-window layers as full attention with a mask")
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
