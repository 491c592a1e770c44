"""Prove a pipeline schedule is complete, well ordered, cannot hang and fits its activation budget.

``check_schedule`` works in two phases so that one mistake does not echo as many:
1. Per-rank reading (no execution): each action names a stage its rank runs and a peer that is the
   neighbour stage's rank; every (stage, micro-batch) has exactly one forward and one backward (fused,
   or split into input and weight parts); a backward comes after its forward; a compute that needs a
   remote tensor has its Recv posted earlier on the same rank; every Send has exactly one matching
   Recv and the reverse; activations in flight stay within the budget.
   Sends and receives between two ranks must also be posted in the same order: NCCL matches
   point-to-point messages per pair of ranks in posting order and ignores tags, so a crossed
   order would hand one micro-batch's tensor (all have the same shape) to another silently.
2. Execution of all ranks together. Point-to-point is modelled as the executor will run it:
   ``Send`` and ``Recv`` post a non-blocking isend/irecv and the rank moves on; a send completes
   when its peer posts the matching receive, and a compute waits until the Send of its input has
   been issued. Sends thus never block their rank (buffered, from the rank's point of view).
   ``rendezvous=True`` models blocking sends instead (a rank waits at a Send until the peer has
   posted the Recv, like ``torch.distributed.send``); GPipe and 1F1B pass it, but interleaved
   1F1B with m > p does not: a chunk's gradient is produced many actions before the peer needs it,
   which is why Megatron-LM posts its sends and receives together as non-blocking batches. A state
   where no rank can move is a deadlock, reported rank by rank.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from xirang.ir.errors import InvalidValue, ScheduleError
from xirang.ir.schedules import (ACTIVATION, Action, Backward, BackwardInput, BackwardWeight, Forward, Recv, Schedule,
                                 Send, describe, input_recv, is_compute, matching_recv)

ACTION_TYPES = (Forward, Backward, BackwardInput, BackwardWeight, Send, Recv)


def _at(rank: int, index: int, action: Action) -> str:
    return f"rank {rank} action #{index} {describe(action)}"


def max_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) pairs whose forward ran and whose backward has not
    finished: the activations held at once. With one stage per rank that is micro-batches; with v
    chunks each pair holds 1/v of a micro-batch's activations on that rank. A split backward frees
    them only at its BackwardWeight, which still reads the stage inputs (Qi et al. 2024).
    For the generated schedules this is v times the planner's closed form,
    ``ScheduleSpec.in_flight_by_rank`` (ir/schedules.py); tests/codegen/test_schedule_formulas.py."""
    peaks = []
    for actions in schedule.ranks:
        held = peak = 0
        for action in actions:
            if isinstance(action, Forward):
                held += 1
                peak = max(peak, held)
            elif isinstance(action, (Backward, BackwardWeight)):
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


def check_schedule(schedule: Schedule, *, in_flight_budget: Sequence[int] | None = None,
                   rendezvous: bool = False) -> None:
    """Raise ScheduleError naming every problem of ``schedule``; return None when it is sound.

    ``in_flight_budget[r]``: the most (stage, micro-batch) activations rank r may hold (see
    ``max_in_flight``); e.g. ``[p - r for r in range(p)]`` for 1F1B."""
    problems = _placement_problems(schedule)
    if not problems:  # order and pairing only mean something once every action is well placed
        problems = _coverage_problems(schedule) + _order_problems(schedule) + _pairing_problems(schedule)
        if not problems:  # posting order is only comparable once every message is paired
            problems = _channel_order_problems(schedule)
    if in_flight_budget is not None:
        problems += _budget_problems(schedule, in_flight_budget)
    if problems:
        raise ScheduleError(schedule.name, problems)
    problems = _deadlock_problems(schedule, rendezvous)
    if problems:
        raise ScheduleError(schedule.name, problems)


# --- phase 1: reading each rank's list -----------------------------------------------------------


def _expected_peer(schedule: Schedule, rank: int, transfer: Send | Recv) -> tuple[int | None, str]:
    """The peer ``transfer`` must name, or None and why it cannot exist at all."""
    toward_next = (transfer.kind == ACTIVATION) == isinstance(transfer, Send)
    other = transfer.stage + 1 if toward_next else transfer.stage - 1
    if not 0 <= other < schedule.num_stages:
        return None, (f"stage {transfer.stage} has no {'next' if toward_next else 'previous'} stage, so there "
                      f"is no {transfer.kind} to {'send' if isinstance(transfer, Send) else 'receive'}; drop it")
    if schedule.rank_of(other) == rank:
        return None, (f"stages {transfer.stage} and {other} both run on rank {rank}: the tensor is handed "
                      f"over locally; drop the {type(transfer).__name__}")
    return schedule.rank_of(other), ""


