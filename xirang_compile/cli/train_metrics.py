"""What ``xirang train`` records every step: one JSON object a line (``--metrics FILE``, by default
``metrics.jsonl`` in the run's folder) and, with the ``tensorboard`` extra, TensorBoard scalars
(``--tensorboard DIR``). Rank 0 writes; every rank hands in its memory. ``python -m xirang.cli.train_metrics
RUN/metrics.jsonl metrics.png`` draws a file (``draw_metrics``).

A line (``json.loads`` of each; a non-finite number, a NaN loss or an infinite norm, is written null):

    step                 the optimizer step, from 1
    loss                 the global batch's mean loss
    lr                   the learning rate the step used
    grad_norm            the whole model's gradient norm before clipping (codegen/runtime/data_parallel/grad_norm.py)
    stepped              false where a non-finite norm skipped the optimizer step (--clip)
    tokens_per_s         global batch tokens / step_s
    step_s               the step measured on rank 0: batch, train_step, clipping, the optimizer
    predicted_step_s     the plan's predicted step; ``predicted_by`` says priced on what (a preset or
                         this machine's calibration), ``step_over_predicted`` is step_s / predicted_step_s
    model_flops          forward + backward FLOPs of one step of the model at the global batch, counted
                         by the analysis (``AnalysisReport.flops``: recompute not counted, as MFU is)
    mfu                  model FLOP utilisation: model_flops / (step_s x peak_flops_per_s)
    peak_flops_per_s     the sum over ranks of each rank's device peak at the plan's precision (the
                         World the plan was priced on: a preset's datasheet figure, or a calibration's
                         measured matmul rate); ``peak`` says which
    memory_bytes         per rank: the CUDA allocator's peak during the step (``max_memory_allocated``,
                         reset each step) on a GPU, the process's peak resident set (``ru_maxrss``,
                         never reset) on the CPU; ``memory`` says which
    time                 seconds since the epoch at the step's end

The peak, the prediction and the memory measure are in every line so that a line can be read alone.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from xirang.ir.errors import XirangError

TENSORBOARD_HINT = 'pip install "xirang[tensorboard]" (or pip install tensorboard)'


def require_tensorboard(option: str = "--tensorboard"):
    """torch's SummaryWriter, or a XirangError saying how to install what it needs."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs the package, not only torch)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise XirangError(f"{option} writes TensorBoard event files, which needs the tensorboard package "
                          f"(not installed)", where=option, hint=TENSORBOARD_HINT) from error
    return SummaryWriter


@dataclass(frozen=True)
class RunFacts:
    """What each line repeats: the step's model FLOPs, the peak it is measured against, the prediction."""

    model_flops: float
    peak_flops_per_s: float
    peak: str
    predicted_step_s: float
    predicted_by: str
    tokens_per_step: int


def peak_of(world, precision: str) -> tuple[float, str]:
    """(FLOP/s, what it is) summed over the World's ranks at ``precision``: each device's peak (a preset's
    datasheet figure, or a calibration's measured matmul rate)."""
    devices = [world.device_of(rank) for rank in range(world.size)]
    per_kind = {device.name: device.peak(precision) for device in devices}
    source = ("the calibration's measured matmul rate" if world.calibration is not None
              else "the preset's datasheet peak")
    kinds = ", ".join(f"{name} {peak / 1e12:.3g}" for name, peak in per_kind.items())
    return (math.fsum(device.peak(precision) for device in devices),
            f"{kinds} TFLOP/s per rank at {precision} x {world.size} ranks: {source}")


def model_flops(model, example_kwargs: dict, global_batch: int) -> float:
    """Forward + backward FLOPs of one step at ``global_batch`` samples, from the analysis's symbolic count."""
    from xirang.analyze import analyze
    report = analyze(model, example_kwargs=example_kwargs)
    return float(report.flops_at(batch=global_batch) if "batch" in report.symbols else report.flops)


def memory_measure(device) -> str:
    if torch.device(device).type == "cuda":
        return "CUDA allocator's peak during the step (torch.cuda.max_memory_allocated, reset each step)"
    return "process peak resident set (ru_maxrss, never reset)"


def step_began(device) -> None:
    """Start the step's memory window (the CUDA allocator's peak; a process's RSS peak cannot be reset)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_bytes(device) -> int:
    """This rank's figure of ``memory_measure(device)``."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def gather_memory(device, world: int) -> list[int]:
    """Every rank's ``memory_bytes`` (a collective over the default group: every rank calls it)."""
    mine = memory_bytes(device)
    if world == 1:
        return [mine]
    import torch.distributed as dist
    local = torch.tensor([mine], dtype=torch.int64, device=device)
    every = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(every, local)
    return [int(t.item()) for t in every]


def _finite(value) -> Optional[float]:
    return None if value is None or not math.isfinite(value) else float(value)


