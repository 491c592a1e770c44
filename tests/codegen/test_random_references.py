"""Exact mode's chain of evidence ends in torch (issue 38 item 2): ``ExactReference`` gives the eager model
Xirang's own ``apply_keep`` (dropout by a given keep-mask) and ``attention_math`` (attention written out
with a given mask), so "exact mode equals one device" compares Xirang with Xirang. These tests check
both functions against torch's own implementations with the same masks given: outputs and gradients
equal, the 1 / (1 - p) scaling of survivors and the masked softmax included.

How torch's mask is had: ``torch.ops.aten.native_dropout`` returns the mask ``F.dropout`` draws (one
Bernoulli draw of the input's shape); on the CPU ``F.scaled_dot_product_attention`` with dropout runs
the math kernel, which drops the softmax by ``F.dropout`` of the (batch, heads, L, S) scores, so the
same seed gives ``F.dropout(ones(batch, heads, L, S))`` that mask; and
``aten._scaled_dot_product_attention_math`` takes the mask as an argument (its ``dropout_mask``).
Float64 throughout: every comparison is exact to rounding (1e-12), not within a training tolerance.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from xirang.codegen.ops.random_ops import apply_keep, attention_math

TOL = 1e-12  # float64: the two computations differ at most by the order of a few roundings


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a - b).abs().max().item() <= TOL, (a - b).abs().max().item()


def _grads(fn, *inputs: torch.Tensor, upstream: torch.Tensor) -> list:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(upstream)
    return [out.detach()] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_apply_keep_equals_torch_dropout_forward_and_backward(p):
    x = torch.randn(6, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(6, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    want = _grads(lambda t: F.dropout(t, p, training=True), x, upstream=upstream)
    torch.manual_seed(3)
    _, keep = torch.ops.aten.native_dropout(x, p, True)  # F.dropout's own mask under the same seed
    assert keep.dtype == torch.bool and 0 < keep.sum() < keep.numel()  # some dropped, some kept
    got = _grads(lambda t: apply_keep(t, keep, p), x, upstream=upstream)
    for a, b in zip(got, want):
        _close(a, b)
    # the scaling itself, stated: a survivor is x / (1 - p), a dropped element 0 (and its gradient)
    _close(got[0][keep], x[keep] / (1 - p))
    assert (got[0][~keep] == 0).all() and (got[1][~keep] == 0).all()


def test_apply_keep_at_p_1_drops_everything_as_torch_does():
    x = torch.randn(3, 4, dtype=torch.float64)
    keep = torch.zeros(3, 4, dtype=torch.bool)
    _close(apply_keep(x, keep, 1.0), F.dropout(x, 1.0, training=True))


def _qkv(heads: int, kv_heads: int, length: int = 8, source: int = 8, dim: int = 16):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    return (torch.randn(2, heads, length, dim, dtype=torch.float64, generator=gen),
            torch.randn(2, kv_heads, source, dim, dtype=torch.float64, generator=gen),
            torch.randn(2, kv_heads, source, dim, dtype=torch.float64, generator=gen))


def _masks(kind: str, length: int = 8, source: int = 8):
    if kind == "none":
        return None
    if kind == "bool":  # a padding mask: the last two source positions hidden from every query
        mask = torch.ones(length, source, dtype=torch.bool)
        mask[:, -2:] = False
        return mask
    return torch.randn(length, source, dtype=torch.float64, generator=torch.Generator().manual_seed(4))  # additive


CASES = [  # (heads, kv heads, causal, mask kind, scale)
    (4, 4, True, "none", None),
    (4, 4, False, "bool", None),
    (4, 4, False, "float", 0.3),
    (4, 2, True, "none", None),  # grouped-query attention: 2 query heads per key/value head
    (4, 2, False, "float", None),
]  # torch refuses an explicit mask with is_causal=True


@pytest.mark.parametrize("heads, kv_heads, causal, mask_kind, scale", CASES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_attention_math_equals_torch_sdpa_with_the_same_mask(heads, kv_heads, causal, mask_kind, scale, p):
    q, k, v = _qkv(heads, kv_heads)
    mask = _masks(mask_kind)
    upstream = torch.randn(2, heads, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    gqa = heads != kv_heads

    def torch_sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)

    torch.manual_seed(6)
    want = _grads(torch_sdpa, q, k, v, upstream=upstream)
    torch.manual_seed(6)  # the math kernel's draw: F.dropout of the (batch, heads, L, S) softmax
    keep = F.dropout(torch.ones(2, heads, 8, 8, dtype=torch.float64), p) != 0
    if p:
        assert 0 < keep.sum() < keep.numel()
    got = _grads(lambda q, k, v: attention_math(q, k, v, mask, keep, p, causal, scale, gqa), q, k, v,
                 upstream=upstream)
    for a, b in zip(got, want):
        _close(a, b)


@pytest.mark.parametrize("heads, kv_heads, causal, mask_kind, scale", CASES)
def test_attention_math_equals_torchs_math_kernel_given_the_mask(heads, kv_heads, causal, mask_kind, scale):
    """The mask passed explicitly (``dropout_mask``): no reliance on which draw the kernel makes."""
    q, k, v = _qkv(heads, kv_heads)
    mask, p = _masks(mask_kind), 0.4
    keep = torch.rand(2, heads, 8, 8, generator=torch.Generator().manual_seed(7)) >= p
    upstream = torch.randn(2, heads, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    gqa = heads != kv_heads

    def torch_math(q, k, v):
        if gqa:  # the aten math kernel takes whole heads: repeat as enable_gqa does
            k, v = (t.repeat_interleave(heads // kv_heads, dim=-3) for t in (k, v))
        additive = mask
        if mask is not None and mask.dtype == torch.bool:  # as the public sdpa hands it to its kernels
            additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        with warnings.catch_warnings():  # "Dropout mask should only be used for testing purposes": this is one
            warnings.simplefilter("ignore")
            return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, additive, p, causal, dropout_mask=keep,
                                                                     scale=scale)[0]

    want = _grads(torch_math, q, k, v, upstream=upstream)
    got = _grads(lambda q, k, v: attention_math(q, k, v, mask, keep, p, causal, scale, gqa), q, k, v,
                 upstream=upstream)
    for a, b in zip(got, want):
        _close(a, b)
    # a dropped weight removes its value row from the output: with every weight dropped the output is 0
    nothing = attention_math(q, k, v, mask, torch.zeros_like(keep), p, causal, scale, gqa)
    assert (nothing == 0).all()
