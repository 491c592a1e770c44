"""The zero-bubble split backward of one stage (codegen/runtime/executor/split_backward.py): B then W give the
fused backward's gradients, bit for bit, including where one weight is read by two chained ops (its
group then reaches the earlier op through the later one, over graph another group's call had freed), and
with the stage under full recompute (``torch.utils.checkpoint``, as ``Recomputed`` runs a block), where W's
calls share one recompute of the block."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from xirang.codegen.runtime.executor.split_backward import backward_input, backward_weights, ungrouped_weights

STAGES = {
    "two weights": lambda x, w, v, b: torch.tanh(x @ w + b) @ v,
    "a matrix applied twice in a chain": lambda x, w, v, b: torch.tanh(x @ w + b) @ w @ v,
    "a bias added twice": lambda x, w, v, b: torch.tanh(x @ w + b) @ v + b,
    "a shared layer three times": lambda x, w, v, b: torch.tanh(torch.tanh(torch.tanh(x @ w + b) @ w + b) @ w + b) @ v,
}


@pytest.mark.parametrize("recomputed", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("name", sorted(STAGES))
def test_input_then_weight_gradients_equal_the_fused_backward(name, recomputed):
    stage = STAGES[name]
    if recomputed:
        stage = lambda *args, plain=stage: checkpoint(plain, *args, use_reentrant=False)  # noqa: E731
    generator = torch.Generator().manual_seed(0)
    w, v = (torch.randn(8, 8, generator=generator).requires_grad_() for _ in range(2))
    b = torch.randn(8, generator=generator).requires_grad_()
    x, received = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
    leaf = x.clone().requires_grad_()
    torch.autograd.backward([stage(leaf, w, v, b)], [received])
    fused = [leaf.grad] + [p.grad.clone() for p in (w, v, b)]
    for p in (w, v, b):
        p.grad = None
    leaf = x.clone().requires_grad_()
    dinputs, groups = backward_input([stage(leaf, w, v, b)], [received.clone()], [leaf], [w, v, b])
    assert ungrouped_weights(groups, [w, v, b]) == []
    assert all(p.grad is None for p in (w, v, b))  # B leaves the weights to W
    backward_weights(groups, [w, v, b])
    for got, want in zip([dinputs[0], w.grad, v.grad, b.grad], fused):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert all("intermediates" not in group for group in groups)  # W let go of the graph


def test_a_weight_on_no_path_from_the_inputs_is_named():
    # the stage's second output reads ``lone`` alone: B, from the inputs, never meets it
    w, lone = torch.randn(8, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    leaf = torch.randn(4, 8, requires_grad=True)
    _, groups = backward_input([leaf @ w, lone * 2], [torch.ones(4, 8), torch.ones(8)], [leaf], [w, lone])
    assert ungrouped_weights(groups, [w, lone]) == [1]
