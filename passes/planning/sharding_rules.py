"""Tensor-parallel sharding rules as data: aten op -> candidate strategies over the tp mesh axis.

``RULES`` maps an aten overload packet to a function ``(node, tp) -> strategies``; adding an op is
adding a row. ``strategies_for`` always puts the all-Replicate strategy first (every rank runs the
whole op: valid for every op), so an op without a row is simply left replicated, and
``ops_without_sharding_rule`` lists those ops. Rules read only the op, its arguments' shapes and
dtypes: no module names. The Megatron layout (Shoeybi et al. 2019) is among the candidates, for the
solver to find: column-parallel linear (weight S(0) -> output S(last)), row-parallel linear (input
S(last), weight S(1) -> output Partial(sum)), attention split by heads, vocabulary-parallel
embedding and cross-entropy.

Choices, so a reader can argue with them:
- ``Strategy.inputs`` holds one placement per ``node.all_input_nodes``; None asks nothing (a SymInt
  input, or any input of an op that reads only metadata, such as sym_size).
  For ``getitem`` of a multi-output op it is the placement of the element picked; a producer whose
  output is a tuple offers one placement per element.
- Partial stays a placement: a row-parallel linear outputs Partial(sum) and the all-reduce (or
  reduce-scatter) is priced on the edge to whichever consumer needs R (or a shard), so the solver can
  also keep a Partial through linear ops (add of Partials, mul by R, views, casts) and reduce later.
  ``collectives`` lists only communication inside an op (vocabulary-parallel cross-entropy).
- The bias of a row-parallel linear is read as Partial(sum): the edge from its Replicate parameter
  is free (rank 0 keeps the bias, the others zero it), so the bias is added exactly once in the sum.
- Shards are offered only on dims tp divides for every batch/seq value (see sharding_rules_views),
  except along the vocabulary chain (a vocabulary of 50257 on tp=8): the embedding table's rows, the
  LM head's out-features when they reach a cross-entropy's class dim, the views between, and the
  vocabulary-parallel cross-entropy take an end-padded shard (``padded``), whose padding they never
  read as data (see sharding_rules_fused). Its compute fraction is ceil(n/tp)/n. Heads, kv heads and an
  MLP's width take padded shards too, in whole heads (``PlanShard(dim, unit=head width)``), through the
  ops whose padding no real element reads (see sharding_rules_padded).
- Never offered: a shard of the rows dim of an experts call's routed rows (its matmuls and the gate
  between, ``expert_ops.routed_rows``). Traced, that dim is tokens x top_k, which tp divides; under
  expert parallelism a rank holds as many rows as were routed to it, which tp need not divide.
- A column-parallel output that is later split into k equal pieces (a fused [q | k | v]) is also
  offered as ``PlanShard(last, chunks=k)``, which the split turns into a per-head shard of each piece;
  parameters read that way are offered the chunked shard too (see sharding_rules_fused).
- Ops that draw random numbers (dropout, attention dropout) are correct in distribution only: a
  replicated dropout needs the same mask on every tp rank, a sharded one distinct streams. The
  lowering pass ``place_random_streams`` (passes/lowering/random_streams.py) gives each exactly
  that, from the placement chosen here; an op with no row (``torch.rand_like``) stays replicated,
  on a stream its tp group shares.
- Backward: ``gradient_placements`` gives the placement each input's gradient has under a strategy
  (S stays S, a Partial input gets an R gradient, an R input gets a Partial gradient when the output
  is split). An edge therefore costs its forward reshard plus the backward reshard of that gradient
  to the dual of the producer's output (Megatron's f and g operators).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import sympy
import torch
from torch.fx import Node

from xirang.ir.placement import PlanPartial, Placement, PlanReplicate, PlanShard

from xirang.passes.analysis.expert_ops import routed_rows  # (and registers torch.ops.xirang.expert_linear)
from xirang.passes.analysis.saved_storages import STAT_BYTES, arg
from xirang.passes.analysis.op_tables import in_any, op_packet, ops_missing_from
from xirang.passes.planning.sharding_rules_fused import (chunked_follows, fused_chunks, padded_follows,
                                                         reaches_vocab_loss, split_follows)
from xirang.passes.planning.sharding_rules_indexing import INDEXING_RULES
from xirang.passes.planning.sharding_rules_padded import padded_heads, uneven_follows, uneven_linear
from xirang.passes.planning.sharding_rules_pieces import asked_pieces, pieces_follows, product_pieces
from xirang.passes.planning.sharding_rules_pieces import fraction as pieces_fraction
from xirang.passes.planning.sharding_rules_sequence import sequence_follows
from xirang.passes.planning.sharding_rules_state_space import STATE_SPACE_RULES
from xirang.passes.planning.sharding_rules_views import (FOLLOW_RULES, R, SUM, Follow, broadcast_input, divides,
                                                         floating, info, is_tensor, padded, remembered, same,
                                                         shape, shard_fraction, shardable)
from xirang.ir.errors import InvalidValue

aten = torch.ops.aten


@dataclass(frozen=True)
class Collective:
    """Communication an op issues itself; ``nbytes`` is one rank's full buffer (nccl-tests convention)."""

    kind: str  # "all_reduce", ...
    nbytes: sympy.Expr  # in the batch/seq symbols
    reduce_op: str = "sum"
    why: str = ""