class MetricsWriter:
    """Rank 0's writer: a JSONL line per step and TensorBoard scalars. ``resume_at``: the step a resumed
    run continues from; the file keeps its lines up to it (steps after the checkpoint are run again)."""

    def __init__(self, path, facts: RunFacts, *, device, tensorboard=None, resume_at: Optional[int] = None):
        self.facts, self.memory = facts, memory_measure(device)
        self.path = None if path is None else Path(path)
        self.file = None
        if self.path is not None:
            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_at] \
                if resume_at is not None and self.path.is_file() else []
            self.file = open(self.path, "w", encoding="utf-8")
            self.file.writelines(json.dumps(r, allow_nan=False) + "\n" for r in kept)
        self.board = None if tensorboard is None else require_tensorboard()(log_dir=str(tensorboard))

    def record(self, *, step: int, loss: float, lr: float, step_s: float, grad_norm: Optional[float],
               stepped: bool, memory: list, note: Optional[str] = None) -> dict:
        """One step's line; ``note``: what the step was besides its numbers (a loss spike's report)."""
        facts = self.facts
        line = {"step": step, "loss": _finite(loss), "lr": lr, "grad_norm": _finite(grad_norm), "stepped": stepped,
                "tokens_per_s": facts.tokens_per_step / step_s, "step_s": step_s,
                "predicted_step_s": facts.predicted_step_s,
                "step_over_predicted": step_s / facts.predicted_step_s if facts.predicted_step_s else None,
                "predicted_by": facts.predicted_by, "model_flops": facts.model_flops,
                "mfu": facts.model_flops / (step_s * facts.peak_flops_per_s),
                "peak_flops_per_s": facts.peak_flops_per_s, "peak": facts.peak, "memory_bytes": list(memory),
                "memory": self.memory, "time": time.time(), "note": note}
        if self.file is not None:
            self.file.write(json.dumps(line, allow_nan=False) + "\n")
            self.file.flush()
        if self.board is not None:
            for name in ("loss", "lr", "grad_norm", "tokens_per_s", "step_s", "predicted_step_s", "mfu"):
                if line[name] is not None:
                    self.board.add_scalar(f"train/{name}", line[name], step)
            for rank, value in enumerate(memory):
                self.board.add_scalar(f"memory_mib/rank{rank}", value / 2**20, step)
        return line

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()


def read_metrics(path) -> list[dict]:
    """The lines of a metrics file, in order."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def draw_metrics(records: list[dict], path, title: str = "xirang train") -> Path:
    """Every metric against the step as a PNG (matplotlib, the ``viz`` extra): loss, learning rate,
    gradient norm, tokens/s, MFU, step time measured against predicted, memory per rank, and the facts."""
    from xirang.codegen.viz.plotting import new_figure
    figure = new_figure(1600, 760, "the metrics picture")
    steps = [r["step"] for r in records]
    panels = [("loss", "loss"), ("learning rate", "lr"), ("gradient norm (before clipping)", "grad_norm"),
              ("tokens/s (global batch)", "tokens_per_s"), ("MFU", "mfu")]
    for index, (label, key) in enumerate(panels):
        axes = figure.add_subplot(2, 4, index + 1)
        values = [r[key] if r[key] is not None else math.nan for r in records]
        axes.plot(steps, values, marker="o", markersize=3, color="#1f5fa8", linewidth=1.4)
        axes.set_title(label, fontsize=10)
    axes = figure.add_subplot(2, 4, 6)
    axes.plot(steps, [r["step_s"] * 1e3 for r in records], marker="o", markersize=3, label="measured")
    axes.plot(steps, [r["predicted_step_s"] * 1e3 for r in records], linestyle="--", label="plan's prediction")
    axes.set_yscale("log")
    axes.set_title("step time (ms)", fontsize=10)
    axes.legend(fontsize=8)
    axes = figure.add_subplot(2, 4, 7)
    for rank in range(len(records[0]["memory_bytes"])):
        axes.plot(steps, [r["memory_bytes"][rank] / 2**20 for r in records], marker="o", markersize=3,
                  label=f"rank {rank}")
    axes.set_title("memory per rank (MiB)", fontsize=10)
    axes.legend(fontsize=8)
    for axes in figure.axes:
        axes.set_xlabel("step", fontsize=9)
        axes.grid(alpha=0.3)
    notes = figure.add_subplot(2, 4, 8)
    notes.axis("off")
    last = records[-1]
    text = (f"prediction: {last['predicted_by']}\n\nMFU peak: {last['peak']}\n\nmemory: {last['memory']}\n\n"
            f"model FLOPs/step {last['model_flops']:.3g}")
    notes.text(0, 1, _wrap(text, 52), va="top", fontsize=8, family="monospace")
    figure.suptitle(title, fontsize=12)
    figure.tight_layout()
    figure.savefig(path)
    return Path(path)


def _wrap(text: str, width: int) -> str:
    import textwrap
    return "\n".join("\n".join(textwrap.wrap(part, width)) if part else "" for part in text.split("\n"))


def default_metrics_path(run_dir) -> Optional[str]:
    return None if run_dir is None else os.path.join(str(run_dir), "metrics.jsonl")


def main(argv=None) -> int:
    """``python -m xirang.cli.train_metrics RUN/metrics.jsonl metrics.png``: draw a run's metrics file."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m xirang.cli.train_metrics", description=main.__doc__)
    parser.add_argument("metrics", help="the JSONL file xirang train wrote (--metrics, or RUN/metrics.jsonl)")
    parser.add_argument("picture", help="the PNG to draw")
    parser.add_argument("--title", default=None, help="the picture's title (default: the metrics file's path)")
    args = parser.parse_args(argv)
    records = read_metrics(args.metrics)
    if not records:
        print(f"error: {args.metrics} has no lines yet", file=sys.stderr)
        return 2
    print(draw_metrics(records, args.picture, title=args.title or f"xirang train: {args.metrics}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
