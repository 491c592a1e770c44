"""Resume and reshard from distributed checkpoints on 8 CPU gloo ranks (the in-repo GPT and HF Llama).

First launch, per model, at (dp, tp, pp) = (2, 2, 2): 6 AdamW steps uninterrupted; then a fresh
compiled model runs 3 steps and saves (the GPT with ``async_save=True``, training on while the files
are written). On disk, the checkpoint is then copied into newer steps that a killed save would
leave: no marker, a truncated shard file (the marker's sizes no longer match), a partial folder.
Second launch, NEW processes: every rank loads the root folder -- the newer broken steps are skipped,
step 3 loads -- under (2, 2, 2), (1, 4, 2), (4, 1, 2) and (8, 1, 1), and runs 3 more steps; the
parent does the same on the single-device model. Same plan: losses and final parameters
bit-for-bit (torch.equal) with the uninterrupted run; other plans and one device: within 1e-6 (other
reduction orders). A checkpoint of the other model is refused on every rank, naming the keys.

Plans are made on meta at seq 4096 on A100s so tp really shards (asserted), then run at seq 16.

Padded shards: the planner splits neither tiny model's vocabulary, so a second test saves an untied
GPT with a vocabulary of 1001 at (1, 4, 1) -- its LM head held as 251 rows per rank, the last rank's
3 of them padding, which the checkpoint must leave out -- and resumes it at (1, 4, 1) (bit for bit),
(2, 2, 1) (501 rows, 1 padding), (4, 1, 1) and on one device, on 4 ranks.
"""
from __future__ import annotations

import logging
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import xirang
from examples.gpt import GPTConfig, build_gpt
from tests.conftest import hf_llama
from tests.codegen.single_device import loss_of
from xirang.codegen.runtime.checkpoint.save_load import load_checkpoint, save_checkpoint
from xirang.codegen.runtime.checkpoint.store import MARKER, latest_checkpoint
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.ir.errors import XirangError
from xirang.ir.placement import PlanShard
from xirang.lower import lower

WORLD, GLOBAL_BATCH, SEQ, VOCAB_USED, TOLERANCE = 8, 8, 16, 500, 1e-6
MODELS = ("gpt", "llama")
RESUMED = ((2, 2, 2), (1, 4, 2), (4, 1, 2), (8, 1, 1))
PADDED, PADDED_RESUMED = "gpt_vocab1001", ((1, 4, 1), (2, 2, 1), (4, 1, 1))  # untied head, 1001 rows

pytestmark = pytest.mark.matrix


def build(name: str, device: str = "cpu"):
    torch.manual_seed(0)
    if name == PADDED:
        return build_gpt(GPTConfig(vocab_size=1001, seq_len=64, hidden=64, heads=4, layers=2, tie_embeddings=False),
                         device=device)
    return build_gpt("tiny", device=device) if name == "gpt" else hf_llama(device=device)


def batch(step: int, size: int = GLOBAL_BATCH) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB_USED, (size, SEQ), generator=generator)}


def make_plan(name: str, dp: int, tp: int, pp: int):
    meta_batch = {k: v.to("meta") for k, v in batch(0, 2).items()}
    plan = xirang.plan(build(name, "meta"), world=dp * tp * pp, example_kwargs=meta_batch, global_batch=GLOBAL_BATCH,
                       seq=4096, hardware="a100-80g", precision="fp32", dp=dp, tp=tp, pp=pp, schedule="1f1b",
                       micro_batch=1)
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (dp, tp, pp)
    if tp > 1:
        sharded = [n for n, s in plan.placements.items() if n.startswith("p_") and isinstance(s.outputs[0].tp,
                                                                                              PlanShard)]
        assert sharded, f"{name}: the plan shards no parameter, so tp would be vacuous"
    return plan


def optimizer_of(parameters):
    return torch.optim.AdamW(parameters, lr=1e-3, eps=1e-3)


