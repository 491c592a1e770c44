"""``xirang demo``: the main job. Plan a small GPT for 8 local CPU ranks, show the plan and the pipeline
schedule, train a few steps on a dp × pp × tp plan with real gloo ranks, and show the loss of every
step beside single-device training of the same model on the same batches.

The model is small so the demo runs in a minute or two on a laptop; it is planned as if its sequence
were long (``PLAN_SEQ``) on A100s, so the tensor-split ILP really shards it (at toy sizes keeping every
op replicated is cheaper, and the planner would rightly say so), then trained at a short sequence.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import torch

# The demo's model is the in-repo GPT in examples/, which a checkout has beside xirang_compile/ (the
# install is editable); spawned ranks inherit this path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.gpt import GPTConfig, build_gpt  # noqa: E402

CONFIG = GPTConfig(vocab_size=512, seq_len=64, hidden=64, heads=4, layers=4)
PLAN_SEQ, TRAIN_SEQ, GLOBAL_BATCH, STEPS, LR = 2048, 32, 8, 3, 1e-3


DEMO_AXES = ("dp", "pp", "tp")  # the axes the demo's plan pins; cp and ep wait for their runtimes


def parse_mesh(text: str) -> dict:
    """``--mesh dp=2,pp=2,tp=2`` as ``{"dp": 2, "pp": 2, "tp": 2}`` (an axis left out is 1). The old
    positional ``2x2x2`` (read DPxTPxPP, unlike ``Mesh(dp, pp, tp)``) is refused with its named form."""
    from xirang.ir.errors import XirangError
    example = "e.g. --mesh dp=2,pp=2,tp=2 (8 ranks; an axis left out is 1)"
    parts = text.lower().split("x")
    if "=" not in text and len(parts) == 3 and all(part.strip().isdigit() for part in parts):
        dp, tp, pp = (int(part) for part in parts)
        named = f"write --mesh dp={dp},pp={pp},tp={tp}" if min(dp, tp, pp) >= 1 else example
        raise XirangError(f"--mesh {text!r} is the old positional form (DPxTPxPP); the mesh axes are named now",
                          where="--mesh", hint=named)
    sizes = {}
    for item in text.split(","):
        axis, _, value = item.strip().partition("=")
        axis = axis.strip().lower()
        if axis in ("cp", "ep"):
            raise XirangError(f"--mesh {text!r} asks for {axis}, which the demo does not plan: context and expert "
                              f"parallelism are not yet enacted by the runtime", where="--mesh",
                              hint=f"name only {', '.join(DEMO_AXES)}, {example}")
        if axis not in DEMO_AXES or axis in sizes or not value.strip().isdigit() or int(value) < 1:
            raise XirangError(f"--mesh {text!r}: {item.strip()!r} is not AXIS=N with AXIS one of "
                              f"{', '.join(DEMO_AXES)} (each once) and N at least 1", where="--mesh", hint=example)
        sizes[axis] = int(value)
    return {axis: sizes.get(axis, 1) for axis in DEMO_AXES}


def _model():
    torch.manual_seed(0)
    return build_gpt(CONFIG)


def _batch(step: int) -> dict:
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, TRAIN_SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}


def _optimizer(parameters):
    return torch.optim.AdamW(parameters, lr=LR)


def _train_rank(rank: int, world: int, plan):
    """Losses of every step, and every step's executor timestamps with the rank in front."""
    import xirang
    from xirang.codegen.viz.chrome_trace import with_rank
    compiled = xirang.compile(_model(), world=world, example_kwargs=_batch(0), plan=plan)
    optimizer, losses, records = _optimizer(compiled.parameters()), [], []
    for step in range(STEPS):
        losses.append(compiled.train_step(**_batch(step)).item())
        last = getattr(compiled, "last_step", None)  # a runtime without step records adds no events
        records.append(with_rank(rank, last.timestamps) if last is not None else [])
        optimizer.step()
        optimizer.zero_grad()
    return losses, records


def _train_single_device() -> list[float]:
    model = _model()
    optimizer, losses = _optimizer(model.parameters()), []
    for step in range(STEPS):
        loss = model(**_batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_demo(*, world: int = 8, dp: int = 2, tp: int = 2, pp: int = 2, schedule: str = "1f1b",
             timeline: str | None = "demo_timeline.png", trace: str | None = "demo_trace.json", out=print) -> dict:
    """Plan, show, train on ``world`` local ranks and compare; returns the figures it printed.
    ``timeline``: where to draw the simulated schedule (PNG); ``trace``: where to write what the
    ranks measured (Chrome-trace JSON); None for neither."""
    import xirang
    from xirang.cli.verify import write_trace
    from xirang.codegen.viz.chrome_trace import check_writable
    from xirang.codegen.runtime.executor.schedule_sim import simulate
    from xirang.ir.schedules import build_schedule
    from xirang.codegen.viz.timeline import format_schedule, write_timeline_png

    if trace:
        check_writable(trace)  # before the run, not after it
    started = time.perf_counter()
    out(f"Xirang demo: a {CONFIG.layers}-layer GPT (hidden {CONFIG.hidden}, vocab {CONFIG.vocab_size}) "
        f"on {world} local CPU ranks (gloo), plan dp={dp} x tp={tp} x pp={pp}, {schedule}\n")
    plan = xirang.plan(_model(), world=world, hardware="a100-80g", precision="fp32", example_kwargs=_batch(0),
                       global_batch=GLOBAL_BATCH, seq=PLAN_SEQ, dp=dp, tp=tp, pp=pp, schedule=schedule)
    out(plan.explain())
    chosen = Counter(s.strategy for s in plan.placements.values()
                     if s.strategy != "replicate" and "S(" not in s.strategy and "->" not in s.strategy)
    out("\nSplits the tensor-split ILP chose for the matmuls, attention and loss (count of ops): "
        + ", ".join(f"{name} x{count}" for name, count in sorted(chosen.items())))
    if plan.mesh.pp > 1:
        pipeline = build_schedule(plan.schedule, plan.mesh.pp, plan.num_micro_batches, plan.virtual_stages)
        out(f"\nPipeline schedule ({plan.schedule}, {plan.mesh.pp} stages, {plan.num_micro_batches} micro-batches; "
            f"F = forward, B = backward of a micro-batch):\n{format_schedule(pipeline)}")
        if timeline:
            path = write_timeline_png(simulate(pipeline), timeline)
            out(f"timeline picture: {path}")
    out(f"\nTraining {STEPS} steps on {world} ranks (each rank: trace, shard, emit its program) ...")
    results = xirang.launch(_train_rank, world, args=(plan,), timeout_s=600)
    distributed = [losses for losses, _ in results]
    single = _train_single_device()
    losses = distributed[0]
    out(f"\n{'step':>4} {'single device':>14} {'xirang ' + str(world) + ' ranks':>16} {'|difference|':>13}")
    for step, (want, got) in enumerate(zip(single, losses)):
        out(f"{step:>4} {want:>14.6f} {got:>16.6f} {abs(want - got):>13.2e}")
    agree = all(r == losses for r in distributed)
    worst = max(abs(a - b) for a, b in zip(single, losses))
    out(f"\nevery rank reports the same loss: {agree}; largest difference from single-device: {worst:.2e} "
        f"(fp32); {time.perf_counter() - started:.0f} s in all")
    written = write_trace(trace, [records for _, records in results], plan, world, out=out) if trace else None
    return {"single": single, "distributed": losses, "worst": worst, "ranks_agree": agree,
            "timeline": str(Path(timeline).resolve()) if timeline and plan.mesh.pp > 1 else None,
            "trace": str(written) if written else None}
