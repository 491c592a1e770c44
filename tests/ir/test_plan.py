"""The Plan: frozen, validated on construction, exact JSON round trip, refused for another model/world."""
import dataclasses
import json
import math
import pickle

import pytest

from xirang.ir.device import GiB
from xirang.ir.mesh import Mesh
from xirang.ir.placement import PlanPartial, PlanReplicate, PlanShard
from xirang.ir.plan import (SCHEMA_VERSION, CollectiveChoice, Layout, NodeStrategy, Plan, PlanError, Prediction,
                            StagePlan)
from xirang.ir.world import LinkSpec, World

WORLD = World.uniform(2, 4, "h100")  # 8 devices
FINGERPRINT = "0123456789abcdef"


def make_plan(**overrides) -> Plan:
    """dp=2 x pp=2 x tp=2, interleaved with 2 virtual stages: 4 stages, Shard/Partial layouts."""
    fields = dict(
        fingerprint=FINGERPRINT, world=WORLD, mesh=Mesh(dp=2, pp=2, tp=2),
        micro_batch=2, num_micro_batches=4, global_batch=16,
        schedule="interleaved", virtual_stages=2, recompute="selective", precision="bf16", grad_reduce_dtype="fp32",
        placements={
            "addmm": NodeStrategy("colwise", inputs=(Layout(dp=PlanShard(0)), Layout(tp=PlanShard(1))),
                                  outputs=(Layout(dp=PlanShard(0), tp=PlanShard(2)),)),
            "mm_1": NodeStrategy("rowwise", inputs=(Layout(dp=PlanShard(0), tp=PlanShard(2)), Layout(tp=PlanShard(0))),
                                 outputs=(Layout(dp=PlanShard(0), tp=PlanPartial("sum")),)),
            "native_layer_norm": NodeStrategy("replicate", inputs=(Layout(),), outputs=(Layout(), Layout())),
        },
        stages=tuple(StagePlan(i, ("segment:0",) * (i == 0) + (f"block:model.layers.{i}",), 80 * GiB)
                     for i in range(4)),
        buckets=(("lm_head.weight", "model.norm.weight"), ("model.layers.3.mlp.up.weight",)),
        fallbacks=("aten.nonzero.default",),
        collectives=(CollectiveChoice("mm_1", "tp", "all_reduce", "ring", 1 << 20),
                     CollectiveChoice("bucket:0", "dp", "all_reduce", "hierarchical", 3 * (1 << 20) + 7)),
        predicted=Prediction(step_seconds=0.1 + 0.2, tflops_per_device=123.456789, memory_bytes_per_device=(
            40 * GiB, 35 * GiB), breakdown={"compute": 0.25, "tp_comm": 1 / 3, "pp_bubble": 0.0125},
            notes=("stage 0 holds the embedding",)),
    )
    fields.update(overrides)
    return Plan(**fields)


def through_json(plan: Plan) -> Plan:
    return Plan.from_json(json.loads(json.dumps(plan.to_json())))


# --- round trip ----------------------------------------------------------------------------------

def test_round_trip_is_identical():
    plan = make_plan()
    again = through_json(plan)
    assert again == plan and hash(again) == hash(plan)
    assert again.to_json() == plan.to_json()
    assert again.predicted.breakdown["tp_comm"] == 1 / 3  # floats survive exactly
    assert again.placements["mm_1"].outputs[0].tp == PlanPartial("sum")
    assert isinstance(again.stages, tuple) and isinstance(again.buckets[0], tuple)


def test_memory_parts_and_offload_round_trip_and_older_files_still_load():
    """Memory by part per pipeline rank, an offloading alternative and the devices' host link survive
    JSON; a file written before them (no memory_parts, no alternative offload, device specs without
    host_link_bytes_per_s) loads, and its World still equals the presets' (so it matches the model)."""
    from xirang.ir.plan import Alternative
    parts = tuple({"parameters": 2 * GiB, "gradients": 2 * GiB, "optimizer": 12 * GiB, "activations": 20 * GiB,
                   "working_set": GiB, "buffers": 1} for _ in range(2))
    other = Alternative(mesh=Mesh(dp=2, pp=2, tp=2), micro_batch=1, num_micro_batches=8, schedule="1f1b",
                        virtual_stages=1, recompute="none", offload="blocks", step_seconds=0.4, tflops_per_device=1.0,
                        memory_bytes_per_device=(GiB, GiB), breakdown={"offload": 0.01})
    plan = make_plan(offload="blocks", alternatives=(other,), predicted=dataclasses.replace(
        make_plan().predicted, memory_parts=parts))
    again = through_json(plan)
    assert again == plan and again.predicted.memory_parts[1]["optimizer"] == 12 * GiB
    assert again.alternatives[0].offload == "blocks" and again.world.nodes[0].device.host_link_bytes_per_s == 64e9
    assert "offload=blocks" in plan.explain() and "work set" in plan.explain()
    old = plan.to_json()
    del old["predicted"]["memory_parts"], old["alternatives"][0]["offload"], old["offload"]
    for node in old["world"]["nodes"]:
        del node["device"]["host_link_bytes_per_s"]
    loaded = Plan.from_json(json.loads(json.dumps(old)))
    assert loaded.world == WORLD and loaded.predicted.memory_parts == () and loaded.offload == "none"
    assert loaded.alternatives[0].offload == "none"
    with pytest.raises(PlanError, match="memory_parts"):
        Prediction(1.0, 1.0, (GiB, GiB), memory_parts=parts[:1])


