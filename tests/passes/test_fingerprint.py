"""Graph fingerprint: the same model always gives the same one (in any process, traced on any
device), another structure a different one; node names do not count, argument wiring does."""
import json

import pytest
import torch

from conftest import hf_gpt2, token_batch
from tests.ir.test_plan import make_plan
from xirang import analyze
from xirang.ir.plan import Plan, PlanError
from xirang.passes.analysis.fingerprint import FINGERPRINT_CHARS, check_plan_matches, graph_fingerprint, model_summary


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


def test_same_in_another_process_with_another_hash_seed(another_interpreter):
    # tests/conftest.py's another_interpreter: PYTHONHASHSEED=12345, shared with test_emit.py's emission check
    assert another_interpreter["fingerprint"] == fingerprint()


# --- a refused plan names what differs first (the plan carries a compact summary of its model) ------

class Activated(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.up, self.act = torch.nn.Linear(8, 32), act

    def forward(self, x):
        hidden = self.act(self.up(x))
        return hidden.sum()


def refusal(planned, given, example=None) -> PlanError:
    """The PlanError of checking a plan made for model ``planned`` against model ``given``."""
    def traced(model):
        if example is None:
            return analyze(model, torch.zeros(4, 8)).graph_module
        return analyze(model, example_kwargs=example).graph_module

    return refused_graph(traced(planned), traced(given))


def refused_graph(made_for, given) -> PlanError:
    plan = make_plan(fingerprint=graph_fingerprint(made_for), model_summary=model_summary(made_for))
    with pytest.raises(PlanError) as info:
        check_plan_matches(plan, given, plan.world)
    return info.value


def test_a_parameter_of_another_shape_is_named_first():
    error = refusal(TwoLayer(hidden=32), TwoLayer(hidden=64))
    assert error.what.startswith("plan was made for a different model: parameter up.weight is float32[64, 8] in "
                                 "this model, float32[32, 8] in the plan's model"), error.what
    assert "fingerprint" in error.what and error.where == "plan.fingerprint"


def test_an_op_that_differs_is_named_with_its_module_and_source_line():
    error = refusal(Activated(torch.relu), Activated(torch.tanh))
    assert "aten.tanh.default in module up" not in error.what  # the activation is the root module's op
    assert "this model runs aten.tanh.default" in error.what and "the plan's model ran aten.relu.default" in error.what
    assert "test_fingerprint.py:" in error.what and "hidden = self.act(self.up(x))" in error.what, error.what


def test_the_same_ops_wired_differently_are_named():
    error = refusal(TwoLayer(swap=False), TwoLayer(swap=True))
    assert "aten.sub.Tensor" in error.what and "the plan's model's node there read other values" in error.what
    assert "b - a if self.swap else a - b" in error.what


@pytest.fixture(scope="module")
def gpt2_tied_and_untied():
    """GPT-2 built on meta (its embedding and head tied), and built on the CPU then moved with
    model.to("meta"), which re-creates each parameter and so unties them; each traced."""
    untied = hf_gpt2(layers=1, device="cpu").to("meta")
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    return tuple(analyze(model, example_kwargs=token_batch()).graph_module
                 for model in (hf_gpt2(layers=1, device="meta"), untied))


def test_a_tie_lost_to_model_to_meta_is_named_with_the_fix(gpt2_tied_and_untied):
    """A plan made from the moved model is refused on the real (tied) one naming the tie and how to keep it."""
    tied, untied = gpt2_tied_and_untied
    error = refused_graph(untied, tied)
    assert error.what.startswith("plan was made for a different model: this model ties lm_head.weight and "
                                 "transformer.wte.weight (one tensor), but they are separate parameters in the "
                                 "plan's model"), error.what
    assert 'with torch.device("meta"):' in error.hint and 'model.to("meta")' in error.hint
    error = refused_graph(tied, untied)  # and the other way round
    assert "the plan's model ties lm_head.weight and transformer.wte.weight" in error.what, error.what
    assert 'with torch.device("meta"):' in error.hint


def test_a_plan_file_without_the_summary_still_loads_and_gets_the_fingerprint_message():
    made_for = analyze(TwoLayer(hidden=32), torch.zeros(4, 8)).graph_module
    plan = make_plan(fingerprint=graph_fingerprint(made_for), model_summary=model_summary(made_for))
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    old = plan.to_json()
    del old["model_summary"]
    old = Plan.from_json(old)
    assert old.model_summary is None
    with pytest.raises(PlanError) as info:
        check_plan_matches(old, analyze(TwoLayer(hidden=64), torch.zeros(4, 8)).graph_module, old.world)
    assert info.value.what.startswith("plan was made for a different model (fingerprint ")


def test_the_summary_stays_small_per_node(gpt2_tied_and_untied):
    gm = gpt2_tied_and_untied[0]
    summary, nodes = json.dumps(model_summary(gm).to_json()), len(gm.graph.nodes)
    assert len(summary) < 80 * nodes, (len(summary), nodes)  # a plan's placements take about as much per node
