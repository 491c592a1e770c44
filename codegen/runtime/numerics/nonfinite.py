"""The optimizer step taken only on finite numbers; a non-finite loss or gradient norm met with the user's policy.

    guard = NonFiniteGuard("stop")                      # or "skip", or "rollback" with checkpoint_dir=
    for step in range(steps):
        loss = compiled.train_step(**batch)
        outcome = guard.step(compiled, optimizer, loss, step=step + 1, clip=1.0)   # instead of step + zero_grad
        if outcome.rolled_back_to is not None: ...       # continue from that checkpoint (its ``extra``)

Detection reads numbers the step already shares. The loss ``train_step`` returns is the same on every
rank (the global-batch mean, all-reduced over dp and broadcast over pp), and the global gradient norm
(``compiled.clip_grad_norm_``: ``clip``, or ``inf`` for the norm alone) is one scalar all-reduce per mesh
axis -- the one clipping runs anyway; a NaN or inf gradient anywhere makes it non-finite on every rank
of the tp x pp group (NaN and inf survive every sum), and under ZeRO of the whole mesh (its norm sums
over dp too). Without ZeRO the norm is not summed over dp (replicas hold equal gradients), so there one
more small all-reduce, a flag over the dp group, makes the verdict every rank's even where a replica went
wrong on its own (a fault, a rank-local bug): every rank takes the same branch in the same step and no
rank waits in a collective the others skipped. Only on a non-finite step does
one more collective run: every rank hands in where it saw non-finite numbers (its own micro-batches'
losses before the dp average, its first gradient and weight by name, the optimizer group holding it), so
the report names the first rank and parameter where it appeared.

Policies (Megatron-LM stops on a non-finite loss or norm by default; skipping is what loss scaling does):

* ``stop`` (default): raise naming the step, the first rank (with its dp, pp, tp coordinates) and the
  first parameter and optimizer param group, with what to do. The optimizer has not stepped, so the
  weights are the last good ones; a checkpoint is never written from a non-finite step.
* ``skip``: no optimizer step, the gradients zeroed; training goes on with the next batch.
* ``rollback``: the newest complete checkpoint in ``checkpoint_dir`` is loaded (model, optimizer,
  randomness) and its step and ``extra`` returned; the caller continues from there with its data
  position *not* rolled back, so the batches that diverged are not replayed. Rolling back more than
  ``max_rollbacks`` times to the same checkpoint stops (the run diverges from there whatever the data).

Finite steps are stepped (``optimizer.step()``, then ``zero_grad()``) and their loss is shown to a
``LossSpikes`` (numerics/loss_spikes.py), whose report comes back in ``StepOutcome.spike``.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from xirang.codegen.runtime.checkpoint.save_load import load_checkpoint
from xirang.codegen.runtime.checkpoint.store import latest_checkpoint
from xirang.codegen.runtime.numerics.loss_spikes import LossSpikes
from xirang.ir.errors import XirangError

LOG = logging.getLogger("xirang.nonfinite")
POLICIES = ("stop", "skip", "rollback")


@dataclass
class StepOutcome:
    """What ``NonFiniteGuard.step`` did: ``action`` is "stepped", "skipped" or "rolled back"."""

    step: int
    loss: float
    norm: float
    action: str
    found: Optional[str] = None         # where non-finite numbers appeared (a non-finite step)
    rolled_back_to: Optional[int] = None
    extra: Optional[dict] = None        # the checkpoint's ``extra`` after a rollback
    spike: Optional[str] = None         # LossSpikes' report of a finite step

    @property
    def stepped(self) -> bool:
        return self.action == "stepped"


class NonFiniteGuard:
    """The policy for non-finite steps (see the module docstring). Collective: every rank calls ``step``."""

    def __init__(self, policy: str = "stop", *, checkpoint_dir=None, max_rollbacks: int = 3,
                 spikes: Optional[LossSpikes] = None):
        if policy not in POLICIES:
            raise XirangError(f"unknown non-finite policy {policy!r}", where="NonFiniteGuard(policy=...)",
                              hint=f"pass one of {', '.join(POLICIES)}")
        if policy == "rollback" and checkpoint_dir is None:
            raise XirangError("the rollback policy needs the folder of checkpoints to roll back to",
                              where="NonFiniteGuard(policy='rollback')",
                              hint="pass checkpoint_dir= (xirang train: --checkpoint-dir with --checkpoint-every)")
        self.policy, self.checkpoint_dir, self.max_rollbacks = policy, checkpoint_dir, max_rollbacks
        self.spikes = spikes if spikes is not None else LossSpikes()
        self.rollbacks: dict = {}  # checkpoint step -> times rolled back to it

    def step(self, compiled, optimizer, loss, *, step: int, clip: Optional[float] = None) -> StepOutcome:
        """After ``train_step``: the global norm (clipped to ``clip`` if given), then the optimizer step and
        ``zero_grad`` on finite numbers, else the policy. ``step``: the step's number in messages (1-based)."""
        norm = compiled.clip_grad_norm_(clip if clip else math.inf)
        value, total = float(loss), float(norm)
        if not _any_replica(not (math.isfinite(value) and math.isfinite(total)), compiled):
            optimizer.step()
            optimizer.zero_grad()
            return StepOutcome(step, value, total, "stepped", spike=self.spikes.observe(step, value))
        found = locate_nonfinite(compiled, optimizer)  # collective: every rank is here, the verdict is global
        what = f"step {step}: the loss is {value:.4g} and the global gradient norm {total:.4g}; {found}"
        optimizer.zero_grad()  # the bad gradients must not reach the next step
        if self.policy == "stop":
            raise XirangError(what, where=f"step {step}, {found.split(';')[0]}",
                              hint="lower the learning rate or warm up longer, clip gradients (--clip), and check "
                                   "this step's data; the weights are the last good ones (no step was taken). "
                                   "To go on past such steps: --on-nonfinite skip, or rollback with "
                                   "--checkpoint-every")
        if self.policy == "skip":
            if compiled.rank == 0:  # one line for the run, not one per rank
                LOG.info("%s: optimizer step skipped", what)
            return StepOutcome(step, value, total, "skipped", found=found)
        return self._roll_back(compiled, optimizer, step, value, total, what, found)

    def _roll_back(self, compiled, optimizer, step, value, total, what, found) -> StepOutcome:
        if latest_checkpoint(self.checkpoint_dir, quiet=True) is None:
            raise XirangError(f"{what}; no complete checkpoint in {self.checkpoint_dir} to roll back to",
                              where=f"step {step}, --checkpoint-dir {self.checkpoint_dir}",
                              hint="save checkpoints more often (--checkpoint-every N) so one exists before "
                                   "the run diverges, or --on-nonfinite skip")
        loaded = load_checkpoint(compiled, optimizer, self.checkpoint_dir)
        back = loaded["step"]
        self.rollbacks[back] = self.rollbacks.get(back, 0) + 1
        if self.rollbacks[back] > self.max_rollbacks:
            raise XirangError(f"{what}; the run diverged again after {self.max_rollbacks} rollbacks to step {back}",
                              where=f"step {step}, checkpoint step {back}",
                              hint="the divergence does not come from a few bad batches: lower the learning rate "
                                   "or clip gradients, and resume from that checkpoint")
        optimizer.zero_grad()
        self.spikes.recent.clear()  # the range before the rollback is not the range after it
        if compiled.rank == 0:
            LOG.info("%s: rolled back to step %d", what, back)
        return StepOutcome(step, value, total, "rolled back", found=found, rolled_back_to=back,
                           extra=loaded["extra"])


