"""Small models shared by the tests: Hugging Face GPT-2, Llama (grouped-query attention), BERT and the
in-repo GPT, built from configs (nothing is downloaded), on the meta device unless a test needs values."""
from __future__ import annotations

import logging

import pytest
import torch

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def private_cache_folder(monkeypatch, tmp_path_factory):
    """The user's cache folder (xirang calibrate keeps calibrations there, xirang train reads them) is an
    empty folder of each test's own, for the test and the ranks it starts: never the real one, and never
    what another test calibrated."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))


def hf_gpt2(layers=2, device="meta", **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, use_cache=False,
                        bos_token_id=0, eos_token_id=0, **overrides)
    with torch.device(device):
        return GPT2LMHeadModel(config)


def hf_llama(layers=2, device="meta", **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=1000, use_cache=False, **overrides)
    with torch.device(device):
        return LlamaForCausalLM(config)


def hf_bert(layers=2, device="meta"):
    from transformers import BertConfig, BertForMaskedLM
    config = BertConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                        vocab_size=1000, max_position_embeddings=128)
    with torch.device(device):
        return BertForMaskedLM(config)


def token_batch(batch=2, seq=16, device="meta"):
    # Two tensors: export treats one tensor passed twice as one input.
    return {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device=device),
            "labels": torch.zeros(batch, seq, dtype=torch.long, device=device)}


HF_MODELS = {"gpt2": hf_gpt2, "llama": hf_llama, "bert": hf_bert}


@pytest.fixture(params=sorted(HF_MODELS))
def hf_model_name(request):
    return request.param


# The bad-input battery's saved plan (tests/bad_input/): here, not in a conftest of that folder, because
# tests import this file as the module "conftest" and a second conftest.py would take its name.
@pytest.fixture(scope="session")
def saved_plan(tmp_path_factory) -> str:
    """plan.json of tests/bad_input/models.py:mlp on 1 cpu rank (global batch 8)."""
    import xirang
    from tests.bad_input.models import mlp
    model, inputs = mlp()
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    xirang.plan(model, world=1, hardware="cpu", example_kwargs=inputs, global_batch=8).save(path)
    return str(path)


# One more interpreter for the tests whose point is another process: started once per session (an
# interpreter start is seconds of the tier on a loaded machine), with another hash seed than this one's.
OTHER_HASH_SEED = "12345"


@pytest.fixture(scope="session")
def another_interpreter(tmp_path_factory) -> dict:
    """What a second interpreter (PYTHONHASHSEED=12345) computes, for the tests to compare with this process:
    "plan": a saved tp 2 plan of tests/codegen/test_emit.py's tiny GPT (its ``tiny_plan(2, 2)``, made here),
    "emitted": that plan's rank 1 program emitted there (test_emission_is_deterministic_across_processes),
    "fingerprint": tests/passes/test_fingerprint.py's ``fingerprint()`` there
    (test_same_in_another_process_with_another_hash_seed)."""
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from tests.codegen.test_emit import tiny_plan
    plan_path = tmp_path_factory.mktemp("another_interpreter") / "plan.json"
    tiny_plan(2, 2).save(plan_path)
    script = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [".", "tests"]
        import xirang
        from tests.codegen.test_emit import tiny_gpt, tiny_batch
        from tests.passes.test_fingerprint import fingerprint
        from xirang.lower import rank_source
        gm = xirang.analyze(tiny_gpt(), example_kwargs=tiny_batch()).graph_module
        emitted = rank_source(gm, xirang.Plan.load({str(plan_path)!r}), 1)
        print(json.dumps({{"emitted": emitted, "fingerprint": fingerprint()}}))
    """)
    env = {**os.environ, "PYTHONHASHSEED": OTHER_HASH_SEED}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    return {"plan": plan_path, **json.loads(done.stdout.splitlines()[-1])}
