"""Saved half-precision weight copies are recipes remade in the backward (codegen/runtime/memory/weight_casts.py)."""
import torch

from xirang.codegen.runtime.memory import weight_casts


def _step(hooked: bool, observer=None):
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(16, 8))
    w2 = torch.nn.Parameter(torch.randn(4, 16))
    x = torch.randn(3, 8, requires_grad=True)  # so the first linear keeps its weight for x's gradient
    kept = []

    class Keep:  # sees what the hooks keep: every saved tensor but the weight copies
        def pack(self, tensor):
            kept.append(tensor)
            return tensor.detach()

        def unpack(self, packed):
            return packed

    context = weight_casts.saved_tensors(observer or Keep()) if hooked else torch.autograd.graph.saved_tensors_hooks(
        lambda t: kept.append(t) or t, lambda t: t)
    with context:
        h = torch.nn.functional.linear(x.bfloat16(), w1.to(torch.bfloat16)).relu()  # linear saves w1's copy (a view)
        loss = torch.nn.functional.linear(h, w2.to(torch.bfloat16)).float().square().sum()
    loss.backward()
    return loss, w1.grad, w2.grad, x.grad, kept


def test_gradients_are_bit_for_bit_those_of_kept_copies():
    plain, hooked = _step(False), _step(True)
    for a, b in zip(plain[:4], hooked[:4]):
        assert torch.equal(a, b)


def test_weight_copies_are_not_kept():
    *_, kept_plain = _step(False)
    *_, kept = _step(True)
    copies = [t for t in kept_plain if weight_casts.recipe_of(t) is not None]
    assert len(copies) >= 2  # both weights' bf16 copies are saved without the hooks
    assert not [t for t in kept if weight_casts.recipe_of(t) is not None]
    assert len(kept) == len(kept_plain) - len(copies)


def test_only_a_cast_of_a_leaf_to_another_dtype_is_a_weight_copy():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(4, 4, requires_grad=True)
    assert weight_casts.recipe_of((x * 1).to(torch.bfloat16)) is None  # a cast of an activation
    assert weight_casts.recipe_of(w * 2) is None
    assert weight_casts.recipe_of(w.to(torch.float32)) is None  # no cast at all (to() returns w itself)
    assert weight_casts.recipe_of(w.to(torch.float64)) is not None
    recast = weight_casts.recipe_of(w.to(torch.bfloat16).t())
    assert recast is not None and torch.equal(recast.fetch(), w.to(torch.bfloat16).t())