def test_layout_json_names_only_sharded_axes():
    assert Layout().to_json() == {}
    assert Layout(dp=PlanShard(0), tp=PlanPartial()).to_json() == {"dp": {"shard": 0}, "tp": {"partial": "sum"}}
    assert Layout.from_json({"tp": "replicate"}) == Layout()
    assert str(Layout(dp=PlanShard(0), tp=PlanShard(1))) == "dp=S(0) tp=S(1)" and str(Layout()) == "R"


def test_save_and_load(tmp_path):
    plan = make_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    text = path.read_text()
    assert '{"dp": {"shard": 0}, "tp": {"partial": "sum"}}' in text  # small objects on one line
    plan.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == text  # deterministic bytes


def test_frozen_picklable_and_defaults():
    plan = make_plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.micro_batch = 4
    with pytest.raises(TypeError):
        plan.placements["addmm"] = NodeStrategy("replicate")
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert plan.schema_version == SCHEMA_VERSION
    assert [s.index for s in plan.stages_of(1)] == [1, 3]  # interleaved: stage s on pp rank s % pp
    minimal = Plan(fingerprint=FINGERPRINT, world=World.uniform(1, 1, "cpu"), mesh=Mesh(1, 1, 1), micro_batch=1,
                   num_micro_batches=1, global_batch=1, schedule="1f1b", stages=[StagePlan(0, ["segment:0"], GiB)],
                   predicted=Prediction(1.0, 0.5, [GiB]))
    assert through_json(minimal) == minimal


# --- validation on construction ------------------------------------------------------------------

def two_stage(**extra):
    """Overrides for a plain 1F1B plan (virtual_stages 1, two stages)."""
    stages = (StagePlan(0, ("segment:0",), GiB), StagePlan(1, ("segment:1",), GiB))
    return {"schedule": "1f1b", "virtual_stages": 1, "stages": stages, **extra}


BAD_PLANS = [
    (dict(mesh=Mesh(1, 2, 2)), "plan.mesh", "mesh dp=1 x pp=2 x tp=2 has 4 ranks but the world has 8 devices"),
    (dict(global_batch=15), "plan.global_batch",
     "global_batch 15 != dp 2 x micro_batch 2 x num_micro_batches 4 = 16"),
    (dict(schedule="zero_bubble"), "plan.schedule", "not one of gpipe, 1f1b, interleaved, zb-h1, zb-h2"),
    (two_stage(virtual_stages=2), "plan.virtual_stages", "virtual_stages is 2 but schedule '1f1b'"),
    (dict(num_micro_batches=3, global_batch=12), "plan.num_micro_batches",
     "'interleaved' needs num_micro_batches (3) to be a multiple of pp (2)"),
    (dict(stages=two_stage()["stages"]), "plan.stages", "2 stages, but pp 2 x virtual_stages 2 needs 4"),
    (two_stage(schedule="gpipe", stages=(StagePlan(1, ("a",), GiB), StagePlan(0, ("b",), GiB))),
     "plan.stages[0].index", "stage at position 0 has index 1"),
    (two_stage(stages=(StagePlan(0, ("a", "b"), GiB), StagePlan(1, ("b",), GiB))), "plan.stages[*].units",
     "lists 'b' twice"),
    (dict(recompute="some"), "plan.recompute", "not one of none, selective, full"),
    (dict(precision="fp8"), "plan.precision", "not one of fp32, bf16, fp16"),
    (dict(grad_reduce_dtype="int8"), "plan.grad_reduce_dtype", "not one of fp32, bf16, fp16"),
    (dict(micro_batch=0), "plan.micro_batch", "micro_batch must be an int >= 1, got 0"),
    (dict(micro_batch="2"), "plan.micro_batch", "micro_batch must be an int >= 1, got '2'"),
    (dict(buckets=(("a",), ())), "plan.buckets[1]", "bucket 1 is empty"),
    # a name may be in two buckets (a tied weight's copy per stage), but not twice in one
    (dict(buckets=(("a", "b", "b"),)), "plan.buckets[0]", "lists 'b' twice"),
    (dict(fingerprint=""), "plan.fingerprint", "fingerprint must be a non-empty string"),
    (dict(world="8xh100"), "plan.world", "world must be a World"),
    (dict(placements={"addmm": "colwise"}), "plan.placements['addmm']", "must be a NodeStrategy"),
    (dict(predicted=Prediction(1.0, 1.0, (GiB,))), "plan.predicted.memory_bytes_per_device",
     "has 1 entries, one per pipeline rank needs 2"),
    (dict(schema_version=3), "plan.schema_version", "schema_version is 3; this Xirang reads version 2"),
]