@dataclass(frozen=True)
class Strategy:
    """One way to run a node on the tp axis: what it reads, what it writes, its share of the work."""

    name: str
    inputs: tuple[Placement | None, ...]  # one per node.all_input_nodes; None: no requirement (non-tensor)
    output: Placement | tuple[Placement, ...]  # a tuple for multi-output ops
    compute_fraction: float  # local FLOPs / full FLOPs (the share of elements for data movement)
    collectives: tuple[Collective, ...] = ()

    @property
    def collective(self) -> str | None:
        """Kinds of the op's own collectives, e.g. 'all_reduce', or None."""
        return "+".join(dict.fromkeys(c.kind for c in self.collectives)) or None

    def __str__(self) -> str:
        ins = ", ".join("-" if p is None else str(p) for p in self.inputs)
        out = self.output if not isinstance(self.output, tuple) else "(" + ", ".join(map(str, self.output)) + ")"
        return f"{self.name}: ({ins}) -> {out} x{self.compute_fraction:g}"


def _outputs(placement) -> tuple:
    return placement if isinstance(placement, tuple) else (placement,)


def make(node: Node, name: str, pairs: Iterable[tuple[Node, Placement]], output, fraction: float,
         collectives: tuple[Collective, ...] = ()) -> Strategy | None:
    """A strategy from (argument, placement) pairs; None when one tensor is asked for two placements
    (``mul(x, x)`` as Partial × R) or a tensor input is left without one (the safe side)."""
    chosen: dict[Node, Placement] = {}
    for value, placement in pairs:
        if chosen.setdefault(value, placement) != placement:
            return None
    inputs = []
    for value in node.all_input_nodes:
        if not is_tensor(value):
            inputs.append(None)
        elif value in chosen:
            inputs.append(chosen[value])
        else:
            return None
    return Strategy(name, tuple(inputs), output, fraction, tuple(collectives))


def replicated(node: Node) -> Strategy:
    """Every rank runs the whole op on whole tensors. An op that makes no tensor (sym_size,
    _assert_tensor_metadata) reads only metadata, so it asks nothing of its inputs (None)."""
    outputs = info(node)
    output = tuple(R for _ in outputs) if isinstance(outputs, tuple) else R
    reads_data = node.op != "call_function" or outputs is not None
    inputs = tuple(R if reads_data and is_tensor(value) else None for value in node.all_input_nodes)
    return Strategy("replicate", inputs, output, 1.0)


# --- products (Megatron column / row parallel) -------------------------------------------------

def _linear(node, tp):
    """linear(x, w[out, in], b): column = w S(0) -> out S(last); row = x S(last), w S(1) -> Partial
    (Shoeybi et al. 2019, sec. 3); or split x's leading dims with w replicated."""
    x, w, b = node.args[0], node.args[1], arg(node, 2, "bias")
    bias = b if is_tensor(b) else None
    last, (out_features, in_features) = len(shape(x)) - 1, shape(w)

    def pairs(px, pw, pb):
        return [(x, px), (w, pw)] + ([(bias, pb)] if bias is not None else [])
    rows = []
    if divides(tp, out_features) or _padded_logits(node, last, out_features, tp):
        rows.append(make(node, "column", pairs(R, PlanShard(0), PlanShard(0)), PlanShard(last),
                         shard_fraction(tp, out_features)))
    rows += [make(node, f"column ({k} chunks)", pairs(R, PlanShard(0, k), PlanShard(0, k)), PlanShard(last, k), 1 / tp)
             for k in fused_chunks(node, last, tp) if divides(tp * k, out_features)]  # fused [q | k | v]
    for fused in product_pieces(node, tp):  # fused [q | k | v] of unequal or unsplittable pieces
        on = PlanShard(0, pieces=fused.pieces, whole=fused.whole)
        rows.append(make(node, "column (pieces)", pairs(R, on, on), fused, pieces_fraction(fused, tp)))
    if divides(tp, in_features):
        rows.append(make(node, "row", pairs(PlanShard(last), PlanShard(1), SUM), SUM, 1 / tp))
    rows += [make(node, f"rows S({d})", pairs(PlanShard(d), R, R), PlanShard(d), 1 / tp)
             for d in shardable(shape(x)[:-1], tp)]
    return rows + [make(node, *row) for row in uneven_linear(node, tp)]  # padded where tp does not divide


