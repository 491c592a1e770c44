"""split_sequence takes an attention mask that reads an input only where it is a key padding mask (issue 36).

The proof is by evaluation (passes/lowering/context_parallel.py ``_padding_mask``): the mask subgraph run on
probe padding patterns must equal the causal (or sliding-window) mask & keep[b, j] on each. A toy decoder builds
its mask from an ``attention_mask`` input one of three ways: Hugging Face's (causal & keep[b, j]) is taken; a
mask that also hides padded queries (keep[b, i] & keep[b, j]) and one that reads the padding reversed are
refused, naming what they read. Hugging Face Llama with an ``attention_mask`` input is offered cp (its calls
marked padded, so the planner prices the bits' all-gather).
"""
from __future__ import annotations

import pytest
import torch

from xirang.analyze import analyze
from xirang.context_facts import context_facts

VOCAB, HIDDEN, HEADS, SEQ = 32, 16, 2, 8


class ToyDecoder(torch.nn.Module):
    """Embedding, one attention with a mask built from ``attention_mask`` by ``how``, a head, the token mean."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask, labels):
        b, s = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = (t.reshape(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        positions = torch.arange(s, device=input_ids.device)
        causal = positions[None, :] <= positions[:, None]
        keep = attention_mask.bool()
        if self.how == "keys":
            mask = causal[None, None] & keep[:, None, None, :]
        elif self.how == "queries and keys":
            mask = causal[None, None] & keep[:, None, None, :] & keep[:, None, :, None]
        else:  # "reversed": the padding read from the other end
            mask = causal[None, None] & keep.flip(-1)[:, None, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        logits = self.head(out.transpose(1, 2).reshape(b, s, HIDDEN))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _facts(how: str):
    inputs = {"input_ids": torch.randint(0, VOCAB, (2, SEQ)), "attention_mask": torch.ones(2, SEQ, dtype=torch.long),
              "labels": torch.randint(0, VOCAB, (2, SEQ))}
    return context_facts(analyze(ToyDecoder(how), (), inputs).graph_module)


def test_a_key_padding_mask_is_taken():
    facts = _facts("keys")
    assert facts.refusal is None and [call.padding for call in facts.calls] == [True]


@pytest.mark.parametrize("how", ["queries and keys", "reversed"])
def test_a_mask_that_reads_the_padding_otherwise_is_refused(how):
    facts = _facts(how)
    assert "reads the input attention_mask other than as a key padding mask" in facts.refusal, facts.refusal


def test_hugging_face_llama_with_an_attention_mask_is_offered_cp():
    from tests.models.test_context_parallel import build
    model, inputs = build("llama:left", "meta", batch=2)
    facts = context_facts(analyze(model, (), inputs).graph_module)
    assert facts.refusal is None and facts.calls and all(call.padding for call in facts.calls)