@pytest.mark.parametrize("overrides, where, message", BAD_PLANS, ids=[w for _, w, _ in BAD_PLANS])
def test_inconsistent_plan_is_refused(overrides, where, message):
    with pytest.raises(PlanError) as error:
        make_plan(**overrides)
    assert error.value.where == where
    assert message in error.value.what
    assert error.value.hint and "what to do:" in str(error.value)


@pytest.mark.parametrize("build, message", [
    (lambda: StagePlan(0, (), GiB), "stage 0 has no units"),
    (lambda: StagePlan(0, ("a",), 0), "memory_limit_bytes must be an int >= 1"),
    (lambda: Layout(tp=1), "tp must be a placement"),
    (lambda: NodeStrategy("", ()), "strategy must be a non-empty string"),
    (lambda: CollectiveChoice("mm", "tp", "allreduce", "ring", 8), "kind is 'allreduce', which is not one of"),
    (lambda: CollectiveChoice("mm", "xp", "all_reduce", "ring", 8),
     "axis is 'xp', which is not one of pp, dp, cp, tp, edp, ep"),
    (lambda: Prediction(-1.0, 1.0, ()), "step_seconds must be a finite number >= 0"),
    (lambda: Prediction(1.0, math.nan, ()), "tflops_per_device must be a finite number >= 0"),
    (lambda: Prediction(1.0, 1.0, (), breakdown={"compute": math.inf}), "breakdown['compute'] must be a finite"),
])
def test_bad_parts_are_refused(build, message):
    with pytest.raises(PlanError) as error:
        build()
    assert message in error.value.what


# --- stale plans ---------------------------------------------------------------------------------

def test_matching_model_and_world_pass():
    make_plan().check_matches(FINGERPRINT, World.uniform(2, 4, "h100"))


def test_other_model_is_refused_naming_both_fingerprints():
    with pytest.raises(PlanError) as error:
        make_plan().check_matches("fedcba9876543210", WORLD)
    assert error.value.what == ("plan was made for a different model (fingerprint 0123456789abcdef, "
                                "this model fedcba9876543210)")
    assert error.value.where == "plan.fingerprint"
    assert "re-plan with xirang.plan(...)" in error.value.hint


def test_other_world_is_refused_naming_both_worlds():
    with pytest.raises(PlanError) as error:
        make_plan().check_matches(FINGERPRINT, World.uniform(1, 8, "a100"))
    assert error.value.what.startswith("plan was made for world '2 nodes x 4 h100-80g (8 devices), ")
    assert "but this world is '1 node x 8 a100-80g (8 devices), " in error.value.what
    assert error.value.where == "plan.world"


def test_world_differing_only_in_a_link_names_the_field():
    # the H100 world's own inter-node bandwidth (DGX H100: 8 x NDR 400 Gb/s = 400 GB/s per node, since
    # links follow the device kind), only the latency differs
    slower = World.uniform(2, 4, "h100", inter_node=LinkSpec(bandwidth=400e9, latency=2e-5))
    with pytest.raises(PlanError) as error:
        make_plan().check_matches(FINGERPRINT, slower)
    assert "first difference at world.inter_node.latency: 1e-05 vs 2e-05" in error.value.what


def test_worlds_of_other_node_counts_say_the_counts_not_every_node():
    """2 nodes of 4 against 1 node of 8: the difference is the node count, not two dumps of every device."""
    with pytest.raises(PlanError) as error:
        make_plan().check_matches(FINGERPRINT, World.uniform(1, 8, "h100"))
    assert "first difference at world.nodes: 2 entries vs 1" in error.value.what
    assert "peak_flops" not in error.value.what