def _placement_problems(schedule: Schedule) -> list[str]:
    problems = []
    p, stages, m = schedule.pipeline_ranks, schedule.num_stages, schedule.num_micro_batches
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if not isinstance(action, ACTION_TYPES):
                problems.append(f"rank {rank} action #{index} is {action!r}, not a schedule action; use "
                                f"Forward, Backward, BackwardInput, BackwardWeight, Send or Recv")
                continue
            where = _at(rank, index, action)
            if action.stage >= stages:
                problems.append(f"{where}: stage {action.stage} does not exist (stages 0..{stages - 1})")
            elif schedule.rank_of(action.stage) != rank:
                owner = schedule.rank_of(action.stage)
                problems.append(f"{where}: stage {action.stage} runs on pipeline rank {owner} (stage i runs on "
                                f"rank i % {p}), not rank {rank}; move it to rank {owner}'s list")
            if action.micro_batch >= m:
                problems.append(f"{where}: micro-batch {action.micro_batch} does not exist (0..{m - 1})")
            if isinstance(action, (Send, Recv)) and action.stage < stages:
                peer, why = _expected_peer(schedule, rank, action)
                if peer is None:
                    problems.append(f"{where}: {why}")
                elif action.peer != peer:
                    problems.append(f"{where}: the {action.kind} of stage {action.stage} goes to/from rank "
                                    f"{peer}, not rank {action.peer}; set peer={peer}")
    return problems


def _coverage_problems(schedule: Schedule) -> list[str]:
    problems = []
    found: dict[tuple[int, Action], list[int]] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            found[rank, action].append(index)
    for (rank, action), indices in found.items():
        if len(indices) > 1:
            problems.append(f"{describe(action)} appears {len(indices)} times on rank {rank}, at actions "
                            f"{', '.join(f'#{i}' for i in indices)}; each must run once: keep one")
    for stage in range(schedule.num_stages):
        rank = schedule.rank_of(stage)
        for mb in range(schedule.num_micro_batches):
            has = {kind: (rank, kind(stage, mb)) in found for kind in (Forward, Backward, BackwardInput,
                                                                       BackwardWeight)}
            split = has[BackwardInput] or has[BackwardWeight]
            missing = [] if has[Forward] else [Forward]
            if has[Backward] and split:
                problems.append(f"stage {stage} micro-batch {mb} on rank {rank} has both a Backward and a "
                                f"split backward part; use either Backward or BackwardInput + BackwardWeight")
            elif split:
                missing += [kind for kind in (BackwardInput, BackwardWeight) if not has[kind]]
            elif not has[Backward]:
                missing.append(Backward)
            for kind in missing:
                problems.append(f"{describe(kind(stage, mb))} is missing: rank {rank} must run it once")
    return problems


def _order_problems(schedule: Schedule) -> list[str]:
    problems = []
    for rank, actions in enumerate(schedule.ranks):
        first: dict[Action, int] = {}
        for index, action in enumerate(actions):
            first.setdefault(action, index)

        def before(index: int, needed: Action, what: str, rank=rank, actions=actions, first=first) -> None:
            if needed in first and first[needed] > index:  # absent is reported as missing/unmatched
                problems.append(f"{_at(rank, index, actions[index])} runs before {describe(needed)} "
                                f"(action #{first[needed]}), {what}; move it after")

        for index, action in enumerate(actions):
            stage, mb = getattr(action, "stage", None), getattr(action, "micro_batch", None)
            if isinstance(action, (Backward, BackwardInput)):
                before(index, Forward(stage, mb), "whose saved activations a backward needs")
            if isinstance(action, BackwardWeight):
                before(index, BackwardInput(stage, mb), "whose per-layer output gradients the weight "
                                                        "gradients are computed from")
            if isinstance(action, Send):
                producer = Forward(stage, mb) if action.kind == ACTIVATION else None
                for candidate in ([producer] if producer else [Backward(stage, mb), BackwardInput(stage, mb)]):
                    before(index, candidate, f"which computes the {action.kind} it sends")
            if not is_compute(action):
                continue
            recv = input_recv(schedule, action)
            if recv is not None:
                if first.get(recv, len(actions)) > index:
                    later = f" (it is listed later, at #{first[recv]})" if recv in first else ""
                    problems.append(f"{_at(rank, index, action)}: its input {recv.kind} for micro-batch {mb} "
                                    f"comes from rank {recv.peer} but was not received before this point"
                                    f"{later}; list {describe(recv)} before it")
            elif isinstance(action, Forward) and stage > 0:
                before(index, Forward(stage - 1, mb), "whose output it takes on the same rank")
            elif isinstance(action, (Backward, BackwardInput)) and stage + 1 < schedule.num_stages:
                for candidate in (Backward(stage + 1, mb), BackwardInput(stage + 1, mb)):
                    before(index, candidate, "whose input gradient it takes on the same rank")
    return problems


