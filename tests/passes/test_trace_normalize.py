"""A model traces to the same graph on every device: layout-only copies dropped, names canonical.

The workflow this protects: plan a big model on the meta device (no memory), then compile it on the
real one. A plan names nodes and carries the graph's fingerprint, so both traces must agree.
"""
from __future__ import annotations

import pytest

import torch
from torch import nn

import xirang
from examples.gpt import build_gpt
from tests.conftest import hf_gpt2, hf_llama, token_batch
from xirang.passes.analysis.fingerprint import graph_fingerprint
from xirang.passes.analysis.trace_normalize import canonical_names


def traced(build, device):
    return xirang.analyze(build(device), example_kwargs=token_batch(device=device)).graph_module


def signature(gm):
    return [(n.op, n.name, str(n.target)) for n in gm.graph.nodes]


@pytest.mark.matrix  # slower end-to-end run: the -m matrix tier
def test_meta_and_cpu_traces_have_the_same_nodes_names_and_fingerprint():
    builders = {  # GPT-2 without dropout is the case that differed: sdpa's output strides on meta
        "gpt2": lambda device: hf_gpt2(device=device, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "llama": lambda device: hf_llama(device=device),
        "gpt": lambda device: build_gpt("tiny", device=device)}
    for name, build in builders.items():
        on_meta, on_cpu = traced(build, "meta"), traced(build, "cpu")
        assert signature(on_meta) == signature(on_cpu), name
        assert graph_fingerprint(on_meta) == graph_fingerprint(on_cpu), name
        assert not any(n.target == torch.ops.aten.contiguous.default for n in on_meta.graph.nodes), name


def test_a_plan_made_on_meta_is_accepted_for_the_cpu_model():
    def build(device):
        torch.manual_seed(0)
        return hf_gpt2(device=device, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    plan = xirang.plan(build("meta"), world=2, example_kwargs=token_batch(device="meta"), global_batch=8, seq=4096,
                       hardware="a100-80g", precision="fp32", tp=2, pp=1, dp=1)
    on_cpu = traced(build, "cpu")
    plan.check_matches(graph_fingerprint(on_cpu), plan.world)  # raises if stale
    names = {n.name for n in on_cpu.graph.nodes}
    assert set(plan.placements) <= names, sorted(set(plan.placements) - names)[:5]


class ScaleMadeInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return (self.proj(x) * torch.tensor([0.5, 1.0, 1.5, 2.0], device=x.device)).sum()


def test_a_tensor_made_in_forward_traces_the_same_on_meta_and_cpu():
    # on CPU export copies the lifted constant (lift_fresh_copy); on meta it does not (Falcon differed)
    def run(device):
        with torch.device(device):
            model = ScaleMadeInForward()
        return xirang.analyze(model, (torch.randn(2, 4, device=device),)).graph_module
    on_meta, on_cpu = run("meta"), run("cpu")
    assert signature(on_meta) == signature(on_cpu)
    assert graph_fingerprint(on_meta) == graph_fingerprint(on_cpu)
    assert not any(n.target == torch.ops.aten.lift_fresh_copy.default for n in on_cpu.graph.nodes)


class TransposeThenView(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2).contiguous().view(x.shape[0], -1) * 2


def test_contiguous_is_dropped_and_the_view_after_it_becomes_a_reshape():
    gm = xirang.analyze(TransposeThenView(), example_kwargs={"x": torch.randn(2, 3, 4)}).graph_module
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.contiguous.default not in targets and torch.ops.aten.view.default not in targets
    assert torch.ops.aten.reshape.default in targets
    x = torch.randn(2, 3, 4)
    assert torch.equal(gm(x)[0], TransposeThenView()(x))  # the same values on a non-contiguous input


def test_canonical_names_number_each_base_in_graph_order_and_keep_inputs():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.name = "input"  # as torch.export names an input called `input`, a builtin's name: kept
    a = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2), name="mul_6")
    b = graph.call_function(torch.ops.aten.mul.Tensor, (a, 3), name="mul_8")
    c = graph.call_function(torch.ops.aten.view.default, (b, [-1]), name="view_1_2")
    graph.output((c,))
    renamed = canonical_names(graph)
    assert [n.name for n in renamed.nodes] == ["input", "mul", "mul_1", "view", "output"]
    added = renamed.call_function(torch.ops.aten.mul.Tensor, (next(iter(renamed.nodes)), 1))
    assert added.name not in {"mul", "mul_1"}  # later nodes cannot take a canonical name
