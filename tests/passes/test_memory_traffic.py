"""count_bytes: hand-derived bytes read, written and saved for backward, per op, as sympy expressions
in batch/seq and as numbers at the example sizes; views move nothing; parameters are never "saved"."""
from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F
from torch import nn

from conftest import token_batch
from examples.gpt import build_gpt
from xirang.ir.facts import ByteCount, evaluate
from xirang.ir.meta_keys import BYTES, symbol
from xirang.ir.pass_spec import CompileContext
from xirang.pass_manager import PassManager
from xirang.passes.analysis.gradients import mark_requires_grad
from xirang.passes.analysis.memory_traffic import count_bytes, total_bytes
from xirang.passes.analysis.tensors import annotate_tensors
from xirang.passes.analysis.trace import trace_model

B, S = symbol("batch"), symbol("seq")
SIZES = {"batch": 3, "seq": 5}  # the example inputs below
BS = 15


def analysed(model, symbolic_dims=None, **inputs):
    ctx = CompileContext(model=model, example_kwargs=inputs, symbolic_dims=symbolic_dims)
    return PassManager([trace_model, annotate_tensors, mark_requires_grad, count_bytes]).run(None, ctx).gm


def bytes_of(gm, op_name) -> list[ByteCount]:
    """ByteCounts of the nodes calling ``aten.<op_name>``, in graph order."""
    return [BYTES.get(n) for n in gm.graph.nodes
            if str(getattr(n.target, "overloadpacket", "")) == f"aten.{op_name}"]


def assert_bytes(count: ByteCount, read, written, saved, at_sizes: tuple[int, int, int]):
    for got, expected, number in zip((count.read, count.written, count.saved_for_backward),
                                     (read, written, saved), at_sizes):
        assert sympy.expand(got - expected) == 0, f"{count} != {(read, written, saved)}"
        assert evaluate(got, SIZES) == number


