"""count_flops: hand-derived formulas for products and attention (as sympy expressions in batch/seq
and as numbers at the example sizes), the Megatron-LM GPT formula, and re-pricing at a new shape."""
from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F
from torch import nn

from conftest import token_batch
from examples.gpt import build_gpt, gpt_config
from xirang.ir.facts import evaluate
from xirang.ir.meta_keys import FLOPS, symbol
from xirang.ir.pass_spec import CompileContext
from xirang.pass_manager import PassManager
from xirang.passes.analysis.flops import count_flops, ops_without_flop_rule, total_flops
from xirang.passes.analysis.gradients import mark_requires_grad
from xirang.passes.analysis.tensors import annotate_tensors
from xirang.passes.analysis.trace import trace_model

B, S = symbol("batch"), symbol("seq")
SIZES = {"batch": 3, "seq": 5}  # the example inputs below


def analysed(model, symbolic_dims=None, **inputs):
    ctx = CompileContext(model=model, example_kwargs=inputs, symbolic_dims=symbolic_dims)
    return PassManager([trace_model, annotate_tensors, mark_requires_grad, count_flops]).run(None, ctx).gm


def flops_of(gm, op_name):
    """FlopCount of the one node calling ``aten.<op_name>``."""
    (node,) = [n for n in gm.graph.nodes if str(getattr(n.target, "overloadpacket", "")) == f"aten.{op_name}"]
    return FLOPS.get(node)


def assert_formula(expr, expected, expected_at_sizes):
    assert sympy.expand(expr - expected) == 0, f"{expr} != {expected}"
    assert evaluate(expr, SIZES) == expected_at_sizes


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)  # its input is data: only the weight and bias need gradients
        self.second = nn.Linear(16, 4, bias=False)  # its input needs a gradient too

    def forward(self, x):
        return self.second(self.first(x)).sum()


def test_linear_forward_is_two_flops_per_multiply_add_and_backward_one_product_per_gradient():
    gm = analysed(TwoLinears(), {"x": {0: "batch", 1: "seq"}}, x=torch.randn(3, 5, 8))
    first, second = [FLOPS.get(n) for n in gm.graph.nodes if "linear" in str(n.target)]
    # first: 2·B·S·8·16 products + B·S·16 bias adds;
    # backward: dW (2·B·S·8·16) + dbias (B·S·16), no dX
    assert_formula(first.forward, 2 * B * S * 8 * 16 + B * S * 16, 2 * 15 * 128 + 15 * 16)
    assert_formula(first.backward, 2 * B * S * 8 * 16 + B * S * 16, 2 * 15 * 128 + 15 * 16)
    # second: 2·B·in·out; backward dX and dW: twice that
    assert_formula(second.forward, 2 * B * S * 16 * 4, 1920)
    assert_formula(second.backward, 4 * B * S * 16 * 4, 3840)


class Products(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 6))

    def forward(self, x):
        y = torch.matmul(x, self.w)  # (B, S, 8) @ (8, 6)
        return torch.bmm(y, y.transpose(1, 2)).sum()  # (B, S, 6) @ (B, 6, S)


def test_matmul_and_bmm():
    gm = analysed(Products(), {"x": {0: "batch", 1: "seq"}}, x=torch.randn(3, 5, 8))
    matmul, bmm = flops_of(gm, "matmul"), flops_of(gm, "bmm")
    assert_formula(matmul.forward, 2 * B * S * 8 * 6, 1440)
    assert_formula(matmul.backward, 2 * B * S * 8 * 6, 1440)  # x is data: only dW
    assert_formula(bmm.forward, 2 * B * S * 6 * S, 2 * 3 * 5 * 6 * 5)
    assert_formula(bmm.backward, 4 * B * S * 6 * S, 4 * 3 * 5 * 6 * 5)  # both operands need gradients


class Attend(nn.Module):
    """Causal attention; a learned scale on the chosen operands makes them need gradients."""

    def __init__(self, trained=("q",), gqa=False):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.trained, self.gqa = trained, gqa

    def forward(self, q, k, v):
        q, k, v = (t * self.scale if name in self.trained else t for name, t in zip("qkv", (q, k, v)))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa).sum()


