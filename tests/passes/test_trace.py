"""Tracing: roles and names of placeholders, tied weights, module paths and source lines, symbols,
layer folding (folded == full trace, node by node), and errors that name module, line and remedy."""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from conftest import HF_MODELS, hf_gpt2, hf_llama, token_batch
from xirang.ir.errors import TraceError
from xirang.ir.meta_keys import (MODULE_PATH, PARAM_ALIASES, PARAM_NAME, ROLE, SOURCE, SYMBOLS, TENSOR,
                                 TRACE_INFO, symbol)
from xirang.ir.pass_spec import CompileContext
from xirang.pass_manager import PassManager
from xirang.passes.analysis.tensors import annotate_tensors
from xirang.passes.analysis import trace as trace_module
from xirang.passes.analysis.trace import trace_model


def traced(model, fold=True, **inputs):
    ctx = CompileContext(model=model, example_kwargs=inputs or token_batch(), fold_repeats=fold)
    return PassManager([trace_model, annotate_tensors]).run(None, ctx).gm


@functools.lru_cache(maxsize=None)
def traced_default(name: str):
    """The folded trace of conftest's 2-layer model ``name`` on token_batch(), traced once for this module:
    the tests below only read it."""
    return traced(HF_MODELS[name]())


def calls(gm, target_name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and target_name in str(n.target)]


def test_hf_models_trace_with_batch_and_seq_symbols(hf_model_name):
    gm = traced_default(hf_model_name)
    assert TRACE_INFO.get(gm)["method"] == "export-symbolic"
    assert SYMBOLS.get(gm) == {"batch": 2, "seq": 16}
    ids = next(n for n in gm.graph.nodes if n.name == "input_ids")
    assert ROLE.get(ids) == "input"
    assert TENSOR.get(ids).shape == (symbol("batch"), symbol("seq"))


def test_parameters_are_named_placeholders_and_tied_weights_are_one():
    gm = traced_default("gpt2")
    params = [n for n in gm.graph.nodes if ROLE.get(n) == "parameter"]
    names = [PARAM_NAME.get(n) for n in params]
    assert "lm_head.weight" not in names  # tied to the token embedding: one placeholder
    wte = next(n for n in params if PARAM_NAME.get(n) == "transformer.wte.weight")
    assert PARAM_ALIASES.get(wte) == ("transformer.wte.weight", "lm_head.weight")
    lm_head = next(n for n in calls(gm, "linear") if MODULE_PATH.get(n) == "lm_head")
    assert lm_head.args[1] is wte


def test_ops_keep_module_path_and_user_source_line():
    gm = traced_default("llama")
    q_proj = next(n for n in calls(gm, "linear") if MODULE_PATH.get(n) == "model.layers.0.self_attn.q_proj")
    source = SOURCE.get(q_proj)
    assert source.file.endswith("modeling_llama.py")
    assert "q_proj" in source.code  # the line in LlamaAttention.forward, not torch's Linear.forward


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_forward_frames_give_torchs_own_stack_traces(name, monkeypatch):
    """Export's stack capture through ``ForwardFrames`` writes the text torch's own capture writes."""
    ours = [n.meta.get("stack_trace") for n in traced_default(name).graph.nodes]
    monkeypatch.setattr(trace_module, "forward_frames_only", contextlib.nullcontext)
    torchs = [n.meta.get("stack_trace") for n in traced(HF_MODELS[name]()).graph.nodes]
    assert sum(map(bool, torchs)) > len(torchs) // 2  # most nodes have one: the comparison says something
    assert ours == torchs


def test_unit_batch_is_traced_symbolically():
    gm = traced(hf_llama(), **token_batch(batch=1, seq=8))
    assert SYMBOLS.get(gm) == {"batch": 1, "seq": 8}
    logits = next(n for n in calls(gm, "linear") if MODULE_PATH.get(n) == "lm_head")
    assert TENSOR.get(logits).shape == (symbol("batch"), symbol("seq"), 1000)


