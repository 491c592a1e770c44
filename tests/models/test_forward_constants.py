"""A tensor made inside forward (``torch.tensor(...)``, an index list such as Falcon's ``qkv[..., [-2], :]``)
is lifted by torch.export as a constant the model does not hold: the trace keeps its value
(``xr_constant_value``) and the runtime binds it, so such a model compiles and trains as on one device.
A Python number written into a view (``x[:, 0] = 2``) traces to one ``fill_`` on every device."""
from __future__ import annotations

import torch
from torch import nn

import xirang
from xirang.ir.meta_keys import CONSTANT_VALUE
from xirang.passes.analysis.fingerprint import graph_fingerprint


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
    compiled = xirang.compile(model, world=1, example_kwargs={"x": x}, hardware="cpu", global_batch=8)
    loss = compiled.train_step(x=x)
    want = model(x)
    want.backward()
    assert torch.allclose(loss, want.detach(), atol=1e-6)
    got = compiled.full_gradients()
    assert torch.allclose(got["proj.weight"], model.proj.weight.grad, atol=1e-6)


class WritesANumber(nn.Module):
    """BART's and T5's label shift: ``shifted[:, 0] = start``, a Python number written into a view."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 2
        return self.embed(shifted).square().mean()


def test_a_number_written_into_a_view_traces_the_same_on_meta_and_cpu():
    # CPU: fill_ from a lifted 0-dim constant; meta: copy_ from an expanded scalar_tensor. Both fill_(x, 2).
    def run(device):
        with torch.device(device):
            model = WritesANumber()
        ids = torch.ones(2, 5, dtype=torch.long, device=device)
        return xirang.analyze(model, example_kwargs={"ids": ids}).graph_module
    on_meta, on_cpu = run("meta"), run("cpu")
    assert [(n.op, n.name, str(n.target)) for n in on_meta.graph.nodes] == \
        [(n.op, n.name, str(n.target)) for n in on_cpu.graph.nodes]
    assert graph_fingerprint(on_meta) == graph_fingerprint(on_cpu)
    fills = [n for n in on_cpu.graph.nodes if n.target == torch.ops.aten.fill_.Scalar]
    assert [n.args[1] for n in fills] == [2] and not any(n.op == "placeholder" and n.name.startswith("c_")
                                                         for n in on_cpu.graph.nodes)
    ids = torch.randint(0, 10, (2, 5))
    torch.manual_seed(0)
    model = WritesANumber()
    assert torch.equal(on_cpu(model.embed.weight, ids)[0], model(ids))
