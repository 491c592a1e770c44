"""Half-precision programs (passes/lowering/precision.py): fp32 master weights, bf16 compute, an fp32 loss,
and the Hugging Face models' own fp32 casts reconciled where an op needs one dtype.

One rank (world = 1): a bf16 plan's training step against the fp32 program of the same model, on
the same batch: the loss within 2% and every gradient pointing the same way (cosine > 0.99); bf16
keeps 8 bits of mantissa, a relative 4e-3 per op. tests/codegen/test_3d.py runs bf16 with pp > 1.
"""
from __future__ import annotations

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.conftest import hf_gpt2, hf_llama
from xirang.passes.lowering.compute_dtypes import compute_dtypes
from xirang.codegen.ops.local_ops import unify_float_dtypes
from xirang.ir.meta_keys import MODULE_TYPE

BUILDERS = {"gpt": lambda: build_gpt("tiny", device="cpu"),
            "gpt2": lambda: hf_gpt2(device="cpu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            "llama": lambda: hf_llama(device="cpu")}


def batch() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 500, (4, 16), generator=generator),
            "labels": torch.randint(0, 500, (4, 16), generator=generator)}


def step(name: str, precision: str):
    torch.manual_seed(0)
    model = BUILDERS[name]()
    # planned inside compile, on compile's one trace (xirang.plan, then compile(plan=), would trace twice)
    compiled = xirang.compile(model, world=1, example_kwargs=batch(), global_batch=4, hardware="a100-80g",
                              precision=precision)
    loss = compiled.train_step(**batch())
    return compiled, loss, compiled.full_gradients()


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_bf16_step_is_close_to_fp32(name):
    _, loss32, grads32 = step(name, "fp32")
    compiled, loss16, grads16 = step(name, "bf16")
    assert "torch.bfloat16" in compiled.code() and loss16.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in compiled.parameters())  # master weights stay fp32
    assert abs(loss16.item() - loss32.item()) <= 0.02 * abs(loss32.item())
    for fqn, grad in grads32.items():
        assert grads16[fqn].dtype == torch.float32
        if grad.abs().max() > 0:
            cosine = torch.nn.functional.cosine_similarity(grad.flatten(), grads16[fqn].flatten(), dim=0)
            assert cosine > 0.99, (name, fqn, cosine.item())


@pytest.mark.matrix  # slower end-to-end run: the -m matrix tier
def test_the_hf_models_fp32_casts_meet_bf16_weights_through_unify():
    """Llama's RMSNorm and GPT-2's position embeddings cast to fp32 in the model's code: without the
    unify step the next matmul or norm refuses mixed dtypes (what happened before it existed)."""
    for name in ("gpt2", "llama"):
        compiled, _, _ = step(name, "bf16")
        assert "unify_float_dtypes" in compiled.code(), name


def test_unify_casts_only_when_floating_inputs_disagree():
    half, full = torch.ones(2, dtype=torch.bfloat16), torch.ones(2)
    mask, ids = torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.long)
    same = unify_float_dtypes((full, full, mask), torch.bfloat16)
    assert all(a is b for a, b in zip(same, (full, full, mask)))  # agreeing inputs: untouched, even fp32
    mixed = unify_float_dtypes((full, half, mask, ids, None), torch.bfloat16)
    assert [t.dtype if t is not None else None for t in mixed] == [torch.bfloat16, torch.bfloat16, torch.bool,
                                                                    torch.long, None]


@pytest.fixture(scope="module")
def llama_graph():
    """The Llama's analysed graph, traced once for the tests below (they only read it)."""
    return xirang.analyze(BUILDERS["llama"](), example_kwargs=batch()).graph_module


def test_rotary_angles_stay_fp32_while_the_hidden_state_is_bf16(llama_graph):
    gm = llama_graph
    dtypes = compute_dtypes(gm, torch.bfloat16)
    of = {target: {dtypes[n.name] for n in gm.graph.nodes if n.target is target}
          for target in (torch.ops.aten.cos.default, torch.ops.aten.linear.default)}
    assert of == {torch.ops.aten.cos.default: {torch.float32}, torch.ops.aten.linear.default: {torch.bfloat16}}


def test_a_norm_that_casts_back_gives_the_compute_dtype_and_the_residual_stays_half(llama_graph):
    """Llama's RMSNorm upcasts and casts back "to the input's dtype"; both were traced as casts to float32,
    and the upcast, a no-op in the trace, stands for the residual too. In bf16 the norm returns bf16 and the
    residual adds stay bf16, so no matmul reading a norm makes a copy of its input (passes/lowering/precision.py)."""
    gm = llama_graph
    dtypes = compute_dtypes(gm, torch.bfloat16)
    kinds = {"norm": "LlamaRMSNorm", "residual": "LlamaDecoderLayer"}
    found = {kind: set() for kind in kinds}
    for node in gm.graph.nodes:
        kind = next((k for k, module in kinds.items() if MODULE_TYPE.get(node, "") == module), None)
        if kind == "norm" and node.target is torch.ops.aten.mul.Tensor and any(
                MODULE_TYPE.get(user, "") != "LlamaRMSNorm" for user in node.users):  # the norm's output
            found[kind].add(dtypes[node.name])
        elif kind == "residual" and node.target is torch.ops.aten.add.Tensor:
            found[kind].add(dtypes[node.name])
    assert found == {"norm": {torch.bfloat16}, "residual": {torch.bfloat16}}


def test_the_cast_back_is_found_through_a_collective_the_tp_rewrite_inserted():
    """Under tensor parallelism the norm's input is a collective the tp rewrite inserted (no trace value):
    its upcast is still a no-op of the trace, so the cast back and the residual are rewritten as in the trace
    (else the receiver's buffers, made from the trace's run-time dtypes, disagree with what is sent)."""
    from xirang.codegen.ops.local_ops import cast_like
    from xirang.ir.meta_keys import INSERTED, MODULE_PATH
    from xirang.passes.lowering.precision import cast_back_to_input_dtype
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, 4)
    gathered = graph.call_function(torch.ops.aten.clone.default, (x,))  # stands for an inserted all-to-all
    INSERTED.set(gathered, "tp: all_to_all")
    upcast = graph.call_function(torch.ops.aten.to.dtype, (gathered, torch.float32))
    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (upcast, 2.0))
    back = graph.call_function(torch.ops.aten.to.dtype, (scaled, torch.float32))
    residual = graph.call_function(torch.ops.aten.add.Tensor, (upcast, back))
    graph.output(residual)
    for node, path in ((upcast, "norm"), (scaled, "norm"), (back, "norm"), (residual, "layer"), (gathered, "layer")):
        MODULE_PATH.set(node, path)
    cast_back_to_input_dtype(graph)
    assert back.target is cast_like and back.args == (scaled, gathered)
    assert residual.args[0] is gathered  # the residual reads the norm's input, not its upcast