def _any_replica(bad: bool, compiled) -> bool:
    """Whether any dp replica says ``bad``: one all-reduce of a flag over the dp group, where the norm's own
    all-reduce did not span dp (dp > 1 without ZeRO); each replica's tp x pp ranks already agree."""
    group = compiled.groups.group("dp")
    if compiled.dp == 1 or compiled.zero is not None or group is None:
        return bad
    flag = torch.tensor([1.0 if bad else 0.0], device=compiled.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag.item() > 0


def _first_nonfinite(named) -> Optional[str]:
    return next((name for name, tensor in named if tensor is not None and not torch.isfinite(tensor).all()), None)


def local_findings(compiled, optimizer) -> dict:
    """Where this rank sees non-finite numbers: its own micro-batches' losses (before any average), its
    first gradient and weight by name (what the optimizer steps), the optimizer group of that parameter."""
    losses = compiled.last_step.losses if compiled.last_step is not None else []
    named = compiled.named_parameters()
    group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    grad = _first_nonfinite((name, t.grad) for name, t in named)
    tensor_of = dict(named)
    return {"rank": compiled.rank, "coords": (compiled.dp_rank, compiled.pp_rank, compiled.tp_rank),
            "micro_batches": [i for i, loss in enumerate(losses) if not torch.isfinite(loss).all()],
            "grad": grad, "group": group_of.get(id(tensor_of[grad])) if grad else None,
            "weight": _first_nonfinite((name, t.detach()) for name, t in named)}


def locate_nonfinite(compiled, optimizer) -> str:
    """Every rank's ``local_findings`` (all-gathered over the world), said as the first rank and parameter
    where non-finite numbers appeared. Collective."""
    mine = local_findings(compiled, optimizer)
    found = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)

    def at(f):
        dp, pp, tp = f["coords"]
        return f"rank {f['rank']} (dp {dp}, pp {pp}, tp {tp})"
    parts = []
    loss = next((f for f in found if f["micro_batches"]), None)
    if loss is not None:
        parts.append(f"first non-finite loss on {at(loss)}, micro-batch {loss['micro_batches'][0]} of its share")
    weight = next((f for f in found if f["weight"]), None)
    if weight is not None:
        parts.append(f"first non-finite weight {weight['weight']!r} on {at(weight)} (an earlier step wrote it)")
    grad = next((f for f in found if f["grad"]), None)
    if grad is not None:
        parts.append(f"first non-finite gradient {grad['grad']!r} on {at(grad)}, optimizer param group "
                     f"{grad['group']}")
    return "; ".join(parts) or "no rank holds a non-finite loss, weight or gradient of its own (an overflow in the sum)"
