"""Gradient sync of a stage with expert weights (expert parallelism): dense weights averaged over the
dp group, expert weights over the expert-data-parallel group.

An ep rank holds ``experts / ep`` experts; the ranks holding the same experts form its edp group
(ir/mesh.py: ``edp = dp * cp / ep``). After the backward, an expert weight's gradient on a rank
already sums the contributions of every ep rank's tokens routed to it (the dispatch's backward
brought them), each the gradient of that rank's own mean loss. Summed over the edp group, it holds
every dp rank's contribution once; the global mean wants that sum divided by dp (the number of
losses averaged), not by edp: so the expert buckets reduce over edp and divide by dp
(``GradientBuckets(divisor=)``). With edp = 1 nothing is sent, the division still happens.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager


class StageBuckets:
    """The dense and the expert ``GradientBuckets`` of one stage, driven as one (``wait``,
    ``no_sync``, ``holds``, ``share_weight``) by the executor and the runtime."""

    def __init__(self, dense, experts):
        self.parts = [b for b in (dense, experts) if b is not None]
        self.dense, self.experts = dense, experts

    def wait(self) -> None:
        for part in self.parts:
            part.wait()

    @contextmanager
    def no_sync(self):
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.no_sync())
            yield self

    def holds(self, tensor) -> bool:
        return any(part.holds(tensor) for part in self.parts)

    @property
    def share_weight(self) -> float:
        return self.parts[0].share_weight

    @share_weight.setter
    def share_weight(self, value: float) -> None:
        for part in self.parts:
            part.share_weight = value