class Chain(nn.Module):
    """x (B, S, 8) float32 -> LayerNorm -> Linear 8->16 -> GELU -> Dropout(0.1) -> * gate(x) -> sum."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.1)
        self.gate = nn.Linear(8, 16, bias=False)

    def forward(self, x):
        h = self.ln(x)
        a = self.drop(F.gelu(self.fc(h)))
        return (a * self.gate(h)).transpose(0, 1).sum()


def chain_graph():
    return analysed(Chain(), {"x": {0: "batch", 1: "seq"}}, x=torch.randn(3, 5, 8))


def test_norm_linear_activation_dropout_and_product():
    gm = chain_graph()
    (ln,), (fc, gate), (gelu,), (drop,), (mul,) = (bytes_of(gm, op) for op in
                                                   ("layer_norm", "linear", "gelu", "dropout", "mul"))
    # LayerNorm: reads x (4·8 bytes per position) and weight+bias (2·8·4); keeps x and fp32 mean+rstd
    assert_bytes(ln, 32 * B * S + 64, 32 * B * S, 32 * B * S + 8 * B * S, (32 * BS + 64, 32 * BS, 40 * BS))
    # Linear 8->16: reads h, W (16·8·4) and b (16·4); keeps h for dW, and not W (a parameter)
    assert_bytes(fc, 32 * B * S + 576, 64 * B * S, 32 * B * S, (32 * BS + 576, 64 * BS, 32 * BS))
    assert_bytes(gate, 32 * B * S + 512, 64 * B * S, 32 * B * S, (32 * BS + 512, 64 * BS, 32 * BS))
    # GELU keeps its input
    assert_bytes(gelu, 64 * B * S, 64 * B * S, 64 * B * S, (64 * BS,) * 3)
    # Dropout writes and keeps a one-byte mask per element
    assert_bytes(drop, 64 * B * S, 64 * B * S + 16 * B * S, 16 * B * S, (64 * BS, 80 * BS, 16 * BS))
    # a * b keeps both operands
    assert_bytes(mul, 128 * B * S, 64 * B * S, 128 * B * S, (128 * BS, 64 * BS, 128 * BS))


def test_views_move_nothing():
    (transpose,) = bytes_of(chain_graph(), "transpose")
    assert transpose == ByteCount(read=0, written=0, saved_for_backward=0)


def test_frozen_weight_is_not_a_reason_to_keep_the_input():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.trained = nn.Linear(8, 8, bias=False)
            self.frozen = nn.Linear(8, 8, bias=False).requires_grad_(False)

        def forward(self, x):
            return self.frozen(self.trained(x)).sum()

    gm = analysed(Frozen(), {"x": {0: "batch", 1: "seq"}}, x=torch.randn(3, 5, 8))
    trained, frozen = bytes_of(gm, "linear")
    assert_bytes(trained, 32 * B * S + 256, 32 * B * S, 32 * B * S, (32 * BS + 256, 32 * BS, 32 * BS))
    # dX of the frozen layer needs only W (resident anyway); dW is not needed: nothing is kept
    assert_bytes(frozen, 32 * B * S + 256, 32 * B * S, 0, (32 * BS + 256, 32 * BS, 0))


class Attend(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q * self.scale, k, v, is_causal=True).sum()


def test_attention_keeps_qkv_output_and_logsumexp_not_the_scores():
    dims = {name: {0: "batch", 2: "seq"} for name in "qkv"}
    gm = analysed(Attend(), dims, **{name: torch.randn(3, 4, 5, 8) for name in "qkv"})
    (attention,) = bytes_of(gm, "scaled_dot_product_attention")
    tensor = 4 * B * 4 * S * 8  # one (B, 4 heads, S, 8) float32 tensor
    logsumexp = 4 * B * 4 * S  # one float32 per (batch, head, query)
    assert_bytes(attention, 3 * tensor, tensor + logsumexp, 4 * tensor + logsumexp,
                 (3 * 1920, 1920 + 240, 4 * 1920 + 240))


def test_embedding_reads_only_the_rows_it_gathers_and_keeps_the_indices():
    gm = analysed(build_gpt("tiny", device="meta"), **token_batch(batch=3, seq=5))
    token, position = bytes_of(gm, "embedding")
    # indices: 8 bytes each; rows: hidden 64 float32 = 256 bytes per position
    assert_bytes(token, 8 * B * S + 256 * B * S, 256 * B * S, 8 * B * S, (264 * BS, 256 * BS, 8 * BS))
    assert_bytes(position, 264 * S, 256 * S, 8 * S, (264 * 5, 256 * 5, 40))


def test_total_bytes_reprice_at_another_shape_equals_a_retrace():
    at_2x16 = total_bytes(analysed(build_gpt("tiny", device="meta"), **token_batch(batch=2, seq=16)))
    at_3x24 = total_bytes(analysed(build_gpt("tiny", device="meta"), **token_batch(batch=3, seq=24)))
    for part in ("read", "written", "saved_for_backward"):
        assert evaluate(getattr(at_2x16, part), {"batch": 3, "seq": 24}) == \
            evaluate(getattr(at_3x24, part), {"batch": 3, "seq": 24})


def test_batched_matmul_keeps_copies_of_the_heads_except_at_a_micro_batch_of_one():
    """Eager attention's q·kᵀ: ATen folds (batch, heads) for a bmm and keeps the folded operands. The
    heads of a fused qkv projection do not fold as views (their strides interleave), so it keeps
    copies: q and k, one hidden-sized tensor each per token. At a micro-batch of 1 they do fold, and
    the views keep the scaled q's storage and the whole qkv storage (3 hidden-sized) alive instead."""
    from examples.gpt import GPTConfig
    config = GPTConfig(vocab_size=512, seq_len=16, hidden=64, heads=4, layers=1, dropout=0.1, attention="eager")
    gm = analysed(build_gpt(config, device="meta"), **token_batch(batch=2, seq=16))
    scores = next(n for n in gm.graph.nodes if str(getattr(n.target, "overloadpacket", "")) == "aten.matmul")
    saved = BYTES.get(scores).saved_for_backward
    hidden = 64 * 4  # bytes of one token's hidden vector, float32
    assert evaluate(saved, {"batch": 2, "seq": 16}) == 2 * (2 * 16 * hidden)  # copies of q and k
    assert evaluate(saved, {"batch": 1, "seq": 16}) == (1 + 3) * 16 * hidden  # scaled q, the qkv storage


class _RepeatKV(nn.Module):
    """Grouped-query attention's repeat_kv (Hugging Face Llama): 2 kv heads expanded to 4 query heads."""

    def forward(self, q, k, v):
        b, heads, s, d = k.shape
        k = k[:, :, None].expand(b, heads, 2, s, d).reshape(b, heads * 2, s, d)
        v = v[:, :, None].expand(b, heads, 2, s, d).reshape(b, heads * 2, s, d)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_a_reshape_that_merges_a_broadcast_dim_is_a_copy_that_attention_keeps():
    q = torch.randn(3, 4, 5, 8, requires_grad=True)
    k, v = (torch.randn(3, 2, 5, 8, requires_grad=True) for _ in range(2))
    gm = analysed(_RepeatKV(), q=q, k=k, v=v)
    from xirang.passes.analysis.saved_storages import input_saved, storage_of
    reshapes = [n for n in gm.graph.nodes if str(getattr(n.target, "overloadpacket", "")) == "aten.reshape"]
    attention = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    assert len(reshapes) == 2 and all(storage_of(n) is n for n in reshapes)  # each owns a new storage
    kept = {item.storage for value in attention.args[:3] for item in input_saved(attention, value)}
    assert {n.name for n in reshapes} <= kept  # the 4-head copies are what attention saves, not the 2-head k, v