def _pairing_problems(schedule: Schedule) -> list[str]:
    problems = []
    recvs = {(rank, action): index for rank, actions in enumerate(schedule.ranks)
             for index, action in enumerate(actions) if isinstance(action, Recv)}
    matched = set()
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if not isinstance(action, Send):
                continue
            recv = matching_recv(action, rank)
            if (action.peer, recv) in recvs:
                matched.add((action.peer, recv))
                continue
            consumer = Forward if action.kind == ACTIVATION else Backward
            problems.append(f"{_at(rank, index, action)} has no matching {describe(recv)} on rank {action.peer}, "
                            f"so it would never complete; list that Recv on rank {action.peer} before its "
                            f"{consumer.__name__}(stage={recv.stage}, micro_batch={recv.micro_batch})")
    for (rank, recv), index in recvs.items():
        if (rank, recv) not in matched:
            sender = Send(recv.kind, recv.stage - 1 if recv.kind == ACTIVATION else recv.stage + 1,
                          recv.micro_batch, rank)
            problems.append(f"{_at(rank, index, recv)} has no matching {describe(sender)} on rank {recv.peer}, "
                            f"so it would wait forever; add that Send on rank {recv.peer} or drop the Recv")
    return problems


def _channel_order_problems(schedule: Schedule) -> list[str]:
    """Sends from a to b, and b's receives from a, must come in the same order (module docstring)."""
    sent_order: dict[tuple[int, int], list[Recv]] = defaultdict(list)
    posted_order: dict[tuple[int, int], list[tuple[int, Recv]]] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if isinstance(action, Send):
                sent_order[rank, action.peer].append(matching_recv(action, rank))
            elif isinstance(action, Recv):
                posted_order[action.peer, rank].append((index, action))
    problems = []
    for (sender, receiver), expected in sent_order.items():
        for position, (want, (index, got)) in enumerate(zip(expected, posted_order[sender, receiver])):
            if want != got:
                problems.append(f"{_at(receiver, index, got)} is rank {receiver}'s receive number {position} "
                                f"from rank {sender}, but rank {sender}'s send number {position} to it pairs "
                                f"with {describe(want)}; NCCL matches messages between two ranks in posting "
                                f"order, so post the receives in the order rank {sender} sends")
                break
    return problems


def _budget_problems(schedule: Schedule, budget: Sequence[int]) -> list[str]:
    if len(budget) != schedule.pipeline_ranks:
        raise InvalidValue(f"in_flight_budget has {len(budget)} entries; schedule {schedule.name!r} has "
                         f"{schedule.pipeline_ranks} pipeline ranks and needs one budget each")
    problems = []
    for rank, actions in enumerate(schedule.ranks):
        held = 0
        for index, action in enumerate(actions):
            held += isinstance(action, Forward) - isinstance(action, (Backward, BackwardWeight))
            if held > budget[rank]:
                problems.append(f"{_at(rank, index, action)}: rank {rank} now holds the activations of {held} "
                                f"(stage, micro-batch) pairs, over its budget of {budget[rank]}; run a backward "
                                f"earlier (fewer warm-up forwards) or raise the budget")
                break
    return problems


# --- phase 2: running all ranks together --------------------------------------------------------


def _deadlock_problems(schedule: Schedule, rendezvous: bool) -> list[str]:
    actions_of = schedule.ranks
    next_index = [0] * schedule.pipeline_ranks
    posted: set[tuple[int, Recv]] = set()  # (receiving rank, its Recv)
    sent: set[tuple[int, Recv]] = set()  # the Recv each issued Send pairs with

    def blocked_on(rank: int) -> str | None:
        """None if rank's next action can run now, else what it waits for."""
        action = actions_of[rank][next_index[rank]]
        if isinstance(action, Send) and rendezvous and (action.peer, matching_recv(action, rank)) not in posted:
            return f"rank {action.peer} to post {describe(matching_recv(action, rank))}"
        if is_compute(action):
            recv = input_recv(schedule, action)
            if recv is not None and (rank, recv) not in sent:
                return f"the {recv.kind} of micro-batch {recv.micro_batch} from rank {recv.peer}"
        return None

    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(actions_of):
            while next_index[rank] < len(actions) and blocked_on(rank) is None:
                action = actions[next_index[rank]]
                if isinstance(action, Recv):
                    posted.add((rank, action))
                elif isinstance(action, Send):
                    sent.add((action.peer, matching_recv(action, rank)))
                next_index[rank] += 1
                progress = True
    stuck = [rank for rank, actions in enumerate(actions_of) if next_index[rank] < len(actions)]
    if not stuck:
        return []
    waits = "; ".join(f"{_at(rank, next_index[rank], actions_of[rank][next_index[rank]])} waits for "
                      f"{blocked_on(rank)}" for rank in stuck)
    model = "rendezvous" if rendezvous else "buffered"
    return [f"deadlock ({model} point-to-point): no rank can proceed: {waits}. Reorder the actions so "
            f"that every rank issues what its peers wait for before it waits on them"]
