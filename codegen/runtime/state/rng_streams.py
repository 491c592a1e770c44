"""The runtime's side of randomness: one seed for all ranks, and the ``RngContext`` a rank's
program draws from (codegen/ops/random_ops.py).

The seed: ``xirang.compile(..., seed=S)`` on every rank, or by default rank 0's
``torch.initial_seed()`` given to every rank, so ``torch.manual_seed(s)`` on rank 0 before
compiling makes a run repeatable (and an unseeded run draws like an unseeded torch program: a new
seed per run), while other ranks' seeds never matter: per-rank habits such as
``torch.manual_seed(1234 + rank)`` cannot make tp ranks disagree. A seed given explicitly must be
the same on every rank; the ranks check.

The state a checkpoint saves is ``RngContext.state()``: ``{"seed", "step", "mode"}``; draws are
counter-based, so the seed and the next step are all there is (``CompiledModel.rng_state`` and
``load_rng_state``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from xirang.codegen.ops.random_ops import RngContext, exact_refusals
from xirang.ir.errors import XirangError


def agree_on_seed(seed: Optional[int]) -> int:
    """The compile seed every rank uses: ``seed``, or rank 0's ``torch.initial_seed()`` (module
    docstring). Collective over the default process group when there is one."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise XirangError(f"seed must be an int, got {seed!r}", where="xirang.compile(seed=...)",
                          hint="pass an int, or leave it out to take rank 0's torch.initial_seed()")
    mine = torch.initial_seed() if seed is None else seed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return int(mine)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (seed is not None, int(mine)))
    given = {value for explicit, value in found if explicit}
    if seed is not None and len(given) > 1:
        raise XirangError(f"the ranks passed different seeds {sorted(given)} to compile",
                          where="xirang.compile(seed=...)", hint="pass the same seed on every rank")
    return int(found[0][1])


def make_rng(program, plan, *, seed: Optional[int], mode: str, dp_rank: int) -> RngContext:
    """This rank's ``RngContext``; exact mode is refused, naming the ops, for a program with a
    random op it cannot replay as one device draws it."""
    rng = RngContext(agree_on_seed(seed), mode, dp_rank=dp_rank, micro_batches=plan.num_micro_batches,
                     micro_batch_size=plan.micro_batch)
    refused = exact_refusals(getattr(program, "random_sites", ())) if mode == "exact" else []
    if refused:
        raise XirangError(f"rng='exact' cannot replay {len(refused)} random op(s) as one device draws them: "
                          + "; ".join(refused), where="xirang.compile(rng='exact')",
                          hint="verify this model with rng='streams' (correct in distribution, not equal to one "
                               "device), or make those draws independent of the batch and tp split")
    return rng
