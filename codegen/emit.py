"""Emit one rank's program: the traced graph rewritten for its tp rank, with precision casts, as a
GraphModule whose Python source is deterministic (byte-identical across runs and processes, so
golden files catch every unintended change).

The program's signature is the traced graph's: local parameters and buffers (by placeholder
name), then the model's inputs; it returns ``(loss,)``. Process group and communication counter
are module attributes (``self.tp_group``, ``self.comm_counter``): the same source runs with any
group object, and ``code(rank)`` can be printed for ranks this process does not run.

Data parallelism adds nothing to the program: dp ranks run the same program on their share of
the batch, and their gradients are averaged outside it (codegen/grad_sync). Pipeline parallelism
(pp > 1) cuts this program into stages afterwards (codegen/compose_3d.py, which also restores
the analysis meta the split reads on the program's nodes).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule

from xirang.ir.errors import XirangError

from xirang.passes.lowering.precision import insert_precision_casts
from xirang.passes.lowering.rewrite_tp import rewrite_for_tp_rank

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_emittable(plan) -> None:
    """Refuse what this emitter cannot run yet, before any rank builds anything."""
    if plan.precision not in COMPUTE_DTYPES:
        raise XirangError(f"the plan computes in {plan.precision!r}, which no program is emitted for",
                          where="plan.precision", hint=f"re-plan with precision in {sorted(COMPUTE_DTYPES)}")


def emit_rank_program(gm, plan, *, rank: int, device="cpu", tp_group=None, counter=None) -> GraphModule:
    """The GraphModule global rank ``rank`` runs under ``plan`` (see the module docstring)."""
    check_emittable(plan)
    coords = plan.mesh.coords(rank)
    graph = rewrite_for_tp_rank(gm, plan.placements, tp_rank=coords["tp"], tp_size=plan.mesh.tp, device=device)
    insert_precision_casts(graph, COMPUTE_DTYPES[plan.precision])
    graph.eliminate_dead_code()
    graph.lint()
    root = torch.nn.Module()
    root.tp_group, root.comm_counter = tp_group, counter
    return GraphModule(root, graph, class_name=f"Rank{rank}Program")


def rank_source(gm, plan, rank: int, device="cpu") -> str:
    """Python source of rank ``rank``'s program, with a header naming the rank and its mesh place."""
    program = emit_rank_program(gm, plan, rank=rank, device=device)
    coords = plan.mesh.coords(rank)
    header = (f"# Xirang program of rank {rank}: mesh {plan.mesh}, dp {coords['dp']} pp {coords['pp']} "
              f"tp {coords['tp']}, precision {plan.precision}\n")
    return header + program.code.lstrip("\n")


def attach(program: GraphModule, *, tp_group=None, counter: Optional[object] = None) -> GraphModule:
    """Point a program at this process's live tp group and counter."""
    program.tp_group, program.comm_counter = tp_group, counter
    return program