def _expert_linear(node, tp):
    """expert_linear(rows[S, in], ids[S], w[E, out, in] (transposed: [E, in, out]), b[E, out]): each row
    times its expert's weight (passes/analysis/expert_ops.py), split over tp as a linear is, every
    expert alike (expert tensor parallelism at the tp degree): column = w's out dim S -> out S(last)
    (with the fused pieces a later split asks for: gate | up); row = rows S(last), w's in dim S ->
    Partial. The ids are read whole; expert parallelism splits the experts dim apart (ep)."""
    rows, ids, w, b = node.args[0], node.args[1], node.args[2], arg(node, 3, "bias")
    transposed = bool(node.args[4]) if len(node.args) > 4 else False
    bias = b if is_tensor(b) else None
    out_dim, in_dim = (2, 1) if transposed else (1, 2)
    out_features, in_features = shape(w)[out_dim], shape(w)[in_dim]

    def pairs(prows, pw, pb):
        return [(rows, prows), (ids, R), (w, pw)] + ([(bias, pb)] if bias is not None else [])
    found = []
    if divides(tp, out_features):
        found.append(make(node, "column", pairs(R, PlanShard(out_dim), PlanShard(1)), PlanShard(1), 1 / tp))
    found += [make(node, f"column ({k} chunks)", pairs(R, PlanShard(out_dim, k), PlanShard(1, k)), PlanShard(1, k),
                   1 / tp) for k in fused_chunks(node, 1, tp) if divides(tp * k, out_features)]
    if divides(tp, in_features):
        found.append(make(node, "row", pairs(PlanShard(1), PlanShard(in_dim), SUM), SUM, 1 / tp))
    return found


def _contraction(a_index: int, b_index: int, bias_index: int | None = None):
    """a[..., n, k] @ b[..., k, m] (+ bias) for mm, bmm, matmul, addmm: b's last dim split (column),
    the contracted dim split (row, Partial), or a's rows / shared batch dims split."""
    def rule(node, tp):
        a, b = node.args[a_index], node.args[b_index]
        bias = node.args[bias_index] if bias_index is not None and is_tensor(node.args[bias_index]) else None
        sa, sb, out = shape(a), shape(b), shape(node)
        batched = len(sb) > 2
        if len(sa) == 2 and batched and bias is None and divides(tp, sa[0]) and sa[0] != 1:
            # W[n, k] @ X[..., k, m] (Mamba's dt_proj): W's rows split the output's rows, X whole
            return [make(node, "column (left)", [(a, PlanShard(0)), (b, R)], PlanShard(len(out) - 2), 1 / tp)]
        if len(sa) < 2 or len(sb) < 2 or (batched and (len(sa) != len(sb) or
                                                       not all(map(same, sa[:-2], sb[:-2])))):
            return []  # vectors and broadcast batch dims: keep it replicated

        def strategy(name, pa, pb, po, fraction=1 / tp):
            pairs = [(a, pa), (b, pb)]
            if bias is not None:
                pairs.append((bias, SUM if po == SUM else broadcast_input(bias, out, po)))
            return make(node, name, pairs, po, fraction)
        rows = []
        if divides(tp, sb[-1]) or _padded_logits(node, len(out) - 1, sb[-1], tp):
            rows.append(strategy("column", R, PlanShard(len(sb) - 1), PlanShard(len(out) - 1),
                                 shard_fraction(tp, sb[-1])))
        rows += [strategy(f"column ({k} chunks)", R, PlanShard(len(sb) - 1, k), PlanShard(len(out) - 1, k))
                 for k in fused_chunks(node, len(out) - 1, tp) if divides(tp * k, sb[-1])]
        for fused in product_pieces(node, tp) if bias is None or len(shape(bias)) == 1 else ():
            on = PlanShard(len(sb) - 1, pieces=fused.pieces, whole=fused.whole)
            pairs = [(a, R), (b, on)] + ([(bias, PlanShard(0, pieces=fused.pieces, whole=fused.whole))]
                                         if bias is not None else [])
            rows.append(make(node, "column (pieces)", pairs, fused, pieces_fraction(fused, tp)))
        if divides(tp, sa[-1]):
            rows.append(strategy("row", PlanShard(len(sa) - 1), PlanShard(len(sb) - 2), SUM))
        for d in shardable(sa[:-1], tp):
            shared = batched and d < len(sa) - 2  # a batch dim both operands have
            rows.append(strategy(f"rows S({d})", PlanShard(d), PlanShard(d) if shared else R, PlanShard(d)))
        return rows
    return rule


