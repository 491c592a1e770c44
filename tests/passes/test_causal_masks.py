"""fold_causal_masks (passes/analysis/causal_masks.py): an attention mask proved to be the causal triangle
becomes is_causal=True; a padding mask, a sliding window and a mask of any input's values keep their mask."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import xirang

SDPA = torch.ops.aten.scaled_dot_product_attention.default
IDS = torch.randint(0, 50, (2, 16))


def _attention_calls(model, **inputs):
    gm = xirang.analyze(model, example_kwargs=inputs).graph_module
    return [(n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask"),
             n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal", False))
            for n in gm.graph.nodes if n.target is SDPA]


class _Masked(nn.Module):
    """One attention over a mask built from positions: ``window`` None is causal, else a sliding window."""

    def __init__(self, window=None):
        super().__init__()
        self.embed, self.proj, self.window = nn.Embedding(50, 8), nn.Linear(8, 24), window

    def forward(self, input_ids, mask=None):
        x = self.embed(input_ids)  # token ids: batch and sequence are symbolic in the trace
        q, k, v = self.proj(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        positions = torch.arange(x.shape[1], device=x.device)
        allowed = positions[None, :] <= positions[:, None]
        if self.window is not None:
            allowed = allowed & (positions[:, None] - positions[None, :] < self.window)
        if mask is not None:
            allowed = allowed & mask[:, None, None, :].bool()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).sum()


def test_a_mask_of_positions_that_is_the_causal_triangle_becomes_is_causal():
    calls = _attention_calls(_Masked(), input_ids=IDS)
    assert calls == [(None, True)]


def test_a_sliding_window_keeps_its_mask_even_where_the_example_is_shorter_than_the_window():
    # at 16 positions a window of 100 allows exactly the causal triangle: only sizes past 100 tell them apart
    calls = _attention_calls(_Masked(window=100), input_ids=IDS)
    assert len(calls) == 1 and calls[0][0] is not None and not calls[0][1]


def test_a_mask_that_reads_an_input_keeps_it():
    calls = _attention_calls(_Masked(), input_ids=IDS, mask=torch.ones(2, 16))
    assert len(calls) == 1 and calls[0][0] is not None and not calls[0][1]


def test_hugging_face_llama_on_meta_attends_causally_with_no_mask():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=100, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    assert _attention_calls(model, input_ids=ids, labels=ids) == [(None, True)] * 2


def test_a_model_that_folds_trains_as_its_eager_self():
    """The folded graph computes what the model computes: the compiled one-rank step's loss and gradients
    equal eager autograd's on the same weights and batch."""
    torch.manual_seed(0)
    model = _Masked()
    expected = model(IDS)
    expected.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    compiled = xirang.compile(model, world=1, example_kwargs={"input_ids": IDS}, hardware="cpu", global_batch=2)
    loss = compiled.train_step(input_ids=IDS)
    assert torch.allclose(torch.as_tensor(loss), expected.detach(), atol=1e-6, rtol=0)
    for name, param in compiled.named_model_parameters():
        assert torch.allclose(param.grad, grads[name], atol=1e-6, rtol=0), name
