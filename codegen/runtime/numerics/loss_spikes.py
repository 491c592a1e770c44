"""Loss spikes: a step's loss far above the range of the steps just before it, reported as such.

    spikes = LossSpikes()
    note = spikes.observe(step, loss)   # None, or "loss spike at step 40: 9.12, above the last 20 steps' ..."

A spike is a loss above ``hi + max(factor * (hi - lo), floor * |hi|)``, where ``lo`` and ``hi`` are the
lowest and highest of the last ``window`` finite losses (at least ``least`` of them): far above the recent
range, and by a margin that does not shrink to nothing when the loss is flat (then any noise would be a
"spike"). A spike is not an error -- training often recovers -- so it is reported, not acted on; a
non-finite loss is numerics/nonfinite.py's. The spike stays in the window: a loss that settles at a new,
higher level is reported once, not at every step after.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional

from xirang.ir.errors import XirangError


class LossSpikes:
    """The recent losses and the spike rule (see the module docstring)."""

    def __init__(self, window: int = 20, least: int = 5, factor: float = 2.0, floor: float = 0.2):
        if not (isinstance(window, int) and isinstance(least, int) and 1 <= least <= window):
            raise XirangError(f"LossSpikes needs 1 <= least <= window, got least={least!r}, window={window!r}",
                              where="LossSpikes", hint="e.g. LossSpikes(window=20, least=5)")
        if not (factor > 0 and floor >= 0):
            raise XirangError(f"LossSpikes needs factor > 0 and floor >= 0, got {factor!r}, {floor!r}",
                              where="LossSpikes", hint="e.g. LossSpikes(factor=2.0, floor=0.2)")
        self.window, self.least, self.factor, self.floor = window, least, factor, floor
        self.recent: deque = deque(maxlen=window)
        self.spikes: list = []  # (step, loss, lo, hi) of every spike seen

    def observe(self, step: int, loss: float) -> Optional[str]:
        """Take step ``step``'s loss; the report when it is a spike, else None (non-finite losses are not kept)."""
        loss = float(loss)
        if not math.isfinite(loss):
            return None
        note = None
        if len(self.recent) >= self.least:
            lo, hi = min(self.recent), max(self.recent)
            if loss > hi + max(self.factor * (hi - lo), self.floor * abs(hi)):
                self.spikes.append((step, loss, lo, hi))
                note = (f"loss spike at step {step}: {loss:.4g}, far above the last {len(self.recent)} steps' "
                        f"range {lo:.4g}-{hi:.4g}")
        self.recent.append(loss)
        return note

    def state_dict(self) -> dict:
        return {"recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        self.recent = deque((float(x) for x in state.get("recent", [])), maxlen=self.window)
