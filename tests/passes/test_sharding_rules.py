"""Sharding rules: hand-checked strategies for linear, views that split heads, attention, broadcasting,
softmax, Partial through linear and nonlinear ops; rule coverage on the GPT-2, Llama, BERT and in-repo GPT
graphs; and the Megatron layout reachable on Llama from the candidates alone."""
from __future__ import annotations

import functools
import operator

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

from conftest import HF_MODELS, token_batch
from examples.gpt import build_gpt
from xirang.ir.meta_keys import symbol
from xirang.ir.pass_spec import CompileContext
from xirang.ir.placement import PlanPartial, PlanReplicate, PlanShard
from xirang.pass_manager import PassManager
from xirang.passes.planning.sharding_rules import gradient_placements, ops_without_sharding_rule, strategies_for
from xirang.passes.planning.sharding_rules_views import info, remembering, reshape_groups
from xirang.passes.analysis.tensors import annotate_tensors
from xirang.passes.analysis.trace import trace_model

R, P = PlanReplicate(), PlanPartial("sum")
B, S = symbol("batch"), symbol("seq")


def analysed(model, symbolic_dims=None, **inputs):
    """Traced graph with shapes; ``symbolic_dims={}`` keeps every dim static."""
    ctx = CompileContext(model=model, example_kwargs=inputs, symbolic_dims=symbolic_dims)
    return PassManager([trace_model, annotate_tensors]).run(None, ctx).gm


def calls(gm, op_name):
    return [n for n in gm.graph.nodes if str(getattr(n.target, "overloadpacket", "")) == f"aten.{op_name}"]


def only(gm, op_name):
    (node,) = calls(gm, op_name)
    return node


def by_name(node, tp):
    return {s.name: s for s in strategies_for(node, tp)}


def layouts(node, tp):
    """Each strategy as (input placements, output placement)."""
    return {(s.inputs, s.output) for s in strategies_for(node, tp)}


# --- linear: Megatron column and row parallel ---------------------------------------------------

def test_linear_offers_column_and_row_parallel():
    gm = analysed(nn.Linear(8, 16), {"input": {0: "batch", 1: "seq"}}, input=torch.randn(2, 3, 8))
    strategies = by_name(only(gm, "linear"), tp=2)
    assert set(strategies) == {"replicate", "column", "row"}  # batch/seq dims are not provably even
    column, row = strategies["column"], strategies["row"]
    # inputs in node.all_input_nodes order: x, weight [out, in], bias
    assert (column.inputs, column.output, column.compute_fraction) == ((R, PlanShard(0), PlanShard(0)), PlanShard(2),
                                                                       0.5)
    # row: the bias is read as Partial, so it is added exactly once in the all-reduced sum
    assert (row.inputs, row.output, row.compute_fraction) == ((PlanShard(2), PlanShard(1), P), P, 0.5)
    assert column.collective is None and row.collective is None  # the all-reduce is priced on the edge
    # backward: column's input gradient is Partial (Megatron's f), row's bias gradient is whole
    assert gradient_placements(column) == (P, PlanShard(0), PlanShard(0))
    assert gradient_placements(row) == (PlanShard(2), PlanShard(1), R)


def test_linear_needs_tp_to_divide_the_split_features():
    gm = analysed(nn.Linear(6, 4, bias=False), {}, input=torch.randn(5, 6))
    # 6 in-features on 4 ranks: no even row, a padded one; 4 out-features on 3 ranks: a padded column
    assert set(by_name(only(gm, "linear"), tp=4)) == {"replicate", "column", "row (padded)"}
    assert set(by_name(only(gm, "linear"), tp=3)) == {"replicate", "row", "column (padded)"}
    assert strategies_for(only(gm, "linear"), tp=1) == strategies_for(only(gm, "linear"), tp=1)[:1]


def test_gpt2_conv1d_addmm_column_and_row():
    """addmm(bias, x, w[in, out]): column splits w's dim 1 and the bias, row w's dim 0."""
    class Conv1D(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(8, 12)), nn.Parameter(torch.randn(12))

        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight)
    strategies = by_name(only(analysed(Conv1D(), {"x": {0: "batch"}}, x=torch.randn(4, 8)), "addmm"), tp=2)
    assert (strategies["column"].inputs, strategies["column"].output) == ((PlanShard(0), R, PlanShard(1)), PlanShard(1))
    assert (strategies["row"].inputs, strategies["row"].output) == ((P, PlanShard(1), PlanShard(0)), P)


# --- views follow the shard through the heads split -----------------------------------------------

