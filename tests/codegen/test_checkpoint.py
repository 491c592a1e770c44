"""Checkpoints in one process (the default tier; the 8-rank resume and reshard grid is
tests/codegen/test_checkpoint_resume.py, -m matrix).

- The pieces a tp shard declares cover the global tensor exactly once, padding excluded, fused
  ``[q | k | v]`` pieces each at their own offset; DCP reads a saved full tensor into every tp
  rank's shard as ``shard_of`` cuts it (the resharding a multi-rank load does, rank by rank).
- The single-device model: 2 AdamW steps, save, 2 more == load into a fresh model, 2 steps
  (torch.equal); ``xirang checkpoint convert`` writes a file ``load_state_dict`` takes.
- Killed saves (no marker, a truncated file, a partial folder) are skipped with a logged message
  naming them; a root with none complete, a missing folder, an incomplete step named directly and a
  checkpoint of another model (names, shapes) are refused saying what, where and what to do.
"""
from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import xirang
from examples.gpt import GPTConfig, build_gpt
from tests.codegen.single_device import loss_of
from xirang.cli import main
from xirang.codegen.ops.padding import shard_of
from xirang.codegen.runtime.checkpoint.layout import PiecesLoadPlanner, PiecesSavePlanner, pieces_of
from xirang.codegen.runtime.checkpoint.store import MARKER
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanReplicate, PlanShard


@pytest.mark.parametrize("shape,placement,tp", [((15, 4), PlanShard(0, chunks=3), 2),  # fused, 5 rows a piece: padded
                                                ((4, 10), PlanShard(1), 4),  # uneven: the last rank holds 1 of 3
                                                ((5, 2), PlanShard(0), 8)])  # ranks 5..7 hold only padding
def test_pieces_cover_the_global_tensor_once(shape, placement, tp):
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    covered = torch.zeros(shape)
    for rank in range(tp):
        local = shard_of(full, placement, rank, tp)
        for piece in pieces_of(local, placement, shape, rank, tp, "w").pieces:
            block = full[tuple(slice(o, o + s) for o, s in zip(piece.global_offsets, piece.sizes))]
            held = local[tuple(slice(o, o + s) for o, s in zip(piece.local_offsets, piece.sizes))]
            assert torch.equal(block, held), (rank, piece)
            covered[tuple(slice(o, o + s) for o, s in zip(piece.global_offsets, piece.sizes))] += 1
    assert torch.equal(covered, torch.ones(shape))


def test_dcp_reshards_a_full_tensor_into_each_tp_shard(tmp_path):
    full = torch.randn(15, 6)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": pieces_of(full, PlanReplicate(), (15, 6), 0, 1, "w")},
                 storage_writer=dcp.FileSystemWriter(tmp_path),
                 planner=PiecesSavePlanner(), no_dist=True)
    for placement, tp in ((PlanShard(0, chunks=3), 2), (PlanShard(1), 4), (PlanShard(0), 4)):
        for rank in range(tp):
            local = torch.full_like(shard_of(full, placement, rank, tp), float("nan"))
            local.zero_()  # load_checkpoint zeroes first: padding is in no piece
            with pytest.warns(UserWarning, match="single process"):
                dcp.load({"w": pieces_of(local, placement, (15, 6), rank, tp, "w")},
                         storage_reader=dcp.FileSystemReader(tmp_path), planner=PiecesLoadPlanner(), no_dist=True)
            assert torch.equal(local, shard_of(full, placement, rank, tp)), (placement, tp, rank)


def batch(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 500, (2, 16), generator=generator)
    return {"input_ids": ids, "labels": ids}


