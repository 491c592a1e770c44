"""Graph fingerprint: the same model always gives the same one (in any process, traced on any
device), another structure a different one; node names do not count, argument wiring does."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import hf_gpt2, token_batch
from xirang import analyze
from xirang.passes.analysis.fingerprint import FINGERPRINT_CHARS, graph_fingerprint

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def gpt2_fingerprint():
    return graph_fingerprint(analyze(hf_gpt2(layers=2), example_kwargs=token_batch()).graph_module)


def test_same_gpt2_traced_twice_gives_the_same_fingerprint(gpt2_fingerprint):
    again = graph_fingerprint(analyze(hf_gpt2(layers=2), example_kwargs=token_batch()).graph_module)
    assert again == gpt2_fingerprint
    assert len(again) == FINGERPRINT_CHARS and int(again, 16) >= 0


def test_one_more_layer_changes_it(gpt2_fingerprint):
    three = graph_fingerprint(analyze(hf_gpt2(layers=3), example_kwargs=token_batch()).graph_module)
    assert three != gpt2_fingerprint


class TwoLayer(torch.nn.Module):
    def __init__(self, hidden=32, swap=False):
        super().__init__()
        self.up, self.down, self.swap = torch.nn.Linear(8, hidden), torch.nn.Linear(8, hidden), swap

    def forward(self, x):
        a, b = self.up(x), self.down(x)
        return (b - a if self.swap else a - b).sum()


def fingerprint(hidden=32, swap=False, device="meta"):
    with torch.device(device):
        model = TwoLayer(hidden, swap)
    return graph_fingerprint(analyze(model, torch.zeros(4, 8, device=device)).graph_module)


def test_hidden_size_changes_it():
    assert fingerprint(hidden=32) == fingerprint(hidden=32)
    assert fingerprint(hidden=32) != fingerprint(hidden=64)


def test_argument_wiring_counts():
    # same ops, shapes and node names; only the order of sub's operands differs
    assert fingerprint(swap=False) != fingerprint(swap=True)


def test_node_names_and_tracing_device_do_not_count():
    gm = analyze(TwoLayer(), torch.zeros(4, 8)).graph_module
    before = graph_fingerprint(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.name = f"renamed_{node.name}"
    assert graph_fingerprint(gm) == before
    assert before == fingerprint(device="meta") == fingerprint(device="cpu")


def test_same_in_another_process_with_another_hash_seed():
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path[:0] = [{HERE!r}, {os.path.dirname(HERE)!r}]
        from test_fingerprint import fingerprint
        print(fingerprint())
    """)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == fingerprint()