class SplitHeads(nn.Module):
    def forward(self, x):
        batch, seq, _ = x.shape
        return x.view(batch, seq, 4, 16).transpose(1, 2)


def test_view_that_splits_heads_maps_the_hidden_shard_to_the_heads_dim():
    gm = analysed(SplitHeads(), {"x": {0: "batch", 1: "seq"}}, x=torch.randn(2, 3, 64))
    view = only(gm, "view")
    assert {(s.inputs[0], s.output) for s in strategies_for(view, tp=2)} == {(R, R), (PlanShard(2), PlanShard(2)),
                                                                             (P, P)}
    # 8 ranks cannot split 4 heads evenly: never a shard inside a head, but one head a rank, the last four all
    # padding, the hidden dim split in whole heads of 16 (sharding_rules_padded)
    assert {(s.inputs[0], s.output) for s in strategies_for(view, tp=8)} == {
        (R, R), (P, P), (PlanShard(2, unit=16), PlanShard(2))}


def test_transpose_swaps_the_sharded_dim():
    gm = analysed(SplitHeads(), {"x": {0: "batch", 1: "seq"}}, x=torch.randn(2, 3, 64))
    assert ((PlanShard(2),), PlanShard(1)) in layouts(only(gm, "transpose"), tp=2)
    assert ((PlanShard(3),), PlanShard(3)) in layouts(only(gm, "transpose"), tp=2)


def test_reshape_groups_pair_the_outermost_dims_of_equal_products():
    assert reshape_groups((B, S, 64), (B, S, 4, 16)) == [(0, 0), (1, 1), (2, 2)]
    assert reshape_groups((B, S, 4, 16), (B, S, 64)) == [(0, 0), (1, 1), (2, 2)]
    assert reshape_groups((B, S, 1000), (B * S, 1000)) == [(0, 0), (2, 1)]
    assert reshape_groups((B, 2, 2, S, 16), (B, 4, S, 16)) == [(0, 0), (1, 1), (3, 2), (4, 3)]
    assert reshape_groups((1, S, 16), (S, 16)) == [(1, 0), (2, 1)]
    assert reshape_groups((6, 4), (4, 6)) == [(0, 0)]


class FusedQKV(nn.Module):
    def forward(self, x):
        q, k, v = x.split(8, dim=-1)
        return q.sum(-1), k.sum(0), v.mean(0)


def test_split_follows_other_dims_but_not_the_split_one():
    gm = analysed(FusedQKV(), {}, x=torch.randn(4, 6, 24))
    split = only(gm, "split")
    # a contiguous quarter of [q | k | v] is not a quarter of each: S(2) is not followed
    assert {s.output for s in strategies_for(split, tp=2)} == {(R,) * 3, (PlanShard(0),) * 3, (PlanShard(1),) * 3,
                                                               (P,) * 3}
    getitem = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    assert ((PlanShard(1),), PlanShard(1)) in layouts(getitem, tp=2)  # the element picked, not the tuple
    # summing over a split dim leaves a Partial; a mean over it is not offered
    assert ((PlanShard(2),), P) in layouts(calls(gm, "sum")[0], tp=2)
    assert ((PlanShard(0),), P) not in layouts(only(gm, "mean"), tp=2)
    assert ((PlanShard(1),), PlanShard(0)) in layouts(only(gm, "mean"), tp=2)


def test_layer_norm_splits_only_the_dims_it_does_not_normalise():
    gm = analysed(nn.LayerNorm(8), {}, input=torch.randn(4, 6, 8))
    assert layouts(only(gm, "layer_norm"), tp=2) == {((R, R, R), R), ((PlanShard(0), R, R), PlanShard(0)),
                                                     ((PlanShard(1), R, R), PlanShard(1))}


# --- attention by heads, grouped-query attention ---------------------------------------------------

class Attend(nn.Module):
    def __init__(self, gqa=False):
        super().__init__()
        self.gqa = gqa

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)


def attention(kv_heads, gqa):
    dims = {name: {0: "batch", 2: "seq"} for name in "qkv"}
    gm = analysed(Attend(gqa), dims, q=torch.randn(2, 4, 5, 8), k=torch.randn(2, kv_heads, 5, 8),
                  v=torch.randn(2, kv_heads, 5, 8))
    return only(gm, "scaled_dot_product_attention")


