"""Repeated blocks: one kind for identical layers, distinct kinds for different ones; the condensed
dependency graph runs through the blocks in order and its edges carry the bytes crossing a cut."""
from __future__ import annotations

import networkx as nx
import sympy
import torch

from conftest import hf_llama, token_batch
from xirang import analyze
from xirang.ir.meta_keys import BLOCK, BLOCK_GRAPH, BLOCK_KINDS, DEPENDENCIES, symbol


def test_identical_decoder_layers_are_one_kind():
    report = analyze(hf_llama(layers=5), example_kwargs=token_batch())
    assert [(k.module_type, k.count, k.example) for k in report.kinds] == [("LlamaDecoderLayer", 5, "model.layers.0")]
    blocks = [r for r in report.rows if r.kind != "-"]
    assert [r.name for r in blocks] == [f"model.layers.{i}" for i in range(5)]
    assert len({(r.params, r.flops, r.activation_bytes) for r in blocks}) == 1


class Wide(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, width), torch.nn.Linear(width, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Alternating(torch.nn.Module):
    """Four blocks of two kinds (widths 32, 64, 32, 64)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Wide(32 if i % 2 == 0 else 64) for i in range(4))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def test_different_blocks_are_different_kinds_and_condensed_graph_is_a_chain():
    report = analyze(Alternating(), torch.zeros(8, 16))
    kinds = BLOCK_KINDS.get(report.graph_module)
    assert sorted(kinds.values()) == [["blocks.0", "blocks.2"], ["blocks.1", "blocks.3"]]
    condensed = BLOCK_GRAPH.get(report.graph_module)
    assert nx.is_directed_acyclic_graph(condensed)
    order = sorted(condensed.nodes, key=lambda u: condensed.nodes[u]["order"])
    assert order == ["block:blocks.0", "block:blocks.1", "block:blocks.2", "block:blocks.3", "segment:4"]
    # Between blocks only the residual stream (batch x 16 fp32) crosses.
    batch = symbol("batch")
    for a, b in zip(order, order[1:]):
        assert sympy.simplify(condensed.edges[a, b]["bytes"] - batch * 16 * 4) == 0
    assert condensed.nodes["block:blocks.1"]["params"] == 16 * 64 + 64 + 64 * 16 + 16
    assert condensed.nodes["segment:4"]["params"] == 16 + 1
    deps = DEPENDENCIES.get(report.graph_module)
    assert deps.number_of_nodes() == len(report.graph_module.graph.nodes)
    assert nx.is_directed_acyclic_graph(deps)


def test_nodes_outside_blocks_have_no_block():
    report = analyze(Alternating(), torch.zeros(8, 16))
    head = [n for n in report.graph_module.graph.nodes if "addmm" in str(n.target) or "linear" in str(n.target)]
    assert BLOCK.get(head[-1]) is None
    assert BLOCK.get(head[0]).path == "blocks.0"
