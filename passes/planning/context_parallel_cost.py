"""What context-parallel attention costs per layer and rank: bytes moved, time left exposed, memory kept.

The formulas of the ops in ``xirang.codegen.ops.context_attention`` (ring and all-to-all attention), and
``with_context_parallel``, which re-prices a tensor split for one rank of a cp group (the degree search's
use of them; see its docstring). Symbols: S the full
sequence, B the micro-batch, Hq query heads, Hkv key/value heads, d the head dim, b bytes per element
of q, k, v (their dtype), cp the context-parallel degree. One rank's key (or value) block is

    block = B · Hkv · (S/cp) · d · b.

**Ring** (``context_attention_ring.py``; Liu et al. 2023, TransformerEngine's p2p context
parallelism), point-to-point sends to the next rank of the ring, per layer:

    forward   cp − 1 key+value blocks              2·(cp−1)·block = 2·S·B·Hkv·d·b·(cp−1)/cp
    backward  cp − 1 key+value blocks, and cp      2·(2cp−1)·block ≈ twice the forward
              gradient blocks (dK, dV home again)

About 2·S·B·Hkv·d·b forward whatever cp: the ring's traffic per rank does not shrink as cp grows, only
its share of the attention does. A transfer runs while the block in hand is attended, so only what
outlasts that attention is exposed (``ring_exposed_seconds``).

**All-to-all** (``context_attention_ulysses.py``; Jacobs et al. 2023, DeepSpeed-Ulysses), per layer:
forward q, k, v sequence->heads and the output heads->sequence, backward their gradients the other way. Each rank's send
buffers (the CommCounter's and nccl-tests' convention) and what leaves the rank, the buffer less the
1/cp it keeps:

    buffers (each way)  (S/cp)·B·(2Hq + 2Hkv')·d·b,    sent  × (cp − 1)/cp,

with Hkv' = lcm(Hkv, cp) the key/value heads after the repeat that lets them split over cp
(``ulysses_kv_heads``; Hkv itself where cp divides it). It shrinks as cp grows, unlike the ring's.

**USP** (``context_attention_usp.py``; Fang & Zhao 2024), cp = A·R: the all-to-all over A ranks, then the
ring over R with the all-to-all's heads (Hq/A query, Hkv'/A kv heads, Hkv' = lcm(Hkv, A)) and S/R tokens a
rank, per layer (``usp_attention_bytes``):

    all-to-all buffers (each way)  (S/cp)·B·(2Hq + 2Hkv')·d·b,   sent × (A − 1)/A
    ring                           the ring's above at cp = R with Hkv'/A kv heads: 2·S·B·(Hkv'/A)·d·b·(R−1)/R
                                   forward

A = 1 is the ring, A = cp the all-to-all; in between the all-to-all's bytes shrink with A and the ring's with
the heads it holds, for the heads a whole all-to-all lacks (A must divide Hq, cp need not).

**Memory** (``attention_saved_bytes``): what one attention keeps for its backward per rank, q, k, v, the
output and the fp32 log-sum-exp of its S/cp rows (a fused kernel's set: the S×S scores are never kept):

    (S/cp)·B·d·b·(2Hq + 2Hkv) + 4·B·Hq·(S/cp)        (ring; the all-to-all keeps Hkv' heads)

and, all-to-all with a sliding window, the S×S mask SDPA is handed and keeps (as an additive mask in the
inputs' dtype): S²·b, quadratic in S, so a window at long sequence wants a kernel that takes it as a size.

Plain functions of numbers, no torch; a test holds each to what the ops' CommCounter records.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

from xirang.ir.context_method import a2a_degree, context_subgroups
from xirang.ir.errors import InvalidValue
from xirang.passes.planning.unit_costs import TensorSplit

LSE_BYTES = 4  # the log-sum-exp is fp32 whatever the inputs' dtype
LOSS_SYNC_BYTES = 8  # the token mean's (sum, count), reduced over cp every micro-batch
LABEL_BYTES = 8  # an int64 label: the label shift gathers each chunk's first (2 chunks a rank and sample)
KEEP_BYTES = 1  # a key's padding bit, gathered as one byte (context_attention_sequence.py key_keep)


@dataclass(frozen=True)
class AttentionTraffic:
    """Bytes of one attention layer's transfers on one rank: ``forward``/``backward`` as the CommCounter
    records them (a send's message; an all-to-all's send buffer), ``forward_sent``/``backward_sent`` what
    leaves the rank (an all-to-all keeps 1/cp of its buffer)."""

    forward: float
    backward: float
    forward_sent: float
    backward_sent: float


def _check(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidValue(f"context_parallel_cost: {name} must be a positive int, got {value!r}",
                               where="xirang.passes.planning.context_parallel_cost",
                               hint=f"pass {name} as a count (tokens, heads, bytes per element, degree)")


def _sequence_shard(seq: int, cp: int) -> int:
    if cp > 1 and seq % (2 * cp):
        raise InvalidValue(f"a sequence of {seq} tokens cannot be cut into 2 x cp = {2 * cp} equal chunks",
                           where="context_parallel_cost", hint=f"price a sequence that is a multiple of {2 * cp}")
    return seq // cp


def ring_attention_bytes(*, seq: int, batch: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                         cp: int) -> AttentionTraffic:
    """Ring attention's sends per layer and rank (module docstring): forward 2·(cp−1) blocks, backward
    2·(cp−1) key/value blocks and 2·cp gradient blocks; nothing at cp = 1."""
    _check(seq=seq, batch=batch, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, cp=cp)
    if cp == 1:
        return AttentionTraffic(0, 0, 0, 0)
    block = batch * kv_heads * _sequence_shard(seq, cp) * head_dim * dtype_bytes
    forward, backward = 2 * (cp - 1) * block, 2 * (cp - 1) * block + 2 * cp * block
    return AttentionTraffic(forward, backward, forward, backward)


def ulysses_kv_heads(q_heads: int, kv_heads: int, cp: int) -> int:
    """Key/value heads the all-to-all moves: lcm(Hkv, cp), the kv heads repeated until cp divides them
    (``codegen/ops/context_attention_ulysses.py`` ``kv_head_repeats``, the same rule); refuses query heads cp does
    not divide, naming the numbers."""
    _check(q_heads=q_heads, kv_heads=kv_heads, cp=cp)
    if q_heads % cp or q_heads % kv_heads:
        raise InvalidValue(f"all-to-all attention needs cp to divide the query heads and the kv heads to divide "
                           f"them too: {q_heads} query heads, {kv_heads} kv heads, cp = {cp}",
                           where="ulysses_kv_heads", hint=f"price ring attention, or a cp among the divisors "
                                                          f"of {q_heads}")
    return kv_heads * cp // math.gcd(kv_heads, cp)


def ulysses_attention_bytes(*, seq: int, batch: int, q_heads: int, kv_heads: int, head_dim: int,
                            dtype_bytes: int, cp: int) -> AttentionTraffic:
    """All-to-all attention's per layer and rank (module docstring): four all-to-alls each way, q, k, v
    and the output forward and their gradients backward; nothing at cp = 1."""
    _check(seq=seq, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
           cp=cp)
    if cp == 1:
        return AttentionTraffic(0, 0, 0, 0)
    heads = 2 * q_heads + 2 * ulysses_kv_heads(q_heads, kv_heads, cp)
    buffers = _sequence_shard(seq, cp) * batch * heads * head_dim * dtype_bytes
    sent = buffers * (cp - 1) / cp
    return AttentionTraffic(buffers, buffers, sent, sent)


def usp_attention_bytes(*, seq: int, batch: int, q_heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                        cp: int, a2a: int) -> tuple[AttentionTraffic, AttentionTraffic]:
    """(all-to-all, ring) traffic of USP attention per layer and rank (module docstring): the all-to-alls'
    four buffers of S/cp rows over ``a2a`` ranks, and the ring over R = cp / a2a ranks, each holding
    Hkv'/a2a kv heads of S/R tokens (Hkv' = lcm(Hkv, a2a), the repeat the all-to-all makes)."""
    _check(cp=cp, a2a=a2a)
    if cp % a2a:
        raise InvalidValue(f"an all-to-all degree of {a2a} does not divide cp = {cp}", where="usp_attention_bytes",
                           hint="pass a divisor of cp")
    repeated = ulysses_kv_heads(q_heads, kv_heads, a2a)
    heads = 2 * q_heads + 2 * repeated
    buffers = _sequence_shard(seq, cp) * batch * heads * head_dim * dtype_bytes if a2a > 1 else 0
    sent = buffers * (a2a - 1) / a2a
    ring = ring_attention_bytes(seq=seq, batch=batch, kv_heads=repeated // a2a, head_dim=head_dim,
                                dtype_bytes=dtype_bytes, cp=cp // a2a)
    return AttentionTraffic(buffers, buffers, sent, sent), ring


def ring_exposed_seconds(*, transfer_s: float, attention_forward_s: float, attention_backward_s: float,
                         cp: int) -> tuple[float, float]:
    """(forward, backward) seconds of ring communication not hidden by attention, per layer.

    ``transfer_s``: one key+value block's send (both directions at once on a full-duplex link);
    ``attention_*_s``: one step's attention of the local queries to one block, forward or backward (the
    causal layout makes every step the same work). Forward: steps 0..cp−2 each have the next block in
    flight, cp − 1 times max(0, t − a). Backward: step 0 has the next key/value block in flight, steps
    1..cp−2 that and the previous step's gradient block (2t on the same link), step cp−1 the gradient
    block only, and the last gradient block's hop home follows the last attention, exposed whole."""
    _check(cp=cp)
    if cp == 1:
        return 0.0, 0.0
    t, a_f, a_b = transfer_s, attention_forward_s, attention_backward_s
    forward = (cp - 1) * max(0.0, t - a_f)
    backward = max(0.0, t - a_b) + (cp - 2) * max(0.0, 2 * t - a_b) + max(0.0, t - a_b) + t
    return forward, backward