def attention_flops(model, kv_heads=4):
    dims = {name: {0: "batch", 2: "seq"} for name in "qkv"}
    gm = analysed(model, dims, q=torch.randn(3, 4, 5, 8), k=torch.randn(3, kv_heads, 5, 8),
                  v=torch.randn(3, kv_heads, 5, 8))
    return flops_of(gm, "scaled_dot_product_attention")


def test_attention_counts_qk_and_av_in_full_even_when_causal():
    # 4 heads, head dim 8: QKᵀ and AV are 2·B·4·S·S·8 each
    full = attention_flops(Attend(trained=("q", "k", "v")))
    assert_formula(full.forward, 4 * B * 4 * S**2 * 8, 4 * 3 * 4 * 25 * 8)
    assert_formula(full.backward, 8 * B * 4 * S**2 * 8, 8 * 3 * 4 * 25 * 8)  # dV, dP, dQ, dK
    only_q = attention_flops(Attend(trained=("q",)))
    assert_formula(only_q.backward, 4 * B * 4 * S**2 * 8, 4 * 3 * 4 * 25 * 8)  # dP and dQ


def test_grouped_query_attention_counts_query_heads():
    gqa = attention_flops(Attend(trained=("q",), gqa=True), kv_heads=2)
    assert_formula(gqa.forward, 4 * B * 4 * S**2 * 8, 4 * 3 * 4 * 25 * 8)


def test_ops_without_a_rule_count_zero_and_are_listed():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(5))

        def forward(self, x):
            return torch.cumprod(x * self.w, dim=1)

    gm = analysed(Odd(), x=torch.randn(3, 5))
    assert list(ops_without_flop_rule(gm)) == ["aten.cumprod"]
    assert flops_of(gm, "cumprod").total == 0


def test_size_arithmetic_needs_no_rule_and_softplus_has_one():
    class SizeMath(nn.Module):  # Mamba's scan (transformers 5.25): min(0, seq), seq - it, softplus
        def forward(self, x):
            keep = min(0, x.shape[1])
            return F.softplus(x[:, :x.shape[1] - keep])

    gm = analysed(SizeMath(), {"x": {1: "seq"}}, x=torch.randn(3, 5))
    assert [n for n in gm.graph.nodes if not isinstance(n.meta.get("val"), torch.Tensor)
            and n.op == "call_function"]  # the size arithmetic is in the graph ...
    assert ops_without_flop_rule(gm) == {}  # ... and needs no row
    assert flops_of(gm, "softplus").total != 0


def test_gpt_matches_megatron_formula():
    """72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)): forward + backward, no recompute (Narayanan et al.
    2021), for the paper's 1.7B shape (h 2304, 24 heads, 24 layers, V 51200, s 2048)."""
    config = gpt_config("gpt-1.7b")
    batch, seq, layers, h, V = 2, config.seq_len, config.layers, config.hidden, config.vocab_size
    gm = analysed(build_gpt(config, device="meta"), **token_batch(batch=batch, seq=seq))
    counted = evaluate(total_flops(gm).total, {"batch": batch, "seq": seq})
    megatron = 72 * batch * seq * layers * h**2 * (1 + seq / (6 * h) + V / (12 * layers * h))
    ratio = counted / megatron
    assert abs(ratio - 1) < 0.02, f"counted / Megatron formula = {ratio:.4f}"


def test_total_flops_reprice_at_another_shape_equals_a_retrace():
    at_2x16 = total_flops(analysed(build_gpt("tiny", device="meta"), **token_batch(batch=2, seq=16)))
    at_3x24 = total_flops(analysed(build_gpt("tiny", device="meta"), **token_batch(batch=3, seq=24)))
    assert at_2x16.total.free_symbols == {B, S}
    for part in ("forward", "backward"):
        assert evaluate(getattr(at_2x16, part), {"batch": 3, "seq": 24}) == \
            evaluate(getattr(at_3x24, part), {"batch": 3, "seq": 24})