def _padded_logits(node, dim: int, size, tp: int) -> bool:
    """A column-parallel product may split out-features tp does not divide only when they are logits:
    the padded weight rows (and bias) are zero, so the padded columns are 0, and the dim reaches a
    cross-entropy's class dim, which masks them (sharding_rules_fused.reaches_vocab_loss)."""
    return padded(tp, size) and reaches_vocab_loss(node, dim, tp)


# --- embedding, attention, loss ----------------------------------------------------------------

def _embedding(node, tp):
    """Vocabulary-parallel: w S(0), ids R -> Partial(sum), each rank looking up only its rows and
    writing zeros elsewhere (Shoeybi et al. 2019, sec. 3), so every rank still writes the full
    output. Hidden-split: w S(1) -> out S(last). Or split the ids."""
    w, ids = node.args[0], node.args[1]
    vocab, hidden = shape(w)
    rows = []
    if divides(tp, vocab) or padded(tp, vocab):  # padded rows: no id looks them up
        rows.append(make(node, "vocab_parallel", [(w, PlanShard(0)), (ids, R)], SUM, 1.0))
    if divides(tp, hidden):
        rows.append(make(node, "hidden", [(w, PlanShard(1)), (ids, R)], PlanShard(len(shape(node)) - 1), 1 / tp))
    rows += [make(node, f"ids S({d})", [(w, R), (ids, PlanShard(d))], PlanShard(d), 1 / tp)
             for d in shardable(shape(ids), tp)]
    return rows


def _attention(node, tp):
    """Scaled dot-product attention split by heads (Shoeybi et al. 2019, sec. 3) or by batch: every
    head is independent. Grouped-query attention needs tp to divide both head counts; then query
    heads of rank r use exactly the kv heads of rank r. Multi-query attention whose one kv head is
    broadcast (k and v of 1 head, as Falcon-7B calls it) splits the query heads and reads k and v
    whole: each rank's heads broadcast against the same kv head. The mask follows by broadcasting."""
    q, k, v = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    mask = mask if is_tensor(mask) else None
    scores = shape(q)[:-1] + (shape(k)[-2],)

    def kv_read(t, d):
        if divides(tp, shape(t)[d]) and shape(t)[d] != 1:
            return PlanShard(d)
        return R if shape(t)[d] == 1 else None  # a broadcast dim of 1 is read whole
    rows = []
    for d in range(len(shape(q)) - 2):
        reads = (kv_read(k, d), kv_read(v, d))
        if divides(tp, shape(q)[d]) and shape(q)[d] != 1 and None not in reads:
            pairs = [(q, PlanShard(d)), (k, reads[0]), (v, reads[1])]
            if mask is not None:
                pairs.append((mask, broadcast_input(mask, scores, PlanShard(d))))
            name = "heads" if d == len(shape(q)) - 3 else f"batch S({d})"
            rows.append(make(node, name, pairs, PlanShard(d), 1 / tp))
    return rows + [make(node, *row) for row in padded_heads(node, tp)]  # heads tp does not divide