def test_attention_splits_heads():
    heads = by_name(attention(4, gqa=False), tp=2)["heads"]
    assert (heads.inputs, heads.output, heads.compute_fraction) == ((PlanShard(1),) * 3, PlanShard(1), 0.5)
    padded = by_name(attention(4, gqa=False), tp=8)["heads (padded)"]  # 4 heads on 8 ranks: 1 a rank, 4 padding
    assert (padded.inputs, padded.output, padded.compute_fraction) == ((PlanShard(1),) * 3, PlanShard(1), 0.25)
    assert set(by_name(attention(4, gqa=False), tp=8)) == {"replicate", "heads (padded)"}


def test_grouped_query_attention_splits_heads_when_tp_divides_both_head_counts():
    assert "heads" in by_name(attention(2, gqa=True), tp=2)
    assert set(by_name(attention(2, gqa=True), tp=4)) == {"replicate"}  # 2 kv heads on 4 ranks


# --- broadcasting, softmax, Partial ----------------------------------------------------------------

class AddBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(8))

    def forward(self, x):
        return x + self.bias


def test_elementwise_broadcasting_maps_the_output_shard_to_each_operand():
    gm = analysed(AddBias(), {}, x=torch.randn(2, 4, 8))  # [b, s, h] + [h]
    found = layouts(only(gm, "add"), tp=2)
    assert ((PlanShard(2), PlanShard(0)), PlanShard(2)) in found  # the bias is split with the hidden dim
    assert ((PlanShard(0), R), PlanShard(0)) in found and ((PlanShard(1), R), PlanShard(1)) in found  # broadcast: R
    assert ((P, P), P) in found  # add of two Partials is a Partial


def test_softmax_never_splits_its_reduction_dim():
    for dim in (-1, 1):
        gm = analysed(nn.Softmax(dim=dim), {}, input=torch.randn(4, 6, 8))
        outputs = {s.output for s in strategies_for(only(gm, "softmax"), tp=2)}
        assert PlanShard(dim % 3) not in outputs
        assert outputs == {R, PlanShard(0), PlanShard(1), PlanShard(2)} - {PlanShard(dim % 3)}


class LinearThenNot(nn.Module):
    def forward(self, x, y):
        return F.gelu(x), x * y, x * x, -x


def test_partial_passes_linear_ops_but_not_gelu_or_a_square():
    gm = analysed(LinearThenNot(), {}, x=torch.randn(4, 6), y=torch.randn(4, 6))
    assert all(P not in s.inputs and s.output != P for s in strategies_for(only(gm, "gelu"), tp=2))
    products = calls(gm, "mul")
    x_times_y = next(n for n in products if n.args[0] is not n.args[1])
    x_times_x = next(n for n in products if n.args[0] is n.args[1])
    assert {((P, R), P), ((R, P), P)} <= layouts(x_times_y, tp=2)  # scaling by a replicated tensor
    assert all(s.output != P for s in strategies_for(x_times_x, tp=2))  # (sum x_r)^2 != sum x_r^2
    assert ((P,), P) in layouts(only(gm, "neg"), tp=2)


def test_an_op_without_a_rule_is_only_replicated_and_listed():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.cumprod(x, dim=1)
    gm = analysed(Odd(), {}, x=torch.randn(4, 6))
    (strategy,) = strategies_for(only(gm, "cumprod"), tp=2)
    assert (strategy.name, strategy.inputs, strategy.output, strategy.compute_fraction) == ("replicate", (R,), R, 1.0)
    assert list(ops_without_sharding_rule(gm)) == ["aten.cumprod"]


# --- embedding and cross-entropy, vocabulary-parallel ----------------------------------------------

class LookupAndLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(100, 8)

    def forward(self, ids, labels):
        logits = self.table(ids) @ self.table.weight.t()
        return F.cross_entropy(logits.reshape(-1, 100), labels.reshape(-1))


def test_vocabulary_parallel_embedding_and_cross_entropy():
    tokens = {name: torch.zeros(2, 3, dtype=torch.long) for name in ("ids", "labels")}
    gm = analysed(LookupAndLoss(), **tokens)
    embedding = by_name(only(gm, "embedding"), tp=4)
    assert (embedding["vocab_parallel"].inputs, embedding["vocab_parallel"].output) == ((PlanShard(0), R), P)
    assert (embedding["hidden"].inputs, embedding["hidden"].output) == ((PlanShard(1), R), PlanShard(2))
    loss = by_name(only(gm, "cross_entropy_loss"), tp=4)["vocab_parallel"]
    assert (loss.inputs, loss.output, loss.collective) == ((PlanShard(1), R), R, "all_reduce")
    # two all-reduces: one float32 per row (max), then target logit and sum of exp in one call of two
    assert [(c.reduce_op, sympy.expand(c.nbytes - 4 * B * S)) for c in loss.collectives] == \
        [("max", 0), ("sum", 4 * B * S)]
    # 100 classes on 3 ranks: an end-padded split, 34 columns each (the last holds 32 and 2 padding)
    padded = by_name(only(gm, "cross_entropy_loss"), tp=3)["vocab_parallel"]
    assert (padded.inputs, padded.compute_fraction) == ((PlanShard(1), R), pytest.approx(34 / 100))