def steps(compiled, optimizer, first: int, count: int) -> list:
    losses = []
    for step in range(first, first + count):
        losses.append(compiled.train_step(**batch(step)).detach().clone())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def compiled_for(traced: dict, name: str, plan, rank: int):
    """The pieces xirang.compile runs, on one trace per model and rank (as tests/codegen/test_3d.py)."""
    if name not in traced:
        traced[name] = xirang.analyze(build(name), example_kwargs=batch(0, 2)).graph_module
    return CompiledModel(build(name), plan, lower(traced[name], plan, rank=rank).program,
                         groups=build_mesh_groups(plan.mesh))


def _first_run(rank, world, plans, root):
    found, traced = {}, {}
    for name, plan in plans.items():
        compiled = compiled_for(traced, name, plan, rank)
        optimizer = optimizer_of(compiled.parameters())
        losses = steps(compiled, optimizer, 0, 6)
        found[name] = {"losses": losses, "params": compiled.full_state_dict()}
        compiled = compiled_for(traced, name, plan, rank)  # a fresh run: 3 steps, save, 3 steps on
        optimizer = optimizer_of(compiled.parameters())
        steps(compiled, optimizer, 0, 3)
        saved = save_checkpoint(compiled, optimizer, f"{root}/{name}", step=3, extra={"loader": {"position": 3}},
                                async_save=name == "gpt")
        if name == "gpt":  # training goes on while the files are written: the saved copy is step 3's
            steps(compiled, optimizer, 3, 2)
            saved = saved.wait()
        found[name]["saved"] = str(saved)
    return found


def _resume(rank, world, jobs, root):
    found, traced = {}, {}
    for label, name, plan in jobs:
        compiled = compiled_for(traced, name, plan, rank)
        optimizer = optimizer_of(compiled.parameters())
        resumed = load_checkpoint(compiled, optimizer, f"{root}/{name}")
        losses = steps(compiled, optimizer, resumed["step"], 3)
        found[label] = {"resumed": resumed, "losses": losses, "params": compiled.full_state_dict()}
    other = {"gpt": "llama", "llama": "gpt"}.get(name)
    if other is None:
        return found
    try:
        load_checkpoint(compiled, optimizer_of(compiled.parameters()), f"{root}/{other}")
        found["refused"] = None
    except XirangError as error:
        found["refused"] = str(error)
    return found