def attention_saved_bytes(*, seq: int, batch: int, q_heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                          cp: int, dense_mask: bool = False) -> float:
    """Bytes one attention keeps for its backward on one rank (module docstring): q, k, v and the output
    of its S/cp rows, and the fp32 log-sum-exp; pass ``ulysses_kv_heads(...)`` as ``kv_heads`` for the
    all-to-all (it keeps the repeated heads), and ``dense_mask`` for the all-to-all with a sliding window
    (the S×S mask)."""
    _check(seq=seq, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
           cp=cp)
    rows = batch * _sequence_shard(seq, cp)
    mask = seq * seq * dtype_bytes if dense_mask else 0
    return rows * head_dim * dtype_bytes * (2 * q_heads + 2 * kv_heads) + LSE_BYTES * rows * q_heads + mask


# --- what runs beside cp: one list for the runtime's refusal and the planner's candidates -------------

def context_parallel_conflicts(*, cp: int, ep: int = 1, zero_stage: int = 0, dp_shares=(),
                               sequence_parallel: bool = False) -> list[tuple[str, str, str]]:
    """(what, where in the plan, why) of each choice the runtime does not run beside cp > 1 yet; empty where
    it runs. codegen/emit.py ``check_context_parallel`` refuses a plan with any; the degree search
    (plan_search_space.py) never lists a candidate with any."""
    if cp == 1:
        return []
    beside = [(ep > 1, f"ep={ep}", "plan.mesh.ep", "expert gradients are divided by dp x cp, "
               "while cp's loss makes each rank's gradient a share of the global mean"),
              (zero_stage > 0, f"ZeRO-{zero_stage}", "plan.zero_stage", "ZeRO shards over the dp group, "
               "and cp's gradients are reduced over dp x cp"),
              (len(set(dp_shares)) > 1, f"uneven dp shares {list(dp_shares)}", "plan.dp_shares",
               "the loss of a cp group is one mean over its whole sequences, not weighed per dp share"),
              (bool(sequence_parallel), "sequence parallelism", "plan.sequence_parallel",
               "it shards the same sequence dim over tp")]
    return [(what, where, why) for refused, what, where, why in beside if refused]