# --- padded (uneven) shards: the vocabulary chain only ---------------------------------------------

V = 1001  # 251 rows per rank on tp = 4, the last rank holding 248 and 3 padding rows


class TiedHead(nn.Module):
    """Embedding tied to the LM head; ``between`` runs on the logits before the loss."""

    def __init__(self, between=None):
        super().__init__()
        self.table, self.between = nn.Embedding(V, 8), between

    def forward(self, ids, labels):
        logits = F.linear(self.table(ids), self.table.weight)
        if self.between is not None:
            logits = self.between(logits)
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def tied(between=None):
    tokens = {name: torch.zeros(2, 3, dtype=torch.long) for name in ("ids", "labels")}
    return analysed(TiedHead(between), **tokens)


def padded_rows(node, tp=4):
    """Strategies that read or write a shard of a dim of size V."""
    def on_v(value, p):
        return isinstance(p, PlanShard) and value is not None and info(value).shape[p.dim] == V
    found = []
    for s in strategies_for(node, tp):
        outputs = s.output if isinstance(s.output, tuple) else (s.output,)
        if any(on_v(v, p) for v, p in zip(node.all_input_nodes, s.inputs)) or any(on_v(node, p) for p in outputs):
            found.append(s)
    return found


def test_vocabulary_tp_does_not_divide_is_split_with_padding():
    gm = tied()
    fraction = pytest.approx(251 / 1001)
    embedding = by_name(only(gm, "embedding"), tp=4)["vocab_parallel"]
    assert (embedding.inputs, embedding.output, embedding.compute_fraction) == ((PlanShard(0), R), P, 1.0)
    column = by_name(only(gm, "linear"), tp=4)["column"]
    assert (column.inputs, column.output, column.compute_fraction) == ((R, PlanShard(0)), PlanShard(2), fraction)
    (view,) = padded_rows(next(n for n in calls(gm, "reshape") if n.args[0] is only(gm, "linear")))
    assert (view.inputs, view.output, view.compute_fraction) == ((PlanShard(2),), PlanShard(1), fraction)
    loss = by_name(only(gm, "cross_entropy_loss"), tp=4)["vocab_parallel"]
    assert (loss.inputs, loss.output, loss.compute_fraction) == ((PlanShard(1), R), R, fraction)
    weight = next(n for n in gm.graph.nodes if n.op == "placeholder" and info(n).shape == (V, 8))
    held = {s.output: s.compute_fraction for s in strategies_for(weight, 4)}
    assert held[PlanShard(0)] == fraction and PlanShard(1) in held  # 8 hidden: even
    # 1001 = 7 x 143: the even split, priced as before
    assert by_name(only(gm, "cross_entropy_loss"), tp=7)["vocab_parallel"].compute_fraction == 1 / 7


@pytest.mark.parametrize("between", [lambda x: F.layer_norm(x, (V,)), lambda x: torch.softmax(x, -1),
                                     lambda x: x - x.sum(-1, keepdim=True)],
                         ids=["layer_norm", "softmax", "sum"])
def test_a_padded_dim_is_not_offered_to_ops_that_would_read_the_padding(between):
    """A norm, softmax or sum over the padded vocabulary would mix padding into real values: it is not
    offered the padded split. The LM head before it may be (its padding gathered away before the norm
    reads the logits whole: sharding_rules_padded); elementwise ops over it may too (their padding is
    finite, and the loss masks padded classes by index)."""
    gm = tied(between)
    loss = only(gm, "cross_entropy_loss")
    # the ops from the LM head up to (not including) the view the loss reads: that view may take the
    # padded split, since whatever precedes it is resharded to it (padding re-added as zeros)
    readers = [n for n in gm.graph.nodes if n.op == "call_function" and n not in (only(gm, "embedding"), loss)
               and n is not loss.args[0] and info(n) is not None
               and any(info(v) is not None and V in info(v).shape for v in n.all_input_nodes)]
    aten = torch.ops.aten
    mixing = [n for n in readers if n.target.overloadpacket in (aten.layer_norm, aten.native_layer_norm,
                                                                aten._softmax, aten.softmax, aten.sum)]
    assert len(readers) >= 2 and mixing and all(not padded_rows(n) for n in mixing), \
        [(n.name, padded_rows(n)) for n in mixing]
    # the loss itself still masks its padded classes; only the chain to it is cut
    assert by_name(only(gm, "cross_entropy_loss"), tp=4)["vocab_parallel"].inputs == (PlanShard(1), R)


