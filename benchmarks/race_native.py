"""Xirang against hand-configured PyTorch-native 3D parallelism, step time and loss, on 8 CPU gloo ranks.

The same GPT (examples/gpt.py; untied head, so the native pipeline needs no hand-made tied-weight
sum) is trained from identical weights by
- Xirang: ``xirang.compile`` of a plan pinned to the mesh (dp, tp, pp, schedule), made for "cpu";
- native: benchmarks/native_3d.py, as strong as the native stack allows at every mesh (DTensor tp with
  the embedding and the LM head vocabulary-parallel and the loss under ``loss_parallel``,
  torch.distributed.pipelining cut where the stages' FLOPs balance, DDP where tp = 1 and DDP's
  bucketed, overlapped all-reduce by hand where tp > 1, since DDP does not take DTensors).
  ``--native weak`` races the earlier baseline instead (layers split evenly, embedding and head
  replicated, one flat all-reduce after the backward where dp, tp > 1), ``--native both`` both against
  the same Xirang steps, so the two can be compared.
Both use AdamW. The steps alternate Xirang, native, Xirang, ... so load drift on a shared machine
hits both; every rank waits on a barrier before each step and a step's time is the slowest
rank's. Reported: the median over the steps after the warm-up, their ratio, and the largest
per-step |loss difference|; and the CPU seconds of a step summed over the ranks (``time.process_time``,
every thread of a rank's process, gloo's included): with more ranks than cores that sum, not the
step's critical path, bounds the step, and unlike wall time it barely moves with other load.

    python benchmarks/race_native.py [--meshes 8,1,1 1,1,8:gpipe ...] [--steps N] [--warmup N] [--native strong]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # examples/, benchmarks/

import xirang  # noqa: E402
from benchmarks.native_3d import NativeRun  # noqa: E402
from examples.gpt import GPTConfig, build_gpt  # noqa: E402
from xirang.codegen.runtime.launch.launcher import launch  # noqa: E402
from xirang.ir.errors import XirangError  # noqa: E402
from xirang.ir.placement import PlanShard  # noqa: E402

CONFIG = GPTConfig(vocab_size=4096, seq_len=128, hidden=256, heads=8, layers=8, tie_embeddings=False)
WORLD, GLOBAL_BATCH, PP_MICRO_BATCHES, LR = 8, 16, 4, 1e-3
# (dp, tp, pp, schedule); pp = 1 runs one micro-batch per dp rank
DEFAULT_MESHES = ["8,1,1", "1,1,8:gpipe", "1,1,8:1f1b", "1,2,4:1f1b", "2,2,2:1f1b", "1,8,1"]


def parse_mesh(text: str) -> tuple:
    dims, _, schedule = text.partition(":")
    try:
        dp, tp, pp = (int(x) for x in dims.split(","))
    except ValueError:
        raise XirangError(f"bad mesh {text!r}", where="--meshes",
                          hint="write dp,tp,pp[:gpipe|1f1b], e.g. 1,2,4:1f1b") from None
    if dp * tp * pp != WORLD:
        raise XirangError(f"mesh {text!r} has {dp * tp * pp} ranks, the race runs {WORLD}", where="--meshes",
                          hint=f"pick dp*tp*pp = {WORLD}")
    return dp, tp, pp, schedule or "1f1b"


def micro_batches(mesh) -> int:
    dp, tp, pp, schedule = mesh
    if pp == 1:
        return 1
    # torch's Schedule1F1B refuses fewer micro-batches than stages
    return max(PP_MICRO_BATCHES, pp) if schedule == "1f1b" else PP_MICRO_BATCHES


def model():
    torch.manual_seed(0)
    return build_gpt(CONFIG, device="cpu")


def batch(step: int) -> dict:
    generator = torch.Generator().manual_seed(1000 + step)
    shape = (GLOBAL_BATCH, CONFIG.seq_len)
    return {"input_ids": torch.randint(0, CONFIG.vocab_size, shape, generator=generator),
            "labels": torch.randint(0, CONFIG.vocab_size, shape, generator=generator)}


def make_plan(mesh):
    dp, tp, pp, schedule = mesh
    m = micro_batches(mesh)
    example = {k: v[:2] for k, v in batch(0).items()}
    return xirang.plan(model(), world=WORLD, example_kwargs=example, global_batch=GLOBAL_BATCH, hardware="cpu",
                       dp=dp, tp=tp, pp=pp, schedule=schedule if pp > 1 else None,
                       micro_batch=GLOBAL_BATCH // (dp * m))


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR)


def _timed(step, data):
    dist.barrier()  # every rank starts the step together: its time is then the slowest rank's
    start, cpu = time.perf_counter(), time.process_time()
    loss = step(data)
    return time.perf_counter() - start, loss, time.process_time() - cpu


class XirangRun:
    """This rank's compiled program and its optimizer; ``step`` returns the global-batch loss."""

    def __init__(self, plan, world):
        example = {k: v[:2] for k, v in batch(0).items()}
        self.compiled = xirang.compile(model(), world=world, plan=plan, example_kwargs=example,
                                       device="cpu")
        self.optimizer = _optimizer(self.compiled.parameters())

    def step(self, data):
        loss = self.compiled.train_step(**data)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