def _cross_entropy(node, tp):
    """Vocabulary-parallel (Shoeybi et al. 2019, sec. 3): logits split on the class dim, labels R;
    two all-reduces (the row max; then the target logit and the sum of exp coalesced into one call
    of two float32 per row, codegen/ops/vocab_parallel.py) give every rank the full loss. Rows split
    only for reduction 'none' or 'sum': a mean divides by the count of non-ignored labels, which is
    global."""
    logits, target = node.args[0], node.args[1]
    weight, reduction = arg(node, 2, "weight"), arg(node, 3, "reduction", 1)
    if is_tensor(weight) or arg(node, 5, "label_smoothing", 0.0) or floating(target):
        return []  # class weights, smoothing, soft labels: more reductions than written here
    class_dim = 1 if len(shape(logits)) >= 2 else 0
    classes = shape(logits)[class_dim]
    rows = []
    if divides(tp, classes) or padded(tp, classes):  # padded classes count as logit -inf
        row_bytes = info(logits).numel / classes * STAT_BYTES
        reduces = (Collective("all_reduce", row_bytes, "max", "row max of the logits"),
                   Collective("all_reduce", 2 * row_bytes, "sum", "target logit and sum of exp(logit - max)"))
        rows.append(make(node, "vocab_parallel", [(logits, PlanShard(class_dim)), (target, R)], R,
                         shard_fraction(tp, classes), reduces))
    if class_dim == 1 and reduction in (0, 2) and divides(tp, shape(logits)[0]):
        rows.append(make(node, "rows S(0)", [(logits, PlanShard(0)), (target, PlanShard(0))],
                         PlanShard(0) if reduction == 0 else SUM, 1 / tp))
    return rows


COMPUTE_RULES: dict[object, Callable[[Node, int], list[Strategy | None]]] = {
    # products
    aten.linear: _linear,
    torch.ops.xirang.expert_linear: _expert_linear,
    aten.mm: _contraction(0, 1), aten.bmm: _contraction(0, 1), aten.matmul: _contraction(0, 1),
    aten.addmm: _contraction(1, 2, bias_index=0),
    # embedding, attention, loss
    aten.embedding: _embedding,
    aten.scaled_dot_product_attention: _attention,
    aten.cross_entropy_loss: _cross_entropy,
}


def _from_follow(rule: Callable[[Node, int], list[Follow]]):
    """A follow rule's rows as strategies: the work splits with the elements, so a rank reading or
    writing a shard does 1/tp of it (ceil(n/tp)/n of a padded dim of n), and a Partial passing
    through costs a whole op per rank."""
    def strategies(node, tp):
        found, rows = [], rule(node, tp)
        extra = chunked_follows(node, tp, rows) + split_follows(node, tp) + padded_follows(node, tp) + \
            pieces_follows(node, tp) + asked_pieces(node, tp, _asked_pieces_of) + uneven_follows(node, tp)
        for follow in rows + extra:
            placements = [p for _, p in follow.inputs] + list(_outputs(follow.output))
            split = any(isinstance(p, PlanShard) for p in placements)
            name = ", ".join(str(p) for _, p in follow.inputs) + " -> " + str(_outputs(follow.output)[0])
            out = follow.output
            fraction = 1 / tp if split else 1.0
            if isinstance(out, PlanShard):  # ceil(n/tp)/n on a padded dim, 1/tp on an even one
                fraction = pieces_fraction(out, tp) if out.pieces else \
                    shard_fraction(tp, shape(node)[out.dim], out.unit)
            found.append(make(node, name, follow.inputs, follow.output, fraction))
        return found
    return strategies


RULES: dict[object, Callable[[Node, int], list[Strategy | None]]] = {
    **COMPUTE_RULES,
    **{op: _from_follow(rule) for op, rule in {**FOLLOW_RULES, **INDEXING_RULES, **STATE_SPACE_RULES}.items()}}