def test_padded_out_features_that_are_not_logits_are_split_padded():
    """Out-features tp does not divide: a padded column (zero weight rows; the padding is gathered away or
    summed over with zeros by a row-parallel reader), at the padded share of the work."""
    gm = analysed(nn.Linear(8, V), {}, input=torch.randn(5, 8))
    strategies = by_name(only(gm, "linear"), tp=4)
    assert set(strategies) == {"replicate", "row", "column (padded)"}
    assert strategies["column (padded)"].compute_fraction == 251 / V


# --- the four graphs -----------------------------------------------------------------------------

GRAPHS = {**HF_MODELS, "gpt": lambda: build_gpt("tiny", device="meta")}
# The compute ops that carry a transformer: each must have a rule.
MUST_HAVE_RULES = {"aten.linear", "aten.addmm", "aten.mm", "aten.bmm", "aten.matmul", "aten.embedding",
                   "aten.scaled_dot_product_attention", "aten.layer_norm", "aten.rms_norm", "aten.softmax",
                   "aten.cross_entropy_loss", "aten.add", "aten.sub", "aten.mul", "aten.div", "aten.neg",
                   "aten.gelu", "aten.silu", "aten.tanh", "aten.pow", "aten.rsqrt", "aten.mean", "aten.dropout",
                   "aten.view", "aten.reshape", "aten.transpose", "aten.split", "aten.cat", "aten.expand",
                   "aten.unsqueeze", "aten.slice", "aten.contiguous", "aten.to"}


@functools.cache
def graph(name):
    return analysed(GRAPHS[name](), **token_batch())


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_every_compute_op_of_the_model_graphs_has_a_rule(name):
    gm = graph(name)
    missing = ops_without_sharding_rule(gm)
    print(f"{name}: replicate-only ops {sorted(missing)}")
    assert not MUST_HAVE_RULES & set(missing)
    # what is left builds positions and masks from integer tensors: replicated is fine and cheap
    nodes = {n.name: n for n in gm.graph.nodes}
    floating = [f"{op} ({node})" for op, names in missing.items() for node in names if info(nodes[node]).is_floating]
    assert not floating


def megatron_walk(gm, tp):
    """Pick strategies front to back as Megatron does, using only the candidates: linears column when
    their input is whole and row when it is split on the last dim, embeddings vocabulary-parallel, a
    Partial all-reduced by its first consumer, and elsewhere a strategy that reads what the producers
    wrote (a split output first). Returns the picks and the producers whose output was resharded."""
    placed, picks, resharded = {}, {}, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):  # returned logits: the caller's choice
            continue
        candidates = strategies_for(node, tp)

        def have(producer, node=node):
            out = placed.get(producer)
            return out[node.args[1]] if node.target is operator.getitem and isinstance(out, tuple) else out

        def fits(strategy, node=node):
            return all(want is None or (want != P and (have(p) or R) == want)
                       for p, want in zip(node.all_input_nodes, strategy.inputs))
        packet = str(getattr(node.target, "overloadpacket", node.target))
        seeded = {"aten.linear": "column" if have(node.args[0]) in (None, R) else "row",
                  "aten.embedding": "vocab_parallel"}
        if packet in seeded:
            pick = next(s for s in candidates if s.name == seeded[packet])
        else:
            ranked = sorted((s for s in candidates if fits(s)), key=lambda s: s.output == R)  # split first
            pick = ranked[0] if ranked else candidates[0]
        for p, want in zip(node.all_input_nodes, pick.inputs):
            if want is not None and p.op != "placeholder" and (have(p) or R) != want:
                resharded.add((p.name, str(have(p)), str(want)))
        picks[node.name], placed[node] = pick, pick.output
    return picks, resharded


