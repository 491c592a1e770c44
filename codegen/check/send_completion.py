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

The same holds through other ranks: a message any rank q sends r after q's compute took a message that p
(or a rank p reached) sent after consuming S is also issued after S's delivery, and so on along any chain.
So release(S) is the first message r takes whose Send happened after p's consuming compute, by the
happens-before order of the schedule (program order on each rank, each Send before the compute that takes
it; ``_clocks``, vector clocks). On an interleaved schedule's backward-only tail, rank 1's gradients to rank 0
are proven delivered by the gradients that come back to rank 1 round the ring of pipeline ranks (0, pp - 1,
..., 2, 1); by the direct rule alone, rank 0 sending rank 1 nothing more in the step, Llama-3-405B's
interleaved plan (pp 16, v 6, 16 micro-batches) kept 81 of them, 2.5 GiB, to the step's end.

Where no message r takes follows it, S stays until the step's end, as it may on a GPU. The bound is an upper
one: a network may finish earlier, never later, than this proof allows, so the dry run's peak is not
flattered. ``completed_by_causality()`` applies it while a step runs: the executor's own code runs
unchanged; only a fake message's completion, which the fake process group cannot know, comes from here.
"""
from __future__ import annotations

import contextlib

from xirang.codegen.runtime.executor.pipeline_executor import PipelineExecutor
from xirang.ir.schedule_actions import ACTIVATION, GRADIENT, Backward, BackwardInput, Forward, Send

Key = tuple  # (kind, receiving stage, micro-batch): one message as its receiver takes it


def _receiving_stage(send: Send) -> int:
    return send.stage + 1 if send.kind == ACTIVATION else send.stage - 1


def _consumes(action, key: Key) -> bool:
    """Does compute ``action`` take the received message ``key`` (executor ``_inputs_of``)?"""
    kind, stage, mb = key
    takers = (Forward,) if kind == ACTIVATION else (Backward, BackwardInput)
    return isinstance(action, takers) and action.stage == stage and action.micro_batch == mb


def _message_keys(schedule) -> dict[Key, int]:
    """Every message of the schedule, by the key its receiver takes it under, with the rank sending it."""
    return {(a.kind, _receiving_stage(a), a.micro_batch): rank
            for rank, actions in enumerate(schedule.ranks) for a in actions if isinstance(a, Send)}


def _taken(action, messages: dict) -> Key | None:
    """The message (another rank's) that compute ``action`` takes, if any (executor ``_inputs_of``)."""
    if isinstance(action, Forward):
        key = (ACTIVATION, action.stage, action.micro_batch)
    elif isinstance(action, (Backward, BackwardInput)):
        key = (GRADIENT, action.stage, action.micro_batch)
    else:
        return None
    return key if key in messages else None


def _clocks(schedule) -> tuple[list, dict]:
    """Vector clocks of the schedule's happens-before order: per rank, the clock after each of its actions
    (entry q: how many of rank q's actions happened before or at it), and each message's clock at its Send."""
    ranks = schedule.ranks
    messages = _message_keys(schedule)
    clock = [[0] * len(ranks) for _ in ranks]
    after: list = [[] for _ in ranks]
    sent: dict[Key, list] = {}
    done = [0] * len(ranks)
    while any(done[r] < len(ranks[r]) for r in range(len(ranks))):
        moved = False
        for r, actions in enumerate(ranks):
            while done[r] < len(actions):
                action = actions[done[r]]
                key = _taken(action, messages)
                if key is not None:
                    if key not in sent:
                        break  # its message is not sent yet: another rank moves first
                    clock[r] = [max(a, b) for a, b in zip(clock[r], sent[key])]
                clock[r][r] = done[r] + 1
                if isinstance(action, Send):
                    sent[(action.kind, _receiving_stage(action), action.micro_batch)] = list(clock[r])
                after[r].append(tuple(clock[r]))
                done[r] += 1
                moved = True
        if not moved:  # a deadlocked schedule (proved apart, deadlock.py): nothing more is proven
            break
    return after, sent


def release_points(schedule, pp_rank: int) -> dict[Key, Key]:
    """For each Send of ``pp_rank`` (by the key its receiver takes it under), the key of the message this rank
    receives back whose taking proves the send delivered (module docstring); sends with none are absent."""
    messages = _message_keys(schedule)
    _, sent = _clocks(schedule)
    # the messages this rank takes from other ranks, in the order it takes them
    takes = [key for key in (_taken(a, messages) for a in schedule.ranks[pp_rank]) if key is not None]
    released: dict[Key, Key] = {}
    for send in (a for a in schedule.ranks[pp_rank] if isinstance(a, Send)):
        key = (send.kind, _receiving_stage(send), send.micro_batch)
        peer_actions = schedule.ranks[send.peer]
        consumed = next((i for i, a in enumerate(peer_actions) if _consumes(a, key)), None)
        if consumed is None:
            continue
        # a message sent after the peer's consuming compute (its clock counts that compute)
        back = next((taken for taken in takes if taken in sent and sent[taken][send.peer] > consumed), None)
        if back is not None:
            released[key] = back
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

