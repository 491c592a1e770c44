"""Lowering: the analysed graph under a plan, as the program one rank runs.

    lowered = lower(report.graph_module, plan, rank=3)            # LOWERING_PASSES, then emission
    lowered.program          # codegen.emit.Program: the rank's stage modules and how to bind them
    lowered.run.timings      # seconds per pass (``xirang inspect --passes``)

The analysed graph is not changed (the first pass copies it), so the same graph lowers for every
rank: ``code(rank)`` of any rank, golden files, ``xirang inspect``. ``dump_dir`` writes the graph
after every pass (``xirang inspect --dump DIR``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from xirang.codegen.emit import Program, check_emittable, emit_program, program_source
from xirang.ir.pass_spec import LoweringContext

from .pass_manager import PassManager, PassRun
from .pipeline import ANALYSIS_PROVIDES, LOWERING_PASSES


@dataclass
class LoweredRank:
    program: Program
    run: PassRun  # the lowered graph and each pass's time


def lower(gm, plan, *, rank: int, device="cpu", dump_dir: Optional[str | Path] = None,
          shared: Optional[dict] = None) -> LoweredRank:
    """Run ``LOWERING_PASSES`` on ``gm`` (analysed, the graph ``plan`` was made for) for ``rank``; ``shared``
    (a dict kept across calls for one gm and plan) keeps what every rank derives alike (LoweringContext)."""
    check_emittable(plan)
    manager = PassManager(LOWERING_PASSES, available=ANALYSIS_PROVIDES, dump_dir=dump_dir)
    run = manager.run(gm, LoweringContext(plan, rank, torch.device(device), shared))
    return LoweredRank(emit_program(run.gm, plan), run)


def rank_source(gm, plan, rank: int, device="cpu") -> str:
    """Python source of every stage module rank ``rank`` runs, headed by its place on the mesh."""
    program = lower(gm, plan, rank=rank, device=device).program
    local = tuple(range(plan.mesh.coords(rank)["pp"], len(plan.stages), plan.mesh.pp))
    return program_source(program, plan, rank, local)