def strategies_for(node: Node, tp: int, sequence_parallel: bool = False) -> list[Strategy]:
    """Candidate strategies of one node on a tp axis of ``tp`` ranks; the first is all-Replicate.

    Placeholders (parameters, inputs) may be held whole or split on any dim tp divides; the output
    node reads whole tensors; an op without a rule is only replicated. ``sequence_parallel`` adds the
    rows that split the residual stream along the sequence (sharding_rules_sequence).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InvalidValue(f"tp must be a positive int, got {tp!r}")
    return list(remembered(("strategies", node, tp, sequence_parallel),
                           lambda: tuple(_strategies(node, tp, sequence_parallel))))


def _strategies(node: Node, tp: int, sequence_parallel: bool) -> list[Strategy]:
    if node.op in ("placeholder", "get_attr"):
        if tp == 1:
            return [Strategy("replicate", (), R, 1.0)]
        return [Strategy("replicate", (), R, 1.0)] + \
            [Strategy(str(p), (), p, shard_fraction(tp, shape(node)[p.dim], p.unit))
             for p in [PlanShard(d) for d in shardable(shape(node), tp)] + _asked_reads(node, tp)]
    found = [replicated(node)]
    if tp == 1:  # one rank: every placement is the whole tensor
        return found
    rule = RULES.get(op_packet(node)) if node.op == "call_function" and is_tensor(node) else None
    candidates = list(remembered(("rule rows", node, tp), lambda: tuple(rule(node, tp)))) if rule else []
    if sequence_parallel and rule:
        candidates += [make(node, "seq " + ", ".join(str(p) for _, p in f.inputs) + " -> " + str(f.output),
                            f.inputs, f.output, 1 / tp) for f in sequence_follows(node, tp)]
    for strategy in candidates:
        if strategy is not None and all((s.inputs, s.output) != (strategy.inputs, strategy.output) for s in found) \
                and not _splits_routed_rows(node, strategy):
            found.append(strategy)
    return found


def _splits_routed_rows(node: Node, strategy: Strategy) -> bool:
    """Whether ``strategy`` of a node of an experts call's routed rows (expert_ops.routed_rows) shards
    their rows dim (dim 0), in its output or in what it reads of another such node: under ep > 1 a rank
    holds a data-dependent count of those rows, which tp need not divide, so a reduce-scatter or a slice
    over them would lose rows."""
    def rows(p):
        return isinstance(p, PlanShard) and p.dim == 0
    if not any(rows(p) for p in _outputs(strategy.output) + strategy.inputs):
        return False  # the common case: the graph's walk is not needed
    routed = remembered(("routed rows", node.graph), lambda: routed_rows(node.graph))
    reads = [p for value, p in zip(node.all_input_nodes, strategy.inputs) if value in routed]
    return node in routed and any(rows(p) for p in _outputs(strategy.output) + tuple(reads))


def _asked_reads(node: Node, tp: int) -> list[PlanShard]:
    """Chunked shards (a fused [q | k | v] weight and bias) and padded ones (a vocabulary tp does not
    divide) that readers of a parameter ask of it, so it can be held that way rather than replicated
    and sliced. Padded shards are offered only when asked: only vocabulary-chain rules ask them."""
    def asked(p):
        return isinstance(p, PlanShard) and (p.chunks > 1 or bool(p.pieces) or p.unit > 1 or
                                             padded(tp, shape(node)[p.dim]))
    wanted = {p for user in node.users if user.op == "call_function" and is_tensor(user)
              for s in strategies_for(user, tp) for value, p in zip(user.all_input_nodes, s.inputs)
              if value is node and asked(p)}
    return sorted(wanted, key=lambda p: (p.dim, p.chunks))


def _asked_pieces_of(node: Node, tp: int) -> list[PlanShard]:
    """The pieces shards the products reading ``node`` ask of it (a weight read through ``W.T``)."""
    wanted = set()
    for user in node.users:
        if user.op == "call_function" and is_tensor(user) and op_packet(user) in COMPUTE_RULES:
            for s in strategies_for(user, tp):
                wanted |= {p for value, p in zip(user.all_input_nodes, s.inputs)
                           if value is node and isinstance(p, PlanShard) and p.pieces}
    return sorted(wanted, key=str)


def ops_without_sharding_rule(gm) -> dict[str, list[str]]:
    """Op name -> names of the nodes (producing a tensor) whose op has no row in ``RULES``."""
    return ops_missing_from(gm, in_any(RULES), applies=is_tensor)


def gradient_placements(strategy: Strategy) -> tuple[Placement | None, ...]:
    """Placement of each input's gradient under ``strategy``, the output gradient arriving as the
    dual of the output (S as S, R as R, Partial as R): a split input gets a split gradient, a Partial
    input an R one, and an R input a Partial(sum) one when the output is split or Partial, since each
    rank then holds one part of it (Megatron's f: identity forward, all-reduce backward)."""
    split = any(not isinstance(p, PlanReplicate) for p in _outputs(strategy.output))

    def dual(p):
        if p is None or isinstance(p, PlanShard):
            return p
        if isinstance(p, PlanPartial):
            return R
        return PlanPartial("sum") if split else R
    return tuple(dual(p) for p in strategy.inputs)