def _structure(gm):
    """Everything about a graph except the generated node names."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def arg_text(arg):
        return torch.fx.map_arg(arg, lambda a: f"%{index[a]}")

    return [(n.op, PARAM_NAME.get(n, None) if n.op == "placeholder" else str(n.target),
             repr(arg_text(n.args)), repr(arg_text(n.kwargs)), TENSOR.get(n, None), MODULE_PATH.get(n),
             str(SOURCE.get(n, None))) for n in gm.graph.nodes]


@pytest.mark.parametrize("build", [hf_llama, hf_gpt2], ids=["llama", "gpt2"])
def test_folded_trace_equals_full_trace(build):
    model = build(layers=6)
    folded, full = traced(model, fold=True), traced(model, fold=False)
    assert TRACE_INFO.get(folded)["folded"] is not None and TRACE_INFO.get(full)["folded"] is None
    assert _structure(folded) == _structure(full)


def test_a_run_after_layers_that_differ_is_folded_and_equals_the_full_trace():
    """DeepSeek-V3 opens with dense layers before its MoE ones: the list was not alike as a whole, so all 61
    layers were traced (55 s of a 60 s plan). The alike tail is folded now; the graph is the full trace's."""
    import transformers
    from examples.hf_families import build_from_config
    model = build_from_config(
        transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, "meta", num_hidden_layers=7,
        first_k_dense_replace=2, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, vocab_size=64,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, head_dim=8, use_cache=False)
    inputs = token_batch()
    folded, full = traced(model, **inputs), traced(model, fold=False, **inputs)
    assert TRACE_INFO.get(folded)["folded"] == {"model.layers": 7}
    assert _structure(folded) == _structure(full)


class ScaledLayer(torch.nn.Module):
    """Each layer scales by its position: the traced layers differ, so folding must give up."""

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x) * (self.index + 1)


class ScaledStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(ScaledLayer(i) for i in range(5))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_folding_falls_back_to_full_trace_when_layers_differ():
    model = ScaledStack()
    ctx = CompileContext(model=model, example_args=(torch.randn(4, 8),))
    gm = PassManager([trace_model, annotate_tensors]).run(None, ctx).gm
    info = TRACE_INFO.get(gm)
    assert info["folded"] is None
    assert any("not folded" in note for note in info["fallbacks"])
    constants = [n.args[1] for n in calls(gm, "aten.mul")]
    assert constants == [1, 2, 3, 4, 5]  # every layer's own scale, as a full trace has them


class MadeInForward(torch.nn.Module):
    """A layer that builds a tensor in forward: export lifts it as a constant named after the layer."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) * torch.tensor([0.5, 1.5]).repeat(4)


class MadeInForwardStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(MadeInForward() for _ in range(5))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_folding_refuses_a_layer_tensor_made_in_forward_in_one_line():
    # Falcon builds such tensors in its attention: the copies of layers 3 and 4 would name tensors
    # the model does not hold, so folding is refused (saying why) and the full trace is used
    ctx = CompileContext(model=MadeInForwardStack(), example_args=(torch.randn(4, 8),))
    gm = PassManager([trace_model, annotate_tensors]).run(None, ctx).gm
    info = TRACE_INFO.get(gm)
    notes = [note for note in info["fallbacks"] if "not folded" in note]
    assert info["folded"] is None and len(notes) == 1 and "made inside forward" in notes[0]
    assert len(calls(gm, "aten.linear")) == 5


class Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:  # depends on tensor values: untraceable on fake tensors
            return y * 2
        return y


class Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.encoder(x))


def test_data_dependent_control_flow_names_module_line_and_remedy():
    with torch.device("meta"):
        model = Gated()
    with pytest.raises(TraceError) as caught:
        trace_model(None, CompileContext(model=model, example_args=(torch.zeros(4, 8, device="meta"),)))
    message = str(caught.value)
    assert "module 'gate' (Gate)" in message
    assert f"test_trace.py:{Gate.forward.__code__.co_firstlineno + 2}" in message
    assert "if y.sum() > 0" in message
    assert "torch.where" in message  # what to do


def test_cache_output_says_use_cache_false():
    model = hf_gpt2()
    model.config.use_cache = True
    with pytest.raises(TraceError, match="use_cache=False"):
        trace_model(None, CompileContext(model=model, example_kwargs=token_batch()))


def test_inputs_that_do_not_match_forward_are_reported():
    with pytest.raises(TraceError, match="do not match Gated.forward"):
        trace_model(None, CompileContext(model=Gated(), example_kwargs={"not_an_input": torch.zeros(2)}))


def test_when_export_fails_fx_symbolic_trace_is_tried_and_the_report_says_so(monkeypatch):
    real_export = torch.export.export

    def export_refusing_the_raw_model(module, *args, **kwargs):
        if not isinstance(module, torch.fx.GraphModule):
            raise RuntimeError("simulated export failure")
        return real_export(module, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export_refusing_the_raw_model)
    model = ScaledStack()
    gm = traced(model, fold=False, x=torch.randn(4, 8))
    info = TRACE_INFO.get(gm)
    assert info["method"] == "fx-symbolic-trace+export-static"
    assert [note.split(":")[0] for note in info["fallbacks"]] == [
        "export-symbolic failed", "export-static failed",
        "batch is a constant in the traced graph"]  # the fx path traces static shapes, and says so
    linears = calls(gm, "linear")
    assert [MODULE_PATH.get(n) for n in linears] == [f"layers.{i}.linear" for i in range(5)]
    assert sum(1 for n in gm.graph.nodes if ROLE.get(n) == "parameter") == 10