def train(model, optimizer, first: int, count: int) -> list:
    losses = []
    for step in range(first, first + count):
        loss = loss_of(model(**batch(step)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def fresh(config="tiny", seed=1):
    torch.manual_seed(seed)
    model = build_gpt(config, device="cpu")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)


@pytest.fixture
def saved(tmp_path):
    """A GPT after 2 steps saved at step 2, and what 2 more steps give (losses, parameters)."""
    model, optimizer = fresh(seed=0)
    train(model, optimizer, 0, 2)
    folder = xirang.save_checkpoint(model, optimizer, tmp_path / "run", step=2, extra={"loader": [2, "a"]})
    losses = train(model, optimizer, 2, 2)
    return tmp_path / "run", folder, losses, dict(model.named_parameters())


def test_single_device_resume_is_exact_and_converts(saved, tmp_path):
    root, folder, losses, params = saved
    assert folder == root / "step-00000002" and (folder / MARKER).is_file()
    model, optimizer = fresh()
    optimizer.param_groups[0]["lr"] = 0.5  # the saved hyperparameters come back
    assert xirang.load_checkpoint(model, optimizer, root) == {"step": 2, "extra": {"loader": [2, "a"]}}
    assert optimizer.param_groups[0]["lr"] == 1e-3
    assert all(torch.equal(a, b) for a, b in zip(train(model, optimizer, 2, 2), losses))
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())

    assert main(["checkpoint", "convert", str(root), "--out", str(tmp_path / "full.pt")]) == 0
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    model, _ = fresh()
    model.load_state_dict(full["model"], strict=False)  # strict as to parameters: the tied head under both names
    assert {n for n, _ in model.named_parameters(remove_duplicate=False)} <= set(full["model"])
    assert full["step"] == 2 and set(full["optimizer"]["state"]["tok_emb.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    again, optimizer = fresh()
    xirang.load_checkpoint(again, optimizer, folder)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_async_save_writes_the_state_of_its_call(tmp_path):
    model, optimizer = fresh(seed=0)
    train(model, optimizer, 0, 1)
    at_save = {n: p.detach().clone() for n, p in model.named_parameters()}
    pending = xirang.save_checkpoint(model, optimizer, tmp_path, step=1, async_save=True)
    train(model, optimizer, 1, 2)  # the parameters change while the files are written
    assert pending.wait() == tmp_path / "step-00000001" and (pending.folder / MARKER).is_file()
    again, optimizer = fresh()
    assert xirang.load_checkpoint(again, optimizer, tmp_path)["step"] == 1
    assert all(torch.equal(p, at_save[n]) for n, p in again.named_parameters())


def test_killed_saves_are_skipped_and_bad_paths_refused(saved, tmp_path, caplog):
    root, folder, _, _ = saved
    no_marker, truncated, partial = (root / f"step-{s:08d}" for s in (3, 4, 5))
    shutil.copytree(folder, no_marker)
    (no_marker / MARKER).unlink()
    shutil.copytree(folder, truncated)
    shard = next(truncated.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    partial.mkdir()
    with caplog.at_level(logging.WARNING, logger="xirang.checkpoint"):
        assert xirang.latest_checkpoint(root) == folder
    assert "step-00000003: no COMPLETE marker" in caplog.text and "step-00000005: no COMPLETE" in caplog.text
    assert "step-00000004" in caplog.text and "the marker recorded" in caplog.text
    model, optimizer = fresh()
    assert xirang.load_checkpoint(model, optimizer, root)["step"] == 2

    two_groups = torch.optim.AdamW([{"params": [p]} for p in model.parameters()][:2], lr=1e-3)
    with pytest.raises(XirangError, match="has 1 optimizer parameter group"):
        xirang.load_checkpoint(model, two_groups, root)
    with pytest.raises(XirangError, match="is incomplete: no COMPLETE marker") as error:
        xirang.load_checkpoint(model, optimizer, no_marker)
    assert "load an earlier step" in str(error.value)
    shutil.rmtree(folder)
    with pytest.raises(XirangError, match=r"no complete checkpoint under .*the step folders \['step-00000005'"):
        xirang.load_checkpoint(model, optimizer, root)
    with pytest.raises(XirangError, match="does not exist"):
        xirang.load_checkpoint(model, optimizer, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert xirang.latest_checkpoint(tmp_path / "empty") is None and xirang.latest_checkpoint(tmp_path / "no") is None
    with pytest.raises(XirangError, match="is a file, not a checkpoint folder"):
        xirang.latest_checkpoint(next(root.glob("*/.metadata")))


def test_a_checkpoint_of_another_model_is_refused(saved):
    root, folder, _, _ = saved
    other, optimizer = fresh(GPTConfig(vocab_size=400, seq_len=64, hidden=64, heads=4, layers=1))
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(XirangError) as error:
        xirang.load_checkpoint(other, optimizer, root)
    message = str(error.value)
    assert "parameters in the checkpoint but not in the model: 'layers.1.attn.proj.bias'" in message, message
    assert "'tok_emb.weight' has shape (512, 64) in the checkpoint, (400, 64) in the model" in message, message
    assert f"where: load_checkpoint('{root}')" in message and "same model configuration" in message
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())  # refused before any change
    with pytest.raises(XirangError, match=r"extra\['f'\] is a function, not plain data"):
        xirang.save_checkpoint(other, optimizer, root, step=9, extra={"f": lambda: 0})
    with pytest.raises(XirangError, match="step must be an int"):
        xirang.save_checkpoint(other, optimizer, root, step=-1)
