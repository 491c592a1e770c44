"""When a pipeline send's tensors are free: the moment a real network has delivered it, proved from the schedule.

The executor keeps each posted send's tensors until ``Transfer.done()`` says every message of it completed
(codegen/runtime/executor/pipeline_executor.py ``_post_send`` drops finished sends; the rest are waited on at
the step's end). Torch's fake process group never completes a message, so in the dry run every send of the
step stayed alive to its end: on a first pipeline rank of 16 micro-batches, each micro-batch's hidden state
and attention mask, 0.5 GiB that no launched rank holds.

A real rank cannot see its peer either; what it knows is causality. Rank r's ``Send`` S to pipeline rank p is
received by p's matching ``Recv`` before p runs the compute that takes it (the executor waits on a receive
when a compute needs it, and a GPU's stream orders the compute after the receive's kernel). Any message p
sends to r after that compute is issued later on p's streams, so when r has taken it, S has been delivered:

    release(S) = the first Send S' on p, to r, listed after p's compute that consumes S;
    S is complete once r has taken the tensors of S' (its matching receive waited on).

Where p sends r nothing more in the step, S stays until the step's end, as it may on a GPU. The bound is an
upper one: a network may finish earlier, never later, than this proof allows, so the dry run's peak is not
flattered. ``completed_by_causality()`` applies it while a step runs: the executor's own code runs
unchanged; only a fake message's completion, which the fake process group cannot know, comes from here.
"""
from __future__ import annotations

import contextlib

from xirang.codegen.runtime.executor.pipeline_executor import PipelineExecutor
from xirang.ir.schedule_actions import ACTIVATION, Backward, BackwardInput, Forward, Send

Key = tuple  # (kind, receiving stage, micro-batch): one message as its receiver takes it


def _receiving_stage(send: Send) -> int:
    return send.stage + 1 if send.kind == ACTIVATION else send.stage - 1


def _consumes(action, key: Key) -> bool:
    """Does compute ``action`` take the received message ``key`` (executor ``_inputs_of``)?"""
    kind, stage, mb = key
    takers = (Forward,) if kind == ACTIVATION else (Backward, BackwardInput)
    return isinstance(action, takers) and action.stage == stage and action.micro_batch == mb


def release_points(schedule, pp_rank: int) -> dict[Key, Key]:
    """For each Send of ``pp_rank`` (by the key its receiver takes it under), the key of the message this rank
    receives back whose taking proves the send delivered (module docstring); sends with none are absent."""
    released: dict[Key, Key] = {}
    for send in (a for a in schedule.ranks[pp_rank] if isinstance(a, Send)):
        key = (send.kind, _receiving_stage(send), send.micro_batch)
        peer_actions = schedule.ranks[send.peer]
        consumed = next((i for i, a in enumerate(peer_actions) if _consumes(a, key)), None)
        if consumed is None:
            continue
        back = next((a for a in peer_actions[consumed + 1:] if isinstance(a, Send) and a.peer == pp_rank), None)
        if back is not None:
            released[key] = (back.kind, _receiving_stage(back), back.micro_batch)
    return released


@contextlib.contextmanager
def completed_by_causality():
    """While a dry-run step runs, a send posted by a ``PipelineExecutor`` reports itself done
    once its executor has taken the message that proves it delivered (module docstring)."""
    post_send, take = PipelineExecutor._post_send, PipelineExecutor._take
    releases: dict[int, dict] = {}

    def _post_send(self, action: Send) -> None:
        post_send(self, action)
        rank_releases = releases.get(id(self))
        if rank_releases is None:  # once per executor (setdefault's argument was rebuilt at every send: 60% of a step)
            rank_releases = releases[id(self)] = release_points(self.schedule, self.pp_rank)
        taken = self.__dict__.setdefault("_dry_run_taken", set())
        release = rank_releases.get((action.kind, _receiving_stage(action), action.micro_batch))
        if release is not None:
            transfer = self._sends[-1]
            transfer.done = lambda: release in taken  # the fake works never complete (module docstring)

    def _take(self, kind, stage, mb, *, copy: bool):
        found = take(self, kind, stage, mb, copy=copy)
        self.__dict__.setdefault("_dry_run_taken", set()).add((kind, stage, mb))
        return found

    PipelineExecutor._post_send, PipelineExecutor._take = _post_send, _take
    try:
        yield
    finally:
        PipelineExecutor._post_send, PipelineExecutor._take = post_send, take

