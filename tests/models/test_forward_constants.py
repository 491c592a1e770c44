"""A tensor made inside forward (``torch.tensor(...)``, an index list such as Falcon's ``qkv[..., [-2], :]``)
is lifted by torch.export as a constant the model does not hold: the trace keeps its value
(``xr_constant_value``) and the runtime binds it, so such a model compiles and trains as on one device."""
from __future__ import annotations

import torch
from torch import nn

import xirang
from xirang.ir.meta_keys import CONSTANT_VALUE


class IndexListInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, x):
        picked = self.proj(x)[..., [-2, 0]]  # an index list: a constant made in forward
        return (picked * torch.tensor([0.5, 2.0])).square().mean()


def test_constants_made_in_forward_are_bound_by_the_runtime():
    torch.manual_seed(0)
    model, x = IndexListInForward(), torch.randn(8, 4)
    gm = xirang.analyze(model, example_kwargs={"x": x}).graph_module
    values = [CONSTANT_VALUE.get(n) for n in gm.graph.nodes if CONSTANT_VALUE.has(n)]
    assert sorted(v.tolist() for v in values) == [[-2, 0], [0.5, 2.0]], values
    compiled = xirang.compile(model, world=1, example_kwargs={"x": x}, device="cpu", global_batch=8)
    loss = compiled.train_step(x=x)
    want = model(x)
    want.backward()
    assert torch.allclose(loss, want.detach(), atol=1e-6)
    got = compiled.full_gradients()
    assert torch.allclose(got["proj.weight"], model.proj.weight.grad, atol=1e-6)