NATIVES = {"strong": (True,), "weak": (False,), "both": (True, False)}


def _rank(rank, world, meshes, plans, steps, warmup, strengths):
    torch.set_num_threads(1)
    results = []
    for mesh, plan in zip(meshes, plans):
        ours = XirangRun(plan, world)
        natives = [NativeRun(model(), mesh[:3], mesh[3], micro_batches(mesh), _optimizer, strong=strong)
                   for strong in strengths]
        rows = []
        for step in range(warmup + steps):
            data = batch(step)
            x_s, x_loss, x_cpu = _timed(ours.step, data)
            timed = [_timed(native.step, data) for native in natives]  # each (seconds, loss, CPU seconds)
            rows.append((x_s, x_loss, x_cpu, timed))
        results.append(rows)
        dist.barrier()
    return results


def summarise(per_rank, warmup, which=0):
    """Xirang against the ``which``-th native variant: medians over the timed steps, the worst |loss difference|."""
    steps = len(per_rank[0])
    x_times = [max(rows[s][0] for rows in per_rank) for s in range(steps)][warmup:]
    n_times = [max(rows[s][3][which][0] for rows in per_rank) for s in range(steps)][warmup:]
    x_loss = [per_rank[0][s][1] for s in range(steps)]
    # the native loss of a step: the mean of the dp shares' losses, reported by their last-stage tp-0 ranks
    n_loss = [statistics.fmean(rows[s][3][which][1] for rows in per_rank if rows[s][3][which][1] is not None)
              for s in range(steps)]
    diff = max(abs(a - b) for a, b in zip(x_loss, n_loss))
    x_cpu = statistics.median([sum(rows[s][2] for rows in per_rank) for s in range(steps)][warmup:])
    n_cpu = statistics.median([sum(rows[s][3][which][2] for rows in per_rank) for s in range(steps)][warmup:])
    return statistics.median(x_times), statistics.median(n_times), diff, x_loss[-1], x_cpu, n_cpu


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=DEFAULT_MESHES, help="dp,tp,pp[:gpipe|1f1b] ...")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per system and mesh")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--native", choices=sorted(NATIVES), default="strong",
                        help="the native baseline: strong (default), the earlier weak one, or both")
    args = parser.parse_args(argv)
    meshes = [parse_mesh(m) for m in args.meshes]
    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; {WORLD} gloo ranks, 1 thread each")
    print(f"GPT: {CONFIG.layers} layers, hidden {CONFIG.hidden}, heads {CONFIG.heads}, seq {CONFIG.seq_len}, "
          f"vocab {CONFIG.vocab_size}; global batch {GLOBAL_BATCH}, {PP_MICRO_BATCHES} micro-batches where pp > 1 "
          f"(pp under 1F1B: at least pp, torch's Schedule1F1B needs it); "
          f"AdamW; median of {args.steps} steps after {args.warmup} warm-up")
    began = time.perf_counter()
    plans = [make_plan(mesh) for mesh in meshes]
    for mesh, plan in zip(meshes, plans):
        sharded = sum(1 for name, s in plan.placements.items()
                      if name.startswith("p_") and isinstance(s.outputs[0].tp, PlanShard))
        print(f"xirang plan {mesh}: units per stage {[len(s.units) for s in plan.stages]}, "
              f"{sharded} tp-sharded parameters")
    # 8 ranks on a few shared cores can go silent for seconds while another rank computes: a long
    # heartbeat keeps the launcher from calling a starved rank frozen
    strengths = NATIVES[args.native]
    results = launch(_rank, WORLD, (meshes, plans, args.steps, args.warmup, strengths), timeout_s=1800,
                     heartbeat_s=300)
    print(f"\n{'mesh (dp,tp,pp)':18s} {'schedule':8s} {'m':>2s} {'native':>6s} {'xirang ms':>10s} {'native ms':>10s} "
          f"{'x/native':>9s} {'max |dloss|':>12s} {'last loss':>10s} {'xirang CPU s':>12s} {'native CPU s':>12s} "
          f"{'CPU x/n':>8s}")
    for i, mesh in enumerate(meshes):
        for which, strong in enumerate(strengths):
            x_s, n_s, diff, last, x_cpu, n_cpu = summarise([r[i] for r in results], args.warmup, which)
            schedule = mesh[3] if mesh[2] > 1 else "-"
            print(f"{str(mesh[:3]):18s} {schedule:8s} {micro_batches(mesh):2d} {'strong' if strong else 'weak':>6s} "
                  f"{x_s * 1e3:10.1f} {n_s * 1e3:10.1f} {x_s / n_s:9.2f} {diff:12.2e} {last:10.4f} {x_cpu:12.2f} "
                  f"{n_cpu:12.2f} {x_cpu / n_cpu:8.2f}")
    print(f"\ntotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