def test_megatron_layout_is_reachable_on_llama_from_the_candidates_alone():
    gm = graph("llama")
    picks, resharded = megatron_walk(gm, tp=2)
    for node in gm.graph.nodes:
        if str(getattr(node.target, "overloadpacket", "")) == "aten.scaled_dot_product_attention":
            assert picks[node.name].name == "heads"
    linears = [picks[n.name].name for n in calls(gm, "linear")]
    # per layer: q, k, v column; o row; gate, up column; down row; then the LM head column
    assert linears == ["column"] * 3 + ["row"] + ["column"] * 2 + ["row"] + \
        ["column"] * 3 + ["row"] + ["column"] * 2 + ["row"] + ["column"]
    assert picks[only(gm, "cross_entropy_loss").name].name == "vocab_parallel"
    # only all-reduces of Partials (embedding, then attention and MLP of each layer), no all-gather
    assert {(old, new) for _, old, new in resharded} == {("P(sum)", "R")}
    assert len({name for name, _, _ in resharded}) == 1 + 2 * 2


# --- fused projections: the chunked shard ------------------------------------------------------------

class FusedProjection(nn.Module):
    """One Linear makes [q | k | v] (the in-repo GPT), or an addmm then a view (GPT-2's Conv1D)."""

    def __init__(self, conv1d=False):
        super().__init__()
        self.conv1d = conv1d
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        if self.conv1d:
            fused = torch.addmm(self.qkv.bias, x.view(-1, 8), self.qkv.weight.t()).view(x.shape[0], x.shape[1], 24)
        else:
            fused = self.qkv(x)
        q, k, v = fused.split(8, dim=-1)
        return q * k + v


def test_fused_projection_offers_a_chunked_column_that_the_split_turns_into_a_shard_of_each_piece():
    gm = analysed(FusedProjection(), {}, x=torch.randn(2, 3, 8))
    fused = PlanShard(2, chunks=3)
    column = by_name(only(gm, "linear"), tp=2)["column (3 chunks)"]
    assert (column.inputs, column.output, column.compute_fraction) == ((R, PlanShard(0, 3), PlanShard(0, 3)), fused,
                                                                       0.5)
    assert "column" in by_name(only(gm, "linear"), tp=2)  # the contiguous column is still offered
    assert ((fused,), (PlanShard(2),) * 3) in layouts(only(gm, "split"), tp=2)
    weight = next(n for n in gm.graph.nodes if n.op == "placeholder" and "weight" in n.name)
    assert PlanShard(0, 3) in {s.output for s in strategies_for(weight, tp=2)}  # held chunked, not sliced
    assert not any("chunks" in name for name in by_name(only(gm, "linear"), tp=16))  # 8-wide pieces on 16 ranks


def test_chunked_shard_follows_views_to_the_split():
    gm = analysed(FusedProjection(conv1d=True), {}, x=torch.randn(2, 3, 8))
    addmm = by_name(only(gm, "addmm"), tp=2)["column (3 chunks)"]
    assert addmm.output == PlanShard(1, 3) and addmm.inputs[0] == PlanShard(0, 3)  # the bias, chunked alike
    view = next(n for n in calls(gm, "view") if n.args[0] is only(gm, "addmm"))
    assert ((PlanShard(1, 3),), PlanShard(2, 3)) in {(s.inputs[:1], s.output) for s in strategies_for(view, tp=2)}
    # ops that do not reach a split are not offered chunked shards
    assert all(getattr(s.output, "chunks", 1) == 1 for s in strategies_for(only(gm, "add"), tp=2))


def test_remembered_rules_answer_as_fresh_ones_for_every_tp_and_layout():
    """The split pricer keeps the rules' walks and rows per graph (``remembering``): one walk serves
    every tp (tp=16 after tp=2 must still lose the 3-chunk column), and nothing is kept outside."""
    gm = analysed(FusedProjection(conv1d=True), {}, x=torch.randn(2, 3, 8))
    nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
    keys = [(tp, sp) for tp in (2, 16, 4, 2) for sp in (False, True)]
    fresh = {key: [strategies_for(n, *key) for n in nodes] for key in keys}
    memo: dict = {}
    with remembering(memo):
        kept = {key: [strategies_for(n, *key) for n in nodes] for key in keys}
    assert kept == fresh
    assert any(key[0] == "reached splits" for key in memo) and any(key[0] == "rule rows" for key in memo)
    assert "column (3 chunks)" in by_name(only(gm, "addmm"), tp=2)
    assert "column (3 chunks)" not in by_name(only(gm, "addmm"), tp=16)  # 8-wide pieces on 16 ranks
    size = len(memo)
    strategies_for(only(gm, "addmm"), tp=8)  # outside the block: derived afresh, nothing kept
    assert len(memo) == size