def test_other_model_and_world_are_both_named():
    with pytest.raises(PlanError) as error:
        make_plan().check_matches("ffff", World.uniform(1, 8, "h100"))
    assert "different model" in error.value.what and "made for world" in error.value.what
    assert error.value.where == "plan.fingerprint, plan.world"


# --- hand-edited JSON ----------------------------------------------------------------------------

def edited(edit) -> dict:
    data = json.loads(json.dumps(make_plan().to_json()))
    edit(data)
    return data


BAD_FILES = [
    (lambda d: d.update(schema_version=3), "plan.schema_version", "plan has schema_version 3; this Xirang reads"),
    # a plan of the first schema: refused with why (the mesh's axes and rank order changed) and what to do
    (lambda d: d.update(schema_version=1, mesh={"dp": 1, "pp": 2, "tp": 4}), "plan.schema_version",
     "plan has schema_version 1; this Xirang reads version 2: version 1 plans name only the mesh axes dp, pp, tp "
     "and number the ranks dp outermost"),
    (lambda d: d.update(schema_version="1"), "plan.schema_version", "plan has schema_version '1'"),
    (lambda d: d.update(micro_batchs=d.pop("micro_batch")), "plan.micro_batchs",
     "unknown field 'micro_batchs' (did you mean 'micro_batch'?)"),
    (lambda d: d.pop("recompute"), "plan.recompute", "missing the field 'recompute'"),
    (lambda d: d.update(micro_batch="2"), "plan.micro_batch", "micro_batch must be an int >= 1, got '2'"),
    (lambda d: d.update(global_batch=16.0), "plan.global_batch", "global_batch must be an int >= 1, got 16.0"),
    (lambda d: d["stages"][1].update(memory_limit_bytes="80GB"), "plan.stages[1].memory_limit_bytes",
     "memory_limit_bytes must be an int"),
    (lambda d: d["stages"][2].update(units="block:model.layers.2"), "plan.stages[2].units", "units must be a list"),
    (lambda d: d["placements"]["addmm"]["inputs"][1].update(tp={"shrad": 1}), "plan.placements['addmm'].inputs[1].tp",
     "bad placement {'shrad': 1}"),
    (lambda d: d["placements"]["mm_1"]["outputs"][0].update(xp="replicate"), "plan.placements['mm_1'].outputs[0].xp",
     "layout has an unknown field 'xp'"),
    (lambda d: d["mesh"].update(tp="2"), "plan.mesh", "Mesh tp (tensor-parallel degree) must be a positive int"),
    (lambda d: d.update(mesh={"dp": 1, "pp": 2, "tp": 4}), "plan.mesh", "was written by an older Xirang"),
    (lambda d: d["mesh"].update(ep=3), "plan.mesh", "Mesh ep=3 does not divide dp x cp = 2 x 1 = 2"),
    (lambda d: d["world"].pop("inter_node"), "plan.world", "bad world"),
    (lambda d: d["collectives"][0].update(bytes=4), "plan.collectives[0].bytes", "did you mean 'nbytes'?"),
    (lambda d: d["predicted"].update(step_seconds="fast"), "plan.predicted.step_seconds", "finite number"),
    (lambda d: d.update(stages={}), "plan.stages", "stages must be a JSON list"),
]


@pytest.mark.parametrize("edit, where, message", BAD_FILES, ids=[w for _, w, _ in BAD_FILES])
def test_hand_edited_json_is_refused_naming_the_field(edit, where, message):
    with pytest.raises(PlanError) as error:
        Plan.from_json(edited(edit))
    assert error.value.where == where
    assert message in error.value.what
    assert error.value.hint


def test_load_names_the_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(edited(lambda d: d.update(schema_version=0))))
    with pytest.raises(PlanError) as error:
        Plan.load(path)
    assert error.value.where == f"plan.schema_version in {path}"
    assert "re-plan with xirang.plan(...)" in error.value.hint
    path.write_text("{\"schema_version\": 1,")
    with pytest.raises(PlanError, match="is not valid JSON: .* at line 1"):
        Plan.load(path)


def test_plan_error_is_a_value_error_with_what_where_hint():
    error = PlanError("bad", where="plan.x", hint="fix it")
    assert isinstance(error, ValueError)
    assert str(error) == "bad\n  where: plan.x\n  what to do: fix it"
    assert PlanReplicate() == Layout().tp
