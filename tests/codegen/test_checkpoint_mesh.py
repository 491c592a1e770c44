"""The mesh a checkpoint records, and a checkpoint of the old rank layout loading under the named mesh.

Checkpoints record their mesh by named axes and rank order; those written before recorded
``str(mesh)`` under the old layout (dp outermost). Parameters load either way (by name); each rank's
torch generator state is taken from the rank saved at its own coordinates. On 4 CPU ranks at dp=2,
pp=2 the two layouts number (dp 1, pp 0) and (dp 0, pp 1) the other way round, so ranks 1 and 2 take
each other's saved state from an old-layout checkpoint and their own from a new one.
"""
from __future__ import annotations

import json

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from xirang.codegen.runtime.checkpoint.mesh_record import mesh_record, saved_mesh, saving_rank
from xirang.codegen.runtime.checkpoint.store import MARKER
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.mesh import Mesh

MESH = Mesh(dp=2, pp=2, tp=1)


def test_the_record_names_every_axis_and_the_order():
    assert mesh_record(MESH) == {"axes": {"pp": 2, "dp": 2, "cp": 1, "tp": 1, "ep": 1},
                                 "order": ["pp", "dp", "cp", "tp"]}
    assert saved_mesh(mesh_record(MESH)) == ({"pp": 2, "dp": 2, "cp": 1, "tp": 1, "ep": 1}, ("pp", "dp", "cp", "tp"))
    assert saved_mesh("dp=2 x pp=2 x tp=1") == ({"dp": 2, "pp": 2, "tp": 1, "cp": 1, "ep": 1}, ("dp", "pp", "tp"))
    assert saved_mesh("one device") is None and saved_mesh(None) is None


def test_a_rank_takes_the_state_saved_at_its_own_coordinates():
    assert [saving_rank(r, MESH, mesh_record(MESH)) for r in range(4)] == [0, 1, 2, 3]
    # old layout: rank = dp * pp_size + pp; named layout: rank = pp * dp_size + dp
    assert [saving_rank(r, MESH, "dp=2 x pp=2 x tp=1") for r in range(4)] == [0, 2, 1, 3]
    big = Mesh(dp=2, pp=2, tp=2)
    assert [saving_rank(r, big, str(big)) for r in range(8)] == [0, 1, 4, 5, 2, 3, 6, 7]
    dp_outer = Mesh(dp=2, pp=2, tp=1, order=("dp", "pp", "cp", "tp"))  # the same sizes in the other order
    assert [saving_rank(r, MESH, mesh_record(dp_outer)) for r in range(4)] == [0, 2, 1, 3]
    assert [saving_rank(r, dp_outer, "dp=2 x pp=2 x tp=1") for r in range(4)] == [0, 1, 2, 3]
    # another mesh, or a record this reader does not know: rank r takes rank r's, as before
    assert [saving_rank(r, MESH, "dp=4 x pp=1 x tp=1") for r in range(4)] == [0, 1, 2, 3]
    assert [saving_rank(r, MESH, "one device") for r in range(4)] == [0, 1, 2, 3]


def _batch(step: int) -> dict:
    ids = torch.randint(0, 500, (4, 16), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}  # two tensors: one object would trace as one input


def _save_and_load(rank, world, plan, root):
    import xirang.codegen.runtime.checkpoint.save_load as save_load
    torch.manual_seed(0)
    compiled = xirang.compile(build_gpt("tiny"), world=world, example_kwargs=_batch(0), plan=plan)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    compiled.train_step(**_batch(0))
    optimizer.step()
    weights = {name: p.detach().clone() for name, p in compiled.named_parameters()}
    found, new_layout = {}, save_load._layout
    for form in ("named", "old"):
        if form == "old":  # as an older Xirang wrote it: str(mesh), ranks numbered dp outermost
            save_load._layout = lambda target, held: {**new_layout(target, held), "mesh": str(target.plan.mesh)}
        torch.manual_seed(1000 + rank)
        probe = torch.Generator()
        probe.set_state(torch.get_rng_state())
        saved_draw = torch.rand(1, generator=probe).item()  # what this rank's saved state draws first
        xirang.save_checkpoint(compiled, optimizer, f"{root}/{form}", step=1)
        save_load._layout = new_layout
        with torch.no_grad():
            for p in compiled.parameters():
                p.zero_()
        torch.manual_seed(7)
        xirang.load_checkpoint(compiled, optimizer, f"{root}/{form}")
        restored = all(torch.equal(p, weights[name]) for name, p in compiled.named_parameters())
        found[form] = (saved_draw, torch.rand(1).item(), restored)
    return found


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    plan = xirang.plan(build_gpt("tiny"), world=4, example_kwargs=_batch(0), global_batch=4, dp=2, pp=2, tp=1,
                       micro_batch=1, schedule="1f1b")
    assert plan.mesh == MESH
    return root, launch(_save_and_load, 4, (plan, str(root)), timeout_s=300)


def test_a_checkpoint_records_its_mesh_by_named_axes(ranks):
    root, _ = ranks
    layout = json.loads((root / "named" / "step-00000001" / MARKER).read_text())["layout"]
    assert layout["mesh"] == mesh_record(MESH) and layout["world"] == 4


def test_an_old_layout_checkpoint_loads_each_rank_taking_the_state_of_its_coordinates(ranks):
    _, found = ranks
    assert json.loads(json.dumps(found[0]))  # plain data back from the ranks
    for rank, result in enumerate(found):
        assert result["named"][2] and result["old"][2], f"rank {rank}: parameters not restored"
        assert result["named"][1] == found[rank]["named"][0], rank  # its own saved state
        old_owner = [0, 2, 1, 3][rank]
        assert result["old"][1] == found[old_owner]["old"][0], (rank, old_owner)
    assert found[1]["old"][1] != found[1]["named"][1]  # the two layouts really differ at rank 1