# --- the planner's use: a tensor split re-priced for one rank of a cp group ---------------------------

@dataclass(frozen=True)
class AttentionCall:
    """One ``scaled_dot_product_attention`` of the model, as the planner prices it: its unit, its query and
    key/value heads (the kv heads before a ``repeat_kv``: what the ring passes) and head dim, whole (tp
    splits the heads), and whether it takes a key padding mask (an input's, all-gathered over cp per call)."""

    unit: str
    q_heads: int
    kv_heads: int
    head_dim: int
    padding: bool = False


@dataclass(frozen=True)
class ContextFacts:
    """What the search needs to offer and price cp > 1 for a model: its attention calls, why the lowering
    would refuse cp for it (``refusal``, None where it runs: no attention, a fused variant, dropout, a padding
    mask, random ops), and whether weights are tied across units (cp then runs at pp = 1 only: the runtime
    refuses ties across pipeline ranks beside cp, and the cuts are not known when candidates are listed)."""

    calls: tuple[AttentionCall, ...] = ()
    refusal: Optional[str] = None
    tied_weights: bool = False

    @property
    def offered(self) -> bool:
        return bool(self.calls) and self.refusal is None


NO_CONTEXT = ContextFacts()  # a model with no attention to split (the default of the pricers)


def local_heads(heads: int, tp: int) -> int:
    """Heads one tp rank attends: tp splits them (a kv head is held whole where tp exceeds them)."""
    return max(1, -(-heads // tp))


def method_refusal(call: AttentionCall, tp: int, cp: int, method: str) -> Optional[str]:
    """Why ``method`` cannot run ``call`` at (tp, cp), or None: an all-to-all (whole, or USP's over A ranks)
    needs its degree to divide the query heads of a tp rank (``ulysses_kv_heads``'s rule, the op's)."""
    if cp == 1:
        return None
    a2a = a2a_degree(method, cp)
    if a2a == 1:
        return None
    q, kv = local_heads(call.q_heads, tp), local_heads(call.kv_heads, tp)
    try:
        ulysses_kv_heads(q, kv, a2a)
    except InvalidValue:
        return (f"{method} needs its all-to-all degree {a2a} to divide the query heads per tp rank: "
                f"{call.q_heads} heads / tp {tp} = {q}")
    return None


def layer_parts(call: AttentionCall, *, seq: int, batch: int, tp: int, cp: int, method: str,
                dtype_bytes: int) -> dict[str, AttentionTraffic]:
    """One call's transfers per micro-batch on one rank, at this tp (heads per tp rank), by the kind the
    CommCounter records them under: "send" (a ring's) and "all_to_all"; a method's kinds only."""
    q, kv = local_heads(call.q_heads, tp), local_heads(call.kv_heads, tp)
    shape = dict(seq=seq, batch=batch, head_dim=call.head_dim, dtype_bytes=dtype_bytes)
    a2a = a2a_degree(method, cp)
    if a2a == 1:
        return {"send": ring_attention_bytes(kv_heads=kv, cp=cp, **shape)}
    if a2a == cp:
        return {"all_to_all": ulysses_attention_bytes(q_heads=q, kv_heads=kv, cp=cp, **shape)}
    exchange, ring = usp_attention_bytes(q_heads=q, kv_heads=kv, cp=cp, a2a=a2a, **shape)
    return {"all_to_all": exchange, "send": ring}


def layer_bytes(call: AttentionCall, *, seq: int, batch: int, tp: int, cp: int, method: str,
                dtype_bytes: int) -> AttentionTraffic:
    """One call's transfers per micro-batch on one rank, at this tp, every kind together (``layer_parts``)."""
    parts = layer_parts(call, seq=seq, batch=batch, tp=tp, cp=cp, method=method, dtype_bytes=dtype_bytes).values()
    return AttentionTraffic(*(sum(getattr(p, name) for p in parts)
                              for name in ("forward", "backward", "forward_sent", "backward_sent")))


def attention_flops(call: AttentionCall, *, seq: int, batch: int) -> float:
    """Forward + backward FLOPs of one call over ``seq`` queries and keys, whole heads (flops.py's
    ``_attention``: 4·B·H·S²·d forward, twice that backward)."""
    return 12.0 * batch * call.q_heads * seq * seq * call.head_dim


def with_context_parallel(split: TensorSplit, *, cp: int, method: str, calls: tuple[AttentionCall, ...], seq: int,
                          dtype_bytes: int, group: tuple[int, ...], cost: Callable[[str, float, tuple], float],
                          attention_seconds: Callable[[float], float]) -> TensorSplit:
    """``split`` (priced at seq / cp tokens) re-priced for one rank of the cp ``group`` (its ranks, in cp order),
    by ``method`` (ir/context_method.py: ring, all-to-all or USP's all-to-all over A ranks x ring over
    R = cp / A); ``cost(kind, nbytes, ranks)`` prices one collective (a "send": from ``ranks[0]`` to
    ``ranks[1]``):

    - compute: the split prices every op at seq / cp tokens, right for per-token work; attention's is
      quadratic, and a rank attends its S/cp queries to all S keys: under the 2·cp-chunk causal layout
      cp steps each as large as the attention of S/cp tokens, so each call's attention forward is cp times
      the split's (whatever the method: the all-to-all attends Hq/A heads of A·S/cp queries instead). One
      step is ``attention_seconds(4·B·Hq·(S/cp)²·d)`` (a fused attention's forward of those FLOPs on this
      device, flops.py's count at the heads of one tp rank): forward and full recompute gain (cp − 1) of
      it, the backward twice that. A unit's model FLOPs become this rank's 1/cp share of the whole
      sequence's (attention's S²/cp, not (S/cp)²), so the pricer's FLOPs, times cp, count each sequence once.
    - communication (``cp_comm``): the ring, the exposed part of each call's sends (``ring_exposed_seconds``,
      one key+value block to the next ring rank against one ring step's attention: A of the cp steps above,
      as each of its R steps attends A times the tokens at 1/A of the heads); the all-to-all, q, k, v and
      the output each way over its A ranks, on the critical path. The last unit (the loss) adds, per
      micro-batch, the token mean's all-reduce of (sum, count) and the label shift's all-gather of each
      chunk's first label over the cp group (``LOSS_SYNC_BYTES``, ``LABEL_BYTES`` a label), latency-bound
      but never hidden; a call with a key padding mask, the all-gather of its bits (``KEEP_BYTES`` a token).
    - memory: what attention keeps follows the split at seq / cp (q, k, v, output of S/cp rows); an
      all-to-all keeps lcm(Hkv, A) kv heads per rank, the difference added. Not modelled: the ring's
      blocks in flight (two key+value blocks), the all-to-all's dense S×S mask under a sliding window.
    """
    if cp == 1:
        return split
    a2a = a2a_degree(method, cp)
    a2a_groups, ring_groups = context_subgroups(tuple(group), a2a)
    exchange_ranks, ring_ranks = a2a_groups[0], ring_groups[0]
    by_unit: dict[str, list[AttentionCall]] = {}
    for call in calls:
        by_unit.setdefault(call.unit, []).append(call)
    units = []
    for unit in split.units:
        mine = by_unit.get(unit.name, ())
        if not mine:
            units.append(unit)
            continue
        forward = backward = kept = flops = more = 0.0
        for call in mine:
            q, kv = local_heads(call.q_heads, split.tp), local_heads(call.kv_heads, split.tp)
            # one cp step: S/cp queries to S/cp keys (the whole attention the split priced for this call)
            step = attention_seconds(4.0 * split.micro_batch * q * (seq // cp) ** 2 * call.head_dim)
            more += (cp - 1) * step
            flops += attention_flops(call, seq=seq, batch=split.micro_batch) * (1 / cp - 1 / cp ** 2)
            parts = layer_parts(call, seq=seq, batch=split.micro_batch, tp=split.tp, cp=cp, method=method,
                                dtype_bytes=dtype_bytes)
            f = b = 0.0
            if "send" in parts:
                r = cp // a2a
                f, b = ring_exposed_seconds(transfer_s=cost("send", parts["send"].forward / (r - 1), ring_ranks[:2]),
                                            attention_forward_s=a2a * step, attention_backward_s=2 * a2a * step, cp=r)
            if a2a > 1:
                rows = seq // cp * split.micro_batch * call.head_dim * dtype_bytes
                repeated = ulysses_kv_heads(q, kv, a2a)
                moved = 2 * cost("all_to_all", rows * q, exchange_ranks) + 2 * cost("all_to_all", rows * repeated,
                                                                                     exchange_ranks)
                f, b = f + moved, b + moved
                shape = dict(seq=seq, batch=split.micro_batch, q_heads=q, head_dim=call.head_dim,
                             dtype_bytes=dtype_bytes, cp=cp)
                kept += attention_saved_bytes(kv_heads=repeated, **shape) - attention_saved_bytes(kv_heads=kv, **shape)
            if call.padding:  # the keys' padding bits, one byte a token of this rank's (key_keep)
                f += cost("all_gather", split.micro_batch * (seq // cp) * KEEP_BYTES, group)
            forward, backward = forward + f, backward + b
        units.append(replace(
            unit, forward_seconds=unit.forward_seconds + more, backward_seconds=unit.backward_seconds + 2 * more,
            full_recompute_seconds=unit.full_recompute_seconds + more,
            saved_bytes=unit.saved_bytes + kept, selective_saved_bytes=unit.selective_saved_bytes + kept,
            model_flops=unit.model_flops + flops, model_forward_flops=unit.model_forward_flops + flops / 3,
            cp_comm_forward_seconds=forward, cp_comm_backward_seconds=backward))
    last = units[-1]  # the loss: token_mean and shift_sequence_left (codegen/ops/context_attention_sequence.py)
    loss = cost("all_reduce", LOSS_SYNC_BYTES, group) + cost("all_gather", 2 * split.micro_batch * LABEL_BYTES, group)
    units[-1] = replace(last, cp_comm_forward_seconds=last.cp_comm_forward_seconds + loss)
    return replace(split, units=tuple(units))