def break_newer_steps(folder) -> list:
    """What a killed save leaves, next to the complete step 3: three newer step folders."""
    no_marker, truncated, partial = (folder.parent / f"step-{step:08d}" for step in (4, 5, 6))
    shutil.copytree(folder, no_marker)
    (no_marker / MARKER).unlink()
    shutil.copytree(folder, truncated)  # marker kept: the recorded sizes expose the cut
    shard = sorted(truncated.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    partial.mkdir()
    shutil.copy(sorted(folder.glob("*.distcp"))[0], partial)
    return [no_marker.name, truncated.name, partial.name]


def single_device_resume(name: str, root) -> dict:
    model = build(name)
    optimizer = optimizer_of(model.parameters())
    resumed = load_checkpoint(model, optimizer, f"{root}/{name}")
    losses = []
    for step in range(resumed["step"], resumed["step"] + 3):
        loss = loss_of(model(**batch(step)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return {"resumed": resumed, "losses": losses,
            "params": {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}}


def worst(got: dict, want: dict) -> float:
    differences = [(a - b).abs().max().item() for a, b in zip(got["losses"], want["losses"][3:])]
    common = set(got["params"]) & set(want["params"])
    assert len(common) == len(want["params"]), sorted(set(want["params"]) ^ set(got["params"]))
    return max(differences + [(got["params"][k] - want["params"][k]).abs().max().item() for k in common])


def test_resume_and_reshard(tmp_path, caplog):
    plans = {name: make_plan(name, 2, 2, 2) for name in MODELS}
    first = launch(_first_run, WORLD, (plans, str(tmp_path)), timeout_s=900, heartbeat_s=120)
    want = first[0]
    for name in MODELS:
        folder = tmp_path / name / "step-00000003"
        assert first[0][name]["saved"] == str(folder) and (folder / MARKER).is_file()
        # the single-device model's names and shapes, a tied weight once (the GPT's head is tok_emb)
        saved = FileSystemReader(folder).read_metadata().state_dict_metadata
        model = {n: tuple(p.shape) for n, p in build(name, "meta").named_parameters()}
        assert {k[len("model."):]: tuple(v.size) for k, v in saved.items() if k.startswith("model.")} == model
        broken = break_newer_steps(folder)
        with caplog.at_level(logging.WARNING, logger="xirang.checkpoint"):
            assert latest_checkpoint(tmp_path / name) == folder
        for step_name in broken:  # each skipped one is named in the log
            assert any(step_name in record.getMessage() for record in caplog.records), (step_name, caplog.text)

    jobs = [(f"{name} {mesh}", name, plans[name] if mesh == (2, 2, 2) else make_plan(name, *mesh))
            for name in MODELS for mesh in RESUMED]
    second = launch(_resume, WORLD, (jobs, str(tmp_path)), timeout_s=900, heartbeat_s=120)
    for label, name, plan in jobs:
        for rank, result in enumerate(second):
            got = result[label]
            assert got["resumed"] == {"step": 3, "extra": {"loader": {"position": 3}}}, (label, rank)
            if (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (2, 2, 2):  # the same plan: bit for bit
                assert all(torch.equal(a, b) for a, b in zip(got["losses"], want[name]["losses"][3:])), label
                assert all(torch.equal(got["params"][k], p) for k, p in want[name]["params"].items()), label
            difference = worst(got, want[name])
            if rank == 0:
                print(f"{label}: max |diff| after resume {difference:.1e}")
            assert difference <= TOLERANCE, (label, rank, difference)
    for result in second:  # the llama jobs ran last: the gpt checkpoint was offered, both sides named
        refused = result["refused"]
        assert "does not match this model" in refused and "parameters missing from the checkpoint" in refused, refused
        assert "'model.embed_tokens.weight'" in refused and "'layers.0.attn.qkv.weight'" in refused, refused

    for name in MODELS:  # the single-device model
        got = single_device_resume(name, tmp_path)
        assert got["resumed"]["step"] == 3
        difference = worst(got, want[name])
        print(f"{name} single device: max |diff| after resume {difference:.1e}")
        assert difference <= TOLERANCE, (name, difference)


def test_padded_shards_are_saved_without_padding_and_reshard(tmp_path):
    plan = make_plan(PADDED, 1, 4, 1)
    head = plan.placements["p_lm_head_weight"].outputs[0].tp
    assert head == PlanShard(0), head  # 1001 rows on 4 ranks: 251 each, the last 3 padding
    first = launch(_first_run, 4, ({PADDED: plan}, str(tmp_path)), timeout_s=900, heartbeat_s=120)
    want = first[0][PADDED]
    saved = FileSystemReader(tmp_path / PADDED / "step-00000003").read_metadata().state_dict_metadata
    assert tuple(saved["model.lm_head.weight"].size) == (1001, 64)
    blocks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in saved["model.lm_head.weight"].chunks)
    assert blocks == [((0, 0), (251, 64)), ((251, 0), (251, 64)), ((502, 0), (251, 64)), ((753, 0), (248, 64))]
    assert tuple(saved["optim.state.lm_head.weight.exp_avg"].size) == (1001, 64)

    jobs = [(f"{PADDED} {mesh}", PADDED, plan if mesh == (1, 4, 1) else make_plan(PADDED, *mesh))
            for mesh in PADDED_RESUMED]
    second = launch(_resume, 4, (jobs, str(tmp_path)), timeout_s=900, heartbeat_s=120)
    for label, _, resumed_plan in jobs:
        for rank, result in enumerate(second):
            got = result[label]
            if resumed_plan is plan:
                assert all(torch.equal(a, b) for a, b in zip(got["losses"], want["losses"][3:])), label
                assert all(torch.equal(got["params"][k], p) for k, p in want["params"].items()), label
            difference = worst(got, want)
            if rank == 0:
                print(f"{label}: max |diff| after resume {difference:.1e}")
            assert difference <= TOLERANCE, (label, rank, difference)
    got = single_device_resume(PADDED, tmp_path)
    print(f"{PADDED} single device: max |diff| after resume {worst(got, want):.1e}")
    assert worst(got, want) <= TOLERANCE
